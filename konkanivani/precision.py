"""Choosing the autocast dtype: fp16 + GradScaler on CUDA, bf16 on a CPU only where it pays.

A CPU's flags are a poor guide (a virtual machine may report ``avx512_bf16`` while its bf16
matrix multiply runs at a fraction of fp32 speed), so a CPU is asked by timing: a short probe
multiplies 256x256 matrices in both dtypes. Measured on x86 machines: with native bf16
(AVX512-BF16) bf16 matmul ran at 0.52-0.60x fp32 speed, and a training step under bf16 autocast
took 0.81-0.86x the fp32 time for the ``small`` preset (batches of 4 x 3 s and 16 x 4 s) but
1.1-1.2x for ``large`` and ``medium`` on 15 s utterances (benchmarks/memory.py), while holding
a quarter less memory; without native bf16, bf16 matmul ran at under 0.01x and the step was 20-25x
slower. bf16 is used when the ratio is at least 0.2, well between the two.

``--precision fp32|fp16|bf16`` names the dtype outright and is honoured wherever it can run (with
a warning where it is slow); ``--mixed_precision`` alone keeps the automatic choice above. Under
either, norms (``conformer.LayerNorm``) and the CTC loss run in fp32, and the softmax inside the
fused attention kernels accumulates in fp32.
"""
from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["PRECISIONS", "Precision", "resolve_precision", "cpu_bf16_speed_ratio"]

PRECISIONS = ("fp32", "fp16", "bf16")


@dataclass(frozen=True)
class Precision:
    dtype: Optional[torch.dtype]  # autocast dtype; None for plain fp32
    use_scaler: bool  # GradScaler: fp16 only
    note: str  # one line for the log
    slow: bool = False  # runs, but far slower than it should: the log warns

    def autocast(self, device: torch.device):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.dtype)


def _matmul_gflops(dtype: torch.dtype, size: int = 256, seconds: float = 0.05) -> float:
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    a @ b  # warm up
    n, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        a @ b
        n += 1
    return 2 * size ** 3 * n / elapsed / 1e9


@functools.lru_cache(maxsize=1)
def cpu_bf16_speed_ratio() -> float:
    """bf16 / fp32 matmul throughput on this CPU (about 0.5 with native bf16, under 0.01 without)."""
    fp32 = max(_matmul_gflops(torch.float32) for _ in range(2))
    bf16 = max(_matmul_gflops(torch.bfloat16) for _ in range(2))
    return bf16 / fp32


def _explicit_precision(device: torch.device, precision: str) -> Precision:
    if precision == "fp32":
        return Precision(None, False, "precision: fp32")
    if precision == "fp16":
        if device.type == "cuda":
            return Precision(torch.float16, True, "precision: fp16 autocast with GradScaler")
        return Precision(torch.float16, True, f"precision: fp16 autocast with GradScaler on {device.type} "
                                              "(runs, but fp16 is slow off CUDA; bf16 needs no scaler)", slow=True)
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return Precision(torch.bfloat16, False, "precision: bf16 autocast (no GradScaler needed)")
        return Precision(torch.bfloat16, False, "precision: bf16 autocast, which this GPU emulates "
                                                "(far slower than fp16; a T4 wants --precision fp16)", slow=True)
    if device.type == "cpu":
        ratio = cpu_bf16_speed_ratio()
        if ratio >= 0.2:
            return Precision(torch.bfloat16, False,
                             f"precision: bf16 autocast (this CPU runs bf16 matmul at {ratio:.2f}x fp32)")
        return Precision(torch.bfloat16, False, f"precision: bf16 autocast as asked, but this CPU has no "
                                                f"native bf16 (bf16 matmul at {ratio:.3f}x fp32): far slower than fp32",
                         slow=True)
    return Precision(torch.bfloat16, False, f"precision: bf16 autocast on {device.type}")


def resolve_precision(device: torch.device, mixed_precision: bool, precision: str = "") -> Precision:
    """The autocast setting for ``--precision`` (when given) or ``--mixed_precision``."""
    if precision:
        if precision not in PRECISIONS:
            raise ValueError(f"--precision {precision!r}: choose one of {', '.join(PRECISIONS)}")
        return _explicit_precision(device, precision)
    if not mixed_precision:
        return Precision(None, False, "precision: fp32")
    if device.type == "cuda":
        return Precision(torch.float16, True, "precision: fp16 autocast with GradScaler")
    if device.type == "cpu":
        ratio = cpu_bf16_speed_ratio()
        if ratio >= 0.2:
            return Precision(torch.bfloat16, False,
                             f"precision: bf16 autocast (this CPU runs bf16 matmul at {ratio:.2f}x fp32)")
        return Precision(None, False, f"--mixed_precision: this CPU has no fast bf16 (bf16 matmul at "
                                      f"{ratio:.3f}x fp32 speed), training in fp32")
    return Precision(None, False, f"--mixed_precision is not supported on {device.type}, training in fp32")
