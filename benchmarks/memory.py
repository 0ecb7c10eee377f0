#!/usr/bin/env python3
"""Peak training memory and step time of each memory option, alone and combined.

Each configuration trains a few optimizer steps on synthetic features in a process of its own, so
that peaks do not mix: ``torch.cuda.max_memory_allocated`` on a GPU, the peak resident set above
the process's start (``/proc/self/status`` VmHWM, reset before the model is built) on a CPU.
Before that start every process trains one step of a throwaway tiny model (``_warm_up``), so that
the libraries a first step loads are not counted as training memory. All configurations make the
same update: 2 utterances of 15 s per optimizer step. Every configuration runs ``--rounds`` times,
the configurations taken in turn, and the table gives the medians: on a machine whose speed
drifts from minute to minute, only step times measured side by side compare.

    nice -n 19 python3 benchmarks/memory.py --csv benchmarks/results/memory/cpu.csv  # table + PNG
    python3 benchmarks/memory.py --device cuda --seconds 20   # on a GPU

On a CPU the reduced precision is bf16 (fp16 autocast runs there but is slow and needs a scaler);
on CUDA it is fp16 with a GradScaler unless ``--half bf16``.
"""
from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_MIB = 2 ** 20


def worker(spec: dict) -> dict:
    """Train ``spec['steps']`` steps as ``spec`` says; return the peak memory and seconds per
    step."""
    import torch

    from konkanivani.config import model_config_from_preset
    from konkanivani.data.dataset import Batch
    from konkanivani.model.asr import ASRModel, SpecAugment
    from konkanivani.training.memory import (
        MemoryEstimator,
        peak_rss_bytes,
        precision_name,
        reset_peak_rss,
        rss_bytes,
    )
    from konkanivani.training.objective import Objective
    from konkanivani.training.optim import build_optimizer
    from konkanivani.training.precision import resolve_precision
    from konkanivani.training.step import forward_backward, optimizer_step

    torch.manual_seed(0)
    device = torch.device(spec["device"])
    cfg = model_config_from_preset(spec["preset"], vocab_size=spec.get("vocab", 128),
                                   subsampling_channels=spec.get("subsampling_channels"))
    utts, frames, tokens = spec["utterances"], spec["frames"], spec["tokens"]
    per_micro = spec.get("micro_batch") or utts
    # waveforms of `frames` feature frames (the step makes the features)
    samples = (frames - 1) * 160
    audio = 0.1 * torch.randn(utts, samples)
    token_ids = torch.randint(3, cfg.vocab_size, (utts, tokens))
    micro = []
    for i in range(0, utts, per_micro):
        idx = list(range(i, min(i + per_micro, utts)))
        micro.append(Batch(audio[idx], torch.full((len(idx),), samples), token_ids[idx],
                           torch.full((len(idx),), tokens), idx))
    precision = resolve_precision(device, False, spec["precision"])
    _warm_up(device, spec["precision"])
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    else:
        base = rss_bytes()
        reset_peak_rss()
    model = ASRModel(cfg).to(device)
    model.set_gradient_checkpointing(spec["checkpointing"])
    optimizer, optimizer_name = build_optimizer(
        spec["optimizer"], model.parameters(), device, 1e-4, 0.01
    )
    scaler = torch.amp.GradScaler(device.type, enabled=precision.use_scaler)

    def step() -> tuple[float, bool]:
        """One optimizer step: its seconds, and whether fp16's GradScaler skipped its update (it
        lowers its scale when it does)."""
        scale, start = scaler.get_scale(), time.perf_counter()
        forward_backward(model, micro, device, precision, scaler,
                         Objective(spec_augment=SpecAugment()),
                         offload_activations=spec.get("offload", False))
        optimizer_step(model, optimizer, scaler, grad_clip=5.0)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start, scaler.get_scale() < scale

    # Until fp16's GradScaler lets an update through (it starts at 2^16 and halves on each
    # overflow: the H100's rows skipped all 3), the optimizer has no states and the peak misses
    # them, as no training run's does after its first steps: those steps are not counted.
    warm_up = 0
    while scaler.is_enabled() and warm_up < 16 and step()[1]:
        warm_up += 1
    if warm_up:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        else:
            reset_peak_rss()
    times, skipped = [], 0
    for _ in range(spec["steps"]):
        seconds, was_skipped = step()
        times.append(seconds)
        skipped += was_skipped
    peak = (
        torch.cuda.max_memory_allocated(device) if device.type == "cuda" else peak_rss_bytes()
    ) - base
    estimate = MemoryEstimator(cfg, precision_name(precision), optimizer_name,
                               spec["checkpointing"], device)
    return {
        "peak_mib": peak / _MIB,
        "step_s": statistics.median(times[1:] or times),
        "optimizer": optimizer_name,
        "device": device.type,
        "skipped_updates": skipped,
        "warm_up_steps": warm_up,
        "estimate_mib": estimate.peak_bytes(per_micro, frames, tokens) / _MIB,
    }


