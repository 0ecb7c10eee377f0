"""A small, deterministic Konkani demo speech corpus synthesized with espeak-ng (and festival).

Sentences (Devanagari Konkani, ``resources/demo_sentences_kok.txt``, package data) are split into
train / valid / test, and each utterance is read by an espeak-ng "speaker" = (language voice,
variant) with a random speed and pitch. The test split uses sentences AND voice variants that never
occur in train or valid. With ``festival_share``, that share of the training utterances is read
instead by festival's voices of other languages (Czech, Finnish, Italian, Catalan, US English; each
recorded from one real speaker), through a transliteration (``transliterate.py``), so that training
hears more than one synthesizer. With ``prosody``, each espeak-ng training utterance also gets its
own intonation range and pause between words (``vary_prosody``). The ``heldout`` split reads the
test sentences with a voice *source* that never occurs in training at all: festival's Marathi NSK
diphone voice, recorded from another real speaker (made when festival and its Marathi voice are
installed); ``test_noisy`` is the test split in a noisy, reverberant room (synthetic,
``corrupt.corrupt_manifest``). ``text.txt`` is a text-only set (``resources/demo_text_kok.txt``):
sentences in no speech split, for a language model. Output (relocatable, paths relative to
OUT_DIR)::

    OUT_DIR/wavs/<split>_<index:05d>.wav     16 kHz mono 16-bit PCM
    OUT_DIR/{train,valid,test,heldout}.jsonl NeMo-style manifests
    OUT_DIR/test_noisy.jsonl, test_noisy/    the test split reverberated, with noise at 5-20 dB SNR
    OUT_DIR/text.txt                         text-only sentences, one a line
    OUT_DIR/corpus_info.json                 generation parameters

The command line is ``konkanivani-demo-corpus --output_dir OUT_DIR``
(``konkanivani/cli/demo_corpus.py``; ``training_scripts/make_demo_corpus.py`` runs the same), with
the defaults of ``default_options``, as ``make_corpus``.
"""
from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import tempfile
from contextlib import nullcontext
from pathlib import Path
from typing import Any, NamedTuple, Optional
from xml.sax.saxutils import escape

import numpy as np
import soundfile as sf
import torch
from tqdm import tqdm

from ..config import DEFAULT_SEED
from ..data.audio import resample
from ..data.frames import SAMPLE_RATE
from ..data.manifest import read_manifest
from ..data.tokenizer import normalize_text
from .corrupt import corrupt_manifest
from .outputs import Staging
from .transliterate import english_segments, phrases, spell
from .voices import (
    FESTIVAL_TRAIN_VOICES,
    FESTIVAL_VOICE,
    FESTIVAL_VOICE_FOLDER,
    FESTIVAL_VOICE_PACKAGE,
)

