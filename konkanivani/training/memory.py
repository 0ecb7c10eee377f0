"""Memory: telling out-of-memory errors apart, freeing memory after one, watching usage (CUDA's
allocator on a GPU, the process's resident set on a CPU), and estimating a training step's peak
before running it."""
from __future__ import annotations

import gc
import logging
import resource
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from ..config import ConfigError, ModelConfig
from ..data.frames import subsampled_lengths
from ..model.conformer import ALIGN

if TYPE_CHECKING:
    from .objective import Objective

__all__ = [
    "GIB",
    "MemoryEstimator",
    "precision_name",
    "largest_fitting",
    "available_memory_bytes",
    "auto_batch_frames",
    "is_out_of_memory",
    "free_memory",
    "BatchDoesNotFit",
    "ModelDoesNotFit",
    "check_model_fits",
    "rss_bytes",
    "peak_rss_bytes",
    "reset_peak_rss",
    "memory_status",
]

log = logging.getLogger("konkanivani")

GIB = 1024 ** 3


class BatchDoesNotFit(RuntimeError):
    """A single utterance does not fit in memory: nothing is left to split."""


class ModelDoesNotFit(ConfigError):
    """By the estimate, the model cannot train in the device's memory even on one utterance: the
    run is refused before the model is built (a sweep skips the trial and goes on)."""


def is_out_of_memory(error: BaseException) -> bool:
    """CUDA's ``OutOfMemoryError``, or the CPU allocator's failure (a plain ``RuntimeError``)."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and (
        "out of memory" in text or "can't allocate memory" in text
    )


def free_memory(device: torch.device) -> None:
    """Drop unreachable tensors and hand CUDA's cached blocks back, after an out-of-memory error."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _proc_status_bytes(field: str) -> int | None:
    """A memory figure of this process from Linux ``/proc/self/status`` (None elsewhere)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def rss_bytes() -> int:
    """Resident memory of this process now (Linux ``/proc``; the peak elsewhere)."""
    now = _proc_status_bytes("VmRSS")
    return now if now is not None else peak_rss_bytes()


def peak_rss_bytes() -> int:
    """Highest resident memory of this process (since ``reset_peak_rss`` where that works)."""
    peak = _proc_status_bytes("VmHWM")
    if peak is not None:
        return peak
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def reset_peak_rss() -> bool:
    """Restart the peak resident memory count at the current value (Linux); False where it
    cannot."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def memory_status(device: torch.device) -> dict[str, float]:
    """GiB in use now and at the peak: CUDA's allocated/peak/reserved, or the process RSS on a
    CPU."""
    if device.type == "cuda":
        return {"mem_gb": torch.cuda.memory_allocated(device) / GIB,
                "peak_gb": torch.cuda.max_memory_allocated(device) / GIB,
                "reserved_gb": torch.cuda.memory_reserved(device) / GIB}
    return {"rss_gb": rss_bytes() / GIB, "peak_rss_gb": peak_rss_bytes() / GIB}


# ---- the estimator ---------------------------------------------------------------------------

# decoder length assumed per second of audio (SentencePiece, vocabulary ~128)
TOKENS_PER_SECOND = 5.0

