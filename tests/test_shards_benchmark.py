"""benchmarks/shards.py end to end on the tiny corpus: shards written, the startup, loader, training
and torchrun phases run under a small simulated latency, and their tables and plot written. Bounded
by utterances and steps."""
import csv

import pytest
from benchmark_modules import load

shards = load("shards")


@pytest.mark.slow
def test_the_shards_benchmark_writes_its_tables_and_plot(tiny_corpus, tmp_path, capsys):
    out = tmp_path / "shards"
    code = shards.main(
        [
            "--corpus",
            str(tiny_corpus),
            "--out",
            str(out),
            "--latency_ms",
            "2",
            "--shard_size",
            "10",
            "--utterances",
            "30",
            "--max_batch_frames",
            "3000",
            "--preset",
            "tiny",
            "--train_steps",
            "6",
            "--scaling_steps",
            "6",
            "--extra",
            "--num_buckets 2",
        ]
    )
    assert code == 0
    loader = list(csv.DictReader(open(out / "loader.csv")))
    assert [r["store"] for r in loader] == ["loose", "shards", "shards / loose"]
    assert int(loader[0]["opens"]) == int(loader[0]["utterances"]) >= 30  # one open an utterance
    assert 1 <= int(loader[1]["opens"]) <= 6 and float(loader[1]["utt_per_s"]) > 0  # one a shard
    train = list(csv.DictReader(open(out / "train.csv")))
    assert [r["store"] for r in train] == ["loose", "shards"]
    assert all(0 <= float(r["data_wait_pct"]) <= 100 and float(r["steps_per_s"]) > 0 for r in train)
    scaling = list(csv.DictReader(open(out / "scaling.csv")))
    assert [int(r["processes"]) for r in scaling] == [1, 2] and float(scaling[1]["efficiency"]) > 0
    assert (out / "shards.png").stat().st_size > 10_000
    printed = capsys.readouterr().out
    assert (
        "| loader alone" in printed
        and "| training" in printed
        and "| torchrun processes" in printed
    )
    assert "startup: checking the manifest's" in printed
