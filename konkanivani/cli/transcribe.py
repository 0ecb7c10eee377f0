"""Transcribe audio with a konkanivani checkpoint (``konkanivani-transcribe``); the checkpoint
carries its tokenizer and model shape.

    konkanivani-transcribe checkpoints/run/best.pt clip.wav more_clips/ test.jsonl \\
        --method joint --output transcripts.jsonl
    konkanivani-transcribe checkpoints/streaming/best.pt meeting.flac --chunk_size 16 --stream

Inputs are audio files (8 to 192 kHz, any channel count soundfile reads), folders (searched
recursively) and JSONL manifests. ``--format`` says what comes out (by default ``text`` printed,
``json`` with ``--output``, as before it existed):

- ``text``: ``path<TAB>text`` per file;
- ``json``: a JSON row per file, ``{"audio_filepath", "text", "duration", "words"}``, each word
  ``{"word", "start", "end", "probability"}`` (seconds from the file's start; the probability in
  [0, 1], ``decoding.alignment``);
- ``srt`` and ``vtt``: subtitles (``decoding.subtitles``): of one input, printed or written to
  ``--output FILE``; of several, one file per input in the folder ``--output`` (made if missing),
  named after the input (its path inside a folder given as an input, with the format's suffix).

An output is written through a temporary file renamed when it is complete, so an interrupted run
leaves the old file whole; an output that is one of the files the run reads (the checkpoint, a
manifest, an audio file a folder or manifest holds), or that two inputs would both write, is refused
before anything is decoded. A file that cannot be read, states
a sample rate outside 8-192 kHz or too odd to resample, is too short for the model (under 0.06 s)
or fails to decode is named once on stderr and the others are still transcribed; the exit status
is then 1.

A file over 30 s, and with ``--chunk_size`` every file, is read block by block and transcribed in
segments, each printed as ``path<TAB>start<TAB>end<TAB>text`` (seconds) or written as a row
``{"audio_filepath", "start", "end", "text", "words"}`` (a cue or more of subtitles): with
``--chunk_size`` (a streaming checkpoint) through a stream whose segments end at pauses
(``--endpoint_ms``), with ``--stream`` its partial results on stderr as they change
(``path start-end … text``); otherwise in windows of at most 20 s cut at quiet moments, each decoded
whole with ``--method``.
"""
from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import soundfile as sf

from ..checkpoint import CheckpointError
from ..data.audio import AudioError
from ..data.manifest import ManifestError
from ..datatools.outputs import OutputError, output_file, write_output
from ..decoding.alignment import Word
from ..decoding.recognizer import Recognizer, Transcript, find_audio
from ..decoding.search import LONG_INPUT_SECONDS
from ..decoding.settings import DecodingConfig
from ..decoding.streaming import FRAME_SECONDS, Result
from ..decoding.subtitles import SUBTITLE_FORMATS, segment_of, subtitles
from . import Parser, fail, refuse_unsafe_outputs, setup_logging, tool
from .decoding_flags import (
    add_decoding_args,
    checked_decoding,
    decoding_inputs,
    decoding_name,
    load_recognizer,
)

# The DecodingConfig fields konkanivani-transcribe takes as flags (docs/generate_flags.py reads
# them).
DECODING_FIELDS = ("method", "beam_size", "ctc_weight", "lm", "lm_weight", "length_bonus",
                   "batch_size", "chunk_size", "left_chunks", "endpoint_ms", "device", "hotwords",
                   "hotword_boost")
FORMATS = ("text", "json", *SUBTITLE_FORMATS)


@tool
def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    streams = bool(args.chunk_size)
    if args.stream and not streams:
        parser.error("--stream needs --chunk_size N (streaming)")
    decoding = checked_decoding(parser, args, streams)
    output_format = args.format or ("json" if args.output else "text")
    setup_logging()
    try:
        found = [(item, path) for item in args.inputs for path, _ in find_audio([item])]
    except ManifestError as e:
        return fail(str(e))
    files = [path for _, path in found]
    subtitle_files = _checked_outputs(parser, args, decoding, output_format, found)
    try:
        recognizer = load_recognizer(args.checkpoint, decoding)
    except (CheckpointError, RuntimeError) as e:
        return fail(str(e))
    try:  # refused for a model that cannot stream; a warning for chunks it was not trained with
        resolved = recognizer.settings(decoding, streams=streams)
    except ValueError as e:
        return fail(f"--chunk_size {decoding.chunk_size}: {args.checkpoint}: {e}" if streams
                    else str(e))
    if not files:
        return fail("no audio files found in " + " ".join(args.inputs))

    tally, start = _Tally(), time.perf_counter()
    one_output = args.output if subtitle_files is None else None
    try:
        with output_file(one_output) if one_output else nullcontext() as out:
            sink = _Sink(output_format, out, subtitle_files)
            _transcribe_all(recognizer, files, decoding, resolved, args.stream, sink, tally)
    except OutputError as e:  # a full disk, say: the old file is left whole
        return fail(str(e))
    print(_summary(tally, len(files), time.perf_counter() - start, resolved, streams)
          + _wrote(args.output, sink), file=sys.stderr)
    if tally.failed:
        print(f"{len(tally.failed)} files could not be transcribed:", *tally.failed, sep="\n  ",
              file=sys.stderr)
        return 1
    return 0


