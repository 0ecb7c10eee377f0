"""From a checkpoint to text: the model, its tokenizer and features, and batched decoding.

A checkpoint carries everything needed (model shape, weights with CMVN statistics, tokenizer),
so ``Recognizer.from_checkpoint(path)`` is all a user needs. A run trained with ``--ema_decay``
decodes with its moving average of the weights (``inference_state_dict``).
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .audio import LogMel, load_audio
from .checkpoint import CheckpointError, inference_state_dict, load_checkpoint
from .checks import resolve_audio_path
from .config import ModelConfig
from .data import read_manifest
from .decode import DEFAULT_CTC_WEIGHT, METHODS, decode_batch
from .frames import SAMPLE_RATE
from .model import ASRModel
from .tokenizer import Tokenizer

__all__ = ["AUDIO_SUFFIXES", "Recognizer", "Transcript", "find_audio"]

log = logging.getLogger("konkanivani")

AUDIO_SUFFIXES = (".wav", ".flac", ".ogg", ".opus", ".mp3", ".aiff", ".aif", ".au")


@dataclass
class Transcript:
    audio_filepath: str
    text: str
    duration: float  # seconds of audio
    error: str | None = None  # why the file could not be transcribed


class Recognizer:
    """Examples:
        >>> rec = Recognizer.from_checkpoint("checkpoints/run/best.pt")  # doctest: +SKIP
        >>> rec.transcribe(["a.wav", "b.flac"], method="joint")  # doctest: +SKIP
    """

    def __init__(self, model: ASRModel, tokenizer: Tokenizer, device: torch.device):
        self.model = model.to(device).eval()
        self.tokenizer = tokenizer
        self.device = device
        self.log_mel = LogMel(model.cfg.n_mels)

    @classmethod
    def from_checkpoint(cls, path: str | Path, device: str | torch.device = "cpu") -> Recognizer:
        state = load_checkpoint(path)
        try:
            cfg = ModelConfig.from_dict(state["model_config"])
            model = ASRModel(cfg)
            model.load_state_dict(inference_state_dict(state))
            tokenizer = Tokenizer(state["tokenizer"])
        except (KeyError, TypeError, RuntimeError, ValueError) as e:
            raise CheckpointError(f"{path}: the checkpoint does not hold a usable model ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0] if str(e) else e})") from e
        return cls(model, tokenizer, torch.device(device))

    def decode_waveforms(self, wavs: Sequence[torch.Tensor], method: str = "greedy", beam_size: int = 10,
                         ctc_weight: float = DEFAULT_CTC_WEIGHT) -> list[str]:
        """Texts of 16 kHz mono waveforms, decoded as one batch."""
        feats = [self.log_mel(w) for w in wavs]
        lens = torch.tensor([len(f) for f in feats], device=self.device)
        padded = torch.nn.utils.rnn.pad_sequence(feats, batch_first=True).to(self.device)
        ids = decode_batch(self.model, padded, lens, method, beam_size, ctc_weight)
        return [self.tokenizer.decode(h) for h in ids]

    def transcribe(self, paths: Iterable[str | Path], method: str = "greedy", beam_size: int = 10,
                   ctc_weight: float = DEFAULT_CTC_WEIGHT, batch_size: int = 8) -> Iterator[Transcript]:
        """Transcripts in the order of ``paths``. Files are read a few batches at a time and batched
        by length. A file that cannot be read yields a ``Transcript`` with ``error`` set, and the
        others are still decoded."""
        if method not in METHODS:
            raise ValueError(f"unknown decoding method {method!r}; choose from {', '.join(METHODS)}")
        paths = list(paths)
        window = 8 * batch_size
        for first in range(0, len(paths), window):
            yield from self._transcribe_window(paths[first:first + window], method, beam_size, ctc_weight,
                                               batch_size)

    def _transcribe_window(self, paths: list[str | Path], method: str, beam_size: int, ctc_weight: float,
                           batch_size: int) -> Iterator[Transcript]:
        wavs: list[torch.Tensor | None] = []
        errors: list[str | None] = []
        for p in paths:
            try:
                wavs.append(load_audio(p))
                errors.append(None)
            except RuntimeError as e:  # the caller names it (Transcript.error), once
                wavs.append(None)
                errors.append(str(e))
        texts: dict[int, str] = {}
        readable = sorted((i for i, w in enumerate(wavs) if w is not None), key=lambda i: -len(wavs[i]))
        for start in range(0, len(readable), batch_size):
            chunk = readable[start:start + batch_size]
            decoded = self.decode_waveforms([wavs[i] for i in chunk], method, beam_size, ctc_weight)
            texts.update(zip(chunk, decoded))
        for i, path in enumerate(paths):
            duration = 0.0 if wavs[i] is None else len(wavs[i]) / SAMPLE_RATE
            yield Transcript(str(path), texts.get(i, ""), duration, errors[i])


def find_audio(inputs: Sequence[str | Path]) -> list[tuple[Path, dict]]:
    """Expand command-line inputs into ``(audio path, manifest row or {})``: audio files as given,
    folders searched recursively for audio files, ``.json``/``.jsonl`` files read as manifests
    (relative paths are relative to the manifest)."""
    found: list[tuple[Path, dict]] = []
    for item in map(Path, inputs):
        if item.is_dir():
            found += [(p, {}) for p in sorted(item.rglob("*")) if p.suffix.lower() in AUDIO_SUFFIXES]
        elif item.suffix.lower() in (".json", ".jsonl"):
            for line_no, row in read_manifest(item):
                audio = row.get("audio_filepath")
                if not isinstance(audio, str) or not audio:
                    log.warning("%s:%d: no audio_filepath; skipped", item, line_no)
                    continue
                found.append((resolve_audio_path(audio, item.parent), {**row, "where": f"{item}:{line_no}"}))
        else:
            found.append((item, {}))
    return found
