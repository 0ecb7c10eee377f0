"""What a run holds while it runs (``Run``) and how it starts: from the flags, or resumed from its
checkpoint's ``TrainState`` (the resume policy: what a resumed run takes from the checkpoint and
what from the flags), with the data loaded and checked, the model built, and the plan logged."""
from __future__ import annotations

import dataclasses
import functools
import logging
import logging.handlers
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
from torch.optim.swa_utils import AveragedModel
from torch.utils.data import DataLoader

from ..checkpoint import (
    CONFIG_FILE,
    LATEST_FILE,
    METRICS_FILE,
    TOKENIZER_FILE,
    InferenceModel,
    TrainState,
    write_file_atomic,
)
from ..config import (
    AugmentConfig,
    ConfigError,
    MixEntry,
    ModelConfig,
    TrainConfig,
    kept_settings,
    parse_mix,
)
from ..config_file import write_config_file
from ..data.augment import Augmenter, batching_duration
from ..data.dataset import (
    ASRDataset,
    Utterance,
    cmvn_of,
    collate,
    compute_cmvn,
    load_utterances,
    log_skipped,
)
from ..data.features import KaldiFbank, LogMel, make_frontend, mel_bins_problem
from ..data.frames import budget_frames, frames_of, padded_frames, subsampled_lengths
from ..data.manifest import ManifestError, read_manifest, refuse_pseudo_labels
from ..data.samplers import (
    EpochKeyed,
    LengthGroupedBatchSampler,
    ResumableBatchSampler,
    ShardedSampler,
    select_samples,
    train_sampler,
)
from ..data.shards import (
    ShardPlan,
    ShardSet,
    ShardStream,
    ShardUtterances,
    open_shards,
    shard_waveforms,
    texts_of,
)
from ..data.tokenizer import Tokenizer, train_tokenizer
from ..model.asr import ASRModel, count_parameters
from .compile import compiled
from .curves import CURVES, have_matplotlib
from .distributed import (
    Dist,
    is_sharded,
    load_optimizer_state,
    wrap_data_parallel,
)
from .ema import load_ema_state, make_ema
from .finetune import keep_init_cmvn, load_init_checkpoint, load_init_weights
from .memory import (
    GIB,
    MemoryEstimator,
    ModelDoesNotFit,
    auto_batch_frames,
    check_model_fits,
    largest_fitting,
    precision_name,
)
from .metrics_log import MetricsLog
from .objective import Objective
from .optim import build_optimizer, canonical_optimizer, scheduled_lr
from .precision import Precision, resolve_precision
from .run_files import load_resume_checkpoint, remove_stale_temporaries
from .signals import NonFiniteSkips, ignore_stop_signals, stop_workers
from .state import restore_rng
from .tensorboard_log import TensorBoardLog, open_tensorboard

__all__ = ["FILL_FRACTION", "Origin", "Run", "gpu_batches", "setup_run", "starting_point"]

log = logging.getLogger("konkanivani")

# A pretraining run's tokenizer (the run folder's like any other's): it reads no text, so one
# character; a fine-tune of its encoder brings its own.
PRETRAIN_TEXT = "a"


@dataclass
class Run:
    """What a training run holds while it runs: its parts, which ``setup_run`` makes and nothing
    replaces after it (the settings in effect among them: ``cfg``), and its progress, which the loop
    moves on (saved as ``TrainState``, with this process's own bookkeeping beside it)."""

    # ---- the parts
    cfg: TrainConfig  # the settings in effect: the flags, a resumed run's kept ones, as resolved
    out_dir: Path
    dist: Dist
    device: torch.device
    precision: Precision
    tokenizer: Tokenizer
    model: ASRModel
    forward: Callable[..., Any]  # the model's forward: data-parallel and/or compiled where asked
    objective: Objective  # the loss terms, their weights and ramps, SpecAugment
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    train_utts: Sequence[Utterance]  # a manifest's, or a shard set's (ShardUtterances)
    valid_utts: list[Utterance]
    sampler: ResumableBatchSampler
    train_loader: DataLoader
    valid_loader: DataLoader
    metrics: MetricsLog
    skips: NonFiniteSkips
    frontend: LogMel | KaldiFbank  # the batches' features, computed in the step on the device
    ema: Optional[AveragedModel] = None  # the moving average of the weights (--ema_decay)
    mix: Optional["Mix"] = None  # --train_mix's sets: which one each training utterance is of
    draw_curves: bool = False  # redraw curves.png after each validation (rank 0, with matplotlib)
    # the metrics rows again, for TensorBoard (opened once a resumed run's step is known)
    board: TensorBoardLog = field(default_factory=TensorBoardLog)
    # seconds of training before this process took over (TrainState.train_seconds)
    elapsed_before: float = 0.0
    # when this process's part of the run began
    started: float = field(default_factory=time.monotonic)
    # ---- the progress, saved
    step: int = 0
    epoch: int = 0  # epochs finished
    batches_done: int = 0  # batches of the epoch in progress, per process
    best_wer: float = math.inf
    best_cer: float = math.inf
    valid_metrics: dict[str, float] = field(default_factory=dict)
    valid_step: int = -1
    # ---- this process's bookkeeping
    epoch_batches: int = 0  # batches in the whole epoch in progress, per process
    saved_step: int = -1
    unreadable: int = 0  # audio files that failed to load in training, all epochs
    # updates whose skip flags are still on the device: (step, skipped, loss finite, utterances);
    # read together where a step needs them (loop.settle), so that a step does not wait for the GPU
    unsettled: list[tuple[int, torch.Tensor, torch.Tensor, list[int]]] = field(default_factory=list)

    def elapsed(self) -> float:
        """Seconds of training so far, over every process that ran this run (resumes included, the
        time between a kill and its resume not)."""
        return self.elapsed_before + time.monotonic() - self.started

    def close(self) -> None:
        """End the data workers and the TensorBoard writer, however the run ended."""
        for loader in (self.train_loader, self.valid_loader):
            stop_workers(loader)
        self.board.close()

    def record(self, kind: str, **values: float) -> None:
        """A metrics row, in metrics.jsonl and TensorBoard. Each carries the 1-based epoch its step
        belongs to: the one in progress, or the one that just ended for an epoch-end validation."""
        if self.dist.is_main:
            # time to a figure: sweeps compare runs by it
            values = {**values, "elapsed_s": round(self.elapsed(), 2)}
            epoch = self.epoch + 1 if self.batches_done else self.epoch
            self.metrics.write(kind, self.step, epoch, **values)
            self.board.write(kind, self.step, **values)


