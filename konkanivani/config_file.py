"""YAML recipes: the flags of a training run in a file, and the resolved config a run writes.

A file has up to four sections; every key is a field of ``TrainConfig`` or ``ModelConfig``, in
the section ``SECTION_OF`` gives it::

    model:                      # the model: --preset, and ModelConfig fields over its dimensions
      preset: small
      dropout: 0.1
    init:                       # a fresh run from another run's weights: --init_from, its options
      init_from: checkpoints/big/best.pt
    data:                       # manifests, tokenizer, which utterances and how they are batched
      train_manifest: data/demo/train.jsonl
      batch_size: 16
    training:                   # the rest of TrainConfig
      lr: 2.0e-3

``konkanivani-train --config FILE`` takes the file's values as its defaults, and flags given on
the command line override them. An unknown key, a key in another section than its own and a value
of the wrong type stop the run before any work, in one line naming the file and the key (with the
nearest valid key). Paths are read as on the command line: relative to the working directory.

At the start of every run (and again on ``--resume``) the values it uses are written to
``OUTPUT_DIR/config.yaml`` in the same form, so ``--config OUTPUT_DIR/config.yaml`` runs it again.
A file of the layout before ``init:`` (``init_from``, ``init_modules`` and ``keep_init_cmvn``
under ``model:``, as every config.yaml a run wrote then) still loads, with a note.
"""
from __future__ import annotations

import dataclasses
import difflib
import logging
from pathlib import Path
from typing import Any, get_type_hints

import yaml

from .checkpoint import write_file_atomic
from .config import ConfigError, ModelConfig, TrainConfig, flag_fields

__all__ = ["SECTIONS", "SWEEP_SECTION", "load_sweep_section", "SECTION_OF", "load_config_file",
           "resolved_config", "write_config_file"]

log = logging.getLogger("konkanivani")

SECTIONS = ("model", "init", "data", "training")
# konkanivani-sweep's grid (and options) in a recipe; the trainer ignores it
SWEEP_SECTION = "sweep"

# The section of every key, from the fields' own metadata (config.flag_help): the model section
# holds --preset and the ModelConfig fields (but vocab_size, which the tokenizer decides; the
# data section's vocab_size is the size of one trained), the init section --init_from and its
# options, the data section the fields marked "data" (augmentation included), the training section
# every other TrainConfig field.
SECTION_OF: dict[str, str] = {
    **{f.name: f.metadata.get("section", "training") for f in flag_fields(TrainConfig)},
    **{
        f.name: "model"
        for f in dataclasses.fields(ModelConfig)
        if not f.metadata.get("from_tokenizer")
    },
}

# Keys an earlier layout filed in another section: still read there, with a note.
_OLD_SECTION = {"init_from": "model", "init_modules": "model", "keep_init_cmvn": "model"}

# How this command started, not what the run is: a config.yaml with them would resume, or move
# the run aside, when it is meant to run the same recipe again.
_NOT_WRITTEN = ("resume", "overwrite")

# Names other toolkits give our fields, so that a near miss of one still finds ours.
_ALIASES = {"learning_rate": "lr", "num_epochs": "epochs", "max_epoch": "epochs",
            "accum_grad": "gradient_accumulation_steps", "max_frames_in_batch": "max_batch_frames"}

# TrainConfig's vocab_size
_TYPES: dict[str, type] = {**get_type_hints(ModelConfig), **get_type_hints(TrainConfig)}


