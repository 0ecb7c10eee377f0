"""The package's shape, as docs/architecture.md draws it: subpackages one level deep, imports only
downwards (a package may import its own modules and those of the layers below it), and no cycle
between modules. Every import counts, those inside functions too."""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "konkanivani"

# Lowest first; each may import itself and what is above it in this list, never what is below.
LAYERS = ["base", "data", "model", "decoding", "training", "tools", "serving", "cli", "facade"]
BASE = {"config", "config_file", "checkpoint", "device"}  # top-level modules every package builds on


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
    raise AssertionError(f"konkanivani.{module} belongs to no layer: add it to docs/architecture.md and LAYERS")


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
    return modules, {m: sorted({t for _, t in _imports(m, p, modules)} - {m}) for m, p in modules.items()}


def test_every_import_goes_down_the_layers():
    modules, wrong = _modules(), []
    for module, path in modules.items():
        for line, target in _imports(module, path, modules):
            if LAYERS.index(_layer(target)) > LAYERS.index(_layer(module)) or target == "":
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {_layer(module)} imports "
                             f"{_layer(target)} (konkanivani.{target})")
    assert not wrong, "imports against docs/architecture.md:\n" + "\n".join(wrong)


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
            assert f"{path.parent.name}/" in doc, f"docs/architecture.md does not name {path.parent.name}/"
    for layer in LAYERS[1:-1]:
        assert f"`{layer}/`" in doc


@pytest.mark.parametrize("bad", ["from ..training.loop import train\n", "def f():\n    from ..cli import tool\n"])
def test_the_check_sees_a_wrong_way_import_even_inside_a_function(tmp_path, bad):
    path = PACKAGE / "data" / "audio.py"
    found = _imports("data.audio", path, _modules()) + _imports(
        "data.audio", _write(tmp_path, bad), _modules())
    layers = {_layer(t) for _, t in found}
    assert {"training", "cli"} & layers


def _write(tmp_path, text):
    # The same relative position as data/audio.py, so relative imports resolve alike.
    path = tmp_path / "data" / "audio.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path
