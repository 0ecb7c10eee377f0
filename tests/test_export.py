"""konkanivani-export: ONNX and TorchScript files of a tiny trained model, run outside the package's
model code (onnxruntime, torch.jit.load) and compared with the PyTorch model and the Recognizer; the
streaming graph (--streaming) run chunk by chunk and compared with the model's chunk-by-chunk
encoding."""

import copy
import dataclasses
import doctest
import json
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
import torchaudio
from decode_helpers import decode_features
from konkani_texts import TEXTS
from scipy.signal import resample_poly
from tiny_args import tiny_args

from konkanivani.checkpoint import load_checkpoint, save_checkpoint
from konkanivani.cli import export as export_cli
from konkanivani.cli import train as train_cli
from konkanivani.config import model_config_from_preset
from konkanivani.data.audio import load_audio
from konkanivani.data.features import KaldiFbank, LogMel
from konkanivani.data.frames import subsampled_lengths
from konkanivani.data.manifest import read_manifest
from konkanivani.data.tokenizer import SOS_EOS_ID, UNK_ID, train_tokenizer
from konkanivani.decoding import model_export as export_module
from konkanivani.decoding.model_export import (
    CHUNK_OUTPUTS,
    FILES,
    MIN_FRAMES,
    STREAMING_FILES,
    ChunkGraph,
    CTCGraph,
    ExportError,
    Streaming,
    chunk_runner,
    export_checkpoint,
    export_chunk_onnx,
    feature_settings,
    max_difference,
    onnx_runner,
    stream_difference,
    torchscript_runner,
    vocabulary,
)
from konkanivani.decoding.recognizer import Recognizer
from konkanivani.decoding.search import ctc_greedy
from konkanivani.model.asr import ASRModel
from konkanivani.model.conformer import feature_windows

ROOT = Path(__file__).resolve().parents[1]
RUNNERS = {"onnx": onnx_runner, "torchscript": torchscript_runner}
# |log-prob| difference allowed from PyTorch; observed: ONNX up to 1.5e-5, TorchScript 0
ATOL = 1e-4


def join_pieces(ids, vocab):
    """Text of token ids as vocabulary.json says (and the snippet in docs/decoding.md does)."""
    ids = [i for i in ids if i not in (vocab["blank_id"], vocab["sos_eos_id"])]
    boundary = vocab["word_boundary"]
    return "".join(vocab["pieces"][i] for i in ids).lstrip(boundary).replace(boundary, " ")


# --- without a trained model ---------------------------------------------------------------------

@pytest.mark.parametrize("model_type", ["unigram", "char"])
def test_vocabulary_joins_pieces_into_the_tokenizers_text(model_type):
    tokenizer = train_tokenizer(TEXTS, vocab_size=40, model_type=model_type)
    vocab = json.loads(json.dumps(vocabulary(tokenizer)))
    assert vocab["pieces"][:3] == ["<blank>", "<unk>", "<sos/eos>"] and vocab["blank_id"] == 0
    assert len(vocab["pieces"]) == tokenizer.vocab_size
    rng = random.Random(0)
    boundary = vocab["pieces"].index(vocab["word_boundary"])
    # <unk> reads " ⁇ " in SentencePiece's text
    ordinary = [i for i in range(tokenizer.vocab_size) if i != UNK_ID]
    for _ in range(2000):
        ids = [rng.choice([boundary, *ordinary]) for _ in range(rng.randrange(8))]
        assert join_pieces(ids, vocab) == tokenizer.decode(ids), tokenizer.pieces(ids)


def test_feature_settings_rebuild_the_package_features_exactly():
    log_mel = LogMel(80)
    settings = json.loads(json.dumps(feature_settings(log_mel)))
    mel = torchaudio.transforms.MelSpectrogram(**settings["mel_spectrogram"])
    wav = 0.1 * torch.randn(12345, generator=torch.Generator().manual_seed(0))
    features = torch.log(mel(wav) + settings["log_offset"]).T
    assert torch.equal(features, log_mel(wav))
    assert features.shape == (
        1 + 12345 // settings["mel_spectrogram"]["hop_length"],
        settings["n_mels"],
    )
    formula = settings["output_lengths"].split("=", 1)[1]
    assert all(eval(formula, {"T": t}) == subsampled_lengths(t) for t in range(MIN_FRAMES, 500))
    assert subsampled_lengths(MIN_FRAMES) == 1 and subsampled_lengths(MIN_FRAMES - 1) == 0


