"""Streaming recognition, and long recordings in bounded memory.

A ``Stream`` (``Recognizer.stream``) takes mono audio in pieces of any size (resampled to 16 kHz as
it comes, ``data.audio.Resampler``) and gives results as it goes. Its features are the frames the
whole-file path computes (``StreamingLogMel``, ``StreamingKaldiFbank``), normalized frame by frame
(``ASRModel.normalize``; with cmvn "utterance" by the running mean of the stream's frames so far),
encoded one chunk at a time with the encoder's caches (``ConformerEncoder.forward_chunk``: the
frames ``ASRModel.encode(..., chunk_size=C)`` gives; ``ModelChunks``, or an export's ONNX chunk
graph, ``decoding.onnx_recognizer``), and each chunk's CTC output advances a prefix beam search
(``CTCPrefixBeam``), or with method ``greedy`` the best path (``CTCBestPath``):

- after each chunk, a partial result: the beam's best so far in the current segment;
- at the end of a segment, a final result: with method ``rescore`` the beam's n-best rescored by the
  attention decoder over the segment's encoder frames (and the LM, with one), with ``beam`` the
  beam's best (the LM fused into the search), with ``greedy`` the best path (the text a whole
  file's greedy search gives over the same frames, and sherpa-onnx's).

A segment ends at an endpoint: more than ``endpoint_ms`` of frames whose likeliest CTC output is
blank after speech (a frame whose likeliest output is a token); or after ``MAX_SEGMENT_SECONDS``
(the longest input the attention decoder is meant for, ``settings.LONG_INPUT_SECONDS``), and at the
end of the stream. Then the search and the encoder's caches start again, so memory stays bounded
however long the stream. Times count from the stream's start, 40 ms per encoder frame: in a partial
result a token's time is that of the frame where it was likeliest; a final result's words are
aligned to the segment's CTC log-probabilities (``alignment.align_words``), with their
probabilities.

A model trained without ``causal_conv`` cannot encode chunk by chunk; a long recording goes through
``quiet_windows`` instead: pieces of at most ``WINDOW_SECONDS``, each decoded whole.
"""
from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..data.audio import Resampler
from ..data.features import LOG_OFFSET, KaldiFbank, LogMel
from ..data.frames import HOP_LENGTH, SAMPLE_RATE
from ..data.tokenizer import BLANK_ID, Tokenizer
from ..model.asr import ASRModel
from ..model.conformer import Conv2dSubsampling
from .alignment import FRAME_SECONDS, WORD_START, Word, align_words
from .hotwords import ContextGraph
from .search import CTCBestPath, CTCPrefixBeam, Fusion, Hypothesis, rescore_nbest
from .settings import LONG_INPUT_SECONDS, STREAM_METHODS, DecodingConfig

__all__ = [
    "FRAME_SECONDS",
    "MAX_RATE",
    "MAX_SEGMENT_SECONDS",
    "MIN_RATE",
    "STREAM_METHODS",
    "WINDOW_SECONDS",
    "ModelChunks",
    "Result",
    "aligned_results",
    "Stream",
    "StreamingLogMel",
    "StreamingKaldiFbank",
    "streaming_features",
    "Word",
    "check_sample_rate",
    "check_streaming",
    "quiet_windows",
]

MAX_SEGMENT_SECONDS = LONG_INPUT_SECONDS
WINDOW_SECONDS = 20.0  # the longest piece of a long recording decoded whole (quiet_windows)
CUT_SECONDS = 5.0  # ... cut at the quietest 100 ms of its last CUT_SECONDS
MIN_RATE, MAX_RATE = 8000, 192000  # the sample rates recordings and streams are resampled from
# floats (8 MB) of the sinc kernel torchaudio builds for a rate (check_sample_rate)
MAX_RESAMPLE_KERNEL = 2 ** 21


@dataclass
class Result:
    """A partial (``is_final`` False: the best so far of the current segment, may still change) or
    final result of a segment. ``words`` holds each word's time, in seconds from the stream's start
    (a final result's with its probability: ``alignment.Word``); ``start`` and ``end`` are those of
    its first and last word (of the segment when it has none)."""

    text: str
    is_final: bool
    start: float
    end: float
    words: list[Word] = field(default_factory=list)


