#!/usr/bin/env python3
"""Train a konkanivani Conformer CTC/attention model.

Every field of ``TrainConfig`` is a flag; model dimensions (``--d_model``, ``--encoder_layers``, ...)
override the chosen ``--preset``. Example, the T4 recipe on the demo corpus::

    python training_scripts/train_konkanivani_asr.py --train_manifest data/demo/train.jsonl \\
        --valid_manifest data/demo/valid.jsonl --preset medium --batch_size 2 \\
        --gradient_accumulation_steps 4 --mixed_precision --output_dir checkpoints/t4
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from konkanivani.checkpoint import CheckpointError  # noqa: E402
from konkanivani.config import ModelConfig, TrainConfig, add_dataclass_args, dataclass_from_args  # noqa: E402
from konkanivani.data import ManifestError  # noqa: E402
from konkanivani.train import train  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_dataclass_args(parser.add_argument_group("training"), TrainConfig)
    add_dataclass_args(parser.add_argument_group("model (overrides the preset)"), ModelConfig, defaults=False,
                       skip=("vocab_size",))
    args = parser.parse_args(argv)
    for name in ("train_manifest", "valid_manifest"):
        if not getattr(args, name):
            parser.error(f"--{name} is required")
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    args = parse_args(argv)
    cfg = dataclass_from_args(TrainConfig, args)
    model_flags = {name: getattr(args, name) for name in ModelConfig.__dataclass_fields__ if name != "vocab_size"}
    try:
        summary = train(cfg, model_flags)
    except (ManifestError, CheckpointError) as e:
        logging.getLogger("konkanivani").error("%s", e)
        return 2
    valid = summary["valid"]
    if valid:
        print(f"done: step {summary['step']}, epoch {summary['epoch']}, valid CER {100 * valid['cer']:.2f}% "
              f"WER {100 * valid['wer']:.2f}% (best WER {100 * summary['best_wer']:.2f}%); "
              f"checkpoints in {cfg.output_dir}")
    else:
        print(f"done: step {summary['step']}; checkpoints in {cfg.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