@dataclass
class Origin:
    """Where a run starts: the checkpoint --resume names (``state``, called ``source`` in the log),
    or a fresh run's --init_from checkpoint (``init``); neither for a run from scratch."""

    state: Optional[TrainState] = None
    source: str = ""
    init: Optional[InferenceModel] = None

    @property
    def model_config(self) -> Optional[dict[str, Any]]:
        """The stored model config the run's model starts from (None: --preset's)."""
        if self.state is not None:
            return self.state.model_config
        return None if self.init is None else self.init.model_config


def starting_point(cfg: TrainConfig) -> Origin:
    """The checkpoint a run starts from, loaded once: --resume's, as a ``TrainState``; for a fresh
    run, --init_from's (``ConfigError`` naming it when it is unusable)."""
    if not cfg.resume:
        return Origin(init=load_init_checkpoint(cfg.init_from) if cfg.init_from else None)
    checkpoint, path = load_resume_checkpoint(cfg.resume, cfg.output_dir)
    if cfg.init_from:  # the run's own checkpoint already started from it
        log.info("--init_from %s not applied: the run resumes from its own checkpoint",
                 cfg.init_from)
    named = cfg.resume if cfg.resume != "latest" or path.name == LATEST_FILE else str(path)
    return Origin(TrainState.from_checkpoint(checkpoint, path), named)


def setup_run(cfg: TrainConfig, model_cfg: ModelConfig, origin: Origin, dist: Dist,
              device: torch.device, start: Callable[[], None] = lambda: None) -> Run:
    """A fresh run from the flags, or the one ``--resume`` names continued from its checkpoint
    (``origin``), with the model ``train`` resolved (``model_cfg``; its vocabulary is the
    tokenizer's). Nothing is written to the output directory until the data is known usable; then
    ``start`` (``run_files.run_directory``) makes the directory this run's."""
    _seed_everything(cfg.seed)  # the same initial weights in every process
    _check_frontend(model_cfg)
    # configs: the settings a resumed run keeps from its checkpoint, the tokenizer, the precision
    cfg, tokenizer, samples_grew = _configs(cfg, origin.state, dist)
    model_cfg = dataclasses.replace(model_cfg, vocab_size=tokenizer.vocab_size)
    # (a CPU's bf16 speed is measured here, with random matrices: before the weights are drawn)
    precision = resolve_precision(device, cfg.mixed_precision, cfg.precision)
    # data: the utterances, checked usable before the output directory becomes this run's
    data = _data(cfg, tokenizer)
    _check_fits(cfg, model_cfg, precision, data, dist, device)
    objective = _objective(cfg, model_cfg)
    _claim_directory(start, Path(cfg.output_dir), dist, tokenizer if origin.state is None else None)
    # model: resumed, or fresh with the data's CMVN and the --init_from weights that fit
    model = _build_model(cfg, model_cfg, data, origin, tokenizer, device)
    if dist.active:
        _seed_everything(cfg.seed + dist.rank)  # dropout and SpecAugment differ between processes
    # forward and optimizer: the model data-parallel under torchrun (FSDP shards it in place,
    # before the optimizer takes its parameters), its optimizer, then the forward compiled
    forward = wrap_data_parallel(model, dist, device, cfg.strategy)
    optimizer, optimizer_name = _optimizer(cfg, model, precision, dist, device)
    forward = compiled(forward) if cfg.compile else forward
    # settings: those in effect, resolved once (the optimizer, batches, LR, warm-up, accumulation)
    cfg, fits = _settings(cfg, optimizer_name, model_cfg, data,
                          (model, forward, precision, objective), origin.state, dist, device)
    # batches and loaders: the samplers, and the data workers of training and validation. The
    # first micro-batch of the second step is the peak (optimizer states exist from then on); a
    # resumed run keeps the count its first epoch was planned with.
    accum_then = (origin.state.train_config["gradient_accumulation_steps"] if origin.state
                  else cfg.gradient_accumulation_steps)
    samplers = (_train_sampler(cfg, data, fits, accum_then, dist),
                _valid_sampler(cfg, data, model, dist))
    train_loader, valid_loader = _loaders(cfg, data, samplers, tokenizer, device)
    out_dir = Path(cfg.output_dir)
    run = Run(cfg=cfg, out_dir=out_dir, dist=dist, device=device, precision=precision,
              tokenizer=tokenizer, model=model, forward=forward, objective=objective,
              optimizer=optimizer,
              scaler=torch.amp.GradScaler(device.type, enabled=precision.use_scaler),
              train_utts=data.train, valid_utts=data.valid, sampler=samplers[0],
              train_loader=train_loader, valid_loader=valid_loader,
              metrics=MetricsLog(out_dir / METRICS_FILE),
              skips=NonFiniteSkips(cfg.max_consecutive_skips),
              frontend=make_frontend(model_cfg.frontend, model_cfg.n_mels).to(device),
              # of the unwrapped model: the DDP or compiled forward shares its parameters
              ema=make_ema(model, cfg.ema_decay) if cfg.ema_decay else None, mix=data.mix,
              draw_curves=dist.is_main and _can_draw_curves(out_dir),
              elapsed_before=origin.state.train_seconds if origin.state else 0.0)
    _begin(run, origin, model_cfg, samples_grew)
    return run


def _check_fits(cfg: TrainConfig, model_cfg: ModelConfig, precision: Precision, data: "_Data",
                dist: Dist, device: torch.device) -> None:
    """The model sized before any of it is built or the directory claimed: one that cannot fit
    even one utterance of the longest it trains on is refused (``ModelDoesNotFit``), as rank 0
    decides for every process. Not with --strategy fsdp or --offload_activations, whose weights
    or activations live elsewhere than the estimate counts them."""
    if cfg.strategy == "fsdp" or cfg.offload_activations:
        return
    refusal = None
    if dist.is_main:
        longest = min(max(data.durations), batching_duration(cfg.max_duration, cfg.speed_perturb))
        try:
            check_model_fits(MemoryEstimator(model_cfg, precision_name(precision), cfg.optimizer,
                                             cfg.gradient_checkpointing, device),
                             padded_frames(frames_of(longest), cfg.pad_to_frames), device,
                             cfg.max_memory_gb, dist.world)
        except ModelDoesNotFit as e:
            refusal = str(e)
    if (refusal := dist.gather(refusal)[0]) is not None:
        raise ModelDoesNotFit(refusal)


