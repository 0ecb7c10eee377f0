#!/usr/bin/env python3
"""Streaming on the demo corpus: what chunks cost one model trained for both, its latency on one CPU
thread, and the peak memory of an hour-long recording.

1. **Training** (``--steps``): two runs of the CPU recipe side by side, one thread each, for the
   same number of steps: a full-context model, and a streaming one (``--dynamic_chunk
   --causal_conv``).
2. **Accuracy**: CER and WER on ``--splits`` with attention rescoring (what a stream's final result
   is) for the streaming model at full context and at each of ``--chunks`` (encoder frames, 40 ms
   each), under the chunk mask: the text its streams give (tests/test_streaming_decode.py), batched.
   The full-context model beside it.
3. **Latency**, on one thread: ``--latency_utterances`` test utterances streamed in 100 ms pieces at
   each chunk size: compute time per chunk, real-time factor, and the time from the end of a word
   (the end of its last token's frame in the final result) to the first result that holds the word
   as the final result spells it (the audio that had come in by then, plus the compute of that
   piece, minus the word's end; one segment per utterance).
4. **Memory**: the peak resident memory of ``konkanivani-transcribe`` on a recording of
   ``--long_minutes`` (test clips joined), streamed (``--chunk_size``) and, for the full-context
   model, in windows; beside the whole-file decoding of shorter recordings (how it grows with the
   length). The memory of a process that only loads the model is the floor under all of them.

    python benchmarks/streaming.py --steps 3000 --out benchmarks/results/streaming

Each phase keeps what it wrote in ``--out`` (training resumes, a finished one is kept); ``--phases``
picks some. Other flags go to both training runs (``konkanivani-train``), over
``configs/cpu_small.yaml``.
"""
from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

import soundfile as sf
import torch

from konkanivani.checkpoint import LATEST_FILE, TrainState
from konkanivani.data.audio import load_audio
from konkanivani.data.frames import SAMPLE_RATE
from konkanivani.data.manifest import read_manifest, resolve_audio_path
from konkanivani.decoding.evaluation import evaluate_manifest
from konkanivani.decoding.recognizer import Recognizer
from konkanivani.training.curves import text_table, write_csv
from konkanivani.training.precision import cpu_description

RECIPE = ["--config", str(ROOT / "configs" / "cpu_small.yaml")]
STREAMING = ["--dynamic_chunk", "--causal_conv"]
PHASES = ("train", "accuracy", "latency", "memory")
PIECE = SAMPLE_RATE // 10  # 100 ms


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", type=Path, default=ROOT / "data" / "demo")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "streaming")
    parser.add_argument(
        "--steps", type=int, default=3000, help="optimizer steps of each training run"
    )
    parser.add_argument("--phases", default=",".join(PHASES))
    parser.add_argument("--splits", default="test,heldout,test_noisy")
    parser.add_argument(
        "--chunks", default="16,8,4", help="chunk sizes in encoder frames (40 ms each)"
    )
    parser.add_argument("--method", default="rescore", help="decoding of the accuracy table")
    parser.add_argument("--latency_utterances", type=int, default=40)
    parser.add_argument("--long_minutes", type=float, default=60.0)
    parser.add_argument(
        "--whole_minutes", default="1,2,4", help="recordings decoded whole, for the growth"
    )
    args, trainer_argv = parser.parse_known_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    phases = args.phases.split(",")
    chunks = [int(c) for c in args.chunks.split(",")]
    runs = {"full": args.out / "run_full", "streaming": args.out / "run_streaming"}
    if "train" in phases:
        train_side_by_side(args.corpus, runs, args.steps, trainer_argv)
    tables = []
    if "accuracy" in phases:
        rows = accuracy(args.corpus, runs, args.splits.split(","), chunks, args.method)
        write_csv(args.out / "accuracy.csv", rows)
        tables.append(text_table(rows, ["model", "chunk", "split", "cer", "wer"],
                             ["model", "chunk (frames)", "split", "CER %", "WER %"]))
    if "latency" in phases:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            rows = latency(
                args.corpus / "test.jsonl",
                runs["streaming"] / "latest.pt",
                chunks,
                args.latency_utterances,
            )
        finally:  # as it was: a caller in the same process (a test) trains on after it
            torch.set_num_threads(threads)
        write_csv(args.out / "latency.csv", rows)
        tables.append(
            text_table(
                rows,
                list(rows[0]),
                [
                    "chunk (frames)",
                    "chunk ms",
                    "compute per chunk ms (median)",
                    "p90",
                    "real-time factor",
                    "word end to partial ms (median)",
                    "p90",
                    "words",
                ],
            )
        )
    if "memory" in phases:
        rows = memory(args.corpus / "test.jsonl", runs, args.out, args.long_minutes,
                      [float(m) for m in args.whole_minutes.split(",")], chunks[0])
        write_csv(args.out / "memory.csv", rows)
        tables.append(text_table(rows, ["what", "minutes", "peak_mib", "seconds"],
                             ["decoding", "audio minutes", "peak RSS MiB", "wall s"]))
    _plot(args.out)
    print(f"\nCPU: {cpu_description()}, {os.cpu_count()} cores; torch {torch.__version__}")
    for table in tables:
        print("\n" + table)
    return 0


