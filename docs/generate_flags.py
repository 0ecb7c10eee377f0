"""Write docs/flags.md from the dataclasses the flags are made of.

    python docs/generate_flags.py           # rewrite docs/flags.md
    python docs/generate_flags.py --check   # exit 1 (and say so) when docs/flags.md is not current

Every field of ``TrainConfig`` and ``ModelConfig`` becomes a ``konkanivani-train`` flag through
``konkanivani.config.add_dataclass_args``; this script builds the flags the same way, as the
trainer's ``parse_args`` does, and reads each one's name, type, default and choices back from the
parser, and its help text from the field's metadata. The presets come from ``PRESETS`` (resolved
with ``model_config_from_preset``), the YAML section of each key from ``config_file.SECTION_OF``,
and the language model's dimensions from ``LMConfig`` (``konkanivani/model/lm.py``) when it is a
dataclass. Nothing is written by hand: add a field, run this, commit both.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import re
import sys
from pathlib import Path
from typing import Any, get_type_hints

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without the package installed
    sys.path.insert(0, str(ROOT))

from konkanivani.config import (  # noqa: E402
    PRESETS,
    ModelConfig,
    TrainConfig,
    _flag_type,
    add_dataclass_args,
    flag_fields,
    model_config_from_preset,
)

FLAGS_MD = ROOT / "docs" / "flags.md"


def _cell(text: Any) -> str:
    """Text for one table cell: no line breaks, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _doc(cls: type) -> str:
    """The class's docstring on one line, its reST ``literals`` as Markdown `code`."""
    return re.sub(r"``(.+?)``", r"`\1`", " ".join((cls.__doc__ or "").split()))


def _flag_rows(cls: type, *, defaults: bool, skip: tuple[str, ...] = ()) -> list[tuple[dataclasses.Field, argparse.Action]]:
    """Each field of ``cls`` with the parser action ``add_dataclass_args`` makes for it."""
    parser = argparse.ArgumentParser(add_help=False)
    add_dataclass_args(parser, cls, defaults=defaults, skip=skip)
    actions = {a.dest: a for a in parser._actions if a.help != argparse.SUPPRESS}  # not an old spelling
    return [(f, actions[f.name]) for f in flag_fields(cls) if f.name in actions]


def _type(action: argparse.Action) -> str:
    if action.nargs == 0:  # a switch: --name / --no_name
        return "bool"
    name = getattr(action.type, "__name__", str(action.type)) if action.type is not None else "str"
    if action.choices:
        return f"{name}: " + ", ".join(f"`{c}`" for c in action.choices)
    return name


def _flag(action: argparse.Action) -> str:
    return " / ".join(f"`{s}`" for s in action.option_strings)


def _sections() -> dict[str, str]:
    try:
        from konkanivani.config_file import SECTION_OF
    except ImportError:  # no YAML recipes in this version
        return {}
    return dict(SECTION_OF)


