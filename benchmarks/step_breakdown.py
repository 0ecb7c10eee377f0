#!/usr/bin/env python3
"""Where a training step's time goes: the trainer end to end against the model alone, on the same
batches, side by side, and the trainer's step cut into its phases.

    python3 benchmarks/step_breakdown.py --corpus data/demo --presets tiny,small --steps 60 \\
        --out benchmarks/results/step_breakdown

For each preset, ``konkanivani-train`` runs in this process on ``--corpus`` (the CPU recipe's
settings, ``configs/cpu_small.yaml``, with the preset and any trainer flags given after the known
ones) for ``--steps`` optimizer steps. After each of its steps, inside the run's ``on_step``, the
**model alone** takes one step on the very batches the trainer's step took: a copy of the model
made after the first step, with an optimizer of its own (the trainer's kind), through the same
``forward_backward`` and ``optimizer_step`` and nothing else: no loader, no moving average, no
logging, no checks. Its random draws come from a forked generator, so the trainer trains as it
would alone. The two alternate step by step, so that a machine whose speed drifts slows both alike.

The trainer's step is the time from the end of one ``on_step`` to the start of the next: waiting
for the loader, the step, the moving average, the flag reads, the log line. Its phases are timed by
wrapping the trainer's own functions (``training.loop``'s names): ``data`` (the loader's
``next``), ``forward+backward`` (features, host-to-device and the model, ``forward_backward``),
``optimizer`` (unscale, clip, step, zero: ``optimizer_step``), ``step other`` (the rest of
``train_step``: the LR, the frozen-encoder check, the skip flags), ``empty_cache``, ``settle``
(reading the skip flags: a host sync), ``ema``, ``log``, and ``other`` (what is left: the sampler,
the bar, the callbacks). A validation or save inside a step is left out of it (there is none with
the defaults here). On CUDA each wrapper synchronizes the device to time its phase, which a plain
run does not: the phases then add up to more than an unwrapped step, and the rates compare the
trainer and the model as they are measured here. The first ``--warmup`` steps are not rated, nor
the last (the run ends on it, with no ``on_step`` after).

``table.md`` (per preset: utterances a second of each, their ratio, each one's step when it met
the batch first and when second, and each phase's milliseconds a step and share) and
``breakdown.json`` are written to ``--out`` (each preset's run in ``OUT/run/PRESET``, written over)
and the table printed. Compare rates only within one run: the machine's speed drifts between runs.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import shutil
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from konkanivani.cli.train import model_flags, parse_args  # noqa: E402
from konkanivani.config import TrainConfig, dataclass_from_args  # noqa: E402
from konkanivani.training import loop  # noqa: E402
from konkanivani.training import start as run_start  # noqa: E402
from konkanivani.training.precision import cpu_description  # noqa: E402
from konkanivani.training.step import forward_backward, optimizer_step  # noqa: E402

RECIPE = ROOT / "configs" / "cpu_small.yaml"
PHASES = ("data", "forward+backward", "optimizer", "step other", "empty_cache", "settle", "ema",
          "log", "other")
UNRATED = ("validate", "save")  # inside a step's interval, but not part of the step


class Clock:
    """Seconds per phase over the rated steps, and what the model alone took."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")  # the run's, from its first step
        self.rating = False
        self.phases: dict[str, float] = defaultdict(float)  # the rated steps'
        self.pending: dict[str, float] = defaultdict(float)  # the step in progress
        self.step_seconds: list[float] = []  # the trainer's, each rated step
        self.model_seconds: list[float] = []  # the model alone, each rated step
        self.model_first: list[bool] = []  # whether the model alone met the batch first
        self.utterances: list[int] = []
        self.alone: tuple[float, bool] = (0.0, False)  # the step in progress's model alone
        self.utterances_now = 0  # the step in progress's

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.sync()
                self.pending[name] += time.perf_counter() - start
        return wrapped

    def close_step(self, seconds: float, utterances: int) -> None:
        """The step in progress ends (``on_step``): rated, or dropped while warming up."""
        if self.rating:
            unrated = sum(self.pending.pop(name, 0.0) for name in UNRATED)
            self.step_seconds.append(seconds - unrated - self.alone[0])
            self.model_seconds.append(self.alone[0])
            self.model_first.append(self.alone[1])
            self.utterances.append(utterances)
            for name, value in self.pending.items():
                self.phases[name] += value
        self.pending.clear()


