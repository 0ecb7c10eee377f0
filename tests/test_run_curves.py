"""Watching a run: TensorBoard event files and curves.png written while training, and
konkanivani-plot redrawing one run or comparing several, all from metrics.jsonl."""
import doctest
import json
import logging
import shutil
import sys

import pytest
from tiny_args import tiny_args

from konkanivani.cli import plot as plot_cli
from konkanivani.cli import train as train_cli
from konkanivani.training import curves
from konkanivani.training.curves import write_curves
from konkanivani.training.loop import _redraw_curves
from konkanivani.training.metrics_log import read_metrics
from konkanivani.training.tensorboard_log import open_tensorboard

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_the_doctests_hold():
    assert doctest.testmod(curves).failed == 0  # text_table, the benchmarks' printed tables


def _is_png(path):
    """A complete PNG: the signature, and an image matplotlib reads back with some width and
    height."""
    from matplotlib.image import imread

    return path.read_bytes()[:8] == PNG_SIGNATURE and min(imread(path).shape[:2]) > 100


def _rows(run_dir, kind):
    """Every row of ``kind`` in RUN_DIR/metrics.jsonl as written, not merged by step as
    ``read_metrics`` merges them: a step a resume failed to drop is seen here."""
    return [
        r
        for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if r["kind"] == kind
    ]


def _scalars(run_dir, tag):
    """(step, value) of every event TensorBoard shows for ``tag`` in RUN_DIR/tensorboard/."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0}).Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def _write_metrics(run_dir, losses, valid_at):
    """A metrics.jsonl as training writes it: a train row per step, a valid row at ``valid_at``."""
    run_dir.mkdir(parents=True)
    with open(run_dir / "metrics.jsonl", "w") as f:
        for step, loss in enumerate(losses, 1):
            f.write(
                json.dumps(
                    {
                        "kind": "train",
                        "step": step,
                        "epoch": 1,
                        "loss": loss,
                        "ctc": loss,
                        "attention": loss,
                        "lr": 1e-3 * step / len(losses),
                        "grad_norm": 1.0,
                        "utt_per_s": 10.0,
                        "data_wait": 0.01,
                        "rss_gb": 0.5,
                        "peak_rss_gb": 0.6,
                    }
                )
                + "\n"
            )
            if step in valid_at:
                f.write(json.dumps({"kind": "valid", "step": step, "epoch": 1, "loss": loss,
                                    "wer": 1.0 - step / 100, "cer": 0.8 - step / 100}) + "\n")


# ---- from hand-written metrics (fast) ----------------------------------------------------------

def test_curves_from_hand_written_metrics_replace_the_old_picture_whole(tmp_path):
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    # None: a non-finite loss
    _write_metrics(run, [150.0, 90.0, None, 40.0, 20.0, 12.0], valid_at={3, 6})
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "st')  # a line cut short by a kill
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows["train"]] == [1, 2, 3, 4, 5, 6] and [
        r["step"] for r in rows["valid"]
    ] == [3, 6]
    (run / "curves.png").write_bytes(b"an older picture")
    assert write_curves(run) == run / "curves.png"
    assert _is_png(run / "curves.png")
    # no temporary left behind
    assert sorted(p.name for p in run.iterdir()) == ["curves.png", "metrics.jsonl"]


def test_plot_cli_compares_runs_and_refuses_a_directory_without_metrics_in_one_line(
    tmp_path, capsys
):
    pytest.importorskip("matplotlib")
    _write_metrics(tmp_path / "small", [100.0, 50.0, 30.0, 20.0], valid_at={2, 4})
    _write_metrics(tmp_path / "medium", [120.0, 40.0, 15.0, 9.0, 6.0], valid_at={5})
    out = tmp_path / "compare.png"
    assert plot_cli.main([str(tmp_path / "small"), str(tmp_path / "medium"), "-o", str(out)]) == 0
    assert _is_png(out)
    assert plot_cli.main([str(tmp_path / "small")]) == 0  # one run: its own curves.png
    assert _is_png(tmp_path / "small" / "curves.png")
    capsys.readouterr()

    (tmp_path / "empty").mkdir()
    assert plot_cli.main([str(tmp_path / "small"), str(tmp_path / "empty"), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "empty: no metrics.jsonl" in err, err
    with pytest.raises(SystemExit) as e:
        plot_cli.main([str(tmp_path / "small"), str(tmp_path / "medium")])
    assert e.value.code == 2 and "-o PNG" in capsys.readouterr().err


def test_a_picture_that_cannot_be_drawn_is_a_warning_not_an_error(tmp_path, caplog):
    pytest.importorskip("matplotlib")
    _write_metrics(tmp_path / "run", [3.0, 2.0], valid_at={2})
    (tmp_path / "run" / "curves.png").mkdir()  # os.replace cannot put a file there
    with caplog.at_level(logging.WARNING, logger="konkanivani"):
        _redraw_curves(tmp_path / "run")
    assert [
        r.getMessage() for r in caplog.records if "could not draw" in r.getMessage()
    ], caplog.text
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["curves.png", "metrics.jsonl"]


def test_tensorboard_hides_the_steps_a_resumed_run_trains_again(tmp_path):
    """A run died after step 4 with a save at step 2; the resumed run logs steps 3 and 4 again:
    TensorBoard shows each step once, with the resumed run's values."""
    pytest.importorskip("tensorboard")
    board = open_tensorboard(tmp_path / "tensorboard", 0)
    for step in (1, 2, 3, 4):
        board.write("train", step, loss=10.0 - step)
    board.close()
    board = open_tensorboard(tmp_path / "tensorboard", 2)
    for step in (3, 4, 5):
        board.write("train", step, loss=100.0 + step, lr=None)  # None (non-finite): left out
        board.write("valid", step, cer=0.5)
    board.close()
    assert _scalars(tmp_path, "train/loss") == [
        (1, 9.0),
        (2, 8.0),
        (3, 103.0),
        (4, 104.0),
        (5, 105.0),
    ]
    assert [step for step, _ in _scalars(tmp_path, "valid/cer")] == [3, 4, 5]