def _check_frontend(model_cfg: ModelConfig) -> None:
    """``ConfigError`` for mel bins beyond what the model's front-end computes; a warning for bins
    some of whose filters hold no frequency."""
    refusal, warning = mel_bins_problem(model_cfg.frontend, model_cfg.n_mels)
    if refusal:
        raise ConfigError(refusal)
    if warning:
        log.warning("%s", warning)


# ---- configs ----------------------------------------------------------------------------------

def _configs(cfg: TrainConfig, state: Optional[TrainState], dist: Dist
             ) -> tuple[TrainConfig, Tokenizer, bool]:
    """The settings and the tokenizer the run goes on with, and whether its training set grew: a
    fresh run's flags and --tokenizer (or one trained, ``_fresh_tokenizer``); for a resumed run,
    the checkpoint's tokenizer and what ``_kept_on_resume`` keeps."""
    if state is None:
        return cfg, _fresh_tokenizer(cfg, dist), False
    changed, grows = _kept_on_resume(cfg, state)
    cfg = dataclasses.replace(cfg, **changed)
    if not (cfg.train_manifest or cfg.train_shards or cfg.train_mix):  # --train_mix is kept
        raise ConfigError("on resume the run trains on its checkpoint's --train_mix (none: it "
                          "trained on one manifest); give its --train_manifest")
    return cfg, Tokenizer(state.tokenizer), grows


def _kept_on_resume(cfg: TrainConfig, state: TrainState) -> tuple[dict[str, Any], bool]:
    """The one place that decides what a resumed run takes from its checkpoint (the model's shape
    aside, which ``config.resolve_model_config`` takes): the settings that fix the data order, the
    optimizer (its state fits no other), and --max_samples unless the new one is larger. Returns
    the settings changed back and whether the training set grew."""
    # A format-2 checkpoint written before a setting existed (speed_perturb, shuffle_buffer,
    # pseudo_weight, ...) lacks it, and ran with its default: a resumed run goes on with that.
    saved = {**dataclasses.asdict(TrainConfig()), **state.train_config}
    changed = kept_settings(cfg, saved)  # the fields that decide which batches remain in the epoch
    if canonical_optimizer(cfg.optimizer) != canonical_optimizer(saved["optimizer"]):
        log.warning("on resume, --optimizer %s as in the checkpoint (its optimizer state is for "
                    "that optimizer)", saved["optimizer"])
        changed["optimizer"] = saved["optimizer"]
    old, new = saved["max_samples"], cfg.max_samples
    grows = old > 0 and (new <= 0 or new > old)
    if new != old and not grows:
        log.warning("on resume, --max_samples %d as in the checkpoint (it may grow, not shrink)",
                    old)
        changed["max_samples"] = old
    shown = {k: v for k, v in changed.items() if k not in ("optimizer", "max_samples")}
    if shown:
        log.warning("on resume, %s as in the checkpoint (they decide which batches remain in the "
                    "epoch)", ", ".join(f"--{k} {v}" for k, v in shown.items()))
    if cfg.train_shards and max(1, cfg.num_workers) != max(1, saved["num_workers"]):
        log.warning("on resume, --num_workers %d as in the checkpoint (the shards' batches are "
                    "planned for that many readers)", saved["num_workers"])
        changed["num_workers"] = saved["num_workers"]
    return changed, grows


def _fresh_tokenizer(cfg: TrainConfig, dist: Dist) -> Tokenizer:
    """--tokenizer, or one trained on the training manifest's text by rank 0 and handed to the
    other processes (in memory: ``setup_run`` writes tokenizer.model once the data is usable)."""
    if cfg.tokenizer:
        return Tokenizer.load(cfg.tokenizer)
    if cfg.pretrain:  # no text is read: the run's heads that need a vocabulary are not trained
        return train_tokenizer([PRETRAIN_TEXT], model_type="char")
    proto = None
    if dist.is_main:
        source = cfg.train_shards or cfg.train_manifest or cfg.train_mix
        if cfg.train_mix:  # one tokenizer over every set's text, so that their scripts share it
            texts = [row.get("text") for entry in parse_mix(cfg.train_mix)
                     for _, row in read_manifest(entry.path)]
        elif cfg.train_shards:
            if (text_file := texts_of(cfg.train_shards)) is None:
                raise ConfigError(f"--train_shards {cfg.train_shards}: no text.txt beside the "
                                  "shards to train a tokenizer on; give --tokenizer")
            texts = text_file.read_text(encoding="utf-8").splitlines()
        else:
            texts = [row.get("text") for _, row in read_manifest(cfg.train_manifest)]
        try:
            proto = train_tokenizer([t for t in texts if isinstance(t, str)], cfg.vocab_size,
                                    cfg.tokenizer_type).model_proto
        except ValueError as e:
            raise ConfigError(f"{source}: {e}") from e
    return Tokenizer(dist.gather(proto)[0])


# ---- data -------------------------------------------------------------------------------------

@dataclass
class _Data:
    """The utterances a run trains and validates on."""

    train: Sequence[Utterance]  # a manifest's, or a shard set's (ShardUtterances)
    valid: list[Utterance]
    shards: Optional[ShardSet]
    augmenter: Optional[Augmenter]
    durations: list[float]  # each training utterance's, as long as speed perturbation may make it
    pseudo_augmenter: Optional[Augmenter] = None  # the noisy student's, of pseudo-labelled ones
    mix: Optional["Mix"] = None


@dataclass
class Mix:
    """The training sets of --train_mix, and each utterance's set (an index into them)."""

    entries: list[MixEntry]
    sources: list[int]

    @property
    def weights(self) -> list[float]:
        return [e.weight for e in self.entries]

    def shares(self, batches: Sequence[Sequence[int]], durations: Sequence[float]) -> str:
        """How much of each set ``batches`` hold: utterances, hours and share, in one line."""
        counts, seconds = [0] * len(self.entries), [0.0] * len(self.entries)
        for batch in batches:
            for i in batch:
                counts[self.sources[i]] += 1
                seconds[self.sources[i]] += durations[i]
        total = max(1, sum(counts))
        return ", ".join(f"{e.name} {n} ({100 * n / total:.1f}%, {s / 3600:.2f} h; weight "
                         f"{e.weight:g})" for e, n, s in zip(self.entries, counts, seconds))


