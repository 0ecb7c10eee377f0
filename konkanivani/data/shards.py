"""Sharded datasets: tar shards in the WebDataset layout, their list, and how training reads them.

A shard is a tar file holding two members per utterance, ``KEY.flac`` (16 kHz mono 16-bit, lossless;
or ``KEY.opus``, Opus in Ogg, lossy and a tenth of the bytes: ``AUDIO_MEMBERS``) and ``KEY.json``
(``text``, ``duration`` and the manifest row's other keys): the layout WebDataset, NeMo's tarred
datasets and SpeechBrain read. ``shards.json`` lists a set of them: each shard's file, size in bytes
and, per utterance, its key and duration, so that an epoch is planned without opening a shard
(``konkanivani-prepare shards`` writes both: ``datatools/shard_writer.py``).
``--train_shards`` takes that list, a brace pattern (``shards/shard-{000000..000099}.tar``) or a
text file of shard paths; for the last two each shard is read once before training to list its
utterances.

**An epoch's plan** (``ShardPlan``) is a pure function of the list, the seed, the epoch, the world
size and the settings, so that every process computes every process's share and a resumed run finds
the same batches:

1. the shards are shuffled (seeded by seed and epoch); process ``r`` of ``W`` takes every ``W``-th
   of the first ``W * (n // W)``; the ``n % W`` left over are read by every process, each taking
   every ``W``-th utterance of them (so a list of fewer shards than processes still splits);
2. a process's shards are dealt to its streams (one per DataLoader worker), every ``S``-th each;
3. a stream reads its shards in turn, through a shuffle buffer of ``--shuffle_buffer`` utterances;
   each run of that many utterances out of it is sorted by duration and cut into batches under the
   same frame budget (or ``--batch_size``) as a manifest's, and those batches are shuffled: length
   bucketing inside the buffer;
4. the process's batches are its streams' in turn, as the DataLoader takes them from its workers;
5. every process gets the same number of batches: one with fewer splits its largest batches in two
   until it has as many as the most (when all are down to one utterance, the last are empty: that
   process adds nothing to those steps). Every utterance is seen once an epoch, and no process
   waits.

Reading (``ShardStream``, an IterableDataset) follows the plan: a worker opens its stream's shards
in order, keeps the encoded bytes of the utterances its coming batches need (a bounded number: the
buffer's) and sends each batch as soon as all of its utterances are read. On a resume it skips the
batches already trained on, and every shard none of the rest needs, without opening it.

Bad data: a member that does not decode (audio or JSON), whose text fails the manifest checks, or
whose duration in the list or its JSON differs from its audio's by more than the manifest's
tolerance is left out of its batch and counted (as a manifest's row is skipped); a truncated shard
ends with a warning naming it (its missing utterances are counted); a missing shard, one whose size
differs from the list's, a shard listed twice or a key found twice is a one-line error before
training starts.
"""
from __future__ import annotations

import bisect
import hashlib
import heapq
import io
import json
import logging
import math
import random
import tarfile
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch.utils.data import IterableDataset, get_worker_info

from .audio import AudioError, load_audio
from .dataset import ASRDataset, Batch, Example, Unreadable, Utterance, collate
from .frames import SAMPLE_RATE
from .manifest import DEFAULT_DURATION_TOLERANCE, ManifestError, check_text
from .samplers import ResumableBatchSampler, cut_batches
from .tokenizer import Tokenizer

__all__ = [
    "LIST_NAME",
    "TEXTS_NAME",
    "FORMAT",
    "ShardError",
    "Shard",
    "ShardSet",
    "open_shards",
    "read_shard_list",
    "shard_files",
    "texts_of",
    "AUDIO_MEMBERS",
    "audio_member",
    "iter_shard",
    "scan_shard",
    "shard_waveforms",
    "ShardPlan",
    "ShardStream",
    "ShardUtterances",
]

log = logging.getLogger("konkanivani")

LIST_NAME = "shards.json"  # the shard list prepare writes beside the shards
# every utterance's text, a line each: what a fresh run trains its tokenizer on
TEXTS_NAME = "text.txt"
FORMAT = {"format": "konkanivani-shards", "version": 1}
AUDIO_MEMBER, META_MEMBER = "flac", "json"
# the audio members a shard may hold: lossless FLAC (what the writer makes by default), or Opus in
# Ogg (``--audio_format opus``: a tenth of the bytes, lossy), as WebDataset names them by extension
AUDIO_MEMBERS = ("flac", "opus")


