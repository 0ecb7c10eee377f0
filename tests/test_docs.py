"""The documentation: docs/flags.md, and the limits table of docs/serving.md, are what
docs/generate_flags.py writes from the dataclasses, the README stays short, every relative link
(and heading anchor) in the README, docs/ and the benchmark results' READMEs points to something
that exists, and so does every dotted name there and in konkanivani/'s docstrings and comments
(``decoding.search.method_for``; the rule is written above its tests)."""
from __future__ import annotations

import ast
import functools
import importlib.util
import io
import re
import tokenize
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


# ---- dotted names ------------------------------------------------------------------------------
#
# A dotted name is the whole of a code span, `...` in a page's prose (not in a fenced block) or
# ``...`` / `...` in a docstring of konkanivani/, made of identifiers joined by dots and maybe
# followed by a call's parentheses: `decode.method_for`, ``Recognizer.from_checkpoint(...)``.
# - One whose last part is a file extension names a file: `name.py` must be a file of the
#   repository by that name (`run.py` is not); `latest.pt`, `metrics.jsonl` are not checked.
# - Any other must resolve in the package: its first part is `konkanivani`, a module of it named by
#   its trailing parts (`search`, `decoding.search`, `model.lm`), or a class, function or constant
#   a module defines at its top level (`Recognizer`); each part after a module is its top-level name
#   or submodule, each part after a class its method, field, class attribute or `self.` attribute
#   (or one of its base classes', the package's own or an imported one's). Past a function, a
#   constant or an attribute of a class the rest is not checked: its type is not known here.
# - A name made outside the package starts with a root of OUTSIDE (a library's module, a variable
#   the text names) and is not checked. A first part that is none of these fails: a module that
#   was renamed (`decode.method_for`) does not pass as someone else's name.
# - Outside code spans (a page's prose, a docstring's, a comment in konkanivani/) a dotted word is
#   checked only where its first part is `konkanivani` or a module of it (config.LONG_INPUT_SECONDS
#   in a comment): elsewhere such a word is too often a file, an abbreviation or a variable.
#   Doctest lines are code, and not read.

PACKAGE = ROOT / "konkanivani"
FILE_EXTENSIONS = {
    "bin", "cfg", "css", "csv", "db", "flac", "gz", "html", "ini", "ipynb", "jpg", "js", "json",
    "jsonl", "lock", "log", "md", "model", "mp3", "npz", "ogg", "onnx", "opus", "png", "pt", "py",
    "scp", "sh", "srt", "svg", "tar", "toml", "tsv", "txt", "vocab", "vtt", "wav", "webm", "yaml",
    "yml", "zip",
}
OUTSIDE = {
    # libraries
    "dataclasses", "nn", "np", "onnxruntime", "sys", "torch", "torchaudio", "uvicorn",
    "webdataset",
    # variables the text names, and a domain
    "args", "ask", "evil", "optimizer", "parser", "rec", "run", "self", "stream",
}
_DOTTED = re.compile(r"([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(.*\))?")
_SPAN = re.compile(r"``([^`]+?)``|(?<!`)`([^`\n]+)`(?!`)")
_WORD = re.compile(r"(?<![\w./`-])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?![\w/`-])")


def _names(text: str) -> set[str]:
    """The dotted names of ``text`` (prose, a docstring or a comment): each code span that is one,
    and outside them each dotted word that starts with the package or one of its modules."""
    spans = [a or b for a, b in _SPAN.findall(text)]
    names = {m.group(1) for s in spans if (m := _DOTTED.fullmatch(s.strip()))}
    words = _WORD.findall(_SPAN.sub(" ", text))
    return names | {w for w in words if w.split(".")[0] in _package().roots}


def _names_in_page(page: Path) -> set[str]:
    prose = _prose(page.read_text(encoding="utf-8"))
    return _names(re.sub(r"\]\([^)]*\)", "]", prose))  # a link's target is checked above


def _names_in_module(path: Path) -> set[str]:
    """The dotted names of the docstrings (but their doctest lines) and comments of ``path``."""
    source = path.read_text(encoding="utf-8")
    texts = [t.string for t in tokenize.generate_tokens(io.StringIO(source).readline)
             if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False) or ""
            texts.append(re.sub(r"^\s*(>>>|\.\.\.) .*$", "", doc, flags=re.M))
    return {n for text in texts for n in _names(text)}


