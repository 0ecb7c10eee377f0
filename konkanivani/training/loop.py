"""The training loop, readable top to bottom: set up a run, train epoch by epoch, end each epoch.

``train()`` is the outline; ``setup_run`` (start.py) builds a ``Run`` (everything a run holds
while it runs) from the flags or from a checkpoint's ``TrainState``; ``train_epoch`` loops over the
epoch's batches and makes one optimizer step per accumulation group (``train_step``), then does
what falls on that step (``_after_step``); ``end_epoch`` validates and saves. What stops a run is a
``Stop``. A step's checkpoint is written once at most. Under ``torchrun`` every process runs this
same loop on its share of the batches (distributed.py); rank 0 alone logs and writes.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import logging.handlers
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from ..checkpoint import LATEST_FILE, TrainState, step_checkpoint_name
from ..config import ConfigError, TrainConfig, check_config, resolve_model_config
from ..data.dataset import Batch
from ..data.frames import frames_of
from ..data.manifest import ManifestError
from ..data.samplers import (
    padding_fraction,
)
from ..model.asr import ASRModel
from .curves import CURVES, write_curves
from .distributed import (
    Dist,
    distributed,
    full_state_dicts,
    is_sharded,
)
from .ema import ema_state
from .finetune import hold_encoder
from .memory import (
    memory_status,
)
from .optim import scheduled_lr
from .run_files import overwrite_refusal, run_directory, save_step
from .signals import Stop, StopRequest, TrainingDiverged, diverged_message
from .start import Run, setup_run, starting_point
from .state import capture_rng
from .step import forward_backward, maybe_empty_cache, optimizer_step, validate

__all__ = ["train", "train_epoch", "train_step", "end_epoch", "validate_and_save", "save", "finish"]

log = logging.getLogger("konkanivani")


# ---- the outline ------------------------------------------------------------------------------

def train(cfg: TrainConfig, model_overrides: Optional[dict[str, Any]] = None,
          on_step: Optional[Callable[[int, int, ASRModel], bool]] = None) -> dict[str, Any]:
    """Train (or resume) as ``cfg`` says. ``model_overrides``: the model flags (``ModelConfig``
    fields; None or left out: not given), over the preset's or the --init_from checkpoint's
    dimensions (fresh runs only). ``on_step(step, epoch, model)`` runs after every optimizer step;
    returning True stops the run there, with a checkpoint (benchmarks use it to evaluate on a
    clock).

    Returns a summary: final step, epoch, last validation metrics, the best WER, what stopped it.
    """
    check_config(cfg)  # every flag value, before any work
    if (refusal := overwrite_refusal(cfg)) is not None:
        raise ConfigError(refusal)
    with distributed(cfg.device) as (dist, device):
        _check_device_settings(cfg, device)
        with run_directory(Path(cfg.output_dir), cfg.resume, cfg.overwrite, dist) as start, \
                StopRequest(cfg.max_time) as stop_request:
            origin = starting_point(cfg)  # --resume's checkpoint, or a fresh run's --init_from one
            # The model, resolved once: the checkpoint's, or the preset's, the model flags over it
            model_cfg = resolve_model_config(cfg, model_overrides, origin.model_config)
            run = setup_run(cfg, model_cfg, origin, dist, device, start)
            with contextlib.closing(run):
                stop = Stop.MAX_STEPS if 0 < cfg.max_steps <= run.step else Stop.NONE
                while run.epoch < cfg.epochs and not stop:
                    stop, epoch_ended = train_epoch(run, stop_request, on_step)
                    if epoch_ended:
                        stop = end_epoch(run, stop, stop_request)
                    else:
                        stop = stop_inside_epoch(run, stop)
                return finish(run, stop, stop_request)


def _check_device_settings(cfg: TrainConfig, device: torch.device) -> None:
    """What can only be checked once the device is known, before any work."""
    if cfg.offload_activations and device.type != "cuda":
        raise ConfigError(
            f"--offload_activations needs a CUDA device (on {device.type} the activations are in"
            " CPU memory already)"
        )


# ---- an epoch ---------------------------------------------------------------------------------


def train_epoch(
    run: Run, stop_request: StopRequest, on_step: Optional[Callable[[int, int, ASRModel], bool]]
) -> tuple[Stop, bool]:
    """Train on the rest of the epoch in progress, one optimizer step per accumulation group of
    batches, until it ends or something stops the run. Returns what stopped it (``Stop.NONE`` when
    nothing did) and whether the epoch ended."""
    cfg = run.cfg
    run.sampler.set_epoch(run.epoch, run.batches_done)
    run.epoch_batches = run.batches_done + len(run.sampler)
    log.info(
        "epoch %d: %d batches, %.1f%% of their frames padding",
        run.epoch + 1,
        run.epoch_batches,
        100
        * padding_fraction(
            run.sampler.epoch_batches(), [frames_of(u.duration) for u in run.train_utts],
            cfg.pad_to_frames,
        ),
    )
    if run.mix is not None:  # how much of each --train_mix set this epoch holds
        share = f" (process {run.dist.rank}'s batches)" if run.dist.active else ""
        log.info("epoch %d draws%s: %s", run.epoch + 1, share, run.mix.shares(
            run.sampler.epoch_batches(), [u.duration for u in run.train_utts]))
    skips_before, unreadable, stop = run.skips.total, [], Stop.NONE
    run.model.train()
    # a bar in a file is only noise
    show_bar = cfg.progress and run.dist.is_main and sys.stderr.isatty()
    bar = _progress_bar(
        run.epoch_batches, run.batches_done, f"epoch {run.epoch + 1}/{cfg.epochs}", show_bar
    )
    micro: list[Batch] = []
    # since the last summary line; since the epoch (re)started
    speed, epoch_speed = _Speed(), _Speed()
    # log lines above the bar
    with logging_redirect_tqdm([logging.root, log]) if show_bar else contextlib.nullcontext():
        for batch in _timed(run.train_loader, speed, epoch_speed):
            run.batches_done += 1
            bar.update()
            maybe_empty_cache(run.device, run.batches_done, cfg.empty_cache_every)
            unreadable += [run.train_utts[i].where for i in batch.missing]
            micro.append(batch)
            # An accumulation group closes after `accum` batches, or at the end of the epoch.
            if (
                len(micro) < cfg.gradient_accumulation_steps
                and run.batches_done < run.epoch_batches
            ):
                continue
            stats = train_step(run, micro)
            micro = []
            if stats is None:  # no readable audio in the whole group, in any process
                continue
            speed.add(stats["utterances"])
            epoch_speed.add(stats["utterances"])
            if stop := _after_step(run, stats, (speed, bar), stop_request, on_step):
                break
    bar.close()
    settle(run)  # the steps since the last read, a stop's among them
    _stop_if_diverged(run)
    _log_epoch_end(run, unreadable, run.skips.total - skips_before, epoch_speed)
    if run.batches_done < run.epoch_batches:
        return stop, False
    run.epoch, run.batches_done = run.epoch + 1, 0
    return stop, True


def train_step(run: Run, micro: list[Batch]) -> Optional[dict[str, Any]]:
    """One optimizer step on an accumulation group: its losses (0-dim tensors on the device, and the
    learning rate, gradient norm and utterance count), or None when no process had audio to train
    on. A non-finite loss or gradient skips the update; the skip is counted and named when its flag
    is read (``settle``). In the first --freeze_encoder_steps steps the encoder's gradients are
    dropped (``hold_encoder``): the norm is then the heads' alone."""
    cfg = run.cfg
    stats = forward_backward(
        run.forward,
        micro,
        run.device,
        run.precision,
        run.scaler,
        run.objective,  # its weights and masks at this step (a pure function of it)
        run.step,
        name_of=lambda i: f"{run.train_utts[i].where} ({run.train_utts[i].duration:.1f} s)",
        dist=run.dist,
        offload_activations=cfg.offload_activations,
        frontend=run.frontend,
    )
    if stats is None:
        return None
    # a pure function of the step and epoch: nothing to resume
    lr = scheduled_lr(cfg, run.step, run.epoch)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    held = hold_encoder(run.model, run.step, cfg.freeze_encoder_steps)
    if not held and cfg.freeze_encoder_steps and run.step == cfg.freeze_encoder_steps:
        log.info(
            "step %d: the encoder trains from now on (--freeze_encoder_steps %d)",
            run.step + 1,
            cfg.freeze_encoder_steps,
        )
    loss = torch.as_tensor(stats["loss"])
    grad_norm = optimizer_step(run.model, run.optimizer, run.scaler, cfg.grad_clip, loss)
    run.step += 1
    loss_finite = torch.isfinite(loss).to(grad_norm.device)
    run.unsettled.append((run.step, ~(loss_finite & torch.isfinite(grad_norm)), loss_finite,
                          [i for b in micro for i in b.indices]))
    return {**stats, "lr": lr, "grad_norm": grad_norm}