def audio_member(files: dict[str, bytes]) -> Optional[str]:
    """The extension of the audio member among an utterance's ``files``, or None."""
    return next((ext for ext in AUDIO_MEMBERS if ext in files), None)
_NAMED = 5  # bad members of a kind a reader names one by one; the others are counted


class ShardError(ManifestError):
    """Shards that cannot be used at all (a missing one, a list that does not match its files); one
    line, reported as an unusable manifest is."""


@dataclass(frozen=True)
class Shard:
    """One shard as its list (or a scan) describes it."""

    path: Path
    name: str  # as listed (relative to the list's folder), for messages
    size: int  # bytes; -1 when not listed (a brace pattern)
    keys: tuple[str, ...]
    durations: tuple[float, ...]

    def __len__(self) -> int:
        return len(self.keys)


@dataclass
class ShardSet:
    """The shards training reads, in list order; utterance ``i`` of the set is ``locate(i)``."""

    shards: list[Shard]
    source: str  # what --train_shards said
    texts: Optional[Path] = None  # the list's text.txt, when there is one
    offsets: list[int] = field(init=False)  # the set's index of each shard's first utterance

    def __post_init__(self) -> None:
        self.offsets, total = [], 0
        for shard in self.shards:
            self.offsets.append(total)
            total += len(shard)
        self.total = total

    def __len__(self) -> int:
        return self.total

    def locate(self, index: int) -> tuple[int, int]:
        """(shard, position in it) of utterance ``index``."""
        s = bisect.bisect_right(self.offsets, index) - 1
        return s, index - self.offsets[s]

    def where(self, index: int) -> str:
        s, pos = self.locate(index)
        return f"{self.shards[s].name}:{self.shards[s].keys[pos]}"

    def durations(self) -> list[float]:
        return [d for shard in self.shards for d in shard.durations]

    def hours(self) -> float:
        return sum(sum(shard.durations) for shard in self.shards) / 3600

    def digest(self) -> str:
        """What a resumed run checks its plan against: the shards' names, sizes and keys."""
        h = hashlib.sha256()
        for shard in self.shards:
            h.update(json.dumps([shard.name, shard.size, shard.keys]).encode())
        return h.hexdigest()[:16]


class ShardUtterances(Sequence[Utterance]):
    """A shard set's utterances as the training loop names them (``where``) and batches them
    (``duration``); made when asked for, as a set may hold millions. Text and tokens are read with
    the audio, so they are empty here."""

    def __init__(self, shards: ShardSet):
        self.shards = shards

    def __len__(self) -> int:
        return len(self.shards)

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        s, pos = self.shards.locate(index)
        shard = self.shards.shards[s]
        return Utterance(
            shard.path, shard.durations[pos], "", [], f"{shard.name}:{shard.keys[pos]}"
        )


# ---- the list --------------------------------------------------------------------------------

def read_shard_list(path: str | Path, check_files: bool = True) -> ShardSet:
    """The shards a ``shards.json`` lists. ``ShardError`` in one line for a list that is not one, a
    missing shard, or one whose size differs from the list's (rewritten or truncated since)."""
    path = Path(path)
    try:
        listing = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ShardError(f"{path}: not a shard list ({e})") from e
    if not isinstance(listing, dict) or listing.get("format") != FORMAT["format"]:
        raise ShardError(f"{path}: not a shard list (konkanivani-prepare shards writes one)")
    if listing.get("version") != FORMAT["version"]:
        raise ShardError(
            f"{path}: shard list version {listing.get('version')}, this konkanivani reads "
            f"{FORMAT['version']}"
        )
    shards = []
    for n, entry in enumerate(listing.get("shards", []), start=1):
        try:
            name, size, keys, durations = (
                entry["path"],
                int(entry["bytes"]),
                entry["keys"],
                entry["durations"],
            )
            if len(keys) != len(durations) or len(keys) != entry["utterances"]:
                raise ValueError(
                    f"{len(keys)} keys, {len(durations)} durations, {entry['utterances']}"
                    " utterances"
                )
            if not all(isinstance(key, str) for key in keys):
                raise ValueError("a key that is not a string")
            seconds = tuple(float(d) for d in durations)
            # json reads NaN, Infinity and 1e999: no number of seconds a batch can be planned by
            bad = next((i for i, d in enumerate(seconds) if not 0 <= d < math.inf), None)
            if bad is not None:
                raise ValueError(f"key {keys[bad]} has the duration {durations[bad]!r}, not a "
                                 "finite number of seconds")
        except (KeyError, TypeError, ValueError) as e:
            raise ShardError(f"{path}: shard entry {n} is malformed ({e})") from e
        shard_path = path.parent / name
        if check_files:
            _check_file(shard_path, size, path)
        shards.append(Shard(shard_path, name, size, tuple(keys), seconds))
    if not shards:
        raise ShardError(f"{path}: the list holds no shard")
    _check_unique(shards, path)
    texts = path.parent / TEXTS_NAME
    return ShardSet(shards, str(path), texts if texts.is_file() else None)


