"""The training loop, readable top to bottom: set up a run, train epoch by epoch, end each epoch.

``train()`` is the outline; ``setup_run`` builds a ``Run`` (everything a run holds while it runs)
from the flags or from a checkpoint's ``TrainState``; ``train_epoch`` loops over the epoch's
batches and makes one optimizer step per accumulation group (``train_step``); ``end_epoch``
validates and saves. A step's checkpoint is written once at most. Under ``torchrun`` every process
runs this same loop on its share of the batches (``distributed.py``); rank 0 alone logs and writes.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import logging.handlers
import math
import random
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

import numpy as np
import torch
from torch.optim.swa_utils import AveragedModel
from torch.utils.data import DataLoader
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from ..checkpoint import load_checkpoint, write_file_atomic
from ..config import ConfigError, ModelConfig, TrainConfig, check_config, kept_settings, model_config_from_preset
from ..config_file import write_config_file
from ..data.augment import Augmenter, batching_duration
from ..data.dataset import ASRDataset, Batch, Utterance, collate, compute_cmvn, load_utterances, log_skipped
from ..data.frames import budget_frames, frames_of
from ..data.manifest import ManifestError, read_manifest
from ..data.samplers import (
    EpochKeyed,
    LengthGroupedBatchSampler,
    ResumableBatchSampler,
    ShardedSampler,
    padding_fraction,
    select_samples,
    split_batch,
    train_sampler,
)
from ..data.tokenizer import Tokenizer, train_tokenizer
from ..decoding.metrics import error_rates
from ..decoding.search import ctc_greedy
from ..model.asr import ASRModel, count_parameters
from .compile import compiled
from .curves import CURVES, have_matplotlib, write_curves
from .distributed import (
    Dist,
    distributed,
    full_state_dicts,
    is_sharded,
    load_optimizer_state,
    no_sync,
    wrap_data_parallel,
)
from .ema import ema_state, load_ema_state, make_ema
from .finetune import hold_encoder, init_checkpoint_config, init_model_config, keep_init_cmvn, load_init_weights
from .memory import (
    GIB,
    BatchDoesNotFit,
    MemoryEstimator,
    auto_batch_frames,
    free_memory,
    is_out_of_memory,
    memory_status,
    precision_name,
)
from .metrics_log import MetricsLog
from .optim import build_optimizer, canonical_optimizer, lr_factor
from .precision import Precision, resolve_precision
from .rundir import load_resume_checkpoint, remove_stale_temporaries, run_directory, save_step, step_checkpoint_name
from .signals import NonFiniteSkips, StopRequest, TrainingDiverged, diverged_message, ignore_stop_signals, stop_workers
from .state import TrainState, capture_rng, restore_rng
from .tensorboard_log import TensorBoardLog, open_tensorboard

__all__ = ["train", "Run", "forward_backward", "optimizer_step", "validate", "maybe_empty_cache"]

log = logging.getLogger("konkanivani")

SIGNAL_STOPS = ("SIGINT", "SIGTERM", "--max_time")  # stops that end a run early; the others are its limits


# ---- the outline ------------------------------------------------------------------------------

def train(cfg: TrainConfig, model_overrides: Optional[dict[str, Any]] = None,
          on_step: Optional[Callable[[int, int, ASRModel], bool]] = None) -> dict[str, Any]:
    """Train (or resume) as ``cfg`` says. ``model_overrides`` replace preset dimensions (fresh runs only).
    ``on_step(step, epoch, model)`` runs after every optimizer step; returning True stops the run
    there, with a checkpoint (benchmarks use it to evaluate on a clock).

    Returns a summary: final step, epoch, last validation metrics, the best WER, what stopped it.
    """
    check_config(cfg, model_overrides, init_checkpoint_config(cfg))  # every flag value, before any work
    with distributed(cfg.device) as (dist, device):
        _check_device_settings(cfg, device)
        with run_directory(Path(cfg.output_dir), cfg.resume, cfg.overwrite, dist) as start, StopRequest(cfg.max_time) as stop_request:
            run = setup_run(cfg, model_overrides or {}, dist, device, start)
            with contextlib.closing(run):
                stop = "max_steps" if 0 < cfg.max_steps <= run.step else None
                while run.epoch < cfg.epochs and stop is None:
                    stop, epoch_ended = train_epoch(run, stop_request, on_step)
                    stop = end_epoch(run, stop, stop_request) if epoch_ended else stop_inside_epoch(run, stop)
                return finish(run, stop)


def _check_device_settings(cfg: TrainConfig, device: torch.device) -> None:
    """What can only be checked once the device is known, before any work."""
    if cfg.offload_activations and device.type != "cuda":
        raise ConfigError(f"--offload_activations needs a CUDA device (on {device.type} the activations are in CPU "
                          "memory already)")


@dataclass
class Run:
    """What a training run holds while it runs: its parts, and its progress (saved as ``TrainState``)."""

    cfg: TrainConfig
    out_dir: Path
    dist: Dist
    device: torch.device
    precision: Precision
    tokenizer: Tokenizer
    model: ASRModel
    forward: Callable[..., Any]  # the model's forward: data-parallel and/or compiled where asked
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    train_utts: list[Utterance]
    valid_utts: list[Utterance]
    sampler: ResumableBatchSampler
    train_loader: DataLoader
    valid_loader: DataLoader
    metrics: MetricsLog
    skips: NonFiniteSkips
    step: int = 0
    epoch: int = 0  # epochs finished
    batches_done: int = 0  # batches of the epoch in progress, per process
    epoch_batches: int = 0  # batches in the whole epoch in progress, per process
    best_wer: float = math.inf
    best_cer: float = math.inf
    valid_metrics: dict[str, float] = field(default_factory=dict)
    valid_step: int = -1
    saved_step: int = -1
    unreadable: int = 0  # audio files that failed to load in training, all epochs
    board: TensorBoardLog = field(default_factory=TensorBoardLog)  # the metrics rows again, for TensorBoard
    ema: Optional[AveragedModel] = None  # the moving average of the weights (--ema_decay)
    draw_curves: bool = False  # redraw curves.png after each validation (rank 0, with matplotlib)

    def close(self) -> None:
        """End the data workers and the TensorBoard writer, however the run ended."""
        for loader in (self.train_loader, self.valid_loader):
            stop_workers(loader)
        self.board.close()

    def record(self, kind: str, **values: float) -> None:
        """A metrics row, in metrics.jsonl and TensorBoard. Each carries the 1-based epoch its step
        belongs to: the one in progress, or the one that just ended for an epoch-end validation."""
        if self.dist.is_main:
            self.metrics.write(kind, self.step, self.epoch + 1 if self.batches_done else self.epoch, **values)
            self.board.write(kind, self.step, **values)


# ---- setting up a run -------------------------------------------------------------------------

def setup_run(cfg: TrainConfig, model_overrides: dict[str, Any], dist: Dist, device: torch.device,
              start: Callable[[], None] = lambda: None) -> Run:
    """A fresh run from the flags, or the one ``--resume`` names continued from its checkpoint.
    Nothing is written to the output directory until the data is known usable; then ``start``
    (``rundir.run_directory``) makes the directory this run's."""
    out_dir = Path(cfg.output_dir)
    _seed_everything(cfg.seed)  # the same initial weights in every process
    state, source = _resume_state(cfg, out_dir)
    init = _init_checkpoint(cfg, state)
    cfg, model_cfg, tokenizer, samples_grew = _settings(cfg, model_overrides, state, dist, init)
    precision = resolve_precision(device, cfg.mixed_precision, cfg.precision)
    augmenter = _augmenter(cfg)  # lists --noise_dir / --rir_dir: a bad folder stops the run before any work
    train_utts, valid_utts = _load_data(cfg, tokenizer)
    start()
    if dist.is_main and (stale := remove_stale_temporaries(out_dir)):
        log.warning("removed %d unfinished checkpoint writes of a run killed while saving: %s", len(stale),
                    ", ".join(p.name for p in stale))
    if dist.is_main and state is None:
        write_file_atomic(out_dir / "tokenizer.model", tokenizer.model_proto)
    model = _build_model(cfg, model_cfg, train_utts, state, device, init, tokenizer)
    if dist.active:
        _seed_everything(cfg.seed + dist.rank)  # dropout and SpecAugment differ between processes
    forward = wrap_data_parallel(model, dist, device, cfg.strategy)  # fsdp shards the model in place
    optimizer, optimizer_name = build_optimizer(cfg.optimizer, model.parameters(), device, cfg.lr, cfg.weight_decay)
    log.info("optimizer: %s", {"adamw": "AdamW", "adamw_8bit": "8-bit AdamW (bitsandbytes)"}[optimizer_name])
    cfg = dataclasses.replace(cfg, optimizer=optimizer_name)  # the checkpoint records the one that runs
    log.log(logging.WARNING if precision.slow else logging.INFO, "%s; device %s%s", precision.note, device,
            f"; {dist.world} processes, {cfg.strategy}" if dist.active else "")
    forward = compiled(forward) if cfg.compile else forward
    estimator = MemoryEstimator(model_cfg, precision_name(precision), optimizer_name, cfg.gradient_checkpointing)
    durations = [batching_duration(u.duration, cfg.speed_perturb) for u in train_utts]  # as long as they may get
    if cfg.auto_batch and state is None:
        longest, tokens = max(frames_of(d) for d in durations), max(len(u.tokens) for u in train_utts)
        frames = auto_batch_frames(forward, model, device, lambda: precision.autocast(device), longest, tokens,
                                   estimator, cfg.max_memory_gb)
        given = budget_frames(cfg.max_batch_frames, cfg.max_batch_seconds)
        cfg = dataclasses.replace(cfg, max_batch_frames=min(frames, given) if given else frames, max_batch_seconds=0.0)
    # The first micro-batch of the second step is the peak (optimizer states exist from then on);
    # a resumed run keeps the count its first epoch was planned with.
    accum_then = state.train_config["gradient_accumulation_steps"] if state else cfg.gradient_accumulation_steps
    sampler = train_sampler(durations, cfg.batch_size,
                            budget_frames(cfg.max_batch_frames, cfg.max_batch_seconds), cfg.seed, cfg.num_buckets,
                            estimator.fits_budget(cfg.max_memory_gb * GIB) if cfg.max_memory_gb > 0 else None,
                            accum_then + 1 if cfg.preflight else 0, dist.rank, dist.world)
    valid_sampler = LengthGroupedBatchSampler([u.duration for u in valid_utts], cfg.batch_size, shuffle=False)
    if not is_sharded(model):  # a sharded model computes in every process together: all validate everything
        valid_sampler = ShardedSampler(valid_sampler, dist.rank, dist.world, even=False)
    run = Run(cfg, out_dir, dist, device, precision, tokenizer, model, forward, optimizer,
              torch.amp.GradScaler(device.type, enabled=precision.use_scaler), train_utts, valid_utts, sampler,
              _loader(ASRDataset(train_utts, model_cfg.n_mels, augmenter), sampler, cfg, device),
              _loader(ASRDataset(valid_utts, model_cfg.n_mels), valid_sampler, cfg, device, workers=0),
              MetricsLog(out_dir / "metrics.jsonl"), NonFiniteSkips(cfg.max_consecutive_skips))
    if cfg.ema_decay:  # of the unwrapped model: the DDP or compiled forward shares its parameters
        run.ema = make_ema(model, cfg.ema_decay)
    if state is not None:
        _restore(run, state, source, samples_grew)
    _log_plan(run, estimator)
    if dist.is_main:  # the values this run uses (the resumed ones on --resume), to run it again with --config
        write_config_file(out_dir / "config.yaml", run.cfg, model_cfg, run.step)
    if dist.is_main and cfg.tensorboard:
        run.board = open_tensorboard(out_dir / "tensorboard", run.step)
    run.draw_curves = dist.is_main and _can_draw_curves(out_dir)
    return run


