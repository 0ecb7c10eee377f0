"""What a training checkpoint holds (``TrainState``): the weights, the optimizer, the scaler, the
step and epoch, the configs, the tokenizer and every process's random state, so that a resumed run
goes on exactly where it stopped."""
from __future__ import annotations

import math
import random
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..checkpoint import CheckpointError, load_checkpoint, save_checkpoint

__all__ = ["TrainState", "capture_rng", "restore_rng"]


@dataclass
class TrainState:
    """Everything a run needs to go on exactly where it stopped; the checkpoint *is* this, as a dict
    of its fields (``save``/``load``). ``model``, ``optimizer`` and ``scaler`` are state dicts;
    ``rng`` holds the random states of each process of the run (``capture_rng``)."""

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
    # per process, beyond batches_done: a
    data_position: list[dict[str, Any]] = field(default_factory=list)
    # shard plan's inputs and each reader's next shard and key (ShardPlan.position); empty for a
    # manifest

    def save(self, path: str | Path) -> Path:
        return save_checkpoint({f.name: getattr(self, f.name) for f in fields(self)}, path)

    @classmethod
    def load(cls, path: str | Path) -> TrainState:
        return cls.from_checkpoint(load_checkpoint(path), path)

    @classmethod
    def from_checkpoint(cls, state: dict[str, Any], path: str | Path) -> TrainState:
        """The training state of a loaded checkpoint; ``CheckpointError`` in one line for one that
        cannot be resumed (averaged weights)."""
        if "optimizer" not in state:
            raise CheckpointError(
                f"{path} holds model weights only (an averaged model?); resume from a step "
                "checkpoint or latest"
            )
        required = [
            f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING
        ]
        if missing := [name for name in required if name not in state]:
            raise CheckpointError(
                f"{path} is not a speech recognition training checkpoint (no {', '.join(missing)}; "
                "a language model's?)"
            )
        # A field added after the format (ema_model, say) is absent from older files: its default.
        return cls(**{f.name: state[f.name] for f in fields(cls) if f.name in state})


def capture_rng() -> dict[str, Any]:
    """This process's random states: Python, NumPy, torch (CPU and CUDA)."""
    np_state = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
