"""The training loop, readable top to bottom: setup, then one loop over optimizer steps."""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import random
import time
import warnings
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader
from tqdm import tqdm

from .audio import LogMel, load_audio
from .checkpoint import (CheckpointError, load_checkpoint, point_to, prune_checkpoints, remove_stale_temporaries,
                         resolve_resume, save_checkpoint, step_checkpoint_name)
from .config import ModelConfig, TrainConfig, model_config_from_preset
from .data import ASRDataset, Batch, LengthGroupedBatchSampler, Utterance, collate, load_utterances, read_manifest
from .decode import ctc_greedy
from .metrics import error_rates
from .model import ASRModel, count_parameters
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
                     scaler: torch.amp.GradScaler, spec_augment: bool) -> dict[str, float]:
    """Accumulate gradients over ``micro_batches``, normalized by their total utterance count, so
    that the update equals the one from a single batch holding all of them."""
    n_utts = sum(len(b) for b in micro_batches)
    sums = {"loss": 0.0, "ctc": 0.0, "attention": 0.0}
    for batch in micro_batches:
        batch = batch.to(device)
        with precision.autocast(device):
            out = model(batch.feats, batch.feat_lens, batch.tokens, batch.token_lens, spec_augment=spec_augment)
        scaler.scale(out.loss / n_utts).backward()
        for name, value in out._asdict().items():
            sums[name] += value.item()
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