def _can_draw_curves(out_dir: Path) -> bool:
    if have_matplotlib():
        return True
    log.info('matplotlib is not installed: no %s in %s (pip install "konkanivani[plot]")', CURVES, out_dir)
    return False


def _resume_state(cfg: TrainConfig, out_dir: Path) -> tuple[Optional[TrainState], str]:
    """The checkpoint ``--resume`` names, as a ``TrainState``, and how to name it in the log."""
    if not cfg.resume:
        return None, ""
    checkpoint, path = load_resume_checkpoint(cfg.resume, out_dir)
    named = cfg.resume if cfg.resume != "latest" or path.name == "latest.pt" else str(path)
    return TrainState.from_checkpoint(checkpoint, path), named


def _init_checkpoint(cfg: TrainConfig, state: Optional[TrainState]) -> Optional[dict[str, Any]]:
    """The checkpoint --init_from names, loaded, for a fresh run; None otherwise (a resumed run
    continues from its own checkpoint, which already started from it)."""
    if not cfg.init_from:
        return None
    if state is not None:
        log.info("--init_from %s not applied: the run resumes from its own checkpoint", cfg.init_from)
        return None
    return load_checkpoint(cfg.init_from)


def _settings(cfg: TrainConfig, model_overrides: dict[str, Any], state: Optional[TrainState], dist: Dist,
              init: Optional[dict[str, Any]] = None) -> tuple[TrainConfig, ModelConfig, Tokenizer, bool]:
    """The one place that decides what a resumed run takes from its checkpoint: the tokenizer, the
    model's shape, the settings that fix the data order, the optimizer (its state fits no other),
    and --max_samples unless the new one is larger. A fresh run takes --tokenizer or trains one
    (``_fresh_tokenizer``); its model shape is the preset's, or the --init_from checkpoint's
    (``init``), with the model flags over it. Returns the config, the model config, the tokenizer
    and whether the training set grew."""
    if state is None:
        tokenizer = _fresh_tokenizer(cfg, dist)
        if init is None:
            return cfg, model_config_from_preset(cfg.preset, vocab_size=tokenizer.vocab_size, **model_overrides), \
                tokenizer, False
        model_cfg, given = init_model_config(init, tokenizer.vocab_size, model_overrides)
        log.info("--init_from: model dimensions from %s%s (--preset not used)", cfg.init_from,
                 f", with {', '.join(f'--{k} {model_overrides[k]}' for k in given)} from the command line"
                 if given else "")
        return cfg, model_cfg, tokenizer, False
    saved = {**dataclasses.asdict(TrainConfig()), **state.train_config}
    changed = kept_settings(cfg, saved)  # the fields that decide which batches remain in the epoch
    if canonical_optimizer(cfg.optimizer) != canonical_optimizer(saved["optimizer"]):
        log.warning("on resume, --optimizer %s as in the checkpoint (its optimizer state is for that optimizer)",
                    saved["optimizer"])
        changed["optimizer"] = saved["optimizer"]
    old, new = saved["max_samples"], cfg.max_samples
    grows = old > 0 and (new <= 0 or new > old)
    if new != old and not grows:
        log.warning("on resume, --max_samples %d as in the checkpoint (it may grow, not shrink)", old)
        changed["max_samples"] = old
    shown = {k: v for k, v in changed.items() if k not in ("optimizer", "max_samples")}
    if shown:
        log.warning("on resume, %s as in the checkpoint (they decide which batches remain in the epoch)",
                    ", ".join(f"--{k} {v}" for k, v in shown.items()))
    model_cfg = ModelConfig.from_dict(state.model_config)
    if any(v is not None and getattr(model_cfg, k) != v for k, v in model_overrides.items()):
        log.warning("model flags ignored on resume: the checkpoint's dimensions are used")
    return dataclasses.replace(cfg, **changed), model_cfg, Tokenizer(state.tokenizer), grows


