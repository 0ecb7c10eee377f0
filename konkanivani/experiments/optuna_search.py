"""Recipe search (``konkanivani-sweep --search optuna``): trials sampled from a search space with
Optuna's TPE sampler instead of a grid, pruned by their validation CER (median pruner), each an
ordinary run directory ``OUTPUT_DIR/trial-NNNN`` as in a grid sweep.

The study lives in an SQLite file in the sweep's folder (``study.db``), so a search that was killed
resumes: its interrupted trial is run again from its own ``latest.pt`` (the same parameters, the
same folder), and the search goes on until ``--trials`` trials have completed or been pruned.
Several machines share one study through an Optuna storage URL (``--storage``): each runs the same
command with its own ``--output_dir``; a trial whose machine stopped answering is given again, after
the heartbeat's grace period, to whichever asks next.

The search space is the ``search:`` mapping of a recipe's ``sweep:`` section::

    sweep:
      search:
        lr: {log_uniform: [3.0e-4, 3.0e-3]}
        warmup_steps: {int: [100, 1000]}
        d_model: {choices: [96, 128, 160]}
        dropout: {uniform: [0.0, 0.2]}
"""
from __future__ import annotations

import difflib
import inspect
import json
import logging
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

from ..checkpoint import LATEST_FILE, METRICS_FILE, write_file_atomic
from ..config import ConfigError
from ..training.loop import train
from ..training.metrics_log import read_metrics
from ..training.run_files import hold_run_directory
from ..training.signals import Stop, TrainingDiverged
from .trials import (
    STOPS,
    SWEEP_FILE,
    MakeTrial,
    SweepError,
    Trial,
    check_same_settings,
    flag_types,
    plot_sweep,
    read_sweep,
    record_trial,
    recorded_trial,
    resolved_settings,
    set_aside_unsaved_run,
    write_tables,
)

__all__ = ["KINDS", "parse_space", "run_search"]

log = logging.getLogger("konkanivani")

KINDS = ("log_uniform", "uniform", "int", "choices")
STUDY = "study.db"
HEARTBEAT_S, GRACE_S = 30, 120  # a trial whose process has not answered for GRACE_S is given again


def parse_space(space: Any, where: str) -> dict[str, tuple[str, list[Any]]]:
    """``{flag: {kind: values}}`` -> ``{flag: (kind, values)}``; ``SweepError`` in one line naming
    the flag for an unknown flag (and the nearest), kind or bounds."""
    if not isinstance(space, dict) or not space:
        raise SweepError(
            f"{where}: sweep: search: must map trainer flags to {{kind: values}}"
            f" ({', '.join(KINDS)})"
        )
    types, parsed = flag_types(), {}
    for flag, spec in space.items():
        if flag not in types:
            near = difflib.get_close_matches(str(flag), types, n=1)
            raise SweepError(
                f"{where}: search: {flag}: not a trainer flag"
                + (f" (did you mean {near[0]}?)" if near else "")
            )
        if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in KINDS:
            raise SweepError(
                f"{where}: search: {flag}: write one of {', '.join(f'{{{k}: ...}}' for k in KINDS)}"
            )
        kind, values = next(iter(spec.items()))
        if not isinstance(values, list) or not values:
            raise SweepError(f"{where}: search: {flag}: {kind} takes a list")
        if kind != "choices":
            if (
                len(values) != 2
                or not all(isinstance(v, (int, float)) for v in values)
                or values[0] >= values[1]
            ):
                raise SweepError(
                    f"{where}: search: {flag}: {kind} takes [low, high] numbers with low < high"
                )
            if kind == "log_uniform" and values[0] <= 0:
                raise SweepError(f"{where}: search: {flag}: log_uniform needs low > 0")
            if types[flag] is int and kind != "int":
                raise SweepError(
                    f"{where}: search: {flag}: an integer flag takes int: [low, high] or choices"
                )
        parsed[flag] = (kind, values)
    return parsed


def _suggest(trial: Any, space: dict[str, tuple[str, list[Any]]]) -> dict[str, Any]:
    settings = {}
    for flag, (kind, values) in space.items():
        if kind == "choices":
            settings[flag] = trial.suggest_categorical(flag, values)
        elif kind == "int":
            settings[flag] = trial.suggest_int(flag, int(values[0]), int(values[1]))
        else:
            settings[flag] = trial.suggest_float(
                flag, float(values[0]), float(values[1]), log=kind == "log_uniform"
            )
    return settings


class _Stopped(Exception):
    """A signal stopped the running trial (it saved); the search stops too."""

    def __init__(self, signal_name: str, number: int):
        super().__init__(signal_name)
        self.signal_name, self.number = signal_name, number


