"""Batch figures recomputed where torch's own kernel may round them past the tolerance.

On the CPU, torch's BatchNorm kernel for inputs whose channels are adjacent in memory
(channels_last, ``(N, C)``) sums each channel's values one after another in float32. That
is recursive summation: its error grows with the number of values ``n``, at worst as
``(n - 1)·u`` of the sum (``u = 2⁻²⁴``), and it reaches that worst case on values that
repeat — blank or padded frames, letterboxing, a constant region — where every rounding
goes the same way. Measured (one thread, each channel ``±a``, the variance's error relative
to the variance): 7.4e-6 at 1,000 values per channel, 1.2e-3 at 100,000; a channels_last
``BatchNorm2d`` fed 8 such batches of 8×32×32 after a random one was read 1.0e-4 off (a
probe), a channels_last efficientnet_b0 fed near-blank frames 1.1e-5 to 2.8e-5 off.

A layer's first (verifying) call is checked on every channel against a float64 reduction,
but later calls rounding this way cannot be told from the ones that passed by their size or
their ``|mean|/σ``. So a call of more than :data:`EXACT_UP_TO` values per channel in that
layout has its figures recomputed from what it normalised by :func:`refigure`: shifted by
torch's own mean (close to the true one), then summed, and summed squared, by ``torch.sum``
— a cascade summation whose error grows with the logarithm of ``n`` — in the input's own memory
layout, slice by slice, the slices' sums added in float64
(:func:`~precisebn.spotcheck.every_channel_sums`, with a float32 shift). It costs about one more
statistics pass of the layer. Measured on the same values: 3.4e-7 at 100,000 values per channel,
6.6e-7 at 4,000,000.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .spotcheck import every_channel_sums

__all__ = ["EXACT_UP_TO", "float64_mean", "refigure", "remean"]

EXACT_UP_TO = 84
"""Values per channel up to which torch's float32 variance is within the float32 tolerance (1e-5 of the variance)
whatever the values: recursive summation of ``n`` non-negative terms errs by at most ``(n - 1)·u`` of their sum, and
``83·2⁻²⁴ < 5e-6`` leaves half of the tolerance to the mean's own rounding. Its mean, though, may err by up to
``(n - 1)·u·|mean|``, which the spread between batches' means multiplies by ``|mean|/σ`` in the pooled variance
(a probe: 1.2e-4 of it at ``|mean|/σ`` = 80 and 84 values, 3.4e-5 on random data): such calls' means are summed
again in float64 (:func:`remean`)."""


def refigure(t: Tensor, pair: Tensor) -> None:
    """Overwrites the figures ``pair`` (``(2, C)`` float32: batch mean, unbiased variance; a layer's
    scratch) of one call that normalised ``t`` (channels in dimension 1, at least 2 values each) with
    figures recomputed from ``t`` (see the module's docstring): within a few ``u`` of the float64
    ones rather than ``n·u``.

    >>> import torch
    >>> t = torch.tensor([[1.0, 10.0], [3.0, 14.0], [5.0, 18.0]])
    >>> pair = torch.tensor([[2.9, 14.2], [0.0, 0.0]])  # (torch's figures, slightly off)
    >>> refigure(t, pair)
    >>> pair.tolist()
    [[3.0, 14.0], [4.0, 16.0]]
    """
    n = t.numel() // t.shape[1]
    s1, s2 = every_channel_sums(t, pair[0])  # (shifted by torch's mean, float32: reduced in float32, slices added)
    torch.div(s2.addcmul_(s1, s1, value=-1.0 / n).clamp_min_(0.0), n - 1, out=pair[1])
    pair[0].add_(s1, alpha=1.0 / n)


def remean(t: Tensor, pair: Tensor) -> None:
    """Overwrites the batch mean in the figures ``pair`` (``(2, C)`` float32; a layer's scratch) of one call that
    normalised ``t`` (channels in dimension 1; at most :data:`EXACT_UP_TO` values each, in torch's float32
    recursive summation) with ``t``'s mean summed in float64: rounded once to float32, as the pooled variance's
    bound takes it (see :func:`~precisebn.measure._warn_far_from_zero`), rather than by up to ``(n - 1)·u·|mean|``.
    The variance, which torch computes around its own mean, moves by ``δ²`` at most: left as it is. A call of no
    values (an empty selection of rows) leaves nothing to sum: its figures stay as they are. (A layer with a forward
    of its own, whose input is only assumed to be what it normalised, has its input's mean taken only where the two
    agree: :meth:`~precisebn.capture.Collector._agreed`, all such calls of a batch at once.)

    >>> import torch
    >>> t = torch.tensor([[1.0, 10.0], [3.0, 14.0], [5.0, 18.0]])
    >>> pair = torch.tensor([[2.9, 14.2], [4.0, 16.0]])  # (torch's figures, the means slightly off)
    >>> remean(t, pair)
    >>> pair.tolist()
    [[3.0, 14.0], [4.0, 16.0]]
    """
    mean = float64_mean(t)
    if mean is not None:
        pair[0].copy_(mean)


def float64_mean(t: Tensor) -> Tensor | None:
    """The mean of ``t`` per channel (dimension 1), summed in float64; ``None`` for no values.

    >>> float64_mean(torch.tensor([[1.0, 10.0], [2.0, 20.0]])).tolist()
    [1.5, 15.0]
    """
    n = t.numel() // t.shape[1] if t.dim() > 1 and t.shape[1] else 0
    if n == 0:
        return None
    return t.detach().sum([d for d in range(t.dim()) if d != 1], dtype=torch.float64).div_(n)
