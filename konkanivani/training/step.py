"""A training step's parts, which the loop, the benchmarks and the tests call: forward and backward
over an accumulation group with the out-of-memory split-and-retry (``forward_backward``), the
optimizer step with clipping and the fp16 scaler's inf/NaN skip (``optimizer_step``), releasing
cached CUDA memory every N batches, and validation with WER/CER (``validate``)."""
from __future__ import annotations

import contextlib
import logging
import logging.handlers
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

from ..data.dataset import Batch, Utterance
from ..data.features import KaldiFbank, LogMel, make_frontend
from ..data.frames import SAMPLE_RATE
from ..data.samplers import (
    split_batch,
)
from ..data.tokenizer import Tokenizer
from ..decoding.metrics import error_rates
from ..decoding.search import ctc_greedy
from ..model.asr import ASRModel
from .distributed import (
    Dist,
    no_sync,
)
from .memory import (
    BatchDoesNotFit,
    free_memory,
    is_out_of_memory,
)
from .objective import Objective
from .precision import Precision

__all__ = ["forward_backward", "maybe_empty_cache", "optimizer_step", "validate"]

log = logging.getLogger("konkanivani")

VALID_MASK_SEED = 0  # the masks of every pretraining validation


def maybe_empty_cache(device: torch.device, batches_done: int, every: int) -> bool:
    """Release cached CUDA blocks every ``every`` batches, against fragmentation over long runs.
    A no-op elsewhere. Returns whether the cache was emptied."""
    if device.type != "cuda" or every <= 0 or batches_done % every:
        return False
    torch.cuda.empty_cache()
    return True


def forward_backward(model: Callable[..., Any], micro_batches: list[Batch], device: torch.device,
                     precision: Precision, scaler: torch.amp.GradScaler,
                     objective: Objective = Objective(), step: int = 0,
                     name_of: Optional[Callable[[int], str]] = None, dist: Dist = Dist(),
                     offload_activations: bool = False,
                     frontend: Optional[LogMel | KaldiFbank] = None
                     ) -> Optional[dict[str, Any]]:
    """Accumulate gradients over ``micro_batches``, normalized by their total utterance count (over
    every process of a data-parallel run), so that the update equals the one from a single batch
    holding all of them, of ``objective`` at ``step``. Returns the mean losses (the weighted one and
    each term), the update's utterances and seconds of audio (every process's, as they are: dynamic
    batches too); None when no process had an utterance (the batches' audio could not be read).

    A micro-batch that runs out of memory is split in halves and retried; the normalization by
    the group's utterance count keeps the update as it would have been. An error in the forward
    pass leaves the gradients alone; one in the backward pass may have added part of them, so the
    gradients are cleared and the group starts again. Only a single utterance that does not fit
    stops training (``BatchDoesNotFit``; ``name_of`` turns its index into a name for the message),
    and so does an error in a data-parallel run's synchronizing backward pass (the last one), which
    the other processes are waiting in. ``offload_activations`` keeps what the backward pass needs
    in (pinned, on CUDA) CPU memory until then.

    The batches hold waveforms: their log-mel features are computed here, on ``device``
    (``frontend``, by default the model's), outside autocast and the graph.
    The losses stay on the device (summed there): reading them is the caller's choice (every
    ``--log_every`` steps in training), so a step waits for the GPU only where it must.
    """
    pending = [b for b in micro_batches if len(b)]
    n_utts, seconds = dist.sum(_group_size(pending))
    if n_utts == 0:
        return None
    # this process has nothing, the others have: join their gradient sync with zeros
    if not pending:
        pending = [_empty_batch()]
    per_process = n_utts / dist.world  # data parallelism averages the processes' gradients
    if frontend is None:  # a compiled model is a function: the caller then gives the front-end
        cfg = getattr(model, "module", model).cfg
        frontend = make_frontend(cfg.frontend, cfg.n_mels).to(device)
    done: list[Batch] = []
    names = objective.term_names()
    sums = _zero_sums(names, device)
    while pending:
        batch = pending.pop(0)
        in_backward = False
        try:
            dev_batch = batch.to(device)
            feats, feat_lens = dev_batch.features(frontend)
            with precision.autocast(device), _saved_on_cpu(offload_activations, device):
                out = objective(model, feats, feat_lens, dev_batch.tokens, dev_batch.token_lens,
                                step)
            in_backward = True
            # gradients sync on the group's last backward pass
            with no_sync(model, skip=bool(pending)):
                scaler.scale(
                    out.loss / per_process if len(batch.indices) else out.loss * 0.0
                ).backward()
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if not is_out_of_memory(e) or (dist.active and in_backward and not pending):
                raise
            # not the error itself: its traceback holds the failed attempt's tensors
            failed = str(e)
        else:
            if len(batch.indices):
                for name, value in out.named().items():
                    sums[name] += value.detach().float()
                done.append(batch)
            continue
        # release the failed attempt's tensors before retrying
        dev_batch = out = feats = None  # noqa: F841
        free_memory(device)
        pending, done, sums = _after_out_of_memory(
            model, batch, pending, done, sums, in_backward, failed, device, name_of
        )
    if dist.active:  # one all-reduce of the sums (it syncs anyway)
        sums = dict(
            zip(sums, torch.tensor(dist.sum([float(v) for v in sums.values()]), device=device))
        )
    return {**{name: value / n_utts for name, value in sums.items()}, "utterances": n_utts,
            "audio_s": round(seconds, 2)}


