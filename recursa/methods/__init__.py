"""Baselines behind one small protocol (see `base.Method`); implementations load on first use.

Internal (docs/reference/python.md): import from the modules.
"""
