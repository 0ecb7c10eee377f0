"""Run the training CLI with one injected fault, for the subprocess tests in test_faults.py.

    python3 tests/fault_run.py FAULT N -- CLI FLAGS...

FAULT is one of
    kill9_at_step   SIGKILL this process inside optimizer step N (before the update)
    kill9_in_save   SIGKILL this process halfway through writing checkpoint number N
    sigterm_at_step send SIGTERM to this process inside optimizer step N
    error_on_rank1_at_step  raise an error in optimizer step N of rank 1 (under torchrun)
The signals are real ones, sent by the process to itself at a known point, so the tests are exact.
"""
import io
import os
import signal
import sys

import torch

from konkanivani.cli import train as cli
from konkanivani.training import loop as train


def _on_call(module, name, n, action):
    """Wrap ``module.name`` so that its ``n``-th call runs ``action(args)`` first."""
    real, calls = getattr(module, name), [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == n:
            action(args)
        return real(*args, **kwargs)

    setattr(module, name, wrapper)


def _half_write_then_die(args):
    state, f = args
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getvalue()
    f.write(data[: len(data) // 2])
    f.flush()
    os.fsync(f.fileno())
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> int:
    fault, n, sep, *argv = sys.argv[1:]
    assert sep == "--", "usage: fault_run.py FAULT N -- CLI FLAGS"
    n = int(n)
    if fault == "kill9_at_step":
        _on_call(train, "optimizer_step", n, lambda _: os.kill(os.getpid(), signal.SIGKILL))
    elif fault == "sigterm_at_step":
        _on_call(train, "optimizer_step", n, lambda _: os.kill(os.getpid(), signal.SIGTERM))
    # under torchrun: one process fails, the others must not hang
    elif fault == "error_on_rank1_at_step":
        def fail(_):
            if os.environ.get("RANK") == "1":
                raise RuntimeError("injected failure of rank 1")
        _on_call(train, "optimizer_step", n, fail)
    elif fault == "kill9_in_save":
        _on_call(torch, "save", n, _half_write_then_die)  # checkpoint.py imports it to save
    else:
        raise SystemExit(f"unknown fault {fault}")
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
