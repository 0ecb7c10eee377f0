"""The training loop, readable top to bottom: setup, then one loop over optimizer steps."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import random
import shutil
import sys
import time
import warnings
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from .audio import LogMel, load_audio
from .batching import (FRAMES_PER_SECOND, DurationBucketSampler, PreflightSampler, frames_of, padding_fraction,
                       select_samples, split_batch)
from .checkpoint import (CheckpointError, existing_run, hold_run_directory, load_resume_checkpoint,
                         move_run_aside, point_to, prune_checkpoints, remove_stale_temporaries, save_checkpoint,
                         step_checkpoint_name)
from .config import ModelConfig, TrainConfig, model_config_from_preset
from .data import ASRDataset, Batch, LengthGroupedBatchSampler, Utterance, collate, load_utterances, read_manifest
from .decode import ctc_greedy
from .memory import (GIB, BatchDoesNotFit, MemoryEstimator, available_memory_bytes, free_memory, is_out_of_memory,
                     largest_fitting, memory_status, precision_name)
from .metrics import error_rates
from .model import ASRModel, count_parameters
from .optim import build_optimizer, canonical_optimizer
from .precision import Precision, resolve_precision
from .safety import NonFiniteSkips, StopRequest, TrainingDiverged, ignore_stop_signals
from .tokenizer import Tokenizer, train_tokenizer

__all__ = ["train", "lr_factor", "forward_backward", "optimizer_step", "validate", "compute_cmvn",
           "maybe_empty_cache", "resolve_device"]

log = logging.getLogger("konkanivani")


def lr_factor(step: int, warmup_steps: int) -> float:
    """Multiplier of the peak LR after ``step`` optimizer steps: linear warm-up, then 1/sqrt decay.

    A pure function of the step, so resuming needs only the step count.
    """
    step += 1
    if warmup_steps <= 0:
        return 1.0
    return min(step / warmup_steps, math.sqrt(warmup_steps / step))


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"--device {name}: CUDA is not available on this machine (use --device cpu)")
    return device


def maybe_empty_cache(device: torch.device, batches_done: int, every: int) -> bool:
    """Release cached CUDA blocks every ``every`` batches, against fragmentation over long runs.
    A no-op elsewhere. Returns whether the cache was emptied."""
    if device.type != "cuda" or every <= 0 or batches_done % every:
        return False
    torch.cuda.empty_cache()
    return True


def compute_cmvn(utterances: list[Utterance], n_mels: int, max_utterances: int = 500,
                 seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Global mean and standard deviation of log-mel features over (a seeded sample of) the training set."""
    sample = random.Random(seed).sample(utterances, min(max_utterances, len(utterances)))
    log_mel = LogMel(n_mels)
    total, total_sq, frames = torch.zeros(n_mels, dtype=torch.float64), torch.zeros(n_mels, dtype=torch.float64), 0
    for utt in sample:
        try:
            feats = log_mel(load_audio(utt.audio_path)).double()  # (T, F)
        except RuntimeError as e:
            log.warning("%s: %s; left out of CMVN", utt.where, e)
            continue
        total += feats.sum(0)
        total_sq += (feats ** 2).sum(0)
        frames += feats.shape[0]
    if frames == 0:
        raise RuntimeError("no training audio could be read to compute feature statistics")
    mean = total / frames
    std = (total_sq / frames - mean ** 2).clamp_min(1e-10).sqrt()
    return mean.float(), std.float()