def _check_unique(shards: Sequence[Shard], source: str | Path) -> None:
    """``ShardError`` in one line for a shard listed twice (the same entry, or two entries that are
    one file) or a key found twice (in one shard, or in two): the plan counts each listing and each
    key as an utterance of its own, so the one would be trained twice an epoch and the other could
    not be found again (a worker looks its members up by key)."""
    files: dict[Path, int] = {}
    for n, shard in enumerate(shards):
        try:
            real = shard.path.resolve()  # symbolic links followed
        except (OSError, RuntimeError):  # a loop of links: the path as given
            real = shard.path.absolute()
        if (first := files.setdefault(real, n)) != n:
            twice = f"{shard.name} is listed twice" if shards[first].name == shard.name else \
                f"{shards[first].name} and {shard.name} are the same file ({real})"
            raise ShardError(f"{source}: {twice}: it would be trained twice an epoch; "
                             "list each shard once")
    owner: dict[str, int] = {}
    for n, shard in enumerate(shards):
        if len(set(shard.keys)) != len(shard.keys):
            key, count = Counter(shard.keys).most_common(1)[0]
            raise ShardError(f"{source}: key {key} is in {shard.name} {count} times: keys must be "
                             "unique; write the shards again with konkanivani-prepare shards")
        for key in shard.keys:
            if (first_n := owner.setdefault(key, n)) != n:
                raise ShardError(f"{source}: key {key} is in both {shards[first_n].name} and "
                                 f"{shard.name}: keys must be unique across the shards of a list")


def _check_file(shard_path: Path, size: int, listed_in: Path) -> None:
    if not shard_path.is_file():
        raise ShardError(f"{shard_path}: shard missing (listed in {listed_in})")
    actual = shard_path.stat().st_size
    if actual != size:
        raise ShardError(
            f"{shard_path}: {actual} bytes, but {listed_in} lists {size}: the shard does not match"
            " its list (rewritten or cut short since); write the shards again with"
            " konkanivani-prepare shards"
        )


def texts_of(spec: str) -> Optional[Path]:
    """The ``text.txt`` beside the shards ``--train_shards`` names (a fresh run trains its tokenizer
    on it)."""
    path = Path(spec)
    folder = path if path.is_dir() else path.parent
    if path.suffix != ".json" and not path.is_dir() and "{" in spec:
        folder = Path(spec.split("{", 1)[0]).parent
    texts = folder / TEXTS_NAME
    return texts if texts.is_file() else None


def _listed_list(spec: str) -> Optional[Path]:
    """The ``shards.json`` ``--train_shards spec`` names (the file, or the one in a folder), or
    None where it names shards otherwise."""
    path = Path(spec)
    if path.suffix == ".json" or path.is_dir():
        return path / LIST_NAME if path.is_dir() else path
    return None


def _named_shards(spec: str) -> list[Path]:
    """The shards a brace pattern or a text file of shard paths (a line each, relative to that
    file) names, unopened."""
    path = Path(spec)
    if path.is_file() and path.suffix != ".tar":
        lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
        return [
            Path(p) if Path(p).is_absolute() else path.parent / p
            for p in lines
            if p and not p.startswith("#")
        ]
    from braceexpand import braceexpand
    return [Path(p) for p in braceexpand(spec)]


