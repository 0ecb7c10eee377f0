"""benchmarks/throughput.py: its FLOP count and a one-round run of the smallest preset (with the
pretraining step)."""
import json

import pytest
import torch
from benchmark_modules import load
from torch import nn

throughput = load("throughput")


def test_grouped_convolution_backward_is_counted_once_per_group():
    """A depthwise conv's weight gradient costs what its forward does, not channels times more."""
    from torch.utils.flop_counter import FlopCounterMode

    C, T, K, B = 64, 100, 31, 2
    conv = nn.Conv1d(C, C, K, padding=K // 2, groups=C)
    x = torch.randn(B, C, T, requires_grad=True)
    custom = {torch.ops.aten.convolution_backward: throughput._conv_backward_flop}
    with FlopCounterMode(display=False, custom_mapping=custom) as counter:
        conv(x).sum().backward()
    forward = 2 * B * C * T * K
    assert counter.get_total_flops() == 3 * forward  # forward, input gradient, weight gradient


@pytest.mark.slow
def test_one_round_of_the_small_preset_prints_one_json_line(capsys):
    threads = torch.get_num_threads()
    assert (
        throughput.main(
            [
                "--preset",
                "small",
                "--rounds",
                "1",
                "--warmup",
                "0",
                "--utterances",
                "2",
                "--seconds",
                "1",
                "--tokens",
                "4",
                "--threads",
                "1",
                "--pretrain",
                "--json",
            ]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    models = {row["model"] for row in result["rows"]}
    assert models == {"torchaudio", "ours enc+CTC", "ours full", "ours pretrain"}
    # A --pretrain step's cost against the supervised steps of the same encoder.
    assert "small/fp32/ours pretrain" in result["cost_vs_full"]
    assert set(result["cost_vs_full"]) == set(result["cost_vs_enc_ctc"])
    assert all(key.endswith("/ours pretrain") for key in result["cost_vs_full"])
    assert all(value > 0 for value in result["cost_vs_full"].values())
    assert all(row["gflop_per_step"] > 0 and row["step_s"] > 0 for row in result["rows"])
    assert set(result["speedup_vs_torchaudio"]) >= {
        "small/fp32/ours enc+CTC",
        "small/fp32/ours full",
    }
    # The process keeps its thread count (a later in-process training run must match one in a
    # subprocess bit for bit, and other thread counts sum in another order).
    assert torch.get_num_threads() == threads
