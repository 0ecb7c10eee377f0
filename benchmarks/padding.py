#!/usr/bin/env python3
"""What --pad_to_frames costs and buys on a manifest: for each N, the training batches of an epoch
(the trainer's sampler: --batch_size utterances of similar length, or a --max_batch_frames budget),
the share of their frames that is padding and how many distinct frame lengths they take (the
shapes cuDNN's autotuner and torch.compile meet). Counts only: nothing is trained or timed.

    python3 benchmarks/padding.py data/demo/train.jsonl --out benchmarks/results/padding/table.md
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from konkanivani.data.frames import (
    frames_of,  # noqa: E402
    padded_frames,  # noqa: E402
)
from konkanivani.data.manifest import read_manifest  # noqa: E402
from konkanivani.data.samplers import padding_fraction, train_sampler  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("manifest", type=Path)
    parser.add_argument("--multiples", default="0,25,50,100,200")
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--max_batch_frames", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    durations = [row["duration"] for _, row in read_manifest(args.manifest)]
    frames = [frames_of(d) for d in durations]
    lines = ["| batches | --pad_to_frames | batches an epoch | padding | frame lengths |",
             "|---|---:|---:|---:|---:|"]
    for what, budget in ((f"{args.batch_size} utterances", 0),
                         (f"--max_batch_frames {args.max_batch_frames}", args.max_batch_frames)):
        for n in map(int, args.multiples.split(",")):
            sampler = train_sampler(durations, args.batch_size, budget, args.seed, 10,
                                    pad_to_frames=n)
            sampler.set_epoch(1)
            batches = sampler.epoch_batches()
            lengths = {padded_frames(max(frames[i] for i in b), n) for b in batches}
            lines.append(f"| {what} | {n} | {len(batches)} | "
                         f"{100 * padding_fraction(batches, frames, n):.1f}% | {len(lengths)} |")
    table = "\n".join(lines) + "\n"
    print(table, end="")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(f"    python3 benchmarks/padding.py {args.manifest}\n\n" + table,
                            encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
