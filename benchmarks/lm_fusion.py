#!/usr/bin/env python3
"""Shallow fusion of a text-only LM: the weight and length bonus chosen on the valid split, then
test WER/CER without and with the LM.

For each method it decodes the valid split with every ``--lm_weights`` x ``--length_bonuses``
pair, keeps the pair with the lowest valid WER (ties: lower CER, then the smaller weight), and
scores the test split with weight 0 / bonus 0 and with the chosen pair. Writes ``sweep.csv`` (every
valid decoding) and ``test.csv`` to ``--out`` and prints the test table.

    python benchmarks/lm_fusion.py checkpoints/run/best.pt checkpoints/lm/best.pt \\
        --valid data/demo/valid.jsonl --test data/demo/test.jsonl --out benchmarks/results/lm_fusion
"""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

from konkanivani.decoding.evaluation import evaluate_manifest
from konkanivani.decoding.recognizer import Recognizer
from konkanivani.decoding.settings import FUSED_METHODS, DecodingConfig
from konkanivani.training.curves import write_csv

ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger("konkanivani")


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("asr_checkpoint", type=Path)
    parser.add_argument("lm_checkpoint", type=Path)
    parser.add_argument(
        "--valid", type=Path, required=True, help="manifest the weights are chosen on"
    )
    parser.add_argument("--test", type=Path, required=True, help="manifest reported")
    parser.add_argument(
        "--methods", default="beam,attention,joint", help=f"any of {', '.join(FUSED_METHODS)}"
    )
    parser.add_argument("--lm_weights", type=_floats, default=_floats("0,0.1,0.2,0.3,0.4,0.5,0.6"))
    parser.add_argument("--length_bonuses", type=_floats, default=_floats("0,0.5,1.0"))
    parser.add_argument("--beam_size", type=int, default=DecodingConfig.beam_size)
    parser.add_argument("--decode_ctc_weight", type=float, default=DecodingConfig.ctc_weight,
                        help="CTC weight of joint and rescore (as konkanivani-evaluate's)")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "lm_fusion")
    args = parser.parse_args(argv)
    methods = args.methods.split(",")
    if unknown := [m for m in methods if m not in FUSED_METHODS]:
        parser.error(f"--methods {','.join(unknown)}: choose from {', '.join(FUSED_METHODS)}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    args.out.mkdir(parents=True, exist_ok=True)
    rec = Recognizer.from_checkpoint(args.asr_checkpoint, args.device, lm=args.lm_checkpoint)

    def score(manifest: Path, method: str, weight: float, bonus: float) -> dict:
        r = evaluate_manifest(rec, manifest, method=method, beam_size=args.beam_size,
                              ctc_weight=args.decode_ctc_weight, batch_size=args.batch_size,
                              lm_weight=weight, length_bonus=bonus)
        row = {
            "method": method,
            "lm_weight": weight,
            "length_bonus": bonus,
            "wer": round(100 * r.wer, 2),
            "cer": round(100 * r.cer, 2),
            "rtf": round(r.rtf, 4),
        }
        log.info("%s %s: %s", manifest.name, method, row)
        return row

    sweep, test = [], []
    for method in methods:
        rows = [
            score(args.valid, method, w, b) for w in args.lm_weights for b in args.length_bonuses
        ]
        sweep += rows
        best = min(rows, key=lambda r: (r["wer"], r["cer"], r["lm_weight"], r["length_bonus"]))
        chosen = (best["lm_weight"], best["length_bonus"])
        test.append(
            {
                **score(args.test, method, 0.0, 0.0),
                "setting": "no LM" + (" (chosen)" if chosen == (0, 0) else ""),
            }
        )
        if chosen != (0, 0):
            test.append({**score(args.test, method, *chosen), "setting": "chosen on valid"})
    write_csv(args.out / "sweep.csv", sweep)
    write_csv(args.out / "test.csv", test)
    print(f"\nTest split {args.test}; LM weight and length bonus chosen on {args.valid} by WER "
          f"(beam {args.beam_size}, CTC weight {args.decode_ctc_weight} in joint/rescore)")
    print("| decoding | setting | LM weight | length bonus | WER % | CER % | RTF |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in test:
        print(
            f"| {r['method']} | {r['setting']} | {r['lm_weight']:g} | {r['length_bonus']:g} |"
            f" {r['wer']} | {r['cer']} | {r['rtf']} |"
        )
    print(f"\nwrote {args.out / 'sweep.csv'}, {args.out / 'test.csv'}")


if __name__ == "__main__":
    main()