def test_kaldi_feature_settings_rebuild_the_package_features_exactly():
    """Kaldi filterbanks as features.json says (its floor included), from digital silence too."""
    fbank = KaldiFbank(80)
    settings = json.loads(json.dumps(feature_settings(fbank)))
    wav = torch.cat([torch.zeros(4000), 0.1 * torch.randn(12345, generator=torch.Generator()
                                                          .manual_seed(0))])
    features = torchaudio.compliance.kaldi.fbank(
        wav[None] * settings["sample_scale"], **settings["kaldi_fbank"]
    ).clamp_min(settings["floor"])
    assert torch.equal(features, fbank(wav))
    assert features.shape == ((len(wav) + 80) // 160, settings["n_mels"])


def test_the_export_check_catches_a_graph_that_computes_something_else():
    graph = CTCGraph(ASRModel(model_config_from_preset("tiny", vocab_size=40)))
    assert max_difference(lambda f, n: graph(f, n), graph) == 0.0
    with pytest.raises(ExportError, match="differ from the model's by up to 0.01"):
        max_difference(lambda f, n: (graph(f, n)[0] + 0.01, graph(f, n)[1]), graph)
    with pytest.raises(ExportError, match="lengths"):
        max_difference(lambda f, n: (graph(f, n)[0], graph(f, n)[1] - 1), graph)


def test_per_utterance_cmvn_is_inside_both_exported_graphs(tmp_path):
    """The mean of the frames each length says are real, computed in the graph, at other batch
    sizes and lengths than the trace's (``export_checkpoint`` checks each file and raises if off).
    """
    tokenizer = train_tokenizer(TEXTS, vocab_size=40)
    cfg = model_config_from_preset("tiny", vocab_size=tokenizer.vocab_size, cmvn="utterance")
    torch.manual_seed(0)
    path = tmp_path / "model.pt"
    save_checkpoint({"model_config": dataclasses.asdict(cfg), "model": ASRModel(cfg).state_dict(),
                     "tokenizer": tokenizer.model_proto}, path)
    written = export_checkpoint(path, tmp_path / "out")
    runner = torchscript_runner(tmp_path / "out" / FILES["torchscript"])
    feats, lens = torch.randn(3, 90, 80), torch.tensor([90, 41, 12])
    feats[torch.arange(90) >= lens[:, None]] = 0.0
    louder = feats + 2.0 * (torch.arange(90) < lens[:, None])[..., None]
    assert torch.allclose(runner(louder, lens)[0], runner(feats, lens)[0], atol=1e-4)
    assert sorted(w.path.name for w in written if w.difference is not None) == sorted(
        [FILES["onnx"], FILES["torchscript"]]
    )


def test_a_self_conditioned_model_exports_with_its_conditioning(tmp_path):
    """The CTC posteriors added after the conditioning block are in both graphs
    (``export_checkpoint`` checks each file against the model and raises if off)."""
    tokenizer = train_tokenizer(TEXTS, vocab_size=40)
    cfg = model_config_from_preset("tiny", vocab_size=tokenizer.vocab_size,
                                   self_condition_layer=1)
    torch.manual_seed(0)
    model = ASRModel(cfg)
    with torch.no_grad():
        model.encoder.ctc_condition.mul_(50)  # a conditioning large enough to matter
    path = tmp_path / "model.pt"
    save_checkpoint({"model_config": dataclasses.asdict(cfg), "model": model.state_dict(),
                     "tokenizer": tokenizer.model_proto}, path)
    written = export_checkpoint(path, tmp_path / "out")
    assert sorted(w.path.name for w in written if w.difference is not None) == sorted(
        [FILES["onnx"], FILES["torchscript"]]
    )
    feats, lens = torch.randn(2, 90, 80), torch.tensor([90, 61])
    unconditioned = copy.deepcopy(model).eval()
    with torch.no_grad():
        unconditioned.encoder.ctc_condition.zero_()
    runner = onnx_runner(tmp_path / "out" / FILES["onnx"])
    assert not torch.allclose(runner(feats, lens)[0], CTCGraph(unconditioned)(feats, lens)[0],
                              atol=1e-2)
    # and int8 (the CTC head's weights are read twice in the graph; the export checks the file)
    int8 = export_checkpoint(path, tmp_path / "int8", formats=["onnx"], quantize="int8")
    assert [w.path.name for w in int8 if w.difference is not None] == [FILES["onnx"]]


@pytest.fixture(scope="module")
def untrained_checkpoint(tmp_path_factory):
    tokenizer = train_tokenizer(TEXTS, vocab_size=40)
    cfg = model_config_from_preset("tiny", vocab_size=tokenizer.vocab_size)
    path = tmp_path_factory.mktemp("untrained") / "model.pt"
    save_checkpoint({"model_config": dataclasses.asdict(cfg), "model": ASRModel(cfg).state_dict(),
                     "tokenizer": tokenizer.model_proto}, path)
    return path


def status(argv):
    """The exit status of konkanivani-export: main's return value, or the parser's SystemExit
    code."""
    try:
        return export_cli.main(argv)
    except SystemExit as e:
        return e.code


def one_error_line(capsys):
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and not captured.out, captured
    return lines[0]


def test_a_missing_foreign_or_broken_checkpoint_is_one_line_and_status_2(
    untrained_checkpoint, tmp_path, capsys
):
    assert status([str(tmp_path / "none.pt"), "--format", "torchscript"]) == 2
    assert "none.pt: file not found" in one_error_line(capsys)
    foreign = tmp_path / "foreign.pt"
    torch.save({"state_dict": {"w": torch.zeros(2)}}, foreign)
    assert status([str(foreign), "--format", "torchscript"]) == 2
    assert "is not a konkanivani checkpoint" in one_error_line(capsys)
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(untrained_checkpoint.read_bytes()[:5000])
    assert status([str(truncated), "--format", "torchscript"]) == 2
    assert "truncated, corrupt" in one_error_line(capsys)
    no_model = tmp_path / "no_model.pt"
    save_checkpoint({"model_config": {"vocab_size": 40}}, no_model)
    assert (
        status([str(no_model), "--format", "torchscript", "--output_dir", str(tmp_path / "out")])
        == 2
    )
    assert "does not hold a usable model" in one_error_line(capsys)
    assert not any((tmp_path / "out").glob("*"))
    assert status([str(untrained_checkpoint), "--output_dir", str(untrained_checkpoint)]) == 2
    assert "is not a folder" in one_error_line(capsys)


def test_without_the_onnx_packages_is_one_line_and_status_2(
    untrained_checkpoint, monkeypatch, capsys
):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *args: None if name == "onnxscript" else real_find_spec(name, *args),
    )
    for flags in (
        ["--format", "onnx"],
        ["--format", "both"],
        ["--format", "torchscript", "--streaming"],
    ):
        assert status([str(untrained_checkpoint), *flags]) == 2
        line = one_error_line(capsys)
        assert "needs onnxscript" in line and "pip install 'konkanivani[export]'" in line
    assert not (untrained_checkpoint.parent / "model_export").exists()


# --- the streaming graph, without a trained model -----------------------------------------------

