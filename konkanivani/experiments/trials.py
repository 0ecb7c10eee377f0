"""Size sweeps (``konkanivani-sweep``): a grid over trainer flags, each trial an ordinary run
directory under the sweep's folder, named by its settings.

A sweep never loses work. Re-running the same command continues it: a finished trial is kept and not
run again, an interrupted one resumes from its own ``latest.pt``, new grid points are added. Ctrl-C
or SIGTERM saves the running trial and stops the sweep. The sweep folder is held by one sweep at a
time (the run-directory lock). A trial whose settings changed since it was recorded is refused by
name. With a memory budget, a trial the memory planner says cannot fit is recorded as skipped, not
run into out-of-memory. After every trial, ``sweep.csv`` and ``sweep.md`` tabulate them all.

The trainer's side is given as ``make_trial(settings, output_dir, resume) -> (TrainConfig, model
flags)`` (``cli/sweep.py`` builds it from the command line), so every flag means what it means to
``konkanivani-train``.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import itertools
import json
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, get_type_hints

from ..checkpoint import LATEST_FILE, METRICS_FILE, atomic_file, write_file_atomic
from ..config import (
    DEFAULT_VOCAB_SIZE,
    ConfigError,
    ModelConfig,
    TrainConfig,
    flag_fields,
    model_config_from_preset,
    parse_mix,
)
from ..data.frames import budget_frames, frames_of
from ..data.manifest import read_manifest
from ..data.shards import open_shards
from ..datatools.outputs import safe_name
from ..training.curves import have_matplotlib, write_csv
from ..training.loop import train
from ..training.memory import GIB, BatchDoesNotFit, MemoryEstimator, ModelDoesNotFit
from ..training.metrics_log import read_metrics
from ..training.run_files import existing_run, hold_run_directory, move_run_aside
from ..training.signals import Stop, TrainingDiverged

__all__ = ["SweepError", "Trial", "check_sweep_folder", "grid_trials", "parse_grid", "plot_sweep",
           "read_sweep", "run_sweep", "sweep_table", "write_tables"]

log = logging.getLogger("konkanivani")

TRIAL_FILE = "trial.json"  # in each trial's folder: its settings and how it ended
SWEEP_FILE = "sweep.json"  # in the sweep's folder: the grid and the flags every trial shares
SWEEP_OUTPUTS = ("sweep.md", "sweep.csv", "sweep.png")  # rewritten whole after every trial
NOT_SETTINGS = ("output_dir", "resume", "overwrite", "progress")  # how a trial runs, not what it is
STOPS = ("SIGINT", "SIGTERM")

MakeTrial = Callable[[dict[str, Any], Path, str], tuple[TrainConfig, dict[str, Any]]]


class SweepError(ValueError):
    """A grid or sweep folder that cannot be used (one line)."""


def flag_types() -> dict[str, type]:
    """Every trainer flag a grid may vary, with its type."""
    hints = {**get_type_hints(ModelConfig), **get_type_hints(TrainConfig)}
    names = [f.name for f in flag_fields(TrainConfig) if f.name not in NOT_SETTINGS]
    names += [
        f.name for f in dataclasses.fields(ModelConfig) if not f.metadata.get("from_tokenizer")
    ]
    return {n: hints[n] for n in names}


def _typed(key: str, text: str, tp: type) -> Any:
    text = text.strip()
    try:
        if tp is bool:
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        return tp(text) if tp in (int, float) else text
    except ValueError:
        raise SweepError(f"--grid {key}: {text!r} is not a {tp.__name__}") from None


def parse_grid(items: list[str]) -> dict[str, list[Any]]:
    """``["preset=small,medium", "lr=1e-3,2e-3"]`` -> ``{"preset": ["small", "medium"], "lr":
    [...]}``; ``SweepError`` naming the item for an unknown flag (and the nearest one), a value of
    the wrong
    type, an empty list or a flag given twice."""
    types, grid = flag_types(), {}
    if not items:
        raise SweepError(
            "an empty grid: give --grid FLAG=V1,V2 (or a sweep: section with grid: in --config)"
        )
    for item in items:
        key, sep, values = item.partition("=")
        key = key.strip().lstrip("-")
        if not sep or not key:
            raise SweepError(f"--grid {item!r}: write FLAG=V1,V2,...")
        if key not in types:
            near = difflib.get_close_matches(key, types, n=1)
            raise SweepError(
                f"--grid {key}: not a trainer flag"
                + (f" (did you mean {near[0]}?)" if near else "")
            )
        if key in grid:
            raise SweepError(
                f"--grid {key}: given twice; list all its values in one --grid {key}=..."
            )
        parts = [v for v in values.split(",") if v.strip()]
        if not parts:
            raise SweepError(f"--grid {key}: no value")
        grid[key] = [_typed(key, v, types[key]) for v in parts]
    return grid


@dataclass
class Trial:
    settings: dict[str, Any]
    status: str = "pending"  # pending, done, stopped, skipped, failed
    reason: str = ""  # why it was skipped or failed
    summary: dict[str, Any] = field(default_factory=dict)  # train()'s
    label: str = ""  # its folder's name when not its settings' (a search's trial-NNNN)

    @property
    def name(self) -> str:
        return self.label or safe_name("_".join(f"{k}-{v}" for k, v in self.settings.items()))


def grid_trials(grid: dict[str, list[Any]]) -> list[Trial]:
    """Every point of the grid, the first flag varying slowest."""
    return [Trial(dict(zip(grid, values))) for values in itertools.product(*grid.values())]


def resolved_settings(cfg: TrainConfig, model_flags: dict[str, Any]) -> dict[str, Any]:
    """What a trial is: every setting but how it runs (its folder, resuming), for comparing runs."""
    values = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in NOT_SETTINGS}
    return {**values, **{k: v for k, v in model_flags.items() if v is not None}}


def record_trial(trial_dir: Path, trial: Trial, resolved: dict[str, Any]) -> None:
    record = {
        "settings": trial.settings,
        "status": trial.status,
        "reason": trial.reason,
        "resolved": resolved,
        # a Stop by its name, as train() gives it in "stopped_by"
        "summary": {k: v.reason if isinstance(v, Stop) else v for k, v in trial.summary.items()},
    }
    trial_dir.mkdir(parents=True, exist_ok=True)
    write_file_atomic(
        trial_dir / TRIAL_FILE, (json.dumps(record, indent=2, default=str) + "\n").encode()
    )


def recorded_trial(trial_dir: Path) -> Optional[dict[str, Any]]:
    try:
        return json.loads((trial_dir / TRIAL_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def check_same_settings(recorded: dict[str, Any], resolved: dict[str, Any], trial_dir: Path
                        ) -> None:
    """A trial's settings may not change under its name: that would mix two runs in one folder."""
    before = json.loads(json.dumps(recorded.get("resolved", {}), default=str))
    now = json.loads(json.dumps(resolved, default=str))
    changed = sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k))
    if changed:
        shown = ", ".join(f"--{k} {before.get(k)!r} -> {now.get(k)!r}" for k in changed[:3])
        raise SweepError(
            f"{trial_dir}: this trial ran with other settings"
            f" ({shown}{', ...' if len(changed) > 3 else ''}); use another --output_dir for the"
            " changed sweep, or give the same flags"
        )


