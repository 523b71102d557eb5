"""The estimator: per-channel count, mean and M2 in float64, exactly mergeable.

This module is pure tensor math; it knows nothing about models or layers.

A :class:`RunningMoments` holds, for every channel ``c``, the number of values seen
``count[c]``, their mean ``mean[c]`` and the sum of squared deviations from that mean
``m2[c]``, all in float64. Two sets of moments merge exactly (Chan, Golub & LeVeque,
1983)::

    n  = n_a + n_b
    δ  = μ_b - μ_a
    μ  = μ_a + δ · n_b / n
    M2 = M2_a + M2_b + δ² · n_a · n_b / n

so the result never depends on how the values were split into pieces or in which
order the pieces arrive (up to float64 rounding), and no ``E[x²] - E[x]²``
cancellation occurs. The population (biased) variance is ``M2 / n``.

Example:
    >>> import torch
    >>> from precisebn.stats import RunningMoments
    >>> x = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])  # 3 samples, 2 channels
    >>> a = RunningMoments.from_data(x[:1], channel_dim=1)
    >>> a.merge(RunningMoments.from_data(x[1:], channel_dim=1))
    >>> a.count.tolist(), a.mean.tolist(), a.var.tolist()
    ([3.0, 3.0], [3.0, 4.0], [2.6666666666666665, 2.6666666666666665])
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["RunningMoments", "chan_merge", "fold_errors", "fold_errors_from_sums", "merge_counted"]

_F64 = torch.float64

CHUNK_VALUES = 1 << 24
"""Largest number of values :meth:`RunningMoments.from_data` converts to float64 at once."""


def _all_positive(counts: Tensor) -> bool:
    """Whether every count is positive, read at once on the CPU (``False`` elsewhere: callers
    then mask, which needs no host read). A reduction rather than ``(counts > 0).all()``:
    boolean kernels are several times slower on large tensors."""
    return counts.device.type == "cpu" and counts.numel() > 0 and float(counts.amin()) > 0


def _centred(x: Tensor, mean: Tensor) -> Tensor:
    """``x - mean`` in float64, in place on the float64 copy of ``x`` when one is made."""
    return x.to(_F64).sub_(mean) if x.dtype != _F64 else x - mean


def chan_merge(
    count_a: Tensor, mean_a: Tensor, m2_a: Tensor, count_b: Tensor, mean_b: Tensor, m2_b: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Merges two sets of (count, mean, M2) element-wise; a side with count 0 is ignored.

    All arguments are float64 tensors of one shape (counts may broadcast).

    Returns:
        The merged ``(count, mean, m2)``.
    """
    has_a, has_b = count_a > 0, count_b > 0
    count = count_a + count_b
    weight_b = count_b / torch.where(count > 0, count, torch.ones_like(count))
    delta = mean_b - mean_a
    both = has_a & has_b
    mean = torch.where(both, mean_a + delta * weight_b, torch.where(has_b, mean_b, mean_a))
    m2 = torch.where(both, m2_a + m2_b + delta * delta * (count_a * weight_b), torch.where(has_b, m2_b, m2_a))
    return count, mean, m2


def merge_counted(mean_a: Tensor, m2_a: Tensor, count_a: int, mean_b: Tensor, m2_b: Tensor, count_b: int) -> None:
    """Merges ``count_b`` values of ``mean_b``/``m2_b`` into ``count_a`` values of
    ``mean_a``/``m2_a``, in place, element-wise — :func:`chan_merge` for counts that are the
    same for every element and known on the host: four kernels instead of about twenty, no
    count tensors, and either side may be empty (count 0: ``mean_a``/``m2_a`` are then
    overwritten, whatever they hold).

    Example:
        >>> import torch
        >>> f64 = lambda *v: torch.tensor(v, dtype=torch.float64)
        >>> mean, m2 = f64(2.0), f64(2.0)  # {1, 3}
        >>> merge_counted(mean, m2, 2, f64(5.0), f64(0.0), 1)  # ∪ {5}
        >>> mean.item(), m2.item()
        (3.0, 8.0)
    """
    if count_b <= 0:
        return
    if count_a <= 0:
        mean_a.copy_(mean_b)
        m2_a.copy_(m2_b)
        return
    weight = count_b / (count_a + count_b)
    delta = mean_b - mean_a
    mean_a.add_(delta, alpha=weight)
    m2_a.add_(m2_b).addcmul_(delta, delta, value=count_a * weight)


