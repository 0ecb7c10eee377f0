#!/usr/bin/env python3
"""Word times and probabilities (decoding/alignment.py) against speech whose word boundaries are
known exactly.

Two kinds of recordings are made from a manifest of the demo corpus (espeak-ng speech, no noise):

- **sentences**: ``--join`` consecutive utterances joined by silences of 0.3 to 1 s (seeded). Where
  each sentence's speech starts and ends is known by construction: the corpus cut each synthesized
  utterance to ``KEEP_SILENCE_S`` (0.1 s) before its first and after its last 10 ms frame within
  45 dB of the loudest (``datatools.corpus.trim_silence``), before it added any noise. So the
  first word's start and the last word's end of every sentence are boundaries to check; connected
  speech, as the model was trained on.
- **words**: each word of a sentence spoken alone by espeak-ng with the utterance's voice, speed and
  pitch (the corpus's own synthesis, no noise), cut by the same rule to its speech and joined by
  silences of 0.15 to 0.5 s: every word's start and end is known.

Each recording is decoded by ``Recognizer.transcribe`` (whole, ``--method``, full context: rescore
by default, as joint decoding takes minutes for a recording of 4 sentences on 2 busy cores) and
streamed (``Recognizer.transcribe_long`` with ``--chunk_size``: the stream's final results), and the
reference alone is aligned as well (its tokens forced onto the same CTC output: the alignment
without recognition errors). A hypothesis word is paired with a reference word where the word
alignment of the two texts (jiwer) puts them one to one (equal or substituted); the error of a
boundary is the hypothesis's time minus the true one. The table gives the median and 90th
percentile of its size and its median (the bias that ``alignment.START_SHIFT`` and ``END_SHIFT``
correct), start and end apart.

``--calibrate`` measures on ``--calibrate_on`` (the validation split) instead and prints the shifts
that make the median error of the reference's alignment zero (every word of both kinds of recording:
the most boundaries, none lost to recognition errors), the way they were chosen.

Probabilities: each hypothesis word is right or wrong (equal in the word alignment); how well a
word's probability tells them apart is the area under the ROC curve (0.5: not at all), for the
least, the mean and the geometric mean of its tokens' posteriors (``alignment.word_probability``
uses the least).

    python benchmarks/word_times.py checkpoints/streaming_small/best.pt \\
        --out benchmarks/results/word_times
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

import jiwer
import numpy as np
import soundfile as sf
import torch

from konkanivani.checkpoint import SaveRecord, load_checkpoint
from konkanivani.data.audio import load_audio
from konkanivani.data.frames import SAMPLE_RATE
from konkanivani.data.manifest import read_manifest, resolve_audio_path
from konkanivani.data.tokenizer import normalize_text
from konkanivani.datatools.corpus import KEEP_SILENCE_S, PlannedUtterance, synthesize
from konkanivani.decoding import alignment
from konkanivani.decoding.alignment import WORD_START, Word, align_tokens, align_words
from konkanivani.decoding.metrics import score
from konkanivani.decoding.recognizer import Recognizer
from konkanivani.training.curves import text_table
from konkanivani.training.precision import cpu_description

SENTENCE_GAP = (0.3, 1.0)  # seconds of silence between joined sentences
WORD_GAP = (0.15, 0.5)  # ... between words spoken alone
WORD_PEAK = 0.5  # each word's peak, as the corpus scales an utterance


@dataclass
class Recording:
    """A joined recording: its reference words and the known times of some of them (index into the
    words -> seconds)."""

    name: str
    wav: np.ndarray
    words: list[str]
    starts: dict[int, float] = field(default_factory=dict)
    ends: dict[int, float] = field(default_factory=dict)


def speech_span(wav: np.ndarray, rate: int = SAMPLE_RATE) -> tuple[float, float]:
    """Where speech starts and ends in a recording of the corpus's synthesis (seconds): the
    margins ``trim_silence`` left (see the module)."""
    return KEEP_SILENCE_S, len(wav) / rate - KEEP_SILENCE_S


def sentence_recordings(rows: list[tuple[Path, dict]], join: int, rng: random.Random
                        ) -> list[Recording]:
    out = []
    for first in range(0, len(rows), join):
        pieces, words, starts, ends, at = [], [], {}, {}, 0.0
        for path, row in rows[first:first + join]:
            if pieces:
                gap = np.zeros(round(rng.uniform(*SENTENCE_GAP) * SAMPLE_RATE), np.float32)
                pieces.append(gap)
                at += len(gap) / SAMPLE_RATE
            wav = load_audio(path).numpy()
            onset, offset = speech_span(wav)
            said = normalize_text(row["text"]).split()
            starts[len(words)] = at + onset
            ends[len(words) + len(said) - 1] = at + offset
            words += said
            pieces.append(wav)
            at += len(wav) / SAMPLE_RATE
        out.append(Recording(f"sentences_{first:05d}", np.concatenate(pieces), words, starts, ends))
    return out


def word_recordings(rows: list[tuple[Path, dict]], rng: random.Random, work: Path
                    ) -> list[Recording]:
    """Each row's words spoken alone (its voice, speed and pitch) and joined (see the module)."""
    (work / "wavs").mkdir(parents=True, exist_ok=True)
    out = []
    for n, (_, row) in enumerate(rows):
        words = normalize_text(row["text"]).split()
        pieces, starts, ends, at = [], {}, {}, 0.0
        for i, word in enumerate(words):
            utt = PlannedUtterance("word", i, word, row["speaker"], int(row["speed"]),
                                   int(row["pitch"]), WORD_PEAK, None, 0)
            synthesize(utt, str(work))
            wav, _ = sf.read(work / utt.rel_path, dtype="float32")
            onset, offset = speech_span(wav)
            wav = wav[round(onset * SAMPLE_RATE):round(offset * SAMPLE_RATE)]
            gap = np.zeros(round(rng.uniform(*WORD_GAP) * SAMPLE_RATE), np.float32)
            pieces += [gap, wav]
            at += len(gap) / SAMPLE_RATE
            starts[i], ends[i] = at, at + len(wav) / SAMPLE_RATE
            at += len(wav) / SAMPLE_RATE
        pieces.append(np.zeros(round(rng.uniform(*WORD_GAP) * SAMPLE_RATE), np.float32))
        out.append(Recording(f"words_{n:05d}", np.concatenate(pieces), words, starts, ends))
    return out