def _after_step(run: Run, stats: dict[str, Any], shown: tuple[_Speed, tqdm],
                stop_request: StopRequest,
                on_step: Optional[Callable[[int, int, ASRModel], bool]]) -> Stop:
    """What falls on an optimizer step, in order: the skip flags read where anything after needs
    them (once; ``settle``), the moving average's update, the summary (``shown``: the speed since
    the last one, the bar), a validation or a save due within the epoch (the epoch's end does both
    anyway), and what asks the run to stop (``_asked_to_stop``), which it returns."""
    cfg = run.cfg
    epoch_goes_on = run.batches_done < run.epoch_batches
    summary = run.step % cfg.log_every == 0
    validating = epoch_goes_on and _every(run.step, cfg.validate_every_steps)
    saving = epoch_goes_on and _every(run.step, cfg.save_every_steps)
    if summary or validating or saving or run.ema is not None:
        went_through = settle(run)
        # the average takes only updates that went through
        if run.ema is not None and went_through:
            run.ema.update_parameters(run.model)
    if summary:
        _log_step(run, stats, *shown)
    if summary or validating or saving:
        _stop_if_diverged(run)
    if validating:
        validate_and_save(run)
    # after the validation: on_step may read its metrics (a search prunes by them)
    stop = _asked_to_stop(run, stop_request, on_step)
    # (a stop saves anyway; a validation has saved already)
    if saving and not stop and run.saved_step != run.step:
        save(run)
    return stop


