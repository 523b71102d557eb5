"""Importing optional dependencies with an install hint."""

from __future__ import annotations

import importlib
from types import ModuleType

from .errors import MissingDependencyError

__all__ = ["require"]


def require(module: str, extra: str, purpose: str) -> ModuleType:
    """Imports ``module`` or raises :class:`MissingDependencyError` with a pip hint.

    Args:
        module: The module to import, e.g. ``"matplotlib.pyplot"``.
        extra: precisebn's extra that installs it, e.g. ``"plot"``.
        purpose: What needs it, for the message (e.g. ``"Report.plot()"``).
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = module.split(".")[0]
        raise MissingDependencyError(
            f"{purpose} needs the optional package {top!r}, which is not installed: pip install 'precisebn[{extra}]'"
        ) from exc
