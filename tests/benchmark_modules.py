"""The benchmark scripts of benchmarks/, imported by their file paths (they are not a package)."""
import importlib.util
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load(name):
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    # registered, as an import would: dataclasses and a process pool's pickles look it up there
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
