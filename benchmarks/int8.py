#!/usr/bin/env python3
"""int8 exports beside float ones: test CER, file sizes and the real-time factor on one CPU thread,
offline (whole files through model.onnx) and streaming (chunk by chunk through encoder_chunk.onnx).

1. **Export** (``export``): the checkpoint (a streaming one, trained with --causal_conv) exported
   with ``--streaming`` as ``konkanivani-export`` does, float (``fp32``) and with ``--quantize
   int8`` (``int8``), into ``--out``/run/. ``int8_conv`` is the int8 export with the convolutions
   quantized too (``quantize_onnx(..., op_types=("MatMul", "Conv"))``): what the export leaves out,
   measured to show why.
2. **Accuracy** (``accuracy``): CER and WER on ``--split`` through ``ExportedRecognizer``, each
   file decoded alone (as the server decodes an upload: int8 quantizes a batch's activations with
   one scale, so a batch would mix its files) with ``--method`` (beam search by default), offline
   and streamed in the export's chunks. File sizes, and the bytes of the weights alone.
3. **Speed** (``speed``), on one thread (torch and onnxruntime): ``--speed_utterances`` files of the
   split, ``--repeats`` times, the variants interleaved (each file goes through every variant in
   turn, the order rotating from file to file), after a warm-up of each. Offline: the time of
   model.onnx on the whole file (the part int8 changes) and of the whole decoding
   (``decode_waveforms``: features, model and ``--speed_method`` search); streaming: the time of
   encoder_chunk.onnx over the chunks and of the whole stream (100 ms pieces through
   ``Stream.accept``, then ``finish``). Each over the seconds of audio: real-time factors.

    python benchmarks/int8.py --out benchmarks/results/int8
    python benchmarks/int8.py --untrained large --phases export,speed --variants fp32,int8 \
        --out benchmarks/results/int8/large_untrained

``--untrained PRESET`` measures the speed of a wider model than the trained one: an untrained
streaming model of that preset (speed does not depend on the weights' values).

Writes sizes.csv, accuracy.csv and speed.csv into ``--out``, and their tables, the CPU and the
checkpoint into tables_PHASES.md (and prints them). Speed figures are only comparable within one
run (and one CPU); measure them on a quiet machine.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

import onnx
import onnxruntime
import torch

from konkanivani.checkpoint import InferenceModel, SaveRecord, load_checkpoint
from konkanivani.config import ModelConfig, model_config_from_preset
from konkanivani.data.audio import load_audio
from konkanivani.data.frames import SAMPLE_RATE
from konkanivani.data.manifest import read_manifest, resolve_audio_path
from konkanivani.decoding.metrics import error_rates
from konkanivani.decoding.model_export import (
    FILES,
    STREAMING_FILES,
    Streaming,
    export_checkpoint,
    quantize_onnx,
)
from konkanivani.decoding.onnx_recognizer import ExportedRecognizer
from konkanivani.model.asr import ASRModel
from konkanivani.training.curves import text_table, write_csv
from konkanivani.training.precision import cpu_description

PHASES = ("export", "accuracy", "speed")
VARIANTS = ("fp32", "int8", "int8_conv")
GRAPHS = (FILES["onnx"], STREAMING_FILES["onnx"])
PIECE = SAMPLE_RATE // 10  # 100 ms: what a client sends at a time
# the CPU flags that decide onnxruntime's int8 kernels (VNNI: u8 x s8 dot products in one step)
INT8_FLAGS = ("avx2", "avx512_vnni", "avx_vnni", "amx_int8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path,
                        default=ROOT / "checkpoints" / "streaming_small" / "best.pt")
    parser.add_argument("--corpus", type=Path, default=ROOT / "data" / "demo")
    parser.add_argument("--split", default="test")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "int8")
    parser.add_argument("--phases", default=",".join(PHASES))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--method", default="beam", help="the search of the accuracy table")
    parser.add_argument("--speed_method", default="greedy", help="the search of the speed table")
    parser.add_argument("--utterances", type=int, default=0,
                        help="files of the split in the accuracy table (0: all)")
    parser.add_argument("--speed_utterances", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--untrained", metavar="PRESET",
                        help="speed alone: an untrained streaming model of this preset (large, "
                             "say), with --checkpoint's vocabulary, CMVN mode and front-end")
    args = parser.parse_args(argv)
    phases, variants = args.phases.split(","), args.variants.split(",")
    unknown = sorted(set(phases) - set(PHASES)) + sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown phases or variants: {', '.join(unknown)}")
    if args.untrained and "accuracy" in phases:
        parser.error("--untrained measures speed alone: --phases export,speed")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.untrained:
        args.checkpoint = untrained(args.checkpoint, args.untrained, args.out / "run")
    folders = {v: args.out / "run" / v for v in variants}
    torch.set_num_threads(1)  # the runners give onnxruntime torch's thread count

    described = describe(args.checkpoint)
    print(described, flush=True)
    if "export" in phases:
        export(args.checkpoint, folders)
    manifest = args.corpus / f"{args.split}.jsonl"
    tables = []
    if "accuracy" in phases:
        rows = sizes(folders)
        write_csv(args.out / "sizes.csv", rows)
        tables.append(text_table(rows, list(rows[0]), list(rows[0])))
        rows = accuracy(manifest, folders, args.method, args.utterances)
        write_csv(args.out / "accuracy.csv", rows)
        tables.append(text_table(rows, list(rows[0]), list(rows[0])))
    if "speed" in phases:
        rows = speed(manifest, folders, args.speed_method, args.speed_utterances, args.repeats)
        write_csv(args.out / "speed.csv", rows)
        tables.append(text_table(rows, list(rows[0]), list(rows[0])))
    summary = "\n\n".join([described.replace("\n", "  \n"), *tables]) + "\n"
    print("\n" + summary)
    # what this run measured, beside the CSVs: the README's tables come from here
    (args.out / f"tables_{'_'.join(phases)}.md").write_text(summary, encoding="utf-8")
    return 0


def describe(checkpoint: Path) -> str:
    """The CPU, its int8 flags, the libraries and the checkpoint (its step and validation CER)."""
    flags = set()
    if Path("/proc/cpuinfo").is_file():
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    record = SaveRecord.of(load_checkpoint(checkpoint))
    valid = record.valid_metrics
    cer = f", validation CER {100 * valid['cer']:.2f}%" if "cer" in valid else ""
    return (f"CPU: {cpu_description()}, {os.cpu_count()} cores; int8 flags: "
            f"{', '.join(f for f in INT8_FLAGS if f in flags) or 'none'}; onnxruntime "
            f"{onnxruntime.__version__}, torch {torch.__version__}\ncheckpoint: {checkpoint} "
            f"(step {record.step}{cer})")


def untrained(checkpoint: Path, preset: str, folder: Path) -> Path:
    """A checkpoint of an untrained ``preset`` model with causal convolutions (weights drawn with
    seed 0), with ``checkpoint``'s vocabulary, CMVN mode and subsampling channels: int8's speed
    does not depend on what the weights learnt."""
    trained = InferenceModel.of(load_checkpoint(checkpoint))
    shape = ModelConfig.from_dict(trained.model_config)
    cfg = model_config_from_preset(
        preset, vocab_size=shape.vocab_size, causal_conv=True, cmvn=shape.cmvn,
        subsampling_channels=shape.subsampling_channels,
    )
    torch.manual_seed(0)
    path = folder / f"untrained_{preset}.pt"
    folder.mkdir(parents=True, exist_ok=True)
    InferenceModel(dataclasses.asdict(cfg), ASRModel(cfg).state_dict(), trained.tokenizer,
                   ema=False).save(path)
    return path


def export(checkpoint: Path, folders: dict[str, Path]) -> None:
    """The variants' export folders, made again (int8_conv from fp32's, made for it if need be)."""
    fp32 = folders["fp32"] if "fp32" in folders else next(iter(folders.values())).with_name("fp32")
    made = {"fp32": fp32, **folders}
    for folder in made.values():
        if folder.exists():
            shutil.rmtree(folder)
    for variant in ("fp32", "int8"):
        if variant in folders or (variant == "fp32" and "int8_conv" in folders):
            quantize = None if variant == "fp32" else "int8"
            for item in export_checkpoint(checkpoint, made[variant], ["onnx"], Streaming(),
                                          quantize=quantize):
                print(f"{variant}: wrote {item.path}", flush=True)
    if "int8_conv" in folders:
        target = folders["int8_conv"]
        target.mkdir(parents=True)
        for path in fp32.iterdir():
            if path.name in GRAPHS:
                quantize_onnx(path, target / path.name, op_types=("MatMul", "Conv"))
            else:
                shutil.copy(path, target / path.name)
        print(f"int8_conv: wrote {target}", flush=True)


def sizes(folders: dict[str, Path]) -> list[dict]:
    """Each graph's file size and the bytes of its weights (initializers) alone: the float files
    also hold torch.onnx's notes on each node, which the int8 ones drop."""
    rows = []
    for graph in GRAPHS:
        base = None
        for variant, folder in folders.items():
            path = folder / graph
            weights = sum(len(t.raw_data) or _tensor_bytes(t)
                          for t in onnx.load(str(path)).graph.initializer)
            size = path.stat().st_size
            base = base or (size, weights)
            rows.append({"graph": graph, "variant": variant, "MB": round(size / 1e6, 2),
                         "weights MB": round(weights / 1e6, 2),
                         "smaller (file)": round(base[0] / size, 2),
                         "smaller (weights)": round(base[1] / weights, 2)})
    return rows


