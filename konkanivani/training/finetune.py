"""Fine-tuning: a fresh run that starts from another run's weights (``--init_from``), and the
encoder held still for its first steps (``--freeze_encoder_steps``).

The new run has its own tokenizer, so the tensors with one row per token
(``ASRModel.VOCABULARY_TENSORS``) may differ in size or order from the checkpoint's. Their rows are
matched by piece: a token whose piece string is in both vocabularies starts from its old row, the
specials (blank, unk, sos/eos) by their role, and the other rows keep their fresh initialization.
Any other tensor is loaded where its shape is the same and skipped otherwise (another ``--d_model``,
say), and the report says which.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..checkpoint import CheckpointError, InferenceModel, load_checkpoint
from ..config import ConfigError
from ..data.tokenizer import BLANK_ID, SOS_EOS_ID, UNK_ID, Tokenizer
from ..model.asr import ASRModel

__all__ = ["InitReport", "load_init_checkpoint", "token_row_map", "load_init_weights",
           "keep_init_cmvn", "hold_encoder"]


_SPECIALS = (BLANK_ID, UNK_ID, SOS_EOS_ID)  # the same ids in every konkanivani tokenizer


@dataclass
class InitReport:
    """What ``load_init_weights`` took from the checkpoint."""

    source: str
    modules: tuple[str, ...]  # the modules asked for (--init_modules)
    weights: str  # "EMA" or "training": which weights of the checkpoint
    loaded: list[str] = field(default_factory=list)  # tensors copied whole
    # name -> (rows matched by token, rows)
    resized: dict[str, tuple[int, int]] = field(default_factory=dict)
    # name -> why it kept its fresh initialization
    skipped: dict[str, str] = field(default_factory=dict)

    def summary(self) -> str:
        """The one log line: ``init_from X: loaded 212 tensors (encoder, decoder), resized 4 (...),
        skipped 0``."""
        modules = sorted({name.split(".")[0] for name in self.loaded}, key=self.modules.index)
        resized = ", ".join(f"{name}: {matched} of {rows} rows matched by token"
                            for name, (matched, rows) in self.resized.items())
        skipped = ", ".join(f"{name}: {why}" for name, why in list(self.skipped.items())[:3])
        more = f", {len(self.skipped) - 3} more" if len(self.skipped) > 3 else ""
        return (
            f"init_from {self.source} ({self.weights} weights): loaded {len(self.loaded)} tensors"
            f" ({', '.join(modules) or 'none'}), resized"
            f" {len(self.resized)}{f' ({resized})' if resized else ''}, skipped"
            f" {len(self.skipped)}{f' ({skipped}{more})' if skipped else ''}"
        )


def token_row_map(old: Tokenizer, new: Tokenizer) -> dict[int, int]:
    """``{new id: old id}`` for the tokens of ``new`` that ``old`` has too: the specials by their
    role, the others by their piece string."""
    old_ids = {
        piece: i for i, piece in enumerate(old.pieces(range(old.vocab_size))) if i not in _SPECIALS
    }
    rows = {i: i for i in _SPECIALS}
    for i, piece in enumerate(new.pieces(range(new.vocab_size))):
        if i not in _SPECIALS and piece in old_ids:
            rows[i] = old_ids[piece]
    return rows


@torch.no_grad()
def load_init_weights(
    model: ASRModel,
    tokenizer: Tokenizer,
    init: InferenceModel,
    modules: tuple[str, ...],
    source: str = "the checkpoint",
) -> InitReport:
    """Load into ``model`` (whose vocabulary is ``tokenizer``'s) the tensors of ``modules`` from
    the checkpoint's model ``init`` (its EMA weights where it has them) that fit; see the module's
    docstring. The CMVN statistics are not among them (``keep_init_cmvn``)."""
    weights = init.weights
    report = InitReport(source, modules, "EMA" if init.ema else "training")
    old_tokenizer = Tokenizer(init.tokenizer)
    same_vocabulary = old_tokenizer.model_proto == tokenizer.model_proto
    rows = token_row_map(old_tokenizer, tokenizer)
    new_ids, old_ids = list(rows), list(rows.values())
    init: dict[str, torch.Tensor] = {}
    for name, fresh in model.state_dict().items():
        if name.split(".")[0] not in modules:
            continue
        if name not in weights:
            report.skipped[name] = "not in the checkpoint"
            continue
        old = weights[name]
        if (
            name in ASRModel.VOCABULARY_TENSORS
            and not same_vocabulary
            and old.shape[1:] == fresh.shape[1:]
        ):
            init[name] = fresh.clone()
            init[name][new_ids] = old[old_ids].to(fresh.dtype)
            report.resized[name] = (len(rows), fresh.shape[0])
        elif old.shape == fresh.shape:
            init[name] = old
            report.loaded.append(name)
        else:
            report.skipped[name] = f"{tuple(old.shape)} there, {tuple(fresh.shape)} here"
    model.load_state_dict(init, strict=False)  # the rest keeps its fresh initialization
    return report


@torch.no_grad()
def keep_init_cmvn(model: ASRModel, init: InferenceModel) -> None:
    """The CMVN statistics of the checkpoint's model ``init`` in place of those of the new training
    data (``--keep_init_cmvn``)."""
    mean, std = init.cmvn
    if mean.shape != model.feat_mean.shape:
        raise ValueError(
            f"--keep_init_cmvn: the checkpoint's features have {mean.numel()} mel bins, this model "
            f"{model.feat_mean.numel()}"
        )
    model.set_cmvn(mean, std)


def hold_encoder(model: torch.nn.Module, step: int, freeze_steps: int) -> bool:
    """Drop the encoder's gradients before optimizer step ``step + 1`` when it is one of the first
    ``freeze_steps``; returns whether it did.

    Dropping gradients, rather than turning ``requires_grad`` off, keeps every process of a
    data-parallel run computing the same graph (DDP and FSDP expect a fixed set of parameters to
    reduce), and AdamW (torch's and bitsandbytes') leaves a parameter without a gradient alone: no
    update, no weight decay, no moment. It is decided from the step alone, so a resumed run freezes
    exactly as an unbroken one. (The encoder's backward pass is still computed.)
    """
    if step >= freeze_steps:
        return False
    for p in model.encoder.parameters():
        p.grad = None
    return True


def load_init_checkpoint(path: str) -> InferenceModel:
    """The model of the checkpoint --init_from names; ``ConfigError`` naming the file when it cannot
    be read or holds no model."""
    try:
        state = load_checkpoint(path)
    except CheckpointError as e:
        raise ConfigError(f"--init_from: {e}") from e
    if missing := InferenceModel.missing(state):
        raise ConfigError(f"--init_from {path}: not a model checkpoint (no {', '.join(missing)})")
    return InferenceModel.of(state)
