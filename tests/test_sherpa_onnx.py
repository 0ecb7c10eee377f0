"""konkanivani-export --format sherpa-onnx, run by the real runtime: the sherpa-onnx wheel's
offline WeNet CTC recognizer computes the features of ``--frontend kaldi_fbank`` and decodes an
exported tone model to the text our own greedy CTC search gives; its online one decodes the
streaming model of a streaming checkpoint to the text of our stream's greedy search."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import soundfile as sf
import torch
from serve_helpers import tone_checkpoint
from tone_speech import SENTENCES, speech

from konkanivani.checkpoint import save_checkpoint
from konkanivani.cli import export as export_cli
from konkanivani.config import model_config_from_preset
from konkanivani.data.features import KALDI_FLOOR, KaldiFbank, LogMel
from konkanivani.data.tokenizer import train_tokenizer
from konkanivani.decoding.model_export import Streaming
from konkanivani.decoding.recognizer import Recognizer
from konkanivani.decoding.sherpa_export import WENET_CHUNK_INPUTS, tail_seconds
from konkanivani.decoding.streaming import StreamingKaldiFbank
from konkanivani.model.asr import ASRModel

sherpa_onnx = pytest.importorskip("sherpa_onnx")


def _checkpoint(path, frontend, **overrides):
    tokenizer = train_tokenizer(SENTENCES, vocab_size=16, model_type="char")
    cfg = model_config_from_preset("tiny", vocab_size=tokenizer.vocab_size, frontend=frontend,
                                   **overrides)
    return save_checkpoint({"model_config": dataclasses.asdict(cfg),
                            "model": ASRModel(cfg).state_dict(),
                            "tokenizer": tokenizer.model_proto}, path)


def _status(argv):
    try:
        return export_cli.main(argv)
    except SystemExit as e:
        return e.code


def _sherpa_text(recognizer, path):
    samples, rate = sf.read(path, dtype="float32")
    stream = recognizer.create_stream()
    stream.accept_waveform(rate, samples)
    recognizer.decode_stream(stream)
    return stream.result.text


def test_sherpa_onnx_computes_the_kaldi_fbank_features(tmp_path):
    """A graph that hands its input features on as "log-probabilities", floored at KALDI_FLOOR as
    the exported graphs floor them: sherpa-onnx's greedy search over them is the argmax of each
    frame, the same as over ours on every frame, the half seconds of digital silence around each
    file included, which the offline recognizer's dither (1 in 16-bit units) turns into noise below
    the floor."""
    import onnx

    class Identity(torch.nn.Module):
        def forward(self, x, x_lens):
            return x.clamp_min(KALDI_FLOOR), x_lens * 1

    path = tmp_path / "identity.onnx"
    torch.onnx.export(Identity(), (torch.randn(1, 50, 80), torch.tensor([50])), str(path),
                      input_names=["x", "x_lens"], output_names=["y", "y_lens"],
                      dynamic_axes={"x": {1: "T"}}, dynamo=False)
    model = onnx.load(str(path))
    onnx.helper.set_model_props(
        model, {"model_type": "wenet_ctc", "vocab_size": "80", "subsampling_factor": "1"}
    )
    onnx.save(model, str(path))
    tokens = tmp_path / "tokens.txt"
    tokens.write_text("<blank> 0\n" + "".join(f"t{i} {i}\n" for i in range(1, 80)))
    recognizer = sherpa_onnx.OfflineRecognizer.from_wenet_ctc(model=str(path), tokens=str(tokens))
    fbank = KaldiFbank(80)
    for seed in range(3):
        wav = speech(SENTENCES[seed], seed=seed)
        wav = wav + 0.05 * torch.randn(len(wav), generator=torch.Generator().manual_seed(seed))
        wav = (wav * 32768).round().clamp(-32768, 32767) / 32768  # what a 16-bit file holds
        wav = torch.cat([torch.zeros(8000), wav, torch.zeros(8000)])
        audio = tmp_path / f"{seed}.wav"
        sf.write(audio, wav.numpy(), 16000, subtype="PCM_16")
        ids = torch.unique_consecutive(fbank(wav).argmax(-1)).tolist()
        expected = " ".join(f"t{i}" for i in ids if i)
        stream = recognizer.create_stream()
        stream.accept_waveform(16000, sf.read(audio, dtype="float32")[0])
        recognizer.decode_stream(stream)
        assert " ".join(stream.result.tokens) == expected
        assert len(stream.result.timestamps) == len(ids) - ids.count(0)


def test_kaldi_fbank_frames_and_their_stream():
    """(N + 80) // 160 frames, 7 (one encoder frame) from 1040 samples; the stream's frames, in
    pieces of any size, are the whole waveform's."""
    fbank = KaldiFbank(80)
    assert (fbank.min_samples, LogMel(80).min_samples) == (1040, 960)
    generator = torch.Generator().manual_seed(0)
    for n in (1040, 1039, 16079, 16080, 23456):
        wav = 0.1 * torch.randn(n, generator=generator)
        whole = fbank(wav)
        assert len(whole) == fbank.frames(n) == (n + 80) // 160
        stream, parts, start = StreamingKaldiFbank(fbank), [], 0
        while start < n:
            size = int(torch.randint(1, 700, (1,), generator=generator))
            parts.append(stream.accept(wav[start:start + size]))
            start += size
        streamed = torch.cat([*parts, stream.finish()])
        assert streamed.shape == whole.shape and torch.allclose(streamed, whole, atol=1e-4)