# Activation bytes kept for the backward pass, per utterance, as coefficients of the terms of
# ``_activation_terms``. Fitted by ``benchmarks/calibrate_memory.py``: non-negative least squares
# over the bytes autograd saves (counted with ``saved_tensors_hooks``) for 4 model shapes x 3
# lengths on the CPU, "half" under bf16 autocast; fit error under 1.8%, and 1.1-4.6% on the tiny
# and small presets held out of the fit. Re-run it after changing the model: with attention dropout
# off by default the fused attention kernel keeps no T x T weights, and the attention terms fell to
# almost nothing.
ACTIVATION_COEFFS: dict[str, dict[str, float]] = {
    "fp32": {
        "subsampling": 6.943,
        "encoder_width": 38.982,
        "encoder_ffn": 22.291,
        "encoder_attention": 0.573,
        "decoder_width": 46.793,
        "decoder_ffn": 18.43,
        "decoder_attention": 0.0,
        "heads": 0.0,
    },
    "half": {
        "subsampling": 3.463,
        "encoder_width": 47.276,
        "encoder_ffn": 9.966,
        "encoder_attention": 0.509,
        "decoder_width": 41.172,
        "decoder_ffn": 7.96,
        "decoder_attention": 0.0,
        "heads": 3.769,
    },
}
# Peak resident memory of a training step = static + PEAK_FACTOR x saved activations +
# ACCUMULATION_FACTOR x parameter bytes + PEAK_OVERHEAD: the backward pass holds gradients of
# activations beside the saved ones; with gradient accumulation the later micro-batches' backward
# passes add new gradients to the accumulated ones; the first steps allocate kernels' and the
# allocator's working memory. Fitted by the same script to the peak RSS of fresh processes training
# the tiny, small, medium and large presets with two micro-batches accumulated (12 runs, fp32 and
# bf16, 1-4 utterances of 8-20 s each; within 8% of each) on a 2-core AMD EPYC with torch 2.14,
# counted above a process that has already loaded its libraries (about 200 MiB of code on a CPU,
# which the estimate leaves out, as CUDA's allocator figures do). A step without accumulation peaks
# somewhat lower.
PEAK_FACTOR = 2.352
ACCUMULATION_FACTOR = 0.375
PEAK_OVERHEAD = 26.8 * 2 ** 20
# With --gradient_checkpointing the peak comes at the end of the backward pass, in the (not
# checkpointed) subsampling convolutions: their saved outputs, the gradients flowing into them and
# the ReLU's gradient are alive together. Their activations then count this many times instead of
# PEAK_FACTOR; fitted by the same script to checkpointed runs of the tiny, small and medium presets
# (fp32: bf16 runs slowly on the CPU it was last fitted on).
CHECKPOINTED_SUBSAMPLING_FACTOR = 3.211

# On CUDA the peak is ``torch.cuda.max_memory_allocated``: the bytes of live tensors, not the
# allocator's cached or fragmented blocks, nor the CPU's freed-but-kept heap that PEAK_FACTOR
# includes. A training step there peaks at parameters + gradients + optimizer states + autocast
# copies + the batch + CUDA_PEAK_FACTOR x the saved activations (the bytes ACTIVATION_COEFFS
# counts: the saved tensors plus the activation gradients in flight) + CUDA_OVERHEAD (cuBLAS and
# cuDNN workspaces, which a process keeps from its first step). Gradient accumulation adds no
# term: the gradients of the earlier micro-batches are the gradients counted already, and a
# single micro-batch peaks as its backward pass begins, before any gradient exists (the estimate
# counts them all the same: the recipes accumulate). With --gradient_checkpointing the peak is at
# the end of the backward pass, in the subsampling convolutions (as on the CPU), with every
# gradient made. Frames and tokens are padded to a multiple of conformer.ALIGN, as the model pads
# them on CUDA. Fitted by ``benchmarks/calibrate_memory.py --cuda_csv`` (non-negative least
# squares on relative errors) to the 22 rows of benchmarks/results/gpu/h100_memory_rows.csv,
# measured on an NVIDIA H100 80GB HBM3 on 2026-11-26 (torch 2.11, CUDA 13.0): within 10% of each.
CUDA_CALIBRATED_ON = "NVIDIA H100 80GB HBM3, 2026-11-26"
CUDA_PEAK_FACTOR = {"fp32": 1.092, "half": 1.096}
CUDA_CHECKPOINTED_SUBSAMPLING_FACTOR = 1.543
CUDA_OVERHEAD = 62.8 * 2 ** 20