def _every(step: int, every: int) -> bool:
    """Whether something done every ``every`` steps (0: never) falls on ``step``."""
    return every > 0 and step % every == 0


def _asked_to_stop(run: Run, stop_request: StopRequest,
                   on_step: Optional[Callable[[int, int, ASRModel], bool]]) -> Stop:
    """The one stop check after each step: --max_steps, else the larger of ``on_step``'s and a
    request's (a signal, the time budget), agreed between the processes."""
    if 0 < run.cfg.max_steps <= run.step:  # the same step in every process
        return Stop.MAX_STEPS
    asked = on_step is not None and on_step(run.step, run.epoch, run.model)
    return _agreed(run, max(Stop.ON_STEP if asked else Stop.NONE, stop_request.stop()))


def _agreed(run: Run, stop: Stop) -> Stop:
    """The stop every process of the run comes to: the largest any of them has."""
    return Stop(int(run.dist.max(float(stop))))


def settle(run: Run) -> bool:
    """Read the skip flags of the updates since the last call, all in one wait for the device:
    count them (``Run.skips``) and name each skipped one. Returns whether the last update went
    through (True when there was none to read)."""
    if not run.unsettled:
        return True
    flags = torch.stack([torch.stack([s, f]) for _, s, f, _ in run.unsettled]).tolist()
    for (step, _, _, indices), (skipped, loss_finite) in zip(run.unsettled, flags):
        run.skips.update(not skipped)
        if skipped:
            _say_skipped(run, step, bool(loss_finite), indices)
    run.unsettled = []
    return not flags[-1][0]


