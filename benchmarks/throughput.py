#!/usr/bin/env python3
"""Training throughput of our Conformer beside torchaudio's, built and timed in one process.

For each preset, three models train on the same fixed batch (default 8 utterances x 4 s, 20 tokens
each, vocabulary 256) with AdamW, their steps interleaved round by round, so that a machine whose
speed drifts from minute to minute slows all of them alike:

* ``ours enc+CTC``: our front-end, Conformer encoder and CTC head, CTC loss only;
* ``torchaudio``: ``torchaudio.models.Conformer`` of the same width, heads, feed-forward size,
  layers and kernel, behind the same front-end as our default one (two 3x3 stride-2 Conv2d, 4x) and
  a linear CTC head: the same work as ``ours enc+CTC``;
* ``ours full``: ``ASRModel`` as the trainer runs it, CTC + attention decoder;
* ``WeNet`` (with ``--wenet PATH``, a WeNet source tree): WeNet's Conformer + Transformer decoder +
  CTC of the same dimensions, the same work as ``ours full``.
* ``ours pretrain`` (with ``--pretrain``): ``ASRModel`` pretraining its encoder on audio alone, as
  ``konkanivani-train --pretrain`` does (masked prediction of random-projection codes, 1,024 codes,
  the default --mask_prob and --mask_span); its rows give ``cost_vs_full`` and
  ``cost_vs_enc_ctc``, the median of the rounds' step-time ratios against ``ours full`` (a
  supervised step of the same encoder as the trainer runs it) and ``ours enc+CTC``.

Each is timed in fp32 and in the precision ``--mixed_precision`` picks on this machine (bf16
autocast where it is faster than fp32; on a CPU without fast bf16 it picks fp32 and the second pass
is skipped). FLOPs are counted once per model with ``torch.utils.flop_counter`` (its backward
formula for grouped convolutions over-counts the weight gradient by the group count; corrected
here), and utilization is the step's FLOP rate over the matmul peak measured in the same run.

    python3 benchmarks/throughput.py                      # all presets: table + PNG
    python3 benchmarks/throughput.py --preset small --json  # one JSON line
    python3 benchmarks/throughput.py --wenet /path/to/wenet  # also WeNet, from its source tree
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from konkanivani.config import (
    DEFAULT_CODEBOOK_SIZE,
    PRESETS,
    ModelConfig,
    TrainConfig,
    model_config_from_preset,
)
from konkanivani.data.frames import subsampled_lengths
from konkanivani.model.asr import ASRModel
from konkanivani.model.conformer import ConformerEncoder
from konkanivani.training.memory import precision_name
from konkanivani.training.objective import Objective
from konkanivani.training.optim import build_optimizer
from konkanivani.training.precision import cpu_description, resolve_precision

SUBSAMPLING = next(f.metadata for f in dataclasses.fields(ModelConfig) if f.name == "subsampling")

ROOT = Path(__file__).resolve().parents[1]
PRESET_ORDER = [p for p in ("small", "medium", "large") if p in PRESETS]


class TorchaudioCTC(nn.Module):
    """``torchaudio.models.Conformer`` behind a two-layer 3x3 stride-2 Conv2d front-end (4x) and a
    linear CTC head."""

    def __init__(self, cfg):
        super().__init__()
        from torchaudio.models import Conformer

        d = cfg.d_model
        self.conv = nn.Sequential(
            nn.Conv2d(1, d, 3, stride=2), nn.ReLU(), nn.Conv2d(d, d, 3, stride=2), nn.ReLU()
        )
        self.proj = nn.Linear(d * (((cfg.n_mels - 1) // 2 - 1) // 2), d)
        self.conformer = Conformer(
            d, cfg.n_heads, cfg.ffn_dim, cfg.encoder_layers, cfg.conv_kernel, dropout=cfg.dropout
        )
        self.head = nn.Linear(d, cfg.vocab_size)

    def forward(self, feats, lens, tokens, token_lens):
        x = self.conv(feats.unsqueeze(1))
        B, C, T, Fq = x.shape
        x = self.proj(x.transpose(1, 2).reshape(B, T, C * Fq))
        lengths = subsampled_lengths(lens)
        x, lengths = self.conformer(x, lengths)
        return _ctc(self.head(x), lengths, tokens, token_lens)


class OursCTC(nn.Module):
    """Our encoder and CTC head with the CTC loss alone (the work ``TorchaudioCTC`` does)."""

    def __init__(self, cfg):
        super().__init__()
        self.encoder = ConformerEncoder(cfg)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size)

    def forward(self, feats, lens, tokens, token_lens):
        x, lengths = self.encoder(feats, lens)
        return _ctc(self.head(x), lengths, tokens, token_lens)


class OursFull(nn.Module):
    """``ASRModel``: CTC + attention, SpecAugment off (the peers get none)."""

    def __init__(self, cfg):
        super().__init__()
        self.model = ASRModel(cfg)

    def forward(self, feats, lens, tokens, token_lens):
        return Objective()(self.model, feats, lens, tokens, token_lens).loss


def _ctc(logits, lengths, tokens, token_lens):
    log_probs = F.log_softmax(logits.float(), dim=-1).transpose(0, 1)
    return F.ctc_loss(log_probs, tokens, lengths, token_lens, reduction="sum", zero_infinity=True)


class WenetFull(nn.Module):
    """WeNet's hybrid model of the same dimensions: Conformer encoder (Conv2d 4x front-end, relative
    positional self-attention, macaron feed-forward, kernel as ours), Transformer decoder, CTC;
    its recipes' defaults otherwise. Needs ``--wenet PATH``: a WeNet source tree, which this
    project neither ships nor installs."""

    def __init__(self, cfg):
        super().__init__()
        from wenet.models.transformer.asr_model import ASRModel as WenetASR
        from wenet.models.transformer.ctc import CTC
        from wenet.models.transformer.decoder import TransformerDecoder
        from wenet.models.transformer.encoder import ConformerEncoder as WenetEncoder

        encoder = WenetEncoder(
            cfg.n_mels,
            cfg.d_model,
            cfg.n_heads,
            cfg.ffn_dim,
            cfg.encoder_layers,
            dropout_rate=cfg.dropout,
            cnn_module_kernel=cfg.conv_kernel,
        )
        decoder = TransformerDecoder(
            cfg.vocab_size,
            cfg.d_model,
            cfg.n_heads,
            cfg.ffn_dim,
            cfg.decoder_layers,
            dropout_rate=cfg.dropout,
        )
        self.model = WenetASR(
            cfg.vocab_size,
            encoder,
            decoder,
            CTC(cfg.vocab_size, cfg.d_model),
            ctc_weight=0.3,
            lsm_weight=0.1,
        )

    def forward(self, feats, lens, tokens, token_lens):
        batch = {
            "feats": feats,
            "feats_lengths": lens,
            "target": tokens,
            "target_lengths": token_lens,
            "langs": ["none"] * len(lens),
            "tasks": ["transcribe"] * len(lens),
        }
        # WeNet averages over utterances
        return self.model(batch, feats.device)["loss"] * feats.shape[0]


class OursFullCompiled(OursFull):
    """``OursFull`` through ``torch.compile`` (inductor; on a CPU it needs a C++ compiler), as
    ``--compile`` runs the trainer; the batch's shape is fixed here, so it compiles once, in the
    warm-up steps."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.compiled = torch.compile(self.model)

    def forward(self, feats, lens, tokens, token_lens):
        return Objective()(self.compiled, feats, lens, tokens, token_lens).loss


