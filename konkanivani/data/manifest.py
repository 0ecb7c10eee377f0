"""Manifests and the checks one row must pass, shared by training, ``konkanivani-validate`` and
``konkanivani-prepare``.

A manifest is NeMo-style JSON lines: ``audio_filepath`` (absolute or relative to the manifest's
folder), ``duration`` (seconds) and ``text``; other keys are kept and ignored.

A row fails (an *error*, the row is skipped) when its audio is missing, unreadable or empty, its
duration differs from the file's, it is longer than the limit, its text is empty, leaves no token
or holds characters the tokenizer cannot encode, or its audio is too short for its text under
CTC. A sample rate other than 16 kHz or more than one channel is only a *warning* (the audio is
resampled and mixed down) unless ``strict``.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import soundfile as sf

from ..config import DEFAULT_DURATION_TOLERANCE
from .frames import SAMPLE_RATE, ctc_frames_of
from .tokenizer import UNK_ID, Tokenizer, normalize_text

__all__ = [
    "DEFAULT_DURATION_TOLERANCE",
    "PSEUDO_LABEL",
    "ManifestError",
    "RowCheck",
    "check_row",
    "check_text",
    "ctc_frames_needed",
    "input_inside",
    "iter_manifest",
    "manifest_audio",
    "read_manifest",
    "refuse_pseudo_labels",
    "pseudo_labelled",
    "resolve_audio_path",
]

# The key konkanivani-pseudolabel marks its rows with: {"teacher": ..., "confidence": ...}.
PSEUDO_LABEL = "pseudo_label"


@dataclass
class RowCheck:
    """What ``check_row`` found. ``error`` is None for a usable row; ``warnings`` may still hold
    notes."""

    error: tuple[str, str] | None = None  # (reason, detail)
    warnings: list[tuple[str, str]] = field(default_factory=list)
    audio_path: Path | None = None
    duration: float = 0.0
    text: str = ""
    tokens: list[int] = field(default_factory=list)


def resolve_audio_path(audio: str, base_dir: Path) -> Path:
    """A manifest's ``audio_filepath``: absolute as written, or relative to the manifest's
    folder."""
    return Path(audio) if Path(audio).is_absolute() else base_dir / audio


def _fail(check: RowCheck, reason: str, detail: str = "") -> RowCheck:
    check.error = (reason, detail)
    return check


def check_row(
    row: dict[str, Any],
    base_dir: Path,
    tokenizer: Optional[Tokenizer],
    *,
    max_duration: float = float("inf"),
    duration_tolerance: float = DEFAULT_DURATION_TOLERANCE,
    decode: bool = False,
    strict: bool = False,
) -> RowCheck:
    """Check one manifest row; relative audio paths are taken from ``base_dir``.

    Only the audio header is read unless ``decode`` (which reads every sample, and finds files
    that are corrupt past their header or hold NaN samples; too slow to do for every run).
    ``duration_tolerance`` < 0 skips the duration comparison. With no ``tokenizer`` (audio alone,
    for pretraining) the text is not read: the row needs none, and its tokens are none.
    """
    check = RowCheck()
    audio, text = row.get("audio_filepath"), row.get("text")
    if not isinstance(audio, str) or not audio:
        return _fail(check, "no audio_filepath")
    if tokenizer is None:
        text = ""
    elif not isinstance(text, str) or not text.strip():
        return _fail(check, "empty text")
    check.text = text
    path = resolve_audio_path(audio, base_dir)
    check.audio_path = path
    if not path.is_file():
        return _fail(check, "audio file missing", str(path))
    try:
        info = sf.info(str(path))
        frames, sample_rate, channels = info.frames, info.samplerate, info.channels
        if decode:
            data, _ = sf.read(str(path), dtype="float32", always_2d=True)
            frames = data.shape[0]
            if not np.isfinite(data).all():
                return _fail(check, "audio holds NaN or infinite samples", str(path))
    # soundfile raises LibsndfileError, RuntimeError, TypeError...
    except Exception as e:  # noqa: BLE001
        return _fail(check, "audio unreadable", f"{path}: {e}")
    if frames <= 0 or sample_rate <= 0:
        return _fail(check, "audio empty", str(path))
    check.duration = duration = frames / sample_rate
    stated = row.get("duration")
    if stated is not None and duration_tolerance >= 0:
        if (
            isinstance(stated, bool)
            or not isinstance(stated, (int, float))
            or not math.isfinite(stated)
        ):
            return _fail(check, "duration not a number", repr(stated))
        if abs(stated - duration) > duration_tolerance:
            return _fail(
                check,
                "duration mismatch",
                f"manifest says {stated:.2f} s, {path} holds {duration:.2f} s",
            )
    conversions = [("not 16 kHz", f"{sample_rate} Hz")] if sample_rate != SAMPLE_RATE else []
    conversions += [("not mono", f"{channels} channels")] if channels != 1 else []
    for reason, detail in conversions:
        if strict:
            return _fail(check, reason, f"{path}: {detail}")
        check.warnings.append((reason, f"{path}: {detail}, converted when loaded"))
    if duration > max_duration:
        return _fail(check, "longer than max_duration", f"{duration:.1f} s")
    if tokenizer is None:
        return check
    error, tokens = check_text(text, duration, tokenizer)
    if error is not None:
        return _fail(check, *error)
    check.tokens = tokens
    return check


def check_text(
    text: str, duration: float, tokenizer: Tokenizer
) -> tuple[tuple[str, str] | None, list[int]]:
    """The text checks of a row whose audio lasts ``duration`` seconds: ``(None, token ids)``, or
    ``((reason, detail), [])`` when it leaves no token, holds characters the tokenizer cannot encode
    or has more tokens than CTC can align to that audio. (Shards check their members with it.)"""
    if not isinstance(text, str) or not text.strip():
        return ("empty text", ""), []
    tokens = tokenizer.encode(text)
    if not tokens:
        return ("no token after normalization", ""), []
    if UNK_ID in tokens:
        unknown = sorted(
            {
                ch
                for ch in normalize_text(text)
                if not ch.isspace() and UNK_ID in tokenizer.encode(ch)
            }
        )
        return ("characters the tokenizer cannot encode",
                " ".join(f"{ch!r} U+{ord(ch):04X}" for ch in unknown) or "unknown pieces"), []
    needed = ctc_frames_needed(tokens)
    if ctc_frames_of(duration) < needed:
        repeats = needed - len(tokens)
        return ("too short for CTC", f"{duration:.2f} s for {len(tokens)} tokens"
                + (f" and {repeats} repeated" if repeats else "")), []
    return None, tokens


def ctc_frames_needed(tokens: Sequence[int]) -> int:
    """The fewest encoder frames CTC can align ``tokens`` to: one a token, and a blank between two
    equal neighbours (below it, CTC's loss is infinite).

    >>> ctc_frames_needed([5, 5, 7]), ctc_frames_needed([5, 6, 7])
    (4, 3)
    """
    return len(tokens) + sum(a == b for a, b in zip(tokens, tokens[1:]))


class ManifestError(ValueError):
    """A manifest that cannot be used at all (missing file, a line that is not a JSON object)."""


def iter_manifest(path: str | Path) -> Iterator[tuple[int, dict | ManifestError]]:
    """``(line number, row)`` for every non-blank line, or ``(line number, ManifestError)`` for a
    line that is not UTF-8 JSON holding an object, so that a checker can report them all."""
    path = Path(path)
    if not path.is_file():
        raise ManifestError(f"manifest {path} does not exist")
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            try:
                # a BOM may open the file
                line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8").strip()
                if not line:
                    continue
                row = json.loads(line)
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                yield line_no, ManifestError(
                    f"{path}:{line_no}: not a JSON line ({e}); a manifest holds one JSON object a"
                    ' line {"audio_filepath": ..., "duration": ..., "text": ...}'
                )
                continue
            if not isinstance(row, dict):
                yield line_no, ManifestError(
                    f"{path}:{line_no}: expected a JSON object, got {type(row).__name__}"
                )
                continue
            yield line_no, row


def read_manifest(path: str | Path) -> list[tuple[int, dict]]:
    """``(line number, row)`` for every non-blank line. Raises ``ManifestError`` naming the file and
    line when the file is missing or a line is not UTF-8 JSON holding an object."""
    rows = []
    for line_no, row in iter_manifest(path):
        if isinstance(row, ManifestError):
            raise ManifestError(
                f"{row}; konkanivani-validate (training_scripts/validate_manifest.py) lists every "
                "bad line and writes a cleaned manifest"
            )
        rows.append((line_no, row))
    return rows


def refuse_pseudo_labels(path: str | Path, what: str) -> None:
    """``ManifestError`` in one line when the manifest ``path`` (given as ``what``, a flag) holds a
    row marked ``pseudo_label``: a model's own guesses scored as the truth would measure the
    teacher, not the student. Lines that are no JSON object are left to the reading, which names
    them."""
    for line_no, row in iter_manifest(path):
        if isinstance(row, dict) and PSEUDO_LABEL in row:
            raise pseudo_labelled(path, line_no, what)


def pseudo_labelled(path: str | Path, line_no: int, what: str) -> ManifestError:
    """The one line that refuses a pseudo-labelled row (line ``line_no`` of ``path``, given as
    ``what``) where true text is needed: validation, evaluation, choosing a threshold."""
    return ManifestError(
        f"{what} {path}:{line_no} is pseudo-labelled (konkanivani-pseudolabel's output): "
        "validate and test on transcribed speech only")


def input_inside(folder: str | Path, reads: Iterable[str | Path]) -> Path | None:
    """The first of ``reads`` that ``folder`` is or holds, symlinks followed (None: none is): a
    tool that replaced or moved ``folder`` would take that input with it."""
    folder = Path(os.path.realpath(folder))
    for read in reads:
        real = Path(os.path.realpath(read))
        if real == folder or folder in real.parents:
            return Path(read)
    return None


def manifest_audio(manifest: str | Path) -> list[Path]:
    """Every audio file the rows of ``manifest`` name, resolved as decoding, validation and shard
    writing resolve them; lines that are no JSON object are passed over (the tools name those)."""
    manifest = Path(manifest)
    rows = [row for _, row in iter_manifest(manifest) if isinstance(row, dict)]
    return [resolve_audio_path(row["audio_filepath"], manifest.parent) for row in rows
            if isinstance(row.get("audio_filepath"), str) and row["audio_filepath"]]