def forward_backward(model: ASRModel, micro_batches: list[Batch], device: torch.device, precision: Precision,
                     scaler: torch.amp.GradScaler, spec_augment: bool,
                     name_of: Optional[Callable[[int], str]] = None) -> dict[str, float]:
    """Accumulate gradients over ``micro_batches``, normalized by their total utterance count, so
    that the update equals the one from a single batch holding all of them.

    A micro-batch that runs out of memory is split in halves and retried; the normalization by
    the group's utterance count keeps the update as it would have been. An error in the forward
    pass leaves the gradients alone; one in the backward pass may have added part of them, so the
    gradients are cleared and the group starts again. Only a single utterance that does not fit
    stops training (``BatchDoesNotFit``; ``name_of`` turns its index into a name for the message).
    """
    n_utts = sum(len(b) for b in micro_batches)
    pending, done = list(micro_batches), []
    sums = {"loss": 0.0, "ctc": 0.0, "attention": 0.0}
    while pending:
        batch = pending.pop(0)
        in_backward = False
        try:
            dev_batch = batch.to(device)
            with precision.autocast(device):
                out = model(dev_batch.feats, dev_batch.feat_lens, dev_batch.tokens, dev_batch.token_lens,
                            spec_augment=spec_augment)
            in_backward = True
            scaler.scale(out.loss / n_utts).backward()
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if not is_out_of_memory(e):
                raise
            failed = str(e)  # not the error itself: its traceback holds the failed attempt's tensors
        else:
            for name, value in out._asdict().items():
                sums[name] += value.item()
            done.append(batch)
            continue
        dev_batch = out = None  # noqa: F841 (release the failed attempt's tensors before retrying)
        free_memory(device)
        if len(batch) == 1:
            who = name_of(batch.indices[0]) if name_of else f"utterance {batch.indices[0]}"
            raise BatchDoesNotFit(
                f"{who} ({int(batch.feat_lens[0])} frames) does not fit in {device.type} memory even alone "
                f"({failed}); lower --max_duration, or use --gradient_checkpointing, --precision bf16/fp16, "
                "--optimizer adamw_8bit or a smaller --preset")
        halves = list(split_batch(batch))
        log.warning("out of memory on a micro-batch of %d utterances (%d frames each)%s; retrying it as %d + %d "
                    "utterances, the update is unchanged", len(batch), batch.feats.shape[1],
                    " in the backward pass: the accumulation group starts again" if in_backward else "",
                    len(halves[0]), len(halves[1]))
        if in_backward:
            model.zero_grad(set_to_none=True)
            pending, done = done + halves + pending, []
            sums = dict.fromkeys(sums, 0.0)
        else:
            pending = halves + pending
    return {name: value / n_utts for name, value in sums.items()}


def optimizer_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                   grad_clip: float, loss: float = 0.0) -> float:
    """Unscale, clip, step, update the scale, zero the gradients. Returns the gradient norm.

    A non-finite gradient norm or ``loss`` skips the update in every precision (with fp16 the
    GradScaler then also lowers its scale); the caller tells a skip by the returned norm and the loss.
    """
    scaler.unscale_(optimizer)
    params = [p for p in model.parameters() if p.grad is not None]
    max_norm = grad_clip if grad_clip > 0 else float("inf")
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    if math.isfinite(grad_norm) and math.isfinite(loss):
        scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


@torch.no_grad()
def validate(model: ASRModel, loader: Iterable[Optional[Batch]], tokenizer: Tokenizer,
             utterances: list[Utterance], device: torch.device, precision: Precision) -> dict[str, float]:
    """Loss per utterance, and CER/WER of greedy CTC, in eval mode."""
    model.eval()
    loss_sum, n, refs, hyps = 0.0, 0, [], []
    for batch in loader:
        if batch is None:
            continue
        batch = batch.to(device)
        with precision.autocast(device):
            enc, enc_lens = model.encode(batch.feats, batch.feat_lens)
            out = model.losses(enc, enc_lens, batch.tokens, batch.token_lens)
            log_probs = model.ctc_log_probs(enc)
        loss_sum += out.loss.item()
        n += len(batch)
        hyps += [tokenizer.decode(h) for h in ctc_greedy(log_probs, enc_lens)]
        refs += [utterances[i].text for i in batch.indices]
    model.train()
    return {"loss": loss_sum / max(n, 1), **error_rates(refs, hyps)}


