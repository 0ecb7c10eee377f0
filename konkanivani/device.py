"""Which device a ``--device`` flag names: training, the LM trainer, decoding and the server all
resolve it here, so ``auto`` means the same everywhere and a device this machine lacks is one line.
"""

from __future__ import annotations

import torch

from .config import ConfigError

__all__ = ["DeviceError", "resolve_device"]


class DeviceError(ConfigError, RuntimeError):
    """A ``--device`` this machine does not have. A ``ConfigError`` (the training CLI's "bad flag
    value", exit 2) and a ``RuntimeError`` (what the decoding CLIs catch), so every tool that
    resolves ``--device`` here says it in one line."""


def resolve_device(name: str) -> torch.device:
    """``auto`` (CUDA where there is one, else the CPU), ``cpu``, ``cuda``, ``cuda:N`` or ``mps``;
    ``DeviceError`` for one this machine lacks, or a name torch does not know."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise DeviceError(
            f"--device {name}: not a device name (auto, cpu, cuda, cuda:N or mps)"
        ) from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError(
            f"--device {name}: CUDA is not available on this machine (use --device cpu)"
        )
    if (
        device.type == "cuda"
        and device.index is not None
        and device.index >= torch.cuda.device_count()
    ):
        count = torch.cuda.device_count()
        first_last = f" to cuda:{count - 1}" if count > 1 else ""
        raise DeviceError(f"--device {name}: this machine has {count} CUDA "
                          f"device{'s' if count != 1 else ''} (cuda:0{first_last})")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise DeviceError(f"--device {name}: MPS (Apple silicon) is not available on this machine "
                          "(use --device cpu)")
    return device
