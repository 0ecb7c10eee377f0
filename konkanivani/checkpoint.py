"""The checkpoint format, in one place: the names of a run's checkpoint files, what each kind of
checkpoint holds, and writing and reading them.

A checkpoint is a dict saved by ``torch.save``. Nothing outside this module reads its keys: each
reader takes the view it needs, which any checkpoint of that kind gives, older ones included:

- ``TrainState``: an ASR training run, to resume it (the dict *is* its fields);
- ``InferenceModel``: an ASR model to decode with or start another run from (``--init_from``);
  every ASR checkpoint has one (a step file, ``latest.pt``, ``best.pt``, an average);
- ``LMTrainState``: a ``konkanivani-train-lm`` run, to resume it; ``LanguageModel``: its model, for
  shallow fusion;
- ``SaveRecord``: the step and validation a checkpoint of any kind records, for reports.

Files survive a crash: written to a temporary file, fsynced, renamed into place; read back with
``weights_only`` (no pickled code runs) and refused in one line when they are not konkanivani
checkpoints. The run directory around them (the lock, latest.pt and best.pt as links, pruning,
resume) is ``training.run_files``.

torch is imported by the two functions that save and load, not with the module: ``config``
checks the checkpoint files flags name (``checkpoint_file_error``) and stays light.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import re
from collections.abc import Iterator
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

if TYPE_CHECKING:
    import torch

# ModelConfig fields added after checkpoints that lack them were written, each with the value that
# builds the model those checkpoints hold (the feature off): ModelConfig.from_dict reads their
# absence so, and step files from before and after one are averaged as one model.
ADDED_OFF: dict[str, Any] = {"time_reduce_layer": 0, "time_recover_layer": 0,
                             "self_condition_layer": 0, "codebook_size": 0}

__all__ = [
    "ADDED_OFF",
    "CONFIG_FILE",
    "METRICS_FILE",
    "TOKENIZER_FILE",
    "BEST_FILE",
    "CheckpointError",
    "FORMAT_VERSION",
    "InferenceModel",
    "LATEST_FILE",
    "LMTrainState",
    "LanguageModel",
    "STEP_FILES",
    "SaveRecord",
    "TrainState",
    "atomic_file",
    "average_checkpoints",
    "checkpoint_file_error",
    "fsync_dir",
    "load_checkpoint",
    "save_checkpoint",
    "step_checkpoint_name",
    "step_of",
    "TEMPORARY_CHECKPOINTS",
    "temporary_path",
    "temporary_writer",
    "tokenizer_of",
    "validated_wer",
    "write_file_atomic",
]

log = logging.getLogger("konkanivani")


FORMAT_VERSION = 2  # 2: TrainState (no LR scheduler state: the LR is a function of the step)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read; the message says which file and why."""


# ---- the files of a run ------------------------------------------------------------------------

LATEST_FILE = "latest.pt"  # the run's newest complete save
BEST_FILE = "best.pt"  # its save with the best validation score (WER; an LM's: perplexity)
STEP_FILES = "step_*.pt"  # one per save, named by step_checkpoint_name: their glob
METRICS_FILE = "metrics.jsonl"  # a row per logged step and validation (training.metrics_log)
CONFIG_FILE = "config.yaml"  # the settings in effect (config_file.write_config_file)
TOKENIZER_FILE = "tokenizer.model"  # the run's tokenizer, written once its data is usable
_STEP_FILE = re.compile(r"step_(\d+)\.pt")


def step_checkpoint_name(step: int) -> str:
    """The name of the save at optimizer step ``step``: ``step_0000160.pt``."""
    return f"step_{step:07d}.pt"


def step_of(name: str) -> int | None:
    """The step of a step file's name (``step_checkpoint_name``); None for any other name."""
    m = _STEP_FILE.fullmatch(name)
    return int(m.group(1)) if m else None


def checkpoint_file_error(path: str | Path, what: str = "checkpoint") -> str | None:
    """Why ``path`` is no checkpoint file to read, in one line naming it as ``what`` (a flag, say),
    or None: it is missing, or it is a folder (a run's, an export's), said as a folder, with a
    checkpoint in it to give instead where it holds one (best.pt first, then latest.pt)."""
    path = Path(path)
    if path.is_dir():
        held = sorted((p.name for p in path.glob("*.pt")
                       if p.is_file() and not p.name.endswith(".torchscript.pt")),
                      key=lambda name: (name != BEST_FILE, name != LATEST_FILE, name))
        instead = (f"give a checkpoint file in it, such as {path / held[0]}" if held
                   else "it holds no checkpoint (*.pt) file")
        return f"{what} {path} is a folder, not a checkpoint file: {instead}"
    if not path.is_file():
        return f"{what} {path}: file not found"
    return None