def _fresh_tokenizer(cfg: TrainConfig, dist: Dist) -> Tokenizer:
    """--tokenizer, or one trained on the training manifest's text by rank 0 and handed to the
    other processes (in memory: ``setup_run`` writes tokenizer.model once the data is usable)."""
    if cfg.tokenizer:
        return Tokenizer.load(cfg.tokenizer)
    proto = None
    if dist.is_main:
        texts = [row.get("text") for _, row in read_manifest(cfg.train_manifest)]
        try:
            proto = train_tokenizer([t for t in texts if isinstance(t, str)], cfg.vocab_size,
                                    cfg.tokenizer_type).model_proto
        except ValueError as e:
            raise ConfigError(f"{cfg.train_manifest}: {e}") from e
    return Tokenizer(dist.gather(proto)[0])


def _augmenter(cfg: TrainConfig) -> Optional[Augmenter]:
    """The training augmentations the flags ask for (logged once), or None when none is on."""
    if not cfg.augments:
        return None
    augmenter = Augmenter(cfg)  # a TrainConfig is an AugmentConfig
    log.info("augmentation of training utterances: %s", augmenter.describe())
    return augmenter


def _load_data(cfg: TrainConfig, tokenizer: Tokenizer) -> tuple[list[Utterance], list[Utterance]]:
    train_utts, skipped = load_utterances(cfg.train_manifest, tokenizer, cfg.max_duration, cfg.duration_tolerance)
    log_skipped("train", cfg.train_manifest, len(train_utts), skipped)
    if cfg.max_samples > 0:
        train_utts = [train_utts[i] for i in select_samples(len(train_utts), cfg.max_samples, cfg.seed)]
        log.info("--max_samples %d: training on %d of the utterances (a seeded choice)", cfg.max_samples,
                 len(train_utts))
    valid_utts, skipped = load_utterances(cfg.valid_manifest, tokenizer, cfg.max_duration, cfg.duration_tolerance)
    log_skipped("valid", cfg.valid_manifest, len(valid_utts), skipped)
    if not train_utts or not valid_utts:
        name, path = ("training", cfg.train_manifest) if not train_utts else ("validation", cfg.valid_manifest)
        raise ManifestError(f"no usable utterance in the {name} manifest {path}; see the warnings above "
                            "(konkanivani-validate lists every bad row)")
    return train_utts, valid_utts


