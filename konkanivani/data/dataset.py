"""The dataset: a manifest's usable rows as utterances (``load_utterances``), CMVN statistics,
examples as (augmented) waveforms, and their collation into padded batches of waveforms, whose
features the training step computes on its device (``Batch.features``)."""
from __future__ import annotations

import logging
import math
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from .audio import load_audio
from .augment import Augmenter
from .features import KaldiFbank, LogMel, make_frontend
from .frames import HOP_LENGTH, padded_samples, rounded_up
from .manifest import DEFAULT_DURATION_TOLERANCE, check_row, ctc_frames_needed, read_manifest
from .tokenizer import Tokenizer

__all__ = [
    "Utterance",
    "load_utterances",
    "log_skipped",
    "compute_cmvn",
    "cmvn_of",
    "ASRDataset",
    "Example",
    "Unreadable",
    "Batch",
    "TOKEN_MULTIPLE",
    "collate",
]

log = logging.getLogger("konkanivani")

_MAX_ROW_WARNINGS = 20


@dataclass
class Utterance:
    audio_path: Path
    duration: float
    text: str
    tokens: list[int]
    where: str  # "manifest.jsonl:LINE", for messages
    pseudo: bool = False  # its text is a teacher's (--pseudo_manifest): the noisy student's noise


def load_utterances(
    path: str | Path,
    tokenizer: Optional[Tokenizer],
    max_duration: float = float("inf"),
    duration_tolerance: float = DEFAULT_DURATION_TOLERANCE,
) -> tuple[list[Utterance], Counter]:
    """Read and check a manifest; return the usable utterances and a count of skipped rows by
    reason.

    Each row goes through ``manifest.check_row`` (audio missing, unreadable or empty, duration
    mismatch, longer than ``max_duration``, empty text or no token, characters the tokenizer
    cannot encode, too short for CTC); a failing row is skipped with a warning naming the
    manifest and line. With no ``tokenizer`` the text is not read (audio alone: pretraining).
    Rows that will be resampled or mixed down are counted in one note.
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
        utterances.append(
            Utterance(check.audio_path, check.duration, check.text, check.tokens, where)
        )
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
                 seed: int = 0, frontend: str = "log_mel") -> tuple[torch.Tensor, torch.Tensor]:
    """Global mean and standard deviation of the ``frontend``'s features over (a seeded sample of)
    the training set."""
    sample = random.Random(seed).sample(list(utterances), min(max_utterances, len(utterances)))

    def waveforms() -> Iterator[torch.Tensor]:
        for utt in sample:
            try:
                yield load_audio(utt.audio_path)
            except RuntimeError as e:
                log.warning("%s: %s; left out of CMVN", utt.where, e)

    return cmvn_of(waveforms(), n_mels, frontend)


def cmvn_of(waveforms: Iterable[torch.Tensor], n_mels: int, frontend: str = "log_mel"
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and standard deviation per mel bin of the features of ``waveforms`` (the front-end
    ``frontend``'s, ``ModelConfig.frontend``)."""
    features_of = make_frontend(frontend, n_mels)
    total, total_sq, frames = (
        torch.zeros(n_mels, dtype=torch.float64),
        torch.zeros(n_mels, dtype=torch.float64),
        0,
    )
    for wav in waveforms:
        feats = features_of(wav).double()  # (T, F)
        total += feats.sum(0)
        total_sq += (feats ** 2).sum(0)
        frames += feats.shape[0]
    if frames == 0:
        raise RuntimeError("no training audio could be read to compute feature statistics")
    mean = total / frames
    std = (total_sq / frames - mean ** 2).clamp_min(1e-10).sqrt()
    return mean.float(), std.float()


class Example(NamedTuple):
    audio: torch.Tensor  # (N,) 16 kHz samples, augmented in training
    tokens: torch.Tensor  # (U,)
    index: int
    vtlp: float = math.nan  # the VTLP warp factor its features get (NaN: none)


class Unreadable(NamedTuple):
    """An utterance whose audio failed to decode when its batch was loaded."""
    index: int


