"""Typed configuration: the model's dimensions (with named presets) and the training run.

Every field of both dataclasses is also a command-line flag (see ``add_dataclass_args``); the
resolved configs are stored in each checkpoint, so a checkpoint alone rebuilds its model.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Union, get_args, get_origin, get_type_hints

from .checkpoint import ADDED_OFF, checkpoint_file_error

__all__ = ["DEFAULT_SEED", "DEFAULT_MAX_DURATION", "DEFAULT_DURATION_TOLERANCE",
           "DEFAULT_VOCAB_SIZE", "DEFAULT_CTC_WEIGHT", "DEFAULT_LABEL_SMOOTHING", "Seeded",
           "RunConfig", "check_run_config", "check_values", "Check",
           "POSITIVE_INTEGER", "COUNT",
           "AMOUNT", "POSITIVE_NUMBER", "BELOW_ONE", "Removed", "FROM_TOKENIZER", "flag_fields",
           "AugmentConfig", "LR_SCHEDULES", "OPTIMIZERS", "PRECISIONS", "STRATEGIES",
           "kept_settings", "time_reduced_blocks", "check_time_reduction",
           "ConfigError", "ModelConfig", "TrainConfig", "PRESETS", "INIT_MODULES",
           "model_config_from_preset", "model_config_from", "check_config", "resolve_model_config",
           "add_dataclass_args", "dataclass_from_args", "MixEntry", "parse_mix"]


log = logging.getLogger("konkanivani")


class ConfigError(ValueError):
    """A flag value that cannot work; the message names the flag, in one line."""


def flag_help(text: str, section: str = "", kept_on_resume: bool = False) -> dict:
    """A field's metadata: its flag's help; for a TrainConfig field the section of a YAML recipe
    it belongs to when that is not "training" ("data"; "model" for --preset, beside the
    ModelConfig fields; "init" for --init_from and its options); and ``kept_on_resume`` for a
    setting a resumed run takes from its checkpoint whatever the flags say, because it decides
    which batches remain in the epoch in progress (``kept_settings``)."""
    return {"help": text, **({"section": section} if section else {}),
            **({"kept_on_resume": True} if kept_on_resume else {})}


def kept_settings(cfg: Any, saved: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's value of every field of ``cfg`` (a dataclass) marked ``kept_on_resume``
    where it differs from ``cfg``'s: what a resumed run must take back (both trainers ask this)."""
    return {
        f.name: saved[f.name]
        for f in dataclasses.fields(cfg)
        if f.metadata.get("kept_on_resume")
        and f.name in saved
        and getattr(cfg, f.name) != saved[f.name]
    }


# The metadata of a model's vocab_size: the tokenizer decides it, so it is no flag and no recipe key
# (a TrainConfig's vocab_size, a flag, is the size to train a tokenizer to).
FROM_TOKENIZER = {"from_tokenizer": True}

DEFAULT_SEED = 0  # every tool's --seed (training, the LM, prepare's valid split, the demo corpus)
# Defaults that training, konkanivani-validate, konkanivani-prepare and the model share, each
# written here once.
# The longest utterance used, in seconds (and the longest decoded whole by an attention-based
# method: decoding.settings.LONG_INPUT_SECONDS).
DEFAULT_MAX_DURATION = 30.0
# Seconds a row's "duration" may differ from its audio file's: rounding passes, a truncated or
# mismatched file does not.
DEFAULT_DURATION_TOLERANCE = 0.5
# The size of a SentencePiece vocabulary trained on a manifest's text.
DEFAULT_VOCAB_SIZE = 128
DEFAULT_CODEBOOK_SIZE = 1024  # --pretrain's codes when --codebook_size is not given
# The loss: w * CTC + (1 - w) * attention, and the attention loss's label smoothing.
DEFAULT_CTC_WEIGHT = 0.3
DEFAULT_LABEL_SMOOTHING = 0.1


