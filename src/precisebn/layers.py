"""Finding normalization layers, and saving/restoring a model's state around a pass.

:func:`find_norm_layers` decides which modules precisebn recalibrates;
:func:`recalibration_state` is the one context manager that puts the model into the
state a recalibration pass needs and restores every flag, momentum, buffer and hook
in ``finally``, whatever happens inside.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import difflib
import functools
import itertools
import operator
import sys
import threading
import types
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _NormBase

from .errors import (
    InvalidArgumentError,
    LayerNotFoundError,
    ModelChangedWarning,
    PreciseBNWarning,
    UninitializedLayerError,
    UnsupportedLayerError,
    caller_stacklevel,
)
from .state import (
    StateSnapshot,
    ValueCopies,
    copy_all,
    in_memory,
    let_go,
    lock_held,
    overlapping,
    refuse_uninitialized,
    to_the_end,
)

__all__ = [
    "LayerSelection",
    "NormLayer",
    "RecalibrationState",
    "find_norm_layers",
    "has_running_stats",
    "layer_matcher",
    "recalibration_state",
    "refuse_freed",
    "refuse_shared_buffers",
    "running_statistics",
    "unwrap",
]

Mode = Literal["norm", "train", "keep", "all"]
Capture = Literal["auto", "float64"]
Path = Literal["fast", "float64"]
LayerSelection = str | type | tuple[type, ...] | Callable[[str, nn.Module], bool] | Iterable[str] | None

_OWN_FIGURE_DTYPES = (torch.float32, torch.float64)
_ALIGN = 16  # elements; keeps every scratch slice 64-byte aligned for cuDNN (on the CPU: no gaps, see below)
_NO_FORWARD = object()  # marks a module without an instance-level forward
_STATISTICS = ("running_mean", "running_var")
_DICT_OF = operator.attrgetter("__dict__")


def has_running_stats(module: nn.Module) -> bool:
    """Whether ``module`` is a normalization layer that keeps running statistics.

    True for every ``BatchNorm*``, ``SyncBatchNorm``, ``LazyBatchNorm*`` and
    ``InstanceNorm*`` (with ``track_running_stats=True``), subclasses included.
    FrozenBatchNorm-style modules (not subclasses of ``_NormBase``) are excluded.
    """
    return (
        isinstance(module, _NormBase)
        and bool(module.track_running_stats)
        and isinstance(module.running_mean, Tensor)
        and isinstance(module.running_var, Tensor)
    )


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside ``DistributedDataParallel``/``DataParallel`` and ``torch.compile``
    wrappers (recalibration runs eagerly on the original module)."""
    wrappers = (nn.parallel.DistributedDataParallel, nn.DataParallel)
    while True:
        if isinstance(model, wrappers):
            model = model.module
        elif type(model).__name__ == "OptimizedModule" and isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        else:
            return model


def _sync_active(module: nn.Module) -> bool:
    if not isinstance(module, nn.SyncBatchNorm):
        return False
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return False
    return dist.get_world_size(module.process_group or dist.group.WORLD) > 1


@dataclass(frozen=True)
class NormLayer:
    """A selected normalization layer.

    Attributes:
        name: Qualified name in the model (``""`` for the model itself).
        module: The layer.
        path: ``"fast"``: a candidate for reading the batch figures the layer leaves in
            its running buffers with momentum 1.0 (float32/64 buffers), verified on its
            first calls against a float64 reduction of what it normalises (see
            :mod:`precisebn.capture`); ``"float64"``: what the layer normalises with its
            running buffers is reduced in float64 on every call (half-precision buffers,
            SyncBatchNorm across processes, a layer without ``num_batches_tracked``,
            ``capture="float64"``).
    """

    name: str
    module: _NormBase
    path: Path

    @functools.cached_property
    def channels(self) -> int:  # read once: a pass swaps the buffer for a scratch view of the same size
        return int(self.module.running_mean.shape[0])

    @property
    def type_name(self) -> str:
        return type(self.module).__name__

    @property
    def label(self) -> str:
        """How messages name the layer: ``layer 'name' (Type)``."""
        return f"layer {self.name!r} ({self.type_name})"


def _path(module: _NormBase, capture: Capture) -> Path:
    fast = (
        capture == "auto"
        and module.running_mean.dtype in _OWN_FIGURE_DTYPES
        and module.running_var.dtype in _OWN_FIGURE_DTYPES
        and not _sync_active(module)  # its figures are those of all processes, not this one's
        # without a counter, a call that computed no figures (tracking turned off for it) would go unseen
        and module._buffers.get("num_batches_tracked") is not None
    )
    return "fast" if fast else "float64"