@contextlib.contextmanager
def instrumented(clock: Clock) -> Iterator[None]:
    """``training.loop``'s functions wrapped to time their phases, and ``train_step`` to give the
    model alone a step on the same batches, before the trainer's on odd steps and after it on even
    ones (the first to meet a batch meets its shapes first); put back afterwards."""
    names = {"forward_backward": "forward+backward", "optimizer_step": "optimizer",
             "maybe_empty_cache": "empty_cache", "settle": "settle", "_log_step": "log",
             "validate_and_save": "validate", "save": "save"}
    saved = {name: getattr(loop, name) for name in (*names, "train_step", "_timed")}
    alone: list[ModelAlone] = []
    inner = {name: clock.timed(phase, saved[name]) for name, phase in names.items()}

    def train_step(run: Any, micro: list[Any]) -> Any:
        if run.ema is not None and not getattr(run.ema, "_timed", False):
            run.ema.update_parameters = clock.timed("ema", run.ema.update_parameters)
            run.ema._timed = True
        clock.device = run.device
        clock.utterances_now = sum(len(b.indices) for b in micro)
        if not alone:
            alone.append(ModelAlone(run))
        first = run.step % 2 == 1
        if first:
            model_step(micro, first)
        start = time.perf_counter()
        before = sum(clock.pending[p] for p in ("forward+backward", "optimizer"))
        stats = saved["train_step"](run, micro)
        inside = sum(clock.pending[p] for p in ("forward+backward", "optimizer")) - before
        clock.pending["step other"] += time.perf_counter() - start - inside
        if not first:
            model_step(micro, first)
        return stats

    def model_step(micro: list[Any], first: bool) -> None:
        clock.sync()
        start = time.perf_counter()
        alone[0].step(micro)
        clock.sync()
        clock.alone = (time.perf_counter() - start, first)

    def timed_batches(batches: Any, *speeds: Any) -> Iterator[Any]:
        start = time.perf_counter()  # each batch's wait: from asking for it to having it
        for batch in saved["_timed"](batches, *speeds):
            clock.pending["data"] += time.perf_counter() - start
            yield batch
            start = time.perf_counter()

    try:
        for name, fn in inner.items():
            setattr(loop, name, fn)
        loop.train_step, loop._timed = train_step, timed_batches
        yield
    finally:
        for name, fn in saved.items():
            setattr(loop, name, fn)


class ModelAlone:
    """One step of a copy of the trainer's model on the trainer's batches: ``forward_backward`` and
    ``optimizer_step``, nothing else."""

    def __init__(self, run: Any):
        self.run = run
        self.model = copy.deepcopy(run.model)
        self.optimizer, _ = run_start._optimizer(run.cfg, self.model, run.precision, run.dist,
                                                 run.device)
        self.scaler = copy.deepcopy(run.scaler)

    def step(self, micro: list[Any]) -> None:
        run = self.run
        devices = [run.device] if run.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            # the step module's own functions, not the timed ones training.loop holds now
            stats = forward_backward(self.model, micro, run.device, run.precision, self.scaler,
                                     run.objective, run.step, dist=run.dist,
                                     frontend=run.frontend)
            if stats is not None:
                optimizer_step(self.model, self.optimizer, self.scaler, run.cfg.grad_clip,
                               torch.as_tensor(stats["loss"]))


def measure(preset: str, args: argparse.Namespace, extra: list[str], out: Path) -> dict[str, Any]:
    """The trainer and the model alone side by side for one preset, its run in ``out`` (an
    earlier one there removed: the folder is the benchmark's own)."""
    shutil.rmtree(out, ignore_errors=True)
    ns = parse_args(["--config", str(args.recipe), "--preset", preset,
                     "--train_manifest", str(args.corpus / "train.jsonl"),
                     "--valid_manifest", str(args.corpus / "valid.jsonl"),
                     "--output_dir", str(out), "--max_steps", str(args.steps),
                     "--validate_every_steps", "0", "--save_every_steps", "0",
                     "--log_every", str(args.log_every), "--seed", str(args.seed), *extra])
    cfg = dataclass_from_args(TrainConfig, ns)
    clock = Clock()
    last = [0.0]

    def on_step(step: int, epoch: int, model: Any) -> bool:
        clock.sync()
        clock.close_step(time.perf_counter() - last[0], clock.utterances_now)
        clock.rating = step >= args.warmup
        last[0] = time.perf_counter()
        return False

    with instrumented(clock):
        loop.train(cfg, model_flags(ns), on_step=on_step)
    return summarize(preset, clock)


