"""Subtitles of timed segments: SRT through the ``srt`` library, WebVTT through ``webvtt-py``.

A segment is anything with ``text``, ``start``, ``end`` (seconds) and ``words``
(``alignment.Word``, timed): a stream's or a long file's final ``Result``, or a whole file's
(``Recognizer.decode_results``, or a ``Transcript`` as ``segment_of`` makes it). Each segment
becomes one cue, or several when it is long, cut between words by their times as faster-whisper
and whisper cut theirs:

- a line holds at most ``MAX_LINE_CHARS`` (42) characters as they are seen (combining marks, such
  as Devanagari's vowel signs and virama, take no place of their own) and a cue at most
  ``MAX_LINES`` (2) lines: the common broadcast rule (42 characters, two lines), which a reader
  reads in the time a cue stays;
- a cue lasts at most ``MAX_CUE_SECONDS`` (6 s), about what two full lines take to read;
- a pause of more than ``MAX_PAUSE_SECONDS`` (1 s) between two words starts a new cue, so no cue
  stays on the screen through a silence.

A cue runs from its first word's start to its last word's end. A segment without words (an export
decodes without them) is one cue over the whole segment, its text wrapped into lines. Segments
without text give no cue.
"""
from __future__ import annotations

import datetime
import unicodedata
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import srt
import webvtt

from .alignment import Word

__all__ = [
    "MAX_CUE_SECONDS",
    "MAX_LINES",
    "MAX_LINE_CHARS",
    "MAX_PAUSE_SECONDS",
    "SUBTITLE_FORMATS",
    "Cue",
    "Segment",
    "cues",
    "segment_of",
    "subtitles",
    "to_srt",
    "to_vtt",
]

MAX_LINE_CHARS = 42
MAX_LINES = 2
MAX_CUE_SECONDS = 6.0
MAX_PAUSE_SECONDS = 1.0
SUBTITLE_FORMATS = ("srt", "vtt")


class Segment(Protocol):
    """What a cue is made from: a ``streaming.Result`` is one."""

    text: str
    start: float
    end: float
    words: list[Word]


@dataclass
class TimedText:
    """A segment of its own: ``segment_of`` makes one of a whole file's transcript."""

    text: str
    start: float
    end: float
    words: list[Word] = field(default_factory=list)


@dataclass
class Cue:
    """A subtitle: its lines, shown from ``start`` to ``end`` seconds."""

    start: float
    end: float
    lines: list[str]

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


def segment_of(text: str, words: Sequence[Word], duration: float) -> TimedText:
    """A whole file's transcript as one segment: from its first word to its last (the whole file
    when it has no words)."""
    words = list(words)
    if words:
        return TimedText(text, words[0].start, words[-1].end, words)
    return TimedText(text, 0.0, round(duration, 3), [])


def width(text: str) -> int:
    """The places ``text`` takes on a line: its characters but combining marks and format
    characters (a vowel sign sits on its consonant)."""
    return sum(unicodedata.category(ch) not in ("Mn", "Mc", "Me", "Cf") for ch in text)


def cues(segments: Iterable[Segment], max_line_chars: int = MAX_LINE_CHARS,
         max_lines: int = MAX_LINES, max_seconds: float = MAX_CUE_SECONDS,
         max_pause: float = MAX_PAUSE_SECONDS) -> list[Cue]:
    """The cues of ``segments`` in order, each segment cut as the module says."""
    out: list[Cue] = []
    for segment in segments:
        if not segment.text.strip():
            continue
        if segment.words:
            out += _cut(segment.words, max_line_chars, max_lines, max_seconds, max_pause)
        else:
            out.append(Cue(segment.start, segment.end, _wrap(segment.text.split(), max_line_chars)))
    return out


def _cut(words: Sequence[Word], max_line_chars: int, max_lines: int, max_seconds: float,
         max_pause: float) -> list[Cue]:
    """Cues of one segment's timed words, filled line by line (see the module)."""
    out: list[Cue] = []
    taken: list[Word] = []  # the words of the cue being filled
    lines: list[str] = []
    for word in words:
        line = lines[-1] if lines else ""
        fits_line = not line or width(line) + 1 + width(word.text) <= max_line_chars
        if taken and (
            word.start - taken[-1].end > max_pause
            or word.end - taken[0].start > max_seconds
            or (not fits_line and len(lines) >= max_lines)
        ):
            out.append(Cue(taken[0].start, taken[-1].end, lines))
            taken, lines = [], []
            line, fits_line = "", True
        if lines and fits_line:
            lines[-1] = f"{line} {word.text}"
        else:
            lines.append(word.text)
        taken.append(word)
    if taken:
        out.append(Cue(taken[0].start, taken[-1].end, lines))
    return out


def _wrap(words: Sequence[str], max_line_chars: int) -> list[str]:
    """``words`` in lines of at most ``max_line_chars`` places (a longer word alone)."""
    lines: list[str] = []
    for word in words:
        if lines and width(lines[-1]) + 1 + width(word) <= max_line_chars:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return lines


def to_srt(segments: Iterable[Segment], **limits) -> str:
    """SubRip text of ``segments``' cues (``cues``, its ``limits`` as keywords), numbered from 1."""
    return srt.compose(
        [
            srt.Subtitle(i, _delta(c.start), _delta(c.end), c.text)
            for i, c in enumerate(cues(segments, **limits), 1)
        ]
    )


def to_vtt(segments: Iterable[Segment], **limits) -> str:
    """WebVTT text of ``segments``' cues (``cues``, its ``limits`` as keywords)."""
    # "-->" in a cue's text would end its timing line; a recognizer's text never holds it, but a
    # cue is no place for it either
    captions = [
        webvtt.Caption(_vtt_time(c.start), _vtt_time(c.end), c.text.replace("-->", "->"))
        for c in cues(segments, **limits)
    ]
    return webvtt.WebVTT(captions=captions).content


def subtitles(segments: Iterable[Segment], subtitle_format: str, **limits) -> str:
    """``to_srt`` or ``to_vtt``, by ``subtitle_format`` (one of ``SUBTITLE_FORMATS``)."""
    if subtitle_format == "srt":
        return to_srt(segments, **limits)
    if subtitle_format == "vtt":
        return to_vtt(segments, **limits)
    raise ValueError(
        f"unknown subtitle format {subtitle_format!r}; choose from {', '.join(SUBTITLE_FORMATS)}"
    )


def _delta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(milliseconds=round(seconds * 1000))


def _vtt_time(seconds: float) -> str:
    """``HH:MM:SS.mmm``, as a WebVTT cue's timing line writes a time."""
    ms = round(seconds * 1000)
    return f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d}.{ms % 1000:03d}"