def shard_files(spec: str) -> list[Path]:
    """Every file ``--train_shards spec`` has a run read: the list (a ``shards.json`` or a text file
    of paths), the shards it names and the ``text.txt`` beside them; no shard is opened.
    ``ShardError`` for a ``shards.json`` that is no shard list."""
    if (listing := _listed_list(spec)) is not None:
        shards = [s.path for s in read_shard_list(listing, check_files=False).shards]
        return [listing, *shards, *filter(None, [texts_of(spec)])]
    shards = _named_shards(spec)
    texts = shards[0].parent / TEXTS_NAME if shards else None
    return [*([Path(spec)] if Path(spec).is_file() else []), *shards,
            *([texts] if texts is not None and texts.is_file() else [])]


def open_shards(spec: str, check_files: bool = True) -> ShardSet:
    """``--train_shards``: a ``shards.json``; or a brace pattern or a text file of shard paths (a
    line each, relative to that file), whose shards are read once here to list their utterances."""
    if (listing := _listed_list(spec)) is not None:
        return read_shard_list(listing, check_files)
    paths = _named_shards(spec)
    if not paths:
        raise ShardError(f"--train_shards {spec}: names no shard")
    shards = []
    for shard_path in paths:
        if not shard_path.is_file():
            raise ShardError(f"{shard_path}: shard missing (from --train_shards {spec})")
        keys, durations, problems = scan_shard(shard_path)
        for problem in problems:
            log.warning("%s", problem)
        shards.append(Shard(shard_path, str(shard_path), -1, tuple(keys), tuple(durations)))
    _check_unique(shards, f"--train_shards {spec}")
    texts = paths[0].parent / TEXTS_NAME
    return ShardSet(shards, spec, texts if texts.is_file() else None)


# ---- reading a shard ---------------------------------------------------------------------------

def iter_shard(path: Path, name: str = "") -> Iterator[tuple[str, dict[str, bytes]]]:
    """``(key, {extension: bytes})`` for each utterance of a shard, in order, reading it once from
    start to end (the right way to read a network mount). A member whose name has no extension is
    passed over. A truncated or corrupt tar ends the shard with a warning naming it."""
    name = name or str(path)
    key, files, count = None, {}, 0
    try:
        with tarfile.open(path, "r|") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                base = member.name.rsplit("/", 1)[-1]
                if "." not in base:
                    continue
                member_key, ext = base.split(".", 1)
                if member_key != key:
                    if key is not None:
                        yield key, files
                        count += 1
                    key, files = member_key, {}
                handle = tar.extractfile(member)
                files[ext] = handle.read() if handle is not None else b""
    except (tarfile.TarError, EOFError, OSError, ValueError) as e:
        log.warning(
            "%s: shard truncated or corrupt after %d utterances (%s); the rest of it is skipped",
            name,
            count,
            e,
        )
        return  # the member being read when it broke is not complete: not yielded
    if key is not None:
        yield key, files


def scan_shard(path: Path) -> tuple[list[str], list[float], list[str]]:
    """A shard's keys and durations (from each JSON member, else the audio's header), and what was
    wrong with it (the utterances that could not be listed are left out)."""
    keys, durations, problems = [], [], []
    for key, files in iter_shard(path):
        try:
            duration = float(json.loads(files[META_MEMBER]).get("duration"))
            if not 0 <= duration < math.inf:  # NaN, Infinity: no duration
                raise ValueError(duration)
        except (KeyError, TypeError, ValueError, AttributeError):
            try:
                import soundfile as sf
                info = sf.info(io.BytesIO(files[audio_member(files) or AUDIO_MEMBER]))
                duration = info.frames / info.samplerate
            except Exception:  # noqa: BLE001 (soundfile raises several kinds)
                problems.append(
                    f"{path}: {key}: no duration in its JSON and no readable audio; not listed"
                )
                continue
        keys.append(key)
        durations.append(duration)
    return keys, durations, problems


def decode_member(files: dict[str, bytes], where: str) -> tuple[torch.Tensor, dict[str, Any]]:
    """An utterance's waveform and metadata; ``AudioError`` (reason counted) when either is
    unusable."""
    if (member := audio_member(files)) is None:
        raise AudioError("no audio member", where)
    try:
        meta = json.loads(files.get(META_MEMBER, b"").decode("utf-8"))
        if not isinstance(meta, dict):
            raise ValueError("not an object")
    except (UnicodeDecodeError, ValueError) as e:
        raise AudioError("metadata unreadable", where, str(e)) from e
    return load_audio(io.BytesIO(files[member]), label=where), meta