def _parser() -> Parser:
    parser = Parser(description=__doc__.split("\n\n")[0])
    add_decoding_args(parser, DECODING_FIELDS)
    parser.add_argument("--stream", action="store_true",
                        help="with --chunk_size: print partial results on stderr as they change")
    parser.add_argument("inputs", nargs="+", help="audio files, folders or JSONL manifests")
    parser.add_argument("--output", help="write here instead of printing: a file, or with --format"
                        " srt/vtt and several inputs a folder of one file per input")
    parser.add_argument("--format", choices=FORMATS,
                        help="text (path and text), json (a row per file or segment, with word"
                        " times and probabilities), srt or vtt (subtitles); default: text printed,"
                        " json with --output")
    return parser


def _checked_outputs(parser: Parser, args, decoding: DecodingConfig, output_format: str,
                     found: Sequence[tuple[str, Path]]) -> dict[Path, Path] | None:
    """The subtitle file of each input (``_subtitle_files``), every output checked against every
    file the run reads (the folders and manifests expanded as find_audio expands them for
    decoding) before anything is decoded: a refusal is one line of ``parser``."""
    reads = [*decoding_inputs(args.checkpoint, decoding), *args.inputs, *(p for _, p in found)]
    subtitle_files = _subtitle_files(parser, output_format, args.output, found)
    if subtitle_files is not None:
        outputs = [(f"--output (the {output_format} of {audio})", out)
                   for audio, out in subtitle_files.items()]
        refuse_unsafe_outputs(parser, outputs, reads)
    else:
        refuse_unsafe_outputs(parser, {"--output": args.output}, reads)
    return subtitle_files


@dataclass
class _Tally:
    """What a run did: the files that failed (their reasons), the long inputs decoded with another
    method, the files decoded in segments, the seconds of audio transcribed."""

    failed: list[str] = field(default_factory=list)
    long_inputs: int = 0
    in_segments: int = 0
    audio_s: float = 0.0


def _transcribe_all(recognizer: Recognizer, files: list[Path], decoding: DecodingConfig,
                    resolved: DecodingConfig, partials: bool, sink: _Sink, tally: _Tally) -> None:
    """Every file to ``sink``: in segments (``_runs`` says which) or whole and batched."""
    for paths, segmented in _runs(files, decoding.chunk_size):
        if segmented:
            error = _transcribe_in_segments(recognizer, paths[0], decoding, partials, sink)
            if error is not None:
                tally.failed.append(error)
                sink.discard()
                continue
            sink.done(paths[0])
            tally.in_segments += 1
            tally.audio_s += _seconds(paths[0])
            continue
        for tr in recognizer.transcribe(paths, decoding):
            if tr.error is not None:
                tally.failed.append(tr.error)
                continue
            tally.audio_s += tr.duration
            tally.long_inputs += tr.method != resolved.method
            sink.whole(tr)
            sink.done(Path(tr.audio_filepath))


def _summary(tally: _Tally, files: int, elapsed: float, resolved: DecodingConfig,
             streams: bool) -> str:
    """The run's summary line (stderr)."""
    audio_s = tally.audio_s
    speed = f" in {elapsed:.1f} s: real-time factor {elapsed / audio_s:.3f}" if audio_s else ""
    if streams:
        chunk, left = resolved.chunk_size, resolved.left_chunks
        how = (f", streamed in chunks of {chunk} frames ({chunk * FRAME_SECONDS * 1000:g} ms"
               + (f", {left} to the left" if left >= 0 else "") + ")")
    else:
        how = (f" ({tally.in_segments} over {LONG_INPUT_SECONDS:g} s in windows)"
               if tally.in_segments else "")
    return (f"{files - len(tally.failed)} of {files} files ({audio_s:.1f} s of audio) transcribed"
            f" with {decoding_name(resolved, tally.long_inputs)}{how}{speed}")


def _runs(files: list[Path], chunk_size: int) -> Iterator[tuple[list[Path], bool]]:
    """The files in order, as runs of consecutive files decoded whole (batched,
    ``Recognizer.transcribe``) and single files decoded in segments
    (``Recognizer.transcribe_long``): with ``chunk_size`` every
    file, else those over ``LONG_INPUT_SECONDS`` by their header."""
    run: list[Path] = []
    for path in files:
        if chunk_size or _seconds(path) > LONG_INPUT_SECONDS:
            if run:
                yield run, False
                run = []
            yield [path], True
        else:
            run.append(path)
    if run:
        yield run, False


def _seconds(path: Path) -> float:
    """The duration a file's header states; 0 for one that cannot be read (decoding it names
    why)."""
    try:
        return sf.info(str(path)).duration
    except Exception:  # noqa: BLE001  soundfile raises LibsndfileError, RuntimeError, TypeError...
        return 0.0


