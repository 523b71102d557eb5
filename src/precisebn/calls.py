"""Layers called several times per forward: one set of statistics per call.

A detection head shared by the levels of a feature pyramid calls its BatchNorm layers
once per level. Training normalises each call with that call's batch statistics, but the
layer's single pair of running buffers pools every level, so in eval mode no level is
normalised with statistics of its own — Wu & Johnson (2021, *Rethinking "Batch" in
BatchNorm*, §5.2) show this breaks RetinaNet, and fix it with per-level statistics and a
shared affine (detectron2's ``CycleBatchNormList``).

:func:`untie_calls` replaces such a layer by a :class:`PerCallBatchNorm`: call i of each
forward is normalised by its own BatchNorm (``calls[i]``, no affine), then scaled and
shifted by the original layer's ``weight`` and ``bias`` — the same ``Parameter`` objects,
so optimizers and averaged models keep working. ``precisebn.estimate(model, data,
per_call=True)`` measures the statistics under the names the parts get
(``"<layer>.calls.<i>"``), and :func:`precisebn.apply` / :func:`precisebn.recalibrate`
fill them on the untied model like any other BatchNorm layers.

Example:
    >>> import torch, precisebn
    >>> class Head(torch.nn.Module):
    ...     def __init__(self) -> None:
    ...         super().__init__()
    ...         self.bn = torch.nn.BatchNorm1d(2)
    ...     def forward(self, levels):
    ...         return [self.bn(x) for x in levels]
    >>> model = Head()
    >>> data = [[torch.randn(8, 2), torch.randn(8, 2) * 10 + 5] for _ in range(4)]
    >>> stats = precisebn.estimate(model, data, forward=lambda m, b: m(b), per_call=True)
    >>> sorted(stats)
    ['bn.calls.0', 'bn.calls.1']
    >>> _ = precisebn.untie_calls(model, stats)
    >>> _ = precisebn.apply(model, stats)
    >>> sorted(model.state_dict())  # doctest: +NORMALIZE_WHITESPACE
    ['bn.bias', 'bn.calls.0.num_batches_tracked', 'bn.calls.0.running_mean', 'bn.calls.0.running_var',
     'bn.calls.1.num_batches_tracked', 'bn.calls.1.running_mean', 'bn.calls.1.running_var', 'bn.weight']
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from .errors import InvalidArgumentError, LayerNotFoundError, UninitializedLayerError, UnsupportedLayerError
from .interrupts import signals_held
from .layers import refuse_freed, unwrap
from .population import PopulationStats
from .state import exclusive

__all__ = ["PerCallBatchNorm", "call_name", "untie_calls"]

logger = logging.getLogger("precisebn")

CALLS = "calls"
"""The name of a :class:`PerCallBatchNorm`'s per-call layers (``"<layer>.calls.<i>"``)."""

_CALL = re.compile(r"^(?:(.*)\.)?calls\.(\d+)$")
_BN_TYPES = (nn.SyncBatchNorm, nn.BatchNorm3d, nn.BatchNorm2d, nn.BatchNorm1d)  # most specific first
_PER_CALL_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


def call_name(layer: str, index: int) -> str:
    """The name of call ``index``'s statistics of layer ``layer`` (``"head.bn.calls.0"``).

    Example:
        >>> call_name("head.bn", 2), call_name("", 0)
        ('head.bn.calls.2', 'calls.0')
    """
    return f"{layer}.{CALLS}.{index}" if layer else f"{CALLS}.{index}"