def _storage(out: Path, url: str) -> Any:
    from optuna.storages import RDBStorage, RetryFailedTrialCallback

    local = not url
    # two processes creating one new database race on its tables: the loser waits
    for attempt in range(5):
        try:
            return _rdb(RDBStorage, RetryFailedTrialCallback, out, url, local)
        # sqlalchemy's OperationalError / IntegrityError, without importing sqlalchemy
        except Exception as e:
            if attempt == 4 or type(e).__name__ not in ("IntegrityError", "OperationalError"):
                raise
            time.sleep(0.5 * (attempt + 1))


def _rdb(RDBStorage: Any, RetryFailedTrialCallback: Any, out: Path, url: str, local: bool) -> Any:
    # Optuna 4.9 renamed the callback for a trial whose heartbeat stopped; the heartbeat is
    # "experimental".
    callback = ("heartbeat_stale_trial_callback" if "heartbeat_stale_trial_callback"
                in inspect.signature(RDBStorage).parameters else "failed_trial_callback")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return RDBStorage(
            url or f"sqlite:///{(out / STUDY).resolve()}",
            heartbeat_interval=HEARTBEAT_S,
            grace_period=GRACE_S,
            **{callback: RetryFailedTrialCallback(max_retry=None)},
            engine_kwargs=(
                {"connect_args": {"timeout": 60}} if local or url.startswith("sqlite") else None
            ),
        )


def _requeue(study: Any, states: tuple, only: Callable[[Any], bool] = lambda t: True) -> None:
    """Give the trials in ``states`` again (same parameters, same run directory, so the new one
    resumes the old one's run), as Optuna's retry callback does for a trial whose process stopped
    answering; a running one is marked failed first."""
    from optuna.storages import RetryFailedTrialCallback
    from optuna.trial import TrialState

    for frozen in study.get_trials(deepcopy=False, states=states):
        if not only(frozen):
            continue
        if frozen.state == TrialState.RUNNING:
            study._storage.set_trial_state_values(frozen._trial_id, state=TrialState.FAIL)
        RetryFailedTrialCallback(max_retry=None)(study, frozen)


def _interrupted(out: Path, study: Any, frozen: Any) -> bool:
    """A failed trial of this folder that was stopped (a signal, a second Ctrl-C, an error outside
    the trial) rather than failed by its settings, and not already given again."""
    from optuna.trial import TrialState

    name = frozen.user_attrs.get("run_dir")
    recorded = recorded_trial(out / name) if name else None
    if recorded is None or recorded.get("status") not in ("running", "stopped"):
        return False
    later = study.get_trials(
        deepcopy=False,
        states=(TrialState.WAITING, TrialState.RUNNING, TrialState.COMPLETE, TrialState.PRUNED),
    )
    return not any(t.user_attrs.get("run_dir") == name and t.number > frozen.number for t in later)


def run_search(
    out: Path,
    space: dict[str, tuple[str, list[Any]]],
    make_trial: MakeTrial,
    n_trials: int,
    storage: str = "",
    study_name: str = "konkanivani-sweep",
    target_cer: float = 0.0,
    shared: Optional[list[str]] = None,
) -> tuple[list[Trial], Optional[str]]:
    """Run (or continue) an Optuna search until ``n_trials`` trials completed or were pruned;
    returns the trials this folder ran and what stopped the search (a signal's name, or None)."""
    try:
        import optuna
    except ImportError:
        raise SweepError(
            "--search optuna needs Optuna: pip install 'konkanivani[search]' (or pip install"
            " optuna)"
        ) from None
    from optuna.study import MaxTrialsCallback
    from optuna.trial import TrialState

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with hold_run_directory(out):
        record = {
            "search": {k: {kind: values} for k, (kind, values) in space.items()},
            "storage": storage or STUDY,
            "study_name": study_name,
            "shared_flags": shared or [],
        }
        write_file_atomic(out / SWEEP_FILE, (json.dumps(record, indent=2) + "\n").encode())
        study = optuna.create_study(
            study_name=study_name,
            storage=_storage(out, storage),
            direction="minimize",
            load_if_exists=True,
            sampler=optuna.samplers.TPESampler(),
            pruner=optuna.pruners.MedianPruner(n_startup_trials=2),
        )
        # the study is this folder's, and this process holds the folder: a running trial is stale
        if not storage:
            _requeue(study, (TrialState.RUNNING,))
        _requeue(study, (TrialState.FAIL,), only=lambda t: _interrupted(out, study, t))
        ran: dict[str, Trial] = {}
        objective = _objective(out, space, make_trial, ran)
        stop: Optional[str] = None
        finished = (TrialState.COMPLETE, TrialState.PRUNED)
        remaining = n_trials - len(study.get_trials(deepcopy=False, states=finished))
        try:
            # (the callback stops this process when other processes finished the rest)
            if remaining > 0:
                study.optimize(objective, n_trials=remaining, catch=(),
                               callbacks=[MaxTrialsCallback(n_trials, states=finished)])
        except _Stopped as e:
            stop, number = e.signal_name, e.number
            # Give the stopped trial again (same parameters, same folder): the command's next run
            # resumes it.
            _requeue(study, (TrialState.FAIL,), only=lambda t: t.number == number)
        trials = read_sweep(out)  # every trial this folder ran, in earlier runs of the command too
        write_tables(out, trials, target_cer)
        from ..training.curves import have_matplotlib
        if have_matplotlib() and trials:
            plot_sweep(out)
    return trials, stop