def _data(cfg: TrainConfig, tokenizer: Tokenizer) -> _Data:
    """The run's utterances (``_load_data``) and its augmentations; ``ConfigError`` or
    ``ManifestError`` when they cannot be used."""
    # It lists --noise_dir / --rir_dir: a bad folder stops the run before any work.
    augmenter = _augmenter(cfg)
    train_utts, valid_utts, shards, mix = _load_data(cfg, tokenizer)
    durations = [batching_duration(d, cfg.speed_perturb)  # as long as they may get
                 for d in (shards.durations() if shards else (u.duration for u in train_utts))]
    return _Data(train_utts, valid_utts, shards, augmenter, durations, _pseudo_augmenter(cfg),
                 mix)


def _pseudo_augmenter(cfg: TrainConfig) -> Optional[Augmenter]:
    """The noisy student's noise on pseudo-labelled utterances (--pseudo_noise_prob), drawn in
    streams of its own (``pseudo/...``): the other augmentations draw as they would without it."""
    if not (cfg.pseudo_manifest and cfg.pseudo_noise_prob):
        return None
    augmenter = Augmenter(AugmentConfig(
        seed=cfg.seed, noise_prob=cfg.pseudo_noise_prob, noise_snr_low_db=cfg.noise_snr_low_db,
        noise_snr_high_db=cfg.noise_snr_high_db, noise_dir=cfg.noise_dir), streams="pseudo/")
    log.info("augmentation of pseudo-labelled utterances (noisy student): %s",
             augmenter.describe())
    return augmenter


def _pseudo_utterances(cfg: TrainConfig, tokenizer: Tokenizer) -> list[Utterance]:
    """The usable rows of --pseudo_manifest, marked pseudo-labelled, as often as --pseudo_weight
    says: each whole time, then a seeded choice of the fraction left (the same every epoch, so the
    batches of a resumed epoch are the unbroken one's). A row whose label is empty or is too
    short for CTC (``manifest.ctc_frames_needed``) is dropped and counted, as any manifest's; a
    label too short for its duration is konkanivani-pseudolabel's to drop
    (--min_chars_per_second)."""
    utts, skipped = load_utterances(cfg.pseudo_manifest, tokenizer, cfg.max_duration,
                                    cfg.duration_tolerance)
    log_skipped("pseudo-labelled", cfg.pseudo_manifest, len(utts), skipped)
    utts = [dataclasses.replace(u, pseudo=True) for u in utts]
    whole, fraction = divmod(cfg.pseudo_weight, 1.0)
    share = round(fraction * len(utts))
    chosen = select_samples(len(utts), share, cfg.seed) if share else []
    weighted = utts * int(whole) + [utts[i] for i in chosen]
    log.info("--pseudo_manifest: %d pseudo-labelled utterances an epoch (--pseudo_weight %g of "
             "%d) beside the transcribed ones", len(weighted), cfg.pseudo_weight, len(utts))
    return weighted


def _augmenter(cfg: TrainConfig) -> Optional[Augmenter]:
    """The training augmentations the flags ask for (logged once), or None when none is on."""
    if not cfg.augments:
        return None
    augmenter = Augmenter(cfg)  # a TrainConfig is an AugmentConfig
    log.info("augmentation of training utterances: %s", augmenter.describe())
    return augmenter


def _load_data(cfg: TrainConfig, tokenizer: Tokenizer
               ) -> tuple[Sequence[Utterance], list[Utterance], Optional[ShardSet], Optional[Mix]]:
    """The training utterances (of a manifest, of --train_mix's, or of the shards), the validation
    ones, the shard set and the mix."""
    refuse_pseudo_labels(cfg.valid_manifest, "--valid_manifest")  # before any work
    shards, mix = None, None
    text = None if cfg.pretrain else tokenizer  # pretraining reads the audio alone
    if cfg.train_mix:
        if cfg.train_manifest:
            log.info("--train_mix: --train_manifest %s is not used", cfg.train_manifest)
        train_utts, mix = _mixed_utterances(cfg, tokenizer)
    elif cfg.train_shards:
        if cfg.train_manifest:
            log.info("--train_shards %s: --train_manifest %s is not used", cfg.train_shards,
                     cfg.train_manifest)
        shards = open_shards(cfg.train_shards)
        train_utts: Sequence[Utterance] = ShardUtterances(shards)
        longer = sum(d > cfg.max_duration for d in shards.durations())
        left_out = f"; {longer} longer than --max_duration {cfg.max_duration:g} s left out"
        log.info("train shards %s: %d shards, %d utterances, %.2f h%s (their text is checked as "
                 "each is read)", cfg.train_shards, len(shards.shards), len(shards), shards.hours(),
                 left_out if longer else "")
        if longer == len(shards):
            raise ConfigError(f"--train_shards {cfg.train_shards}: every utterance is longer than "
                              "--max_duration")
    else:
        train_utts, skipped = load_utterances(cfg.train_manifest, text, cfg.max_duration,
                                              cfg.duration_tolerance)
        log_skipped("train", cfg.train_manifest, len(train_utts), skipped)
    if cfg.max_samples > 0:
        chosen = select_samples(len(train_utts), cfg.max_samples, cfg.seed)
        train_utts = [train_utts[i] for i in chosen]
        log.info("--max_samples %d: training on %d of the utterances (a seeded choice)",
                 cfg.max_samples, len(train_utts))
    if cfg.pseudo_manifest:
        train_utts = [*train_utts, *_pseudo_utterances(cfg, tokenizer)]
    valid_utts, skipped = load_utterances(cfg.valid_manifest, text, cfg.max_duration,
                                          cfg.duration_tolerance)
    log_skipped("valid", cfg.valid_manifest, len(valid_utts), skipped)
    if not train_utts or not valid_utts:
        name, path = (("training", cfg.train_manifest) if not train_utts
                      else ("validation", cfg.valid_manifest))
        raise ManifestError(f"no usable utterance in the {name} manifest {path}; see the warnings "
                            "above (konkanivani-validate lists every bad row)")
    return train_utts, valid_utts, shards, mix