def causal_model(**kw):
    """An untrained tiny model with causal convolutions and CMVN statistics away from 0 and 1."""
    torch.manual_seed(0)
    model = ASRModel(model_config_from_preset("tiny", vocab_size=40, causal_conv=True, **kw))
    generator = torch.Generator().manual_seed(0)
    model.set_cmvn(
        torch.randn(80, generator=generator) - 8.0, torch.rand(80, generator=generator) + 0.5
    )
    return model.eval()


def test_the_chunk_graph_example_holds():
    globs = {"model_config_from_preset": model_config_from_preset}
    finder, runner = doctest.DocTestFinder(), doctest.DocTestRunner()
    for test in finder.find(ChunkGraph, "ChunkGraph", globs={**vars(export_module), **globs}):
        runner.run(test)
    assert runner.failures == 0 and runner.tries == 7


STREAMS = [
    ("conv2d", "global", 4, 2),
    ("dw_striding", "utterance", 3, 1),
    ("conv2d", "global", 1, 3),
    ("conv2d", "utterance", 8, 1),
]


@pytest.mark.parametrize(
    "subsampling,cmvn,chunk,left", STREAMS, ids=["-".join(map(str, s)) for s in STREAMS]
)
def test_the_onnx_chunk_graph_streams_as_forward_chunk_does(
    subsampling, cmvn, chunk, left, tmp_path
):
    """Chunk after chunk through onnxruntime, each fed the caches of the one before: the first
    chunks with the attention cache not yet full, then full ones, then a shorter last window; the
    log-probs and encoder frames are forward_chunk's (and with global CMVN, the full forward's
    under the same chunk mask)."""
    import onnxruntime as ort

    model = causal_model(subsampling=subsampling, cmvn=cmvn)
    graph = ChunkGraph(model, Streaming(chunk, left))
    path = tmp_path / STREAMING_FILES["onnx"]
    export_chunk_onnx(graph, path)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    window = graph.window_frames if chunk == 1 else "window"
    expected_inputs = {
        "features": [1, window, 80],
        "offset": [],
        "attention_cache": [2, 2, 2, left * chunk, 24],
        "conv_cache": [2, 6, 48],
        **({"feature_mean": [80]} if cmvn == "utterance" else {}),
    }
    assert {i.name: i.shape for i in session.get_inputs()} == expected_inputs
    assert [o.name for o in session.get_outputs()] == list(CHUNK_OUTPUTS)

    last = max(chunk // 2, 1)  # encoder frames of the last window
    frames = (left + 3) * 4 * chunk + (last - 1) * 4 + 7
    generator = torch.Generator().manual_seed(2)
    feats = torch.randn(1, frames, 80, generator=generator) * model.feat_std + model.feat_mean
    caches = {name: np.zeros(c.shape, np.float32) for name, c in graph.initial_caches().items()}
    state, got, worst = None, [], 0.0
    for k, window in enumerate(feature_windows(feats, chunk)):
        offset = k * chunk
        inputs = {"features": window.numpy(), "offset": np.array(offset, np.int64), **caches}
        mean = None
        if cmvn == "utterance":
            inputs["feature_mean"] = (
                mean := feats[0, : k * 4 * chunk + window.shape[1]].mean(0)
            ).numpy()
        log_probs, enc, caches["attention_cache"], caches["conv_cache"] = session.run(None, inputs)
        with torch.no_grad():
            reference, state = model.encoder.forward_chunk(
                model.normalize(window, mean), state, left * chunk
            )
            reference_log_probs = model.ctc_log_probs(reference)
        assert state.offset == offset + log_probs.shape[1]
        worst = max(worst, float((torch.from_numpy(enc) - reference).abs().max()),
                    float((torch.from_numpy(log_probs) - reference_log_probs).abs().max()))
        got.append(torch.from_numpy(log_probs))
    assert [g.shape[1] for g in got] == [chunk] * (left + 3) + [last]
    assert worst < ATOL
    if cmvn == "global":
        with torch.no_grad():
            enc, _ = model.encode(feats, torch.tensor([frames]), chunk_size=chunk, left_chunks=left)
            expected = model.ctc_log_probs(enc)
        assert (torch.cat(got, dim=1) - expected).abs().max() < ATOL
    assert stream_difference(chunk_runner(path), graph) < ATOL  # the export's own check agrees


def test_the_stream_check_catches_a_chunk_graph_that_computes_something_else():
    graph = ChunkGraph(causal_model(), Streaming(2, 2))
    assert stream_difference(lambda **kw: graph(**kw), graph) < 1e-5
    shifted = lambda **kw: (graph(**kw)[0] + 0.01, *graph(**kw)[1:])  # noqa: E731
    with pytest.raises(ExportError, match="differ from the model's chunk by chunk by up to 0.01"):
        stream_difference(shifted, graph)
    forgetful = lambda **kw: graph(**{**kw, **graph.initial_caches()})  # noqa: E731
    with pytest.raises(ExportError, match="chunk by chunk"):
        stream_difference(forgetful, graph)
    first_position = lambda **kw: graph(**{**kw, "offset": torch.tensor(0)})  # noqa: E731
    with pytest.raises(ExportError, match="chunk by chunk"):
        stream_difference(first_position, graph)


def test_streaming_a_model_without_causal_convolutions_is_refused_in_one_line(
    untrained_checkpoint, tmp_path, capsys
):
    out = tmp_path / "out"
    assert status([str(untrained_checkpoint), "--streaming", "--output_dir", str(out)]) == 2
    line = one_error_line(capsys)
    assert "trained without --causal_conv" in line and "train with --causal_conv" in line
    assert not out.exists()


@pytest.mark.parametrize("flags,message", [
    (["--chunk_size", "4"], "--chunk_size and --left_chunks go with --streaming"),
    (["--streaming", "--left_chunks", "0"], "--left_chunks must be a positive integer, got 0"),
    (["--streaming", "--chunk_size", "-1"],
     "--chunk_size must be 0 (none) or a positive number of encoder frames, got -1"),
])
def test_bad_streaming_flags_are_one_line_and_status_2(
    untrained_checkpoint, flags, message, capsys
):
    assert status([str(untrained_checkpoint), *flags]) == 2
    assert message in one_error_line(capsys)


# --- an export folder holds one model ----------------------------------------------------------

@pytest.fixture(scope="module")
def causal_checkpoint(tmp_path_factory):
    """An untrained tiny model with causal convolutions and its own tokenizer: one that streams."""
    tokenizer = train_tokenizer(TEXTS[:2], vocab_size=30, model_type="char")
    model = causal_model()
    cfg = dataclasses.replace(model.cfg, vocab_size=tokenizer.vocab_size)
    path = tmp_path_factory.mktemp("causal") / "causal.pt"
    save_checkpoint({"model_config": dataclasses.asdict(cfg), "model": ASRModel(cfg).state_dict(),
                     "tokenizer": tokenizer.model_proto}, path)
    return path


def _hashes(folder):
    import hashlib
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_an_export_replaces_the_previous_one_whole(causal_checkpoint, untrained_checkpoint,
                                                   tmp_path, capsys):
    """A streaming export, then another model's plain one into the same folder: the folder holds
    the second export alone (no encoder_chunk.onnx nor streaming.json of the first), nothing is
    left beside it, and a symbolic link to the folder still points at it."""
    out = tmp_path / "exported"
    assert status([str(causal_checkpoint), "--streaming", "--output_dir", str(out)]) == 0
    assert set(STREAMING_FILES.values()) <= {p.name for p in out.iterdir()}
    (tmp_path / "link").symlink_to(out)
    capsys.readouterr()
    assert status([str(untrained_checkpoint), "--output_dir", str(tmp_path / "link")]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [FILES["onnx"], FILES["vocabulary"], FILES["features"]])
    vocabulary = json.loads((out / FILES["vocabulary"]).read_text())
    assert len(vocabulary["pieces"]) == load_checkpoint(untrained_checkpoint)["model_config"][
        "vocab_size"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported", "link"]
    assert (tmp_path / "link").is_symlink()


def test_a_folder_holding_other_files_is_not_replaced(untrained_checkpoint, tmp_path, capsys):
    """An export replaces its folder whole: a folder holding a user's file (or the checkpoint it
    reads) is refused in one line, exit 2, before any work, and every byte stays."""
    out = tmp_path / "exported"
    assert status([str(untrained_checkpoint), "--format", "torchscript", "--output_dir",
                   str(out)]) == 0
    (out / "notes.txt").write_text("mine")
    before, checkpoint = _hashes(out), _hashes(untrained_checkpoint.parent)
    capsys.readouterr()
    assert status([str(untrained_checkpoint), "--format", "torchscript", "--output_dir",
                   str(out)]) == 2
    assert one_error_line(capsys).endswith(
        f"--output_dir {out} holds notes.txt, which no export writes: an export replaces the whole "
        "folder; move it away or choose another folder (see --help)")
    assert _hashes(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["exported"]
    with pytest.raises(export_module.ExportError, match="holds notes.txt, which no export writes"):
        export_checkpoint(untrained_checkpoint, out, ["torchscript"])
    assert _hashes(out) == before
    folder = untrained_checkpoint.parent
    assert status([str(untrained_checkpoint), "--format", "torchscript", "--output_dir",
                   str(folder)]) == 2
    assert f"--output_dir {folder} holds {untrained_checkpoint}, which this command reads" in \
        one_error_line(capsys)
    assert _hashes(folder) == checkpoint


KILLED_EXPORT = """
import os, signal, sys
from konkanivani.cli import export
from konkanivani.decoding import model_export
real = model_export._write_json
def write_then_die(path, value):
    real(path, value)
    if path.name == "features.json":  # the last file of the new export, before it is swapped in
        os.kill(os.getpid(), signal.SIGKILL)
model_export._write_json = write_then_die
export.main(sys.argv[1:])
"""


def test_a_killed_or_failed_export_leaves_the_old_folder_whole(causal_checkpoint,
                                                               untrained_checkpoint, tmp_path,
                                                               monkeypatch, capsys):
    out = tmp_path / "exported"
    assert status([str(causal_checkpoint), "--streaming", "--output_dir", str(out)]) == 0
    before = _hashes(out)
    flags = [str(untrained_checkpoint), "--format", "torchscript", "--output_dir", str(out)]
    killed = subprocess.run([sys.executable, "-c", KILLED_EXPORT, *flags], capture_output=True,
                            text=True, timeout=600)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert _hashes(out) == before
    # what the killed one built stays hidden beside it
    [left] = [p.name for p in tmp_path.iterdir() if p.name != "exported"]
    assert left.startswith(".exported.export-")

    def fail(*args):
        raise export_module.ExportError("the check failed")

    with monkeypatch.context() as patched:
        patched.setattr(export_module, "torchscript_runner", fail)
        capsys.readouterr()
        assert status(flags) == 2
        assert one_error_line(capsys) == "error: the check failed"
    assert _hashes(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["exported", left])
    # and neither stops the next export, which deletes what the killed one left
    assert status(flags) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [FILES["torchscript"], FILES["vocabulary"], FILES["features"]])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported"]
    assert f"removed {tmp_path / left}, left by an export whose process" in capsys.readouterr().err


def gone_pid():
    """The id of a process that has ended (and been reaped), and that no process has taken since."""
    for _ in range(10):
        child = subprocess.Popen([sys.executable, "-c", "pass"])
        child.wait(timeout=60)
        try:
            os.kill(child.pid, 0)
        except ProcessLookupError:
            return child.pid
    pytest.fail("no ended process id stayed free")


def test_an_export_deletes_the_build_folders_of_gone_exports_of_its_folder_alone(
    untrained_checkpoint, tmp_path, capsys
):
    """Build folders beside the output (``.NAME.export-PID``): the one of a process that is gone is
    deleted by the next export into NAME, with one line of the log; the one of a process still
    running, one of another folder's name and one whose name ends in no process id are left as
    they are."""
    dead = gone_pid()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        stale = tmp_path / f".exported.export-{dead}"
        kept = [tmp_path / f".exported.export-{sleeper.pid}", tmp_path / f".other.export-{dead}",
                tmp_path / ".exported.export-notes"]
        for folder in (stale, *kept):
            folder.mkdir()
            (folder / FILES["vocabulary"]).write_text("{}")
        before = {p.name: _hashes(p) for p in kept}
        capsys.readouterr()
        out = tmp_path / "exported"
        assert status([str(untrained_checkpoint), "--format", "torchscript", "--output_dir",
                       str(out)]) == 0
        assert sleeper.poll() is None  # still running when the export looked
    finally:
        sleeper.kill()
        sleeper.wait(timeout=60)
    removed = [line for line in capsys.readouterr().err.splitlines() if "removed" in line]
    assert len(removed) == 1 and removed[0].endswith(
        f" INFO removed {stale}, left by an export whose process ({dead}) is gone"), removed
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["exported", *before])
    assert {p.name: _hashes(p) for p in kept} == before
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [FILES["torchscript"], FILES["vocabulary"], FILES["features"]])