def layer_matcher(
    selection: LayerSelection, candidates: dict[str, nn.Module], root: nn.Module | None = None
) -> Callable[[str, nn.Module], bool]:
    """A predicate ``(name, module) -> bool`` for a ``layers=`` selection among ``candidates``
    (``model.named_modules()``), whose names it checks now; with ``root`` (the model, or the
    DDP/DataParallel/``torch.compile`` wrapper around it), a module registered under two names is
    found by either — the wrapper's names (``module.1``) included.

    Raises:
        LayerNotFoundError: A named module is not among ``candidates``.
        InvalidArgumentError: ``selection`` is not a selection, or names a module without
            running statistics.
    """
    if selection is None:
        return lambda name, module: True
    if isinstance(selection, nn.Module):  # (callable, but not a predicate)
        named = [name for name, module in candidates.items() if module is selection]
        hint = f"layers=[{named[0]!r}]" if named else "its qualified name from model.named_modules()"
        raise InvalidArgumentError(
            f"layers= got a module ({type(selection).__name__}), not a selection; pass {hint}, a type, or a "
            "predicate (name, module) -> bool."
        )
    if isinstance(selection, type) or (
        isinstance(selection, tuple) and selection and all(isinstance(t, type) for t in selection)
    ):
        types = selection
        return lambda name, module: isinstance(module, types)
    if callable(selection):
        return _by_any_name(_checked_predicate(selection), candidates)  # type: ignore[arg-type]
    if isinstance(selection, str):
        names = [selection]
    elif isinstance(selection, Iterable) and not isinstance(selection, (bytes, Tensor, nn.Module)):
        names = list(selection)
    else:
        names = [selection]  # refused just below
    if not all(isinstance(n, str) for n in names):
        raise InvalidArgumentError(
            "layers= takes qualified layer names, a layer type (or tuple of types), or a "
            f"predicate (name, module) -> bool; got {selection!r}"
        )
    known = dict(candidates)
    unknown = [n for n in names if n not in known]
    if unknown and root is not None:  # a second name of a module registered twice (get_submodule takes it)
        canonical = {id(m): name for name, m in known.items()}
        every = dict(root.named_modules(remove_duplicate=False))
        names = [canonical.get(id(every[n]), n) if n in every else n for n in names]
        unknown = [n for n in names if n not in known]
    if unknown:
        hints = []
        for n in unknown:
            close = difflib.get_close_matches(n, list(known), n=3)
            hints.append(f"{n!r}" + (f" (did you mean {', '.join(map(repr, close))}?)" if close else ""))
        raise LayerNotFoundError(
            f"layers= names {len(unknown)} module(s) not found in the model: {'; '.join(hints)}. "
            "Use the qualified names from model.named_modules()."
            + (  # (the CLI's --layers takes globs; here a name is a name)
                " Patterns such as 'layer4.*' are the command line's; in Python pass a predicate: "
                "layers=lambda name, module: fnmatch.fnmatch(name, 'layer4.*')."
                if any(c in n for n in unknown for c in "*?[")
                else ""
            )
        )
    wanted = set(names)
    for n in names:
        if not has_running_stats(known[n]):
            raise InvalidArgumentError(
                f"layer {n!r} ({type(known[n]).__name__}) is not a normalization layer with running "
                "statistics (track_running_stats=True); precisebn cannot recalibrate it."
            )
    return lambda name, module: name in wanted


def _checked_predicate(predicate: Callable[[str, nn.Module], Any]) -> Callable[[str, nn.Module], bool]:
    """``predicate`` as a ``bool``, a call that does not fit ``(name, module) -> bool`` refused by name (probe
    33b: a predicate of one argument, or one returning a tensor of several values, raised torch's or Python's
    own error)."""

    def check(name: str, module: nn.Module) -> bool:
        try:
            verdict = predicate(name, module)
        except TypeError as exc:
            if exc.__traceback__ is not None and exc.__traceback__.tb_next is not None:
                raise  # raised inside the predicate's own code: its own error (probe 35a), not a wrong signature
            raise InvalidArgumentError(
                f"layers= takes a predicate (name, module) -> bool; calling it on {name!r} raised TypeError: {exc}"
            ) from exc
        try:
            return bool(verdict)
        except (RuntimeError, TypeError, ValueError) as exc:
            raise InvalidArgumentError(
                f"layers= takes a predicate (name, module) -> bool; on {name!r} it returned {type(verdict).__name__}"
                f" {_short(verdict)}, which is not a truth value ({exc})"
            ) from exc

    return check


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _by_any_name(
    predicate: Callable[[str, nn.Module], bool], candidates: dict[str, nn.Module]
) -> Callable[[str, nn.Module], bool]:
    """``predicate``, true for a module registered under several names if it is true for any of them (the
    model's walk gives only the first: a shared layer selected by another name, or by a prefix of it, was
    left out silently — a probe), as a list of names finds it by either."""
    model = candidates.get("")
    if model is None:
        return predicate
    names: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        names.setdefault(id(module), []).append(name)
    if all(len(every) == 1 for every in names.values()):
        return predicate
    return lambda name, module: any(predicate(n, module) for n in names.get(id(module), [name]))