def _rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    return {"python": random.getstate(), "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


_DATA_ORDER_FIELDS = ("batch_size", "seed", "max_duration")
# The same for the dynamic batches; --max_samples is handled apart, as it may grow.
_SAMPLER_FIELDS = ("max_batch_frames", "max_batch_seconds", "num_buckets", "max_memory_gb", "preflight")


def _resume_optimizer_and_samples(cfg: TrainConfig, saved: dict[str, Any]) -> tuple[TrainConfig, bool]:
    """On resume: the checkpoint's optimizer (its state fits no other), and its --max_samples unless
    the new one is larger. Returns the config and whether the training set grew."""
    if canonical_optimizer(cfg.optimizer) != canonical_optimizer(saved["optimizer"]):
        log.warning("on resume, --optimizer %s as in the checkpoint (its optimizer state is for that optimizer)",
                    saved["optimizer"])
        cfg = dataclasses.replace(cfg, optimizer=saved["optimizer"])
    old, new = saved["max_samples"], cfg.max_samples
    grows = old > 0 and (new <= 0 or new > old)
    if new != old and not grows:
        log.warning("on resume, --max_samples %d as in the checkpoint (it may grow, not shrink)", old)
        cfg = dataclasses.replace(cfg, max_samples=old)
    return cfg, grows


def _train_sampler(cfg: TrainConfig, utterances: list[Utterance], model_cfg: ModelConfig, precision: Precision,
                   optimizer_name: str, preflight_count: int) -> Sampler:
    """Fixed-size or duration-bucketed batches (capped by the memory estimate under
    --max_memory_gb), the largest first in the first epoch under --preflight."""
    durations = [u.duration for u in utterances]
    if cfg.max_batch_frames and cfg.max_batch_seconds:
        raise ValueError("give --max_batch_frames or --max_batch_seconds, not both")
    max_frames = cfg.max_batch_frames or round(cfg.max_batch_seconds * FRAMES_PER_SECOND)
    if cfg.max_memory_gb > 0 and not max_frames:
        max_frames = 10 ** 9  # the memory budget alone decides
    if max_frames:
        fits = None
        if cfg.max_memory_gb > 0:
            estimator = MemoryEstimator(model_cfg, precision_name(precision), optimizer_name,
                                        cfg.gradient_checkpointing)
            fits = estimator.fits_budget(cfg.max_memory_gb * GIB)
        sampler = DurationBucketSampler(durations, max_frames, seed=cfg.seed, num_buckets=cfg.num_buckets, fits=fits)
        log.info("dynamic batches: up to %s padded frames%s, %d length buckets (--batch_size is not used)",
                 f"{max_frames:,}" if max_frames < 10 ** 9 else "any number of",
                 f" and an estimated peak under {cfg.max_memory_gb:g} GiB" if fits else "", cfg.num_buckets)
    else:
        sampler = LengthGroupedBatchSampler(durations, cfg.batch_size, seed=cfg.seed)
    if cfg.preflight:
        sampler = PreflightSampler(sampler, durations, preflight_count)
    return sampler


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop metric rows written after ``step`` by a run that died before its next save."""
    if not path.is_file():
        return
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    kept = [line for line in lines if _metric_step(line) <= step]
    if len(kept) < len(lines):
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(kept), encoding="utf-8")
        os.replace(tmp, path)


def _metric_step(line: str) -> float:
    """The step of a metrics row; infinite for a line cut short by a kill, so that it is dropped."""
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return float("inf")


def _log_skipped(name: str, path: str, kept: int, skipped: Counter) -> None:
    if skipped:
        reasons = ", ".join(f"{n} {reason}" for reason, n in skipped.most_common())
        log.warning("%s manifest %s: %d utterances, %d rows skipped (%s)", name, path, kept,
                    sum(skipped.values()), reasons)
    else:
        log.info("%s manifest %s: %d utterances", name, path, kept)


def _loader(dataset: ASRDataset, sampler: Sampler, cfg: TrainConfig,
            device: torch.device) -> DataLoader:
    workers = cfg.num_workers
    # A generator of its own, so that starting an epoch's iterator (which draws the workers' seed)
    # leaves the global RNG, and with it dropout and SpecAugment, as a resumed run finds it.
    return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, num_workers=workers,
                      pin_memory=device.type == "cuda", persistent_workers=workers > 0,
                      prefetch_factor=4 if workers > 0 else None,
                      worker_init_fn=ignore_stop_signals if workers > 0 else None,
                      generator=torch.Generator().manual_seed(cfg.seed))


def _diverged_message(in_a_row: int, step: int, out_dir: Path, fp16: bool) -> str:
    advice = ("with fp16 the gradients overflowed every time: go on in bf16 or fp32 (--precision bf16 or "
              "--precision fp32; --no-mixed_precision trains in fp32)" if fp16 else
              "lower --lr or --grad_clip, and check the utterances named above")
    return (f"{in_a_row} updates in a row were skipped for a non-finite loss or gradients (steps "
            f"{step - in_a_row + 1} to {step}), so training stopped. The weights are those of step {step - in_a_row}, "
            f"saved in {out_dir / 'latest.pt'}; {advice}, then resume with --resume latest.")


def _auto_batch_frames(cfg: TrainConfig, model: ASRModel, run_model: Callable[..., Any], device: torch.device,
                       precision: Precision, utterances: list[Utterance], estimator: MemoryEstimator) -> int:
    """--auto_batch: the largest --max_batch_frames whose batches of the longest utterance fit.
    On CUDA it is measured: forward + backward passes on growing synthetic batches until one runs
    out of memory or its peak plus the optimizer states passes 90% of the device. A CPU raises no
    error to probe for (the kernel ends the process instead), so there the estimator decides."""
    longest = max(frames_of(u.duration) for u in utterances)
    tokens = max(len(u.tokens) for u in utterances)
    budget = 0.9 * available_memory_bytes(device)
    if cfg.max_memory_gb > 0:
        budget = min(budget, cfg.max_memory_gb * GIB)
    if device.type != "cuda":
        frames = estimator.max_frames(budget, longest)
        log.info("--auto_batch on %s: no out-of-memory error to probe for; by the estimate, %d utterances of the "
                 "longest (%d frames) fit in %.1f GiB", device.type, frames // longest, longest, budget / GIB)
    else:
        def runs(n: int) -> bool:
            feats = torch.randn(n, longest, model.cfg.n_mels, device=device)
            lens = torch.full((n,), longest, device=device)
            toks = torch.randint(3, model.cfg.vocab_size, (n, tokens), device=device)
            torch.cuda.reset_peak_memory_stats(device)
            try:
                with precision.autocast(device):
                    out = run_model(feats, lens, toks, torch.full((n,), tokens, device=device), spec_augment=True)
                out.loss.backward()
                fits = torch.cuda.max_memory_allocated(device) + estimator.optimizer_bytes <= budget
            except (torch.OutOfMemoryError, RuntimeError) as e:
                if not is_out_of_memory(e):
                    raise
                fits = False
            out = feats = None
            model.zero_grad(set_to_none=True)
            free_memory(device)
            return fits

        with torch.random.fork_rng(devices=[device]):  # the probe leaves training's random draws alone
            frames = largest_fitting(runs, limit=512) * longest
        log.info("--auto_batch: %d utterances of the longest (%d frames) fit in %.1f GiB on %s (measured)",
                 frames // longest, longest, budget / GIB, device)
    if frames == 0:
        raise BatchDoesNotFit(f"--auto_batch: even one utterance of {longest} frames does not fit in "
                              f"{budget / GIB:.1f} GiB; lower --max_duration or use the memory options")
    return frames


def _compiled(model: ASRModel) -> Callable[..., Any]:
    """The model's forward through ``torch.compile`` (dynamic shapes: batches vary in length); the
    eager model, with a warning, wherever compiling fails (no compiler, an unsupported platform)."""
    try:
        compiled = torch.compile(model, dynamic=True)
    except Exception as e:
        log.warning("--compile: torch.compile is not available here (%s: %s); running eager", type(e).__name__, e)
        return model
    current = [compiled]

    def forward(*args: Any, **kwargs: Any) -> Any:
        if current[0] is not model:
            try:
                return current[0](*args, **kwargs)
            except Exception as e:
                if is_out_of_memory(e):
                    raise
                first_line = (str(e).strip().splitlines() or [""])[0]
                log.warning("--compile: compiling the model failed (%s: %s); running eager", type(e).__name__,
                            first_line)
                current[0] = model
        return model(*args, **kwargs)

    log.info("--compile: the model is compiled with torch.compile at its first batches")
    return forward


# GradScaler skips the first fp16 steps while it finds its scale; LambdaLR then warns that the
# scheduler stepped before the optimizer. The schedule is a function of the step count, as intended.
warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")


def train(cfg: TrainConfig, model_overrides: Optional[dict[str, Any]] = None,
          on_step: Optional[Callable[[int, int, ASRModel], bool]] = None) -> dict[str, Any]:
    """Train (or resume) as ``cfg`` says. ``model_overrides`` replace preset dimensions (fresh runs only).
    ``on_step(step, epoch, model)`` runs after every optimizer step; returning True stops the run
    there, with a checkpoint (benchmarks use it to evaluate on a clock).

    Returns a summary: final step, epoch, last validation metrics and the best WER.
    """
    # ---- setup ----------------------------------------------------------------------------
    out_dir = Path(cfg.output_dir)
    with hold_run_directory(out_dir):  # one run at a time in a directory
        moved_to = _claim_output_dir(cfg, out_dir)
        file_log = logging.FileHandler(out_dir / "train.log", encoding="utf-8")
        file_log.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        log.addHandler(file_log)
        try:
            if moved_to is not None:
                log.warning("--overwrite: the previous run in %s was moved to %s", out_dir, moved_to)
            with StopRequest(cfg.max_time) as stop_request:
                return _train(cfg, model_overrides or {}, out_dir, stop_request, on_step)
        finally:
            log.removeHandler(file_log)
            file_log.close()


def _claim_output_dir(cfg: TrainConfig, out_dir: Path) -> Optional[Path]:
    """A fresh run never writes over an earlier one: where ``out_dir`` holds a run, it is refused
    (``CheckpointError``), or under --overwrite the old run is moved aside (returned), not deleted."""
    if cfg.resume:
        return None
    found = existing_run(out_dir)
    if found is None:
        return None
    if not cfg.overwrite:
        raise CheckpointError(f"{out_dir} already holds a run ({found}): continue it with --resume latest, or start "
                              f"a new one with --overwrite (moves the old run to {out_dir.name}.replaced-<time>/ "
                              "beside it; nothing is deleted) or with another --output_dir")
    return move_run_aside(out_dir)


def _train(cfg: TrainConfig, model_overrides: dict[str, Any], out_dir: Path,
           stop_request: StopRequest, on_step: Optional[Callable[[int, int, ASRModel], bool]]) -> dict[str, Any]:
    if cfg.gradient_accumulation_steps < 1:
        raise ValueError("--gradient_accumulation_steps must be >= 1")
    device = resolve_device(cfg.device)
    _seed_everything(cfg.seed)
    if stale := remove_stale_temporaries(out_dir):
        log.warning("removed %d unfinished checkpoint writes of a run killed while saving: %s", len(stale),
                    ", ".join(p.name for p in stale))
    ckpt, ckpt_path = load_resume_checkpoint(cfg.resume, out_dir) if cfg.resume else (None, None)
    if ckpt is not None and "optimizer" not in ckpt:
        raise CheckpointError(f"--resume {cfg.resume}: the checkpoint holds model weights only (an averaged "
                              "model?); resume from a step checkpoint or latest")

    # Tokenizer, model shape and the settings that fix the data order come from the checkpoint
    # when resuming, so that the epoch in progress continues with exactly the batches it had left.
    if ckpt is not None:
        saved = {**dataclasses.asdict(TrainConfig()), **ckpt["train_config"]}  # older checkpoints: defaults
        changed = {k: saved[k] for k in _DATA_ORDER_FIELDS + _SAMPLER_FIELDS if getattr(cfg, k) != saved[k]}
        if changed:
            log.warning("on resume, %s as in the checkpoint (they decide which batches remain in the epoch)",
                        ", ".join(f"--{k} {v}" for k, v in changed.items()))
            cfg = dataclasses.replace(cfg, **changed)
        cfg, samples_grew = _resume_optimizer_and_samples(cfg, saved)
        tokenizer = Tokenizer(ckpt["tokenizer"])
        model_cfg = ModelConfig(**ckpt["model_config"])
        if any(v is not None and getattr(model_cfg, k) != v for k, v in model_overrides.items()):
            log.warning("model flags ignored on resume: the checkpoint's dimensions are used")
    else:
        if cfg.tokenizer:
            tokenizer = Tokenizer.load(cfg.tokenizer)
        else:
            texts = [row.get("text") for _, row in read_manifest(cfg.train_manifest)]
            tokenizer = train_tokenizer([t for t in texts if isinstance(t, str)], cfg.vocab_size, cfg.tokenizer_type)
        tokenizer.save(out_dir / "tokenizer.model")
        model_cfg = model_config_from_preset(cfg.preset, vocab_size=tokenizer.vocab_size, **model_overrides)

    train_utts, skipped = load_utterances(cfg.train_manifest, tokenizer, cfg.max_duration, cfg.duration_tolerance)
    _log_skipped("train", cfg.train_manifest, len(train_utts), skipped)
    if cfg.max_samples > 0:
        train_utts = [train_utts[i] for i in select_samples(len(train_utts), cfg.max_samples, cfg.seed)]
        log.info("--max_samples %d: training on %d of the utterances (a seeded choice)", cfg.max_samples,
                 len(train_utts))
    valid_utts, skipped = load_utterances(cfg.valid_manifest, tokenizer, cfg.max_duration, cfg.duration_tolerance)
    _log_skipped("valid", cfg.valid_manifest, len(valid_utts), skipped)
    if not train_utts or not valid_utts:
        raise RuntimeError("no usable utterance in the " + ("training" if not train_utts else "validation")
                           + " manifest; see the warnings above")

    model = ASRModel(model_cfg, cfg.ctc_weight, cfg.label_smoothing)
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
    else:
        model.set_cmvn(*compute_cmvn(train_utts, model_cfg.n_mels, seed=cfg.seed))
    model.to(device)
    model.set_gradient_checkpointing(cfg.gradient_checkpointing)
    run_model = _compiled(model) if cfg.compile else model
    n_enc, n_dec = count_parameters(model.encoder), count_parameters(model.decoder)
    log.info("model: %s parameters (encoder %s, decoder %s); d_model=%d, %d encoder + %d decoder layers, "
             "vocabulary %d", f"{count_parameters(model):,}", f"{n_enc:,}", f"{n_dec:,}", model_cfg.d_model,
             model_cfg.encoder_layers, model_cfg.decoder_layers, model_cfg.vocab_size)

    optimizer, optimizer_name = build_optimizer(cfg.optimizer, model.parameters(), device, cfg.lr, cfg.weight_decay)
    log.info("optimizer: %s", {"adamw": "AdamW", "adamw_8bit": "8-bit AdamW (bitsandbytes)"}[optimizer_name])
    cfg = dataclasses.replace(cfg, optimizer=optimizer_name)  # the checkpoint records the one that runs
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, partial(lr_factor, warmup_steps=cfg.warmup_steps))
    precision = resolve_precision(device, cfg.mixed_precision, cfg.precision)
    log.log(logging.WARNING if precision.slow else logging.INFO, "%s; device %s", precision.note, device)
    if cfg.gradient_checkpointing:
        log.info("gradient checkpointing: each encoder and decoder layer is recomputed in the backward pass")
    scaler = torch.amp.GradScaler(device.type, enabled=precision.use_scaler)

    train_set, valid_set = ASRDataset(train_utts, model_cfg.n_mels), ASRDataset(valid_utts, model_cfg.n_mels)
    if cfg.auto_batch and ckpt is None:
        estimator = MemoryEstimator(model_cfg, precision_name(precision), optimizer_name, cfg.gradient_checkpointing)
        frames = _auto_batch_frames(cfg, model, run_model, device, precision, train_utts, estimator)
        given = cfg.max_batch_frames or round(cfg.max_batch_seconds * FRAMES_PER_SECOND)
        cfg = dataclasses.replace(cfg, max_batch_frames=min(frames, given) if given else frames, max_batch_seconds=0.0)
    # The first micro-batch of the second step is the peak: optimizer states exist from then on.
    accum_then = ckpt["train_config"]["gradient_accumulation_steps"] if ckpt else cfg.gradient_accumulation_steps
    sampler = _train_sampler(cfg, train_utts, model_cfg, precision, optimizer_name, accum_then + 1)
    valid_sampler = LengthGroupedBatchSampler([u.duration for u in valid_utts], cfg.batch_size, shuffle=False)
    train_loader = _loader(train_set, sampler, cfg, device)
    valid_loader = _loader(valid_set, valid_sampler, dataclasses.replace(cfg, num_workers=0), device)

    step, epoch, batches_done, valid_metrics, valid_step = 0, 0, 0, {}, -1
    best_wer = best_cer = float("inf")
    if ckpt is not None:
        saved_optimizer = canonical_optimizer(ckpt["train_config"].get("optimizer", "adamw"))
        if saved_optimizer == optimizer_name:
            optimizer.load_state_dict(ckpt["optimizer"])
        else:
            log.warning("the checkpoint's optimizer state is %s's and cannot be loaded into %s: the Adam moments "
                        "start again from zero (weights, step and schedule carry on)", saved_optimizer, optimizer_name)
        scheduler.load_state_dict(ckpt["scheduler"])
        if scaler.is_enabled() and ckpt["scaler"]:  # empty when the saved run had no fp16
            scaler.load_state_dict(ckpt["scaler"])
        step, epoch, batches_done = ckpt["step"], ckpt["sampler"]["epoch"], ckpt["sampler"]["start"]
        best_wer, best_cer = ckpt["best_wer"], ckpt.get("best_cer", float("inf"))
        valid_metrics, valid_step = ckpt["valid_metrics"], ckpt.get("valid_step", -1)
        _truncate_metrics(out_dir / "metrics.jsonl", step)
        _set_rng_state(ckpt["rng"])
        if samples_grew and batches_done:
            log.info("--max_samples grew from %d: epoch %d ends here, the next one covers the larger set",
                     saved["max_samples"], epoch + 1)
            epoch, batches_done = epoch + 1, 0
        log.info("resumed from %s at step %d (epoch %d, batch %d), lr %.3g",
                 cfg.resume if ckpt_path.name == "latest.pt" or cfg.resume != "latest" else ckpt_path, step,
                 epoch + 1, batches_done, scheduler.get_last_lr()[0])

    if isinstance(getattr(sampler, "inner", sampler), DurationBucketSampler):
        log.info("%d dynamic batches per update, peak lr %g, %d warm-up steps", cfg.gradient_accumulation_steps,
                 cfg.lr, cfg.warmup_steps)
    else:
        log.info("%d utterances per update (batch %d x %d accumulation steps), peak lr %g, %d warm-up steps",
                 cfg.batch_size * cfg.gradient_accumulation_steps, cfg.batch_size, cfg.gradient_accumulation_steps,
                 cfg.lr, cfg.warmup_steps)

    def record(kind: str, **values: Any) -> None:
        # Each row carries the (1-based) epoch its step belongs to: the one in progress, or the one
        # that just ended when an epoch-end validation is recorded.
        shown = epoch + 1 if batches_done else epoch
        values = {k: v if math.isfinite(v) else None for k, v in values.items()}  # strict JSON: no NaN
        with open(out_dir / "metrics.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps({"kind": kind, "step": step, "epoch": shown, **values}) + "\n")

    saved_step = -1

    def save(is_best: bool = False, quiet: bool = False) -> None:
        nonlocal saved_step
        state = {
            "model_config": dataclasses.asdict(model_cfg), "train_config": dataclasses.asdict(cfg),
            "tokenizer": tokenizer.model_proto, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(), "step": step,
            "sampler": {"epoch": epoch, "start": batches_done}, "rng": _rng_state(),
            "best_wer": best_wer, "best_cer": best_cer, "valid_metrics": valid_metrics, "valid_step": valid_step,
        }
        path = save_checkpoint(state, out_dir / step_checkpoint_name(step))
        point_to(path, out_dir / "latest.pt")
        if is_best:
            point_to(path, out_dir / "best.pt")
        prune_checkpoints(out_dir, cfg.keep_checkpoints)
        saved_step = step
        if not quiet:
            log.info("saved %s%s", path, " (best so far: also best.pt)" if is_best else "")

    def validate_and_save() -> None:
        """Validate at this step, record the metrics, save (best.pt too when the WER improved).
        Draws nothing from the global RNG, so a resumed run goes on exactly as it would have."""
        nonlocal best_wer, best_cer, valid_metrics, valid_step
        valid_metrics, valid_step = validate(model, valid_loader, tokenizer, valid_utts, device, precision), step
        record("valid", **valid_metrics)
        # The lowest WER, and among equal WERs the lowest CER (early on every WER is 100%).
        is_best = (valid_metrics["wer"], valid_metrics["cer"]) < (best_wer, best_cer)
        if is_best:
            best_wer, best_cer = valid_metrics["wer"], valid_metrics["cer"]
        where = f"epoch {epoch}" if not batches_done else f"epoch {epoch + 1}, {100 * batches_done / epoch_batches:.0f}%"
        log.info("step %d (%s): valid loss %.3f  CER %.2f%%  WER %.2f%%%s", step, where, valid_metrics["loss"],
                 100 * valid_metrics["cer"], 100 * valid_metrics["wer"], "  (best)" if is_best else "")
        save(is_best)

    # ---- the loop -------------------------------------------------------------------------
    accum = cfg.gradient_accumulation_steps
    stop = cfg.max_steps > 0 and step >= cfg.max_steps
    stopped_by: Optional[str] = None  # the signal or budget that ended the run early
    reached_max_steps = False
    skips, unreadable_total = NonFiniteSkips(cfg.max_consecutive_skips), 0
    show_bar = cfg.progress and sys.stderr.isatty()  # a bar redirected into a file is only noise
    while epoch < cfg.epochs and not stop:
        sampler.set_epoch(epoch, batches_done)
        epoch_batches = batches_done + len(sampler)
        # The loader delivers the sampler's batches in order; what is missing from one failed to load.
        planned, unreadable, skips_before = iter(list(sampler)), [], skips.total
        log.info("epoch %d: %d batches, %.1f%% of their frames padding", epoch + 1, epoch_batches,
                 100 * padding_fraction(sampler.epoch_batches(), [frames_of(u.duration) for u in train_utts]))
        model.train()
        bar = _progress_bar(epoch_batches, batches_done, f"epoch {epoch + 1}/{cfg.epochs}", show_bar)
        micro: list[Batch] = []
        window_utts, window_start = 0, time.perf_counter()
        with logging_redirect_tqdm() if show_bar else contextlib.nullcontext():  # log lines above the bar
            for batch in train_loader:
                batches_done += 1
                bar.update()
                maybe_empty_cache(device, batches_done, cfg.empty_cache_every)
                loaded = set(batch.indices) if batch is not None else set()
                unreadable += [train_utts[i].where for i in next(planned) if i not in loaded]
                if batch is not None:
                    micro.append(batch)
                # An accumulation group closes after `accum` batches, or at the end of the epoch.
                if (len(micro) < accum and batches_done < epoch_batches) or not micro:
                    continue
                stats = forward_backward(run_model, micro, device, precision, scaler, cfg.spec_augment,
                                         name_of=lambda i: f"{train_utts[i].where} ({train_utts[i].duration:.1f} s)")
                window_utts += sum(len(b) for b in micro)
                group = [train_utts[i] for b in micro for i in b.indices]
                micro = []
                lr = scheduler.get_last_lr()[0]
                grad_norm = optimizer_step(model, optimizer, scaler, cfg.grad_clip, stats["loss"])
                scheduler.step()
                step += 1
                finite = math.isfinite(stats["loss"]) and math.isfinite(grad_norm)
                diverged = skips.update(finite)
                if not finite:
                    log.warning("step %d: non-finite %s, update skipped (%d in a row, %d in all%s); batch: %s", step,
                                "gradients" if math.isfinite(stats["loss"]) else "loss", skips.in_a_row, skips.total,
                                f"; fp16 loss scale now {scaler.get_scale():g}" if scaler.is_enabled() else "",
                                ", ".join(f"{u.where} ({u.audio_path.name})" for u in group))

                speed = window_utts / (time.perf_counter() - window_start)
                bar.set_postfix_str(f"loss {stats['loss']:.3g}, {speed:.1f} utt/s", refresh=False)
                if step % cfg.log_every == 0:
                    record("train", lr=lr, grad_norm=grad_norm, utt_per_s=speed, **stats)
                    log.info("%s", _summary_line(step, epoch, batches_done, epoch_batches, stats, lr, grad_norm,
                                                 speed, device))
                    window_utts, window_start = 0, time.perf_counter()
                if cfg.save_every_steps and step % cfg.save_every_steps == 0:
                    save()
                if diverged:
                    if saved_step != step:
                        save()
                    raise TrainingDiverged(_diverged_message(skips.in_a_row, step, out_dir, scaler.is_enabled()))
                mid_epoch = batches_done < epoch_batches  # the epoch's end validates anyway
                if cfg.validate_every_steps and step % cfg.validate_every_steps == 0 and mid_epoch:
                    validate_and_save()
                reached_max_steps = cfg.max_steps > 0 and step >= cfg.max_steps
                if reached_max_steps or (on_step is not None and on_step(step, epoch, model)):
                    stop = True
                    break
                if stopped_by := stop_request.reason():
                    stop = True
                    break
        bar.close()
        unreadable_total += len(unreadable)
        if unreadable:
            log.warning("epoch %d: %d audio files could not be read and were left out: %s%s", epoch + 1,
                        len(unreadable), ", ".join(unreadable[:10]), " ..." if len(unreadable) > 10 else "")
        if skips.total > skips_before:
            log.warning("epoch %d: %d updates skipped for a non-finite loss or gradients", epoch + 1,
                        skips.total - skips_before)
        log.info("epoch %d memory (GiB): %s", epoch + 1,
                 ", ".join(f"{k[:-3]} {v:.2f}" for k, v in memory_status(device).items()))
        if stop and batches_done < epoch_batches:
            if reached_max_steps and valid_step != step:  # --max_steps ends with a score and a current best.pt
                validate_and_save()
            elif stopped_by is None:
                log.info("stopped at step %d in epoch %d", step, epoch + 1)
            if saved_step != step:
                save()
            break

        # Save before validating, so that nothing that goes wrong in validation costs the epoch;
        # save again after it, with the metrics and the best WER (only that save is logged).
        epoch, batches_done = epoch + 1, 0
        save(quiet=True)
        if stopped_by := stopped_by or stop_request.reason():  # saved; validation can wait for the next run
            log.info("saved %s", out_dir / step_checkpoint_name(step))
            break
        validate_and_save()
        if not stop and epoch < cfg.epochs:  # a stop asked for during validation
            stopped_by = stop_request.reason()
            stop = stopped_by is not None

    if stopped_by is not None:
        log.warning("stopped by %s at step %d (epoch %d, batch %d), saved in %s; to go on, run the same command "
                    "with --resume latest", stopped_by, step, epoch + 1, batches_done, out_dir / "latest.pt")
    return {"step": step, "epoch": epoch, "valid": valid_metrics, "best_wer": best_wer, "stopped_by": stopped_by,
            "skipped_updates": skips.total, "unreadable_files": unreadable_total}


def _progress_bar(total: int, done: int, desc: str, show: bool) -> tqdm:
    """An epoch's bar that fits 80 columns: count, times, loss and speed (the summary lines carry the rest)."""
    return tqdm(total=total, initial=done, desc=desc, disable=not show, leave=False, mininterval=1.0,
                ncols=min(80, shutil.get_terminal_size().columns),
                bar_format="{desc} {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}] {postfix}")


def _summary_line(step: int, epoch: int, batches_done: int, epoch_batches: int, stats: dict[str, float], lr: float,
                  grad_norm: float, speed: float, device: torch.device) -> str:
    """The --log_every line: where the run is, the losses, lr, gradient norm, speed and memory."""
    memory = memory_status(device)
    now, peak = list(memory.values())[:2]
    return (f"step {step} (epoch {epoch + 1}, {100 * batches_done / epoch_batches:.0f}%): loss {stats['loss']:.3f} "
            f"(ctc {stats['ctc']:.3f}, attention {stats['attention']:.3f}), lr {lr:.2e}, grad norm {grad_norm:.2f}, "
            f"{speed:.1f} utt/s, memory {now:.2f} GiB (peak {peak:.2f})")
