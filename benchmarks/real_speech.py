#!/usr/bin/env python3
"""The real-speech yardstick: human recordings with their transcripts, from Debian's packages.

    python3 benchmarks/real_speech.py --out data/real_speech          # fetch, unpack, build
    python3 benchmarks/real_speech.py --table benchmarks/results/real_speech/README.md

Sources (fetched with ``apt-get download``, unpacked with ``dpkg-deb``; nothing else is
downloaded):

- ``tuxpaint-stamps-default`` (GPL-2): Tux Paint's stamp descriptions read by volunteers,
  ``stamps/**/<stamp>_desc_<lang>.ogg``, their text the ``<lang>.utf8=...`` line of
  ``<stamp>.txt``;
- ``asterisk-core-sounds-en-wav`` with ``asterisk-core-sounds-en`` (CC-BY-SA-3.0): one speaker's
  telephone prompts (8 kHz), their text in ``core-sounds-en.txt.gz``, language ``en``.

Each language with at least ``--min_phrases`` phrases is split by phrase into train, valid and
test (a phrase, as ``normalize_text`` writes it, is never in two splits; the assignment is a
seeded shuffle of the phrases, the same on every machine). **Tux Paint's Spanish (``es``) is for
evaluation only**: all of it goes to test, nothing of it to train or valid, so that nothing is
trained, tuned or chosen on it. Audio is resampled to 16 kHz mono FLAC. A row is dropped, and
counted, when its stamp has no text in its language, when its text holds what is read as words
(digits, ``$``, ``#``, ``*``...), when its audio is unreadable, shorter than 0.3 s or longer
than 20 s, or when its text is too long or short for its audio (``MAX_CHARS_PER_SECOND``).

In ``--out`` OUT: ``<lang>/{train,valid,test}.jsonl`` (manifests: ``audio_filepath`` relative to
OUT, ``duration``, ``text`` normalized, ``original_text``, ``language``, ``speaker``, ``source``),
``<lang>/train_15min.jsonl`` (the first 15 minutes of a seeded shuffle of train: the fine-tuning
set), ``all_train.jsonl`` / ``all_valid.jsonl`` (every training language's), ``table.md`` (hours
and utterances per language and split) and ``yardstick.json`` (the settings and counts). A second
run with the same settings reuses what the first made: nothing is converted again.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import re
import shutil
import subprocess
import sys
from collections import Counter, defaultdict
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile as sf
from scipy.signal import resample_poly

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from konkanivani.checkpoint import write_file_atomic  # noqa: E402
from konkanivani.data.tokenizer import normalize_text  # noqa: E402

PACKAGES = ("tuxpaint-stamps-default", "asterisk-core-sounds-en-wav", "asterisk-core-sounds-en")
EVAL_ONLY = frozenset({"es"})  # Tux Paint's Spanish: test only, never trained, tuned or chosen on
SPLITS = ("train", "valid", "test")
SAMPLE_RATE = 16000
MIN_SECONDS, MAX_SECONDS = 0.3, 20.0
FINETUNE_SECONDS = 15 * 60
READ_AS_WORDS = re.compile(r"[0-9$%&@#*+=€£§]")  # spoken as words the text does not hold
# characters of normalized text a second of audio: outside, the recording is of another text (Tux
# Paint's recordings of an older description) or cut short. Chosen on the Catalan recordings, 123
# of whose 816 read faster than 25 a second, most of them under a second long.
MIN_CHARS_PER_SECOND, MAX_CHARS_PER_SECOND = 2.0, 25.0
VERSION = 2  # of the build: a change of how rows are made rebuilds


@dataclass(frozen=True)
class Recording:
    """One human recording and its transcript."""

    language: str
    source: str  # tuxpaint or asterisk
    path: Path
    text: str


# ---- fetching -----------------------------------------------------------------------------------

def fetch(cache: Path) -> Path:
    """The packages downloaded into ``cache/debs`` (those there already kept) and unpacked into
    ``cache/root``; returns that root. Only the system's package client downloads."""
    debs, root = cache / "debs", cache / "root"
    debs.mkdir(parents=True, exist_ok=True)
    missing = [p for p in PACKAGES if not list(debs.glob(f"{p}_*.deb"))]
    if missing:
        print(f"apt-get download {' '.join(missing)}", file=sys.stderr)
        subprocess.run(["apt-get", "download", *missing], cwd=debs, check=True)
    done = root / ".unpacked"
    names = sorted(p.name for p in debs.glob("*.deb"))
    if not done.is_file() or done.read_text().split() != names:
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        for name in names:
            subprocess.run(["dpkg-deb", "-x", str(debs / name), str(root)], check=True)
        done.write_text("\n".join(names) + "\n")
    return root