# --- a tiny trained model, exported in both formats ----------------------------------------------

def redraw_ctc_head(checkpoint, path):
    """``checkpoint`` with a random CTC head, which emits tokens: after a few dozen steps greedy CTC
    emits blanks only, and every transcript would be empty (and equal). CMVN and encoder stay as
    trained; <unk> and <sos/eos> stay silent, as in a trained model."""
    state = load_checkpoint(checkpoint)
    weight = state["model"]["ctc_head.weight"]
    generator = torch.Generator().manual_seed(0)
    state["model"]["ctc_head.weight"] = 0.5 * torch.randn(weight.shape, generator=generator)
    state["model"]["ctc_head.bias"] = torch.zeros(weight.shape[0]).index_fill_(
        0, torch.tensor([UNK_ID, SOS_EOS_ID]), -100.0
    )
    save_checkpoint(state, path)
    return path


@pytest.fixture(scope="module")
def exported(tiny_corpus, tmp_path_factory):
    """A tiny model trained 36 steps, its CTC head redrawn, exported with --format both:
    (checkpoint, export folder, the tool's stdout lines)."""
    run = tmp_path_factory.mktemp("export") / "run"
    assert train_cli.main(tiny_args(tiny_corpus, run, "--max_steps", "36")) == 0
    checkpoint = redraw_ctc_head(run / "latest.pt", run.parent / "model.pt")
    out = run.parent / "exported"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "konkanivani.cli.export",
            str(checkpoint),
            "--output_dir",
            str(out),
            "--format",
            "both",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return checkpoint, out, result.stdout.splitlines()


