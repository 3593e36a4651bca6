"""The library's version, in a module of its own so that importing it loads nothing else (pyproject.toml reads it)."""

__version__ = "0.1.0"
