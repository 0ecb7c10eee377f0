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
again. Each seed's results are kept in ``OUT/seed-S.json``, and ``OUT/table.md`` gives every
seed's (and their mean): each stage's CER on every split, the share of the gap to ``--full`` (a
``recipe_levers`` run on all the transcripts, same seed and budget) the pretraining recovers where
it is given, the pretraining's masked loss against chance (the log of its codebook's size), and the
seconds a step of the pretraining and of the scratch run (the same encoder, one after the other on
this machine); ``OUT/pretrain.png`` draws each seed's validation masked loss and each stage's mean
CER on every split. A second seed is the same command with ``--seed`` changed.
"""
from __future__ import annotations

import argparse
import json
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


def chance(pretrained: Path) -> float:
    """The masked loss of a uniform guess among the pretrained run's codes (nats a frame)."""
    import yaml

    config = yaml.safe_load((pretrained / "config.yaml").read_text(encoding="utf-8"))
    return math.log(config["model"]["codebook_size"])


def record(args: argparse.Namespace, stages: dict[str, Path], pretrained: Path) -> dict:
    """One seed's results, kept as ``OUT/seed-S.json`` so that a later seed's table holds them."""
    rec = {"seed": args.seed, "cpu": cpu_description(),
           "cers": {name: pseudo_labels.final_cers(run) for name, run in stages.items()},
           "masked": masked_losses(pretrained), "chance": chance(pretrained),
           "seconds": {"pretraining": seconds_a_step(pretrained),
                       "scratch": seconds_a_step(stages["scratch"] / "run")}}
    (args.out / f"seed-{args.seed}.json").write_text(json.dumps(rec, indent=1) + "\n",
                                                     encoding="utf-8")
    return rec


def records(out: Path) -> list[dict]:
    return sorted((json.loads(p.read_text(encoding="utf-8")) for p in out.glob("seed-*.json")),
                  key=lambda r: r["seed"])


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def table(args: argparse.Namespace, recs: list[dict]) -> str:
    """Each stage's CER on every split for each seed (and their mean), the share of the gap
    between scratch and full the pretraining recovers, the masked loss and the step times."""
    keys = [f"{s}_{m}" for s in SPLITS for m in ("greedy", "joint")]
    names = list(dict.fromkeys(name for r in recs for name in r["cers"]))
    seeds = [r["seed"] for r in recs]
    mean = {name: {k: _mean([r["cers"][name][k] for r in recs
                             if k in r["cers"].get(name, {})]) for k in keys} for name in names}
    lines = [f"CPU: {'; '.join(dict.fromkeys(r['cpu'] for r in recs))}; seeds "
             f"{', '.join(map(str, seeds))}; {args.labelled_share:.0%} of the training set "
             f"transcribed; pretraining {args.pretrain_steps} steps on all its audio, "
             f"{args.budget_steps} steps a fine-tune; final (EMA) weights, CER %", "",
             "| model | seed | " + " | ".join(keys) + " |", "|---" * (len(keys) + 2) + "|"]
    for name in names:
        rows = [(str(r["seed"]), r["cers"][name]) for r in recs if name in r["cers"]]
        if len(recs) > 1:
            rows.append(("mean", mean[name]))
        lines += [f"| {name} | {seed} | " + " | ".join(
            f"{cers.get(k, float('nan')):.2f}" for k in keys) + " |" for seed, cers in rows]

    def share(cers: dict[str, dict[str, float]], k: str) -> str:
        gap = cers["scratch"][k] - cers["full"][k]
        return f"{100 * (cers['scratch'][k] - cers['tuned'][k]) / gap:.0f}%" if gap else "no gap"

    if all("full" in r["cers"] for r in recs):
        lines += ["", "Share of the gap between scratch and full the pretraining recovers:", ""]
        for k in keys:
            each = ", ".join(f"{share(r['cers'], k)} (seed {r['seed']})" for r in recs)
            lines.append(f"- {k}: {each}" + (f"; of the means {share(mean, k)}"
                                             if len(recs) > 1 else ""))
    lines += ["", "Pretraining's validation masked loss (nats a masked frame):", ""]
    lines += [f"- seed {r['seed']} (chance log({round(math.exp(r['chance']))}) = "
              f"{r['chance']:.2f}): " + ", ".join(f"step {s} {v:.3f}" for s, v in r["masked"])
              for r in recs]
    lines += ["", "Seconds a step, pretraining and the scratch run (one after the other, the same "
              "encoder; the scratch run's decoder and CTC head beside it):", ""]
    lines += [f"- seed {r['seed']}: {r['seconds']['pretraining']:.3f} and "
              f"{r['seconds']['scratch']:.3f}" for r in recs]
    return "\n".join(lines) + "\n"


def plot(recs: list[dict], path: Path) -> None:
    """Left, each seed's pretraining validation masked loss by step (chance dashed); right, each
    stage's final joint CER on every split, the mean over the seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for r in recs:
        left.plot([s for s, _ in r["masked"]], [v for _, v in r["masked"]], marker="o",
                  label=f"masked loss, seed {r['seed']}")
    left.axhline(recs[0]["chance"], linestyle="--", color="grey",
                 label=f"chance, log({round(math.exp(recs[0]['chance']))})")
    left.set(xlabel="pretraining step", ylabel="nats a masked frame (valid)",
             title="pretraining on audio alone")
    left.legend()
    names = list(dict.fromkeys(name for r in recs for name in r["cers"]))
    width = 0.8 / len(SPLITS)
    for i, split in enumerate(SPLITS):
        right.bar([x + (i - (len(SPLITS) - 1) / 2) * width for x in range(len(names))],
                  [_mean([r["cers"][n][f"{split}_joint"] for r in recs
                          if f"{split}_joint" in r["cers"].get(n, {})]) for n in names], width,
                  label=split)
    right.set_xticks(range(len(names)), names, rotation=20)
    seeds = ", ".join(str(r["seed"]) for r in recs)
    right.set(ylabel="CER % (joint, final EMA weights)", title=f"each stage, mean of seeds {seeds}")
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
    record(args, stages, pretrained)
    recs = records(args.out)
    text = table(args, recs)
    (args.out / "table.md").write_text(text, encoding="utf-8")
    plot(recs, args.out / "pretrain.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