class PerCallBatchNorm(nn.Module):
    """A BatchNorm layer with one set of statistics per call within a forward pass.

    Call i of each forward pass (i = 0, 1, ..., cycling through ``len(calls)``) is
    normalised by ``calls[i]``, a BatchNorm layer of the original's class (torch's
    ``BatchNorm1d/2d/3d`` or ``SyncBatchNorm``) with its ``eps`` and ``momentum`` and no
    affine; then the shared ``weight`` and ``bias`` are applied per channel (dimension
    1). In training mode each call is normalised with its own batch statistics and
    ``calls[i]`` tracks that call's running statistics; in eval mode call i uses
    ``calls[i]``'s running statistics.

    The position restarts at 0 whenever the model given to :func:`untie_calls` starts a
    forward pass, so an interrupted forward cannot shift the calls of the next one; it
    also wraps around after the last call. A call that raises (and that the model catches)
    takes no position, as it takes no index in :func:`~precisebn.estimate`'s per-call
    statistics.

    State dict: ``weight`` and ``bias`` (when affine), and
    ``calls.<i>.running_mean``, ``calls.<i>.running_var``,
    ``calls.<i>.num_batches_tracked``. A state dict of the original layer
    (``running_mean``, ``running_var``, ``num_batches_tracked``) loads too: every call
    starts from those statistics.

    Args:
        layer: The layer to untie (its parameters are shared, not copied).
        calls: The number of calls per forward pass (at least 1).

    Attributes:
        weight, bias: The original layer's affine parameters (the same objects), or None.
        calls: The per-call BatchNorm layers (a ``ModuleList``).
        position: The index of the next call.
    """

    def __init__(self, layer: _BatchNorm, calls: int) -> None:
        super().__init__()
        base = _base_type(layer)
        self.weight = layer.weight
        self.bias = layer.bias
        kwargs: dict[str, Any] = {"process_group": layer.process_group} if base is nn.SyncBatchNorm else {}
        parts = []
        for _ in range(calls):
            part = base(
                layer.num_features,
                eps=layer.eps,
                momentum=layer.momentum,
                affine=False,
                track_running_stats=True,
                device=layer.running_mean.device,
                dtype=layer.running_mean.dtype,
                **kwargs,
            )
            with torch.no_grad():
                for key in _PER_CALL_BUFFERS:
                    value = layer._buffers.get(key)
                    if isinstance(value, Tensor):
                        part._buffers[key].copy_(value)  # type: ignore[union-attr]
            part.train(layer.training)
            parts.append(part)
        self.calls = nn.ModuleList(parts)
        self.position = 0
        self.train(layer.training)

    @property
    def num_features(self) -> int:
        return int(self.calls[0].num_features)

    @property
    def eps(self) -> float:
        """The per-call layers' ``eps`` (setting it sets every call's)."""
        return float(self.calls[0].eps)

    @eps.setter
    def eps(self, value: float) -> None:
        for part in self.calls:
            part.eps = value

    @property
    def momentum(self) -> float | None:
        """The per-call layers' ``momentum`` (setting it sets every call's)."""
        return self.calls[0].momentum  # type: ignore[no-any-return]

    @momentum.setter
    def momentum(self, value: float | None) -> None:
        for part in self.calls:
            part.momentum = value

    def forward(self, input: Tensor) -> Tensor:
        i = self.position
        out = self.calls[i](input)
        # (after the call: one that raises, and that the model catches, takes no index, as in estimate())
        self.position = i + 1 if i + 1 < len(self.calls) else 0
        if self.weight is None and self.bias is None:
            return out  # type: ignore[no-any-return]
        shape = (1, -1) + (1,) * (out.dim() - 2)
        if self.weight is not None:
            out = out * self.weight.view(shape)
        if self.bias is not None:
            out = out + self.bias.view(shape)
        # the tied layer's output dtype: its input's (bfloat16 activations with float32 parameters stay
        # bfloat16; the affine above would promote them)
        return out if out.dtype == input.dtype else out.to(input.dtype)  # type: ignore[no-any-return]

    def extra_repr(self) -> str:
        return f"{self.num_features}, calls={len(self.calls)}, eps={self.eps}, momentum={self.momentum}"

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        # The tied layer's buffers (an older checkpoint): every call starts from them.
        if prefix + "running_mean" in state_dict and not any(k.startswith(prefix + CALLS + ".") for k in state_dict):
            for key in _PER_CALL_BUFFERS:
                value = state_dict.pop(prefix + key, None)
                if value is not None:
                    for i in range(len(self.calls)):
                        state_dict[f"{prefix}{CALLS}.{i}.{key}"] = value
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )


class _RestartCalls:
    """A forward pre-hook on the model: every forward pass starts at call 0 (picklable,
    and copied along with the model by ``copy.deepcopy``)."""

    def __init__(self, layers: list[PerCallBatchNorm]) -> None:
        self.layers = layers

    def __call__(self, module: nn.Module, args: Any) -> None:
        for layer in self.layers:
            layer.position = 0


def _base_type(layer: nn.Module) -> type[_BatchNorm]:
    for base in _BN_TYPES:
        if isinstance(layer, base):
            return base
    raise TypeError(type(layer).__name__)  # filtered out by _check_layer


