"""Run the training CLI and write down the utterances of every batch each process trains on, for
the torchrun tests of test_shards.py.

    python3 tests/traced_run.py TRACE_DIR -- CLI FLAGS...

Each process appends one JSON line per optimizer step to TRACE_DIR/rank<RANK>.jsonl: the step's
epoch (0-based, as the run counts them) and the set indices of each of its batches.
"""
import json
import os
import sys
from pathlib import Path

from konkanivani.cli import train as cli
from konkanivani.training import loop


def main() -> int:
    trace_dir, sep, *argv = sys.argv[1:]
    assert sep == "--", "usage: traced_run.py TRACE_DIR -- CLI FLAGS"
    path = Path(trace_dir) / f"rank{os.environ.get('RANK', '0')}.jsonl"
    real = loop.train_step

    def traced(run, micro):
        with open(path, "a") as f:
            f.write(
                json.dumps(
                    {
                        "epoch": run.epoch,
                        "step": run.step + 1,
                        "batches": [list(b.indices) + list(b.missing) for b in micro],
                    }
                )
                + "\n"
            )
        return real(run, micro)

    loop.train_step = traced
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