def pairs(reference: list[str], hypothesis: list[str]) -> list[tuple[int, int, bool]]:
    """(reference index, hypothesis index, equal) of the words the alignment of the two texts puts
    one to one."""
    if not reference or not hypothesis:
        return []
    out = []
    for chunk in jiwer.process_words(" ".join(reference), " ".join(hypothesis)).alignments[0]:
        if chunk.type in ("equal", "substitute"):
            for k in range(chunk.ref_end_idx - chunk.ref_start_idx):
                out.append(
                    (chunk.ref_start_idx + k, chunk.hyp_start_idx + k, chunk.type == "equal")
                )
    return out


def boundary_errors(rec: Recording, words: list[Word]) -> dict[str, list[float]]:
    """Signed errors (seconds) of the known boundaries of ``rec`` that ``words`` pair with: all
    pairs, and the equal ones apart."""
    errors = {"start": [], "end": [], "start_equal": [], "end_equal": []}
    for ref, hyp, equal in pairs(rec.words, [w.text for w in words]):
        for kind, known, got in (("start", rec.starts, words[hyp].start),
                                 ("end", rec.ends, words[hyp].end)):
            if ref in known:
                errors[kind].append(got - known[ref])
                if equal:
                    errors[kind + "_equal"].append(got - known[ref])
    return errors


def token_probabilities(rec: Recognizer, wav: torch.Tensor, text: str) -> list[list[float]]:
    """Each word's token posteriors on the alignment of ``text`` (a whole-file hypothesis) to the
    full-context CTC output: the parts a word's probability is made of."""
    tokens = rec.tokenizer.encode(text)
    with torch.inference_mode():
        feats = rec.frontend(wav)[None]
        enc, lens = rec.model.encode(feats, torch.tensor([feats.shape[1]]), chunk_size=0)
        log_probs = rec.model.ctc_log_probs(enc)[0, : int(lens[0])]
    spans = align_tokens(log_probs, tokens) or []
    groups: list[list[float]] = []
    for span, piece in zip(spans, rec.tokenizer.pieces([s.token for s in spans])):
        if piece.startswith(WORD_START) or not groups:
            groups.append([])
        if piece != WORD_START:
            groups[-1].append(span.probability)
    return [g for g in groups if g]