# Package data: installed with the package (a wheel too), so the corpus can be made anywhere.
DEFAULT_SENTENCES = Path(__file__).resolve().parent.parent / "resources" / "demo_sentences_kok.txt"
DEFAULT_TEXT = Path(__file__).resolve().parent.parent / "resources" / "demo_text_kok.txt"
SPLITS = ("train", "valid", "test")  # sentence splits; "heldout" reads the test sentences
HELDOUT = "heldout"
NOISY = "test_noisy"  # the test split reverberated and with noise at 5-20 dB SNR
NOISY_SNR_DB = (5.0, 20.0)
SPLIT_FRACTIONS = {"train": 0.80, "valid": 0.08, "test": 0.12}
# "kok" spells out vowel signs in espeak-ng 1.51; mr / hi read Devanagari Konkani well.
LANG_VOICES = ("mr", "hi")
# espeak-ng's voice variants (`espeak-ng --voices=variant`) that sound like a person: the robots,
# whispers and effects are left out.
TRAIN_VARIANTS = (
    "",
    "f1",
    "f2",
    "f3",
    "f4",
    "m1",
    "m2",
    "m3",
    "m4",
    "m5",
    "m6",
    "m8",
    "klatt",
    "klatt2",
    "klatt4",
    "klatt5",
    "klatt6",
    "adam",
    "Alex",
    "Alicia",
    "Andrea",
    "Andy",
    "Annie",
    "antonio",
    "aunty",
    "belinda",
    "benjamin",
    "boris",
    "caleb",
    "david",
    "ed",
    "edward",
    "Gene",
    "gustave",
    "Henrique",
    "Hugo",
    "iven",
    "iven2",
    "john",
    "linda",
    "max",
    "Michael",
    "michel",
    "miguel",
    "Mike",
    "pablo",
    "paul",
    "pedro",
    "quincy",
    "rob",
    "robert",
    "steph",
    "zac",
    "anika",
    "grandpa",
    "grandma",
    "norbert",
    "sandro",
    "shelby",
    "victor",
    "croak",
)
# held out: never in train / valid
TEST_VARIANTS = ("f5", "m7", "klatt3", "travis", "steph2", "edward2")
SPEED_RANGE = (115, 215)  # words per minute (espeak -s)
PITCH_RANGE = (15, 85)  # espeak -p, 0..99
FESTIVAL_SPEAKER = "festival:nsk"
FESTIVAL_F0_RANGE = (100, 170)  # mean F0 in Hz (below ~90 Hz its LPC resynthesis crashes)
FESTIVAL_STRETCH_RANGE = (1.0, 1.5)  # duration stretch (the voice's own is 1.4)
HELDOUT_PER_SENTENCE = 2
# --prosody_variety: an espeak-ng training utterance's intonation range (SSML <prosody range>, in
# percent of the voice's own) and pause between words (espeak-ng -g, in 10 ms at normal speed)
PITCH_RANGE_PERCENT = (30, 200)
WORD_GAP_RANGE = (0, 4)


FESTIVAL_TRAIN_STRETCH_RANGE = (0.8, 1.3)
# konkanivani-demo-corpus's defaults, measured side by side
# (benchmarks/results/festival_voices/README.md): at 2,000 steps they took the held-out voice from
# 64% to 36% CER, for 1.4 points on the clean test split.
DEFAULT_FESTIVAL_SHARE = 0.3
DEFAULT_TRAIN_FROM_TEXT = 800
# the English voices read phones with our F0 (the others use their own intonation)
ENGLISH_F0_RANGE = (85, 150)
FESTIVAL_VOICE_ROOTS = ("/usr/share/festival/voices", "/usr/local/share/festival/voices")
PEAK_RANGE = (0.75, 0.95)  # peak-normalization target (random gain around ~0.9)
NOISE_PROB = 0.7  # share of utterances that get light white noise
SNR_RANGE_DB = (25.0, 40.0)
TARGET_SR = SAMPLE_RATE
KEEP_SILENCE_S = 0.1
INFO_VERSION = 3  # 3: festival's training voices, the transliteration's fixes
INFO_FILE = "corpus_info.json"  # written last, when the corpus is whole


class EspeakMissingError(RuntimeError):
    """Raised when the espeak-ng binary is not on PATH."""


def festival_available() -> bool:
    """True when festival's text2wave and its Marathi diphone voice are installed (Debian:
    ``apt-get install festival`` and ``voices.FESTIVAL_VOICE_PACKAGE``)."""
    return shutil.which("text2wave") is not None and any(
        Path(root, FESTIVAL_VOICE_FOLDER).is_dir() for root in FESTIVAL_VOICE_ROOTS)


def festival_train_voices() -> list[str]:
    """The speaker names of FESTIVAL_TRAIN_VOICES whose voice is installed (with festival
    itself)."""
    if shutil.which("festival") is None or shutil.which("text2wave") is None:
        return []
    return [name for name, v in FESTIVAL_TRAIN_VOICES.items()
            if any(Path(root, v.folder).is_dir() for root in FESTIVAL_VOICE_ROOTS)]


