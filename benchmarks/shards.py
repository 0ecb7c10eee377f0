#!/usr/bin/env python3
"""Shards against loose files on a slow store, and 1 against 2 torchrun processes on shards.

A slow store is simulated the way a Drive mount behaves: every file open waits ``--latency_ms``
(20 ms by default) before it reads. Loose files pay it for every utterance (and for every row's
header when the manifest is checked at the start); shards pay it once per shard. Phases:

- ``write``: the corpus's train manifest as shards of ``--shard_size`` utterances (once; kept in
  OUT/shards);
- ``startup``: the manifest's row checks (one header read per row) under the latency, against the
  shard list (no open at all);
- ``loader``: the training DataLoader alone, consumed as fast as it gives (what a GPU would take):
  utterances per second from loose files and from shards, the same workers and frame budget;
- ``train``: a short training run on each, under the latency: data wait and steps per second;
- ``scaling``: 1 and 2 torchrun CPU processes training on the shards (one thread and one worker
  each): utterances per second and the scaling efficiency.

    python benchmarks/shards.py --corpus data/demo --out benchmarks/results/shards

Writes OUT/loader.csv, OUT/train.csv, OUT/scaling.csv and OUT/shards.png, and prints the tables.
Bounded: ``--utterances`` for the loader, ``--train_steps`` and ``--scaling_steps`` for training.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import os
import subprocess
import sys
import tarfile
import tempfile
import time
import types
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[1]

import torch

from konkanivani.checkpoint import METRICS_FILE
from konkanivani.config import TrainConfig
from konkanivani.data import dataset as dataset_module
from konkanivani.data import manifest as manifest_module
from konkanivani.data import shards as shards_module
from konkanivani.data.dataset import ASRDataset, load_utterances
from konkanivani.data.frames import frames_of
from konkanivani.data.manifest import read_manifest
from konkanivani.data.samplers import train_sampler
from konkanivani.data.shards import LIST_NAME, ShardPlan, ShardStream, open_shards
from konkanivani.data.tokenizer import train_tokenizer
from konkanivani.datatools.shard_writer import write_shards
from konkanivani.training.curves import text_table
from konkanivani.training.metrics_log import read_metrics
from konkanivani.training.precision import cpu_description
from konkanivani.training.start import _loader, _shard_loader

PHASES = ("write", "startup", "loader", "train", "scaling")
SCRIPT = ROOT / "training_scripts" / "train_konkanivani_asr.py"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", type=Path, default=ROOT / "data" / "demo")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "shards")
    p.add_argument("--phases", default=",".join(PHASES))
    p.add_argument(
        "--latency_ms", type=float, default=20.0, help="wait per file open (default: %(default)s)"
    )
    p.add_argument("--shard_size", type=int, default=200)
    p.add_argument(
        "--shard_dir", type=Path, help="where the shards are, or go (default: OUT/shards)"
    )
    p.add_argument(
        "--workers", type=int, default=2, help="DataLoader workers (default: %(default)s)"
    )
    p.add_argument("--max_batch_frames", type=int, default=20000)
    p.add_argument(
        "--utterances", type=int, default=1500, help="utterances the loader phase reads from each"
    )
    p.add_argument("--preset", default="small")
    p.add_argument("--train_steps", type=int, default=40)
    p.add_argument("--scaling_steps", type=int, default=30)
    p.add_argument(
        "--extra", default="", help="more training flags, in one string (the tests' tiny model)"
    )
    args = p.parse_args(argv)
    phases = set(args.phases.split(","))
    args.out.mkdir(parents=True, exist_ok=True)
    manifest = args.corpus / "train.jsonl"
    shard_dir = args.shard_dir or args.out / "shards"
    print(
        f"CPU: {cpu_description()}, {os.cpu_count()} cores; torch {torch.__version__}; corpus"
        f" {args.corpus}; {args.latency_ms:g} ms a file open"
    )
    if "write" in phases or not (shard_dir / LIST_NAME).is_file():
        start = time.perf_counter()
        report = write_shards(manifest, shard_dir, shard_size=args.shard_size, progress=False)
        size = sum(p.stat().st_size for p in shard_dir.glob("shard-*.tar"))
        print(
            f"wrote {report.shards} shards ({report.written} now) of {report.utterances}"
            f" utterances, {report.seconds / 3600:.2f} h, {size / 2 ** 20:.0f} MiB in"
            f" {time.perf_counter() - start:.1f} s"
        )
    tokenizer = train_tokenizer([row["text"] for _, row in read_manifest(manifest)], 128)
    if "startup" in phases:
        _startup(manifest, shard_dir, tokenizer, args)
    if "loader" in phases:
        rows = [_read(kind, manifest, shard_dir, tokenizer, args) for kind in ("loose", "shards")]
        rows.append({"store": "shards / loose", "utterances": "", "seconds": "", "opens": "",
                     "utt_per_s": round(rows[1]["utt_per_s"] / rows[0]["utt_per_s"], 1)})
        _write_csv(args.out / "loader.csv", rows)
        print(text_table(rows, ["store", "utterances", "seconds", "opens", "utt_per_s"],
                         ["loader alone", "utterances", "seconds", "file opens", "utterances/s"]))
    if "train" in phases:
        rows = [_train(kind, manifest, shard_dir, args) for kind in ("loose", "shards")]
        _write_csv(args.out / "train.csv", rows)
        print(text_table(rows, ["store", "steps", "steps_per_s", "utt_per_s", "data_wait_pct"],
                         ["training", "steps", "steps/s", "utterances/s", "data wait %"]))
    if "scaling" in phases:
        rows = [_scaling(n, shard_dir, args) for n in (1, 2)]
        rows[1]["efficiency"] = round(rows[1]["utt_per_s"] / (2 * rows[0]["utt_per_s"]), 2)
        _write_csv(args.out / "scaling.csv", rows)
        print(
            text_table(
                rows,
                ["processes", "steps", "utt_per_s", "efficiency"],
                ["torchrun processes (shards)", "steps", "utterances/s", "scaling efficiency"],
            )
        )
    _plot(args.out)
    return 0


# ---- the slow store ------------------------------------------------------------------------------

@contextlib.contextmanager
def slow_store(latency_s: float, counter: list[int]) -> Iterator[None]:
    """Every audio file a loose manifest opens, every header it checks and every shard opened waits
    ``latency_s`` first (DataLoader workers, forked inside the block, wait too)."""
    def slow(fn):
        def wrapped(*a, **k):
            counter[0] += 1
            time.sleep(latency_s)
            return fn(*a, **k)
        return wrapped

    saved = dataset_module.load_audio, manifest_module.sf, shards_module.tarfile
    dataset_module.load_audio = slow(saved[0])
    manifest_module.sf = types.SimpleNamespace(info=slow(saved[1].info), read=slow(saved[1].read))
    shards_module.tarfile = types.SimpleNamespace(
        open=slow(tarfile.open), TarError=tarfile.TarError
    )
    try:
        yield
    finally:
        dataset_module.load_audio, manifest_module.sf, shards_module.tarfile = saved


def _startup(manifest: Path, shard_dir: Path, tokenizer, args) -> None:
    opens = [0]
    with slow_store(args.latency_ms / 1000, opens):
        start = time.perf_counter()
        utts, _ = load_utterances(manifest, tokenizer)
        loose = time.perf_counter() - start
        start = time.perf_counter()
        shards = open_shards(str(shard_dir / LIST_NAME))
        listed = time.perf_counter() - start
    print(
        f"startup: checking the manifest's {len(utts)} rows {loose:.1f} s ({opens[0]} header"
        f" reads); the shard list ({len(shards)} utterances, {len(shards.shards)} shards)"
        f" {listed:.2f} s (no open)"
    )


def _cfg(**kw) -> TrainConfig:
    return TrainConfig(**kw)


def _read(kind: str, manifest: Path, shard_dir: Path, tokenizer, args) -> dict:
    cfg = _cfg(train_manifest=str(manifest), valid_manifest=str(manifest), num_workers=args.workers,
               max_batch_frames=args.max_batch_frames, seed=0)
    device = torch.device("cpu")
    with slow_store(args.latency_ms / 1000, [0]):
        if kind == "loose":
            utts, _ = load_utterances(manifest, tokenizer)
            sampler = train_sampler([u.duration for u in utts], 8, args.max_batch_frames, 0, 10)
            loader = _loader(ASRDataset(utts), sampler, cfg, device)
        else:
            shards = open_shards(str(shard_dir / LIST_NAME))
            plan = ShardPlan(
                shards,
                [frames_of(d) for d in shards.durations()],
                streams=args.workers,
                max_frames=args.max_batch_frames,
            )
            plan.set_epoch(0)
            loader = _shard_loader(ShardStream(plan, tokenizer, ASRDataset([])), cfg, device)
        count, touched, start = 0, set(), time.perf_counter()
        for batch in loader:
            count += len(batch)
            if kind == "shards":
                touched |= {shards.locate(i)[0] for i in batch.indices}
            if count >= args.utterances:
                break
        seconds = time.perf_counter() - start
        del loader
    return {
        "store": kind,
        "utterances": count,
        "seconds": round(seconds, 2),
        "opens": len(touched) if kind == "shards" else count,
        "utt_per_s": round(count / seconds, 1),
    }


def _train(kind: str, manifest: Path, shard_dir: Path, args) -> dict:
    from konkanivani.training.loop import train

    with tempfile.TemporaryDirectory() as tmp:
        data = (
            {"train_shards": str(shard_dir / LIST_NAME)}
            if kind == "shards"
            else {"train_manifest": str(manifest)}
        )
        extra = _flags(args.extra)
        cfg = _cfg(
            **data,
            valid_manifest=str(args.corpus / "valid.jsonl"),
            output_dir=tmp,
            preset=args.preset,
            num_workers=args.workers,
            max_batch_frames=args.max_batch_frames,
            max_steps=args.train_steps,
            log_every=max(1, args.train_steps // 10),
            progress=False,
            tensorboard=False,
            seed=0,
            vocab_size=128,
            **extra,
        )
        with slow_store(args.latency_ms / 1000, [0]):
            start = time.perf_counter()
            train(cfg)
        rows = read_metrics(Path(tmp) / METRICS_FILE)
    # the first summary holds the workers' start
    steps = rows["train"][1:]
    seconds = steps[-1]["elapsed_s"] - steps[0]["elapsed_s"]
    return {
        "store": kind,
        "steps": args.train_steps,
        "steps_per_s": round((steps[-1]["step"] - steps[0]["step"]) / seconds, 3),
        "utt_per_s": round(sum(r["utt_per_s"] for r in steps[1:]) / len(steps[1:]), 1),
        "data_wait_pct": round(100 * sum(r["data_wait"] for r in steps[1:]) / len(steps[1:]), 1),
        "wall_s": round(time.perf_counter() - start, 1),
    }


def _flags(extra: str) -> dict:
    out, words = {}, extra.split()
    for flag, value in zip(words[::2], words[1::2]):
        name = flag.lstrip("-")
        kind = type(getattr(TrainConfig(), name))
        out[name] = kind(value) if kind is not bool else value.lower() in ("1", "true", "yes")
    return out


def _scaling(processes: int, shard_dir: Path, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        flags = [
            "--train_shards",
            str(shard_dir / LIST_NAME),
            "--valid_manifest",
            str(args.corpus / "valid.jsonl"),
            "--output_dir",
            tmp,
            "--preset",
            args.preset,
            "--num_workers",
            "1",
            "--max_batch_frames",
            str(args.max_batch_frames),
            "--max_steps",
            str(args.scaling_steps),
            "--log_every",
            str(max(1, args.scaling_steps // 10)),
            "--no_progress",
            "--no_tensorboard",
            "--vocab_size",
            "128",
            "--no_preflight",
            *args.extra.split(),
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        launcher = (
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node",
                str(processes),
            ]
            if processes > 1
            else [sys.executable]
        )
        result = subprocess.run(
            [*launcher, str(SCRIPT), *flags], env=env, capture_output=True, text=True, timeout=3600
        )
        if result.returncode != 0:
            raise SystemExit(f"the {processes}-process run failed:\n{result.stderr[-3000:]}")
        rows = read_metrics(Path(tmp) / METRICS_FILE)["train"][1:]
    return {"processes": processes, "steps": args.scaling_steps,
            "utt_per_s": round(sum(r["utt_per_s"] for r in rows) / len(rows), 1), "efficiency": 1.0}


# ---- output --------------------------------------------------------------------------------------

def _write_csv(path: Path, rows: list[dict]) -> None:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, keys)
        writer.writeheader()
        writer.writerows(rows)


def _plot(out: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    panels = [
        (name, list(csv.DictReader(open(out / f"{name}.csv"))))
        for name in ("loader", "train", "scaling")
        if (out / f"{name}.csv").is_file()
    ]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.6), squeeze=False)
    for ax, (name, rows) in zip(axes[0], panels):
        rows = [
            r
            for r in rows
            if r.get("utterances", "x") != "" and r.get("store", "") != "shards / loose"
        ]
        labels = [r.get("store") or f"{r['processes']} proc" for r in rows]
        ax.bar(
            labels, [float(r["utt_per_s"]) for r in rows], color=["#999999", "#1f77b4"][: len(rows)]
        )
        ax.set_title(
            {"loader": "DataLoader alone", "train": "training", "scaling": "torchrun on shards"}[
                name
            ]
        )
        ax.set_ylabel("utterances / s")
        if name == "train":
            for i, r in enumerate(rows):
                ax.annotate(
                    f"data wait {r['data_wait_pct']}%",
                    (i, float(r["utt_per_s"])),
                    ha="center",
                    va="bottom",
                    fontsize=8,
                )
    fig.tight_layout()
    fig.savefig(out / "shards.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
