"""Layers a training loop keeps frozen: in eval mode while the rest of the model trains.

Training code freezes normalization layers by keeping them in eval mode while the model
trains — mmdetection's ``norm_eval=True``, a backbone frozen for fine-tuning
(``model.eval(); model.head.train()``), a ``train()`` override that puts some layers back
in eval mode. Their running statistics are then fixed on purpose, and training normalises
with them. A recalibration made during training (:class:`~precisebn.PreciseBNScheduler`,
every training-loop integration) leaves them as they are: :meth:`FrozenLayers.observe`
notes which layers are in eval mode whenever the model is seen training, and
:meth:`FrozenLayers.excluding` takes them out of each computation's selection.

The model is *seen training* when the module inside its wrappers is in training mode, or
any of its submodules that holds parameters of its own (a head trained on a frozen backbone:
``model.eval(); model.head.train()``; not a dropout layer switched on for MC-dropout
evaluation); a model otherwise in eval mode tells nothing, and what was noted before stays.
Before any training step was seen the modes may not say what training freezes (a model built
in training mode whose ``train()`` override freezes layers has not run it yet):
:func:`train_override` names such an override, and the scheduler then computes nothing
rather than guess (running ``train()`` to look would run its side effects).

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.BatchNorm1d(2), torch.nn.BatchNorm1d(2))
    >>> _ = model.train(); _ = model[0].eval()  # layer 0 frozen
    >>> frozen = FrozenLayers()
    >>> frozen.observe(model)
    True
    >>> frozen.names
    ('0',)
    >>> _ = model.eval()  # evaluating: nothing is learnt from this
    >>> frozen.observe(model), frozen.names
    (False, ('0',))
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from .errors import InvalidArgumentError, PreciseBNWarning, caller_stacklevel
from .layers import LayerSelection, has_running_stats, layer_matcher, unwrap

__all__ = ["FrozenLayers", "agreed_names", "any_rank", "core_model", "train_override"]

_RELIST_FACTOR = 100  # the layers are listed again once this many times the last listing's duration has passed


def core_model(model: nn.Module) -> nn.Module:
    """The module whose layer names a frozen layer is noted by: ``model`` without its
    DDP/DataParallel/``torch.compile`` wrappers and averaging shells — a module whose only
    child is ``module`` (torch's ``AveragedModel``, timm's ``ModelEmaV2``/``V3``, mmengine's
    ``ExponentialMovingAverage``) — so that the layers frozen in the trained model are found
    in its averaged copy."""
    while True:
        model = unwrap(model)
        children = list(model.named_children())
        if len(children) == 1 and children[0][0] == "module":
            model = children[0][1]
        else:
            return model


class FrozenLayers:
    """The qualified names of the normalization layers last seen in eval mode while their
    model was seen training (see the module's docstring).

    Only layers with running statistics are noted (see
    :func:`~precisebn.layers.has_running_stats`), by name relative to :func:`core_model`.
    The model's layers are listed again at most every hundred times the listing's own
    duration (under 1 % of the time between observations), and at every
    :meth:`excluding`, so that a layer replaced during training (SyncBatchNorm conversion,
    a module swapped in) is seen as it is.
    """

    def __init__(self) -> None:
        self.names: tuple[str, ...] = ()
        self.seen = False  # whether a model was ever seen training
        self._model: nn.Module | None = None
        self._layers: list[tuple[str, nn.Module]] = []
        self._others: list[nn.Module] = []  # the model's other modules
        self._listed_at = 0.0
        self._listing = 0.0
        self._absent: tuple[str, ...] = ()  # noted names last warned about as absent from a model

    def _list(self, core: nn.Module, *, now: bool = False) -> list[tuple[str, nn.Module]]:
        start = time.perf_counter()
        if now or core is not self._model or start - self._listed_at > _RELIST_FACTOR * self._listing:
            self._layers, self._others = [], []
            for name, m in core.named_modules():
                if has_running_stats(m):
                    self._layers.append((name, m))
                else:
                    self._others.append(m)
            self._model, self._listed_at = core, start
            self._listing = time.perf_counter() - start
        return self._layers

    def observe(self, model: nn.Module, *, relist: bool = False, modes: Mapping[str, bool] | None = None) -> bool:
        """Notes the layers of ``model`` in eval mode, if ``model`` is seen training (else
        keeps what was noted before, and returns ``False``): a host-only scan of the
        modules' flags, cheap enough for every training step (``relist``: list the model's
        layers again first; ``modes``: the flags of ``model``'s modules by qualified name, as
        recorded before something put it in eval mode, read instead of theirs).

        Raises:
            InvalidArgumentError: ``model`` is not an ``nn.Module``.
        """
        if not isinstance(model, nn.Module):
            raise InvalidArgumentError(f"observe() takes the model being trained, got {type(model).__name__}")
        core = core_model(model)
        layers = self._list(core, now=relist)
        if modes is None:
            flags = None
        else:  # (by module: the names are model's, the layers' core's)
            flags = {id(m): bool(modes[name]) for name, m in model.named_modules() if name in modes}

        def training(m: nn.Module) -> bool:
            return m.training if flags is None else flags.get(id(m), m.training)

        if (
            not training(core)
            and not any(training(m) for _, m in layers)
            and not any(
                training(m) and m._parameters
                for m in self._others  # (a dropout layer switched on says nothing)
            )
        ):
            return False
        self.names = tuple(name for name, m in layers if not training(m))
        self.seen = True
        return True

    def excluding(self, layers: LayerSelection, model: nn.Module) -> tuple[LayerSelection, list[str]]:
        """``layers`` (a selection for :func:`precisebn.recalibrate` on ``model``) without the
        frozen layers, found in ``model`` by name; and the names of those found there.

        Raises:
            LayerNotFoundError: ``layers`` names a module that is not in ``model``.
            InvalidArgumentError: ``layers`` is not a selection.
        """
        self._model = None  # (listed again at the next observation)
        if not self.names:
            return layers, []
        core = dict(core_model(model).named_modules())
        found = [name for name in self.names if name in core and has_running_stats(core[name])]
        if not found:
            if self.names != self._absent:  # (a model observed that is not the one recalibrated, or its copy)
                self._absent = self.names
                shown = ", ".join(map(repr, self.names[:5])) + (" ..." if len(self.names) > 5 else "")
                warnings.warn(
                    f"precisebn: the layers noted as frozen for training ({shown}) are not in the model being "
                    f"recalibrated ({type(model).__name__}), so none is left out there; observe() the model being "
                    "trained, with the same structure (an averaged copy's own module, not its wrapper).",
                    PreciseBNWarning,
                    stacklevel=caller_stacklevel(),
                )
            return layers, []
        skipped = {id(core[name]) for name in found}
        base = layer_matcher(layers, dict(unwrap(model).named_modules()), model)  # (checks the user's names now)

        def selected(name: str, module: nn.Module, base: Callable[[str, nn.Module], bool] = base) -> bool:
            return id(module) not in skipped and bool(base(name, module))

        return selected, found


def _gathered(value: Any, distributed: Any, group: Any) -> list[Any] | None:
    """Every rank's ``value`` (one ``all_gather_object``), or ``None`` without a process group of several ranks
    (or with ``distributed=False``)."""
    dist = torch.distributed
    if distributed is False or not (dist.is_available() and dist.is_initialized()):
        return None
    group = group if group is not None else dist.group.WORLD
    try:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
    except Exception:  # a wrong process_group: recalibrate says so, on every rank
        return None
    if world <= 1 or rank < 0:
        return None
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, value, group=group)
    return gathered


def any_rank(flag: bool, distributed: Any, group: Any = None) -> bool:
    """Whether ``flag`` holds on any rank (see :func:`agreed_names` for when the ranks are asked): a decision every
    rank must take alike — whether to recalibrate now, when one rank's statistics were invalidated (probe 40: that
    rank alone went on to the gathering below, and waited for the others until the group's timeout)."""
    gathered = _gathered(bool(flag), distributed, group)
    return bool(flag) if gathered is None else any(gathered)


