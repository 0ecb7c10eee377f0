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
sherpa-onnx's offline recognizer dithers the samples at random, so it decodes each file a second
time, untimed: how often it agrees with itself is the ceiling of any agreement with it.

    python benchmarks/sherpa_runtime.py checkpoints/causal/best.pt data/demo/test.jsonl --streaming

With ``--streaming`` (a checkpoint trained with --causal_conv), the two streaming models at the
default chunks (16 frames, 4 left chunks): sherpa-onnx's online WeNet CTC recognizer on
``model-streaming.onnx`` against a ``Stream`` of our export's chunk graph (``encoder_chunk.onnx``,
method greedy, no endpoints), each fed the file then ``tail_seconds`` of silence (what sherpa-onnx
needs to decode a stream's last chunk) in one piece.
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
from konkanivani.decoding.model_export import Streaming, export_checkpoint
from konkanivani.decoding.onnx_recognizer import ExportedRecognizer
from konkanivani.decoding.sherpa_export import export_sherpa_onnx, tail_seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("manifest", type=Path)
    parser.add_argument("--limit", type=int, default=0, help="the first N rows only (0: all)")
    parser.add_argument("--texts", type=Path,
                        help="write each file's two texts here (CSV), with whether it holds a run "
                             "of digital silence (0.1 s of zero samples)")
    parser.add_argument("--streaming", action="store_true",
                        help="the streaming models, sherpa-onnx's online recognizer against our "
                             "export's stream (see the module)")
    args = parser.parse_args(argv)
    import sherpa_onnx

    torch.set_num_threads(1)
    rows = [row for _, row in read_manifest(args.manifest)]
    rows = rows[:args.limit] if args.limit else rows
    with tempfile.TemporaryDirectory() as tmp:
        sherpa_dir, onnx_dir = Path(tmp) / "sherpa", Path(tmp) / "onnx"
        streaming = Streaming()
        export_sherpa_onnx(args.checkpoint, sherpa_dir)
        export_checkpoint(args.checkpoint, onnx_dir, ["onnx"],
                          streaming=streaming if args.streaming else None)
        if args.streaming:
            decode_theirs, decode_ours = _streaming(sherpa_onnx, sherpa_dir, onnx_dir, streaming)
        else:
            decode_theirs, decode_ours = _offline(sherpa_onnx, sherpa_dir, onnx_dir)
        refs, texts, silent, again = [], {"sherpa-onnx": [], "ours": []}, [], []
        seconds, audio_seconds = {"sherpa-onnx": 0.0, "ours": 0.0}, 0.0
        for row in rows:
            wav = load_audio(resolve_audio_path(row["audio_filepath"], args.manifest.parent))
            refs.append(row["text"])
            silent.append(_has_silence(wav))
            audio_seconds += len(wav) / 16000
            for name, decode in (("sherpa-onnx", decode_theirs), ("ours", decode_ours)):
                start = time.perf_counter()
                text = decode(wav)
                seconds[name] += time.perf_counter() - start
                # the words, one space apart: sherpa-onnx's result strips the ends, and ours
                # keeps a space after a final word boundary
                texts[name].append(" ".join(text.split()))
            # sherpa-onnx dithers its samples at random (the offline recognizer, at least): a
            # second pass over the file shows how far it agrees with itself
            again.append(" ".join(decode_theirs(wav).split()))
    pairs = list(zip(texts["sherpa-onnx"], texts["ours"]))
    same = sum(a == b for a, b in pairs)
    for a, b in [p for p in pairs if p[0] != p[1]][:5]:
        print(f"differ: sherpa-onnx {a!r}, ours {b!r}")
    print(f"{args.checkpoint} on {args.manifest}: {len(rows)} files, {audio_seconds:.1f} s of"
          f" audio; {platform.processor() or platform.machine()}, one thread")
    print(f"same text: {same}/{len(rows)} ({100 * same / max(len(rows), 1):.2f}%)")
    itself = sum(a == b for a, b in zip(texts["sherpa-onnx"], again))
    print(f"sherpa-onnx's same text in a second pass: {itself}/{len(rows)}"
          f" ({100 * itself / max(len(rows), 1):.2f}%)")
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


def _offline(sherpa_onnx, sherpa_dir: Path, onnx_dir: Path):
    """Each side's text of a whole waveform: sherpa-onnx's offline recognizer, our export's greedy
    CTC."""
    theirs = sherpa_onnx.OfflineRecognizer.from_wenet_ctc(
        model=str(sherpa_dir / "model.onnx"), tokens=str(sherpa_dir / "tokens.txt"), num_threads=1,
    )
    ours = ExportedRecognizer(onnx_dir)

    def decode_theirs(wav: torch.Tensor) -> str:
        stream = theirs.create_stream()
        stream.accept_waveform(16000, wav.numpy())
        theirs.decode_stream(stream)
        return stream.result.text

    def decode_ours(wav: torch.Tensor) -> str:
        return ours.decode_waveforms([wav], method="greedy")[0]

    return decode_theirs, decode_ours


def _streaming(sherpa_onnx, sherpa_dir: Path, onnx_dir: Path, streaming: Streaming):
    """Each side's text of a waveform streamed with the tail of silence: sherpa-onnx's online
    recognizer, a greedy ``Stream`` of our export's chunk graph."""
    theirs = sherpa_onnx.OnlineRecognizer.from_wenet_ctc(
        model=str(sherpa_dir / "model-streaming.onnx"), tokens=str(sherpa_dir / "tokens.txt"),
        chunk_size=streaming.chunk_size, num_left_chunks=streaming.left_chunks, num_threads=1,
    )
    ours = ExportedRecognizer(onnx_dir)
    tail = torch.zeros(round(tail_seconds(streaming) * 16000))

    def decode_theirs(wav: torch.Tensor) -> str:
        stream = theirs.create_stream()
        stream.accept_waveform(16000, torch.cat([wav, tail]).numpy())
        stream.input_finished()
        while theirs.is_ready(stream):
            theirs.decode_stream(stream)
        return theirs.get_result(stream)

    def decode_ours(wav: torch.Tensor) -> str:
        stream = ours.stream(method="greedy", endpoint_ms=0)
        results = stream.accept(torch.cat([wav, tail])) + stream.finish()
        return " ".join(r.text for r in results if r.is_final)

    return decode_theirs, decode_ours


def _has_silence(wav: torch.Tensor, samples: int = 1600) -> bool:
    """Whether ``wav`` holds ``samples`` zero samples in a row: where sherpa-onnx's offline dither
    (1 in 16-bit units) makes features of what ours computes from silence."""
    zero = (wav == 0).int()
    runs = torch.cumsum(zero, 0)
    ends = runs[samples - 1:] - torch.cat([torch.zeros(1, dtype=runs.dtype), runs[:-samples]])
    return bool((ends == samples).any())


if __name__ == "__main__":
    sys.exit(main())
