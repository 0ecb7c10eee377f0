"""The memory estimator's CUDA calibration against the peaks measured on an H100
(benchmarks/results/gpu/h100_memory_rows.csv), its refit from that file, and the batch budget it
plans for the T4 recipe on a 15 GiB card. All on the CPU: the estimator needs no GPU."""
from pathlib import Path

import pytest
import torch
from benchmark_modules import load

from konkanivani.cli import plan_memory
from konkanivani.cli import train as train_cli
from konkanivani.config import TrainConfig, dataclass_from_args, model_config_from_preset
from konkanivani.data.frames import frames_of
from konkanivani.training import memory
from konkanivani.training.memory import GIB, MemoryEstimator, precision_name
from konkanivani.training.precision import resolve_precision
from konkanivani.training.start import FILL_FRACTION, gpu_batches

ROOT = Path(__file__).resolve().parents[1]
ROWS = ROOT / "benchmarks" / "results" / "gpu" / "h100_memory_rows.csv"
calibrate = load("calibrate_memory")

# estimate_mib of each memory row in the H100 report, as the CPU-calibrated estimator gave it
# then (its ROW lines): the CPU figures must give them still
CPU_ESTIMATES_MIB = {"fp32 + AdamW + fixed batch 2 (baseline)": 1448.8652470800782,
                     "--precision fp16": 1142.3004772597656,
                     "--optimizer adamw_8bit": 1299.0869267675782,
                     "--gradient_checkpointing": 885.0797256948242,
                     "--max_batch_seconds 15 (1 x 15 s; 2 accumulated)": 958.8320742236328,
                     "all combined": 485.35958252709963,
                     "all but --gradient_checkpointing": 681.0284490791015,
                     "all but --precision fp16": 527.1609932185058}


def _rows():
    return calibrate.read_cuda_rows(ROWS)


def test_every_recorded_h100_peak_is_within_a_quarter_of_the_cuda_estimate():
    rows = _rows()
    # every memory row of the report
    assert sum(r["source"] == "gpu_report memory" for r in rows) == 8
    for row in rows:
        peak = row["peak_mib"] * 2 ** 20
        as_measured = sum(calibrate.measured_parts(row).values())
        assert 0.75 <= as_measured / peak <= 1.25, (row, as_measured / peak)
        # what a training run plans with counts all that the row's conditions left out
        est = calibrate._row_estimator(row)
        assert est.peak_bytes(row["utterances"], row["frames"], row["tokens"]) >= as_measured


def test_the_cpu_figures_are_the_ones_the_h100_report_printed():
    for row in _rows():
        if row["source"] != "gpu_report memory":
            continue
        cfg = model_config_from_preset(row["preset"], vocab_size=row["vocab_size"],
                                       conv_kernel=row["conv_kernel"])
        for device in ("cpu", torch.device("cpu"), "mps"):  # all but CUDA get the CPU's figures
            est = MemoryEstimator(cfg, row["precision"], row["optimizer"],
                                  bool(row["checkpointing"]), device)
            estimate = est.peak_bytes(row["utterances"], row["frames"], row["tokens"]) / 2 ** 20
            assert estimate == pytest.approx(CPU_ESTIMATES_MIB[row["configuration"]], rel=1e-12)


def test_refitting_the_recorded_rows_gives_the_figures_memory_uses():
    figures = calibrate.fit_cuda(_rows())
    committed = [memory.CUDA_PEAK_FACTOR["fp32"], memory.CUDA_PEAK_FACTOR["half"],
                 memory.CUDA_CHECKPOINTED_SUBSAMPLING_FACTOR, memory.CUDA_OVERHEAD / 2 ** 20]
    assert list(figures) == pytest.approx(committed, abs=1e-9)
    # the fit, each row's estimate with the figures fitted, within 10% (as memory.py says)
    for row in _rows():
        ratio = calibrate.cuda_estimate(row, figures) / (row["peak_mib"] * 2 ** 20)
        assert ratio == pytest.approx(1, abs=0.1), row


def test_a_bad_rows_file_is_one_line_naming_it(tmp_path, capsys):
    text = ROWS.read_text()
    bad = tmp_path / "rows.csv"
    bad.write_text(text.replace("large,128,15,fp32,adamw,0,2,1,1500",
                                "large,128,15,fp64,adamw,0,2,1,1500", 1))
    assert calibrate.main_cuda(bad) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"{bad}: data row 1: precision 'fp64' is not one of fp32, fp16, bf16"
    bad.write_text(text.replace("peak_mib", "peak", 1))
    assert calibrate.main_cuda(bad) == 2
    assert f"{bad}: no column peak_mib" in capsys.readouterr().err
    assert calibrate.main_cuda(tmp_path / "missing.csv") == 2
    assert "missing.csv: cannot be read" in capsys.readouterr().err
    assert bad.read_text() == text.replace("peak_mib", "peak", 1)  # left as it was


