"""Value equality for the result rows (:class:`~precisebn.population.LayerStats`,
:class:`~precisebn.report.LayerReport`), whose fields hold per-channel tensors: the generated
``__eq__`` compared them element by element and raised ("Boolean value of Tensor with more
than one value is ambiguous")."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import Tensor


def equal_fields(a: Any, b: Any, but: tuple[str, ...] = ()) -> bool:
    """Whether two dataclass instances of one class hold equal fields (but those named in ``but``),
    tensors equal in shape, dtype and values (NaN equal to NaN: a layer never reached has NaN statistics).

    >>> import torch
    >>> from precisebn.population import LayerStats
    >>> nan = torch.tensor([float("nan"), 1.0])
    >>> LayerStats(nan, nan.clone(), 0, 0, "BatchNorm1d") == LayerStats(nan.clone(), nan, 0, 0, "BatchNorm1d")
    True
    """
    for f in dataclasses.fields(a):
        if f.name in but:
            continue
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, Tensor) or isinstance(y, Tensor):
            if not (isinstance(x, Tensor) and isinstance(y, Tensor) and _same_tensor(x, y)):
                return False
        elif x != y:
            return False
    return True


def hash_fields(a: Any) -> int:
    """A hash of the fields that are not tensors (equal instances hash alike)."""
    return hash(tuple(v for f in dataclasses.fields(a) if not isinstance(v := getattr(a, f.name), Tensor)))


def _same_tensor(x: Tensor, y: Tensor) -> bool:
    if x.shape != y.shape or x.dtype != y.dtype or x.device != y.device:
        return False
    same = x == y
    if x.is_floating_point():
        same |= x.isnan() & y.isnan()
    return bool(same.all())