class _Package:
    """konkanivani's modules, classes and their names, read from the source (nothing imported but
    the library base classes an attribute may come from)."""

    def __init__(self):
        self.modules: dict[str, ast.Module] = {}
        for path in sorted(PACKAGE.rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            self.modules[name] = ast.parse(path.read_text(encoding="utf-8"))
        self.classes: dict[str, list[tuple[str, ast.ClassDef]]] = {}
        self.defined: dict[str, set[str]] = {}  # a top-level name -> the modules defining it
        for module, tree in self.modules.items():
            for node in self._top_level(tree):
                if isinstance(node, ast.ClassDef):
                    self.classes.setdefault(node.name, []).append((module, node))
                for name in self._bound(node, imports=False):
                    self.defined.setdefault(name, set()).add(module)
        self.files = {p.name for p in ROOT.rglob("*.py") if ".git" not in p.parts}
        self.roots = {"konkanivani", *(m.rsplit(".", 1)[-1] for m in self.modules)}

    @staticmethod
    def _top_level(tree: ast.Module):
        stack = list(tree.body)
        while stack:
            node = stack.pop()
            if isinstance(node, (ast.If, ast.Try, ast.With)):
                stack += node.body + getattr(node, "orelse", []) + getattr(node, "finalbody", [])
                stack += [s for h in getattr(node, "handlers", []) for s in h.body]
            else:
                yield node

    @staticmethod
    def _bound(node: ast.AST, imports: bool = True) -> set[str]:
        """The names a top-level statement (or a class body's) binds."""
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return {node.name}
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        if imports and isinstance(node, (ast.Import, ast.ImportFrom)):
            return {(a.asname or a.name).split(".")[0] for a in node.names}
        return set()

    def module_names(self, module: str) -> set[str] | None:
        """The names module ``module`` has: its top-level ones and its submodules; None when it
        makes names on demand (a module ``__getattr__``)."""
        tree = self.modules[module]
        names = {n for node in self._top_level(tree) for n in self._bound(node)}
        if "__getattr__" in names:
            return None
        return names | {m[len(module) + 1:].split(".")[0] for m in self.modules
                        if m.startswith(module + ".")}

    def class_has(self, module: str, node: ast.ClassDef, attr: str, seen=()) -> bool:
        own = {n for s in node.body for n in self._bound(s)}
        for f in ast.walk(node):
            if isinstance(f, ast.Attribute) and isinstance(f.ctx, ast.Store) and \
                    isinstance(f.value, ast.Name) and f.value.id in ("self", "cls"):
                own.add(f.attr)
        if attr in own:
            return True
        for base in node.bases:
            text = ast.unparse(base).split("[")[0]
            if text in self.classes and text not in seen:
                if any(self.class_has(m, c, attr, (*seen, text)) for m, c in self.classes[text]):
                    return True
            elif text not in ("object", "NamedTuple", "Generic", "Protocol"):
                if self._library_has(module, text, attr):
                    return True
        return False

    def _library_has(self, module: str, base: str, attr: str) -> bool:
        """Whether the library class ``base`` (as module ``module`` spells it) has ``attr``; True
        where it cannot be imported here."""
        import importlib

        head, *rest = base.split(".")
        for node in self._top_level(self.modules[module]):
            for alias in getattr(node, "names", []) if isinstance(
                    node, (ast.Import, ast.ImportFrom)) else []:
                if (alias.asname or alias.name).split(".")[0] != head:
                    continue
                try:
                    if isinstance(node, ast.ImportFrom):
                        obj = getattr(importlib.import_module(node.module), alias.name)
                    else:
                        obj = importlib.import_module(alias.name.split(".")[0])
                    for part in rest:
                        obj = getattr(obj, part)
                except (ImportError, AttributeError):
                    return True
                return hasattr(obj, attr)
        return True

    def in_class(self, name: str, rest: list[str]) -> bool:
        """Whether ``rest`` names an attribute of a class ``name`` of the package (the first
        part checked; what it holds is not known)."""
        return not rest or any(self.class_has(m, c, rest[0]) for m, c in self.classes[name])

    def in_module(self, module: str, rest: list[str]) -> bool:
        if not rest:
            return True
        names = self.module_names(module)
        if names is None:
            return True
        head, *tail = rest
        if head not in names:
            return False
        if f"{module}.{head}" in self.modules:
            return self.in_module(f"{module}.{head}", tail)
        return self.in_class(head, tail) if head in self.classes else True

    def stale(self, name: str) -> str | None:
        """Why dotted ``name`` names nothing; None where it resolves (or is not checked)."""
        parts = name.split(".")
        if parts[-1] in FILE_EXTENSIONS:
            if parts[-1] == "py" and name.rsplit("/", 1)[-1] not in self.files:
                return "no such file"
            return None
        for k in range(len(parts), 0, -1):
            tail = ".".join(parts[:k])
            matches = [m for m in self.modules if m == tail or m.endswith("." + tail)]
            if matches:
                if any(self.in_module(m, parts[k:]) for m in matches):
                    return None
                return f"{parts[k]} is not a name of {' or '.join(matches)}"
        if parts[0] in self.defined:
            if parts[0] in self.classes and not self.in_class(parts[0], parts[1:]):
                return f"class {parts[0]} has no {parts[1]}"
            return None
        if parts[0] in OUTSIDE:
            return None
        return f"{parts[0]} is no module, class, function or constant of konkanivani"


@functools.cache
def _package() -> _Package:
    return _Package()


def _stale(names: set[str]) -> list[str]:
    return sorted(f"{n} ({why})" for n in names if (why := _package().stale(n)))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_dotted_name_in_a_page_exists(page):
    assert not (stale := _stale(_names_in_page(page))), \
        f"{page.relative_to(ROOT)} names what is not there: " + "; ".join(stale)


@pytest.mark.parametrize("module", sorted(PACKAGE.rglob("*.py")),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_every_dotted_name_in_a_docstring_or_comment_exists(module):
    assert not (stale := _stale(_names_in_module(module))), \
        f"{module.relative_to(ROOT)} names what is not there: " + "; ".join(stale)


def test_the_dotted_name_check_tells_a_stale_name_from_a_real_one():
    package = _package()
    for real in ("decoding.search.method_for", "search.LONG_INPUT_METHOD", "Recognizer.transcribe",
                 "konkanivani.decoding.alignment.Word", "ConformerEncoder.forward_chunk",
                 "config.DEFAULT_MAX_DURATION", "torch.compile", "latest.pt", "checkpoint.py",
                 "ASRModel.load_state_dict", "Word.probability", "features.LogMel.batch"):
        assert package.stale(real) is None, real
    for stale in ("decode.method_for", "decoding.exported", "config.LONG_INPUT_SECONDS",
                  "run.py", "Recognizer.no_such_method", "features.LogMel.no_such_method"):
        assert package.stale(stale), stale