def _group_size(batches: list[Batch]) -> list[float]:
    """The utterances and seconds of audio of an accumulation group (summed on the host: the
    lengths are CPU tensors)."""
    return [sum(len(b) for b in batches),
            sum(int(b.audio_lens.sum()) for b in batches) / SAMPLE_RATE]


def _zero_sums(names: tuple[str, ...], device: torch.device) -> dict[str, torch.Tensor]:
    return {name: torch.zeros((), device=device) for name in names}


def _after_out_of_memory(
    model: Any,
    batch: Batch,
    pending: list[Batch],
    done: list[Batch],
    sums: dict[str, torch.Tensor],
    in_backward: bool,
    failed: str,
    device: torch.device,
    name_of: Optional[Callable[[int], str]],
) -> tuple[list[Batch], list[Batch], dict[str, torch.Tensor]]:
    """The micro-batches left to run after ``batch`` ran out of memory: its halves, and the whole
    group again when the error came in the backward pass (its gradients are cleared)."""
    if len(batch) == 1:
        who = name_of(batch.indices[0]) if name_of else f"utterance {batch.indices[0]}"
        raise BatchDoesNotFit(
            f"{who} ({int(batch.feat_lens[0])} frames) does not fit in {device.type} memory even"
            f" alone ({failed}); lower --max_duration, or use --gradient_checkpointing, --precision"
            " bf16/fp16, --optimizer adamw_8bit or a smaller --preset"
        )
    halves = list(split_batch(batch))
    log.warning(
        "out of memory on a micro-batch of %d utterances (%d frames each)%s; retrying it as %d + %d"
        " utterances, the update is unchanged",
        len(batch),
        int(batch.feat_lens.max()),
        " in the backward pass: the accumulation group starts again" if in_backward else "",
        len(halves[0]),
        len(halves[1]),
    )
    if in_backward:
        model.zero_grad(set_to_none=True)
        return done + halves + pending, [], _zero_sums(tuple(sums), device)
    return halves + pending, done, sums


def _saved_on_cpu(offload: bool, device: torch.device) -> Any:
    if not offload:
        return contextlib.nullcontext()
    return torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda")


def _empty_batch() -> Batch:
    """A one-utterance batch of silence that stands in, with its loss multiplied by 0, for a process
    whose whole accumulation group failed to load (``indices`` is empty: it counts for nothing).
    """
    return Batch(torch.zeros(1, SAMPLE_RATE), torch.tensor([SAMPLE_RATE]), torch.full((1, 1), 3),
                 torch.tensor([1]), [])


def optimizer_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    grad_clip: float,
    loss: float | torch.Tensor = 0.0,
) -> torch.Tensor:
    """Unscale, clip, step, update the scale, zero the gradients. Returns the gradient norm, a
    0-dim tensor on the gradients' device: reading it is the caller's choice.

    A non-finite gradient norm or ``loss`` skips the update in every precision: with fp16 the
    GradScaler skips it (and lowers its scale); fused AdamW takes the skip as a flag on the device
    (the ``found_inf`` it reads from a GradScaler), so neither waits for the GPU; any other
    optimizer is stepped only after the flag is read. The caller tells a skip by the returned norm
    and the loss.
    """
    scaler.unscale_(optimizer)
    params = [p for p in model.parameters() if p.grad is not None]
    max_norm = grad_clip if grad_clip > 0 else float("inf")
    grad_norm = (
        torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        if params
        else torch.zeros(())
    )
    if hasattr(grad_norm, "full_tensor"):  # FSDP: a DTensor
        grad_norm = grad_norm.full_tensor()
    loss = torch.as_tensor(loss, dtype=torch.float32).to(grad_norm.device, non_blocking=True)
    skip = ~(torch.isfinite(grad_norm) & torch.isfinite(loss))
    if scaler.is_enabled():  # a non-finite loss gives non-finite gradients, which the scaler finds
        scaler.step(optimizer)
    elif _fused(optimizer):
        # GradScaler's contract with it
        optimizer.found_inf, optimizer.grad_scale = skip.float(), None
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf, optimizer.grad_scale
    elif not skip.item():
        optimizer.step()
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm.float()


