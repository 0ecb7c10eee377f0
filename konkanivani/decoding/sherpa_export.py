"""A checkpoint as a sherpa-onnx model folder (``konkanivani-export --format sherpa-onnx``), for
sherpa-onnx's WeNet CTC recognizers: its Python wheel, C/C++ API, Android, iOS and WebAssembly
apps and its other language bindings run it without this package.

The folder holds::

    model.onnx    CMVN, the encoder and the CTC head (``CTCGraph``, the graph of model.onnx in an
                  ONNX export): features (1, T, n_mels) float32 and their lengths (1,) int64 in,
                  CTC log-probabilities (1, T', V) and their lengths (1,) int64 out, with the ONNX
                  metadata sherpa-onnx's offline WeNet CTC model reads (``sherpa_metadata``)
    model-streaming.onnx
                  a checkpoint trained with causal_conv only: one chunk of a stream through CMVN,
                  the encoder and the CTC head (``WenetChunkGraph``), with the inputs, outputs and
                  metadata sherpa-onnx's online WeNet CTC model takes (``streaming_metadata``), for
                  its Python OnlineRecognizer.from_wenet_ctc at the chunk it was exported for
    tokens.txt    "piece id" a line, the tokenizer's pieces, blank (<blank>) at id 0
    README.md     how to load it in Python and C++ (the streaming model: Python and sherpa-onnx's
                  C++ command-line tool; its C API has no online WeNet CTC model)

sherpa-onnx computes the features itself: Kaldi filterbanks of the samples scaled to 16-bit
integers, what ``features.KaldiFbank`` computes (sherpa-onnx/csrc/features.h's defaults with
normalize_samples false, offline-recognizer-ctc-impl.h) but for the floor ``KaldiFbank`` puts under
each bin (``KALDI_FLOOR``), which both graphs apply to their input first. A model trained on
another front-end (``--frontend log_mel``, the default) would see other features there; it is
refused, before anything is written. The folder is built and swapped in as any export's
(``model_export._building``, ``_swap_in``).

model-streaming.onnx is checked as sherpa-onnx drives it (``sherpa_stream_difference``: its offset,
mask and caches, full windows only) against ``ConformerEncoder.forward_chunk``. A streaming model
of cmvn "utterance" is refused: CMVN by the stream's running mean needs a state sherpa-onnx does
not keep.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..data.features import KALDI_FLOOR
from ..data.frames import HOP_LENGTH, SAMPLE_RATE
from ..model.asr import ASRModel
from ..model.conformer import Conv2dSubsampling
from .model_export import (
    OPSET,
    SHERPA_FILES,
    TOLERANCE,
    ChunkGraph,
    CTCGraph,
    Exported,
    ExportError,
    Streaming,
    _building,
    _chunk_example,
    _first_line,
    _quiet_exporter,
    _refuse_foreign,
    _stream_windows,
    _swap_in,
    export_onnx,
    max_difference,
    onnx_runner,
)
from .recognizer import Recognizer

__all__ = [
    "SHERPA_FORMAT",
    "SHERPA_FRONTEND",
    "WENET_CHUNK_INPUTS",
    "WENET_CHUNK_OUTPUTS",
    "WenetChunkGraph",
    "export_sherpa_onnx",
    "export_wenet_chunk_onnx",
    "sherpa_metadata",
    "sherpa_stream_difference",
    "streaming_metadata",
    "tail_seconds",
    "tokens",
]

SHERPA_FORMAT = "sherpa-onnx"  # --format
SHERPA_FRONTEND = "kaldi_fbank"  # the ModelConfig.frontend sherpa-onnx computes for WeNet models
# model-streaming.onnx's inputs and outputs, in the order sherpa-onnx passes and reads them (it
# goes by position; the names are WeNet's, as sherpa-onnx's scripts/wenet/export-onnx-streaming.py
# writes them)
WENET_CHUNK_INPUTS = ("x", "offset", "required_cache_size", "attn_cache", "conv_cache",
                      "attn_mask")
WENET_CHUNK_OUTPUTS = ("log_probs", "next_att_cache", "next_conv_cache")
FRAME_MS = Conv2dSubsampling.STRIDE * HOP_LENGTH * 1000 // SAMPLE_RATE  # an encoder frame: 40 ms


def export_sherpa_onnx(checkpoint: str | Path, out_dir: str | Path,
                       streaming: Streaming | None = None) -> list[Exported]:
    """Export ``checkpoint`` into ``out_dir`` as a sherpa-onnx folder (see the module): for a
    model trained with causal_conv also model-streaming.onnx, for the chunks of ``streaming``
    (default ``Streaming()``: 16 frames, 4 left chunks, sherpa-onnx's own defaults). Raises
    ``CheckpointError`` for a checkpoint that holds no usable model and ``ExportError`` (one line)
    for a model of another front-end than ``SHERPA_FRONTEND``, for ``streaming`` asked of a model
    that cannot stream or a streaming model of cmvn "utterance" (sherpa-onnx keeps no running
    mean), when the export or its check fails, or ``out_dir`` holds files no export writes."""
    out_dir = Path(os.path.realpath(out_dir))
    _refuse_foreign(out_dir)
    recognizer = Recognizer.from_checkpoint(checkpoint)  # CPU, eval mode
    cfg = recognizer.model.cfg
    if cfg.frontend != SHERPA_FRONTEND:
        raise ExportError(
            f"{checkpoint} was trained on --frontend {cfg.frontend} features, which sherpa-onnx"
            f" does not compute: train with --frontend {SHERPA_FRONTEND} for a sherpa-onnx export"
        )
    if streaming is not None and not cfg.causal_conv:
        raise ExportError(
            f"{checkpoint} was trained without --causal_conv: its convolutions look at later"
            " frames, so it cannot stream; train with --causal_conv --dynamic_chunk for a"
            " streaming model"
        )
    streams = cfg.causal_conv
    if streams and cfg.cmvn == "utterance":
        raise ExportError(
            f"{checkpoint} normalizes by each utterance's mean (--cmvn utterance), which"
            " sherpa-onnx's streaming recognizer does not keep: train with --cmvn global for a"
            " sherpa-onnx export"
        )
    import onnx

    graph = FlooredCTCGraph(recognizer.model)
    with _building(out_dir) as tmp:
        path = tmp / SHERPA_FILES["onnx"]
        export_onnx(graph, path)
        _set_metadata(onnx, path, sherpa_metadata(recognizer.model))
        written = [Exported(out_dir / path.name, max_difference(onnx_runner(path), graph))]
        if streams:
            chunk_graph = WenetChunkGraph(ChunkGraph(recognizer.model, streaming or Streaming()))
            path = tmp / SHERPA_FILES["streaming"]
            export_wenet_chunk_onnx(chunk_graph, path)
            _set_metadata(onnx, path, streaming_metadata(chunk_graph))
            written.append(Exported(out_dir / path.name,
                                    sherpa_stream_difference(path, chunk_graph)))
        (tmp / SHERPA_FILES["tokens"]).write_text(tokens(recognizer.tokenizer), encoding="utf-8")
        (tmp / SHERPA_FILES["readme"]).write_text(
            readme(chunk_graph.streaming if streams else None), encoding="utf-8"
        )
        written += [Exported(out_dir / SHERPA_FILES["tokens"]),
                    Exported(out_dir / SHERPA_FILES["readme"])]
        _swap_in(tmp, out_dir)
    return written


def _set_metadata(onnx: Any, path: Path, metadata: dict[str, str]) -> None:
    model = onnx.load(str(path))
    onnx.helper.set_model_props(model, metadata)
    onnx.save(model, str(path))


def sherpa_metadata(model: ASRModel) -> dict[str, str]:
    """The ONNX metadata of model.onnx: what sherpa-onnx's OfflineWenetCtcModel reads
    (vocab_size, subsampling_factor; model_type picks the model class where the config does not),
    as WeNet's own export (sherpa-onnx's scripts/wenet/export-onnx.py) writes it, and the
    front-end and CMVN it was trained with, for a reader's information."""
    cfg = model.cfg
    return {
        "model_type": "wenet_ctc",
        "version": "1",
        "model_author": "konkanivani",
        "comment": "non-streaming",
        "subsampling_factor": str(Conv2dSubsampling.STRIDE),
        "vocab_size": str(cfg.vocab_size),
        "frontend": cfg.frontend,
        "n_mels": str(cfg.n_mels),
        "cmvn": f"{cfg.cmvn}, inside the graph",
    }


