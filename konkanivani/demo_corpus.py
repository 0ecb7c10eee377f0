"""A small, deterministic Konkani demo speech corpus synthesized with espeak-ng.

Sentences (Devanagari Konkani, ``resources/demo_sentences_kok.txt``, package data) are split into
train / valid / test, and each utterance is read by an espeak-ng "speaker" = (language voice, variant) with a
random speed and pitch. The test split uses sentences AND voice variants that never occur in
train or valid. Output (relocatable, paths relative to OUT_DIR)::

    OUT_DIR/wavs/<split>_<index:05d>.wav     16 kHz mono 16-bit PCM
    OUT_DIR/{train,valid,test}.jsonl         NeMo-style manifests
    OUT_DIR/corpus_info.json                 generation parameters

The command line is ``training_scripts/make_demo_corpus.py``.
"""
from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import random
import shutil
import subprocess
import tempfile
from contextlib import nullcontext
from pathlib import Path
from typing import Any, NamedTuple, Optional

import numpy as np
import soundfile as sf
import torch
from tqdm import tqdm

from .audio import resample
from .frames import SAMPLE_RATE
from .data import read_manifest

# Package data: installed with the package (a wheel too), so the corpus can be made anywhere.
DEFAULT_SENTENCES = Path(__file__).resolve().parent / "resources" / "demo_sentences_kok.txt"
SPLITS = ("train", "valid", "test")
SPLIT_FRACTIONS = {"train": 0.80, "valid": 0.08, "test": 0.12}
# "kok" spells out vowel signs in espeak-ng 1.51; mr / hi read Devanagari Konkani well.
LANG_VOICES = ("mr", "hi")
TRAIN_VARIANTS = ("", "f1", "f2", "f3", "f4", "m1", "m2", "m3", "m4", "m6", "klatt", "klatt2")
TEST_VARIANTS = ("f5", "m7", "klatt3")  # held out: never used in train / valid
SPEED_RANGE = (130, 190)  # words per minute (espeak -s)
PITCH_RANGE = (30, 70)  # espeak -p, 0..99
PEAK_RANGE = (0.75, 0.95)  # peak-normalization target (random gain around ~0.9)
NOISE_PROB = 0.7  # share of utterances that get light white noise
SNR_RANGE_DB = (25.0, 40.0)
TARGET_SR = SAMPLE_RATE
KEEP_SILENCE_S = 0.1
INFO_VERSION = 1


class EspeakMissingError(RuntimeError):
    """Raised when the espeak-ng binary is not on PATH."""


class PlannedUtterance(NamedTuple):
    """Everything needed to synthesize one utterance (decided up front, seeded)."""

    split: str
    index: int
    text: str
    speaker: str
    speed: int
    pitch: int
    peak: float
    snr_db: Optional[float]
    noise_seed: int

    @property
    def rel_path(self) -> str:
        return f"wavs/{self.split}_{self.index:05d}.wav"


def speaker_pools() -> dict[str, list[str]]:
    """Speaker names per split, e.g. 'mr' or 'hi+f2'."""
    def names(variants: tuple[str, ...]) -> list[str]:
        return [f"{lang}+{v}" if v else lang for lang in LANG_VOICES for v in variants]

    train = names(TRAIN_VARIANTS)
    return {"train": train, "valid": list(train), "test": names(TEST_VARIANTS)}


def load_sentences(path: Path) -> list[str]:
    """Non-empty, de-duplicated lines of the sentence file (file order kept)."""
    lines = [ln.strip() for ln in path.read_text(encoding="utf-8").splitlines()]
    return list(dict.fromkeys(ln for ln in lines if ln))


def split_sizes(n: int) -> dict[str, int]:
    """Roughly 80/8/12 split with at least one item per split."""
    if n < len(SPLITS):
        raise ValueError(f"need at least {len(SPLITS)} sentences, got {n}")
    test = max(1, round(n * SPLIT_FRACTIONS["test"]))
    valid = max(1, round(n * SPLIT_FRACTIONS["valid"]))
    return {"train": n - valid - test, "valid": valid, "test": test}


