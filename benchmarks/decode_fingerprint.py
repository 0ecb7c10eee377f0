"""Every decoding path's output on a manifest, written as JSON, to show a change left decoding as it
was: each method's text and words (times and probabilities) for every utterance, with and without a
language model and hotwords, and a stream's results where the model streams.

    python benchmarks/decode_fingerprint.py CHECKPOINT data/demo/test.jsonl out.json \
        [--lm LM_CHECKPOINT] [--hotwords FILE] [--limit N]
    python benchmarks/decode_fingerprint.py --compare before.json after.json

``--compare`` prints the cases that differ (none: exit 0; else exit 1). Decoding is deterministic on
one machine, so equal files mean the same text and the same numbers to the last digit.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from konkanivani.data.audio import load_audio
from konkanivani.data.manifest import read_manifest, resolve_audio_path
from konkanivani.decoding.recognizer import Recognizer
from konkanivani.decoding.settings import HOTWORD_METHODS, METHODS, STREAM_METHODS


def _results(results) -> list[dict]:
    return [{"text": r.text, "final": r.is_final, "start": r.start, "end": r.end,
             "words": [[w.text, w.start, w.end, w.probability] for w in r.words]} for r in results]


def fingerprint(checkpoint: str, manifest: str, lm: str | None, hotwords: str | None,
                limit: int, batch: int = 8) -> dict:
    torch.manual_seed(0)
    rec = Recognizer.from_checkpoint(checkpoint)
    rows = [row for _, row in read_manifest(manifest)[:limit]]
    base = Path(manifest).parent
    wavs = [load_audio(resolve_audio_path(r["audio_filepath"], base)) for r in rows]
    words = tuple(Path(hotwords).read_text(encoding="utf-8").split("\n")) if hotwords else ()
    words = tuple(w for w in words if w.strip())
    cases: dict[str, list] = {}

    def run(name: str, **settings) -> None:
        out = []
        for i in range(0, len(wavs), batch):
            out += _results(rec.decode_results(wavs[i:i + batch], **settings))
        cases[name] = out

    for method in METHODS:
        run(method, method=method)
        if hotwords:
            if method in HOTWORD_METHODS:
                run(f"{method}+hotwords", method=method, hotwords=words)
    if lm:
        rec.attach_lm(lm)
        for method in METHODS:
            if method != "greedy":
                run(f"{method}+lm", method=method, lm_weight=0.3)
    if rec.model.cfg.causal_conv:
        for method in STREAM_METHODS:
            cases[f"stream:{method}"] = [
                _results(rec.stream_results(w.split(3200), method=method, chunk_size=8))
                for w in wavs[:16]]
    return cases


def compare(before: Path, after: Path) -> int:
    a, b = json.loads(before.read_text()), json.loads(after.read_text())
    differ = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    for k in sorted(set(a) | set(b)):
        print(f"{k:24s} {'same' if k not in differ else 'DIFFERENT'}"
              f" ({len(a.get(k, []))} utterances)")
    return 1 if differ else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("paths", nargs="+")
    p.add_argument("--compare", action="store_true")
    p.add_argument("--lm")
    p.add_argument("--hotwords")
    p.add_argument("--limit", type=int, default=64)
    a = p.parse_args(argv)
    if a.compare:
        return compare(Path(a.paths[0]), Path(a.paths[1]))
    checkpoint, manifest, out = a.paths
    cases = fingerprint(checkpoint, manifest, a.lm, a.hotwords, a.limit)
    Path(out).write_text(json.dumps(cases, ensure_ascii=False, indent=0), encoding="utf-8")
    print(f"{len(cases)} cases, {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