# ---- reading the packages -----------------------------------------------------------------------

def tuxpaint_recordings(root: Path, dropped: Counter) -> list[Recording]:
    """Every ``<stamp>_desc_<lang>.ogg`` under ``root``'s Tux Paint stamps whose ``<stamp>.txt``
    has a ``<lang>.utf8=`` line."""
    stamps = root / "usr" / "share" / "tuxpaint" / "stamps"
    found = []
    for audio in sorted(stamps.rglob("*_desc_*.ogg")):
        stamp, lang = audio.name[:-len(".ogg")].rsplit("_desc_", 1)
        texts = _stamp_texts(audio.with_name(stamp + ".txt"))
        if lang not in texts:
            dropped[f"{lang}: no text in its language"] += 1
            continue
        found.append(Recording(lang, "tuxpaint", audio, texts[lang]))
    return found


def _stamp_texts(path: Path) -> dict[str, str]:
    texts = {}
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return texts
    for line in lines:
        key, sep, value = line.partition("=")
        if sep and key.endswith(".utf8") and value.strip():
            texts[key[:-len(".utf8")]] = value.strip()
    return texts


def asterisk_recordings(root: Path, dropped: Counter) -> list[Recording]:
    """The English prompts of ``core-sounds-en.txt.gz`` (``name: text``) whose ``name.wav`` is in
    the package's sound folder."""
    listing = root / "usr" / "share" / "doc" / "asterisk-core-sounds-en" / "core-sounds-en.txt.gz"
    sounds = root / "usr" / "share" / "asterisk" / "sounds"
    if not listing.is_file():
        return []
    folders = [d for d in sorted(sounds.iterdir()) if d.is_dir()] if sounds.is_dir() else []
    found = []
    for line in gzip.open(listing, "rt", encoding="utf-8", errors="replace"):
        name, sep, text = line.partition(":")
        if line.startswith(";") or not sep or not text.strip():
            continue
        audio = next((d / f"{name.strip()}.wav" for d in folders
                      if (d / f"{name.strip()}.wav").is_file()), None)
        if audio is None:
            dropped["en: no audio for its text"] += 1
            continue
        found.append(Recording("en", "asterisk", audio, text.strip()))
    return found


# ---- splitting ----------------------------------------------------------------------------------

def split_by_phrase(recordings: list[Recording], seed: int, valid: float, test: float
                    ) -> dict[str, dict[str, list[Recording]]]:
    """``{language: {split: recordings}}``: each language's phrases shuffled by ``seed`` and cut
    into test (``test`` of them), valid and train; every recording goes with its phrase. An
    evaluation-only language is all test."""
    by_language: dict[str, dict[str, list[Recording]]] = defaultdict(lambda: defaultdict(list))
    for rec in recordings:
        by_language[rec.language][normalize_text(rec.text)].append(rec)
    splits: dict[str, dict[str, list[Recording]]] = {}
    for lang, phrases in sorted(by_language.items()):
        order = sorted(phrases)
        random.Random(f"{seed}:{lang}").shuffle(order)
        n_test = len(order) if lang in EVAL_ONLY else round(test * len(order))
        n_valid = 0 if lang in EVAL_ONLY else round(valid * len(order))
        cut = {"test": order[:n_test], "valid": order[n_test:n_test + n_valid],
               "train": order[n_test + n_valid:]}
        splits[lang] = {s: [r for p in cut[s] for r in phrases[p]] for s in SPLITS}
    return splits


def usable_text(rec: Recording) -> str | None:
    """Why a recording's text cannot be its transcript (None: it can)."""
    if READ_AS_WORDS.search(rec.text):
        return "text with digits or symbols read as words"
    if not normalize_text(rec.text):
        return "no text after normalization"
    return None


# ---- audio --------------------------------------------------------------------------------------