def _mixed_utterances(cfg: TrainConfig, tokenizer: Tokenizer) -> tuple[list[Utterance], Mix]:
    """The usable rows of each --train_mix manifest, one after another, and which set each is of;
    ``ManifestError`` when a manifest has none."""
    entries, utts, sources = parse_mix(cfg.train_mix), [], []
    for k, entry in enumerate(entries):
        these, skipped = load_utterances(entry.path, None if cfg.pretrain else tokenizer,
                                         cfg.max_duration,
                                         cfg.duration_tolerance)
        log_skipped(f"train ({entry.name})", entry.path, len(these), skipped)
        if not these:
            raise ManifestError(f"no usable utterance in the --train_mix manifest {entry.path}; "
                                "see the warnings above (konkanivani-validate lists every bad row)")
        utts += these
        sources += [k] * len(these)
    log.info("--train_mix: each epoch draws %d utterances, from each set in proportion to its "
             "weight (%s)", len(utts), ", ".join(f"{e.name} {e.weight:g}" for e in entries))
    return utts, Mix(entries, sources)


def _claim_directory(start: Callable[[], None], out_dir: Path, dist: Dist,
                     tokenizer: Optional[Tokenizer]) -> None:
    """The output directory made this run's (``start``): the unfinished checkpoint writes of a run
    killed while saving removed, and a fresh run's ``tokenizer`` written."""
    start()
    if dist.is_main and (stale := remove_stale_temporaries(out_dir)):
        log.warning("removed %d unfinished checkpoint writes of a run killed while saving: %s",
                    len(stale), ", ".join(p.name for p in stale))
    if dist.is_main and tokenizer is not None:
        write_file_atomic(out_dir / TOKENIZER_FILE, tokenizer.model_proto)


# ---- model ------------------------------------------------------------------------------------

def _objective(cfg: TrainConfig, model_cfg: ModelConfig) -> Objective:
    """The training objective of the run's flags (an --inter_ctc_layer the encoder lacks is
    refused here, before any work)."""
    objective = Objective.from_config(cfg, model_cfg.encoder_layers)
    tap = model_cfg.self_condition_layer
    if tap and objective.inter_ctc_layer != tap:
        log.warning("--self_condition_layer %d adds the CTC posteriors of block %d, which no "
                    "intermediate CTC trains (give --inter_ctc_weight and --inter_ctc_layer %d)",
                    tap, tap, tap)
    return objective