def _stop_if_diverged(run: Run) -> None:
    """Save and stop if too many updates in a row were skipped, as far as ``settle`` has read."""
    if run.skips.exceeded:
        save(run)
        raise TrainingDiverged(
            diverged_message(run.skips.in_a_row, run.step, run.out_dir, run.scaler.is_enabled())
        )


# utterances of a skipped update's batch named in its message; the rest counted
_NAMED_IN_A_SKIP = 3


def _say_skipped(run: Run, step: int, loss_finite: bool, indices: list[int]) -> None:
    fp16 = run.scaler.is_enabled()
    named = ", ".join(f"{u.where} ({u.audio_path.name})" for u in (run.train_utts[i] for i in
                                                                    indices[:_NAMED_IN_A_SKIP]))
    more = f" and {len(indices) - _NAMED_IN_A_SKIP} more" if len(indices) > _NAMED_IN_A_SKIP else ""
    # fp16 gradients overflowing while the GradScaler finds its scale are expected: not a warning
    level = logging.INFO if fp16 and loss_finite and run.skips.in_a_row < 3 else logging.WARNING
    log.log(
        level,
        "step %d: non-finite %s, update skipped (%d in a row, %d in all%s); batch: %s%s",
        step,
        "gradients" if loss_finite else "loss",
        run.skips.in_a_row,
        run.skips.total,
        f"; fp16 loss scale now {run.scaler.get_scale():g}" if fp16 else "",
        named,
        more,
    )


def _log_step(run: Run, stats: dict[str, Any], speed: _Speed, bar: tqdm) -> None:
    """The step's summary: the bar's postfix, a train row of metrics.jsonl and the log line; then
    the speed counts again from here."""
    stats = _floats(stats)  # the step's figures read from the device: it waits here
    bar.set_postfix_str(f"loss {stats['loss']:.3g}, {speed.rate():.1f} utt/s, data "
                        f"{speed.wait_percent():.0f}%", refresh=False)
    memory = {name: round(gib, 4) for name, gib in memory_status(run.device).items()}
    run.record(
        "train",
        **stats,
        utt_per_s=speed.rate(),
        data_wait=round(speed.wait_percent() / 100, 4),
        **memory,
    )
    log.info("%s", _summary_line(run, stats, speed, memory))
    speed.restart()


def _floats(stats: dict[str, Any]) -> dict[str, float]:
    """The step's figures as numbers (the first waits for the device; the others are then there)."""
    return {k: float(v) if isinstance(v, torch.Tensor) else v for k, v in stats.items()}


# ---- the end of an epoch, or of the run ---------------------------------------------------------

def end_epoch(run: Run, stop: Stop, stop_request: StopRequest) -> Stop:
    """Validate, and save the epoch's checkpoint once, with the metrics. A request to stop early (a
    signal, the time budget) skips the validation (the run saves and stops; the next one validates
    later). Returns what stops the run (``Stop.NONE``: nothing)."""
    if not stop.early:  # a request in the epoch's last step
        stop = max(stop, _agreed(run, stop_request.stop()))
    if stop.early:
        save(run)
        return stop
    _validate_and_save_epoch(run)
    if not stop and run.epoch < run.cfg.epochs:  # a request during the validation
        stop = _agreed(run, stop_request.stop())
    return stop