class FlooredCTCGraph(CTCGraph):
    """model.onnx: ``CTCGraph`` of the features floored at ``KALDI_FLOOR`` first, as
    ``KaldiFbank`` floors them (sherpa-onnx computes them without the floor)."""

    def forward(self, features: torch.Tensor, feature_lengths: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        return super().forward(features.clamp_min(KALDI_FLOOR), feature_lengths)


class WenetChunkGraph(nn.Module):
    """``ChunkGraph`` (one chunk of a stream through CMVN, the encoder and the CTC head, caches of
    a fixed size) with the signature of a WeNet streaming CTC model, as sherpa-onnx's
    OnlineWenetCtcModel (sherpa-onnx/csrc/online-wenet-ctc-model.cc) drives it: the graph of
    model-streaming.onnx.

    sherpa-onnx computes the Kaldi filterbanks of the stream and gives the graph windows of
    ``ChunkLength`` = (C - 1) * subsampling_factor + right_context + 1 frames every
    ``ChunkShift`` = C * subsampling_factor frames: with subsampling_factor 4 and right_context 6
    (``Conv2dSubsampling.RECEPTIVE_FIELD`` - 1) those are ``ChunkGraph.window_frames`` and
    ``window_hop``, our ``Stream``'s windows. It keeps the caches the graph gives back, and an
    offset it starts at L = C * left_chunks (``required_cache_size``) and moves on by the
    log-probabilities' frames, and builds the attention mask from it: the first L - k * C cache
    rows masked at chunk k < left_chunks.

    With N blocks, H heads of width d, model width D, K = ``conv_kernel - 1``:

    Args:
        x: ``(1, W, F)`` raw Kaldi filterbank frames (CMVN is in the graph), W = window_frames.
        offset: ``(1,)`` int64, L + the encoder frames of the stream so far.
        required_cache_size: ``(1,)`` int64, L.
        attn_cache: ``(N, H, L, 2d)``, each block's keys (rotated) and values side by side on the
            last axis (WeNet's layout; ``ChunkGraph``'s is ``(N, 2, H, L, d)``).
        conv_cache: ``(N, 1, D, K)`` (WeNet's layout; ``ChunkGraph``'s is ``(N, K, D)``).
        attn_mask: ``(1, 1, L + C)`` bool, the cache rows and chunk frames to attend to.
    Returns:
        ``(1, C, V)`` CTC log-probabilities, the next ``attn_cache`` and ``conv_cache``.
    """

    def __init__(self, chunk: ChunkGraph):
        super().__init__()
        self.chunk = chunk
        self.streaming = chunk.streaming
        self.eval()

    def initial_inputs(self) -> dict[str, torch.Tensor]:
        """The inputs but ``x`` of a stream's first chunk, as sherpa-onnx makes them."""
        past, chunk = self.chunk.cache_frames, self.streaming.chunk_size
        caches = self.chunk.initial_caches()
        return {
            "offset": torch.tensor([past]),
            "required_cache_size": torch.tensor([past]),
            "attn_cache": self._attn_cache(caches["attention_cache"]),
            "conv_cache": self._conv_cache(caches["conv_cache"]),
            "attn_mask": wenet_mask(past, past, chunk, self.streaming.left_chunks),
        }

    def forward(self, x: torch.Tensor, offset: torch.Tensor, required_cache_size: torch.Tensor,
                attn_cache: torch.Tensor, conv_cache: torch.Tensor, attn_mask: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        past = self.chunk.cache_frames
        keys, values = attn_cache.chunk(2, dim=-1)  # (N, H, L, d) each
        log_probs, _, next_attention, next_conv = self.chunk.encode(
            x.clamp_min(KALDI_FLOOR), offset[0] - required_cache_size[0], attn_mask[0, 0, :past],
            torch.stack([keys, values], dim=1), conv_cache[:, 0].transpose(1, 2),
        )
        return log_probs, self._attn_cache(next_attention), self._conv_cache(next_conv)

    @staticmethod
    def _attn_cache(cache: torch.Tensor) -> torch.Tensor:
        """``ChunkGraph``'s ``(N, 2, H, L, d)`` in WeNet's ``(N, H, L, 2d)``."""
        return torch.cat([cache[:, 0], cache[:, 1]], dim=-1)

    @staticmethod
    def _conv_cache(cache: torch.Tensor) -> torch.Tensor:
        """``ChunkGraph``'s ``(N, K, D)`` in WeNet's ``(N, 1, D, K)``."""
        return cache.transpose(1, 2)[:, None]


def wenet_mask(offset: int, past: int, chunk: int, left_chunks: int) -> torch.Tensor:
    """The ``(1, 1, L + C)`` attention mask sherpa-onnx gives the chunk at ``offset``
    (online-wenet-ctc-model.cc, ``Forward``)."""
    mask = torch.ones(1, 1, past + chunk, dtype=torch.bool)
    index = offset // chunk - left_chunks
    if index < left_chunks:
        mask[..., :past - index * chunk] = False
    return mask


def export_wenet_chunk_onnx(graph: WenetChunkGraph, path: str | Path) -> None:
    """Write ``graph`` to ``path`` as one ONNX file of fixed shapes (sherpa-onnx gives every chunk
    the same), inputs and outputs named ``WENET_CHUNK_INPUTS`` and ``WENET_CHUNK_OUTPUTS``."""
    chunk = graph.chunk
    example = _chunk_example(chunk, torch.Generator().manual_seed(0), chunk.window_frames)
    inputs = {"x": example["features"], **graph.initial_inputs()}
    try:
        with _quiet_exporter(), torch.no_grad():
            torch.onnx.export(
                graph, (), str(path), kwargs=inputs, dynamo=True, opset_version=OPSET,
                verbose=False, external_data=False, input_names=list(WENET_CHUNK_INPUTS),
                output_names=list(WENET_CHUNK_OUTPUTS),
            )
    except Exception as e:
        raise ExportError(
            f"ONNX export of the streaming model failed ({type(e).__name__}: {_first_line(e)})"
        ) from e


def sherpa_stream_difference(path: str | Path, graph: WenetChunkGraph,
                             chunks: int | None = None) -> float:
    """The largest |log-prob difference| between the ONNX file at ``path`` driven as sherpa-onnx
    drives it (offset, mask and caches as ``WenetChunkGraph`` says) and
    ``ConformerEncoder.forward_chunk`` on the same full windows (``model_export``'s check stream:
    ``chunks`` chunks, default left_chunks + 2). ``ExportError`` if a shape differs or the
    difference exceeds ``TOLERANCE``."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    model, chunk = graph.chunk.model, graph.chunk
    inputs = {k: v.numpy() for k, v in graph.initial_inputs().items()}
    state, difference = None, 0.0
    for window in _stream_windows(chunk, chunks, seed=1):
        # features as KaldiFbank gives them (floored; the graph floors its input again)
        features = window["features"].clamp_min(KALDI_FLOOR)
        if features.shape[1] < chunk.window_frames:  # sherpa-onnx gives full windows only
            break
        offset = int(inputs["offset"][0])
        inputs["attn_mask"] = wenet_mask(offset, chunk.cache_frames, graph.streaming.chunk_size,
                                         graph.streaming.left_chunks).numpy()
        log_probs, attn_cache, conv_cache = session.run(
            None, {"x": features.numpy(), **inputs}
        )
        with torch.no_grad():
            enc, state = model.encoder.forward_chunk(
                model.normalize(features), state, chunk.cache_frames
            )
            expected = model.ctc_log_probs(enc)
        if log_probs.shape != expected.shape:
            raise ExportError(
                f"the exported streaming model gives log-probs {log_probs.shape} for a window"
                f" where the model gives {tuple(expected.shape)}"
            )
        difference = max(difference, float((torch.from_numpy(log_probs) - expected).abs().max()))
        inputs.update(offset=inputs["offset"] + log_probs.shape[1], attn_cache=attn_cache,
                      conv_cache=conv_cache)
    if not difference <= TOLERANCE:  # NaN fails too
        raise ExportError(
            "the exported streaming model's log-probs differ from the model's chunk by chunk by"
            f" up to {difference:.3g} (tolerance {TOLERANCE})"
        )
    return difference


def streaming_metadata(graph: WenetChunkGraph) -> dict[str, str]:
    """The ONNX metadata of model-streaming.onnx: what sherpa-onnx's OnlineWenetCtcModel reads
    (head, num_blocks, output_size, cnn_module_kernel, right_context, subsampling_factor,
    vocab_size), the chunk_size and left_chunks it was exported for (which the recognizer must be
    given: sherpa-onnx takes them from its config), as sherpa-onnx's
    scripts/wenet/export-onnx-streaming.py writes them, and the front-end and CMVN."""
    cfg = graph.chunk.model.cfg
    return {
        **sherpa_metadata(graph.chunk.model),
        "comment": "streaming",
        "chunk_size": str(graph.streaming.chunk_size),
        "left_chunks": str(graph.streaming.left_chunks),
        "head": str(cfg.n_heads),
        "num_blocks": str(cfg.encoder_layers),
        "output_size": str(cfg.d_model),
        "cnn_module_kernel": str(cfg.conv_kernel),
        "right_context": str(Conv2dSubsampling.RECEPTIVE_FIELD - 1),
    }


def tokens(tokenizer: Any) -> str:
    """tokens.txt: "piece id" a line for every id, as sherpa-onnx's SymbolTable reads it (it finds
    the blank by its name, <blank>, our id 0, and turns a leading ▁ into a space)."""
    pieces = tokenizer.pieces(range(tokenizer.vocab_size))
    return "".join(f"{piece} {i}\n" for i, piece in enumerate(pieces))


def readme(streaming: Streaming | None) -> str:
    """README.md: how to load the folder; with ``streaming``, its streaming model too."""
    if streaming is None:
        return README
    return README + STREAMING_README.format(
        chunk=streaming.chunk_size, ms=streaming.chunk_size * FRAME_MS, left=streaming.left_chunks,
        tail=tail_seconds(streaming),
    )


def tail_seconds(streaming: Streaming) -> float:
    """The silence to feed sherpa-onnx's online recognizer after a stream's audio so that it decodes
    every chunk our ``Stream`` does (0.66 s for chunks of 16): it decodes a chunk only when a frame
    after its window has come and never a shorter last one, where ours decodes down to a last
    window of ``RECEPTIVE_FIELD`` frames, up to 4C - 3 frames before the end."""
    return (Conv2dSubsampling.STRIDE * streaming.chunk_size + 2) * HOP_LENGTH / SAMPLE_RATE


README = """\
# A konkanivani model for sherpa-onnx

`model.onnx` and `tokens.txt` are a WeNet-style CTC model for
[sherpa-onnx](https://github.com/k2-fsa/sherpa-onnx)'s offline recognizer: 16 kHz mono audio in,
text out, greedy CTC search. sherpa-onnx computes the features (Kaldi filterbanks, 80 bins) and
the model normalizes them itself.

## Python

```python
import sherpa_onnx
import soundfile as sf

recognizer = sherpa_onnx.OfflineRecognizer.from_wenet_ctc(
    model="model.onnx", tokens="tokens.txt", num_threads=1
)
samples, sample_rate = sf.read("audio.wav", dtype="float32")  # mono, in [-1, 1]
stream = recognizer.create_stream()
stream.accept_waveform(sample_rate, samples)
recognizer.decode_stream(stream)
print(stream.result.text)
```

## C++ (sherpa-onnx's cxx-api)

```cpp
#include "sherpa-onnx/c-api/cxx-api.h"

using namespace sherpa_onnx::cxx;

OfflineRecognizerConfig config;
config.model_config.wenet_ctc.model = "model.onnx";
config.model_config.tokens = "tokens.txt";
config.model_config.num_threads = 1;
OfflineRecognizer recognizer = OfflineRecognizer::Create(config);
Wave wave = ReadWave("audio.wav");
OfflineStream stream = recognizer.CreateStream();
stream.AcceptWaveform(wave.sample_rate, wave.samples.data(), wave.samples.size());
recognizer.Decode(&stream);
std::cout << recognizer.GetResult(&stream).text << "\\n";
```

The other bindings (Kotlin/Java for Android, Swift for iOS, JavaScript and WebAssembly, Go, C#,
Rust, ...) take the same two files as a "WeNet CTC" model: see sherpa-onnx's `*wenet-ctc*`
examples.
"""

STREAMING_README = """
## Streaming (model-streaming.onnx)

`model-streaming.onnx` is the same model for sherpa-onnx's online (streaming) recognizer, in
chunks of {chunk} encoder frames ({ms} ms) that see {left} chunks back. Its caches are of
that size: give the recognizer the same `chunk_size` and `num_left_chunks` (the file's metadata
holds them); another chunk is refused by onnxruntime (a shape error).

sherpa-onnx decodes a chunk once the audio after it has come, and never a last partial one: after
the last samples, feed {tail} s of silence (sherpa-onnx's examples feed 0.66 s), or up to the
last {tail} s of speech go undecoded.

```python
import numpy as np
import sherpa_onnx
import soundfile as sf

recognizer = sherpa_onnx.OnlineRecognizer.from_wenet_ctc(
    model="model-streaming.onnx", tokens="tokens.txt", chunk_size={chunk}, num_left_chunks={left},
    num_threads=1,
)
samples, sample_rate = sf.read("audio.wav", dtype="float32")  # or pieces from a microphone
stream = recognizer.create_stream()
stream.accept_waveform(sample_rate, samples)
stream.accept_waveform(sample_rate, np.zeros(int({tail} * sample_rate), dtype=np.float32))
stream.input_finished()
while recognizer.is_ready(stream):
    recognizer.decode_stream(stream)
print(recognizer.get_result(stream))
```

sherpa-onnx's online WeNet CTC model is in its Python bindings and its C++ library and
command-line tools (built from source), not in its C API nor the bindings over it (Kotlin/Java,
Swift, JavaScript/WebAssembly, Go, C#): there, use `model.onnx` (an offline recognizer, with a VAD
for "simulated streaming" as sherpa-onnx's Android and iOS examples do). The C++ tool:

```bash
sherpa-onnx --tokens=tokens.txt --wenet-ctc-model=model-streaming.onnx \\
    --wenet-ctc-chunk-size={chunk} --wenet-ctc-num-left-chunks={left} --num-threads=1 \\
    --left-padding=0 --right-padding={tail} audio.wav
```

(its default 0.5 s of silence before the audio changes the text; `--right-padding` is the tail.)
"""
