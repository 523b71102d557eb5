"""Layers a training loop keeps frozen: in eval mode while the rest of the model trains.

Training code freezes normalization layers by keeping them in eval mode while the model
trains — mmdetection's ``norm_eval=True``, a backbone frozen for fine-tuning, a
``train()`` override that puts some layers back in eval mode. Their running statistics
are then fixed on purpose, and training normalises with them. A recalibration made
during training (:class:`~precisebn.PreciseBNScheduler`, every training-loop integration)
leaves them as they are: :meth:`FrozenLayers.observe` notes which layers are in eval
mode whenever the model is seen in training mode, and :meth:`FrozenLayers.excluding`
takes them out of each computation's selection.

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

from collections.abc import Callable

from torch import nn

from .layers import LayerSelection, has_running_stats, layer_matcher, unwrap

__all__ = ["FrozenLayers", "core_model"]


def core_model(model: nn.Module) -> nn.Module:
    """The module whose layer names a frozen layer is noted by: ``model`` without its
    DDP/DataParallel/``torch.compile`` wrappers and ``AveragedModel`` shells, so that the
    layers frozen in the trained model are found in its averaged copy."""
    while True:
        model = unwrap(model)
        inner = getattr(model, "module", None)
        if type(model).__name__ == "AveragedModel" and isinstance(inner, nn.Module):
            model = inner
        else:
            return model


class FrozenLayers:
    """The qualified names of the normalization layers last seen in eval mode while their
    model was in training mode.

    Only layers with running statistics are noted (see
    :func:`~precisebn.layers.has_running_stats`), by name relative to
    :func:`core_model`. The layers of a model are listed once, at its first observation
    (a model observed again is assumed to hold the same layers).
    """

    def __init__(self) -> None:
        self.names: tuple[str, ...] = ()
        self._model: nn.Module | None = None
        self._layers: list[tuple[str, nn.Module]] = []

    def observe(self, model: nn.Module) -> bool:
        """Notes the layers of ``model`` in eval mode, if ``model`` is in training mode
        (else keeps what was noted before, and returns ``False``): a host-only scan of the
        layers' flags, cheap enough for every training step."""
        if not model.training:
            return False
        core = core_model(model)
        if core is not self._model:
            self._layers = [(name, m) for name, m in core.named_modules() if has_running_stats(m)]
            self._model = core
        self.names = tuple(name for name, m in self._layers if not m.training)
        return True

    def excluding(self, layers: LayerSelection, model: nn.Module) -> tuple[LayerSelection, list[str]]:
        """``layers`` (a selection for :func:`precisebn.recalibrate` on ``model``) without the
        frozen layers, found in ``model`` by name; and the names of those found there.

        Raises:
            LayerNotFoundError: ``layers`` names a module that is not in ``model``.
            InvalidArgumentError: ``layers`` is not a selection.
        """
        if not self.names:
            return layers, []
        core = dict(core_model(model).named_modules())
        found = [name for name in self.names if name in core and has_running_stats(core[name])]
        if not found:
            return layers, []
        skipped = {id(core[name]) for name in found}
        base = layer_matcher(layers, dict(unwrap(model).named_modules()))  # (checks the user's names now)

        def selected(name: str, module: nn.Module, base: Callable[[str, nn.Module], bool] = base) -> bool:
            return id(module) not in skipped and bool(base(name, module))

        return selected, found
