#!/usr/bin/env python3
"""How far a model gets on the demo corpus in a fixed wall-clock training budget.

Trains (by default the ``small`` preset on the CPU) and pauses every few minutes to score the
test split, whose sentences and voices never occur in training, with greedy CTC. Evaluation time
is not counted against the budget. At the end it scores every decoding method, on the final
weights and on the average of the last epoch checkpoints. Writes ``curve.csv``, ``final.csv`` and
``learning_curve.png`` to ``--out`` and prints the tables.

    python benchmarks/learning_curve.py --budget_minutes 30 --out benchmarks/results/learning_curve

Any other flag goes to the trainer (``konkanivani-train``), e.g. ``--batch_size 24 --lr 2e-3``, over
``configs/cpu_small.yaml``: the CPU recipe this benchmark measures.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import logging
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from konkanivani.checkpoint import (
    LATEST_FILE,
    TOKENIZER_FILE,
    TrainState,
    average_checkpoints,
    load_checkpoint,
    save_checkpoint,
    validated_wer,
)
from konkanivani.cli.train import model_flags, parse_args
from konkanivani.config import TrainConfig, dataclass_from_args
from konkanivani.data.tokenizer import Tokenizer
from konkanivani.datatools.corpus import default_options, make_corpus
from konkanivani.decoding.evaluation import evaluate_manifest
from konkanivani.decoding.recognizer import Recognizer
from konkanivani.decoding.settings import FUSED_METHODS, LM_WEIGHT, METHODS, DecodingConfig
from konkanivani.model.asr import ASRModel
from konkanivani.training.curves import text_table, write_csv
from konkanivani.training.loop import train
from konkanivani.training.run_files import step_checkpoints

# The CPU recipe (its reasons are in the file); --recipe names another, command-line flags override
# it.
RECIPE = ["--config", str(ROOT / "configs" / "cpu_small.yaml")]

log = logging.getLogger("konkanivani")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--corpus", type=Path, default=ROOT / "data" / "demo", help="made if missing"
    )
    parser.add_argument(
        "--recipe", type=Path, help="a recipe (YAML) instead of configs/cpu_small.yaml"
    )
    parser.add_argument("--target_cer", type=float, default=10.0,
                        help="report when the scored curve first reaches this test CER (percent)")
    parser.add_argument("--budget_minutes", type=float, default=30.0)
    parser.add_argument("--eval_every_minutes", type=float, default=3.0)
    parser.add_argument(
        "--budget_steps",
        type=int,
        default=0,
        help="a budget of optimizer steps instead of minutes (for tests: the same on any machine)",
    )
    parser.add_argument(
        "--eval_every_steps", type=int, default=0, help="with --budget_steps: score every N steps"
    )
    parser.add_argument(
        "--average_last", type=int, default=5, help="epoch checkpoints averaged at the end"
    )
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument(
        "--splits",
        default="test",
        help="corpus manifests the final weights are scored on, e.g. test,heldout,test_noisy",
    )
    parser.add_argument("--weights", default="final,training,average",
                        help="which weights the final scoring decodes: final (the EMA where the "
                             "run keeps one), training (the training weights beside an EMA), "
                             "average (of the last epoch checkpoints)")
    parser.add_argument("--beam_size", type=int, default=DecodingConfig.beam_size)
    parser.add_argument(
        "--decode_ctc_weight",
        type=float,
        default=DecodingConfig.ctc_weight,
        help="CTC weight of joint decoding and rescoring (--ctc_weight is the training loss's)",
    )
    parser.add_argument(
        "--lm",
        type=Path,
        help=(
            "a konkanivani-train-lm checkpoint fused into the final scoring "
            "(beam, attention, joint, rescore; greedy is scored without it)"
        ),
    )
    parser.add_argument("--lm_weight", type=float, default=LM_WEIGHT, help="with --lm")
    parser.add_argument(
        "--length_bonus", type=float, default=0.0, help="per token, in the fused methods"
    )
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks" / "results" / "learning_curve"
    )
    parser.add_argument("--evaluate_only", action="store_true",
                        help="skip training; score the checkpoints and curve already in --out")
    args, trainer_argv = parser.parse_known_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if not (args.corpus / "train.jsonl").is_file():
        make_corpus(args.corpus, **default_options())  # as konkanivani-demo-corpus makes it
    test_manifest = args.corpus / "test.jsonl"
    recipe = ["--config", str(args.recipe)] if args.recipe else RECIPE
    ns = parse_args(
        [
            "--train_manifest",
            str(args.corpus / "train.jsonl"),
            "--valid_manifest",
            str(args.corpus / "valid.jsonl"),
            "--output_dir",
            str(args.out / "run"),
            *recipe,
            *trainer_argv,
        ]
    )
    cfg = dataclass_from_args(TrainConfig, ns)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    budget, every = 60 * args.budget_minutes, 60 * args.eval_every_minutes
    curve: list[dict] = []
    clock = {"start": time.perf_counter(), "paused": 0.0, "next": every}

    def on_step(step: int, epoch: int, model: ASRModel) -> bool:
        trained = time.perf_counter() - clock["start"] - clock["paused"]
        if args.budget_steps:
            done = step >= args.budget_steps
            due = done or (args.eval_every_steps > 0 and step % args.eval_every_steps == 0)
        else:
            done = trained >= budget
            due = done or trained >= clock["next"]
        if due:
            clock["next"] += every
            paused = time.perf_counter()
            tokenizer = Tokenizer.load(Path(cfg.output_dir) / TOKENIZER_FILE)
            recognizer = Recognizer(model, tokenizer, next(model.parameters()).device)
            result = evaluate_manifest(recognizer, test_manifest, method="greedy")
            model.train()
            curve.append({"minutes": round(trained / 60, 2), "step": step, "epoch": epoch + 1,
                          "cer": round(100 * result.cer, 2), "wer": round(100 * result.wer, 2)})
            log.info(
                "learning curve: %.1f min, step %d: test CER %.2f%% WER %.2f%% (greedy)",
                trained / 60,
                step,
                100 * result.cer,
                100 * result.wer,
            )
            clock["paused"] += time.perf_counter() - paused
        return done

    if args.evaluate_only:  # the final scoring again, on the checkpoints of an earlier run
        with open(args.out / "curve.csv", encoding="utf-8") as f:
            curve = [
                {k: (float if k in ("minutes", "cer", "wer") else int)(v) for k, v in row.items()}
                for row in csv.DictReader(f)
            ]
    else:
        summary = train(cfg, model_flags(ns), on_step=on_step)
        # Ctrl-C or SIGTERM before the budget: nothing final to score
        if summary["stopped_by"] is not None:
            log.info(
                "stopped by %s before the budget: no final scoring (the points scored so far are"
                " above)",
                summary["stopped_by"],
            )
            stop = summary["stopped_by"]
            return 1 if stop == "--max_time" else 128 + signal.Signals[stop]
        write_csv(args.out / "curve.csv", curve)

    # ---- every decoding method on the final weights and on the average of the last epochs ----
    run = Path(cfg.output_dir)
    finals = [("final", run / LATEST_FILE)]
    latest = TrainState.load(run / LATEST_FILE)
    # "final" decodes the moving average (--ema_decay): the training weights too, saved as a run
    # without an average saves them
    if latest.ema_model:
        dataclasses.replace(latest, ema_model={}, ema_updates=0).save(
            run / "latest_training_weights.pt")
        finals = [("final (EMA)", run / LATEST_FILE),
                  ("final (training weights)", run / "latest_training_weights.pt")]
    # the saves validated at their own step: the ends of epochs
    epoch_ends = [p for step, p in step_checkpoints(run)
                  if validated_wer(load_checkpoint(p), step) is not None]
    if len(epoch_ends) >= 2 and args.average_last > 1:
        averaged = run / f"average_last{args.average_last}.pt"
        save_checkpoint(average_checkpoints(epoch_ends[-args.average_last:]), averaged)
        finals.append(
            (f"average of last {min(args.average_last, len(epoch_ends))} epochs", averaged)
        )
    kinds = {"final": "final", "final (EMA)": "final", "final (training weights)": "training"}
    wanted = set(args.weights.split(","))
    finals = [(name, path) for name, path in finals
              if kinds.get(name, "average") in wanted]
    rows = []
    for name, path in finals:
        rec = Recognizer.from_checkpoint(path, lm=args.lm)
        for split in args.splits.split(","):
            for method in args.methods.split(","):
                fused = method in FUSED_METHODS
                lm_weight = args.lm_weight if fused and args.lm else 0.0
                bonus = args.length_bonus if fused else 0.0
                result = evaluate_manifest(rec, args.corpus / f"{split}.jsonl", method=method,
                                           beam_size=args.beam_size,
                                           ctc_weight=args.decode_ctc_weight,
                                           lm_weight=lm_weight, length_bonus=bonus)
                rows.append(
                    {
                        "weights": name,
                        "split": split,
                        "method": method,
                        "cer": round(100 * result.cer, 2),
                        "wer": round(100 * result.wer, 2),
                        "rtf": round(result.rtf, 4),
                    }
                )
                log.info(
                    "%s, %s, %s: CER %.2f%% WER %.2f%% RTF %.4f",
                    name,
                    split,
                    method,
                    100 * result.cer,
                    100 * result.wer,
                    result.rtf,
                )
    write_csv(args.out / "final.csv", rows)
    _plot(curve, rows, args.out / "learning_curve.png",
          f"{args.budget_steps} steps" if args.budget_steps else f"{args.budget_minutes:g} min")

    print(
        f"\nTest split of {args.corpus} (sentences and voices unseen in training); training flags:",
        " ".join(recipe + trainer_argv),
    )
    print(
        text_table(
            curve,
            ["minutes", "step", "epoch", "cer", "wer"],
            ["train min", "step", "epoch", "CER %", "WER %"],
        )
    )
    reached = time_to_cer(curve, args.target_cer)
    print(
        f"test CER {args.target_cer:g}% (greedy, training weights) reached at "
        + (
            f"{reached:.2f} training minutes (interpolated between the scored points)"
            if reached is not None
            else "none of the scored points"
        )
    )
    print()
    print(text_table(rows, ["weights", "split", "method", "cer", "wer", "rtf"],
                 ["weights", "split", "decoding", "CER %", "WER %", "RTF"]))
    print(
        f"\nwrote {args.out / 'curve.csv'}, {args.out / 'final.csv'},"
        f" {args.out / 'learning_curve.png'}"
    )
    return 0


def time_to_cer(curve: list[dict], target: float) -> float | None:
    """The training minutes at which the curve first reaches ``target`` CER, interpolated linearly
    between the last point above it and the first at or below; None if no point reaches it.

    >>> rows = [{"minutes": 2, "cer": 30.0}, {"minutes": 4, "cer": 14.0},
    ...         {"minutes": 6, "cer": 6.0}]
    >>> time_to_cer(rows, 10)
    5.0
    """
    before = None
    for point in curve:
        if point["cer"] <= target:
            if before is None:
                return point["minutes"]
            share = (before["cer"] - target) / (before["cer"] - point["cer"])
            return before["minutes"] + share * (point["minutes"] - before["minutes"])
        before = point
    return None


def _plot(curve: list[dict], finals: list[dict], path: Path, budget: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, x, label in (
        (axes[0], "minutes", "training time (min)"),
        (axes[1], "step", "optimizer step"),
    ):
        ax.plot([r[x] for r in curve], [r["cer"] for r in curve], "o-", label="CER (greedy)")
        ax.plot([r[x] for r in curve], [r["wer"] for r in curve], "s-", label="WER (greedy)")
        ax.set_xlabel(label)
        ax.set_ylabel("% on the test split")
        ax.set_ylim(0, 105)
        ax.grid(alpha=0.3)
    best = min(
        (r for r in finals if r["method"] == "joint" and r["split"] == "test"),
        key=lambda r: r["wer"],
        default=None,
    )
    if best is not None:
        axes[0].scatter(
            [curve[-1]["minutes"]] * 2,
            [best["cer"], best["wer"]],
            marker="*",
            s=150,
            c="k",
            zorder=3,
            label=f"joint decoding ({best['weights']})",
        )
    axes[0].legend()
    fig.suptitle(
        f"Learning curve within a {budget} budget (test split: unseen sentences and voices)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