# ---- real tiny training runs (slow) ------------------------------------------------------------

@pytest.fixture(scope="module")
def runs(tiny_corpus, tmp_path_factory):
    """A run of 4 steps validating every 2; and a copy of it resumed from its step-2 checkpoint and
    trained on to step 6, so steps 3 and 4 are logged twice in its directory."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("matplotlib")
    base = tmp_path_factory.mktemp("runs")
    first, resumed = base / "first", base / "resumed"
    assert (
        train_cli.main(
            tiny_args(
                tiny_corpus,
                first,
                "--max_steps",
                "4",
                "--validate_every_steps",
                "2",
                "--keep_checkpoints",
                "5",
            )
        )
        == 0
    )
    shutil.copytree(first, resumed)
    assert (
        train_cli.main(
            tiny_args(
                tiny_corpus,
                resumed,
                "--max_steps",
                "6",
                "--validate_every_steps",
                "2",
                "--resume",
                str(resumed / "step_0000002.pt"),
            )
        )
        == 0
    )
    return first, resumed


@pytest.mark.slow
def test_tensorboard_shows_what_metrics_jsonl_holds_and_curves_png_is_drawn(runs):
    for run_dir in runs:
        train_rows, valid_rows = _rows(run_dir, "train"), _rows(run_dir, "valid")
        names = [name for name in train_rows[0] if name not in ("kind", "step", "epoch")]
        assert {"loss", "ctc", "attention", "lr", "grad_norm", "utt_per_s", "data_wait"} < set(
            names
        )
        assert {"rss_gb", "mem_gb"} & set(names)  # the memory: on a CPU, on CUDA
        for name in names:
            shown = _scalars(run_dir, f"train/{name}")
            assert [step for step, _ in shown] == [r["step"] for r in train_rows], name
            assert [value for _, value in shown] == pytest.approx(
                [r[name] for r in train_rows], rel=1e-5
            ), name
        for name in ("loss", "cer", "wer"):
            shown = _scalars(run_dir, f"valid/{name}")
            assert [step for step, _ in shown] == [r["step"] for r in valid_rows], name
            assert [value for _, value in shown] == pytest.approx(
                [r[name] for r in valid_rows], rel=1e-5
            ), name
        assert _is_png(run_dir / "curves.png")
    first, resumed = runs
    assert [r["step"] for r in _rows(first, "valid")] == [2, 4]
    assert [r["step"] for r in _rows(resumed, "train")] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in _rows(resumed, "valid")] == [2, 4, 6]


@pytest.mark.slow
def test_plot_cli_draws_two_real_runs_in_one_figure(runs, tmp_path):
    out = tmp_path / "both.png"
    assert plot_cli.main([str(d) for d in runs] + ["-o", str(out)]) == 0
    assert _is_png(out)


@pytest.mark.slow
def test_without_tensorboard_and_matplotlib_training_runs_and_says_how_to_get_them(
    tiny_corpus, tmp_path, monkeypatch, caplog
):
    for module in ("torch.utils.tensorboard", "matplotlib"):
        monkeypatch.setitem(sys.modules, module, None)  # as if not installed: importing it fails
    out = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="konkanivani"):
        assert (
            train_cli.main(
                tiny_args(tiny_corpus, out, "--max_steps", "2", "--validate_every_steps", "1")
            )
            == 0
        )
    assert [r["step"] for r in _rows(out, "train")] == [1, 2] and [
        r["step"] for r in _rows(out, "valid")
    ] == [1, 2]
    assert not (out / "tensorboard").exists() and not (out / "curves.png").exists()
    log = (out / "train.log").read_text()
    assert log.count('pip install "konkanivani[tensorboard]"') == 1, log
    assert log.count('pip install "konkanivani[plot]"') == 1, log


@pytest.mark.slow
def test_no_tensorboard_flag_writes_no_event_files(tiny_corpus, tmp_path, caplog):
    out = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="konkanivani"):
        assert (
            train_cli.main(tiny_args(tiny_corpus, out, "--max_steps", "1", "--no_tensorboard")) == 0
        )
    assert not (out / "tensorboard").exists() and _rows(out, "train")
    assert "TensorBoard" not in (out / "train.log").read_text()
