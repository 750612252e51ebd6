"""`equiconvert recipes`: list the shipped recipes, or print one's TOML."""

from __future__ import annotations

import argparse
from .commands import SUBCOMMANDS


def _cmd_recipes(args: argparse.Namespace) -> int:
    from ..recipes.recipe import recipe_text, shipped_recipes

    if args.name:
        print(recipe_text(args.name)[0], end="")
        return 0
    for name, about in shipped_recipes().items():
        print(f"{name}: {about}")
    print("run one: equiconvert train --recipe NAME [--set KEY=VALUE ...]; show one: equiconvert recipes NAME")
    return 0


def add_parser(sub) -> None:
    recipes = sub.add_parser("recipes", help=SUBCOMMANDS["recipes"])
    recipes.add_argument("name", nargs="?", help="print this recipe's TOML")
    recipes.set_defaults(func=_cmd_recipes)