def _build_model(cfg: TrainConfig, model_cfg: ModelConfig, data: _Data, origin: Origin,
                 tokenizer: Tokenizer, device: torch.device) -> ASRModel:
    """The model: a resumed run's weights; or fresh, with the CMVN statistics of the training data
    and, from an --init_from checkpoint, the weights that fit."""
    try:
        model = ASRModel(model_cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if origin.state is not None:
        model.load_state_dict(origin.state.model)
    elif data.shards is not None:
        model.set_cmvn(*cmvn_of(shard_waveforms(data.shards, seed=cfg.seed), model_cfg.n_mels,
                                 model_cfg.frontend))
    else:
        model.set_cmvn(*compute_cmvn(data.train, model_cfg.n_mels, seed=cfg.seed,
                                     frontend=model_cfg.frontend))
    if origin.init is not None:
        _load_init(model, cfg, origin.init, tokenizer)
    if cfg.pretrain:  # nothing trains the heads of text: out of the optimizer and data parallelism
        for module in (model.ctc_head, model.decoder):
            module.requires_grad_(False)
    model.to(device)
    model.set_gradient_checkpointing(cfg.gradient_checkpointing)
    if cfg.gradient_checkpointing:
        log.info("gradient checkpointing: each encoder and decoder layer is recomputed in the "
                 "backward pass")
    log.info("model: %s parameters (encoder %s, decoder %s); d_model=%d, %d encoder + %d decoder "
             "layers, vocabulary %d", f"{count_parameters(model):,}",
             f"{count_parameters(model.encoder):,}", f"{count_parameters(model.decoder):,}",
             model_cfg.d_model, model_cfg.encoder_layers, model_cfg.decoder_layers,
             model_cfg.vocab_size)
    return model


def _load_init(model: ASRModel, cfg: TrainConfig, init: InferenceModel,
               tokenizer: Tokenizer) -> None:
    """The weights of the --init_from checkpoint ``init`` that fit, and its CMVN statistics with
    --keep_init_cmvn."""
    modules = tuple(m.strip() for m in cfg.init_modules.split(","))
    if init.model_config.get("codebook_size") and "encoder" in modules:
        # a pretrained encoder: its heads of text learned nothing
        modules = ("encoder",)
        log.info("--init_from %s: a pretrained encoder (--pretrain); its encoder is loaded, the "
                 "CTC head and decoder start fresh", cfg.init_from)
    log.info("%s", load_init_weights(model, tokenizer, init, modules, cfg.init_from).summary())
    if cfg.keep_init_cmvn:
        try:
            keep_init_cmvn(model, init)
        except ValueError as e:
            raise ConfigError(f"{cfg.init_from}: {e}") from e
    log.info("CMVN statistics: %s", f"kept from {cfg.init_from} (--keep_init_cmvn)"
             if cfg.keep_init_cmvn else "computed from the new training data (--keep_init_cmvn "
             "keeps the init checkpoint's)")


# ---- optimizer --------------------------------------------------------------------------------

def _optimizer(cfg: TrainConfig, model: ASRModel, precision: Precision, dist: Dist,
               device: torch.device) -> tuple[torch.optim.Optimizer, str]:
    """The model's optimizer, logged with the precision, and the name of the optimizer that runs
    (--optimizer's, or AdamW where that cannot)."""
    optimizer, name = build_optimizer(cfg.optimizer, model.parameters(), device, cfg.lr,
                                      cfg.weight_decay)
    log.info("optimizer: %s", {"adamw": "AdamW", "adamw_8bit": "8-bit AdamW (bitsandbytes)",
                               "scaled_adam": "ScaledAdam (no weight decay)"}[name])
    log.log(logging.WARNING if precision.slow else logging.INFO, "%s; device %s%s", precision.note,
            device, f"; {dist.world} processes, {cfg.strategy}" if dist.active else "")
    return optimizer, name


# ---- batching ---------------------------------------------------------------------------------

# The batches of training (of a manifest, or a plan of shards) and of validation.
Samplers = tuple[ResumableBatchSampler, ResumableBatchSampler]
# A cap on batches: whether ``n`` utterances padded to ``frames`` frames fit.
Fits = Callable[[int, int], bool]


def _settings(cfg: TrainConfig, optimizer: str, model_cfg: ModelConfig, data: _Data,
              computes: tuple[ASRModel, Callable[..., Any], Precision, Objective],
              state: Optional[TrainState], dist: Dist, device: torch.device
              ) -> tuple[TrainConfig, Optional[Fits]]:
    """The settings the run trains with, resolved here once and logged in one line
    (``_log_settings``): the ``optimizer`` that runs; with --gpu_memory_gb on CUDA, batches that
    fill it and the LR, warm-up and accumulation for them (``gpu_batches``); with --auto_batch (a
    fresh run), the largest budget of padded frames that fits (no larger than one the flags give).
    Returns them and the memory estimate's cap on every batch (None: none)."""
    model, _, precision, _ = computes
    flags = cfg = dataclasses.replace(cfg, optimizer=optimizer)
    estimator = MemoryEstimator(model_cfg, precision_name(precision), cfg.optimizer,
                                cfg.gradient_checkpointing, device)
    fills, per_batch = None, 0
    # before --auto_batch, which probes under its cap
    if (cap := _cap_gpu_memory(cfg, device)) is not None:
        cfg, fills, per_batch = gpu_batches(cfg, estimator, data.durations, cap)
    if cfg.auto_batch and state is None:
        frames = _auto_batch_frames(cfg, data, computes, estimator, device)
        given = budget_frames(cfg.max_batch_frames, cfg.max_batch_seconds)
        cfg = dataclasses.replace(cfg, max_batch_frames=min(frames, given) if given else frames,
                                  max_batch_seconds=0.0)
    _log_settings(cfg, flags, per_batch, dist)
    return cfg, _memory_cap(cfg, estimator, fills)


def _auto_batch_frames(cfg: TrainConfig, data: _Data,
                       computes: tuple[ASRModel, Callable[..., Any], Precision, Objective],
                       estimator: MemoryEstimator, device: torch.device) -> int:
    """--auto_batch: the largest budget of padded frames whose batches of the longest utterance
    fit, probed on the device."""
    model, forward, precision, objective = computes
    longest = max(frames_of(d) for d in data.durations)
    # a shard's text is read with its audio: as many tokens as CTC allows, at most what a usable
    # one has
    tokens = subsampled_lengths(longest) if data.shards else max(len(u.tokens) for u in data.train)
    return auto_batch_frames(forward, model, device, lambda: precision.autocast(device), longest,
                             tokens, estimator, cfg.max_memory_gb, objective)


def _log_settings(cfg: TrainConfig, flags: TrainConfig, per_batch: int, dist: Dist) -> None:
    """The settings in effect, in one line: the batches of an update (of --batch_size utterances,
    under a budget of padded frames or memory, or filling --gpu_memory_gb: ``per_batch``
    utterances of the median length), the accumulation and the processes, the peak LR and the
    warm-up; where --gpu_memory_gb changed the LR and warm-up, the ``flags``' beside them."""
    accum, per_step = cfg.gradient_accumulation_steps, cfg.gradient_accumulation_steps * dist.world
    processes = f" x {dist.world} processes" if dist.active else ""
    frames = budget_frames(cfg.max_batch_frames, cfg.max_batch_seconds)
    if per_batch:
        batches = (f"about {per_batch * per_step} utterances per update (batches of about "
                   f"{per_batch} of the median length, filling {FILL_FRACTION:.0%} of "
                   f"--gpu_memory_gb {cfg.gpu_memory_gb:g}, x {accum} accumulation steps"
                   f"{processes})")
    elif frames or cfg.max_memory_gb > 0:
        capped = f" and an estimated peak under {cfg.max_memory_gb:g} GiB"
        batches = (f"dynamic batches: up to {f'{frames:,}' if frames else 'any number of'} padded "
                   f"frames{capped if cfg.max_memory_gb > 0 else ''}, {cfg.num_buckets} length "
                   f"buckets (--batch_size is not used); {per_step} dynamic batches per update"
                   f"{f' in each of {dist.world} processes' if dist.active else ''}")
    else:
        batches = (f"{cfg.batch_size * per_step} utterances per update (batch {cfg.batch_size} x "
                   f"{accum} accumulation steps{processes})")
    lr, warmup = f"peak lr {cfg.lr:g}", f"{cfg.warmup_steps} warm-up steps"
    if cfg.lr != flags.lr or cfg.warmup_steps != flags.warmup_steps:
        lr += f" (--lr {flags.lr:g} x {cfg.lr / flags.lr:.2f})"
        warmup += f" (--warmup_steps {flags.warmup_steps})"
    if cfg.lr_schedule == "eden":
        warmup += f", Eden decay over {cfg.eden_steps} steps and {cfg.eden_epochs:g} epochs"
    log.info("%s, %s, %s", batches, lr, warmup)
    ramps = [f"{what} {start:g} -> {end:g}" for what, start, end in (
        ("CTC weight", cfg.ctc_weight_from, cfg.ctc_weight),
        ("label smoothing", cfg.label_smoothing_from, cfg.label_smoothing)) if start != -1]
    if ramps and cfg.loss_ramp_steps:
        log.info("loss ramps over the first %d steps: %s", cfg.loss_ramp_steps, ", ".join(ramps))


def _memory_cap(cfg: TrainConfig, estimator: MemoryEstimator, fills: Optional[Fits]
                ) -> Optional[Fits]:
    """The ``fits`` cap of every batch: under --max_memory_gb, and filling --gpu_memory_gb
    (``fills``)."""
    fits = estimator.fits_budget(cfg.max_memory_gb * GIB) if cfg.max_memory_gb > 0 else None
    if fills is None:
        return fits
    return fills if fits is None else (lambda n, frames: fills(n, frames) and fits(n, frames))


def _train_sampler(cfg: TrainConfig, data: _Data, fits: Optional[Fits], accum_then: int,
                   dist: Dist) -> ResumableBatchSampler:
    """The training batches: a plan of the shards, or length-bucketed batches of a manifest's
    rows."""
    budget = budget_frames(cfg.max_batch_frames, cfg.max_batch_seconds)
    if data.shards is not None:
        return ShardPlan(data.shards, [padded_frames(frames_of(d), cfg.pad_to_frames)
                                       for d in data.durations], rank=dist.rank,
                         world=dist.world, streams=cfg.num_workers, seed=cfg.seed,
                         buffer=cfg.shuffle_buffer, max_frames=budget, batch_size=cfg.batch_size,
                         max_duration=cfg.max_duration, fits=fits)
    if cfg.length_curriculum_epochs:
        log.info("length curriculum: the first %d epoch(s) take their batches shortest first",
                 cfg.length_curriculum_epochs)
    mix = (data.mix.sources, data.mix.weights) if data.mix else None
    return train_sampler(data.durations, cfg.batch_size, budget, cfg.seed, cfg.num_buckets, fits,
                         accum_then + 1 if cfg.preflight else 0, dist.rank, dist.world,
                         cfg.length_curriculum_epochs, mix, cfg.pad_to_frames)


def _valid_sampler(cfg: TrainConfig, data: _Data, model: ASRModel, dist: Dist
                   ) -> ResumableBatchSampler:
    sampler = LengthGroupedBatchSampler([u.duration for u in data.valid], cfg.batch_size,
                                        shuffle=False)
    # a sharded model computes in every process together: all validate everything
    if is_sharded(model):
        return sampler
    return ShardedSampler(sampler, dist.rank, dist.world, even=False)


# The share of --gpu_memory_gb that batches are sized to fill: the estimate is within about 10% of
# the H100's measured peaks (docs/memory.md), and the caching allocator needs room to fragment.
FILL_FRACTION = 0.75


def _cap_gpu_memory(cfg: TrainConfig, device: torch.device) -> Optional[float]:
    """--gpu_memory_gb on CUDA: cap the process at that much memory, and return the cap in bytes
    for batches to fill (``gpu_batches``). None elsewhere, or without the flag."""
    if cfg.gpu_memory_gb <= 0:
        return None
    if device.type != "cuda":
        log.info("--gpu_memory_gb %g: no effect on %s (batches as --batch_size says)",
                 cfg.gpu_memory_gb, device.type)
        return None
    if device.index is None:  # set_per_process_memory_fraction wants the card's index
        device = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(device).total_memory
    cap = min(cfg.gpu_memory_gb * GIB, total)
    torch.cuda.set_per_process_memory_fraction(cap / total, device)
    log.info("--gpu_memory_gb %g: this process uses at most %.1f GiB of %s's %.1f; batches sized "
             "to an estimated %.1f GiB peak", cfg.gpu_memory_gb, cap / GIB,
             torch.cuda.get_device_name(device), total / GIB, FILL_FRACTION * cap / GIB)
    return cap


def gpu_batches(cfg: TrainConfig, estimator: MemoryEstimator, durations: list[float],
                cap_bytes: float) -> tuple[TrainConfig, Fits, int]:
    """Batches that fill ``cap_bytes`` of GPU memory: each sized to ``FILL_FRACTION`` of it by the
    estimate (the ``fits`` cap returned), one micro-batch a step, and the LR and warm-up for them.
    Both follow the batch's growth over the flags' own (--batch_size x --gradient_accumulation_steps
    utterances), counted in utterances of the median length: the peak LR by its square root (the
    rule for Adam's updates, at most 2x), the warm-up over as many utterances as before (at least
    25 steps). Returns the settings, the cap and the utterances of the median length a batch holds.
    A pure function of the flags, the data and the estimate: a resumed run comes to the same."""
    fits = estimator.fits_budget(FILL_FRACTION * cap_bytes)
    median = frames_of(sorted(durations)[len(durations) // 2])
    per_batch = largest_fitting(lambda n: fits(n, median), limit=100_000)
    before = cfg.batch_size * cfg.gradient_accumulation_steps
    lr = cfg.lr * min(2.0, math.sqrt(max(1.0, per_batch / before)))
    warmup = max(25, math.ceil(cfg.warmup_steps * before / max(per_batch, 1)))
    planned = dataclasses.replace(cfg, gradient_accumulation_steps=1, lr=lr, warmup_steps=warmup)
    return planned, fits, per_batch


# ---- loaders ----------------------------------------------------------------------------------

def _loaders(cfg: TrainConfig, data: _Data, samplers: Samplers, tokenizer: Tokenizer,
             device: torch.device) -> tuple[DataLoader, DataLoader]:
    """The DataLoaders of training (a shard plan's streams, or a manifest's batches) and
    validation."""
    sampler, valid_sampler = samplers
    if isinstance(sampler, ShardPlan):
        stream = ShardStream(sampler, tokenizer, ASRDataset([], data.augmenter),
                             cfg.duration_tolerance, cfg.pad_to_frames)
        train_loader = _shard_loader(stream, cfg, device)
    else:
        train_loader = _loader(ASRDataset(data.train, data.augmenter, data.pseudo_augmenter),
                               sampler, cfg, device, pad_to_frames=cfg.pad_to_frames)
    return train_loader, _loader(ASRDataset(data.valid), valid_sampler, cfg, device, workers=0)


def _shard_loader(stream: ShardStream, cfg: TrainConfig, device: torch.device) -> DataLoader:
    """The shards' batches: each worker reads its stream of the plan and collates
    (``batch_size=None``). Workers start afresh each epoch, each with the plan of that epoch."""
    workers = cfg.num_workers
    return DataLoader(stream, batch_size=None, num_workers=workers,
                      pin_memory=device.type == "cuda",
                      prefetch_factor=4 if workers > 0 else None,
                      worker_init_fn=ignore_stop_signals if workers > 0 else None,
                      generator=torch.Generator().manual_seed(cfg.seed))


def _loader(dataset: ASRDataset, sampler: ResumableBatchSampler | EpochKeyed, cfg: TrainConfig,
            device: torch.device, workers: Optional[int] = None,
            pad_to_frames: int = 0) -> DataLoader:
    workers = cfg.num_workers if workers is None else workers
    batching = functools.partial(collate, pad_to_frames=pad_to_frames) if pad_to_frames else collate
    if dataset.augments:  # the augmentation draws need the epoch with each index
        sampler = EpochKeyed(sampler)
    # A generator of its own, so that starting an epoch's iterator (which draws the workers' seed)
    # leaves the global RNG, and with it dropout and SpecAugment, as a resumed run finds it.
    return DataLoader(dataset, batch_sampler=sampler, collate_fn=batching, num_workers=workers,
                      pin_memory=device.type == "cuda", persistent_workers=workers > 0,
                      prefetch_factor=4 if workers > 0 else None,
                      worker_init_fn=ignore_stop_signals if workers > 0 else None,
                      generator=torch.Generator().manual_seed(cfg.seed))


# ---- progress ---------------------------------------------------------------------------------

def _begin(run: Run, origin: Origin, model_cfg: ModelConfig, samples_grew: bool) -> None:
    """A resumed run's progress restored, the plan logged; rank 0 writes config.yaml (the values
    this run uses, the resumed ones on --resume, to run it again with --config) and opens the
    TensorBoard writer."""
    if origin.state is not None:
        _restore(run, origin.state, origin.source, samples_grew)
    _log_plan(run)
    if run.dist.is_main:
        write_config_file(run.out_dir / CONFIG_FILE, run.cfg, model_cfg, run.step)
    if run.dist.is_main and run.cfg.tensorboard:
        run.board = open_tensorboard(run.out_dir / "tensorboard", run.step)


def _restore(run: Run, state: TrainState, source: str, samples_grew: bool) -> None:
    """Optimizer, scaler, random states and progress of a resumed run (weights:
    ``_build_model``)."""
    saved_optimizer = canonical_optimizer(state.train_config["optimizer"])
    if saved_optimizer == run.cfg.optimizer:
        load_optimizer_state(run.model, run.optimizer, state.optimizer)
    else:  # the checkpoint's optimizer is not installed here (bitsandbytes missing, say)
        log.warning("the checkpoint's optimizer state is %s's and cannot be loaded into %s: the "
                    "Adam moments start again from zero (weights, step and schedule carry on)",
                    saved_optimizer, run.cfg.optimizer)
    if run.scaler.is_enabled() and state.scaler:  # empty when the saved run had no fp16
        run.scaler.load_state_dict(state.scaler)
    run.step, run.epoch, run.batches_done = state.step, state.epoch, state.batches_done
    plan_changed = _plan_changed(run, state)
    if state.processes == run.dist.world:
        restore_rng(state.rng[run.dist.rank])
    elif plan_changed:
        log.warning("the checkpoint was written by %d processes, this run has %d: random draws "
                    "start afresh", state.processes, run.dist.world)
    else:  # the processes took interleaved shares of the same batches: so many of them are done
        consumed = state.batches_done * state.processes
        run.batches_done = consumed // run.dist.world
        twice = consumed % run.dist.world
        log.warning("the checkpoint was written by %d processes, this run has %d: random draws "
                    "start afresh, and the epoch goes on after %d of its batches%s",
                    state.processes, run.dist.world, run.batches_done * run.dist.world,
                    f" ({twice} done twice)" if twice else "")
    run.best_wer, run.best_cer = state.best_wer, state.best_cer
    run.valid_metrics, run.valid_step = state.valid_metrics, state.valid_step
    _restore_ema(run, state)
    if run.dist.is_main:
        run.metrics.truncate(run.step)
    if samples_grew and run.batches_done:
        log.info("--max_samples grew: epoch %d ends here, the next one covers the larger set",
                 run.epoch + 1)
        run.epoch, run.batches_done = run.epoch + 1, 0
    if plan_changed and run.batches_done:
        log.warning("the rest of epoch %d cannot be found again (%s): it ends here, and the next "
                    "epoch starts", run.epoch + 1, plan_changed)
        run.epoch, run.batches_done = run.epoch + 1, 0
    lr = scheduled_lr(run.cfg, run.step, run.epoch)
    log.info("resumed from %s at step %d (epoch %d, batch %d), lr %.3g", source, run.step,
             run.epoch + 1, run.batches_done, lr)


def _plan_changed(run: Run, state: TrainState) -> Optional[str]:
    """What makes the batches a checkpoint's epoch had left differ from this run's, where it
    trains on shards or did (their plan depends on the shard list, the processes and readers);
    None otherwise."""
    saved = state.data_position[run.dist.rank] if len(state.data_position) == run.dist.world else {}
    if isinstance(run.sampler, ShardPlan):
        if not state.data_position:
            return "the run trained on a manifest, now on shards"
        if not saved:
            return f"{len(state.data_position)} processes then, {run.dist.world} now"
        return run.sampler.same_plan(saved)
    return "the run trained on shards, now on a manifest" if state.data_position else None


def _restore_ema(run: Run, state: TrainState) -> None:
    """The moving average as the checkpoint kept it; one started afresh when it kept none."""
    if run.ema is not None and state.ema_model:
        load_ema_state(run.ema, state.ema_model, state.ema_updates)
        saved_decay = state.train_config["ema_decay"]
        if saved_decay != run.cfg.ema_decay:
            log.warning("--ema_decay %g on resume: the average so far was kept with %g",
                        run.cfg.ema_decay, saved_decay)
    elif run.ema is not None:
        log.info("--ema_decay %g: the checkpoint holds no average; it starts from the weights of "
                 "step %d", run.cfg.ema_decay, run.step + 1)
    elif state.ema_model:
        log.warning("--ema_decay 0: the checkpoint's moving average of the weights is dropped")


def _log_plan(run: Run) -> None:
    """What the run does besides its settings (``_log_settings``): the encoder held, an average
    kept."""
    cfg = run.cfg
    if cfg.freeze_encoder_steps > run.step:
        log.info("--freeze_encoder_steps %d: the encoder is not updated until step %d",
                 cfg.freeze_encoder_steps, cfg.freeze_encoder_steps + 1)
    if run.ema is not None:
        log.info("--ema_decay %g: a moving average of the weights is kept; validation, best.pt and "
                 "decoding use it", cfg.ema_decay)


def _can_draw_curves(out_dir: Path) -> bool:
    if have_matplotlib():
        return True
    log.info('matplotlib is not installed: no %s in %s (pip install "konkanivani[plot]")', CURVES,
             out_dir)
    return False


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