def summarize(preset: str, clock: Clock) -> dict[str, Any]:
    steps, total = len(clock.step_seconds), sum(clock.step_seconds)
    timed = {p: clock.phases.get(p, 0.0) for p in PHASES if p != "other"}
    phases = {**timed, "other": max(0.0, total - sum(timed.values()))}
    utterances = sum(clock.utterances)
    trainer_rate = utterances / total if total else 0.0
    model_total = sum(clock.model_seconds)
    model_rate = utterances / model_total if model_total else 0.0
    return {"preset": preset, "steps": steps, "utterances": utterances,
            "trainer_utt_per_s": trainer_rate, "model_utt_per_s": model_rate,
            "trainer_vs_model": trainer_rate / model_rate if model_rate else 0.0,
            "trainer_ms_per_step": 1000 * total / max(steps, 1),
            "model_ms_per_step": 1000 * model_total / max(steps, 1),
            "phases_ms_per_step": {p: 1000 * s / max(steps, 1) for p, s in phases.items()},
            # each one's mean step when it met the batch first, and when second
            "first_ms": {"trainer": _mean(clock.step_seconds, clock.model_first, False),
                         "model": _mean(clock.model_seconds, clock.model_first, True)},
            "second_ms": {"trainer": _mean(clock.step_seconds, clock.model_first, True),
                          "model": _mean(clock.model_seconds, clock.model_first, False)},
            "phases_share": {p: s / total if total else 0.0 for p, s in phases.items()}}


def _mean(seconds: list[float], model_first: list[bool], which: bool) -> float:
    """Mean milliseconds of the steps whose ``model_first`` is ``which``."""
    picked = [s for s, first in zip(seconds, model_first) if first == which]
    return 1000 * sum(picked) / len(picked) if picked else 0.0


def table(rows: list[dict[str, Any]], header: str) -> str:
    lines = [header, "",
             "| preset | rated steps | trainer utt/s | model alone utt/s | trainer / model | "
             "trainer ms/step | model ms/step |", "|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['preset']} | {r['steps']} | {r['trainer_utt_per_s']:.1f} | "
              f"{r['model_utt_per_s']:.1f} | {100 * r['trainer_vs_model']:.1f}% | "
              f"{r['trainer_ms_per_step']:.1f} | {r['model_ms_per_step']:.1f} |" for r in rows]
    lines += ["", "Each one's step (ms) when it met the batch first and when it met it second, "
              "just after the other:", "",
              "| preset | trainer first | trainer second | model alone first | model alone "
              "second |",
              "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['preset']} | {r['first_ms']['trainer']:.1f} | "
              f"{r['second_ms']['trainer']:.1f} | {r['first_ms']['model']:.1f} | "
              f"{r['second_ms']['model']:.1f} |" for r in rows]
    lines += ["", "The trainer's step, phase by phase (ms a step, share of the step):", "",
              "| phase | " + " | ".join(r["preset"] for r in rows) + " |",
              "|---|" + "---:|" * len(rows)]
    for phase in PHASES:
        lines.append(f"| {phase} | " + " | ".join(
            f"{r['phases_ms_per_step'][phase]:.2f} ({100 * r['phases_share'][phase]:.1f}%)"
            for r in rows) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", type=Path, default=ROOT / "data" / "demo",
                        help="a folder with train.jsonl and valid.jsonl")
    parser.add_argument("--presets", default="tiny,small")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps a preset")
    parser.add_argument("--warmup", type=int, default=10, help="first steps not rated")
    parser.add_argument("--log_every", type=int, default=20, help="the trainer's --log_every")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--recipe", type=Path, default=RECIPE)
    parser.add_argument("--out", type=Path, required=True)
    args, extra = parser.parse_known_args(argv)
    if args.steps <= args.warmup:
        parser.error(f"--steps {args.steps}: want more than --warmup {args.warmup}")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for preset in args.presets.split(","):
        rows.append(measure(preset, args, extra, args.out / "run" / preset))
        print(json.dumps(rows[-1]), flush=True)
    header = (f"{args.steps} steps a preset ({args.warmup} not rated), the recipe "
              f"{args.recipe.name} on {args.corpus}; CPU: {cpu_description()}; torch "
              f"{torch.__version__}, {torch.get_num_threads()} threads")
    text = table(rows, header)
    (args.out / "table.md").write_text(text, encoding="utf-8")
    (args.out / "breakdown.json").write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
