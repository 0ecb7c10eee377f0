"""The training objective, in one place: which loss terms train the model, their weights and the
ramps that move them (pure functions of the optimizer step, like the learning rate), and the
SpecAugment policy.

``ASRModel.forward`` returns the terms unweighted (``LossTerms``: CTC, attention and, when a tap
asks for it, intermediate CTC, each summed over the batch); ``Objective`` runs it for a step and
weights them::

    loss = w_ctc * ctc + (1 - w_ctc) * attention  [+ w_ctc * w_inter * (inter_ctc - ctc)]

or, pretraining on audio alone (``pretrain``), the masked-prediction term by itself
(``ASRModel.masked_prediction``)::

    loss = masked

The training step and validation both take the run's objective, so the training weights and their
moving average (EMA) are scored by one definition, and every term is reported (the step's log line
and ``metrics.jsonl``). A new loss is one more term here and in ``LossTerms``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional

import torch

from ..config import DEFAULT_CTC_WEIGHT, DEFAULT_LABEL_SMOOTHING, ConfigError, TrainConfig
from ..data.augment import ramp_done
from ..model.asr import LossTerms, Masking, SpecAugment

__all__ = ["Losses", "Objective", "StepWeights"]


class StepWeights(NamedTuple):
    """What the objective is at one step."""

    ctc: float  # the CTC term's weight; the attention term's is 1 - ctc
    label_smoothing: float  # of the attention term's targets
    inter_ctc: float  # intermediate CTC's share of the CTC weight (0: off)
    spec_scale: float  # SpecAugment's widest masks, as a share of their full widths


class Losses(NamedTuple):
    """A batch's weighted loss and its terms, each summed over the batch's utterances."""

    loss: torch.Tensor
    ctc: Optional[torch.Tensor]  # None in pretraining, as attention
    attention: Optional[torch.Tensor]
    inter_ctc: Optional[torch.Tensor] = None
    masked: Optional[torch.Tensor] = None  # pretraining's

    def named(self) -> dict[str, torch.Tensor]:
        """The terms there are, by name (``inter_ctc`` only where it was computed)."""
        return {k: v for k, v in self._asdict().items() if v is not None}


@dataclasses.dataclass(frozen=True)
class Objective:
    """The loss terms' weights, their ramps and SpecAugment, for a model of ``encoder_layers``
    blocks. ``ctc_weight_from`` / ``label_smoothing_from`` (-1: none) move in a straight line to
    ``ctc_weight`` / ``label_smoothing`` over ``loss_ramp_steps``; SpecAugment's widest masks grow
    from 0 over ``spec_augment_ramp_steps``. ``inter_ctc_layer`` 0 is the middle block.
    ``pretrain``: masked prediction alone, with spans of ``mask_span`` frames starting at a frame
    with probability ``mask_prob``."""

    ctc_weight: float = DEFAULT_CTC_WEIGHT
    label_smoothing: float = DEFAULT_LABEL_SMOOTHING
    ctc_weight_from: float = -1.0
    label_smoothing_from: float = -1.0
    loss_ramp_steps: int = 0
    inter_ctc_weight: float = 0.0
    inter_ctc_layer: int = 0
    encoder_layers: int = 0
    spec_augment: Optional[SpecAugment] = None
    spec_augment_ramp_steps: int = 0
    pretrain: bool = False
    mask_prob: float = 0.01
    mask_span: int = 40

    def __post_init__(self) -> None:
        if self.inter_ctc_weight and self.encoder_layers:
            if not 0 <= self.inter_ctc_layer < self.encoder_layers:
                raise ConfigError(f"--inter_ctc_layer {self.inter_ctc_layer}: the encoder's blocks "
                                  f"are 1 to {self.encoder_layers}, and the last one is the CTC "
                                  "head's own")
            if not self.inter_ctc_layer:
                object.__setattr__(self, "inter_ctc_layer", max(self.encoder_layers // 2, 1))
        elif not self.inter_ctc_weight:
            object.__setattr__(self, "inter_ctc_layer", 0)

    @classmethod
    def from_config(cls, cfg: TrainConfig, encoder_layers: int) -> "Objective":
        """The objective of a training run's flags."""
        augment = (SpecAugment(cfg.spec_freq_masks, cfg.spec_freq_width, cfg.spec_time_masks,
                               cfg.spec_time_width, cfg.spec_time_ratio)
                   if cfg.spec_augment else None)
        return cls(cfg.ctc_weight, cfg.label_smoothing, cfg.ctc_weight_from,
                   cfg.label_smoothing_from, cfg.loss_ramp_steps, cfg.inter_ctc_weight,
                   cfg.inter_ctc_layer, encoder_layers, augment, cfg.spec_augment_ramp_steps,
                   cfg.pretrain, cfg.mask_prob, cfg.mask_span)

    def masking(self, generator: Optional[torch.Generator] = None) -> Optional[Masking]:
        """Pretraining's masks, drawn from ``generator`` (None: torch's); None otherwise."""
        return Masking(self.mask_prob, self.mask_span, generator) if self.pretrain else None

    def at(self, step: int) -> StepWeights:
        """The weights of the update after ``step`` optimizer steps: a pure function of the step,
        so a resumed run goes on with the weights the unbroken one had."""
        done = ramp_done(step, self.loss_ramp_steps)

        def ramp(start: float, end: float) -> float:
            return end if start == -1 or done == 1.0 else start + (end - start) * done

        return StepWeights(ramp(self.ctc_weight_from, self.ctc_weight),
                           ramp(self.label_smoothing_from, self.label_smoothing),
                           self.inter_ctc_weight, ramp_done(step, self.spec_augment_ramp_steps))

    def __call__(self, forward: Callable[..., Any], feats: torch.Tensor, feat_lens: torch.Tensor,
                 tokens: torch.Tensor, token_lens: torch.Tensor, step: int = 0) -> Losses:
        """The training losses of a batch at ``step``: ``forward`` (the model, or its
        data-parallel or compiled forward) with this step's SpecAugment, label smoothing and tap,
        its terms weighted."""
        weights = self.at(step)
        if self.pretrain:  # the masks take SpecAugment's place
            return self.weigh(forward(feats, feat_lens, tokens, token_lens,
                                      masking=self.masking()), weights)
        if self.spec_augment is not None:
            self.spec_augment.set_scale(weights.spec_scale)
        terms = forward(feats, feat_lens, tokens, token_lens, augment=self.spec_augment,
                        label_smoothing=weights.label_smoothing, tap=self.inter_ctc_layer)
        return self.weigh(terms, weights)

    def validation(self, model: torch.nn.Module, enc: torch.Tensor, enc_lens: torch.Tensor,
                   tokens: torch.Tensor, token_lens: torch.Tensor, step: int) -> Losses:
        """The losses of encoder states ``enc`` at a validation after ``step`` optimizer steps,
        weighted as the update that made those weights was (the step before): training weights and
        their average alike. Intermediate CTC trains only; it is not part of it."""
        weights = self.at(max(step - 1, 0))
        return self.weigh(model.losses(enc, enc_lens, tokens, token_lens,
                                       label_smoothing=weights.label_smoothing), weights)

    @staticmethod
    def weigh(terms: LossTerms, weights: StepWeights) -> Losses:
        """The weighted sum of ``terms`` (the formula of the module's docstring)."""
        if terms.masked is not None:
            return Losses(terms.masked, None, None, masked=terms.masked)
        w = weights.ctc
        loss = w * terms.ctc + (1.0 - w) * terms.attention
        if terms.inter_ctc is not None:
            loss = loss + w * weights.inter_ctc * (terms.inter_ctc - terms.ctc)
        return Losses(loss, terms.ctc, terms.attention, terms.inter_ctc)

    def term_names(self) -> tuple[str, ...]:
        """The names of the losses a training step reports."""
        if self.pretrain:
            return ("loss", "masked")
        return ("loss", "ctc", "attention") + (("inter_ctc",) if self.inter_ctc_layer else ())
