"""NeMo manifests from the data people already have (``konkanivani-prepare``).

Four sources, each read into a list of ``Item`` (where it came from, its split, its text, the
audio file the manifest will name and, when that file must first be written, how to write it):

- ``commonvoice``: a Common Voice release folder, ``train.tsv``/``dev.tsv``/``test.tsv`` and
  ``clips/*.mp3``, to ``train.jsonl``/``valid.jsonl``/``test.jsonl``;
- ``kaldi``: a Kaldi data directory (``wav.scp``, ``text``, optional ``segments`` and ``utt2spk``);
  each segment is cut into a file of its own under ``OUT_DIR/wavs/``;
- ``folder``: audio files with same-named ``.txt`` transcripts, searched recursively;
- ``hf``: a Hugging Face ``datasets`` audio dataset saved with ``save_to_disk``, decoded to
  ``OUT_DIR/wavs/``.

Then one pass writes the files that must be written (16 kHz mono 16-bit PCM), checks every row
with ``manifest.check_row`` (the validator's check, which also measures the duration from the
file's header), and writes ``OUT_DIR/<split>.jsonl``. A row that cannot be used is counted by
reason and never stops the others. Audio paths are relative to the manifest's folder when the file
lies under it, absolute otherwise. Text is kept as written but for surrounding whitespace:
``tokenizer.normalize_text`` runs in training.

Nothing is mislabeled or lost on the way (``outputs``): every written file's name comes from its
source through ``safe_name``, so two sources never share one name, and two rows that would still
land on one file are both refused by name; the output folder may not be or contain the source;
everything is built in ``OUT_DIR/.prepare.partial/`` and moved in at the end (manifests last), so
an interrupted run leaves the previous result as it was.
"""
from __future__ import annotations

import csv
import io
import json
import random
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import soundfile as sf
import torch
from tqdm import tqdm

from ..config import DEFAULT_MAX_DURATION
from ..data.audio import AUDIO_SUFFIXES, AudioError, load_audio
from ..data.frames import SAMPLE_RATE
from ..data.manifest import check_row
from ..data.tokenizer import Tokenizer, train_tokenizer
from .outputs import OutputError, Staging, child, safe_name

__all__ = [
    "CONVERT_FORMATS",
    "PrepareError",
    "Item",
    "Report",
    "commonvoice_items",
    "kaldi_items",
    "folder_items",
    "hf_items",
    "prepare",
    "print_report",
    "print_skipped",
]

CONVERT_FORMATS = ("wav", "flac")
_EXAMPLES = 10  # skipped rows named one by one in the report
_CV_SPLITS = {"train": "train", "dev": "valid", "test": "test"}  # Common Voice file -> our manifest
_HF_SPLITS = {"validation": "valid", "dev": "valid"}
_HF_TEXT_COLUMNS = ("sentence", "text", "transcription")
# what the runs wrote into OUT_DIR, a group of manifests and files each (outputs.Staging)
RECORD = ".prepare.json"


class PrepareError(ValueError):
    """A source that cannot be read at all (a missing folder or file, a TSV without its columns)."""