def _build_model(cfg: TrainConfig, model_cfg: ModelConfig, train_utts: list[Utterance],
                 state: Optional[TrainState], device: torch.device, init: Optional[dict[str, Any]] = None,
                 tokenizer: Optional[Tokenizer] = None) -> ASRModel:
    """The model: a resumed run's weights; or fresh, with the CMVN statistics of the training data
    and, from an --init_from checkpoint (``init``), the weights that fit."""
    model = ASRModel(model_cfg, cfg.ctc_weight, cfg.label_smoothing)
    if state is not None:
        model.load_state_dict(state.model)
    else:
        model.set_cmvn(*compute_cmvn(train_utts, model_cfg.n_mels, seed=cfg.seed))
    if init is not None:
        modules = tuple(m.strip() for m in cfg.init_modules.split(","))
        log.info("%s", load_init_weights(model, tokenizer, init, modules, cfg.init_from).summary())
        if cfg.keep_init_cmvn:
            try:
                keep_init_cmvn(model, init)
            except ValueError as e:
                raise ConfigError(f"{cfg.init_from}: {e}") from e
        log.info("CMVN statistics: %s", f"kept from {cfg.init_from} (--keep_init_cmvn)" if cfg.keep_init_cmvn
                 else "computed from the new training data (--keep_init_cmvn keeps the init checkpoint's)")
    model.to(device)
    model.set_gradient_checkpointing(cfg.gradient_checkpointing)
    if cfg.gradient_checkpointing:
        log.info("gradient checkpointing: each encoder and decoder layer is recomputed in the backward pass")
    log.info("model: %s parameters (encoder %s, decoder %s); d_model=%d, %d encoder + %d decoder layers, "
             "vocabulary %d", f"{count_parameters(model):,}", f"{count_parameters(model.encoder):,}",
             f"{count_parameters(model.decoder):,}", model_cfg.d_model, model_cfg.encoder_layers,
             model_cfg.decoder_layers, model_cfg.vocab_size)
    return model


def _restore(run: Run, state: TrainState, source: str, samples_grew: bool) -> None:
    """Optimizer, scaler, random states and progress of a resumed run (weights: ``_build_model``)."""
    saved_optimizer = canonical_optimizer(state.train_config.get("optimizer", "adamw"))
    if saved_optimizer == run.cfg.optimizer:
        load_optimizer_state(run.model, run.optimizer, state.optimizer)
    else:  # the checkpoint's optimizer is not installed here (bitsandbytes missing, say)
        log.warning("the checkpoint's optimizer state is %s's and cannot be loaded into %s: the Adam moments "
                    "start again from zero (weights, step and schedule carry on)", saved_optimizer, run.cfg.optimizer)
    if run.scaler.is_enabled() and state.scaler:  # empty when the saved run had no fp16
        run.scaler.load_state_dict(state.scaler)
    run.step, run.epoch, run.batches_done = state.step, state.epoch, state.batches_done
    if state.processes == run.dist.world:
        restore_rng(state.rng[run.dist.rank])
    else:  # the processes took interleaved shares of the same batches: so many of them are done
        consumed = state.batches_done * state.processes
        run.batches_done = consumed // run.dist.world
        log.warning("the checkpoint was written by %d processes, this run has %d: random draws start afresh, and "
                    "the epoch goes on after %d of its batches%s", state.processes, run.dist.world,
                    run.batches_done * run.dist.world,
                    f" ({consumed % run.dist.world} done twice)" if consumed % run.dist.world else "")
    run.best_wer, run.best_cer = state.best_wer, state.best_cer
    run.valid_metrics, run.valid_step = state.valid_metrics, state.valid_step
    _restore_ema(run, state)
    if run.dist.is_main:
        run.metrics.truncate(run.step)
    if samples_grew and run.batches_done:
        log.info("--max_samples grew: epoch %d ends here, the next one covers the larger set", run.epoch + 1)
        run.epoch, run.batches_done = run.epoch + 1, 0
    log.info("resumed from %s at step %d (epoch %d, batch %d), lr %.3g", source, run.step, run.epoch + 1,
             run.batches_done, run.cfg.lr * lr_factor(run.step, run.cfg.warmup_steps))


def _restore_ema(run: Run, state: TrainState) -> None:
    """The moving average as the checkpoint kept it; one started afresh when it kept none."""
    if run.ema is not None and state.ema_model:
        load_ema_state(run.ema, state.ema_model, state.ema_updates)
        saved_decay = state.train_config.get("ema_decay", 0.0)
        if saved_decay != run.cfg.ema_decay:
            log.warning("--ema_decay %g on resume: the average so far was kept with %g", run.cfg.ema_decay,
                        saved_decay)
    elif run.ema is not None:
        log.info("--ema_decay %g: the checkpoint holds no average; it starts from the weights of step %d",
                 run.cfg.ema_decay, run.step + 1)
    elif state.ema_model:
        log.warning("--ema_decay 0: the checkpoint's moving average of the weights is dropped")