def _config_help() -> str:
    """``CONFIG_HELP`` of konkanivani/cli/train.py, the help of ``--config`` (the one flag that is no
    field), read from the source: importing the trainer would import the whole training stack."""
    source = ROOT / "konkanivani" / "cli" / "train.py"
    for node in ast.parse(source.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["CONFIG_HELP"]:
            return ast.literal_eval(node.value)
    raise SystemExit(f"{source}: no CONFIG_HELP, the help text of --config")


def _train_table(sections: dict[str, str]) -> list[str]:
    lines = ["| flag | default | type | config file | meaning |", "| --- | --- | --- | --- | --- |",
             f"| `--config` | none | path | — | {_cell(_config_help())} |"]
    for f, action in _flag_rows(TrainConfig, defaults=True):
        default = "required" if action.required else f"`{action.default!r}`"
        lines.append(f"| {_flag(action)} | {default} | {_type(action)} | {sections.get(f.name, '—')} | "
                     f"{_cell(f.metadata.get('help', ''))} |")
    return lines


def _model_table(sections: dict[str, str]) -> list[str]:
    from_preset = {name for values in PRESETS.values() for name in values}
    lines = ["| flag | default | type | config file | meaning |", "| --- | --- | --- | --- | --- |"]
    for f, action in _flag_rows(ModelConfig, defaults=False):  # vocab_size: no flag (config.FROM_TOKENIZER)
        default = "the preset's" if f.name in from_preset else f"`{f.default!r}`"
        lines.append(f"| {_flag(action)} | {default} | {_type(action)} | {sections.get(f.name, '—')} | "
                     f"{_cell(f.metadata.get('help', ''))} |")
    return lines


def _presets_table() -> list[str]:
    resolved = {name: dataclasses.asdict(model_config_from_preset(name)) for name in PRESETS}
    names = [f.name for f in dataclasses.fields(ModelConfig) if not f.metadata.get("from_tokenizer")]
    varying = [n for n in names if len({repr(r[n]) for r in resolved.values()}) > 1]
    same = [n for n in names if n not in varying]
    lines = ["| `--preset` | " + " | ".join(f"`{n}`" for n in varying) + " |",
             "| --- |" + " ---: |" * len(varying)]
    for preset, values in resolved.items():
        lines.append(f"| `{preset}` | " + " | ".join(_cell(values[n]) for n in varying) + " |")
    if same:
        first = next(iter(resolved.values()))
        lines += ["", "Every preset leaves the other model fields at their defaults: "
                  + ", ".join(f"`{n}` = `{first[n]!r}`" for n in same) + "."]
    return lines


def _lm_section() -> list[str]:
    try:
        from konkanivani.model.lm import LMConfig
    except ImportError:
        return []
    if not dataclasses.is_dataclass(LMConfig):
        return []
    hints = get_type_hints(LMConfig)
    lines = ["## konkanivani-train-lm: `LMConfig`", "",
             f"`LMConfig` ([konkanivani/model/lm.py](../konkanivani/model/lm.py)): {_cell(_doc(LMConfig))} "
             "The LM checkpoint stores it; the `konkanivani-train-lm` flags of the same names set it "
             "(`konkanivani-train-lm --help` lists them with the tool's own defaults).", "",
             "| field | default | type | meaning |", "| --- | --- | --- | --- |"]
    for f in dataclasses.fields(LMConfig):
        if f.default is not dataclasses.MISSING:
            default = f"`{f.default!r}`"
        elif f.default_factory is not dataclasses.MISSING:
            default = f"`{f.default_factory()!r}`"
        else:
            default = "—"
        tp = _flag_type(hints[f.name])
        lines.append(f"| `{f.name}` | {default} | {getattr(tp, '__name__', tp)} | {_cell(f.metadata.get('help', '')) or '—'} |")
    return lines


def render() -> str:
    """The text of docs/flags.md for the dataclasses as they are now."""
    sections = _sections()
    lines = ["<!-- Generated by docs/generate_flags.py from konkanivani/config.py: do not edit by hand. "
             "Change the dataclasses, then run `python docs/generate_flags.py`. -->", "",
             "# Flags", "",
             "Every flag of `konkanivani-train` (and of `python training_scripts/train_konkanivani_asr.py`, "
             "the same code) is a field of `TrainConfig` or `ModelConfig` in "
             "[konkanivani/config.py](../konkanivani/config.py). A boolean has a `--no_` form. "
             "*config file* is the section of a `--config` YAML file the key belongs in "
             "([training.md](training.md#recipes-yaml-configs)). A bad value stops the run before any work, "
             "in one line, with exit status 2.", "",
             "## konkanivani-train", "",
             "### Training: `TrainConfig`", "", _cell(_doc(TrainConfig)), "",
             *_train_table(sections), "",
             "### Model: `ModelConfig`", "",
             f"{_cell(_doc(ModelConfig))} Each flag overrides the value of `--preset` (or of the `--init_from` "
             "checkpoint).", "",
             *_model_table(sections), "",
             "## Presets", "",
             "`PRESETS`, as `model_config_from_preset` resolves them:", "",
             *_presets_table(), ""]
    lm = _lm_section()
    if lm:
        lines += [*lm, ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 when the file is not what this script writes")
    p.add_argument("--output", type=Path, default=FLAGS_MD, help="default: docs/flags.md")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        current = args.output.read_text(encoding="utf-8") if args.output.is_file() else ""
        if current == text:
            return 0
        diff = difflib.unified_diff(current.splitlines(), text.splitlines(), str(args.output), "generated", lineterm="")
        print("\n".join(list(diff)[:40]), file=sys.stderr)
        print(f"{args.output} is stale: run python docs/generate_flags.py", file=sys.stderr)
        return 1
    args.output.write_text(text, encoding="utf-8")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
