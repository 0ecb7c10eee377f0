#!/usr/bin/env python3
"""Re-measure the coefficients of konkanivani.training.memory's estimator on this machine.

1. Activations: for a grid of model shapes and lengths, count the bytes of the tensors autograd
   saves for the backward pass (``saved_tensors_hooks``, one forward pass, batch 2 minus batch 1
   so that weights and their autocast copies cancel), in fp32 and under bf16 autocast, and fit
   the coefficients of each term of ``_activation_terms`` by non-negative least squares.
2. Peak: train the presets a few steps in fresh processes (benchmarks/memory.py's worker), two
   micro-batches accumulated per step, and fit peak RSS = static + factor x activations +
   accumulation x parameter bytes + overhead.
3. Checkpointed peak: the same with --gradient_checkpointing (tiny, small and medium), fitting the
   factor of the subsampling activations, where those runs peak.

With ``--cuda_csv FILE`` it fits the CUDA figures instead (``CUDA_PEAK_FACTOR``,
``CUDA_CHECKPOINTED_SUBSAMPLING_FACTOR``, ``CUDA_OVERHEAD``), from peaks measured on a GPU and
written one a row (benchmarks/results/gpu/h100_memory_rows.csv: its comment lines say what each
column means), and prints each row's estimate / peak with the fitted figures and with memory.py's.
No GPU is needed for the fit; the rows come from one (benchmarks/gpu_report.py's memory part).

    nice -n 19 python3 benchmarks/calibrate_memory.py     # prints the values to paste into
    memory.py python3 benchmarks/calibrate_memory.py --cuda_csv
    benchmarks/results/gpu/h100_memory_rows.csv
"""
from __future__ import annotations

import argparse
import csv
import itertools
import sys
from pathlib import Path

import numpy as np
import torch
from scipy.optimize import nnls

ROOT = Path(__file__).resolve().parents[1]

from konkanivani.config import ModelConfig, model_config_from_preset
from konkanivani.model.asr import ASRModel, SpecAugment
from konkanivani.training import memory
from konkanivani.training.objective import Objective

SHAPES = [  # d_model, heads, ffn, encoder layers, decoder layers, vocabulary
    (32, 2, 64, 1, 1, 64), (64, 2, 256, 2, 1, 256), (48, 4, 96, 1, 2, 128), (96, 4, 192, 2, 2, 64),
]
LENGTHS = [(240, 6), (240, 40), (600, 30)]  # (frames, tokens)
HELD_OUT = [("tiny", 1000, 50), ("small", 800, 40)]  # checked against the fit, not used in it


