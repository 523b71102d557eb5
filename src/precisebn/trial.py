"""What a layer's calls showed in the batch that verifies its fast path.

In the first batch that calls a layer (see :mod:`~precisebn.capture`), each call records
what it normalised with its running buffers and how it compares with the figures the layer
left behind: :class:`Trial` keeps that per layer until the end of the batch, when the layer
keeps the fast path or moves to the float64 path with that batch's float64 moments
(:meth:`Trial.resolve`); :func:`fitting` says whether a call can be read through its own
figures at all.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .spotcheck import passes, rounding_passes
from .stats import RunningMoments
from .watch import TOLERANCE, moments_of

__all__ = ["Trial", "fitting"]


def fitting(seen: list[Tensor], x: Tensor, channels: int) -> Tensor | None:
    """What a call normalised, if it fits the fast path: exactly one tensor, of the input's
    size, with the layer's channels in dimension 1 (else ``None``)."""
    if len(seen) != 1:
        return None
    t = seen[0]
    shape = t.shape
    if len(shape) < 2 or shape[1] != channels or (t is not x and t.numel() != x.numel()):
        return None
    return t


class Trial:
    """What one layer's calls showed in the batch that verifies its fast path."""

    __slots__ = ("calls", "counted", "counts", "fits", "off", "refs", "slot")

    def __init__(self, counts: int) -> None:
        self.counts = counts  # the layer's count before this batch
        self.fits = True  # one normalised tensor per call, of the input's size and channels
        self.off = False  # a call's own figures were checked at once, and were off
        self.counted = True  # each call incremented the layer's num_batches_tracked once
        # where the figures of the call being recorded are found at the end of the batch: their index
        # among the layer's figures then (the figures kept when it was called again, in order, then what
        # its buffers hold); set by the caller before each call is recorded (calls inside the layer's own
        # call, which have no figures of their own, make it differ from the call's index)
        self.slot = 0
        # (figures' slot, float64 moments of what the call normalised): compared with its figures in _settle
        self.refs: list[tuple[int, RunningMoments]] = []
        # per call: (values per channel counted from its input, float64 moments of what it normalised
        # or None if nothing, their values per channel, the slot of its own figures if they passed the
        # check made at once — its moments are then those figures, built by resolve() only if needed)
        self.calls: list[tuple[int, RunningMoments | None, int, int | None]] = []

    def add_checked(self, t: Tensor, x: Tensor, channels: int, n: int, pair: Tensor, eps: float) -> None:
        """On the CPU, for float64 figures (held to 1e-10): checks this call's figures (``pair``:
        its mean and unbiased variance, shape ``(2, C)``) at once against a two-pass float64
        reduction of ``t``, what it normalised, on every channel — torch's float64 sums round by
        about √n·2⁻⁵³·|mean| per channel, so the channels furthest from 0 may fail where a few
        spread ones pass (probe 33a: 2.1e-9 σ, 21 times the tolerance, read on 4 unchecked
        channels at |mean|/σ = 1e5) — and the rounding term over every channel (bounded first
        from the extremes of the figures, computed exactly only where that bound is too loose).
        A call that passes keeps its figures as its moments; one that fails, that reduction."""
        exact = RunningMoments.from_data(t, 1)
        tolerance = TOLERANCE[pair.dtype]
        figures = pair.detach().to(torch.float64)
        reference = (exact.mean, exact.m2 / (n - 1), 0.0, 0.0)  # (no error bound: a two-pass float64 reduction)
        ok = rounding_passes(pair, eps, torch.finfo(pair.dtype).eps / 2, tolerance) and bool(
            passes(figures[0], figures[1], reference, eps, tolerance).all()
        )  # NaN fails too
        self.checked(ok, [t], x, channels, n, exact)

    def checked(
        self, ok: bool, seen: list[Tensor], x: Tensor, channels: int, n: int, exact: RunningMoments | None = None
    ) -> None:
        """Records a call whose own figures were checked at once: kept as its moments if they
        passed (``ok``), else what it normalised (``seen``) is reduced in float64 now (``exact``:
        that reduction, if the check made it already)."""
        self.calls.append((n, None, n, self.slot))
        if not ok:
            self.off = True
            if exact is None:
                self.redo(len(self.calls) - 1, seen, x, channels, n)
            else:
                self.calls[-1] = (n, exact, n, None)

    def redo(self, k: int, seen: list[Tensor], x: Tensor, channels: int, n: int) -> None:
        """Call ``k``, whose own figures failed their check: its moments are those of what it
        normalised (``seen``), reduced in float64 whole."""
        self.calls[k] = (n, moments_of(seen), sum(t.numel() // channels for t in seen), None)

    def add(self, seen: list[Tensor], x: Tensor, channels: int, n: int, figures: bool = True) -> None:
        """Records a call by the float64 moments of what it normalised (``seen``), to be compared
        with its figures at the end of the batch if it fits the fast path — never if its
        normalization did not overwrite the buffers with figures (``figures=False``)."""
        moments = moments_of(seen)
        values = sum(t.numel() // channels for t in seen)
        self.calls.append((n, moments, values, None))
        if moments is None or not figures or fitting(seen, x, channels) is None:
            self.fits = False
        else:
            self.refs.append((self.slot, moments))

    def resolve(self, figures: list[tuple[Tensor, Tensor]]) -> RunningMoments | None:
        """float64 moments of everything the layer normalised in this batch (None if nothing),
        each call's own figures standing for a call whose figures passed the check at once;
        ``figures`` holds the layer's figures (mean, unbiased variance) by slot (see :attr:`slot`)."""
        total = None
        for j, (n, moments, values, slot) in enumerate(self.calls):
            if slot is not None:
                mean, var = figures[slot]
                count = torch.full_like(mean, float(n), dtype=torch.float64)
                moments = RunningMoments(count, mean.to(torch.float64, copy=True), var.double() * (n - 1))
                self.calls[j] = (n, moments, values, None)
            if moments is None:
                continue
            if total is None:
                total = RunningMoments(moments.count, moments.mean, moments.m2)  # merge() rebinds, never mutates
            else:
                total.merge(moments)
        return total
