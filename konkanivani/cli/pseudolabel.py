"""Label untranscribed audio with a teacher checkpoint, keep the labels it is sure of
(``konkanivani-pseudolabel``): the manifest a student trains on beside the transcribed one
(``konkanivani-train --pseudo_manifest``).

    konkanivani-pseudolabel checkpoints/teacher/best.pt radio/ untranscribed.jsonl \\
        --choose_threshold_on data/demo/valid.jsonl --target_label_cer 10 --output_dir pseudo/r1
    konkanivani-pseudolabel checkpoints/teacher/best.pt --shards audio_shards/shards.json \\
        --threshold 0.8 --method joint --lm checkpoints/lm/best.pt --jobs 2 --output_dir pseudo/r1

Inputs are audio files, folders (searched recursively), manifests (their ``text``, if any, is not
used) and with ``--shards`` tar shards (``konkanivani-prepare shards``; each labelled utterance's
audio is copied to ``OUT/audio/``, as a manifest must name a file). Each utterance is decoded with
the shared decoding flags (any ``--method``, LM fusion, hotwords; ``--jobs`` threads decode
batches side by side) and scored (``decoding.confidence``): mean and least word probability,
agreement of the greedy CTC text with the method's text, characters per second.

In ``--output_dir`` OUT:

- ``labels.jsonl``: every utterance decoded, with its text and scores, appended a batch at a time,
  each key once, each row marked ``pseudo_label`` (the text is the teacher's, so evaluation and
  validation refuse it). A killed run started again with the same teacher and settings goes on
  after the last complete row: nothing written is decoded again (a row cut off by the kill is
  dropped), and what failed is tried again. A run with other inputs labels what it is given now:
  the rows of inputs not given stay in the file, unused, and inputs that are gone are no longer
  counted. OUT labelled by another teacher or with other settings is refused, one line, exit 2;
  so is a second run while one labels OUT (``.lock`` names its process);
- ``labelling.json``: the teacher, its checkpoint's hash, the decoding settings and the inputs of
  the last run;
- ``valid_labels.jsonl``: the same of ``--choose_threshold_on``'s transcribed rows, with their true
  text as ``reference``: the threshold is the lowest confidence whose kept labels' CER against
  the truth is at most ``--target_label_cer`` percent (the most audio at that quality); none
  reaching it: exit 2, the labels kept for a rerun with another target;
- ``pseudo.jsonl``: the kept utterances, ``{"audio_filepath", "duration", "text", "confidence",
  "pseudo_label": {"teacher", "confidence"}}`` (a manifest's other keys kept); training refuses it
  as a validation set, as ``konkanivani-evaluate`` does;
- ``report.json`` and ``report.md``: how many utterances (and hours) each threshold keeps, and on
  the validation set their label CER; what was dropped and why (no text, too short for CTC: fewer
  encoder frames than the label's tokens need, a label too short or too long for its duration,
  below the threshold, unreadable).

``--rounds N`` repeats it: each round labels into ``OUT/round_R``, trains a student on
``--train_manifest`` and the kept labels (``OUT/round_R/student``, with ``--train_flags``, validated
on ``--valid_manifest`` or else ``--choose_threshold_on``), and makes the student's best.pt the
next teacher; ``OUT/rounds.md`` and ``rounds.json`` hold each round's threshold, labels kept and
validation CER. Started again, it goes on where it stopped.

Outputs are written through temporary files renamed at the end, and never over an input: OUT may
not hold a file the run reads. Exit status 1 when some files could not be decoded (named on stderr,
counted in the report); the others are labelled.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import io
import itertools
import json
import os
import shlex
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoint import BEST_FILE, LATEST_FILE, CheckpointError, write_file_atomic
from ..data.audio import load_audio
from ..data.frames import SAMPLE_RATE
from ..data.manifest import (
    PSEUDO_LABEL,
    ManifestError,
    check_text,
    manifest_audio,
    read_manifest,
    refuse_pseudo_labels,
)
from ..data.shards import AUDIO_MEMBER, META_MEMBER, audio_member, iter_shard, open_shards
from ..datatools.outputs import OutputError, safe_name, write_output
from ..decoding.confidence import (
    MAX_CHARS_PER_SECOND,
    MIN_CHARS_PER_SECOND,
    REPORT_THRESHOLDS,
    Scored,
    choose_threshold,
    confidence_of,
    kept_cer,
)
from ..decoding.evaluation import evaluate_manifest
from ..decoding.metrics import score
from ..decoding.recognizer import MIN_SAMPLES, Recognizer, find_audio
from ..decoding.settings import DecodingConfig
from ..training.run_files import hold_run_directory
from . import Parser, fail, refuse_unsafe_outputs, setup_logging, tool
from . import train as train_cli
from .decoding_flags import (
    add_decoding_args,
    checked_decoding,
    decoding_inputs,
    decoding_name,
    load_recognizer,
)

# The DecodingConfig fields konkanivani-pseudolabel takes as flags (docs/generate_flags.py reads
# them): whole utterances, so no stream's settings.
DECODING_FIELDS = ("method", "beam_size", "ctc_weight", "lm", "lm_weight", "length_bonus",
                   "batch_size", "device", "hotwords", "hotword_boost")
LABELS, VALID_LABELS, KEPT = "labels.jsonl", "valid_labels.jsonl", "pseudo.jsonl"
POOL = "pool.jsonl"  # --keep_pool: the labels every round so far kept, each utterance's latest
SETTINGS, REPORT_JSON, REPORT_MD, AUDIO = "labelling.json", "report.json", "report.md", "audio"
ROUNDS_MD, ROUNDS_JSON = "rounds.md", "rounds.json"


@tool
def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    decoding = checked_decoding(parser, args)
    if (args.threshold is None) == (args.choose_threshold_on is None):
        parser.error("give --threshold T or --choose_threshold_on VALID_MANIFEST (one of them)")
    if not args.inputs and not args.shards:
        parser.error("give audio to label: files, folders, manifests or --shards")
    if args.jobs < 1:
        parser.error(f"--jobs must be a positive integer, got {args.jobs}")
    if args.threshold is not None and not 0.0 <= args.threshold <= 1.0:
        parser.error(f"--threshold must be in [0, 1], got {args.threshold}")
    if not args.target_label_cer >= 0:
        parser.error(f"--target_label_cer must be a percentage >= 0, got {args.target_label_cer}")
    if not 0 <= args.min_chars_per_second <= args.max_chars_per_second:
        parser.error("--min_chars_per_second must be >= 0 and at most --max_chars_per_second")
    if not 0.0 <= args.min_agreement <= 1.0:
        parser.error(f"--min_agreement must be in [0, 1], got {args.min_agreement}")
    setup_logging()
    if args.rounds:
        return _rounds(parser, args, decoding)
    return _label(parser, args, decoding)


def _label(parser: Parser, args: argparse.Namespace, decoding: DecodingConfig) -> int:
    """One labelling of the inputs by ``args.checkpoint`` into ``args.output_dir``: the tool
    without ``--rounds``, and each round of it."""
    try:
        if args.choose_threshold_on is not None:
            refuse_pseudo_labels(args.choose_threshold_on, "--choose_threshold_on")
        files = _files(args.inputs)
        valid = _files([args.choose_threshold_on]) if args.choose_threshold_on else []
        shards = open_shards(args.shards) if args.shards else None
    except ManifestError as e:
        return fail(str(e))
    out = args.output_dir
    reads = [*decoding_inputs(args.checkpoint, decoding), *args.inputs,
             *(f.path for f in files + valid), *([args.choose_threshold_on] if valid else []),
             *((s.path for s in shards.shards) if shards else ())]
    refuse_unsafe_outputs(parser, [(f"--output_dir ({name})", out / name) for name in
                                   (LABELS, VALID_LABELS, KEPT, SETTINGS, REPORT_JSON, REPORT_MD)],
                          reads, {"--output_dir": out})
    try:
        recognizer = load_recognizer(args.checkpoint, decoding)
        resolved = recognizer.settings(decoding)
    except (CheckpointError, RuntimeError, ValueError) as e:
        return fail(str(e))
    teacher = args.teacher or str(args.checkpoint)
    # what makes a label what it is: the model and every setting of its search (not the device)
    searched = {name: getattr(resolved, name) for name in DECODING_FIELDS
                if name not in ("batch_size", "device")}
    settings = json.loads(json.dumps({"teacher": teacher, "checkpoint": _digest(args.checkpoint),
                                      "decoding": searched}, default=str))
    inputs = [*map(str, args.inputs), *([args.shards] if args.shards else [])]
    try:
        with hold_run_directory(out, "labelling run"):
            return _label_held(args, out, settings, inputs, (recognizer, resolved, teacher),
                               (files, valid, shards))
    except (CheckpointError, OutputError) as e:
        return fail(str(e))


def _label_held(args: argparse.Namespace, out: Path, settings: dict, inputs: list[str],
                teaching: tuple[Recognizer, DecodingConfig, str], work: tuple) -> int:
    """``_label``'s work once this run holds OUT: claimed for ``settings`` (the ``inputs`` noted),
    the utterances of ``work`` (files, validation files, shards) labelled, the kept ones and the
    report written."""
    recognizer, resolved, teacher = teaching
    files, valid, shards = work
    try:
        _claim(out, settings, inputs)
        labeller = _Labeller(recognizer, resolved, args.jobs, teacher)
        start = time.perf_counter()
        valid_rows = labeller.run(out / VALID_LABELS, iter(valid)) if valid else []
        items = _shard_items(shards, Path(os.path.abspath(out / AUDIO))) if shards else iter(())
        rows = labeller.run(out / LABELS, itertools.chain(files, items))
        speed = labeller.decoded_s / (time.perf_counter() - start)
        report = _Report(args, teacher, rows, valid_rows, recognizer, speed)
        if report.threshold is None:
            return fail(report.unreached())
        write_output(out / KEPT, "".join(json.dumps(r, ensure_ascii=False) + "\n"
                                         for r in report.kept_rows()))
        write_output(out / REPORT_JSON, json.dumps(report.as_json(), indent=2,
                                                   ensure_ascii=False) + "\n")
        write_output(out / REPORT_MD, report.markdown())
    except OutputError as e:
        return fail(str(e))
    print(report.summary(resolved), file=sys.stderr)
    if report.failed:
        print(f"{len(report.failed)} utterances could not be labelled:",
              *(f"{r['key']}: {r['error']}" for r in report.failed[:20]), sep="\n  ",
              file=sys.stderr)
        return 1
    return 0


def _parser() -> Parser:
    parser = Parser(description=__doc__.split("\n\n")[0])
    add_decoding_args(parser, DECODING_FIELDS)
    parser.add_argument("inputs", nargs="*", help="audio files, folders or JSONL manifests")
    parser.add_argument("--shards", help="tar shards of audio: a shards.json, a brace pattern or a "
                        "file listing shard paths")
    parser.add_argument("--output_dir", type=Path, required=True,
                        help="where labels.jsonl, pseudo.jsonl and the report go")
    parser.add_argument("--threshold", type=float,
                        help="keep labels of at least this confidence (0-1)")
    parser.add_argument("--choose_threshold_on", type=Path, metavar="VALID_MANIFEST",
                        help="label this transcribed manifest too, and choose the threshold on it "
                        "(--target_label_cer)")
    parser.add_argument("--target_label_cer", type=float, default=10.0,
                        help="with --choose_threshold_on: the CER in percent the kept labels may "
                        "have against the true text (default: 10)")
    parser.add_argument("--min_chars_per_second", type=float, default=MIN_CHARS_PER_SECOND,
                        help="drop labels with fewer characters per second of audio (default: "
                        f"{MIN_CHARS_PER_SECOND:g})")
    parser.add_argument("--max_chars_per_second", type=float, default=MAX_CHARS_PER_SECOND,
                        help="drop labels with more characters per second of audio (default: "
                        f"{MAX_CHARS_PER_SECOND:g})")
    parser.add_argument("--min_agreement", type=float, default=0.0,
                        help="drop labels that greedy CTC (no decoder, no LM) spells with more "
                        "than 1 - this CER against them, whatever their confidence; with --lm "
                        "fused into the labels, a filter on the agreement of decoding with and "
                        "without the LM, as noisy student training's (0-1; default: 0, none)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="threads decoding batches side by side (default: 1)")
    parser.add_argument("--teacher", help="the teacher's name in each row's pseudo_label "
                        "(default: the checkpoint's path)")
    rounds = parser.add_argument_group("rounds: label, train a student on both, repeat with it")
    rounds.add_argument("--rounds", type=int, default=0,
                        help="N rounds into OUT/round_1 ... (each labelling, its student in "
                        "student/): needs --train_manifest, and --choose_threshold_on or "
                        "--valid_manifest (default: 0, label once into OUT)")
    rounds.add_argument("--train_manifest", type=Path,
                        help="with --rounds: the transcribed manifest each student trains on")
    rounds.add_argument("--valid_manifest", type=Path,
                        help="with --rounds: the students' validation set, and the table's "
                        "(default: --choose_threshold_on)")
    rounds.add_argument("--keep_pool", action="store_true",
                        help="with --rounds: each student trains on the labels of every round so "
                             "far (OUT/round_R/pool.jsonl: an utterance with the label of the last "
                             "round that kept it), not on its own round's alone")
    rounds.add_argument("--train_flags", default="",
                        help="with --rounds: more konkanivani-train flags for each student, one "
                        "string ('--preset small --max_steps 3000 --pseudo_noise_prob 0.5')")
    return parser


# ---- rounds -------------------------------------------------------------------------------------

def _rounds(parser: Parser, args: argparse.Namespace, decoding: DecodingConfig) -> int:
    """``--rounds N``: label with the teacher, train a student on the transcribed and kept labels,
    make its best.pt the next teacher; OUT/rounds.md holds each round's threshold, labels kept and
    validation CER (round 0: the first teacher's). Started again, a round whose student finished is
    taken as it is, a labelling or a training cut short goes on where it stopped."""
    valid = args.valid_manifest or args.choose_threshold_on
    if args.rounds < 0 or args.train_manifest is None or valid is None:
        parser.error("--rounds N (N >= 1) needs --train_manifest (the transcribed part) and "
                     "--choose_threshold_on or --valid_manifest (the students' validation set)")
    try:
        flags = shlex.split(args.train_flags)
        refuse_pseudo_labels(valid, "--valid_manifest")
        reads = [args.train_manifest, valid,
                 *manifest_audio(args.train_manifest), *manifest_audio(valid)]
    except (ValueError, ManifestError) as e:
        return fail(str(e))
    refuse_unsafe_outputs(parser, {}, reads, {"--output_dir": args.output_dir})
    try:
        with hold_run_directory(args.output_dir, "labelling run"):
            return _rounds_held(parser, args, decoding, valid, flags)
    except CheckpointError as e:
        return fail(str(e))


def _rounds_held(parser: Parser, args: argparse.Namespace, decoding: DecodingConfig,
                 valid: Path, flags: list[str]) -> int:
    """``_rounds``' work once this run holds OUT."""
    teacher, table = args.checkpoint, [{"round": 0, "teacher": str(args.checkpoint)}]
    table[0]["valid_cer"] = _valid_cer(teacher, valid, decoding)
    for r in range(1, args.rounds + 1):
        folder = args.output_dir / f"round_{r}"
        labelled = argparse.Namespace(**{**vars(args), "checkpoint": teacher,
                                         "output_dir": folder, "teacher": None})
        if (code := _label(parser, labelled, decoding)) == 2:
            return code
        student, done = folder / "student", folder / "student.done"
        pseudo = _write_pool(args.output_dir, r) if args.keep_pool else folder / KEPT
        if not done.is_file():
            run = ["--train_manifest", str(args.train_manifest), "--valid_manifest", str(valid),
                   "--pseudo_manifest", str(pseudo),
                   "--output_dir", str(student), *flags]
            if (student / LATEST_FILE).is_file():
                run += ["--resume", "latest"]
            if (code := train_cli.main(run)) != 0:
                return code
            write_output(done, "")
        teacher = student / BEST_FILE
        report = json.loads((folder / REPORT_JSON).read_text(encoding="utf-8"))
        table.append({"round": r, "teacher": str(labelled.checkpoint),
                      "threshold": report["threshold"], "kept": report["kept"],
                      "kept_hours": next(t["kept_hours"] for t in report["thresholds"]
                                         if t["threshold"] == report["threshold"]),
                      "trained_on": len(read_manifest(pseudo)),
                      "valid_cer": _valid_cer(teacher, valid, decoding)})
        _write_rounds(args.output_dir, table)
    print(f"{args.rounds} rounds; the table is {args.output_dir / ROUNDS_MD}", file=sys.stderr)
    return 0


def _write_pool(out: Path, last: int) -> Path:
    """OUT/round_LAST/pool.jsonl: the kept labels of rounds 1 to ``last`` (``--keep_pool``)."""
    return write_pool([out / f"round_{r}" / KEPT for r in range(1, last + 1)],
                      out / f"round_{last}" / POOL)


def write_pool(kept: Sequence[Path], path: Path) -> Path:
    """``path``: the rows of the ``kept`` label manifests, earliest round first, each utterance
    once, with the label of the last manifest that holds it."""
    pool: dict[str, dict] = {}
    for manifest in kept:
        for _, row in read_manifest(manifest):
            pool[row["audio_filepath"]] = row
    write_output(path, "".join(json.dumps(row, ensure_ascii=False) + "\n"
                               for row in pool.values()))
    return path


def _valid_cer(checkpoint: Path, manifest: Path, decoding: DecodingConfig) -> float:
    """The CER in percent of ``checkpoint`` on ``manifest``, decoded as the labels are."""
    result = evaluate_manifest(load_recognizer(checkpoint, decoding), manifest, decoding)
    return round(100 * result.chars.rate, 2)


def _write_rounds(out: Path, table: list[dict]) -> None:
    lines = ["# Rounds of pseudo-labelling", "",
             "| round | teacher | threshold | labels kept | hours | labels trained on "
             "| student's valid CER % |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in table:
        if row["round"] == 0:
            lines.append(f"| 0 | | | | | | {row['valid_cer']:.2f} (the first teacher) |")
        else:
            lines.append(f"| {row['round']} | {row['teacher']} | {row['threshold']:g} | "
                         f"{row['kept']} | {row['kept_hours']:.3f} | "
                         f"{row.get('trained_on', row['kept'])} | {row['valid_cer']:.2f} |")
    write_output(out / ROUNDS_MD, "\n".join(lines) + "\n")
    write_output(out / ROUNDS_JSON, json.dumps(table, indent=2, ensure_ascii=False) + "\n")


# ---- what is labelled ---------------------------------------------------------------------------

@dataclass
class _Item:
    """An utterance to label: its key (the audio's absolute path, or shard:key), the file it is
    as the manifest names it, its manifest row (or {}), and for a shard's its encoded audio (decoded
    where it is labelled, written to ``path`` once it is) or why it has none."""

    key: str
    path: Path
    row: dict = field(default_factory=dict)
    data: bytes | None = None
    error: str | None = None


def _files(inputs: Sequence[str | Path]) -> list[_Item]:
    """The audio files of folders, manifests and files, each once."""
    items: dict[str, _Item] = {}
    for path, row in find_audio(inputs):
        key = os.path.abspath(path)
        items.setdefault(key, _Item(key, Path(key), {k: v for k, v in row.items() if k != "where"}))
    return list(items.values())


def _shard_items(shards, audio_dir: Path) -> Iterator[_Item]:
    """The utterances of ``shards``, read in order, their audio written to ``audio_dir`` (a
    manifest must name a file) when they are labelled."""
    audio_dir.mkdir(parents=True, exist_ok=True)
    for shard in shards.shards:
        for key, files in iter_shard(shard.path, shard.name):
            where = f"{shard.name}:{key}"
            member = audio_member(files)
            target = audio_dir / (safe_name(where) + "." + (member or AUDIO_MEMBER))
            try:
                meta = json.loads(files[META_MEMBER].decode("utf-8"))
                row = {k: v for k, v in meta.items() if k not in ("text", "duration")}
            except (KeyError, UnicodeDecodeError, ValueError, AttributeError):
                row = {}  # its metadata is not needed to label it
            if member is None:
                yield _Item(where, target, error=f"{where}: no audio member")
                continue
            yield _Item(where, target, row, data=files[member])


def _digest(path: Path) -> str:
    """A short hash of the checkpoint: a new model saved under the teacher's name is another
    teacher."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def _claim(out: Path, settings: dict, inputs: list[str]) -> None:
    """OUT for these settings and ``inputs``: a fresh folder gets them written; one labelled with
    other settings is refused (``OutputError``), as its rows would mix two teachers. Other inputs
    are noted: only what this run is given is labelled and kept."""
    path = out / SETTINGS
    before = None
    if path.is_file():
        try:
            before = json.loads(path.read_text(encoding="utf-8"))
        except ValueError:
            before = {}
        before = before if isinstance(before, dict) else {}
        earlier = {k: v for k, v in before.items() if k != "inputs"}
        if earlier != settings:
            raise OutputError(f"--output_dir {out} holds labels of another teacher or other "
                              f"settings ({path}: {earlier}); give another --output_dir")
        if before.get("inputs") == inputs:
            return
        if "inputs" in before:
            print(f"{out} was labelling {before['inputs']}; now {inputs}: the labels of inputs "
                  f"not given now stay in {out / LABELS}, unused", file=sys.stderr)
    write_output(path, json.dumps({**settings, "inputs": inputs}, indent=2,
                                  ensure_ascii=False) + "\n")


# ---- labelling ----------------------------------------------------------------------------------

def _done_rows(path: Path, teacher: str) -> dict[str, dict]:
    """The labelled rows of an append-only labels file, by key. A file left by a kill or by an
    earlier version is rewritten as this one writes it: a last line cut off, a line that is no
    row, a key's second row and the rows of utterances that failed (tried again) are dropped,
    and every row is marked pseudo-labelled by ``teacher``."""
    if not path.is_file():
        return {}
    data = path.read_bytes()
    rows: dict[str, dict] = {}
    changed = not data.endswith(b"\n") and bool(data)
    for line in data[:data.rfind(b"\n") + 1].splitlines():
        try:
            row = json.loads(line)
            key = row["key"]
        except (ValueError, TypeError, KeyError):
            changed = changed or bool(line.strip())
            continue
        if "error" in row or key in rows:
            changed = True
            continue
        if PSEUDO_LABEL not in row:
            row[PSEUDO_LABEL] = {"teacher": teacher, "confidence": row.get("confidence")}
            changed = True
        rows[key] = row
    if changed:
        write_file_atomic(path, "".join(json.dumps(r, ensure_ascii=False) + "\n"
                                        for r in rows.values()).encode("utf-8"))
    return rows


class _Labeller:
    """Decodes items in windows (``--jobs`` of them at once) and appends a row per utterance to a
    labels file, skipping the keys it already holds. ``label`` reads and decodes a window (in a
    thread with ``--jobs``), its utterances sorted by length into batches of ``batch_size``."""

    WINDOW_BATCHES = 4  # batches per window: its utterances sorted by length, little padding

    def __init__(self, recognizer: Recognizer, resolved, jobs: int, teacher: str):
        self.recognizer, self.resolved, self.jobs = recognizer, resolved, jobs
        self.teacher = teacher  # named in each row's pseudo_label
        self.decoded_s = 0.0  # seconds of audio decoded by this run (not those resumed after)

    def run(self, path: Path, items: Iterator[_Item]) -> list[dict]:
        """The rows of ``items``, each key once and in their order: those ``path`` holds already,
        the others decoded and appended to it. An item that fails has a row here but none in the
        file, so that the next run tries it again; the file's rows of keys not among ``items``
        stay there, unused."""
        done = _done_rows(path, self.teacher)
        failed: dict[str, dict] = {}
        order: dict[str, None] = {}  # this run's keys, each once, in their order

        def todo() -> Iterator[_Item]:
            for item in items:
                if item.key in order:
                    continue
                order[item.key] = None
                if item.key not in done:
                    yield item

        path.parent.mkdir(parents=True, exist_ok=True)
        size = self.resolved.batch_size * self.WINDOW_BATCHES
        with open(path, "a", encoding="utf-8") as out:
            def write(new: list[dict]) -> None:
                labelled = [r for r in new if "error" not in r]
                out.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in labelled))
                out.flush()
                os.fsync(out.fileno())
                for r in new:
                    (failed if "error" in r else done)[r["key"]] = r
                self.decoded_s += sum(r.get("duration", 0.0) for r in labelled)

            if self.jobs == 1:
                for window in _windows(todo(), size):
                    write(self.label(window))
            else:
                _in_threads(self.label, _windows(todo(), size), self.jobs, write)
        return [done[key] if key in done else failed[key] for key in order]

    def label(self, window: list[_Item]) -> list[dict]:
        """The rows of a window of items, in its order."""
        rows: dict[str, dict] = {}
        ready = []
        for item in window:
            wav, error = None, item.error
            if error is None:
                try:
                    wav = load_audio(item.path if item.data is None else io.BytesIO(item.data),
                                     label=item.key)
                except RuntimeError as e:
                    error = str(e)
            if error is None and len(wav) < MIN_SAMPLES:
                error = f"{item.key}: audio too short for the model ({len(wav)} samples)"
            if error is not None:
                rows[item.key] = {"key": item.key, "error": error}
            else:
                ready.append((item, wav))
        ready.sort(key=lambda p: -len(p[1]))
        for first in range(0, len(ready), self.resolved.batch_size):
            batch = ready[first:first + self.resolved.batch_size]
            for (item, wav), decoded in zip(batch, self._decode(batch)):
                rows[item.key] = self._row(item, wav, decoded)
        return [rows[item.key] for item in window]

    def _decode(self, batch: list[tuple[_Item, object]]) -> list[tuple | str]:
        """Each waveform's (result, greedy text), or why it failed: a batch that raises is decoded
        again one by one, so one bad file loses no other."""
        try:
            return self.recognizer.decode_with_greedy([w for _, w in batch], self.resolved)
        except Exception as e:  # noqa: BLE001  whatever a file makes the model raise
            if len(batch) > 1:
                return [d for one in batch for d in self._decode([one])]
            return f"decoding failed ({type(e).__name__}: {str(e).strip()[:200]})"

    def _row(self, item: _Item, wav, decoded) -> dict:
        if isinstance(decoded, str):
            return {"key": item.key, "error": f"{item.key}: {decoded}"}
        result, greedy = decoded
        duration = round(len(wav) / SAMPLE_RATE, 3)
        scores = confidence_of(result.text, result.words, greedy, duration)
        if item.data is not None:  # a shard's: its audio becomes a file the manifest names
            write_file_atomic(item.path, item.data)
        row = {"key": item.key, "audio_filepath": str(item.path), "duration": duration,
               "text": result.text, "greedy_text": greedy, **dataclasses.asdict(scores),
               "confidence": scores.value,
               PSEUDO_LABEL: {"teacher": self.teacher, "confidence": scores.value}}
        if "text" in item.row and isinstance(item.row["text"], str):
            row["reference"] = item.row["text"]
        row["row"] = {k: v for k, v in item.row.items()
                      if k not in ("audio_filepath", "duration", "text", PSEUDO_LABEL)}
        return row


def _windows(items: Iterable[_Item], size: int) -> Iterator[list[_Item]]:
    window: list[_Item] = []
    for item in items:
        window.append(item)
        if len(window) == size:
            yield window
            window = []
    if window:
        yield window


def _in_threads(label: Callable[[list[_Item]], list[dict]], windows: Iterator[list[_Item]],
                jobs: int, write: Callable[[list[dict]], None]) -> None:
    """``write(label(window))`` for each window in order, ``jobs`` windows decoding at once (torch
    releases the GIL in its kernels); at most twice that many wait."""
    with ThreadPoolExecutor(jobs) as pool:
        pending = []
        for window in windows:
            pending.append(pool.submit(label, window))
            if len(pending) >= 2 * jobs:
                write(pending.pop(0).result())
        for future in pending:
            write(future.result())


# ---- the report ---------------------------------------------------------------------------------

class _Report:
    """What the labels keep: the reasons rows are dropped, the threshold (given, or chosen on the
    validation labels), how many each threshold keeps."""

    def __init__(self, args: argparse.Namespace, teacher: str, rows: list[dict],
                 valid_rows: list[dict], recognizer: Recognizer, speed: float):
        """``speed``: the seconds of audio this run decoded a second (the real-time factor's
        inverse)."""
        self.args, self.teacher, self.speed, self.total = args, teacher, speed, len(rows)
        self.tokenizer = recognizer.tokenizer
        self.failed = [r for r in rows if "error" in r]
        self.dropped: Counter = Counter()
        self.usable = [r for r in rows if "error" not in r and self._usable(r, self.dropped)]
        self.dropped["unreadable or failed"] = len(self.failed)
        self.audio_s = sum(r.get("duration", 0.0) for r in rows)
        valid_usable = [r for r in valid_rows if "error" not in r and self._usable(r, Counter())
                        and r.get("reference")]
        self.valid = [Scored(r["confidence"], score(r["reference"], r["text"])[1])
                      for r in valid_usable]
        self.threshold = (args.threshold if args.threshold is not None
                          else choose_threshold(self.valid, args.target_label_cer / 100))
        if self.threshold is not None:
            self.dropped["below the threshold"] = sum(r["confidence"] < self.threshold
                                                      for r in self.usable)

    def _usable(self, row: dict, dropped: Counter) -> bool:
        """Whether a label may train at all, whatever its confidence; else why not, counted."""
        error, _ = check_text(row["text"], row["duration"], self.tokenizer)
        if error is not None:
            dropped["no text" if error[0] in ("empty text", "no token after normalization")
                    else error[0]] += 1
            return False
        if row["chars_per_second"] < self.args.min_chars_per_second:
            dropped["label too short for its duration"] += 1
            return False
        if row["chars_per_second"] > self.args.max_chars_per_second:
            dropped["label too long for its duration"] += 1
            return False
        if row["agreement"] < self.args.min_agreement:
            dropped["greedy CTC disagrees (--min_agreement)"] += 1
            return False
        return True

    def kept_rows(self) -> list[dict]:
        rows = []
        for r in self.usable:
            if r["confidence"] < self.threshold:
                continue
            rows.append({**r["row"], "audio_filepath": r["audio_filepath"],
                         "duration": r["duration"], "text": r["text"],
                         "confidence": r["confidence"],
                         PSEUDO_LABEL: {"teacher": self.teacher, "confidence": r["confidence"]}})
        return rows

    def table(self) -> list[dict]:
        thresholds = sorted({*REPORT_THRESHOLDS, self.threshold})
        lines = []
        for t in thresholds:
            kept = [r for r in self.usable if r["confidence"] >= t]
            line = {"threshold": t, "kept": len(kept),
                    "kept_hours": round(sum(r["duration"] for r in kept) / 3600, 4)}
            if self.valid:
                valid_kept, cer = kept_cer(self.valid, t)
                line |= {"valid_kept": valid_kept,
                         "valid_label_cer": None if cer != cer else round(100 * cer, 2)}
            lines.append(line)
        return lines

    def as_json(self) -> dict:
        return {"teacher": self.teacher, "checkpoint": str(self.args.checkpoint),
                "inputs": [*map(str, self.args.inputs)] + ([self.args.shards]
                                                          if self.args.shards else []),
                "utterances": self.total,
                "audio_hours": round(self.audio_s / 3600, 4),
                "threshold": self.threshold,
                "threshold_chosen_on": (str(self.args.choose_threshold_on)
                                        if self.args.choose_threshold_on else None),
                "target_label_cer": (self.args.target_label_cer
                                     if self.args.choose_threshold_on else None),
                "valid_utterances": len(self.valid),
                "kept": len(self.kept_rows()), "dropped": dict(self.dropped),
                "times_real_time": round(self.speed, 1), "thresholds": self.table()}

    def markdown(self) -> str:
        report = self.as_json()
        chosen = (f"chosen on {report['threshold_chosen_on']} for a label CER of at most "
                  f"{report['target_label_cer']:g}%" if report["threshold_chosen_on"] else "given")
        lines = [f"# Pseudo-labels of {self.teacher}", "",
                 f"{report['utterances']} utterances ({report['audio_hours']:.2f} h) labelled; "
                 f"threshold {self.threshold:g} ({chosen}) keeps {report['kept']}.", "",
                 "| threshold | kept | hours |" + (" valid kept | valid label CER % |"
                                                   if self.valid else ""),
                 "| --- | --- | --- |" + (" --- | --- |" if self.valid else "")]
        for line in report["thresholds"]:
            mark = " (chosen)" if line["threshold"] == self.threshold else ""
            row = f"| {line['threshold']:g}{mark} | {line['kept']} | {line['kept_hours']:.3f} |"
            if self.valid:
                cer = line["valid_label_cer"]
                row += f" {line['valid_kept']} | {'-' if cer is None else f'{cer:.2f}'} |"
            lines.append(row)
        lines += ["", "Dropped: " + (", ".join(f"{n} {why}" for why, n in self.dropped.items()
                                              if n) or "none") + "."]
        return "\n".join(lines) + "\n"

    def unreached(self) -> str:
        best = min(((kept_cer(self.valid, s.confidence)[1], s.confidence) for s in self.valid),
                   default=None)
        how = (f"the best is {100 * best[0]:.1f}% at threshold {best[1]:g}" if best
               else "no validation utterance could be labelled")
        return (f"no threshold keeps labels of {self.args.choose_threshold_on} under "
                f"--target_label_cer {self.args.target_label_cer:g}% ({how}); the labels are kept "
                f"in {self.args.output_dir}: run again with a higher target or --threshold")

    def summary(self, resolved) -> str:
        speed = f", {self.speed:.1f}x real time" if self.speed else ""
        return (f"{self.total} utterances labelled with "
                f"{decoding_name(resolved)}{speed}; threshold {self.threshold:g} keeps "
                f"{len(self.kept_rows())}; wrote {self.args.output_dir / KEPT} and "
                f"{self.args.output_dir / REPORT_MD}")


if __name__ == "__main__":
    sys.exit(main())
