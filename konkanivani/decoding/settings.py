"""The decoding settings, in one place: ``DecodingConfig``.

Every setting of decoding is a field here, with its default and its flag's help: the method, the
beam, the CTC and LM weights, the streaming chunk, its left context and endpoint, the batch and the
device. konkanivani-transcribe, -evaluate, -serve and -export each take the fields they need as
flags (``add_decoding_flags(parser, fields)``, then ``decoding_config_from_args``), docs/flags.md
lists them (docs/generate_flags.py), and ``DecodingConfig.check`` is their one validation. The
recognizers take a ``DecodingConfig`` (``Recognizer``, ``ExportedRecognizer``, the server's
``Engine``), with keyword overrides of its fields: ``rec.transcribe(paths, method="greedy")``.

A field left at None (``method``, ``lm_weight``, ``endpoint_ms``), or a ``chunk_size`` of 0, takes
its default from how it decodes (``resolved``): the method is ``joint`` for whole files,
``rescore`` for a stream and ``beam`` for an ONNX export; the LM weight is 0.3 with ``lm``; a
stream's chunk is 16 encoder frames. This module imports nothing of torch: the tools' ``--help``
and the docs generator read it.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import types
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

from ..config import DEFAULT_MAX_DURATION, ConfigError, Removed
from .hotwords import MAX_BOOST, HotwordError, parse_hotword, read_hotwords

__all__ = ["CHUNK_SIZE", "ENDPOINT_MS", "EXPORTED_METHOD", "EXPORTED_METHODS", "EXPORT_LEFT_CHUNKS",
           "FUSED_METHODS", "HOTWORD_BOOST", "HOTWORD_METHODS", "JOINT_HOTWORD_BOOST", "LM_WEIGHT",
           "LONG_INPUT_SECONDS", "METHOD", "METHODS", "STREAMING_METHOD", "STREAM_METHODS",
           "DecodingConfig", "add_decoding_flags", "decoding_config_from_args", "default_text",
           "flag_name", "hotwords_file"]

METHODS = ("greedy", "beam", "attention", "joint", "rescore")
# greedy has no hypotheses to weigh
FUSED_METHODS = ("beam", "attention", "joint", "rescore")
# The searches that take a hotwords' context bonus (decoding.hotwords). Greedy has no hypotheses to
# favour one of; the attention decoder alone, with no CTC score to hold it to the audio, writes a
# boosted word again and again ("bed bed bed" for "bad cafe" on the tests' tone model).
HOTWORD_METHODS = ("beam", "joint", "rescore")
# What a stream decodes with: CTC prefix beam search chunk by chunk, rescored at a segment's end.
STREAM_METHODS = ("greedy", "beam", "rescore")
# CTC only: an export holds no attention decoder.
EXPORTED_METHODS = ("greedy", "beam")
METHOD = "joint"  # whole files
STREAMING_METHOD = "rescore"  # a stream
EXPORTED_METHOD = "beam"  # an ONNX export
CHUNK_SIZE = 16  # encoder frames (40 ms each) a stream's chunk holds when none is given: 640 ms
# The left context a streaming export's fixed caches hold when none is given, in chunks (an export
# cannot see "all" of a segment: its caches have one size).
EXPORT_LEFT_CHUNKS = 4
# The shallow fusion weight with --lm: a common starting point, not a tuned value
# (benchmarks/lm_fusion.py chooses one on a validation set).
LM_WEIGHT = 0.3
# The context bonus per token of a hotword (decoding.hotwords), chosen with benchmarks/hotwords.py
# (benchmarks/results/hotwords/README.md): 1.5 for the CTC prefix beam (beam, rescore, a stream),
# 0.75 for joint decoding, which writes a boosted name over an unclear word more readily; at these
# the CER of sentences without hotwords moved by at most +1.7% relative there.
HOTWORD_BOOST = 1.5
JOINT_HOTWORD_BOOST = 0.75
ENDPOINT_MS = 800  # a streamed segment ends after this much of blank frames after speech
# Above this many seconds an utterance asked of an attention-based method is decoded with
# search.LONG_INPUT_METHOD instead: the training default --max_duration, so the decoder never saw
# longer input, and where joint decoding's square-law cost starts to dominate. Tiny model, one
# thread of a 2-core AMD EPYC: joint 0.7 s for 10 s of audio, 5.6 s for 30 s, 22 s for 60 s, 873 s
# for 5 min; beam 0.13 / 0.25 / 1.5 s at 30 s / 60 s / 5 min, 10.5 s for 20 min.
LONG_INPUT_SECONDS = DEFAULT_MAX_DURATION


def _setting(help: str, **more: Any) -> dict[str, Any]:
    """A field's metadata: its flag's help, and where they apply ``flag`` (the flag's name when
    it is not the field's), ``old`` (a removed spelling, refused in one line naming the flag),
    ``choices``, ``metavar`` and ``default`` (how the default reads where the field's is None)."""
    return {"help": help, **more}


def hotwords_file(path: str) -> tuple[str, ...]:
    """The type of ``--hotwords FILE``: the file's hotword lines; its errors in the parser's one
    line."""
    try:
        return read_hotwords(path)
    except HotwordError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


@dataclass(frozen=True)
class DecodingConfig:
    """How a recognizer decodes: a checkpoint's (``Recognizer``), an ONNX export's
    (``ExportedRecognizer``) or the server's (``Engine``). ``check`` says whether the settings can
    work, ``resolved`` fills in the defaults that depend on how they decode."""

    method: str | None = field(default=None, metadata=_setting(
        "greedy: best CTC path; beam: CTC prefix beam search; attention: attention beam search; "
        "joint: attention beam search with CTC prefix scores; rescore: CTC n-best rescored by the "
        f"attention decoder. A stream takes {', '.join(STREAM_METHODS)}; an ONNX export "
        f"{' or '.join(EXPORTED_METHODS)}", choices=METHODS,
        default=f"{METHOD}; {STREAMING_METHOD} when streaming; {EXPORTED_METHOD} for an ONNX "
                "export"))
    beam_size: int = field(default=10, metadata=_setting(
        "hypotheses each beam search keeps (and the tokens a CTC prefix beam considers per frame)"))
    # Chosen on the demo corpus's validation split (unseen sentences) among 0.3 / 0.5 / 0.7: the CTC
    # head generalizes to new sentences better than the attention decoder, which has learned the
    # training sentences as a language model.
    ctc_weight: float = field(default=0.7, metadata=_setting(
        "weight of the CTC score in joint decoding and rescoring (training's --ctc_weight is "
        "another weight, the CTC loss's)", flag="decode_ctc_weight", old="ctc_weight",
        metavar="DECODE_CTC_WEIGHT"))
    lm: Path | None = field(default=None, metadata=_setting(
        "a konkanivani-train-lm checkpoint of the same tokenizer, for shallow fusion "
        f"({', '.join(FUSED_METHODS)})", metavar="CHECKPOINT", default="none"))
    lm_weight: float | None = field(default=None, metadata=_setting(
        "weight W of the LM's log-probabilities; choose it on a validation set with "
        "benchmarks/lm_fusion.py",
        default=f"{LM_WEIGHT} with --lm (a common starting point), else 0"))
    length_bonus: float = field(default=0.0, metadata=_setting(
        "score B added per emitted token, against the LM's preference for short outputs"))
    batch_size: int = field(default=8, metadata=_setting("utterances decoded together"))
    chunk_size: int = field(default=0, metadata=_setting(
        "chunks of this many encoder frames (40 ms each) for a model trained with --causal_conv: "
        "transcribe decodes each file as a stream in them (each segment printed with its times), "
        "evaluate scores each utterance as such a stream decodes it, serve streams in them, export "
        "--streaming makes its chunk graph for them. 0: transcribe and evaluate decode files whole "
        f"(a file over {LONG_INPUT_SECONDS:g} s in windows cut at pauses); serve and export use "
        f"{CHUNK_SIZE} ({CHUNK_SIZE * 40} ms), a served export its own"))
    left_chunks: int = field(default=-1, metadata=_setting(
        "with --chunk_size: how many chunks back each chunk sees (-1: all of its segment; an "
        f"export's fixed caches, at least 1: {EXPORT_LEFT_CHUNKS}, a served export its own)"))
    endpoint_ms: int | None = field(default=None, metadata=_setting(
        "a streamed segment ends after this many ms in which CTC's likeliest output is blank, "
        f"after speech (0: segments end only at {LONG_INPUT_SECONDS:g} s)",
        default=str(ENDPOINT_MS)))
    device: str = field(default="auto", metadata=_setting(
        "auto (CUDA where there is one, else the CPU), cpu, cuda, cuda:1 ... (an ONNX export runs "
        "on onnxruntime's CPU)"))
    # The flag reads a file into the lines; a library caller passes the lines (a request's, say).
    hotwords: tuple[str, ...] = field(default=(), metadata=_setting(
        "a file of words or phrases to favour (names, places), one a line, as 'phrase' or "
        "'phrase :BOOST' (a boost of its own); blank lines and lines starting with # skipped. "
        f"Biases {', '.join(HOTWORD_METHODS)}: each token of a hotword a hypothesis spells earns "
        "the boost, taken back unless the word is completed", metavar="FILE", read=hotwords_file,
        default="none"))
    hotword_boost: float | None = field(default=None, metadata=_setting(
        "with --hotwords: the score added per token of a hotword (its line's boost where it has "
        "one); 0 changes nothing", default=f"{HOTWORD_BOOST}; {JOINT_HOTWORD_BOOST} with joint"))

    def __post_init__(self) -> None:
        # a list of hotwords (a library caller's) held as a tuple: the settings stay hashable
        if isinstance(self.hotwords, list):
            object.__setattr__(self, "hotwords", tuple(self.hotwords))

    @classmethod
    def of(cls, decoding: DecodingConfig | None = None, **overrides: Any) -> DecodingConfig:
        """``decoding`` (the defaults when None) with the fields ``overrides`` names replaced: how
        the recognizers take their settings."""
        return dataclasses.replace(decoding or cls(), **overrides)

    def check(self, streams: bool | None = False, exported: bool = False,
              lm_loaded: bool = False) -> None:
        """``ConfigError`` in one line naming the flag of the first setting that cannot work.

        ``streams``: whether the settings decode through a stream (True: its method must be one a
        stream takes), whole inputs (False: a stream's settings then need ``chunk_size``), or None
        where the model decides (``konkanivani-serve``). ``exported``: an ONNX export decodes them
        (CTC alone). ``lm_loaded``: the recognizer holds an LM besides ``lm`` (a library caller's
        ``Recognizer.from_checkpoint(..., lm=...)``)."""
        for name in ("beam_size", "batch_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"{flag_name(name)} must be a positive integer, got "
                                  f"{getattr(self, name)!r}")
        if not 0.0 <= self.ctc_weight <= 1.0:
            raise ConfigError(f"{flag_name('ctc_weight')} must be in [0, 1], got {self.ctc_weight}")
        self._check_fusion(lm_loaded)
        self._check_chunks(streams)
        self._check_hotwords()
        method = self.method or self._default_method(streams, exported)
        if exported and self.hotwords:
            raise ConfigError("an ONNX export decodes without --hotwords (it holds no tokenizer "
                              "to spell them with)")
        if method is None:
            return
        if self.hotwords and method not in HOTWORD_METHODS:
            raise ConfigError(f"--method {method} cannot be biased towards --hotwords; choose from "
                              f"{', '.join(HOTWORD_METHODS)}")
        if method not in METHODS:
            raise ConfigError(f"--method {method}: unknown; choose from {', '.join(METHODS)}")
        fused = self.lm is not None or bool(self.lm_weight) or bool(self.length_bonus)
        if exported and method not in EXPORTED_METHODS:
            raise ConfigError(f"an ONNX export decodes with {' or '.join(EXPORTED_METHODS)} (CTC): "
                              f"the attention decoder that {method} needs is not exported")
        if exported and fused:
            raise ConfigError("an ONNX export decodes with CTC alone: no --lm or --length_bonus")
        if streams and method not in STREAM_METHODS:
            raise ConfigError(f"--method {method} cannot stream; a stream decodes with "
                              f"{', '.join(STREAM_METHODS)}")
        if fused and method not in FUSED_METHODS:
            raise ConfigError(f"--method {method} takes no --lm or --length_bonus; choose from "
                              f"{', '.join(FUSED_METHODS)}")

    def _check_fusion(self, lm_loaded: bool) -> None:
        if self.lm is not None and not Path(self.lm).is_file():
            raise ConfigError(f"--lm {self.lm}: file not found")
        # A weight of 0 fuses nothing: a library caller may pass it with no LM at all.
        if self.lm_weight and self.lm is None and not lm_loaded:
            raise ConfigError("--lm_weight needs --lm CHECKPOINT")
        weight = self.lm_weight
        if weight is not None and not (math.isfinite(weight) and weight >= 0):
            raise ConfigError(f"--lm_weight must be >= 0, got {self.lm_weight}")
        if not math.isfinite(self.length_bonus):
            raise ConfigError(f"--length_bonus must be a number, got {self.length_bonus}")

    def _check_hotwords(self) -> None:
        if isinstance(self.hotwords, str) or not all(isinstance(h, str) for h in self.hotwords):
            raise ConfigError(f"--hotwords: a list of words or phrases (strings), got "
                              f"{self.hotwords!r:.60}")
        for line in self.hotwords:
            try:
                parse_hotword(line)
            except HotwordError as e:
                raise ConfigError(f"--hotwords {line!r:.60}: {e}") from None
        boost = self.hotword_boost
        if boost is not None and not (isinstance(boost, (int, float)) and math.isfinite(boost)
                                      and boost >= 0):
            raise ConfigError(f"--hotword_boost must be a number >= 0, got {boost!r}")
        if boost is not None and boost > MAX_BOOST:  # float32 scores overflow to NaN
            raise ConfigError(f"--hotword_boost must be at most {MAX_BOOST:g}, got {boost!r}")

    def _check_chunks(self, streams: bool | None) -> None:
        if not isinstance(self.chunk_size, int) or self.chunk_size < 0:
            raise ConfigError(f"--chunk_size must be 0 (none) or a positive number of encoder "
                              f"frames, got {self.chunk_size!r}")
        if not isinstance(self.left_chunks, int) or self.left_chunks < -1:
            raise ConfigError(f"--left_chunks must be -1 (all) or >= 0, got {self.left_chunks!r}")
        if self.endpoint_ms is not None and not self.endpoint_ms >= 0:
            raise ConfigError(f"--endpoint_ms must be >= 0 (0: no endpointing), got "
                              f"{self.endpoint_ms}")
        # Whole inputs take a chunk only as a mask (evaluate); a stream's own settings need one.
        if streams is False and not self.chunk_size:
            if self.left_chunks != -1:
                raise ConfigError("--left_chunks needs --chunk_size N")
            if self.endpoint_ms is not None:
                raise ConfigError("--endpoint_ms needs --chunk_size N (streaming)")

    @staticmethod
    def _default_method(streams: bool | None, exported: bool) -> str | None:
        if exported:
            return EXPORTED_METHOD
        return None if streams is None else STREAMING_METHOD if streams else METHOD

    def resolved(self, streams: bool, exported: bool = False, lm_loaded: bool = False
                 ) -> DecodingConfig:
        """These settings, checked (``check``), with each default that depends on how they decode
        written in: the method, the LM weight with ``lm`` (``LM_WEIGHT``; None, no fusion, without
        one), the hotwords' boost (``HOTWORD_BOOST``, ``JOINT_HOTWORD_BOOST`` with joint), and for a
        stream its chunk (``CHUNK_SIZE``) and endpoint (``ENDPOINT_MS``) unless given. Resolving
        settings again in the same context gives them back unchanged."""
        self.check(streams, exported, lm_loaded)
        method = self.method or self._default_method(streams, exported)
        weight = LM_WEIGHT if self.lm_weight is None and self.lm is not None else self.lm_weight
        endpoint = ENDPOINT_MS if streams and self.endpoint_ms is None else self.endpoint_ms
        boost = self.hotword_boost
        if boost is None:
            boost = JOINT_HOTWORD_BOOST if method == "joint" else HOTWORD_BOOST
        return dataclasses.replace(
            self, method=method, lm_weight=weight,
            chunk_size=(self.chunk_size or CHUNK_SIZE) if streams else self.chunk_size,
            endpoint_ms=endpoint, hotword_boost=boost)


def flag_name(name: str) -> str:
    """The flag of the field ``name``: ``--decode_ctc_weight`` for ``ctc_weight``, else
    ``--name``."""
    f = _FIELDS[name]
    return "--" + f.metadata.get("flag", f.name)


def default_text(f: dataclasses.Field) -> str:
    """How the default of field ``f`` reads in the help and the docs."""
    return f.metadata.get("default", str(f.default))


def add_decoding_flags(parser: argparse.ArgumentParser, fields: Iterable[str]) -> None:
    """A flag for each ``DecodingConfig`` field of ``fields`` (a tool's choice), in the class's
    order, each with the field's help and default. The flags default to None, "not given":
    ``decoding_config_from_args`` leaves those to the dataclass."""
    wanted = set(fields)
    if unknown := wanted - set(_FIELDS):
        raise ValueError(f"no decoding setting {', '.join(sorted(unknown))}")
    hints = get_type_hints(DecodingConfig)
    for f in dataclasses.fields(DecodingConfig):
        if f.name not in wanted:
            continue
        kind, meta = _flag_type(hints[f.name]), f.metadata
        parser.add_argument(flag_name(f.name), dest=f.name, type=meta.get("read", kind),
                            default=None,
                            choices=meta.get("choices"), metavar=meta.get("metavar"),
                            help=f"{meta['help']} (default: {default_text(f)})")
        if "old" in meta:
            parser.add_argument(f"--{meta['old']}", action=Removed, new=flag_name(f.name))


def decoding_config_from_args(args: argparse.Namespace) -> DecodingConfig:
    """The ``DecodingConfig`` of the flags ``add_decoding_flags`` made: those given, the rest
    its defaults (unchecked: ``check`` it)."""
    given = {name: getattr(args, name) for name in _FIELDS if getattr(args, name, None) is not None}
    return DecodingConfig(**given)


def _flag_type(tp: Any) -> Any:
    """The flag's type of a field's annotation: ``X`` of ``X | None``."""
    if get_origin(tp) in (Union, types.UnionType):
        return next(a for a in get_args(tp) if a is not type(None))
    return tp


_FIELDS = {f.name: f for f in dataclasses.fields(DecodingConfig)}