@dataclass
class ModelConfig:
    """Dimensions of the Conformer encoder + Transformer decoder. ``vocab_size`` is set from the
    tokenizer."""

    vocab_size: int = field(default=0, metadata=FROM_TOKENIZER)  # no flag: the tokenizer decides it
    n_mels: int = field(default=80, metadata=flag_help("log-mel bins per frame"))
    d_model: int = field(default=192, metadata=flag_help("model width D (encoder and decoder)"))
    n_heads: int = field(default=4, metadata=flag_help("attention heads H"))
    ffn_dim: int = field(default=768, metadata=flag_help("hidden size of the feed-forward modules"))
    encoder_layers: int = field(default=8, metadata=flag_help("Conformer blocks"))
    decoder_layers: int = field(default=4, metadata=flag_help("Transformer decoder layers"))
    conv_kernel: int = field(
        default=15,
        metadata=flag_help("depthwise convolution kernel (odd), in frames after subsampling"),
    )
    dropout: float = field(default=0.1, metadata=flag_help("dropout in every block"))
    attention_dropout: float = field(default=0.0, metadata=flag_help(
        "dropout on attention weights (0 lets a CPU run the fused attention kernel)"))
    subsampling: str = field(
        default="conv2d",
        metadata={
            "help": (
                "4x front-end: conv2d (two full 3x3 stride-2 convs) or dw_striding (the second one"
                " depthwise-separable: about 1.7x faster training steps, but on the demo corpus its"
                " CTC branch had not started to align after 200 steps)"
            ),
            "choices": ("conv2d", "dw_striding"),
        },
    )
    subsampling_channels: int = field(default=0, metadata=flag_help(
        "channels of conv2d's first convolution (0: d_model, as WeNet and ESPnet; fewer make the "
        "second convolution, the front-end's costliest part, that much cheaper)"))
    frontend: str = field(
        default="log_mel",
        metadata={
            "help": (
                "the features: log_mel (torchaudio's mel spectrogram, centred windows) or"
                " kaldi_fbank (Kaldi filterbanks, as sherpa-onnx computes them for WeNet models:"
                " what konkanivani-export --format sherpa-onnx needs)"
            ),
            "choices": ("log_mel", "kaldi_fbank"),
        },
    )
    cmvn: str = field(
        default="global",
        metadata={
            "help": (
                "feature normalization: global (the training set's mean and std per mel bin) or"
                " utterance (each utterance's own mean, then the training set's std: a channel or"
                " loudness change shifts log-mel bins by a constant, which this removes; ESPnet's"
                " utterance_mvn)"
            ),
            "choices": ("global", "utterance"),
        },
    )
    # Streaming: one model for full-context and chunk-by-chunk recognition (docs/architecture.md,
    # "Streaming").
    dynamic_chunk: bool = field(
        default=False,
        metadata=flag_help(
            "train for chunk-by-chunk recognition too: each training batch attends with full"
            " context half the time, otherwise in chunks of 1 to --max_chunk encoder frames drawn"
            " per batch (each frame sees its own chunk and those before it)"
        ),
    )
    max_chunk: int = field(default=25, metadata=flag_help(
        "the largest chunk --dynamic_chunk draws, in encoder frames of 40 ms (25: 1 s)"))
    dynamic_left_chunks: bool = field(
        default=False,
        metadata=flag_help(
            "with --dynamic_chunk, also draw per batch how many chunks to the left a chunk sees (0"
            " up to all of them), for recognition with a bounded left context; off: all of them"
        ),
    )
    causal_conv: bool = field(
        default=False,
        metadata=flag_help(
            "the convolution module's depthwise convolution sees past frames only (--conv_kernel -"
            " 1 of them), as chunk-by-chunk recognition needs; off: centered on the frame"
        ),
    )

    time_reduce_layer: int = field(default=0, metadata=flag_help(
        "progressive time reduction: after this encoder block (counted from 1) a stride-2 "
        "depthwise convolution halves the frames, to 80 ms, until --time_recover_layer (0: off; "
        "full-context models only)"))
    time_recover_layer: int = field(default=0, metadata=flag_help(
        "with --time_reduce_layer: after this block each halved frame is repeated and the states "
        "from before the halving added, back to 40 ms for the blocks after it and the heads (0: "
        "the last block but one)"))
    self_condition_layer: int = field(default=0, metadata=flag_help(
        "self-conditioned CTC: after this encoder block (counted from 1) the CTC head's "
        "posteriors, mapped back to d_model, are added to the states, in training and in "
        "recognition (0: off; full-context models only; pair it with --inter_ctc_layer on the "
        "same block)"))
    codebook_size: int = field(default=0, metadata=flag_help(
        "with --pretrain: the codes of the frozen random codebook the masked frames are predicted"
        f" as (0: {DEFAULT_CODEBOOK_SIZE} with --pretrain; a model fine-tuned from a pretrained"
        " one has none)"))

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "ModelConfig":
        """The config stored in a checkpoint, which names every field: ``ConfigError`` in one line
        for one that lacks a field (written before it existed, CHANGELOG.md) or has one unknown here
        (written by a newer konkanivani), rather than a default that would build another model."""
        names = {f.name for f in dataclasses.fields(cls)}
        # fields added since, whose absence is the model as it was before them
        values = {**{k: v for k, v in ADDED_OFF.items() if k not in values}, **values}
        if missing := sorted(names - set(values)):
            raise ConfigError(
                f"the checkpoint's model config has no {', '.join(missing)}: it was written by an "
                "earlier konkanivani, whose checkpoints this one does not read (CHANGELOG.md)")
        if unknown := sorted(set(values) - names):
            raise ConfigError(
                f"the checkpoint's model config has {', '.join(unknown)}, unknown to this "
                "konkanivani: it was written by a newer one")
        return cls(**values)


# ADDED_OFF (checkpoint.py): ModelConfig fields newer than some checkpoints; from_dict reads their
# absence as the feature off.


PRESETS: dict[str, dict[str, Any]] = {
    "large": dict(d_model=256, n_heads=4, ffn_dim=1024, encoder_layers=12, decoder_layers=6),
    "medium": dict(d_model=192, n_heads=4, ffn_dim=768, encoder_layers=8, decoder_layers=4),
    "small": dict(d_model=128, n_heads=4, ffn_dim=512, encoder_layers=6, decoder_layers=3),
    # For tests and smoke runs: trains in seconds on a laptop CPU.
    "tiny": dict(
        d_model=48, n_heads=2, ffn_dim=96, encoder_layers=2, decoder_layers=1, conv_kernel=7
    ),
}


# The top-level modules of ASRModel that hold weights: what --init_modules may name.
INIT_MODULES = ("encoder", "decoder", "ctc_head")


def model_config_from_preset(preset: str, **overrides: Any) -> ModelConfig:
    """``ModelConfig`` for a named preset; keyword overrides whose value is None are ignored."""
    if preset not in PRESETS:
        raise ConfigError(f"--preset {preset}: unknown; choose one of {', '.join(PRESETS)}")
    return model_config_from(PRESETS[preset], **overrides)