def train_side_by_side(corpus: Path, runs: dict[str, Path], steps: int, extra: list[str]) -> None:
    """Both runs at once, one thread each (a finished run is kept; an interrupted one resumes)."""
    procs = []
    for name, out in runs.items():
        if _steps_done(out) >= steps:
            continue
        resume = ["--resume", "latest"] if (out / "latest.pt").is_file() else []
        cmd = [
            sys.executable,
            "-m",
            "konkanivani.cli.train",
            *RECIPE,
            "--train_manifest",
            str(corpus / "train.jsonl"),
            "--valid_manifest",
            str(corpus / "valid.jsonl"),
            "--output_dir",
            str(out),
            "--max_steps",
            str(steps),
            *(STREAMING if name == "streaming" else []),
            *extra,
            *resume,
        ]
        procs.append(subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}))
    for proc in procs:
        if proc.wait() != 0:
            raise SystemExit(f"training failed: {' '.join(proc.args)}")


def _steps_done(out: Path) -> int:
    if not (out / LATEST_FILE).is_file():
        return 0
    return TrainState.load(out / LATEST_FILE).step


def accuracy(
    corpus: Path, runs: dict[str, Path], splits: list[str], chunks: list[int], method: str
) -> list[dict]:
    rows = []
    for model, chunk in [("full", 0), ("streaming", 0), *(("streaming", c) for c in chunks)]:
        rec = Recognizer.from_checkpoint(runs[model] / "latest.pt")
        for split in splits:
            result = evaluate_manifest(rec, corpus / f"{split}.jsonl", method=method,
                                       chunk_size=chunk)
            rows.append(
                {
                    "model": model,
                    "chunk": chunk or "full",
                    "split": split,
                    "cer": round(100 * result.cer, 2),
                    "wer": round(100 * result.wer, 2),
                }
            )
            print(rows[-1], flush=True)
    return rows


def latency(manifest: Path, checkpoint: Path, chunks: list[int], utterances: int) -> list[dict]:
    rec = Recognizer.from_checkpoint(checkpoint)
    wavs = [load_audio(resolve_audio_path(row["audio_filepath"], manifest.parent))
            for _, row in list(read_manifest(manifest))[:utterances]]
    rows = []
    for chunk in chunks:
        per_chunk, delays, compute, audio = [], [], 0.0, 0.0
        for wav in wavs:
            stream = rec.stream(chunk_size=chunk, endpoint_ms=0)
            # (when a result was out, had the audio come in real time; the result)
            seen, shown = 0, []
            for piece in [*wav.split(PIECE), None]:
                start = time.perf_counter()
                got = stream.accept(piece) if piece is not None else stream.finish()
                spent = time.perf_counter() - start
                seen += 0 if piece is None else len(piece)
                compute += spent
                chunks_done = sum(not r.is_final for r in got)
                if chunks_done:
                    per_chunk.append(spent / chunks_done)
                shown += [(seen / SAMPLE_RATE + spent, r) for r in got]
            audio += len(wav) / SAMPLE_RATE
            # A word is out at the first result that holds it whole, as the final result has it.
            final = shown[-1][1].words
            for i, word in enumerate(final):
                delays.append(
                    next(t for t, r in shown if len(r.words) > i and r.words[i].text == word.text)
                    - word.end
                )
        rows.append(
            {
                "chunk": chunk,
                "chunk_ms": chunk * 40,
                "chunk_compute_ms": round(1000 * statistics.median(per_chunk), 1),
                "chunk_compute_p90_ms": round(1000 * _quantile(per_chunk, 0.9), 1),
                "rtf": round(compute / audio, 4),
                "word_delay_ms": round(1000 * statistics.median(delays)),
                "word_delay_p90_ms": round(1000 * _quantile(delays, 0.9)),
                "words": len(delays),
            }
        )
        print(rows[-1], flush=True)
    return rows


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def memory(
    manifest: Path,
    runs: dict[str, Path],
    out: Path,
    long_minutes: float,
    whole_minutes: list[float],
    chunk: int,
) -> list[dict]:
    rows = []
    floor = _peak(
        [
            sys.executable,
            "-c",
            (
                "import sys; from konkanivani.decoding.recognizer import Recognizer; "
                "Recognizer.from_checkpoint(sys.argv[1])"
            ),
            str(runs["streaming"] / "latest.pt"),
        ]
    )
    rows.append({"what": "only loading the model", "minutes": 0, **floor})
    # decoded whole, as transcribe did before it read long files in pieces
    for minutes in whole_minutes:
        path = _recording(manifest, out / f"recording_{minutes:g}min.wav", minutes)
        code = (
            "import sys, torch; from konkanivani.decoding.recognizer import Recognizer; from"
            " konkanivani.data.audio import load_audio; rec ="
            " Recognizer.from_checkpoint(sys.argv[1]);"
            " print(rec.decode_waveforms([load_audio(sys.argv[2])], method='greedy')[0][:40])"
        )
        rows.append(
            {
                "what": "whole file (full-context model)",
                "minutes": minutes,
                **_peak([sys.executable, "-c", code, str(runs["full"] / "latest.pt"), str(path)]),
            }
        )
        print(rows[-1], flush=True)
    hour = _recording(manifest, out / "recording_long.wav", long_minutes)
    for what, model, flags in [
        (f"stream, chunks of {chunk} (streaming model)", "streaming", ["--chunk_size", str(chunk)]),
        ("windows of 20 s (full-context model)", "full", ["--method", "rescore"]),
    ]:
        cmd = [
            sys.executable,
            "-m",
            "konkanivani.cli.transcribe",
            str(runs[model] / "latest.pt"),
            str(hour),
            "--output",
            str(out / f"long_{model}.jsonl"),
            *flags,
        ]
        rows.append({"what": what, "minutes": long_minutes, **_peak(cmd)})
        print(rows[-1], flush=True)
    return rows