def convert(source: str, target: str) -> float | str:
    """``source`` as 16 kHz mono 16-bit FLAC at ``target`` (written under a temporary name and
    renamed; one there already is kept); its seconds, or why it cannot be used."""
    if os.path.isfile(target):
        return sf.info(target).duration
    try:
        wav, rate = sf.read(source, dtype="float32", always_2d=True)
    except (RuntimeError, sf.LibsndfileError) as e:
        return f"unreadable audio ({str(e).splitlines()[0][:80]})"
    wav = wav.mean(axis=1)
    if rate != SAMPLE_RATE:
        g = np.gcd(rate, SAMPLE_RATE)
        wav = resample_poly(wav, SAMPLE_RATE // g, rate // g).astype(np.float32)
    seconds = len(wav) / SAMPLE_RATE
    if not MIN_SECONDS <= seconds <= MAX_SECONDS:
        return f"audio shorter than {MIN_SECONDS} s or longer than {MAX_SECONDS} s"
    peak = float(np.abs(wav).max(initial=0.0))
    if peak > 1.0:  # resampling's ringing past full scale
        wav = wav / peak
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = f"{target}.tmp-{os.getpid()}"
    sf.write(tmp, wav, SAMPLE_RATE, format="FLAC", subtype="PCM_16")
    os.replace(tmp, target)
    return seconds


def _target(out: Path, rec: Recording, root: Path) -> Path:
    rel = rec.path.relative_to(root).with_suffix(".flac")  # usr/share/<package's folder>/...
    return out / rec.language / "audio" / rec.source / Path(*rel.parts[3:])


# ---- the build ----------------------------------------------------------------------------------

def build(out: Path, root: Path, seed: int, valid: float, test: float, min_phrases: int,
          jobs: int) -> dict:
    """The yardstick in ``out`` from the unpacked packages at ``root``; returns its summary (also
    ``out/yardstick.json``)."""
    settings = {"version": VERSION, "seed": seed, "valid": valid, "test": test,
                "min_phrases": min_phrases, "eval_only": sorted(EVAL_ONLY)}
    summary_path = out / "yardstick.json"
    if summary_path.is_file():
        summary = json.loads(summary_path.read_text(encoding="utf-8"))
        if summary.get("settings") == settings and all(
                (out / lang / f"{s}.jsonl").is_file() for lang in summary["languages"]
                for s in SPLITS):
            print(f"{out}: built before with these settings, reused", file=sys.stderr)
            return summary
    dropped: Counter = Counter()
    recordings = [*tuxpaint_recordings(root, dropped), *asterisk_recordings(root, dropped)]
    kept = []
    for rec in recordings:
        if (why := usable_text(rec)) is not None:
            dropped[f"{rec.language}: {why}"] += 1
        else:
            kept.append(rec)
    phrases = Counter()
    for rec in {(r.language, normalize_text(r.text)): r for r in kept}.values():
        phrases[rec.language] += 1
    small = {lang for lang, n in phrases.items() if n < min_phrases and lang not in EVAL_ONLY}
    for lang in sorted(small):
        dropped[f"{lang}: fewer than {min_phrases} phrases ({phrases[lang]})"] += sum(
            r.language == lang for r in kept)
    kept = [r for r in kept if r.language not in small]
    splits = split_by_phrase(kept, seed, valid, test)
    todo = [(rec, lang, split) for lang, by_split in splits.items()
            for split, recs in by_split.items() for rec in recs]
    with ProcessPoolExecutor(max(1, jobs)) as pool:
        results = list(pool.map(convert, [str(r.path) for r, _, _ in todo],
                                [str(_target(out, r, root)) for r, _, _ in todo], chunksize=16))
    rows: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for (rec, lang, split), result in zip(todo, results):
        if isinstance(result, str):
            dropped[f"{lang}: {result.split(' (')[0]}"] += 1
            continue
        if not MIN_CHARS_PER_SECOND <= len(normalize_text(rec.text)) / result <= \
                MAX_CHARS_PER_SECOND:
            dropped[f"{lang}: text too long or short for its audio"] += 1
            continue
        rows[lang][split].append({
            "audio_filepath": str(_target(out, rec, root).relative_to(out / lang)),
            "duration": round(result, 3), "text": normalize_text(rec.text),
            "original_text": rec.text, "language": lang, "speaker": f"{rec.source}:{lang}",
            "source": rec.source})
    table = {}
    for lang in sorted(rows):
        for split in SPLITS:
            _write_manifest(out / lang / f"{split}.jsonl", rows[lang][split])
        if lang not in EVAL_ONLY:
            _write_manifest(out / lang / "train_15min.jsonl",
                            _first_seconds(rows[lang]["train"], FINETUNE_SECONDS, seed))
        table[lang] = {s: {"utterances": len(rows[lang][s]),
                           "hours": round(sum(r["duration"] for r in rows[lang][s]) / 3600, 3)}
                       for s in SPLITS}
    for split in ("train", "valid"):
        _write_manifest(out / f"all_{split}.jsonl", [
            {**r, "audio_filepath": f"{lang}/{r['audio_filepath']}"}
            for lang in sorted(rows) if lang not in EVAL_ONLY for r in rows[lang][split]])
    summary = {"settings": settings, "languages": sorted(rows), "table": table,
               "dropped": dict(sorted(dropped.items()))}
    (out / "table.md").write_text(markdown(summary), encoding="utf-8")
    _write_atomic(summary_path, json.dumps(summary, indent=2, ensure_ascii=False) + "\n")
    return summary


def _first_seconds(rows: list[dict], seconds: float, seed: int) -> list[dict]:
    order = list(rows)
    random.Random(seed).shuffle(order)
    chosen, total = [], 0.0
    for row in order:
        if total >= seconds:
            break
        chosen.append(row)
        total += row["duration"]
    return chosen


def _write_manifest(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def _write_atomic(path: Path, text: str) -> None:
    write_file_atomic(path, text.encode("utf-8"))


def markdown(summary: dict) -> str:
    """The table of hours and utterances per language and split, and what was dropped."""
    lines = ["| language | source | train utt | train h | valid utt | valid h | test utt | "
             "test h |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    totals = Counter()
    for lang, splits in summary["table"].items():
        cells = []
        for s in SPLITS:
            cells += [f"{splits[s]['utterances']:,}", f"{splits[s]['hours']:.2f}"]
            totals[f"{s} utt"] += splits[s]["utterances"]
            totals[f"{s} h"] += splits[s]["hours"]
        source = "asterisk" if lang == "en" else "tuxpaint"
        name = f"{lang} (evaluation only)" if lang in EVAL_ONLY else lang
        lines.append(f"| {name} | {source} | " + " | ".join(cells) + " |")
    lines.append("| all | | " + " | ".join(
        f"{totals[f'{s} utt']:,} | {totals[f'{s} h']:.2f}" for s in SPLITS) + " |")
    lines += ["", "Dropped: " + (", ".join(f"{why}: {n}" for why, n in summary["dropped"].items())
                                 or "none") + "."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "data" / "real_speech",
                        help="the yardstick's folder (default: data/real_speech)")
    parser.add_argument("--cache", type=Path,
                        help="where the packages are downloaded and unpacked "
                        "(default: OUT/packages)")
    parser.add_argument("--unpacked", type=Path,
                        help="a folder the packages are unpacked in already: nothing is fetched")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--valid", type=float, default=0.1, help="share of phrases (default 0.1)")
    parser.add_argument("--test", type=float, default=0.15, help="share of phrases (default 0.15)")
    parser.add_argument("--min_phrases", type=int, default=250,
                        help="languages with fewer phrases are left out (default 250)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--table", type=Path, help="also write the table here (a results file)")
    args = parser.parse_args(argv)
    if not (0 <= args.valid < 1 and 0 < args.test < 1 and args.valid + args.test < 1):
        parser.error("--valid and --test are shares of the phrases: 0 <= valid, 0 < test, "
                     "valid + test < 1")
    root = args.unpacked or fetch(args.cache or args.out / "packages")
    summary = build(args.out, root, args.seed, args.valid, args.test, args.min_phrases, args.jobs)
    table = markdown(summary)
    print(table, end="")
    if args.table:
        args.table.parent.mkdir(parents=True, exist_ok=True)
        command = f"python3 benchmarks/real_speech.py --seed {args.seed}"
        args.table.write_text(f"# The real-speech yardstick\n\n    {command}\n\n{table}",
                              encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
