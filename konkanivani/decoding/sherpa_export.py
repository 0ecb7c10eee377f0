"""A checkpoint as a sherpa-onnx model folder (``konkanivani-export --format sherpa-onnx``), for
sherpa-onnx's WeNet CTC recognizers: its Python wheel, C/C++ API, Android, iOS and WebAssembly
apps and its other language bindings run it without this package.

The folder holds::

    model.onnx    CMVN, the encoder and the CTC head (``CTCGraph``, the graph of model.onnx in an
                  ONNX export): features (1, T, n_mels) float32 and their lengths (1,) int64 in,
                  CTC log-probabilities (1, T', V) and their lengths (1,) int64 out, with the ONNX
                  metadata sherpa-onnx's offline WeNet CTC model reads (``sherpa_metadata``)
    tokens.txt    "piece id" a line, the tokenizer's pieces, blank (<blank>) at id 0
    README.md     how to load it in Python and C++

sherpa-onnx computes the features itself: Kaldi filterbanks of the samples scaled to 16-bit
integers, what ``features.KaldiFbank`` computes (sherpa-onnx/csrc/features.h's defaults with
normalize_samples false, offline-recognizer-ctc-impl.h). A model trained on another front-end
(``--frontend log_mel``, the default) would see other features there; it is refused, before
anything is written. The folder is built and swapped in as any export's
(``model_export._building``, ``_swap_in``).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..model.asr import ASRModel
from ..model.conformer import Conv2dSubsampling
from .model_export import (
    SHERPA_FILES,
    CTCGraph,
    Exported,
    ExportError,
    _building,
    _refuse_foreign,
    _swap_in,
    export_onnx,
    max_difference,
    onnx_runner,
)
from .recognizer import Recognizer

__all__ = ["SHERPA_FORMAT", "SHERPA_FRONTEND", "export_sherpa_onnx", "sherpa_metadata", "tokens"]

SHERPA_FORMAT = "sherpa-onnx"  # --format
SHERPA_FRONTEND = "kaldi_fbank"  # the ModelConfig.frontend sherpa-onnx computes for WeNet models


def export_sherpa_onnx(checkpoint: str | Path, out_dir: str | Path) -> list[Exported]:
    """Export ``checkpoint`` into ``out_dir`` as a sherpa-onnx folder (see the module). Raises
    ``CheckpointError`` for a checkpoint that holds no usable model and ``ExportError`` (one line)
    for a model of another front-end than ``SHERPA_FRONTEND``, when the export or its check
    fails, or ``out_dir`` holds files no export writes."""
    out_dir = Path(os.path.realpath(out_dir))
    _refuse_foreign(out_dir)
    recognizer = Recognizer.from_checkpoint(checkpoint)  # CPU, eval mode
    frontend = recognizer.model.cfg.frontend
    if frontend != SHERPA_FRONTEND:
        raise ExportError(
            f"{checkpoint} was trained on --frontend {frontend} features, which sherpa-onnx does"
            f" not compute: train with --frontend {SHERPA_FRONTEND} for a sherpa-onnx export"
        )
    import onnx

    graph = CTCGraph(recognizer.model)
    with _building(out_dir) as tmp:
        path = tmp / SHERPA_FILES["onnx"]
        export_onnx(graph, path)
        model = onnx.load(str(path))
        onnx.helper.set_model_props(model, sherpa_metadata(recognizer.model))
        onnx.save(model, str(path))
        written = [Exported(out_dir / path.name, max_difference(onnx_runner(path), graph))]
        (tmp / SHERPA_FILES["tokens"]).write_text(tokens(recognizer.tokenizer), encoding="utf-8")
        (tmp / SHERPA_FILES["readme"]).write_text(README, encoding="utf-8")
        written += [Exported(out_dir / SHERPA_FILES["tokens"]),
                    Exported(out_dir / SHERPA_FILES["readme"])]
        _swap_in(tmp, out_dir)
    return written


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


def tokens(tokenizer: Any) -> str:
    """tokens.txt: "piece id" a line for every id, as sherpa-onnx's SymbolTable reads it (it finds
    the blank by its name, <blank>, our id 0, and turns a leading ▁ into a space)."""
    pieces = tokenizer.pieces(range(tokenizer.vocab_size))
    return "".join(f"{piece} {i}\n" for i, piece in enumerate(pieces))


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