def set_aside_unsaved_run(trial_dir: Path, resume: str, label: str) -> None:
    """A trial killed before its first checkpoint has nothing to resume but its folder holds a run
    (metrics, a log), which a fresh start would be refused: move that aside, as --overwrite does."""
    if not resume and existing_run(trial_dir):
        log.warning(
            "%s: no checkpoint to resume; its partial run moved to %s",
            label,
            move_run_aside(trial_dir),
        )


def _fits(cfg: TrainConfig, model_flags: dict[str, Any], budget_gb: float) -> Optional[str]:
    """None when the memory planner says the trial's largest micro-batch fits ``budget_gb``; else
    why not."""
    longest = frames_of(
        min(
            max(_train_durations(cfg.train_shards, cfg.train_manifest, cfg.train_mix),
                default=1.0),
            cfg.max_duration,
        )
    )
    base = model_config_from_preset(cfg.preset, vocab_size=cfg.vocab_size,
                                    **{k: v for k, v in model_flags.items() if v is not None})
    # as on a GPU, which the budget is
    precision = cfg.precision or ("fp16" if cfg.mixed_precision else "fp32")
    estimator = MemoryEstimator(base, precision, cfg.optimizer, cfg.gradient_checkpointing)
    # the run sizes its batches to the device itself: only one utterance must fit
    if cfg.auto_batch:
        utterances = 1
    else:
        frames = budget_frames(cfg.max_batch_frames, cfg.max_batch_seconds)
        utterances = max(1, frames // longest) if frames else cfg.batch_size
    # the sampler keeps every batch under it: one utterance must fit, and it under the budget
    if cfg.max_memory_gb > 0:
        if cfg.max_memory_gb > budget_gb:
            return (
                f"--max_memory_gb {cfg.max_memory_gb:g} plans batches past the {budget_gb:g} GiB"
                " budget"
            )
        budget_gb, utterances = cfg.max_memory_gb, 1
    peak = estimator.peak_bytes(utterances, longest) / GIB
    if peak <= budget_gb:
        return None
    return (
        f"needs about {peak:.2f} GiB (memory planner: {utterances} utterances of {longest} frames,"
        f" {precision}, {cfg.optimizer}) of {budget_gb:g} GiB"
    )


def check_sweep_folder(out: Path) -> None:
    """``SweepError`` when ``out`` holds a sweep's table or picture that no sweep wrote there: a
    sweep writes its ``SWEEP_FILE`` before any of them, and rewrites them after every trial, so
    without it they are someone else's files, which this sweep would replace."""
    if (out / SWEEP_FILE).is_file():  # an earlier sweep's folder: continued, its tables rewritten
        return
    for name in SWEEP_OUTPUTS:
        if (out / name).exists() or (out / name).is_symlink():
            raise SweepError(f"{out / name} exists and no konkanivani-sweep wrote it (no "
                             f"{SWEEP_FILE} beside it): a sweep would replace it; move it away or "
                             "choose another --output_dir")


def run_sweep(
    out: Path,
    grid: dict[str, list[Any]],
    make_trial: MakeTrial,
    budget_gb: float = 0.0,
    target_cer: float = 0.0,
    shared: Optional[list[str]] = None,
) -> tuple[list[Trial], Optional[str]]:
    """Run (or continue) every trial of ``grid`` under ``out``; returns the trials and what stopped
    the sweep (a signal's name, or None when every trial ended). ``budget_gb`` > 0: skip what cannot
    fit.
    """
    trials = grid_trials(grid)
    with hold_run_directory(out):  # one sweep at a time in this folder
        check_sweep_folder(out)
        write_file_atomic(
            out / SWEEP_FILE,
            (
                json.dumps({"grid": grid, "shared_flags": shared or []}, indent=2, default=str)
                + "\n"
            ).encode(),
        )
        for i, trial in enumerate(trials, 1):
            stop = _run_trial(out, trial, make_trial, budget_gb, f"trial {i}/{len(trials)}")
            write_tables(out, trials, target_cer)
            if stop is not None:
                break
        else:
            stop = None
        if have_matplotlib():
            plot_sweep(out)
    return trials, stop


def _run_trial(
    out: Path, trial: Trial, make_trial: MakeTrial, budget_gb: float, label: str
) -> Optional[str]:
    trial_dir = out / trial.name
    resume = "latest" if (trial_dir / LATEST_FILE).exists() else ""
    cfg, model_flags = make_trial(trial.settings, trial_dir, resume)
    resolved = resolved_settings(cfg, model_flags)  # (resuming is no setting: the same either way)
    recorded = recorded_trial(trial_dir)
    if recorded is not None:
        check_same_settings(recorded, resolved, trial_dir)
        if recorded["status"] in ("done", "failed"):
            trial.status, trial.reason, trial.summary = (
                recorded["status"],
                recorded["reason"],
                recorded["summary"],
            )
            log.info("%s %s: %s before, kept", label, trial.name, trial.status)
            return None
    if budget_gb > 0 and (why := _fits(cfg, model_flags, budget_gb)) is not None:
        trial.status, trial.reason = "skipped", why
        record_trial(trial_dir, trial, resolved)
        log.warning("%s %s: skipped, %s", label, trial.name, why)
        return None
    set_aside_unsaved_run(trial_dir, resume, f"{label} {trial.name}")
    trial.status = "running"
    record_trial(trial_dir, trial, resolved)
    log.info(
        "%s %s: %s", label, trial.name, "resuming from its latest.pt" if resume else "starting"
    )
    try:
        trial.summary = train(cfg, model_flags)
    except ModelDoesNotFit as e:  # too large for this machine, by the estimate: as for --gpu_gb
        trial.status, trial.reason = "skipped", str(e)
        record_trial(trial_dir, trial, resolved)
        log.warning("%s %s: skipped, %s", label, trial.name, trial.reason)
        return None
    # these settings cannot train: this trial's end, not the sweep's
    except (TrainingDiverged, BatchDoesNotFit) as e:
        # (anything else, a full disk or a missing manifest, stops the sweep; the same command then
        # resumes the trial)
        trial.status, trial.reason = "failed", str(e).splitlines()[0]
        record_trial(trial_dir, trial, resolved)
        log.error("%s %s failed: %s", label, trial.name, trial.reason)
        return None
    stopped = trial.summary.get("stopped_by")
    trial.status = "stopped" if stopped in STOPS else "done"
    record_trial(trial_dir, trial, resolved)
    return stopped if stopped in STOPS else None


# ---- the table ----------------------------------------------------------------------------------

COLUMNS = [
    "trial",
    "status",
    "parameters_m",
    "steps",
    "s_per_step",
    "audio_s_per_s",
    "peak_gb",
    "best_cer",
    "best_wer",
    "best_step",
    "best_at_s",
    "target_at_s",
    "reason",
]


def _trial_row(out: Path, trial: Trial, target_cer: float) -> dict[str, Any]:
    trial_dir = out / trial.name
    row: dict[str, Any] = {
        "trial": trial.name,
        **trial.settings,
        "status": trial.status,
        "reason": trial.reason,
    }
    recorded = recorded_trial(trial_dir) or {}
    resolved = recorded.get("resolved") or {}
    if resolved.get("preset"):
        with_flags = {f.name: resolved[f.name] for f in dataclasses.fields(ModelConfig)
                      if f.name in resolved and not f.metadata.get("from_tokenizer")}
        try:
            vocab_size = resolved.get("vocab_size", DEFAULT_VOCAB_SIZE)
            model_cfg = model_config_from_preset(resolved["preset"], vocab_size=vocab_size,
                                                 **with_flags)
            params = MemoryEstimator(model_cfg).n_params
            row["parameters_m"] = round(params / 1e6, 2)
        except ConfigError:  # a combination the trainer refused: no model, its reason says why
            pass
    metrics = trial_dir / METRICS_FILE
    if not metrics.is_file():
        return row
    rows = read_metrics(metrics)
    train_rows, valid_rows = rows.get("train", []), rows.get("valid", [])
    if train_rows:
        last = train_rows[-1]
        row["steps"] = last["step"]
        if last.get("elapsed_s"):
            row["s_per_step"] = round(last["elapsed_s"] / last["step"], 3)
        peaks = [r.get("peak_gb") or r.get("peak_rss_gb") for r in train_rows]
        row["peak_gb"] = max((p for p in peaks if p is not None), default=None)
        rates = [r["utt_per_s"] for r in train_rows if r.get("utt_per_s")]
        data = [resolved.get(k, "") for k in ("train_shards", "train_manifest", "train_mix")]
        if rates and any(data):
            mean = _mean_duration(*data)
            row["audio_s_per_s"] = round(mean * sum(rates) / len(rates), 1)
    scored = [r for r in valid_rows if r.get("cer") is not None]
    if scored:
        best = min(scored, key=lambda r: (r["cer"], r["step"]))
        row.update(
            best_cer=round(100 * best["cer"], 2),
            best_wer=round(100 * best.get("wer", math.nan), 2),
            best_step=best["step"],
            best_at_s=best.get("elapsed_s"),
        )
        if target_cer:
            reached = [r for r in scored if 100 * r["cer"] <= target_cer]
            row["target_at_s"] = reached[0].get("elapsed_s") if reached else None
    return row


@functools.lru_cache(maxsize=8)
def _train_durations(shards: str, manifest: str, mix: str = "") -> tuple[float, ...]:
    """The duration of every training utterance: of the shards when given, of --train_mix's
    manifests, else of the manifest's rows (read once: each trial of a sweep asks)."""
    if shards:
        return tuple(open_shards(shards, check_files=False).durations())
    manifests = [entry.path for entry in parse_mix(mix)] if mix else [manifest]
    return tuple(float(row.get("duration", 0) or 0) for path in manifests
                 for _, row in read_manifest(path))


def _mean_duration(shards: str, manifest: str, mix: str = "") -> float:
    try:
        durations = _train_durations(shards, manifest, mix)
    except (OSError, ValueError):
        return math.nan
    return sum(durations) / len(durations) if durations else math.nan


def sweep_table(out: Path, trials: list[Trial], target_cer: float = 0.0) -> list[dict[str, Any]]:
    """One row per trial: its settings, size, speed, memory, best validation CER/WER and when it was
    reached, the time to ``target_cer`` (percent), its status."""
    return [_trial_row(out, t, target_cer) for t in trials]


def write_tables(out: Path, trials: list[Trial], target_cer: float = 0.0) -> list[dict[str, Any]]:
    """``sweep.csv`` and ``sweep.md`` in the sweep folder (rewritten whole, atomically)."""
    rows = sweep_table(out, trials, target_cer)
    keys = list(dict.fromkeys(["trial", *(k for t in trials for k in t.settings), *COLUMNS[1:]]))
    if not target_cer:
        keys.remove("target_at_s")
    write_csv(out / "sweep.csv", rows, keys)
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(_cell(r.get(k)) for k in keys) + " |" for r in rows]
    header = f"# Sweep {out}\n\n" + (f"Target CER {target_cer:g}%.\n\n" if target_cer else "")
    write_file_atomic(out / "sweep.md", (header + "\n".join(lines) + "\n").encode())
    return rows


