"""Scoring a recognizer on a manifest: corpus WER/CER with substitutions, deletions and insertions,
per-utterance results, the worst utterances, and a markdown report."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..data.manifest import PSEUDO_LABEL, pseudo_labelled, read_manifest, resolve_audio_path
from ..data.tokenizer import normalize_text
from .metrics import ErrorCounts, score
from .recognizer import Recognizer
from .search import LONG_INPUT_METHOD, LONG_INPUT_SECONDS
from .settings import DecodingConfig

__all__ = [
    "ErrorCounts",
    "EvalResult",
    "UtteranceResult",
    "evaluate_manifest",
    "markdown_report",
    "score",
]


@dataclass
class UtteranceResult:
    where: str  # manifest:line
    audio_filepath: str
    reference: str
    hypothesis: str
    duration: float
    words: ErrorCounts
    chars: ErrorCounts
    method: str = ""  # the method that decoded it (LONG_INPUT_METHOD for a long one)

    def to_json(self) -> dict:
        row = asdict(self)
        row["wer"], row["cer"] = self.words.rate, self.chars.rate
        return row


@dataclass
class EvalResult:
    manifest: str
    method: str
    utterances: list[UtteranceResult] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)  # (where, why) of rows not scored
    words: ErrorCounts = field(default_factory=ErrorCounts)
    chars: ErrorCounts = field(default_factory=ErrorCounts)
    audio_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def wer(self) -> float:
        return self.words.rate

    @property
    def cer(self) -> float:
        return self.chars.rate

    @property
    def rtf(self) -> float:
        return self.decode_seconds / self.audio_seconds if self.audio_seconds else float("nan")

    @property
    def long_inputs(self) -> int:
        """Utterances decoded with another method than ``method``: too long for it
        (``settings.LONG_INPUT_SECONDS``)."""
        return sum(bool(u.method) and u.method != self.method for u in self.utterances)

    def worst(self, n: int = 10) -> list[UtteranceResult]:
        """The ``n`` utterances with the most word errors (then character errors)."""
        return sorted(
            self.utterances, key=lambda u: (u.words.errors, u.chars.errors), reverse=True
        )[:n]


def evaluate_manifest(recognizer: Recognizer, manifest: str | Path,
                      decoding: DecodingConfig | None = None, **overrides) -> EvalResult:
    """Decode every row of ``manifest`` with ``decoding`` and its ``overrides`` (as
    ``Recognizer.transcribe``: with the recognizer's LM at ``lm_weight`` and ``length_bonus``,
    under the chunk mask of ``chunk_size``) and score it against its ``text``. Rows without text or
    with audio that cannot be read or decoded are listed in ``failed`` and left out of the totals;
    an utterance too long for the method is scored as ``LONG_INPUT_METHOD`` decoded it
    (``long_inputs``). A pseudo-labelled row stops it (``ManifestError``, naming its line)."""
    d = recognizer.settings(decoding, **overrides)
    manifest = Path(manifest)
    result = EvalResult(str(manifest), d.method)
    rows = []
    for line_no, row in read_manifest(manifest):
        where = f"{manifest}:{line_no}"
        if PSEUDO_LABEL in row:  # a teacher's text scored as the truth would measure the teacher
            raise pseudo_labelled(manifest, line_no, "manifest")
        audio, text = row.get("audio_filepath"), row.get("text")
        if not isinstance(audio, str) or not audio:
            result.failed.append((where, "no audio_filepath"))
        elif not isinstance(text, str) or not normalize_text(text):
            result.failed.append((where, "empty reference text"))
        else:
            rows.append((where, resolve_audio_path(audio, manifest.parent), text))
    start = time.perf_counter()
    transcripts = list(recognizer.transcribe([path for _, path, _ in rows], d))
    result.decode_seconds = time.perf_counter() - start
    for (where, path, text), tr in zip(rows, transcripts, strict=True):
        if tr.error is not None:
            result.failed.append((where, tr.error))
            continue
        words, chars = score(text, tr.text)
        result.utterances.append(
            UtteranceResult(where, str(path), text, tr.text, tr.duration, words, chars, tr.method)
        )
        result.words += words
        result.chars += chars
        result.audio_seconds += tr.duration
    return result


def markdown_report(result: EvalResult, checkpoint: str, worst: int = 10) -> str:
    w, c = result.words, result.chars
    lines = [
        f"# Evaluation of `{checkpoint}`",
        "",
        f"Manifest `{result.manifest}`, decoding `{result.method}`{_long_note(result)}: "
        f"{len(result.utterances)} utterances scored, "
        f"{result.audio_seconds / 60:.1f} min of audio"
        + (f", real-time factor {result.rtf:.3f}." if result.audio_seconds else "."),
        "",
        "| unit | reference length | substitutions | deletions | insertions | error rate |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
        (
            f"| words | {w.length} | {w.substitutions} | {w.deletions} | {w.insertions} |"
            f" {100 * w.rate:.2f}% |"
        ),
        (
            f"| characters | {c.length} | {c.substitutions} | {c.deletions} | {c.insertions} |"
            f" {100 * c.rate:.2f}% |"
        ),
    ]
    if result.failed:
        lines += ["", f"## {len(result.failed)} rows not scored", ""]
        lines += [f"- `{where}`: {why}" for where, why in result.failed]
    lines += ["", f"## The {min(worst, len(result.utterances))} worst utterances", "",
              "| where | WER | CER | reference | hypothesis |", "| --- | ---: | ---: | --- | --- |"]
    for u in result.worst(worst):
        lines.append(f"| `{u.where}` | {100 * u.words.rate:.0f}% | {100 * u.chars.rate:.0f}% | "
                     f"{_cell(u.reference)} | {_cell(u.hypothesis)} |")
    return "\n".join(lines) + "\n"


def _long_note(result: EvalResult) -> str:
    """How many utterances were too long for the method, and what decoded them; empty when none."""
    n = result.long_inputs
    return (
        f" ({n} utterance{'s' * (n > 1)} over {LONG_INPUT_SECONDS:g} s with `{LONG_INPUT_METHOD}`)"
        if n
        else ""
    )


def _cell(text: str) -> str:
    return normalize_text(text).replace("|", "\\|") or "—"
