"""The subcommands, in the order `--help` lists them, with their one-line help: read without importing them.

Each name is a module of this package whose `add_parser(sub)` adds its full parser; `equiconvert --help` and
`--version` import none of them."""

from __future__ import annotations

SUBCOMMANDS: dict[str, str] = {
    "convert": "convert a model and report what changed",
    "demo": "the main job: convert ResNet9 to D4 and train it with DP-SGD on Fashion-MNIST",
    "train": "train a (converted) model with DP-SGD and write OUT/result.json",
    "recipes": "list the shipped recipes, or print one",
    "audit": "empirical lower bound on epsilon from one DP-SGD run with canaries",
}