def _validate_and_save_epoch(run: Run) -> None:
    """``validate_and_save``; should validation fail (or a second Ctrl-C come), the epoch is saved
    without its metrics before the error goes on, so that it costs no training. Only in a run of
    one process: in a data-parallel run the others may not come to the save, which would wait for
    them."""
    try:
        validate_and_save(run)
    except (Exception, KeyboardInterrupt):
        if run.saved_step != run.step and not run.dist.active:
            try:
                save(run, quiet=True)
                log.warning(
                    "validation at the end of epoch %d failed; the epoch is saved in %s",
                    run.epoch,
                    run.out_dir / step_checkpoint_name(run.step),
                )
            except Exception as e:  # noqa: BLE001 (the first error is the one to report)
                log.warning("could not save the epoch after validation failed: %s", e)
        raise


def stop_inside_epoch(run: Run, stop: Stop) -> Stop:
    """The run stops inside an epoch: at --max_steps with a score (and a current best.pt), else
    with a checkpoint at this step."""
    if stop is Stop.MAX_STEPS and run.valid_step != run.step:
        validate_and_save(run)
    elif stop is Stop.ON_STEP:
        log.info("stopped at step %d in epoch %d", run.step, run.epoch + 1)
    if run.saved_step != run.step:
        save(run)
    return stop


def finish(run: Run, stop: Stop, stop_request: StopRequest) -> dict[str, Any]:
    """The run's summary, and a warning when a request stopped it early. A signal after the last
    agreement (in the last step or validation: the run saved) is what stopped it, so that a caller
    stops too."""
    if not stop.early:
        stop = max(stop, stop_request.signalled())
    stopped_by = stop.reason if stop.early else None
    if stopped_by is not None:
        log.warning(
            "stopped by %s at step %d (epoch %d, batch %d), saved in %s; to go on, run the same"
            " command with --resume latest",
            stopped_by,
            run.step,
            run.epoch + 1,
            run.batches_done,
            run.out_dir / LATEST_FILE,
        )
    return {
        "step": run.step,
        "epoch": run.epoch,
        "valid": run.valid_metrics,
        "best_wer": run.best_wer,
        # stop: any reason (a Stop), --max_steps and on_step's too; stopped_by: an early one's name
        "stopped_by": stopped_by,
        "stop": stop,
        "skipped_updates": run.skips.total,
        "unreadable_files": run.unreadable,
    }


def validate_and_save(run: Run) -> None:
    """Validate at this step (the EMA weights with --ema_decay), record the metrics, save (best.pt
    too when they improved: the lowest WER, then the lowest CER, as early on every WER is 100%),
    redraw curves.png. Draws nothing from the global RNG, so a resumed run goes on exactly as it
    would have.
    """
    weights = run.model if run.ema is None else run.ema.module
    metrics = validate(
        weights,
        run.valid_loader,
        run.tokenizer,
        run.valid_utts,
        run.device,
        run.precision,
        # sharded: each process saw all
        Dist() if is_sharded(run.model) else run.dist,
        objective=run.objective,
        step=run.step,
    )
    run.valid_metrics, run.valid_step = metrics, run.step
    run.record(
        "valid", **metrics, **({"ema_decay": run.cfg.ema_decay} if run.ema is not None else {})
    )
    # pretraining has no text: its best is the lowest masked loss (kept where the WER/CER are)
    score = (metrics["wer"], metrics["cer"]) if "wer" in metrics else (metrics["masked"],) * 2
    is_best = score < (run.best_wer, run.best_cer)
    if is_best:
        run.best_wer, run.best_cer = score
    epochs_done = run.batches_done == 0
    where = f"epoch {run.epoch}" if epochs_done else \
        f"epoch {run.epoch + 1}, {100 * run.batches_done / max(run.epoch_batches, 1):.0f}%"
    scores = (f"masked loss {metrics['masked']:.3f} nats a masked frame" if "wer" not in metrics
              else f"CER {100 * metrics['cer']:.2f}%  WER {100 * metrics['wer']:.2f}%")
    log.info(
        "step %d (%s): valid loss %.3f  %s%s%s",
        run.step,
        where,
        metrics["loss"],
        scores,
        "  (EMA weights)" if run.ema is not None else "",
        "  (best)" if is_best else "",
    )
    save(run, is_best)
    if run.draw_curves:  # after the save: nothing that goes wrong in drawing costs the checkpoint
        _redraw_curves(run.out_dir)