def _warm_up(device, precision: str) -> None:
    """Load the code every configuration may need before the start reading, the same in all of
    them: one training step of a throwaway ``tiny`` model in fp32 and in ``precision``, with AdamW
    and with 8-bit AdamW. On a CPU the first step of a process maps about 200 MiB of libraries and
    kernels (bitsandbytes' import alone about as much); that is code, not training memory, and
    counting it in some rows and not in others would skew the comparison."""
    import torch

    from konkanivani.config import model_config_from_preset
    from konkanivani.data.dataset import Batch
    from konkanivani.model.asr import ASRModel, SpecAugment
    from konkanivani.training.objective import Objective
    from konkanivani.training.optim import build_optimizer
    from konkanivani.training.precision import resolve_precision
    from konkanivani.training.step import forward_backward, optimizer_step

    cfg = model_config_from_preset("tiny", vocab_size=32)
    batch = Batch(
        0.1 * torch.randn(1, 199 * 160),
        torch.tensor([199 * 160]),
        torch.randint(3, 32, (1, 10)),
        torch.tensor([10]),
        [0],
    )
    for name in dict.fromkeys(["fp32", precision]):
        prec = resolve_precision(device, False, name)
        scaler = torch.amp.GradScaler(device.type, enabled=prec.use_scaler)
        for optimizer in ("adamw", "adamw_8bit"):
            model = ASRModel(cfg).to(device)
            opt, _ = build_optimizer(optimizer, model.parameters(), device, 1e-4, 0.01)
            forward_backward(model, [batch], device, prec, scaler,
                             Objective(spec_augment=SpecAugment()))
            optimizer_step(model, opt, scaler, grad_clip=5.0)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def measure(spec: dict) -> dict:
    """``worker(spec)`` in a fresh Python process."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if result.returncode:
        raise RuntimeError(f"benchmark worker failed for {spec}:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def configurations(half: str, cuda: bool = False) -> list[tuple[str, dict]]:
    """(row name, options): the baseline, each option alone, all combined, and all but one of
    the two options that cost step time on a CPU; on CUDA also --offload_activations (alone, and
    instead of checkpointing in the combination)."""
    base = {"precision": "fp32", "optimizer": "adamw", "checkpointing": False, "micro_batch": 0}
    combined = {
        "precision": half,
        "optimizer": "adamw_8bit",
        "checkpointing": True,
        "micro_batch": 1,
    }
    offload = [
        ("--offload_activations", {**base, "offload": True}),
        (
            "all, offloading instead of checkpointing",
            {**combined, "checkpointing": False, "offload": True},
        ),
    ]
    return [
        ("fp32 + AdamW + fixed batch 2 (baseline)", base),
        (f"--precision {half}", {**base, "precision": half}),
        ("--optimizer adamw_8bit", {**base, "optimizer": "adamw_8bit"}),
        ("--gradient_checkpointing", {**base, "checkpointing": True}),
        ("--max_batch_seconds 15 (1 x 15 s, 2 accumulated)", {**base, "micro_batch": 1}),
        ("all combined", combined),
        ("all but --gradient_checkpointing", {**combined, "checkpointing": False}),
        (f"all but --precision {half}", {**combined, "precision": "fp32"}),
    ] + (offload if cuda else [])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--presets", nargs="+", default=["large", "medium"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seconds", type=float, default=15.0, help="length of each utterance")
    parser.add_argument("--utterances", type=int, default=2, help="utterances per optimizer step")
    parser.add_argument(
        "--steps", type=int, default=4, help="optimizer steps per run; the first is not timed"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help=(
            "runs of every configuration, taken in turn so that a slow minute of the machine "
            "falls on all of them; the table gives medians"
        ),
    )
    parser.add_argument(
        "--half",
        default="",
        help="reduced precision: bf16 or fp16 (default: fp16 on CUDA, bf16 elsewhere)",
    )
    parser.add_argument("--plot", default=str(ROOT / "benchmarks" / "memory_cpu.png"))
    parser.add_argument("--csv", default="", help="also write every run's figures here")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    half = args.half or ("fp16" if args.device.startswith("cuda") else "bf16")
    configs = configurations(half, cuda=args.device.startswith("cuda"))
    frames = int(args.seconds * 100)
    tokens = int(args.seconds * 5)
    what = (
        "torch.cuda.max_memory_allocated"
        if args.device.startswith("cuda")
        else "peak RSS above process start"
    )
    print(f"{args.utterances} x {args.seconds:g} s per optimizer step, {args.steps} steps per run, "
          f"{args.rounds} rounds, device {args.device}; memory: {what}", flush=True)
    runs: dict[tuple[str, int], list[dict]] = {}
    for preset in args.presets:
        for r in range(args.rounds):
            for i, (name, options) in enumerate(configs):
                spec = {
                    "device": args.device,
                    "preset": preset,
                    "utterances": args.utterances,
                    "frames": frames,
                    "tokens": tokens,
                    "steps": args.steps,
                    **options,
                }
                runs.setdefault((preset, i), []).append(measure(spec))
            print(f"{preset}: round {r + 1} of {args.rounds} done", file=sys.stderr, flush=True)
    rows = {key: _summary(results) for key, results in runs.items()}
    for preset in args.presets:
        base = rows[(preset, 0)]
        print(
            f"\n{preset}\n| configuration | peak MiB | vs baseline | estimate MiB | step s | vs"
            " baseline |"
        )
        print("| --- | --- | --- | --- | --- | --- |")
        for i, (name, options) in enumerate(configs):
            r = rows[(preset, i)]
            note = "" if r["optimizer"] == options["optimizer"] else f" (ran {r['optimizer']})"
            print(
                f"| {name}{note} | {r['peak_mib']:.0f} | {r['peak_mib'] / base['peak_mib']:.2f}x |"
                f" {r['estimate_mib']:.0f} | {r['step_s']:.2f} |"
                f" {r['step_s'] / base['step_s']:.2f}x |"
            )
    if args.csv:
        _write_csv(args.csv, runs, configs)
    _plot(rows, [n for n, _ in configs], args.presets, args.plot, what)
    print(f"\nplot: {args.plot}")


def _summary(results: list[dict]) -> dict:
    """Medians over the rounds of one configuration."""
    return {"peak_mib": statistics.median(r["peak_mib"] for r in results),
            "step_s": statistics.median(r["step_s"] for r in results),
            "estimate_mib": results[0]["estimate_mib"], "optimizer": results[0]["optimizer"]}


def _write_csv(path: str, runs: dict, configs: list) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(
            ["preset", "configuration", "round", "peak_mib", "estimate_mib", "step_s", "optimizer"]
        )
        for (preset, i), results in runs.items():
            for r, res in enumerate(results):
                out.writerow(
                    [
                        preset,
                        configs[i][0],
                        r + 1,
                        f"{res['peak_mib']:.1f}",
                        f"{res['estimate_mib']:.1f}",
                        f"{res['step_s']:.3f}",
                        res["optimizer"],
                    ]
                )


def _plot(rows: dict, names: list[str], presets: list[str], path: str, what: str) -> None:
    """Two panels: the peak memory of each configuration, and its step time against the
    baseline's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem_ax, time_ax) = plt.subplots(1, 2, figsize=(12, 5), sharey=True,
                                          gridspec_kw={"width_ratios": [3, 2]})
    width = 0.8 / len(presets)
    ticks = [i + width * (len(presets) - 1) / 2 for i in range(len(names))]
    for p, preset in enumerate(presets):
        at = [i + p * width for i in range(len(names))]
        peaks = [rows[(preset, i)]["peak_mib"] for i in range(len(names))]
        slow = [
            rows[(preset, i)]["step_s"] / rows[(preset, 0)]["step_s"] for i in range(len(names))
        ]
        bars = mem_ax.barh(at, peaks, height=width, label=preset, color=f"C{p}")
        mem_ax.bar_label(bars, fmt="%.0f", fontsize=7, padding=2)
        bars = time_ax.barh(at, slow, height=width, label=preset, color=f"C{p}")
        time_ax.bar_label(bars, fmt="%.2fx", fontsize=7, padding=2)
    mem_ax.set_yticks(ticks, names, fontsize=8)
    mem_ax.invert_yaxis()
    mem_ax.set_xlabel(f"peak training memory, MiB ({what})")
    mem_ax.legend()
    time_ax.axvline(1.0, color="gray", linewidth=0.8)
    time_ax.set_xlabel("step time / baseline step time (median of the rounds)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
