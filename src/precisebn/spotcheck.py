"""Checking layers' own float32 figures on the CPU: a few channels per call, many calls at once.

In the batch that verifies a layer, its figures (the batch mean and unbiased variance it
left in its buffers) are compared with a float64 reduction of what it normalised. On the
CPU, where reading a value costs no synchronisation, that reduction covers only
:data:`CHECKED_CHANNELS` channels spread over the layer — a float64 copy of every input
would cost more than the check is worth — and the rounding term is computed over every
channel from the figures (see :func:`~precisebn.watch.discrepancies`). A caller may ask for every
channel instead (``every=True``: inputs whose kernel rounds most on channels a few would miss).

Each call copies its checked channels, as float64 and channel after channel, into one
workspace (one kernel), and its check waits there — unless its input is larger than
:data:`AT_ONCE`, which is checked at once (:meth:`SpotChecks.check_now`, the same check on
its own) rather than held. :meth:`SpotChecks.run` makes the
checks of every waiting call together — a few dozen small kernels (four more per run of
calls with as many values per channel) and one host read, whatever their number — when
the workspace is full or :data:`HELD` bytes of inputs are held, before a waiting layer is
called again (which overwrites its figures), and at the end of the batch. The calls'
inputs are held until then, so that a call whose figures fail can still be reduced in
float64 whole.

The reference is exact up to a bound that the check takes off its tolerance, so that its
own error can never let off figures: the values are shifted by the figure's mean before
they are summed (in float64, in any order), so the bound is
``4 (n + 2) u r² n/(n - 1)`` on the variance (and ``2 (n + 2) u r`` on the mean), with
``u = 2⁻⁵³`` and ``r²`` the mean square of the shifted values — about the variance
itself, whatever the mean, when the figures are right.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

__all__ = [
    "AT_ONCE",
    "CAPACITY",
    "CHECKED_CHANNELS",
    "HELD",
    "PARTIAL_MARGIN",
    "SpotChecks",
    "checked_channels",
    "every_channel_sums",
    "passes",
    "reference",
    "references",
    "rounding_passes",
]

CHECKED_CHANNELS = 4
"""Channels of each call reduced in float64 to check its figures on the CPU."""

CAPACITY = 1 << 18
"""float64 values the workspace holds (2 MiB) before the waiting checks are made: a model of a few dozen
layers on small inputs is checked in one go. One such workspace is kept between passes (see below)."""

HELD = 32 << 20
"""Bytes of the waiting calls' inputs held (for a call that fails) before the checks are made."""

AT_ONCE = 1 << 18
"""Bytes of input above which a call is checked at once (:meth:`SpotChecks.check_now`) instead
of waiting: holding a large input makes the forward passes after it take fresh memory (page
faults), while checking a small call on its own costs more than its share of a run. Measured
on one-batch calls (paired, 40 rounds; held / 1 MiB / 256 KiB / every call at once): resnet26d
24.1 / 23.0 / 21.5 / 16.1 ms, mobilenetv3 25.8 / 24.5 / 23.9 / 27.1, mnasnet_small 21.7 / 22.4 /
23.3 / 27.0 — medians within a few milliseconds of each other on this machine."""

PARTIAL_MARGIN = 4.0
"""How much tighter than the tolerance a call's figures, checked on every channel, must be for the call to
vouch for later calls up to twice as far from 0 (:meth:`SpotChecks.check_now` with ``every``; see
:meth:`~precisebn.layercall.LayerCall.passed`)."""

_UNIT = 2.0**-53  # unit roundoff of float64

# One workspace of CAPACITY values kept between passes (2 MiB, once a pass has used it): a fresh one
# costs a page fault per 4 KiB it fills, in every pass — about as much as the copies themselves. A pass
# takes it while its checks wait and gives it back when they have run; a pass that finds it taken (two
# passes at once, in threads or nested) makes its own. Taken and given back by single list operations, atomic
# under the GIL, not under a lock: a Ctrl-C as `with lock:` was entered left a lock held, and every later pass
# in the process waited for it forever (probe 40).
_spare: list[Tensor] = []