def find_norm_layers(
    model: nn.Module,
    layers: LayerSelection = None,
    *,
    capture: Capture = "auto",
    require: bool = True,
    modules: list[tuple[str, nn.Module]] | None = None,
    root: nn.Module | None = None,
) -> list[NormLayer]:
    """The normalization layers of ``model`` to recalibrate, in module order.

    Args:
        model: The model to search.
        layers: ``None`` (every layer with running statistics), qualified names, a
            type or tuple of types, or a predicate ``(name, module) -> bool``.
        capture: ``"auto"``: each layer gets the fastest path that verifies exact
            (see :class:`NormLayer`); ``"float64"``: every layer on the float64 path.
        require: Raise :class:`LayerNotFoundError` when nothing is selected.
        modules: ``model.named_modules()``, if the caller has already listed them.
        root: What the user passed, if ``model`` is the module inside a wrapper (its names
            are accepted in ``layers``).

    Raises:
        LayerNotFoundError: A named layer does not exist, or nothing is selected.
        UninitializedLayerError: A selected lazy layer has not run yet.
    """
    all_modules = dict(modules if modules is not None else model.named_modules(remove_duplicate=True))
    match = layer_matcher(layers, all_modules, model if root is None else root)
    found: list[NormLayer] = []
    scripted: list[str] = []  # TorchScript norm layers: compiled code, out of reach
    # modules of other classes that keep running statistics as buffers (timm's EvoNorm2dB0, a hand-written BatchNorm
    # not derived from torch's): not recalibrated, and said so (probe 43: kept without a word)
    foreign: list[tuple[str, nn.Module]] = []
    # BatchNorm layers with track_running_stats turned off that still hold running buffers: torch's forward never
    # updates those in training mode but normalises with them in eval mode (probe 49: left stale without a word)
    untracked: list[tuple[str, nn.Module]] = []
    for name, module in all_modules.items():
        if isinstance(module, torch.jit.ScriptModule) and hasattr(module, "running_var"):
            scripted.append(name)
        elif not isinstance(module, _NormBase) and _keeps_statistics(module):
            foreign.append((name, module))
        if not isinstance(module, _NormBase):
            continue
        if not module.track_running_stats:
            if _untracked_but_read(module):
                untracked.append((name, module))
            continue
        if not match(name, module):
            continue
        if isinstance(module.running_mean, nn.parameter.UninitializedBuffer):
            raise UninitializedLayerError(
                f"layer {name!r} ({type(module).__name__}) is a lazy layer that has not been "
                "initialised; run one forward pass first (e.g. model(example_batch)) so that "
                "its number of channels is known, then recalibrate."
            )
        buffers, params = module._buffers, module._parameters  # (Module.__getattr__ is slow)
        on_meta = [
            key
            for key, t in (
                ("running_mean", buffers.get("running_mean")),
                ("running_var", buffers.get("running_var")),
                ("weight", params.get("weight")),
                ("bias", params.get("bias")),
            )
            if isinstance(t, Tensor) and t.is_meta
        ]
        if on_meta:
            what = "its buffers" if on_meta[0] == "running_mean" else f"its {' and '.join(on_meta)}"
            raise UninitializedLayerError(
                f"layer {name!r} ({type(module).__name__}) is on the meta device ({what}): it holds no values "
                "to measure with or write to. Materialise the model first (e.g. model.to_empty(device='cpu'), "
                "then load its weights), or exclude the layer with layers=. Nothing was changed."
            )
        if has_running_stats(module):
            found.append(NormLayer(name, module, _path(module, capture)))
    where = ", ".join(repr(n) for n in scripted[:5]) + (f" and {len(scripted) - 5} more" if len(scripted) > 5 else "")
    script = (
        f"{'layer' if len(scripted) == 1 else 'layers'} {where} of {type(model).__name__} "
        f"{'is' if len(scripted) == 1 else 'are'} TorchScript (torch.jit.script/trace), which runs as compiled "
        "code that no hook sees: recalibrate the nn.Module before scripting or tracing it, then script or "
        "trace it again."
    )
    fx = sys.modules.get("torch.fx")  # (a graph module's class is named after the module traced: not by name)
    graph_module = fx is not None and isinstance(model, fx.GraphModule)
    if found and graph_module and layers is None:  # some layers traced into operations, others kept as modules
        orphans = _orphan_statistics(model, graph_module)
        if orphans:
            warnings.warn(
                f"{len(orphans)} running statistics buffer(s) of {type(model).__name__}, a torch.fx graph, are held by "
                f"no normalization layer ({', '.join(repr(n) for n in orphans[:3])}"
                f"{' and others' if len(orphans) > 3 else ''}): layers traced into operations, which precisebn cannot "
                "watch, and their statistics are kept. Recalibrate the nn.Module before tracing it (or trace with "
                "its normalization layers as leaf modules).",
                PreciseBNWarning,
                stacklevel=caller_stacklevel(),
            )
    if foreign and layers is None:
        held = {id(t) for layer in found for t in (layer.module._buffers.get(k) for k in _STATISTICS) if t is not None}
        foreign = [(n, m) for n, m in foreign if not any(id(t) in held for t in running_statistics(m))]
    kept = ""
    if foreign and layers is None:
        names = ", ".join(f"{n!r} ({type(m).__name__})" for n, m in foreign[:5])
        kept = (
            f"{names}{f' and {len(foreign) - 5} more' if len(foreign) > 5 else ''} "
            f"{'keeps' if len(foreign) == 1 else 'keep'} running statistics but {'is' if len(foreign) == 1 else 'are'} "
            "not a BatchNorm/InstanceNorm layer (a subclass of torch's _NormBase), whose calls precisebn knows how "
            "to measure"
        )
    stale = _untracked_note(untracked) if untracked and layers is None else ""
    if require and not found:
        chosen = repr(layers)  # (the command line's selection shows itself as its option: "--layers ...")
        # running statistics held by no normalization layer: a graph (torch.export, torch.fx) with the layers
        # turned into operations (a probe: refused without a word of why)
        orphans = _orphan_statistics(model, graph_module)
        graph = (
            f" Its buffers {orphans[0]!r}{' and others' if len(orphans) > 1 else ''} are running statistics that no "
            "such layer holds: in an exported or traced graph (torch.export, torch.fx) the layers are operations, "
            "which precisebn cannot watch; recalibrate the nn.Module before exporting or tracing it."
            if orphans and layers is None
            else ""
        )
        # FrozenBatchNorm (torchvision's, detectron2's, timm's): constants by design, not running statistics
        frozen = [name for name, m in model.named_modules() if "FrozenBatchNorm" in type(m).__name__]
        frozen_note = (
            f" Its {len(frozen)} FrozenBatchNorm layer{'s' if len(frozen) > 1 else ''} ({frozen[0]!r}"
            f"{' and others' if len(frozen) > 1 else ''}) hold fixed statistics by design and are left out; to "
            "recalibrate them, build the model with BatchNorm instead (torchvision: norm_layer=nn.BatchNorm2d; "
            "timm: timm.layers.unfreeze_batch_norm_2d) and load the same weights."
            if frozen and layers is None
            else ""
        )
        raise LayerNotFoundError(
            "no normalization layer with running statistics was selected "
            f"(model {type(model).__name__}, {chosen if chosen.startswith('--') else f'layers={chosen}'}); "
            "precisebn recalibrates "
            "BatchNorm*/SyncBatchNorm/InstanceNorm* layers with track_running_stats=True."
            + (f" The {script}" if scripted else "")
            + graph
            + frozen_note
            + (f" The model's {kept}." if kept else "")
            + (f" {stale[0].upper()}{stale[1:]}" if stale else "")
        )
    if kept and found:
        warnings.warn(
            f"precisebn: {kept}: {'its' if len(foreign) == 1 else 'their'} statistics are kept as they are.",
            PreciseBNWarning,
            stacklevel=caller_stacklevel(),
        )
    if stale and found:
        warnings.warn(f"precisebn: {stale}", PreciseBNWarning, stacklevel=caller_stacklevel())
    if scripted and layers is None:
        kept = "Its statistics are" if len(scripted) == 1 else "Their statistics are"
        warnings.warn(f"The {script} {kept} kept.", PreciseBNWarning, stacklevel=caller_stacklevel())
    return found