def _cell(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, float):
        # a sampled 0.0018149789739443749 reads 0.001815 (sweep.csv keeps every digit)
        return f"{value:.4g}"
    return str(value).replace("|", "/")


# ---- the picture --------------------------------------------------------------------------------

def read_sweep(out: Path) -> list[Trial]:
    """The trials of the sweep in ``out`` as its record and the trials' own records hold them."""
    record = json.loads((out / SWEEP_FILE).read_text(encoding="utf-8"))
    if "grid" in record:
        trials = grid_trials(record["grid"])
    else:  # a search (tools.search): its trials are the folders it ran
        trials = [
            Trial((recorded_trial(d) or {}).get("settings", {}), label=d.name)
            for d in sorted(out.glob("trial-*"))
            if re.fullmatch(r"trial-\d+", d.name) and (d / TRIAL_FILE).is_file()
        ]
    for trial in trials:
        recorded = recorded_trial(out / trial.name) or {}
        trial.status, trial.reason = recorded.get("status", "pending"), recorded.get("reason", "")
    return trials


def plot_sweep(out: Path, output: Optional[Path] = None) -> Path:
    """``sweep.png``: every trial's validation CER against its training time, and each trial's best
    CER against its parameters (matplotlib, which the caller checks for)."""
    from matplotlib.figure import Figure

    rows = sweep_table(out, read_sweep(out))
    figure = Figure(figsize=(11, 4.2), layout="constrained")
    time_ax, size_ax = figure.subplots(1, 2)
    for i, row in enumerate(rows):
        valid = read_metrics(out / row["trial"] / METRICS_FILE).get("valid", []) \
            if (out / row["trial"] / METRICS_FILE).is_file() else []
        points = [
            (r["elapsed_s"] / 60, 100 * r["cer"])
            for r in valid
            if r.get("cer") is not None and r.get("elapsed_s")
        ]
        if points:
            time_ax.plot(*zip(*points), "o-", color=f"C{i % 10}", ms=3, label=row["trial"])
        if row.get("best_cer") is not None and row.get("parameters_m"):
            size_ax.plot(row["parameters_m"], row["best_cer"], "o", color=f"C{i % 10}")
            size_ax.annotate(row["trial"], (row["parameters_m"], row["best_cer"]), fontsize=7)
    time_ax.set(xlabel="training time (min)", ylabel="validation CER (%)", title="CER against time")
    size_ax.set(
        xlabel="parameters (M)", ylabel="best validation CER (%)", title="best CER against size"
    )
    if time_ax.lines:
        time_ax.legend(fontsize=7)
    output = output or out / "sweep.png"
    output.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(output) as f:  # a reader sees the old picture or the new one
        figure.savefig(f, format="png", dpi=110)
    return output
