#!/usr/bin/env python3
"""sherpa-onnx beside our own ONNX decoding of the same checkpoint: how often their greedy texts
agree, the CER of each, and the real-time factor of each on one thread.

    python benchmarks/sherpa_runtime.py checkpoints/kaldi/best.pt data/demo/test.jsonl --limit 200

The checkpoint (trained with --frontend kaldi_fbank) is exported twice into a temporary folder,
``--format sherpa-onnx`` and ``--format onnx``; each file of the manifest is decoded alone by
sherpa-onnx's offline WeNet CTC recognizer (features, model and greedy search in C++) and by
``ExportedRecognizer`` (our features in torch, model.onnx on onnxruntime, greedy CTC in Python),
both on one thread, in turn. RTF: the seconds each spent decoding over the seconds of audio
(reading the file excluded). Speed figures are only comparable within one run on one CPU.
"""
from __future__ import annotations

import argparse
import csv
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from konkanivani.data.audio import load_audio
from konkanivani.data.manifest import read_manifest, resolve_audio_path
from konkanivani.decoding.metrics import error_rates
from konkanivani.decoding.model_export import export_checkpoint
from konkanivani.decoding.onnx_recognizer import ExportedRecognizer
from konkanivani.decoding.sherpa_export import export_sherpa_onnx


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("manifest", type=Path)
    parser.add_argument("--limit", type=int, default=0, help="the first N rows only (0: all)")
    parser.add_argument("--texts", type=Path,
                        help="write each file's two texts here (CSV), with whether it holds a run "
                             "of digital silence (0.1 s of zero samples)")
    args = parser.parse_args(argv)
    import sherpa_onnx

    torch.set_num_threads(1)
    rows = [row for _, row in read_manifest(args.manifest)]
    rows = rows[:args.limit] if args.limit else rows
    with tempfile.TemporaryDirectory() as tmp:
        sherpa_dir, onnx_dir = Path(tmp) / "sherpa", Path(tmp) / "onnx"
        export_sherpa_onnx(args.checkpoint, sherpa_dir)
        export_checkpoint(args.checkpoint, onnx_dir, ["onnx"])
        theirs = sherpa_onnx.OfflineRecognizer.from_wenet_ctc(
            model=str(sherpa_dir / "model.onnx"), tokens=str(sherpa_dir / "tokens.txt"),
            num_threads=1,
        )
        ours = ExportedRecognizer(onnx_dir)
        refs, texts, silent = [], {"sherpa-onnx": [], "ours": []}, []
        seconds, audio_seconds = {"sherpa-onnx": 0.0, "ours": 0.0}, 0.0
        for row in rows:
            wav = load_audio(resolve_audio_path(row["audio_filepath"], args.manifest.parent))
            refs.append(row["text"])
            silent.append(_has_silence(wav))
            audio_seconds += len(wav) / 16000
            start = time.perf_counter()
            stream = theirs.create_stream()
            stream.accept_waveform(16000, wav.numpy())
            theirs.decode_stream(stream)
            seconds["sherpa-onnx"] += time.perf_counter() - start
            # both texts' words, one space apart: sherpa-onnx's result strips the ends, and ours
            # keeps a space after a final word boundary
            texts["sherpa-onnx"].append(" ".join(stream.result.text.split()))
            start = time.perf_counter()
            [text] = ours.decode_waveforms([wav], method="greedy")
            seconds["ours"] += time.perf_counter() - start
            texts["ours"].append(" ".join(text.split()))
    pairs = list(zip(texts["sherpa-onnx"], texts["ours"]))
    same = sum(a == b for a, b in pairs)
    for a, b in [p for p in pairs if p[0] != p[1]][:5]:
        print(f"differ: sherpa-onnx {a!r}, ours {b!r}")
    print(f"{args.checkpoint} on {args.manifest}: {len(rows)} files, {audio_seconds:.1f} s of"
          f" audio; {platform.processor() or platform.machine()}, one thread")
    print(f"same text: {same}/{len(rows)} ({100 * same / max(len(rows), 1):.1f}%)")
    both = [(a == b, q) for (a, b), q in zip(pairs, silent)]
    print(f"same text where a file holds digital silence: {sum(s for s, q in both if q)}/"
          f"{sum(silent)}; where not: {sum(s for s, q in both if not q)}/{len(rows) - sum(silent)}")
    if args.texts:
        with open(args.texts, "w", encoding="utf-8", newline="") as f:
            out = csv.writer(f)
            out.writerow(["audio_filepath", "digital_silence", "sherpa_onnx", "ours"])
            for row, q, (a, b) in zip(rows, silent, pairs):
                out.writerow([row["audio_filepath"], int(q), a, b])
    print("| decoder | CER % | RTF |\n|---|---|---|")
    for name in texts:
        cer = error_rates(refs, texts[name])["cer"]
        print(f"| {name} | {100 * cer:.2f} | {seconds[name] / max(audio_seconds, 1e-9):.4f} |")
    return 0


def _has_silence(wav: torch.Tensor, samples: int = 1600) -> bool:
    """Whether ``wav`` holds ``samples`` zero samples in a row: where sherpa-onnx's offline dither
    (1 in 16-bit units) makes features of what ours computes from silence."""
    zero = (wav == 0).int()
    runs = torch.cumsum(zero, 0)
    ends = runs[samples - 1:] - torch.cat([torch.zeros(1, dtype=runs.dtype), runs[:-samples]])
    return bool((ends == samples).any())


if __name__ == "__main__":
    sys.exit(main())
