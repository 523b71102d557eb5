"""What each selected layer's wrapped forward does during the passes: :class:`LayerCall`.

One small object per layer routes each call by the layer's path (see :mod:`~precisebn.capture`):
in the batch that verifies it, the call runs watched and is recorded for the check; on the fast
path, only its number of values per channel is counted (its figures stay in the scratch buffer),
unless the call is beyond what its layer was verified for (:func:`verified_size`, the layout of
what it normalises: :func:`layout_of`), at an input shape not seen before, or the layer's second
call in the batch; on the float64 path what it normalises is reduced in float64. The bookkeeping
it writes to (counts, kept figures, checks waiting) is the :class:`~precisebn.capture.Collector`'s.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from threading import get_ident
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.nn.modules.instancenorm import _InstanceNorm

from .errors import UnsupportedLayerError
from .figures import EXACT_UP_TO, float64_mean, refigure, remean
from .trial import Trial, fitting
from .watch import Watch, moments_of, normalises_its_input

if TYPE_CHECKING:
    from .capture import Collector

__all__ = [
    "REDUCED",
    "SHAPES",
    "LayerCall",
    "call_key",
    "layout_of",
    "mean_bound",
    "reach",
    "refigured_alike",
    "verified_size",
]

SHAPES = 256
"""Input shapes remembered per layer with a forward of its own (more: each call of a new one watched)."""


class LayerCall:
    """What one layer's wrapped forward calls: routes the call by the layer's path and
    records it in the collector. One small object per layer (rather than closures: a
    pass makes few objects for the garbage collector to track)."""

    __slots__ = (
        "active",
        "c",
        "channels",
        "cover",
        "few_watched",
        "i",
        "init_mean",
        "init_var",
        "inner",
        "instance",
        "itself",
        "mean_view",
        "module",
        "nested",
        "on_cpu",
        "own_forward",
        "pair",
        "ratios",
        "shapes",
        "var_view",
        "verified",
    )

    def __init__(self, collector: Collector, i: int) -> None:
        self.c = collector
        self.i = i
        self.channels = collector.layers[i].channels
        self.mean_view, self.var_view = collector._views[i]
        self.pair = collector._pairs[i]
        self.init_mean, self.init_var = collector._initial_views[i]  # type: ignore[misc]
        self.module = collector.layers[i].module
        self.own_forward = normalises_its_input(self.module)  # torch's own forward: what it normalises is its input
        self.instance = (  # torch's own InstanceNorm forward (statistics per sample; measured in float64)
            isinstance(self.module, _InstanceNorm)
            and type(self.module).forward is _InstanceNorm.forward
            and "forward" not in self.module.__dict__
        )
        self.active = 0  # calls of the layer running now (more than one: a call inside its own call)
        self.inner = 0  # calls made inside the layer's own call, ever (a call that saw some ran none: see _unseen)
        self.nested = False  # verifying batch: a call ran inside the outermost call running now
        # by layout (see _layout), the most values per channel a later call may have to be read through its
        # figures (see verified_size; 0: no call in that layout was checked): a call with more is measured in
        # float64 (and on the CPU checked, raising this when its figures pass) — torch's CPU kernels for
        # channels_last and (N, C) inputs round more, and more with more values; other layouts round otherwise
        self.verified = [0, 0]
        # on the CPU, in layout 1, the (values per channel, largest mean² / (var + eps)) of the calls whose figures
        # passed: the rounding of those kernels grows with both, so a later call is read through its figures only
        # where one checked call had at least as many values and as large a ratio, channel by channel (see bound)
        self.on_cpu = self.pair.device.type == "cpu"
        # a forward of its own whose calls in layout 1 with at most EXACT_UP_TO values per channel, at an input shape
        # where it was not seen to normalise its input itself (x * s, a transpose), are measured in float64: torch's
        # float32 mean of those may err by (n - 1)·u·|mean| (see figures.remean), and what it normalised is at hand
        # only watched (a review: 2.7e-5 of the variance off at |mean|/σ = 75, unwarned). Where it normalised its
        # input itself, its input's mean is taken where the two agree (Collector._agreed)
        self.few_watched = not self.own_forward and self.on_cpu and self.pair.dtype == torch.float32
        self.ratios: list[tuple[int, float]] = []  # (values per channel, largest mean² / (var + eps))
        self.cover: dict[int, float] = {}  # by values per channel: the largest ratio the checked calls vouch for
        # a layer with a forward of its own (not torch's), by its input's layout (see _layout): the input shapes
        # its calls were seen, watched, to normalise a tensor of the input's size once with batch figures in its
        # buffers, and that tensor's layout (which `verified` is read by) — a call of another shape or layout is
        # watched again (its behaviour may depend on them: a "ghost" BatchNorm normalising per chunk of the batch,
        # a copy in another memory layout)
        self.shapes: tuple[dict[torch.Size, int], dict[torch.Size, int]] = ({}, {})
        # of those, the shapes at which the tensor it normalised was its input itself (not a copy or a transform):
        # a call there that its checked calls do not vouch for (see bound) is measured from its input in float64
        self.itself: tuple[set[torch.Size], set[torch.Size]] = (set(), set())

    def watched(
        self, forward: Callable[..., Any], x: Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Any, list[Tensor], bool]:
        """Runs the layer; returns its output, what it normalised with its running buffers, and
        whether every such normalization overwrote them with its batch figures (see
        :attr:`~precisebn.watch.Watch.frozen`)."""
        module = self.module
        if (
            self.own_forward
            and module.track_running_stats
            and module.momentum == 1.0  # else what it leaves is not its batch figures (watched: frozen)
            and module._buffers.get("running_mean") is self.mean_view
        ):
            return forward(*args, **kwargs), [x], True  # torch's own forward, in training mode (checked)
        with Watch(module, x) as watch:
            out = forward(*args, **kwargs)
        if watch.changed():
            layer = self.c.layers[self.i]
            raise UnsupportedLayerError(
                f"{layer.label} changed the tensor it normalised with its running "
                "buffers in place, later in its own forward, so what that tensor holds now is not what the layer "
                "normalised, and precisebn cannot measure it. Make the layer's forward leave that tensor as it "
                "is (e.g. use an out-of-place operation), or exclude the layer with layers=. The model was left "
                "unchanged."
            )
        return out, watch.seen, not watch.frozen

    def _unseen(self, inner: int, held: Tensor) -> bool:
        """After a watched call that normalised nothing precisebn saw: whether it wrote its running buffers all
        the same, out of the watch's sight — they (the scratch views still) no longer hold what they held before
        the call (``held``; the model's statistics in the verifying batch) — whether or not it moved its
        ``num_batches_tracked``: a forward normalising with a slice of its buffers (``F.batch_norm(x,
        self.running_mean[:c], ...)``, as slimmable networks do) or updating them by hand writes them without
        it (a probe: "buffers never used (kept)", the old statistics kept). Not when calls ran inside it
        (``inner``: the count before it): theirs are the normalization and the writes. A call that took its
        buffers away, or normalised a copy of them, wrote none of them: it normalised without them. The
        comparison reads the device only in such a call (none of torch's own or of a layer the watch sees)."""
        buffers = self.module._buffers
        return (
            self.inner == inner
            and buffers.get("running_mean") is self.mean_view
            and buffers.get("running_var") is self.var_view
            and not torch.equal(self.pair, held)
        )

    def stash(self, x: Tensor, j: int, inside: bool = False) -> int | None:
        """Before a call on the fast path (or verifying it) that is not the layer's usual first call
        of a batch: refuses too few values, and keeps the previous call's figures if the layer was
        called earlier in this batch (the call is about to overwrite them) — unless the call runs
        inside the layer's own call (``inside``): the enclosing call kept them already, and the
        scratch holds nothing of a call's since. Returns where they are kept, for :meth:`unstash`."""
        c, i = self.c, self.i
        if self.too_few(x):
            raise c._too_few(i, x)
        if not c._row[i] or inside:
            return None
        c._extras.append((i, j - 1, c._row[i], self.mean_view.clone(), self.var_view.clone()))
        self.pair.copy_(c._initial_pair(i))  # what this call reads in its buffers: the model's statistics
        c._wrote()
        return len(c._extras) - 1

    def too_few(self, x: Tensor) -> bool:
        """Whether torch's own forward would refuse ``x`` for too few values (a forward of its own may handle it):
        one value per channel for a BatchNorm, one spatial position for an InstanceNorm (whose statistics are each
        sample's; a 1x1 map, torch's ValueError without the layer's name: a probe)."""
        if self.instance:  # (an input of another rank: torch's own error says so)
            unbatched = self.module._get_no_batch_dim()
            if x.dim() not in (unbatched, unbatched + 1):
                return False
            return math.prod(x.shape[1:] if x.dim() == unbatched else x.shape[2:]) == 1
        return self.own_forward and _one_per_channel(x, self.channels)

    def unstash(self, stashed: int | None) -> None:
        """After a call that raised (the model may catch it and go on), whatever its forward wrote:
        puts back in the layer's scratch what it held before the call — the previous call's figures
        that :meth:`stash` kept (no longer kept apart), else the layer's own statistics (its scratch
        before its first call of a batch)."""
        c = self.c
        if stashed is None:
            self.pair.copy_(c._initial_pair(self.i))
            return
        _, _, _, mean, var = c._extras[stashed]
        self.mean_view.copy_(mean)
        self.var_view.copy_(var)
        del c._extras[stashed]

    def measure_beyond(self, seen: list[Tensor], figures: bool, x: Tensor, j: int) -> None:
        """A fast-path call beyond the size its layer was verified for in its layout (see
        :attr:`verified`, :func:`verified_size`): what it normalised is reduced in float64 and kept as its moments, and
        its figures are taken out of the scratch (the layer's own statistics again: the sums read
        nothing of this call; an earlier call of this batch was stashed already). Its figures, if it
        left them, are checked against those moments at the end of the batch (all such calls at once,
        see :meth:`Collector._check_beyond`): when they pass, later calls of up to this many
        values are read through their figures again. Only on the CPU, where reading a value costs no
        synchronisation: elsewhere such calls stay on float64 (exact, no host read in the batch loop)."""
        c, i = self.c, self.i
        moments = moments_of(seen)  # (what can fail comes first: a call that raises leaves nothing counted)
        on_cpu = x.device.type == "cpu" and self.pair.device.type == "cpu"
        check = None
        t = fitting(seen, x, self.channels) if on_cpu and figures and moments is not None else None
        if t is not None and t.numel() // self.channels > 1:
            check = (self, t.numel() // self.channels, layout_of(t), self.pair.clone(), moments)
        n = sum(v.numel() // self.channels for v in seen)
        if moments is not None:  # (nothing normalised with its buffers: nothing counted, as on the float64 path)
            c._keep((i, j if c.per_call else 0), moments, n)
        if check is not None:
            c._beyond.append(check)
        self.pair.copy_(c._initial_pair(i))
        c._wrote()
        c._row[i] = 0
        c.calls[i] += 1
        if moments is not None:
            c.counts[i] += n
            if c.per_call:
                c._count_call(i, j, n)

    def _known_shape(self, seen: list[Tensor], figures: bool, x: Tensor, counted: bool, key: Any) -> int | None:
        """After a watched call of a layer with a forward of its own, with an input shape not seen
        before: the layout (:func:`_layout`) of what it normalised if that is one tensor of the input's
        size, normalised once with its running buffers and batch figures — later calls of that shape are
        then read through their figures unwatched (up to the size verified for that layout). Else
        ``None``: the call is measured in float64 from what it normalised (:meth:`measure_beyond`), its
        behaviour depending on the shape (a "ghost" BatchNorm normalising each chunk of the batch apart
        leaves the last chunk's figures). The shape is remembered, under ``key`` (see :func:`call_key`), only if
        the call also moved the layer's counter once (``counted``): the check of calls read unwatched relies on it."""
        t = fitting(seen, x, self.channels) if figures and x.numel() // self.channels > 1 else None
        if t is None:
            return None
        layout = layout_of(t)
        shapes = self.shapes[layout_of(x)]
        if counted and key is not None and len(shapes) < SHAPES:
            shapes[key] = layout
            if t is x:
                self.itself[layout_of(x)].add(key)
        return layout

    def bound(self, n: int) -> float:
        """The largest mean² / (var + eps) that the checked calls of at least ``n`` values vouch for (-1: none):
        a call of ``n`` values in layout 1 (on the CPU) is read through its figures only within it on every
        channel whose data vary (a constant one, variance 0, is exact: see :meth:`passed`) — torch's float32
        reduction of such inputs errs more with both the values and the mean's distance from 0 in units of σ."""
        bound = self.cover.get(n)
        if bound is None:  # (cached by n: usually the same in every batch)
            bound = self.cover[n] = max((r for k, r in self.ratios if n <= k), default=-1.0)
        return bound

    def passed(self, n: int, pair: Tensor, reach: float = 1.0) -> None:
        """Records that figures ``pair`` of a call of ``n`` values per channel in layout 1 passed their check
        (see :meth:`bound`): its largest |mean|/σ, ``r``, over the channels whose data vary — a constant channel
        (a dead filter's bias: mean²/eps of 1e9) has variance 0 exactly, and figures that are exact (every value
        equal to the mean they give), so it vouches for no other (a probe: it let them be read 1.26e-5 σ off).
        Only the calls not vouched for by another are kept. ``reach``: by how much further from 0 they vouch for
        calls, as ``1 + r`` — the kernel's error grows at most as ``(1 + r)²`` (a float32 sum of squares; a sum,
        or two passes, as ``1 + r``), so figures that passed within a quarter of the tolerance vouch for calls up
        to ``2r + 1`` (reach 2), ones whose error was a fraction f of it up to ``(1 + r)/√f − 1``. Non-finite
        figures vouch for nothing. Kept as a copy of the figures until the collector computes every such call's
        ``r`` at once (:meth:`~precisebn.capture.Collector._take_passed`, before any bound is read: a few kernels
        in all rather than a few per call), then given to :meth:`vouch`."""
        self.c._passing.append((self, n, pair.detach().clone(), float(self.module.eps), reach))

    def vouch(self, n: int, r2: float, reach: float) -> None:
        """:meth:`passed`, with the call's largest mean² / (var + eps) over the channels whose data vary: ``r2``."""
        if r2 != r2 or r2 == float("inf"):
            return
        if reach > 1.0:
            r2 = ((1 + r2**0.5) * reach - 1) ** 2
        if any(n <= k and r2 <= r for k, r in self.ratios):
            return
        self.ratios = [(k, r) for k, r in self.ratios if not (k <= n and r <= r2)] + [(n, r2)]
        self.cover.clear()
        self.c._fronts += 1

    def count(self, x: Tensor, j: int) -> int:
        """Counts a call that returned: its values per channel are this batch's (in the sums at its end)."""
        c, i = self.c, self.i
        n = x.numel() // self.channels
        c._row[i] = n
        c.counts[i] += n
        c.calls[i] += 1
        if c.per_call:
            c._count_call(i, j, n)
        return n

    def __call__(self, forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        c, i = self.c, self.i
        if not c.in_forward or get_ident() != c.thread or _is_tracing():  # (before anything is counted)
            if c.pid != os.getpid():  # a loader's worker process, forked with the wrappers on: its own copy, left
                return forward(*args, **kwargs)  # to the model's own forward, in whatever mode (probe 35a)
            other = get_ident() != c.thread
            if c.over and not other:  # (a shallow copy of the layer, made during the passes, called after them)
                raise c._after_passes(i)
            # in another thread than the passes' while forward runs (a data thread's), or while the pass is set up
            # or put back (probe 40: such calls ran unrefused, in training mode, before the wrappers were on);
            # between forwards (the data's, in any thread); or traced
            if other and (c.in_forward or c.over or not c._batch):
                c._refused = c._other_thread(i)
            else:
                c._refused = c._outside_forward(i) if not c.in_forward else c._traced(i)
            raise c._refused  # (raised again at the end of the batch: a thread of the data's, or code that catches
            # it, would leave the pass to go on)
        path = c.paths[i]
        in_batch = c._in_batch
        j = in_batch[i]  # this call's index within the batch
        in_batch[i] = j + 1
        module = self.module
        guard = c._guard
        buffers = module._buffers
        lent = False
        inside = self.active  # > 0: a call inside the layer's own call
        self.active = inside + 1
        if inside:
            self.nested = True  # (read by the enclosing call in the verifying batch; it cleared it)
            self.inner += 1
        pushed = False  # (a Ctrl-C before the push must not pop another call's entry)
        counter = c._counters[i]
        before = counter._version if counter is not None else 0  # (what a call that raises did to it: not counted)
        try:
            if guard:  # (inline: this runs for every layer in every batch)
                stack = c._stack
                owner = stack[-1] if stack else c._last
                stack.append(i)
                pushed = True
                if c._changed():
                    c._entered(owner, len(stack) > 1)
            if inside and (path == "fast" or c.per_call):
                raise c._called_inside_itself(i)
            # lend the layer its scratch for this call (between calls it holds its own statistics)
            held = buffers.get("running_mean")
            if held is self.init_mean and buffers.get("running_var") is self.init_var:
                buffers["running_mean"], buffers["running_var"] = self.mean_view, self.var_view
                lent = True
            elif path == "fast" and (held is not self.mean_view or buffers.get("running_var") is not self.var_view):
                raise c._buffers_replaced(i)  # (the scratch already: a call inside its own call)
            if path == "fast":
                x = args[0] if args else None
                if type(x) is not Tensor or not module.training or module.momentum != 1.0:
                    x = c._check(i, args, kwargs)  # the full checks (which raise)
                    if module.momentum != 1.0:
                        raise c._momentum_changed(i)
                n = x.numel() // self.channels
                row = c._row
                layout: int | None = (  # (layout_of, inline)
                    x.dim() < 3 or x.stride(1) == 1 or x.dtype in REDUCED or not x.is_contiguous()
                )
                new_shape = False
                if not self.own_forward:  # a forward of its own, called with a new input shape: watched (_known_shape)
                    xl = layout
                    key = call_key(x, args, kwargs)
                    layout = self.shapes[xl].get(key) if key is not None else None  # (what it normalises: its layout)
                    new_shape = layout is None
                # beyond the size verified for its layout (see verified_size): measured in float64
                beyond = layout is not None and (
                    n > self.verified[layout]
                    or (layout == 1 and self.few_watched and n <= EXACT_UP_TO and key not in self.itself[xl])
                )
                watching = beyond or new_shape
                # too few values, a second call in this batch, per call, beyond, new shape
                unusual = n == 1 or row[i] or c.per_call or watching
                if row[i] and c._pending:  # (its figures are about to be overwritten)
                    c._run_pending()
                if self.instance and not unusual and self.too_few(x):  # (stash() checks the unusual calls)
                    raise c._too_few(i, x)
                stashed = self.stash(x, j) if unusual else None
                try:
                    if watching:
                        out, seen, figures = self.watched(forward, x, args, kwargs)
                    else:
                        out = forward(*args, **kwargs)
                except BaseException:
                    self.unstash(stashed)
                    raise
                if buffers.get("running_mean") is not self.mean_view or buffers.get("running_var") is not self.var_view:
                    raise c._buffers_replaced(i)  # its forward put other tensors there: its figures went there
                if lent:  # (here rather than in finally: the identities are checked already)
                    buffers["running_mean"], buffers["running_var"] = self.init_mean, self.init_var
                    lent = False
                if guard and c._changed():
                    raise c._modified_in_place(i, during=True)
                once = counter is None or counter._version == before + 1  # (a host integer, every call)
                if not (once or watching) and c._checked_calls[i]:
                    raise c._counted_otherwise(i, counter._version - before)  # type: ignore[union-attr]
                if new_shape:
                    layout = self._known_shape(seen, figures, x, once, key)
                    # not its input alone, once, with batch figures: what it normalised, in float64; else as usual
                    beyond = layout is None or n > self.verified[layout]  # (watched: what it normalised is at hand)
                deferred = layout == 1 and not beyond and self.on_cpu  # its figures' ratio, compared later
                if beyond:
                    try:
                        self.measure_beyond(seen, figures, x, j)
                    except BaseException:  # (e.g. no memory for the float64 copy): the call counts for nothing
                        self.unstash(stashed)
                        raise
                elif unusual:
                    self.count(x, j)
                else:  # count() for the usual call, inline: this runs for every layer in every batch
                    row[i] = n
                    c.counts[i] += n
                    c.calls[i] += 1
                if watching and counter is not None:  # (what it left is known: its counts are its own business)
                    c._lost[i] += counter._version - before - 1
                if deferred:  # (once counted: the comparison may run at once, and then needs the call's count)
                    known = watching or self.own_forward or key in self.itself[xl]  # what it normalised
                    t = (seen[0] if watching else x) if known else None
                    agree = None
                    if t is not None and self.pair.dtype == torch.float32:  # torch's kernel sums it in float32,
                        own = watching or self.own_forward  # one value after another (see figures)
                        if n > EXACT_UP_TO:
                            if own:
                                refigure(t, self.pair)
                            elif not refigured_alike(t, self.pair, float(module.eps)):  # (its input, assumed)
                                t = None  # (it normalised something else this time: its own figures, nothing to check)
                        elif own:
                            remean(t, self.pair)
                        else:  # (its input, assumed: its mean, summed now, taken where it agrees, checked at once)
                            agree = float64_mean(t)
                        c._wrote()
                    c._defer(self, j, n, t, agree)
            elif path == "verify":
                out = self.verify(forward, args, kwargs, j, inside > 0)
            else:
                x = c._check(i, args, kwargs)
                if self.too_few(x):  # (torch would say so without the name)
                    raise c._too_few(i, x)
                if path == "none":  # verified never to normalise with its running buffers: nothing to watch
                    out = forward(*args, **kwargs)
                    c.calls[i] += 1
                else:
                    inner, held = self.inner, self.pair.clone()  # (the float64 path: slow anyway)
                    out, seen, _ = self.watched(forward, x, args, kwargs)
                    if not seen and not inside and self._unseen(inner, held):
                        raise c._unseen(i)
                    if seen:  # (what can fail comes first: a call that raises leaves nothing counted)
                        n = sum(t.numel() // self.channels for t in seen)
                        c._keep((i, j if c.per_call else 0), moments_of(seen), n)  # type: ignore[arg-type]
                        c.counts[i] += n
                        if c.per_call:
                            c._count_call(i, j, n)
                    c.calls[i] += 1
                if guard:
                    c._changed()  # (its buffers are not read: whatever its forward did to them is its own)
        except BaseException as exc:
            c._failed(i, j, before)
            if isinstance(exc, UnsupportedLayerError):
                c._refused = exc
            x = args[0] if args else None
            if (  # torch's own error inside a forward of its own, which did not handle the call: named
                type(exc) is ValueError
                and isinstance(x, Tensor)
                and _one_per_channel(x, self.channels)
                and "more than 1 value per channel" in str(exc)
            ):
                raise c._too_few(i, x) from exc
            raise
        finally:
            self.active = inside
            if lent:  # its own statistics again, unless its forward put other tensors there
                if buffers.get("running_mean") is self.mean_view:
                    buffers["running_mean"] = self.init_mean
                if buffers.get("running_var") is self.var_view:
                    buffers["running_var"] = self.init_var
            if pushed:
                c._stack.pop()
                c._last = i
        if j >= c.most[i]:
            c.most[i] = j + 1
        return out

    def verify(
        self, forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], j: int, inside: bool
    ) -> Any:
        """A call in the batch that verifies the layer: runs it watched, then counts it and
        records what it normalised (checked against its figures, see :class:`~precisebn.trial.Trial`).
        A call inside the layer's own call (``inside``), and one that enclosed such a call, leave no
        figures of their own (the enclosing call overwrites the inner one's): the float64 path."""
        c, i = self.c, self.i
        x = c._check(i, args, kwargs)
        if c._spots is not None and i in c._spots.layers:  # its waiting figures are about to be overwritten
            c._run_spot_checks()
        counter = c._counters[i]
        before = counter._version if counter is not None else -1
        if not inside:
            self.nested = False  # (a call inside this one sets it)
        stashed = self.stash(x, j, inside)
        inner = self.inner
        try:
            out, seen, figures = self.watched(forward, x, args, kwargs)
        except BaseException:
            self.unstash(stashed)
            raise
        if not seen and not inside and self._unseen(inner, c._initial_pair(i)):
            raise c._unseen(i)
        trial = c._trials.get(i) or c._trials.setdefault(i, Trial(c.counts[i]))
        n = self.count(x, j)
        if c._guard and c._changed():  # its forward changed its buffers in place after normalising: not its figures
            figures = False
        if inside or self.nested or n == 1:  # (one value per channel: a forward of its own that handles it)
            figures = False
        trial.slot = sum(1 for e in c._extras if e[0] == i)  # this call's figures: kept next, else in its buffers
        # the layout of what it normalised, if it fits the fast path (else the layer goes to the float64 path)
        t = fitting(seen, x, self.channels)
        xl = layout_of(x)
        layout = xl if t is None or t is x else layout_of(t)
        self.verified[layout] = max(self.verified[layout], verified_size(n, layout, x.device))
        shapes = self.shapes[xl]
        once = counter is None or counter._version == before + 1
        key = None if self.own_forward else call_key(x, args, kwargs)
        if key is not None and figures and t is not None and once and len(shapes) < SHAPES:
            shapes[key] = layout
            if t is x:
                self.itself[xl].add(key)
        if figures and x.device.type == "cpu" and self.mean_view.device.type == "cpu":  # host reads: free
            comfortably = c._check_on_cpu(i, trial, seen, x, n, self.pair)
            if layout:  # (the layer keeps the fast path only if this call's figures pass)
                self.passed(n, self.pair, reach=2.0 if comfortably else 1.0)
        else:  # (no figures of this call in its buffers, whatever they hold: the float64 path)
            trial.add(seen, x, self.channels, n, figures)
        trial.counted &= counter is not None and counter._version == before + 1
        return out


class _Unkeyable(Exception):
    """An argument that no key can stand for (see :func:`call_key`)."""


def call_key(x: Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What a call of a layer with a forward of its own is remembered by: its input's shape, and, when it has other
    arguments, each one's type, shape, dtype, device and strides if a tensor, its value if a number, string or
    ``None``, and the contents of tuples, lists and dicts of those — an argument may choose what the forward
    normalises (``forward(x, y)`` normalising ``y``) or how (``chunks=4``, ``use_running=True``), and a call read
    unwatched at a shape verified with other arguments was read wrong, "fast" (probe 38: 0.26 σ and 16 % off; a
    ghost BatchNorm's ``chunks`` 136 %). ``None`` for a call with an argument of another kind (an object of its own,
    whose identity a fresh one may reuse, a review found): such a call is watched every time, remembered by nothing."""
    if len(args) == 1 and not kwargs:
        return x.shape
    try:
        return (x.shape, tuple(map(_argument_key, args[1:])), tuple((k, _argument_key(v)) for k, v in kwargs.items()))
    except _Unkeyable:
        return None


def _argument_key(v: Any) -> Any:
    if isinstance(v, Tensor):
        return (type(v), v.shape, v.dtype, v.device, v.stride() if v.layout == torch.strided else v.layout)
    if v is None or type(v) in (bool, int, float, str):
        return (type(v), v)  # (True is not 1 here)
    if type(v) in (tuple, list):
        return (type(v), tuple(map(_argument_key, v)))
    if type(v) is dict:
        return (dict, tuple((_argument_key(k), _argument_key(value)) for k, value in v.items()))
    raise _Unkeyable


def refigured_alike(t: Tensor, pair: Tensor, eps: float) -> bool:
    """Recomputes the float32 figures ``pair`` of an unwatched call of a layer with a forward of its own from ``t``,
    its input, as :func:`~precisebn.figures.refigure` does (where an earlier call with the same arguments normalised
    its input itself), and tells whether the two agree within twice what torch's kernel may round (recursive float32
    summation: ``(n - 1)·u`` of the values' mean square) and the tolerance. Where they do not, the forward normalised
    something else this time, by state its arguments do not show (``x * self.scale`` once ``scale`` changed, a clamp
    applied to some batches only): recomputed from the input, such figures were the statistics of a tensor the layer
    never normalised (probe 38: 0.58 σ and 88 % off) where its own were right — its own are put back then, and
    ``False`` returned. A change smaller than that bound (``x * 1.003`` at 32,768 values per channel) is not told
    apart: such state stays unchecked, as the README says."""
    own = pair.clone()
    refigure(t, pair)
    n = t.numel() // t.shape[1]
    mean, var = pair[0].double(), pair[1].double()
    slack = (n - 1) * 2.0**-24 * 2.0  # (the kernel's bound, twice over: it reaches about a fifth of it, blank frames)
    far = ((own[0].double() - mean).abs() > mean_bound(mean, var, n, eps)) | (
        (own[1].double() - var).abs() > slack * mean.square().add(var) + 1e-5 * (var + eps)
    )
    if bool(far.any()):
        pair.copy_(own)
        return False
    return True


def mean_bound(mean: Tensor, var: Tensor, n: float | Tensor, eps: float | Tensor) -> Tensor:
    """How far, per channel, a call's own float32 batch mean may lie from ``mean``, the float64 mean of its input,
    for the input to count as what it normalised: twice what torch's recursive float32 summation of ``n`` values
    may round (``(n - 1)·u`` of the values' root mean square, at least ``sqrt(mean² + var)``), and the tolerance
    (1e-5 σ). ``n`` and ``eps`` may be per-channel tensors (several calls at once)."""
    return (n - 1) * 2.0**-24 * 2.0 * mean.square().add(var).sqrt_() + 1e-5 * (var + eps).sqrt()


def _one_per_channel(x: Tensor, channels: int) -> bool:
    """Whether ``x`` holds one value for each of the layer's ``channels`` (dimension 1). An input with other
    channels is left to torch's own error — a RuntimeError that a model may catch (a probe's model skipped a
    malformed feature level so), which a message of precisebn's would replace (and misread as one value per
    channel: a probe)."""
    return x.dim() >= 2 and x.shape[1] == channels and x.numel() == channels


def verified_size(n: int, layout: int, device: torch.device) -> int:
    """Up to how many values per channel a call whose figures passed with ``n`` lets later calls in
    its layout read their figures: ``n`` where the kernel's rounding grows with them (the CPU's
    float32 reductions of channels adjacent in memory), any number elsewhere (the CPU's default
    layout reduces in float64; accelerators are checked in the verifying batch only, and checking
    a larger call later would take a host read inside the loop)."""
    return n if layout and device.type == "cpu" else sys.maxsize


REDUCED = (torch.float16, torch.bfloat16)

_is_tracing = torch._C._is_tracing  # (torch.jit.is_tracing() without its Python frames: every call asks)


def reach(score: float, tolerance: float) -> float:
    """How much further from 0 (as ``1 + r``) figures whose check scored ``score`` vouch for later calls (see
    :meth:`LayerCall.passed`): ``sqrt(tolerance / score)``, at most 2 (a quarter of the tolerance)."""
    return min(2.0, (tolerance / score) ** 0.5) if score > 0 else 2.0


def layout_of(x: Tensor) -> int:
    """1 if torch's CPU kernels reduce ``x`` in float32, rounding more with more values — its channels
    (dimension 1) adjacent in memory (channels_last, ``(N, C)``), any other non-contiguous input (a crop
    ``x[..., 1:]``, a channel split: a probe measured 1.1e-4 σ at 1.6 M values), or a half-precision input
    (autocast, or a half-precision module before a float32 layer) — else 0 (contiguous float32 and float64
    inputs in the default layout, reduced in float64; a float64 input's sums round by about √n·2⁻⁵³·|mean|, far
    below float32's, which the verifying batch checks on every channel and the end of the passes warns of: see
    :func:`~precisebn.measure._warn_far_from_zero`)."""
    return 1 if x.dim() < 3 or x.stride(1) == 1 or x.dtype in REDUCED or not x.is_contiguous() else 0
