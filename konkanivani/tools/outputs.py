"""Where the data tools write: names made from inputs, folders that must not be the input, and
results that appear whole or not at all.

- ``safe_name``: a file name for any key (a Kaldi utterance id, a clip's relative path) that is
  unique by construction: a key that is already a plain name is kept, any other gets its unsafe
  characters replaced *and* a short hash of the whole key, so ``a/b`` and ``a_b`` stay two files
  and ``..`` or ``../x`` become ordinary names inside the folder.
- ``child``: a name given on the command line (a split name) as one file in its folder, or a
  one-line refusal.
- ``refuse_overlap``: no tool writes into its own input.
- ``Staging``: a tool builds its outputs in a hidden folder inside the output folder and
  ``publish`` moves them in at the end, the manifests last; a kill before that leaves the old
  result, and no manifest ever names audio of another build.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from ..checkpoint import fsync_dir, write_file_atomic

__all__ = ["OutputError", "Staging", "child", "refuse_overlap", "safe_name"]

_PLAIN = re.compile(r"[\w][\w.\-]*")  # letters (any script), digits, _ . - ; not starting with a dot
_MAX_NAME = 120  # characters of a kept name; longer keys are cut and hashed


class OutputError(ValueError):
    """An output that cannot be written where it was asked for (said in one line)."""


def _hash(key: str) -> str:
    return hashlib.sha1(key.encode("utf-8", "surrogatepass")).hexdigest()[:8]


def safe_name(key: str) -> str:
    """A file name (no folder) standing for ``key``: ``key`` itself when it is plain (letters,
    digits, ``_ . -``, not starting with a dot, at most 120 characters), otherwise its plain
    characters with ``_`` for the others and ``-`` and 8 hex digits of its SHA-1 appended. Two
    different keys get two different names (but for a hash collision, which callers still check)."""
    if _PLAIN.fullmatch(key) and len(key) <= _MAX_NAME:
        return key
    cleaned = re.sub(r"[^\w.\-]+", "_", key).lstrip(".")[:_MAX_NAME - 9] or "_"
    return f"{cleaned}-{_hash(key)}"


def child(folder: Path, name: str, what: str) -> Path:
    """``folder / name`` for a ``name`` the user chose (``what`` names the flag in the message);
    ``OutputError`` unless it is one plain file name that stays in ``folder``."""
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name or name.startswith("."):
        raise OutputError(f"{what} {name!r}: not a plain name (no folders, '.', '..' or leading dot); it names a "
                          f"file in {folder}")
    return folder / name


def refuse_overlap(source: Path, out: Path, source_what: str = "the source") -> None:
    """``OutputError`` when the output folder is ``source`` or contains it: a tool that wrote
    there could replace or re-read its own input."""
    src, dst = source.resolve(), out.resolve()
    if src == dst or dst in src.parents:
        how = "is" if src == dst else "contains"
        raise OutputError(f"output folder {out} {how} {source_what} {source}: a tool never writes into its own "
                          "input; choose an output folder outside it")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


class Staging:
    """A build of a tool's outputs in ``OUT/.<tool>.partial/``, laid out as they will lie in
    ``OUT``, then ``publish``\\ ed. ``OUT/<record>`` lists what the last complete build wrote
    (JSON), so the next build replaces exactly that and nothing a user put beside it.

    Publishing removes the record and every old manifest first, then swaps the audio folders and
    files, then moves the new manifests in and writes the record last. A kill while building
    leaves the old result untouched (the partial folder is removed by the next build); a kill in
    the instant of publishing leaves no manifest rather than one naming another build's audio.
    """

    def __init__(self, out: Path, tool: str, record: str):
        self.out, self.record = out, record
        self.path = out / f".{tool}.partial"

    def __enter__(self) -> Staging:
        self.out.mkdir(parents=True, exist_ok=True)
        if self.path.exists():  # a build that was killed: start clean
            _remove(self.path)
        self.path.mkdir()
        return self

    def __exit__(self, exc_type, *exc: object) -> None:
        if self.path.exists():  # not published: an error or a kill on the way
            _remove(self.path)

    def previous(self) -> list[str] | None:
        """The names the last complete build wrote (None when no build recorded any)."""
        try:
            names = json.loads((self.out / self.record).read_text(encoding="utf-8"))["outputs"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return [n for n in names if isinstance(n, str) and n and "/" not in n and n not in (".", "..")]

    def publish(self, info: dict[str, Any] | None = None, stale: list[str] = ()) -> list[str]:
        """Move everything built into ``OUT``, replacing what the last build wrote (and ``stale``,
        names an unrecorded earlier build may have left); write the record (``info`` plus the
        list of outputs). Returns the names published."""
        new = sorted(p.name for p in self.path.iterdir())
        old = set(self.previous() or ()) | set(stale)
        manifests = [n for n in new if n.endswith(".jsonl")]
        (self.out / self.record).unlink(missing_ok=True)
        for name in sorted(old | set(manifests)):  # first: no manifest may outlive the audio it names
            if name.endswith(".jsonl"):
                (self.out / name).unlink(missing_ok=True)
        for name in sorted(old - set(new)):
            _remove(self.out / name)
        for name in new:
            if name not in manifests:
                _remove(self.out / name)
                os.replace(self.path / name, self.out / name)
        for name in manifests:
            os.replace(self.path / name, self.out / name)
        record = {**(info or {}), "outputs": new}
        write_file_atomic(self.out / self.record, (json.dumps(record, indent=2, ensure_ascii=False) + "\n").encode())
        self.path.rmdir()
        fsync_dir(self.out)
        return new