def model_config_from(base: dict[str, Any], **overrides: Any) -> ModelConfig:
    """``ModelConfig`` of ``base`` (a preset's values, or an --init_from checkpoint's config) with
    the
    overrides whose value is not None; ``ConfigError`` for dimensions that do not fit together."""
    values = dict(base)
    values.update({k: v for k, v in overrides.items() if v is not None})
    cfg = ModelConfig(**values)
    for name in ("n_mels", "d_model", "n_heads", "ffn_dim", "conv_kernel", "max_chunk"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"--{name} must be a positive integer, got {getattr(cfg, name)}")
    for name in ("encoder_layers", "decoder_layers"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"--{name} must be 0 or more, got {getattr(cfg, name)}")
    if cfg.d_model % cfg.n_heads or (cfg.d_model // cfg.n_heads) % 2:
        raise ConfigError(
            f"--d_model {cfg.d_model} must split into --n_heads {cfg.n_heads} heads of even width"
        )
    for f in dataclasses.fields(ModelConfig):  # --subsampling, --cmvn: one of the field's choices
        choices, value = f.metadata.get("choices"), getattr(cfg, f.name)
        if choices and value not in choices:
            raise ConfigError(f"--{f.name} {value}: unknown; choose {' or '.join(choices)}")
    if cfg.subsampling_channels < 0 or (cfg.subsampling_channels and cfg.subsampling != "conv2d"):
        raise ConfigError(
            f"--subsampling_channels {cfg.subsampling_channels}: must be 0 (d_model) or a positive "
            "width for --subsampling conv2d"
        )
    if cfg.conv_kernel % 2 == 0:
        raise ConfigError(f"--conv_kernel must be odd, got {cfg.conv_kernel}")
    for name in ("dropout", "attention_dropout"):
        if not 0.0 <= getattr(cfg, name) < 1.0:
            raise ConfigError(f"--{name} must be in [0, 1), got {getattr(cfg, name)}")
    check_time_reduction(cfg)
    if cfg.self_condition_layer:
        if not 1 <= cfg.self_condition_layer < cfg.encoder_layers:
            raise ConfigError(
                f"--self_condition_layer {cfg.self_condition_layer}: want a block from 1 to "
                f"{cfg.encoder_layers - 1} (the last one is the CTC head's own)")
        if cfg.causal_conv or cfg.dynamic_chunk or cfg.time_reduce_layer:
            raise ConfigError(
                "--self_condition_layer is for full-context models at one frame rate (drop "
                "--causal_conv, --dynamic_chunk and --time_reduce_layer)")
    return cfg


def time_reduced_blocks(cfg: ModelConfig) -> tuple[int, int]:
    """``(after, until)``: blocks ``after + 1`` to ``until`` (counted from 1) run at half the frame
    rate; ``(0, 0)`` without time reduction."""
    if not cfg.time_reduce_layer:
        return 0, 0
    return cfg.time_reduce_layer, cfg.time_recover_layer or cfg.encoder_layers - 1


def check_time_reduction(cfg: ModelConfig) -> None:
    """``ConfigError`` in one line for a time reduction the encoder cannot run."""
    if not cfg.time_reduce_layer and not cfg.time_recover_layer:
        return
    after, until = time_reduced_blocks(cfg)
    if not 1 <= after < until <= cfg.encoder_layers:
        raise ConfigError(
            f"--time_reduce_layer {cfg.time_reduce_layer} --time_recover_layer "
            f"{cfg.time_recover_layer}: want 1 <= reduce < recover <= --encoder_layers "
            f"{cfg.encoder_layers} (recover 0: the last block but one)")
    if cfg.causal_conv or cfg.dynamic_chunk:
        raise ConfigError("--time_reduce_layer is for full-context models: a stream's chunks are "
                          "encoded at one frame rate (drop --causal_conv and --dynamic_chunk)")


@dataclass
class Seeded:
    """The seed of a run's every random draw: both trainers' and the augmentations'."""

    seed: int = field(default=DEFAULT_SEED, metadata=flag_help(
        kept_on_resume=True, text="seeds every random draw of the run (python, numpy and torch)"))


@dataclass
class RunConfig(Seeded):
    """What both trainers' runs share (``TrainConfig``'s and the language model's,
    ``training.lm_training.LMTrainConfig``): how long they train, the optimizer's peak LR and weight
    decay, the device, resuming and replacing a run, which checkpoints stay, and the seed. Each
    field is defined here once and checked once, by ``check_run_config``."""

    epochs: int = field(default=20, metadata=flag_help("passes over the training data"))
    max_steps: int = field(default=0, metadata=flag_help(
        "stop after this many optimizer steps (0: no limit)"))
    lr: float = field(default=1e-3, metadata=flag_help("peak learning rate"))
    weight_decay: float = field(default=1e-2, metadata=flag_help("AdamW weight decay"))
    device: str = field(default="auto", metadata=flag_help("auto, cpu, cuda or cuda:N"))
    keep_checkpoints: int = field(default=3, metadata=flag_help(
        "step checkpoints to keep (latest.pt and best.pt are extra)"))
    resume: str = field(default="", metadata=flag_help(
        "checkpoint path, or 'latest' for OUTPUT_DIR/latest.pt (the newest readable step file if "
        "that is broken)"))
    overwrite: bool = field(default=False, metadata=flag_help(
        "start afresh in an OUTPUT_DIR that holds a run: the old run is moved to "
        "OUTPUT_DIR.replaced-<time>/"))
    max_time: float = field(default=0.0, metadata=flag_help(
        "wall-clock budget in seconds: after the step that passes it, save and stop (0: none)"))


@dataclass
class AugmentConfig(Seeded):
    """Which augmentations run on training utterances and how, every one off by default, and the
    seed of every random draw (``data.augment.Augmenter`` takes this; a ``TrainConfig`` is one)."""

    speed_perturb: bool = field(
        default=False,
        metadata=flag_help(
            kept_on_resume=True,
            section="data",
            text=(
                "play each training utterance at a speed drawn from 0.9, 1.0, 1.1 (tempo and pitch;"
                " batches are planned for the slowest)"
            ),
        ),
    )
    noise_prob: float = field(default=0.0, metadata=flag_help(section="data", text=
        "share of training utterances that get additive noise (generated, or from --noise_dir)"))
    noise_snr_low_db: float = field(
        default=5.0,
        metadata=flag_help(section="data", text="lowest signal-to-noise ratio of the added noise"),
    )
    noise_snr_high_db: float = field(
        default=20.0,
        metadata=flag_help(section="data", text="highest signal-to-noise ratio of the added noise"),
    )
    noise_dir: str = field(
        default="",
        metadata=flag_help(
            section="data",
            text=(
                "folder of noise recordings (searched recursively), random excerpts of them"
                " (default: generated noise)"
            ),
        ),
    )
    reverb_prob: float = field(
        default=0.0,
        metadata=flag_help(
            section="data",
            text=(
                "share of training utterances convolved with a room impulse response (synthetic, or"
                " from --rir_dir)"
            ),
        ),
    )
    rir_dir: str = field(
        default="",
        metadata=flag_help(
            section="data",
            text=(
                "folder of room impulse responses (searched recursively) (default: synthetic rooms,"
                " RT60 0.2-0.9 s)"
            ),
        ),
    )
    vtlp_prob: float = field(
        default=0.0,
        metadata=flag_help(
            section="data",
            text=(
                "share of training utterances whose spectrum is warped by a factor in [0.9, 1.1]"
                " (vocal tract length perturbation)"
            ),
        ),
    )
    augment_ramp_epochs: int = field(default=0, metadata=flag_help(section="data", text=
        "a curriculum: --noise_prob, --reverb_prob and --vtlp_prob grow by a share of 1/N an epoch"
        " to their full value in epoch N (0: full from the start)"))

    @property
    def noise_snr_db(self) -> tuple[float, float]:
        return self.noise_snr_low_db, self.noise_snr_high_db

    @property
    def augments(self) -> bool:
        """Whether any augmentation is on."""
        return (
            self.speed_perturb or self.noise_prob > 0 or self.reverb_prob > 0 or self.vtlp_prob > 0
        )


@dataclass
class TrainConfig(AugmentConfig, RunConfig):
    """One training run: its own fields, then those of every run (``RunConfig``) and the
    augmentations (``AugmentConfig``). Defaults suit the demo corpus on a small GPU or a CPU."""

    train_manifest: str = field(
        default="",
        metadata={
            "section": "data",
            "help": "NeMo-style JSONL manifest for training (required, or --train_shards)",
        },
    )
    train_mix: str = field(default="", metadata=flag_help(kept_on_resume=True, section="data", text=
        "several training manifests mixed by weight, instead of --train_manifest: a comma list of "
        "PATH[:WEIGHT[:NAME]] ('fr/train.jsonl:1:fr,data/demo/train.jsonl:2:kok'); each epoch "
        "draws from each in proportion to its weight as many utterances as they have together, "
        "NAME (a language, say; default the file's name) naming it in the log"))
    train_shards: str = field(
        default="",
        metadata=flag_help(
            section="data",
            text=(
                "train on tar shards instead of --train_manifest: their shards.json"
                " (konkanivani-prepare shards), a brace pattern (shards/shard-{000000..000099}.tar)"
                " or a file listing shard paths"
            ),
        ),
    )
    shuffle_buffer: int = field(
        default=1000,
        metadata=flag_help(
            kept_on_resume=True,
            section="data",
            text=(
                "with --train_shards: utterances in the shuffle buffer of each reader, and in each"
                " length-sorted pool cut into batches (about twice this many encoded utterances in"
                " memory per worker)"
            ),
        ),
    )
    valid_manifest: str = field(
        default="",
        metadata={"section": "data", "help": "JSONL manifest for validation", "required": True},
    )
    pseudo_manifest: str = field(default="", metadata=flag_help(section="data", text=
        "a konkanivani-pseudolabel manifest to train on beside --train_manifest (its labels the "
        "teacher's; rows with an empty label, or too short for CTC: fewer encoder frames than "
        "their tokens need, are dropped and counted)"))
    pseudo_weight: float = field(default=1.0, metadata=flag_help(
        kept_on_resume=True, section="data", text=
        "with --pseudo_manifest: how often an epoch each pseudo-labelled utterance is seen against "
        "once for a transcribed one (2: twice; 0.5: a seeded half of them, the same each epoch)"))
    pseudo_noise_prob: float = field(default=0.0, metadata=flag_help(section="data", text=
        "noisy student: the share of pseudo-labelled utterances that get additive noise at "
        "--noise_snr_low_db to --noise_snr_high_db (from --noise_dir, or generated), drawn apart "
        "from and on top of the other augmentations"))
    output_dir: str = field(
        default="checkpoints/run", metadata=flag_help("where checkpoints and logs go")
    )
    preset: str = field(
        default="medium",
        metadata=flag_help(section="model", text="model size: " + ", ".join(PRESETS)),
    )
    tokenizer: str = field(
        default="",
        metadata=flag_help(
            section="data", text="existing SentencePiece .model (default: train one)"
        ),
    )
    vocab_size: int = field(default=DEFAULT_VOCAB_SIZE, metadata=flag_help(
        section="data", text="SentencePiece vocabulary size when training one"))
    tokenizer_type: str = field(
        default="unigram",
        metadata=flag_help(
            section="data",
            text=(
                "SentencePiece model type: unigram, bpe, or char (one token per character, every"
                " character of the training text: --vocab_size is then ignored)"
            ),
        ),
    )
    batch_size: int = field(
        default=8,
        metadata=flag_help(kept_on_resume=True, section="data", text="utterances per micro-batch"),
    )
    gradient_accumulation_steps: int = field(
        default=1, metadata=flag_help("micro-batches per optimizer step")
    )
    warmup_steps: int = field(
        default=300, metadata=flag_help("linear warm-up, then inverse square-root decay")
    )
    lr_schedule: str = field(default="noam", metadata=flag_help(
        "noam: a linear warm-up to --lr over --warmup_steps, then 1/sqrt(step) decay; eden "
        "(Zipformer's): half of --lr rising to --lr over --warmup_steps, times (1 + (step / "
        "--eden_steps)^2)^-1/4 (1 + (epoch / --eden_epochs)^2)^-1/4"))
    eden_steps: int = field(default=7500, metadata=flag_help(
        "with --lr_schedule eden: the steps over which the step factor decays"))
    eden_epochs: float = field(default=3.5, metadata=flag_help(
        "with --lr_schedule eden: the epochs over which the epoch factor decays"))
    grad_clip: float = field(
        default=5.0, metadata=flag_help("clip the gradient norm to this (0: off)")
    )
    ctc_weight: float = field(default=DEFAULT_CTC_WEIGHT, metadata=flag_help(
        "weight w of the CTC loss in training: loss = w * CTC + (1 - w) * attention (decoding's "
        "CTC weight is another flag, --decode_ctc_weight)"))
    label_smoothing: float = field(default=DEFAULT_LABEL_SMOOTHING, metadata=flag_help(
        "label smoothing of the attention loss"))
    ctc_weight_from: float = field(default=-1.0, metadata=flag_help(
        "start the CTC loss weight at this and move it in a straight line to --ctc_weight over "
        "--loss_ramp_steps optimizer steps (-1: --ctc_weight from the start)"))
    label_smoothing_from: float = field(default=-1.0, metadata=flag_help(
        "start the label smoothing at this and move it in a straight line to --label_smoothing "
        "over --loss_ramp_steps optimizer steps (-1: --label_smoothing from the start)"))
    loss_ramp_steps: int = field(default=0, metadata=flag_help(
        "the optimizer steps over which --ctc_weight_from and --label_smoothing_from reach "
        "--ctc_weight and --label_smoothing"))
    inter_ctc_weight: float = field(default=0.0, metadata=flag_help(
        "intermediate CTC: the CTC loss becomes (1 - w) * CTC + w * the same CTC head's loss on the"
        " states after --inter_ctc_layer (0: off; training only, the model is unchanged)"))
    inter_ctc_layer: int = field(default=0, metadata=flag_help(
        "the encoder block whose output --inter_ctc_weight scores, counted from 1 (0: the middle"
        " one)"))
    pretrain: bool = field(default=False, metadata=flag_help(
        "pretrain the encoder on audio alone by masked prediction (BEST-RQ): spans of the "
        "features become noise and a head predicts, where they were, the codes a frozen random "
        "projection gives them; the manifests' text is not read, validation reports the masked "
        "loss a frame and best.pt is its lowest; fine-tune the result with --init_from",
        kept_on_resume=True))
    mask_prob: float = field(default=0.01, metadata=flag_help(
        "with --pretrain: the chance that a feature frame starts a masked span"))
    mask_span: int = field(default=40, metadata=flag_help(
        "with --pretrain: a masked span's length in feature frames of 10 ms (40: 0.4 s)"))
    spec_augment: bool = field(
        default=True, metadata=flag_help("time and frequency masks on training batches")
    )
    spec_freq_masks: int = field(default=2, metadata=flag_help(
        "with --spec_augment: frequency masks an utterance gets"))
    spec_freq_width: int = field(default=27, metadata=flag_help(
        "with --spec_augment: the widest frequency mask, in mel bins"))
    spec_time_masks: int = field(default=2, metadata=flag_help(
        "with --spec_augment: time masks an utterance gets"))
    spec_time_width: int = field(default=40, metadata=flag_help(
        "with --spec_augment: the longest time mask, in 10 ms frames"))
    spec_time_ratio: float = field(default=0.05, metadata=flag_help(
        "with --spec_augment: the longest time mask as a share of the utterance, at most"))
    spec_augment_ramp_steps: int = field(default=0, metadata=flag_help(
        "with --spec_augment: the masks' largest widths grow in a straight line from 0 to "
        "--spec_freq_width and --spec_time_width over this many optimizer steps (0: full from "
        "the start)"))
    mixed_precision: bool = field(default=False, metadata=flag_help(
        "fp16 autocast + GradScaler on CUDA; bf16 on a CPU only where it computes bf16 natively"))
    num_workers: int = field(
        default=2, metadata=flag_help(section="data", text="DataLoader worker processes")
    )
    empty_cache_every: int = field(default=50, metadata=flag_help(
        "call torch.cuda.empty_cache() every N batches on CUDA (0: never)"))
    pad_to_frames: int = field(default=0, metadata=flag_help(
        section="data", text="pad each training batch to a multiple of N feature frames (and its "
        "tokens to a multiple of 8), so that batches take few shapes and cuDNN's and "
        "torch.compile's caches hit; the epoch's log line gives the padding (0: off)"))
    save_every_steps: int = field(
        default=0, metadata=flag_help("also save every N optimizer steps (0: each epoch only)")
    )
    max_duration: float = field(default=DEFAULT_MAX_DURATION, metadata=flag_help(
        kept_on_resume=True, section="data", text="skip utterances longer than this many seconds"))
    log_every: int = field(
        default=50,
        metadata=flag_help(
            "log a summary line (loss, lr, utt/s, memory) every N optimizer steps, to the console"
            " and train.log"
        ),
    )
    validate_every_steps: int = field(
        default=0,
        metadata=flag_help(
            "also validate (and keep best.pt current) every N optimizer steps, not only at epoch"
            " ends (0: epochs only)"
        ),
    )
    progress: bool = field(default=True, metadata=flag_help("show tqdm progress bars"))
    tensorboard: bool = field(
        default=True,
        metadata=flag_help(
            "write the metrics as TensorBoard event files to OUTPUT_DIR/tensorboard/ (when"
            " TensorBoard is installed)"
        ),
    )
    max_consecutive_skips: int = field(
        default=20,
        metadata=flag_help(
            "stop after this many updates in a row skipped for a non-finite loss or gradients (0:"
            " never)"
        ),
    )
    duration_tolerance: float = field(
        default=DEFAULT_DURATION_TOLERANCE,
        metadata=flag_help(
            section="data",
            text=(
                "skip rows whose 'duration' differs from the audio file's by more seconds "
                "than this (<0: don't compare)"
            ),
        ),
    )
    optimizer: str = field(default="adamw", metadata=flag_help(
        "adamw; adamw_8bit (also adamw8bit): 8-bit AdamW states from bitsandbytes; or "
        "scaled_adam (Zipformer's ScaledAdam: steps relative to each tensor's scale, no weight "
        "decay; its --lr is about ten times AdamW's, e.g. 0.045 with --lr_schedule eden)"))
    gradient_checkpointing: bool = field(
        default=False,
        metadata=flag_help(
            "recompute each encoder/decoder layer in the backward pass instead of storing its"
            " activations"
        ),
    )
    precision: str = field(
        default="",
        metadata=flag_help(
            "fp32, fp16 or bf16 autocast; overrides --mixed_precision (default: as"
            " --mixed_precision decides)"
        ),
    )
    max_batch_frames: int = field(
        default=0,
        metadata=flag_help(
            kept_on_resume=True,
            section="data",
            text=(
                "dynamic batches of at most this many padded 10 ms frames, bucketed by length (0:"
                " --batch_size)"
            ),
        ),
    )
    max_batch_seconds: float = field(
        default=0.0,
        metadata=flag_help(
            kept_on_resume=True,
            section="data",
            text="the same budget in seconds of padded audio (100 frames a second)",
        ),
    )
    num_buckets: int = field(
        default=10,
        metadata=flag_help(
            kept_on_resume=True, section="data", text="length buckets of the dynamic batches"
        ),
    )
    length_curriculum_epochs: int = field(
        default=0,
        metadata=flag_help(
            kept_on_resume=True,
            section="data",
            text=(
                "the first N epochs take their batches shortest first (a length curriculum, "
                "SortaGrad); later epochs are shuffled as usual (0: off)"
            ),
        ),
    )
    max_memory_gb: float = field(
        default=0.0,
        metadata=flag_help(
            kept_on_resume=True,
            section="data",
            text=(
                "cap each dynamic batch so the estimated peak training memory stays under this (0:"
                " no cap)"
            ),
        ),
    )
    auto_batch: bool = field(default=False, metadata=flag_help(section="data", text=
        "probe the device before training for the largest batch budget that fits"))
    preflight: bool = field(
        default=True,
        metadata=flag_help(
            kept_on_resume=True,
            section="data",
            text=(
                "first epoch starts with the largest batches, so an out-of-memory error shows at"
                " once"
            ),
        ),
    )
    max_samples: int = field(default=0, metadata=flag_help(section="data", text=
        "train on a seeded choice of N utterances (0: all); may grow on resume"))
    compile: bool = field(
        default=False, metadata=flag_help("torch.compile the model (eager if compiling fails)")
    )
    strategy: str = field(
        default="ddp",
        metadata=flag_help(
            "under torchrun: ddp (each process holds the model) or fsdp (parameters, gradients and"
            " optimizer states sharded between the processes, offloaded to CPU memory on CUDA; for"
            " models past ~100 M parameters)"
        ),
    )
    gpu_memory_gb: float = field(
        default=0.0,
        metadata=flag_help(
            section="data",
            text=(
                "on CUDA: use at most this much GPU memory (a larger card then behaves as one of"
                " this size) and size each batch to fill it by the calibrated memory estimate, in"
                " place of --batch_size and --gradient_accumulation_steps; the peak --lr grows with"
                " the square root of the batch (at most 2x) and the warm-up covers as many"
                " utterances as before (0: off; no effect on a CPU)"
            ),
        ),
    )
    offload_activations: bool = field(
        default=False,
        metadata=flag_help(
            "keep the activations saved for the backward pass in pinned CPU memory (CUDA only;"
            " slower, less GPU memory)"
        ),
    )
    ema_decay: float = field(
        default=0.0,
        metadata=flag_help(
            "keep an exponential moving average of the weights with this decay (e.g. 0.999; 0:"
            " off); validation, best.pt and decoding use it"
        ),
    )
    init_from: str = field(default="", metadata=flag_help(section="init", text=
        "start a fresh run from another run's checkpoint: its weights where they fit (vocabulary "
        "rows matched by token), its model dimensions unless model flags are given; own tokenizer, "
        "optimizer and step 0"))
    init_modules: str = field(
        default=",".join(INIT_MODULES),
        metadata=flag_help(
            section="init",
            text="with --init_from: the modules to take from it, a comma list of "
            + ", ".join(INIT_MODULES),
        ),
    )
    keep_init_cmvn: bool = field(
        default=False,
        metadata=flag_help(
            section="init",
            text=(
                "with --init_from: keep its CMVN statistics instead of computing them from the new"
                " training data"
            ),
        ),
    )
    freeze_encoder_steps: int = field(
        default=0,
        metadata=flag_help(
            "leave the encoder unchanged for the first N optimizer steps (the heads learn first),"
            " then train it"
        ),
    )


TOKENIZER_TYPES = ("unigram", "bpe", "char")
# --precision ("" or left out: decided by --mixed_precision and the device)
PRECISIONS = ("fp32", "fp16", "bf16")
# --optimizer's accepted spellings -> the name stored in checkpoints (training.optim builds them).
OPTIMIZERS = {"adamw": "adamw", "adamw_8bit": "adamw_8bit", "adamw8bit": "adamw_8bit",
              "scaled_adam": "scaled_adam", "scaledadam": "scaled_adam"}
LR_SCHEDULES = ("noam", "eden")
STRATEGIES = ("ddp", "fsdp")  # --strategy under torchrun (training.distributed)


def _at_least(low: float, integer: bool = True) -> Callable[[Any], bool]:
    return lambda v: (isinstance(v, int) or not integer) and math.isfinite(v) and v >= low


def _fraction(v: float) -> bool:
    return 0.0 <= v <= 1.0


# What a checked value must be, said as the message says it.
Check = tuple[Callable[[Any], bool], str]
POSITIVE_INTEGER: Check = (_at_least(1), "a positive integer")
COUNT: Check = (_at_least(0), "0 or more")
AMOUNT: Check = (_at_least(0, integer=False), "0 or more")
POSITIVE_NUMBER: Check = (lambda v: math.isfinite(v) and v > 0, "a positive number")
BELOW_ONE: Check = (lambda v: 0.0 <= v < 1.0, "in [0, 1)")

# The checks of the fields every run has (RunConfig), which both trainers make.
_RUN_CHECKS: dict[str, Check] = {
    "epochs": POSITIVE_INTEGER, "keep_checkpoints": POSITIVE_INTEGER, "max_steps": COUNT,
    "max_time": AMOUNT, "weight_decay": AMOUNT, "lr": POSITIVE_NUMBER,
    "device": (lambda v: re.fullmatch(r"auto|cpu|cuda(:\d+)?|mps", v) is not None,
               "auto, cpu, cuda or cuda:N"),
}

# Each checked flag of TrainConfig's own and its augmentations'.
_CHECKS: dict[str, Check] = {
    **{
        name: POSITIVE_INTEGER
        for name in (
            "batch_size",
            "gradient_accumulation_steps",
            "vocab_size",
            "log_every",
            "num_buckets",
            "shuffle_buffer",
        )
    },
    **{
        name: COUNT
        for name in (
            "warmup_steps",
            "num_workers",
            "empty_cache_every",
            "pad_to_frames",
            "save_every_steps",
            "validate_every_steps",
            "max_batch_frames",
            "max_samples",
            "max_consecutive_skips",
            "freeze_encoder_steps",
            "augment_ramp_epochs",
            "length_curriculum_epochs",
        )
    },
    **{
        name: AMOUNT
        for name in ("max_batch_seconds", "max_memory_gb", "gpu_memory_gb", "grad_clip")
    },
    "max_duration": (lambda v: v > 0, "a positive number of seconds"),
    "ctc_weight": (_fraction, "in [0, 1]"),
    "inter_ctc_weight": BELOW_ONE,
    "mask_prob": (lambda v: 0.0 < v < 1.0, "in (0, 1)"),
    "mask_span": POSITIVE_INTEGER,
    "pseudo_weight": POSITIVE_NUMBER,
    "pseudo_noise_prob": (_fraction, "in [0, 1]"),
    "inter_ctc_layer": (lambda v: v >= 0, "a block number from 1 (0: the middle one)"),
    **{name: (_fraction, "in [0, 1]") for name in ("noise_prob", "reverb_prob", "vtlp_prob")},
    **{
        name: (math.isfinite, "a number of dB")
        for name in ("noise_snr_low_db", "noise_snr_high_db")
    },
    "label_smoothing": BELOW_ONE,
    "ctc_weight_from": (lambda v: v == -1 or 0 <= v <= 1, "in [0, 1] (or -1: off)"),
    "label_smoothing_from": (lambda v: v == -1 or 0 <= v < 1, "in [0, 1) (or -1: off)"),
    "loss_ramp_steps": COUNT,
    **{name: COUNT for name in ("spec_freq_masks", "spec_freq_width", "spec_time_masks",
                                "spec_time_width", "spec_augment_ramp_steps")},
    "spec_time_ratio": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "ema_decay": (lambda v: 0.0 <= v < 1.0, "in [0, 1) (0: off)"),
    "tokenizer_type": (TOKENIZER_TYPES.__contains__, "one of " + ", ".join(TOKENIZER_TYPES)),
    "precision": (
        lambda v: v in ("", *PRECISIONS),
        f"one of {', '.join(PRECISIONS)} (or left out)",
    ),
    "optimizer": (OPTIMIZERS.__contains__, "adamw, adamw_8bit or scaled_adam"),
    "lr_schedule": (LR_SCHEDULES.__contains__, "noam or eden"),
    "eden_steps": POSITIVE_INTEGER,
    "eden_epochs": POSITIVE_NUMBER,
    "strategy": (STRATEGIES.__contains__, " or ".join(STRATEGIES)),
    "preset": (PRESETS.__contains__, "one of " + ", ".join(PRESETS)),
}


def check_values(cfg: Any, checks: dict[str, Check]) -> None:
    """``ConfigError`` for the first field of ``cfg`` whose value its check refuses, in one line:
    ``--NAME must be WANTED, got VALUE``."""
    for name, (ok, wanted) in checks.items():
        value = getattr(cfg, name)
        if not ok(value):
            raise ConfigError(f"--{name} must be {wanted}, got {value!r}")


def check_run_config(cfg: RunConfig) -> None:
    """The checks of every run's fields (``RunConfig``), the same for both trainers."""
    check_values(cfg, _RUN_CHECKS)
    if cfg.resume and cfg.resume != "latest" and not Path(cfg.resume).is_file():
        raise ConfigError(f"{checkpoint_file_error(cfg.resume, '--resume')} (or give 'latest')")
    if cfg.resume and cfg.overwrite:
        raise ConfigError("give --resume or --overwrite, not both")


@dataclass(frozen=True)
class MixEntry:
    """One training manifest of ``--train_mix``: its path, weight and name."""

    path: str
    weight: float
    name: str


def parse_mix(spec: str) -> list[MixEntry]:
    """The entries of a ``--train_mix`` value, ``PATH[:WEIGHT[:NAME]]`` separated by commas (the
    fields read from the right, so a path may hold a colon); ``ConfigError`` naming a bad one."""
    entries = []
    for item in (part.strip() for part in spec.split(",")):
        fields, weight, name = item.split(":"), "1", ""
        if len(fields) >= 3 and _is_number(fields[-2]):
            *path, weight, name = fields
        elif len(fields) >= 2 and _is_number(fields[-1]):
            *path, weight = fields
        else:
            path = fields
        path = ":".join(path)
        if not path:
            raise ConfigError(f"--train_mix {spec!r}: an entry without a manifest ({item!r})")
        value = float(weight)
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"--train_mix {item}: the weight must be a positive number")
        name = name.strip() or Path(path).stem
        if not re.fullmatch(r"[\w.-]+", name):
            raise ConfigError(f"--train_mix {item}: a name is letters, digits, '.', '-' or '_'")
        entries.append(MixEntry(path, value, name))
    names = [e.name for e in entries]
    if len(entries) < 2 or len(set(names)) != len(names):
        raise ConfigError(f"--train_mix {spec!r}: give two or more manifests, each its own name "
                          f"(got {', '.join(names)})")
    return entries


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def check_config(cfg: TrainConfig) -> None:
    """Every flag value of ``cfg`` that can be checked before any work; ``ConfigError`` naming the
    first bad one. (The model's flags are checked as ``resolve_model_config`` resolves them.)"""
    check_run_config(cfg)
    check_values(cfg, _CHECKS)
    if not cfg.train_manifest and not cfg.train_shards and not cfg.train_mix:
        raise ConfigError("--train_manifest (or --train_shards, or --train_mix) is required")
    if cfg.train_mix:
        _check_mix(cfg)
    if not cfg.valid_manifest:
        raise ConfigError("--valid_manifest is required")
    if cfg.train_shards and cfg.pseudo_manifest:
        raise ConfigError("--pseudo_manifest goes with --train_manifest; to train on shards, write "
                          "shards of both manifests together (konkanivani-prepare shards)")
    files = ((() if cfg.train_shards or cfg.train_mix else ("train_manifest",))
             + ("valid_manifest", "tokenizer", "pseudo_manifest"))
    for name in files:
        path = getattr(cfg, name)
        if path and not Path(path).is_file():
            raise ConfigError(f"--{name} {path}: file not found")
    # A resumed run does not read --init_from: its own checkpoint started from it.
    if cfg.init_from and not cfg.resume and (why := checkpoint_file_error(cfg.init_from,
                                                                          "--init_from")):
        raise ConfigError(why)
    for name in ("noise_dir", "rir_dir"):
        path = getattr(cfg, name)
        if path and not Path(path).is_dir():
            raise ConfigError(f"--{name} {path}: folder not found")
    if cfg.noise_snr_low_db > cfg.noise_snr_high_db:
        raise ConfigError(
            f"--noise_snr_low_db {cfg.noise_snr_low_db:g} is above --noise_snr_high_db "
            f"{cfg.noise_snr_high_db:g}"
        )
    if cfg.max_batch_frames and cfg.max_batch_seconds:
        raise ConfigError("give --max_batch_frames or --max_batch_seconds, not both")
    if cfg.train_shards and cfg.length_curriculum_epochs:
        raise ConfigError("--length_curriculum_epochs orders the rows of --train_manifest; shards "
                          "are read as they were written, a stream a worker")
    if cfg.train_shards and cfg.max_samples:
        raise ConfigError(
            "--max_samples picks rows of --train_manifest; with --train_shards, write shards of the"
            " rows to train on"
        )
    for name in ("ctc_weight_from", "label_smoothing_from"):
        if getattr(cfg, name) != -1 and not cfg.loss_ramp_steps:
            raise ConfigError(f"--{name} needs --loss_ramp_steps, the steps its ramp takes")
    if cfg.strategy == "fsdp" and cfg.optimizer != "adamw":
        raise ConfigError(
            "--strategy fsdp shards AdamW's states itself; use --optimizer adamw with it"
        )
    if cfg.strategy == "fsdp" and cfg.ema_decay:
        raise ConfigError(
            "--ema_decay keeps a whole copy of the weights in every process, which --strategy fsdp "
            "is there to avoid; use --strategy ddp with it"
        )
    unknown = [m for m in cfg.init_modules.split(",") if m.strip() not in INIT_MODULES]
    if unknown or not cfg.init_modules.strip():
        raise ConfigError(
            f"--init_modules {cfg.init_modules!r}: give a comma list of {', '.join(INIT_MODULES)}"
        )
    if cfg.keep_init_cmvn and not cfg.init_from:
        raise ConfigError(
            "--keep_init_cmvn keeps the CMVN statistics of --init_from: give --init_from too"
        )
    if cfg.pretrain:
        _check_pretrain(cfg)


