"""Capturing each layer's statistics during the forward passes, without host syncs.

What is measured: for every selected layer, the tensor it normalises with its running
buffers (found by :class:`~precisebn.watch.Watch`; for torch's own layers, its input).
Two paths, chosen per layer by verifying it, not by its class:

* ``"fast"`` — the layer's own figures. In training mode with momentum 1.0 a BatchNorm
  layer leaves exactly the batch mean and unbiased variance in its running buffers,
  which :func:`~precisebn.layers.recalibration_state` has pointed at one flat scratch
  buffer per device/dtype. After each batch that whole buffer is added to two float64
  sums around a fixed shift per channel (the mean of the first batch that calls the layer):
  ``s1 += n·(μ_b − K)`` and ``s2 += n·(μ_b − K)² + (n − 1)·σ²_b`` — five whole-buffer
  kernels, whatever the number of layers (see
  :meth:`~precisebn.stats.RunningMoments.from_shifted_sums` for the precision); at the
  end the pooled moments and the standard errors of a group's layers come from those
  sums at once (:func:`~precisebn.stats.fold_errors_from_sums`). A
  wrapper around the layer's forward records only the number of values per channel
  (a host integer from the input's shape), and — for a layer called several times in
  one forward — keeps the previous call's figures before the layer overwrites them;
  those are merged with Chan's formula.

  The path is verified on the batch in which a layer is first called: every call then
  also records what the layer normalises with its buffers (its input, for a layer running
  torch's own forward on the scratch buffers, see
  :func:`~precisebn.watch.normalises_its_input`; else what :class:`~precisebn.watch.Watch`
  sees), reduces it in float64, and compares the figures the layer left behind
  (:func:`~precisebn.watch.discrepancies`, one host read at the end of that batch for all
  layers; on the CPU each call is checked on a few channels instead, many calls at once, see
  :mod:`~precisebn.spotcheck`). A layer that normalises
  exactly one tensor of its input's size per call and whose figures match within
  :data:`~precisebn.watch.TOLERANCE` keeps the fast path; any other moves to the
  float64 path with that batch's float64 figures (a biased variance stored, buffers
  left untouched, a transformed input, channels_last rounding); a layer that never
  normalises with its running buffers is left out (count 0: not updated).
* ``"float64"`` — what the layer normalises with its buffers is reduced in float64 on
  every call (half-precision buffers, SyncBatchNorm across processes, layers that
  failed verification, ``capture="float64"``).

With ``per_call=True`` a layer called k > 1 times per batch gets k sets of moments, one
per call index within the batch: on the fast path the last call's figures go into the
shifted sums and the earlier calls' (stashed before the layer overwrites them) are kept
per call index; on the float64 path, and for a layer that fails verification, each
call's float64 moments are kept under its index. The call index is a host integer, and
so is the check that every batch calls the layer equally often.

Later calls are read through their figures unchecked — except a call beyond the size its layer was
verified for in the layout of what it normalises (:func:`verified_size`), measured in float64 (and on the
CPU checked at the end of its batch, see :meth:`LayerCall.measure_beyond`), and a call of a layer with a
forward of its own at an input shape not seen before, watched (:meth:`LayerCall._known_shape`: measured in
float64 unless it normalises one tensor of its input's size once with batch figures into its own buffers;
the counter increments of watched calls are left out of :meth:`Collector.finish`'s check); what
keeps the verified batch valid for them: each
layer's scratch ``num_batches_tracked`` is set back to the layer's own count after every batch, and put back in the
layer if its forward replaced it (a forward that counts its calls sees the verified counts again); a
fast-path call whose layer's momentum is no longer 1.0 is refused; a call that raises counts for
nothing, and what it wrote into the scratch is taken back (:meth:`LayerCall.unstash`,
:meth:`Collector._failed`); a call inside the layer's own call (whose figures the enclosing call
overwrites) is refused — in the verifying batch such calls, and the calls enclosing them, go to the
float64 path; a call read unwatched that does not move the layer's counter by exactly one is refused
at once, and :meth:`Collector.finish` refuses a layer whose counter moved otherwise outside its calls.

Outside the verifying batch nothing here reads a device value on the host (the check of calls beyond
their layer's verified size is made on the CPU only); the only
host-to-device traffic is the per-channel count vector of each distinct combination
of per-layer counts (usually one or two per run), kept in a small cache.
"""

from __future__ import annotations

import logging
import operator
import os
import threading
from typing import Any

import torch
from torch import Tensor

from ._table import times
from .errors import InvalidArgumentError, PreciseBNError, UnsupportedLayerError
from .layercall import LayerCall, layout_of, mean_bound, reach, verified_size
from .layers import RecalibrationState, ScratchGroup
from .spotcheck import HELD, SpotChecks
from .state import version_of
from .stats import RunningMoments, fold_errors, fold_errors_from_sums, merge_counted
from .trial import Trial, fitting
from .watch import TOLERANCE, discrepancies, moments_of

_TRAINING = operator.attrgetter("training")

logger = logging.getLogger("precisebn")

__all__ = ["Collector"]

_COUNT_CACHE = 16  # distinct per-layer count combinations kept on the device

FOLDS = 16
"""Batches are accumulated into this many interleaved folds (batch b into fold b mod FOLDS),
so that standard errors can be derived at the end (jackknife over folds) without any
per-batch work beyond the sums themselves."""


def _accumulation_device(device: torch.device) -> torch.device:
    return torch.device("cpu") if device.type == "mps" else device  # no float64 on MPS