class OursPretrain(nn.Module):
    """``ASRModel`` with the masked-prediction head (``codebook_size``), its loss alone through
    ``Objective(pretrain=True)`` with the trainer's default masking: a ``--pretrain`` step. The
    tokens are not used."""

    def __init__(self, cfg):
        super().__init__()
        defaults = TrainConfig()
        self.model = ASRModel(dataclasses.replace(cfg, codebook_size=DEFAULT_CODEBOOK_SIZE))
        self.objective = Objective(pretrain=True, mask_prob=defaults.mask_prob,
                                   mask_span=defaults.mask_span)

    def forward(self, feats, lens, tokens, token_lens):
        return self.objective(self.model, feats, lens, tokens, token_lens).loss


MODELS = {"torchaudio": TorchaudioCTC, "ours enc+CTC": OursCTC, "ours full": OursFull}


def _conv_backward_flop(
    grad_out_shape,
    x_shape,
    w_shape,
    bias,
    stride,
    padding,
    dilation,
    transposed,
    output_padding,
    groups,
    output_mask,
    out_shape,
    **kwargs,
) -> int:
    """torch's formula, with the weight gradient of a grouped convolution divided by the group count
    (torch counts it as if every output channel saw every input channel)."""
    from torch.utils.flop_counter import conv_backward_flop  # registered form: takes out_val

    def count(mask):
        return conv_backward_flop(
            grad_out_shape,
            x_shape,
            w_shape,
            bias,
            stride,
            padding,
            dilation,
            transposed,
            output_padding,
            groups,
            mask,
            out_val=out_shape,
        )

    total = count(output_mask)
    if output_mask[1] and groups > 1:
        weight_only = count([False, True, False])
        total -= weight_only - weight_only // groups
    return total


