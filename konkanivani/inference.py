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
from .decode import DEFAULT_CTC_WEIGHT, FUSED_METHODS, METHODS, Fusion, decode_batch
from .frames import SAMPLE_RATE
from .lm import TransformerLM, check_same_vocabulary, load_lm
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
        >>> rec = Recognizer.from_checkpoint("checkpoints/run/best.pt", lm="checkpoints/lm/best.pt")  # doctest: +SKIP
        >>> rec.transcribe(["a.wav"], method="joint", lm_weight=0.3, length_bonus=0.5)  # doctest: +SKIP
    """

    def __init__(self, model: ASRModel, tokenizer: Tokenizer, device: torch.device,
                 lm: TransformerLM | None = None):
        self.model = model.to(device).eval()
        self.tokenizer = tokenizer
        self.device = device
        self.log_mel = LogMel(model.cfg.n_mels)
        self.lm = None if lm is None else lm.to(device).eval()

    @classmethod
    def from_checkpoint(cls, path: str | Path, device: str | torch.device = "cpu",
                        lm: str | Path | None = None) -> Recognizer:
        """The recognizer of an ASR checkpoint, with the language model of ``lm`` (a
        ``konkanivani-train-lm`` checkpoint of the same tokenizer) for shallow fusion."""
        rec = cls._from_checkpoint(path, device)
        if lm is not None:
            rec.attach_lm(lm, path)
        return rec

    def attach_lm(self, lm_path: str | Path, asr_name: str | Path = "the recognizer") -> None:
        """Load the LM of ``lm_path`` for fusion; ``CheckpointError`` in one line, naming both files,
        when its vocabulary is not this recognizer's."""
        lm, lm_tokenizer = load_lm(lm_path, self.device)
        check_same_vocabulary(lm_tokenizer, lm_path, self.tokenizer, asr_name)
        self.lm = lm

    def fusion(self, method: str, lm_weight: float = 0.0, length_bonus: float = 0.0) -> Fusion | None:
        """The fusion settings of a decoding call; ``ValueError`` for ones that cannot apply."""
        if lm_weight and self.lm is None:
            raise ValueError("lm_weight needs a language model (Recognizer.from_checkpoint(..., lm=...))")
        if method not in FUSED_METHODS:
            if lm_weight or length_bonus:
                raise ValueError(f"{method} decoding takes no language model or length bonus; choose from "
                                 f"{', '.join(FUSED_METHODS)}")
            return None
        return Fusion(self.lm if lm_weight else None, lm_weight, length_bonus)  # weight 0: the LM need not run

    @classmethod
    def _from_checkpoint(cls, path: str | Path, device: str | torch.device) -> Recognizer:
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
                         ctc_weight: float = DEFAULT_CTC_WEIGHT, lm_weight: float = 0.0,
                         length_bonus: float = 0.0) -> list[str]:
        """Texts of 16 kHz mono waveforms, decoded as one batch."""
        fusion = self.fusion(method, lm_weight, length_bonus)
        feats = [self.log_mel(w) for w in wavs]
        lens = torch.tensor([len(f) for f in feats], device=self.device)
        padded = torch.nn.utils.rnn.pad_sequence(feats, batch_first=True).to(self.device)
        ids = decode_batch(self.model, padded, lens, method, beam_size, ctc_weight, fusion=fusion)
        return [self.tokenizer.decode(h) for h in ids]

    def transcribe(self, paths: Iterable[str | Path], method: str = "greedy", beam_size: int = 10,
                   ctc_weight: float = DEFAULT_CTC_WEIGHT, batch_size: int = 8, lm_weight: float = 0.0,
                   length_bonus: float = 0.0) -> Iterator[Transcript]:
        """Transcripts in the order of ``paths``. Files are read a few batches at a time and batched
        by length. A file that cannot be read yields a ``Transcript`` with ``error`` set, and the
        others are still decoded."""
        if method not in METHODS:
            raise ValueError(f"unknown decoding method {method!r}; choose from {', '.join(METHODS)}")
        self.fusion(method, lm_weight, length_bonus)  # refused here, before any file is read
        paths = list(paths)
        window = 8 * batch_size
        for first in range(0, len(paths), window):
            yield from self._transcribe_window(paths[first:first + window], method, beam_size, ctc_weight,
                                               batch_size, lm_weight, length_bonus)

    def _transcribe_window(self, paths: list[str | Path], method: str, beam_size: int, ctc_weight: float,
                           batch_size: int, lm_weight: float, length_bonus: float) -> Iterator[Transcript]:
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
            decoded = self.decode_waveforms([wavs[i] for i in chunk], method, beam_size, ctc_weight, lm_weight,
                                            length_bonus)
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