def test_the_t4_recipe_budget_for_a_15_gib_card(capsys):
    """configs/t4.yaml (medium, mixed precision: fp16 on CUDA, AdamW, no checkpointing) on a 15 GiB
    card with konkanivani-plan-memory's 25% margin, utterances up to the recipe's --max_duration."""
    args = train_cli.parse_args(["--config", str(ROOT / "configs" / "t4.yaml")])
    cfg = dataclass_from_args(TrainConfig, args)
    precision = precision_name(resolve_precision(torch.device("cuda"), cfg.mixed_precision,
                                                 cfg.precision))
    options = (cfg.preset, precision, cfg.optimizer, cfg.gradient_checkpointing)
    assert options == ("medium", "fp16", "adamw", False)
    model_cfg = model_config_from_preset(cfg.preset, vocab_size=128)
    longest, budget = frames_of(cfg.max_duration), 0.75 * 15 * GIB
    est = MemoryEstimator(model_cfg, precision, cfg.optimizer, cfg.gradient_checkpointing, "cuda")
    frames = est.max_frames(budget, longest)
    n = frames // longest
    assert frames == n * longest
    assert est.peak_bytes(n, longest) <= budget < est.peak_bytes(n + 1, longest)
    # many times the recipe's micro-batch of 2; the CPU-calibrated estimate (1.9-2.6x the H100's
    # peaks) allowed less than half as many
    cpu = MemoryEstimator(model_cfg, precision, cfg.optimizer, cfg.gradient_checkpointing)
    assert n >= 16 * cfg.batch_size and cpu.max_frames(budget, longest) < frames / 2
    # per second of audio, as the largest medium batch measured on the H100 peaked (256 x 4 s,
    # bf16: half precision as fp16 is)
    row = next(r for r in _rows()
               if (r["preset"], r["precision"], r["utterances"]) == ("medium", "bf16", 256))
    measured = row["peak_mib"] * 2 ** 20 / (row["utterances"] * row["frames"] / 100)
    assert est.peak_bytes(n, longest) / (n * cfg.max_duration) == pytest.approx(measured, rel=0.25)
    # the planner says the same
    flags = ["--seconds", str(cfg.max_duration), "--utterances_per_update", "1000"]
    assert plan_memory.main(["--preset", "medium", "--gpu_gb", "15", *flags]) == 0
    out = capsys.readouterr().out
    assert "estimates calibrated on CUDA (NVIDIA H100 80GB HBM3, 2026-11-26)" in out
    fp16_row = next(line.split() for line in out.splitlines()
                    if line.startswith("fp16      adamw       no"))
    assert int(fp16_row[-1]) == frames and int(fp16_row[-4]) == n


def test_the_t4_recipe_fills_15_gib_with_batches_of_the_median_utterance():
    """--gpu_memory_gb 15 (configs/t4.yaml) on CUDA: batches sized to 3/4 of 15 GiB by the CUDA
    estimate, one micro-batch a step, and the LR and warm-up that follow from the batch's growth
    over the CPU recipe's 2 x 4 utterances, for a corpus of 3 s utterances (the demo's median)."""
    args = train_cli.parse_args(["--config", str(ROOT / "configs" / "t4.yaml")])
    cfg = dataclass_from_args(TrainConfig, args)
    assert cfg.gpu_memory_gb == 15
    est = MemoryEstimator(
        model_config_from_preset(cfg.preset, vocab_size=128),
        "fp16",
        cfg.optimizer,
        cfg.gradient_checkpointing,
        "cuda",
    )
    durations = [2.0, 3.0, 3.0, 4.5, 9.0]
    planned, fits, per_batch = gpu_batches(cfg, est, durations, 15 * GIB)
    median = frames_of(3.0)
    assert (
        est.peak_bytes(per_batch, median)
        <= FILL_FRACTION * 15 * GIB
        < est.peak_bytes(per_batch + 1, median)
    )
    assert fits(per_batch, median) and not fits(per_batch + 1, median)
    assert 250 <= per_batch <= 1500  # hundreds of utterances a step, where the CPU recipe takes 8
    assert planned.gradient_accumulation_steps == 1
    assert planned.lr == pytest.approx(2 * cfg.lr)  # sqrt(per_batch / 8) > 2: capped at 2x
    assert planned.warmup_steps == max(25, -(-cfg.warmup_steps * 8 // per_batch))
    assert (planned.batch_size, planned.max_memory_gb) == (cfg.batch_size, cfg.max_memory_gb)