def _to_device(host: Tensor, device: torch.device) -> Tensor:
    """Copies a small host tensor to ``device`` without making the host wait."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


class Collector:
    """Per-layer statistics of every call of the selected layers.

    Args:
        state: The prepared model state (layers, scratch buffers, hook registry).
        per_call: Keep the moments of each call index within a batch apart (see the
            module's docstring); a layer must then be called equally often in every
            batch that calls it.
    """

    def __init__(self, state: RecalibrationState, per_call: bool = False) -> None:
        self.layers = state.layers
        self._counters = state.counters
        self._views = state.views
        self.per_call = per_call
        n = len(self.layers)
        self.calls = [0] * n
        self.counts = [0] * n  # values per channel seen by each layer, on the host
        self.most = [0] * n  # most calls of each layer in one batch
        self.per_batch = [0] * n  # per_call: calls of each layer in every batch that calls it (0: not yet)
        self.call_counts: list[list[int]] = [[] for _ in range(n)]  # per_call: values per channel per call index
        self._in_batch = [0] * n  # calls of each layer in the current batch
        # whether the pass's forward(model, batch) is running: a layer called otherwise (by the data, between
        # forwards) is refused (see LayerCall.__call__)
        self.in_forward = False
        self.over = False  # the passes are over (a layer still called through this collector is a shallow copy)
        self.pid = os.getpid()  # (a loader's worker process, forked during a pass, runs its own copy: not refused)
        # the thread that runs the passes (it makes the collector): a call from another is refused, even during a
        # forward — a data thread running the model then would be counted, its calls mixed with the batch's
        self.thread = threading.get_ident()
        self._first_batch = [0] * n  # per_call: the batch that set per_batch
        # "verify" until the end of the first batch that calls the layer, then "fast", "float64" or "none"
        self.paths = ["verify" if layer.path == "fast" else "float64" for layer in self.layers]
        self._checked_calls = [False] * n  # whether finish() may check calls against the layer's counter
        # the layers' scratch num_batches_tracked, set back to the layers' own counts after every batch (see
        # end_batch), how often that was done, and per layer the increments of calls that raised (each counter's
        # version is then calls + resets + those); with the buffer dicts they are put back in (a forward may
        # replace them)
        self._counter_list = [t for t in self._counters if t is not None]
        # each layer's own count (what its counter is set back to: see end_batch), by layer and as a list
        self._starts = [None if t is None else t.clone() for t in self._counters]
        self._counter_starts = [t for t in self._starts if t is not None]
        # each counter's version now (0, but 1 for a clone of an inference tensor: a model built in inference mode)
        self._born = [0 if t is None else t._version for t in self._counters]
        # for the layers on the float64 path whose forward is torch's own (which counts each call once): what their
        # counters counted, by value, over the batches (on their devices: read in finish) — more counts than calls
        # are calls that went around precisebn's wrapper (see finish); kept for those layers only (see _unseen_now)
        self._counted: dict[int, Tensor] = {}
        self._unseen_lists: tuple[list[Tensor], list[Tensor], list[Tensor]] = ([], [], [])
        self._counter_homes = [
            (layer.module._buffers, t) for layer, t in zip(self.layers, self._counters) if t is not None
        ]
        self._resets = 0
        self._lost = [0] * n
        # a layer refused during a call, raised again at the end of the batch in case the model caught it
        self._refused: PreciseBNError | None = None
        self._row = [0] * (n + 1)  # values per channel of each layer in this batch
        self._extras: list[tuple[int, int, int, Tensor, Tensor]] = []  # (layer, call index, n, mean, var)
        # per fold (FOLDS, C), by (layer, call index; 0 unless per_call): float64-path layers, stashed calls
        self._kept: dict[tuple[int, int], RunningMoments] = {}
        self._kept_n: dict[tuple[int, int], list[int]] = {}  # their counts per fold, on the host
        self._batch = 0  # batches ended so far; the current one goes to fold _batch % FOLDS
        self._summed = [[0] * (n + 1) for _ in range(FOLDS)]  # per fold: values per channel in the sums
        self._trials: dict[int, Trial] = {}  # layers being verified in this batch
        # this batch's calls beyond their layer's verified size, on the CPU: (call, values per channel, layout,
        # figures, float64 moments)
        self._beyond: list[tuple[LayerCall, int, int, Tensor, RunningMoments]] = []
        self._spots: SpotChecks | None = None  # CPU: the checks of this batch's calls waiting to be made together
        # this batch's calls read through their figures in layout 1 on the CPU, waiting for their ratio to be
        # compared (see _defer): (call, index in the batch, values per channel, what it normalised or None)
        self._pending: list[tuple[LayerCall, int, int, Tensor | None, int | None]] = []
        self._pending_bytes = 0
        self._agreeing: list[tuple[int, Tensor]] = []  # of those, calls whose input's mean is taken where it agrees
        self._ratio_plans: dict[int, tuple[int, int]] = {}  # layer: (its scratch group, its slot there)
        for g, scratch in enumerate(state.groups):
            for slot, i in enumerate(scratch.layer_ids):
                self._ratio_plans[i] = (g, slot)
        self._ratio_steps: dict[int, tuple[Tensor, Tensor]] = {}  # group: (eps per channel, segment lengths)
        self._bound_tests: dict[tuple[Any, ...], list[tuple[int, Tensor, Tensor, int, int]]] = {}
        self._fronts = 0  # changes of the layers' checked calls (see LayerCall.passed): the cached bounds' version
        self._passing: list[tuple[LayerCall, int, Tensor, float, float]] = []  # (see LayerCall.passed)
        self._count_vectors: dict[tuple[int, ...], list[tuple[Tensor, Tensor]]] = {}
        self._groups: list[_Group] = []
        self._scratch = state.groups
        # after finish(): the pooled (moments, variance, se_mean, se_var) of fast-path layers pooled there
        self.pooled: dict[int, tuple[RunningMoments, Tensor, Tensor, Tensor]] = {}
        for scratch in state.groups:
            own = [i for i in scratch.layer_ids if self.layers[i].path == "fast"]
            if own:
                device = _accumulation_device(scratch.buffer.device)
                self._groups.append(_Group(scratch, scratch.positions(own, other=n), device))
        self._pairs: list[Tensor | None] = [None] * n  # each layer's (mean, var) scratch as one (2, C) view
        for scratch in state.groups:
            for i, pair in zip(scratch.layer_ids, scratch.slices(scratch.buffer)):
                self._pairs[i] = pair
        # Each layer's own statistics (the scratch's starting point), as (2, C) and as (mean, var) views: what
        # the layer's buffers are between its calls, so that code reading them outside the layer's own call (a
        # QAT ConvBn scaling its conv's weight by them, a forward hook) sees the model's statistics, not the
        # figures of a call earlier in the batch; each call is lent its scratch (see LayerCall.__call__).
        self._initial_pairs: list[Tensor | None] = [None] * n
        self._initial_views: list[tuple[Tensor, Tensor] | None] = [None] * n
        for scratch in state.groups:
            assert scratch.initial is not None  # (_allocate_scratch fills it)
            for i, pair in zip(scratch.layer_ids, scratch.slices(scratch.initial)):
                self._initial_pairs[i] = pair
                self._initial_views[i] = (pair[0], pair[1])
        # and as they were: a layer never called through its forward must still hold them at the end (see
        # _refuse_written_around)
        self._pristine = [scratch.initial.clone() for scratch in state.groups]  # type: ignore[union-attr]
        self._calls: list[LayerCall] = []
        for i, layer in enumerate(self.layers):
            self._calls.append(LayerCall(self, i))  # (it looks at the forward before it is wrapped)
            state.wrap_forward(layer.module, self._calls[-1])
            buffers = layer.module._buffers
            buffers["running_mean"], buffers["running_var"] = self._initial_views[i]  # type: ignore[misc]
        # In-place changes of the scratch buffers by anything but torch's normalization kernels (which leave
        # version counters alone): their version counters are read at every call's start and end (see
        # LayerCall.__call__); where the kernels bump them (checked once per device type), not at all. (The
        # statistics a layer holds between its calls are not watched: nothing written there is read.)
        self._scratch_buffers = [g.buffer for g in state.groups]  # (what is held between calls is not read)
        self._guard = bool(self._scratch_buffers) and not any(
            _kernels_bump_versions(b.device) for b in self._scratch_buffers
        )
        self._seen = self._version()
        self._evaluating = state.evaluating  # (see end_batch)
        self._modules = state.modules  # (their names, for its message)
        self._stack: list[int] = []  # layers whose call is running (a call may run inside another's)
        self._last = -1  # the layer whose call returned last
        self._unseen_now()  # (capture="float64": their paths are set already)

    # -- calls -------------------------------------------------------------------------

    def _too_few(self, i: int, x: Tensor) -> InvalidArgumentError:
        if self._calls[i].instance:
            return InvalidArgumentError(
                f"layer {self.layers[i].name!r} ({self.layers[i].type_name}) received maps of one value "
                f"(input of shape {tuple(x.shape)}): InstanceNorm in training mode normalises each sample's channel "
                "over its positions and needs more than one. Feed larger maps, or leave the layer out with layers=. "
                "The model was left unchanged."
            )
        return InvalidArgumentError(
            f"layer {self.layers[i].name!r} ({self.layers[i].type_name}) received one value per channel "
            f"(input of shape {tuple(x.shape)}): BatchNorm in training mode needs at least two to compute a "
            "batch variance. Use batches of two or more samples (e.g. DataLoader(drop_last=True) when the "
            "last batch holds a single sample)."
        )

    def _check(self, i: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor:
        if not self.layers[i].module.training:
            raise InvalidArgumentError(
                f"layer {self.layers[i].name!r} was switched to eval mode during recalibration "
                "(by the model or forward=); precisebn needs it in training mode to measure it. "
                "Do not call model.eval()/model.train() inside forward."
            )
        x = args[0] if args else kwargs.get("input", next(iter(kwargs.values()), None))
        if not isinstance(x, Tensor):
            raise InvalidArgumentError(
                f"layer {self.layers[i].name!r} was called without a tensor input "
                f"({type(x).__name__}); cannot measure it."
            )
        return x

    def _refusal(self, i: int, what: str, remedy: str) -> UnsupportedLayerError:
        """Layer ``i`` refused during the passes, after its verification: ``what`` happened, ``remedy``."""
        layer = self.layers[i]
        return UnsupportedLayerError(
            f"{layer.label} {what}, after precisebn had verified that {remedy} The model was left unchanged."
        )

    def _outside_forward(self, i: int) -> InvalidArgumentError:
        layer = self.layers[i]
        return InvalidArgumentError(
            f"{layer.label} was called while the next batch was being drawn from the "
            "data, not by forward(model, batch): the data (a generator, a loader, a collate function) runs the "
            "model being recalibrated, and those calls would count in its statistics as if they were the "
            "batches'. Have the data run another copy of the model (copy.deepcopy(model)), or compute what it "
            "needs from the model beforehand. The model was left unchanged."
        )

    def _after_passes(self, i: int) -> InvalidArgumentError:
        return InvalidArgumentError(
            f"{self.layers[i].label} was called through precisebn's wrapper of its forward after "
            "the passes that put it there had ended: the module called is a shallow copy of the layer "
            "(copy.copy) made during those passes, which kept the wrapper in its own attributes. Make copies "
            "before or after a recalibration, or with copy.deepcopy (which gives the copy its own forward); "
            "del copy.forward gives this one back its class's forward."
        )

    def _other_thread(self, i: int) -> InvalidArgumentError:
        here = threading.current_thread().name
        return InvalidArgumentError(
            f"{self.layers[i].label} was called in thread {here!r} while precisebn's passes over the model "
            "ran in another thread: precisebn counts the calls of the thread that runs the passes only — a call "
            "from another thread (the data's, prefetching with the model) would count in the statistics as if "
            "it were the batch's, and calls from two threads at once would mix in its bookkeeping. Have the "
            "other thread run another copy of the model (copy.deepcopy(model)), or run the model in forward's "
            "own thread. The model was left unchanged."
        )

    def _put_in_training_mode(self) -> InvalidArgumentError:
        m = next(m for m in self._evaluating if m.training)
        name = next((name for name, module in self._modules if module is m), "?") or "(the model)"
        return InvalidArgumentError(
            f"module {name!r} ({type(m).__name__}) was put in training mode during the passes (model.train() "
            "called by the model or forward=), so that it ran as in training — dropout active, normalization layers "
            "left out normalising with batch statistics — and the selected layers measured other inputs than the "
            "mode precisebn ran them in gives. Do not call model.train()/model.eval() inside forward; to measure with "
            "the model in training mode pass mode='train'. The model was left unchanged."
        )

    def _traced(self, i: int) -> UnsupportedLayerError:
        return UnsupportedLayerError(
            f"{self.layers[i].label} was called by torch.jit.trace during the passes: the trace "
            "would record precisebn's bookkeeping with the layer, and the layers as the passes hold them (in "
            "training mode, momentum 1, precisebn's own buffers), and the traced module would run them ever "
            "after. Trace the model before or after the recalibration. The model was left unchanged."
        )

    def _unseen(self, i: int) -> UnsupportedLayerError:
        """Layer ``i`` normalised with its running buffers out of precisebn's sight (see
        :meth:`~precisebn.layercall.LayerCall._unseen`)."""
        layer = self.layers[i]
        return UnsupportedLayerError(
            f"{layer.label} wrote its running buffers during its forward, as torch's "
            "BatchNorm forward does when it normalises with batch statistics, but precisebn saw no normalization "
            "with them whole, so it cannot tell what the layer normalised (on either path): its forward "
            "computes the statistics itself (a BatchNorm written from scratch), normalises with a part of its "
            "buffers (a slice, as slimmable networks' BatchNorm does: statistics of some of its channels only) or "
            "a copy of them or through TorchScript, or its call is hidden from precisebn's watch "
            "(torch._C.DisableTorchFunctionSubclass(), DisableTorchFunction(), a running_mean stripped of its class). "
            "Exclude the layer with layers=, or have it call F.batch_norm with its own running buffers, outside such "
            "modes. The model was left unchanged."
        )

    def _momentum_changed(self, i: int) -> UnsupportedLayerError:
        return self._refusal(
            i,
            f"had its momentum set to {self.layers[i].module.momentum!r} during the passes (by the model's forward "
            "or a hook)",
            "with momentum 1.0 it leaves each batch's own mean and variance in its buffers: its later figures "
            "would be a mix of batches. Leave the layers' momentum as it is during forward passes, or pass "
            "capture='float64' (every layer measured in float64 as it is called, whatever its momentum).",
        )

    def _called_inside_itself(self, i: int) -> UnsupportedLayerError:
        if self.per_call:
            layer = self.layers[i]
            return UnsupportedLayerError(
                f"per_call=True: {layer.label} was called inside its own call (its "
                "forward calls itself), so its calls have no order to number them by. Estimate without per_call, "
                "or exclude the layer with layers=. The model was left unchanged."
            )
        return self._refusal(
            i,
            "was called inside its own call (its forward calls itself) in a later batch",
            "it leaves each call's figures in its buffers, in the first batch that called it, where no call "
            "inside its own call returned; a call inside another has its figures overwritten by the enclosing one. "
            "Pass capture='float64' (every layer measured in float64 as it is called), or exclude the layer "
            "with layers=.",
        )

    def _version(self) -> int:
        """The sum of the scratch buffers' version counters."""
        buffers = self._scratch_buffers
        return buffers[0]._version if len(buffers) == 1 else sum(t._version for t in buffers)  # type: ignore[no-any-return]

    def _wrote(self) -> None:
        """precisebn itself wrote the scratch buffers (in place): the guard's last look moves past that write, so
        that :meth:`_changed` does not take it for the model's."""
        if self._guard:
            self._seen = self._version()

    def _changed(self) -> bool:
        """Whether the scratch buffers were changed in place since the last look (and looks again)."""
        now = self._version()
        if now == self._seen:
            return False
        self._seen = now
        return True

    def _entered(self, owner: int, nested: bool) -> None:
        """At the start of a call, the scratch changed since the last call started or ended: the change
        belongs to the enclosing call (``nested``), else to the last call's forward hooks or the code after
        it (``owner``); refused if that layer is read through its own figures."""
        if owner >= 0 and self.paths[owner] in ("fast", "verify"):
            raise self._modified_in_place(owner, during=nested)

    def _modified_in_place(self, i: int, during: bool) -> UnsupportedLayerError:
        when = "in its forward" if during else "after its call (by a forward hook, or the model's code after it)"
        return self._refusal(
            i,
            f"had the running buffers precisebn gave it changed in place {when}",
            "it leaves each batch's own figures in them; the figures read would not be those of what it "
            "normalised. Pass capture='float64' (every layer measured in float64 from what it normalises, "
            "whatever is done to its buffers), or exclude the layer with layers=.",
        )

    def _counted_otherwise(self, i: int, moved: int) -> UnsupportedLayerError:
        return self._refusal(
            i,
            f"changed its num_batches_tracked by {moved} in a call (not 1), at an input shape it was verified at",
            "each call computes batch figures once (torch's forward counts each call once): a call that counts "
            "otherwise may have left no figures of its own (one normalising with its running statistics), or "
            "other ones. Pass capture='float64' (every layer measured in float64 from what it normalises), or "
            "exclude the layer with layers=.",
        )

    def _beyond_checked(self, i: int, changed: bool = False) -> UnsupportedLayerError:
        not_at_hand = (
            "what it normalised (its input) was changed in place later in the batch, before it could be measured "
            "in float64"
            if changed
            else "its forward is its own, so what it normalised is not at hand to measure in float64"
        )
        return self._refusal(
            i,
            "left batch figures with a mean further from 0 (in units of its σ) than any of its calls precisebn "
            "checked at that many values per channel, for an input whose channels are adjacent in memory "
            "(channels_last, (N, C)) or in half precision, which torch's CPU kernel reduces in float32, rounding "
            f"more the further the mean is from 0; {not_at_hand}",
            "its figures match what it normalises for such calls. Pass capture='float64' (every layer measured "
            "in float64 from what it normalises), or exclude the layer with layers=.",
        )

    def _defer(self, call: LayerCall, j: int, n: int, t: Tensor | None, agree: Tensor | None = None) -> None:
        """Keeps a call read through its figures in layout 1 on the CPU until its figures' ratio is compared
        with the calls its layer had checked (:meth:`_run_pending`: all waiting calls at once, before the layer
        is called again, at the end of the batch, or once :data:`~precisebn.spotcheck.HELD` bytes of their inputs
        are held): ``t``, what it normalised (held until then, with its version: a model may change it in place
        later in the batch), or ``None`` where that is not known. ``agree``: the float64 mean of ``t``, a forward of
        its own's input, summed at the call (a write into ``t`` later in the batch cannot change it, a review), which
        replaces the call's own mean where the two agree (:meth:`_agreed`)."""
        self._pending.append((call, j, n, t, None if t is None else version_of(t)))
        if agree is not None:
            self._agreeing.append((len(self._pending) - 1, agree))
        if t is not None:
            self._pending_bytes += t.nbytes
            if self._pending_bytes > HELD:
                self._run_pending()

    def _run_pending(self) -> None:
        """The calls kept by :meth:`_defer`: each whose figures no checked call vouches for (see
        :meth:`LayerCall.bound`) has them checked now (:meth:`_vouched`); if they do not pass, what it
        normalised is measured in float64 instead (and its figures checked at the end of the batch, as a call
        beyond its verified size). A call whose normalised tensor is not known is refused.

        Raises:
            UnsupportedLayerError: As said.
        """
        pending, self._pending, self._pending_bytes = self._pending, [], 0
        agreeing, self._agreeing = self._agreeing, []
        if agreeing:
            self._agreed(pending, agreeing)
        self._take_passed()  # (the bounds read below)
        # per scratch group, the ratio each pending call's checked calls vouch for, spread over its channels
        # (cached: usually the same layers with the same counts in every batch, and the same checked calls)
        key = (self._fronts, *[(call.i, n) for call, _, n, _, _ in pending])
        tests = self._bound_tests.get(key)
        if tests is None:
            if len(self._bound_tests) >= _COUNT_CACHE:
                self._bound_tests.clear()
            tests = self._bound_tests[key] = self._bound_vectors(pending)
        # the groups where a call is beyond its bounds on a channel (one test per group, a few kernels), and there
        # whether each layer is
        beyond = {g: self._beyond_bounds(g, *vectors) for g, *vectors in tests}
        if not any(beyond.values()):
            return
        over = {g: self._over_of(g, bound, bound_eps) for g, bound, bound_eps, _, _ in tests if beyond[g]}
        for call, j, n, t, version in pending:
            g, slot = self._ratio_plans[call.i]
            if g not in over or not over[g][slot]:
                continue
            i = call.i
            if t is None or (version is not None and version_of(t) != version):
                self._refused = self._beyond_checked(i, changed=t is not None)
                raise self._refused
            eps_i = float(call.module.eps)
            if self._vouched(t, call.pair, eps_i):
                call.passed(n, call.pair, reach=2.0)
                continue
            moments = moments_of([t])  # (float32 figures here: the call counted n, kept now in float64 instead)
            assert moments is not None
            self._keep((i, j if self.per_call else 0), moments, n)
            self._beyond.append((call, n, 1, call.pair.clone(), moments))
            call.pair.copy_(self._initial_pair(i))
            self._row[i] = 0
            self._wrote()

    def _agreed(self, pending: list[tuple[LayerCall, int, int, Any, Any]], agreeing: list[tuple[int, Tensor]]) -> None:
        """For the waiting calls ``pending[k]`` (``(k, mean)`` in ``agreeing``) of layers with a forward of their own,
        seen to normalise their input itself, with at most EXACT_UP_TO values per channel: their input's ``mean``
        (float64, summed at the call) replaces their own figures' where the two agree within twice what torch's
        float32 sum may round and the tolerance (see :func:`~precisebn.figures.remean`, which takes it for one call
        of torch's own forward) — all at once, one host read. Where they do not, the call keeps its own figures and
        nothing is known of what it normalised (``t`` None)."""
        entries = [k for k, _ in agreeing]
        means = [mean for _, mean in agreeing]
        calls = [pending[k][0] for k in entries]
        sizes = [m.numel() for m in means]
        mean = torch.cat(means)
        own, var = torch.cat([call.pair for call in calls], 1).double()
        steps = [(float(pending[k][2]), float(pending[k][0].module.eps)) for k in entries]
        n: Tensor | float
        eps: Tensor | float
        if len(set(steps)) == 1:  # (usually: as numbers, the same arithmetic without spreading them over channels)
            n, eps = steps[0]
        else:
            lengths = torch.tensor(sizes, device="cpu")
            n, eps = (
                torch.tensor(v, dtype=torch.float64, device="cpu").repeat_interleave(lengths) for v in zip(*steps)
            )
        far = torch.gt(own.sub_(mean).abs_(), mean_bound(mean, var, n, eps))
        if not bool(far.any()):  # (usually: every call agrees, one reduction)
            disagree = [False] * len(calls)
        else:
            owner = torch.arange(len(calls), device="cpu").repeat_interleave(torch.tensor(sizes, device="cpu"))
            disagree = torch.zeros(len(calls), device="cpu").scatter_reduce_(0, owner, far.float(), "amax").tolist()
        taken = [(call.pair[0], m) for call, m, d in zip(calls, means, disagree) if not d]
        if taken:
            torch._foreach_copy_([p for p, _ in taken], [m for _, m in taken])
            self._wrote()
        for k, d in zip(entries, disagree):
            if d:  # (it normalised something else this time: its own figures, nothing to check them against)
                call, j, n, _, _ = pending[k]
                pending[k] = (call, j, n, None, None)

    def _bound_vectors(
        self, pending: list[tuple[LayerCall, int, int, Any, Any]]
    ) -> list[tuple[int, Tensor, Tensor, int, int]]:
        """Per scratch group of the pending calls: the ratio each call's checked calls vouch for (see
        :meth:`LayerCall.bound`) on its layer's channels, infinite elsewhere, that times eps, and the stretch of
        the buffer that holds those layers."""
        by_slot: dict[int, dict[int, float]] = {}
        for call, _, n, _, _ in pending:
            g, slot = self._ratio_plans[call.i]
            by_slot.setdefault(g, {})[slot] = call.bound(n)
        out = []
        for g, bounds in by_slot.items():
            eps, lengths = self._ratio_steps_of(g)
            segments = [float("inf")] * len(lengths)  # (the gaps, then each layer: 2·slot + 1)
            for slot, value in bounds.items():
                segments[2 * slot + 1] = value
            bound = torch.tensor(segments, dtype=eps.dtype, device="cpu").repeat_interleave(lengths)
            scratch = self._scratch[g]  # (the test reads only the stretch of the buffer that holds these layers)
            lo = min(scratch.offsets[slot] for slot in bounds)
            hi = max(scratch.offsets[slot] + scratch.channels[slot] for slot in bounds)
            out.append((g, bound, bound * eps, lo, hi))
        return out

    def _beyond_bounds(self, g: int, bound: Tensor, bound_eps: Tensor, lo: int, hi: int) -> bool:
        """Whether in scratch group ``g`` (columns ``lo:hi``) a layer's figures are beyond their bound on some
        channel (see :meth:`_over`)."""
        return bool(self._over(g, bound, bound_eps, lo, hi).any())

    def _over(self, g: int, bound: Tensor, bound_eps: Tensor, lo: int, hi: int) -> Tensor:
        """Per channel of scratch group ``g``'s columns ``lo:hi``: mean² > bound · (var + eps), where the data
        vary (variance 0: constant data, exact figures; NaN is not beyond: non-finite figures are refused by
        name at the end anyway)."""
        mean, var = self._scratch[g].buffer[:, lo:hi]
        over = torch.gt(mean.square(), torch.addcmul(bound_eps[lo:hi], bound[lo:hi], var))
        return over.logical_and_(var > 0)

    def _ratio_steps_of(self, g: int) -> tuple[Tensor, Tensor]:
        """Scratch group ``g``'s eps per channel (1 in the gaps between layers) and the lengths of its segments
        (the gaps and the layers' channels, in turn)."""
        if g not in self._ratio_steps:
            scratch = self._scratch[g]
            values, lengths, at = [], [], 0
            for i, off, c in zip(scratch.layer_ids, scratch.offsets, scratch.channels):
                values += [1.0, float(self.layers[i].module.eps)]
                lengths += [off - at, c]
                at = off + c
            values.append(1.0)
            lengths.append(scratch.buffer.shape[1] - at)
            counts = torch.tensor(lengths, device="cpu")
            eps = torch.tensor(values, dtype=scratch.buffer.dtype, device="cpu").repeat_interleave(counts)
            self._ratio_steps[g] = (eps, counts)
        return self._ratio_steps[g]

    def _over_of(self, g: int, bound: Tensor, bound_eps: Tensor) -> list[bool]:
        """By the slots of ``_ratio_plans``: whether each layer of scratch group ``g`` has a channel beyond its
        bound (see :meth:`_beyond_bounds`) — one segmented maximum over the whole buffer (its segments: the
        layers' channels and the gaps between them)."""
        _, lengths = self._ratio_steps_of(g)
        over = self._over(g, bound, bound_eps, 0, bound.numel()).to(bound.dtype)
        return [bool(v) for v in torch.segment_reduce(over, "max", lengths=lengths, unsafe=True).tolist()[1::2]]

    def _vouched(self, t: Tensor, pair: Tensor, eps: float) -> bool:
        """Whether the float32 figures ``pair`` of a later call, which no checked call vouches for (see
        :meth:`LayerCall.bound`), pass a check now against ``t``, what it normalised — on every channel,
        within a quarter of the tolerance (:meth:`~precisebn.spotcheck.SpotChecks.check_now`)."""
        if pair.dtype != torch.float32:
            return False
        verdict = self._spot_checks().check_now(t, pair, eps, every=True)
        self._wrote()  # (figures that passed are the reference's now)
        return verdict is True

    def _spot_checks(self) -> SpotChecks:
        """The batch's CPU checks of float32 figures (made when first needed)."""
        if self._spots is None:
            self._spots = SpotChecks(TOLERANCE[torch.float32], torch.finfo(torch.float32).eps / 2)
        return self._spots

    def _buffers_replaced(self, i: int) -> UnsupportedLayerError:
        return self._refusal(
            i,
            "had its running_mean/running_var replaced by other tensors during the passes (by the model's forward "
            "or a hook)",
            "it leaves each batch's figures in the buffers precisebn gave it: its later figures went elsewhere. "
            "Leave the layers' buffers in place during forward passes, or pass capture='float64' (every layer "
            "measured in float64 as it is called, whatever its buffers).",
        )

    def _initial_pair(self, i: int) -> Tensor:
        """Layer ``i``'s own statistics as its scratch holds them before its first call of a batch, ``(2, C)``."""
        pair = self._initial_pairs[i]
        assert pair is not None  # (every layer is in a group)
        return pair

    def _failed(self, i: int, j: int, before: int) -> None:
        """Takes back the call of layer ``i`` (index ``j`` in the batch) that raised: nothing of it was
        counted (and its scratch is as before it, see :meth:`LayerCall.unstash`), so that if the model
        goes on (catching the error), the layer is as before the call — but for what the call did to its
        counter (from version ``before``), taken off the check in :meth:`finish` (only that: a shortfall of
        earlier calls still shows there)."""
        if self._in_batch[i] == j + 1:
            self._in_batch[i] = j
        self._wrote()  # (unstash wrote the scratch)
        counter = self._counters[i]
        if counter is not None:
            self._lost[i] += counter._version - before

    def _count_call(self, i: int, j: int, n: int) -> None:
        counts = self.call_counts[i]
        while len(counts) <= j:
            counts.append(0)
        counts[j] += n

    # -- batches -----------------------------------------------------------------------

    def end_batch(self) -> None:
        """Merges the figures of the batch that just ran (call after each forward).

        Raises:
            InvalidArgumentError: With ``per_call``, a layer was called a different
                number of times than in an earlier batch that called it.
        """
        if self._refused is not None:
            raise self._refused
        if self._guard and self._changed():  # (before precisebn's own writes below: see _wrote)
            self._entered(self._last, nested=False)  # (as if the next call started: after the last one)
        if self._pending:
            self._run_pending()
        if self.per_call:
            self._check_calls_per_batch()
        if any(map(_TRAINING, self._evaluating)):  # (model.train() in forward: every module ran in training mode)
            raise self._put_in_training_mode()
        self._in_batch = [0] * len(self.layers)
        if self._spots:
            self._run_spot_checks()
        if self._trials:
            self._settle()
            self._unseen_now()
        if self._beyond:
            self._check_beyond()
        self._take_passed()
        fold = self._batch % FOLDS
        if self._groups:
            self._sum_figures(fold)
        if self._extras:
            self._merge_extras()  # into this batch's fold, like everything else of it
        for scratch in self._scratch:  # what the next batch reads before a layer's first call
            scratch.reset()
        if self._counter_list:  # each batch shows a layer the counts the verified one did (a forward may use them)
            first = self._counter_list[0]
            before = first._version
            if self._unseen_lists[0]:  # (what they counted: see _unseen_now)
                counters, starts, counted = self._unseen_lists
                torch._foreach_add_(counted, torch._foreach_sub(counters, starts))
            torch._foreach_copy_(self._counter_list, self._counter_starts)  # (the layers' own counts again)
            # (what a reset adds to each counter's version: 1, but 0 under a TorchDispatchMode, where the foreach
            # kernel bumps none — counted as 1, every layer was refused as never computing batch statistics)
            self._resets += first._version - before
            for buffers, counter in self._counter_homes:  # (host only) also to one that replaces its counter
                if buffers.get("num_batches_tracked") is not counter:
                    buffers["num_batches_tracked"] = counter
        self._wrote()  # (the resets wrote the scratch)
        self._batch += 1

    def _unseen_now(self) -> None:
        """The layers whose counts by value :meth:`finish` compares with their calls (on the float64 path, torch's
        own forward, a counter): after their paths are settled, or set (capture="float64")."""
        ids = [
            i
            for i, path in enumerate(self.paths)
            if path == "float64" and self._calls[i].own_forward and self._counters[i] is not None
        ]
        for i in ids:
            if i not in self._counted:
                self._counted[i] = torch.zeros_like(self._counters[i])  # type: ignore[arg-type]
        self._unseen_lists = (
            [self._counters[i] for i in ids],  # type: ignore[misc]
            [self._starts[i] for i in ids],  # type: ignore[misc]
            [self._counted[i] for i in ids],
        )

    def _moves(self, i: int) -> int:
        """How many times layer ``i``'s scratch counter was written in place during the passes, besides precisebn's
        own resets and the calls that raised or ran watched: one per call of torch's forward that computed batch
        figures, where nothing else writes it."""
        return self._counters[i]._version - self._born[i] - self._resets - self._lost[i]  # type: ignore[union-attr]

    def _refuse_written_around(self, never: list[int]) -> None:
        """Refuses a layer that precisebn's wrapper never saw called but whose running buffers were written during the
        passes: its counter moved (torch's forward counts each call that computes batch figures), or what it holds
        between calls changed. Something normalised with them around its forward — a bound method kept from before
        the passes (``self.norm = self.bn.forward``), a call through its class, another module calling
        ``F.batch_norm`` with its buffers — and what that normalised was not measured: reported "not reached
        (kept)", its statistics stayed stale (a probe). Host reads for such layers only, once, at the end. Writes by
        another process into memory it shares (a spawned loader worker's copy of the model) are not this one's."""
        written = []
        for i in never:
            g, slot = self._ratio_plans[i]
            moved = 0 if self._counters[i] is None else self._moves(i)
            held = self._initial_pairs[i]
            # (by value only where that memory is this process's own: a spawned loader worker given the model holds
            # it shared, and its copy may run a layer the passes never reach, a review found; versions are per process)
            shared = self._scratch[g].initial.is_shared()  # type: ignore[union-attr]
            if moved > 0 or (not shared and not torch.equal(held, self._scratch[g].slices(self._pristine[g])[slot])):  # type: ignore[arg-type]
                written.append(self.layers[i].label)
        if written:
            shown = ", ".join(written[:5]) + (f" and {len(written) - 5} more" if len(written) > 5 else "")
            raise UnsupportedLayerError(
                f"{shown}: never called through its forward during the passes, yet its running buffers were "
                "written as a normalization in training mode writes them: something ran it around the layer's "
                "forward — a bound method kept from before the passes (self.norm = self.bn.forward), a call through "
                "its class (nn.BatchNorm2d.forward(self.bn, x)), or another module calling F.batch_norm with its "
                "buffers — so what it normalised was not measured. Call the layer itself (self.bn(x)) in the model's "
                "forward, or exclude it with layers=. The model was left unchanged."
            )

    def _take_passed(self) -> None:
        """Gives the calls recorded by :meth:`LayerCall.passed` their largest mean² / (var + eps) over the channels
        whose data vary (NaN where a figure is), in their figures' dtype: a few kernels per dtype and one host read,
        whatever their number."""
        passing, self._passing = self._passing, []
        by_dtype: dict[torch.dtype, list[tuple[LayerCall, int, Tensor, float, float]]] = {}
        for entry in passing:
            by_dtype.setdefault(entry[2].dtype, []).append(entry)
        for dtype, entries in by_dtype.items():
            pairs = [pair for _, _, pair, _, _ in entries]
            mean, var = torch.cat(pairs, 1) if len(pairs) > 1 else pairs[0]
            epsilons = [e for _, _, _, e, _ in entries]
            if len(pairs) == 1 and mean.numel() and dtype in (torch.float32, torch.float64):  # (amax: NaN too)
                r2 = [float(torch.where(var > 0, mean.square().div_(var + epsilons[0]), 0.0).amax())]
            else:
                # (a maximum per call by scatter_reduce: several times faster than segment_reduce on the CPU; the
                # same NaN, -inf for a call without channels; eps as a number where every call shares it, the same
                # arithmetic where the figures' dtype is float32 or float64: a half-precision kernel would add a
                # number in float32)
                sizes = torch.tensor([pair.shape[1] for pair in pairs], device="cpu")
                owner = torch.arange(len(pairs), device="cpu").repeat_interleave(sizes)
                eps = (
                    epsilons[0]
                    if len(set(epsilons)) == 1 and dtype in (torch.float32, torch.float64)
                    else torch.tensor(epsilons, dtype=dtype, device="cpu").index_select(0, owner)
                )
                terms = torch.where(var > 0, mean.square().div_(var + eps), 0.0)
                largest = torch.full((len(pairs),), float("-inf"), dtype=terms.dtype, device="cpu")
                r2 = largest.scatter_reduce_(0, owner, terms, "amax").tolist()
            for (call, n, _, _, reach_), value in zip(entries, r2):
                call.vouch(n, value, reach_)

    def _check_beyond(self) -> None:
        """Checks the figures of this batch's calls beyond their layer's verified size (on the CPU)
        against their float64 moments: a layer whose call passes reads later calls of up to that many
        values per channel, in that layout, through their figures."""
        beyond, self._beyond = self._beyond, []
        items = [(pair[0], pair[1], moments, float(call.module.eps)) for call, _, _, pair, moments in beyond]
        for (call, n, layout, pair, _), score in zip(beyond, discrepancies(items)):
            if score <= TOLERANCE[pair.dtype]:
                call.verified[layout] = max(call.verified[layout], verified_size(n, layout, pair.device))
                if layout:  # (how far it passed: how much further it vouches for)
                    call.passed(n, pair, reach=reach(score, TOLERANCE[pair.dtype]))

    def _sum_figures(self, fold: int) -> None:
        """Adds the figures left in the scratch buffers by this batch's last calls to the sums."""
        row, self._row = self._row, [0] * (len(self.layers) + 1)
        summed = self._summed[fold]
        for i, n in enumerate(row):
            if n:
                summed[i] += n
        for g, (count, count_minus_one) in zip(self._groups, self._counts_on_device(row)):
            mean, var = g.scratch.buffer[0], g.scratch.buffer[1]
            if g.device != mean.device:
                mean, var = mean.to(g.device), var.to(g.device)
            if g.shift is None:  # the first batch's figures; 0 for a layer it did not call (its scratch
                g.shift = torch.where(count > 0, mean.to(torch.float64), 0.0)  # holds the model's statistics)
                g.pending = {i for i in g.scratch.layer_ids if not row[i]}
            elif g.pending and any(row[i] for i in g.pending):  # a layer's first batch: its figures (its sums are 0)
                first = [i for i in g.pending if row[i]]
                g.pending.difference_update(first)
                host = torch.zeros(len(row), dtype=torch.float64, device="cpu")
                host[first] = 1.0
                g.shift = torch.where(g.per_channel(host) > 0, mean.to(torch.float64), g.shift)
            d = torch.sub(mean, g.shift, out=g.d)  # float64; garbage only where count is 0
            s1, s2 = g.s1[fold], g.s2[fold]
            if self._batch < FOLDS:  # this fold's first batch: its rows are written, not added to
                torch.mul(d, count, out=s1)
                torch.mul(s1, d, out=s2).addcmul_(var, count_minus_one)
            else:
                nd = torch.mul(d, count, out=g.nd)
                s1.add_(nd)
                s2.addcmul_(nd, d).addcmul_(var, count_minus_one)

    def _check_on_cpu(self, i: int, trial: Trial, seen: list[Tensor], x: Tensor, n: int, pair: Tensor) -> bool:
        """On the CPU, where reading a value costs no synchronisation: checks a call's own figures
        on a few channels — every channel where the channels are adjacent in memory (channels_last,
        ``(N, C)``: see :func:`_layout`) — (float32 figures: together with other calls', see
        :mod:`~precisebn.spotcheck`; float64 figures: at once) rather than reducing all it
        normalised in float64; a call that passes keeps its figures as its moments. Returns whether they were
        seen to pass within a quarter of the tolerance already (checked at once, on every channel:
        :meth:`~precisebn.spotcheck.SpotChecks.check_now` with ``every``)."""
        layer = self.layers[i]
        channels = layer.channels
        t = fitting(seen, x, channels)
        if t is None:
            trial.add(seen, x, channels, n)
            return False
        # channels adjacent in memory: torch's kernel rounds more, and most where |mean|/σ is largest, in a
        # channel a few checked ones can miss: every channel is checked
        every = bool(layout_of(t))
        eps = float(layer.module.eps)
        if pair.dtype != torch.float32:
            trial.add_checked(t, x, channels, n, pair, eps)
            return False
        spots = self._spot_checks()
        nbytes = t.numel() * t.element_size()
        if spots.at_once(nbytes):  # checked now: holding it until the others' checks costs fresh pages
            verdict = spots.check_now(t, pair, eps, every)  # (None: passed on every channel, not comfortably)
            self._wrote()  # (figures that passed on every channel are the reference's now)
            trial.checked(verdict is not False, seen, x, channels, n)
            return verdict is True and every
        if not spots.room(n, nbytes, channels, every):
            self._run_spot_checks()
        version = version_of(t)  # None: an inference tensor, checked at once (nothing can have changed it yet)
        trial.calls.append((n, None, n, trial.slot))  # passed, unless the check says otherwise
        spots.add((i, trial, len(trial.calls) - 1, seen, x, n, version), i, t, pair, eps, nbytes, every)
        if version is None:
            self._run_spot_checks()
        return False

    def _run_spot_checks(self) -> None:
        """Makes the waiting CPU checks; a call that fails is reduced in float64 whole, from
        what it normalised (held until now).

        Raises:
            UnsupportedLayerError: A call failed, but what it normalised was changed in place
                since, so that it cannot be measured from it either.
        """
        assert self._spots is not None
        checked = self._spots.run_graded()
        self._wrote()  # (figures that passed on every channel are the reference's now)
        for (i, trial, k, seen, x, n, version), passed, comfortably in checked:
            if passed:
                if comfortably and layout_of(seen[0]):  # (it vouches for calls up to twice as far from 0: see passed)
                    call = self._calls[i]
                    call.passed(n, call.pair, reach=2.0)
                continue
            if version is not None and version_of(seen[0]) != version:
                layer = self.layers[i]
                raise UnsupportedLayerError(
                    f"{layer.label}: its own batch figures did not match what it "
                    "normalised, and that tensor was changed in place after the layer's call, before precisebn "
                    "could measure it in float64. Pass capture='float64' (every layer measured in float64 as it "
                    "is called), or exclude the layer with layers=. The model was left unchanged."
                )
            trial.off = True
            trial.redo(k, seen, x, self.layers[i].channels, n)

    def _check_calls_per_batch(self) -> None:
        for i, k in enumerate(self._in_batch):
            if not k or k == self.per_batch[i]:
                continue
            if not self.per_batch[i]:
                self.per_batch[i], self._first_batch[i] = k, self._batch
                continue
            layer = self.layers[i]
            raise InvalidArgumentError(
                f"per_call=True: {layer.label} was called {times(self.per_batch[i])} in "
                f"batch {self._first_batch[i] + 1} (the first to call it) but {times(k)} in batch {self._batch + 1}; "
                "per-call statistics need the same number of calls in every forward (statistics i are those of "
                "call i). Feed every batch the same way (e.g. the same number of feature levels), or estimate "
                "without per_call to pool all calls. The model was left unchanged."
            )

    def _settle(self) -> None:
        """Decides the path of every layer verified in this batch (one host read per device)."""
        self._take_passed()  # (their checked calls read below)
        trials, self._trials = self._trials, {}
        # each call's figures: those kept when the layer was called again, then what is in its buffers now
        figures: dict[int, list[tuple[Tensor, Tensor]]] = {}
        for i, _, _, mean, var in self._extras:
            figures.setdefault(i, []).append((mean, var))
        items, owners = [], []
        for i, trial in trials.items():
            if trial.fits and not trial.off:
                calls = [*figures.get(i, []), self._views[i]]
                eps = float(self.layers[i].module.eps)
                items += [(*calls[slot], ref, eps) for slot, ref in trial.refs]
                owners += [i] * len(trial.refs)
        worst = dict.fromkeys(trials, 0.0)
        scores = discrepancies(items)
        for i, value in zip(owners, scores):
            worst[i] = max(worst[i], value)
        for i, (mean, var, ref, _), value in zip(owners, items, scores):  # calls checked whole, in layout 1 on the
            call = self._calls[i]  # CPU: how far they passed says how much further they vouch (see _check_beyond)
            tolerance = TOLERANCE[mean.dtype]
            only_layout_1 = call.ratios and not call.verified[0]  # (every call of this batch in layout 1)
            if call.on_cpu and mean.dtype == torch.float32 and worst[i] <= tolerance and only_layout_1:
                call.passed(int(ref.count.reshape(-1)[0]), torch.stack([mean, var]), reach=reach(value, tolerance))
        for i, trial in trials.items():
            dtype = self._views[i][0].dtype  # the layer's own buffers may be gone by now (a forward may drop them)
            if trial.fits and not trial.off and worst[i] <= TOLERANCE[dtype]:
                self.paths[i] = "fast"
                self._checked_calls[i] = trial.counted
                continue
            # undo this batch's fast-path bookkeeping; use the float64 figures of what it normalised
            self.counts[i], self._row[i] = trial.counts, 0
            self._extras = [e for e in self._extras if e[0] != i]
            moments = trial.resolve([*figures.get(i, []), self._views[i]])
            if self.per_call:  # this batch's calls are indices 0, 1, ... of the layer's trial
                for j, (n, _, values, _) in enumerate(trial.calls):
                    self.call_counts[i][j] += (values if moments is not None else 0) - n
            if moments is None:
                self.paths[i] = "none"
                continue
            self.paths[i] = "float64"
            self.counts[i] += sum(values for _, m, values, _ in trial.calls if m is not None)
            if self.per_call:
                for j, (_, call_moments, values, _) in enumerate(trial.calls):
                    if call_moments is not None:
                        self._keep((i, j), call_moments, values)
            else:
                self._keep((i, 0), moments, sum(values for _, m, values, _ in trial.calls if m is not None))
            logger.info(
                "precisebn: layer %r measured in float64 (its own figures are %s)",
                self.layers[i].name,
                f"off by {worst[i]:.2g}" if trial.fits else "not those of what it normalises",
            )

    def _counts_on_device(self, row: list[int]) -> list[tuple[Tensor, Tensor]]:
        """Per-channel (n, n - 1) of each group for a batch's per-layer counts (cached)."""
        key = tuple(row)
        vectors = self._count_vectors.get(key)
        if vectors is None:
            if len(self._count_vectors) >= _COUNT_CACHE:
                self._count_vectors.clear()
            host = torch.tensor(row, dtype=torch.float64, device="cpu")
            vectors = []
            for g in self._groups:
                count = g.per_channel(host)
                vectors.append((count, (count - 1).clamp_min_(0)))
            self._count_vectors[key] = vectors
        return vectors

    def _merge_extras(self) -> None:
        by_layer: dict[tuple[int, int], list[tuple[int, Tensor, Tensor]]] = {}
        for i, j, n, mean, var in self._extras:
            by_layer.setdefault((i, j if self.per_call else 0), []).append((n, mean, var))
        self._extras.clear()
        for key, items in by_layer.items():
            acc = _accumulation_device(items[0][1].device)
            count = _to_device(torch.tensor([n for n, _, _ in items], dtype=torch.float64, device="cpu"), acc)[:, None]
            means = torch.stack([m for _, m, _ in items]).to(acc, torch.float64)
            m2 = torch.stack([v for _, _, v in items]).to(acc, torch.float64) * (count - 1)
            self._keep(key, RunningMoments.from_batches(count.expand_as(means), means, m2), sum(n for n, _, _ in items))

    def _keep(self, key: tuple[int, int], moments: RunningMoments, n: int) -> None:
        """Merges float64 moments of ``n`` values per channel (every channel's count, known on the
        host) into the current batch's fold of ``key`` (layer, call index); the fold's count is
        kept on the host, and written into the moments by :meth:`finish`."""
        kept = self._kept.get(key)
        if kept is None:
            kept = self._kept[key] = RunningMoments.zeros((FOLDS, moments.mean.shape[0]), moments.mean.device)
            self._kept_n[key] = [0] * FOLDS
        fold = self._batch % FOLDS
        counts = self._kept_n[key]
        merge_counted(kept.mean[fold], kept.m2[fold], counts[fold], moments.mean, moments.m2, n)
        counts[fold] += n

    # -- results -----------------------------------------------------------------------

    def finish(self, *, pool: bool = True, overwrite: bool = False) -> list[list[RunningMoments]]:
        """Each layer's moments per fold, shape ``(K, channels)`` with ``K = min(batches, FOLDS)``
        (the folds that can hold values), over everything it saw (count 0 if never reached);
        see :func:`precisebn.stats.fold_errors`. One set per
        layer, or with ``per_call`` one per call index for a layer called k > 1 times per
        batch (in call order).

        With ``pool``, fast-path layers whose every fold holds values (K >= 2, each call's
        figures in the sums) get their pooled moments, population variance and standard
        errors here, from their group's sums at once
        (:func:`~precisebn.stats.fold_errors_from_sums`), kept in ``pooled`` by layer; their
        entry is then those pooled moments as one fold, shape ``(1, channels)``.
        ``overwrite``: the last call, the sums may serve as scratch space.

        Raises:
            UnsupportedLayerError: A layer read through its own figures was called but its
                forward did not produce them (checked on the host: each call of torch's
                BatchNorm forward increments the layer's scratch ``num_batches_tracked``).
        """
        if self._refused is not None:  # (a call refused after the last batch: while the data ran out)
            raise self._refused
        unseen = [i for i in self._counted if self.paths[i] == "float64"]  # (torch's own forward counts each call)
        if unseen:
            counted = torch.stack([self._counted[i].reshape(()) for i in unseen]).tolist()
            for i, n in zip(unseen, counted):
                version = self._moves(i)
                # more counts by value and by version: a value alone may be another process's (a spawned loader
                # worker's copy shares the counter's memory, not its version), a version alone a reset in forward
                if n - self._lost[i] > self.calls[i] and version > self.calls[i]:
                    layer = self.layers[i]
                    raise UnsupportedLayerError(
                        f"{layer.label} ran {n - self._lost[i] - self.calls[i]} times "
                        "around precisebn's wrapper of its forward, which saw and measured "
                        f"{self.calls[i]} calls (its num_batches_tracked counted {n - self._lost[i]}): the model's "
                        "modules had their forward attribute removed during the passes, a bound method of the layer "
                        "kept from before them ran (self.norm = self.bn.forward; or a call through its class), or a "
                        "copy sharing their buffers ran, so that what those calls normalised was not measured. Run "
                        "the model itself in forward=, call the layer itself (self.bn(x)), and leave its modules' "
                        "forward attributes alone during the passes. The model was left unchanged."
                    )
        never = [i for i, calls in enumerate(self.calls) if not calls]
        if never:
            self._refuse_written_around(never)
        for i, layer in enumerate(self.layers):
            counter = self._counters[i]
            if not self._checked_calls[i] or counter is None:
                continue
            computed = self._moves(i)  # by calls that returned
            if computed > self.calls[i]:  # (its forward wrote the counter besides torch's increments)
                raise UnsupportedLayerError(
                    f"{layer.label}: its num_batches_tracked, which torch's BatchNorm "
                    f"forward increments once per call that computes batch statistics, changed {computed} times in "
                    f"the {self.calls[i]} calls precisebn saw: its forward (or a hook) also writes the counter (e.g. "
                    "reset_running_stats()), so precisebn cannot tell from it that every call left figures to read — "
                    "pass capture='float64' (every layer measured in float64 as it is called), or exclude the layer "
                    "with layers= — or calls of it went around precisebn's wrapper of its forward (its forward "
                    "attribute removed during the passes), and what they normalised was not measured: run the model "
                    "itself in forward=. The model was left unchanged."
                )
            if computed != self.calls[i]:
                raise UnsupportedLayerError(
                    f"{layer.label} was called {self.calls[i]} times, but its forward "
                    f"computed batch statistics {computed} times: for some calls after the first batch it did not "
                    "(a forward that normalises some inputs with its running statistics instead, or torch's "
                    "BatchNorm forward replaced at run time), so the figures precisebn would read for those were "
                    "never written (or its forward replaced its num_batches_tracked, whose increments then went "
                    "elsewhere). Pass capture='float64' (every layer measured in float64 as it is called), "
                    "restore the layer's forward, or exclude it with layers=. The model was left unchanged."
                )
        for key, kept in self._kept.items():  # their counts, on the host until now
            counts = torch.tensor(self._kept_n[key], dtype=torch.float64, device="cpu")
            kept.count.copy_(_to_device(counts, kept.count.device)[:, None])
        folds = max(1, min(self._batch, FOLDS))  # fold b holds batches b, b + FOLDS, ...: the rest are empty
        summed = torch.tensor(self._summed[:folds], dtype=torch.float64, device="cpu")  # (folds, layers + 1)
        self.pooled = {}
        own = {}
        for g in self._groups:
            fast = [i for i in g.scratch.layer_ids if self.paths[i] == "fast"]
            if not fast:
                continue
            keep = set(fast)
            stashed = any(key[0] in keep for key in self._kept)
            if pool and folds > 1 and g.shift is not None and not stashed and float(summed[:, fast].amin()) > 0:
                own.update(self._pool(g, g.shift, keep, summed, folds, overwrite))
            else:
                own.update(self._own_moments(g, keep, summed, folds))
        out = []
        for i in range(len(self.layers)):
            channels = self._views[i][0].shape[0]
            k = max(self.per_batch[i], 1) if self.per_call else 1
            parts = [self._kept.get((i, j)) for j in range(k)]
            parts = [p[:folds] if p is not None else None for p in parts]
            if self.paths[i] == "fast":  # the last call of each batch is in the sums
                m = own[i]
                if parts[-1] is not None:  # pooled: the calls before the last one in a batch
                    m.merge(parts[-1].to(m.mean.device))
                parts[-1] = m
            device = _accumulation_device(self._views[i][0].device)
            out.append([p if p is not None else RunningMoments.zeros((folds, channels), device) for p in parts])
        return out

    def _own_moments(self, g: _Group, keep: set[int], summed: Tensor, folds: int) -> dict[int, RunningMoments]:
        """Fast-path layers' moments per fold: views of the group's moments, computed over its
        whole buffer at once (the other columns come out meaningless, and are not read)."""
        shift = g.shift if g.shift is not None else torch.zeros_like(g.s1[0])
        m = RunningMoments.from_shifted_sums(g.per_channel(summed), shift, g.s1[:folds], g.s2[:folds])
        parts = zip(g.scratch.layer_ids, *(g.scratch.slices(t) for t in (m.count, m.mean, m.m2)))
        return {i: RunningMoments(count, mean, m2) for i, count, mean, m2 in parts if i in keep}

    def _pool(
        self, g: _Group, shift: Tensor, keep: set[int], summed: Tensor, folds: int, overwrite: bool
    ) -> dict[int, RunningMoments]:
        """Fast-path layers' pooled moments and errors (into ``pooled``), computed over the
        group's whole buffer at once: a few kernels on its sums, whatever the number of layers
        (the alignment gaps and other layers' columns come out meaningless, and are not read)."""
        pooled, se_mean, se_var = fold_errors_from_sums(
            g.per_channel(summed), shift, g.s1[:folds], g.s2[:folds], overwrite=overwrite
        )
        var = pooled.var
        out = {}
        pieces = (g.scratch.slices(t) for t in (pooled.count, pooled.mean, pooled.m2, var, se_mean, se_var))
        for i, count, mean, m2, v, sm, sv in zip(g.scratch.layer_ids, *pieces):
            if i in keep:
                self.pooled[i] = (RunningMoments(count, mean, m2), v, sm, sv)
                out[i] = RunningMoments(count[None], mean[None], m2[None])
        return out

    def precision(self) -> float:
        """The worst layer's median standard error so far: the largest, over layers that
        hold values, of the median over the channels that vary (a constant channel's
        errors are 0: half the channels dead would make any median 0) of the mean's error
        (in standard deviations) and of the variance's relative error; 0 for a layer whose
        every channel is constant; ``inf`` while unknown (one host read per device)."""
        by_device: dict[torch.device, list[Tensor]] = {}
        for i, (parts, count) in enumerate(zip(self.finish(), self.counts)):
            for folds in parts if count else ():
                if i in self.pooled:
                    _, var, se_mean, se_var = self.pooled[i]
                else:
                    pooled, se_mean, se_var = fold_errors(folds)
                    var = pooled.var.reshape(se_mean.shape)
                live = var > 0  # (NaN: not counted)
                median = torch.maximum(  # (masks and nanquantile: no host read, unlike indexing)
                    se_mean.masked_fill(~live, float("nan")).nanquantile(0.5),
                    se_var.masked_fill(~live, float("nan")).nanquantile(0.5),
                )
                worst = torch.where(live.any() | (var != var).any(), median, torch.zeros_like(median))
                by_device.setdefault(worst.device, []).append(worst)
        values = [v for group in by_device.values() for v in torch.stack(group).tolist()]
        return max((v if v == v else float("inf") for v in values), default=float("inf"))