def _redraw_curves(out_dir: Path) -> None:
    """curves.png from metrics.jsonl. A picture is not worth a run: any failure is a warning."""
    try:
        write_curves(out_dir)
    # a full disk, a broken matplotlib install, a font cache...
    except Exception as e:  # noqa: BLE001
        log.warning("could not draw %s: %s: %s", out_dir / CURVES, type(e).__name__, e)


def save(run: Run, is_best: bool = False, quiet: bool = False) -> None:
    """Write the run's ``TrainState`` as this step's checkpoint and point latest.pt (and best.pt)
    at it; keep the newest --keep_checkpoints. Every process takes part (their random states go
    into the checkpoint); rank 0 writes."""
    rng = run.dist.gather(capture_rng())
    position = run.dist.gather(run.sampler.position(run.epoch, run.batches_done))
    model_state, optimizer_state = full_state_dicts(run.model, run.optimizer)  # sharded: gathered
    run.saved_step = run.step
    if not run.dist.is_main:
        return
    ema_model, ema_updates = ema_state(run.ema) if run.ema is not None else ({}, 0)
    state = TrainState(
        model_config=dataclasses.asdict(run.model.cfg),
        train_config=dataclasses.asdict(run.cfg),
        tokenizer=run.tokenizer.model_proto,
        model=model_state,
        optimizer=optimizer_state,
        scaler=run.scaler.state_dict(),
        step=run.step,
        epoch=run.epoch,
        batches_done=run.batches_done,
        processes=run.dist.world,
        rng=rng,
        data_position=position if any(position) else [],
        best_wer=run.best_wer,
        best_cer=run.best_cer,
        valid_metrics=run.valid_metrics,
        valid_step=run.valid_step,
        ema_model=ema_model,
        ema_updates=ema_updates,
        train_seconds=run.elapsed(),
    )
    path = save_step(run.out_dir, run.step, state.save, is_best, run.cfg.keep_checkpoints)
    if not quiet:
        log.info("saved %s%s", path, " (best so far: also best.pt)" if is_best else "")


# ---- what a run prints -------------------------------------------------------------------------

class _Speed:
    """Utterances a second, and the share of the time spent waiting for the data loader, since
    ``restart``."""

    def __init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        self.utterances, self.waited, self.start = 0.0, 0.0, time.perf_counter()

    def add(self, utterances: float) -> None:
        self.utterances += utterances

    def add_wait(self, seconds: float) -> None:
        self.waited += seconds

    def rate(self) -> float:
        return self.utterances / max(time.perf_counter() - self.start, 1e-9)

    def wait_percent(self) -> float:
        return 100 * self.waited / max(time.perf_counter() - self.start, 1e-9)


def _timed(batches: Iterable[Batch], *speeds: _Speed) -> Iterator[Batch]:
    """The loader's batches, each one's wait (the time ``next`` took) added to ``speeds``. An error
    in reading (a DataLoader worker's, with its traceback) ends the run in one line
    (``ManifestError``), the loader's workers ended first."""
    it = iter(batches)
    while True:
        start = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            return
        except BaseException as e:
            # The exception's traceback (in a reference cycle, or kept by a caller) holds the
            # iterator, and with it the workers, up to the interpreter's exit, which then waits for
            # them for ever (they ignore SIGTERM: signals.ignore_stop_signals). So they end here.
            if (shutdown := getattr(it, "_shutdown_workers", None)) is not None:
                shutdown()
            if not isinstance(e, Exception) or isinstance(e, ManifestError) and "\n" not in str(e):
                raise  # Ctrl-C; or one of our one-line errors, raised without workers
            raise ManifestError(_loader_error(e)) from e
        for speed in speeds:
            speed.add_wait(time.perf_counter() - start)
        yield batch


