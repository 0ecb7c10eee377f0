"""benchmarks/data_wait.py reads the trainer's own data wait back from a run's metrics.jsonl."""
import json

from benchmark_modules import load

data_wait = load("data_wait")


def test_waits_skip_the_first_logged_step_and_count_steps_over_the_target(tmp_path):
    rows = [{"kind": "train", "step": 10, "data_wait": 0.30, "elapsed_s": 5.0},
            {"kind": "valid", "step": 10, "elapsed_s": 6.0},
            {"kind": "train", "step": 20, "data_wait": 0.01, "elapsed_s": 10.0},
            {"kind": "train", "step": 30, "data_wait": 0.07, "elapsed_s": 20.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    points = data_wait.waits(tmp_path)
    assert points == [(20, 0.01, 0.5), (30, 0.07, 1.0)]  # the loader's start (step 10) left out
    row = data_wait.summary("case", points)
    assert row["over_target"] == 1 and row["max_wait"] == 0.07
    assert abs(row["mean_wait"] - 0.04) < 1e-12 and abs(row["s_per_step"] - 0.75) < 1e-12
