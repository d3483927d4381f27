"""The package version, in a module of its own so any part of recursa can read it without
importing the public API in `recursa/__init__.py` (which imports most of the package)."""

__version__ = "0.1.0"