def _log_plan(run: Run, estimator: MemoryEstimator) -> None:
    cfg, per_step = run.cfg, run.cfg.gradient_accumulation_steps * run.dist.world
    processes = f" in each of {run.dist.world} processes" if run.dist.active else ""
    if budget_frames(cfg.max_batch_frames, cfg.max_batch_seconds) or cfg.max_memory_gb > 0:
        frames = budget_frames(cfg.max_batch_frames, cfg.max_batch_seconds)
        log.info("dynamic batches: up to %s padded frames%s, %d length buckets (--batch_size is not used)",
                 f"{frames:,}" if frames else "any number of",
                 f" and an estimated peak under {cfg.max_memory_gb:g} GiB" if cfg.max_memory_gb > 0 else "",
                 cfg.num_buckets)
        log.info("%d dynamic batches per update%s, peak lr %g, %d warm-up steps", per_step, processes, cfg.lr,
                 cfg.warmup_steps)
    else:
        log.info("%d utterances per update (batch %d x %d accumulation steps%s), peak lr %g, %d warm-up steps",
                 cfg.batch_size * per_step, cfg.batch_size, cfg.gradient_accumulation_steps,
                 f" x {run.dist.world} processes" if run.dist.active else "", cfg.lr, cfg.warmup_steps)
    if cfg.freeze_encoder_steps > run.step:
        log.info("--freeze_encoder_steps %d: the encoder is not updated until step %d", cfg.freeze_encoder_steps,
                 cfg.freeze_encoder_steps + 1)
    if run.ema is not None:
        log.info("--ema_decay %g: a moving average of the weights is kept; validation, best.pt and decoding use it",
                 cfg.ema_decay)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _loader(dataset: ASRDataset, sampler: ResumableBatchSampler | EpochKeyed, cfg: TrainConfig, device: torch.device,
            workers: Optional[int] = None) -> DataLoader:
    workers = cfg.num_workers if workers is None else workers
    if dataset.augment is not None:  # the augmentation draws need the epoch with each index
        sampler = EpochKeyed(sampler)
    # A generator of its own, so that starting an epoch's iterator (which draws the workers' seed)
    # leaves the global RNG, and with it dropout and SpecAugment, as a resumed run finds it.
    return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, num_workers=workers,
                      pin_memory=device.type == "cuda", persistent_workers=workers > 0,
                      prefetch_factor=4 if workers > 0 else None,
                      worker_init_fn=ignore_stop_signals if workers > 0 else None,
                      generator=torch.Generator().manual_seed(cfg.seed))


# ---- an epoch ---------------------------------------------------------------------------------

def train_epoch(run: Run, stop_request: StopRequest,
                on_step: Optional[Callable[[int, int, ASRModel], bool]]) -> tuple[Optional[str], bool]:
    """Train on the rest of the epoch in progress, one optimizer step per accumulation group of
    batches, until it ends or something stops the run. Returns what stopped it (None when nothing
    did) and whether the epoch ended."""
    cfg = run.cfg
    run.sampler.set_epoch(run.epoch, run.batches_done)
    run.epoch_batches = run.batches_done + len(run.sampler)
    log.info("epoch %d: %d batches, %.1f%% of their frames padding", run.epoch + 1, run.epoch_batches,
             100 * padding_fraction(run.sampler.epoch_batches(), [frames_of(u.duration) for u in run.train_utts]))
    skips_before, unreadable, stop = run.skips.total, [], None
    run.model.train()
    show_bar = cfg.progress and run.dist.is_main and sys.stderr.isatty()  # a bar in a file is only noise
    bar = _progress_bar(run.epoch_batches, run.batches_done, f"epoch {run.epoch + 1}/{cfg.epochs}", show_bar)
    micro: list[Batch] = []
    speed, epoch_speed = _Speed(), _Speed()  # since the last summary line; since the epoch (re)started
    with logging_redirect_tqdm([logging.root, log]) if show_bar else contextlib.nullcontext():  # log lines above the bar
        for batch in _timed(run.train_loader, speed, epoch_speed):
            run.batches_done += 1
            bar.update()
            maybe_empty_cache(run.device, run.batches_done, cfg.empty_cache_every)
            unreadable += [run.train_utts[i].where for i in batch.missing]
            micro.append(batch)
            # An accumulation group closes after `accum` batches, or at the end of the epoch.
            if len(micro) < cfg.gradient_accumulation_steps and run.batches_done < run.epoch_batches:
                continue
            stats = train_step(run, micro)
            micro = []
            if stats is None:  # no readable audio in the whole group, in any process
                continue
            speed.add(stats["utterances"])
            epoch_speed.add(stats.pop("utterances"))
            bar.set_postfix_str(f"loss {stats['loss']:.3g}, {speed.rate():.1f} utt/s, data {speed.wait_percent():.0f}%",
                                refresh=False)
            if run.step % cfg.log_every == 0:
                memory = {name: round(gib, 4) for name, gib in memory_status(run.device).items()}
                run.record("train", **stats, utt_per_s=speed.rate(), data_wait=round(speed.wait_percent() / 100, 4),
                           **memory)
                log.info("%s", _summary_line(run, stats, speed, memory))
                speed.restart()
            if run.skips.exceeded:  # too many non-finite updates in a row: save and stop
                save(run)
                raise TrainingDiverged(diverged_message(run.skips.in_a_row, run.step, run.out_dir,
                                                        run.scaler.is_enabled()))
            epoch_goes_on = run.batches_done < run.epoch_batches
            if cfg.validate_every_steps and run.step % cfg.validate_every_steps == 0 and epoch_goes_on:
                validate_and_save(run)  # (the epoch's end validates anyway)
            stop = _stop_after_step(run, stop_request, on_step)
            if cfg.save_every_steps and run.step % cfg.save_every_steps == 0 and run.saved_step != run.step \
                    and epoch_goes_on and stop is None:  # (the epoch's end and a stop save anyway)
                save(run)
            if stop:
                break
    bar.close()
    _log_epoch_end(run, unreadable, run.skips.total - skips_before, epoch_speed)
    if run.batches_done < run.epoch_batches:
        return stop, False
    run.epoch, run.batches_done = run.epoch + 1, 0
    return stop, True