class Unusable(Exception):
    """One row that cannot be used: ``reason`` (counted) and ``detail`` (shown for the first
    few)."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason, detail)
        self.reason, self.detail = reason, detail


@dataclass
class Item:
    """One utterance a source offers."""

    where: str  # "train.tsv:14", "data/text:3": the file and line, for messages
    split: str
    text: str = ""
    # the file the manifest names (for a written one, where it will lie in OUT_DIR)
    audio: Path | None = None
    # writes the audio to the given path (a conversion, a cut)
    write_audio: Callable[[Path], None] | None = None
    # what is written to ``audio``: the source file (and span), for refusing two on one name
    source: str = ""
    extra: dict[str, Any] = field(default_factory=dict)  # more keys of the row ("speaker")
    error: Unusable | None = None  # known unusable before any audio is read
    written_by: Item | None = None  # another item writes this item's audio (the same source)


@dataclass
class Report:
    # split -> (path, rows, seconds)
    manifests: dict[str, tuple[Path, int, float]] = field(default_factory=dict)
    skipped: Counter = field(default_factory=Counter)  # reason -> rows
    # the first few skipped rows, "where: reason (detail)"
    examples: list[str] = field(default_factory=list)
    # check_row's warnings (not 16 kHz, not mono) -> rows
    notes: Counter = field(default_factory=Counter)
    total: int = 0


# --- audio ------------------------------------------------------------------------------------


def _decode(
    source: Path | io.BytesIO, label: str, start_s: float = 0.0, end_s: float | None = None
) -> torch.Tensor:
    """``audio.load_audio`` of a file or bytes (named ``label``), its failures as ``Unusable``
    rows."""
    try:
        return load_audio(source, start_s=start_s, end_s=end_s, label=label)
    except AudioError as e:
        raise Unusable(e.reason, f"{label}: {e.detail}" if e.detail else label) from e


def _writer(source: Path | Callable[[], io.BytesIO], label: str, start_s: float = 0.0,
            end_s: float | None = None) -> Callable[[Path], None]:
    """A function that decodes ``source`` (a file, or a function giving bytes) and writes it to the
    path it is given as 16 kHz mono 16-bit PCM, in the format of that path's suffix."""
    def write(target: Path) -> None:
        wav = _decode(source if isinstance(source, Path) else source(), label, start_s, end_s)
        target.parent.mkdir(parents=True, exist_ok=True)
        # resampling overshoots
        sf.write(str(target), np.clip(wav.numpy(), -1.0, 1.0), SAMPLE_RATE, subtype="PCM_16")
    return write


def _source_audio(item: Item, path: Path, folder: Path, convert: str | None, name: str) -> None:
    """Set ``item``'s audio to a source file as it is, or to it decoded to
    ``folder/name.convert``."""
    if convert is None:
        item.audio = path
        return
    item.audio, item.write_audio, item.source = (
        folder / f"{name}.{convert}",
        _writer(path, str(path)),
        str(path),
    )


# --- sources ----------------------------------------------------------------------------------

def commonvoice_items(cv_dir: Path, out_dir: Path, convert: str | None = None) -> list[Item]:
    """``train.tsv``, ``dev.tsv`` and ``test.tsv`` (those present) of a Common Voice release: the
    clip in ``clips/`` named by ``path``, the text in ``sentence``, ``client_id`` as ``speaker``."""
    tsvs = [
        (cv_dir / f"{name}.tsv", split)
        for name, split in _CV_SPLITS.items()
        if (cv_dir / f"{name}.tsv").is_file()
    ]
    if not tsvs:
        raise PrepareError(
            f"{cv_dir}: no train.tsv, dev.tsv or test.tsv (a Common Voice release folder holds them"
            " beside clips/)"
        )
    if "MP3" not in sf.available_formats():
        raise PrepareError(
            f"this soundfile's libsndfile {sf.__libsndfile_version__} cannot read MP3 (1.1 and"
            " later can): pip install -U soundfile"
        )
    items = []
    for tsv, split in tsvs:
        with open(tsv, encoding="utf-8", newline="") as f:
            # Common Voice does not quote its fields: a sentence may open with a quotation mark.
            reader = csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
            missing = {"path", "sentence"} - set(reader.fieldnames or ())
            if missing:
                raise PrepareError(f"{tsv}: no column {', '.join(sorted(missing))} in its header "
                                   f"({', '.join(reader.fieldnames or ['empty file'])})")
            for row in reader:
                item = Item(f"{tsv}:{reader.line_num}", split, (row["sentence"] or "").strip())
                clip = row["path"] or ""
                if not clip:
                    item.error = Unusable("no clip named")
                elif not _stays_inside(cv_dir / "clips", clip):
                    item.error = Unusable("clip path leaves clips/", clip)
                # the name of the path without its suffix: "a/x.mp3" and "a_x.mp3" stay two files
                else:
                    _source_audio(item, cv_dir / "clips" / clip, out_dir / "clips", convert,
                                  safe_name(str(Path(clip).with_suffix(""))))
                if row.get("client_id"):
                    item.extra["speaker"] = row["client_id"]
                items.append(item)
    return items


