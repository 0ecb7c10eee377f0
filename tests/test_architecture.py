"""The package's shape, as docs/architecture.md draws it: subpackages one level deep, each layer
importing only the layers its row of ``ALLOWED`` names (and its own modules), no cycle between
modules, and no module name in two layers. Every import counts, those inside functions too."""
import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "konkanivani"
# top-level modules every package builds on
BASE = {"config", "config_file", "checkpoint", "device"}

# What each layer may import besides itself: the table of docs/architecture.md, by what each needs.
ALLOWED = {
    "base": set(),
    "data": {"base"},
    "model": {"base", "data"},
    "decoding": {"base", "data", "model"},
    "datatools": {"base", "data"},
    "serving": {"base", "data", "decoding"},
    "training": {"base", "data", "model", "decoding"},
    "experiments": {"base", "data", "model", "decoding", "datatools", "training"},
    "cli": {"base", "data", "model", "decoding", "datatools", "serving", "training", "experiments"},
    "facade": {
        "base",
        "data",
        "model",
        "decoding",
        "datatools",
        "serving",
        "training",
        "experiments",
    },
}
LAYERS = list(ALLOWED)


def _module_name(path):
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module):
    """The layer of a module named relative to the package ("" is the package itself)."""
    if module == "":
        return "facade"
    head = module.split(".")[0]
    if head in BASE:
        return "base"
    if head in LAYERS:
        return head
    raise AssertionError(
        f"konkanivani.{module} belongs to no layer: add it to docs/architecture.md and LAYERS"
    )


def _modules():
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(module, path, known):
    """(line, imported module) for every konkanivani import in ``path``, wherever it stands."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    package = [p for p in package if p]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            elif (node.module or "").split(".")[0] == "konkanivani":
                target = node.module.partition(".")[2]
            else:
                continue
            for alias in node.names:  # "from ..training import state" imports a module
                sub = f"{target}.{alias.name}" if target else alias.name
                found.append((node.lineno, sub if sub in known else target))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "konkanivani":
                    found.append((node.lineno, alias.name.partition(".")[2]))
    return found


def _graph():
    modules = _modules()
    return modules, {
        m: sorted({t for _, t in _imports(m, p, modules)} - {m}) for m, p in modules.items()
    }


def _forbidden(module, target) -> bool:
    """Whether ``module`` may not import ``target`` (both named relative to the package)."""
    if target == "":  # the package itself (its facade) is imported by nobody
        return True
    source, layer = _layer(module), _layer(target)
    return layer != source and layer not in ALLOWED[source]


def test_every_import_follows_the_table_of_allowed_layers():
    modules, wrong = _modules(), []
    for module, path in modules.items():
        for line, target in _imports(module, path, modules):
            if _forbidden(module, target):
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {_layer(module)} imports "
                             f"{_layer(target)} (konkanivani.{target})")
    assert not wrong, "imports against docs/architecture.md:\n" + "\n".join(wrong)


def test_the_table_is_the_one_in_the_docs():
    """docs/architecture.md's table says what each layer may import, in words a test can read:
    a row per layer, its first cell naming it (`data/`, base, facade), its last listing the
    layers."""
    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    rows = {}
    for line in doc.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        names = [w for w in re.findall(r"\w+", cells[0]) if w in ALLOWED] if len(cells) == 3 else []
        if line.startswith("|") and names:
            rows[names[0]] = set(re.findall(r"\w+", cells[2])) & set(ALLOWED)
    assert rows == ALLOWED


def test_no_module_name_is_in_two_layers():
    names: dict[str, set[str]] = {}
    for module in _modules():
        leaf = module.split(".")[-1]
        if module and leaf != "__init__" and module not in [p for p in LAYERS]:
            names.setdefault(leaf, set()).add(_layer(module))
    twice = {name: layers for name, layers in names.items() if len(layers) > 1}
    assert not twice, f"module names in two layers: {twice}"


def test_no_import_cycle_between_modules():
    modules, graph = _graph()
    state, cycles = {}, []

    def visit(node, stack):
        state[node] = "open"
        for nxt in graph.get(node, ()):
            if nxt not in modules:
                continue
            if state.get(nxt) == "open":
                cycles.append(" -> ".join([*stack[stack.index(nxt):], nxt]))
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = "done"

    for module in modules:
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_subpackages_are_one_level_deep_and_named_in_the_docs():
    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    for path in PACKAGE.rglob("*.py"):
        depth = len(path.relative_to(PACKAGE).parts)
        assert depth <= 2, f"{path}: subpackages are one level deep"
        if depth == 2:
            assert (
                f"{path.parent.name}/" in doc
            ), f"docs/architecture.md does not name {path.parent.name}/"
    for layer in LAYERS[1:-1]:
        assert f"`{layer}/`" in doc


def test_every_module_is_named_in_its_layers_row():
    """docs/architecture.md draws the layers as they are: a subpackage's row names each of its
    modules as `name`, so that a module added (or renamed) is described where it lives."""
    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    rows = {}
    for line in doc.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 3 and (m := re.fullmatch(r"`(\w+)/`", cells[0])):
            rows[m.group(1)] = cells[1]
    missing = [
        module for module in _modules()
        if "." in module and not module.endswith("__init__")
        and f"`{module.split('.')[-1]}`" not in rows.get(module.split(".")[0], "")
    ]
    assert not missing, f"docs/architecture.md's rows do not name: {', '.join(missing)}"


@pytest.mark.parametrize("bad,importer", [
    ("from ..training.loop import train\n", "data.audio"),
    ("def f():\n    from ..cli import tool\n", "data.audio"),
    ("from ..training.memory import GIB\n", "serving.app"),  # below training, in no order of layers
    ("from ..decoding.search import ctc_greedy\n", "datatools.outputs"),
])
def test_the_check_fails_on_an_import_the_table_forbids(tmp_path, bad, importer):
    path = _write(tmp_path, bad, importer)
    found = _imports(importer, path, _modules())
    assert found and all(_forbidden(importer, target) for _, target in found), found


def _write(tmp_path, text, importer):
    # The same relative position as the importing module, so relative imports resolve alike.
    path = tmp_path.joinpath(*importer.split(".")).with_suffix(".py")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path
