"""Tests of the package's top-level modules: cli, groups, export, saved_model."""