def agreed_names(
    names: tuple[str, ...], distributed: Any, group: Any = None, unsure: bool = False
) -> tuple[tuple[str, ...], bool]:
    """Every rank's frozen layers (the union, in a fixed order) and whether any rank is
    ``unsure`` (see :func:`train_override`), so that all ranks leave the same layers out, or
    all skip — one ``all_gather_object`` when a process group of several ranks is initialised
    and ``distributed`` is not ``False``; ``(names, unsure)`` otherwise."""
    gathered = _gathered((list(names), unsure), distributed, group)
    if gathered is None:
        return names, unsure
    union: set[str] = set()
    for part, _ in gathered:
        union.update(part or ())
    return tuple(sorted(union)), any(flag for _, flag in gathered)


_HARMLESS_TRAIN = {"transformers.modeling_utils.PreTrainedModel.train"}  # (kernels switched, nothing frozen)


def train_override(model: nn.Module) -> str | None:
    """The first class among ``model``'s modules whose ``train()`` is its own (not
    ``nn.Module.train``): one that may keep layers in eval mode when training starts; ``None``
    when ``model.train()`` can only put every module in training mode."""
    for m in core_model(model).modules():
        train = type(m).train
        if train is not nn.Module.train and f"{train.__module__}.{train.__qualname__}" not in _HARMLESS_TRAIN:
            return f"{type(m).__module__}.{type(m).__qualname__}"
    return None
