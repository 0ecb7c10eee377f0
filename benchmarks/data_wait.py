#!/usr/bin/env python3
"""How long the training step waits for its data: several training sets mixed by weight
(``--train_mix``, the multilingual base's ten) beside one manifest, the same recipe and model.

Each case is a ``konkanivani-train`` run of ``--steps`` steps, one after the other, without
validation, logging every ``--log_every`` steps; the trainer's own ``data_wait`` (the share of the
step's wall time spent waiting for the loader, ``metrics.jsonl``) is read back from every logged
step after the first (the loader's start). Prints a table, writes ``table.md``, ``runs.csv`` and
``data_wait.png`` (each case's data wait over the steps) under ``--out``.

    python3 benchmarks/real_speech.py && konkanivani-demo-corpus --output_dir data/demo
    python3 benchmarks/data_wait.py --steps 200 --out benchmarks/results/data_wait
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

from konkanivani.checkpoint import METRICS_FILE  # noqa: E402
from konkanivani.training.metrics_log import read_metrics  # noqa: E402
from konkanivani.training.precision import cpu_description  # noqa: E402

CASES = {
    "ten sets mixed by weight": f"--config {ROOT / 'configs' / 'multilingual_base.yaml'}",
    "one manifest": f"--config {ROOT / 'configs' / 'cpu_small.yaml'}",
}
TARGET = 0.05  # issue's bound: data wait at most 5% of a step


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--log_every", type=int, default=10)
    p.add_argument("--flags", default="", help="more flags of every run (--num_workers 2, say)")
    return p.parse_args(argv)


def run_case(args: argparse.Namespace, name: str, flags: str) -> Path:
    """One training run of the case (again from the start: a run folder is replaced); its
    folder."""
    out = args.out / "runs" / name.replace(" ", "_")
    cmd = [sys.executable, "-m", "konkanivani.cli.train", *shlex.split(flags),
           "--max_steps", str(args.steps), "--validate_every_steps", "0", "--log_every",
           str(args.log_every), "--output_dir", str(out), "--overwrite",
           *shlex.split(args.flags)]
    print(f"{name}: {' '.join(cmd[3:])}", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f"{out.name}.log", "w", encoding="utf-8") as log:
        code = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    if code != 0:
        raise SystemExit(f"{name}: exit status {code}; see {out.parent}/{out.name}.log")
    return out


def waits(run: Path) -> list[tuple[int, float, float]]:
    """(step, data wait, seconds a step since the last logged step) of every logged training
    step after the first."""
    train = read_metrics(run / METRICS_FILE)["train"]
    return [(b["step"], b["data_wait"], (b["elapsed_s"] - a["elapsed_s"]) / (b["step"] - a["step"]))
            for a, b in zip(train, train[1:])]


def summary(name: str, points: list[tuple[int, float, float]]) -> dict[str, object]:
    shares = [w for _, w, _ in points]
    return {"case": name, "logged_steps": len(points),
            "mean_wait": statistics.fmean(shares), "median_wait": statistics.median(shares),
            "max_wait": max(shares), "over_target": sum(w > TARGET for w in shares),
            "s_per_step": statistics.fmean(s for _, _, s in points)}


def plot(out: Path, curves: dict[str, list[tuple[int, float, float]]]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for name, points in curves.items():
        ax.plot([s for s, _, _ in points], [100 * w for _, w, _ in points], marker=".", label=name)
    ax.axhline(100 * TARGET, color="grey", linestyle="--", label="5% of a step")
    ax.set_xlabel("step")
    ax.set_ylabel("data wait, % of the step")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.set_title(f"Data wait, {cpu_description()}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "data_wait.png", dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    curves = {name: waits(run_case(args, name, flags)) for name, flags in CASES.items()}
    rows = [summary(name, points) for name, points in curves.items()]
    with open(args.out / "runs.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    lines = [f"CPU: {cpu_description()}; {args.steps} steps a case, one after the other; data "
             f"wait from every {args.log_every}th step after the first", "",
             "| case | logged steps | mean data wait | median | max | over 5% | s a step |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['case']} | {r['logged_steps']} | {r['mean_wait']:.1%} | "
              f"{r['median_wait']:.1%} | {r['max_wait']:.1%} | {r['over_target']} | "
              f"{r['s_per_step']:.2f} |" for r in rows]
    text = "\n".join(lines) + "\n"
    (args.out / "table.md").write_text(text, encoding="utf-8")
    plot(args.out, curves)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
