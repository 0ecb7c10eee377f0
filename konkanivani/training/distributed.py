"""Data parallelism under ``torchrun``: one process per GPU (NCCL) or per CPU worker (gloo).

Two strategies: ``ddp`` (``DistributedDataParallel``: every process holds the whole model and
optimizer, gradients are averaged) and ``fsdp`` (FSDP2's ``fully_shard``: parameters, gradients
and optimizer states are split between the processes, each encoder block and decoder layer
gathered only while it computes, and on CUDA kept in CPU memory between uses). For the presets
here (up to 27 M parameters) activations dominate memory and ``ddp`` is the one to use;
``fsdp`` is for models past ~100 M parameters.

``torchrun`` starts the processes and sets ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE``; without
them a run is one process and every call here is a cheap no-op. The training loop needs only a
few collective operations, all in ``Dist``: sums of a few numbers (losses, utterance counts), an
agreement on whether to stop, and gathering small Python objects (validation transcripts, the
random states of every process for the checkpoint).
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import os
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as td
from torch.nn.parallel import DistributedDataParallel

from .precision import resolve_device

__all__ = ["Dist", "distributed", "wrap_data_parallel", "no_sync", "is_sharded",
           "full_state_dicts", "load_optimizer_state"]


log = logging.getLogger("konkanivani")


@dataclass(frozen=True)
class Dist:
    """This process's place in the run: ``rank`` of ``world`` processes (0 of 1 without
    torchrun)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        """Rank 0 logs, writes checkpoints and metrics."""
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1

    def sum(self, values: Sequence[float]) -> list[float]:
        """Each value summed over the processes (in float64)."""
        if not self.active:
            return list(values)
        t = torch.tensor(list(values), dtype=torch.float64, device=self._device())
        td.all_reduce(t)
        return t.tolist()

    def max(self, value: float) -> float:
        """The largest ``value`` of the processes."""
        if not self.active:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self._device())
        td.all_reduce(t, op=td.ReduceOp.MAX)
        return t.item()

    def gather(self, obj: Any) -> list[Any]:
        """``obj`` of every process, in rank order, on every process."""
        if not self.active:
            return [obj]
        out: list[Any] = [None] * self.world
        td.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.active:
            td.barrier()

    def _device(self) -> torch.device:
        return (
            torch.device("cuda", torch.cuda.current_device())
            if td.get_backend() == "nccl"
            else torch.device("cpu")
        )


@contextlib.contextmanager
def distributed(device_name: str) -> Iterator[tuple[Dist, torch.device]]:
    """The process group, when ``torchrun`` started this process (``WORLD_SIZE`` > 1), and this
    process's device: its own GPU (``cuda:LOCAL_RANK``, NCCL) or the CPU (gloo).

    A group made here is destroyed on the way out, after every process has got there: a process
    that ends with gloo's threads still running aborts at interpreter exit (SIGABRT, "terminate
    called without an active exception"), which fails the whole run after its last save. A
    group the caller made is left to the caller."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        yield Dist(), resolve_device(device_name)
        return
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(device_name)
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    made_here = not td.is_initialized()
    if made_here:
        td.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(minutes=30)
        )
    try:
        yield Dist(rank, world, local_rank), device
        if made_here:
            td.barrier()  # no process leaves while another still needs it (rank 0's last save)
    finally:
        if made_here:
            td.destroy_process_group()


def wrap_data_parallel(model: torch.nn.Module, dist: Dist, device: torch.device,
                       strategy: str = "ddp") -> torch.nn.Module:
    """``model`` made data-parallel when the run has several processes. ``ddp``: wrapped in
    ``DistributedDataParallel`` (the processes start from rank 0's weights and buffers; gradients
    are averaged in the backward pass). ``fsdp``: sharded in place by FSDP2 (each encoder block,
    decoder layer, then the rest), with CPU offload of parameters, gradients and optimizer states
    on CUDA; build the optimizer after this, on the sharded parameters."""
    if not dist.active:
        return model
    if strategy == "fsdp":
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            OffloadPolicy,
            fully_shard,
            register_fsdp_forward_method,
        )

        policy = CPUOffloadPolicy(pin_memory=True) if device.type == "cuda" else OffloadPolicy()
        for layer in [*model.encoder.blocks, *model.decoder.layers]:
            fully_shard(layer, offload_policy=policy)
        fully_shard(model, offload_policy=policy)
        for method in ("encode", "losses", "ctc_log_probs"):  # validation calls these, not forward
            register_fsdp_forward_method(model, method)
        return model
    return DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False
    )  # CMVN statistics are the only buffers


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def full_state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Whole (unsharded) model and optimizer state dicts, for a checkpoint any number of processes
    can resume. Sharded models gather them (every process must call this; keys are parameter names).
    """
    if not is_sharded(model):
        return model.state_dict(), optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options), get_optimizer_state_dict(
        model, optimizer, options=options
    )


def load_optimizer_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict
) -> None:
    """Load a whole optimizer state dict, keyed by parameter index (``optimizer.state_dict()``) or
    by parameter name (a sharded run's), into a plain or sharded ``optimizer``."""
    groups = state.get("param_groups") or [{"params": []}]
    by_name = any(isinstance(p, str) for g in groups for p in g["params"])
    if not by_name and not is_sharded(model):
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    if not by_name:  # index -> name, in the order the optimizer was given the parameters
        names = [name for name, _ in model.named_parameters()]
        state = {
            "state": {names[i]: v for i, v in state["state"].items()},
            "param_groups": [
                {**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]
            ],
        }
    set_optimizer_state_dict(
        model, optimizer, state, options=StateDictOptions(full_state_dict=True)
    )


@contextlib.contextmanager
def no_sync(model: torch.nn.Module, skip: bool) -> Iterator[None]:
    """Leave the gradients unsynchronized in this backward pass (all but the last micro-batch of
    an accumulation group), when ``model`` is data-parallel and ``skip`` is True."""
    if skip and isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
    elif isinstance(model, torch.nn.Module) and is_sharded(model):
        model.set_requires_gradient_sync(not skip)
        yield
    else:
        yield
