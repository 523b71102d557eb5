"""What a layer normalises with its running buffers, and whether its own figures match it.

A layer's population statistics are those of the tensor it normalises with its running
buffers — the same tensor in training and in eval mode. For torch's own layers, and for
fused ones such as timm's ``BatchNormAct2d``, that is the layer's input; a subclass may
normalise something else (``super().forward(x * s)``, a reshaped view), or not use its
buffers at all.

:class:`Watch` is active only around one layer's forward: it records the ``input`` of
every ``F.batch_norm``/``F.instance_norm`` call (or of the ops they call, ``torch.batch_norm``,
``torch.native_batch_norm``, ``torch.instance_norm``, and their ``torch.ops.aten`` forms, which some
layers and traced code call directly) that is
given that layer's own ``running_mean`` (through an alias of that buffer, a tensor subclass), and of torch's
cross-process gathering of batch figures
(``SyncBatchNorm`` across processes: its running buffers get the figures of all
processes' batches, what this process normalises is its own input).
:func:`discrepancies` compares the figures a layer left in its buffers (with momentum 1.0:
the batch mean and unbiased variance, if it behaves like torch's BatchNorm) with a
float64 reduction of what it normalised.
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from .state import version_of
from .stats import RunningMoments

__all__ = ["TOLERANCE", "Watch", "discrepancies", "moments_of", "normalises_its_input"]

TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10}
"""Largest :func:`discrepancy` for which a layer's own figures are used (by buffer dtype).

