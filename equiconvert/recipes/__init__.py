"""Experiment recipes: the runner behind `equiconvert train`, typed recipes loaded from TOML, and the demo.

Layering: the command line (equiconvert.cli) uses this package; this package uses the library
(convert, models, data, privacy); the library imports neither.
"""
