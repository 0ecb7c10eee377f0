"""The dataset: a manifest's usable rows as utterances (``load_utterances``), CMVN statistics,
examples as log-mel features, and their collation into padded batches."""
from __future__ import annotations

import logging
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, NamedTuple, Sequence

import torch
from torch.utils.data import Dataset

from .audio import load_audio
from .augment import Augmenter, vtlp_warp_matrix
from .features import LogMel
from .manifest import DEFAULT_DURATION_TOLERANCE, check_row, read_manifest
from .tokenizer import Tokenizer

__all__ = ["Utterance", "load_utterances", "log_skipped", "compute_cmvn", "cmvn_of", "ASRDataset", "Example",
           "Unreadable", "Batch", "collate"]

log = logging.getLogger("konkanivani")

_MAX_ROW_WARNINGS = 20


@dataclass
class Utterance:
    audio_path: Path
    duration: float
    text: str
    tokens: list[int]
    where: str  # "manifest.jsonl:LINE", for messages


def load_utterances(path: str | Path, tokenizer: Tokenizer, max_duration: float = float("inf"),
                    duration_tolerance: float = DEFAULT_DURATION_TOLERANCE) -> tuple[list[Utterance], Counter]:
    """Read and check a manifest; return the usable utterances and a count of skipped rows by reason.

    Each row goes through ``checks.check_row`` (audio missing, unreadable or empty, duration
    mismatch, longer than ``max_duration``, empty text or no token, characters the tokenizer
    cannot encode, too short for CTC); a failing row is skipped with a warning naming the
    manifest and line. Rows that will be resampled or mixed down are counted in one note.
    """
    path = Path(path)
    utterances, skipped, converted = [], Counter(), Counter()
    for line_no, row in read_manifest(path):
        where = f"{path}:{line_no}"
        check = check_row(row, path.parent, tokenizer, max_duration=max_duration,
                          duration_tolerance=duration_tolerance)
        if check.error is not None:
            reason, detail = check.error
            skipped[reason] += 1
            if sum(skipped.values()) <= _MAX_ROW_WARNINGS:
                log.warning("skipping %s: %s%s", where, reason, f" ({detail})" if detail else "")
            continue
        converted.update(reason for reason, _ in check.warnings)
        utterances.append(Utterance(check.audio_path, check.duration, check.text, check.tokens, where))
    total = sum(skipped.values())
    if total > _MAX_ROW_WARNINGS:
        log.warning("... %d more rows of %s skipped", total - _MAX_ROW_WARNINGS, path)
    if converted:
        log.info("%s: audio converted to 16 kHz mono when loaded (rows %s)", path,
                 ", ".join(f"{reason}: {n}" for reason, n in converted.items()))
    return utterances, skipped


def log_skipped(name: str, path: str | Path, kept: int, skipped: Counter) -> None:
    """One summary line of a manifest as ``load_utterances`` read it."""
    if skipped:
        reasons = ", ".join(f"{n} {reason}" for reason, n in skipped.most_common())
        log.warning("%s manifest %s: %d utterances, %d rows skipped (%s)", name, path, kept,
                    sum(skipped.values()), reasons)
    else:
        log.info("%s manifest %s: %d utterances", name, path, kept)