def shard_waveforms(
    shards: ShardSet, max_utterances: int = 500, seed: int = 0
) -> Iterator[torch.Tensor]:
    """Up to ``max_utterances`` waveforms from shards taken in a seeded order (for CMVN statistics;
    whole shards, read once each: cheap on a network mount)."""
    order = list(range(len(shards.shards)))
    random.Random(seed).shuffle(order)
    count = 0
    for s in order:
        shard = shards.shards[s]
        for key, files in iter_shard(shard.path, shard.name):
            if count >= max_utterances:
                return
            try:
                wav, _ = decode_member(files, f"{shard.name}:{key}")
            except AudioError as e:
                log.warning("%s; left out of CMVN", e)
                continue
            count += 1
            yield wav


# ---- the plan ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Unit:
    """A stream's share of one shard: its utterances at positions ``phase``, ``phase + stride``,
    ..."""

    shard: int
    stride: int = 1
    phase: int = 0


@dataclass
class StreamWork:
    """What one reader (a DataLoader worker) does in an epoch: its shards and its batches left."""

    epoch: int
    # path, name, offset, stride, phase, key -> position
    units: list[tuple[Path, str, int, int, int, dict[str, int]]]
    batches: list[list[int]]


def _shuffle_buffer(items: Sequence[int], size: int, rng: random.Random) -> Iterator[int]:
    """The classic shuffle buffer: an item goes out when a later one takes its place at random."""
    buffer: list[int] = []
    for item in items:
        if len(buffer) < size:
            buffer.append(item)
            continue
        j = rng.randrange(size)
        buffer[j], item = item, buffer[j]
        yield item
    rng.shuffle(buffer)
    yield from buffer


def interleave(streams: Sequence[Sequence[Any]]) -> list[Any]:
    """The streams' items in turn, a finished stream passed over: the order in which a DataLoader
    takes batches from its workers."""
    out, depth = [], max((len(s) for s in streams), default=0)
    for k in range(depth):
        out.extend(s[k] for s in streams if k < len(s))
    return out