def _untracked_but_read(module: _NormBase) -> bool:
    """Whether ``module``, a layer with ``track_running_stats`` off, is a BatchNorm that still holds both running
    buffers: torch's forward then normalises with them in eval mode and never updates them in training mode (an
    InstanceNorm normalises with each sample's own statistics in both)."""
    return isinstance(module, nn.modules.batchnorm._BatchNorm) and len(running_statistics(module)) == 2


def _untracked_note(untracked: list[tuple[str, nn.Module]]) -> str:
    """What the warning (or the error, when nothing else is selected) says of layers :func:`_untracked_but_read`."""
    one = len(untracked) == 1
    names = ", ".join(f"{n!r} ({type(m).__name__})" for n, m in untracked[:5])
    more = f" and {len(untracked) - 5} more" if len(untracked) > 5 else ""
    return (
        f"{'layer' if one else 'layers'} {names}{more} {'has' if one else 'have'} track_running_stats=False but "
        f"still {'holds' if one else 'hold'} running_mean/running_var: torch's forward never updates them in training "
        "mode but normalises with them in eval mode, and precisebn left them as they are (it measures a layer "
        "through its own updates). To recalibrate them, set module.track_running_stats = True first; to have eval "
        "mode use each batch's statistics instead, set module.running_mean = module.running_var = None."
    )


def _keeps_statistics(module: nn.Module) -> bool:
    """Whether ``module`` (not a ``_NormBase``) holds a ``running_mean`` or ``running_var`` buffer of its own — a plain
    container's (a traced graph's, see :func:`_orphan_statistics`) and FrozenBatchNorm's (constants by design) apart."""
    buffers = module._buffers
    return (
        bool(buffers)
        and any(isinstance(buffers.get(k), Tensor) for k in _STATISTICS)
        and type(module) is not nn.Module
        and "FrozenBatchNorm" not in type(module).__name__
    )


def running_statistics(module: nn.Module) -> list[Tensor]:
    """``module``'s own ``running_mean``/``running_var`` buffers (a TorchScript module's too: its buffer dict is a
    wrapper without ``get``)."""
    buffers = module._buffers
    return [t for k in _STATISTICS if k in buffers and isinstance(t := buffers[k], Tensor)]


def _orphan_statistics(model: nn.Module, graph_module: bool) -> list[str]:
    """The ``running_mean`` buffers that no normalization layer holds: in plain ``nn.Module`` containers, as traced
    and exported graphs keep them, or on a graph module itself — not a module of another class that holds some (a
    FrozenBatchNorm kept as a module)."""
    return [
        f"{name}.running_mean" if name else "running_mean"
        for name, m in model.named_modules()
        if "running_mean" in m._buffers and (type(m) is nn.Module or (graph_module and m is model))
    ]


def refuse_parameter_statistics(layers: Sequence[NormLayer]) -> None:
    """Raises :class:`UnsupportedLayerError` for a layer whose running statistics are not buffers
    (``nn.Parameter`` objects, as some converted models register them): the passes stand scratch
    buffers in for its buffers, and there are none to stand in for."""
    for layer in layers:
        buffers = layer.module._buffers
        missing = [k for k in ("running_mean", "running_var") if not isinstance(buffers.get(k), Tensor)]
        if missing:
            kind = type(getattr(layer.module, missing[0], None)).__name__
            parametrized = [k for k in missing if k in getattr(layer.module, "parametrizations", {})]
            remedy = (  # (a parametrized attribute is a property: `del` has nothing to delete)
                f"torch.nn.utils.parametrize.remove_parametrizations(layer, {parametrized[0]!r})"
                if parametrized
                else f"data = layer.{missing[0]}.data; del layer.{missing[0]}; "
                f"layer.register_buffer({missing[0]!r}, data)"
            )
            raise UnsupportedLayerError(
                f"{layer.label} keeps its {' and '.join(missing)} as "
                f"{'a parametrization' if parametrized else kind}, not as buffers; precisebn measures a layer by "
                f"standing scratch buffers in for its running buffers. Make them buffers (e.g. {remedy}), or exclude "
                "the layer with layers=. The model was left unchanged."
            )


def refuse_shared_buffers(buffers: list[tuple[str, str, Tensor]]) -> None:
    """Raises :class:`UnsupportedLayerError` if two of the running-statistics buffers about
    to be written, ``(layer name, buffer name, tensor)``, share memory (two layers given the
    same tensor, or views of one): each layer's statistics would be written over the other's,
    the last one winning, while the report listed both as updated; or if one buffer's own
    elements do (an ``expand()``ed tensor), which cannot hold one value per channel.

    >>> import torch
    >>> a, b = torch.nn.BatchNorm1d(2), torch.nn.BatchNorm1d(2)
    >>> b.running_var = a.running_var
    >>> refuse_shared_buffers([("a", "running_var", a.running_var), ("b", "running_var", b.running_var)])
    Traceback (most recent call last):
    ...
    precisebn.errors.UnsupportedLayerError: running statistics that share memory: layer 'a' running_var and ...
    """
    for layer, name, t in buffers:  # one tensor whose elements share memory (an expand()ed buffer)
        if any(stride == 0 and size > 1 for stride, size in zip(t.stride(), t.shape)):
            raise UnsupportedLayerError(
                f"layer {layer!r} {name}: its {t.numel()} elements share memory (a buffer made by expand(), stride "
                f"{tuple(t.stride())}), so it cannot hold one statistic per channel. Give the layer a buffer of its "
                f"own (layer.{name} = layer.{name}.clone()), or exclude it with layers=. The model was left unchanged."
            )
    pairs = overlapping([t for _, _, t in buffers])
    if not pairs:
        return
    shown = "; ".join(
        f"layer {buffers[i][0]!r} {buffers[i][1]} and layer {buffers[j][0]!r} {buffers[j][1]}" for i, j in pairs[:3]
    ) + (f"; and {len(pairs) - 3} more" if len(pairs) > 3 else "")
    raise UnsupportedLayerError(
        f"running statistics that share memory: {shown} are one tensor (or overlapping views of one), so "
        "writing each layer's statistics would overwrite the other's, and only the last would remain. Give each "
        "layer buffers of its own (e.g. layer.running_var = layer.running_var.clone()), or recalibrate one of "
        "them (layers=[...]). The model was left unchanged."
    )