_BUMPS: dict[str, bool] = {}


def _kernels_bump_versions(device: torch.device) -> bool:
    """Whether torch's BatchNorm kernels on ``device``'s type bump the version counters of the running
    buffers they update (they do not on the CPU): checked once per device type, with a tiny call."""
    if device.type not in _BUMPS:
        with torch.no_grad():
            flat = torch.zeros(2, 2, device=device)
            before = flat._version
            x = torch.arange(6.0, device=device).reshape(3, 2)  # (no random numbers: the model's streams stay)
            torch.nn.functional.batch_norm(x, flat[0], flat[1], training=True, momentum=1.0)
            _BUMPS[device.type] = flat._version != before
    return _BUMPS[device.type]


class _Group:
    """Accumulators of one scratch buffer: float64 sums around a per-channel shift."""

    __slots__ = ("d", "device", "nd", "pending", "position_layer", "s1", "s2", "scratch", "shift")

    def __init__(self, scratch: ScratchGroup, position_layer: Tensor, device: torch.device) -> None:
        self.scratch = scratch
        self.position_layer = position_layer  # host: the layer of each channel (or the padding index)
        self.device = device
        self.shift: Tensor | None = None
        # layers not called yet when the shift was set: each gets its own first figures as its shift when it is
        # first called (around 0, a float64 layer's variance lost (u·|mean|/σ)²: 5e-7 at |mean|/σ = 1e5, a probe)
        self.pending: set[int] = set()
        size = scratch.buffer.shape[1]
        # per fold; fold k is written by the batch that first uses it (a short pass touches only a few)
        self.s1 = torch.empty(FOLDS, size, dtype=torch.float64, device=device)
        self.s2 = torch.empty(FOLDS, size, dtype=torch.float64, device=device)
        # per-batch temporaries, reused: a fresh buffer each batch costs page faults on the CPU
        self.d = torch.empty(size, dtype=torch.float64, device=device)
        self.nd = torch.empty(size, dtype=torch.float64, device=device)
        self.s1[0].zero_()  # what finish() reads before any batch has ended
        self.s2[0].zero_()

    def per_channel(self, per_layer: Tensor) -> Tensor:
        """Spreads host per-layer values (last dimension) over this group's channels, on its device
        (by ``index_select``/``gather``: several times faster than advanced indexing on the CPU)."""
        at = self.position_layer
        if per_layer.dim() == 1:
            return _to_device(per_layer.index_select(0, at), self.device)
        return _to_device(per_layer.gather(-1, at.expand(*per_layer.shape[:-1], -1)), self.device)