def _peak(cmd: list[str]) -> dict:
    """Run ``cmd`` alone (one thread); its peak resident memory (MiB) and wall time."""
    start = time.perf_counter()
    code = (
        "import resource, subprocess, sys; p = subprocess.run(sys.argv[1:],"
        " stdout=subprocess.DEVNULL); print(p.returncode,"
        " resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, *cmd],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    returncode, kib = map(int, done.stdout.split())
    if returncode != 0:
        raise SystemExit(f"failed ({returncode}): {' '.join(cmd)}")
    return {"peak_mib": round(kib / 1024), "seconds": round(time.perf_counter() - start, 1)}


def _recording(manifest: Path, path: Path, minutes: float) -> Path:
    """A recording of ``minutes``: the manifest's clips one after another, 0.5 s of silence between,
    from the first clip again when they run out (16-bit PCM, written block by block)."""
    if path.is_file() and sf.info(str(path)).duration >= 60 * minutes - 1:
        return path
    clips = [
        resolve_audio_path(row["audio_filepath"], manifest.parent)
        for _, row in read_manifest(manifest)
    ]
    target, written, pause = round(60 * minutes * SAMPLE_RATE), 0, torch.zeros(SAMPLE_RATE // 2)
    with sf.SoundFile(str(path), "w", SAMPLE_RATE, 1, "PCM_16") as f:
        i = 0
        while written < target:
            wav = torch.cat([load_audio(clips[i % len(clips)]), pause])[:target - written]
            f.write(wav.clamp(-1, 1).numpy())
            written += len(wav)
            i += 1
    return path


def _plot(out: Path) -> None:
    """streaming.png: CER by chunk size per split, and the latency by chunk size (what has been
    measured)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def rows(name: str) -> list[dict]:
        return (
            list(csv.DictReader(open(out / name, encoding="utf-8")))
            if (out / name).is_file()
            else []
        )

    accuracy, latency = rows("accuracy.csv"), rows("latency.csv")
    if not accuracy and not latency:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for split in dict.fromkeys(r["split"] for r in accuracy):
        points = [r for r in accuracy if r["split"] == split and r["model"] == "streaming"]
        axes[0].plot(
            [r["chunk"] for r in points],
            [float(r["cer"]) for r in points],
            "o-",
            label=f"{split}, streaming",
        )
        full = [float(r["cer"]) for r in accuracy if r["split"] == split and r["model"] == "full"]
        if full:
            axes[0].axhline(
                full[0],
                ls=":",
                c=axes[0].lines[-1].get_color(),
                label=f"{split}, full-context model",
            )
    axes[0].set_xlabel("chunk (encoder frames of 40 ms)")
    axes[0].set_ylabel("CER % (attention rescoring)")
    axes[0].legend(fontsize=7)
    if latency:
        ms = [int(r["chunk_ms"]) for r in latency]
        axes[1].plot(
            ms,
            [float(r["word_delay_ms"]) for r in latency],
            "o-",
            label="word end to partial (median)",
        )
        axes[1].plot(
            ms,
            [float(r["chunk_compute_ms"]) for r in latency],
            "s-",
            label="compute per chunk (median)",
        )
        axes[1].set_xlabel("chunk (ms)")
        axes[1].set_ylabel("ms, one CPU thread")
        axes[1].legend(fontsize=7)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "streaming.png", dpi=110)


if __name__ == "__main__":
    sys.exit(main())