def _loader(dataset: ASRDataset, sampler: LengthGroupedBatchSampler, cfg: TrainConfig,
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
    out_dir.mkdir(parents=True, exist_ok=True)
    file_log = logging.FileHandler(out_dir / "train.log", encoding="utf-8")
    file_log.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    log.addHandler(file_log)
    try:
        with StopRequest(cfg.max_time) as stop_request:
            return _train(cfg, model_overrides or {}, out_dir, stop_request, on_step)
    finally:
        log.removeHandler(file_log)
        file_log.close()


def _train(cfg: TrainConfig, model_overrides: dict[str, Any], out_dir: Path,
           stop_request: StopRequest, on_step: Optional[Callable[[int, int, ASRModel], bool]]) -> dict[str, Any]:
    if cfg.gradient_accumulation_steps < 1:
        raise ValueError("--gradient_accumulation_steps must be >= 1")
    device = resolve_device(cfg.device)
    _seed_everything(cfg.seed)
    if stale := remove_stale_temporaries(out_dir):
        log.warning("removed %d unfinished checkpoint writes of a run killed while saving: %s", len(stale),
                    ", ".join(p.name for p in stale))
    ckpt = load_checkpoint(resolve_resume(cfg.resume, out_dir)) if cfg.resume else None
    if ckpt is not None and "optimizer" not in ckpt:
        raise CheckpointError(f"--resume {cfg.resume}: the checkpoint holds model weights only (an averaged "
                              "model?); resume from a step checkpoint or latest")

    # Tokenizer, model shape and the settings that fix the data order come from the checkpoint
    # when resuming, so that the epoch in progress continues with exactly the batches it had left.
    if ckpt is not None:
        saved = ckpt["train_config"]
        changed = {k: saved[k] for k in _DATA_ORDER_FIELDS if getattr(cfg, k) != saved[k]}
        if changed:
            log.warning("on resume, %s as in the checkpoint (they decide which batches remain in the epoch)",
                        ", ".join(f"--{k} {v}" for k, v in changed.items()))
            cfg = dataclasses.replace(cfg, **changed)
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
    n_enc, n_dec = count_parameters(model.encoder), count_parameters(model.decoder)
    log.info("model: %s parameters (encoder %s, decoder %s); d_model=%d, %d encoder + %d decoder layers, "
             "vocabulary %d", f"{count_parameters(model):,}", f"{n_enc:,}", f"{n_dec:,}", model_cfg.d_model,
             model_cfg.encoder_layers, model_cfg.decoder_layers, model_cfg.vocab_size)

    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, partial(lr_factor, warmup_steps=cfg.warmup_steps))
    precision = resolve_precision(device, cfg.mixed_precision)
    log.info("%s; device %s", precision.note, device)
    scaler = torch.amp.GradScaler(device.type, enabled=precision.use_scaler)

    train_set, valid_set = ASRDataset(train_utts, model_cfg.n_mels), ASRDataset(valid_utts, model_cfg.n_mels)
    sampler = LengthGroupedBatchSampler([u.duration for u in train_utts], cfg.batch_size, seed=cfg.seed)
    valid_sampler = LengthGroupedBatchSampler([u.duration for u in valid_utts], cfg.batch_size, shuffle=False)
    train_loader = _loader(train_set, sampler, cfg, device)
    valid_loader = _loader(valid_set, valid_sampler, dataclasses.replace(cfg, num_workers=0), device)

    step, epoch, batches_done, best_wer, valid_metrics, valid_step = 0, 0, 0, float("inf"), {}, -1
    if ckpt is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        if scaler.is_enabled() and ckpt["scaler"]:  # empty when the saved run had no fp16
            scaler.load_state_dict(ckpt["scaler"])
        step, epoch, batches_done = ckpt["step"], ckpt["sampler"]["epoch"], ckpt["sampler"]["start"]
        best_wer, valid_metrics, valid_step = ckpt["best_wer"], ckpt["valid_metrics"], ckpt.get("valid_step", -1)
        _truncate_metrics(out_dir / "metrics.jsonl", step)
        _set_rng_state(ckpt["rng"])
        log.info("resumed from %s at step %d (epoch %d, batch %d), lr %.3g", cfg.resume, step, epoch + 1,
                 batches_done, scheduler.get_last_lr()[0])

    log.info("%d utterances per update (batch %d x %d accumulation steps), peak lr %g, %d warm-up steps",
             cfg.batch_size * cfg.gradient_accumulation_steps, cfg.batch_size, cfg.gradient_accumulation_steps,
             cfg.lr, cfg.warmup_steps)

    def record(kind: str, **values: Any) -> None:
        # Training rows carry the epoch in progress, validation rows the epoch just finished.
        shown = epoch + 1 if kind == "train" else epoch
        values = {k: v if math.isfinite(v) else None for k, v in values.items()}  # strict JSON: no NaN
        with open(out_dir / "metrics.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps({"kind": kind, "step": step, "epoch": shown, **values}) + "\n")

    saved_step = -1

    def save(is_best: bool = False) -> None:
        nonlocal saved_step
        state = {
            "model_config": dataclasses.asdict(model_cfg), "train_config": dataclasses.asdict(cfg),
            "tokenizer": tokenizer.model_proto, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(), "step": step,
            "sampler": {"epoch": epoch, "start": batches_done}, "rng": _rng_state(),
            "best_wer": best_wer, "valid_metrics": valid_metrics, "valid_step": valid_step,
        }
        path = save_checkpoint(state, out_dir / step_checkpoint_name(step))
        point_to(path, out_dir / "latest.pt")
        if is_best:
            point_to(path, out_dir / "best.pt")
        prune_checkpoints(out_dir, cfg.keep_checkpoints)
        saved_step = step
        log.info("saved %s", path)

    # ---- the loop -------------------------------------------------------------------------
    accum = cfg.gradient_accumulation_steps
    stop = cfg.max_steps > 0 and step >= cfg.max_steps
    stopped_by: Optional[str] = None  # the signal or budget that ended the run early
    skips, unreadable_total = NonFiniteSkips(cfg.max_consecutive_skips), 0
    while epoch < cfg.epochs and not stop:
        sampler.set_epoch(epoch, batches_done)
        epoch_batches = batches_done + len(sampler)
        # The loader delivers the sampler's batches in order; what is missing from one failed to load.
        planned, unreadable, skips_before = iter(list(sampler)), [], skips.total
        model.train()
        bar = tqdm(total=epoch_batches, initial=batches_done, desc=f"epoch {epoch + 1}/{cfg.epochs}",
                   disable=not cfg.progress, dynamic_ncols=True, leave=False)
        micro: list[Batch] = []
        window_utts, window_start = 0, time.perf_counter()
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
            stats = forward_backward(model, micro, device, precision, scaler, cfg.spec_augment)
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
            bar.set_postfix(loss=f"{stats['loss']:.3f}", lr=f"{lr:.2e}", utt_s=f"{speed:.1f}", refresh=False)
            if step % cfg.log_every == 0:
                record("train", lr=lr, grad_norm=grad_norm, utt_per_s=speed, **stats)
                window_utts, window_start = 0, time.perf_counter()
            if cfg.save_every_steps and step % cfg.save_every_steps == 0:
                save()
            if diverged:
                if saved_step != step:
                    save()
                raise TrainingDiverged(_diverged_message(skips.in_a_row, step, out_dir, scaler.is_enabled()))
            if (cfg.max_steps and step >= cfg.max_steps) or (on_step is not None and on_step(step, epoch, model)):
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
        if stop and batches_done < epoch_batches:
            if stopped_by is None:
                log.info("stopped at step %d in epoch %d", step, epoch + 1)
            if saved_step != step:
                save()
            break

        # Save before validating, so that nothing that goes wrong in validation costs the epoch;
        # save again after it, with the metrics and the best WER.
        epoch, batches_done = epoch + 1, 0
        save()
        if stopped_by := stopped_by or stop_request.reason():  # saved; validation can wait for the next run
            break
        valid_metrics, valid_step = validate(model, valid_loader, tokenizer, valid_utts, device, precision), step
        record("valid", **valid_metrics)
        is_best = valid_metrics["wer"] < best_wer
        best_wer = min(best_wer, valid_metrics["wer"])
        log.info("epoch %d step %d: valid loss %.3f  CER %.2f%%  WER %.2f%%%s", epoch, step,
                 valid_metrics["loss"], 100 * valid_metrics["cer"], 100 * valid_metrics["wer"],
                 "  (best)" if is_best else "")
        save(is_best)
        if not stop and epoch < cfg.epochs:  # a stop asked for during validation
            stopped_by = stop_request.reason()
            stop = stopped_by is not None

    if stopped_by is not None:
        log.warning("stopped by %s at step %d (epoch %d, batch %d), saved in %s; to go on, run the same command "
                    "with --resume latest", stopped_by, step, epoch + 1, batches_done, out_dir / "latest.pt")
    return {"step": step, "epoch": epoch, "valid": valid_metrics, "best_wer": best_wer, "stopped_by": stopped_by,
            "skipped_updates": skips.total, "unreadable_files": unreadable_total}
