"""Load a script of benchmarks/ as a module, for tests of its main()."""

import importlib.util
import sys
from types import ModuleType

from tests.support.paths import REPO_ROOT


BENCHMARKS = REPO_ROOT / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """benchmarks/<name>.py, registered in sys.modules (dataclasses look their module up there)."""
    spec = importlib.util.spec_from_file_location(f"{name}_benchmark", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