def _flags_text(settings: dict[str, Any]) -> str:
    """A trial's settings as the flags they are (floats to four digits)."""
    return ", ".join(f"--{k} {v:.4g}" if isinstance(v, float) else f"--{k} {v}"
                     for k, v in settings.items())


def _pruner(trial, trial_dir: Path, every: int) -> Callable[[int, int, Any], bool]:
    """The training's ``on_step`` for ``trial``: at each validation (every ``every`` steps) it
    reports the step's CER to the study and says whether to prune."""

    def on_step(step: int, epoch: int, model: Any) -> bool:
        if not every or step % every:
            return False
        valid = (
            read_metrics(trial_dir / METRICS_FILE).get("valid", [])
            if (trial_dir / METRICS_FILE).is_file()
            else []
        )
        if valid and valid[-1]["step"] == step and valid[-1].get("cer") is not None:
            trial.report(100 * valid[-1]["cer"], step)
            # The first validation comes before a model has learned to align (every trial's CER is
            # near 100% then): ranking by it would prune on noise. Pruning starts at the second.
            return step > every and trial.should_prune()
        return False

    return on_step


def _objective(
    out: Path,
    space: dict[str, tuple[str, list[Any]]],
    make_trial: MakeTrial,
    ran: dict[str, Trial],
):
    import optuna

    def objective(trial: optuna.Trial) -> float:
        settings = _suggest(trial, space)
        name = trial.user_attrs.get("run_dir") or f"trial-{trial.number:04d}"
        trial.set_user_attr("run_dir", name)
        trial_dir = out / name
        record = Trial(settings, status="running", label=name)
        ran[name] = record
        resume = "latest" if (trial_dir / LATEST_FILE).exists() else ""
        cfg, model_flags = make_trial(settings, trial_dir, resume)
        set_aside_unsaved_run(trial_dir, resume, f"search trial {name}")
        resolved = resolved_settings(cfg, model_flags)
        # this folder's run: the same trial, the same settings
        if (recorded := recorded_trial(trial_dir)) is not None:
            if recorded.get("settings") != json.loads(json.dumps(settings)):
                raise SweepError(
                    f"{trial_dir} holds another trial (settings {recorded.get('settings')}); a new "
                    "study needs its own --output_dir"
                )
            check_same_settings(recorded, resolved, trial_dir)
        record_trial(trial_dir, record, resolved)
        log.info("search trial %s (%s): %s", name, "resuming" if resume else "starting",
                 _flags_text(settings))
        try:
            record.summary = train(cfg, model_flags,
                                   on_step=_pruner(trial, trial_dir, cfg.validate_every_steps))
        # a second Ctrl-C: the trial's last checkpoint stands; give it again next time
        except KeyboardInterrupt:
            record.status = "stopped"
            record_trial(trial_dir, record, resolved)
            raise _Stopped("SIGINT", trial.number) from None
        # this trial's settings diverge: the worst score, and the search goes on
        except TrainingDiverged as e:
            record.status, record.reason = "failed", str(e).splitlines()[0]
            record_trial(trial_dir, record, resolved)
            return 100.0
        except ConfigError as e:
            if not any(f"--{flag} " in f"{e} " or f"--{flag}:" in str(e) for flag in space):
                raise  # the recipe's own settings: every trial would fail alike
            # a combination the trainer refuses (--subsampling_channels with dw_striding): the worst
            # score, so that the sampler learns to avoid it, and the search goes on
            record.status, record.reason = "failed", str(e).splitlines()[0]
            record_trial(trial_dir, record, resolved)
            log.warning("search trial %s refused: %s", name, record.reason)
            return 100.0
        # a broken recipe would break every trial: the search stops, saying why
        except Exception as e:
            record.status, record.reason = "failed", (
                str(e).splitlines()[0] if str(e) else type(e).__name__
            )
            record_trial(trial_dir, record, resolved)
            raise
        stopped = record.summary.get("stopped_by")
        pruned = record.summary.get("stop") == Stop.ON_STEP
        if stopped in STOPS:
            record.status = "stopped"
            record_trial(trial_dir, record, resolved)
            raise _Stopped(stopped, trial.number)
        valid = read_metrics(trial_dir / METRICS_FILE).get("valid", [])
        scored = [100 * r["cer"] for r in valid if r.get("cer") is not None]
        record.status = "pruned" if pruned else "done"
        record_trial(trial_dir, record, resolved)
        if pruned:
            raise optuna.TrialPruned()
        return min(scored) if scored else 100.0

    return objective