def train_step(run: Run, micro: list[Batch]) -> Optional[dict[str, float]]:
    """One optimizer step on an accumulation group: its losses (and the learning rate, gradient
    norm and utterance count), or None when no process had audio to train on. A non-finite loss or
    gradient skips the update, counted in ``run.skips``. In the first --freeze_encoder_steps steps
    the encoder's gradients are dropped (``hold_encoder``): the norm is then the heads' alone."""
    cfg = run.cfg
    stats = forward_backward(run.forward, micro, run.device, run.precision, run.scaler, cfg.spec_augment,
                             name_of=lambda i: f"{run.train_utts[i].where} ({run.train_utts[i].duration:.1f} s)",
                             dist=run.dist, offload_activations=cfg.offload_activations)
    if stats is None:
        return None
    lr = cfg.lr * lr_factor(run.step, cfg.warmup_steps)  # a pure function of the step: nothing to resume
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    held = hold_encoder(run.model, run.step, cfg.freeze_encoder_steps)
    if not held and cfg.freeze_encoder_steps and run.step == cfg.freeze_encoder_steps:
        log.info("step %d: the encoder trains from now on (--freeze_encoder_steps %d)", run.step + 1,
                 cfg.freeze_encoder_steps)
    grad_norm = optimizer_step(run.model, run.optimizer, run.scaler, cfg.grad_clip, stats["loss"])
    run.step += 1
    finite = math.isfinite(stats["loss"]) and math.isfinite(grad_norm)
    run.skips.update(finite)
    if finite and run.ema is not None:  # a skipped update (fp16's scaler, a non-finite loss) leaves it alone
        run.ema.update_parameters(run.model)
    if not finite:
        group = [run.train_utts[i] for b in micro for i in b.indices]
        log.warning("step %d: non-finite %s, update skipped (%d in a row, %d in all%s); batch: %s", run.step,
                    "gradients" if math.isfinite(stats["loss"]) else "loss", run.skips.in_a_row, run.skips.total,
                    f"; fp16 loss scale now {run.scaler.get_scale():g}" if run.scaler.is_enabled() else "",
                    ", ".join(f"{u.where} ({u.audio_path.name})" for u in group))
    return {**stats, "lr": lr, "grad_norm": grad_norm}


def _stop_after_step(run: Run, stop_request: StopRequest,
                     on_step: Optional[Callable[[int, int, ASRModel], bool]]) -> Optional[str]:
    """The one stop check, after each step: --max_steps, ``on_step``, a signal or the time budget.
    Every process of a data-parallel run comes to the same answer at the same step."""
    if 0 < run.cfg.max_steps <= run.step:
        return "max_steps"
    asked = on_step is not None and on_step(run.step, run.epoch, run.model)
    signal = stop_request.reason()
    code = run.dist.max(2.0 + SIGNAL_STOPS.index(signal) if signal else float(asked))
    return None if code == 0 else "on_step" if code == 1 else SIGNAL_STOPS[int(code) - 2]


def end_epoch(run: Run, stop: Optional[str], stop_request: StopRequest) -> Optional[str]:
    """Validate, and save the epoch's checkpoint once, with the metrics. A signal or the time
    budget skips the validation (the run saves and stops; the next one validates later). Returns
    what stops the run, if anything."""
    if stop not in SIGNAL_STOPS and (signal := _agreed_signal(run, stop_request)):
        stop = signal
    if stop in SIGNAL_STOPS:
        save(run)
        return stop
    _validate_and_save_epoch(run)
    if stop is None and run.epoch < run.cfg.epochs:  # a stop asked for during validation
        stop = _agreed_signal(run, stop_request)
    return stop


def _validate_and_save_epoch(run: Run) -> None:
    """``validate_and_save``; should validation fail (or a second Ctrl-C come), the epoch is saved
    without its metrics before the error goes on, so that it costs no training. Only in a run of
    one process: in a data-parallel run the others may not come to the save, which would wait for
    them."""
    try:
        validate_and_save(run)
    except (Exception, KeyboardInterrupt):
        if run.saved_step != run.step and not run.dist.active:
            try:
                save(run, quiet=True)
                log.warning("validation at the end of epoch %d failed; the epoch is saved in %s", run.epoch,
                            run.out_dir / step_checkpoint_name(run.step))
            except Exception as e:  # noqa: BLE001 (the first error is the one to report)
                log.warning("could not save the epoch after validation failed: %s", e)
        raise


def stop_inside_epoch(run: Run, stop: Optional[str]) -> Optional[str]:
    """The run stops inside an epoch: at --max_steps with a score (and a current best.pt), else
    with a checkpoint at this step."""
    if stop == "max_steps" and run.valid_step != run.step:
        validate_and_save(run)
    elif stop == "on_step":
        log.info("stopped at step %d in epoch %d", run.step, run.epoch + 1)
    if run.saved_step != run.step:
        save(run)
    return stop


def _agreed_signal(run: Run, stop_request: StopRequest) -> Optional[str]:
    signal = stop_request.reason()
    code = run.dist.max(1.0 + SIGNAL_STOPS.index(signal) if signal else 0.0)
    return SIGNAL_STOPS[int(code) - 1] if code else None


def finish(run: Run, stop: Optional[str]) -> dict[str, Any]:
    stopped_by = stop if stop in SIGNAL_STOPS else None
    if stopped_by is not None:
        log.warning("stopped by %s at step %d (epoch %d, batch %d), saved in %s; to go on, run the same command "
                    "with --resume latest", stopped_by, run.step, run.epoch + 1, run.batches_done,
                    run.out_dir / "latest.pt")
    return {"step": run.step, "epoch": run.epoch, "valid": run.valid_metrics, "best_wer": run.best_wer,
            "stopped_by": stopped_by, "skipped_updates": run.skips.total, "unreadable_files": run.unreadable}


