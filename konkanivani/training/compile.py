"""``--compile``: the model's Conformer blocks and decoder layers through ``torch.compile``, falling
back to eager wherever compiling fails, but never hiding an out-of-memory error (the loop splits
that batch).

Regional compilation: each layer's ``forward`` is compiled, not the whole model. The layers of a
kind share one compiled graph (their code is the same; their weights are the graph's inputs), so
compiling costs one encoder block and one decoder layer, however deep the model, and the parts
around them (front-end, SpecAugment, the losses) stay eager. Inside a layer the compiler fuses the
norms, activations, rotary embeddings and residual additions into a few kernels. Lengths are
dynamic; on CUDA they come padded to a multiple of ``conformer.ALIGN``.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch
from torch import nn

from ..model.conformer import ConformerBlock
from ..model.decoder import DecoderLayer
from .memory import is_out_of_memory

__all__ = ["compiled", "compiled_layers"]

log = logging.getLogger("konkanivani")


def compiled_layers(model: nn.Module) -> list[nn.Module]:
    """The layers ``compiled`` compiles: every ``ConformerBlock`` and ``DecoderLayer`` of ``model``
    (a DDP wrapper's module too)."""
    return [m for m in model.modules() if isinstance(m, (ConformerBlock, DecoderLayer))]


def _eager(layers: list[nn.Module]) -> None:
    for layer in layers:
        layer.__dict__.pop("forward", None)  # the class's own forward again


def compiled(model: nn.Module) -> Callable[..., Any]:
    """``model``'s forward with its layers compiled (dynamic shapes: batches vary in length); the
    eager model, with a warning, wherever compiling fails (no compiler, an unsupported platform).
    The parameters stay ``model``'s: checkpoints, EMA and the optimizer see no wrapper."""
    layers = compiled_layers(model)
    try:
        for layer in layers:
            layer.forward = torch.compile(layer.forward, dynamic=True)
    except Exception as e:
        _eager(layers)
        log.warning(
            "--compile: torch.compile is not available here (%s: %s); running eager",
            type(e).__name__,
            e,
        )
        return model
    compiling = [True]

    def forward(*args: Any, **kwargs: Any) -> Any:
        if compiling[0]:
            try:
                return model(*args, **kwargs)
            except Exception as e:
                if is_out_of_memory(e):
                    raise
                first_line = (str(e).strip().splitlines() or [""])[0]
                log.warning(
                    "--compile: compiling the model failed (%s: %s); running eager",
                    type(e).__name__,
                    first_line,
                )
                _eager(layers)
                compiling[0] = False
        return model(*args, **kwargs)

    log.info(
        "--compile: the model's %d layers are compiled with torch.compile at its first batches",
        len(layers),
    )
    return forward
