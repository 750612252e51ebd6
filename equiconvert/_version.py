"""The package version: its one source (pyproject.toml reads it; equiconvert.__version__ re-exports it)."""

__version__ = "0.1.0"
