"""DecodingConfig (decoding/settings.py): one check with one-line errors, the defaults that depend
on how a recognizer decodes, the flags of the four decoding tools made from its fields (each flag
defined once, with one help text), and the recognizers and the server's engine taking it."""
from __future__ import annotations

import argparse
import ast
import dataclasses
import re
from pathlib import Path

import pytest
import torch

from konkanivani.config import ConfigError
from konkanivani.decoding.settings import (
    CHUNK_SIZE,
    ENDPOINT_MS,
    LM_WEIGHT,
    DecodingConfig,
    add_decoding_flags,
    decoding_config_from_args,
    default_text,
)

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ("transcribe", "evaluate", "serve", "export")

BAD = [
    ({"beam_size": 0}, False, "--beam_size must be a positive integer, got 0"),
    ({"batch_size": -1}, False, "--batch_size must be a positive integer, got -1"),
    ({"ctc_weight": 1.5}, False, "--decode_ctc_weight must be in [0, 1], got 1.5"),
    ({"ctc_weight": float("nan")}, False, "--decode_ctc_weight must be in [0, 1], got nan"),
    ({"lm_weight": 0.3}, False, "--lm_weight needs --lm CHECKPOINT"),
    ({"lm": "missing_lm.pt"}, False, "--lm missing_lm.pt: file not found"),
    ({"lm": "{lm}", "lm_weight": -1.0}, False, "--lm_weight must be >= 0, got -1.0"),
    ({"method": "greedy", "length_bonus": 0.5}, False,
     "--method greedy takes no --lm or --length_bonus; choose from beam, attention, joint, "
     "rescore"),
    ({"method": "greedy", "lm": "{lm}"}, False, "--method greedy takes no --lm or --length_bonus"),
    ({"method": "viterbi"}, False, "--method viterbi: unknown; choose from greedy, beam"),
    ({"chunk_size": -1}, False,
     "--chunk_size must be 0 (none) or a positive number of encoder frames, got -1"),
    ({"chunk_size": 4, "left_chunks": -2}, False, "--left_chunks must be -1 (all) or >= 0, got -2"),
    ({"chunk_size": 4, "endpoint_ms": -5}, True,
     "--endpoint_ms must be >= 0 (0: no endpointing), got -5"),
    ({"left_chunks": 2}, False, "--left_chunks needs --chunk_size N"),
    ({"endpoint_ms": 300}, False, "--endpoint_ms needs --chunk_size N (streaming)"),
    ({"method": "joint", "chunk_size": 4}, True,
     "--method joint cannot stream; a stream decodes with greedy, beam, rescore"),
]


@pytest.mark.parametrize("values,streams,message", BAD, ids=[m[:40] for _, _, m in BAD])
def test_a_setting_that_cannot_work_is_one_line_naming_its_flag(values, streams, message, tmp_path):
    (tmp_path / "lm.pt").write_bytes(b"")
    values = {k: (str(tmp_path / "lm.pt") if v == "{lm}" else v) for k, v in values.items()}
    with pytest.raises(ConfigError) as refused:
        DecodingConfig(**values).check(streams)
    assert message in str(refused.value) and "\n" not in str(refused.value)
    assert isinstance(refused.value, ValueError)  # what the library's callers catch


def test_an_export_decodes_with_ctc_alone():
    with pytest.raises(ConfigError, match="the attention decoder that rescore needs is not "):
        DecodingConfig(method="rescore").check(True, exported=True)
    with pytest.raises(ConfigError, match="an ONNX export decodes with CTC alone"):
        DecodingConfig(length_bonus=1.0).check(False, exported=True)
    assert DecodingConfig().resolved(True, exported=True).method == "beam"


def test_the_defaults_that_depend_on_how_it_decodes(tmp_path):
    whole, stream = DecodingConfig().resolved(False), DecodingConfig().resolved(True)
    assert (whole.method, whole.chunk_size, whole.endpoint_ms, whole.lm_weight) == \
        ("joint", 0, None, None)
    assert (stream.method, stream.chunk_size, stream.endpoint_ms) == \
        ("rescore", CHUNK_SIZE, ENDPOINT_MS)
    assert (CHUNK_SIZE, ENDPOINT_MS, LM_WEIGHT, DecodingConfig.beam_size) == (16, 800, 0.3, 10)
    given = DecodingConfig(method="beam", chunk_size=4, left_chunks=2, endpoint_ms=0).resolved(True)
    assert (given.method, given.chunk_size, given.left_chunks, given.endpoint_ms) == \
        ("beam", 4, 2, 0)
    (tmp_path / "lm.pt").write_bytes(b"")
    assert DecodingConfig(lm=tmp_path / "lm.pt").resolved(False).lm_weight == LM_WEIGHT
    assert DecodingConfig(lm=tmp_path / "lm.pt", lm_weight=0.5).resolved(False).lm_weight == 0.5
    # Resolving again in the same context changes nothing (the engine resolves, its recognizer
    # again).
    for d, streams in ((whole, False), (stream, True), (given, True)):
        assert d.resolved(streams) == d
    # evaluate encodes whole utterances under a stream's chunk mask: any method, no endpoint.
    DecodingConfig(method="joint", chunk_size=4, left_chunks=2).check(False)
    # A weight of 0 fuses nothing, and a recognizer may hold its own LM (a library caller's).
    DecodingConfig(method="greedy", lm_weight=0.0).check(False)
    DecodingConfig(lm_weight=0.4).check(False, lm_loaded=True)
    # konkanivani-serve: the model decides whether it streams; the method is left to it.
    assert DecodingConfig(endpoint_ms=300).resolved(None).method is None


