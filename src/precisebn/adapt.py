"""Adapting to a new domain: the layer's current statistics as a prior, and partial updates.

Re-estimating statistics on a handful of unlabelled images from a new domain (AdaBN)
is noisy. Schneider et al. (2020, *Improving robustness against common corruptions by
covariate shift adaptation*) mix the source statistics in as a prior with a
pseudo-count ``N``. Here the prior is exact pooling: the layer's current running
statistics count as ``N`` **samples** of pseudo-data with that mean and variance, and
the new statistics are the mean and population variance of those pseudo-values and the
measured ones together — Chan's merge of ``(N·v, μ_s, N·v·σ²_s)`` with
``(n, μ_t, n·σ²_t)`` in float64, between-group term included::

    w   = N·v                        (the prior, in values per channel)
    μ   = (w·μ_s + n·μ_t) / (w + n)
    σ²  = (w·σ²_s + n·σ²_t) / (w + n) + w·n·(μ_t − μ_s)² / (w + n)²

``n`` is the number of values per channel the layer received during the passes
(samples × positions × calls) and ``v = n / samples`` its values per sample, so that
``N`` weighs like ``N`` more samples of the new data whatever the layer's spatial size
(``prior=16`` next to 16 images gives both halves equal weight in every layer).

``adapt="mean"`` or ``adapt="var"`` writes only that buffer (exactly the value
``adapt="both"`` would write) and leaves the other one bitwise as it was.

Example:
    >>> import torch, precisebn
    >>> model = torch.nn.Sequential(torch.nn.BatchNorm1d(1))  # running mean 0, variance 1
    >>> data = [torch.tensor([[2.0], [4.0]])]  # 2 samples: mean 3, variance 1
    >>> report = precisebn.recalibrate(model, data, prior=2)  # 2 pseudo-samples at mean 0, variance 1
    >>> model[0].running_mean.item(), model[0].running_var.item()  # pooled: mean 1.5, 1 + 2·2/16·9
    (1.5, 3.25)
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Literal

import torch
from torch import Tensor

from .errors import InvalidArgumentError
from .population import LayerStats

__all__ = [
    "ADAPT",
    "WRITTEN",
    "Adapt",
    "check_adapt",
    "mean_error_in_kept_sd",
    "pool_with_prior",
    "prior_values",
    "with_prior",
]

Adapt = Literal["both", "mean", "var"]
ADAPT = ("both", "mean", "var")
"""The values of ``adapt``: which running buffers are written."""

WRITTEN = {"both": ("running_mean", "running_var"), "mean": ("running_mean",), "var": ("running_var",)}
"""The running buffers each ``adapt`` writes."""


def check_adapt(prior: Any, adapt: Any) -> float | None:
    """Checks ``prior`` and ``adapt``; returns the prior as a float, or ``None`` for no prior.

    Raises:
        InvalidArgumentError: ``prior`` is not ``None`` or a finite number ≥ 0 (bools
            refused), or ``adapt`` is not ``"both"``, ``"mean"`` or ``"var"``.

    Example:
        >>> check_adapt(16, "both"), check_adapt(None, "mean"), check_adapt(0, "var")
        (16.0, None, None)
    """
    if adapt not in ADAPT:
        raise InvalidArgumentError(
            f"adapt must be 'both', 'mean' or 'var' (which running buffers to write), got {adapt!r}"
        )
    if prior is None:
        return None
    if isinstance(prior, bool) or not isinstance(prior, numbers.Real) or not math.isfinite(prior) or prior < 0:
        raise InvalidArgumentError(
            "prior must be None or a number of samples >= 0 (the weight of the layer's current running statistics, "
            f"as that many samples of pseudo-data; e.g. prior=16), got {prior!r}"
        )
    return float(prior) or None


def prior_values(prior: float, count: int, samples: int) -> float:
    """The prior's weight in values per channel: ``prior`` samples at the layer's
    ``count / samples`` values per sample.

    Example:
        >>> prior_values(16, count=64 * 196, samples=64)  # 14×14 positions per sample
        3136.0
    """
    return prior * count / samples


def pool_with_prior(
    prior_mean: Tensor, prior_var: Tensor, weight: float, mean: Tensor, var: Tensor, count: int
) -> tuple[Tensor, Tensor]:
    """The mean and population variance of ``weight`` pseudo-values with ``prior_mean``/
    ``prior_var`` and ``count`` values with ``mean``/``var``, per channel, in float64
    (Chan's merge, the between-group term included, written with the two groups' shares
    ``a = w / (w + n)`` and ``b = n / (w + n)``: no product of the counts, which overflowed
    for a prior of ~1e306 samples; an infinite weight gives the prior back).

    Example:
        >>> one = torch.tensor([1.0], dtype=torch.float64)
        >>> pool_with_prior(0 * one, one, 2.0, 3 * one, one, 2)  # {-1, 1} ∪ {2, 4}
        (tensor([1.5000], dtype=torch.float64), tensor([3.2500], dtype=torch.float64))
    """
    f64 = torch.float64
    mean, var = mean.detach().to("cpu", f64), var.detach().to("cpu", f64)
    prior_mean, prior_var = prior_mean.detach().to("cpu", f64), prior_var.detach().to("cpu", f64)
    w, n = torch.tensor(float(weight), dtype=f64, device="cpu"), torch.tensor(float(count), dtype=f64, device="cpu")
    a = 1 / (1 + n / w)  # the prior's share (w = 0: n / w = inf, a = 0)
    b = 1 / (1 + w / n)  # the data's (w = inf: b = 0)
    delta = mean - prior_mean
    return prior_mean + b * delta, a * prior_var + b * var + (a * b) * delta.square()


def with_prior(
    entries: list[tuple[str, Any, LayerStats]], prior: float, samples: int, adapt: str = "both"
) -> tuple[list[tuple[str, Any, LayerStats]], list[str]]:
    """``(name, layer, stats)`` entries whose reached statistics are pooled with the
    layer's current running buffers as ``prior`` samples; and the problems found (a
    layer whose current statistics are NaN/Inf or negative cannot serve as a prior).
    With ``adapt="mean"`` only the mean is pooled (it needs no variance: a NaN variance,
    which that leaves as it is, is no problem — probe 41 found it refused). Nothing is
    written here."""
    out, problems = [], []
    for name, m, s in entries:
        if not s.reached:
            out.append((name, m, s))
            continue
        measured = samples if s.samples is None else s.samples  # (a merge of different layer selections)
        if measured <= 0:
            problems.append(
                f"{name!r}: the statistics record {measured} samples, so prior= (in samples) cannot be converted to "
                "values per channel"
            )
            continue
        old_mean = m.running_mean.detach().to("cpu", torch.float64)
        old_var = m.running_var.detach().to("cpu", torch.float64)
        mean_only = adapt == "mean"
        if mean_only:
            old_var = torch.zeros_like(old_var)  # (not read by the pooled mean; the pooled variance is not written)
        if not (bool(old_mean.isfinite().all()) and bool(old_var.isfinite().all()) and bool((old_var >= 0).all())):
            which = "running_mean" if mean_only else "running statistics"
            problems.append(
                f"{name!r}: its current {which}, the prior, {'is' if mean_only else 'are'} NaN/Inf or negative; "
                "recalibrate it without prior= first"
            )
            continue
        mean, var = pool_with_prior(old_mean, old_var, prior_values(prior, s.count, measured), s.mean, s.var, s.count)
        var = s.var if mean_only else var
        out.append((name, m, dataclasses.replace(s, mean=mean, var=var, se_mean=None, se_var=None)))
    return out, problems


def mean_error_in_kept_sd(se_mean: Tensor, measured_var: Tensor, kept_var: Tensor, eps: float) -> Tensor:
    """The mean's standard error ``se_mean`` (in the measured standard deviations, ``sqrt(measured_var)``)
    in units of ``sqrt(kept_var + eps)``: what the layer normalises with after ``adapt="mean"``, and the
    unit of the report's ``mean_shift`` (probe 45: the report gave the shift in the kept σ and its error in
    the measured one — a shift of 3.3 kept σ with an error of 0.042 "σ", 0.42 kept σ, where the measured σ
    was 10 times the kept one). Per channel, float64.

    Example:
        >>> one = torch.ones(1, dtype=torch.float64)
        >>> mean_error_in_kept_sd(0.05 * one, 100 * one, one, 0.0)  # 0.05 of σ 10 is 0.5 of σ 1
        tensor([0.5000], dtype=torch.float64)
    """
    f64 = torch.float64
    absolute = se_mean.detach().to("cpu", f64) * measured_var.detach().to("cpu", f64).clamp_min(0).sqrt()
    return absolute / (kept_var.detach().to("cpu", f64).clamp_min(0) + eps).sqrt()
