"""``--compile``: the model's forward through ``torch.compile``, falling back to eager wherever
compiling fails, but never hiding an out-of-memory error (the loop splits that batch)."""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch
from torch import nn

from .memory import is_out_of_memory

__all__ = ["compiled"]

log = logging.getLogger("konkanivani")


def compiled(model: nn.Module) -> Callable[..., Any]:
    """The model's forward through ``torch.compile`` (dynamic shapes: batches vary in length); the
    eager model, with a warning, wherever compiling fails (no compiler, an unsupported platform)."""
    try:
        compiled_model = torch.compile(model, dynamic=True)
    except Exception as e:
        log.warning("--compile: torch.compile is not available here (%s: %s); running eager", type(e).__name__, e)
        return model
    current = [compiled_model]

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
