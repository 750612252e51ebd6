"""The package's modules import each other without cycles (read from the source with ast, nothing imported).

Run as a script to print the import graph's cycles: `python tests/package/test_import_graph.py [--all]`.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "equiconvert"
CLI = ("equiconvert.cli", "equiconvert.__main__")  # the top layer: the command line package and `python -m`
PRIVACY, TRAINING = ("equiconvert.privacy",), ("equiconvert.training",)  # the mechanism, and the loop built on it


def in_layer(name: str, layer: tuple[str, ...]) -> bool:
    """`name` is one of the `layer` modules or packages, or a module inside one of them."""
    return any(name == top or name.startswith(top + ".") for top in layer)


def module_names(root: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    names = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.Module, module_level: bool) -> list[ast.Import | ast.ImportFrom]:
    """Import statements run when the module is imported (module_level) or anywhere in it."""
    if not module_level:
        return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    found, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If) and not _is_type_checking(node):
            todo += node.body + node.orelse
        elif isinstance(node, ast.Try):
            todo += node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body]
    return found


def imports_of(name: str, path: Path, modules: dict[str, Path], module_level: bool = True) -> set[str]:
    """The package modules that `name` imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text()), module_level):
        if isinstance(node, ast.Import):
            targets |= {alias.name for alias in node.names}
            continue
        base = package
        for _ in range(node.level - 1):
            base = base.rpartition(".")[0]
        base = f"{base}.{node.module}" if node.level and node.module else (base if node.level else node.module)
        for alias in node.names:
            targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {t for t in targets if t in modules and t != name}


def import_graph(module_level: bool = True) -> dict[str, set[str]]:
    modules = module_names()
    return {name: imports_of(name, path, modules, module_level) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph.get(node, ()):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_graph_reader_finds_relative_imports_and_a_planted_cycle():
    graph = import_graph()
    assert "equiconvert.models._registry" in graph["equiconvert.models.resnet9"]
    assert "equiconvert.errors" in graph["equiconvert"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles_among_module_level_imports():
    assert cycles(import_graph(module_level=True)) == []


def test_no_import_cycles_even_counting_imports_inside_functions():
    """Deferred imports included: the CLI -> training runner -> CLI loop is gone (the registry builds models)."""
    graph = import_graph(module_level=False)
    assert not {t for t in graph["equiconvert.recipes.runner"] if in_layer(t, CLI)}
    assert cycles(graph) == []


def test_layers_point_one_way_cli_recipes_library():
    """cli -> recipes -> library: the library (privacy and training included) imports neither the recipes nor the
    CLI, and no recipes module imports the CLI (the cli package and each of its subcommand modules)."""
    graph = import_graph(module_level=False)
    assert {"equiconvert.cli", "equiconvert.cli.train", "equiconvert.cli.common"} <= set(graph)  # the package is read
    upper = (*CLI, "equiconvert.recipes")
    for name, targets in graph.items():
        if in_layer(name, upper) or name == "equiconvert":
            continue
        assert not {t for t in targets if in_layer(t, upper)}, name
    for name, targets in graph.items():
        if in_layer(name, ("equiconvert.recipes",)):
            assert not {t for t in targets if in_layer(t, CLI)}, name


def test_training_builds_on_privacy_and_privacy_never_imports_training():
    """privacy (the mechanism) is the lower layer: training imports it, it imports neither training nor the CLI."""
    graph = import_graph(module_level=False)
    assert {"equiconvert.training.trainer", "equiconvert.privacy.dp_step"} <= set(graph)  # both packages are read
    assert "equiconvert.privacy.dp_step" in graph["equiconvert.training.trainer"]
    for name, targets in graph.items():
        if in_layer(name, PRIVACY):
            assert not {t for t in targets if in_layer(t, (*TRAINING, *CLI))}, name


def _methods(path: Path) -> set[str]:
    """The names of the methods of the classes a module defines."""
    classes = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)]
    return {f.name for c in classes for f in c.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}


def test_privacy_holds_no_training_loop():
    """A class with fit() is a training loop: it belongs in equiconvert.training, which calls privacy's step."""
    modules = module_names()
    assert "fit" in _methods(modules["equiconvert.training.trainer"])  # the reader finds DPTrainer.fit
    loops = [name for name, path in modules.items() if in_layer(name, PRIVACY) and "fit" in _methods(path)]
    assert loops == []


if __name__ == "__main__":
    for cycle in cycles(import_graph(module_level="--all" not in sys.argv)):
        print(" <-> ".join(cycle))
