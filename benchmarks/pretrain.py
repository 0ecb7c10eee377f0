#!/usr/bin/env python3
"""Pretraining on audio alone, measured: the encoder pretrained by masked prediction
(``konkanivani-train --pretrain``) on all of the demo corpus's training audio, then fine-tuned on a
transcribed share of it, against the same recipe trained on that share alone from scratch.

    python benchmarks/pretrain.py --pretrain_steps 1500 --budget_steps 1500 --seed 1234 \\
        --out benchmarks/results/pretrain

1. ``OUT/split/``: a seeded ``--labelled_share`` of ``train.jsonl`` with its text
   (``labelled.jsonl``; the split of ``benchmarks/pseudo_labels.py``) and every training utterance
   without its text (``audio.jsonl``), the validation split's likewise (``valid_audio.jsonl``).
2. ``pretrained/seed-S``: the CPU recipe's model (``configs/cpu_small.yaml``) pretrained
   ``--pretrain_steps`` on ``audio.jsonl`` (intermediate CTC, a term of text, off).
3. ``scratch`` and ``tuned``: ``benchmarks/learning_curve.py`` runs of the recipe on
   ``labelled.jsonl``, from scratch and from the pretrained ``best.pt`` (``--init_from``: its
   encoder), ``--budget_steps`` each, their final weights scored on test, the held-out voice and
   the noisy test split (``recipe_levers.run_one``).

``--tune_variant NAME=FLAGS`` adds a fine-tune from the same encoder with more flags
(``tuned_NAME``: ``--freeze_encoder_steps 100``, say), ``--scratch_variant NAME=FLAGS`` a run from
scratch with more flags (``scratch_NAME``): the same NAME in both compares the pretrained encoder
with a random one under those flags (``--freeze_encoder_steps`` the whole budget: a linear probe,
the CTC head on the frozen encoder, read by greedy decoding). A stage whose results exist is not run
again. ``OUT/table.md`` gives each stage's CER on every split, the share of the gap to ``--full``
(a ``recipe_levers`` run on all the transcripts, same seed and budget) the pretraining recovers
where it is given, and the seconds a step of the pretraining and of the scratch run (the same
encoder, one after the other on this machine); ``OUT/pretrain.png`` draws the pretraining's
validation masked loss and each stage's CER on every split.
"""
from __future__ import annotations

import argparse
import math
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import pseudo_labels  # noqa: E402
import recipe_levers  # noqa: E402

from konkanivani.checkpoint import METRICS_FILE  # noqa: E402
from konkanivani.training.metrics_log import read_metrics  # noqa: E402
from konkanivani.training.precision import cpu_description  # noqa: E402

SPLITS = pseudo_labels.SPLITS
RECIPE = ROOT / "configs" / "cpu_small.yaml"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", type=Path, default=ROOT / "data" / "demo")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--labelled_share", type=float, default=0.1)
    p.add_argument("--split_seed", type=int, default=0)
    p.add_argument("--pretrain_steps", type=int, default=1500)
    p.add_argument("--budget_steps", type=int, default=1500)
    p.add_argument("--eval_every_steps", type=int, default=500)
    p.add_argument("--pretrain_flags", default="", help="more flags of the pretraining run")
    p.add_argument("--tune_variant", action="append", default=[], metavar="NAME=FLAGS",
                   help="another fine-tune from the pretrained encoder, with these flags "
                   "(stage tuned_NAME); repeatable")
    p.add_argument("--scratch_variant", action="append", default=[], metavar="NAME=FLAGS",
                   help="another run from scratch, with these flags (stage scratch_NAME); "
                   "repeatable")
    p.add_argument("--full", type=Path, default=None,
                   help="a recipe_levers run on all the transcripts (same seed and budget)")
    return p.parse_args(argv)


def audio_only(rows_from: Path, out: Path, base: Path) -> Path:
    """``rows_from``'s rows without their text, audio paths absolute."""
    if not out.is_file():
        pseudo_labels._write_rows(out, [
            {"audio_filepath": str((base / r["audio_filepath"]).resolve()),
             "duration": r["duration"]} for r in pseudo_labels._rows(rows_from)])
    return out


def pretrain(args: argparse.Namespace, audio: Path, valid: Path) -> Path:
    """The pretraining run (resumed where a killed one stopped); its folder."""
    out = args.out / "pretrained" / f"seed-{args.seed}"
    if (out / "done").is_file():
        return out
    resume = ["--resume", "latest"] if (out / "latest.pt").is_file() else []
    cmd = [sys.executable, "-m", "konkanivani.cli.train", "--config", str(RECIPE), "--pretrain",
           "--train_manifest", str(audio), "--valid_manifest", str(valid), "--inter_ctc_weight",
           "0", "--max_steps", str(args.pretrain_steps), "--validate_every_steps",
           str(args.eval_every_steps), "--seed", str(args.seed), "--output_dir", str(out),
           *args.pretrain_flags.split(), *resume]
    print("pretrain:", " ".join(cmd[3:]), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f"seed-{args.seed}.log", "a", encoding="utf-8") as log:
        code = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
    if code != 0:
        raise SystemExit(f"pretraining: exit status {code}; see {out.parent}/seed-{args.seed}.log")
    (out / "done").write_text("")
    return out


