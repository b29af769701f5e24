"""mixprec's version, at the bottom layer so that any module can read it (pyproject reads it too)."""

__version__ = "0.2.0.dev0"