def _fused(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` runs torch's fused kernel, which skips an update on a flag (its groups
    say: a state loaded from a foreach optimizer, FSDP's, turns them off)."""
    return getattr(optimizer, "_step_supports_amp_scaling", False) and all(
        g.get("fused") for g in optimizer.param_groups)


@torch.no_grad()
def validate(
    model: ASRModel,
    loader: Iterable[Batch],
    tokenizer: Tokenizer,
    utterances: list[Utterance],
    device: torch.device,
    precision: Precision,
    dist: Dist = Dist(),
    frontend: Optional[LogMel | KaldiFbank] = None,
    objective: Objective = Objective(),
    step: int = 0,
) -> dict[str, float]:
    """Loss per utterance (``objective``'s after ``step`` optimizer steps) and its terms', and
    CER/WER of greedy CTC, in eval mode; over the shares of every process. Pretraining: the masked
    loss a masked frame (``_validate_masked``)."""
    frontend = frontend or make_frontend(model.cfg.frontend, model.cfg.n_mels).to(device)
    if objective.pretrain:
        return _validate_masked(model, loader, device, precision, dist, frontend, objective)
    loss_sum, ctc_sum, attention_sum, n, refs, hyps = 0.0, 0.0, 0.0, 0, [], []
    for batch, feats, feat_lens in _eval_batches(model, loader, device, frontend):
        with precision.autocast(device):
            enc, enc_lens = model.encode(feats, feat_lens)
            out = objective.validation(model, enc, enc_lens, batch.tokens, batch.token_lens,
                                       step)
            log_probs = model.ctc_log_probs(enc)
        loss_sum += out.loss.item()
        ctc_sum += out.ctc.item()
        attention_sum += out.attention.item()
        n += len(batch)
        hyps += [tokenizer.decode(h) for h in ctc_greedy(log_probs, enc_lens)]
        refs += [utterances[i].text for i in batch.indices]
    loss_sum, ctc_sum, attention_sum, n = dist.sum([loss_sum, ctc_sum, attention_sum, n])
    pairs = [pair for share in dist.gather(list(zip(refs, hyps))) for pair in share]
    return {
        "loss": loss_sum / max(n, 1),
        "ctc": ctc_sum / max(n, 1),
        "attention": attention_sum / max(n, 1),
        **error_rates([r for r, _ in pairs], [h for _, h in pairs]),
    }


def _eval_batches(model: ASRModel, loader: Iterable[Batch], device: torch.device,
                  frontend: LogMel | KaldiFbank,
                  ) -> Iterator[tuple[Batch, torch.Tensor, torch.Tensor]]:
    """``loader``'s non-empty batches on ``device`` with their features, ``model`` in eval mode
    while they are read (train mode again after the last)."""
    model.eval()
    try:
        for batch in loader:
            if len(batch):
                batch = batch.to(device)
                yield (batch, *batch.features(frontend))
    finally:
        model.train()


def _validate_masked(model: ASRModel, loader: Iterable[Batch], device: torch.device,
                     precision: Precision, dist: Dist, frontend: LogMel | KaldiFbank,
                     objective: Objective) -> dict[str, float]:
    """Pretraining's validation: the masked-prediction loss per utterance (``loss``, as training
    reports it) and a masked frame (``masked``, in nats: ``log(codebook_size)`` for a model that
    learned nothing), with the same masks at every validation (drawn from a generator seeded alike
    each time), so that validations compare."""
    generator = torch.Generator().manual_seed(VALID_MASK_SEED)
    loss_sum, frames, n = 0.0, 0, 0
    for batch, feats, feat_lens in _eval_batches(model, loader, device, frontend):
        with precision.autocast(device):
            terms = model.masked_prediction(feats, feat_lens, objective.masking(generator))
        loss_sum += terms.masked.item()
        frames += int(terms.masked_frames)
        n += len(batch)
    loss_sum, frames, n = dist.sum([loss_sum, frames, n])
    return {"loss": loss_sum / max(n, 1), "masked": loss_sum / max(frames, 1),
            "masked_frames": frames}