def _stays_inside(folder: Path, relative: str) -> bool:
    """Whether ``folder / relative`` (a path a source file names) lies inside ``folder``."""
    return (
        not Path(relative).is_absolute()
        and folder.resolve() in (folder / relative).resolve().parents
    )


def _kaldi_table(path: Path) -> dict[str, tuple[str, int]]:
    """A Kaldi table file: the first field of each line -> (the rest, stripped; its line number)."""
    table = {}
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            fields = line.split(maxsplit=1)  # the key, then the rest (spaces or tabs between)
            if fields:
                table[fields[0]] = (fields[1].strip() if len(fields) > 1 else "", line_no)
    return table


def _kaldi_audio(utt: str, recording: str, wav_scp: dict, path: Path, audio_root: Path) -> Path:
    if recording not in wav_scp:
        raise Unusable("recording not in wav.scp", f"{recording} of {utt}")
    value, line_no = wav_scp[recording]
    if value.endswith("|"):  # "sox ... - |": a command whose output is the audio
        raise Unusable(
            "wav.scp entry is a command",
            f"{path / 'wav.scp'}:{line_no}: not supported, write that audio to files first",
        )
    return audio_root / value  # an absolute path stays as it is


def kaldi_items(data_dir: Path, out_dir: Path, split: str, convert: str | None = None,
                audio_root: Path = Path(".")) -> list[Item]:
    """One item per line of ``text``; its audio is the ``wav.scp`` recording of the same id, or with
    ``segments`` its segment, cut to ``out_dir/wavs/<safe_name(utt)>.<convert or wav>``. Relative
    ``wav.scp`` paths are taken from ``audio_root`` (Kaldi reads them from the current directory).
    """
    for name in ("wav.scp", "text"):
        if not (data_dir / name).is_file():
            raise PrepareError(
                f"{data_dir}: no {name} (a Kaldi data directory holds wav.scp and text)"
            )
    wav_scp, texts = _kaldi_table(data_dir / "wav.scp"), _kaldi_table(data_dir / "text")
    segments = _kaldi_table(data_dir / "segments") if (data_dir / "segments").is_file() else None
    speakers = _kaldi_table(data_dir / "utt2spk") if (data_dir / "utt2spk").is_file() else {}
    items = []
    for utt, (text, line_no) in texts.items():
        item = Item(f"{data_dir / 'text'}:{line_no}", split, text)
        if utt in speakers:
            item.extra["speaker"] = speakers[utt][0]
        name = safe_name(utt)  # "a/b" and "a_b", "." and "..": each a file of its own in wavs/
        try:
            if segments is None:
                _source_audio(
                    item,
                    _kaldi_audio(utt, utt, wav_scp, data_dir, audio_root),
                    out_dir / "wavs",
                    convert,
                    name,
                )
            else:
                _segment(item, utt, segments, wav_scp, data_dir, audio_root,
                         out_dir / "wavs" / f"{name}.{convert or 'wav'}")
        except Unusable as e:
            item.error = e
        items.append(item)
    return items


def _segment(item: Item, utt: str, segments: dict, wav_scp: dict, data_dir: Path, audio_root: Path,
             target: Path) -> None:
    if utt not in segments:
        raise Unusable("not in segments", utt)
    value, line_no = segments[utt]
    fields = value.split()
    try:
        recording, start, end = fields[0], float(fields[1]), float(fields[2])
    except (IndexError, ValueError):
        raise Unusable(
            "bad segments line", f"{data_dir / 'segments'}:{line_no}: {value!r}"
        ) from None
    if end >= 0 and end <= start:  # an end of -1 means the end of the recording
        raise Unusable(
            "bad segments line", f"{data_dir / 'segments'}:{line_no}: ends at {end} before {start}"
        )
    source = _kaldi_audio(utt, recording, wav_scp, data_dir, audio_root)
    item.audio, item.write_audio = target, _writer(
        source, str(source), start, None if end < 0 else end
    )
    item.source = f"{source} from {start} s to {end} s"