def plan_corpus(sentences: list[str], seed: int, num_utterances: int,
                max_sentences: Optional[int]) -> list[PlannedUtterance]:
    """Decide every utterance's sentence, speaker and acoustics from one seeded RNG."""
    rng = random.Random(seed)
    order = list(sentences)
    rng.shuffle(order)
    if max_sentences is not None:
        order = order[:max_sentences]
    sizes = split_sizes(len(order))
    by_split: dict[str, list[str]] = {}
    start = 0
    for split in SPLITS:
        by_split[split] = order[start:start + sizes[split]]
        start += sizes[split]
    # Utterances per split proportional to its sentences (every sentence at least once
    # when the budget allows); the train split absorbs the rounding.
    counts = {s: max(1, round(num_utterances * sizes[s] / len(order))) for s in ("valid", "test")}
    counts["train"] = max(1, num_utterances - counts["valid"] - counts["test"])
    pools = speaker_pools()
    plan: list[PlannedUtterance] = []
    for split in SPLITS:
        texts, speakers = by_split[split], pools[split]
        text_cycle: list[str] = []
        speaker_cycle: list[str] = []
        for i in range(counts[split]):
            if not text_cycle:  # reshuffled passes: balanced but random repetitions
                text_cycle = rng.sample(texts, len(texts))
            if not speaker_cycle:
                speaker_cycle = rng.sample(speakers, len(speakers))
            snr = rng.uniform(*SNR_RANGE_DB) if rng.random() < NOISE_PROB else None
            plan.append(PlannedUtterance(
                split=split, index=i, text=text_cycle.pop(), speaker=speaker_cycle.pop(),
                speed=rng.randint(*SPEED_RANGE), pitch=rng.randint(*PITCH_RANGE),
                peak=round(rng.uniform(*PEAK_RANGE), 4),
                snr_db=None if snr is None else round(snr, 2),
                noise_seed=rng.randrange(2**31)))
    return plan


def trim_silence(x: np.ndarray, sr: int, keep_s: float = KEEP_SILENCE_S) -> np.ndarray:
    """Cut leading/trailing near-silence (-45 dB re. loudest 10 ms frame) so that
    exactly ~keep_s of margin remains on each side (zero-padded where espeak-ng
    starts speaking at the very first sample)."""
    frame = max(1, int(0.01 * sr))
    n_frames = len(x) // frame
    if n_frames == 0:
        return x
    rms = np.sqrt((x[: n_frames * frame].reshape(n_frames, frame) ** 2).mean(axis=1))
    loud = np.flatnonzero(rms > rms.max() * 10 ** (-45 / 20))
    if loud.size == 0:
        return x
    keep = int(keep_s * sr)
    start, end = loud[0] * frame, min(len(x), (loud[-1] + 1) * frame)
    core = x[max(0, start - keep): min(len(x), end + keep)]
    pad_left, pad_right = max(0, keep - start), max(0, end + keep - len(x))
    return np.pad(core, (pad_left, pad_right))