def seconds_a_step(run: Path) -> float:
    """Training seconds a step between the first and the last logged steps of ``run`` (NaN once
    its folder is gone: the results of an earlier run kept without their checkpoints)."""
    if not (run / METRICS_FILE).is_file():
        return float("nan")
    train = [r for r in read_metrics(run / METRICS_FILE)["train"] if "elapsed_s" in r]
    first, last = train[0], train[-1]
    return (last["elapsed_s"] - first["elapsed_s"]) / max(last["step"] - first["step"], 1)


def masked_losses(run: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["masked"]) for r in read_metrics(run / METRICS_FILE)["valid"]]


def table(args: argparse.Namespace, stages: dict[str, Path], cers: dict[str, dict[str, float]],
          pretrained: Path, steps: list[tuple[int, float]]) -> str:
    keys = [f"{s}_{m}" for s in SPLITS for m in ("greedy", "joint")]
    lines = [f"CPU: {cpu_description()}; seed {args.seed}; {args.labelled_share:.0%} of the "
             f"training set transcribed; pretraining {args.pretrain_steps} steps on all its audio,"
             f" {args.budget_steps} steps a fine-tune; final (EMA) weights, CER %", "",
             "| model | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for name in stages:
        lines.append(f"| {name} | " + " | ".join(f"{cers[name].get(k, float('nan')):.2f}"
                                                for k in keys) + " |")
    if "full" in cers:
        lines += ["", "Share of the gap between scratch and full the pretraining recovers:", ""]
        for k in keys:
            gap = cers["scratch"][k] - cers["full"][k]
            lines.append(f"- {k}: {100 * (cers['scratch'][k] - cers['tuned'][k]) / gap:.0f}%"
                         if gap else f"- {k}: no gap")
    lines += ["", "Pretraining's validation masked loss (nats a masked frame; chance "
              "log(1024) = 6.93): " + ", ".join(f"step {s} {v:.3f}" for s, v in steps),
              "", f"Seconds a step: pretraining {seconds_a_step(pretrained):.3f}, the scratch "
              f"run {seconds_a_step(stages['scratch'] / 'run'):.3f} (one after the other, the "
              "same encoder; the scratch run's decoder and CTC head beside it)"]
    return "\n".join(lines) + "\n"


def plot(cers: dict[str, dict[str, float]], steps: list[tuple[int, float]], path: Path) -> None:
    """Left, the pretraining's validation masked loss by step (chance dashed); right, each stage's
    final joint CER on every split."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot([s for s, _ in steps], [v for _, v in steps], marker="o", label="masked loss")
    left.axhline(math.log(1024), linestyle="--", color="grey", label="chance, log(1024)")
    left.set(xlabel="pretraining step", ylabel="nats a masked frame (valid)",
             title="pretraining on audio alone")
    left.legend()
    names = list(cers)
    width = 0.8 / len(SPLITS)
    for i, split in enumerate(SPLITS):
        right.bar([x + (i - (len(SPLITS) - 1) / 2) * width for x in range(len(names))],
                  [cers[n].get(f"{split}_joint", float("nan")) for n in names], width,
                  label=split)
    right.set_xticks(range(len(names)), names, rotation=20)
    right.set(ylabel="CER % (joint, final EMA weights)", title="each stage")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    labelled, _ = pseudo_labels.split_corpus(args.corpus, args.out / "split",
                                             args.labelled_share, args.split_seed)
    audio = audio_only(args.corpus / "train.jsonl", args.out / "split" / "audio.jsonl",
                       args.corpus)
    valid = audio_only(args.corpus / "valid.jsonl", args.out / "split" / "valid_audio.jsonl",
                       args.corpus)
    pretrained = pretrain(args, audio, valid)
    la = recipe_levers.parse_args(
        ["--variant", "x=", "--budget_steps", str(args.budget_steps), "--eval_every_steps",
         str(args.eval_every_steps), "--corpus", str(args.corpus), "--out", str(args.out),
         "--splits", ",".join(SPLITS)])
    scratch = ["--train_manifest", str(labelled)]
    tuned = [*scratch, "--init_from", str(pretrained / "best.pt")]
    stages = {"scratch": recipe_levers.run_one(la, "scratch", scratch, args.seed),
              "tuned": recipe_levers.run_one(la, "tuned", tuned, args.seed)}
    for stage, start, variants in (("scratch", scratch, args.scratch_variant),
                                   ("tuned", tuned, args.tune_variant)):
        for variant in variants:
            name, _, flags = variant.partition("=")
            stages[f"{stage}_{name}"] = recipe_levers.run_one(
                la, f"{stage}_{name}", [*start, *shlex.split(flags)], args.seed)
    if args.full is not None:
        stages["full"] = args.full
    cers = {name: pseudo_labels.final_cers(run) for name, run in stages.items()}
    steps = masked_losses(pretrained)
    text = table(args, stages, cers, pretrained, steps)
    (args.out / "table.md").write_text(text, encoding="utf-8")
    plot(cers, steps, args.out / "pretrain.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
