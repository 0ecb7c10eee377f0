"""From a checkpoint to text: the model, its tokenizer and features, and batched decoding.

A checkpoint carries everything needed (model shape, weights with CMVN statistics, tokenizer),
so ``Recognizer.from_checkpoint(path)`` is all a user needs. A run trained with ``--ema_decay``
decodes with its moving average of the weights (``checkpoint.InferenceModel``).

``Recognizer.transcribe`` loses no file to another: a file that cannot be read, is too short for
the encoder, or fails to decode yields a ``Transcript`` with ``error`` set, and a file longer than
``settings.LONG_INPUT_SECONDS`` asked of an attention-based method is decoded with CTC prefix beam
search, said once per call and recorded in ``Transcript.method``.

Each transcript and result has its words with their times and probabilities: the hypothesis aligned
to the CTC log-probabilities of the forward pass that decoded it (``alignment.align_words``), which
the recognizer encodes the batch itself and hands the encoder's output to the search
(``search.decode_encoded``), so nothing is encoded twice.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import soundfile as sf
import torch

from ..checkpoint import CheckpointError, InferenceModel, load_checkpoint
from ..config import ModelConfig
from ..data.audio import AUDIO_SUFFIXES, AudioError, load_audio, read_blocks
from ..data.features import LogMel, make_frontend, min_samples
from ..data.frames import SAMPLE_RATE, frames_of_samples
from ..data.manifest import read_manifest, resolve_audio_path
from ..data.tokenizer import Tokenizer
from ..device import resolve_device
from ..model.asr import ASRModel
from ..model.lm import TransformerLM, check_same_vocabulary, load_lm
from .alignment import Word
from .hotwords import ContextGraph, context_graph
from .search import (
    FUSED_METHODS,
    LONG_INPUT_METHOD,
    LONG_INPUT_SECONDS,
    Fusion,
    ctc_greedy,
    decode_encoded,
    method_for,
)
from .settings import DecodingConfig
from .streaming import (
    Result,
    Stream,
    aligned_results,
    check_sample_rate,
    check_streaming,
    quiet_windows,
)

__all__ = ["MIN_SAMPLES", "Recognizer", "Transcript", "Word", "find_audio"]

log = logging.getLogger("konkanivani")

# The fewest samples a model of the default front-end decodes (LogMel.min_samples); a model's own
# is its front-end's (Recognizer.frontend.min_samples).
MIN_SAMPLES = min_samples(LogMel)
_MAX_NAMED = 5  # files named in the long-input note; the rest counted


@dataclass
class Transcript:
    audio_filepath: str
    text: str
    duration: float  # seconds of audio
    error: str | None = None  # why the file could not be transcribed
    # the method that decoded it: the one asked for, or LONG_INPUT_METHOD for a long file
    method: str = ""
    # its words, with times in seconds from the file's start and probabilities (alignment.Word);
    # empty for no text, and where the hypothesis could not be aligned (alignment.align_tokens)
    words: list[Word] = field(default_factory=list)


class Recognizer:
    """A checkpoint's model and tokenizer, and decoding with them. Each decoding method takes a
    ``DecodingConfig`` (its defaults when None) and keyword overrides of its fields (``settings``).

    Examples:
        >>> rec = Recognizer.from_checkpoint("checkpoints/run/best.pt")  # doctest: +SKIP
        >>> rec.transcribe(["a.wav", "b.flac"], method="joint")  # doctest: +SKIP
        >>> rec.transcribe(["a.wav"], DecodingConfig(method="beam", beam_size=4))  # doctest: +SKIP
        >>> rec = Recognizer.from_checkpoint("checkpoints/run/best.pt",
        ...                                  lm="checkpoints/lm/best.pt")  # doctest: +SKIP
        >>> rec.transcribe(["a.wav"], method="joint", lm_weight=0.3,
        ...                length_bonus=0.5)  # doctest: +SKIP
    """

    def __init__(self, model: ASRModel, tokenizer: Tokenizer, device: torch.device,
                 lm: TransformerLM | None = None):
        self.model = model.to(device).eval()
        self.tokenizer = tokenizer
        self.device = device
        self.frontend = make_frontend(model.cfg.frontend, model.cfg.n_mels)
        self.lm = None if lm is None else lm.to(device).eval()
        self._said: set[str] = set()  # the warnings given: each once

    @classmethod
    def from_checkpoint(cls, path: str | Path, device: str | torch.device = "cpu",
                        lm: str | Path | None = None) -> Recognizer:
        """The recognizer of an ASR checkpoint on ``device`` (``auto``, ``cpu``, ``cuda:1`` ...:
        ``device.resolve_device``), with the language model of ``lm`` (a ``konkanivani-train-lm``
        checkpoint of the same tokenizer) for shallow fusion."""
        rec = cls._from_checkpoint(path, resolve_device(device) if isinstance(device, str)
                                   else device)
        if lm is not None:
            rec.attach_lm(lm, path)
        return rec

    def attach_lm(self, lm_path: str | Path, asr_name: str | Path = "the recognizer") -> None:
        """Load the LM of ``lm_path`` for fusion; ``CheckpointError`` in one line, naming both
        files, when its vocabulary is not this recognizer's."""
        lm, lm_tokenizer = load_lm(lm_path, self.device)
        check_same_vocabulary(lm_tokenizer, lm_path, self.tokenizer, asr_name)
        self.lm = lm

    def settings(self, decoding: DecodingConfig | None = None, *, streams: bool = False,
                 **overrides) -> DecodingConfig:
        """The settings a call decodes with: ``decoding`` with ``overrides``, checked
        (``ConfigError``, a ``ValueError``, in one line) and resolved for a stream (``streams``) or
        whole inputs (``DecodingConfig.resolved``). With a chunk (a stream's, or whole inputs
        encoded under its mask) ``ValueError`` for a model that cannot stream, and a warning, once,
        for chunks it was not trained with."""
        d = DecodingConfig.of(decoding, **overrides)
        d = d.resolved(streams, lm_loaded=self.lm is not None)
        if d.chunk_size:
            for message in check_streaming(self.model.cfg, d.chunk_size, d.left_chunks):
                if message not in self._said:
                    self._said.add(message)
                    log.warning("%s", message)
        return d

    def fusion(self, d: DecodingConfig) -> Fusion | None:
        """The fusion of resolved settings ``d``; ``ValueError`` for an LM weight without an LM."""
        if d.lm_weight and self.lm is None:
            raise ValueError(
                "lm_weight needs a language model (Recognizer.from_checkpoint(..., lm=...))"
            )
        if d.method not in FUSED_METHODS:
            return None
        # weight 0: the LM need not run
        return Fusion(self.lm if d.lm_weight else None, d.lm_weight or 0.0, d.length_bonus)

    def hotword_graph(self, d: DecodingConfig) -> ContextGraph | None:
        """The hotwords' graph of resolved settings ``d`` (``hotwords.context_graph``, spelled
        with this recognizer's tokenizer): None without hotwords. A request's own list goes in as
        an override: ``rec.transcribe(paths, hotwords=["पणजी", "मांडवी :2.5"])``."""
        return context_graph(d.hotwords, d.hotword_boost, self.tokenizer)

    @classmethod
    def _from_checkpoint(cls, path: str | Path, device: torch.device) -> Recognizer:
        state = load_checkpoint(path)
        if (state.get("model_config") or {}).get("codebook_size"):
            raise CheckpointError(
                f"{path}: a pretrained encoder (konkanivani-train --pretrain), which has learned "
                "no text: fine-tune it on transcribed audio with konkanivani-train --init_from "
                f"{path}")
        try:
            saved = InferenceModel.of(state)
            model = ASRModel(ModelConfig.from_dict(saved.model_config))
            model.load_state_dict(saved.weights)
            tokenizer = Tokenizer(saved.tokenizer)
        except (KeyError, TypeError, RuntimeError, ValueError) as e:
            raise CheckpointError(
                f"{path}: the checkpoint does not hold a usable model ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else e})"
            ) from e
        return cls(model, tokenizer, device)

    def decode_waveforms(self, wavs: Sequence[torch.Tensor], decoding: DecodingConfig | None = None,
                         **overrides) -> list[str]:
        """Texts of 16 kHz mono waveforms, decoded as one batch; those too long for the method
        (``search.method_for``) with ``LONG_INPUT_METHOD``, said in one warning. With
        ``chunk_size``, each is encoded under the chunk mask of a stream in chunks of that size:
        the text such a stream gives it."""
        return [r.text for r in self.decode_results(wavs, decoding, **overrides)]

    def decode_results(self, wavs: Sequence[torch.Tensor], decoding: DecodingConfig | None = None,
                       **overrides) -> list[Result]:
        """``decode_waveforms`` with the words: a final ``Result`` per waveform, its ``words``
        timed in seconds from the waveform's start with their probabilities (``Word``), ``start``
        and ``end`` those of its first and last word (0 and its duration when it has none)."""
        d = self.settings(decoding, **overrides)
        results = self._decode_waveforms(wavs, d)
        long_inputs = [(f"waveform {i}", len(w) / SAMPLE_RATE) for i, w in enumerate(wavs)
                       if _method_of(d.method, w) != d.method]
        _say_long_inputs(d.method, long_inputs)
        return results

    def decode_with_greedy(self, wavs: Sequence[torch.Tensor],
                           decoding: DecodingConfig | None = None, **overrides
                           ) -> list[tuple[Result, str]]:
        """``decode_results`` with each waveform's greedy CTC text beside its result, both from the
        same forward pass: how far the chosen method and the CTC head alone agree is a confidence
        of the text (``decoding.confidence``) that costs no second encoding."""
        d = self.settings(decoding, **overrides)
        greedy: list[list[int]] = []
        results = self._decode_waveforms(wavs, d, greedy=greedy)
        return [(r, self.tokenizer.decode(g)) for r, g in zip(results, greedy)]

    @torch.inference_mode()
    def _decode_waveforms(self, wavs: Sequence[torch.Tensor], d: DecodingConfig,
                          offset: float = 0.0, greedy: list[list[int]] | None = None
                          ) -> list[Result]:
        """The final results of waveforms decoded as one batch, their words aligned and timed from
        ``offset`` seconds; ``greedy``, when given, is filled with each one's greedy CTC tokens."""
        fusion = self.fusion(d)
        feats = [self.frontend(w) for w in wavs]
        lens = torch.tensor([len(f) for f in feats], device=self.device)
        padded = torch.nn.utils.rnn.pad_sequence(feats, batch_first=True).to(self.device)
        enc, enc_lens = self.model.encode(padded, lens, chunk_size=d.chunk_size,
                                          left_chunks=d.left_chunks)
        ids = decode_encoded(self.model, enc, enc_lens, lens, d, fusion, self.hotword_graph(d))
        log_probs = self.model.ctc_log_probs(enc).cpu()
        if greedy is not None:
            greedy.extend(ctc_greedy(log_probs, enc_lens.cpu()))
        return aligned_results(self.tokenizer, ids, wavs, log_probs, enc_lens, offset)

    def stream(self, decoding: DecodingConfig | None = None, *, sample_rate: int = SAMPLE_RATE,
               **overrides) -> Stream:
        """A ``Stream`` of mono float audio at ``sample_rate`` (resampled to 16 kHz as it comes),
        encoded in chunks of ``chunk_size`` encoder frames (40 ms each; ``CHUNK_SIZE`` unless given)
        that see ``left_chunks`` chunks back (-1: all of the segment), decoded with ``method``
        (``STREAM_METHODS``); a segment ends after ``endpoint_ms`` of blank frames following speech
        (0: only at ``MAX_SEGMENT_SECONDS``). ``ValueError`` in one line for a model that cannot
        stream (trained without ``causal_conv``) or settings it cannot take; a warning, once, for
        chunks it was not trained with."""
        d = self.settings(decoding, streams=True, **overrides)
        check_sample_rate(sample_rate)
        return Stream(self.model, self.tokenizer, self.frontend, d, self.fusion(d), sample_rate,
                      hotword_graph=self.hotword_graph(d))

    def stream_results(self, pieces: Iterable[torch.Tensor], decoding: DecodingConfig | None = None,
                       *, sample_rate: int = SAMPLE_RATE, **overrides) -> Iterator[Result]:
        """The results of a stream (``stream``, its settings checked at once) fed ``pieces`` one by
        one, then finished:

            >>> for result in rec.stream_results(pieces, chunk_size=8):  # doctest: +SKIP
            ...     print(result.is_final, result.start, result.end, result.text)
        """
        return _stream_results(self.stream(decoding, sample_rate=sample_rate, **overrides), pieces)

    def transcribe_long(self, path: str | Path, decoding: DecodingConfig | None = None, *,
                        partials: bool = False, **overrides) -> Iterator[Result]:
        """The results of one recording of any length, read block by block (``read_blocks``), in the
        memory of a segment: with ``chunk_size`` > 0 through a ``stream`` (its final results, and
        with ``partials`` its partial ones); else in windows of at most ``WINDOW_SECONDS`` cut at
        quiet moments (``quiet_windows``), each decoded whole with the method, one final result each
        (its start and end the window's, its words timed from the file's start). As a stream does,
        it leaves out a final result without text unless there is no other. ``AudioError`` for a
        file that cannot be read, states a sample rate that is not resampled from
        (``check_sample_rate``) or is too short for the model."""
        streams = bool(DecodingConfig.of(decoding, **overrides).chunk_size)
        d = self.settings(decoding, streams=streams, **overrides)
        seen = 0

        def blocks() -> Iterator[torch.Tensor]:
            nonlocal seen
            _check_rate(path)
            for block in read_blocks(path):
                seen += len(block)
                yield block

        if streams:
            stream = self.stream(d)
            for block in blocks():
                yield from (r for r in stream.accept(block) if partials or r.is_final)
            _check_length(path, seen, self.frontend.min_samples)
            yield from (r for r in stream.finish() if partials or r.is_final)
            return
        self.fusion(d)
        given = False
        for result in self._window_results(quiet_windows(blocks()), d, path):
            given = True
            yield result
        _check_length(path, seen, self.frontend.min_samples)
        if not given:
            yield Result("", True, 0.0, round(seen / SAMPLE_RATE, 3))

    def waveform_results(self, wav: torch.Tensor, decoding: DecodingConfig | None = None,
                         **overrides) -> list[Result]:
        """The final results of one 16 kHz waveform, as ``konkanivani-transcribe`` gives a file of
        it, so that a server answers with the same words, times and probabilities as the tool:
        up to ``LONG_INPUT_SECONDS`` decoded whole (``transcribe``'s ``Transcript``, one result from
        0 to its end), longer in windows cut at quiet moments (``transcribe_long``'s). The empty
        result only when none has text."""
        d = self.settings(decoding, **overrides)
        seconds = round(len(wav) / SAMPLE_RATE, 3)
        if len(wav) <= LONG_INPUT_SECONDS * SAMPLE_RATE:
            [result] = self._decode_waveforms([wav], d)
            results = [Result(result.text, True, 0.0, seconds, result.words)] if result.text else []
        else:
            results = list(self._window_results(quiet_windows([wav]), d, "the waveform"))
        return results or [Result("", True, 0.0, seconds)]

    def _window_results(self, windows: Iterable[tuple[int, torch.Tensor]], d: DecodingConfig,
                        label: str | Path) -> Iterator[Result]:
        """The final result of each window with text (``quiet_windows``' ``(first sample,
        waveform)``), decoded whole: its start and end the window's, its words timed from the start
        of the recording; a last sliver too short for the model is left out."""
        for first, wav in windows:
            if _too_short(label, len(wav), self.frontend.min_samples):
                continue
            [result] = self._decode_waveforms([wav], d, first / SAMPLE_RATE)
            if result.text:
                yield Result(result.text, True, round(first / SAMPLE_RATE, 3),
                             round((first + len(wav)) / SAMPLE_RATE, 3), result.words)

    def transcribe(self, paths: Iterable[str | Path], decoding: DecodingConfig | None = None,
                   **overrides) -> Iterator[Transcript]:
        """Transcripts in the order of ``paths``. Files are read a few batches at a time and batched
        by length (``batch_size``). A file that cannot be read, is shorter than ``MIN_SAMPLES`` or
        fails to decode yields a ``Transcript`` with ``error`` set, and the others are still decoded
        (a failing batch is decoded again file by file). Files longer than ``LONG_INPUT_SECONDS``
        asked of an attention-based method are decoded with ``LONG_INPUT_METHOD``: their ``method``
        says so, and one warning at the end of the call names them. With ``chunk_size``, each file
        is encoded under the chunk mask of a stream in chunks of that size
        (``decode_waveforms``)."""
        d = self.settings(decoding, **overrides)  # refused here, before any file is read
        self.fusion(d)
        paths = list(paths)
        window = 8 * d.batch_size
        long_inputs: list[tuple[str, float]] = []
        for first in range(0, len(paths), window):
            for tr in self._transcribe_window(paths[first:first + window], d):
                if tr.error is None and tr.method != d.method:
                    long_inputs.append((tr.audio_filepath, tr.duration))
                yield tr
        _say_long_inputs(d.method, long_inputs)

    def _transcribe_window(self, paths: list[str | Path], d: DecodingConfig
                           ) -> Iterator[Transcript]:
        read = [_read(p, self.frontend.min_samples) for p in paths]
        wavs, errors = [w for w, _ in read], [e for _, e in read]
        results: dict[int, Result] = {}
        decodable = sorted(
            (i for i, e in enumerate(errors) if e is None), key=lambda i: -len(wavs[i])
        )
        for start in range(0, len(decodable), d.batch_size):
            batch = decodable[start:start + d.batch_size]
            self._decode_files(batch, paths, wavs, results, errors, d)
        for i, path in enumerate(paths):
            duration = 0.0 if wavs[i] is None else len(wavs[i]) / SAMPLE_RATE
            used = _method_of(d.method, wavs[i]) if errors[i] is None else ""
            result = results.get(i)
            yield Transcript(str(path), result.text if result else "", duration, errors[i], used,
                             result.words if result else [])

    def _decode_files(
        self,
        chunk: list[int],
        paths: list[str | Path],
        wavs: Sequence[torch.Tensor | None],
        results: dict[int, Result],
        errors: list[str | None],
        d: DecodingConfig,
    ) -> None:
        """Decode the files ``chunk`` (indices into ``paths``) as one batch into ``results``. If the
        batch raises, each file alone, so that only a file that fails by itself gets an ``errors``
        entry (naming it and what was raised) and no other file is lost with it."""
        try:
            results.update(zip(chunk, self._decode_waveforms([wavs[i] for i in chunk], d)))
        except Exception as e:  # noqa: BLE001  whatever one file makes the model raise
            if len(chunk) > 1:
                for i in chunk:
                    self._decode_files([i], paths, wavs, results, errors, d)
            else:
                reason = str(e).strip().splitlines()[0] if str(e).strip() else "no message"
                errors[chunk[0]] = (
                    f"{paths[chunk[0]]}: decoding failed ({type(e).__name__}: {reason})"
                )