# ---- what a checkpoint holds -------------------------------------------------------------------

def _as_dict(view: Any) -> dict[str, Any]:
    """A view's fields as the checkpoint's dict, in their order (the order they are saved in)."""
    return {f.name: getattr(view, f.name) for f in fields(view)}


def _missing(cls: type, checkpoint: dict[str, Any]) -> list[str]:
    """The fields of ``cls`` without a default that ``checkpoint`` lacks."""
    return [f.name for f in fields(cls) if f.default is MISSING
            and f.default_factory is MISSING and f.name not in checkpoint]


@dataclass
class TrainState:
    """Everything a run needs to go on exactly where it stopped; the checkpoint *is* this, as a dict
    of its fields (``save``/``load``). ``model``, ``optimizer`` and ``scaler`` are state dicts;
    ``rng`` holds the random states of each process of the run (``training.state.capture_rng``)."""

    model_config: dict[str, Any]
    train_config: dict[str, Any]
    tokenizer: bytes  # the SentencePiece model
    model: dict[str, Any]
    optimizer: dict[str, Any] = field(default_factory=dict)
    scaler: dict[str, Any] = field(default_factory=dict)  # empty unless fp16
    step: int = 0  # optimizer steps done
    epoch: int = 0  # epochs finished
    batches_done: int = 0  # batches of the epoch in progress already trained on, by each process
    processes: int = 1  # of the run that wrote it (torchrun's world size)
    rng: list[dict[str, Any]] = field(default_factory=list)  # one per process (rank)
    best_wer: float = math.inf
    best_cer: float = math.inf
    valid_metrics: dict[str, float] = field(default_factory=dict)
    valid_step: int = -1  # the step valid_metrics were measured at
    # the EMA weights (--ema_decay); empty when off
    ema_model: dict[str, Any] = field(default_factory=dict)
    ema_updates: int = 0  # optimizer steps averaged into ema_model (AveragedModel.n_averaged)
    # seconds of training up to this step (Run.elapsed); 0 in older checkpoints
    train_seconds: float = 0.0
    # per process, beyond batches_done: a shard plan's inputs and each reader's next shard and key
    # (ShardPlan.position); empty for a manifest
    data_position: list[dict[str, Any]] = field(default_factory=list)

    def save(self, path: str | Path) -> Path:
        return save_checkpoint(_as_dict(self), path)

    @classmethod
    def load(cls, path: str | Path) -> TrainState:
        return cls.from_checkpoint(load_checkpoint(path), path)

    @classmethod
    def from_checkpoint(cls, state: dict[str, Any], path: str | Path) -> TrainState:
        """The training state of a loaded checkpoint; ``CheckpointError`` in one line for one that
        cannot be resumed (averaged weights; ``load_checkpoint`` refuses other formats)."""
        if "optimizer" not in state:
            raise CheckpointError(
                f"{path} holds model weights only (an averaged model?); resume from a step "
                "checkpoint or latest"
            )
        if missing := _missing(cls, state):
            raise CheckpointError(
                f"{path} is not a speech recognition training checkpoint (no {', '.join(missing)}; "
                "a language model's?)"
            )
        # A field added after the format (ema_model, say) is absent from older files: its default.
        return cls(**{f.name: state[f.name] for f in fields(cls) if f.name in state})