def default_options(
    sentences_path: Optional[str | Path] = None, max_sentences: Optional[int] = None
) -> dict[str, Any]:
    """The options a corpus gets when they are not given, for ``make_corpus`` and
    konkanivani-demo-corpus alike: DEFAULT_FESTIVAL_SHARE of the training utterances read by
    festival's voices when all of them are installed (the share would otherwise fall on the few that
    are: Debian's festival brings one English voice along), and DEFAULT_TRAIN_FROM_TEXT more
    sentences, none with another sentence set or a cut one (the package's text is no fit for them).
    """
    every_voice = len(festival_train_voices()) == len(FESTIVAL_TRAIN_VOICES)
    own_sentences = sentences_path is None and max_sentences is None
    return {"festival_share": DEFAULT_FESTIVAL_SHARE if every_voice else 0.0,
            "train_from_text": DEFAULT_TRAIN_FROM_TEXT if own_sentences else 0}


class PlannedUtterance(NamedTuple):
    """Everything needed to synthesize one utterance (decided up front, seeded)."""

    split: str
    index: int
    text: str
    speaker: str
    speed: int  # espeak-ng: words per minute; festival: duration stretch in percent
    pitch: int  # espeak-ng: -p (0..99); festival: mean F0 in Hz (0: the voice's own intonation)
    peak: float
    snr_db: Optional[float]
    noise_seed: int
    # drawn by vary_prosody (None: not varied): espeak-ng's intonation range in percent of the
    # voice's, and its pause between words (-g), in 10 ms
    pitch_range: Optional[int] = None
    word_gap: Optional[int] = None

    @property
    def plain_prosody(self) -> bool:
        """Read as plain text: not varied, or drawn as the voice's own (100%, no gap)."""
        return self.pitch_range in (None, 100) and not self.word_gap

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
                max_sentences: Optional[int], heldout: bool = False) -> list[PlannedUtterance]:
    """Decide every utterance's sentence, speaker and acoustics from one seeded RNG; with `heldout`,
    also the festival readings of the test sentences."""
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
    if heldout:
        texts = [t for t in by_split["test"] for _ in range(HELDOUT_PER_SENTENCE)]
        for i, text in enumerate(texts):
            snr = rng.uniform(*SNR_RANGE_DB) if rng.random() < NOISE_PROB else None
            plan.append(
                PlannedUtterance(
                    split=HELDOUT,
                    index=i,
                    text=text,
                    speaker=FESTIVAL_SPEAKER,
                    speed=round(100 * rng.uniform(*FESTIVAL_STRETCH_RANGE)),
                    pitch=rng.randint(*FESTIVAL_F0_RANGE),
                    peak=round(rng.uniform(*PEAK_RANGE), 4),
                    snr_db=None if snr is None else round(snr, 2),
                    noise_seed=rng.randrange(2**31),
                )
            )
    return plan


def read_text_into_train(
    plan: list[PlannedUtterance], extra: list[str], seed: int
) -> list[PlannedUtterance]:
    """The plan with its training utterances' sentences drawn, in reshuffled passes, from the train
    split's sentences plus `extra`: more distinct sentences for the same utterances, speakers and
    acoustics. A second RNG chooses them, so valid, test and heldout stay as they were."""
    if not extra:
        return plan
    rng = random.Random(f"{seed}:train-from-text")
    texts = list(dict.fromkeys([u.text for u in plan if u.split == "train"] + extra))
    cycle: list[str] = []
    out = []
    for u in plan:
        if u.split == "train":
            if not cycle:
                cycle = rng.sample(texts, len(texts))
            u = u._replace(text=cycle.pop())
        out.append(u)
    return out


def read_with_festival_voices(plan: list[PlannedUtterance], share: float, voices: list[str],
                              seed: int) -> list[PlannedUtterance]:
    """The plan with `share` of its training utterances (a seeded choice) read by festival's
    training `voices` instead of espeak-ng, in reshuffled passes, each with a random duration
    stretch. A second
    RNG chooses them, so valid, test and heldout stay as they were."""
    if share <= 0 or not voices:
        return plan
    rng = random.Random(f"{seed}:festival-voices")
    train = [i for i, u in enumerate(plan) if u.split == "train"]
    chosen = sorted(rng.sample(train, round(share * len(train))))
    out = list(plan)
    cycle: list[str] = []
    for i in chosen:
        if not cycle:
            cycle = rng.sample(voices, len(voices))
        speaker = cycle.pop()
        stretch, f0 = round(100 * rng.uniform(*FESTIVAL_TRAIN_STRETCH_RANGE)), rng.randint(
            *ENGLISH_F0_RANGE
        )
        voice = FESTIVAL_TRAIN_VOICES[speaker]
        out[i] = out[i]._replace(speaker=speaker, speed=stretch if voice.stretches else 100,
                                 pitch=f0 if voice.language == "en" else 0)
    return out