def folder_items(
    audio_dir: Path, split: str, convert: str | None = None, out_dir: Path | None = None
) -> list[Item]:
    """Every audio file under ``audio_dir`` (recursively) with its same-named ``.txt`` beside it."""
    # by --convert, when OUT_DIR lies in AUDIO_DIR: not a source
    written = (out_dir or audio_dir) / "wavs"
    items = []
    for path in sorted(
        p
        for p in audio_dir.rglob("*")
        if p.suffix.lower() in AUDIO_SUFFIXES
        and p.is_file()
        and written.resolve() not in p.resolve().parents
    ):
        transcript = path.with_suffix(".txt")
        item = Item(str(transcript), split)
        try:
            item.text = transcript.read_text(encoding="utf-8-sig").strip()
        except FileNotFoundError:
            item.where, item.error = str(path), Unusable("no transcript (.txt) beside it")
        except (UnicodeDecodeError, OSError) as e:
            item.error = Unusable("transcript unreadable", str(e))
        # its folders kept: "a/b" and "a_b" stay apart
        relative = path.relative_to(audio_dir).with_suffix("")
        _source_audio(
            item, path, written, convert, "/".join(safe_name(part) for part in relative.parts)
        )
        items.append(item)
    if not items:
        raise PrepareError(
            f"{audio_dir}: no audio file ({', '.join(AUDIO_SUFFIXES)}) in it or below"
        )
    return items


def _load_hf(path: Path):
    try:
        import datasets
    except ImportError:
        raise PrepareError("reading a Hugging Face dataset needs the datasets package: pip install "
                           "'konkanivani[hf]' (or pip install 'datasets>=2.14')") from None
    try:
        loaded = datasets.load_from_disk(str(path))
    except FileNotFoundError as e:
        raise PrepareError(f"{path}: not a dataset saved with save_to_disk ({e})") from None
    return datasets, loaded


def hf_items(path: Path, out_dir: Path, split: str, text_column: str | None = None,
             audio_column: str | None = None, convert: str | None = None) -> list[Item]:
    """Every row of a dataset saved with ``save_to_disk`` (a ``Dataset``: one split, named
    ``split``; a ``DatasetDict``: each of its splits, validation/dev as valid), its audio decoded to
    ``out_dir/wavs/<split>_<row>.<convert or wav>``. The audio is read as the stored bytes and
    decoded with soundfile, so no audio decoder of ``datasets``' own is needed."""
    datasets, loaded = _load_hf(path)
    parts = loaded.items() if isinstance(loaded, datasets.DatasetDict) else [(split, loaded)]
    items = []
    for name, ds in parts:
        name = _HF_SPLITS.get(name, name)
        try:
            child(out_dir, name, "the dataset's split")  # it names a manifest
        except OutputError as e:
            raise PrepareError(f"{path}: {e}") from None
        audio_col = audio_column or next(
            (c for c, f in ds.features.items() if isinstance(f, datasets.Audio)), None
        )
        text_col = text_column or next((c for c in _HF_TEXT_COLUMNS if c in ds.column_names), None)
        for flag, col in (("--audio_column", audio_col), ("--text_column", text_col)):
            if col not in ds.column_names:
                what = f"no column {col}" if col else f"no {flag[2:].replace('_', ' ')} found"
                raise PrepareError(
                    f"{path} ({name}): {what}; its columns: {', '.join(ds.column_names)} "
                    f"({flag} chooses)"
                )
        raw = ds.cast_column(audio_col, datasets.Audio(decode=False)).select_columns([audio_col])
        for index, text in enumerate(ds[text_col]):
            target = out_dir / "wavs" / f"{name}_{index:06d}.{convert or 'wav'}"
            # read when written
            stored = lambda raw=raw, i=index: _hf_bytes(raw[i][audio_col])  # noqa: E731
            where = f"{path} {name} row {index}"
            items.append(Item(where, name, text.strip() if isinstance(text, str) else "",
                              target, _writer(stored, "the stored audio"), where))
    return items