def _check_pretrain(cfg: TrainConfig) -> None:
    """The flags that pretraining leaves nothing to do for, or does not read."""
    if cfg.train_shards:
        raise ConfigError("--pretrain reads manifests (their text is not needed); shards are "
                          "checked against a tokenizer as they are read")
    if cfg.pseudo_manifest:
        raise ConfigError("--pretrain learns from audio alone: give --pseudo_manifest's audio as "
                          "a --train_mix entry or the --train_manifest")
    if cfg.inter_ctc_weight:
        raise ConfigError("--inter_ctc_weight is a CTC term; --pretrain has no transcripts")


def _check_mix(cfg: TrainConfig) -> None:
    """--train_mix's entries, and the flags that go with one training manifest only."""
    for other in ("train_shards", "pseudo_manifest"):  # (--train_manifest, a recipe's say, unused)
        if getattr(cfg, other):
            raise ConfigError(f"--train_mix takes the place of --train_manifest; give --{other} "
                              "as one of its entries, or leave it out")
    if cfg.max_samples:
        raise ConfigError("--max_samples picks rows of --train_manifest; with --train_mix, the "
                          "weights decide how many of each manifest an epoch takes")
    for entry in parse_mix(cfg.train_mix):
        if not Path(entry.path).is_file():
            raise ConfigError(f"--train_mix {entry.path}: file not found")