def vary_prosody(plan: list[PlannedUtterance], seed: int) -> list[PlannedUtterance]:
    """The plan with each training utterance that espeak-ng reads given its own intonation range
    (``PITCH_RANGE_PERCENT``: from a near monotone to twice the voice's own swings) and pause
    between words (``WORD_GAP_RANGE``), on top of its speed and pitch: more of the variety one
    real speaker brings from sentence to sentence. A third RNG draws them, so valid, test and
    heldout stay as they were, and festival's readings too."""
    rng = random.Random(f"{seed}:prosody")
    return [u._replace(pitch_range=rng.randint(*PITCH_RANGE_PERCENT),
                       word_gap=rng.randint(*WORD_GAP_RANGE))
            if u.split == "train" and u.speaker not in FESTIVAL_TRAIN_VOICES else u for u in plan]


def check_transliterable(plan: list[PlannedUtterance], sources: list[Path]) -> None:
    """Raise ValueError naming the file and line of the first sentence a festival training voice is
    to
    read that the transliteration cannot (a digit or a Latin letter in it), before any synthesis."""
    for u in plan:
        if u.speaker not in FESTIVAL_TRAIN_VOICES:
            continue
        try:
            phrases(u.text)
        except ValueError as e:
            where = next((f"{path}: line {n}" for path in sources
                          for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
                          if line.strip() == u.text), "a sentence")
            raise ValueError(
                f"{where}: {e}; festival's voices read only Devanagari (--festival_share 0 leaves "
                "the training split to espeak-ng)"
            ) from None


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