def _tensor_bytes(tensor: onnx.TensorProto) -> int:
    return onnx.numpy_helper.to_array(tensor).nbytes


def _files(manifest: Path, count: int) -> list[tuple[torch.Tensor, str]]:
    rows = list(read_manifest(manifest))
    rows = rows[:count] if count else rows
    return [(load_audio(resolve_audio_path(row["audio_filepath"], manifest.parent)), row["text"])
            for _, row in rows]


def accuracy(manifest: Path, folders: dict[str, Path], method: str, count: int) -> list[dict]:
    files = _files(manifest, count)
    refs = [text for _, text in files]
    rows = []
    for variant, folder in folders.items():
        rec = ExportedRecognizer(folder)
        for mode in ("offline", "streaming"):
            hyps = []
            for wav, _ in files:
                if mode == "offline":
                    [text] = rec.decode_waveforms([wav], method=method)
                else:
                    stream = rec.stream(method=method)
                    results = stream.accept(wav) + stream.finish()
                    text = " ".join(r.text for r in results if r.is_final and r.text)
                hyps.append(text)
            rates = error_rates(refs, hyps)
            rows.append({"variant": variant, "mode": mode, "method": method,
                         "files": len(files), "CER %": round(100 * rates["cer"], 2),
                         "WER %": round(100 * rates["wer"], 2)})
            print(rows[-1], flush=True)
    base = {row["mode"]: row["CER %"] for row in rows if row["variant"] == rows[0]["variant"]}
    for row in rows:
        row["CER vs first %"] = round(100 * (row["CER %"] / base[row["mode"]] - 1), 1)
    return rows


