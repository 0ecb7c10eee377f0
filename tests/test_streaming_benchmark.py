"""benchmarks/streaming.py end to end on the tiny corpus: two tiny runs trained side by side for a
few steps, the accuracy table by chunk size, latency on two utterances and the memory of a short
recording, each written and printed. Bounded by steps and counts."""
import csv

import pytest
from benchmark_modules import load

streaming = load("streaming")


@pytest.mark.slow
def test_the_streaming_benchmark_writes_its_tables_and_plot(tiny_corpus, tmp_path, capsys):
    out = tmp_path / "streaming"
    code = streaming.main(
        [
            "--corpus",
            str(tiny_corpus),
            "--out",
            str(out),
            "--steps",
            "3",
            "--splits",
            "test",
            "--chunks",
            "8,4",
            "--latency_utterances",
            "2",
            "--long_minutes",
            "0.7",
            "--whole_minutes",
            "0.2",
            "--preset",
            "tiny",
            "--vocab_size",
            "48",
            "--num_workers",
            "0",
            "--no_mixed_precision",
        ]
    )
    assert code == 0
    rows = list(csv.DictReader(open(out / "accuracy.csv")))
    assert [(r["model"], r["chunk"]) for r in rows] == [
        ("full", "full"),
        ("streaming", "full"),
        ("streaming", "8"),
        ("streaming", "4"),
    ]
    assert all(0 <= float(r["cer"]) for r in rows)
    latency = list(csv.DictReader(open(out / "latency.csv")))
    assert [int(r["chunk"]) for r in latency] == [8, 4] and all(
        float(r["rtf"]) > 0 for r in latency
    )
    memory = list(csv.DictReader(open(out / "memory.csv")))
    assert len(memory) == 4 and all(int(r["peak_mib"]) > 0 for r in memory)
    assert (out / "long_streaming.jsonl").is_file() and (out / "long_full.jsonl").is_file()
    assert (out / "streaming.png").stat().st_size > 10_000
    assert (
        streaming.main(
            ["--corpus", str(tiny_corpus), "--out", str(out), "--steps", "3", "--phases", "train"]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "| model" in printed and "| chunk (frames)" in printed and "peak RSS MiB" in printed