@dataclass(frozen=True)
class InferenceModel:
    """The speech recognition model of a checkpoint, to decode with or to start another run from:
    the model's shape (``ModelConfig`` as a dict), its weights and its tokenizer. ``weights`` are
    the moving average where the run kept one (--ema_decay; ``ema``), else the training weights;
    either holds the CMVN statistics (``cmvn``)."""

    model_config: dict[str, Any]
    weights: dict[str, Any]  # a state dict of ASRModel
    tokenizer: bytes  # the SentencePiece model
    ema: bool  # whether ``weights`` are the EMA weights

    @classmethod
    def of(cls, checkpoint: dict[str, Any]) -> InferenceModel:
        """The model of a loaded checkpoint; ``KeyError`` for the first part it lacks (its
        ``model_config``, ``model`` or ``tokenizer``: ``missing`` names them all)."""
        config = checkpoint["model_config"]
        # "model" stays the raw training weights in the file, as resuming needs them
        weights = checkpoint.get("ema_model") or checkpoint["model"]
        return cls(config, weights, checkpoint["tokenizer"], weights is not checkpoint["model"])

    @staticmethod
    def missing(checkpoint: dict[str, Any]) -> list[str]:
        """The parts of a model that ``checkpoint`` lacks; none for any ASR checkpoint."""
        return [k for k in ("model_config", "model", "tokenizer") if k not in checkpoint]

    def save(self, path: str | Path) -> Path:
        """A checkpoint of this model alone, to decode or export but not to resume: its config,
        ``weights`` as its ``model`` and its tokenizer."""
        return save_checkpoint({"model_config": self.model_config, "model": self.weights,
                                "tokenizer": self.tokenizer}, path)

    @property
    def cmvn(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The feature mean and standard deviation the model normalizes its input with."""
        return self.weights["feat_mean"], self.weights["feat_std"]


@dataclass
class LMTrainState:
    """Everything a ``konkanivani-train-lm`` run needs to go on where it stopped; the checkpoint is
    this, as a dict of its fields. ``model`` and ``optimizer`` are state dicts; ``rng`` is the
    process's random states (``training.state.capture_rng``)."""

    lm_config: dict[str, Any]
    train_config: dict[str, Any]
    tokenizer: bytes  # the SentencePiece model, the ASR model's
    model: dict[str, Any]
    optimizer: dict[str, Any]
    step: int  # optimizer steps done
    epoch: int  # epochs finished
    batches_done: int  # batches of the epoch in progress already trained on
    rng: dict[str, Any]
    valid_ppl: float  # the validation perplexity at this step
    best_valid_ppl: float

    def save(self, path: str | Path) -> Path:
        return save_checkpoint(_as_dict(self), path)

    @classmethod
    def from_checkpoint(cls, state: dict[str, Any], path: str | Path) -> LMTrainState:
        """The training state of a loaded LM checkpoint; ``CheckpointError`` in one line for a
        checkpoint of another kind."""
        if missing := _missing(cls, state):
            raise CheckpointError(
                f"{path} is not a language model training checkpoint (no {', '.join(missing)})"
            )
        return cls(**{f.name: state[f.name] for f in fields(cls)})


@dataclass(frozen=True)
class LanguageModel:
    """The language model of a ``konkanivani-train-lm`` checkpoint, for shallow fusion: its shape
    (``LMConfig`` as a dict), weights and tokenizer."""

    lm_config: dict[str, Any]
    weights: dict[str, Any]  # a state dict of TransformerLM
    tokenizer: bytes  # the SentencePiece model

    @classmethod
    def of(cls, checkpoint: dict[str, Any], path: str | Path) -> LanguageModel:
        """The LM of a loaded checkpoint: ``CheckpointError`` for a checkpoint of another kind,
        ``KeyError`` for the first part an LM checkpoint lacks."""
        if "lm_config" not in checkpoint:
            raise CheckpointError(
                f"{path} is not a language model checkpoint (made by konkanivani-train-lm)"
            )
        return cls(checkpoint["lm_config"], checkpoint["model"], checkpoint["tokenizer"])


@dataclass(frozen=True)
class SaveRecord:
    """What a checkpoint of any kind records of its save, for reports: the optimizer step and the
    validation metrics. A checkpoint that keeps no metrics (an LM's, an average) has none; one that
    no run saved (a model built untrained) has no step either."""

    step: int | None
    valid_metrics: dict[str, float]  # an ASR run's last validation (``valid_step``); empty if none
    best_cer: float | None  # the run's best validation CER up to the save

    @classmethod
    def of(cls, checkpoint: dict[str, Any]) -> SaveRecord:
        return cls(checkpoint.get("step"), checkpoint.get("valid_metrics") or {},
                   checkpoint.get("best_cer"))


def tokenizer_of(checkpoint: dict[str, Any]) -> bytes:
    """The SentencePiece model a checkpoint holds, an ASR model's or an LM's; ``KeyError`` when it
    holds none."""
    return checkpoint["tokenizer"]


def validated_wer(checkpoint: dict[str, Any], step: int) -> float | None:
    """The validation WER of the save at ``step`` (its file's step) when it was measured at that
    very step (an end-of-epoch save, or one at a validation); None otherwise, and for checkpoints
    that keep no metrics (an LM's, an average). A pretraining run's (no text): its masked loss."""
    if checkpoint.get("valid_step") == step and (metrics := checkpoint["valid_metrics"]):
        return metrics["wer"] if "wer" in metrics else metrics["masked"]
    return None


# ---- writing and reading -----------------------------------------------------------------------

def temporary_path(path: Path) -> Path:
    """Where ``path`` is written before it is renamed into place: ``.NAME.tmpPID`` beside it."""
    return path.with_name(f".{path.name}.tmp{os.getpid()}")


TEMPORARY_CHECKPOINTS = ".*.pt.tmp*"  # the temporary_path of checkpoints: their glob
_TEMPORARY_CHECKPOINT = re.compile(r"\..+\.pt\.tmp(\d+)")


def temporary_writer(name: str) -> int | None:
    """The process id that writes the checkpoint temporary named ``name`` (``temporary_path``);
    None for any other name."""
    m = _TEMPORARY_CHECKPOINT.fullmatch(name)
    return int(m.group(1)) if m else None


def fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some file systems (and Windows) cannot open a directory
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(path: str | Path) -> Iterator[BinaryIO]:
    """A binary file to write ``path`` through: a temporary file beside it, fsynced and renamed into
    place when the block ends, removed if the block raises. A reader sees the old file or the
    new one, never half."""
    path = Path(path)
    tmp = temporary_path(path)
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


class _KeepsWriteError:
    """A binary file that remembers the first ``OSError`` its ``write`` raised. torch.save turns
    such an error into a RuntimeError of its own ("[enforce fail at inline_container.cc:...]
    unexpected pos 704 vs 598"), which hides the reason: "No space left on device"."""

    def __init__(self, f: BinaryIO):
        self.f, self.error = f, None

    def write(self, data: bytes) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise

    def __getattr__(self, name: str) -> Any:  # flush, fileno, ...: the file's own
        return getattr(self.f, name)


def save_checkpoint(state: dict[str, Any], path: str | Path) -> Path:
    """Write ``state`` to ``path`` atomically: a reader sees the old file or the new one, never
    half.
    ``CheckpointError`` when it cannot be written, with the system's reason (a full disk, say)."""
    import torch

    path = Path(path)
    f = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(path) as raw:
            f = _KeepsWriteError(raw)
            torch.save({"format_version": FORMAT_VERSION, **state}, f)
    except (OSError, RuntimeError) as e:  # torch.save reports a failed write as either
        cause = f.error if f is not None and f.error is not None else e
        reason = cause.strerror if isinstance(cause, OSError) and cause.strerror else cause
        raise CheckpointError(f"could not write checkpoint {path}: {reason}; "
                              "the previous checkpoints are untouched") from e
    return path


def write_file_atomic(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` as checkpoints are written (``atomic_file``)."""
    path = Path(path)
    try:
        with atomic_file(path) as f:
            f.write(data)
    except OSError as e:
        raise CheckpointError(f"could not write {path}: {e.strerror or e}") from e
    return path


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load a konkanivani checkpoint; ``CheckpointError`` with a plain reason if it is not one."""
    import torch

    path = Path(path)
    if path.is_dir():
        raise CheckpointError(checkpoint_file_error(path))
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        raise CheckpointError(
            f"cannot read checkpoint {path}: the file is truncated, corrupt or not a "
            f"PyTorch checkpoint ({type(e).__name__})"
        ) from e
    if not isinstance(state, dict) or "format_version" not in state:
        raise CheckpointError(f"{path} is not a konkanivani checkpoint")
    if state["format_version"] != FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has checkpoint format {state['format_version']}; this konkanivani "
            f"reads format {FORMAT_VERSION} only (CHANGELOG.md)"
        )
    return state


def average_checkpoints(paths: list[str | Path]) -> dict[str, Any]:
    """A checkpoint whose weights are the mean of those in ``paths`` (same model shape), for
    decoding; optimizer and schedule state are left out, so it cannot be resumed."""
    if not paths:
        raise CheckpointError("no checkpoint to average")
    total: dict[str, torch.Tensor] = {}
    first = None
    for p in paths:
        state = load_checkpoint(p)
        if first is None:
            first = state
        elif (
            # a model field added since reads as off where an older step file lacks it
            {**ADDED_OFF, **state["model_config"]} != {**ADDED_OFF, **first["model_config"]}
            or state["tokenizer"] != first["tokenizer"]
        ):
            raise CheckpointError(
                f"{p}: model shape or tokenizer differs from {paths[0]}; cannot average"
            )
        for name, tensor in state["model"].items():
            if name not in total:
                total[name] = tensor.double() if tensor.is_floating_point() else tensor.clone()
            elif tensor.is_floating_point():
                total[name] += tensor.double()
    averaged = {
        name: (t / len(paths)).to(first["model"][name].dtype) if t.is_floating_point() else t
        for name, t in total.items()
    }
    keep = ("model_config", "train_config", "tokenizer", "step")
    return {**{k: first[k] for k in keep if k in first}, "model": averaged,
            "averaged_from": [str(p) for p in paths]}
