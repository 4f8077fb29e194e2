"""The package version (one place: the CLI reads it without importing the package root)."""

__version__ = "0.1.0"