def aligned_results(tokenizer: Tokenizer, hypotheses: Sequence[Sequence[int]],
                    wavs: Sequence[torch.Tensor], log_probs: torch.Tensor, lengths: torch.Tensor,
                    offset: float = 0.0) -> list[Result]:
    """The final ``Result`` of each waveform of a batch decoded whole: its hypothesis's text and
    words, aligned to its CTC log-probabilities (``log_probs[b, :lengths[b]]``) and timed from
    ``offset`` seconds; its start and end its words' (the waveform's when it has none)."""
    results = []
    for b, (tokens, wav) in enumerate(zip(hypotheses, wavs)):
        seconds = len(wav) / SAMPLE_RATE
        words = align_words(tokenizer, tokens, log_probs[b, :int(lengths[b])], offset, seconds)
        start, end = (words[0].start, words[-1].end) if words else (offset, offset + seconds)
        results.append(Result(tokenizer.decode(tokens), True, round(start, 3), round(end, 3),
                              words))
    return results


def check_streaming(cfg, chunk_size: int, left_chunks: int) -> list[str]:
    """``ValueError`` in one line when a model of ``cfg`` cannot stream (no ``causal_conv``); else
    what to warn of when it was not trained for chunks of ``chunk_size`` frames seeing
    ``left_chunks`` back (values ``DecodingConfig.check`` has checked)."""
    if not cfg.causal_conv:
        raise ValueError(
            "the checkpoint is not a streaming model (trained without"
            " --causal_conv/--dynamic_chunk); decode it whole (long recordings go in windows)"
        )
    if not cfg.dynamic_chunk:
        return [
            f"chunks of {chunk_size} frames: this model was trained with full context only (no"
            " --dynamic_chunk) and will recognize worse in chunks"
        ]
    warnings = []
    if chunk_size > cfg.max_chunk:
        warnings.append(
            f"chunks of {chunk_size} frames: this model was trained with chunks of 1 to"
            f" {cfg.max_chunk} frames (--max_chunk) and with full context"
        )
    if left_chunks >= 0 and not cfg.dynamic_left_chunks:
        warnings.append(
            f"{left_chunks} left chunks: this model was trained with every chunk to the left in"
            " view (no --dynamic_left_chunks)"
        )
    return warnings


def check_sample_rate(rate: int) -> None:
    """``ValueError`` in one line for a sample rate that is not resampled from: outside ``MIN_RATE``
    .. ``MAX_RATE``, or one whose ratio to 16 kHz in lowest terms is so odd that the sinc kernel
    torchaudio builds for it (``new`` rows of ``orig + 2 * width``) would hold more than
    ``MAX_RESAMPLE_KERNEL`` floats. A wav header is four bytes anyone can write: 2147483647 Hz made
    the resampler ask for 8.6 GB, 44101 Hz (44101/16000) for 2.8 GB. Checked before resampling a
    file (``Recognizer``), a stream
    (``Recognizer.stream``) and what the server takes."""
    if not MIN_RATE <= rate <= MAX_RATE:
        raise ValueError(
            f"a sample rate of {rate} Hz: konkanivani takes {MIN_RATE} to {MAX_RATE} Hz"
        )
    if rate == SAMPLE_RATE:
        return
    gcd = math.gcd(rate, SAMPLE_RATE)
    orig, new = rate // gcd, SAMPLE_RATE // gcd
    # torchaudio's lowpass_filter_width 6, rolloff 0.99
    width = math.ceil(6 * orig / (0.99 * min(orig, new)))
    if new * (orig + 2 * width) > MAX_RESAMPLE_KERNEL:
        raise ValueError(
            f"a sample rate of {rate} Hz: too odd a ratio to {SAMPLE_RATE} Hz to resample"
            f" ({orig}/{new}); use a common rate (8000, 11025, 16000, 22050, 32000, 44100, 48000"
            " ...)"
        )


