"""What a layer normalises with its running buffers, and whether its own figures match it.

A layer's population statistics are those of the tensor it normalises with its running
buffers — the same tensor in training and in eval mode. For torch's own layers, and for
fused ones such as timm's ``BatchNormAct2d``, that is the layer's input; a subclass may
normalise something else (``super().forward(x * s)``, a reshaped view), or not use its
buffers at all.

:class:`Watch` is a ``TorchFunctionMode`` entered only around one layer's forward: it
records the ``input`` of every ``F.batch_norm``/``F.instance_norm`` call that is given
that layer's own ``running_mean``. :func:`discrepancy` compares the figures a layer left
in its buffers (with momentum 1.0: the batch mean and unbiased variance, if it behaves
like torch's BatchNorm) with a float64 reduction of what it normalised.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from .stats import RunningMoments

__all__ = ["TOLERANCE", "Watch", "discrepancy"]

TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10}
"""Largest :func:`discrepancy` for which a layer's own figures are used (by buffer dtype).

Above the rounding of torch's own kernels in the default memory layout (float32: about
1e-7), below what a behavioural difference costs (a biased variance stored over n values:
1/(n - 1)). A layer whose figures are further off — e.g. channels_last inputs on CPU,
whose float32 figures carry about 2e-5 — is measured in float64 instead."""

_SIGNATURES = {f: inspect.signature(f) for f in (F.batch_norm, F.instance_norm)}


class Watch(TorchFunctionMode):
    """Records what ``module`` normalises with its running buffers while active.

    Attributes:
        seen: The ``input`` of every normalization call given the module's running mean.
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.running_mean = module._buffers.get("running_mean")
        self.seen: list[Tensor] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        signature = _SIGNATURES.get(func)
        if signature is not None:
            try:
                bound = signature.bind(*args, **kwargs).arguments
            except TypeError:  # torch will say what is wrong with the call
                bound = {}
            if self.running_mean is not None and bound.get("running_mean") is self.running_mean:
                self.seen.append(bound["input"])
        return func(*args, **kwargs)


def moments_of(seen: list[Tensor]) -> RunningMoments | None:
    """float64 moments per channel (dimension 1) of everything in ``seen``."""
    out = None
    for t in seen:
        m = RunningMoments.from_data(t.cpu() if t.device.type == "mps" else t, 1)
        if out is None:
            out = m
        else:
            out.merge(m)
    return out


def discrepancy(mean: Tensor, unbiased_var: Tensor, ref: RunningMoments, eps: float) -> Tensor:
    """How far a layer's figures are from the float64 reference, or may be in other batches.

    The largest over channels of ``|Δmean| / sqrt(var + eps)``, ``|Δvar| / (var + eps)``
    and ``(u · |mean| / sqrt(var + eps))²``, where ``u`` is the unit roundoff of the
    figures' dtype: the last is what rounding each batch's mean to that dtype adds to the
    pooled variance — an error that a single batch can show as zero by luck, and that
    only matters where ``|mean|/std`` is in the thousands (returns a 0-d tensor; no host
    read).
    """
    var = ref.m2 / (ref.count - 1).clamp_min(1)
    mean64, var64 = mean.to(ref.mean.device, torch.float64), unbiased_var.to(ref.mean.device, torch.float64)
    scale = (var + eps).sqrt()
    d_mean = (mean64 - ref.mean).abs() / scale
    d_var = (var64 - var).abs() / (var + eps)
    d_rounding = (torch.finfo(mean.dtype).eps / 2 * ref.mean.abs() / scale).square()
    d = torch.maximum(torch.maximum(d_mean, d_var), d_rounding).max()
    return torch.where(d.isnan(), torch.full_like(d, float("inf")), d)