def _take_workspace(size: int) -> Tensor:
    try:
        spare = _spare.pop()
    except IndexError:
        spare = None
    if spare is not None and spare.numel() == size:
        return spare
    with torch.inference_mode(False):
        return torch.empty(size, dtype=torch.float64, device="cpu")


def _give_back(workspace: Tensor) -> None:
    if workspace.numel() == CAPACITY and not workspace.is_inference() and not _spare:  # (one would fail every
        _spare.append(workspace)  # later pass; two passes giving theirs back at once may keep both: 4 MiB)


def checked_channels(channels: int) -> slice:
    """Up to :data:`CHECKED_CHANNELS` channels spread evenly over the layer's, from the first
    to (about) the last, as a slice: taking them makes a view, not a copy."""
    step = max(1, (channels - 1) // (CHECKED_CHANNELS - 1))
    return slice(0, step * (CHECKED_CHANNELS - 1) + 1, step)


@functools.lru_cache(maxsize=256)
def _picked(channels: int, every: bool = False) -> tuple[int, tuple[int, ...]]:
    """The step between the checked channels of a layer, and those channels (``every``: all of them)."""
    idx = slice(None) if every else checked_channels(channels)
    return idx.step or 1, tuple(range(channels)[idx])


def reference(sums: Tensor, squares: Tensor, shifts: Tensor, n: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """float64 ``(mean, unbiased variance, bound on the mean's error, bound on the variance's
    error)`` of ``n`` values each, elementwise, from float64 sums, in any order, of the values
    shifted by ``shifts`` (each ``x - shift`` rounded once) and of their squares.

    The bounds follow from |error of a sum of n terms| ≤ γₙ · Σ|term| (Higham, *Accuracy and
    Stability of Numerical Algorithms*, §4.2) with Σ|x - K| ≤ n·r (Cauchy–Schwarz), where
    ``r²`` is the mean square of the shifted values.

    >>> import torch
    >>> f64 = lambda *v: torch.tensor(v, dtype=torch.float64)
    >>> mean, var, _, _ = reference(f64(6.0), f64(20.0), f64(1.0), f64(4.0))  # 1, 1, 3, 5 shifted by 1
    >>> mean.item(), var.item()
    (2.5, 3.6666666666666665)
    """
    d = sums / n
    mean = shifts + d
    var = (squares - sums * d).clamp_min_(0.0).div_(n - 1)
    r2 = squares / n
    bound_mean = (n + 2).mul_(2 * _UNIT).mul_(r2.sqrt()).add_(mean.abs(), alpha=2 * _UNIT)
    bound_var = (n + 2).mul_(4 * _UNIT).mul_(r2).mul_(n).div_(n - 1).add_(var, alpha=2 * _UNIT)
    return mean, var, bound_mean, bound_var


def references(values: Tensor, lengths: list[int], shifts: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`reference` of each segment of the float64 vector ``values`` (consecutive
    segments of ``lengths``), each shifted by its ``shifts``: consecutive segments of one
    length are reduced as the rows of one matrix (a few kernels each; a segmented sum
    kernel is several times slower on the CPU), no host read. ``values`` is overwritten."""
    runs = [(n, len(list(run))) for n, run in itertools.groupby(lengths)]
    return _references(values, runs, shifts)


def _references(
    values: Tensor, runs: list[tuple[int, int]], shifts: Tensor, n_per_row: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`references` with the lengths as runs ``(length, segments)`` (``n_per_row``: each segment's length
    as a float64 vector, if made already; it is not written)."""
    total = sum(rows for _, rows in runs)
    sums = torch.empty(total, dtype=torch.float64, device="cpu")
    squares = torch.empty(total, dtype=torch.float64, device="cpu")
    at = row = 0
    for n, rows in runs:
        block = values[at : at + rows * n].view(rows, n).sub_(shifts[row : row + rows, None])
        _row_sums(block, sums[row : row + rows])
        _row_sums(block.square_(), squares[row : row + rows])
        at, row = at + rows * n, row + rows
    if n_per_row is None:
        n_per_row = torch.tensor([n for n, _ in runs], dtype=torch.float64, device="cpu").repeat_interleave(
            torch.tensor([rows for _, rows in runs], device="cpu")
        )
    return reference(sums, squares, shifts, n_per_row)


def _row_sums(block: Tensor, out: Tensor | None = None) -> Tensor:
    """The sums of a float64 matrix's rows: for short rows by a matrix-vector product (torch's
    reduction over a short last dimension is ~20x slower on the CPU: every channel of a call with
    2 values each), in any order (the reference's bound holds for any)."""
    if block.shape[1] < 32:
        return torch.mv(block, block.new_ones(block.shape[1]), out=out)
    return torch.sum(block, 1, out=out)


def passes(
    fig_mean: Tensor, fig_var: Tensor, ref: tuple[Tensor | float, ...], eps: Tensor | float, tolerance: float
) -> Tensor:
    """Whether each channel's figures match the reference ``(mean, var, bound_mean,
    bound_var)``: ``|Δmean| / σ`` and ``|Δvar| / (var + eps)`` within ``tolerance`` after the
    reference's error bounds are taken off it (NaN fails); elementwise, float64."""
    return _within(_offsets(fig_mean, fig_var, ref, eps), tolerance)


def _offsets(
    fig_mean: Tensor, fig_var: Tensor, ref: tuple[Tensor | float, ...], eps: Tensor | float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """What :func:`passes` compares, computed once for any number of tolerances: ``(|Δmean| + its bound, σ,
    |Δvar| + its bound, var + eps)``."""
    mean, var, bound_mean, bound_var = ref
    scale: Tensor = var + eps  # type: ignore[assignment]  (a tensor: the reference's variances are)
    off_mean = (fig_mean - mean).abs_().add_(bound_mean)
    off_var = (fig_var - var).abs_().add_(bound_var)
    return off_mean, scale.sqrt(), off_var, scale


def _within(offsets: tuple[Tensor, Tensor, Tensor, Tensor], tolerance: float) -> Tensor:
    """:func:`passes` from its :func:`_offsets` (NaN fails)."""
    off_mean, root, off_var, scale = offsets
    return (off_mean <= root * tolerance) & (off_var <= scale * tolerance)


def _passes_one(fm: float, fv: float, shift: float, s1: float, s2: float, n: int, eps: float, tolerance: float) -> bool:
    """:func:`passes` of one channel against :func:`reference` (same formulas, same bounds), on
    the host: figures ``fm``, ``fv``; float64 sums ``s1``, ``s2`` of ``n`` values shifted by
    ``shift`` and of their squares. NaN anywhere fails, and so do fewer than 2 values (whose
    variance :func:`reference` gives as NaN or infinite)."""
    if n < 2:
        return False
    d = s1 / n
    mean = shift + d
    var = s2 - s1 * d
    var = 0.0 if var < 0 else var / (n - 1)  # (NaN stays NaN)
    r2 = s2 / n
    bound_mean = 2 * _UNIT * (n + 2) * math.sqrt(r2) + 2 * _UNIT * abs(mean)
    bound_var = 4 * _UNIT * (n + 2) * r2 * n / (n - 1) + 2 * _UNIT * var
    scale = var + eps
    return (
        abs(fm - mean) + bound_mean <= math.sqrt(scale) * tolerance and abs(fv - var) + bound_var <= scale * tolerance
    )


def _take_reference(pair: Tensor, ref: tuple[Tensor | float, ...]) -> None:
    """Overwrites a call's figures ``pair`` that passed their check on every channel with the reference's float64
    mean and unbiased variance (rounded once to the figures' dtype). The check lets figures within the tolerance
    pass, but their errors add up over the batches: torch's float32 figures of a channels_last call, checked in the
    verifying batch at 9.3e-6 σ and 9.9e-6 of the variance off, left a timm mobileone_s0 layer's pooled variance
    1.13e-5 off after later batches (probe 40, unwarned). The reference is at hand already, so this costs nothing."""
    pair[0].copy_(ref[0])
    pair[1].copy_(ref[1])


def rounding_passes(pair: Tensor, eps: float, unit: float, tolerance: float) -> bool:
    """Whether the rounding term of a call's figures ``pair`` (``(2, C)``: means, unbiased
    variances, in a dtype of unit roundoff ``unit``), the largest ``(unit · mean)² / (var + eps)``
    over channels, is within ``tolerance``: bounded first from the figures' extremes (one kernel
    and a host read), computed over every channel only where that bound is too loose. NaN or Inf
    anywhere fails."""
    low, high = pair.aminmax(dim=1)  # (min mean, min var), (max mean, max var)
    return _rounding_passes(pair, torch.cat([low, high]).tolist(), eps, unit, tolerance)


def _rounding_passes(pair: Tensor, extremes: list[float], eps: float, unit: float, tolerance: float) -> bool:
    """:func:`rounding_passes` with the figures' extremes read already: ``[min mean, min var, max mean, max var]``."""
    if not all(map(math.isfinite, extremes)):
        return False  # NaN figures, or Inf (an infinite variance made the term 0: a kernel's float32 sum of
        # squares that overflowed on finite values, |x| ~ 1e18, on a channel not checked — probe 32a)
    low_mean, low_var, high_mean, _ = extremes
    scale = max(abs(low_mean), abs(high_mean)) * unit
    if scale * scale / (max(low_var, 0.0) + eps) <= tolerance:  # >= every channel's rounding term
        return True
    return float(pair[0].square().div_(pair[1] + eps).amax()) * unit * unit <= tolerance


def _copy_checked(t: Tensor, step: int, k: int, into: Tensor) -> None:
    """Copies the ``k`` checked channels of ``t`` (channels in dimension 1, every ``step``-th
    from the first), channel after channel, into the float64 vector ``into``: one kernel,
    whatever ``t``'s strides and storage offset."""
    t = t.detach()  # (a forward under enable_grad or forward-mode AD: the copy must not join its graph)
    shape = (k, t.shape[0], *t.shape[2:])  # channels first: one segment per channel
    strides = t.stride()
    source = t.as_strided(shape, (strides[1] * step, strides[0], *strides[2:]), t.storage_offset())
    into.view(shape).copy_(source)


def every_channel_sums(t: Tensor, shifts: Tensor, chunk: int = CAPACITY) -> tuple[Tensor, Tensor]:
    """float64 sums, per channel (dimension 1 of ``t``), of the values of ``t`` shifted by ``shifts`` and of their
    squares, computed in the shifts' dtype — float64: each ``x - shift`` rounded once, as :func:`reference` asks; a
    float32 shift reduces each slice in float32 (:func:`~precisebn.figures.refigure`) — reduced in ``t``'s own memory
    layout (a copy channel after channel across channels_last costs several times more), at most about
    ``chunk`` values at a time (slices of the first dimension, or of the rows of a channels-last view).

    >>> import torch
    >>> x = torch.tensor([[1.0, 10.0], [3.0, 14.0]])
    >>> s1, s2 = every_channel_sums(x, torch.tensor([2.0, 12.0], dtype=torch.float64), chunk=2)
    >>> s1.tolist(), s2.tolist()
    ([0.0, 0.0], [2.0, 8.0])
    """
    t = t.detach()
    channels = t.shape[1]
    rows = t.movedim(1, -1)
    if rows.is_contiguous():  # channels adjacent in memory: rows of channels, a view
        t, shape, dims = rows.reshape(-1, channels), (1, channels), [0]
    else:
        shape, dims = (1, channels, *([1] * (t.dim() - 2))), [0, *range(2, t.dim())]
    shift = shifts.reshape(shape)
    step = max(1, chunk // max(1, t[:1].numel()))
    out: list[Tensor] = []  # (the sums and the squares' sums, float64; the first slice's converted, not added)
    for part in t.split(step) if step < t.shape[0] else (t,):
        d = torch.sub(part, shift)  # (in the shift's dtype, or the input's if wider)
        sums = (d.sum(dims), d.square_().sum(dims))
        if out:
            out[0].add_(sums[0])
            out[1].add_(sums[1])
        else:
            out = [s.to(torch.float64) for s in sums]
    return out[0], out[1]


_Waiting = tuple[Any, Tensor, float, int, tuple[int, ...]]  # owner, figures (2, C), eps, values per channel, checked


class SpotChecks:
    """The checks of the calls waiting in one batch (see the module's docstring).

    Args:
        tolerance: The largest discrepancy of figures that pass (the figures' dtype's
            :data:`~precisebn.watch.TOLERANCE`).
        unit: The unit roundoff of the figures' dtype (for the rounding term).
        capacity: float64 values the workspace holds (default :data:`CAPACITY`).
    """

    def __init__(self, tolerance: float, unit: float, capacity: int | None = None) -> None:
        self.tolerance, self.unit = tolerance, unit
        self.capacity = CAPACITY if capacity is None else capacity
        self.layers: set[int] = set()  # layers with a call waiting
        self._waiting: list[_Waiting] = []
        self._workspace: Tensor | None = None
        self._used = 0
        self._held = 0  # bytes of the waiting calls' inputs

    def __len__(self) -> int:
        return len(self._waiting)

    def room(self, n: int, nbytes: int, channels: int, every: bool = False) -> bool:
        """Whether a call that normalised ``n`` values per channel (``nbytes`` in all) of
        ``channels`` (``every`` one of them checked) can wait with those waiting now: its checked
        values fit in the workspace, and the inputs held stay within :data:`HELD` bytes."""
        checked = len(_picked(channels, every)[1])
        return self._used + n * checked <= self.capacity and self._held + nbytes <= HELD

    def add(
        self, owner: Any, layer: int, t: Tensor, pair: Tensor, eps: float, nbytes: int, every: bool = False
    ) -> None:
        """Copies the checked channels of ``t`` (what the layer normalised, channels in
        dimension 1; ``nbytes`` in all, held until the checks run) and keeps the call's
        figures ``pair`` (its ``(2, C)`` view of the scratch buffer, read when the checks run)
        for :meth:`run`; make :meth:`room` first (a call alone too large for it gets a
        workspace of its own size). ``every``: every channel is checked, not a few."""
        step, picked = _picked(pair.shape[1], every)
        size = len(picked) * (t.numel() // t.shape[1])
        if self._workspace is None or self._used + size > self._workspace.numel():
            if self._used:
                raise RuntimeError("SpotChecks.add without room: run the waiting checks first")
            self._workspace = _take_workspace(max(self.capacity, size))
        _copy_checked(t, step, len(picked), self._workspace[self._used : self._used + size])
        self._waiting.append((owner, pair, eps, size // len(picked), picked))
        self._used += size
        self._held += nbytes
        self.layers.add(layer)

    @staticmethod
    def at_once(nbytes: int) -> bool:
        """Whether a call with ``nbytes`` of input is checked at once (see :data:`AT_ONCE`)."""
        return nbytes > AT_ONCE

    def check_now(self, t: Tensor, pair: Tensor, eps: float, every: bool = False) -> bool | None:
        """Checks one call at once, nothing held: whether its figures ``pair`` (its ``(2, C)``
        view of the scratch buffer, this call's) pass against ``t``, what it normalised — the
        check :meth:`run` makes, with :func:`reference`'s bounds and :func:`passes`' test, and the
        rounding term by :func:`rounding_passes`: for a few channels computed on the host (a handful
        of kernels rather than the few dozen of a run). ``every``: every channel is checked, from
        float64 sums taken in ``t``'s own memory layout, a slice of at most :data:`CAPACITY` values
        at a time (:func:`every_channel_sums`); then ``True`` means passed within
        :data:`PARTIAL_MARGIN` of the tolerance (the call vouches for others twice as far from 0,
        see :meth:`~precisebn.layercall.LayerCall.passed`), ``None`` passed, but not that comfortably."""
        if every:
            return self._check_every(t, pair, eps)
        step, picked = _picked(pair.shape[1])
        k = len(picked)
        n = t.numel() // t.shape[1]
        taken = None
        if self._workspace is not None and self._used + k * n <= self._workspace.numel():
            values = self._workspace[self._used : self._used + k * n]  # past the waiting calls' values
        else:  # the kept workspace if it is free and large enough (a fresh one costs page faults)
            taken = _take_workspace(self.capacity if k * n <= self.capacity else k * n)
            values = taken[: k * n]
        try:
            _copy_checked(t, step, k, values)
            figures = pair[:, checked_channels(pair.shape[1])]
            block = values.view(k, n).sub_(figures[0].unsqueeze(1))  # shifted by the figures' means
            s1 = _row_sums(block)  # (new: the workspace is free)
            s2 = _row_sums(block.square_())
        finally:
            if taken is not None:
                _give_back(taken)
        # one host read: the checked figures, the extremes of every channel's (for the rounding term), the sums
        low, high = pair.aminmax(dim=1)
        host = torch.cat([figures[0], figures[1], low, high, s1, s2]).tolist()
        if not _rounding_passes(pair, host[2 * k : 2 * k + 4], eps, self.unit, self.tolerance):
            return False
        fig_mean, fig_var, s1s, s2s = host[:k], host[k : 2 * k], host[2 * k + 4 : 3 * k + 4], host[3 * k + 4 :]
        checked = zip(fig_mean, fig_var, s1s, s2s)  # (each shifted by its figure's mean: fm)
        return all(_passes_one(fm, fv, fm, s1, s2, n, eps, self.tolerance) for fm, fv, s1, s2 in checked)

    def _check_every(self, t: Tensor, pair: Tensor, eps: float) -> bool | None:
        """:meth:`check_now` on every channel (see there)."""
        if not rounding_passes(pair, eps, self.unit, self.tolerance):
            return False
        figures = pair.detach().double()
        n = t.numel() // t.shape[1]
        sums, squares = every_channel_sums(t, figures[0], self.capacity)
        ref = reference(sums, squares, figures[0], torch.full_like(sums, float(n)))
        ok = passes(figures[0], figures[1], ref, eps, self.tolerance)
        good = passes(figures[0], figures[1], ref, eps, self.tolerance / PARTIAL_MARGIN)
        passed, comfortably = (bool(v) for v in torch.stack([ok.all(), good.all()]).tolist())
        if passed:
            _take_reference(pair, ref)
        return (True if comfortably else None) if passed else False

    def run(self) -> list[tuple[Any, bool]]:
        """Makes the waiting checks: ``(owner, passed)`` per call, in the order added."""
        return [(owner, passed) for owner, passed, _ in self.run_graded()]

    def run_graded(self) -> list[tuple[Any, bool, bool]]:
        """:meth:`run`, with whether each call passed within :data:`PARTIAL_MARGIN` of the tolerance too
        (every checked channel, and the rounding term, within a quarter of it): ``(owner, passed, comfortably)``."""
        waiting, self._waiting = self._waiting, []
        self.layers.clear()
        used, self._used, self._held = self._used, 0, 0
        workspace, self._workspace = self._workspace, None
        if not waiting or workspace is None:
            return []
        try:
            return self._decide(waiting, workspace[:used])
        finally:
            _give_back(workspace)

    def _decide(self, waiting: list[_Waiting], values: Tensor) -> list[tuple[Any, bool, bool]]:
        figures = torch.cat([pair for _, pair, _, _, _ in waiting], dim=1)  # (2, every call's channels)
        plan = _plan(waiting, figures.dtype)
        fig_mean, fig_var = figures.index_select(1, plan.columns).double()
        refs = _references(values, plan.runs, fig_mean, plan.n_per_row)  # shifted by the figures' means
        # per checked column, then per channel of every call (the rounding term): 0 within a quarter of the
        # tolerance, 1 within it, 2 beyond it (NaN too); a call's verdict is the worst of its own
        offsets = _offsets(fig_mean, fig_var, refs, plan.eps_per_column)
        # the rounding term mean² / (var + eps) · unit² of every channel (in the figures' dtype: a positive factor
        # commutes with the maximum); a figure that is NaN or infinite makes its channel's NaN, which fails (an
        # infinite variance would make the term 0: var · 0 is NaN there, 0 for any finite variance)
        rounding = figures[0].square().div_(figures[1] + plan.eps_per_channel).add_(figures[1] * 0)
        rounding.mul_(self.unit * self.unit)
        tolerances = (self.tolerance, self.tolerance / PARTIAL_MARGIN)
        levels = []
        for fails in (lambda t: _within(offsets, t).logical_not_(), lambda t: rounding.le(t).logical_not_()):
            beyond, beyond_margin = map(fails, tolerances)
            levels.append(beyond.to(torch.float32).add_(beyond_margin))
        worst = torch.zeros(len(waiting), dtype=torch.float32, device="cpu")
        worst = worst.scatter_reduce_(0, plan.owners, torch.cat(levels), "amax").tolist()
        # a call checked on every channel that passed: its figures become the reference (see _take_reference)
        taken = [k for k, level in enumerate(worst) if level < 2 and plan.every[k]]
        if taken:
            ref = torch.stack(refs[:2]).split(plan.checked, dim=1)
            torch._foreach_copy_([waiting[k][1] for k in taken], [ref[k] for k in taken])
        return [(owner, level < 2, level < 1) for (owner, *_), level in zip(waiting, worst)]


class _Plan(NamedTuple):
    """What :meth:`SpotChecks.run` derives from the waiting calls' shapes alone (see :func:`_plan`)."""

    columns: Tensor  # the checked channels' columns among all the calls' channels, call after call
    runs: list[tuple[int, int]]  # (values per checked channel, checked channels) of consecutive calls
    n_per_row: Tensor  # values per checked channel, by checked column (float64)
    eps_per_column: Tensor  # the call's eps, by checked column (float64)
    eps_per_channel: Tensor  # the call's eps, by channel (the figures' dtype)
    owners: Tensor  # the call of each checked column, then of each channel
    checked: list[int]  # checked channels per call
    every: list[bool]  # whether every channel of the call is checked


_PLANS: dict[tuple[Any, ...], _Plan] = {}
_PLANS_KEPT = 16  # (the same model's calls give the same plan in every pass)


def _plan(waiting: list[_Waiting], dtype: torch.dtype) -> _Plan:
    """The :class:`_Plan` of the waiting calls' widths, checked channels, values per channel and eps: a few dozen
    small kernels, made once per distinct set of those (cached; the tensors are never written)."""
    key = (dtype, *((pair.shape[1], len(picked), n, eps) for _, pair, eps, n, picked in waiting))
    plan = _PLANS.get(key)
    if plan is not None:
        return plan
    widths = [pair.shape[1] for _, pair, _, _, _ in waiting]
    starts, steps, checked = [], [], []  # each call's checked channels: every step-th from its first (its columns)
    runs: list[tuple[int, int]] = []  # (values per checked channel, checked channels) per call
    offset = 0
    for (_, _, _, n, picked), width in zip(waiting, widths):
        starts.append(offset + picked[0])
        steps.append(picked[1] - picked[0] if len(picked) > 1 else 1)
        checked.append(len(picked))
        if runs and runs[-1][0] == n:
            runs[-1] = (n, runs[-1][1] + len(picked))
        else:
            runs.append((n, len(picked)))
        offset += width
    eps = [e for _, _, e, _, _ in waiting]
    count = torch.tensor(checked, device="cpu")
    sizes = torch.tensor(widths, device="cpu")
    # the columns as tensors (every channel of a layer may be checked: thousands of them)
    within = torch.arange(sum(checked), device="cpu") - torch.repeat_interleave(count.cumsum(0) - count, count)
    columns = torch.repeat_interleave(torch.tensor(starts, device="cpu"), count) + within * torch.repeat_interleave(
        torch.tensor(steps, device="cpu"), count
    )
    n_per_row = torch.tensor([n for n, _ in runs], dtype=torch.float64, device="cpu").repeat_interleave(
        torch.tensor([rows for _, rows in runs], device="cpu")
    )
    calls = torch.arange(len(waiting), device="cpu")
    plan = _Plan(
        columns,
        runs,
        n_per_row,
        torch.tensor(eps, dtype=torch.float64, device="cpu").repeat_interleave(count),
        torch.tensor(eps, dtype=dtype, device="cpu").repeat_interleave(sizes),
        torch.cat([calls.repeat_interleave(count), calls.repeat_interleave(sizes)]),
        checked,
        [len(picked) == width for (_, _, _, _, picked), width in zip(waiting, widths)],
    )
    if len(_PLANS) >= _PLANS_KEPT:
        _PLANS.clear()
    _PLANS[key] = plan
    return plan
