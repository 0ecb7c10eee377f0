"""Transcribe audio with a konkanivani checkpoint (``konkanivani-transcribe``); the checkpoint
carries its tokenizer and model shape.

    konkanivani-transcribe checkpoints/run/best.pt clip.wav more_clips/ test.jsonl \\
        --method joint --output transcripts.jsonl
    konkanivani-transcribe checkpoints/streaming/best.pt meeting.flac --chunk_size 16 --stream

Inputs are audio files (8 to 192 kHz, any channel count soundfile reads), folders (searched
recursively) and JSONL manifests. Prints ``path<TAB>text`` per file, or writes JSONL rows
``{"audio_filepath", "text", "duration"}`` with ``--output``: through a temporary file renamed
when the run ends, so an interrupted run leaves the old file whole; an ``--output`` that is one of
the files the run reads (the checkpoint, a manifest, an audio file a folder or manifest holds) is
refused before anything is decoded. A file that cannot be read, states
a sample rate outside 8-192 kHz or too odd to resample, is too short for the model (under 0.06 s)
or fails to decode is named once on stderr and the others are still transcribed; the exit status
is then 1.

A file over 30 s, and with ``--chunk_size`` every file, is read block by block and transcribed in
segments, each printed as ``path<TAB>start<TAB>end<TAB>text`` (seconds) or written as a row
``{"audio_filepath", "start", "end", "text"}`` (streams add ``words``, each with its times): with
``--chunk_size`` (a streaming checkpoint) through a stream whose segments end at pauses
(``--endpoint_ms``), with ``--stream`` its partial results on stderr as they change
(``path start-end … text``); otherwise in windows of at most 20 s cut at quiet moments, each decoded
whole with ``--method``.
"""
from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import TextIO

import soundfile as sf

from ..checkpoint import CheckpointError
from ..data.audio import AudioError
from ..data.manifest import ManifestError
from ..datatools.outputs import OutputError, output_file
from ..decoding.recognizer import Recognizer, find_audio
from ..decoding.search import LONG_INPUT_SECONDS
from ..decoding.settings import DecodingConfig
from ..decoding.streaming import FRAME_SECONDS
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


@tool
def main(argv: list[str] | None = None) -> int:
    parser = Parser(description=__doc__.split("\n\n")[0])
    add_decoding_args(parser, DECODING_FIELDS)
    parser.add_argument("--stream", action="store_true",
                        help="with --chunk_size: print partial results on stderr as they change")
    parser.add_argument("inputs", nargs="+", help="audio files, folders or JSONL manifests")
    parser.add_argument("--output", help="write JSONL here instead of printing")
    args = parser.parse_args(argv)
    streams = bool(args.chunk_size)
    if args.stream and not streams:
        parser.error("--stream needs --chunk_size N (streaming)")
    decoding = checked_decoding(parser, args, streams)
    setup_logging()
    try:
        files = [path for path, _ in find_audio(args.inputs)]
    except ManifestError as e:
        return fail(str(e))
    # Every file the run reads, the folders and manifests expanded as find_audio expands them for
    # decoding; checked before anything is decoded.
    reads = [*decoding_inputs(args.checkpoint, decoding), *args.inputs, *files]
    refuse_unsafe_outputs(parser, {"--output": args.output}, reads)
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

    failed, long_inputs, in_segments, audio_s, start = [], 0, 0, 0.0, time.perf_counter()
    try:
        with output_file(args.output) if args.output else nullcontext() as out:
            for paths, segmented in _runs(files, decoding.chunk_size):
                if segmented:
                    error = _transcribe_in_segments(recognizer, paths[0], decoding, args.stream,
                                                    out)
                    if error is not None:
                        failed.append(error)
                        continue
                    in_segments += 1
                    audio_s += _seconds(paths[0])
                    continue
                for tr in recognizer.transcribe(paths, decoding):
                    if tr.error is not None:
                        failed.append(tr.error)
                        continue
                    audio_s += tr.duration
                    long_inputs += tr.method != resolved.method
                    row = {"audio_filepath": tr.audio_filepath, "text": tr.text,
                           "duration": round(tr.duration, 3)}
                    _write(out, f"{tr.audio_filepath}\t{tr.text}", row)
    except OutputError as e:  # a full disk, say: the old file is left whole
        return fail(str(e))
    elapsed = time.perf_counter() - start
    done = len(files) - len(failed)
    speed = f" in {elapsed:.1f} s: real-time factor {elapsed / audio_s:.3f}" if audio_s else ""
    if streams:
        chunk, left = resolved.chunk_size, resolved.left_chunks
        how = (f", streamed in chunks of {chunk} frames ({chunk * FRAME_SECONDS * 1000:g} ms"
               + (f", {left} to the left" if left >= 0 else "") + ")")
    else:
        how = f" ({in_segments} over {LONG_INPUT_SECONDS:g} s in windows)" if in_segments else ""
    print(f"{done} of {len(files)} files ({audio_s:.1f} s of audio) transcribed with "
          f"{decoding_name(resolved, long_inputs)}{how}{speed}"
          + (f"; wrote {args.output}" if args.output else ""), file=sys.stderr)
    if failed:
        print(
            f"{len(failed)} files could not be transcribed:", *failed, sep="\n  ", file=sys.stderr
        )
        return 1
    return 0


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
                            partials: bool, out: TextIO | None) -> str | None:
    """Write the segments of one file as they come (partial results on stderr with ``partials``,
    ``--stream``); the reason it failed, or None."""
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
            row = {"audio_filepath": str(path), "start": r.start, "end": r.end, "text": r.text}
            if r.words:
                row["words"] = [{"word": w.text, "start": w.start, "end": w.end} for w in r.words]
            _write(out, f"{path}\t{r.start:.2f}\t{r.end:.2f}\t{r.text}", row)
    except AudioError as e:
        return str(e)
    # whatever the file makes the model raise: the other files go on
    except Exception as e:  # noqa: BLE001
        reason = str(e).strip().splitlines()[0] if str(e).strip() else "no message"
        return f"{path}: decoding failed ({type(e).__name__}: {reason})"
    return None


def _write(out: TextIO | None, line: str, row: dict) -> None:
    if out is None:
        print(line, flush=True)
    else:
        out.write(json.dumps(row, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    sys.exit(main())