Above the rounding of torch's own kernels in the default memory layout (float32: about
1e-7), below what a behavioural difference costs (a biased variance stored over n values:
1/(n - 1)). A layer whose figures are further off — e.g. channels_last inputs on CPU,
whose float32 figures carry about 2e-5 — is measured in float64 instead."""

_NORMS = (F.batch_norm, F.instance_norm)  # both (input, running_mean, running_var, ...)


class _Spec(NamedTuple):
    """Where a normalization op takes what the watch reads (``input`` is always argument 0)."""

    running_mean: int  # its position (running_var's is next)
    batch: int | None  # the batch flag's position (training / use_input_stats); None: always batch_default
    batch_keyword: str
    batch_default: bool
    momentum: int  # its position
    writes: bool = True  # False: an op that returns the new running statistics instead of writing them


def _ops(*names: str) -> list[Any]:
    """``torch.<name>`` and ``torch.ops.aten.<name>`` (its packet and overloads) for each name, as layers and
    traced code may call them."""
    out: list[Any] = []
    for name in names:
        out.append(getattr(torch, name, None))
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None:
            out += [packet, *(getattr(packet, o, None) for o in packet.overloads() if not o.startswith("no_stats"))]
    return [f for f in out if f is not None]


# Every normalization call watched: F.batch_norm/F.instance_norm, and the ops under them, which some layers and
# traced code call directly.
_CALLS: dict[Any, _Spec] = {
    f: spec
    for fs, spec in (
        ([F.batch_norm], _Spec(1, 5, "training", False, 6)),
        ([F.instance_norm], _Spec(1, 5, "use_input_stats", True, 6)),
        (
            _ops(
                "batch_norm",
                "native_batch_norm",
                "_native_batch_norm_legit",
                "_batch_norm_impl_index",
                "cudnn_batch_norm",
                "miopen_batch_norm",
            ),
            _Spec(3, 5, "training", False, 6),
        ),
        (_ops("instance_norm"), _Spec(3, 5, "use_input_stats", True, 6)),
        (_ops("_batch_norm_with_update"), _Spec(3, None, "", True, 5)),
        (_ops("_batch_norm_no_update"), _Spec(3, None, "", False, 5)),  # (with the running statistics)
        (_ops("_batch_norm_with_update_functional"), _Spec(3, None, "", True, 5, writes=False)),
        (_ops("_native_batch_norm_legit_functional"), _Spec(3, 5, "training", False, 6, writes=False)),
    )
    for f in fs
}
# torch.nn.modules._functions.SyncBatchNorm (world size > 1) does not call F.batch_norm: it
# passes its input and running buffers to these (input first, running_mean fourth).
_GATHERS = tuple(
    f
    for f in (
        getattr(torch, "batch_norm_gather_stats_with_counts", None),
        getattr(torch, "batch_norm_gather_stats", None),
    )
    if f
)


_TORCH_FORWARDS = (nn.modules.batchnorm._BatchNorm.forward, nn.SyncBatchNorm.forward)


def normalises_its_input(module: nn.Module) -> bool:
    """Whether ``module`` runs torch's own BatchNorm forward (its class's forward is torch's
    ``_BatchNorm.forward`` or ``SyncBatchNorm.forward``, nothing replaces it on the instance,
    and ``F.batch_norm`` is torch's): that forward normalises exactly its input with the
    layer's running buffers, so there is nothing to watch for — as long as it tracks them
    (``track_running_stats``) and they are still the ones the caller put there (both
    checked by the caller at each call, after any pre-hook or parent has run)."""
    return (
        type(module).forward in _TORCH_FORWARDS
        and "forward" not in module.__dict__
        and getattr(F.batch_norm, "__module__", None) == "torch.nn.functional"
        and F.batch_norm in _NORMS
    )


class Watch:
    """Records what ``module`` normalises with its running buffers while active.

    While active, the module's ``running_mean`` is an alias of itself (same storage and
    version counter) of a tensor subclass whose ``__torch_function__`` records the
    ``input`` of every normalization call it is given, then runs the call as usual: one
    Python call per operation on that buffer, where a ``TorchFunctionMode`` would take one
    per operation of the whole forward (several times slower on a fused layer such as
    timm's ``BatchNormAct2d``). A ``running_mean`` that is already a tensor subclass (not
    precisebn's scratch buffer: a pre-hook put it there), or an input ``x`` of one (whose
    ``__torch_function__`` may run the call with subclasses' disabled, the alias's
    included), is watched through a mode instead. The alias is put back on exit unless the
    forward replaced the buffer itself.

    Args:
        module: The layer.
        x: The layer's input, if known.

    Attributes:
        seen: The ``input`` of every normalization call given the module's running mean.
        frozen: Whether one of those calls did not overwrite the running buffers with its
            batch figures: it normalised with them (``training=False``,
            ``use_input_stats=False``), passed a momentum other than 1.0 of its own (the
            layer's momentum is 1.0 during the passes), or a ``running_var`` other than the
            layer's. What they hold is then never that call's own figures.
    """

    def __init__(self, module: nn.Module, x: Any = None) -> None:
        self._plain_input = x is None or type(x) is Tensor
        self._buffers = module._buffers
        self.running_mean = self._buffers.get("running_mean")
        self.running_var = self._buffers.get("running_var")  # (batch figures land in it only if given it)
        self.seen: list[Tensor] = []
        self.frozen = False
        self._versions: list[int | None] = []  # of each tensor in seen, when it was normalised
        self._tap: _Tap | None = None
        self._derived: list[_Tap] = []  # taps on aliases of the buffer made during the call (see _Tap)
        self._mode: _WatchMode | None = None

    def __enter__(self) -> Watch:
        running_mean = self.running_mean
        if self._plain_input and type(running_mean) in (Tensor, _Tap):  # _Tap: a forward that calls itself
            tap = running_mean.as_subclass(_Tap)  # type: ignore[union-attr]
            tap._watch = self
            self._buffers["running_mean"] = self._tap = tap
            _active().append(self)
        elif running_mean is not None:
            self._mode = _WatchMode(self)
            self._mode.__enter__()
        return self

    def tap(self, alias: Tensor) -> _Tap:
        """A tap of this watch on ``alias``, a view of the watched buffer's memory (detached on exit)."""
        tap = alias.as_subclass(_Tap)
        tap._watch = self
        self._derived.append(tap)
        return tap

    def __exit__(self, *exc: object) -> None:
        if self._tap is not None:
            if self._buffers.get("running_mean") is self._tap:
                self._buffers["running_mean"] = self.running_mean
            self._tap._watch = None
            self._tap = None
            active = _active()
            if self in active:
                active.remove(self)
        for tap in self._derived:
            tap._watch = None
        self._derived.clear()
        if self._mode is not None:
            self._mode.__exit__(*exc)
            self._mode = None

    def changed(self) -> bool:
        """Whether a tensor in :attr:`seen` was changed in place since it was normalised (by the
        rest of the layer's forward): what it holds now is no longer what the layer normalised."""
        return any(v is not None and version_of(t) != v for t, v in zip(self.seen, self._versions))

    def record(self, x: Any, figures: bool) -> None:
        """Records ``x``, normalised with the watched buffer (unless it is not a tensor: torch then
        says what is wrong); ``figures``: whether the call computed batch figures."""
        if isinstance(x, Tensor):
            self.seen.append(x)
            self._versions.append(version_of(x))
            self.frozen |= not figures


def _norm_call(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any, Any, bool] | None:
    """``(input, running_mean, running_var, whether it overwrites those buffers with its batch
    figures)`` of a normalization call (or of torch's gathering of batch figures across processes),
    else ``None``."""
    spec = _CALLS.get(func)
    if spec is None and func not in _GATHERS:
        return None
    x = args[0] if args else kwargs.get("input")
    at = 3 if spec is None else spec.running_mean  # (running_var's position is next)
    running_mean = args[at] if len(args) > at else kwargs.get("running_mean")
    running_var = args[at + 1] if len(args) > at + 1 else kwargs.get("running_var")
    if spec is None:  # torch's gathering: the layer's running buffers get the batch figures
        return x, running_mean, running_var, True
    at = spec.batch
    batch = args[at] if at is not None and len(args) > at else kwargs.get(spec.batch_keyword, spec.batch_default)
    at = spec.momentum
    momentum = args[at] if len(args) > at else kwargs.get("momentum", kwargs.get("exponential_average_factor", 0.1))
    return x, running_mean, running_var, spec.writes and bool(batch) and momentum == 1.0


_no_subclass = torch._C.DisableTorchFunctionSubclass


def _aliases(a: Any, b: Any) -> bool:
    """Whether ``a`` is ``b`` or a tensor viewing exactly its memory (``b.data``, ``b.detach()``,
    ``b.view(-1)``): normalising with it updates ``b`` as with ``b`` itself."""
    if a is b:
        return True
    return (
        isinstance(a, Tensor)
        and isinstance(b, Tensor)
        and a.layout == torch.strided
        and b.layout == torch.strided
        and a.dtype == b.dtype
        and a.device == b.device
        and a.shape == b.shape
        and a.data_ptr() == b.data_ptr() != 0
        and a.stride() == b.stride()
    )


_watching = threading.local()


def _active() -> list[Watch]:
    """The watches through a tap active in this thread, innermost last."""
    active = getattr(_watching, "active", None)
    if active is None:
        active = _watching.active = []
    return active


def _watch_of(t: Tensor, exact: bool) -> Watch | None:
    """The watch that ``t`` (a tap) belongs to — its own while active, else the innermost active watch
    whose buffer ``t`` views (a tap kept by the layer from an earlier call: ``self._cache =
    self.running_mean.detach()``) — if ``t`` views exactly that buffer (``exact``) or any of its memory."""
    own = getattr(t, "_watch", None)
    if own is not None and t is own._tap:  # (the buffer itself: also where its memory has no address, meta)
        return own
    for watch in ([own] if own is not None else []) + _active()[::-1]:
        buffer = watch.running_mean
        if exact and _aliases(t, buffer):
            return watch
        if not exact and isinstance(buffer, Tensor) and _same_storage(t, buffer):
            return watch
    return None


def _same_storage(a: Tensor, b: Tensor) -> bool:
    try:
        return a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() != 0
    except (RuntimeError, NotImplementedError):  # (no storage: a tensor subclass of another kind, meta...)
        return False


class _Tap(Tensor):
    """The alias a :class:`Watch` puts in place of a layer's ``running_mean``. An operation on it that
    gives views of its memory (``.data``, ``.detach()``, ``.view(1, -1)[0]``, ``.chunk(1)``: a forward passing
    one of exactly the buffer's memory to ``F.batch_norm`` normalises with the layer's buffers all the same)
    gives taps of the same watch, so that the normalization call is seen (a probe: such layers were reported
    "never used"); so does a tap the layer kept from an earlier call, while a watch of that memory is active."""

    _watch: Watch | None

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        with _no_subclass():  # (the checks' own tensor calls on taps come here too otherwise)
            call = _norm_call(func, args, kwargs)
            if call is not None and type(call[1]) is cls:
                watch = _watch_of(call[1], exact=True)
                if watch is not None:
                    watch.record(call[0], call[3] and _aliases(call[2], watch.running_var))
            out = func(*args, **kwargs)
            if call is None and args and type(args[0]) is cls and _may_view(out):
                watch = _watch_of(args[0], exact=False)
                if watch is not None:
                    return _tapped(out, watch)
        return out


def _may_view(out: Any) -> bool:
    """Whether ``out`` is a plain tensor, or a tuple or list holding one (what a view of a tap can give)."""
    return type(out) is Tensor or (isinstance(out, (tuple, list)) and any(type(o) is Tensor for o in out))


def _tapped(out: Any, watch: Watch) -> Any:
    """``out`` (a tensor, or a tuple or list of them) with every plain tensor that views the watched buffer's
    memory made a tap of ``watch``."""
    if type(out) is Tensor:
        return watch.tap(out) if _same_storage(out, watch.running_mean) else out  # type: ignore[arg-type]
    if isinstance(out, (tuple, list)) and any(type(o) is Tensor for o in out):
        return type(out)(_tapped(o, watch) if type(o) is Tensor else o for o in out)
    return out


class _WatchMode(TorchFunctionMode):
    """:class:`Watch` through a mode (see there for when)."""

    def __init__(self, watch: Watch) -> None:
        super().__init__()
        self.watch = watch

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        call = _norm_call(func, args, kwargs)
        if call is not None and call[1] is not None and _aliases(call[1], self.watch.running_mean):
            self.watch.record(call[0], call[3] and _aliases(call[2], self.watch.running_var))
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


def discrepancies(items: list[tuple[Tensor, Tensor, RunningMoments, float]]) -> list[float]:
    """How far each layer call's figures are from the float64 reference, or may be in other
    batches; all calls at once, one host read per device.

    Each item is a call's ``(mean, unbiased_var)`` figures, the float64 moments of what it
    normalised and the layer's eps. Its score is the largest over channels of
    ``|Δmean| / sqrt(var + eps)``, ``|Δvar| / (var + eps)`` and
    ``(u · |mean| / sqrt(var + eps))²``, where ``u`` is the unit roundoff of the figures'
    dtype: the last is what rounding each batch's mean to that dtype adds to the pooled
    variance — an error that a single batch can show as zero by luck, and that only matters
    where ``|mean|/std`` is in the thousands. NaN scores are infinite.
    """
    by_device: dict[torch.device, list[int]] = {}
    for k, (_, _, ref, _) in enumerate(items):
        by_device.setdefault(ref.mean.device, []).append(k)
    out = [0.0] * len(items)
    for device, ks in by_device.items():
        chosen = [items[k] for k in ks]
        sizes = [ref.mean.numel() for _, _, ref, _ in chosen]
        mean = _flat64([m for m, _, _, _ in chosen], device)
        fig_var = _flat64([v for _, v, _, _ in chosen], device)
        ref_mean = _flat64([ref.mean for _, _, ref, _ in chosen], device)
        ref_var = _flat64([ref.m2 / (ref.count - 1).clamp_min(1) for _, _, ref, _ in chosen], device)
        counts = torch.tensor(sizes, device=device)
        call = torch.repeat_interleave(torch.arange(len(ks), device=device), counts)
        eps = torch.tensor([e for _, _, _, e in chosen], dtype=torch.float64, device=device)[call]
        unit = torch.tensor([torch.finfo(m.dtype).eps / 2 for m, _, _, _ in chosen], dtype=torch.float64, device=device)
        unit = unit[call]
        scale = (ref_var + eps).sqrt()
        d = torch.maximum(
            torch.maximum((mean - ref_mean).abs() / scale, (fig_var - ref_var).abs() / scale.square()),
            (unit * ref_mean.abs() / scale).square(),
        )
        d = torch.where(d.isnan(), torch.full_like(d, float("inf")), d)
        worst = torch.zeros(len(ks), dtype=torch.float64, device=device).scatter_reduce_(0, call, d, "amax")
        for k, value in zip(ks, worst.tolist()):
            out[k] = value
    return out


def _flat64(tensors: list[Tensor], device: torch.device) -> Tensor:
    return torch.cat([t.reshape(-1).to(device, torch.float64) for t in tensors])
