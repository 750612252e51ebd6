"""A class name means one thing across the package: no other module defines the same name (class or alias)."""

from __future__ import annotations

import ast
from collections import defaultdict

from tests.support.paths import REPO_ROOT


def _top_level_names() -> dict[str, dict[str, str]]:
    """name -> {module path: "class" or "alias"} for each public class and capitalised assignment."""
    found: dict[str, dict[str, str]] = defaultdict(dict)
    for path in sorted((REPO_ROOT / "equiconvert").rglob("*.py")):
        where = str(path.relative_to(REPO_ROOT))
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                found[node.name][where] = "class"
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            for target in targets:
                if isinstance(target, ast.Name) and target.id[:1].isupper() and not target.id.isupper():
                    found[target.id].setdefault(where, "alias")
    return found


def test_a_class_name_is_defined_in_one_module_only():
    clashes = {
        name: modules
        for name, modules in _top_level_names().items()
        if len(modules) > 1 and "class" in modules.values() and not name.startswith("_")
    }
    assert not clashes, clashes


def test_the_training_recipe_and_the_build_recipe_have_their_own_names():
    names = _top_level_names()
    assert names["Recipe"] == {"equiconvert/recipes/recipe.py": "class"}
    assert names["BuildRecipe"] == {"equiconvert/build_recipe.py": "alias"}
