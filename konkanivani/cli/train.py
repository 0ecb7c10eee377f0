"""Train a konkanivani Conformer CTC/attention model (``konkanivani-train``).

Every field of ``TrainConfig`` is a flag; model dimensions (``--d_model``, ``--encoder_layers``,
...) override the chosen ``--preset``. Example, the T4 recipe's model, batches and precision on the
demo corpus::

    konkanivani-train --train_manifest data/demo/train.jsonl \\
        --valid_manifest data/demo/valid.jsonl --preset medium --batch_size 2 \\
        --gradient_accumulation_steps 4 --mixed_precision --output_dir checkpoints/t4

or the whole recipe from its YAML file (character tokens, ``seed: 1234`` and the rest; without a
recipe ``--seed`` is 0), with any flag overriding the file::

    konkanivani-train --config configs/t4.yaml --output_dir checkpoints/t4

Under ``torchrun --nproc_per_node N`` it trains data-parallel (see docs/training.md, "Several GPUs
or CPU processes: torchrun").

Exit status: 0 when training finished or stopped at --max_time (both leave a checkpoint to resume
from), 130 / 143 when SIGINT / SIGTERM stopped it after saving (128 + the signal, as a shell
reports a process ended by that signal, so a wrapper can tell "interrupted" from "done"), 2 for
a bad flag value or an unusable manifest, checkpoint or output directory, 3 when too many updates
in a row had a non-finite loss.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shlex
import sys
from pathlib import Path

from ..checkpoint import CheckpointError
from ..config import (
    ConfigError,
    ModelConfig,
    TrainConfig,
    add_dataclass_args,
    dataclass_from_args,
)
from ..config_file import load_config_file
from ..data.manifest import ManifestError
from ..training.loop import train
from ..training.signals import Stop, TrainingDiverged
from . import Parser, fail, setup_logging, tool

CONFIG_HELP = (
    "YAML recipe (sections model, init, data, training; see configs/): its values become "
    "the defaults, flags given here override them"
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags; with ``--config FILE`` the file's values are their defaults (so the manifests
    may come from it), and flags on the command line override them. ``ConfigError`` for a bad file.
    """
    parser = Parser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", metavar="FILE", help=CONFIG_HELP)
    add_dataclass_args(parser.add_argument_group("training"), TrainConfig)
    add_dataclass_args(
        parser.add_argument_group("model (overrides the preset)"), ModelConfig, defaults=False
    )
    # --config alone first: its file sets the defaults of the others
    config = Parser(add_help=False)
    config.add_argument("--config")
    path = config.parse_known_args(argv)[0].config
    if path:
        values = load_config_file(path)
        for action in parser._actions:
            if action.dest in values:
                action.default, action.required = values[action.dest], False
    args = parser.parse_args(argv)
    # one of the two (argparse cannot say "or")
    if not args.train_manifest and not args.train_shards and not args.train_mix:
        parser.error("the following arguments are required: --train_manifest (or --train_shards, "
                     "or --train_mix)")
    return args


def model_flags(args: argparse.Namespace) -> dict:
    """The model flags given on the command line (None: not given), for ``train`` to resolve over
    the preset's dimensions or a checkpoint's."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(ModelConfig)
            if not f.metadata.get("from_tokenizer")}


def resume_command(argv: list[str]) -> str:
    """The command line that continues this run: the same flags, with ``--resume latest``."""
    kept, skip_next = [], False
    for arg in argv:
        if skip_next:
            skip_next = False
        elif arg == "--resume":
            skip_next = True
        elif not arg.startswith("--resume=") and arg != "--overwrite":
            kept.append(arg)
    program = sys.argv[0]
    command = ["python3", program] if program.endswith(".py") else [Path(program).name]
    return shlex.join([*command, *kept, "--resume", "latest"])


@tool
def main(argv: list[str] | None = None) -> int:
    setup_logging()
    log = logging.getLogger("konkanivani")
    try:
        args = parse_args(argv)
    except ConfigError as e:  # a --config file that cannot be used
        return fail(str(e))
    cfg = dataclass_from_args(TrainConfig, args)
    argv = sys.argv[1:] if argv is None else argv
    try:
        summary = train(cfg, model_flags(args))
    except (ConfigError, ManifestError, CheckpointError) as e:
        return fail(str(e))
    except TrainingDiverged as e:
        log.error("%s", e)
        return 3
    except KeyboardInterrupt:
        log.error(
            "interrupted at once by a second Ctrl-C; the last complete checkpoint is %s/latest.pt; "
            "resume with: %s",
            cfg.output_dir,
            resume_command(argv),
        )
        return Stop.SIGINT.exit_code
    # torchrun: rank 0 reports
    report = print if os.environ.get("RANK", "0") == "0" else (lambda *a, **k: None)
    if (stop := summary["stop"]).early:
        report(
            f"stopped by {summary['stopped_by']} at step {summary['step']}; checkpoints in"
            f" {cfg.output_dir}; resume with:\n  {resume_command(argv)}"
        )
        return stop.exit_code
    valid = summary["valid"]
    if valid and "wer" not in valid:  # pretraining
        report(f"done: step {summary['step']}, epoch {summary['epoch']}, valid masked loss "
               f"{valid['masked']:.3f} nats a masked frame (best {summary['best_wer']:.3f}); "
               f"checkpoints in {cfg.output_dir}; fine-tune with --init_from")
    elif valid:
        report(
            f"done: step {summary['step']}, epoch {summary['epoch']}, valid CER"
            f" {100 * valid['cer']:.2f}% WER {100 * valid['wer']:.2f}% (best WER"
            f" {100 * summary['best_wer']:.2f}%); checkpoints in {cfg.output_dir}"
        )
    else:
        report(f"done: step {summary['step']}; checkpoints in {cfg.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