def test_a_log_mel_model_is_refused_in_one_line(tmp_path, capsys):
    checkpoint = _checkpoint(tmp_path / "log_mel.pt", "log_mel")
    out = tmp_path / "sherpa"
    assert _status([str(checkpoint), "--format", "sherpa-onnx", "--output_dir", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "train with --frontend kaldi_fbank" in err
    assert not out.exists()


@pytest.mark.parametrize("overrides, flags, why", [
    ({}, ["--streaming"], "trained without --causal_conv"),
    ({"causal_conv": True, "cmvn": "utterance"}, [], "train with --cmvn global"),
])
def test_what_cannot_stream_in_sherpa_onnx_is_refused_in_one_line(tmp_path, capsys, overrides,
                                                                   flags, why):
    checkpoint = _checkpoint(tmp_path / "kaldi.pt", "kaldi_fbank", **overrides)
    out = tmp_path / "sherpa"
    argv = [str(checkpoint), "--format", "sherpa-onnx", "--output_dir", str(out), *flags]
    assert _status(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and why in err
    assert not out.exists()


@pytest.mark.slow
def test_sherpa_onnx_decodes_an_export_as_we_do(tmp_path, capsys):
    """A tone model trained on kaldi_fbank features, exported: sherpa-onnx's offline recognizer and
    our greedy CTC search give the same text for each file, and it is the sentence."""
    checkpoint = tone_checkpoint(tmp_path / "tone.pt", streaming=False, frontend="kaldi_fbank")
    out = tmp_path / "sherpa"
    assert _status([str(checkpoint), "--format", "sherpa-onnx", "--output_dir", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "model.onnx", "tokens.txt"]
    lines = (out / "tokens.txt").read_text(encoding="utf-8").splitlines()
    assert lines[0] == "<blank> 0" and lines[-1].split()[-1] == str(len(lines) - 1)
    import onnx

    metadata = {p.key: p.value for p in onnx.load(str(out / "model.onnx")).metadata_props}
    assert metadata["model_type"] == "wenet_ctc" and metadata["subsampling_factor"] == "4"
    assert metadata["vocab_size"] == str(len(lines))
    ours = Recognizer.from_checkpoint(checkpoint)
    theirs = sherpa_onnx.OfflineRecognizer.from_wenet_ctc(
        model=str(out / "model.onnx"), tokens=str(out / "tokens.txt"), num_threads=1
    )
    paths = []
    for i, sentence in enumerate(SENTENCES):
        paths.append(tmp_path / f"{i}.wav")
        sf.write(paths[-1], speech(sentence, seed=i).numpy(), 16000, subtype="PCM_16")
    texts = [t.text for t in ours.transcribe(paths, method="greedy")]
    assert [_sherpa_text(theirs, p) for p in paths] == texts == SENTENCES


@pytest.mark.slow
def test_sherpa_onnx_streams_an_export_as_we_do(tmp_path, capsys):
    """A streaming tone model (causal convolutions, dynamic chunks) trained on kaldi_fbank
    features, exported at the default chunks (16 frames, 4 left chunks, sherpa-onnx's defaults
    too): sherpa-onnx's online recognizer, fed a file and the tail of silence it needs to decode
    the last chunk (``tail_seconds``), gives the text of our stream's greedy search over the same
    samples, on the sentences it learned and on others it did not (whatever it makes of them).
    sherpa-onnx's Python ``get_result`` strips the text's spaces at both ends; ours keeps a
    trailing one where the last token is a word boundary."""
    checkpoint = tone_checkpoint(tmp_path / "tone.pt", streaming=True, frontend="kaldi_fbank")
    out = tmp_path / "sherpa"
    assert _status([str(checkpoint), "--format", "sherpa-onnx", "--output_dir", str(out)]) == 0
    assert "model-streaming.onnx (log-probs within" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md", "model-streaming.onnx", "model.onnx", "tokens.txt"
    ]
    import onnx

    model = onnx.load(str(out / "model-streaming.onnx"))
    metadata = {p.key: p.value for p in model.metadata_props}
    streaming = Streaming()
    assert {k: metadata[k] for k in ("model_type", "chunk_size", "left_chunks", "right_context",
                                     "subsampling_factor")} == {
        "model_type": "wenet_ctc", "chunk_size": str(streaming.chunk_size),
        "left_chunks": str(streaming.left_chunks), "right_context": "6",
        "subsampling_factor": "4"}
    assert tuple(i.name for i in model.graph.input) == WENET_CHUNK_INPUTS
    assert "chunk_size=16, num_left_chunks=4" in (out / "README.md").read_text(encoding="utf-8")
    ours = Recognizer.from_checkpoint(checkpoint)
    theirs = sherpa_onnx.OnlineRecognizer.from_wenet_ctc(
        model=str(out / "model-streaming.onnx"), tokens=str(out / "tokens.txt"),
        chunk_size=streaming.chunk_size, num_left_chunks=streaming.left_chunks, num_threads=1,
    )
    tail = np.zeros(round(tail_seconds(streaming) * 16000), dtype=np.float32)
    texts = []
    for i, sentence in enumerate([*SENTENCES, "abc de fed", "cab bad", "e"]):
        path = tmp_path / f"{i}.wav"
        sf.write(path, speech(sentence, seed=i).numpy(), 16000, subtype="PCM_16")
        samples = np.concatenate([sf.read(path, dtype="float32")[0], tail])
        stream = ours.stream(chunk_size=streaming.chunk_size, left_chunks=streaming.left_chunks,
                             method="greedy", endpoint_ms=0)
        results = stream.accept(torch.from_numpy(samples)) + stream.finish()
        (result,) = [r for r in results if r.is_final]  # one segment: no endpoints
        sherpa_stream = theirs.create_stream()
        sherpa_stream.accept_waveform(16000, samples)
        sherpa_stream.input_finished()
        while theirs.is_ready(sherpa_stream):
            theirs.decode_stream(sherpa_stream)
        assert theirs.get_result(sherpa_stream) == result.text.strip()
        texts.append(result.text.strip())
    assert texts[:len(SENTENCES)] == SENTENCES


def test_silence_and_the_offline_dither_give_the_floor():
    """Every bin of digital silence, and of sherpa-onnx's offline dither alone (1 in 16-bit units,
    five seconds of it), is KALDI_FLOOR: the features sherpa-onnx's graph sees after its own floor
    are ours wherever a file is silent."""
    fbank = KaldiFbank(80)
    dither = torch.randn(80000, generator=torch.Generator().manual_seed(0)) / 32768
    assert (fbank(torch.zeros(16000)) == KALDI_FLOOR).all()
    assert (fbank(dither) == KALDI_FLOOR).all()
    assert (fbank(speech(SENTENCES[0])) > KALDI_FLOOR).float().mean() > 0.5