def refuse_freed(buffers: list[tuple[str, str, Tensor]]) -> None:
    """Raises :class:`UnsupportedLayerError` for a running buffer whose memory was freed (its storage smaller than its
    shape: ``untyped_storage().resize_(0)``, as FSDP frees what it shards): reading or writing it would read freed
    memory — the process crashed (the review of probe 42, in the copies of the buffers taken out for the passes)."""
    freed = [
        f"the {key} of {label}"
        for label, key, t in buffers
        if t.layout == torch.strided and not t.is_meta and t.numel() and not in_memory(t)
    ]
    if freed:
        shown = ", ".join(freed[:3]) + (f" and {len(freed) - 3} more" if len(freed) > 3 else "")
        raise UnsupportedLayerError(
            f"running statistics without memory: {shown} — the storage under them was freed (untyped_storage()"
            ".resize_(0), as FSDP frees what it shards), so they can be neither read nor written. Gather the "
            "model's full state first (FSDP: summon_full_params), or recalibrate an unsharded copy. The model was "
            "left unchanged."
        )


@dataclass
class ScratchGroup:
    """Flat scratch buffers standing in for the running statistics of layers that
    share a device and dtype: ``buffer[0]`` holds every layer's running mean,
    ``buffer[1]`` its running variance, each layer at ``offsets[i]``.

    ``initial`` holds the layers' own statistics (NaN/Inf replaced: means by 0, variances
    by 1, as in the alignment gaps; negative variances by 0), which ``buffer`` starts from and is reset to after
    every batch (:meth:`reset`): code that reads a layer's running buffers outside its
    normalization — e.g. ``torch.ao``'s QAT ``ConvBn2d``, which scales the conv's weight
    by the BatchNorm's running std before calling it — sees the model's statistics, as it
    would without the pass, rather than figures of an earlier batch."""

    buffer: Tensor
    layer_ids: list[int] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    channels: list[int] = field(default_factory=list)
    initial: Tensor | None = None

    def reset(self) -> None:
        """Puts the layers' own statistics back into ``buffer`` (one copy, no host sync)."""
        if self.initial is not None:
            self.buffer.copy_(self.initial)

    def slices(self, t: Tensor, dim: int = -1) -> list[Tensor]:
        """Each of this group's layers' stretch of ``t`` along ``dim`` (laid out as the
        buffer's columns), in ``layer_ids`` order: views, made by one split."""
        if self._packed:  # one piece per layer (a third of tensor_split's cost with the gaps)
            rest = t.shape[dim] - sum(self.channels)
            pieces = t.split([*self.channels, rest] if rest else self.channels, dim=dim)
            return list(pieces[:-1] if rest else pieces)
        bounds = [b for off, c in zip(self.offsets, self.channels) for b in (off, off + c)]
        return list(t.tensor_split(bounds, dim=dim)[1::2])  # the pieces between are alignment gaps

    @functools.cached_property
    def _packed(self) -> bool:
        """Whether the stretches follow one another from column 0, with no gaps between them."""
        return list(self.offsets) == list(itertools.accumulate(self.channels[:-1], initial=0))

    def positions(self, keep: Iterable[int], other: int) -> Tensor:
        """The layer of each of the buffer's columns (host): ``i`` for the channels of layer
        ``i`` in ``keep``, ``other`` for the rest (alignment gaps, the other layers)."""
        keep = set(keep)
        values, lengths, at = [], [], 0
        for i, off, c in zip(self.layer_ids, self.offsets, self.channels):
            if i in keep:
                values += [other, i]
                lengths += [off - at, c]
                at = off + c
        values.append(other)
        lengths.append(self.buffer.shape[1] - at)
        return torch.repeat_interleave(torch.tensor(values, device="cpu"), torch.tensor(lengths, device="cpu"))