def test_keyword_overrides_replace_fields():
    base = DecodingConfig(method="beam", beam_size=3)
    assert DecodingConfig.of(base, beam_size=5) == DecodingConfig(method="beam", beam_size=5)
    assert DecodingConfig.of(None, method="greedy") == DecodingConfig(method="greedy")
    with pytest.raises(TypeError, match="beam_width"):
        DecodingConfig.of(base, beam_width=5)


def test_flags_left_out_take_the_dataclass_defaults_and_the_removed_spelling_is_refused(capsys):
    parser = argparse.ArgumentParser()
    add_decoding_flags(parser, [f.name for f in dataclasses.fields(DecodingConfig)])
    assert decoding_config_from_args(parser.parse_args([])) == DecodingConfig()
    args = parser.parse_args(
        ["--decode_ctc_weight", "0.5", "--chunk_size", "8", "--lm_weight", "0.2"]
    )
    assert decoding_config_from_args(args) == \
        DecodingConfig(ctc_weight=0.5, chunk_size=8, lm_weight=0.2)
    with pytest.raises(SystemExit):
        parser.parse_args(["--ctc_weight", "0.5"])
    assert "--ctc_weight is now spelled --decode_ctc_weight" in capsys.readouterr().err
    with pytest.raises(ValueError, match="no decoding setting beam_width"):
        add_decoding_flags(argparse.ArgumentParser(), ["beam_width"])


def _tool_fields(tool: str) -> tuple[str, ...]:
    source = (ROOT / "konkanivani" / "cli" / f"{tool}.py").read_text(encoding="utf-8")
    for node in ast.parse(source).body:
        names = [getattr(t, "id", None) for t in getattr(node, "targets", [])]
        if isinstance(node, ast.Assign) and names == ["DECODING_FIELDS"]:
            return ast.literal_eval(node.value)
    raise AssertionError(f"cli/{tool}.py has no DECODING_FIELDS")


@pytest.mark.parametrize("tool", TOOLS)
def test_each_tools_decoding_flags_come_from_the_config_with_one_help_text(tool, capsys,
                                                                          monkeypatch):
    import importlib

    monkeypatch.setenv("COLUMNS", "2000")  # no wrapping: each flag's help on its line, whole
    module = importlib.import_module(f"konkanivani.cli.{tool}")
    with pytest.raises(SystemExit) as exit_:
        module.main(["--help"])
    assert exit_.value.code == 0
    # the options' part of the help, the usage line left out
    text = " ".join(capsys.readouterr().out.split("options:", 1)[1].split())
    taken = set(_tool_fields(tool))
    assert taken == set(module.DECODING_FIELDS)
    for f in dataclasses.fields(DecodingConfig):
        flag = "--" + f.metadata.get("flag", f.name)
        defined = len(re.findall(rf"(?<![\w-]){flag} [A-Z_{{]", text))  # the option's own line
        if f.name in taken:
            help_text = " ".join(f"{f.metadata['help']} (default: {default_text(f)})".split())
            assert defined == 1 and help_text in text, (tool, flag)
        else:
            assert defined == 0, (tool, flag)
    assert "--chunk_size" in text and "--left_chunks" in text


def _checkpoint(path: Path, causal: bool) -> Path:
    """An untrained tiny checkpoint: what the engine and the device need, not what it says."""
    from konkanivani.checkpoint import save_checkpoint
    from konkanivani.config import model_config_from_preset
    from konkanivani.data.tokenizer import train_tokenizer
    from konkanivani.model.asr import ASRModel

    tokenizer = train_tokenizer(["abc", "cab", "bca"] * 4, vocab_size=8, model_type="char")
    torch.manual_seed(0)
    cfg = model_config_from_preset("tiny", vocab_size=tokenizer.vocab_size, causal_conv=causal,
                                   dynamic_chunk=causal, max_chunk=8)
    return save_checkpoint({"model_config": dataclasses.asdict(cfg),
                            "model": ASRModel(cfg).state_dict(),
                            "tokenizer": tokenizer.model_proto}, path)


def test_the_engine_takes_the_config_and_resolves_it_for_its_model(tmp_path):
    from konkanivani.decoding.recognizer import Recognizer
    from konkanivani.serving.engine import Engine

    streaming = Recognizer.from_checkpoint(_checkpoint(tmp_path / "s.pt", causal=True), "auto")
    full = Recognizer.from_checkpoint(_checkpoint(tmp_path / "f.pt", causal=False), "auto")
    assert streaming.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    engine = Engine(streaming, DecodingConfig(chunk_size=4, left_chunks=2))
    described = {k: engine.description[k] for k in ("method", "beam_size", "chunk_size", "chunk_ms",
                                                    "left_chunks", "endpoint_ms")}
    assert described == {"method": "rescore", "beam_size": 10, "chunk_size": 4, "chunk_ms": 160,
                         "left_chunks": 2, "endpoint_ms": ENDPOINT_MS}
    engine.close()
    engine = Engine(streaming)
    assert engine.decoding.chunk_size == CHUNK_SIZE
    engine.close()
    with pytest.raises(ValueError, match="--method joint cannot stream"):
        Engine(streaming, DecodingConfig(method="joint"))
    # a stream's settings, which a model that cannot stream does not use
    engine = Engine(full, DecodingConfig(chunk_size=4, endpoint_ms=300))
    assert engine.decoding.method == "joint" and engine.decoding.chunk_size == 0
    assert not engine.streaming and "chunk_size" not in engine.description
    engine.close()


def test_serve_resolves_its_device_as_every_tool_does(tmp_path, capsys, monkeypatch):
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    from konkanivani.cli import serve

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    checkpoint = _checkpoint(tmp_path / "m.pt", causal=False)
    assert serve.main([str(checkpoint), "--device", "cuda:1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --device cuda:1: CUDA is not available on this machine "
                   "(use --device cpu)"]
