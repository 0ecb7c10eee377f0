"""The hybrid CTC/attention model: CMVN, SpecAugment, Conformer encoder, CTC head, Transformer
decoder; with ``codebook_size``, the masked-prediction head and targets that pretrain the encoder on
audio alone (``model/bestrq.py``)."""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
import torchaudio
from torch import nn

from ..config import DEFAULT_LABEL_SMOOTHING, ModelConfig
from ..data.tokenizer import BLANK_ID, SOS_EOS_ID
from .bestrq import (
    RandomProjectionQuantizer,
    mask_features,
    masked_frames,
    masked_prediction_loss,
    span_mask,
)
from .conformer import ConformerEncoder
from .decoder import TransformerDecoder

__all__ = ["ASRModel", "LossTerms", "Masking", "SpecAugment", "count_parameters"]


IGNORE_ID = -1


class LossTerms(NamedTuple):
    """The model's losses, each summed over the utterances of a batch and unweighted: the training
    objective (``training/objective.py``) weights them."""

    ctc: Optional[torch.Tensor]  # None in pretraining (``Masking``)
    attention: Optional[torch.Tensor]  # label-smoothed cross-entropy of the decoder
    inter_ctc: Optional[torch.Tensor] = None  # the CTC head on a middle block's states (a tap)
    masked: Optional[torch.Tensor] = None  # masked prediction of the codes, in pretraining
    masked_frames: Optional[torch.Tensor] = None  # the frames ``masked`` sums over


class Masking(NamedTuple):
    """How pretraining masks a batch: each feature frame starts a span of ``span`` masked frames
    with probability ``prob``, drawn from ``generator`` (None: torch's global generator)."""

    prob: float
    span: int
    generator: Optional[torch.Generator] = None


class SpecAugment(nn.Module):
    """``freq_masks`` frequency masks (each up to ``freq_width`` bins) and ``time_masks`` time masks
    (each up to ``time_width`` frames and at most ``time_ratio`` of the utterance), drawn
    independently per utterance; by default two of each, 27 bins and 40 frames at most 5%.
    ``scale`` (0 to 1) shrinks every mask's largest width in proportion: a schedule sets it as
    training goes (``--spec_augment_ramp_steps``)."""

    def __init__(self, freq_masks: int = 2, freq_width: int = 27, time_masks: int = 2,
                 time_width: int = 40, time_ratio: float = 0.05):
        super().__init__()
        self.widths = (freq_width, time_width)
        self.freq_masks = nn.ModuleList(
            torchaudio.transforms.FrequencyMasking(freq_width, iid_masks=True)
            for _ in range(freq_masks)
        )
        self.time_masks = nn.ModuleList(
            torchaudio.transforms.TimeMasking(time_width, iid_masks=True, p=time_ratio)
            for _ in range(time_masks)
        )

    def set_scale(self, scale: float) -> None:
        """Every mask's largest width, ``scale`` times its full one (rounded)."""
        for masks, width in zip((self.freq_masks, self.time_masks), self.widths):
            for mask in masks:
                mask.mask_param = round(width * scale)

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        x = feats.transpose(1, 2)  # (B, F, T), the layout torchaudio masks expect
        for mask in [*self.freq_masks, *self.time_masks]:
            x = mask(x)  # masked bins become 0, the mean after CMVN
        return x.transpose(1, 2)