def _transcribe_in_segments(recognizer: Recognizer, path: Path, decoding: DecodingConfig,
                            partials: bool, sink: _Sink) -> str | None:
    """Give ``sink`` the segments of one file as they come (partial results on stderr with
    ``partials``, ``--stream``); the reason it failed, or None."""
    shown = ""  # the partial text last shown
    try:
        for r in recognizer.transcribe_long(path, decoding, partials=partials):
            if not r.is_final:
                if r.text.strip() != shown:
                    shown = r.text.strip()
                    print(
                        f"{path} {r.start:.2f}-{r.end:.2f} … {shown}", file=sys.stderr, flush=True
                    )
                continue
            shown = ""
            sink.segment(path, r)
    except AudioError as e:
        return str(e)
    # whatever the file makes the model raise: the other files go on
    except Exception as e:  # noqa: BLE001
        reason = str(e).strip().splitlines()[0] if str(e).strip() else "no message"
        return f"{path}: decoding failed ({type(e).__name__}: {reason})"
    return None


def _subtitle_files(parser: Parser, output_format: str, output: str | None,
                    found: Sequence[tuple[str, Path]]) -> dict[Path, Path] | None:
    """Where the subtitles of each input go: None where they are printed, or where the format is no
    subtitles (one ``--output`` file or none); else the file of each input, refused in one line of
    ``parser`` when several inputs have no folder to go to (see the module)."""
    if output_format not in SUBTITLE_FORMATS:
        return None
    folder = output is not None and (os.path.isdir(output) or output.endswith(("/", os.sep)))
    if len(found) <= 1 and not folder:
        return None if output is None else {path: Path(output) for _, path in found}
    if output is None:
        parser.error(f"--format {output_format} writes a file per input: give --output FOLDER for"
                     f" the {len(found)} inputs")
    if not folder and os.path.exists(output):
        parser.error(f"--output {output} is a file: --format {output_format} writes a file per"
                     f" input, into a folder, for the {len(found)} inputs")
    return {path: Path(output) / _name_inside(item, path).with_suffix("." + output_format)
            for item, path in found}


def _name_inside(item: str, path: Path) -> Path:
    """The name a subtitle file of ``path`` takes in the output folder: its path inside ``item``
    when the input is a folder, else its file name."""
    if Path(item).is_dir():
        return path.relative_to(item)
    return Path(path.name)


def _word_rows(words: list[Word]) -> list[dict]:
    return [{"word": w.text, "start": w.start, "end": w.end}
            | ({} if w.probability is None else {"probability": w.probability}) for w in words]


class _Sink:
    """Where the transcripts go, in ``output_format``: lines or JSON rows to ``out`` (stdout when
    None) as they come; subtitles when a file is done, to its file of ``files`` (stdout when
    None)."""

    def __init__(self, output_format: str, out: TextIO | None, files: dict[Path, Path] | None):
        self.format, self.out, self.files = output_format, out, files
        self.segments: list = []  # the segments of the file being transcribed, for subtitles
        self.written = 0  # subtitle files

    def whole(self, tr: Transcript) -> None:
        row = {"audio_filepath": tr.audio_filepath, "text": tr.text,
               "duration": round(tr.duration, 3), "words": _word_rows(tr.words)}
        self._give(f"{tr.audio_filepath}\t{tr.text}", row,
                   segment_of(tr.text, tr.words, tr.duration))

    def segment(self, path: Path, r: Result) -> None:
        row = {"audio_filepath": str(path), "start": r.start, "end": r.end, "text": r.text,
               "words": _word_rows(r.words)}
        self._give(f"{path}\t{r.start:.2f}\t{r.end:.2f}\t{r.text}", row, r)

    def _give(self, line: str, row: dict, segment) -> None:
        if self.format in SUBTITLE_FORMATS:
            self.segments.append(segment)
        elif self.format == "json":
            self._print(json.dumps(row, ensure_ascii=False))
        else:
            self._print(line)

    def _print(self, line: str) -> None:
        if self.out is None:
            print(line, flush=True)
        else:
            self.out.write(line + "\n")

    def discard(self) -> None:
        """The file being transcribed failed: no subtitles of it."""
        self.segments = []

    def done(self, path: Path) -> None:
        """The file ``path`` is transcribed: its subtitles are written."""
        if self.format not in SUBTITLE_FORMATS:
            return
        text = subtitles(self.segments, self.format)
        self.segments = []
        target = None if self.files is None else self.files.get(path)
        if target is None:
            print(text, end="", flush=True)
            return
        write_output(target, text)
        self.written += 1


def _wrote(output: str | None, sink: _Sink) -> str:
    """What the summary line says was written."""
    if output is None:
        return ""
    if os.path.isdir(output):
        return f"; wrote {sink.written} {sink.format} files in {output}"
    return f"; wrote {output}"


if __name__ == "__main__":
    sys.exit(main())