@dataclass
class RecalibrationState:
    """What :func:`recalibration_state` set up; valid inside the ``with`` block."""

    layers: list[NormLayer]
    groups: list[ScratchGroup]
    views: list[tuple[Tensor, Tensor]]
    counters: list[Tensor | None]  # each layer's scratch num_batches_tracked (one increment per own call)
    originals: ValueCopies | None = None  # the values of the buffers swapped out
    owners: list[tuple[int, str]] = field(default_factory=list)  # (layer, buffer name) of each of them
    _wrapped: list[tuple[nn.Module, object]] = field(default_factory=list)
    # the modules the mode put in eval mode (the passes check after every batch that none was put in training
    # mode: model.train() in forward, probe 37), and the model's named modules (for the message)
    evaluating: list[nn.Module] = field(default_factory=list)
    modules: list[tuple[str, nn.Module]] = field(default_factory=list)
    prepared: Any = None  # what recalibration_state's `prepare` returned

    def refuse_written_elsewhere(self) -> None:
        """Raises :class:`~precisebn.errors.UnsupportedLayerError` if a selected layer's own ``running_mean``/
        ``running_var`` (swapped out for the passes) were written during them: by code that holds them apart
        from the layer's buffer dict (``self.stats = [self.running_mean, ...]``, a parent's ``self.rm =
        bn.running_mean``) and normalises with them — in some calls or in all: what precisebn measures would
        miss those calls — or by a hook updating them at every forward (an EMA of another model's statistics),
        which cannot be told apart from the former. Their values are put back on exit."""
        if self.originals is None:
            return
        names = sorted(
            {
                self.layers[i].name
                for k in self.originals.changed()
                for i, key in [self.owners[k]]
                if key != "num_batches_tracked"
            }
        )
        if names:
            shown = ", ".join(map(repr, names[:5])) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            raise UnsupportedLayerError(
                f"the running statistics of layer(s) {shown} were written during the passes through references "
                "held apart from the layer's own buffers: code normalising with them (an attribute holding "
                "self.running_mean, a parent module) — precisebn points a layer's running_mean/running_var at its "
                "own scratch buffers for the passes, so it cannot see what such code normalises — or a hook "
                "updating them at every forward (an EMA). Read the buffers from the layer at each call "
                "(self.running_mean, not a reference kept in __init__), remove such hooks while recalibrating, or "
                "exclude the layer with layers=. The model was left unchanged."
            )

    def wrap_forward(
        self, module: nn.Module, call: Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]
    ) -> None:
        """Routes every call of ``module``'s forward through ``call(forward, args, kwargs)``
        (which must call ``forward(*args, **kwargs)`` and return its result), until the
        state is restored.

        Done by wrapping ``forward`` on the instance rather than with hooks: a module with
        hooks leaves PyTorch's fast call path, which costs several microseconds per call —
        more than the whole bookkeeping of a small layer. The instance attribute is removed
        (or the previous one put back) on exit.
        """
        previous = module.__dict__.get("forward", _NO_FORWARD)
        wrapped = _Routed(module.forward, call)
        self._wrapped.append((module, previous))
        if (
            type(module).__setattr__ is nn.Module.__setattr__
            and not hasattr(type(getattr(type(module), "forward", None)), "__set__")  # (a data descriptor)
            and not any("forward" in d for d in (module._parameters, module._buffers, module._modules))
        ):
            module.__dict__["forward"] = wrapped  # what Module.__setattr__ does for a function, without its lookups
        else:
            module.forward = wrapped  # type: ignore[method-assign]

    def add_pre_hook(
        self, module: nn.Module, hook: Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], None]
    ) -> None:
        """Runs ``hook(module, args, kwargs)`` before every call of ``module``'s forward."""

        def call(forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            hook(module, args, kwargs)
            return forward(*args, **kwargs)

        self.wrap_forward(module, call)


def _running(module: nn.Module) -> tuple[Tensor, Tensor]:
    buffers = module._buffers  # (Module.__getattr__ is slow)
    return buffers["running_mean"], buffers["running_var"]  # type: ignore[return-value]


def _fill_from_layers(buffer: Tensor, gaps: bool, targets: list[Tensor], own: list[Tensor]) -> None:
    """Copies each layer's running statistics (``own``: mean, variance, mean, ...) into its
    stretch of the scratch ``buffer`` (``targets``, in the same order): one cat per row where
    the stretches fill it (no alignment ``gaps``) and the dtypes agree, else one foreach copy,
    else tensor by tensor (a running_var of another shape than the mean...)."""
    try:
        if not gaps and all(t.dim() == 1 for t in own):
            torch.cat(own[0::2], out=buffer[0])
            torch.cat(own[1::2], out=buffer[1])
        else:
            copy_all(targets, own)
        return
    except RuntimeError:
        pass
    for target, t in zip(targets, own):
        if t.numel() == target.numel():
            target.copy_(t.detach().reshape(target.shape))


def _allocate_scratch(layers: Sequence[NormLayer]) -> tuple[list[ScratchGroup], list[tuple[Tensor, Tensor]]]:
    by_key: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, layer in enumerate(layers):
        rm = layer.module.running_mean
        by_key.setdefault((rm.device, rm.dtype), []).append(i)
    groups: list[ScratchGroup] = []
    views: list[tuple[Tensor, Tensor] | None] = [None] * len(layers)
    for (device, dtype), ids in by_key.items():
        offsets, size = [], 0
        align = 1 if device.type == "cpu" else _ALIGN  # the CPU: one cat fills the buffer from the layers' own
        for i in ids:
            offsets.append(size)
            size += -(-layers[i].channels // align) * align
        buffer = torch.zeros(2, size, dtype=dtype, device=device)
        buffer[1].fill_(1.0)
        group = ScratchGroup(buffer, list(ids), offsets, [layers[i].channels for i in ids])
        means, variances = group.slices(buffer[0]), group.slices(buffer[1])
        for i, mean, var in zip(ids, means, variances):
            views[i] = (mean, var)
        targets = [t for pair in zip(means, variances) for t in pair]
        own = [t for i in ids for t in _running(layers[i].module)]
        _fill_from_layers(buffer, size != sum(group.channels), targets, own)
        buffer[0].nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        buffer[1].nan_to_num_(nan=1.0, posinf=1.0, neginf=1.0).clamp_min_(0.0)
        group.initial = buffer.clone()
        groups.append(group)
    return groups, [v for v in views if v is not None]


@contextlib.contextmanager
def recalibration_state(
    model: nn.Module,
    layers: Sequence[NormLayer],
    mode: Mode,
    modules: list[tuple[str, nn.Module]] | None = None,
    prepare: Callable[[RecalibrationState], Any] | None = None,
) -> Iterator[RecalibrationState]:
    """Prepares ``model`` for a statistics pass and restores it bitwise afterwards.

    Inside the block:

    * ``mode="norm"``: the selected layers are in training mode, every other module in
      eval mode; ``"train"``: every module in training mode except unselected
      normalization layers, which stay in eval mode so that nothing updates them;
      ``"keep"``: training flags are left as they are; ``"all"``: every module in training
      mode, unselected normalization layers too (``torch.optim.swa_utils.update_bn``'s
      ``model.train()``; their buffers change during the passes and are restored with the rest).
    * Each selected layer's ``running_mean``/``running_var`` are replaced by views of
      one flat scratch buffer per device and dtype and its ``num_batches_tracked`` by a
      fresh counter (``RecalibrationState.counters``), so the layer's own updates never
      touch the real buffers, and its momentum is 1.0.

    On exit — normal, exception or ``KeyboardInterrupt`` — the forward wrappers are
    removed, every module's buffers and parameters are put back as the tensor objects
    they were (values copied back where the passes changed them, see
    :class:`~precisebn.state.StateSnapshot`), and every momentum and ``training``
    flag is restored. Parameters that the model's own forward changed in place and that
    could not be restored are named in a :class:`~precisebn.errors.ModelChangedWarning`.

    ``modules``: the model's ``named_modules()``, if the caller has already listed them.
    ``prepare``: called with the state before the training flags are set (the collector, which wraps the
    layers' forwards); what it returns is the state's ``prepared``.

    Raises:
        UninitializedLayerError: The model has lazy modules that never ran (the passes
            would materialise them).
    """
    modules = list(model.named_modules()) if modules is None else modules
    refuse_uninitialized(modules)
    refuse_parameter_statistics(layers)
    owners, originals = [], []  # the buffers swapped out (and which layer had each)
    for i, layer in enumerate(layers):
        for k in ("running_mean", "running_var", "num_batches_tracked"):
            if isinstance(t := layer.module._buffers.get(k), Tensor):
                owners.append((i, k))
                originals.append(t)
    refuse_freed([(layers[i].label, k, t) for (i, k), t in zip(owners, originals)])
    with contextlib.ExitStack() as stack:
        # parallel lists rather than (module, value) pairs: a pass makes few objects for the gc to track
        mods = [m for _, m in modules]
        norms = [layer.module for layer in layers]
        # the snapshot puts everything back, flags and momenta too, and runs last; what precisebn itself set is
        # put back before it, so that in the common case it finds every module as it was (a look at C speed,
        # not a module-by-module restore: 3 ms on efficientnet_b0)
        snapshot = StateSnapshot(modules, uncopied={id(t) for t in originals})
        stack.callback(to_the_end, _restore_snapshot, snapshot)
        # the forward wrappers come off after everything else they guard is back (and go on before the modes are
        # set, by `prepare`): a call from another thread meanwhile is refused by them, not run in training mode
        # on the scratch buffers (a probe: its output silently the batch's)
        wrapped: list[tuple[nn.Module, object]] = []
        stack.callback(to_the_end, _unwrap_forwards, wrapped)
        stack.callback(to_the_end, _restore_flags, mods, [m.training for m in mods])
        stack.callback(to_the_end, _restore_momenta, norms, [m.momentum for m in norms])
        stack.callback(to_the_end, _swap_back, [layers[i].module._buffers for i, _ in owners], owners, originals)
        # their values too: nothing should write them while they are out, but code holding them (a list
        # attribute, a parent module) still can (a probe: estimate() left the last batch's figures there)
        kept = ValueCopies(originals)
        stack.callback(to_the_end, kept.restore)

        groups, views = _allocate_scratch(layers)
        counters: list[Tensor | None] = []
        state = RecalibrationState(list(layers), groups, views, counters, kept, owners, wrapped)
        stack.enter_context(_compiled_code_runs_eagerly())

        for layer, (mean_view, var_view) in zip(layers, views):
            m = layer.module
            m._buffers["running_mean"] = mean_view
            m._buffers["running_var"] = var_view
            tracked = m._buffers.get("num_batches_tracked")
            # (from the layer's own count, as every batch starts: a forward reading it — Batch Renormalization's
            # warm-up — runs as the model does; from 0 it ran as at step 0, probe 37)
            counter = tracked.detach().clone() if isinstance(tracked, Tensor) else None
            if counter is not None:
                m._buffers["num_batches_tracked"] = counter
            counters.append(counter)
            _set_attribute(m, "momentum", 1.0)
        state.modules = modules
        if prepare is not None:
            state.prepared = prepare(state)
        state.evaluating[:] = _set_modes(mods, {id(m) for m in norms}, mode)
        yield state


_eager_lock = threading.RLock()  # (re-entrant: a signal handler running a pass in this thread must not wait for itself)
_eager_holders: set[object] = set()  # the passes running now (one token each: see _compiled_code_runs_eagerly)
_eager_stance: Any = None


@contextlib.contextmanager
def _compiled_code_runs_eagerly() -> Iterator[None]:
    """``torch.compiler.set_stance("force_eager")`` while any statistics pass runs.

    A ``torch.compile``d submodule or a ``model.compile()``d model then runs as plain
    PyTorch: nothing is compiled for the passes' configuration (layers in training mode,
    scratch buffers), ``fullgraph=True`` is no obstacle, no recompilation counts against
    the model's limit, and the forward wrappers' host-side bookkeeping is never traced
    (traced, its counters became guards: 23 graphs for one call). The stance is global,
    so it is set by the first pass to start and put back by the last to end, across
    threads. Without ``torch._dynamo`` loaded (1.9 s to import) nothing can be compiled.
    """
    global _eager_stance
    if "torch._dynamo" not in sys.modules or not hasattr(torch.compiler, "set_stance"):  # set_stance: torch >= 2.6
        yield
        return
    token = object()
    nested = lock_held(_eager_lock)  # (a pass run by a signal handler inside another's `with`: that one lets go)
    try:  # (each pass holds the stance by its own token, added and taken away in one operation each, and the
        # stance is put back to the end: Ctrl-C there left every later torch.compile eager, silently, a probe)
        with _eager_lock:
            if _eager_stance is None:
                _eager_stance = torch.compiler.set_stance("force_eager")  # sets it now; exiting puts back the old
            _eager_holders.add(token)
        yield
    finally:
        to_the_end(_leave_eager, token, nested)


def _leave_eager(token: object, nested: bool = True) -> None:
    """The pass holding ``token`` is done: the last one puts the stance back (idempotent: run to the end); the lock
    is let go of unless the pass is ``nested`` (see :func:`~precisebn.state.let_go`)."""
    global _eager_stance
    with _eager_lock:
        _eager_holders.discard(token)
        if not _eager_holders and _eager_stance is not None:
            _eager_stance.__exit__(None, None, None)  # (puts back the stance it found: the same if run again)
            _eager_stance = None
    let_go(_eager_lock, nested)


def _set_modes(modules: list[nn.Module], selected: set[int], mode: Mode) -> list[nn.Module]:
    """Sets the modules' flags for ``mode``; returns those set to eval mode."""
    # Flags are assigned directly rather than through Module.train(), which models
    # may override with side effects (freezing, re-initialising...).
    if mode == "keep":
        return []
    if mode == "norm":  # (the default: the selected layers in training mode, every other module in eval mode)
        flags = list(map(selected.__contains__, map(id, modules)))
        _set_attributes(modules, "training", flags)
        return list(itertools.compress(modules, map(operator.not_, flags)))
    evaluating = []
    flags = []
    for m in modules:
        if id(m) in selected or mode == "all":
            flags.append(True)
        elif isinstance(m, _NormBase) and m.track_running_stats:
            flags.append(False)
            evaluating.append(m)
        else:
            flags.append(mode == "train")
            if mode != "train":
                evaluating.append(m)
    _set_attributes(modules, "training", flags)
    return evaluating


def _set_attribute(m: nn.Module, name: str, value: object) -> None:
    """``setattr(m, name, value)`` for a plain attribute already in ``m.__dict__``."""
    if name in m.__dict__ and type(m).__setattr__ is nn.Module.__setattr__:
        m.__dict__[name] = value  # what Module.__setattr__ would do for a non-tensor, without its lookups
    else:
        setattr(m, name, value)


def _set_attributes(modules: list[nn.Module], name: str, values: list[Any]) -> None:
    """:func:`_set_attribute` for each module and value, in order: at C speed when every module holds ``name`` in its
    ``__dict__`` and none has a ``__setattr__`` of its own (the common case: 0.2 ms on efficientnet_b0's 337 modules,
    module by module)."""
    attributes = list(map(_DICT_OF, modules))
    if all(map(operator.contains, attributes, itertools.repeat(name))) and all(
        cls.__setattr__ is nn.Module.__setattr__ for cls in set(map(type, modules))
    ):
        collections.deque(map(operator.setitem, attributes, itertools.repeat(name), values), maxlen=0)  # (run it)
        return
    for m, value in zip(modules, values):
        _set_attribute(m, name, value)


def _restore_flags(modules: list[nn.Module], flags: list[bool]) -> None:
    _set_attributes(modules, "training", flags)


def _restore_momenta(modules: list[nn.Module], momenta: list[float | None]) -> None:
    _set_attributes(modules, "momentum", momenta)


def _swap_back(buffers: list[dict[str, Any]], owners: list[tuple[int, str]], originals: list[Tensor]) -> None:
    """Puts the swapped-out running buffers back in their layers' buffer dicts (the snapshot checks after)."""
    for held, (_, key), t in zip(buffers, owners, originals):
        held[key] = t


def _restore_snapshot(snapshot: StateSnapshot) -> None:
    lost = snapshot.restore()
    if lost:
        shown = ", ".join(map(repr, lost[:5])) + (f" and {len(lost) - 5} more" if len(lost) > 5 else "")
        warnings.warn(
            f"the model's own forward changed {shown} in place (or assigned their .data) during the statistics "
            "passes, and precisebn could not put them back: it keeps no copy of parameters (and a buffer it could "
            "not copy or reshape keeps its new values too). Make forward leave parameters alone, or recalibrate a copy "
            "(copy.deepcopy(model)).",
            ModelChangedWarning,
            stacklevel=caller_stacklevel(),
        )


class _Routed:
    """A module's forward while it is measured: every call goes through ``call(forward, args, kwargs)`` (see
    :meth:`RecalibrationState.wrap_forward`). A copy of the module made during the passes (``copy.deepcopy``: a
    teacher made in ``forward``; pickling: a loader's spawn or forkserver worker, ``torch.save``) gets the module's
    own forward instead: it is a model of its own, neither measured nor bound to these passes. Copied with the
    wrapper, its layers ran the original's forward, counted in its statistics, and refused every call after the
    passes."""

    __slots__ = ("call", "forward")

    def __init__(self, forward: Callable[..., Any], call: Callable[..., Any]) -> None:
        self.forward = forward
        self.call = call

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_inference_mode_enabled():  # the model's forward runs the layer in inference mode: so
            with torch.inference_mode(False):  # does the layer, but what `call` keeps (figures, moments, the
                return self.call(self._inferring, args, kwargs)  # workspace) must stay writable outside it
        return self.call(self.forward, args, kwargs)

    def _inferring(self, *args: Any, **kwargs: Any) -> Any:
        with torch.inference_mode():
            return self.forward(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return copy.deepcopy(self.forward, memo)  # (a bound method: the copy's own, bound to the copy)

    def __reduce_ex__(self, protocol: Any) -> Any:
        forward = self.forward
        if isinstance(forward, types.FunctionType):  # (a function: pickled by name, which would name this object's)
            return _itself, (forward,)
        return forward.__reduce_ex__(protocol)  # (a bound method, a partial...: as without precisebn)


def _itself(x: Any) -> Any:
    return x


def _unwrap_forwards(wrapped: list[tuple[nn.Module, object]]) -> None:
    for module, previous in reversed(wrapped):
        if previous is _NO_FORWARD:
            module.__dict__.pop("forward", None)
        else:
            module.__dict__["forward"] = previous
    wrapped.clear()
