"""The Lightning callbacks for the legacy ``pytorch_lightning`` package.

The same classes as :mod:`precisebn.integrations.lightning` — :class:`PreciseBN` and
:class:`PreciseWeightAveraging`, same options, same behaviour — built on
``pytorch_lightning.Callback`` so that a ``pytorch_lightning.Trainer`` accepts them.
A callback only works with the Trainer of the package it was imported for.

Example:
    >>> from precisebn.integrations.pytorch_lightning import PreciseBN
    >>> import pytorch_lightning
    >>> isinstance(PreciseBN(num_samples=4096), pytorch_lightning.Callback)
    True
"""

from __future__ import annotations

import importlib
from typing import Any

from ..errors import MissingDependencyError
from ._lightning_common import AveragingMixin, PreciseBNMixin

try:
    _pl = importlib.import_module("pytorch_lightning")
except ImportError as exc:
    raise MissingDependencyError(
        "precisebn.integrations.pytorch_lightning needs the legacy package 'pytorch_lightning', which is not "
        "installed: pip install pytorch-lightning (for the 'lightning' package, use "
        "precisebn.integrations.lightning: pip install 'precisebn[lightning]')"
    ) from exc

__all__ = ["PreciseBN", "PreciseWeightAveraging"]


class PreciseBN(PreciseBNMixin, _pl.Callback):
    """Recomputes precise statistics before each validation and each checkpoint of ``fit``
    (see :class:`precisebn.integrations.lightning.PreciseBN`)."""


_WeightAveraging = getattr(_pl.callbacks, "WeightAveraging", None)

if _WeightAveraging is not None:

    class PreciseWeightAveraging(AveragingMixin, _WeightAveraging):  # type: ignore[misc,valid-type]
        """``WeightAveraging`` (SWA or EMA) with precise statistics for the average
        (see :class:`precisebn.integrations.lightning.PreciseWeightAveraging`)."""

else:  # pytorch_lightning < 2.6

    class PreciseWeightAveraging:  # type: ignore[no-redef]
        """Needs pytorch_lightning 2.6 or later (``WeightAveraging``)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise MissingDependencyError(
                f"PreciseWeightAveraging needs pytorch_lightning>=2.6 (WeightAveraging), found {_pl.__version__}: "
                "pip install --upgrade 'pytorch-lightning>=2.6'"
            )
