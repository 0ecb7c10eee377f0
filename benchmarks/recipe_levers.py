#!/usr/bin/env python3
"""Recipe variants side by side: each trained from the same corpus with each seed, one after the
other on the same machine, at the same step (or wall-clock) budget, and every split scored.

    python benchmarks/recipe_levers.py --budget_steps 1500 --seeds 1234,1235 \\
        --variant today= --variant interctc='--inter_ctc_weight 0.3' \\
        --out benchmarks/results/recipe_levers/full

Each ``--variant NAME=FLAGS`` is ``configs/cpu_small.yaml`` (or ``--recipe``) with FLAGS on top
(``today=`` is the recipe as it is). Every (variant, seed) is one run of
``benchmarks/learning_curve.py`` in a process of its own, into ``OUT/NAME/seed-S/``: its greedy test
CER every ``--eval_every_steps`` (or minutes), then the final weights (the EMA) scored on
``--splits`` with ``--methods``. A run whose ``final.csv`` exists is not run again, so a killed
benchmark goes on where it stopped. Then ``runs.csv`` (a row a run), ``table.md`` (each variant's
mean and both seeds, its seconds a step and its speed against the first variant) and ``levers.png``
(test CER against steps and against training minutes) are written to ``OUT`` and the table printed.

Seconds a step are training time alone (scoring paused), from the last scored point; compare them
only within one benchmark run (the machine's speed drifts between runs).
"""
from __future__ import annotations

import argparse
import csv
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from konkanivani.training.precision import cpu_description  # noqa: E402

CURVE = ROOT / "benchmarks" / "learning_curve.py"
SPLITS = "test,heldout,test_noisy"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                        help="a recipe variant: trainer flags over the recipe (repeat; the first "
                             "is the one the others are compared with)")
    parser.add_argument("--seeds", default="1234", help="comma-separated training seeds")
    parser.add_argument("--budget_steps", type=int, default=0, help="optimizer steps a run")
    parser.add_argument("--budget_minutes", type=float, default=0.0,
                        help="training minutes a run (instead of --budget_steps)")
    parser.add_argument("--eval_every_steps", type=int, default=250)
    parser.add_argument("--eval_every_minutes", type=float, default=3.0)
    parser.add_argument("--corpus", type=Path, default=ROOT / "data" / "demo")
    parser.add_argument("--recipe", type=Path, help="instead of configs/cpu_small.yaml")
    parser.add_argument("--splits", default=SPLITS)
    parser.add_argument("--methods", default="greedy,joint")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--table_only", action="store_true",
                        help="write the table and plot of the runs already in --out")
    args = parser.parse_args(argv)
    if bool(args.budget_steps) == bool(args.budget_minutes):
        parser.error("give --budget_steps or --budget_minutes")
    variants = []
    for spec in args.variant:
        name, sep, flags = spec.partition("=")
        if not sep or not name or "/" in name:
            parser.error(f"--variant {spec!r}: want NAME=FLAGS")
        variants.append((name, shlex.split(flags)))
    if not variants:
        parser.error("give at least one --variant (today= is the recipe as it is)")
    args.variants = variants
    args.seed_list = [int(s) for s in args.seeds.split(",")]
    return args


