"""The documentation: docs/flags.md, and the limits table of docs/serving.md, are what
docs/generate_flags.py writes from the dataclasses, the README stays short, and every relative link
(and heading anchor) in the README, docs/ and the
benchmark results' READMEs points to something that exists."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 250
PAGES = sorted(
    [
        ROOT / "README.md",
        *(ROOT / "docs").glob("*.md"),
        *(ROOT / "benchmarks" / "results").glob("*/README.md"),
    ]
)


def _generator():
    spec = importlib.util.spec_from_file_location(
        "generate_flags", ROOT / "docs" / "generate_flags.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_flags_page_and_the_limits_table_are_what_the_generator_writes(capsys):
    assert _generator().main(["--check"]) == 0, capsys.readouterr().err


def test_the_generator_check_fails_on_a_stale_page_and_rewriting_fixes_it(tmp_path, capsys):
    generator, page = _generator(), tmp_path / "flags.md"
    page.write_text("# Flags\n\n| `--lr` | 0.001 |\n", encoding="utf-8")
    assert generator.main(["--check", "--output", str(page)]) == 1
    assert "stale: run python docs/generate_flags.py" in capsys.readouterr().err
    assert generator.main(["--output", str(page)]) == 0
    assert generator.main(["--check", "--output", str(page)]) == 0


def test_a_stale_limits_table_is_caught_and_rewritten_from_the_limits(tmp_path, capsys):
    import dataclasses

    from konkanivani.serving.limits import Limits

    generator, flags, page = _generator(), tmp_path / "flags.md", tmp_path / "serving.md"
    flags.write_text((ROOT / "docs" / "flags.md").read_text(encoding="utf-8"), encoding="utf-8")
    text = (ROOT / "docs" / "serving.md").read_text(encoding="utf-8")
    assert "| `--max_streams` | 8 |" in text
    page.write_text(
        text.replace("| `--max_streams` | 8 |", "| `--max_streams` | 9 |"), encoding="utf-8"
    )
    pages = ["--output", str(flags), "--serving", str(page)]
    assert generator.main(["--check", *pages]) == 1
    assert f"{page} is stale: run python docs/generate_flags.py" in capsys.readouterr().err
    assert generator.main(pages) == 0 and page.read_text(encoding="utf-8") == text
    for f in dataclasses.fields(Limits):  # the default and the help konkanivani-serve shows
        assert f"| `--{f.name}` | {f.default:g} | {f.metadata['help']} |" in text, f.name


def test_the_flags_page_has_every_field_of_the_configs():
    import dataclasses

    from konkanivani.config import PRESETS, ModelConfig, TrainConfig
    from konkanivani.decoding.settings import DecodingConfig, flag_name

    text = (ROOT / "docs" / "flags.md").read_text(encoding="utf-8")
    for f in dataclasses.fields(TrainConfig):
        assert f"| `--{f.name}`" in text, f.name
    for f in dataclasses.fields(ModelConfig):
        if f.name != "vocab_size":
            assert f"| `--{f.name}`" in text, f.name
    for preset in PRESETS:
        assert f"| `{preset}` |" in text, preset
    decoding = text.split("## Decoding: `DecodingConfig`\n")[1]
    for f in dataclasses.fields(DecodingConfig):
        assert f"| `{flag_name(f.name)}`" in decoding and f.metadata["help"] in decoding, f.name


def test_the_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move the detail to docs/"


def _prose(text: str) -> str:
    """``text`` without its fenced code blocks (a ``# comment`` there is no heading, a link no
    link)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _anchors(path: Path) -> set[str]:
    """The heading anchors GitHub makes for ``path``: lower case, punctuation dropped, spaces to
    dashes,
    a repeated one numbered."""
    seen: dict[str, int] = {}
    anchors = set()
    for heading in re.findall(
        r"^#{1,6}\s+(.+?)\s*#*\s*$", _prose(path.read_text(encoding="utf-8")), re.M
    ):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _links(path: Path) -> list[str]:
    return re.findall(
        r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", _prose(path.read_text(encoding="utf-8"))
    )


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_to_an_existing_file(page):
    broken = []
    for link in _links(page):
        if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", link):  # https:, mailto:
            continue
        target, _, anchor = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        if not path.exists():
            broken.append(f"{link}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(f"{link}: no heading #{anchor} in {path.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_module_path_named_exists(page):
    named = set(re.findall(r"\bkonkanivani/[\w/]+\.py\b", page.read_text(encoding="utf-8")))
    missing = sorted(p for p in named if not (ROOT / p).is_file())
    assert (
        not missing
    ), f"{page.relative_to(ROOT)} names modules that are not there: {', '.join(missing)}"


def test_no_suite_size_or_time_is_written_down():
    """A count of tests or a suite's run time is stale the day after it is written."""
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        assert not re.search(r"\b\d[\d,]* tests (in|pass|passed|run)\b", text), page.relative_to(
            ROOT
        )