def _festival(command: list[str], body: bytes, suffix: str, wav_path: str) -> None:
    """Run festival's `command` (text2wave or festival -b) on `body` written to a temporary file,
    whose path stands for {} in the command; `wav_path` must then hold the wav."""
    fd, path = tempfile.mkstemp(
        suffix=suffix, prefix=".festival", dir=os.path.dirname(wav_path) or None
    )
    with os.fdopen(fd, "wb") as f:
        f.write(body)
    try:
        subprocess.run(
            [a.replace("{}", path) for a in command],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
    finally:
        os.unlink(path)


def _scheme_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _speak_festival_train(utt: PlannedUtterance, wav_path: str) -> None:
    """One utterance read by a festival training voice: spelled text through text2wave, or, for the
    English diphone voices, US English phones with their durations and F0 through a festival script.
    """
    v = FESTIVAL_TRAIN_VOICES[utt.speaker]
    if v.language == "en":
        segments = english_segments(utt.text, utt.speed / 100, utt.pitch)
        script = (f"({v.voice})\n(set! utt (Utterance Segments ({segments})))\n(utt.synth utt)\n"
                  f"(utt.save.wave utt {_scheme_string(wav_path)} 'riff)\n")
        _festival(["festival", "-b", "{}"], script.encode("utf-8"), ".scm", wav_path)
    else:
        setup = f"(begin ({v.voice}) (Parameter.set 'Duration_Stretch {utt.speed / 100}))"
        _festival(["text2wave", "-eval", setup, "{}", "-o", wav_path],
                  (spell(utt.text, v.language) + "\n").encode(v.encoding), ".txt", wav_path)


def _speak(utt: PlannedUtterance, wav_path: str) -> None:
    """Write the synthesizer's own wav of one utterance to `wav_path`."""
    if utt.speaker in FESTIVAL_TRAIN_VOICES:
        _speak_festival_train(utt, wav_path)
        return
    if utt.speaker != FESTIVAL_SPEAKER:
        # a plain reading is the text as it is; a varied one is SSML (-m) with a word gap (-g)
        prosody = [] if utt.plain_prosody else ["-m", "-g", str(utt.word_gap)]
        text = (utt.text if utt.plain_prosody else
                f'<speak><prosody range="{utt.pitch_range}%">{escape(utt.text)}</prosody></speak>')
        subprocess.run(
            [
                "espeak-ng",
                "-b",
                "1",
                *prosody,
                "-v",
                utt.speaker,
                "-s",
                str(utt.speed),
                "-p",
                str(utt.pitch),
                "-w",
                wav_path,
                "--",
                text,
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        return
    # The Debian voice leaves Int_Method unset (festival stops with "Feature Int_Method not
    # defined"); the simple intonation model with our mean F0 stands in.
    scheme = (
        f"(begin ({FESTIVAL_VOICE}) (set! int_simple_params '((f0_mean {utt.pitch}) (f0_std 15))) "
        f"(Parameter.set 'Int_Method 'Simple) (Parameter.set 'Duration_Stretch {utt.speed / 100}))"
    )
    _festival(
        ["text2wave", "-eval", scheme, "{}", "-o", wav_path],
        (utt.text + "\n").encode("utf-8"),
        ".txt",
        wav_path,
    )


def synthesize(utt: PlannedUtterance, out_dir: str) -> tuple[str, int, float]:
    """Synthesize one utterance, post-process and write the 16 kHz wav. The synthesizer's own file
    is a temporary inside `out_dir` (the corpus's staging folder), so a killed worker leaves
    nothing behind that the next build does not remove."""
    fd, tmp = tempfile.mkstemp(suffix=".wav", prefix=".synth", dir=out_dir)
    os.close(fd)
    try:
        _speak(utt, tmp)
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


# before records
_OUTPUTS = ["wavs", NOISY, "text.txt", *(f"{s}.jsonl" for s in (*SPLITS, NOISY, HELDOUT))]


def _rows(path: Path) -> list[dict[str, Any]]:
    return [row for _, row in read_manifest(path)]


def _splits(info: dict[str, Any]) -> tuple[str, ...]:
    return (*SPLITS, NOISY, *([HELDOUT] if info.get("heldout") else []))


def corpus_is_complete(out_dir: Path, info: dict[str, Any]) -> bool:
    """True when corpus_info.json matches `info` and every manifest + wav (and text.txt) exists."""
    info_path = out_dir / INFO_FILE
    try:
        recorded = json.loads(info_path.read_text(encoding="utf-8"))
        recorded.pop("outputs", None)  # what the build wrote (outputs.Staging)
        if recorded != info:
            return False
        if info.get("text_sha1") and not (out_dir / "text.txt").is_file():
            return False
        return all((out_dir / row["audio_filepath"]).is_file()
                   for split in _splits(info) for row in _rows(out_dir / f"{split}.jsonl"))
    except (OSError, ValueError, KeyError):  # ManifestError is a ValueError
        return False


def text_only_sentences(text_path: Path, speech_sentences: list[str]) -> list[str]:
    """The lines of `text_path` that no speech split may contain: any line equal to a sentence of
    the speech corpus (after text normalization) is dropped, so an LM trained on them has not seen a
    test sentence."""
    spoken = {normalize_text(t) for t in speech_sentences}
    return [t for t in load_sentences(text_path) if normalize_text(t) not in spoken]


def summarize(out_dir: Path) -> dict[str, Any]:
    """Per-split counts/hours/sentences/speakers plus train/test disjointness checks."""
    names = [*SPLITS, *(s for s in (NOISY, HELDOUT) if (out_dir / f"{s}.jsonl").is_file())]
    rows = {s: _rows(out_dir / f"{s}.jsonl") for s in names}
    splits = {s: {"utterances": len(r),
                  "hours": round(sum(x["duration"] for x in r) / 3600, 3),
                  "sentences": len({x["text"] for x in r}),
                  "speakers": sorted({x["speaker"] for x in r})} for s, r in rows.items()}
    seen_text = {x["text"] for s in ("train", "valid") for x in rows[s]}
    seen_spk = {x["speaker"] for s in ("train", "valid") for x in rows[s]}
    summary = {"out_dir": str(out_dir), "splits": splits,
               "test_sentences_disjoint": seen_text.isdisjoint(x["text"] for x in rows["test"]),
               "test_speakers_disjoint": seen_spk.isdisjoint(x["speaker"] for x in rows["test"])}
    if HELDOUT in rows:
        summary["heldout_source_unseen"] = not any(x["speaker"] == FESTIVAL_SPEAKER for x in
                                                   rows["train"] + rows["valid"])
    if (out_dir / "text.txt").is_file():
        text = {normalize_text(t) for t in load_sentences(out_dir / "text.txt")}
        summary["text_sentences"] = len(text)
        summary["text_disjoint"] = text.isdisjoint(
            normalize_text(x["text"]) for r in rows.values() for x in r
        )
    return summary


def print_summary(summary: dict[str, Any]) -> None:
    for split, s in summary["splits"].items():
        print(f"{split:10s}: {s['utterances']:5d} utts  {s['hours']:6.3f} h  "
              f"{s['sentences']:4d} sentences  {len(s['speakers']):3d} speakers")
    if "text_sentences" in summary:
        print(f"{'text':10s}: {summary['text_sentences']:5d} sentences (text only)")
    checks = {k: v for k, v in summary.items() if k.endswith(("disjoint", "unseen"))}
    verdict = "OK" if all(checks.values()) else "FAILED"
    print("check: " + ", ".join(f"{k}={v}" for k, v in checks.items()) + f" -> {verdict}")


def _voices_for_share(festival_share: float) -> list[str]:
    """The installed festival training voices that are to read `festival_share` of training (none
    for a share of 0); a share above 1, or one with no voice installed, is an error."""
    if festival_share <= 0:
        return []
    if festival_share > 1:
        raise ValueError(f"festival_share must be in (0, 1], got {festival_share}")
    voices = festival_train_voices()
    if not voices:
        raise EspeakMissingError(
            "festival_share needs festival and at least one of its training voices "
            "(training_scripts/setup_env.sh installs them)"
        )
    return voices


def _build(
    root: Path,
    plan: list[PlannedUtterance],
    info: dict[str, Any],
    jobs: int,
    progress: bool,
    seed: int,
) -> None:
    """Synthesize every planned utterance under `root` and write the manifests and the noisy
    copy."""
    (root / "wavs").mkdir()
    durations: dict[tuple[str, int], float] = {}
    tasks = [(u, str(root)) for u in plan]
    # Workers are started fresh ("spawn"), never forked: a fork of a process whose torch/OpenMP
    # threads have already run hangs in the child's first parallel torch op (the resampler).
    spawn = multiprocessing.get_context("spawn")
    workers = spawn.Pool(jobs, initializer=_worker_init) if jobs > 1 else nullcontext()
    with workers as pool:  # None without workers
        results = (
            pool.imap_unordered(_synthesize_job, tasks, chunksize=8)
            if pool
            else map(_synthesize_job, tasks)
        )
        for split, idx, dur in tqdm(results, total=len(tasks), desc="synthesizing", unit="utt",
                                    disable=not progress):
            durations[split, idx] = dur
    for split in (s for s in _splits(info) if s != NOISY):
        with open(root / f"{split}.jsonl", "w", encoding="utf-8") as f:
            for u in (u for u in plan if u.split == split):
                row = {"audio_filepath": u.rel_path, "duration": durations[split, u.index],
                       "text": u.text, "speaker": u.speaker, "speed": u.speed, "pitch": u.pitch}
                if u.pitch_range is not None:  # every varied reading, plain draws too
                    row.update(pitch_range=u.pitch_range, word_gap=u.word_gap)
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    corrupt_manifest(root / "test.jsonl", root, NOISY, seed=seed, snr_db=NOISY_SNR_DB, reverb=True)


def _worker_init() -> None:
    """A synthesis worker: one torch thread, and Ctrl-C left to the main process (which ends the
    pool and removes the staging folder), so a worker prints no traceback of its own."""
    torch.set_num_threads(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def make_corpus(out_dir: str | Path, seed: int = DEFAULT_SEED, num_utterances: int = 4800,
                max_sentences: Optional[int] = None, jobs: int = 2,
                sentences_path: Optional[str | Path] = None, force: bool = False,
                progress: bool = True, heldout: Optional[bool] = None,
                text_path: Optional[str | Path] = None, train_from_text: Optional[int] = None,
                festival_share: Optional[float] = None, prosody: bool = False) -> dict[str, Any]:
    """Generate (or reuse) the corpus in `out_dir`; returns the summary dict. `heldout` (default:
    when festival is installed) adds the festival split; `text_path` (default: the package's
    text-only sentences, when present) gives text.txt. `train_from_text` N reads N of the text-only
    sentences (a seeded choice) in the training split too, and text.txt keeps the rest.
    `festival_share` of the training utterances are read by festival's voices of other languages
    (those installed). With `prosody`, each training utterance espeak-ng reads gets its own
    intonation range and pause between words (``vary_prosody``). Options
    left None take ``default_options``, as konkanivani-demo-corpus does."""
    defaults = default_options(sentences_path, max_sentences)
    train_from_text = defaults["train_from_text"] if train_from_text is None else train_from_text
    festival_share = defaults["festival_share"] if festival_share is None else festival_share
    if shutil.which("espeak-ng") is None:
        raise EspeakMissingError("espeak-ng not found on PATH; install it first, e.g. "
                                 "`sudo apt-get install espeak-ng`")
    if heldout is None:
        heldout = festival_available()
        if not heldout and progress:
            print(
                "festival or its Marathi voice is missing (apt-get install festival"
                f" {FESTIVAL_VOICE_PACKAGE}): no {HELDOUT} split"
            )
    elif heldout and not festival_available():
        raise EspeakMissingError("the heldout split needs festival and its Marathi voice: "
                                 f"`sudo apt-get install festival {FESTIVAL_VOICE_PACKAGE}`")
    out = Path(out_dir)
    sent_path = Path(sentences_path) if sentences_path else DEFAULT_SENTENCES
    text_file = Path(text_path) if text_path else (DEFAULT_TEXT if DEFAULT_TEXT.is_file() else None)
    info = {
        "version": INFO_VERSION,
        "seed": seed,
        "num_utterances": num_utterances,
        "max_sentences": max_sentences,
        "sentences_sha1": sha1_of(sent_path),
        "heldout": heldout,
        "text_sha1": sha1_of(text_file) if text_file else None,
    }
    if train_from_text:
        if text_file is None:
            raise ValueError("train_from_text needs a text-only sentence file")
        info["train_from_text"] = train_from_text
    train_voices = _voices_for_share(festival_share)
    if train_voices:
        info.update(festival_share=festival_share, festival_voices=train_voices)
    if prosody:
        info["prosody"] = {"pitch_range_percent": list(PITCH_RANGE_PERCENT),
                           "word_gap": list(WORD_GAP_RANGE)}
    if not force and corpus_is_complete(out, info):
        if progress:
            print(f"corpus already present in {out}")
        return {**summarize(out), "skipped": True}

    sentences = load_sentences(sent_path)
    plan = plan_corpus(sentences, seed, num_utterances, max_sentences, heldout)
    text_only = text_only_sentences(text_file, sentences) if text_file else []
    extra = random.Random(seed).sample(text_only, min(train_from_text, len(text_only)))
    plan = read_text_into_train(plan, extra, seed)
    plan = read_with_festival_voices(plan, festival_share, train_voices, seed)
    if prosody:
        plan = vary_prosody(plan, seed)
    check_transliterable(plan, [sent_path, *([text_file] if text_file else [])])
    with Staging(out, "demo_corpus", INFO_FILE) as staging:
        _build(staging.path, plan, info, jobs, progress, seed)
        if text_file:
            lines = text_only_sentences(text_file, sentences + extra)
            (staging.path / "text.txt").write_text(
                "".join(t + "\n" for t in lines), encoding="utf-8"
            )
        staging.publish(info, stale=_OUTPUTS)
    return {**summarize(out), "skipped": False}