def synthesize(utt: PlannedUtterance, out_dir: str) -> tuple[str, int, float]:
    """Run espeak-ng for one utterance, post-process and write the 16 kHz wav."""
    fd, tmp = tempfile.mkstemp(suffix=".wav")
    os.close(fd)
    try:
        subprocess.run(
            ["espeak-ng", "-b", "1", "-v", utt.speaker, "-s", str(utt.speed),
             "-p", str(utt.pitch), "-w", tmp, "--", utt.text],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        audio, sr = sf.read(tmp, dtype="float64", always_2d=True)
    finally:
        os.unlink(tmp)
    x = resample(torch.from_numpy(trim_silence(audio.mean(axis=1), sr)), sr, TARGET_SR).numpy()
    x = x * (utt.peak / max(float(np.abs(x).max()), 1e-9))
    if utt.snr_db is not None:
        noise = np.random.default_rng(utt.noise_seed).standard_normal(len(x))
        x = x + noise * np.sqrt(np.mean(x**2)) / 10 ** (utt.snr_db / 20)
    x = np.clip(x, -1.0, 1.0)
    sf.write(os.path.join(out_dir, utt.rel_path), x, TARGET_SR, subtype="PCM_16")
    return utt.split, utt.index, round(len(x) / TARGET_SR, 3)


def _synthesize_job(args: tuple[PlannedUtterance, str]) -> tuple[str, int, float]:
    return synthesize(*args)


def sha1_of(path: Path) -> str:
    return hashlib.sha1(path.read_bytes()).hexdigest()


def _rows(path: Path) -> list[dict[str, Any]]:
    return [row for _, row in read_manifest(path)]


def corpus_is_complete(out_dir: Path, info: dict[str, Any]) -> bool:
    """True when corpus_info.json matches `info` and every manifest + wav exists."""
    info_path = out_dir / "corpus_info.json"
    try:
        if json.loads(info_path.read_text(encoding="utf-8")) != info:
            return False
        return all((out_dir / row["audio_filepath"]).is_file()
                   for split in SPLITS for row in _rows(out_dir / f"{split}.jsonl"))
    except (OSError, ValueError, KeyError):  # ManifestError is a ValueError
        return False


def summarize(out_dir: Path) -> dict[str, Any]:
    """Per-split counts/hours/sentences/speakers plus train/test disjointness checks."""
    rows = {s: _rows(out_dir / f"{s}.jsonl") for s in SPLITS}
    splits = {s: {"utterances": len(r),
                  "hours": round(sum(x["duration"] for x in r) / 3600, 3),
                  "sentences": len({x["text"] for x in r}),
                  "speakers": sorted({x["speaker"] for x in r})} for s, r in rows.items()}
    seen_text = {x["text"] for s in ("train", "valid") for x in rows[s]}
    seen_spk = {x["speaker"] for s in ("train", "valid") for x in rows[s]}
    return {"out_dir": str(out_dir), "splits": splits,
            "test_sentences_disjoint": seen_text.isdisjoint(x["text"] for x in rows["test"]),
            "test_speakers_disjoint": seen_spk.isdisjoint(x["speaker"] for x in rows["test"])}


def print_summary(summary: dict[str, Any]) -> None:
    for split, s in summary["splits"].items():
        print(f"{split:5s}: {s['utterances']:5d} utts  {s['hours']:6.3f} h  "
              f"{s['sentences']:4d} sentences  {len(s['speakers']):2d} speakers")
    ok = summary["test_sentences_disjoint"] and summary["test_speakers_disjoint"]
    print(f"check: test sentences disjoint={summary['test_sentences_disjoint']}, test speakers "
          f"disjoint={summary['test_speakers_disjoint']} -> {'OK' if ok else 'FAILED'}")


def make_corpus(out_dir: str | Path, seed: int = 0, num_utterances: int = 4800,
                max_sentences: Optional[int] = None, jobs: int = 2,
                sentences_path: Optional[str | Path] = None, force: bool = False,
                progress: bool = True) -> dict[str, Any]:
    """Generate (or reuse) the corpus in `out_dir`; returns the summary dict."""
    if shutil.which("espeak-ng") is None:
        raise EspeakMissingError("espeak-ng not found on PATH; install it first, e.g. "
                                 "`sudo apt-get install espeak-ng`")
    out = Path(out_dir)
    sent_path = Path(sentences_path) if sentences_path else DEFAULT_SENTENCES
    info = {"version": INFO_VERSION, "seed": seed, "num_utterances": num_utterances,
            "max_sentences": max_sentences, "sentences_sha1": sha1_of(sent_path)}
    if not force and corpus_is_complete(out, info):
        if progress:
            print(f"corpus already present in {out}")
        return {**summarize(out), "skipped": True}

    plan = plan_corpus(load_sentences(sent_path), seed, num_utterances, max_sentences)
    (out / "corpus_info.json").unlink(missing_ok=True)
    shutil.rmtree(out / "wavs", ignore_errors=True)
    (out / "wavs").mkdir(parents=True)
    durations: dict[tuple[str, int], float] = {}
    tasks = [(u, str(out)) for u in plan]
    # Workers are started fresh ("spawn"), never forked: a fork of a process whose torch/OpenMP
    # threads have already run hangs in the child's first parallel torch op (the resampler).
    spawn = multiprocessing.get_context("spawn")
    workers = spawn.Pool(jobs, initializer=torch.set_num_threads, initargs=(1,)) if jobs > 1 else nullcontext()
    with workers as pool:  # None without workers
        results = pool.imap_unordered(_synthesize_job, tasks, chunksize=8) if pool else map(_synthesize_job, tasks)
        for split, idx, dur in tqdm(results, total=len(tasks), desc="synthesizing", unit="utt",
                                    disable=not progress):
            durations[split, idx] = dur
    for split in SPLITS:
        with open(out / f"{split}.jsonl", "w", encoding="utf-8") as f:
            for u in (u for u in plan if u.split == split):
                row = {"audio_filepath": u.rel_path, "duration": durations[split, u.index],
                       "text": u.text, "speaker": u.speaker, "speed": u.speed, "pitch": u.pitch}
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    (out / "corpus_info.json").write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    return {**summarize(out), "skipped": False}
