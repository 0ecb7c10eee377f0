"""Training the language model of shallow fusion (``konkanivani-train-lm``) on the ASR trainer's
machinery: the same run directory (one run at a time, an earlier run refused or moved aside,
``train.log``), the same stop requests (Ctrl-C, SIGTERM, ``--max_time``: save, then stop), the
same checkpoint writing (step files, ``latest.pt``, ``best.pt``, pruning), the same resume policy
(settings marked ``kept_on_resume`` come from the checkpoint) and the same LR schedule.

One sentence a line, normalized as transcripts are (``normalize_text``) and tokenized with the ASR
checkpoint's own tokenizer (or a ``.model`` file), which the LM checkpoint then carries. Blank
lines are skipped and counted. Without ``valid_text`` a seeded share of the text is held out.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from ..checkpoint import METRICS_FILE, CheckpointError, LMTrainState, load_checkpoint, tokenizer_of
from ..config import (
    BELOW_ONE,
    COUNT,
    POSITIVE_INTEGER,
    ConfigError,
    RunConfig,
    check_run_config,
    check_values,
    flag_help,
    kept_settings,
)
from ..data.tokenizer import UNK_ID, Tokenizer, normalize_text
from ..model.lm import LMConfig, TransformerLM
from .metrics_log import MetricsLog
from .optim import adamw, lr_factor
from .precision import resolve_device
from .run_files import load_resume_checkpoint, run_directory, save_step
from .signals import Stop, StopRequest
from .state import capture_rng, restore_rng

__all__ = [
    "LMTrainConfig",
    "TextError",
    "check_lm_config",
    "load_tokenizer",
    "perplexity",
    "read_sentences",
    "train_lm",
]

log = logging.getLogger("konkanivani")


@dataclass
class LMTrainConfig(RunConfig):
    """One LM training run: its own fields, then those of every run (``config.RunConfig``); the
    model's dimensions are ``model.lm.LMConfig``."""

    text: list[str] = field(
        default_factory=list, metadata=flag_help("text files, one sentence a line")
    )
    tokenizer: str = field(
        default="",
        metadata={"help": "the ASR checkpoint the LM will serve, or a .model", "required": True},
    )
    output_dir: str = field(
        default="", metadata={"help": "where checkpoints and logs go", "required": True}
    )
    valid_text: str = field(
        default="", metadata=flag_help("held-out text for validation perplexity")
    )
    valid_fraction: float = field(default=0.05, metadata=flag_help(
        "without --valid_text, this share of the sentences is held out", kept_on_resume=True))
    batch_size: int = field(
        default=64, metadata=flag_help("sentences per step", kept_on_resume=True)
    )
    warmup_steps: int = field(
        default=500, metadata=flag_help("then 1/sqrt decay, as konkanivani-train")
    )
    valid_every: int = field(
        default=500, metadata=flag_help("validate and save every N steps, and each epoch")
    )


class TextError(ValueError):
    """Text that cannot be used; the message names the file (and line)."""