class ASRModel(nn.Module):
    """Examples:
        >>> model = ASRModel(model_config_from_preset("tiny", vocab_size=40))
        >>> terms = model(torch.randn(2, 120, 80), torch.tensor([120, 90]),
        ...               torch.tensor([[5, 6, 7], [8, 9, -1]]), torch.tensor([3, 2]))
        >>> terms.ctc.shape, terms.inter_ctc
        (torch.Size([]), None)
    """

    # The tensors with one row per token: a model of another vocabulary has them in another size,
    # and their rows follow the tokens (``finetune.load_init_weights`` matches them by piece).
    VOCABULARY_TENSORS = (
        "ctc_head.weight",
        "ctc_head.bias",
        "decoder.embed.weight",
        "decoder.output.weight",
        "decoder.output.bias",
        "encoder.ctc_condition",  # with self_condition_layer
    )

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.vocab_size <= SOS_EOS_ID:
            raise ValueError(f"vocab_size must exceed {SOS_EOS_ID}, got {cfg.vocab_size}")
        self.cfg = cfg
        # CMVN statistics from the training set, saved with the weights (cmvn "utterance" uses the
        # std only).
        self.register_buffer("feat_mean", torch.zeros(cfg.n_mels))
        self.register_buffer("feat_std", torch.ones(cfg.n_mels))
        self.encoder = ConformerEncoder(cfg)
        self.ctc_head = nn.Linear(cfg.d_model, cfg.vocab_size)
        self.decoder = TransformerDecoder(cfg)
        if cfg.codebook_size:  # pretraining: the frozen targets (seeded from torch's generator)
            seed = int(torch.randint(2**31 - 1, (), device="cpu"))
            self.quantizer = RandomProjectionQuantizer(cfg.n_mels, cfg.codebook_size, seed=seed)
            self.masked_head = nn.Linear(cfg.d_model, cfg.codebook_size)

    def set_gradient_checkpointing(self, enabled: bool) -> None:
        """Recompute each encoder and decoder layer's activations in the backward pass (training
        only): less memory for about a third more compute."""
        self.encoder.gradient_checkpointing = self.decoder.gradient_checkpointing = enabled

    @torch.no_grad()
    def set_cmvn(self, mean: torch.Tensor, std: torch.Tensor) -> None:
        self.feat_mean.copy_(mean)
        self.feat_std.copy_(std.clamp_min(1e-5))

    def encode(
        self,
        feats: torch.Tensor,
        feat_lens: torch.Tensor,
        augment: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
        chunk_size: Optional[int] = None,
        left_chunks: int = -1,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(B, T, F)`` raw log-mel, zero-padded -> ``(B, T', D)`` encoder states and ``(B,)``
        lengths. ``augment``: a SpecAugment of the normalized features, in training mode only.
        ``chunk_size`` and ``left_chunks``: the attention's chunks (``ConformerEncoder.forward``;
        0 full context, None the model's own: full context, drawn per batch in training with
        ``dynamic_chunk``).
        """
        return self.encoder(self._normalized(feats, feat_lens, augment), feat_lens,
                            chunk_size, left_chunks, head=self.ctc_head)

    def _normalized(self, feats: torch.Tensor, feat_lens: torch.Tensor,
                    augment: Optional[Callable[[torch.Tensor], torch.Tensor]]) -> torch.Tensor:
        """The encoder's input: CMVN, then ``augment`` when given in training."""
        x = (feats - self._mean(feats, feat_lens)) / self.feat_std
        return augment(x) if augment is not None and self.training else x

    def normalize(self, feats: torch.Tensor, mean: Optional[torch.Tensor] = None) -> torch.Tensor:
        """CMVN of raw log-mel frames ``(B, T, F)`` for a stream
        (``ConformerEncoder.forward_chunk``), frame by frame: minus ``mean`` (default: the training
        set's, ``feat_mean``), over the training set's std. With cmvn "utterance" the model was
        trained on each utterance's own mean, which a stream does not know yet: pass the mean of the
        frames seen so far (a running mean), which
        comes closer to it as the stream goes on; with cmvn "global" pass nothing."""
        return (feats - (self.feat_mean if mean is None else mean)) / self.feat_std

    def _mean(self, feats: torch.Tensor, feat_lens: torch.Tensor) -> torch.Tensor:
        """What CMVN subtracts: the training set's mean ``(F,)``, or each utterance's own mean over
        its frames, ``(B, T, F)`` with zeros on the padding (which then stays as it came)."""
        if self.cfg.cmvn == "global":
            return self.feat_mean
        valid = (
            torch.arange(feats.shape[1], device=feats.device)[None, :, None]
            < feat_lens[:, None, None]
        )
        frames = feat_lens.clamp_min(1).to(feats.dtype)[:, None, None]
        return feats.masked_fill(~valid, 0.0).sum(1, keepdim=True) / frames * valid

    def ctc_log_probs(self, enc: torch.Tensor) -> torch.Tensor:
        """``(B, T', D)`` -> ``(B, T', V)`` float32 log-probabilities."""
        return F.log_softmax(self.ctc_head(enc).float(), dim=-1)

    def forward(self, feats: torch.Tensor, feat_lens: torch.Tensor, tokens: torch.Tensor,
                token_lens: torch.Tensor,
                augment: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                label_smoothing: float = DEFAULT_LABEL_SMOOTHING, tap: int = 0,
                masking: Optional[Masking] = None) -> LossTerms:
        """
        Args:
            feats: ``(B, T, F)`` log-mel features; feat_lens ``(B,)``.
            tokens: ``(B, U)`` target ids padded with -1; token_lens ``(B,)``.
            augment: masks the normalized features (SpecAugment; in training mode only).
            label_smoothing: of the attention term's targets.
            tap: in training, the CTC head also scores the states after this encoder block
                (intermediate CTC, ESPnet's InterCTC: a loss term, no parameters); 0: none.
            masking: pretraining (a model with ``codebook_size``): the masked-prediction term
                alone (``masked_prediction``); the tokens are not used.
        Returns:
            ``LossTerms``: scalar sums over the batch, unweighted.
        """
        if masking is not None:
            return self.masked_prediction(feats, feat_lens, masking)
        if not (tap and self.training):
            enc, enc_lens = self.encode(feats, feat_lens, augment)
            return self.losses(enc, enc_lens, tokens, token_lens, label_smoothing)
        enc, enc_lens, inter = self.encoder.forward_tapped(
            self._normalized(feats, feat_lens, augment), feat_lens, tap=tap, head=self.ctc_head)
        out = self.losses(enc, enc_lens, tokens, token_lens, label_smoothing)
        return out._replace(inter_ctc=self._ctc(inter, enc_lens, tokens, token_lens))

    def masked_prediction(self, feats: torch.Tensor, feat_lens: torch.Tensor,
                          masking: Masking) -> LossTerms:
        """BEST-RQ's term: the normalized features get spans of noise (``masking``); the head over
        the encoder's states predicts, at each encoder frame whose four feature frames hold a
        masked one, the code the quantizer gives the unmasked features there. The cross-entropy
        summed over those frames, and their count."""
        x = self._normalized(feats, feat_lens, None)
        mask = span_mask(feat_lens, x.shape[1], masking.prob, masking.span, masking.generator)
        enc, enc_lens = self.encoder(mask_features(x, mask, generator=masking.generator),
                                     feat_lens, head=self.ctc_head)
        codes = self.quantizer(x, enc.shape[1])
        loss, frames = masked_prediction_loss(enc, enc_lens, codes,
                                              masked_frames(mask, enc.shape[1]), self.masked_head)
        return LossTerms(None, None, masked=loss, masked_frames=frames)

    def _ctc(self, enc: torch.Tensor, enc_lens: torch.Tensor, tokens: torch.Tensor,
             token_lens: torch.Tensor) -> torch.Tensor:
        log_probs = self.ctc_log_probs(enc).transpose(0, 1)  # (T', B, V)
        return F.ctc_loss(log_probs, tokens.clamp_min(0), enc_lens, token_lens, blank=BLANK_ID,
                          reduction="sum", zero_infinity=True)

    def losses(self, enc: torch.Tensor, enc_lens: torch.Tensor, tokens: torch.Tensor,
               token_lens: torch.Tensor,
               label_smoothing: float = DEFAULT_LABEL_SMOOTHING) -> LossTerms:
        """CTC and label-smoothed attention losses from encoder states ``(B, T', D)``."""
        # CTC in float32 (its recursions underflow in half precision); sum, then mean by the caller.
        # On CUDA it is the one wait for the device in a step: torch's CTC copies the lengths to the
        # CPU to plan its kernels (and back), wherever the caller keeps them.
        ctc = self._ctc(enc, enc_lens, tokens, token_lens)

        B, U = tokens.shape
        sos = tokens.new_full((B, 1), SOS_EOS_ID)
        dec_in = torch.cat([sos, tokens.clamp_min(0)], dim=1)  # (B, U+1): <sos> y1 .. yU
        target = torch.cat([tokens, tokens.new_full((B, 1), IGNORE_ID)], dim=1)  # (B, U+1)
        # y1 .. yU <eos>, then ignored
        # scatter_, not an indexed assignment: on CUDA that waits for the device (seen on an H200)
        target.scatter_(1, token_lens.long().unsqueeze(1), SOS_EOS_ID)
        logits = self.decoder(dec_in, token_lens + 1, enc, enc_lens)  # (B, U+1, V)
        attention = F.cross_entropy(
            logits.float().flatten(0, 1),
            target.flatten(),
            ignore_index=IGNORE_ID,
            label_smoothing=label_smoothing,
            reduction="sum",
        )
        return LossTerms(ctc, attention)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
