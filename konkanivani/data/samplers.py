"""The batch samplers, all resumable mid-epoch: length-grouped batches of a fixed size (validation),
a process's share of them under torchrun, and dynamic batching by duration: batches hold as many
utterances as fit a frame budget, grouped by length so that little of each batch is padding; plus
the helpers that change a batch's size
(halving a micro-batch after an out-of-memory error) or the training set's (``--max_samples``)."""
from __future__ import annotations

import random
from typing import Callable, Iterator, Optional, Sequence

from torch.utils.data import Sampler

from .dataset import Batch
from .frames import frames_of, padded_frames

__all__ = [
    "ResumableBatchSampler",
    "LengthGroupedBatchSampler",
    "ShardedSampler",
    "EpochKeyed",
    "DurationBucketSampler",
    "PreflightSampler",
    "LengthCurriculum",
    "WeightedMix",
    "cut_batches",
    "train_sampler",
    "padding_fraction",
    "split_batch",
    "select_samples",
]


class ResumableBatchSampler(Sampler[list[int]]):
    """A batch sampler whose batches for an epoch are a pure function of its settings and the
    epoch (``epoch_batches``), so that ``set_epoch(epoch, start)`` / ``load_state_dict`` can
    restart an epoch after the ``start`` batches already consumed: a mid-epoch resume."""

    epoch = 0
    start = 0  # batches of this epoch to skip

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "start": self.start}

    def load_state_dict(self, state: dict) -> None:
        self.set_epoch(state["epoch"], state["start"])

    def epoch_batches(self) -> list[list[int]]:
        raise NotImplementedError

    def position(self, epoch: int, batches_done: int) -> dict:
        """More of the data position than ``epoch`` and ``batches_done`` that a checkpoint keeps (a
        shard plan's)."""
        return {}

    def __iter__(self) -> Iterator[list[int]]:
        yield from self.epoch_batches()[self.start:]

    def __len__(self) -> int:
        return max(0, len(self.epoch_batches()) - self.start)


class EpochKeyed(Sampler[list[tuple[int, int]]]):
    """The batches of ``sampler`` as ``(epoch, index)`` keys, for a dataset that augments: the
    epoch reaches ``ASRDataset.__getitem__`` in every worker with each index (persistent workers
    hold copies of the dataset made once, so setting it on the dataset would not), and it is the
    sampler's own, so a resumed epoch draws as the unbroken one did."""

    def __init__(self, sampler: ResumableBatchSampler):
        self.sampler = sampler

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        epoch = self.sampler.epoch
        for batch in self.sampler:
            yield [(epoch, i) for i in batch]

    def __len__(self) -> int:
        return len(self.sampler)


