"""Plan a run that fits a GPU (``konkanivani-plan-memory``): the estimated peak training memory per
component, and the batch budget, accumulation and options that fit with a safety margin.

    konkanivani-plan-memory --preset large --gpu_gb 15
    konkanivani-plan-memory --preset medium --gpu_gb 8 --seconds 20 --utterances_per_update 16

The estimate is calibrated for the ``--device``: CUDA (the default; fitted to peaks measured on a
GPU) or the CPU (its resident memory, which peaks higher for the same step).
"""
from __future__ import annotations

import argparse
import sys

from ..config import DEFAULT_VOCAB_SIZE, PRESETS, model_config_from_preset
from ..data.frames import frames_of
from ..training.memory import CUDA_CALIBRATED_ON, GIB, MemoryEstimator
from . import Parser, setup_logging, tool

_MIB = 2 ** 20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="medium", choices=list(PRESETS))
    parser.add_argument("--gpu_gb", type=float, required=True, help="memory of the device, GiB")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="the kind of device to plan for, whose calibration the estimate uses "
                             "(default: cuda)")
    parser.add_argument("--seconds", type=float, default=20.0, help="longest utterance to plan for")
    parser.add_argument(
        "--utterances_per_update", type=int, default=8, help="effective batch to keep"
    )
    parser.add_argument("--vocab_size", type=int, default=DEFAULT_VOCAB_SIZE)
    parser.add_argument(
        "--margin",
        type=float,
        default=0.25,
        help="share of the device kept free (CUDA context, allocator slack, estimate error)",
    )
    args = parser.parse_args(argv)
    for name in ("gpu_gb", "seconds"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name} must be a positive number, got {getattr(args, name)}")
    for name in ("utterances_per_update", "vocab_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be a positive integer, got {getattr(args, name)}")
    if not 0.0 <= args.margin < 1.0:
        parser.error(f"--margin must be in [0, 1), got {args.margin}")
    return args


def table(est: MemoryEstimator, batch: int, frames: int) -> str:
    parts = est.components(batch, frames)
    lines = [f"  {name:<34} {value / _MIB:>9.0f} MiB" for name, value in parts.items()]
    lines.append(f"  {'total':<34} {sum(parts.values()) / _MIB:>9.0f} MiB")
    return "\n".join(lines)


@tool
def main(argv: list[str] | None = None) -> int:
    setup_logging()
    args = parse_args(argv)
    cfg = model_config_from_preset(args.preset, vocab_size=args.vocab_size)
    longest = frames_of(args.seconds)
    budget = args.gpu_gb * (1 - args.margin) * GIB
    print(
        f"preset {args.preset}: {MemoryEstimator(cfg).n_params / 1e6:.1f} M parameters; device"
        f" {args.gpu_gb:g} GiB, planning for {(1 - args.margin) * args.gpu_gb:.1f} GiB; utterances"
        f" up to {args.seconds:g} s ({longest} frames); {args.utterances_per_update} utterances per"
        " update"
    )
    cuda = args.device == "cuda"
    print(f"estimates calibrated on {f'CUDA ({CUDA_CALIBRATED_ON})' if cuda else 'a CPU'}")
    print(f"\nbaseline, fp32 + AdamW, one {args.seconds:g} s utterance per micro-batch:")
    print(table(MemoryEstimator(cfg, device=args.device), 1, longest))

    options = [("fp32", "adamw", False), ("fp16", "adamw", False), ("fp16", "adamw_8bit", False),
               ("fp16", "adamw_8bit", True)]
    chosen = None
    print(
        "\n--max_batch_frames below = utterances per micro-batch x the longest utterance's frames,"
        " the value to pass;\na micro-batch never needs more than --utterances_per_update"
        f" ({args.utterances_per_update}) utterances, even where the estimate allows more (last"
        " column)"
    )
    print(f"{'precision':<10}{'optimizer':<12}{'checkpointing':<15}{'utterances/micro-batch':>24}"
          f"{'max_batch_frames':>18}{'accumulation':>14}{'estimate allows':>17}")
    for precision, optimizer, ckpt in options:
        est = MemoryEstimator(cfg, precision, optimizer, ckpt, device=args.device)
        allowed = est.max_frames(budget, longest)
        per_batch = min(allowed // longest, args.utterances_per_update)
        accum = -(-args.utterances_per_update // per_batch) if per_batch else 0
        print(
            f"{precision:<10}{optimizer:<12}{'yes' if ckpt else 'no':<15}{per_batch:>24}"
            f"{per_batch * longest:>18}{accum if per_batch else '-':>14}{allowed:>17}"
        )
        # The fewest options that hold the most utterances per micro-batch (fewest accumulation
        # steps).
        if per_batch and (chosen is None or per_batch > chosen[3]):
            chosen = (precision, optimizer, ckpt, per_batch, accum, est)
    if chosen is None:
        print(
            f"\nnot even one {args.seconds:g} s utterance fits: use a smaller preset or shorter"
            " utterances"
        )
        return 1
    precision, optimizer, ckpt, per_batch, accum, est = chosen
    flags = (
        f"--preset {args.preset} --max_batch_frames {per_batch * longest}"
        f" --gradient_accumulation_steps {accum}"
    )
    if precision != "fp32":
        flags += f" --precision {precision}"
    if optimizer != "adamw":
        flags += f" --optimizer {optimizer}"
    if ckpt:
        flags += " --gradient_checkpointing"
    print(f"\nrecommended (the fewest options for the most utterances per micro-batch):\n  {flags}")
    print(
        f"estimated peak {est.peak_bytes(per_batch, longest) / GIB:.2f} GiB of {args.gpu_gb:g} GiB:"
    )
    print(table(est, per_batch, longest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