def _hf_bytes(audio: dict) -> io.BytesIO:
    """The stored bytes of an undecoded ``Audio`` value (``{"bytes", "path"}``), or its file's."""
    if audio.get("bytes"):
        return io.BytesIO(audio["bytes"])
    if audio.get("path") and Path(audio["path"]).is_file():
        return io.BytesIO(Path(audio["path"]).read_bytes())
    raise Unusable("audio file missing", str(audio.get("path")))


# --- checking and writing ---------------------------------------------------------------------

def _manifest_path(audio: Path, out_dir: Path) -> str:
    """Relative to the manifest's folder when the file lies under it (so the two move together)."""
    try:
        return audio.resolve().relative_to(out_dir.resolve()).as_posix()
    except ValueError:
        return str(audio.absolute())


def _claim_targets(items: list[Item]) -> None:
    """Refuse, by name, every two items that would write different audio to one file (both are
    skipped: either would be mislabeled); an item whose file another item with the same source
    writes just names it."""
    first: dict[Path, Item] = {}
    for item in items:
        if item.error or item.write_audio is None:
            continue
        target = item.audio.resolve()
        other = first.setdefault(target, item)
        if other is item:
            continue
        if other.source == item.source:  # one clip named by two rows: written once
            item.write_audio = None
            item.written_by = other
            continue
        clash = Unusable(
            "two sources, one output file",
            f"{other.source} ({other.where}) and {item.source} "
            f"({item.where}) would both write {item.audio}",
        )
        item.error = other.error = clash


def _refuse_sources_in(items: list[Item], out_dir: Path, replaced: set[str]) -> None:
    """A source file among the files this run replaces (an earlier run's output) would be gone after
    it: such rows are skipped."""
    gone = {(out_dir / f).resolve() for f in replaced}
    for item in items:
        if (
            item.error is None
            and item.write_audio is None
            and item.written_by is None
            and item.audio is not None
        ):
            if item.audio.resolve() in gone:
                item.error = Unusable(
                    "source audio is an earlier run's output, which this run replaces",
                    str(item.audio),
                )


def _check(
    items: list[Item],
    out_dir: Path,
    staging: Path,
    tokenizer: Tokenizer,
    max_duration: float,
    progress: bool,
    report: Report,
) -> dict[str, list[dict]]:
    """Write each item's audio (under ``staging``, laid out as in ``out_dir``) when it must be,
    check its row, and group the good rows by split."""
    rows: dict[str, list[dict]] = defaultdict(list)
    for item in tqdm(items, desc="reading audio", unit="utt", disable=not progress):
        written = item.write_audio is not None or item.written_by is not None
        try:
            if item.error:
                raise item.error
            if not item.text:  # said before any audio is decoded for it
                raise Unusable("empty text")
            if item.write_audio:
                item.write_audio(staging / item.audio.relative_to(out_dir))
            row = {
                "audio_filepath": _manifest_path(item.audio, out_dir),
                "text": item.text,
                **item.extra,
            }
            check = check_row(
                row, staging if written else out_dir, tokenizer, max_duration=max_duration
            )
            if check.error:
                raise Unusable(*check.error)
        except Unusable as e:
            report.skipped[e.reason] += 1
            if len(report.examples) < _EXAMPLES:
                report.examples.append(
                    f"{item.where}: {e.reason}" + (f" ({e.detail})" if e.detail else "")
                )
            continue
        report.notes.update(reason for reason, _ in check.warnings)
        rows[item.split].append(
            {
                "audio_filepath": row["audio_filepath"],
                "duration": round(check.duration, 3),
                "text": item.text,
                **item.extra,
            }
        )
    return rows


def _carve_valid(rows: dict[str, list[dict]], split: str, fraction: float, seed: int) -> None:
    """Move a seeded ``fraction`` of ``split``'s rows (at least one, never all) to ``valid``."""
    source = rows.get(split, [])
    if fraction <= 0 or len(source) < 2:
        return
    k = min(max(1, round(len(source) * fraction)), len(source) - 1)
    chosen = set(random.Random(seed).sample(range(len(source)), k))
    rows["valid"] = rows.get("valid", []) + [r for i, r in enumerate(source) if i in chosen]
    rows[split] = [r for i, r in enumerate(source) if i not in chosen]


