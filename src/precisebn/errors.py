"""Exceptions and warnings raised by precisebn.

Every error derives from :class:`PreciseBNError` *and* from the built-in exception
that matches its meaning, so ``except ValueError`` keeps working in code that does
not know precisebn::

    PreciseBNError (Exception)
    ├── InvalidArgumentError (ValueError)      an option has a wrong value or type
    │   └── NotWritableError (PermissionError) an output's folder cannot be written
    ├── BatchTypeError (TypeError)             a batch the default forward cannot feed
    ├── EmptyDataError (ValueError)            the data yielded no batch
    ├── LayerNotFoundError (LookupError)       no layer matches, or an unknown name
    ├── UninitializedLayerError (RuntimeError) a lazy layer that never ran
    ├── UnsupportedLayerError (TypeError)      a layer whose forward precisebn cannot measure
    ├── ConcurrentUseError (RuntimeError)      a second pass on a model already in one
    ├── NonFiniteError (FloatingPointError)    NaN/Inf statistics in a layer
    ├── StatsMismatchError (ValueError)        statistics that do not fit the model
    ├── MissingDependencyError (ImportError)   an optional extra is not installed
    ├── MissingFileError (FileNotFoundError)   a file to read does not exist
    └── DistributedError (RuntimeError)        ranks disagree, or one of them failed

Messages say what was wrong, where (the layer's qualified name, the rank) and what to
do about it. Whenever one of these is raised by :func:`precisebn.recalibrate` or
:func:`precisebn.estimate`, the model has been restored bitwise to its state before
the call.
"""

from __future__ import annotations

import contextlib
import os
import sys

__all__ = [
    "BatchTypeError",
    "ConcurrentUseError",
    "DistributedError",
    "EmptyDataError",
    "InvalidArgumentError",
    "LayerNotFoundError",
    "MissingDependencyError",
    "MissingFileError",
    "ModelChangedWarning",
    "NonFiniteError",
    "NotWritableError",
    "PreciseBNError",
    "PreciseBNWarning",
    "ShortDataWarning",
    "StatsMismatchError",
    "UninitializedLayerError",
    "UnsupportedLayerError",
]


class PreciseBNError(Exception):
    """Base class of every error raised by precisebn."""


class InvalidArgumentError(PreciseBNError, ValueError):
    """An argument has a value or type that precisebn cannot use."""


class NotWritableError(InvalidArgumentError, PermissionError):
    """An output path whose folder this process may not write (found before anything is written): an
    ``InvalidArgumentError`` and a ``PermissionError``, which is what code that writes files catches."""


class BatchTypeError(PreciseBNError, TypeError):
    """A batch that the default forward does not know how to pass to the model."""


class EmptyDataError(PreciseBNError, ValueError):
    """The data yielded no batch at all (or too few where fewer is an error)."""


class LayerNotFoundError(PreciseBNError, LookupError):
    """No normalization layer matched the selection, or a named layer does not exist."""


class UninitializedLayerError(PreciseBNError, RuntimeError):
    """A lazy normalization layer has not been initialised by a first forward pass."""


class UnsupportedLayerError(PreciseBNError, TypeError):
    """A selected layer whose forward does not produce the figures precisebn reads."""


class ConcurrentUseError(PreciseBNError, RuntimeError):
    """A recalibration was started on a model that another one is using (any thread)."""


class NonFiniteError(PreciseBNError, FloatingPointError):
    """A layer's statistics contain NaN or infinity."""


class StatsMismatchError(PreciseBNError, ValueError):
    """Statistics do not fit the model they are applied to (names or channel counts)."""


class MissingDependencyError(PreciseBNError, ImportError):
    """An optional dependency is missing; the message gives the ``pip install`` line."""


class MissingFileError(PreciseBNError, FileNotFoundError):
    """A file to read (statistics, a checkpoint) does not exist; the message names it."""


class DistributedError(PreciseBNError, RuntimeError):
    """Ranks disagree about the recalibration, or one of them failed.

    Attributes:
        failed_ranks: The global ranks that reported a failure (empty when the ranks only
            disagreed).
    """

    def __init__(self, message: str, failed_ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.failed_ranks = failed_ranks


class PreciseBNWarning(UserWarning):
    """Base class of the warnings precisebn emits."""


class ShortDataWarning(PreciseBNWarning):
    """The data ran out before the requested number of samples or batches."""


class ModelChangedWarning(PreciseBNWarning):
    """The model's own forward changed parameters in place during the passes, and they
    could not be put back (precisebn copies buffers, not parameters)."""


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_CONTEXTLIB = contextlib.__file__


def caller_stacklevel() -> int:
    """The ``stacklevel`` with which a ``warnings.warn`` in the calling function names the first frame outside
    precisebn (and contextlib): the user's line, however deep in precisebn the warning comes from — a fixed
    level named precisebn's own line when the same code was reached through another entry point (the drop-ins
    of :mod:`precisebn.compat` named ``compat.py``, probe 41)."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and (
        frame.f_code.co_filename.startswith(_PACKAGE) or frame.f_code.co_filename == _CONTEXTLIB
    ):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 1
