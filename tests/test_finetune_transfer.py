"""The fine-tuning benchmark end to end on the tiny corpus, for a few steps of each run."""
import csv
import logging

from benchmark_modules import load

finetune_transfer = load("finetune_transfer")


def test_finetune_benchmark_compares_both_runs_step_by_step(tiny_corpus, tmp_path, capsys, caplog):
    out = tmp_path / "ft"
    flags = [
        "--corpus",
        str(tiny_corpus),
        "--pretrain_steps",
        "4",
        "--steps",
        "4",
        "--every",
        "2",
        "--out",
        str(out),
        "--preset",
        "tiny",
        "--vocab_size",
        "48",
        "--batch_size",
        "8",
        "--num_workers",
        "0",
        "--warmup_steps",
        "2",
        "--ema_decay",
        "0",
    ]
    caplog.set_level(logging.INFO)
    finetune_transfer.main(flags)
    rows = list(csv.DictReader(open(out / "finetune.csv")))
    # every 2 steps and at epoch ends
    assert [int(r["step"]) for r in rows][-1] == 4 and len(rows) >= 2
    assert all(0 <= float(r[k]) for r in rows for k in ("cer_scratch", "cer_finetuned"))
    # The fine-tuned run started from the hi model (pieces) with its own character vocabulary.
    assert (
        f"init_from {out / 'hi_pieces' / 'latest.pt'}" in caplog.text
        and "matched by token" in caplog.text
    )
    assert (out / "finetune.png").stat().st_size > 10_000
    printed = capsys.readouterr().out
    assert (
        "| step | from scratch | fine-tuned from hi |" in printed and "mr runs on chars" in printed
    )

    # Run again: every run is complete, so nothing trains and the same table comes out.
    finetune_transfer.main(flags)
    assert list(csv.DictReader(open(out / "finetune.csv"))) == rows