def validate_and_save(run: Run) -> None:
    """Validate at this step (the EMA weights with --ema_decay), record the metrics, save (best.pt too
    when they improved: the lowest WER, then the lowest CER, as early on every WER is 100%), redraw
    curves.png. Draws nothing from the global RNG, so a resumed run goes on exactly as it would have."""
    weights = run.model if run.ema is None else run.ema.module
    metrics = validate(weights, run.valid_loader, run.tokenizer, run.valid_utts, run.device, run.precision,
                       Dist() if is_sharded(run.model) else run.dist)  # sharded: each process saw all
    run.valid_metrics, run.valid_step = metrics, run.step
    run.record("valid", **metrics, **({"ema_decay": run.cfg.ema_decay} if run.ema is not None else {}))
    is_best = (metrics["wer"], metrics["cer"]) < (run.best_wer, run.best_cer)
    if is_best:
        run.best_wer, run.best_cer = metrics["wer"], metrics["cer"]
    epochs_done = run.batches_done == 0
    where = f"epoch {run.epoch}" if epochs_done else \
        f"epoch {run.epoch + 1}, {100 * run.batches_done / max(run.epoch_batches, 1):.0f}%"
    log.info("step %d (%s): valid loss %.3f  CER %.2f%%  WER %.2f%%%s%s", run.step, where, metrics["loss"],
             100 * metrics["cer"], 100 * metrics["wer"], "  (EMA weights)" if run.ema is not None else "",
             "  (best)" if is_best else "")
    save(run, is_best)
    if run.draw_curves:  # after the save: nothing that goes wrong in drawing costs the checkpoint
        _redraw_curves(run.out_dir)


def _redraw_curves(out_dir: Path) -> None:
    """curves.png from metrics.jsonl. A picture is not worth a run: any failure is a warning."""
    try:
        write_curves(out_dir)
    except Exception as e:  # noqa: BLE001 (a full disk, a broken matplotlib install, a font cache...)
        log.warning("could not draw %s: %s: %s", out_dir / CURVES, type(e).__name__, e)


def save(run: Run, is_best: bool = False, quiet: bool = False) -> None:
    """Write the run's ``TrainState`` as this step's checkpoint and point latest.pt (and best.pt)
    at it; keep the newest --keep_checkpoints. Every process takes part (their random states go
    into the checkpoint); rank 0 writes."""
    rng = run.dist.gather(capture_rng())
    model_state, optimizer_state = full_state_dicts(run.model, run.optimizer)  # sharded: gathered
    run.saved_step = run.step
    if not run.dist.is_main:
        return
    ema_model, ema_updates = ema_state(run.ema) if run.ema is not None else ({}, 0)
    state = TrainState(
        model_config=dataclasses.asdict(run.model.cfg), train_config=dataclasses.asdict(run.cfg),
        tokenizer=run.tokenizer.model_proto, model=model_state, optimizer=optimizer_state,
        scaler=run.scaler.state_dict(), step=run.step, epoch=run.epoch, batches_done=run.batches_done,
        processes=run.dist.world, rng=rng,
        best_wer=run.best_wer, best_cer=run.best_cer, valid_metrics=run.valid_metrics, valid_step=run.valid_step,
        ema_model=ema_model, ema_updates=ema_updates)
    path = save_step(run.out_dir, run.step, state.save, is_best, run.cfg.keep_checkpoints)
    if not quiet:
        log.info("saved %s%s", path, " (best so far: also best.pt)" if is_best else "")


# ---- the step's parts (benchmarks and tests call them too) ------------------------------------



def maybe_empty_cache(device: torch.device, batches_done: int, every: int) -> bool:
    """Release cached CUDA blocks every ``every`` batches, against fragmentation over long runs.
    A no-op elsewhere. Returns whether the cache was emptied."""
    if device.type != "cuda" or every <= 0 or batches_done % every:
        return False
    torch.cuda.empty_cache()
    return True


def forward_backward(model: Callable[..., Any], micro_batches: list[Batch], device: torch.device,
                     precision: Precision, scaler: torch.amp.GradScaler, spec_augment: bool,
                     name_of: Optional[Callable[[int], str]] = None, dist: Dist = Dist(),
                     offload_activations: bool = False) -> Optional[dict[str, float]]:
    """Accumulate gradients over ``micro_batches``, normalized by their total utterance count (over
    every process of a data-parallel run), so that the update equals the one from a single batch
    holding all of them. Returns the mean losses and the utterance count; None when no process had
    an utterance (the batches' audio could not be read).

    A micro-batch that runs out of memory is split in halves and retried; the normalization by
    the group's utterance count keeps the update as it would have been. An error in the forward
    pass leaves the gradients alone; one in the backward pass may have added part of them, so the
    gradients are cleared and the group starts again. Only a single utterance that does not fit
    stops training (``BatchDoesNotFit``; ``name_of`` turns its index into a name for the message),
    and so does an error in a data-parallel run's synchronizing backward pass (the last one), which
    the other processes are waiting in. ``offload_activations`` keeps what the backward pass needs
    in (pinned, on CUDA) CPU memory until then.
    """
    pending = [b for b in micro_batches if len(b)]
    n_utts = dist.sum([sum(len(b) for b in pending)])[0]
    if n_utts == 0:
        return None
    if not pending:  # this process has nothing, the others have: join their gradient sync with zeros
        pending = [_empty_batch(model)]
    per_process = n_utts / dist.world  # data parallelism averages the processes' gradients
    done: list[Batch] = []
    sums = {"loss": 0.0, "ctc": 0.0, "attention": 0.0}
    while pending:
        batch = pending.pop(0)
        in_backward = False
        try:
            dev_batch = batch.to(device)
            with precision.autocast(device), _saved_on_cpu(offload_activations, device):
                out = model(dev_batch.feats, dev_batch.feat_lens, dev_batch.tokens, dev_batch.token_lens,
                            spec_augment=spec_augment)
            in_backward = True
            with no_sync(model, skip=bool(pending)):  # gradients sync on the group's last backward pass
                scaler.scale(out.loss / per_process if len(batch.indices) else out.loss * 0.0).backward()
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if not is_out_of_memory(e) or (dist.active and in_backward and not pending):
                raise
            failed = str(e)  # not the error itself: its traceback holds the failed attempt's tensors
        else:
            if len(batch.indices):
                for name, value in out._asdict().items():
                    sums[name] += value.item()
                done.append(batch)
            continue
        dev_batch = out = None  # noqa: F841 (release the failed attempt's tensors before retrying)
        free_memory(device)
        pending, done, sums = _after_out_of_memory(model, batch, pending, done, sums, in_backward, failed, device,
                                                   name_of)
    totals = dist.sum(list(sums.values()))
    return {**{name: value / n_utts for name, value in zip(sums, totals)}, "utterances": n_utts}


