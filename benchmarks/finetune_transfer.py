#!/usr/bin/env python3
"""Fine-tuning across languages against training from scratch, on the demo corpus.

The demo corpus's training utterances are read by espeak-ng's Hindi (``hi``) and Marathi (``mr``)
voices. This benchmark trains a model on the ``hi`` half with one tokenizer (``--pretrain_tokens``,
default 128 subword pieces), then trains on the ``mr`` half with another (``--tokens``, default
characters) twice, for the same number of steps: once from scratch, once with ``--init_from`` the
``hi`` model. Both validate on the ``mr`` half of the valid split
every few steps; the table and plot show their validation CER by step, and the last line says at
which step the fine-tuned run first reached the from-scratch run's final CER.

    python benchmarks/finetune_transfer.py --corpus data/demo --pretrain_steps 900 --steps 600 \\
        --out benchmarks/results/finetune python benchmarks/finetune_transfer.py --corpus data/demo
        --pretrain_tokens chars --tokens pieces ...

Every run is bounded by steps, so the result is the same on any machine (up to thread-count
rounding). Other flags go to every run (``konkanivani-train``), over ``configs/cpu_small.yaml``.
"""
from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from konkanivani.checkpoint import METRICS_FILE
from konkanivani.cli.train import model_flags, parse_args
from konkanivani.config import TrainConfig, dataclass_from_args
from konkanivani.data.manifest import read_manifest
from konkanivani.training.curves import write_csv
from konkanivani.training.loop import train
from konkanivani.training.metrics_log import read_metrics

RECIPE = ["--config", str(ROOT / "configs" / "cpu_small.yaml")]
TOKENS = {
    "chars": ["--tokenizer_type", "char"],
    "pieces": ["--tokenizer_type", "unigram", "--vocab_size", "128"],
}


def language_manifest(src: Path, out: Path, voice: str) -> Path:
    """The rows of `src` read by one espeak-ng language voice (``hi`` or ``mr``, any variant), with
    absolute audio paths."""
    rows = [{**row, "audio_filepath": str((src.parent / row["audio_filepath"]).resolve())}
            for _, row in read_manifest(src) if row["speaker"].split("+")[0] == voice]
    out.write_text(
        "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8"
    )
    return out


def run(
    out_dir: Path,
    train_manifest: Path,
    valid_manifest: Path,
    steps: int,
    every: int,
    extra: list[str],
) -> list:
    """Train for `steps` optimizer steps, validating every `every`; the valid rows of metrics.jsonl.
    A run
    that was interrupted is resumed (one that already reached `steps` stops at once)."""
    resume = ["--resume", "latest"] if (out_dir / "latest.pt").is_file() else []
    ns = parse_args(
        [
            "--train_manifest",
            str(train_manifest),
            "--valid_manifest",
            str(valid_manifest),
            "--output_dir",
            str(out_dir),
            *RECIPE,
            "--max_steps",
            str(steps),
            "--validate_every_steps",
            str(every),
            *extra,
            *resume,
        ]
    )
    train(dataclass_from_args(TrainConfig, ns), model_flags(ns))
    return read_metrics(out_dir / METRICS_FILE)["valid"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", type=Path, default=ROOT / "data" / "demo")
    parser.add_argument("--pretrain_steps", type=int, default=900, help="steps on the hi voices")
    parser.add_argument("--steps", type=int, default=600, help="steps of each run on the mr voices")
    parser.add_argument("--every", type=int, default=50, help="validate every N steps")
    parser.add_argument("--freeze_encoder_steps", type=int, default=0, help="of the fine-tuned run")
    parser.add_argument(
        "--pretrain_tokens", choices=TOKENS, default="pieces", help="tokenizer of the hi model"
    )
    parser.add_argument(
        "--tokens", choices=TOKENS, default="chars", help="tokenizer of both mr runs"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "finetune")
    args, extra = parser.parse_known_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    data = {
        (split, voice): language_manifest(
            args.corpus / f"{split}.jsonl", args.out / f"{split}_{voice}.jsonl", voice
        )
        for split in ("train", "valid")
        for voice in ("hi", "mr")
    }

    hi = args.out / f"hi_{args.pretrain_tokens}"
    hi_final = run(hi, data["train", "hi"], data["valid", "hi"], args.pretrain_steps, args.every,
                   [*TOKENS[args.pretrain_tokens], *extra])[-1]
    mr = (data["train", "mr"], data["valid", "mr"], args.steps, args.every)
    scratch = run(args.out / "mr_scratch", *mr, [*TOKENS[args.tokens], *extra])
    tuned = run(
        args.out / "mr_finetuned",
        *mr,
        [
            *TOKENS[args.tokens],
            "--init_from",
            str(hi / "latest.pt"),
            "--freeze_encoder_steps",
            str(args.freeze_encoder_steps),
            *extra,
        ],
    )

    print(
        f"\nvalidation CER (%) on the mr voices of {args.corpus / 'valid.jsonl'}, by optimizer"
        f" step; mr runs on {args.tokens}, the hi model on {args.pretrain_tokens}"
        f" ({args.pretrain_steps} steps, final validation CER {100 * hi_final['cer']:.2f}% on the"
        " hi voices)"
    )
    table = [
        {
            "step": a["step"],
            "cer_scratch": round(100 * a["cer"], 2),
            "cer_finetuned": round(100 * b["cer"], 2),
        }
        for a, b in zip(scratch, tuned, strict=True)
    ]
    print("| step | from scratch | fine-tuned from hi |")
    print("|------|--------------|--------------------|")
    for row in table:
        print(f"| {row['step']} | {row['cer_scratch']:.2f} | {row['cer_finetuned']:.2f} |")
    target = scratch[-1]["cer"]
    reached = next((r["step"] for r in tuned if r["cer"] <= target), None)
    print(
        f"\nfrom scratch: final CER {100 * target:.2f}% at step {scratch[-1]['step']}; fine-tuned: "
        + (
            f"reached it at step {reached} ({reached / scratch[-1]['step']:.0%} of the steps)"
            if reached
            else "did not reach it"
        )
    )
    write_csv(args.out / "finetune.csv", table)
    _plot(scratch, tuned, args.out / "finetune.png", args.tokens, args.pretrain_tokens)
    print(f"wrote {args.out / 'finetune.csv'}, {args.out / 'finetune.png'}")


def _plot(scratch: list, tuned: list, path: Path, tokens: str, pretrain_tokens: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for rows, label in ((scratch, f"from scratch ({tokens})"),
                        (tuned, f"fine-tuned from the hi model ({pretrain_tokens} -> {tokens})")):
        ax.plot([r["step"] for r in rows], [100 * r["cer"] for r in rows], "o-", label=label)
    ax.set_xlabel("optimizer step on the mr voices")
    ax.set_ylabel("validation CER % (mr voices)")
    ax.set_ylim(0, 105)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