def _read(path: str | Path, min_samples: int) -> tuple[torch.Tensor | None, str | None]:
    """The waveform of ``path`` and why it cannot be decoded (None if it can): unreadable or of a
    sample rate not resampled from (no waveform), or too short for the encoder's subsampling,
    decided here before any batching."""
    try:
        _check_rate(path)
        wav = load_audio(path)
    except RuntimeError as e:  # the caller names it (Transcript.error), once
        return None, str(e)
    too_short = _too_short(path, len(wav), min_samples)
    return wav, None if too_short is None else str(too_short)


def _check_rate(path: str | Path) -> None:
    """``AudioError`` naming ``path`` when its header states a sample rate that is not resampled
    from (``check_sample_rate``: resampling from it would build a filter of gigabytes), before any
    of it is
    read. A header that cannot be read is left to the reading, which names why."""
    try:
        rate = sf.info(str(path)).samplerate
    except Exception:  # noqa: BLE001  soundfile raises LibsndfileError, RuntimeError, TypeError...
        return
    try:
        check_sample_rate(rate)
    except ValueError as e:
        raise AudioError("sample rate unsupported", str(path), str(e)) from None


def _stream_results(stream: Stream, pieces: Iterable[torch.Tensor]) -> Iterator[Result]:
    for piece in pieces:
        yield from stream.accept(piece)
    yield from stream.finish()


