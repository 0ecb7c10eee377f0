#!/usr/bin/env python3
"""Plan a run that fits a GPU: the estimated peak training memory per component, and the batch
budget, accumulation and options that fit with a safety margin.

    python training_scripts/plan_memory.py --preset large --gpu_gb 15
    python training_scripts/plan_memory.py --preset medium --gpu_gb 8 --seconds 20 --utterances_per_update 16
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from konkanivani.config import PRESETS, model_config_from_preset  # noqa: E402
from konkanivani.memory import GIB, MemoryEstimator  # noqa: E402

_MIB = 2 ** 20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="medium", choices=list(PRESETS))
    parser.add_argument("--gpu_gb", type=float, required=True, help="memory of the device, GiB")
    parser.add_argument("--seconds", type=float, default=20.0, help="longest utterance to plan for")
    parser.add_argument("--utterances_per_update", type=int, default=8, help="effective batch to keep")
    parser.add_argument("--vocab_size", type=int, default=128)
    parser.add_argument("--margin", type=float, default=0.25,
                        help="share of the device kept free (CUDA context, allocator slack, estimate error)")
    return parser.parse_args(argv)


def table(est: MemoryEstimator, batch: int, frames: int) -> str:
    parts = est.components(batch, frames)
    lines = [f"  {name:<34} {value / _MIB:>9.0f} MiB" for name, value in parts.items()]
    lines.append(f"  {'total':<34} {sum(parts.values()) / _MIB:>9.0f} MiB")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = model_config_from_preset(args.preset, vocab_size=args.vocab_size)
    longest = int(args.seconds * 100) + 1
    budget = args.gpu_gb * (1 - args.margin) * GIB
    print(f"preset {args.preset}: {MemoryEstimator(cfg).n_params / 1e6:.1f} M parameters; device {args.gpu_gb:g} GiB, "
          f"planning for {(1 - args.margin) * args.gpu_gb:.1f} GiB; utterances up to {args.seconds:g} s; "
          f"{args.utterances_per_update} utterances per update")
    print(f"\nbaseline, fp32 + AdamW, one {args.seconds:g} s utterance per micro-batch:")
    print(table(MemoryEstimator(cfg), 1, longest))

    options = [("fp32", "adamw", False), ("fp16", "adamw", False), ("fp16", "adamw_8bit", False),
               ("fp16", "adamw_8bit", True)]
    chosen = None
    print(f"\n{'precision':<10}{'optimizer':<12}{'checkpointing':<15}{'utterances/micro-batch':>24}"
          f"{'max_batch_frames':>18}{'accumulation':>14}")
    for precision, optimizer, ckpt in options:
        est = MemoryEstimator(cfg, precision, optimizer, ckpt)
        frames = est.max_frames(budget, longest)
        per_batch = min(frames // longest, args.utterances_per_update)
        accum = -(-args.utterances_per_update // per_batch) if per_batch else 0
        print(f"{precision:<10}{optimizer:<12}{'yes' if ckpt else 'no':<15}{per_batch:>24}{frames:>18}"
              f"{accum if per_batch else '-':>14}")
        # The fewest options that hold the most utterances per micro-batch (fewest accumulation steps).
        if per_batch and (chosen is None or per_batch > chosen[3]):
            chosen = (precision, optimizer, ckpt, per_batch, accum, est)
    if chosen is None:
        print(f"\nnot even one {args.seconds:g} s utterance fits: use a smaller preset or shorter utterances")
        return 1
    precision, optimizer, ckpt, per_batch, accum, est = chosen
    flags = f"--preset {args.preset} --max_batch_frames {per_batch * longest} --gradient_accumulation_steps {accum}"
    if precision != "fp32":
        flags += f" --precision {precision}"
    if optimizer != "adamw":
        flags += f" --optimizer {optimizer}"
    if ckpt:
        flags += " --gradient_checkpointing"
    print(f"\nrecommended (the fewest options for the most utterances per micro-batch):\n  {flags}")
    print(f"estimated peak {est.peak_bytes(per_batch, longest) / GIB:.2f} GiB of {args.gpu_gb:g} GiB:")
    print(table(est, per_batch, longest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
