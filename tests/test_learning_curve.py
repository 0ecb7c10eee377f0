"""The learning-curve benchmark end to end on the tiny corpus, for a few seconds of training."""
import csv

import yaml
from benchmark_modules import load

learning_curve = load("learning_curve")


def test_learning_curve_writes_curve_table_and_plot(tiny_corpus, tmp_path, capsys):
    """Bounded by steps, not seconds: the same curve on a fast or a busy machine."""
    out = tmp_path / "lc"
    code = learning_curve.main(
        [
            "--corpus",
            str(tiny_corpus),
            "--budget_steps",
            "14",
            "--eval_every_steps",
            "5",
            "--out",
            str(out),
            "--methods",
            "greedy,rescore",
            "--beam_size",
            "2",
            "--average_last",
            "2",
            "--preset",
            "tiny",
            "--vocab_size",
            "48",
            "--batch_size",
            "16",
            "--num_workers",
            "0",
            "--warmup_steps",
            "5",
        ]
    )
    assert code == 0
    curve = list(csv.DictReader(open(out / "curve.csv")))
    assert [int(r["step"]) for r in curve] == [5, 10, 14]
    minutes = [float(r["minutes"]) for r in curve]
    assert minutes == sorted(minutes)
    # 51 utterances in batches of 16: 4 steps an epoch
    assert [int(r["epoch"]) for r in curve][-1] >= 4
    finals = list(csv.DictReader(open(out / "final.csv")))
    assert {r["method"] for r in finals} == {"greedy", "rescore"}
    # The recipe keeps a moving average (ema_decay): the final weights are scored as both.
    assert {r["weights"] for r in finals} == {
        "final (EMA)",
        "final (training weights)",
        "average of last 2 epochs",
    }
    assert {r["split"] for r in finals} == {"test"}
    assert all(0 <= float(r["cer"]) for r in finals)
    assert (out / "learning_curve.png").stat().st_size > 10_000
    printed = capsys.readouterr().out
    assert "| train min |" in printed and "| weights" in printed
    assert "test CER 10% (greedy, training weights) reached at" in printed


def test_time_to_cer_interpolates_the_first_crossing():
    curve = [{"minutes": 2, "cer": 30.0}, {"minutes": 4, "cer": 14.0}, {"minutes": 6, "cer": 6.0},
             {"minutes": 8, "cer": 12.0}, {"minutes": 10, "cer": 4.0}]
    assert learning_curve.time_to_cer(curve, 10.0) == 5.0
    assert learning_curve.time_to_cer(curve, 40.0) == 2
    assert learning_curve.time_to_cer(curve, 3.0) is None


def test_a_recipe_file_replaces_the_cpu_recipe(tiny_corpus, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "model:\n  preset: tiny\ntraining:\n  lr: 3.0e-3\n  ema_decay: 0.0\n", encoding="utf-8"
    )
    out = tmp_path / "lc"
    code = learning_curve.main(
        [
            "--corpus",
            str(tiny_corpus),
            "--recipe",
            str(recipe),
            "--budget_steps",
            "3",
            "--eval_every_steps",
            "3",
            "--out",
            str(out),
            "--methods",
            "greedy",
            "--average_last",
            "1",
            "--vocab_size",
            "48",
            "--num_workers",
            "0",
        ]
    )
    assert code == 0
    run = yaml.safe_load((out / "run" / "config.yaml").read_text())
    flat = {
        k: v for section in run.values() if isinstance(section, dict) for k, v in section.items()
    }
    # not cpu_small's 16
    assert flat["lr"] == 3.0e-3 and flat["ema_decay"] == 0.0 and flat["batch_size"] == 8


def test_a_run_stopped_by_sigterm_before_its_budget_scores_nothing(
    tiny_corpus, tmp_path, monkeypatch, caplog
):
    """SIGTERM at step 3 of 40: the run saves and stops, and the benchmark says so and exits 143
    instead of
    scoring the stopped weights as the budget's (it used to fail on an empty curve)."""
    import signal
    real_train = learning_curve.train

    def train_with_sigterm(cfg, flags, on_step):
        def step(step, epoch, model):
            if step == 3:
                signal.raise_signal(signal.SIGTERM)
            return on_step(step, epoch, model)
        return real_train(cfg, flags, on_step=step)

    monkeypatch.setattr(learning_curve, "train", train_with_sigterm)
    out = tmp_path / "lc"
    caplog.set_level("INFO")
    code = learning_curve.main(
        [
            "--corpus",
            str(tiny_corpus),
            "--budget_steps",
            "40",
            "--out",
            str(out),
            "--preset",
            "tiny",
            "--vocab_size",
            "48",
            "--batch_size",
            "16",
            "--num_workers",
            "0",
            "--warmup_steps",
            "5",
        ]
    )
    assert code == 128 + signal.SIGTERM  # as konkanivani-train exits, so a script sees the stop
    assert "stopped by SIGTERM before the budget" in caplog.text
    assert (out / "run" / "latest.pt").is_file()
    assert not (out / "curve.csv").exists() and not (out / "final.csv").exists()