def load_config_file(path: str | Path) -> dict[str, Any]:
    """The values of a YAML recipe, as ``{field: value}`` of the right types; ``ConfigError``
    naming the file and the key for anything else."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: file not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--config {path}: cannot read it ({e})") from e
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(
            f"{path}: not valid YAML ({getattr(e, 'problem', None) or 'unreadable'}{where})"
        ) from e
    if document is None:
        return {}
    if not isinstance(document, dict):
        raise ConfigError(f"{path}: a config is a mapping of the sections {', '.join(SECTIONS)}")
    values: dict[str, Any] = {}
    moved: list[str] = []
    for section, entries in document.items():
        # konkanivani-sweep's (load_sweep_section); every trial runs the rest
        if section == SWEEP_SECTION:
            continue
        if section not in SECTIONS:
            raise ConfigError(_unknown_section(path, section))
        if entries is None:  # a section left empty
            continue
        if not isinstance(entries, dict):
            raise ConfigError(
                f"{path}: section {section} must be a mapping of keys to values, got {entries!r}"
            )
        for key, value in entries.items():
            values[key] = _checked(path, section, key, value)
            if _OLD_SECTION.get(key) == section:
                moved.append(f"{section}.{key}")
    if moved:
        log.info(
            "%s: note: %s now belong%s in the %s section; the file loads as it is",
            path,
            ", ".join(moved),
            "" if len(moved) > 1 else "s",
            SECTION_OF[moved[0].split(".")[1]],
        )
    return values


def load_sweep_section(path: str | Path) -> dict[str, Any]:
    """The ``sweep:`` section of a recipe: ``grid`` (flag -> list of values) or ``search`` (flag ->
    {kind: values}, ``experiments.optuna_search``) and the sweep's own options (``target_cer``,
    ``gpu_gb``); {}
    without one. ``ConfigError`` naming the file otherwise."""
    path = Path(path)
    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"--config {path}: cannot read it ({type(e).__name__})") from e
    section = document.get(SWEEP_SECTION) if isinstance(document, dict) else None
    if section is None:
        return {}
    grid = section.get("grid", {}) if isinstance(section, dict) else None
    if not isinstance(grid, dict) or not all(isinstance(v, list) for v in grid.values()):
        raise ConfigError(f"{path}: sweep: holds grid:, a mapping of flags to lists of values")
    unknown = set(section) - {"grid", "search", "target_cer", "gpu_gb"}
    if unknown:
        raise ConfigError(
            f"{path}: sweep: {sorted(unknown)[0]} is not a sweep option (grid, search, target_cer, "
            "gpu_gb)"
        )
    return section


def _unknown_section(path: Path, section: Any) -> str:
    if section in SECTION_OF:
        return f"{path}: key {section} outside a section (it belongs in {SECTION_OF[section]}:)"
    near = difflib.get_close_matches(str(section), SECTIONS, n=1)
    hint = f"did you mean {near[0]}?" if near else f"the sections are {', '.join(SECTIONS)}"
    return f"{path}: unknown section {section} ({hint})"


def _checked(path: Path, section: str, key: Any, value: Any) -> Any:
    """``value`` as the field ``key`` of ``section`` takes it; ``ConfigError`` otherwise."""
    right = SECTION_OF.get(key) if isinstance(key, str) else None
    if right is None:
        raise ConfigError(f"{path}: unknown key {section}.{key}{_suggestion(str(key), section)}")
    if right != section and _OLD_SECTION.get(key) != section:
        raise ConfigError(f"{path}: {section}.{key} belongs in the {right} section ({right}.{key})")
    tp, where = _TYPES[key], f"{path}: {section}.{key}"
    if value is None:
        raise ConfigError(f"{where} has no value (leave the key out for its default)")
    if (tp is bool and isinstance(value, bool)) or (tp is str and isinstance(value, str)):
        return value
    if tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if tp is float and not isinstance(value, bool):
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):  # YAML reads 2e-3 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    wanted = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[tp]
    raise ConfigError(f"{where} must be {wanted}, got {value!r}")


def _suggestion(key: str, section: str) -> str:
    """`` (did you mean lr?)``: the nearest key, qualified where it lives in another section."""
    near = difflib.get_close_matches(key, [*SECTION_OF, *_ALIASES], n=1)
    if not near:
        return " (not a field of TrainConfig or ModelConfig: konkanivani-train --help lists them)"
    name = _ALIASES.get(near[0], near[0])
    return (
        f" (did you mean {name if SECTION_OF[name] == section else f'{SECTION_OF[name]}.{name}'}?)"
    )


def resolved_config(cfg: TrainConfig, model_cfg: ModelConfig) -> dict[str, dict[str, Any]]:
    """Every value a run uses, in the sections of a config file, in the order of the dataclasses."""
    values = {
        **dataclasses.asdict(cfg),
        **dataclasses.asdict(model_cfg),
        "vocab_size": cfg.vocab_size,
    }
    sections: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
    for name, section in SECTION_OF.items():
        if name not in _NOT_WRITTEN:
            sections[section][name] = values[name]
    return sections


def write_config_file(
    path: str | Path, cfg: TrainConfig, model_cfg: ModelConfig, step: int = 0
) -> Path:
    """Write the resolved config of a run to ``path`` (atomically), loadable again with
    ``--config``."""
    header = (
        f"# The config of this run as konkanivani-train resolved it at step {step}, every value it"
        f" uses\n# (model vocabulary: {model_cfg.vocab_size}, from the tokenizer; --resume and"
        " --overwrite are not written).\n# Run it again with: konkanivani-train --config THIS_FILE"
        " --output_dir ANOTHER_DIR\n"
    )
    body = yaml.safe_dump(resolved_config(cfg, model_cfg), sort_keys=False, allow_unicode=True)
    return write_file_atomic(path, (header + body).encode("utf-8"))