def resolve_model_config(cfg: TrainConfig, flags: dict[str, Any] | None = None,
                         saved: dict[str, Any] | None = None) -> ModelConfig:
    """The model a run trains, resolved once. On --resume: its checkpoint's ``saved`` config (model
    flags that differ are ignored, with a warning). On a fresh run: --preset's dimensions, or the
    --init_from checkpoint's (``saved``), with the model ``flags`` given (not None) over them;
    ``ConfigError`` for dimensions that do not fit together. The vocabulary is the tokenizer's,
    filled in with ``dataclasses.replace`` once it is known (0 until then on a fresh run)."""
    given = {k: v for k, v in (flags or {}).items() if v is not None}
    if cfg.resume:
        model_cfg = ModelConfig.from_dict(saved)
        if any(getattr(model_cfg, k) != v for k, v in given.items()):
            log.warning("model flags ignored on resume: the checkpoint's dimensions are used")
        return _fits(cfg, model_cfg)
    # pretraining has the masked-prediction head (1024 codes unless --codebook_size says); a
    # model fine-tuned, from a pretrained encoder too, has none
    given["codebook_size"] = ((given.get("codebook_size") or DEFAULT_CODEBOOK_SIZE)
                              if cfg.pretrain else 0)
    if not cfg.init_from:
        return _fits(cfg, model_config_from_preset(cfg.preset, **given))
    base = {**dataclasses.asdict(ModelConfig.from_dict(saved)), "vocab_size": 0}
    changed = ", ".join(f"--{k} {v}" for k, v in given.items() if v != base[k])
    log.info("--init_from: model dimensions from %s%s (--preset not used)", cfg.init_from,
             f", with {changed} from the command line" if changed else "")
    return _fits(cfg, model_config_from(base, **given))


