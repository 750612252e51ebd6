"""Helpers shared by the test modules (no tests here): paths, tiny models and data, CLI and benchmark runners."""