def _after_out_of_memory(model: Any, batch: Batch, pending: list[Batch], done: list[Batch], sums: dict[str, float],
                         in_backward: bool, failed: str, device: torch.device,
                         name_of: Optional[Callable[[int], str]]) -> tuple[list[Batch], list[Batch], dict[str, float]]:
    """The micro-batches left to run after ``batch`` ran out of memory: its halves, and the whole
    group again when the error came in the backward pass (its gradients are cleared)."""
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
        return done + halves + pending, [], dict.fromkeys(sums, 0.0)
    return halves + pending, done, sums


def _saved_on_cpu(offload: bool, device: torch.device) -> Any:
    if not offload:
        return contextlib.nullcontext()
    return torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda")


def _empty_batch(model: Any) -> Batch:
    """A one-utterance batch of silence that stands in, with its loss multiplied by 0, for a
    process whose whole accumulation group failed to load (``indices`` is empty: it counts for nothing)."""
    cfg = getattr(model, "module", model).cfg
    return Batch(torch.zeros(1, 101, cfg.n_mels), torch.tensor([101]), torch.full((1, 1), 3), torch.tensor([1]), [])


def optimizer_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                   grad_clip: float, loss: float = 0.0) -> float:
    """Unscale, clip, step, update the scale, zero the gradients. Returns the gradient norm.

    A non-finite gradient norm or ``loss`` skips the update in every precision (with fp16 the
    GradScaler then also lowers its scale); the caller tells a skip by the returned norm and the loss.
    """
    scaler.unscale_(optimizer)
    params = [p for p in model.parameters() if p.grad is not None]
    max_norm = grad_clip if grad_clip > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)  # sharded: DTensor
    if math.isfinite(grad_norm) and math.isfinite(loss):
        scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


@torch.no_grad()
def validate(model: ASRModel, loader: Iterable[Batch], tokenizer: Tokenizer, utterances: list[Utterance],
             device: torch.device, precision: Precision, dist: Dist = Dist()) -> dict[str, float]:
    """Loss per utterance, and CER/WER of greedy CTC, in eval mode; over the shares of every process."""
    model.eval()
    loss_sum, n, refs, hyps = 0.0, 0, [], []
    for batch in loader:
        if not len(batch):
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
    loss_sum, n = dist.sum([loss_sum, n])
    pairs = [pair for share in dist.gather(list(zip(refs, hyps))) for pair in share]
    return {"loss": loss_sum / max(n, 1), **error_rates([r for r, _ in pairs], [h for _, h in pairs])}


# ---- what a run prints -------------------------------------------------------------------------

class _Speed:
    """Utterances a second, and the share of the time spent waiting for the data loader, since
    ``restart``."""

    def __init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        self.utterances, self.waited, self.start = 0.0, 0.0, time.perf_counter()

    def add(self, utterances: float) -> None:
        self.utterances += utterances

    def wait(self, seconds: float) -> None:
        self.waited += seconds

    def rate(self) -> float:
        return self.utterances / max(time.perf_counter() - self.start, 1e-9)

    def wait_percent(self) -> float:
        return 100 * self.waited / max(time.perf_counter() - self.start, 1e-9)


def _timed(batches: Iterable[Batch], *speeds: _Speed) -> Iterator[Batch]:
    """The loader's batches, each one's wait (the time ``next`` took) added to ``speeds``."""
    it = iter(batches)
    while True:
        start = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            return
        for speed in speeds:
            speed.wait(time.perf_counter() - start)
        yield batch


def _log_epoch_end(run: Run, unreadable: list[str], skipped: int, speed: _Speed) -> None:
    run.unreadable += len(unreadable)
    log.info("epoch %d: %.1f utt/s, %.1f%% of the time waiting for data", run.epoch + 1, speed.rate(),
             speed.wait_percent())
    if unreadable:
        log.warning("epoch %d: %d audio files could not be read and were left out: %s%s", run.epoch + 1,
                    len(unreadable), ", ".join(unreadable[:10]), " ..." if len(unreadable) > 10 else "")
    if skipped:
        log.warning("epoch %d: %d updates skipped for a non-finite loss or gradients", run.epoch + 1, skipped)
    log.info("epoch %d memory (GiB): %s", run.epoch + 1,
             ", ".join(f"{k[:-3]} {v:.2f}" for k, v in memory_status(run.device).items()))


def _progress_bar(total: int, done: int, desc: str, show: bool) -> tqdm:
    """An epoch's bar that fits 80 columns: count, times, loss and speed (the summary lines carry the rest)."""
    return tqdm(total=total, initial=done, desc=desc, disable=not show, leave=False, mininterval=1.0,
                ncols=min(80, shutil.get_terminal_size().columns),
                bar_format="{desc} {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}] {postfix}")


def _summary_line(run: Run, stats: dict[str, float], speed: _Speed, memory: dict[str, float]) -> str:
    """The --log_every line: where the run is, the losses, lr, gradient norm, speed and memory
    (``memory_status``: in use now, then the peak)."""
    now, peak = list(memory.values())[:2]
    return (f"step {run.step} (epoch {run.epoch + 1}, {100 * run.batches_done / run.epoch_batches:.0f}%): "
            f"loss {stats['loss']:.3f} (ctc {stats['ctc']:.3f}, attention {stats['attention']:.3f}), "
            f"lr {stats['lr']:.2e}, grad norm {stats['grad_norm']:.2f}, {speed.rate():.1f} utt/s "
            f"(data wait {speed.wait_percent():.0f}%), "
            f"memory {now:.2f} GiB (peak {peak:.2f})")