def _too_short(path: str | Path, samples: int, min_samples: int) -> AudioError | None:
    """Why ``samples`` samples of ``path`` are too few for the encoder, if they are: its subsampling
    needs enough feature frames for one encoder frame (``min_samples`` samples, the front-end's)."""
    if samples >= min_samples:
        return None
    return AudioError(
        "audio too short",
        str(path),
        f"{samples / SAMPLE_RATE:.3f} s; the model needs at least "
        f"{min_samples / SAMPLE_RATE:.3f} s",
    )


def _check_length(path: str | Path, samples: int, min_samples: int) -> None:
    too_short = _too_short(path, samples, min_samples)
    if too_short is not None:
        raise too_short


def _method_of(method: str, wav: torch.Tensor) -> str:
    """The method ``decode_encoded`` decodes ``wav`` with when asked for ``method``."""
    return method_for(method, frames_of_samples(len(wav)))


def _say_long_inputs(method: str, long_inputs: list[tuple[str, float]]) -> None:
    """One warning naming the inputs (name, seconds) decoded with ``LONG_INPUT_METHOD`` instead of
    ``method``, and what to do instead; nothing when there are none."""
    if not long_inputs:
        return
    named = ", ".join(f"{name} ({seconds:.1f} s)" for name, seconds in long_inputs[:_MAX_NAMED])
    more = f" and {len(long_inputs) - _MAX_NAMED} more" if len(long_inputs) > _MAX_NAMED else ""
    log.warning(
        "%d input%s longer than %g s decoded with %s (CTC prefix beam search) instead of %s, which"
        " is meant for inputs up to that length (its cost grows with the square of the length):"
        " %s%s. Split long recordings into pieces of at most %g s, or decode them with --method"
        " greedy",
        len(long_inputs),
        "s" if len(long_inputs) > 1 else "",
        LONG_INPUT_SECONDS,
        LONG_INPUT_METHOD,
        method,
        named,
        more,
        LONG_INPUT_SECONDS,
    )


def find_audio(inputs: Sequence[str | Path]) -> list[tuple[Path, dict]]:
    """Expand command-line inputs into ``(audio path, manifest row or {})``: audio files as given,
    folders searched recursively for audio files, ``.json``/``.jsonl`` files read as manifests
    (relative paths are relative to the manifest)."""
    found: list[tuple[Path, dict]] = []
    for item in map(Path, inputs):
        if item.is_dir():
            found += [
                (p, {}) for p in sorted(item.rglob("*")) if p.suffix.lower() in AUDIO_SUFFIXES
            ]
        elif item.suffix.lower() in (".json", ".jsonl"):
            for line_no, row in read_manifest(item):
                audio = row.get("audio_filepath")
                if not isinstance(audio, str) or not audio:
                    log.warning("%s:%d: no audio_filepath; skipped", item, line_no)
                    continue
                found.append(
                    (resolve_audio_path(audio, item.parent), {**row, "where": f"{item}:{line_no}"})
                )
        else:
            found.append((item, {}))
    return found
