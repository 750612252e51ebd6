"""Tests of the package as a whole: metadata, lint, import graph, lazy imports, wheel install, docs, examples."""
