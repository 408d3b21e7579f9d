"""The package version (one place; the package and saved models read it)."""

__version__ = "0.1.0"