class StreamingLogMel:
    """``LogMel`` of a waveform that comes in pieces: the frames of the whole waveform, each one as
    soon as its samples are in (the same STFT of the same 400 samples: equal but for float rounding
    where the FFTs are batched otherwise, under 1e-6). ``LogMel`` centres frame t on sample 160t and
    pads the waveform's ends by reflection, so frame t needs samples 160t - 200 .. 160t + 199: the
    frames trail the input by 200 samples, and the last ones, which reach
    into the end's reflection, come from ``finish``."""

    def __init__(self, log_mel: LogMel):
        self.mel = copy.deepcopy(log_mel.mel)
        self.n_mels = log_mel.n_mels
        self.mel.spectrogram.center = False  # the centring's padding is done here
        self.n_fft, self.hop, self.half = self.mel.n_fft, self.mel.hop_length, self.mel.n_fft // 2
        self.buffer = torch.zeros(0)  # the samples frames still need, from sample `buffer_start`
        self.buffer_start = 0  # -half once the start's reflection is in front
        self.seen = 0  # samples taken
        self.frames = 0  # frames given

    def accept(self, wav: torch.Tensor) -> torch.Tensor:
        """The frames ``(T, n_mels)`` that the samples so far complete."""
        self.buffer = torch.cat([self.buffer, wav])
        self.seen += len(wav)
        if self.buffer_start == 0:
            if self.seen <= self.half:  # the reflection of the start needs samples 1 .. 200
                return self._empty()
            self.buffer = torch.cat([self.buffer[1:self.half + 1].flip(0), self.buffer])
            self.buffer_start = -self.half
        return self._frames((self.seen - self.half) // self.hop + 1)

    def finish(self) -> torch.Tensor:
        """The last frames, up to the ``1 + N // 160`` of ``LogMel`` (none for fewer than 201
        samples, which ``LogMel`` cannot pad either)."""
        if self.buffer_start == 0:
            return self._empty()
        self.buffer = torch.cat([self.buffer, self.buffer[-self.half - 1:-1].flip(0)])
        return self._frames(1 + self.seen // self.hop)

    def _frames(self, upto: int) -> torch.Tensor:
        """Frames ``self.frames`` .. ``upto - 1``, and the samples before the next one dropped."""
        count = upto - self.frames
        if count <= 0:
            return self._empty()
        first = self.frames * self.hop - self.half - self.buffer_start
        span = self.buffer[first:first + (count - 1) * self.hop + self.n_fft]
        out = torch.log(self.mel(span) + LOG_OFFSET).transpose(0, 1)
        self.frames = upto
        drop = self.frames * self.hop - self.half - self.buffer_start
        self.buffer, self.buffer_start = self.buffer[drop:], self.buffer_start + drop
        return out

    def _empty(self) -> torch.Tensor:
        return torch.zeros(0, self.mel.n_mels)


class StreamingKaldiFbank:
    """``KaldiFbank`` of a waveform that comes in pieces, as ``StreamingLogMel`` is ``LogMel``'s.
    Frame t covers samples 160t - 120 .. 160t + 279 (sample -k being sample k - 1, the start's
    reflection) and is computed from those alone (its own DC offset, pre-emphasis and window), so
    it is out once they are in; the last ones, which reach into the end's reflection (sample N + k
    being sample N - 1 - k), come from ``finish``."""

    WINDOW, SHIFT = 400, HOP_LENGTH
    PAD = WINDOW // 2 - SHIFT // 2  # 120: the samples of the first frame before the start

    def __init__(self, fbank: KaldiFbank):
        self.fbank, self.n_mels = fbank, fbank.n_mels
        self.buffer = torch.zeros(0)  # the samples frames still need, from sample `buffer_start`
        self.buffer_start = 0  # -PAD once the start's reflection is in front
        self.seen = 0  # samples taken
        self.frames = 0  # frames given

    def accept(self, wav: torch.Tensor) -> torch.Tensor:
        """The frames ``(T, n_mels)`` that the samples so far complete."""
        self.buffer = torch.cat([self.buffer, wav])
        self.seen += len(wav)
        if self.buffer_start == 0:
            if self.seen < self.PAD:
                return self._empty()
            self.buffer = torch.cat([self.buffer[:self.PAD].flip(0), self.buffer])
            self.buffer_start = -self.PAD
        return self._frames((self.seen + self.PAD - self.WINDOW) // self.SHIFT + 1)

    def finish(self) -> torch.Tensor:
        """The last frames, up to the ``(N + 80) // 160`` of ``KaldiFbank`` (none for fewer than
        120 samples, too few to decode in any case)."""
        if self.buffer_start == 0:
            return self._empty()
        self.buffer = torch.cat([self.buffer, self.buffer.flip(0)])
        return self._frames(self.fbank.frames(self.seen))

    def _frames(self, upto: int) -> torch.Tensor:
        """Frames ``self.frames`` .. ``upto - 1``, and the samples before the next one dropped."""
        count = upto - self.frames
        if count <= 0:
            return self._empty()
        first = self.frames * self.SHIFT - self.PAD - self.buffer_start
        out = self.fbank(self.buffer[first:first + (count - 1) * self.SHIFT + self.WINDOW],
                         snip_edges=True)
        self.frames = upto
        drop = self.frames * self.SHIFT - self.PAD - self.buffer_start
        self.buffer, self.buffer_start = self.buffer[drop:], self.buffer_start + drop
        return out

    def _empty(self) -> torch.Tensor:
        return torch.zeros(0, self.n_mels)


def streaming_features(frontend: LogMel | KaldiFbank) -> StreamingLogMel | StreamingKaldiFbank:
    """The streaming form of a front-end (``features.make_frontend``)."""
    if isinstance(frontend, KaldiFbank):
        return StreamingKaldiFbank(frontend)
    return StreamingLogMel(frontend)


class ModelChunks:
    """How a ``Stream`` encodes with an ``ASRModel``: new feature frames normalized as they come
    (``ASRModel.normalize``; with cmvn "utterance", each frame by the mean of the frames up to it),
    a window of them through ``ConformerEncoder.forward_chunk`` with its caches, seeing
    ``left_frames`` encoder frames back (-1: all of the segment), and its CTC log-probabilities.
    Another way to encode
    a stream (``decoding.onnx_recognizer``'s ONNX chunk graph) has the same three methods."""

    def __init__(self, model: ASRModel, left_frames: int):
        self.model, self.left_frames = model, left_frames
        self.device = next(model.parameters()).device
        self.feat_sum = torch.zeros(model.cfg.n_mels, dtype=torch.float64)  # for cmvn "utterance"
        self.feat_count = 0
        self.reset()

    def reset(self) -> None:
        """A new segment: the caches start again."""
        self.state = None

    def prepare(self, feats: torch.Tensor) -> torch.Tensor:
        """New raw log-mel frames ``(T, F)`` as the stream keeps them until they are encoded:
        normalized."""
        if self.model.cfg.cmvn != "utterance" or not len(feats):
            return self.model.normalize(feats.to(self.device))
        sums = self.feat_sum + feats.double().cumsum(0)
        counts = self.feat_count + torch.arange(1, len(feats) + 1, dtype=torch.float64)
        self.feat_sum, self.feat_count = sums[-1], self.feat_count + len(feats)
        mean = (sums / counts[:, None]).float()
        return self.model.normalize(feats.to(self.device), mean.to(self.device))

    def encode(self, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A window of prepared frames ``(W, *)``: the chunk's CTC log-probabilities ``(C, V)`` and
        its encoder frames ``(C, D)``."""
        enc, self.state = self.model.encoder.forward_chunk(
            window[None], self.state, self.left_frames
        )
        return self.model.ctc_log_probs(enc)[0], enc[0]

    def batch_key(self, window: torch.Tensor) -> tuple:
        """Streams whose windows have equal keys can be encoded together (``encode_together``):
        one model, one ``left_frames``, windows of one length."""
        return id(self.model), self.left_frames, tuple(window.shape)

    @staticmethod
    def encode_together(chunks: Sequence[ModelChunks], windows: Sequence[torch.Tensor]
                        ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``encode`` of several streams' windows (of one ``batch_key``) in one batched forward,
        ``ConformerEncoder.forward_chunk_of_streams``: each stream's ``(C, V)`` and ``(C, D)``,
        what its own ``encode`` gives (within float rounding), and its caches moved on."""
        model, left_frames = chunks[0].model, chunks[0].left_frames
        enc, states = model.encoder.forward_chunk_of_streams(
            torch.stack(list(windows)), [c.state for c in chunks], left_frames
        )
        log_probs = model.ctc_log_probs(enc)
        for c, state in zip(chunks, states):
            c.state = state
        return list(zip(log_probs, enc))


class Stream:
    """One audio stream through a recognizer (made by ``Recognizer.stream``, which checks the
    settings).

    ``accept(samples)`` takes the next piece (any length, empty too) and returns the results it
    brings: a partial result after each chunk encoded, and a final one at each endpoint.
    ``finish()`` ends the stream and returns what remains, ending with a final result: the last
    segment's, given when it has text or when the stream has given no final result yet (so every
    stream gives at least one, maybe empty; a segment of silence after an endpoint gives none).

    ``chunks`` encodes the chunks: by default the model's own ``forward_chunk`` (``ModelChunks``);
    with another (an exported chunk graph) ``model`` may be None, and ``method`` not ``rescore``,
    which needs the model's attention decoder. ``hotword_graph``: the hotwords'
    (``Recognizer.hotword_graph``), which the search and the rescoring are biased towards."""

    def __init__(self, model: ASRModel | None, tokenizer: Tokenizer,
                 frontend: LogMel | KaldiFbank,
                 decoding: DecodingConfig, fusion: Fusion | None, sample_rate: int = SAMPLE_RATE,
                 chunks: ModelChunks | None = None,
                 hotword_graph: ContextGraph | None = None):
        d = decoding  # resolved: chunk_size, method and endpoint_ms written in
        if model is None and d.method == "rescore":
            raise ValueError("rescoring needs the model's attention decoder")
        self.model, self.tokenizer = model, tokenizer
        chunk_size = d.chunk_size
        left_frames = d.left_chunks * chunk_size if d.left_chunks >= 0 else -1
        self.chunks = chunks or ModelChunks(model, left_frames)
        self.chunk_size, self.method, self.ctc_weight = chunk_size, d.method, d.ctc_weight
        self.beam_size = d.beam_size
        self.fusion = fusion or Fusion()
        self.hotword_graph = hotword_graph
        # a run of blank frames longer than this ends a segment
        self.endpoint_frames = d.endpoint_ms / 1000 / FRAME_SECONDS
        self.max_segment_frames = round(MAX_SEGMENT_SECONDS / FRAME_SECONDS)
        # encoder frame t sees feature frames stride * t .. stride * t + receptive_field - 1, so a
        # chunk of C frames is encoded from a window of these; the next one starts C strides later
        self.window = Conv2dSubsampling.window_frames(chunk_size)
        self.step = Conv2dSubsampling.STRIDE * chunk_size
        self.receptive_field = Conv2dSubsampling.RECEPTIVE_FIELD
        self.resampler = Resampler(sample_rate)
        self.features = streaming_features(frontend)
        # prepared, not yet encoded
        self.feats = self.chunks.prepare(torch.zeros(0, self.features.n_mels))
        self.frames = 0  # encoder frames of the stream so far
        self.finals = 0  # final results given
        self.finished = False
        self._new_segment()

    @torch.inference_mode()
    def accept(self, samples: torch.Tensor | np.ndarray) -> list[Result]:
        """The results the piece ``samples`` brings: mono float samples ``(N,)`` at the stream's
        rate."""
        self.take(samples)
        return self._encode()

    @torch.inference_mode()
    def finish(self) -> list[Result]:
        """The results of the rest of the stream, ending with its final result (see the class)."""
        self.take_end()
        return self._encode() + self.last_results()

    # accept and finish in steps, for a caller that encodes the windows of several streams
    # together (the server's batched streams, serving.engine): take or take_end, then each window
    # of next_window encoded (ModelChunks.encode_together) and given to chunk_encoded, in turn,
    # until there is none; after take_end, last_results.

    @torch.inference_mode()
    def take(self, samples: torch.Tensor | np.ndarray) -> None:
        """The piece ``samples`` (as ``accept``) made into features, not yet encoded."""
        if self.finished:
            raise ValueError("the stream is finished: make a new one with Recognizer.stream")
        self._take(self.features.accept(self.resampler(_samples(samples))))

    @torch.inference_mode()
    def take_end(self) -> None:
        """The end of the stream (as ``finish``): the last features, the last windows shorter."""
        if self.finished:
            raise ValueError("the stream is finished: make a new one with Recognizer.stream")
        self.finished = True
        self._take(self.features.accept(self.resampler.flush()))
        self._take(self.features.finish())

    def next_window(self) -> torch.Tensor | None:
        """The window of prepared frames the stream's next chunk is encoded from, when its
        features are in; else None."""
        if len(self.feats) >= (self.receptive_field if self.finished else self.window):
            return self.feats[:self.window]
        return None

    @torch.inference_mode()
    def chunk_encoded(self, log_probs: torch.Tensor, enc: torch.Tensor) -> list[Result]:
        """The results of ``next_window``'s chunk, encoded: its CTC log-probabilities ``(C, V)``
        and encoder frames ``(C, D)``."""
        self.feats = self.feats[self.step:]
        return self._advance(log_probs, enc)

    @torch.inference_mode()
    def last_results(self) -> list[Result]:
        """After ``take_end`` and the last window: the stream's final result (see the class)."""
        results = []
        final = self._final()
        if final.text or not self.finals:
            self.finals += 1
            results.append(final)
        return results

    def _new_segment(self) -> None:
        self.chunks.reset()
        self.search = CTCBestPath() if self.method == "greedy" else CTCPrefixBeam(
            self.beam_size, self.fusion if self.method == "beam" else None, self.hotword_graph)
        self.segment_start = self.frames
        self.encoded: list[torch.Tensor] = []  # the segment's encoder frames, for rescoring
        # the segment's CTC log-probabilities, to align the final result's words to
        self.segment_log_probs: list[torch.Tensor] = []
        self.speech = False  # a frame whose likeliest output is a token, in this segment
        self.blanks = 0  # frames since the last such frame

    def _take(self, feats: torch.Tensor) -> None:
        """New raw log-mel frames, prepared, after those not yet encoded."""
        self.feats = torch.cat([self.feats, self.chunks.prepare(feats)])

    def _encode(self) -> list[Result]:
        """Encode every chunk the features so far complete (at the end, also a last shorter one)."""
        results = []
        while (window := self.next_window()) is not None:
            results += self.chunk_encoded(*self.chunks.encode(window))
        return results

    def _advance(self, log_probs: torch.Tensor, enc: torch.Tensor) -> list[Result]:
        """One chunk's CTC log-probabilities ``(C, V)`` and encoder frames ``(C, D)`` through the
        search; a partial result, or at an endpoint the segment's final one (none when it is empty).
        """
        self.search.advance(log_probs)
        self.segment_log_probs.append(log_probs)
        if self.method == "rescore":
            self.encoded.append(enc)
        self.frames += len(enc)
        for token in log_probs.argmax(-1).tolist():
            self.speech, self.blanks = (
                (self.speech, self.blanks + 1) if token == BLANK_ID else (True, 0)
            )
        endpoint = self.speech and self.endpoint_frames and self.blanks > self.endpoint_frames
        if not endpoint and self.frames - self.segment_start < self.max_segment_frames:
            return [self._result(self.search.hypotheses(final=False)[0], is_final=False)]
        final = self._final()
        self._new_segment()
        self.finals += bool(final.text)
        return [final] if final.text else []

    def _final(self) -> Result:
        """The current segment's final result."""
        nbest = self.search.hypotheses()
        if self.method == "rescore" and self.encoded and any(h.tokens for h in nbest):
            best = rescore_nbest(self.model, torch.cat(self.encoded), nbest, self.ctc_weight,
                                 self.fusion)
        else:
            best = nbest[0]
        return self._result(best, is_final=True)

    def _result(self, hyp: Hypothesis, is_final: bool) -> Result:
        if is_final and self.segment_log_probs:
            # aligned to the segment's CTC output, as offline decoding aligns a whole file
            words = align_words(self.tokenizer, hyp.tokens, torch.cat(self.segment_log_probs),
                                self.segment_start * FRAME_SECONDS,
                                (self.frames - self.segment_start) * FRAME_SECONDS)
        else:
            # The frame of each token, never before the one of the token before it.
            frames = list(
                itertools.accumulate((self.segment_start + f for f in hyp.frames or []), max)
            )
            words = _words(self.tokenizer, hyp.tokens, frames)
        if words:
            start, end = words[0].start, words[-1].end
        else:
            start, end = round(self.segment_start * FRAME_SECONDS, 3), round(
                self.frames * FRAME_SECONDS, 3
            )
        return Result(self.tokenizer.decode(hyp.tokens), is_final, start, end, words)


def _words(tokenizer: Tokenizer, tokens: list[int], frames: list[int]) -> list[Word]:
    """The words of ``tokens`` (a new one at each piece that starts with SentencePiece's "▁"), each
    from the frame of its first token to the end of its last one's."""
    groups: list[tuple[list[int], list[int]]] = []
    for token, piece, frame in zip(tokens, tokenizer.pieces(tokens), frames):
        if piece.startswith(WORD_START) or not groups:
            groups.append(([], []))
        if piece != WORD_START:  # a space alone (character tokenizers): no part of the word's time
            groups[-1][0].append(token)
            groups[-1][1].append(frame)
    return [
        Word(
            tokenizer.decode(ids),
            round(at[0] * FRAME_SECONDS, 3),
            round((at[-1] + 1) * FRAME_SECONDS, 3),
        )
        for ids, at in groups
        if ids
    ]


def _samples(samples: torch.Tensor | np.ndarray) -> torch.Tensor:
    """A piece of a stream as a float32 CPU tensor ``(N,)``; ``ValueError`` in one line for one that
    is not mono float audio."""
    wav = torch.as_tensor(samples)
    if wav.dim() != 1:
        raise ValueError(
            f"a stream takes mono samples, shape (N,); got shape {tuple(wav.shape)}: mix the"
            " channels down first (the mean over them)"
        )
    if not wav.is_floating_point():
        raise ValueError(f"a stream takes float samples (-1 to 1); got {wav.dtype}")
    wav = wav.detach().to("cpu", torch.float32)
    if not torch.isfinite(wav).all():
        raise ValueError("the samples hold NaN or infinite values")
    return wav


def quiet_windows(blocks: Iterable[torch.Tensor], window_seconds: float = WINDOW_SECONDS,
                  cut_seconds: float = CUT_SECONDS) -> Iterator[tuple[int, torch.Tensor]]:
    """``(first sample, waveform)`` of consecutive pieces of the 16 kHz waveform that comes in
    ``blocks``: each at most ``window_seconds`` long, cut at the quietest 100 ms (the least mean
    square) of its last ``cut_seconds``, where a pause most likely is; together they are the whole,
    with no overlap. Holds one window and a block at a time."""
    window, search = round(window_seconds * SAMPLE_RATE), round(cut_seconds * SAMPLE_RATE)
    buffer, first = torch.zeros(0), 0
    for block in blocks:
        buffer = torch.cat([buffer, block])
        while len(buffer) >= window:
            cut = window - search + _quietest(buffer[window - search:window])
            yield first, buffer[:cut]
            buffer, first = buffer[cut:], first + cut
    if len(buffer):
        yield first, buffer


def _quietest(wav: torch.Tensor, span: int = SAMPLE_RATE // 10) -> int:
    """The sample at the middle of the quietest ``span`` samples of ``wav`` (on a 10 ms grid)."""
    if len(wav) <= span:
        return len(wav) // 2
    energy = wav.unfold(0, span, HOP_LENGTH).square().mean(1)
    return int(energy.argmin()) * HOP_LENGTH + span // 2