def check_lm_config(cfg: LMTrainConfig, lm_cfg: LMConfig) -> None:
    """Every value that can be checked before any work; ``ConfigError`` naming the first bad one.
    The fields every run has are checked as the ASR trainer checks them (``check_run_config``)."""
    check_run_config(cfg)
    check_values(cfg, {"batch_size": POSITIVE_INTEGER, "valid_every": POSITIVE_INTEGER,
                       "warmup_steps": COUNT,
                       "valid_fraction": (lambda v: 0.0 < v < 1.0, "in (0, 1)")})
    check_values(lm_cfg, {"d_model": POSITIVE_INTEGER, "layers": POSITIVE_INTEGER,
                          "n_heads": POSITIVE_INTEGER, "dropout": BELOW_ONE})
    if lm_cfg.d_model % lm_cfg.n_heads or (lm_cfg.d_model // lm_cfg.n_heads) % 2:
        raise ConfigError(f"--d_model {lm_cfg.d_model} must split into --n_heads {lm_cfg.n_heads} "
                          "heads of even width")


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of an ASR checkpoint, or a SentencePiece ``.model`` file."""
    path = Path(path)
    if not path.is_file():
        raise TextError(f"--tokenizer {path}: file not found")
    try:
        if path.suffix == ".model":
            return Tokenizer.load(path)
        return Tokenizer(tokenizer_of(load_checkpoint(path)))
    except KeyError:
        raise TextError(f"--tokenizer {path}: the checkpoint carries no tokenizer") from None
    except (RuntimeError, ValueError, OSError) as e:
        raise TextError(
            f"--tokenizer {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
        ) from e


def read_sentences(paths: list[str | Path], tokenizer: Tokenizer) -> tuple[list[list[int]], int]:
    """Token ids of every non-blank line of ``paths`` (after normalization), and how many lines were
    blank. ``TextError`` naming the file and line for text that is not UTF-8."""
    sentences: list[list[int]] = []
    blank = 0
    for path in map(Path, paths):
        if not path.is_file():
            raise TextError(f"{path}: file not found")
        with open(path, "rb") as f:  # bytes, decoded line by line, so that an error names its line
            for line_no, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError:
                    raise TextError(f"{path}:{line_no}: not UTF-8 text") from None
                ids = tokenizer.encode(line) if normalize_text(line) else []
                if ids:
                    sentences.append(ids)
                else:
                    blank += 1
    return sentences, blank


def _split(
    sentences: list[list[int]], fraction: float, seed: int
) -> tuple[list[list[int]], list[list[int]]]:
    """A held-out share of the sentences, the same for a given seed (a resumed run sees the same
    split)."""
    order = torch.randperm(len(sentences), generator=torch.Generator().manual_seed(seed)).tolist()
    n_valid = max(1, round(fraction * len(sentences))) if len(sentences) > 1 else 0
    return [sentences[i] for i in order[n_valid:]], [sentences[i] for i in order[:n_valid]]


@torch.inference_mode()
def perplexity(
    model: TransformerLM, sentences: list[list[int]], batch_size: int, device: torch.device
) -> float:
    """exp(mean negative log-likelihood per predicted token, end symbols included)."""
    model.eval()
    nll, tokens = 0.0, 0
    for start in range(0, len(sentences), batch_size):
        loss, n = model.loss(sentences[start:start + batch_size], device)
        nll, tokens = nll + float(loss), tokens + n
    return math.exp(nll / tokens) if tokens else math.nan


@dataclass
class LMRun:
    """What an LM run holds while it runs, and its progress (saved in each checkpoint)."""

    cfg: LMTrainConfig
    lm_cfg: LMConfig
    tokenizer: Tokenizer
    model: TransformerLM
    optimizer: torch.optim.Optimizer
    device: torch.device
    metrics: MetricsLog
    train_set: list[list[int]]
    valid_set: list[list[int]]
    step: int = 0
    epoch: int = 0
    batches_done: int = 0
    best: float = math.inf
    last_ppl: float = math.inf
    saved_step: int = -1


def _read_text(cfg: LMTrainConfig, tokenizer: Tokenizer) -> tuple[list, list, list]:
    """All sentences, the training set and the validation set (``TextError`` for an empty one). What
    was read is logged here; the split is logged by the caller, after a resume has redone it."""
    sentences, blank = read_sentences(cfg.text, tokenizer)
    if not sentences:
        raise TextError(f"no sentence in {', '.join(map(str, cfg.text))} ({blank} blank lines)")
    if cfg.valid_text:
        train_set, (valid_set, valid_blank) = sentences, read_sentences([cfg.valid_text], tokenizer)
    else:
        (train_set, valid_set), valid_blank = _split(sentences, cfg.valid_fraction, cfg.seed), 0
    if not valid_set or not train_set:
        raise TextError(
            f"no sentence left for {'validation' if not valid_set else 'training'} "
            f"({cfg.valid_text or f'--valid_fraction {cfg.valid_fraction} of {len(sentences)}'})"
        )
    n_tokens = sum(map(len, sentences))
    unk = sum(s.count(UNK_ID) for s in sentences)
    log.info(
        "%d sentences (%d tokens, %d <unk>), %d blank lines skipped%s",
        len(sentences),
        n_tokens,
        unk,
        blank,
        (
            f"; validation on {cfg.valid_text} ({valid_blank} blank lines skipped)"
            if cfg.valid_text
            else ""
        ),
    )
    return sentences, train_set, valid_set


def _resumed_settings(
    cfg: LMTrainConfig, state: LMTrainState, tokenizer: Tokenizer
) -> LMTrainConfig:
    """A resumed run's tokenizer must be the checkpoint's, and it keeps the settings that decide its
    batches (``config.kept_settings``, as the ASR trainer)."""
    if bytes(state.tokenizer) != tokenizer.model_proto:
        raise CheckpointError(
            f"--resume {cfg.resume}: the checkpoint's tokenizer differs from --tokenizer "
            f"{cfg.tokenizer}"
        )
    changed = kept_settings(cfg, state.train_config)
    if changed:
        log.warning("on resume, %s as in the checkpoint (they decide the batches)",
                    ", ".join(f"--{k} {v}" for k, v in changed.items()))
    return dataclasses.replace(cfg, **changed)


def _train_step(run: LMRun, batch: list[list[int]], lr: float) -> float:
    """One update at learning rate ``lr``; the batch's mean loss per token."""
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    nll, n = run.model.loss(batch, run.device)
    (nll / n).backward()
    torch.nn.utils.clip_grad_norm_(run.model.parameters(), 1.0)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    return float(nll.detach()) / n


def _save(run: LMRun, valid_ppl: float) -> None:
    """Validate-and-save: this step's checkpoint (``run_files.save_step``, as the ASR trainer
    saves)."""
    run.last_ppl, run.saved_step = valid_ppl, run.step
    is_best = valid_ppl < run.best
    run.best = min(run.best, valid_ppl)
    train_config = {k: v for k, v in dataclasses.asdict(run.cfg).items() if k != "text"}
    state = LMTrainState(
        lm_config=run.lm_cfg.to_dict(),
        train_config=train_config,
        tokenizer=run.tokenizer.model_proto,
        model=run.model.state_dict(),
        optimizer=run.optimizer.state_dict(),
        step=run.step,
        epoch=run.epoch,
        batches_done=run.batches_done,
        rng=capture_rng(),
        valid_ppl=valid_ppl,
        best_valid_ppl=run.best,
    )
    path = save_step(
        Path(run.cfg.output_dir), run.step, state.save, is_best, run.cfg.keep_checkpoints
    )
    run.metrics.write("valid", run.step, run.epoch, ppl=valid_ppl)
    log.info(
        "step %d: validation perplexity %.2f%s; saved %s",
        run.step,
        valid_ppl,
        " (best)" if is_best else "",
        path.name,
    )


def _setup(
    cfg: LMTrainConfig,
    lm_cfg: LMConfig,
    state: Optional[LMTrainState],
    tokenizer: Tokenizer,
    train_set: list,
    valid_set: list,
) -> LMRun:
    device = resolve_device(cfg.device)
    lm_cfg = (
        LMConfig(**state.lm_config)
        if state
        else dataclasses.replace(lm_cfg, vocab_size=tokenizer.vocab_size)
    )
    torch.manual_seed(cfg.seed)
    model = TransformerLM(lm_cfg).to(device)
    optimizer = adamw(
        list(model.parameters()), lr=cfg.lr, betas=(0.9, 0.98), weight_decay=cfg.weight_decay
    )
    run = LMRun(
        cfg,
        lm_cfg,
        tokenizer,
        model,
        optimizer,
        device,
        MetricsLog(Path(cfg.output_dir) / METRICS_FILE),
        train_set,
        valid_set,
    )
    if state is not None:
        model.load_state_dict(state.model)
        optimizer.load_state_dict(state.optimizer)
        restore_rng(state.rng)
        run.step, run.epoch, run.batches_done = state.step, state.epoch, state.batches_done
        run.best = state.best_valid_ppl
        log.info(
            "resumed at step %d (epoch %d, batch %d)", run.step, run.epoch + 1, run.batches_done
        )
    run.metrics.truncate(run.step)
    log.info("LM: %s, %.2fM parameters", lm_cfg, sum(p.numel() for p in model.parameters()) / 1e6)
    return run


def _epoch(run: LMRun, stop_request: StopRequest) -> Stop:
    """The rest of the epoch in progress, or until a stop; returns what stopped it (``Stop.NONE``:
    the epoch ended)."""
    cfg = run.cfg
    order = torch.randperm(
        len(run.train_set), generator=torch.Generator().manual_seed(cfg.seed * 100_003 + run.epoch)
    )
    batches = [
        order[i : i + cfg.batch_size].tolist() for i in range(0, len(run.train_set), cfg.batch_size)
    ]
    losses, stop = [], Stop.NONE
    for i in range(run.batches_done, len(batches)):
        run.model.train()
        lr = cfg.lr * lr_factor(run.step, cfg.warmup_steps)
        losses.append(_train_step(run, [run.train_set[j] for j in batches[i]], lr))
        run.step, run.batches_done = run.step + 1, i + 1
        run.metrics.write("train", run.step, run.epoch, loss=losses[-1], lr=lr)
        if 0 < cfg.max_steps <= run.step:
            stop = Stop.MAX_STEPS
        else:
            stop = stop_request.stop()
        if stop:
            break
        if run.step % cfg.valid_every == 0:
            _save(run, perplexity(run.model, run.valid_set, cfg.batch_size, run.device))
    else:
        run.epoch, run.batches_done = run.epoch + 1, 0
    if losses:
        log.info(
            "step %d (%d epochs done): mean training loss %.3f over the last %d steps",
            run.step,
            run.epoch,
            sum(losses) / len(losses),
            len(losses),
        )
    return stop


def train_lm(cfg: LMTrainConfig, lm_cfg: LMConfig) -> dict[str, Any]:
    """Train (or resume) as ``cfg`` says; returns the final step, validation perplexity and what
    stopped it (``stop``, a ``Stop``, and its ``reason`` as ``stopped_by``)."""
    check_lm_config(cfg, lm_cfg)
    tokenizer = load_tokenizer(cfg.tokenizer)
    sentences, train_set, valid_set = _read_text(cfg, tokenizer)
    out = Path(cfg.output_dir)
    with (
        run_directory(out, cfg.resume, cfg.overwrite) as start,
        StopRequest(cfg.max_time) as stop_request,
    ):
        state = (LMTrainState.from_checkpoint(*load_resume_checkpoint(cfg.resume, out))
                 if cfg.resume else None)
        if state is not None:
            cfg = _resumed_settings(cfg, state, tokenizer)
            if not cfg.valid_text:
                train_set, valid_set = _split(sentences, cfg.valid_fraction, cfg.seed)
        start()
        log.info("%d sentences for training, %d for validation", len(train_set), len(valid_set))
        run = _setup(cfg, lm_cfg, state, tokenizer, train_set, valid_set)
        stop = Stop.MAX_STEPS if 0 < cfg.max_steps <= run.step else Stop.NONE
        while run.epoch < cfg.epochs and not stop:
            stop = _epoch(run, stop_request)
            if run.saved_step != run.step:  # not saved by --valid_every at this very step
                _save(run, perplexity(run.model, run.valid_set, cfg.batch_size, run.device))
    return {
        "step": run.step,
        "epoch": run.epoch,
        "valid_ppl": run.last_ppl,
        "best_ppl": run.best,
        "stop": stop,  # a Stop; its name for messages and JSON:
        "stopped_by": stop.reason,
    }