def auc(scores: list[float], positive: list[bool]) -> float:
    """Area under the ROC curve of ``scores`` for ``positive`` (ties count half)."""
    pos = [s for s, p in zip(scores, positive) if p]
    neg = [s for s, p in zip(scores, positive) if not p]
    if not pos or not neg:
        return float("nan")
    ranks = _ranks(pos + neg)
    return (sum(ranks[: len(pos)]) - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg))


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def summary(errors: list[float]) -> dict[str, float | int]:
    if not errors:
        return {"n": 0, "median_ms": float("nan"), "p90_ms": float("nan"),
                "bias_ms": float("nan")}
    sizes = np.abs(np.array(errors)) * 1000
    return {"n": len(errors), "median_ms": round(float(np.median(sizes)), 1),
            "p90_ms": round(float(np.percentile(sizes, 90)), 1),
            "bias_ms": round(statistics.median(errors) * 1000, 1)}


def measure(rec: Recognizer, recordings: list[Recording], work: Path, method: str,
            chunk_size: int) -> tuple[dict[str, dict[str, list[float]]], dict]:
    """Boundary errors per way of decoding, the probabilities of the whole-file hypotheses'
    words with whether each is right, and the character errors of those hypotheses."""
    paths = []
    for r in recordings:
        paths.append(work / f"{r.name}.wav")
        sf.write(paths[-1], r.wav, SAMPLE_RATE)
    errors: dict[str, dict[str, list[float]]] = {}

    def add(way: str, found: dict[str, list[float]]) -> None:
        for kind, values in found.items():
            errors.setdefault(way, {}).setdefault(kind, []).extend(values)

    probs: dict[str, list] = {"least": [], "mean": [], "geometric": [], "shipped": [],
                              "right": []}
    char_errors = char_count = 0
    started = time.perf_counter()
    for r, tr in zip(recordings, rec.transcribe(paths, method=method)):
        add("whole file, " + method, boundary_errors(r, tr.words))
        wav = torch.from_numpy(r.wav)
        reference = alignment_of_reference(rec, wav, r.words)
        add("reference forced", boundary_errors(r, reference))
        right = {hyp for _, hyp, equal in pairs(r.words, [w.text for w in tr.words]) if equal}
        parts = token_probabilities(rec, wav, tr.text)
        if len(parts) == len(tr.words):
            for i, (word, tokens) in enumerate(zip(tr.words, parts)):
                probs["least"].append(min(tokens))
                probs["mean"].append(sum(tokens) / len(tokens))
                probs["geometric"].append(math.exp(sum(map(math.log, tokens)) / len(tokens)))
                probs["shipped"].append(word.probability)
                probs["right"].append(i in right)
        chars = score(" ".join(r.words), tr.text)[1]
        char_errors, char_count = char_errors + chars.errors, char_count + chars.length
    print(f"  whole files: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    if chunk_size:
        started = time.perf_counter()
        for r, path in zip(recordings, paths):
            results = rec.transcribe_long(path, chunk_size=chunk_size)
            words = [w for result in results for w in result.words]
            add(f"stream, {chunk_size} frames", boundary_errors(r, words))
        print(f"  streams: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return errors, {"probabilities": probs, "cer": char_errors / max(1, char_count)}


def alignment_of_reference(rec: Recognizer, wav: torch.Tensor, words: list[str]) -> list[Word]:
    """The reference's own tokens forced onto the full-context CTC output."""
    tokens = rec.tokenizer.encode(" ".join(words))
    with torch.inference_mode():
        feats = rec.frontend(wav)[None]
        enc, lens = rec.model.encode(feats, torch.tensor([feats.shape[1]]), chunk_size=0)
        log_probs = rec.model.ctc_log_probs(enc)[0, : int(lens[0])]
    return align_words(rec.tokenizer, tokens, log_probs, 0.0, len(wav) / SAMPLE_RATE)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--manifest", type=Path, default=ROOT / "data" / "demo" / "test.jsonl")
    parser.add_argument("--calibrate_on", type=Path,
                        default=ROOT / "data" / "demo" / "valid.jsonl")
    parser.add_argument("--calibrate", action="store_true",
                        help="measure on --calibrate_on and print the shifts that zero the bias")
    parser.add_argument("--sentences", type=int, default=0,
                        help="utterances joined into recordings (0: all of the manifest)")
    parser.add_argument("--join", type=int, default=4, help="utterances per joined recording")
    parser.add_argument("--word_sentences", type=int, default=150,
                        help="utterances whose words are spoken alone")
    parser.add_argument("--method", default="rescore",
                        help="of the whole files (the CTC n-best rescored, a stream's method)")
    parser.add_argument("--chunk_size", type=int, default=16, help="the stream's (0: none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write README.md and results.json here")
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    manifest = args.calibrate_on if args.calibrate else args.manifest
    rows = [(resolve_audio_path(row["audio_filepath"], manifest.parent), row)
            for _, row in read_manifest(manifest)]
    rng = random.Random(args.seed)
    record = SaveRecord.of(load_checkpoint(args.checkpoint))
    rec = Recognizer.from_checkpoint(args.checkpoint)
    with tempfile.TemporaryDirectory(prefix="word_times.") as tmp:
        work = Path(tmp)
        started = time.perf_counter()
        sentences = sentence_recordings(rows[: args.sentences or None], args.join, rng)
        words = word_recordings(rows[: args.word_sentences], rng, work / "synth")
        print(f"{len(sentences)} joined recordings, {len(words)} of words alone, made in "
              f"{time.perf_counter() - started:.0f} s", file=sys.stderr)
        results = {}
        for kind, recordings in (("sentences", sentences), ("words", words)):
            print(kind, file=sys.stderr)
            results[kind] = measure(rec, recordings, work, args.method, args.chunk_size)
    table = []
    for kind, (errors, _) in results.items():
        for way, found in errors.items():
            for edge in ("start", "end"):
                for which, key in (("paired", edge), ("right", edge + "_equal")):
                    table.append({"recordings": kind, "words": way, "boundary": edge,
                                  "pairs": which, **summary(found[key])})
    keys = ["recordings", "words", "boundary", "pairs", "n", "median_ms", "p90_ms", "bias_ms"]
    titles = ["recordings", "words from", "boundary", "words", "n", "median |error| ms",
              "p90 |error| ms", "median error ms"]
    print(text_table(table, keys, titles))
    probs = {k: [] for k in ("least", "mean", "geometric", "shipped", "right")}
    for _, extra in results.values():
        for k in probs:
            probs[k] += extra["probabilities"][k]
    aucs = {k: round(auc(probs[k], probs["right"]), 3) for k in ("least", "mean", "geometric",
                                                                   "shipped")}
    right = sum(probs["right"])
    print(f"probability AUC (right against wrong words, {right} right of {len(probs['right'])}):"
          f" {aucs}")
    if args.calibrate:
        for edge, name, now in (("start", "START_SHIFT", alignment.START_SHIFT),
                                ("end", "END_SHIFT", alignment.END_SHIFT)):
            both = [e for errors, _ in results.values() for e in errors["reference forced"][edge]]
            print(f"{name} = {now - statistics.median(both):.3f}  (now {now}, median error "
                  f"{statistics.median(both) * 1000:.1f} ms over {len(both)} boundaries)")
    info = {
        "checkpoint": str(args.checkpoint), "step": record.step,
        "valid_cer": record.valid_metrics.get("cer"), "manifest": str(manifest),
        "cer": {kind: round(extra["cer"], 4) for kind, (_, extra) in results.items()},
        "cpu": cpu_description(), "shifts": [alignment.START_SHIFT, alignment.END_SHIFT],
        "rows": table, "probability_auc": aucs, "right_words": right,
        "hypothesis_words": len(probs["right"]),
        "command": "python benchmarks/word_times.py " + " ".join(argv or sys.argv[1:]),
    }
    print(json.dumps({k: v for k, v in info.items() if k != "rows"}, ensure_ascii=False))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(info, indent=1, ensure_ascii=False)
                                               + "\n", encoding="utf-8")
        (args.out / "table.md").write_text(text_table(table, keys, titles) + "\n",
                                           encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