def saved_bytes(model: ASRModel, batch: int, frames: int, tokens: int, half: bool) -> int:
    """Bytes of the distinct storages autograd saves in one forward pass."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    feats = torch.randn(batch, frames, model.cfg.n_mels)
    toks = torch.randint(3, model.cfg.vocab_size, (batch, tokens))
    lens, tok_lens = torch.full((batch,), frames), torch.full((batch,), tokens)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=half):
        Objective(spec_augment=SpecAugment())(model, feats, lens, toks, tok_lens)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in storages.items() if ptr not in params)


def _per_utterance(cfg: ModelConfig, frames: int, tokens: int) -> dict[bool, int]:
    torch.manual_seed(0)
    model = ASRModel(cfg).train()
    return {
        half: (
            saved_bytes(model, 2, frames, tokens, half)
            - saved_bytes(model, 1, frames, tokens, half)
        )
        for half in (False, True)
    }


def fit_activations() -> dict[str, dict[str, float]]:
    rows, targets = [], {False: [], True: []}
    for (d, h, f, le, ld, v), (frames, tokens) in itertools.product(SHAPES, LENGTHS):
        cfg = ModelConfig(
            vocab_size=v, d_model=d, n_heads=h, ffn_dim=f, encoder_layers=le, decoder_layers=ld
        )
        rows.append(list(memory._activation_terms(cfg, frames, tokens).values()))
        for half, n in _per_utterance(cfg, frames, tokens).items():
            targets[half].append(n)
    names = list(memory._activation_terms(ModelConfig(vocab_size=8), 100, 1))
    held_out = [
        (model_config_from_preset(p, vocab_size=128), frames, tokens)
        for p, frames, tokens in HELD_OUT
    ]
    held_out = [
        (cfg, frames, tokens, _per_utterance(cfg, frames, tokens))
        for cfg, frames, tokens in held_out
    ]
    out = {}
    for half in (False, True):
        a, b = np.array(rows, dtype=float), np.array(targets[half], dtype=float)
        # relative errors matter: weight each row by 1 / its size
        coef, _ = nnls(a / b[:, None], np.ones_like(b))
        err = np.abs(a @ coef / b - 1)
        checks = [
            abs(
                np.array(list(memory._activation_terms(cfg, frames, tokens).values()))
                @ coef
                / n[half]
                - 1
            )
            for cfg, frames, tokens, n in held_out
        ]
        print(
            f"{'half' if half else 'fp32'}: {len(b)} measurements, fit error mean {err.mean():.1%},"
            f" max {err.max():.1%}; held out (tiny, small presets): "
            + ", ".join(f"{c:.1%}" for c in checks)
        )
        out["half" if half else "fp32"] = {n: round(float(c), 3) for n, c in zip(names, coef)}
    return out


PEAK_RUNS = [("tiny", 4, 8), ("small", 2, 8), ("small", 1, 20), ("medium", 2, 8), ("medium", 1, 15),
             ("large", 1, 10), ("large", 1, 15)]  # (preset, utterances per micro-batch, seconds)


def _accumulated_spec(
    preset: str, utts: int, seconds: int, precision: str, checkpointing: bool
) -> dict:
    """A run of benchmarks/memory.py's worker: 2 micro-batches of ``utts`` utterances accumulated
    per optimizer step, as the training loop runs with --gradient_accumulation_steps 2 or more
    (the second micro-batch's backward pass adds to gradients that already exist)."""
    return {"device": "cpu", "preset": preset, "utterances": 2 * utts, "micro_batch": utts,
            "frames": seconds * 100, "tokens": seconds * 5, "steps": 2, "precision": precision,
            "optimizer": "adamw", "checkpointing": checkpointing}


def fit_peak(coeffs: dict[str, dict[str, float]]) -> tuple[float, float, float]:
    """Peak RSS = static + factor x activations + accumulation x parameter bytes + overhead,
    fitted by least squares on relative errors. Returns (factor, accumulation, overhead MiB)."""
    from memory import measure  # benchmarks/memory.py

    memory.ACTIVATION_COEFFS.update(coeffs)
    memory.PEAK_FACTOR, memory.ACCUMULATION_FACTOR, memory.PEAK_OVERHEAD = 1.0, 0.0, 0.0
    a, b = [], []
    for preset, utts, seconds in PEAK_RUNS:
        for precision in ("fp32", "bf16"):
            peak = (
                measure(_accumulated_spec(preset, utts, seconds, precision, False))["peak_mib"]
                * 2**20
            )
            est = memory.MemoryEstimator(
                model_config_from_preset(preset, vocab_size=128), precision
            )
            parts = est.components(utts, seconds * 100, seconds * 5)
            act = sum(v for k, v in parts.items() if k.startswith("activations"))
            static = sum(parts.values()) - act
            a.append(np.array([act, 4.0 * est.n_params, 1.0]) / peak)
            b.append((peak - static) / peak)
            print(f"{preset} 2 x {utts} x {seconds} s {precision}: peak {peak / 2 ** 20:.0f} MiB, "
                  f"static {static / 2 ** 20:.0f} MiB, activations {act / 2 ** 20:.0f} MiB")
    (factor, accumulation, overhead), *_ = np.linalg.lstsq(np.array(a), np.array(b), rcond=None)
    return round(float(factor), 3), round(float(accumulation), 3), round(float(overhead) / 2**20, 1)


def fit_checkpointed_subsampling(factor: float, accumulation: float, overhead_mib: float) -> float:
    """The factor of the subsampling activations in checkpointed runs, whose peak comes in the
    backward pass of the subsampling convolutions: least squares on what the rest leaves over."""
    from memory import measure  # benchmarks/memory.py

    memory.PEAK_FACTOR, memory.ACCUMULATION_FACTOR = factor, accumulation
    memory.PEAK_OVERHEAD = overhead_mib * 2 ** 20
    memory.CHECKPOINTED_SUBSAMPLING_FACTOR = 1.0  # so that the subsampling part is its bare size
    a, b = [], []
    for preset, utts, seconds in [
        ("tiny", 4, 8),
        ("small", 2, 8),
        ("small", 1, 20),
        ("medium", 1, 15),
    ]:
        for precision in ("fp32", "bf16"):
            frames, tokens = seconds * 100, seconds * 5
            peak = (
                measure(_accumulated_spec(preset, utts, seconds, precision, True))["peak_mib"]
                * 2**20
            )
            est = memory.MemoryEstimator(
                model_config_from_preset(preset, vocab_size=128), precision, checkpointing=True
            )
            parts = est.components(utts, frames, tokens)
            sub = parts["activations: subsampling"]
            a.append(sub)
            b.append(peak - (sum(parts.values()) - sub))
            print(
                f"{preset} 2 x {utts} x {seconds} s {precision}, checkpointed: peak"
                f" {peak / 2 ** 20:.0f} MiB, subsampling activations {sub / 2 ** 20:.0f} MiB"
            )
    a, b = np.array(a), np.array(b)
    return round(float(a @ b / (a @ a)), 3)


CUDA_COLUMNS = ("source", "configuration", "preset", "vocab_size", "conv_kernel", "precision",
                "optimizer", "checkpointing", "utterances", "micro_batches", "frames", "tokens",
                "align", "counted_from", "optimizer_states", "peak_mib")
INTEGER_COLUMNS = ("vocab_size", "conv_kernel", "checkpointing", "utterances", "micro_batches",
                   "frames", "tokens", "align", "optimizer_states")
COUNTED_FROM = ("warm_start", "process")
# the figures fitted, in the order of the columns of ``cuda_terms``
CUDA_FIGURES = ("CUDA_PEAK_FACTOR['fp32']", "CUDA_PEAK_FACTOR['half']",
                "CUDA_CHECKPOINTED_SUBSAMPLING_FACTOR", "CUDA_OVERHEAD (MiB)")


class BadRows(ValueError):
    """A CSV of CUDA peaks that cannot be used; the message names the file and the row."""


def read_cuda_rows(path: Path) -> list[dict]:
    """The rows of a CSV of CUDA peaks (lines starting with # are comments), values checked."""
    try:
        lines = [line for line in Path(path).read_text().splitlines() if not line.startswith("#")]
    except (OSError, UnicodeDecodeError) as e:
        raise BadRows(f"{path}: cannot be read ({e})") from e
    reader = csv.DictReader(lines)
    missing = [c for c in CUDA_COLUMNS if c not in (reader.fieldnames or [])]
    if missing:
        raise BadRows(f"{path}: no column {', '.join(missing)} (needs {', '.join(CUDA_COLUMNS)})")
    from konkanivani.config import OPTIMIZERS, PRECISIONS, PRESETS

    rows = []
    for number, raw in enumerate(reader, start=1):
        where = f"{path}: data row {number}"
        try:
            row = {**raw, **{k: int(raw[k]) for k in INTEGER_COLUMNS},
                   "peak_mib": float(raw["peak_mib"])}
        except (TypeError, ValueError) as e:
            raise BadRows(f"{where}: {e}") from e
        for key, allowed in (("preset", PRESETS), ("precision", PRECISIONS),
                             ("optimizer", OPTIMIZERS), ("counted_from", COUNTED_FROM)):
            if row[key] not in allowed:
                raise BadRows(f"{where}: {key} {row[key]!r} is not one of {', '.join(allowed)}")
        sizes = ("utterances", "micro_batches", "frames", "tokens", "align")
        if min(row[k] for k in sizes) < 1 or not row["peak_mib"] > 0:
            raise BadRows(f"{where}: {', '.join(sizes)} and peak_mib must be positive")
        rows.append(row)
    if not rows:
        raise BadRows(f"{path}: no rows")
    return rows


def _row_estimator(row: dict) -> memory.MemoryEstimator:
    cfg = model_config_from_preset(row["preset"], vocab_size=row["vocab_size"],
                                   conv_kernel=row["conv_kernel"])
    est = memory.MemoryEstimator(cfg, row["precision"], row["optimizer"],
                                 bool(row["checkpointing"]), device="cuda")
    est.align = row["align"]  # as the model padded when the row was measured
    return est


def measured_parts(row: dict) -> dict[str, float]:
    """The CUDA estimator's components for what ``row`` measured (with memory.py's figures): the
    peak it would have under that row's conditions. Three differ from a training run's estimate:
    a row counted from a warm start leaves out the workspaces its warm-up made (the runtime
    overhead); a row whose updates were all skipped had no optimizer states; and a single
    micro-batch without checkpointing peaks as its backward pass begins, before any gradient."""
    est = _row_estimator(row)
    parts = est.components(row["utterances"], row["frames"], row["tokens"])
    if row["counted_from"] == "warm_start":
        del parts["runtime overhead"]
    if not row["optimizer_states"]:
        del parts[f"optimizer ({est.optimizer})"]
    if row["micro_batches"] == 1 and not row["checkpointing"]:
        del parts["gradients"]
    return parts


def cuda_terms(row: dict) -> tuple[float, np.ndarray]:
    """``measured_parts`` as the bytes that the fitted figures leave alone, and the sizes they
    multiply (the columns of ``CUDA_FIGURES``): the bare activations in fp32 and in half
    precision, the checkpointed subsampling's, and 1 MiB of overhead where the row counts it."""
    parts = measured_parts(row)
    per_utterance = _row_estimator(row)._activations(row["frames"], row["tokens"])
    bare = {name: row["utterances"] * size for name, size in per_utterance.items()}
    sizes = np.zeros(len(CUDA_FIGURES))
    sizes[2] = bare.pop("subsampling") if row["checkpointing"] else 0.0
    sizes[0 if row["precision"] == "fp32" else 1] = sum(bare.values())
    sizes[3] = 2 ** 20 if "runtime overhead" in parts else 0.0
    fixed = sum(v for k, v in parts.items()
                if not k.startswith("activations") and k != "runtime overhead")
    return fixed, sizes


def fit_cuda(rows: list[dict]) -> np.ndarray:
    """The figures of ``CUDA_FIGURES`` by non-negative least squares on relative errors (each row
    weighted by 1 / its peak), rounded as memory.py keeps them."""
    a, b = [], []
    for row in rows:
        fixed, sizes = cuda_terms(row)
        peak = row["peak_mib"] * 2 ** 20
        a.append(sizes / peak)
        b.append((peak - fixed) / peak)
    figures, _ = nnls(np.array(a), np.array(b))
    return np.array([round(float(v), digits) for v, digits in zip(figures, (3, 3, 3, 1))])


def cuda_estimate(row: dict, figures: np.ndarray) -> float:
    """The estimate of ``row``'s peak in bytes with ``figures`` (those ``fit_cuda`` returns)."""
    fixed, sizes = cuda_terms(row)
    return fixed + float(sizes @ figures)


def main_cuda(path: Path) -> int:
    try:
        rows = read_cuda_rows(path)
    except BadRows as e:
        print(e, file=sys.stderr)
        return 2
    figures = fit_cuda(rows)
    print("\n".join(f"{name} = {value:g}" for name, value in zip(CUDA_FIGURES, figures)))
    print("\n| source | configuration | preset | precision | optimizer | checkpointing | "
          "utterances x micro-batches | peak MiB | fitted: estimate / peak | "
          "memory.py's: estimate / peak |\n" + "| --- " * 10 + "|")
    for row in rows:
        peak = row["peak_mib"] * 2 ** 20
        print(f"| {row['source']} | {row['configuration']} | {row['preset']} | "
              f"{row['precision']} | {row['optimizer']} | "
              f"{'yes' if row['checkpointing'] else 'no'} | "
              f"{row['utterances']} x {row['micro_batches']} | {row['peak_mib']:.0f} | "
              f"{cuda_estimate(row, figures) / peak:.3f} | "
              f"{sum(measured_parts(row).values()) / peak:.3f} |")
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cuda_csv", type=Path,
                        help="fit the CUDA figures to the peaks in this CSV instead")
    args = parser.parse_args()
    if args.cuda_csv:
        sys.exit(main_cuda(args.cuda_csv))
    coeffs = fit_activations()
    print("ACTIVATION_COEFFS =", coeffs)
    factor, accumulation, overhead_mib = fit_peak(coeffs)
    print(f"PEAK_FACTOR = {factor}\nACCUMULATION_FACTOR = {accumulation}\n"
          f"PEAK_OVERHEAD = {overhead_mib} * 2 ** 20")
    print(
        "CHECKPOINTED_SUBSAMPLING_FACTOR =",
        fit_checkpointed_subsampling(factor, accumulation, overhead_mib),
    )


if __name__ == "__main__":
    main()