def compute_cmvn(utterances: Sequence[Utterance], n_mels: int, max_utterances: int = 500,
                 seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Global mean and standard deviation of log-mel features over (a seeded sample of) the training set."""
    sample = random.Random(seed).sample(list(utterances), min(max_utterances, len(utterances)))

    def waveforms() -> Iterator[torch.Tensor]:
        for utt in sample:
            try:
                yield load_audio(utt.audio_path)
            except RuntimeError as e:
                log.warning("%s: %s; left out of CMVN", utt.where, e)

    return cmvn_of(waveforms(), n_mels)


def cmvn_of(waveforms: Iterable[torch.Tensor], n_mels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and standard deviation per mel bin of the log-mel features of ``waveforms``."""
    log_mel = LogMel(n_mels)
    total, total_sq, frames = torch.zeros(n_mels, dtype=torch.float64), torch.zeros(n_mels, dtype=torch.float64), 0
    for wav in waveforms:
        feats = log_mel(wav).double()  # (T, F)
        total += feats.sum(0)
        total_sq += (feats ** 2).sum(0)
        frames += feats.shape[0]
    if frames == 0:
        raise RuntimeError("no training audio could be read to compute feature statistics")
    mean = total / frames
    std = (total_sq / frames - mean ** 2).clamp_min(1e-10).sqrt()
    return mean.float(), std.float()


class Example(NamedTuple):
    feats: torch.Tensor  # (T, F)
    tokens: torch.Tensor  # (U,)
    index: int


class Unreadable(NamedTuple):
    """An utterance whose audio failed to decode when its batch was loaded."""
    index: int


class ASRDataset(Dataset):
    """Utterances -> (log-mel features, token ids). A file that fails to decode yields
    ``Unreadable`` (and a warning); ``collate`` leaves it out of the batch and names it in
    ``Batch.missing``, so a corrupt file never stops an epoch.

    With an ``augment``er (training only) the key is ``(epoch, index)``, as ``EpochKeyed`` yields
    them: the augmentation draws depend on both, and on nothing else. A plain index is epoch 0.
    """

    def __init__(self, utterances: Sequence[Utterance], n_mels: int = 80, augment: Augmenter | None = None):
        self.utterances = list(utterances)
        self.log_mel = LogMel(n_mels)
        self.augment = augment

    def __len__(self) -> int:
        return len(self.utterances)

    def __getitem__(self, key: int | tuple[int, int]) -> Example | Unreadable:
        epoch, index = key if isinstance(key, tuple) else (0, key)
        utt = self.utterances[index]
        try:
            wav = load_audio(utt.audio_path)
        except RuntimeError as e:
            log.warning("%s: %s; skipped in this batch", utt.where, e)
            return Unreadable(index)
        return self.example(wav, utt.tokens, epoch, index)

    def example(self, wav: torch.Tensor, tokens: Sequence[int], epoch: int, index: int) -> Example:
        """Utterance ``index``'s waveform as features, augmented (training) as its epoch and index draw."""
        warp = None
        if self.augment is not None:
            wav = self.augment.waveform(wav, epoch, index, min_encoder_frames=len(tokens))
            alpha = self.augment.vtlp_alpha(epoch, index)
            warp = None if alpha is None else vtlp_warp_matrix(alpha, self.log_mel.n_freqs)
        return Example(self.log_mel(wav, warp), torch.tensor(tokens, dtype=torch.long), index)


class Batch(NamedTuple):
    feats: torch.Tensor  # (B, T, F), zero-padded
    feat_lens: torch.Tensor  # (B,)
    tokens: torch.Tensor  # (B, U), padded with -1
    token_lens: torch.Tensor  # (B,)
    indices: list[int]  # positions in the dataset, to name utterances in messages
    missing: tuple[int, ...] = ()  # positions of the batch's utterances whose audio could not be read

    def to(self, device: torch.device | str) -> "Batch":
        nb = torch.device(device).type == "cuda"
        return Batch(self.feats.to(device, non_blocking=nb), self.feat_lens.to(device),
                     self.tokens.to(device, non_blocking=nb), self.token_lens.to(device), self.indices, self.missing)

    def __len__(self) -> int:
        return len(self.indices)


def collate(examples: Sequence[Example | Unreadable]) -> Batch:
    """Pad the readable examples into a batch (empty, ``len(batch) == 0``, when none is) and name
    the unreadable ones in ``missing``."""
    missing = tuple(e.index for e in examples if isinstance(e, Unreadable))
    examples = [e for e in examples if isinstance(e, Example)]
    if not examples:
        return Batch(torch.zeros(0, 0, 0), torch.zeros(0, dtype=torch.long), torch.zeros(0, 0, dtype=torch.long),
                     torch.zeros(0, dtype=torch.long), [], missing)
    feats = torch.nn.utils.rnn.pad_sequence([e.feats for e in examples], batch_first=True)
    tokens = torch.nn.utils.rnn.pad_sequence([e.tokens for e in examples], batch_first=True, padding_value=-1)
    return Batch(feats, torch.tensor([len(e.feats) for e in examples]), tokens,
                 torch.tensor([len(e.tokens) for e in examples]), [e.index for e in examples], missing)
