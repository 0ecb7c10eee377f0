"""konkanivani: a compact Conformer CTC/attention ASR trainer for low-resource languages."""
import importlib

__version__ = "0.1.0"
__all__ = ["PRESETS", "ModelConfig", "TrainConfig", "model_config_from_preset", "ASRModel",
           "Tokenizer", "normalize_text", "train_tokenizer", "__version__"]

# The public names, each imported from its module when first used: importing the package itself
# stays free of torch, so a console script (konkanivani/cli/scripts.py) handles Ctrl-C before
# the seconds torch takes to import.
_PUBLIC = {"PRESETS": "config", "ModelConfig": "config", "TrainConfig": "config",
           "model_config_from_preset": "config", "ASRModel": "model.asr",
           "Tokenizer": "data.tokenizer", "normalize_text": "data.tokenizer",
           "train_tokenizer": "data.tokenizer"}


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_PUBLIC[name]}", __name__), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