@pytest.fixture(scope="module")
def recognizer(exported):
    return Recognizer.from_checkpoint(exported[0])


def corpus_wavs(corpus, count):
    """The first ``count`` test utterances of different lengths, longest first."""
    wavs = {}
    for _, row in read_manifest(corpus / "test.jsonl"):
        wav = load_audio(corpus / row["audio_filepath"])
        wavs.setdefault(len(wav) // 160, wav)
    return sorted(wavs.values(), key=len, reverse=True)[:count]


def features_of(recognizer, wavs):
    feats = [recognizer.frontend(w) for w in wavs]
    return torch.nn.utils.rnn.pad_sequence(feats, batch_first=True), torch.tensor(
        [len(f) for f in feats]
    )


def compare(runner, recognizer, feats, lens):
    """The largest |log-prob| difference over real frames; asserts shapes and lengths match."""
    with torch.no_grad():
        expected, expected_lens = CTCGraph(recognizer.model)(feats, lens)
    got, got_lens = runner(feats, lens)
    assert got.shape == expected.shape and got.dtype == torch.float32
    assert torch.equal(got_lens, expected_lens) and got_lens.dtype == torch.int64
    return max(
        float((got[b, :n] - expected[b, :n]).abs().max())
        for b, n in enumerate(expected_lens.tolist())
    )


def test_the_tool_writes_four_files_and_reports_each_check(exported):
    _, out, lines = exported
    # no temporary folder left
    assert sorted(p.name for p in out.iterdir()) == sorted(FILES.values())
    assert [line.split()[1] for line in lines] == [
        str(out / FILES[k]) for k in ("onnx", "torchscript", "vocabulary", "features")
    ]
    assert all("of PyTorch's" in line for line in lines[:2])
    import onnx

    model = onnx.load(out / FILES["onnx"])
    onnx.checker.check_model(model)
    assert [i.name for i in model.graph.input] == ["features", "feature_lengths"]
    assert [o.name for o in model.graph.output] == ["log_probs", "log_prob_lengths"]


@pytest.mark.parametrize("fmt", ["onnx", "torchscript"])
def test_a_batch_of_two_matches_pytorch_and_the_recognizers_greedy_transcript(
    exported, recognizer, tiny_corpus, fmt
):
    _, out, _ = exported
    wavs = corpus_wavs(tiny_corpus, 2)
    feats, lens = features_of(recognizer, wavs)
    assert lens[0] > lens[1]
    runner = RUNNERS[fmt](out / FILES[fmt])
    assert compare(runner, recognizer, feats, lens) < ATOL

    log_probs, log_prob_lens = runner(feats, lens)
    ids = ctc_greedy(log_probs, log_prob_lens)
    with torch.no_grad():
        assert ids == decode_features(recognizer.model, feats, lens, "greedy")
    vocab = json.loads((out / FILES["vocabulary"]).read_text(encoding="utf-8"))
    texts = [join_pieces(h, vocab) for h in ids]
    assert texts == recognizer.decode_waveforms(wavs, method="greedy")
    assert all(texts)  # tokens, not blanks only


@pytest.mark.parametrize("fmt", ["onnx", "torchscript"])
def test_batch_and_length_axes_are_free(exported, recognizer, tiny_corpus, fmt):
    _, out, _ = exported
    runner = RUNNERS[fmt](out / FILES[fmt])
    wavs = corpus_wavs(tiny_corpus, 3)
    # 1 utterance, 3, the shortest possible
    for batch in ([wavs[2]], wavs, [wavs[0][:160 * (MIN_FRAMES - 1)]]):
        feats, lens = features_of(recognizer, batch)
        assert not set(lens.tolist()) & {100, 80}  # the lengths the export traced with
        assert compare(runner, recognizer, feats, lens) < ATOL


def readme_snippet(marker="<!-- snippet: onnx-transcribe -->"):
    readme = (ROOT / "docs" / "decoding.md").read_text(encoding="utf-8")
    match = re.search(re.escape(marker) + r"\s*```python\n(.*?)```", readme, re.S)
    assert match, f"docs/decoding.md has no python block after {marker}"
    return match.group(1)


def test_the_readme_snippet_transcribes_like_the_recognizer_without_konkanivani(
    exported, recognizer, tiny_corpus, tmp_path
):
    _, out, _ = exported
    snippet = readme_snippet()
    export_dir, wav_path = re.search(r'export_dir, wav_path = "(.+)", "(.+)"', snippet).groups()
    (tmp_path / export_dir).symlink_to(out, target_is_directory=True)
    wav = corpus_wavs(tiny_corpus, 1)[0].numpy()
    # 44.1 kHz stereo, to go through the downmix and the resampler as the package does.
    wav44 = resample_poly(wav, 441, 160).astype(np.float32)
    sf.write(
        tmp_path / wav_path, np.stack([1.5 * wav44, 0.5 * wav44], axis=1), 44100, subtype="FLOAT"
    )
    check = "\nimport sys\nassert not [m for m in sys.modules if m.startswith('konkanivani')]\n"
    result = subprocess.run(
        [sys.executable, "-c", snippet + check],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    [expected] = recognizer.transcribe([tmp_path / wav_path], method="greedy")
    assert expected.text and result.stdout == expected.text + "\n"


# --- a tiny streaming model, exported with --streaming -------------------------------------------

STREAM_FLAGS = ["--streaming", "--chunk_size", "4", "--left_chunks", "2"]


@pytest.fixture(scope="module")
def streaming_exported(tiny_corpus, tmp_path_factory):
    """A tiny model trained 2 steps with --causal_conv --dynamic_chunk, its CTC head redrawn,
    exported with --streaming in chunks of 4 with 2 left: (checkpoint, export folder, stdout lines).
    Barely trained, so that a random head spells several tokens: after 36 steps the encoder's frames
    differ so little over time that it spells one."""
    run = tmp_path_factory.mktemp("streaming") / "run"
    assert (
        train_cli.main(
            tiny_args(
                tiny_corpus,
                run,
                "--max_steps",
                "2",
                "--causal_conv",
                "--dynamic_chunk",
                "--max_chunk",
                "4",
            )
        )
        == 0
    )
    checkpoint = redraw_ctc_head(run / "latest.pt", run.parent / "model.pt")
    out = run.parent / "exported"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "konkanivani.cli.export",
            str(checkpoint),
            "--output_dir",
            str(out),
            *STREAM_FLAGS,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return checkpoint, out, result.stdout.splitlines()


def test_the_streaming_export_writes_the_chunk_graph_and_how_to_feed_it(streaming_exported):
    import onnxruntime as ort

    _, out, lines = streaming_exported
    names = [FILES["onnx"], *STREAMING_FILES.values(), FILES["vocabulary"], FILES["features"]]
    assert sorted(p.name for p in out.iterdir()) == sorted(names)
    assert [line.split()[1] for line in lines] == [str(out / name) for name in names]
    assert "chunk by chunk" in lines[1]
    settings = json.loads((out / STREAMING_FILES["settings"]).read_text(encoding="utf-8"))
    assert (
        settings["chunk_size"],
        settings["left_chunks"],
        settings["window_frames"],
        settings["window_hop"],
    ) == (4, 2, 19, 16)
    session = ort.InferenceSession(
        str(out / STREAMING_FILES["onnx"]), providers=["CPUExecutionProvider"]
    )
    shapes = {i.name: i.shape for i in session.get_inputs()}
    assert settings["cmvn"] == "global" and set(shapes) == {
        "features",
        "offset",
        *settings["cache_shapes"],
    }
    assert all(shapes[name] == shape for name, shape in settings["cache_shapes"].items())


def test_the_streaming_snippet_transcribes_as_the_model_chunk_by_chunk_without_konkanivani(
    streaming_exported, tiny_corpus, tmp_path
):
    checkpoint, out, _ = streaming_exported
    snippet = readme_snippet("<!-- snippet: onnx-stream -->")
    export_dir, wav_path = re.search(r'export_dir, wav_path = "(.+)", "(.+)"', snippet).groups()
    (tmp_path / export_dir).symlink_to(out, target_is_directory=True)
    wav = corpus_wavs(tiny_corpus, 1)[0].numpy()
    # 44.1 kHz stereo, as in the snippet test above
    wav44 = resample_poly(wav, 441, 160).astype(np.float32)
    sf.write(
        tmp_path / wav_path, np.stack([1.5 * wav44, 0.5 * wav44], axis=1), 44100, subtype="FLOAT"
    )
    check = "\nimport sys\nassert not [m for m in sys.modules if m.startswith('konkanivani')]\n"
    result = subprocess.run(
        [sys.executable, "-c", snippet + check],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    partials = result.stdout.splitlines()

    # greedy CTC over forward_chunk_by_chunk, in PyTorch
    recognizer = Recognizer.from_checkpoint(checkpoint)
    model, feats = recognizer.model, recognizer.frontend(load_audio(tmp_path / wav_path))[None]
    with torch.no_grad():
        log_probs = model.ctc_log_probs(
            model.encoder.forward_chunk_by_chunk(model.normalize(feats), 4, 2)
        )
    [ids] = ctc_greedy(log_probs, torch.tensor([log_probs.shape[1]]))
    expected = recognizer.tokenizer.decode(ids)
    assert len(set(ids)) >= 3 and partials[-1] == expected
    assert len(partials) == len(feature_windows(feats, 4))  # the text so far after each chunk
    assert all(later.startswith(earlier) for earlier, later in zip(partials, partials[1:]))


# --- --quantize int8: the tiny streaming model's graphs in int8 ---------------------------------

# The int8 graphs against the float export on the test corpus's speech, the tiny model of the
# streaming fixture (2 steps, a random CTC head: a harder case than a trained model). A token's
# probability on a frame: the export's own check allows INT8_TOLERANCE (0.1); observed 0.038 (0.018
# on checkpoints/streaming_small).
INT8_PROBABILITY_ATOL = 0.08
# |log-prob| differences where either graph gives the token at least e^-5: observed 0.27.
INT8_LOG_PROB_ATOL = 0.6
# the frames whose best token is the float graph's: observed 94%
INT8_AGREEMENT = 0.9


@pytest.fixture(scope="module")
def int8_exported(streaming_exported, tmp_path_factory):
    """The streaming fixture's checkpoint through konkanivani-export --quantize int8 in its chunks,
    into the default folder (the checkpoint's name plus _export_int8): (folder, stdout lines)."""
    checkpoint = tmp_path_factory.mktemp("int8") / "model.pt"
    checkpoint.write_bytes(streaming_exported[0].read_bytes())
    result = subprocess.run(
        [sys.executable, "-m", "konkanivani.cli.export", str(checkpoint), *STREAM_FLAGS,
         "--quantize", "int8"],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return checkpoint.with_name("model_export_int8"), result.stdout.splitlines()


def weight_matmuls(model):
    """The MatMul nodes of an ONNX model whose second input is a weight (an initializer)."""
    weights = {t.name for t in model.graph.initializer}
    return [n for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in weights]


def test_quantize_int8_writes_int8_graphs_under_the_names_of_an_export(
    int8_exported, streaming_exported
):
    import onnx
    import onnxruntime as ort

    out, lines = int8_exported
    float_out = streaming_exported[1]
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in float_out.iterdir())
    names = [FILES["onnx"], *STREAMING_FILES.values(), FILES["vocabulary"], FILES["features"]]
    assert [line.split()[1] for line in lines] == [str(out / name) for name in names]
    for line in lines[:2]:
        assert "(int8, " in line and "smaller than float" in line and "tolerance 0.1)" in line
    for name in (FILES["onnx"], STREAMING_FILES["onnx"]):
        model = onnx.load(out / name)
        onnx.checker.check_model(model)
        assert {p.key: p.value for p in model.metadata_props} == export_module.INT8_METADATA
        # observed 3.1x and 2.8x smaller: the tiny model has fewer weights for its graph (the
        # small model's files are 3.7x and 3.6x smaller, benchmarks/results/int8)
        assert (float_out / name).stat().st_size > 2.5 * (out / name).stat().st_size
        float_session, session = (
            ort.InferenceSession(str(folder / name), providers=["CPUExecutionProvider"])
            for folder in (float_out, out)
        )
        assert [(i.name, i.shape) for i in session.get_inputs()] == [
            (i.name, i.shape) for i in float_session.get_inputs()
        ]
        assert session.get_modelmeta().custom_metadata_map["quantization"] == "int8"
    for name in ("streaming", "vocabulary", "features"):
        file = FILES.get(name) or STREAMING_FILES["settings"]
        assert (out / file).read_bytes() == (float_out / file).read_bytes()


def test_int8_quantizes_every_weight_matmul_and_leaves_the_convolutions_float(
    int8_exported, streaming_exported
):
    import onnx

    for name in (FILES["onnx"], STREAMING_FILES["onnx"]):
        float_model = onnx.load(streaming_exported[1] / name)
        model = onnx.load(int8_exported[0] / name)
        ops = [n.op_type for n in model.graph.node]
        float_ops = [n.op_type for n in float_model.graph.node]
        assert not {"ConvInteger", "QLinearConv"} & set(ops)
        assert ops.count("Conv") == float_ops.count("Conv") == 4  # 2 subsampling, 2 depthwise
        weights = {t.name: t for t in model.graph.initializer}
        for conv in (n for n in model.graph.node if n.op_type == "Conv"):
            assert weights[conv.input[1]].data_type == onnx.TensorProto.FLOAT
        # each linear layer: 2 blocks x (4 feed-forward, 4 attention, 2 pointwise), the
        # subsampling's output and the CTC head
        assert ops.count("MatMulInteger") == len(weight_matmuls(float_model)) == 22
        assert not weight_matmuls(model)  # the MatMuls left are attention's, of activations
        assert ops.count("MatMul") == float_ops.count("MatMul") - 22 == 4


def test_int8_log_probs_are_close_to_the_float_exports_offline_and_chunk_by_chunk(
    int8_exported, streaming_exported, tiny_corpus
):
    out, float_out = int8_exported[0], streaming_exported[1]
    recognizer = Recognizer.from_checkpoint(streaming_exported[0])
    runners = [onnx_runner(folder / FILES["onnx"]) for folder in (out, float_out)]
    probability, log_prob, agree, frames = 0.0, 0.0, 0, 0
    # one file at a time, as a server decodes uploads: int8 quantizes a batch with one scale
    for wav in corpus_wavs(tiny_corpus, 3):
        feats, lens = features_of(recognizer, [wav])
        (got, got_lens), (expected, expected_lens) = (run(feats, lens) for run in runners)
        assert torch.equal(got_lens, expected_lens) and got.shape == expected.shape
        probability = max(probability, float((got.exp() - expected.exp()).abs().max()))
        likely = torch.maximum(got, expected) > -5
        log_prob = max(log_prob, float((got - expected)[likely].abs().max()))
        agree += int((got.argmax(-1) == expected.argmax(-1)).sum())
        frames += got.shape[1]
    assert probability < INT8_PROBABILITY_ATOL and log_prob < INT8_LOG_PROB_ATOL
    assert agree >= INT8_AGREEMENT * frames, (agree, frames)

    graph = ChunkGraph(recognizer.model, Streaming(4, 2))
    int8_chunks, float_chunks = (
        chunk_runner(folder / STREAMING_FILES["onnx"]) for folder in (out, float_out)
    )
    # a longer stream than the export checked, of another seed
    assert export_module.stream_probability_difference(
        int8_chunks, float_chunks, graph, chunks=8, seed=3
    ) < INT8_PROBABILITY_ATOL


def test_the_int8_checks_catch_a_graph_that_computes_something_else(streaming_exported):
    recognizer = Recognizer.from_checkpoint(streaming_exported[0])
    graph = CTCGraph(recognizer.model)
    exact = lambda f, n: graph(f, n)  # noqa: E731
    assert export_module.probability_difference(exact, exact, graph) == 0.0
    # every token's log-prob lowered by 0.5: probabilities down by up to 40%
    lowered = lambda f, n: (graph(f, n)[0] - 0.5, graph(f, n)[1])  # noqa: E731
    with pytest.raises(ExportError, match=r"probabilities differ from the float graph's by up to"):
        export_module.probability_difference(lowered, exact, graph)
    chunk_graph = ChunkGraph(recognizer.model, Streaming(4, 2))
    chunks = lambda **kw: chunk_graph(**kw)  # noqa: E731
    forgetful = lambda **kw: chunk_graph(**{**kw, **chunk_graph.initial_caches()})  # noqa: E731
    assert export_module.stream_probability_difference(chunks, chunks, chunk_graph) == 0.0
    with pytest.raises(ExportError, match="chunk by chunk by up to"):
        export_module.stream_probability_difference(forgetful, chunks, chunk_graph)


def test_an_int8_export_is_recognized_and_served_as_any_export(
    int8_exported, streaming_exported, tiny_corpus, tmp_path
):
    from konkanivani.decoding.onnx_recognizer import ExportedRecognizer

    out, float_out = int8_exported[0], streaming_exported[1]
    rec, float_rec = ExportedRecognizer(out), ExportedRecognizer(float_out)
    assert (rec.quantization, float_rec.quantization) == ("int8", None)
    wav = corpus_wavs(tiny_corpus, 1)[0]
    [text] = rec.decode_waveforms([wav], method="greedy")
    stream = rec.stream(method="greedy")
    streamed = [r.text for r in stream.accept(wav) + stream.finish() if r.is_final]
    assert text and streamed and all(streamed)

    # a folder holding an int8 model.onnx and a float encoder_chunk.onnx: two exports mixed
    mixed = tmp_path / "mixed"
    shutil.copytree(out, mixed)
    shutil.copy(float_out / STREAMING_FILES["onnx"], mixed / STREAMING_FILES["onnx"])
    with pytest.raises(ExportError, match="model.onnx is int8 but encoder_chunk.onnx is float"):
        ExportedRecognizer(mixed)

    pytest.importorskip("uvicorn", reason="konkanivani-serve needs the serve extra")
    from serve_helpers import http_json, served

    clip = tmp_path / "clip.wav"
    sf.write(clip, wav.numpy(), 16000)
    with served(out, "--method", "greedy") as server:
        assert "(ONNX, streaming, greedy)" in "".join(server.log)
        status, result = http_json("POST", server.url + "transcribe", clip.read_bytes())
        assert status == 200 and result["model_format"] == "onnx", result
        assert " ".join(s["text"] for s in result["segments"]) == text
        assert server.alive() and "Traceback" not in "".join(server.log)


def test_the_onnx_snippet_transcribes_an_int8_export_without_konkanivani(
    int8_exported, tiny_corpus, tmp_path
):
    from konkanivani.decoding.onnx_recognizer import ExportedRecognizer

    out = int8_exported[0]
    snippet = readme_snippet()
    export_dir, wav_path = re.search(r'export_dir, wav_path = "(.+)", "(.+)"', snippet).groups()
    (tmp_path / export_dir).symlink_to(out, target_is_directory=True)
    wav = corpus_wavs(tiny_corpus, 1)[0]
    sf.write(tmp_path / wav_path, wav.numpy(), 16000, subtype="FLOAT")
    check = "\nimport sys\nassert not [m for m in sys.modules if m.startswith('konkanivani')]\n"
    result = subprocess.run([sys.executable, "-c", snippet + check], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    [expected] = ExportedRecognizer(out).decode_waveforms([load_audio(tmp_path / wav_path)],
                                                          method="greedy")
    assert expected and result.stdout == expected + "\n"


@pytest.mark.parametrize("flags,message", [
    (["--quantize", "int8", "--format", "torchscript"],
     "--quantize int8 quantizes the ONNX graphs: it goes with --format onnx (the default), not"
     " --format torchscript"),
    (["--quantize", "int8", "--format", "both"], "not --format both"),
    (["--quantize", "int4"], "argument --quantize: invalid choice: 'int4'"),
])
def test_bad_quantize_flags_are_one_line_and_status_2(
    untrained_checkpoint, flags, message, capsys
):
    assert status([str(untrained_checkpoint), *flags]) == 2
    assert message in one_error_line(capsys)
    assert not (untrained_checkpoint.parent / "model_export_int8").exists()
