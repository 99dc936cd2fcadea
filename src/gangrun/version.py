"""The package version (its own module: every layer may read it)."""

__version__ = "0.1.0"
