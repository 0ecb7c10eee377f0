"""konkanivani-sweep: a grid of trainer flags, each trial an ordinary run; a sweep never loses
work."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from tiny_args import tiny_args

from konkanivani.cli import sweep as sweep_cli
from konkanivani.experiments.trials import SweepError, grid_trials, parse_grid
from konkanivani.training.metrics_log import read_metrics


def _shared(corpus, *extra):
    """tiny_args without --output_dir (the sweep sets each trial's)."""
    args = tiny_args(corpus, "unused", *extra)
    i = args.index("--output_dir")
    return args[:i] + args[i + 2:]


def test_a_grid_is_typed_and_every_combination_is_a_trial():
    grid = parse_grid(["preset=tiny,small", "lr=1e-3,2e-3", "spec_augment=false"])
    assert grid == {"preset": ["tiny", "small"], "lr": [1e-3, 2e-3], "spec_augment": [False]}
    trials = grid_trials(grid)
    assert [t.settings for t in trials][:2] == [
        {"preset": "tiny", "lr": 1e-3, "spec_augment": False},
        {"preset": "tiny", "lr": 2e-3, "spec_augment": False},
    ]
    assert (
        len({t.name for t in trials}) == 4
        and trials[0].name == "preset-tiny_lr-0.001_spec_augment-False"
    )


@pytest.mark.parametrize("items, message", [
    (["lrr=1e-3"], "--grid lrr: not a trainer flag (did you mean lr?)"),
    (["lr=fast"], "--grid lr: 'fast' is not a float"),
    (["d_model=128,wide"], "--grid d_model: 'wide' is not a int"),
    ([], "an empty grid"),
    (["lr=1e-3", "lr=2e-3"], "--grid lr: given twice"),
    (["lr="], "--grid lr: no value"),
    (["output_dir=a,b"], "--grid output_dir: not a trainer flag"),
])
def test_a_bad_grid_is_one_line_naming_the_flag(items, message):
    with pytest.raises(SweepError) as e:
        parse_grid(items)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("argv, message", [
    (["--grid", "lrr=1"], "did you mean lr?"),
    (["--grid", "lr=1e-3", "--target_cer", "0"], "--target_cer must be in (0, 100]"),
    (["--grid", "lr=1e-3", "--target_cer", "150"], "--target_cer must be in (0, 100]"),
    (["--grid", "lr=1e-3", "--resume", "latest"], "--resume is the sweep's to set"),
])
def test_the_command_says_a_bad_sweep_in_one_line_with_exit_2(tmp_path, capsys, argv, message):
    try:
        status = sweep_cli.main(
            [
                "--output_dir",
                str(tmp_path / "s"),
                *argv,
                "--train_manifest",
                "t.jsonl",
                "--valid_manifest",
                "v.jsonl",
            ]
        )
    except SystemExit as e:
        status = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and message in err[0], err
    assert not (tmp_path / "s").exists()


def test_a_sweep_section_in_the_recipe_is_the_grid(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "model:\n  preset: tiny\nsweep:\n  grid:\n    lr: [0.001, 0.002]\n  target_cer: 50\n",
        encoding="utf-8",
    )
    args, shared = sweep_cli.parse_args(
        ["--output_dir", str(tmp_path / "s"), "--config", str(recipe), "--grid", "warmup_steps=4,8"]
    )
    assert args.grid == ["lr=0.001,0.002", "warmup_steps=4,8"] and args.target_cer == 50
    assert shared == ["--config", str(recipe)]


def _train_steps(trial_dir):
    return [r["step"] for r in read_metrics(trial_dir / "metrics.jsonl").get("train", [])]


def _sigterm_when_saved(argv, trial_dir, steps):
    """konkanivani-sweep ARGV as a process, sent SIGTERM once ``trial_dir`` has saved and logged
    ``steps`` steps (bounded: 2400 polls); asserts it then exits 143, and returns its output."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "konkanivani.cli.sweep", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    for _ in range(2400):
        if proc.poll() is not None or (
            (trial_dir / "latest.pt").exists() and len(_train_steps(trial_dir)) >= steps
        ):
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the sweep ended before it could be stopped"
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-2000:]
    return stdout, stderr


@pytest.mark.slow
def test_a_sweep_killed_in_its_second_trial_continues_without_repeating_a_step(
    tiny_corpus, tmp_path
):
    """Three trials; SIGTERM while the second trains; the same command again finishes all three, the
    first kept as it was, the second resumed from its own checkpoint: every step once."""
    out = tmp_path / "sweep"
    argv = [
        "--output_dir",
        str(out),
        "--grid",
        "lr=1e-3,2e-3,3e-3",
        "--target_cer",
        "99",
        *_shared(
            tiny_corpus,
            "--max_steps",
            "12",
            "--save_every_steps",
            "2",
            "--validate_every_steps",
            "6",
        ),
    ]
    second = out / "lr-0.002"
    stdout, stderr = _sigterm_when_saved(argv, second, steps=5)
    assert "continue with:" in stdout and "Traceback" not in stderr
    first = out / "lr-0.001"
    assert json.loads((first / "trial.json").read_text())["status"] == "done"
    first_metrics = (first / "metrics.jsonl").read_bytes()
    assert json.loads((second / "trial.json").read_text())["status"] == "stopped"
    assert not (out / "lr-0.003").exists()

    assert sweep_cli.main(argv) == 0  # the same command again
    assert (first / "metrics.jsonl").read_bytes() == first_metrics  # kept, not run again
    for name in ("lr-0.001", "lr-0.002", "lr-0.003"):
        assert _train_steps(out / name) == list(range(1, 13)), name  # every step once
        assert json.loads((out / name / "trial.json").read_text())["status"] == "done"
    table = (out / "sweep.csv").read_text().splitlines()
    assert table[0].startswith("trial,lr,status,parameters_m,steps") and len(table) == 4
    assert all(",done," in line and ",12," in line for line in table[1:])
    assert "| lr-0.003 | 0.003 | done |" in (out / "sweep.md").read_text()
    assert (out / "sweep.png").stat().st_size > 0  # CER against time, best CER against size
    from konkanivani.cli import plot as plot_cli

    # konkanivani-plot of the folder
    assert plot_cli.main([str(out), "--output", str(tmp_path / "again.png")]) == 0
    assert (tmp_path / "again.png").stat().st_size > 0

    # another --max_steps under the same trial names
    changed = [a if a != "12" else "13" for a in argv]
    assert sweep_cli.main(changed) == 2


def test_a_trial_that_cannot_fit_the_budget_is_skipped_not_run(tmp_path, capsys):
    # a manifest needs no audio for the planner
    from konkanivani.data.frames import SAMPLE_RATE  # noqa: F401

    manifest = tmp_path / "train.jsonl"
    manifest.write_text(
        json.dumps({"audio_filepath": "a.wav", "duration": 20.0, "text": "क"}) + "\n",
        encoding="utf-8",
    )
    status = sweep_cli.main(
        [
            "--output_dir",
            str(tmp_path / "s"),
            "--grid",
            "preset=large,medium",
            "--gpu_gb",
            "0.5",
            "--train_manifest",
            str(manifest),
            "--valid_manifest",
            str(manifest),
            "--batch_size",
            "8",
        ]
    )
    assert status == 0
    for name in ("preset-large", "preset-medium"):
        record = json.loads((tmp_path / "s" / name / "trial.json").read_text())
        assert (
            record["status"] == "skipped"
            and "GiB (memory planner" in record["reason"]
            and "of 0.5 GiB" in record["reason"]
        )
        assert not (tmp_path / "s" / name / "metrics.jsonl").exists()
    assert "2 trials: 2 skipped" in capsys.readouterr().out


def test_a_second_sweep_into_a_running_sweeps_folder_is_refused(tmp_path, capsys):
    manifest = tmp_path / "train.jsonl"
    manifest.write_text(
        json.dumps({"audio_filepath": "a.wav", "duration": 1.0, "text": "क"}) + "\n",
        encoding="utf-8",
    )
    out = tmp_path / "s"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys, time\n"
                "from konkanivani.training.run_files import hold_run_directory\n"
                f"with hold_run_directory({str(out)!r}):\n"
                "    print('held', flush=True)\n    time.sleep(120)\n"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"  # another process runs a sweep there
        status = sweep_cli.main(
            [
                "--output_dir",
                str(out),
                "--grid",
                "lr=1e-3",
                "--gpu_gb",
                "0.001",
                "--train_manifest",
                str(manifest),
                "--valid_manifest",
                str(manifest),
            ]
        )
    finally:
        holder.kill()
        holder.wait()
    assert status == 2 and "in use by another" in capsys.readouterr().err
    assert not (out / "sweep.json").exists()


@pytest.mark.parametrize("name", ["sweep.md", "sweep.csv"])
def test_a_sweep_into_a_folder_with_someone_elses_table_is_refused_and_keeps_it(tmp_path, capsys,
                                                                                 name):
    """A sweep.md (or sweep.csv) that no sweep wrote there (no sweep.json beside it) is one line and
    exit 2, before any trial; moved away, the same command runs."""
    manifest = tmp_path / "train.jsonl"
    row = {"audio_filepath": "a.wav", "duration": 20.0, "text": "क"}
    manifest.write_text(json.dumps(row) + "\n", encoding="utf-8")
    out = tmp_path / "s"
    out.mkdir()
    (out / name).write_text("# my notes, not a sweep's\n", encoding="utf-8")
    argv = ["--output_dir", str(out), "--grid", "preset=large", "--gpu_gb", "0.5",
            "--train_manifest", str(manifest), "--valid_manifest", str(manifest)]
    assert sweep_cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{out / name} exists and no konkanivani-sweep wrote it" in err[0], err
    assert (out / name).read_text(encoding="utf-8") == "# my notes, not a sweep's\n"
    assert sorted(p.name for p in out.iterdir()) == [name]  # no sweep.json, no trial, no lock

    (out / name).rename(tmp_path / name)
    assert sweep_cli.main(argv) == 0  # skipped as too large: no training
    assert "| preset-large | large | skipped |" in (out / "sweep.md").read_text(encoding="utf-8")
    assert sweep_cli.main(argv) == 0  # its own tables, found again: the sweep continues


# --- search with Optuna ---------------------------------------------------------------------------

from konkanivani.experiments.optuna_search import parse_space  # noqa: E402

SPACE = (
    "sweep:\n  search:\n    lr: {log_uniform: [1.0e-3, 3.0e-3]}\n    warmup_steps: {int: [4, 8]}\n"
)


@pytest.mark.parametrize(
    "space, message",
    [
        ({"lrr": {"uniform": [0, 1]}}, "lrr: not a trainer flag (did you mean lr?)"),
        ({"lr": {"normal": [0, 1]}}, "lr: write one of"),
        ({"lr": {"uniform": [2, 1]}}, "lr: uniform takes [low, high] numbers with low < high"),
        ({"lr": {"log_uniform": [0, 1]}}, "lr: log_uniform needs low > 0"),
        (
            {"warmup_steps": {"uniform": [1, 9]}},
            "warmup_steps: an integer flag takes int: [low, high] or choices",
        ),
        ({}, "sweep: search: must map trainer flags"),
    ],
)
def test_a_bad_search_space_is_one_line_naming_the_flag(space, message):
    with pytest.raises(SweepError) as e:
        parse_space(space, "r.yaml")
    assert message in str(e.value) and "\n" not in str(e.value)


def _search_argv(corpus, out, recipe, *extra):
    return [
        "--output_dir",
        str(out),
        "--search",
        "optuna",
        "--config",
        str(recipe),
        *_shared(
            corpus, "--max_steps", "6", "--save_every_steps", "2", "--validate_every_steps", "3"
        ),
        *extra,
    ]


def _study_trials(url):
    import optuna

    study = optuna.load_study(study_name="konkanivani-sweep", storage=url)
    return study.get_trials(deepcopy=False)


@pytest.mark.slow
def test_a_search_killed_in_a_trial_resumes_from_its_sqlite_study(tiny_corpus, tmp_path):
    pytest.importorskip("optuna")
    from optuna.trial import TrialState

    recipe = tmp_path / "search.yaml"
    recipe.write_text(SPACE, encoding="utf-8")
    out = tmp_path / "search"
    argv = _search_argv(tiny_corpus, out, recipe, "--trials", "3")
    second = out / "trial-0001"
    _sigterm_when_saved(argv, second, steps=3)
    url = f"sqlite:///{out / 'study.db'}"
    stopped = [t for t in _study_trials(url) if t.user_attrs.get("run_dir") == "trial-0001"]
    # given again, same parameters
    assert [t.state for t in stopped] == [TrialState.FAIL, TrialState.WAITING]
    params = stopped[0].params

    assert sweep_cli.main(argv) == 0  # the same command again
    finished = [
        t for t in _study_trials(url) if t.state in (TrialState.COMPLETE, TrialState.PRUNED)
    ]
    assert len(finished) == 3
    again = [t for t in finished if t.user_attrs["run_dir"] == "trial-0001"]
    assert len(again) == 1 and again[0].params == params
    # resumed: every step once
    assert _train_steps(second) == list(range(1, len(_train_steps(second)) + 1))
    assert len((out / "sweep.csv").read_text().splitlines()) >= 2


@pytest.mark.slow
def test_two_sweep_processes_share_one_sqlite_study(tiny_corpus, tmp_path):
    pytest.importorskip("optuna")
    from optuna.trial import TrialState

    recipe = tmp_path / "search.yaml"
    recipe.write_text(SPACE, encoding="utf-8")
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "konkanivani.cli.sweep",
                *_search_argv(
                    tiny_corpus, tmp_path / f"machine{i}", recipe, "--trials", "4", "--storage", url
                ),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        for i in range(2)
    ]
    for proc in procs:
        _, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr[-2000:]
    trials = _study_trials(url)
    finished = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    # each process stops once four are done; one may be finishing its own
    assert 4 <= len(finished) <= 5
    folders = [{p.name for p in (tmp_path / f"machine{i}").glob("trial-*")} for i in range(2)]
    # each trial ran once, on one machine
    assert folders[0] and folders[1] and not folders[0] & folders[1]
    assert {t.user_attrs["run_dir"] for t in finished} <= folders[0] | folders[1]


@pytest.mark.slow
def test_a_pruned_trial_stops_at_its_validation_and_counts_as_pruned(
    tiny_corpus, tmp_path, monkeypatch
):
    optuna = pytest.importorskip("optuna")
    from optuna.trial import TrialState

    # every report is below the median
    monkeypatch.setattr(optuna.trial.Trial, "should_prune", lambda self: True)
    recipe = tmp_path / "search.yaml"
    recipe.write_text(SPACE, encoding="utf-8")
    out = tmp_path / "search"
    argv = _search_argv(tiny_corpus, out, recipe, "--trials", "2", "--max_steps", "9")
    assert sweep_cli.main(argv) == 0
    trials = _study_trials(f"sqlite:///{out / 'study.db'}")
    assert [t.state for t in trials] == [TrialState.PRUNED, TrialState.PRUNED]
    # not at the first validation (step 3: nothing has aligned yet); at the second, saved there
    for t in trials:
        assert _train_steps(out / t.user_attrs["run_dir"]) == [1, 2, 3, 4, 5, 6]
        assert (
            json.loads((out / t.user_attrs["run_dir"] / "trial.json").read_text())["status"]
            == "pruned"
        )
    assert sweep_cli.main(argv) == 0  # finished: nothing more
    assert len(_study_trials(f"sqlite:///{out / 'study.db'}")) == 2


def test_a_combination_the_trainer_refuses_fails_that_trial_and_the_search_goes_on(
    tiny_corpus, tmp_path, capsys
):
    pytest.importorskip("optuna")
    # dw_striding takes no --subsampling_channels: every sample is refused
    recipe = tmp_path / "search.yaml"
    recipe.write_text("sweep:\n  search:\n    subsampling: {choices: [dw_striding]}\n"
                      "    subsampling_channels: {choices: [8]}\n", encoding="utf-8")
    out = tmp_path / "search"
    # failed trials: exit 1
    assert sweep_cli.main(_search_argv(tiny_corpus, out, recipe, "--trials", "2")) == 1
    for name in ("trial-0000", "trial-0001"):
        record = json.loads((out / name / "trial.json").read_text())
        assert record["status"] == "failed" and "--subsampling_channels 8" in record["reason"]
        assert not (out / name / "latest.pt").exists()

    recipe.write_text(
        "model:\n  subsampling: dw_striding\n  subsampling_channels: 8\n" + SPACE, encoding="utf-8"
    )
    assert (
        sweep_cli.main(_search_argv(tiny_corpus, tmp_path / "broken", recipe, "--trials", "2")) == 2
    )
    # the recipe's own refusal stops the search
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--subsampling_channels 8" in err


@pytest.mark.parametrize("flags, fits", [
    ({}, False),  # 8 utterances of 20 s, medium, fp32: about 3 GiB
    ({"auto_batch": True}, True),  # the run sizes its batches: one utterance must fit
    ({"max_batch_seconds": 40.0}, True),  # two utterances a batch
    ({"max_memory_gb": 1.5}, True),  # the sampler keeps batches under it
    ({"max_memory_gb": 4.0}, False),  # ...which is past the budget
])
def test_the_fit_check_plans_with_the_batch_flags_the_run_has(tmp_path, flags, fits):
    from konkanivani.config import TrainConfig
    from konkanivani.experiments.trials import _fits

    manifest = tmp_path / "train.jsonl"
    manifest.write_text(
        json.dumps({"audio_filepath": "a.wav", "duration": 20.0, "text": "क"}) + "\n",
        encoding="utf-8",
    )
    cfg = TrainConfig(
        train_manifest=str(manifest),
        valid_manifest=str(manifest),
        preset="medium",
        batch_size=8,
        **flags,
    )
    assert (_fits(cfg, {}, 2.0) is None) == fits