def _fits(cfg: TrainConfig, model_cfg: ModelConfig) -> ModelConfig:
    """``model_cfg``, once the training flags that depend on its dimensions are checked."""
    if model_cfg.codebook_size and (model_cfg.time_reduce_layer or
                                    model_cfg.self_condition_layer):
        raise ConfigError("--pretrain predicts a code every four feature frames, from the states "
                          "of a model without --time_reduce_layer or --self_condition_layer")
    if cfg.spec_augment and cfg.spec_freq_masks and cfg.spec_freq_width > model_cfg.n_mels:
        raise ConfigError(f"--spec_freq_width {cfg.spec_freq_width}: a mask wider than the "
                          f"model's {model_cfg.n_mels} mel bins would blank whole utterances")
    return model_cfg


def _flag_type(tp: Any) -> Any:
    if get_origin(tp) is Union:  # Optional[X] -> X
        tp = next(a for a in get_args(tp) if a is not type(None))
    return tp


class Removed(argparse.Action):
    """A removed spelling of a flag (CHANGELOG.md): giving it, with or without a value, stops the
    parser with one line naming the flag to use, where argparse would only call it unrecognized
    (``parser.add_argument("--old", action=Removed, new="--new")``)."""

    def __init__(self, option_strings: list[str], dest: str, new: str, **kwargs: Any):
        super().__init__(option_strings, dest, nargs="?", default=argparse.SUPPRESS,
                         help=argparse.SUPPRESS, **kwargs)
        self.new = new

    def __call__(self, parser, namespace, values, option_string: str | None = None) -> None:
        parser.error(f"{option_string} is now spelled {self.new}")