class ASRDataset(Dataset):
    """Utterances -> (waveform, token ids): the data workers read and decode audio and apply the
    waveform augmentations; the features are made from the batch on the training device
    (``features.LogMel.batch``, in the training step). A file that fails to decode yields
    ``Unreadable`` (and a warning); ``collate`` leaves it out of the batch and names it in
    ``Batch.missing``, so a corrupt file never stops an epoch.

    With an ``augment``er (training only) the key is ``(epoch, index)``, as ``EpochKeyed`` yields
    them: the augmentation draws depend on both, and on nothing else. A plain index is epoch 0.
    ``pseudo_augment`` further augments the pseudo-labelled utterances (``Utterance.pseudo``): the
    noisy student's stronger augmentation, keyed alike.
    """

    def __init__(self, utterances: Sequence[Utterance], augment: Augmenter | None = None,
                 pseudo_augment: Augmenter | None = None):
        self.utterances = list(utterances)
        self.augment = augment
        self.pseudo_augment = pseudo_augment

    @property
    def augments(self) -> bool:
        """Whether any utterance is augmented: its key then carries the epoch."""
        return self.augment is not None or self.pseudo_augment is not None

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
        return self.example(wav, utt.tokens, epoch, index, utt.pseudo)

    def example(self, wav: torch.Tensor, tokens: Sequence[int], epoch: int, index: int,
                pseudo: bool = False) -> Example:
        """Utterance ``index``'s waveform, augmented (training) as its epoch and index draw (a
        pseudo-labelled one's also by ``pseudo_augment``), with the VTLP factor its features are to
        be warped by."""
        alpha, needed = None, ctc_frames_needed(tokens)
        if self.augment is not None:
            wav = self.augment.waveform(wav, epoch, index, min_encoder_frames=needed)
            alpha = self.augment.vtlp_alpha(epoch, index)
        if pseudo and self.pseudo_augment is not None:
            wav = self.pseudo_augment.waveform(wav, epoch, index, min_encoder_frames=needed)
        return Example(
            wav, torch.tensor(tokens, dtype=torch.long), index, math.nan if alpha is None else alpha
        )


class Batch(NamedTuple):
    """A batch of waveforms and their targets. ``features`` turns the waveforms into log-mel
    features on whatever device the batch is on (the training step's)."""

    audio: torch.Tensor  # (B, N) 16 kHz samples, zero-padded
    audio_lens: torch.Tensor  # (B,) samples
    tokens: torch.Tensor  # (B, U), padded with -1
    token_lens: torch.Tensor  # (B,)
    indices: list[int]  # positions in the dataset, to name utterances in messages
    # positions of the batch's utterances whose audio could not be read
    missing: tuple[int, ...] = ()
    # (B,) VTLP warp factors, NaN where none; None: no utterance warped
    vtlp: Optional[torch.Tensor] = None

    @property
    def feat_lens(self) -> torch.Tensor:
        """``(B,)`` feature frames of the utterances, ``1 + samples // 160``."""
        return 1 + self.audio_lens // HOP_LENGTH

    def features(self, frontend: LogMel | KaldiFbank) -> tuple[torch.Tensor, torch.Tensor]:
        """``(B, T, F)`` features of ``frontend`` (log-mels or Kaldi filterbanks; zero after each
        utterance's frames) and ``(B,)`` frame counts, computed where the batch is."""
        return frontend.batch(self.audio, self.audio_lens, self.vtlp)

    def to(self, device: torch.device | str) -> "Batch":
        """The batch on ``device``; from pinned memory to CUDA without waiting for the copies."""
        nb = torch.device(device).type == "cuda"
        return Batch(
            self.audio.to(device, non_blocking=nb),
            self.audio_lens.to(device, non_blocking=nb),
            self.tokens.to(device, non_blocking=nb),
            self.token_lens.to(device, non_blocking=nb),
            self.indices,
            self.missing,
            None if self.vtlp is None else self.vtlp.to(device, non_blocking=nb),
        )

    def __len__(self) -> int:
        return len(self.indices)


# With --pad_to_frames, a batch's tokens are padded to a multiple of this too.
TOKEN_MULTIPLE = 8


def collate(examples: Sequence[Example | Unreadable], pad_to_frames: int = 0) -> Batch:
    """Pad the readable examples into a batch (empty, ``len(batch) == 0``, when none is) and name
    the unreadable ones in ``missing``. With ``pad_to_frames`` N the audio is padded to
    ``frames.padded_frames`` of its frames (a multiple of N after the first) and the tokens to a
    multiple of ``TOKEN_MULTIPLE``, so that batches take few distinct shapes
    (``--pad_to_frames``)."""
    missing = tuple(e.index for e in examples if isinstance(e, Unreadable))
    examples = [e for e in examples if isinstance(e, Example)]
    if not examples:
        return Batch(
            torch.zeros(0, 0),
            torch.zeros(0, dtype=torch.long),
            torch.zeros(0, 0, dtype=torch.long),
            torch.zeros(0, dtype=torch.long),
            [],
            missing,
        )
    audio = torch.nn.utils.rnn.pad_sequence([e.audio for e in examples], batch_first=True)  # (B, N)
    tokens = torch.nn.utils.rnn.pad_sequence(
        [e.tokens for e in examples], batch_first=True, padding_value=-1
    )
    if pad_to_frames:
        audio = F.pad(audio, (0, padded_samples(audio.shape[1], pad_to_frames) - audio.shape[1]))
        tokens = F.pad(tokens, (0, rounded_up(tokens.shape[1], TOKEN_MULTIPLE) - tokens.shape[1]),
                       value=-1)
    vtlp = (
        torch.tensor([e.vtlp for e in examples])
        if any(not math.isnan(e.vtlp) for e in examples)
        else None
    )
    return Batch(
        audio,
        torch.tensor([len(e.audio) for e in examples]),
        tokens,
        torch.tensor([len(e.tokens) for e in examples]),
        [e.index for e in examples],
        missing,
        vtlp,
    )