class ShardedSampler(ResumableBatchSampler):
    """One process's share of another batch sampler's batches under data parallelism: of the
    epoch's batches (the same list in every process: they are seeded alike), process ``rank`` of
    ``world`` takes every ``world``-th, starting at its rank, after the last few batches are dropped
    so that every process has the same number (each optimizer step needs every process)."""

    def __init__(self, inner: ResumableBatchSampler, rank: int, world: int, even: bool = True):
        # even=False: keep them all
        self.inner, self.rank, self.world, self.even = inner, rank, world, even

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        super().set_epoch(epoch, start)
        self.inner.set_epoch(epoch, 0)

    def epoch_batches(self) -> list[list[int]]:
        batches = self.inner.epoch_batches()
        if self.even:
            batches = batches[:len(batches) // self.world * self.world]
        return batches[self.rank::self.world]


class LengthGroupedBatchSampler(ResumableBatchSampler):
    """Fixed-size batches of similar duration, so padding stays small.

    Each epoch (seeded by ``seed + epoch``) the utterances are shuffled, cut into pools of
    ``pool_batches`` batches, sorted by duration inside each pool and batched; then the batches are
    shuffled. Without ``shuffle`` the batches go shortest first. ``load_state_dict`` restarts an
    epoch after the batches already consumed, which is what a mid-epoch resume needs.
    """

    def __init__(
        self,
        durations: Sequence[float],
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        pool_batches: int = 50,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.durations = list(durations)
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.pool_batches = pool_batches

    def epoch_batches(self) -> list[list[int]]:
        order = list(range(len(self.durations)))
        if not self.shuffle:
            order.sort(key=self.durations.__getitem__)
            return [order[i:i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        rng = random.Random(self.seed + self.epoch)
        rng.shuffle(order)
        pool = self.batch_size * self.pool_batches
        batches = []
        for p in range(0, len(order), pool):
            chunk = sorted(order[p:p + pool], key=self.durations.__getitem__)
            batches += [chunk[i:i + self.batch_size] for i in range(0, len(chunk), self.batch_size)]
        rng.shuffle(batches)
        return batches

    def __len__(self) -> int:  # without building the epoch's batches
        return max(0, -(-len(self.durations) // self.batch_size) - self.start)


class DurationBucketSampler(ResumableBatchSampler):
    """Batches of at most ``max_frames`` padded frames (utterances x longest utterance).

    Each epoch (seeded by ``seed + epoch``) the utterances are sorted by duration (ties in a
    seeded random order) and cut into ``num_buckets`` buckets of equal count; each bucket is
    shuffled and cut greedily into batches (its utterances are alike in length, so padding stays
    small); then all batches are shuffled across buckets. ``fits(n, frames)``, when given, is a
    further cap (the memory estimator's). In the first epoch, with ``worst_first``, the
    ``worst_first`` largest batches go first, so that running out of memory shows at the start.

    Same resume interface as ``LengthGroupedBatchSampler``: ``set_epoch(epoch, start)`` skips the
    batches already consumed; ``state_dict``/``load_state_dict``.
    """

    def __init__(
        self,
        durations: Sequence[float],
        max_frames: int,
        seed: int = 0,
        num_buckets: int = 10,
        shuffle: bool = True,
        fits: Optional[Callable[[int, int], bool]] = None,
        pad_to_frames: int = 0,
    ):
        if max_frames < 1:
            raise ValueError(f"max_frames must be >= 1, got {max_frames}")
        if num_buckets < 1:
            raise ValueError(f"num_buckets must be >= 1, got {num_buckets}")
        self.frames = [frames_of(d) for d in durations]
        # what a batch of each utterance is padded to (--pad_to_frames), for the budget
        self.padded = [padded_frames(f, pad_to_frames) for f in self.frames]
        self.max_frames = max_frames
        self.seed = seed
        self.num_buckets = num_buckets
        self.shuffle = shuffle
        self.fits = fits
        self._cache: tuple[int, list[list[int]]] | None = None

    def _cut(self, order: list[int]) -> list[list[int]]:
        return cut_batches(order, self.padded, self.max_frames, self.fits)

    def epoch_batches(self) -> list[list[int]]:
        if self._cache is not None and self._cache[0] == self.epoch:
            return self._cache[1]
        key = self.frames.__getitem__
        if not self.shuffle:
            batches = self._cut(sorted(range(len(self.frames)), key=key))
        else:
            rng = random.Random(self.seed + self.epoch)
            order = list(range(len(self.frames)))
            rng.shuffle(order)
            order.sort(key=key)  # stable: equal durations stay in shuffled order
            size = -(-len(order) // self.num_buckets)
            batches = []
            for b in range(0, len(order), size):
                bucket = order[b:b + size]
                rng.shuffle(bucket)
                batches += self._cut(bucket)
            rng.shuffle(batches)
        self._cache = (self.epoch, batches)
        return batches


class _Reordered(ResumableBatchSampler):
    """A wrapper that gives the batches of an inner batch sampler, reordered in some epochs
    (``_reorder``): the same batches, so as many as the inner sampler's."""

    def __init__(self, inner: ResumableBatchSampler, durations: Sequence[float]):
        self.inner = inner
        self.frames = [frames_of(d) for d in durations]

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        super().set_epoch(epoch, start)
        self.inner.set_epoch(epoch, 0)

    def epoch_batches(self) -> list[list[int]]:
        return self._reorder(self.inner.epoch_batches())

    def _reorder(self, batches: list[list[int]]) -> list[list[int]]:
        raise NotImplementedError

    def __len__(self) -> int:  # as many batches as the inner sampler's
        return max(0, len(self.inner) - self.start)


class PreflightSampler(_Reordered):
    """Wraps a batch sampler so that its first epoch starts with its ``count`` largest batches
    (utterances x longest frames, longest first), the worst case for memory: an out-of-memory
    error then shows in the first minute, not hours in. Other epochs are left as they are."""

    def __init__(self, inner: ResumableBatchSampler, durations: Sequence[float], count: int):
        super().__init__(inner, durations)
        self.count = count

    def _reorder(self, batches: list[list[int]]) -> list[list[int]]:
        if self.epoch != 0 or self.count <= 0:
            return batches
        ranked = sorted(
            range(len(batches)),
            key=lambda b: -len(batches[b]) * max(self.frames[i] for i in batches[b]),
        )
        first = ranked[:self.count]
        chosen = set(first)
        return [batches[b] for b in first] + [
            batch for b, batch in enumerate(batches) if b not in chosen
        ]


class LengthCurriculum(_Reordered):
    """Wraps a batch sampler so that its first ``epochs`` epochs take the same batches shortest
    first (by each batch's longest utterance; ties in the inner sampler's order): a length
    curriculum (SortaGrad), easy short utterances while the model knows nothing. Later epochs are
    left as they are. The order is a pure function of the epoch, so a resume continues it."""

    def __init__(self, inner: ResumableBatchSampler, durations: Sequence[float], epochs: int):
        super().__init__(inner, durations)
        self.epochs = epochs

    def _reorder(self, batches: list[list[int]]) -> list[list[int]]:
        if self.epoch >= self.epochs:
            return batches
        return sorted(batches, key=lambda batch: max(self.frames[i] for i in batch))


class WeightedMix(ResumableBatchSampler):
    """The batches of several training sets mixed by weight, an epoch at a time. ``sources[i]`` is
    utterance ``i``'s set; an epoch draws from set ``s`` ``round(N * weights[s] /
    sum(weights))`` utterances, ``N`` all of theirs, reading on through the set in seeded rounds
    (each a shuffle of it): a set drawn less than its size shows the rest of itself in the next
    epochs, one drawn more repeats itself only after it has shown all. The drawn utterances are
    batched by ``batcher(durations)`` (a bucketing sampler over them), so a batch mixes sets of
    one length. A pure function of ``seed`` and the epoch: a resumed epoch is the unbroken
    one's."""

    def __init__(self, durations: Sequence[float], sources: Sequence[int],
                 weights: Sequence[float],
                 batcher: Callable[[list[float]], ResumableBatchSampler], seed: int = 0):
        if len(sources) != len(durations) or not weights or min(weights) <= 0:
            raise ValueError("WeightedMix: a set for every utterance and a positive weight each")
        self.durations, self.seed, self.batcher = list(durations), seed, batcher
        self.members = [[i for i, s in enumerate(sources) if s == k] for k in range(len(weights))]
        if not all(self.members):
            raise ValueError("WeightedMix: every set needs an utterance")
        total = sum(weights)
        self.counts = [max(1, round(len(self.durations) * w / total)) for w in weights]
        self._cache: tuple[int, list[list[int]]] | None = None

    def drawn(self, epoch: int) -> list[int]:
        """The utterances epoch ``epoch`` draws, set by set."""
        out = []
        for k, (members, count) in enumerate(zip(self.members, self.counts)):
            first = epoch * count  # where this epoch starts in the set's endless rounds
            for n in range(first // len(members), (first + count - 1) // len(members) + 1):
                order = list(members)
                random.Random(f"{self.seed}:{k}:{n}").shuffle(order)
                lo = max(first - n * len(members), 0)
                hi = min(first + count - n * len(members), len(members))
                out += order[lo:hi]
        return out

    def epoch_batches(self) -> list[list[int]]:
        if self._cache is not None and self._cache[0] == self.epoch:
            return self._cache[1]
        drawn = self.drawn(self.epoch)
        inner = self.batcher([self.durations[i] for i in drawn])
        inner.set_epoch(self.epoch)
        batches = [[drawn[p] for p in batch] for batch in inner.epoch_batches()]
        self._cache = (self.epoch, batches)
        return batches


def cut_batches(order: Sequence[int], frames: Sequence[int], max_frames: int,
                fits: Optional[Callable[[int, int], bool]] = None) -> list[list[int]]:
    """Greedy batches of the utterances in ``order`` (``frames`` long each) of at most
    ``max_frames`` padded frames (utterances x longest), and ``fits(n, longest)`` when given; an
    utterance over the
    budget on its own goes alone."""
    batches, batch, longest = [], [], 0
    for i in order:
        grown = max(longest, frames[i])
        if batch and not (
            (len(batch) + 1) * grown <= max_frames and (fits is None or fits(len(batch) + 1, grown))
        ):
            batches.append(batch)
            batch, longest = [], 0
        batch.append(i)
        longest = max(longest, frames[i])
    if batch:
        batches.append(batch)
    return batches


def train_sampler(
    durations: Sequence[float],
    batch_size: int,
    max_frames: int,
    seed: int,
    num_buckets: int,
    fits: Optional[Callable[[int, int], bool]] = None,
    preflight: int = 0,
    rank: int = 0,
    world: int = 1,
    curriculum_epochs: int = 0,
    mix: Optional[tuple[Sequence[int], Sequence[float]]] = None,
    pad_to_frames: int = 0,
) -> ResumableBatchSampler:
    """The training batches: duration-bucketed under a frame budget (``max_frames``; ``fits`` a
    further cap, the memory estimator's) or ``batch_size`` utterances of similar length; with
    ``mix`` (each utterance's set, each set's weight), of an epoch's weighted draw of the sets
    (``WeightedMix``); shortest first in the first ``curriculum_epochs`` epochs; the ``preflight``
    largest first in the first epoch; process ``rank``'s share of them when ``world`` > 1. A
    frame budget counts each batch's frames as ``pad_to_frames`` pads them.
    """
    def batcher(lengths: Sequence[float]) -> ResumableBatchSampler:
        if max_frames or fits is not None:
            return DurationBucketSampler(lengths, max_frames or 10**9, seed=seed,
                                         num_buckets=num_buckets, fits=fits,
                                         pad_to_frames=pad_to_frames)
        return LengthGroupedBatchSampler(lengths, batch_size, seed=seed)

    sampler = (batcher(durations) if mix is None
               else WeightedMix(durations, mix[0], mix[1], batcher, seed))
    if curriculum_epochs > 0:
        sampler = LengthCurriculum(sampler, durations, curriculum_epochs)
    if preflight > 0:
        sampler = PreflightSampler(sampler, durations, preflight)
    return ShardedSampler(sampler, rank, world) if world > 1 else sampler


def padding_fraction(batches: Sequence[Sequence[int]], frames: Sequence[int],
                     pad_to_frames: int = 0) -> float:
    """Share of the padded frames of ``batches`` that are padding, each batch padded to its
    longest utterance (and that to a multiple of ``pad_to_frames``, ``padded_frames``)."""
    real = sum(frames[i] for batch in batches for i in batch)
    padded = sum(len(batch) * padded_frames(max(frames[i] for i in batch), pad_to_frames)
                 for batch in batches)
    return 1.0 - real / padded if padded else 0.0


def split_batch(batch: Batch) -> tuple[Batch, Batch]:
    """Two halves of a batch (of at least 2 utterances), each trimmed to its own longest
    utterance."""
    if len(batch) < 2:
        raise ValueError("a batch of one utterance cannot be split")
    half = len(batch) // 2

    def part(sl: slice) -> Batch:
        audio_lens, token_lens = batch.audio_lens[sl], batch.token_lens[sl]
        return Batch(
            batch.audio[sl, : int(audio_lens.max())],
            audio_lens,
            batch.tokens[sl, : int(token_lens.max())],
            token_lens,
            batch.indices[sl],
            vtlp=None if batch.vtlp is None else batch.vtlp[sl],
        )

    return part(slice(0, half)), part(slice(half, None))


def select_samples(n_total: int, max_samples: int, seed: int) -> list[int]:
    """Positions of a seeded random choice of ``max_samples`` of ``n_total`` utterances (all when
    ``max_samples`` is 0 or more than there are), in manifest order. A larger ``max_samples``
    keeps every utterance a smaller one chose: the set only grows."""
    if max_samples <= 0 or max_samples >= n_total:
        return list(range(n_total))
    order = list(range(n_total))
    random.Random(seed).shuffle(order)
    return sorted(order[:max_samples])