class _Switch(argparse.Action):
    """A boolean flag: ``--name`` sets it, ``--no_name`` clears it."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any):
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, option_string == f"--{self.dest}")


def flag_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of ``cls`` in the order its flags, its help and a recipe list them: its own first,
    then those it inherits (a TrainConfig's augmentation fields come after the run's own)."""
    own = set(cls.__dict__.get("__annotations__", {}))
    return sorted(dataclasses.fields(cls), key=lambda f: f.name not in own)


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, *, defaults: bool = True,
                       skip: tuple[str, ...] = ()) -> None:
    """Add one ``--field`` flag per dataclass field, typed from its annotation.

    With ``defaults=False`` every flag defaults to None, meaning "not given" (used for model
    dimensions, which fall back to the chosen preset). Booleans take ``--flag`` / ``--no_flag``
    (``--no-flag``, argparse's spelling, is refused in one line naming ``--no_flag``:
    ``Removed``).
    """
    hints = get_type_hints(cls)
    for f in flag_fields(cls):
        if f.name in skip or f.metadata.get("from_tokenizer"):
            continue
        tp = _flag_type(hints[f.name])
        default = f.default if defaults else None
        help_text = f.metadata.get("help", "")
        required = f.metadata.get("required", False)
        if required:
            help_text += " (required)"
        elif defaults and tp is not bool:
            help_text += f" (default: {f.default!r})"
        if tp is bool:
            parser.add_argument(
                f"--{f.name}", f"--no_{f.name}", action=_Switch, default=default, help=help_text
            )
            # argparse's spelling, this project's before
            parser.add_argument(f"--no-{f.name}", action=Removed, new=f"--no_{f.name}")
        else:
            parser.add_argument(
                f"--{f.name}",
                type=tp,
                default=default,
                help=help_text,
                required=required,
                choices=f.metadata.get("choices"),
            )


def dataclass_from_args(cls: type, args: argparse.Namespace, **extra: Any):
    """Build ``cls`` from the parsed flags that name its fields."""
    names = {f.name for f in dataclasses.fields(cls)}
    values = {k: v for k, v in vars(args).items() if k in names and v is not None}
    values.update(extra)
    return cls(**values)