def run_one(args: argparse.Namespace, name: str, flags: list[str], seed: int) -> Path:
    """One variant with one seed, unless its results are there already."""
    out = args.out / name / f"seed-{seed}"
    if (out / "final.csv").is_file():
        print(f"{name} seed {seed}: done before, kept", flush=True)
        return out
    budget = (["--budget_steps", str(args.budget_steps), "--eval_every_steps",
               str(args.eval_every_steps)] if args.budget_steps else
              ["--budget_minutes", f"{args.budget_minutes:g}", "--eval_every_minutes",
               f"{args.eval_every_minutes:g}"])
    cmd = [sys.executable, str(CURVE), "--corpus", str(args.corpus), "--out", str(out),
           "--splits", args.splits, "--methods", args.methods, "--weights", "final", *budget,
           *(["--recipe", str(args.recipe)] if args.recipe else []), "--seed", str(seed),
           "--overwrite", *flags]
    print(f"{name} seed {seed}: {shlex.join(cmd[1:])}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "log.txt", "w", encoding="utf-8") as log:
        code = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
    if code != 0:
        raise SystemExit(f"{name} seed {seed}: exit status {code}; see {out / 'log.txt'}")
    return out


def _read(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return list(csv.DictReader(f))


def run_row(name: str, seed: int, out: Path) -> dict:
    """One run's figures: seconds a step, and the final weights' CER per split and method."""
    curve = _read(out / "curve.csv")
    last = curve[-1]
    row = {"variant": name, "seed": seed, "steps": int(last["step"]),
           "minutes": float(last["minutes"]),
           "s_per_step": round(60 * float(last["minutes"]) / int(last["step"]), 4)}
    for r in _read(out / "final.csv"):
        row[f"{r['split']}_{r['method']}"] = float(r["cer"])
    return row


def table(rows: list[dict], splits: list[str], methods: list[str]) -> str:
    """Markdown: a variant a row, each figure as the seeds' mean (each seed's after it)."""
    names = list(dict.fromkeys(r["variant"] for r in rows))
    keys = [f"{s}_{m}" for m in reversed(methods) for s in splits]
    head = ["variant", "seeds", "s/step", "speed vs first", *[f"{k} CER %" for k in keys]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    base = None
    for name in names:
        mine = [r for r in rows if r["variant"] == name]
        speed = statistics.mean(r["s_per_step"] for r in mine)
        base = base or speed
        cells = [name, ",".join(str(r["seed"]) for r in mine), f"{speed:.3f}",
                 f"{speed / base:.2f}x"]
        for key in keys:
            values = [r[key] for r in mine if key in r]
            cells.append(f"**{statistics.mean(values):.2f}** ("
                         + " / ".join(f"{v:.2f}" for v in values) + ")" if values else "n/a")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(args: argparse.Namespace, names: list[str], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    # one colour a variant: matplotlib's ten cycle, or twenty for more variants than that
    colors = [f"C{i}" for i in range(10)] if len(names) <= 10 else [
        plt.get_cmap("tab20")(i % 20) for i in range(len(names))]
    for i, name in enumerate(names):
        for j, seed in enumerate(args.seed_list):
            curve_file = args.out / name / f"seed-{seed}" / "curve.csv"
            if not curve_file.is_file():
                continue
            curve = _read(curve_file)
            for ax, x in ((axes[0], "step"), (axes[1], "minutes")):
                ax.plot([float(r[x]) for r in curve], [float(r["cer"]) for r in curve],
                        "o-" if j == 0 else "s--", color=colors[i],
                        label=name if j == 0 and x == "step" else None)
    for ax, label in ((axes[0], "optimizer step"), (axes[1], "training minutes")):
        ax.set_xlabel(label)
        ax.set_ylabel("test CER % (greedy, training weights)")
        ax.set_ylim(0, 60)
        ax.grid(alpha=0.3)
    fig.legend(loc="center right", fontsize="small")
    fig.suptitle("Recipe variants side by side (solid: first seed, dashed: second)")
    fig.tight_layout(rect=(0, 0, 0.8, 1))
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for seed in args.seed_list:  # seed by seed: a first table of every variant comes early
        for name, flags in args.variants:
            out = (args.out / name / f"seed-{seed}" if args.table_only
                   else run_one(args, name, flags, seed))
            if (out / "final.csv").is_file():
                rows.append(run_row(name, seed, out))
    if not rows:
        raise SystemExit(f"no finished run in {args.out}")
    rows.sort(key=lambda r: ([n for n, _ in args.variants].index(r["variant"]), r["seed"]))
    with open(args.out / "runs.csv", "w", newline="", encoding="utf-8") as f:
        fields = list(dict.fromkeys(k for r in rows for k in r))
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    text = table(rows, args.splits.split(","), args.methods.split(","))
    budget = (f"{args.budget_steps} steps" if args.budget_steps
              else f"{args.budget_minutes:g} minutes")
    flags = "\n".join(f"- `{n}`: `{shlex.join(f) or '(the recipe as it is)'}`"
                      for n, f in args.variants)
    (args.out / "table.md").write_text(
        f"{budget} a run; final weights (EMA); CPU: {cpu_description()}"
        f"\n\n{text}\n\n{flags}\n", encoding="utf-8")
    plot(args, [n for n, _ in args.variants], args.out / "levers.png")
    print(text)
    print(f"wrote {args.out / 'runs.csv'}, {args.out / 'table.md'}, {args.out / 'levers.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