def prepare(
    items: list[Item],
    out_dir: Path,
    *,
    tokenizer: Tokenizer | None = None,
    max_duration: float = DEFAULT_MAX_DURATION,
    valid_fraction: float = 0.0,
    split_name: str = "train",
    seed: int = 0,
    progress: bool = True,
) -> Report:
    """Check ``items``, write ``out_dir/<split>.jsonl`` for every split with a usable row, and
    report what was written and what was skipped.

    Without ``tokenizer`` the texts are checked against a character tokenizer trained on them all:
    a row that passes with characters (the most tokens, so the strictest "too short for CTC") passes
    with any tokenizer trained on the same text.

    The audio and the manifests are built in a staging folder and replace those of the previous
    run only at the end: an interrupted run (Ctrl-C, a kill) leaves the previous result whole.
    """
    report = Report(total=len(items))
    if tokenizer is None:
        texts = [item.text for item in items if item.error is None and item.text]
        try:
            tokenizer = train_tokenizer(texts, model_type="char")
        except ValueError:  # no text at all: every row fails as "empty text" below
            tokenizer = train_tokenizer(["a"], model_type="char")
    _claim_targets(items)
    with Staging(out_dir, "prepare", RECORD) as staging:
        # The manifests this run may write, and so the earlier run's files it replaces (runs of
        # other splits stay).
        splits = {item.split for item in items} | ({"valid"} if valid_fraction > 0 else set())
        manifests = [f"{split}.jsonl" for split in splits]
        targets = [item.audio.relative_to(out_dir).as_posix() for item in items
                   if item.error is None and item.write_audio is not None]
        try:
            staging.check_group(manifests, targets)  # before any work; publishing checks again
        except OutputError as e:
            raise PrepareError(str(e)) from None
        _refuse_sources_in(items, out_dir, staging.group_files(manifests))
        rows = _check(items, out_dir, staging.path, tokenizer, max_duration, progress, report)
        _carve_valid(rows, split_name, valid_fraction, seed)
        if not rows:  # nothing usable: the previous result stays as it was
            return report
        for split, split_rows in rows.items():
            with open(child(staging.path, f"{split}.jsonl", "split"), "w", encoding="utf-8") as f:
                for row in split_rows:
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")
            report.manifests[split] = (out_dir / f"{split}.jsonl", len(split_rows),
                                       sum(r["duration"] for r in split_rows))
        written = sorted(
            {
                p.relative_to(staging.path).as_posix()
                for p in staging.path.rglob("*")
                if p.is_file() and not (p.parent == staging.path and p.suffix == ".jsonl")
            }
        )
        try:
            staging.publish_group([f"{split}.jsonl" for split in rows], written)
        except OutputError as e:
            raise PrepareError(str(e)) from None
    return report


def print_report(report: Report) -> None:
    for split, (path, n, seconds) in report.manifests.items():
        print(f"wrote {path}: {n} utterance{'s' if n != 1 else ''}, {seconds / 3600:.2f} h")
    if not report.manifests:
        print("no usable utterance: no manifest written")
    for reason, n in report.notes.most_common():
        print(
            f"  note: {n} rows {reason}; converted when training loads them (--convert wav writes"
            " 16 kHz mono files once)"
        )
    print_skipped(report.skipped, report.examples, report.total)


def print_skipped(skipped: Counter, examples: list[str], total: int) -> None:
    """The rows a tool could not use: a count by reason, then the first few by file and line."""
    if not skipped:
        return
    count = sum(skipped.values())
    print(f"skipped {count} of {total} utterances:")
    for reason, n in skipped.most_common():
        print(f"  {n:6d} {reason}")
    for example in examples:
        print(f"  {example}")
    if count > len(examples):
        print(f"  ... and {count - len(examples)} more")