class ShardPlan(ResumableBatchSampler):
    """The epochs of a shard set, for process ``rank`` of ``world`` with ``streams`` readers: the
    module's docstring tells how. As a ``ResumableBatchSampler`` (what the training loop asks of its
    sampler) its ``epoch_batches`` are this process's batches, as utterance indices of the set."""

    def __init__(
        self,
        shards: ShardSet,
        frames: Sequence[int],
        *,
        rank: int = 0,
        world: int = 1,
        streams: int = 1,
        seed: int = 0,
        buffer: int = 1000,
        max_frames: int = 0,
        batch_size: int = 8,
        max_duration: float = float("inf"),
        fits: Optional[Callable[[int, int], bool]] = None,
    ):
        if buffer < 1:
            raise ValueError(f"the shuffle buffer must hold at least 1 utterance, got {buffer}")
        # frames: each utterance's, as batching counts them
        self.shards, self.frames = shards, list(frames)
        self.rank, self.world, self.streams, self.seed, self.buffer = (
            rank,
            world,
            max(1, streams),
            seed,
            buffer,
        )
        self.max_frames, self.batch_size, self.fits = max_frames, batch_size, fits
        self.usable = [d <= max_duration for d in shards.durations()]
        self._cache: tuple[int, list[list[list[list[int]]]]] | None = None

    # -- the plan of an epoch
    def _units(self, epoch: int) -> list[list[Unit]]:
        """Each process's shards (or shares of one) this epoch."""
        order = list(range(len(self.shards.shards)))
        random.Random(f"shards {self.seed} {epoch}").shuffle(order)
        whole = len(order) // self.world * self.world
        return [
            [Unit(s) for s in order[r : whole : self.world]]
            + [Unit(s, self.world, r) for s in order[whole:]]
            for r in range(self.world)
        ]

    def _indices(self, unit: Unit) -> list[int]:
        offset, count = self.shards.offsets[unit.shard], len(self.shards.shards[unit.shard])
        return [
            offset + p for p in range(unit.phase, count, unit.stride) if self.usable[offset + p]
        ]

    def _stream(self, units: Sequence[Unit], rng: random.Random) -> list[list[int]]:
        items = [i for unit in units for i in self._indices(unit)]
        batches, pool = [], []
        key = self.frames.__getitem__

        def flush() -> None:
            pool.sort(key=key)  # stable: equal lengths stay in buffer order
            if self.max_frames or self.fits is not None:
                cut = cut_batches(pool, self.frames, self.max_frames or 10 ** 9, self.fits)
            else:
                cut = [pool[i:i + self.batch_size] for i in range(0, len(pool), self.batch_size)]
            rng.shuffle(cut)
            batches.extend(cut)
            pool.clear()

        for item in _shuffle_buffer(items, self.buffer, rng):
            pool.append(item)
            if len(pool) == self.buffer:
                flush()
        if pool:
            flush()
        return batches

    def plan(self, epoch: int) -> list[list[list[list[int]]]]:
        """Every process's streams of batches in ``epoch`` (``[rank][stream][batch]``), equal in
        count per process."""
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        ranks = []
        for r, units in enumerate(self._units(epoch)):
            ranks.append(
                [
                    self._stream(
                        units[k :: self.streams],
                        random.Random(f"stream {self.seed} {epoch} {r} {k}"),
                    )
                    for k in range(self.streams)
                ]
            )
        target = max(sum(len(s) for s in streams) for streams in ranks)
        for streams in ranks:
            self._even_out(streams, target)
        self._cache = (epoch, ranks)
        return ranks

    def _even_out(self, streams: list[list[list[int]]], target: int) -> None:
        """Split this process's largest batches in two until it has ``target`` batches (each half
        stays where its batch stood, in its stream); then, if need be, add empty ones."""
        short = target - sum(len(s) for s in streams)
        if short <= 0:
            return
        batches: dict[int, list[int]] = {}  # id -> batch
        orders: list[list[int]] = []  # each stream's batch ids in order
        heap: list[tuple[int, int]] = []  # (-padded frames, id) of the batches that can be split
        for s in streams:
            orders.append([])
            for b in s:
                batches[len(batches)] = b
                orders[-1].append(len(batches) - 1)
                if len(b) > 1:
                    # sorted: the last is the longest
                    heap.append((-len(b) * self.frames[b[-1]], len(batches) - 1))
        heapq.heapify(heap)
        where = {i: k for k, order in enumerate(orders) for i in order}
        next_id = len(batches)
        while short > 0 and heap:
            _, i = heapq.heappop(heap)
            batch, k = batches.pop(i), where.pop(i)
            ids = []
            for half in (batch[:len(batch) // 2], batch[len(batch) // 2:]):
                new, next_id = next_id, next_id + 1
                ids.append(new)
                batches[new], where[new] = half, k
                if len(half) > 1:
                    heapq.heappush(heap, (-len(half) * self.frames[half[-1]], new))
            at = orders[k].index(i)
            orders[k][at:at + 1] = ids
            short -= 1
        # every batch down to one utterance, and still fewer: a share of nothing
        for _ in range(short):
            orders[min(range(len(orders)), key=lambda k: len(orders[k]))].append(-1)
        for k, order in enumerate(orders):
            streams[k][:] = [batches[i] if i >= 0 else [] for i in order]

    # -- ResumableBatchSampler: this process's batches
    def epoch_batches(self) -> list[list[int]]:
        return interleave(self.plan(self.epoch)[self.rank])

    def __len__(self) -> int:
        return max(0, sum(len(s) for s in self.plan(self.epoch)[self.rank]) - self.start)

    def _done(self, streams: list[list[list[int]]], batches_done: int) -> list[int]:
        """How many batches of each stream are among the process's first ``batches_done``."""
        done = [0] * len(streams)
        for k in interleave([[k] * len(s) for k, s in enumerate(streams)])[:batches_done]:
            done[k] += 1
        return done

    def work(self, worker: int) -> StreamWork:
        """DataLoader worker ``worker``'s share of the rest of this process's epoch (after ``start``
        batches). A fresh DataLoader asks its workers in turn from worker 0, so after a resume
        worker 0 reads the stream whose batch comes next, worker 1 the stream after it, and so on:
        the
        batches then come in the order the unbroken epoch had."""
        streams = self.plan(self.epoch)[self.rank]
        order = interleave([[k] * len(s) for k, s in enumerate(streams)])
        stream = ((order[self.start] if self.start < len(order) else 0) + worker) % self.streams
        left = streams[stream][self._done(streams, self.start)[stream]:]
        needed = {i for b in left for i in b}
        units = []
        for unit in self._units(self.epoch)[self.rank][stream::self.streams]:
            # a shard nothing left needs is not opened
            if any(i in needed for i in self._indices(unit)):
                shard = self.shards.shards[unit.shard]
                units.append(
                    (
                        shard.path,
                        shard.name,
                        self.shards.offsets[unit.shard],
                        unit.stride,
                        unit.phase,
                        {key: p for p, key in enumerate(shard.keys)},
                    )
                )
        return StreamWork(self.epoch, units, left)

    def __getstate__(self) -> dict[str, Any]:
        """A worker started by pickling (not forking) gets the plan without ``fits`` (a closure
        need not pickle), with the epoch's plan made already."""
        return {**self.__dict__, "fits": None}

    # -- the data position a checkpoint keeps
    def position(self, epoch: int, batches_done: int) -> dict[str, Any]:
        """This process's place in ``epoch``: its plan's inputs, and for each stream its next batch
        and the shard and key that batch starts with (what a person reading the checkpoint wants).
        """
        streams = self.plan(epoch)[self.rank]
        done = self._done(streams, batches_done)
        at = []
        for k, stream in enumerate(streams):
            nxt = stream[done[k]] if done[k] < len(stream) else None
            at.append(
                {
                    "batch": done[k],
                    "of": len(stream),
                    "next": self.shards.where(nxt[0]) if nxt else None,
                }
            )
        return {
            "kind": "shards",
            "digest": self.shards.digest(),
            "world": self.world,
            "streams": self.streams,
            "seed": self.seed,
            "buffer": self.buffer,
            "epoch": epoch,
            "batches_done": batches_done,
            "stream_positions": at,
        }

    def same_plan(self, position: dict[str, Any]) -> Optional[str]:
        """None when a saved ``position`` was made by this plan's inputs; else what differs."""
        for name, mine in (
            ("kind", "shards"),
            ("digest", self.shards.digest()),
            ("world", self.world),
            ("streams", self.streams),
            ("seed", self.seed),
            ("buffer", self.buffer),
        ):
            if position.get(name) != mine:
                return f"{name} {position.get(name)} then, {mine} now"
        return None


# ---- reading, in each DataLoader worker ----------------------------------------------------------

class ShardStream(IterableDataset):
    """The batches of a ``ShardPlan``'s process, read from its shards: worker ``w`` of the
    DataLoader reads stream ``w`` (without workers, the one stream). Each yields ``Batch``es
    (``collate``d), so the DataLoader takes them with ``batch_size=None``; a member that cannot be
    used is in ``Batch.missing``, as an unreadable file of a manifest is. A member whose duration in
    the list or in its JSON differs from its audio's by more than ``duration_tolerance`` seconds is
    one (a manifest's row is skipped for it); the first few of a stream are named, all counted."""

    def __init__(self, plan: ShardPlan, tokenizer: Tokenizer, features: ASRDataset,
                 duration_tolerance: float = DEFAULT_DURATION_TOLERANCE, pad_to_frames: int = 0):
        # features: log-mel + augmentation
        self.plan, self.tokenizer, self.features = plan, tokenizer, features
        self.duration_tolerance = duration_tolerance  # < 0: not compared, as for a manifest
        self.pad_to_frames = pad_to_frames  # collate's

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        # a programming error: the plan is made for the loader's workers
        if workers != self.plan.streams:
            raise RuntimeError(
                f"a plan of {self.plan.streams} shard streams read by {workers} DataLoader workers"
            )
        self._reading = self.plan.shards.source
        try:
            yield from self._read(self.plan.work(worker))
        except ShardError:
            raise
        except Exception as e:  # a fault of ours, most likely: named with its shard and place
            at = traceback.extract_tb(e.__traceback__)[-1]
            raise ShardError(f"{self._reading}: reading failed ({type(e).__name__}: {e}, at "
                             f"{Path(at.filename).name}:{at.lineno})") from e

    def _read(self, work: StreamWork) -> Iterator[Batch]:
        pending = list(reversed(work.batches))  # a stack: the next batch last
        needed = {i for b in work.batches for i in b}
        # index -> (where, files or None: never comes)
        held: dict[int, tuple[str, Optional[dict[str, bytes]]]] = {}
        problems: Counter = Counter()
        for path, name, offset, stride, phase, positions in work.units:
            self._reading = name
            wanted = {offset + p for p in range(phase, len(positions), stride)} & needed
            for key, files in iter_shard(path, name):
                p = positions.get(key)
                if p is None:
                    problems["not in the shard list"] += 1
                    continue
                if offset + p in wanted:
                    wanted.discard(offset + p)
                    held[offset + p] = (f"{name}:{key}", files)
                    yield from self._ready(pending, held, work.epoch, problems)
            if lost := wanted:  # a truncated shard: they will not come
                keys = {offset + p: key for key, p in positions.items()}
                for i in lost:
                    held[i] = (f"{name}:{keys[i]}", None)
                problems["missing from their shard"] += len(lost)
                yield from self._ready(pending, held, work.epoch, problems)
        if problems:
            log.warning("shards, epoch %d: %s", work.epoch + 1,
                        ", ".join(f"{n} {reason}" for reason, n in problems.most_common()))

    def _ready(
        self,
        pending: list[list[int]],
        held: dict[int, tuple[str, Optional[dict[str, bytes]]]],
        epoch: int,
        problems: Counter,
    ) -> Iterator[Batch]:
        while pending and all(i in held for i in pending[-1]):
            examples, reading = [], self._reading
            for i in pending.pop():
                where, files = held.pop(i)
                self._reading = where  # what an error in making its example names
                examples.append(self._example(i, where, files, epoch, problems))
            self._reading = reading
            yield collate(examples, self.pad_to_frames)

    def _example(self, index: int, where: str, files: Optional[dict[str, bytes]], epoch: int,
                 problems: Counter) -> Example | Unreadable:
        if files is None:
            return Unreadable(index)
        try:
            wav, meta = decode_member(files, where)
        except AudioError as e:
            problems[e.reason] += 1
            log.warning("%s; skipped in this batch", e)
            return Unreadable(index)
        seconds = wav.shape[0] / SAMPLE_RATE
        if (error := self._duration_error(index, meta.get("duration"), seconds)) is not None:
            problems[error[0]] += 1
            if problems[error[0]] <= _NAMED:  # the rest are counted in the stream's summary
                last = problems[error[0]] == _NAMED
                more = " (more are counted at the epoch's end)" if last else ""
                log.warning("%s: %s (%s); skipped in this batch%s", where, *error, more)
            return Unreadable(index)
        error, tokens = check_text(meta.get("text"), seconds, self.tokenizer)
        if error is not None:
            problems[error[0]] += 1
            log.warning(
                "%s: %s%s; skipped in this batch",
                where,
                error[0],
                f" ({error[1]})" if error[1] else "",
            )
            return Unreadable(index)
        return self.features.example(wav, tokens, epoch, index)

    def _duration_error(self, index: int, stated: Any, seconds: float) -> Optional[tuple[str, str]]:
        """(reason, detail) when the list's duration of utterance ``index`` or its JSON's
        (``stated``, when there) is not the audio's ``seconds``, within the tolerance; else None.
        The plan batched it by the list's duration: a much longer one could overrun the budget."""
        if self.duration_tolerance < 0:
            return None
        s, pos = self.plan.shards.locate(index)
        listed = self.plan.shards.shards[s].durations[pos]
        if abs(listed - seconds) > self.duration_tolerance:
            return "duration mismatch", f"listed as {listed:.2f} s, the audio holds {seconds:.2f} s"
        if stated is None:
            return None
        if isinstance(stated, bool) or not isinstance(stated, (int, float)) \
                or not math.isfinite(stated):
            return "duration not a number", f"its JSON says {stated!r}"
        if abs(stated - seconds) > self.duration_tolerance:
            return "duration mismatch", \
                f"its JSON says {stated:.2f} s, the audio holds {seconds:.2f} s"
        return None
