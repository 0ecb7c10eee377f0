"""Manifests, the dataset, length-grouped batches and collation.

A manifest is NeMo-style JSON lines: ``audio_filepath`` (absolute or relative to the manifest's
folder), ``duration`` (seconds) and ``text``; other keys are kept and ignored.
"""
from __future__ import annotations

import json
import logging
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, NamedTuple, Optional, Sequence

import soundfile as sf
import torch
from torch.utils.data import Dataset, Sampler

from .audio import HOP_LENGTH, SAMPLE_RATE, LogMel, load_audio
from .masks import subsampled_lengths
from .tokenizer import Tokenizer

__all__ = ["ManifestError", "Utterance", "read_manifest", "load_utterances", "ASRDataset", "Batch", "collate",
           "LengthGroupedBatchSampler"]

log = logging.getLogger("konkanivani")

_MAX_ROW_WARNINGS = 20


class ManifestError(ValueError):
    """A manifest that cannot be used at all (missing file, a line that is not a JSON object)."""


@dataclass
class Utterance:
    audio_path: Path
    duration: float
    text: str
    tokens: list[int]
    where: str  # "manifest.jsonl:LINE", for messages


def read_manifest(path: str | Path) -> list[tuple[int, dict]]:
    """``(line number, row)`` for every non-blank line. Raises ``ManifestError`` naming the file and
    line when the file is missing or a line is not UTF-8 JSON holding an object."""
    path = Path(path)
    if not path.is_file():
        raise ManifestError(f"manifest {path} does not exist")
    rows = []
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8").strip()  # a BOM may open the file
                if not line:
                    continue
                row = json.loads(line)
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ManifestError(f"{path}:{line_no}: not a JSON line ({e}); a manifest holds one JSON object a line "
                                    '{"audio_filepath": ..., "duration": ..., "text": ...}') from None
            if not isinstance(row, dict):
                raise ManifestError(f"{path}:{line_no}: expected a JSON object, got {type(row).__name__}")
            rows.append((line_no, row))
    return rows


def load_utterances(path: str | Path, tokenizer: Tokenizer, max_duration: float = float("inf"),
                    ) -> tuple[list[Utterance], Counter]:
    """Read and check a manifest; return the usable utterances and a count of skipped rows by reason.

    A row is skipped, with a warning naming the manifest and line, when its audio is missing or
    unreadable, its text is empty or leaves no token after normalization, it is longer than
    ``max_duration``, or it is too short for CTC (fewer frames after 4x subsampling than tokens).
    """
    path = Path(path)
    utterances, skipped = [], Counter()

    def skip(where: str, reason: str, detail: str = "") -> None:
        skipped[reason] += 1
        if sum(skipped.values()) <= _MAX_ROW_WARNINGS:
            log.warning("skipping %s: %s%s", where, reason, f" ({detail})" if detail else "")

    for line_no, row in read_manifest(path):
        where = f"{path}:{line_no}"
        audio, text = row.get("audio_filepath"), row.get("text")
        if not isinstance(audio, str) or not audio:
            skip(where, "no audio_filepath")
            continue
        if not isinstance(text, str) or not text.strip():
            skip(where, "empty text")
            continue
        audio_path = Path(audio) if Path(audio).is_absolute() else path.parent / audio
        if not audio_path.is_file():
            skip(where, "audio file missing", str(audio_path))
            continue
        try:
            info = sf.info(str(audio_path))
            duration = info.frames / info.samplerate
        except Exception as e:
            skip(where, "audio unreadable", f"{audio_path}: {e}")
            continue
        if duration <= 0:
            skip(where, "audio empty", str(audio_path))
            continue
        if duration > max_duration:
            skip(where, "longer than max_duration", f"{duration:.1f} s")
            continue
        tokens = tokenizer.encode(text)
        if not tokens:
            skip(where, "no token after normalization")
            continue
        frames = torch.tensor(1 + int(duration * SAMPLE_RATE) // HOP_LENGTH)
        if int(subsampled_lengths(frames)) < len(tokens):
            skip(where, "too short for CTC", f"{duration:.2f} s for {len(tokens)} tokens")
            continue
        utterances.append(Utterance(audio_path, duration, text, tokens, where))
    total = sum(skipped.values())
    if total > _MAX_ROW_WARNINGS:
        log.warning("... %d more rows of %s skipped", total - _MAX_ROW_WARNINGS, path)
    return utterances, skipped


class Example(NamedTuple):
    feats: torch.Tensor  # (T, F)
    tokens: torch.Tensor  # (U,)
    index: int


class ASRDataset(Dataset):
    """Utterances -> (log-mel features, token ids). A file that fails to decode yields None (and a
    warning); ``collate`` drops it, so a corrupt file never stops an epoch."""

    def __init__(self, utterances: Sequence[Utterance], n_mels: int = 80):
        self.utterances = list(utterances)
        self.log_mel = LogMel(n_mels)

    def __len__(self) -> int:
        return len(self.utterances)

    def __getitem__(self, index: int) -> Optional[Example]:
        utt = self.utterances[index]
        try:
            wav = load_audio(utt.audio_path)
        except RuntimeError as e:
            log.warning("%s: %s; skipped in this batch", utt.where, e)
            return None
        return Example(self.log_mel(wav), torch.tensor(utt.tokens, dtype=torch.long), index)


class Batch(NamedTuple):
    feats: torch.Tensor  # (B, T, F), zero-padded
    feat_lens: torch.Tensor  # (B,)
    tokens: torch.Tensor  # (B, U), padded with -1
    token_lens: torch.Tensor  # (B,)
    indices: list[int]  # positions in the dataset, to name utterances in messages

    def to(self, device: torch.device | str) -> "Batch":
        nb = torch.device(device).type == "cuda"
        return Batch(self.feats.to(device, non_blocking=nb), self.feat_lens.to(device),
                     self.tokens.to(device, non_blocking=nb), self.token_lens.to(device), self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def collate(examples: Sequence[Optional[Example]]) -> Optional[Batch]:
    examples = [e for e in examples if e is not None]
    if not examples:
        return None
    feats = torch.nn.utils.rnn.pad_sequence([e.feats for e in examples], batch_first=True)
    tokens = torch.nn.utils.rnn.pad_sequence([e.tokens for e in examples], batch_first=True, padding_value=-1)
    return Batch(feats, torch.tensor([len(e.feats) for e in examples]), tokens,
                 torch.tensor([len(e.tokens) for e in examples]), [e.index for e in examples])


class LengthGroupedBatchSampler(Sampler[list[int]]):
    """Fixed-size batches of similar duration, so padding stays small.

    Each epoch (seeded by ``seed + epoch``) the utterances are shuffled, cut into pools of
    ``pool_batches`` batches, sorted by duration inside each pool and batched; then the batches are
    shuffled. Without ``shuffle`` the batches go shortest first. ``load_state_dict`` restarts an
    epoch after the batches already consumed, which is what a mid-epoch resume needs.
    """

    def __init__(self, durations: Sequence[float], batch_size: int, seed: int = 0, shuffle: bool = True,
                 pool_batches: int = 50):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.durations = list(durations)
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.pool_batches = pool_batches
        self.epoch = 0
        self.start = 0  # batches of this epoch to skip

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "start": self.start}

    def load_state_dict(self, state: dict) -> None:
        self.set_epoch(state["epoch"], state["start"])

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

    def __iter__(self) -> Iterator[list[int]]:
        yield from self.epoch_batches()[self.start:]

    def __len__(self) -> int:
        return max(0, -(-len(self.durations) // self.batch_size) - self.start)
