"""Choosing the autocast dtype: fp16 + GradScaler on CUDA, bf16 on a CPU only where it pays.

A CPU's flags are a poor guide (a virtual machine may report ``avx512_bf16`` while its bf16
matrix multiply runs at a fraction of fp32 speed), so a CPU is asked by timing: a short probe
multiplies 256x256 matrices in both dtypes, alternating, several rounds, and keeps the fastest
product of each (a busy machine slows some products down, never speeds one up). bf16 matmul ran,
against fp32: 0.52-0.60x on an Intel Xeon with AVX512-BF16 (where a training step under bf16
autocast took 0.81-0.86x the fp32 time for ``small`` but 1.1-1.2x for ``large`` and ``medium`` on
15 s utterances, holding a quarter less memory), about 2.3x on an Intel Xeon with AMX-BF16, and
0.03x on an AMD EPYC with AVX2 only (a step 20-25x slower). bf16 is used when the ratio is at
least 0.2. The log line names the CPU and its relevant flags (``cpu_description``).

``--precision fp32|fp16|bf16`` names the dtype outright and is honoured wherever it can run (with
a warning where it is slow); ``--mixed_precision`` alone keeps the automatic choice above. Under
either, norms (``conformer.LayerNorm``) and the CTC loss run in fp32, and the softmax inside the
fused attention kernels accumulates in fp32.
"""
from __future__ import annotations

import contextlib
import functools
import platform
import time
from dataclasses import dataclass
from typing import Optional

import torch

from ..config import PRECISIONS
from ..device import DeviceError, resolve_device  # re-exported: the trainers import them from here

__all__ = [
    "DeviceError",
    "Precision",
    "resolve_device",
    "resolve_precision",
    "cpu_bf16_speed_ratio",
    "cpu_description",
]


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


_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")  # the ones that decide bf16 speed


@functools.lru_cache(maxsize=1)
def _cpuinfo() -> tuple[str, frozenset[str]]:
    """The CPU's model name and flags from /proc/cpuinfo (empty off Linux)."""
    name, flags = "", set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not name:
                    name = " ".join(value.split())
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:  # not Linux
        pass
    return name, frozenset(flags)


def cpu_description() -> str:
    """The CPU's model name and its bf16-relevant flags, e.g. "AMD EPYC with avx2", for logs and
    tables."""
    name, flags = _cpuinfo()
    name = name or platform.processor() or platform.machine() or "unknown CPU"
    shown = [f for f in _CPU_FLAGS if f in flags]
    return f"{name} with {', '.join(shown)}" if shown else name


def _matmul_seconds(dtype: torch.dtype, size: int = 256, seconds: float = 0.02) -> float:
    """The fastest of the products of two ``size`` x ``size`` matrices made within ``seconds`` (at
    least one). The matrices come from a generator of their own: the global one is the run's, which
    a probe made after its seeding would otherwise move (the first run in a process would then draw
    other weights than the next one with the same seed)."""
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(size, size, generator=generator).to(dtype) for _ in range(2))
    best, start = float("inf"), time.perf_counter()
    while best == float("inf") or time.perf_counter() - start < seconds:
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return best


@functools.lru_cache(maxsize=1)
def cpu_bf16_speed_ratio(rounds: int = 5) -> float:
    """bf16 / fp32 matmul throughput on this CPU (about 0.5 with AVX512-BF16, 2 with AMX, under 0.05
    without native bf16). The two dtypes alternate for ``rounds`` rounds after a warm-up of each, on
    one thread, and each keeps its fastest product, so a busy moment of the machine moves neither
    figure. (On two threads beside another busy process, an AVX2-only EPYC measured 0.38x: the fp32
    product waited for its second thread, and bf16 was chosen for a run 20x slower.) An x86 CPU
    without AVX512-BF16 or AMX has no native bf16, whatever the figure: 0 then."""
    _, flags = _cpuinfo()
    if "avx2" in flags and not flags & {"avx512_bf16", "amx_bf16"}:
        return 0.0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for dtype in (torch.float32, torch.bfloat16):  # warm up: kernel selection, JIT
            _matmul_seconds(dtype, seconds=0.0)
        fp32 = bf16 = float("inf")
        for _ in range(rounds):
            fp32 = min(fp32, _matmul_seconds(torch.float32))
            bf16 = min(bf16, _matmul_seconds(torch.bfloat16))
    finally:
        torch.set_num_threads(threads)
    return fp32 / bf16


def _explicit_precision(device: torch.device, precision: str) -> Precision:
    if precision == "fp32":
        return Precision(None, False, "precision: fp32")
    if precision == "fp16":
        if device.type == "cuda":
            return Precision(torch.float16, True, "precision: fp16 autocast with GradScaler")
        return Precision(
            torch.float16,
            True,
            f"precision: fp16 autocast with GradScaler on {device.type} "
            "(runs, but fp16 is slow off CUDA; bf16 needs no scaler)",
            slow=True,
        )
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return Precision(
                torch.bfloat16, False, "precision: bf16 autocast (no GradScaler needed)"
            )
        return Precision(
            torch.bfloat16,
            False,
            "precision: bf16 autocast, which this GPU emulates "
            "(far slower than fp16; a T4 wants --precision fp16)",
            slow=True,
        )
    if device.type == "cpu":
        ratio = cpu_bf16_speed_ratio()
        if ratio >= 0.2:
            return _fast_cpu_bf16(ratio)
        speed = f"bf16 matmul at {ratio:.3f}x fp32" if ratio else "no avx512_bf16 or amx_bf16"
        return Precision(
            torch.bfloat16,
            False,
            "precision: bf16 autocast as asked, but this CPU "
            f"({cpu_description()}) has no native bf16 ({speed}): far slower "
            "than fp32",
            slow=True,
        )
    return Precision(torch.bfloat16, False, f"precision: bf16 autocast on {device.type}")


def _fast_cpu_bf16(ratio: float) -> Precision:
    """bf16 autocast on a CPU whose bf16 matmul runs at ``ratio`` of fp32 speed (at least 0.2)."""
    return Precision(
        torch.bfloat16,
        False,
        f"precision: bf16 autocast (this CPU, {cpu_description()}, runs bf16 "
        f"matmul at {ratio:.2f}x fp32)",
    )


def resolve_precision(
    device: torch.device, mixed_precision: bool, precision: str = ""
) -> Precision:
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
            return _fast_cpu_bf16(ratio)
        speed = f"bf16 matmul at {ratio:.3f}x fp32 speed" if ratio else "no avx512_bf16 or amx_bf16"
        return Precision(
            None,
            False,
            f"--mixed_precision: this CPU ({cpu_description()}) has no fast bf16 "
            f"({speed}), training in fp32",
        )
    return Precision(
        None, False, f"--mixed_precision is not supported on {device.type}, training in fp32"
    )