def untie_calls(model: nn.Module, calls: Mapping[str, int] | PopulationStats) -> nn.Module:
    """Gives each call of a layer called several times per forward its own statistics.

    Every named layer is replaced — under every name it has in the model — by a
    :class:`PerCallBatchNorm` with one BatchNorm per call: call i of each forward pass
    is normalised by ``<layer>.calls.<i>`` (initialised with the layer's running
    statistics, ``eps`` and ``momentum``), then scaled and shifted by the layer's own
    ``weight`` and ``bias`` (the same ``Parameter`` objects). Then
    ``precisebn.apply(model, stats)`` writes per-call statistics from
    ``estimate(..., per_call=True)``, and ``precisebn.recalibrate(model, data)``
    measures them. State dict keys: ``<layer>.weight``, ``<layer>.bias`` and
    ``<layer>.calls.<i>.running_mean|running_var|num_batches_tracked``.

    A forward pre-hook on ``model`` restarts the cycle at call 0 at every forward pass.
    A layer that is already a :class:`PerCallBatchNorm` with as many calls is left as it
    is, so untying twice is harmless. All or nothing: everything is checked before the
    first layer is replaced.

    Args:
        model: The model (a DDP/DataParallel wrapper is looked through); changed in place.
        calls: Layer name → calls per forward (e.g. ``{"head.bn": 5}``), or the
            statistics of ``estimate(..., per_call=True)``, whose ``"<layer>.calls.<i>"``
            entries say which layers to untie and into how many calls.

    Returns:
        ``model``.

    Raises:
        LayerNotFoundError: A named layer is not in the model.
        UnsupportedLayerError: A layer is not a ``BatchNorm1d/2d/3d``/``SyncBatchNorm``
            (or subclass) with running statistics, its class or instance overrides
            ``forward`` (the per-call layers could not reproduce it), it has hooks, it is
            the model itself, or it is already untied into another number of calls.
        UninitializedLayerError: A lazy layer has not run yet.
        InvalidArgumentError: ``calls`` has a wrong type, a count is not a positive
            integer, or per-call statistics skip a call index.
        ConcurrentUseError: A recalibration is using the model.

    Example:
        >>> import torch, precisebn
        >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.BatchNorm2d(4))
        >>> weight = model[1].weight
        >>> _ = precisebn.untie_calls(model, {"1": 3})
        >>> type(model[1]).__name__, model[1].extra_repr()
        ('PerCallBatchNorm', '4, calls=3, eps=1e-05, momentum=0.1')
        >>> [type(m).__name__ for m in model[1].calls], model[1].calls[0].affine
        (['BatchNorm2d', 'BatchNorm2d', 'BatchNorm2d'], False)
        >>> model[1].weight is weight
        True
    """
    if not isinstance(model, nn.Module):
        raise InvalidArgumentError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    wanted = _calls_per_layer(calls)
    model = unwrap(model)
    with signals_held(), exclusive(model):  # (the swap of layers and the hook run to their end: see interrupts)
        modules = dict(model.named_modules(remove_duplicate=False))
        plan: dict[int, tuple[nn.Module, int]] = {}  # id(layer) -> (layer, calls)
        for name, k in wanted.items():
            layer = modules.get(name)
            if layer is None:
                raise LayerNotFoundError(
                    f"untie_calls: layer {name!r} is not in the model {type(model).__name__}; use the qualified names "
                    "of model.named_modules() (or the statistics of estimate(..., per_call=True) on this model). "
                    "Nothing was changed."
                )
            if isinstance(layer, PerCallBatchNorm):
                if len(layer.calls) != k:
                    raise UnsupportedLayerError(
                        f"untie_calls: layer {name!r} is already untied into {len(layer.calls)} calls, not {k}; "
                        "untie the original model (or load its checkpoint into a model untied once). Nothing was "
                        "changed."
                    )
                continue
            _check_layer(name, layer, model)
            refuse_freed(  # (its statistics are copied into each call's: freed memory crashed the process)
                [(f"layer {name!r} ({type(layer).__name__})", k, t) for k, t in layer._buffers.items() if t is not None]
            )
            previous = plan.get(id(layer))
            if previous is not None and previous[1] != k:
                raise InvalidArgumentError(
                    f"untie_calls: layer {name!r} is shared under several names with different numbers of calls "
                    f"({previous[1]} and {k}); one module is called as often whichever name reaches it. Nothing "
                    "was changed."
                )
            plan[id(layer)] = (layer, k)
        if not plan:
            return model
        untied = {key: PerCallBatchNorm(layer, k) for key, (layer, k) in plan.items()}  # type: ignore[arg-type]
        slots = [
            (parent, child_name, untied[id(child)])
            for parent in model.modules()
            for child_name, child in parent._modules.items()
            if child is not None and id(child) in untied
        ]
        done: list[tuple[nn.Module, str, nn.Module]] = []
        try:
            for parent, child_name, new in slots:
                done.append((parent, child_name, parent._modules[child_name]))  # type: ignore[arg-type]
                parent._modules[child_name] = new
        except BaseException:
            for parent, child_name, old in reversed(done):
                parent._modules[child_name] = old
            raise
        model.register_forward_pre_hook(_RestartCalls(list(untied.values())))
    logger.info("precisebn: untied %d layer(s) into per-call statistics", len(untied))
    return model