def count_flops(model: nn.Module, batch, precision) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    aten = torch.ops.aten
    with FlopCounterMode(
        display=False, custom_mapping={aten.convolution_backward: _conv_backward_flop}
    ) as counter:
        with precision.autocast(torch.device("cpu")):
            loss = model(*batch)
        loss.backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def matmul_peak(dtype: torch.dtype, size: int = 2048, repeats: int = 5) -> float:
    """Best GFLOP/s of a ``size``-cubed matmul in ``dtype`` on this CPU."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size ** 3 / best / 1e9


def make_batch(cfg, utterances: int, seconds: float, tokens: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    frames = int(seconds * 100)
    feats = torch.randn(utterances, frames, cfg.n_mels, generator=g)
    lens = torch.full((utterances,), frames, dtype=torch.long)
    token_ids = torch.randint(3, cfg.vocab_size, (utterances, tokens), generator=g)
    return feats, lens, token_ids, torch.full((utterances,), tokens, dtype=torch.long)


def step(model, optimizer, batch, precision) -> float:
    start = time.perf_counter()
    with precision.autocast(torch.device("cpu")):
        loss = model(*batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def run_preset(preset: str, args, peaks: dict[str, float]) -> list[dict]:
    cfg = model_config_from_preset(
        preset,
        vocab_size=args.vocab,
        conv_kernel=args.conv_kernel,
        subsampling=args.subsampling,
        subsampling_channels=args.subsampling_channels,
    )
    batch = make_batch(cfg, args.utterances, args.seconds, args.tokens)
    audio_seconds = args.utterances * args.seconds
    precisions = {"fp32": resolve_precision(torch.device("cpu"), False, "fp32")}
    picked = resolve_precision(torch.device("cpu"), True)
    if picked.dtype is not None:
        precisions[precision_name(picked)] = picked
    rows = []
    for pname, precision in precisions.items():
        built = {}
        for name, cls in args.models.items():
            torch.manual_seed(0)
            model = cls(cfg).train()
            # Ours with the trainer's optimizer (fused AdamW); the peer with torch's default AdamW.
            optimizer = (
                torch.optim.AdamW(model.parameters(), lr=1e-4)
                if name == "torchaudio"
                else build_optimizer("adamw", model.parameters(), torch.device("cpu"), 1e-4, 0.01)[
                    0
                ]
            )
            flops = count_flops(model, batch, precision)
            for _ in range(args.warmup):
                step(model, optimizer, batch, precision)
            built[name] = (model, optimizer, flops)
        times = {name: [] for name in built}
        for _ in range(args.rounds):
            for name, (model, optimizer, _) in built.items():
                times[name].append(step(model, optimizer, batch, precision))
        peak = peaks["bf16" if pname == "bf16" else "fp32"]
        for name, (model, _, flops) in built.items():
            median = statistics.median(times[name])
            row = {
                "preset": preset,
                "precision": pname,
                "model": name,
                "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 2),
                "step_s": round(median, 4),
                "audio_s_per_s": round(audio_seconds / median, 1),
                "gflop_per_step": round(flops / 1e9, 1),
                "gflop_s": round(flops / median / 1e9, 1),
                "utilization": round(flops / median / 1e9 / peak, 3),
            }
            # The median of the per-round ratios, not the ratio of medians.
            if name.startswith("ours"):
                row["speedup_vs_torchaudio"] = _speedup(times["torchaudio"], times[name])
            if name.startswith("ours full") and "WeNet" in times:
                row["speedup_vs_wenet"] = _speedup(times["WeNet"], times[name])
            if name == "ours pretrain":  # what a step costs against the supervised ones
                row["cost_vs_full"] = _speedup(times[name], times["ours full"])
                row["cost_vs_enc_ctc"] = _speedup(times[name], times["ours enc+CTC"])
            rows.append(row)
    return rows


def _speedup(reference: list[float], ours: list[float]) -> float:
    return round(statistics.median(r / o for r, o in zip(reference, ours)), 2)


def print_table(rows: list[dict], cpu: str, peaks: dict[str, float]) -> None:
    print(f"CPU: {cpu}; {torch.get_num_threads()} threads; matmul peak "
          + ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in peaks.items()))
    header = [
        "preset",
        "precision",
        "model",
        "params_m",
        "step_s",
        "audio_s_per_s",
        "gflop_per_step",
        "gflop_s",
        "utilization",
        "speedup_vs_torchaudio",
        "speedup_vs_wenet",
        "cost_vs_full",
        "cost_vs_enc_ctc",
    ]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(str(row.get(h, "")) for h in header) + " |")


def plot(rows: list[dict], path: Path, names: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["preset"], r["precision"]) for r in rows},
                    key=lambda g: (PRESET_ORDER.index(g[0]) if g[0] in PRESET_ORDER else 9, g[1]))
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        values = [
            next(
                (
                    r["audio_s_per_s"]
                    for r in rows
                    if (r["preset"], r["precision"]) == g and r["model"] == name
                ),
                0,
            )
            for g in groups
        ]
        ax.bar([x + i * width for x in range(len(groups))], values, width, label=name)
    ax.set_xticks([x + width * (len(names) - 1) / 2 for x in range(len(groups))])
    ax.set_xticklabels([f"{p}\n{q}" for p, q in groups])
    ax.set_ylabel("seconds of audio trained per second")
    ax.set_title("training throughput (higher is better)")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--preset", choices=PRESET_ORDER, action="append", help="repeatable; default: all"
    )
    parser.add_argument("--utterances", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--tokens", type=int, default=20)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--conv_kernel", type=int, default=31)
    parser.add_argument("--subsampling", choices=SUBSAMPLING["choices"], default="conv2d",
                        help="our front-end (the peers keep theirs)")
    parser.add_argument(
        "--subsampling_channels",
        type=int,
        default=0,
        help="our conv2d front-end's first convolution width (0: d_model, as the peers')",
    )
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--wenet",
        metavar="PATH",
        help=(
            "also time WeNet's hybrid model, imported from this "
            "WeNet source tree (not shipped with this project)"
        ),
    )
    parser.add_argument(
        "--compile", action="store_true", help="also time ours full through torch.compile"
    )
    parser.add_argument(
        "--pretrain", action="store_true",
        help="also time ours pretraining its encoder (konkanivani-train --pretrain's step)"
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON line instead of the table"
    )
    parser.add_argument("--png", default=str(ROOT / "benchmarks" / "throughput_cpu.png"))
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run(args)
    finally:  # a caller in the same process (the tests) keeps its own thread count
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace) -> int:
    if args.wenet:
        sys.path.insert(0, args.wenet)
    args.models = {**MODELS, **({"WeNet": WenetFull} if args.wenet else {}),
                   **({"ours full, compiled": OursFullCompiled} if args.compile else {}),
                   **({"ours pretrain": OursPretrain} if args.pretrain else {})}
    cpu = cpu_description()
    peaks = {"fp32": matmul_peak(torch.float32)}
    if resolve_precision(torch.device("cpu"), True).dtype is torch.bfloat16:
        peaks["bf16"] = matmul_peak(torch.bfloat16)
    rows = [
        row for preset in args.preset or PRESET_ORDER for row in run_preset(preset, args, peaks)
    ]
    if args.json:
        speedups = {
            key: {f"{r['preset']}/{r['precision']}/{r['model']}": r[key] for r in rows if key in r}
            for key in ("speedup_vs_torchaudio", "speedup_vs_wenet", "cost_vs_full",
                        "cost_vs_enc_ctc")
        }
        print(
            json.dumps(
                {
                    "cpu": cpu,
                    "threads": args.threads,
                    "matmul_peak_gflop_s": peaks,
                    **speedups,
                    "rows": rows,
                }
            )
        )
    else:
        print_table(rows, cpu, peaks)
        if args.png:
            plot(rows, Path(args.png), list(args.models))
            print(f"plot: {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