def precision_name(precision: Any) -> str:
    """``fp32``, ``bf16`` or ``fp16`` for a ``Precision``."""
    return {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[precision.dtype]


def _aligned(length: int, align: int) -> int:
    return -(-length // align) * align


def _activation_terms(cfg: ModelConfig, frames: int, tokens: int,
                      layers: Optional[tuple[int, int]] = None, align: int = 1) -> dict[str, float]:
    """Sizes (in elements) that activation memory grows with, for one utterance of ``frames``
    feature frames and ``tokens`` tokens; ``layers`` overrides (encoder, decoder) layer counts;
    encoder frames and decoder tokens padded to a multiple of ``align`` (as on CUDA)."""
    enc_layers, dec_layers = layers or (cfg.encoder_layers, cfg.decoder_layers)
    t = _aligned(max(1, subsampled_lengths(frames)), align)
    u = _aligned(tokens + 1, align)
    first = cfg.subsampling_channels or cfg.d_model
    return {
        # the two convolutions' outputs, T/2 x F/2 x first and T/4 x F/4 x D; times 0.8, so that at
        # first = D (the width the coefficients were fitted at) the term stays T x F x D / 4
        "subsampling": frames * cfg.n_mels * (first / 4 + cfg.d_model / 16) * 0.8,
        "encoder_width": enc_layers * t * cfg.d_model,
        "encoder_ffn": enc_layers * t * cfg.ffn_dim,
        "encoder_attention": enc_layers * cfg.n_heads * t * t,
        "decoder_width": dec_layers * u * cfg.d_model,
        "decoder_ffn": dec_layers * u * cfg.ffn_dim,
        "decoder_attention": dec_layers * cfg.n_heads * u * (t + u),
        # the CTC head's and the decoder's outputs; a self-conditioned encoder's pass of the CTC
        # head on its block's states too
        "heads": (t * (2 if cfg.self_condition_layer else 1) + u) * cfg.vocab_size,
    }


_COMPONENT_OF = {
    "subsampling": "subsampling",
    "encoder_width": "encoder",
    "encoder_ffn": "encoder",
    "encoder_attention": "encoder",
    "decoder_width": "decoder",
    "decoder_ffn": "decoder",
    "decoder_attention": "decoder",
    "heads": "CTC + output heads",
}


class MemoryEstimator:
    """Peak training memory of one preset under one precision, optimizer and checkpointing choice,
    per component: parameters, gradients, optimizer states, autocast weight copies, and the
    activations of a batch (which grow with its utterances x frames, and with frames squared in
    attention). The activations' sizes were measured on the CPU (see ``ACTIVATION_COEFFS``); how
    they add up to the peak depends on the ``device``: CUDA's figures (``CUDA_PEAK_FACTOR``...)
    were fitted to peaks measured on a GPU, every other device gets the CPU's."""

    def __init__(self, cfg: ModelConfig, precision: str = "fp32", optimizer: str = "adamw",
                 checkpointing: bool = False, device: str | torch.device = "cpu"):
        # here: model imports nothing from this module, but keep it light
        from ..model.asr import ASRModel
        from .optim import canonical_optimizer

        self.cfg, self.precision, self.checkpointing = cfg, precision, checkpointing
        self.cuda = torch.device(device).type == "cuda"
        # the model pads frames and tokens to this multiple on CUDA (conformer.ALIGN)
        self.align = ALIGN if self.cuda else 1
        self.optimizer = canonical_optimizer(optimizer)
        with torch.device("meta"):
            shapes = [p.numel() for p in ASRModel(cfg).parameters()]
        self.n_params = sum(shapes)
        # bitsandbytes keeps tensors under 4096 elements in 32 bits
        if self.optimizer == "adamw_8bit":
            self.optimizer_bytes = sum(
                2 * n + 8 * -(-n // 256) if n >= 4096 else 8 * n for n in shapes
            )
        else:
            self.optimizer_bytes = 8 * self.n_params

    def _activations(self, frames: int, tokens: int) -> dict[str, float]:
        coeffs = ACTIVATION_COEFFS["fp32" if self.precision == "fp32" else "half"]
        cfg = self.cfg
        if not self.checkpointing:
            terms = _activation_terms(cfg, frames, tokens, align=self.align)
            out: dict[str, float] = {}
            for name, size in terms.items():
                out[_COMPONENT_OF[name]] = out.get(_COMPONENT_OF[name], 0.0) + coeffs[name] * size
            return out
        # Checkpointed: each layer keeps its fp32 input; one layer's activations live at a time.
        one = _activation_terms(cfg, frames, tokens, layers=(1, 1), align=self.align)
        t = _aligned(max(1, subsampled_lengths(frames)), self.align)
        u = _aligned(tokens + 1, self.align)
        enc_one = sum(
            coeffs[k] * one[k] for k in ("encoder_width", "encoder_ffn", "encoder_attention")
        )
        dec_one = sum(
            coeffs[k] * one[k] for k in ("decoder_width", "decoder_ffn", "decoder_attention")
        )
        return {
            "subsampling": coeffs["subsampling"] * one["subsampling"],
            "encoder": (
                4 * cfg.encoder_layers * t * cfg.d_model + (enc_one if cfg.encoder_layers else 0)
            ),
            "decoder": (
                4 * cfg.decoder_layers * u * cfg.d_model + (dec_one if cfg.decoder_layers else 0)
            ),
            "CTC + output heads": coeffs["heads"] * one["heads"],
        }

    def components(self, batch: int, frames: int, tokens: Optional[int] = None) -> dict[str, float]:
        """Bytes per component for ``batch`` utterances padded to ``frames`` frames (``tokens``
        tokens each; by default ``TOKENS_PER_SECOND`` of the audio's length)."""
        if tokens is None:
            tokens = max(1, round(frames / 100 * TOKENS_PER_SECOND))
        parts = {"parameters": 4.0 * self.n_params, "gradients": 4.0 * self.n_params,
                 f"optimizer ({self.optimizer})": float(self.optimizer_bytes)}
        if self.precision != "fp32":
            parts["autocast weight copies"] = 2.0 * self.n_params
        acts = self._activations(frames, tokens)
        if self.cuda:
            kind = "fp32" if self.precision == "fp32" else "half"
            for name, value in acts.items():
                checkpointed = self.checkpointing and name == "subsampling"
                factor = (CUDA_CHECKPOINTED_SUBSAMPLING_FACTOR if checkpointed
                          else CUDA_PEAK_FACTOR[kind])
                parts[f"activations: {name}"] = factor * batch * value
            # on the device for the whole step: fp32 features and int64 tokens
            parts["input batch"] = batch * (4.0 * frames * self.cfg.n_mels + 8.0 * tokens)
            parts["runtime overhead"] = CUDA_OVERHEAD
            return parts
        for name, value in acts.items():
            factor = (
                CHECKPOINTED_SUBSAMPLING_FACTOR
                if self.checkpointing and name == "subsampling"
                else PEAK_FACTOR
            )
            parts[f"activations: {name}"] = factor * batch * value
        parts["gradient accumulation"] = ACCUMULATION_FACTOR * 4.0 * self.n_params
        parts["runtime overhead"] = PEAK_OVERHEAD
        return parts

    def peak_bytes(self, batch: int, frames: int, tokens: Optional[int] = None) -> float:
        return sum(self.components(batch, frames, tokens).values())

    def fits_budget(self, budget_bytes: float) -> Callable[[int, int], bool]:
        """``fits(batch, frames)`` for ``DurationBucketSampler``: the estimated peak is under the
        budget."""
        def fits(batch: int, frames: int) -> bool:
            return self.peak_bytes(batch, frames) <= budget_bytes

        return fits

    def max_frames(self, budget_bytes: float, longest_frames: int) -> int:
        """The largest ``max_batch_frames`` whose every batch (up to utterances of
        ``longest_frames``) stays under the budget; 0 if not even one such utterance fits."""
        fits = self.fits_budget(budget_bytes)
        if not fits(1, longest_frames):
            return 0
        n = 1
        while fits(n + 1, longest_frames):
            n += 1
        return n * longest_frames


def largest_fitting(runs: Callable[[int], bool], limit: int) -> int:
    """The largest ``n <= limit`` for which ``runs(n)`` is True (0 if not even 1), assuming
    that what fits for ``n`` fits for anything smaller: doubling, then bisection."""
    if limit < 1 or not runs(1):
        return 0
    good = 1
    while good < limit:
        trial = min(2 * good, limit)
        if not runs(trial):
            bad = trial
            break
        good = trial
    else:
        return good
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if runs(mid) else (good, mid)
    return good


def available_memory_bytes(device: torch.device) -> int:
    """Memory a training run may use: the GPU's total, or the RAM the kernel reports available
    (less where the process's limits allow less: ``_process_limits``).

    On a CPU this process's own resident memory is not added: most of it is library code, which
    the estimator does not count, and the model's weights already resident are counted again by
    the estimate, which errs on the safe side."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    available = 8 * GIB
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        pass
    return min([available, *_process_limits()])


def _process_limits() -> list[int]:
    """What this process may still allocate under its limits, where it has any: its address space
    (``RLIMIT_AS``, less what it maps now) and its memory control group's (``_cgroup_room``)."""
    limits = []
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        limits.append(max(0, soft - (_proc_status_bytes("VmSize") or 0)))
    if (room := _cgroup_room()) is not None:
        limits.append(room)
    return limits


def _cgroup_room() -> int | None:
    """What this process's memory control group still allows: its limit less what the group holds
    beyond page cache (which the kernel reclaims first); None without a limit. cgroup v2 (the
    group named in ``/proc/self/cgroup``) or v1 (the memory controller's, as a container mounts
    its own)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, group = line.split(":", 2)
        if not controllers:
            base, names = Path("/sys/fs/cgroup") / group.lstrip("/"), (
                "memory.max", "memory.current", "file")
        elif "memory" in controllers.split(","):
            base, names = Path("/sys/fs/cgroup/memory"), (
                "memory.limit_in_bytes", "memory.usage_in_bytes", "total_cache")
        else:
            continue
        try:
            limit = (base / names[0]).read_text().strip()
            if limit == "max" or int(limit) >= 1 << 60:  # v1 writes "no limit" as a huge number
                continue
            stat = dict(row.split()[:2] for row in (base / "memory.stat").read_text().splitlines())
            held = int((base / names[1]).read_text()) - int(stat.get(names[2], 0))
            return max(0, int(limit) - max(0, held))
        except (OSError, ValueError):
            continue
    return None


def check_model_fits(estimator: MemoryEstimator, longest: int, device: torch.device,
                     max_memory_gb: float = 0.0, processes: int = 1) -> None:
    """``ModelDoesNotFit`` in one line when the estimated peak of a training step on one utterance
    of ``longest`` frames passes the memory the run may use: the RAM available on a CPU (shared by
    its ``processes``), the card's on a GPU, or ``--max_memory_gb`` when it is less. The model's
    dimensions and the estimate's largest part are named. Nothing is allocated: the estimator
    counts parameters on the meta device."""
    budget, where = float(available_memory_bytes(device)), (
        "the GPU's memory" if device.type == "cuda" else "the RAM available to this process")
    if 0 < max_memory_gb and max_memory_gb * GIB < budget:
        budget, where = max_memory_gb * GIB, "--max_memory_gb"
    elif device.type != "cuda" and processes > 1:
        budget, where = budget / processes, f"{where}, shared by {processes} processes"
    parts = estimator.components(1, longest)
    peak = sum(parts.values())
    if peak <= budget:
        return
    cfg = estimator.cfg
    dims = " ".join(f"--{name} {getattr(cfg, name)}" for name in (
        "d_model", "n_heads", "ffn_dim", "encoder_layers", "decoder_layers", "n_mels"))
    weights = sum(v for k, v in parts.items()
                  if k in ("parameters", "gradients", "autocast weight copies")
                  or k.startswith("optimizer"))
    largest = max(parts, key=parts.get)
    raise ModelDoesNotFit(
        f"the model ({dims}, {cfg.vocab_size} tokens: {estimator.n_params / 1e6:,.1f} M "
        f"parameters) needs an estimated {peak / GIB:,.1f} GiB to train on one utterance of "
        f"{longest / 100:.1f} s (weights, gradients and optimizer states {weights / GIB:,.1f} GiB; "
        f"the largest part {largest}), more than {where} ({budget / GIB:.1f} GiB): give smaller "
        "model flags, or see docs/memory.md")


def auto_batch_frames(
    forward: Callable[..., Any],
    model: torch.nn.Module,
    device: torch.device,
    autocast: Callable[[], Any],
    longest: int,
    tokens: int,
    estimator: MemoryEstimator,
    max_memory_gb: float = 0.0,
    objective: Optional[Objective] = None,
) -> int:
    """--auto_batch: the largest frame budget whose batches of the longest utterance (``longest``
    frames, ``tokens`` tokens) fit. On CUDA it is measured: forward + backward passes of ``forward``
    (the model's, under ``objective``: the run's, by default SpecAugment's) on growing synthetic
    batches until one runs out of memory or its peak plus the
    optimizer states passes 90% of the device. A CPU raises no error to probe for (the kernel ends
    the process instead), so there the estimator decides. ``autocast()`` opens the run's precision.
    """
    budget = 0.9 * available_memory_bytes(device)
    if max_memory_gb > 0:
        budget = min(budget, max_memory_gb * GIB)
    if device.type != "cuda":
        frames = estimator.max_frames(budget, longest)
        log.info(
            "--auto_batch on %s: no out-of-memory error to probe for; by the estimate, %d"
            " utterances of the longest (%d frames) fit in %.1f GiB",
            device.type,
            frames // longest,
            longest,
            budget / GIB,
        )
    else:
        if objective is None:  # (imported here, as the estimator's model: keep this module light)
            from ..model.asr import SpecAugment
            from .objective import Objective
            objective = Objective(spec_augment=SpecAugment())

        def runs(n: int) -> bool:
            feats = torch.randn(n, longest, model.cfg.n_mels, device=device)
            lens = torch.full((n,), longest, device=device)
            toks = torch.randint(3, model.cfg.vocab_size, (n, tokens), device=device)
            torch.cuda.reset_peak_memory_stats(device)
            try:
                with autocast():
                    out = objective(forward, feats, lens, toks,
                                    torch.full((n,), tokens, device=device))
                out.loss.backward()
                fits = torch.cuda.max_memory_allocated(device) + estimator.optimizer_bytes <= budget
            except (torch.OutOfMemoryError, RuntimeError) as e:
                if not is_out_of_memory(e):
                    raise
                fits = False
            out = feats = None
            model.zero_grad(set_to_none=True)
            free_memory(device)
            return fits

        # the probe leaves training's random draws alone
        with torch.random.fork_rng(devices=[device]):
            frames = largest_fitting(runs, limit=512) * longest
        log.info(
            "--auto_batch: %d utterances of the longest (%d frames) fit in %.1f GiB on %s"
            " (measured)",
            frames // longest,
            longest,
            budget / GIB,
            device,
        )
    if frames == 0:
        raise BatchDoesNotFit(
            f"--auto_batch: even one utterance of {longest} frames does not fit in "
            f"{budget / GIB:.1f} GiB; lower --max_duration or use the memory options"
        )
    return frames