class Timed:
    """A runner that adds the seconds it runs to ``seconds``."""

    def __init__(self, run):
        self.run, self.seconds, self.calls = run, 0.0, 0

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.run(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1


def speed(manifest: Path, folders: dict[str, Path], method: str, count: int,
          repeats: int) -> list[dict]:
    files = [wav for wav, _ in _files(manifest, count)]
    audio = sum(len(w) for w in files) / SAMPLE_RATE
    recs = {}
    for variant, folder in folders.items():
        rec = ExportedRecognizer(folder)
        rec.run, rec.chunk_run = Timed(rec.run), Timed(rec.chunk_run)
        recs[variant] = rec
    names = list(recs)
    # seconds by (variant, what), one entry a repeat
    took = {(v, w): [] for v in names for w in ("model", "whole", "chunks", "stream")}
    chunk_calls = dict.fromkeys(names, 0)
    for repeat in range(-1, repeats):  # -1: the warm-up, on the first files, not counted
        spent = {key: 0.0 for key in took}
        calls = {v: recs[v].chunk_run.calls for v in names}
        for i, wav in enumerate(files if repeat >= 0 else files[:3]):
            for variant in names[i % len(names):] + names[:i % len(names)]:
                rec = recs[variant]
                model, chunks = rec.run.seconds, rec.chunk_run.seconds
                start = time.perf_counter()
                rec.decode_waveforms([wav], method=method)
                spent[variant, "whole"] += time.perf_counter() - start
                spent[variant, "model"] += rec.run.seconds - model
                start = time.perf_counter()
                stream = rec.stream(method=method)
                for first in range(0, len(wav), PIECE):
                    stream.accept(wav[first:first + PIECE])
                stream.finish()
                spent[variant, "stream"] += time.perf_counter() - start
                spent[variant, "chunks"] += rec.chunk_run.seconds - chunks
        if repeat >= 0:
            for key, seconds in spent.items():
                took[key].append(seconds)
            for v in names:
                chunk_calls[v] += recs[v].chunk_run.calls - calls[v]
            print(f"repeat {repeat + 1}: " + ", ".join(
                f"{v} {w} {spent[v, w] / audio:.4f}" for v, w in spent), flush=True)
    rows = []
    for mode, parts in (("offline", ("model", "whole")), ("streaming", ("chunks", "stream"))):
        for variant in names:
            row = {"mode": mode, "variant": variant, "files": len(files),
                   "audio s": round(audio, 1), "repeats": repeats}
            for part, title in zip(parts, ("model RTF", f"decoding RTF ({method})")):
                seconds = took[variant, part]
                row[title] = round(sum(seconds) / (audio * repeats), 5)
                # the speed-up over the first variant in each repeat: its spread
                ratios = [a / b for a, b in zip(took[names[0], part], seconds)]
                row[f"{title.split(' (')[0]} speed-up"] = (
                    f"{sum(took[names[0], part]) / sum(seconds):.2f}"
                    f" ({min(ratios):.2f}-{max(ratios):.2f})"
                )
            # the mean compute of one chunk (640 ms of audio)
            row["model ms a chunk"] = "" if mode == "offline" else round(
                1000 * sum(took[variant, "chunks"]) / max(chunk_calls[variant], 1), 2
            )
            rows.append(row)
    return rows


if __name__ == "__main__":
    sys.exit(main())
