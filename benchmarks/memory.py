#!/usr/bin/env python3
"""Peak training memory and step time of each memory option, alone and combined.

Each configuration trains a few optimizer steps on synthetic features in a process of its own, so
that peaks do not mix: ``torch.cuda.max_memory_allocated`` on a GPU, the peak resident set above
the process's start (``/proc/self/status`` VmHWM, reset before the model is built) on a CPU. All
configurations make the same update: 2 utterances of 15 s per optimizer step.

    nice -n 19 python3 benchmarks/memory.py                   # large and medium, table + PNG
    python3 benchmarks/memory.py --device cuda --seconds 20   # on a GPU

On a CPU the reduced precision is bf16 (fp16 autocast runs there but is slow and needs a scaler);
on CUDA it is fp16 with a GradScaler unless ``--half bf16``.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

_MIB = 2 ** 20


def worker(spec: dict) -> dict:
    """Train ``spec['steps']`` steps as ``spec`` says; return the peak memory and seconds per step."""
    import torch

    from konkanivani.config import model_config_from_preset
    from konkanivani.data import Batch
    from konkanivani.memory import MemoryEstimator, peak_rss_bytes, precision_name, reset_peak_rss, rss_bytes
    from konkanivani.model import ASRModel
    from konkanivani.optim import build_optimizer
    from konkanivani.precision import resolve_precision
    from konkanivani.train import forward_backward, optimizer_step

    torch.manual_seed(0)
    device = torch.device(spec["device"])
    cfg = model_config_from_preset(spec["preset"], vocab_size=spec.get("vocab", 128))
    utts, frames, tokens = spec["utterances"], spec["frames"], spec["tokens"]
    per_micro = spec.get("micro_batch") or utts
    feats = torch.randn(utts, frames, cfg.n_mels)
    token_ids = torch.randint(3, cfg.vocab_size, (utts, tokens))
    micro = []
    for i in range(0, utts, per_micro):
        idx = list(range(i, min(i + per_micro, utts)))
        micro.append(Batch(feats[idx], torch.full((len(idx),), frames), token_ids[idx],
                           torch.full((len(idx),), tokens), idx))
    precision = resolve_precision(device, False, spec["precision"])
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    else:
        base = rss_bytes()
        reset_peak_rss()
    model = ASRModel(cfg).to(device)
    model.set_gradient_checkpointing(spec["checkpointing"])
    optimizer, optimizer_name = build_optimizer(spec["optimizer"], model.parameters(), device, 1e-4, 0.01)
    scaler = torch.amp.GradScaler(device.type, enabled=precision.use_scaler)
    times = []
    for _ in range(spec["steps"]):
        start = time.perf_counter()
        forward_backward(model, micro, device, precision, scaler, spec_augment=True)
        optimizer_step(model, optimizer, scaler, grad_clip=5.0)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    peak = (torch.cuda.max_memory_allocated(device) if device.type == "cuda" else peak_rss_bytes()) - base
    estimate = MemoryEstimator(cfg, precision_name(precision), optimizer_name, spec["checkpointing"])
    return {"peak_mib": peak / _MIB, "step_s": sum(times[1:]) / max(1, len(times) - 1),
            "optimizer": optimizer_name,
            "estimate_mib": estimate.peak_bytes(per_micro, frames, tokens) / _MIB}


def measure(spec: dict, nice: bool = False) -> dict:
    """``worker(spec)`` in a fresh Python process."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if result.returncode:
        raise RuntimeError(f"benchmark worker failed for {spec}:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def configurations(half: str) -> list[tuple[str, dict]]:
    base = {"precision": "fp32", "optimizer": "adamw", "checkpointing": False, "micro_batch": 0}
    return [
        ("fp32 + AdamW + fixed batch 2 (baseline)", base),
        (f"--precision {half}", {**base, "precision": half}),
        ("--optimizer adamw_8bit", {**base, "optimizer": "adamw_8bit"}),
        ("--gradient_checkpointing", {**base, "checkpointing": True}),
        ("--max_batch_seconds 15 (1 x 15 s, 2 accumulated)", {**base, "micro_batch": 1}),
        ("all combined", {"precision": half, "optimizer": "adamw_8bit", "checkpointing": True, "micro_batch": 1}),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--presets", nargs="+", default=["large", "medium"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seconds", type=float, default=15.0, help="length of each utterance")
    parser.add_argument("--utterances", type=int, default=2, help="utterances per optimizer step")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps; the first is not timed")
    parser.add_argument("--half", default="", help="reduced precision: bf16 or fp16 (default: fp16 on CUDA, "
                                                   "bf16 elsewhere)")
    parser.add_argument("--plot", default=str(ROOT / "benchmarks" / "memory_cpu.png"))
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    half = args.half or ("fp16" if args.device.startswith("cuda") else "bf16")
    frames = int(args.seconds * 100)
    tokens = int(args.seconds * 5)
    what = "torch.cuda.max_memory_allocated" if args.device.startswith("cuda") else "peak RSS above process start"
    print(f"{args.utterances} x {args.seconds:g} s per optimizer step, {args.steps} steps, device {args.device}; "
          f"memory: {what}")
    rows = {}
    for preset in args.presets:
        print(f"\n{preset}\n| configuration | peak MiB | vs baseline | estimate MiB | step s | vs baseline |")
        print("| --- | --- | --- | --- | --- | --- |")
        for name, options in configurations(half):
            spec = {"device": args.device, "preset": preset, "utterances": args.utterances, "frames": frames,
                    "tokens": tokens, "steps": args.steps, **options}
            r = measure(spec)
            base = rows.get((preset, 0), r)
            rows[(preset, len([k for k in rows if k[0] == preset]))] = r
            note = "" if r["optimizer"] == options["optimizer"] else f" (ran {r['optimizer']})"
            print(f"| {name}{note} | {r['peak_mib']:.0f} | {r['peak_mib'] / base['peak_mib']:.2f}x | "
                  f"{r['estimate_mib']:.0f} | {r['step_s']:.2f} | {r['step_s'] / base['step_s']:.2f}x |", flush=True)
    _plot(rows, [n for n, _ in configurations(half)], args.presets, args.plot, what)
    print(f"\nplot: {args.plot}")


def _plot(rows: dict, names: list[str], presets: list[str], path: str, what: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(presets)
    for p, preset in enumerate(presets):
        values = [rows[(preset, i)]["peak_mib"] for i in range(len(names))]
        bars = ax.barh([i + p * width for i in range(len(names))], values, height=width, label=preset)
        ax.bar_label(bars, fmt="%.0f", fontsize=7, padding=2)
    ax.set_yticks([i + width * (len(presets) - 1) / 2 for i in range(len(names))], names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(f"peak training memory, MiB ({what})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