class RunningMoments:
    """Count, mean and M2 (sum of squared deviations) per channel, in float64.

    Attributes:
        count: Number of values seen per channel (float64, exact up to 2**53).
        mean: Mean per channel.
        m2: Sum of squared deviations from ``mean`` per channel.
    """

    __slots__ = ("count", "m2", "mean")

    def __init__(self, count: Tensor, mean: Tensor, m2: Tensor) -> None:
        # (the dtype read first: a no-op .to() still costs a dispatch, and moments are made often)
        self.count = count if count.dtype is _F64 else count.to(_F64)
        self.mean = mean if mean.dtype is _F64 else mean.to(_F64)
        self.m2 = m2 if m2.dtype is _F64 else m2.to(_F64)

    @classmethod
    def zeros(cls, shape: int | Sequence[int], device: torch.device | str | None = None) -> RunningMoments:
        """Empty moments (count 0) of the given shape."""
        z = torch.zeros(shape, dtype=_F64, device=device)
        return cls(z, z.clone(), z.clone())

    @classmethod
    def from_data(cls, x: Tensor, channel_dim: int = 1) -> RunningMoments:
        """Moments of ``x`` per index of ``channel_dim``, pooled over every other dimension.

        The reduction runs in float64 (two passes: the mean, then the squared deviations
        from it), whatever the dtype of ``x``. A large tensor is reduced in slices along
        its first other dimension, so that the float64 copies made on the way stay below
        about :data:`CHUNK_VALUES` values (128 MiB) rather than twice the tensor's size.
        """
        if x.dim() == 0:
            raise ValueError("from_data needs at least one dimension (the channels)")
        x = x.detach()
        channel_dim %= x.dim()
        dims = [d for d in range(x.dim()) if d != channel_dim]
        channels = x.shape[channel_dim]
        count = x.numel() // channels if channels else 0
        if count == 0:
            return cls.zeros(channels, device=x.device)
        if not dims:
            xd = x.to(_F64)
            return cls(torch.ones_like(xd), xd.clone(), torch.zeros_like(xd))
        shape = [1] * x.dim()
        shape[channel_dim] = channels
        split = dims[0]  # sliced along this dimension when large
        step = max(1, CHUNK_VALUES // max(1, x.numel() // x.shape[split]))
        if step >= x.shape[split]:  # one piece: a single float64 copy, centred in place
            xd = x.to(_F64)
            mean = xd.sum(dims).div_(count)
            centred = xd.sub_(mean.view(shape)) if xd is not x else xd - mean.view(shape)
            return cls(torch.full_like(mean, float(count)), mean, centred.square_().sum(dims))
        pieces = list(x.split(step, split))
        mean = sum(p.to(_F64).sum(dims) for p in pieces) / count
        m2 = sum(_centred(p, mean.view(shape)).square_().sum(dims) for p in pieces)
        return cls(torch.full_like(mean, float(count)), mean, m2)

    @classmethod
    def from_batches(cls, counts: Tensor, means: Tensor, m2s: Tensor) -> RunningMoments:
        """Pools K sets of moments stacked along dimension 0 (shape ``[K, ...]``).

        Rows with count 0 are ignored whatever their mean and M2 hold (even NaN).
        Uses the two-pass form: the pooled mean first, then the deviations from it.
        """
        counts, means, m2s = counts.to(_F64), means.to(_F64), m2s.to(_F64)
        if not _all_positive(counts):  # rows without values must not leak NaN in
            present = counts > 0
            zero = torch.zeros((), dtype=_F64, device=counts.device)
            counts = torch.where(present, counts, zero)
            means = torch.where(present, means, zero)
            m2s = torch.where(present, m2s, zero)
        total = counts.sum(0)
        mean = (counts * means).sum(0).div_(total.clamp_min(1))
        dev = means - mean
        m2 = dev.square_().mul_(counts).sum(0).add_(m2s.sum(0))
        return cls(total, mean, m2)

    def merge(self, other: RunningMoments) -> None:
        """Adds ``other``'s values to these moments, in place."""
        self.count, self.mean, self.m2 = chan_merge(self.count, self.mean, self.m2, other.count, other.mean, other.m2)

    @classmethod
    def from_shifted_sums(cls, count: Tensor, shift: Tensor, s1: Tensor, s2: Tensor) -> RunningMoments:
        """Moments from sums taken around a fixed shift ``K`` (the shifted-data algorithm).

        With ``s1 = Σ (x - K)`` and ``s2 = Σ (x - K)²`` over ``count`` values:
        ``mean = K + s1 / n`` and ``M2 = s2 - s1² / n``. In float64 the cancellation in
        ``M2`` costs about ``2⁻⁵³ · ((mean - K) / std)²`` relative error: negligible
        whenever ``K`` is within a few thousand standard deviations of the mean (e.g.
        the first batch's mean). Where ``count`` is 0 the sums must be 0 too (no value
        added): there ``mean = K`` and ``M2 = 0``.
        """
        offset = s1 / count.clamp_min(1)
        return cls(count, shift + offset, torch.sub(s2, s1 * offset).clamp_min_(0))  # 0 where the sums are

    def update(self, x: Tensor, channel_dim: int = 1) -> None:
        """Adds the values of a raw tensor (see :meth:`from_data`), in place."""
        self.merge(RunningMoments.from_data(x, channel_dim))

    @property
    def var(self) -> Tensor:
        """Population (biased) variance ``M2 / count``; NaN where count is 0."""
        return self.m2 / self.count

    @property
    def unbiased_var(self) -> Tensor:
        """Sample (unbiased) variance ``M2 / (count - 1)``."""
        return self.m2 / (self.count - 1)

    def __getitem__(self, index: slice | Tensor) -> RunningMoments:
        return RunningMoments(self.count[index], self.mean[index], self.m2[index])

    def to(self, device: torch.device | str) -> RunningMoments:
        """A copy on ``device``."""
        return RunningMoments(self.count.to(device), self.mean.to(device), self.m2.to(device))

    def __repr__(self) -> str:
        return f"RunningMoments(channels={tuple(self.mean.shape)}, device={self.mean.device})"


def fold_errors(folds: RunningMoments) -> tuple[RunningMoments, Tensor, Tensor]:
    """Pooled moments and their standard errors from moments kept per fold.

    ``folds`` has shape ``(K, channels)``: the values split into K disjoint folds (e.g.
    batches interleaved into K groups). The pooled moments are exact (as if never split);
    the standard errors come from the delete-one-fold jackknife over the folds that hold
    values: with ``θ_(-k)`` the estimate without fold k and K' such folds,
    ``SE² = (K' - 1) / K' · Σ_k (θ_(-k) - mean_k θ_(-k))²``. The folds must be
    exchangeable (e.g. batches of shuffled data dealt round-robin) for the errors to mean
    anything.

    Returns:
        ``(pooled, se_mean, se_var)``: ``se_mean`` is the standard error of the mean in
        units of the pooled standard deviation, ``se_var`` that of the population
        variance relative to it; both NaN where fewer than two folds hold values (0 where
        the variance and its error are both 0, infinite where only the variance is).

    Example:
        >>> import torch
        >>> x = torch.arange(8.0).reshape(8, 1)  # 8 values of one channel
        >>> folds = [RunningMoments.from_data(x[k::4], 1) for k in range(4)]  # 4 folds of 2
        >>> stacked = RunningMoments(*(torch.stack([getattr(f, a) for f in folds]) for a in ("count", "mean", "m2")))
        >>> pooled, se_mean, se_var = fold_errors(stacked)
        >>> pooled.mean.tolist(), pooled.var.tolist()
        ([3.5], [5.25])
    """
    if folds.count.shape[0] == 1:  # one fold: nothing to compare it with
        nan = torch.full_like(folds.mean[0], float("nan"))
        return RunningMoments.from_batches(folds.count, folds.mean, folds.m2), nan, nan.clone()
    if _all_positive(folds.count):  # the usual case on the CPU
        return _fold_errors_dense(folds)
    return _fold_errors_general(folds)


def _fold_errors_dense(folds: RunningMoments) -> tuple[RunningMoments, Tensor, Tensor]:
    """:func:`fold_errors` when every fold holds values: the folds as sums around the pooled
    mean, then :func:`fold_errors_from_sums` (no masking; three ``(K, channels)`` buffers,
    reused in place: fresh large buffers cost page faults)."""
    n_k, mean_k, m2_k = folds.count, folds.mean, folds.m2
    a = torch.mul(n_k, mean_k)
    shift = a.sum(0).div_(n_k.sum(0))  # the pooled mean: no cancellation in the sums around it
    d = torch.sub(mean_k, shift, out=a)
    s1 = torch.mul(d, n_k)
    s2 = torch.addcmul(m2_k, s1, d)  # M2_k + n_k (mean_k - shift)²
    return fold_errors_from_sums(a.copy_(n_k), shift, s1, s2, overwrite=True)


def fold_errors_from_sums(
    count: Tensor, shift: Tensor, s1: Tensor, s2: Tensor, *, overwrite: bool = False
) -> tuple[RunningMoments, Tensor, Tensor]:
    """:func:`fold_errors` of folds kept as sums around a shift (see
    :meth:`RunningMoments.from_shifted_sums`): ``count``, ``s1`` and ``s2`` of shape
    ``(K, channels)``, ``shift`` of shape ``(channels,)``.

    Every fold must hold values (``count > 0``) in every channel, and ``K >= 2``; where
    that does not hold the results mean nothing. The delete-one-fold estimates come from
    the sums without fold k, ``S - s_k``: ``mean_(-k) = K + (S1 - s1_k) / (n - n_k)`` and
    ``var_(-k) = (S2 - s2_k) / (n - n_k) - (mean_(-k) - K)²`` (the shifted-sums
    cancellation again, negligible for a shift within a few thousand standard deviations
    of the mean). No host read.

    Args:
        overwrite: ``count``, ``s1`` and ``s2`` may serve as scratch space (their values
            are then lost): no ``(K, channels)`` buffer is allocated.

    Example:
        >>> import torch
        >>> x = torch.arange(8.0, dtype=torch.float64).reshape(4, 2)  # 4 folds of 2 values, one channel
        >>> k = torch.tensor([1.0], dtype=torch.float64)  # the shift
        >>> n = torch.full((4, 1), 2.0, dtype=torch.float64)
        >>> s1, s2 = (x - k).sum(1, keepdim=True), (x - k).square().sum(1, keepdim=True)
        >>> pooled, se_mean, se_var = fold_errors_from_sums(n, k, s1, s2)
        >>> pooled.mean.tolist(), pooled.var.tolist()
        ([3.5], [5.25])
        >>> folds = RunningMoments.from_shifted_sums(n, k.expand(4, 1), s1, s2)
        >>> bool(torch.allclose(se_var, fold_errors(folds)[2]))
        True
    """
    k = count.shape[0]
    n = count.sum(0)
    total1, total2 = s1.sum(0), s2.sum(0)
    pooled = RunningMoments.from_shifted_sums(n, shift, total1, total2)
    if not overwrite:
        count, s1, s2 = count.clone(), s1.clone(), s2.clone()
    inv_rest = torch.sub(n, count, out=count).reciprocal_()  # 1 / (n - n_k)
    mean_out = torch.sub(total1, s1, out=s1).mul_(inv_rest)  # mean_(-k) - K
    var_out = torch.sub(total2, s2, out=s2).mul_(inv_rest).addcmul_(mean_out, mean_out, value=-1).clamp_min_(0)
    scale, var = _scales(pooled.m2 / n)
    se_mean, se_var = _spread(mean_out.div_(scale.sqrt()), k), _spread(var_out.div_(scale), k)
    return pooled, *_relative(se_mean, se_var, var)


def _scales(var: Tensor) -> tuple[Tensor, Tensor]:
    """The jackknife's estimates are divided by the pooled variance (its square root for the means) before their
    spread is taken, where it is positive: squared in the units of the data, variances beyond about 1e154 overflowed
    float64 and below 1e-154 underflowed (a float64 layer: every error infinite, or 0 — "±0%"). Returns that divisor
    (1 elsewhere) and what :func:`_relative` then divides by: 1 where it divided already, else the variance."""
    positive = var > 0
    return torch.where(positive, var, 1.0), torch.where(positive, 1.0, var)


def _spread(values: Tensor, k: int) -> Tensor:
    """The jackknife's ``sqrt((K - 1) / K · Σ_k (θ_k - mean θ)²)`` over dimension 0, in
    place on ``values``."""
    return values.sub_(values.sum(0).div_(k)).square_().sum(0).mul_((k - 1) / k).sqrt_()


def _relative(se_mean: Tensor, se_var: Tensor, var: Tensor) -> tuple[Tensor, Tensor]:
    """The errors in σ (mean) and relative to the variance, in place: infinite where only
    the variance is 0, and 0 where both are (0 / 0, the only NaN that values without NaN
    can give here)."""
    inf = float("inf")
    return (
        se_mean.div_(var.sqrt()).nan_to_num_(nan=0.0, posinf=inf, neginf=-inf),
        se_var.div_(var).nan_to_num_(nan=0.0, posinf=inf, neginf=-inf),
    )


def _fold_errors_general(folds: RunningMoments) -> tuple[RunningMoments, Tensor, Tensor]:
    """:func:`fold_errors` with folds that may hold no values (and on any device: no host read)."""
    pooled = RunningMoments.from_batches(folds.count, folds.mean, folds.m2)
    n, mean, m2 = pooled.count, pooled.mean, pooled.m2
    n_k = folds.count
    rest = n - n_k
    used = (n_k > 0) & (rest > 0)
    rest.masked_fill_(~used, 1)
    # without fold k (in place, few temporaries; the jackknife is shift-invariant and
    # sign-blind, so the mean's deviation is taken as n_k (mean_k - mean) / (n - n_k)):
    #   mean_(-k) - mean = -n_k (mean_k - mean) / (n - n_k)
    #   var_(-k) = (M2 - M2_k - n_k n (mean_k - mean)^2 / (n - n_k)) / (n - n_k)
    d = folds.mean - mean
    mean_out = d.mul(n_k).div_(rest).masked_fill_(~used, 0)
    var_out = torch.sub(m2, folds.m2).sub_(d.mul_(mean_out).mul_(n)).clamp_min_(0).div_(rest).masked_fill_(~used, 0)
    k = used.sum(0).to(_F64)
    factor = (k - 1) / k.clamp_min(1)

    def spread(values: Tensor) -> Tensor:
        centre = values.sum(0).div_(k.clamp_min(1))
        return values.sub_(centre).masked_fill_(~used, 0).square_().sum(0).mul_(factor).sqrt_()

    scale, var = _scales(m2 / n.clamp_min(1))
    se_mean, se_var = spread(mean_out.div_(scale.sqrt())), spread(var_out.div_(scale))
    rel_mean, rel_var = _relative(se_mean, se_var, var)
    nan = torch.full_like(rel_mean, float("nan"))
    return pooled, torch.where(k >= 2, rel_mean, nan), torch.where(k >= 2, rel_var, nan)