def call_indices(names: Any) -> dict[str, set[int]]:
    """Layer name -> the call indices among ``names`` named as per-call statistics (``call_name``).

    Example:
        >>> call_indices(["bn.calls.0", "bn.calls.1", "calls.0", "conv"])
        {'bn': {0, 1}, '': {0}}
    """
    found: dict[str, set[int]] = {}
    for name in names:
        match = _CALL.match(name)
        if match:
            found.setdefault(match.group(1) or "", set()).add(int(match.group(2)))
    return found


def _calls_per_layer(calls: Any) -> dict[str, int]:
    """Layer name -> number of calls, from a mapping or from per-call statistics."""
    if isinstance(calls, PopulationStats):
        found = call_indices(calls)
        out = {}
        for name, indices in found.items():
            k = max(indices) + 1
            if indices != set(range(k)):
                missing = sorted(set(range(k)) - indices)
                raise InvalidArgumentError(
                    f"untie_calls: the statistics hold calls {sorted(indices)} of layer {name!r} but not {missing}; "
                    "per-call statistics come from estimate(..., per_call=True) whole. Nothing was changed."
                )
            out[name] = k
        return out
    if not isinstance(calls, Mapping):
        raise InvalidArgumentError(
            "untie_calls: calls must map layer names to calls per forward ({'head.bn': 5}) or be the statistics of "
            f"estimate(..., per_call=True); got {type(calls).__name__}"
        )
    out = {}
    for name, k in calls.items():
        if not isinstance(name, str):
            raise InvalidArgumentError(f"untie_calls: layer names must be strings, got {name!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise InvalidArgumentError(
                f"untie_calls: layer {name!r} needs a positive integer number of calls per forward, got {k!r}"
            )
        out[name] = k
    return out


def _check_layer(name: str, layer: nn.Module, model: nn.Module) -> None:
    where = f"untie_calls: layer {name!r} ({type(layer).__name__})"
    if layer is model:
        raise UnsupportedLayerError(
            f"{where} is the model itself, which cannot be replaced in place; untie it inside a container "
            "(nn.Sequential(layer)). Nothing was changed."
        )
    if isinstance(layer, nn.modules.lazy.LazyModuleMixin) and layer.has_uninitialized_params():
        raise UninitializedLayerError(
            f"{where} is a lazy layer that has not run yet; run one forward pass first so that its number of "
            "channels is known. Nothing was changed."
        )
    if not isinstance(layer, _BN_TYPES) or not layer.track_running_stats or layer.running_mean is None:
        raise UnsupportedLayerError(
            f"{where} is not a BatchNorm1d/2d/3d or SyncBatchNorm layer with running statistics; untie_calls "
            "gives per-call statistics to those only. Nothing was changed."
        )
    own = _base_type(layer)
    if type(layer).forward is not own.forward or "forward" in layer.__dict__:
        raise UnsupportedLayerError(
            f"{where} has its own forward; the per-call layers are torch's {own.__name__} followed by the "
            "shared affine and would not do what that forward does. Untie a layer with torch's forward, "
            "or split it per call in the model's code. Nothing was changed."
        )
    if layer._forward_pre_hooks or layer._forward_hooks or layer._backward_hooks or layer._backward_pre_hooks:
        raise UnsupportedLayerError(
            f"{where} has hooks, which would be lost with the layer; remove them first (and register them on "
            "the untied layer if needed). Nothing was changed."
        )