def _loader_error(e: Exception) -> str:
    """One line for an exception out of the training DataLoader. A worker's comes with its
    traceback as the message ("Caught KeyError in DataLoader worker process 0.\\nOriginal
    Traceback ..."), whose last line says what went wrong and last frame where."""
    first, _, rest = str(e).partition("\n")
    if not (first.startswith("Caught ") and rest.startswith("Original Traceback")):
        return f"reading the training data failed: {type(e).__name__}: {first}"
    lines = [line.strip() for line in rest.splitlines() if line.strip()]
    what, where = lines[-1], first.rstrip(".").split(" in ", 1)[-1]
    if isinstance(e, ManifestError):  # one of ours, one line already: its message alone
        return f"{what.split(': ', 1)[-1]}; in {where}"
    frames = [re.match(r'File "(.*)", line (\d+)', line) for line in lines]
    at = [f" (at {Path(m.group(1)).name}:{m.group(2)})" for m in frames if m]
    return f"reading the training data failed in {where}: {what}{at[-1] if at else ''}"


def _log_epoch_end(run: Run, unreadable: list[str], skipped: int, speed: _Speed) -> None:
    run.unreadable += len(unreadable)
    log.info(
        "epoch %d: %.1f utt/s, %.1f%% of the time waiting for data",
        run.epoch + 1,
        speed.rate(),
        speed.wait_percent(),
    )
    if unreadable:
        log.warning(
            "epoch %d: %d audio files could not be read and were left out: %s%s",
            run.epoch + 1,
            len(unreadable),
            ", ".join(unreadable[:10]),
            " ..." if len(unreadable) > 10 else "",
        )
    if skipped:
        log.warning(
            "epoch %d: %d updates skipped for a non-finite loss or gradients",
            run.epoch + 1,
            skipped,
        )
    log.info("epoch %d memory (GiB): %s", run.epoch + 1,
             ", ".join(f"{k[:-3]} {v:.2f}" for k, v in memory_status(run.device).items()))


def _progress_bar(total: int, done: int, desc: str, show: bool) -> tqdm:
    """An epoch's bar that fits 80 columns: count, times, loss and speed (the summary lines carry
    the rest)."""
    return tqdm(
        total=total,
        initial=done,
        desc=desc,
        disable=not show,
        leave=False,
        mininterval=1.0,
        ncols=min(80, shutil.get_terminal_size().columns),
        bar_format=(
            "{desc} {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}] {postfix}"
        ),
    )


def _summary_line(
    run: Run, stats: dict[str, float], speed: _Speed, memory: dict[str, float]
) -> str:
    """The --log_every line: where the run is, the losses, lr, gradient norm, speed and memory
    (``memory_status``: in use now, then the peak)."""
    now, peak = list(memory.values())[:2]
    terms = (f"masked {stats['masked']:.3f}" if "masked" in stats else
             f"ctc {stats['ctc']:.3f}, attention {stats['attention']:.3f}"
             + (f", inter-CTC {stats['inter_ctc']:.3f}" if "inter_ctc" in stats else ""))
    return (
        f"step {run.step} (epoch {run.epoch + 1},"
        f" {100 * run.batches_done / run.epoch_batches:.0f}%): loss {stats['loss']:.3f} ({terms}"
        f"), {stats['utterances']:.0f} utt ({stats['audio_s']:.0f} s of audio) an update, lr"
        f" {stats['lr']:.2e}, grad norm"
        f" {stats['grad_norm']:.2f}, {speed.rate():.1f} utt/s (data wait"
        f" {speed.wait_percent():.0f}%), memory {now:.2f} GiB (peak {peak:.2f})"
    )
