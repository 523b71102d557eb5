"""Drop-in replacements for fvcore's and torch's BatchNorm recalibration functions.

Same signatures and calling conventions, the exact estimator underneath, and the model
left untouched when anything fails:

* :func:`update_bn_stats` replaces ``fvcore.nn.update_bn_stats`` (also what
  detectron2's ``PreciseBN`` hook calls).
* :func:`update_bn` replaces ``torch.optim.swa_utils.update_bn``.

Both keep statistics local to the process (as the originals do); use
:func:`precisebn.recalibrate` for the exact merge across ranks.
"""

from __future__ import annotations

import contextlib
import operator
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .adapt import WRITTEN
from .data import to_device
from .errors import BatchTypeError, EmptyDataError, InvalidArgumentError, ShortDataWarning
from .interrupts import signals_held
from .layers import find_norm_layers, unwrap
from .recalibrate import _estimate
from .writing import plan_writes

__all__ = ["ShortLoaderError", "update_bn", "update_bn_stats"]


class ShortLoaderError(EmptyDataError, AssertionError):
    """The loader stopped before ``num_iters`` batches (an ``AssertionError`` too, which
    is what fvcore's callers catch)."""


def update_bn_stats(
    model: nn.Module, data_loader: Iterable[Any], num_iters: int = 200, progress: str | None = None
) -> None:
    """Recomputes the statistics of the BatchNorm layers that are in training mode.

    Like fvcore: runs ``model(batch)`` on the first ``num_iters`` batches exactly as
    they come (the loader's own objects: no unpacking, no copy, no device move), leaves
    every ``training`` flag as it is, and touches only BatchNorm layers in training mode. Unlike fvcore, the
    statistics are exact (float64, count-weighted pooled mean and variance), a layer
    may be called several times per forward, and the model is left unchanged on any
    failure.

    Args:
        model: The model; BatchNorm layers in eval mode are left alone.
        data_loader: Iterable of batches, each passed to ``model`` as is.
        num_iters: Number of batches to use.
        progress: ``"tqdm"`` for a progress bar; anything else, none (as fvcore's reads it).

    Raises:
        ShortLoaderError: The loader gave fewer than ``num_iters`` batches (also an
            ``AssertionError``); the model is untouched.

    Example:
        >>> import torch
        >>> from precisebn.compat import update_bn_stats
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)).train()
        >>> update_bn_stats(model, [torch.randn(8, 4) for _ in range(10)], num_iters=10)
    """
    _refuse_non_module(model, "update_bn_stats(model, data_loader, ...)", data_loader)
    num_iters = _positive(num_iters)

    def selected(name: str, module: nn.Module) -> bool:
        return module.training and isinstance(module, _BatchNorm)

    if not find_norm_layers(model, selected, require=False):
        return
    data_loader = _batches_of(data_loader, "update_bn_stats")
    walk: list[tuple[str, nn.Module]] = []
    with contextlib.ExitStack() as guard:  # one hold on the model from the passes to the writes
        held = guard.enter_context(signals_held())  # (the model's restore runs to its end: see interrupts)
        try:  # (a short loader is its own error here: no warning first — nor a filter that would hide other threads')
            stats = _measure(
                guard,
                walk,
                model,
                data_loader,
                num_samples=None,
                num_batches=num_iters,
                forward=lambda m, b: m(b),
                layers=selected,
                device=None,
                progress=progress == "tqdm",
                _mode="keep",
                warn_short=False,
            )
        except EmptyDataError as exc:
            raise ShortLoaderError(
                f"update_bn_stats is meant to run for {num_iters} iterations, but the data loader is empty"
            ) from exc
        if stats.batches < num_iters:
            raise ShortLoaderError(
                f"update_bn_stats is meant to run for {num_iters} iterations, but the data loader stops at "
                f"{stats.batches} iterations; the model was left unchanged."
            )
        plan_writes(unwrap(model), stats, modules=walk, shared_checked=True).commit()
        held.done = "update_bn_stats() had completed before this signal: the model holds the new statistics"


def update_bn(loader: Iterable[Any], model: nn.Module, device: torch.device | str | None = None) -> None:
    """Recomputes the statistics of every BatchNorm layer over the whole loader.

    Like ``torch.optim.swa_utils.update_bn``: the model runs in training mode, a
    tuple/list batch gives its first element, ``device`` moves the input, momentum and
    training flags are as before afterwards. Unlike it, the statistics are the exact
    pooled mean and variance (torch averages per-batch variances, dropping the
    variance of batch means), per-module training flags are restored exactly, and an
    empty loader (a :class:`~precisebn.errors.ShortDataWarning`, no error, as torch's returns)
    or a failing forward leaves the model unchanged.

    Example:
        >>> import torch
        >>> from precisebn.compat import update_bn
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
        >>> update_bn([(torch.randn(8, 4), torch.zeros(8)) for _ in range(5)], model)
    """

    _refuse_non_module(model, "update_bn(loader, model, device=None)", loader)

    def selected(name: str, module: nn.Module) -> bool:
        return isinstance(module, _BatchNorm)

    def forward(m: nn.Module, batch: Any) -> Any:  # torch's: the first element of a tuple/list, else the batch
        x = batch[0] if isinstance(batch, (list, tuple)) else batch
        return m(x if device is None else _moved(x, device))

    if not find_norm_layers(model, selected, require=False):
        return
    loader = _batches_of(loader, "update_bn")
    walk: list[tuple[str, nn.Module]] = []
    with contextlib.ExitStack() as guard:  # one hold on the model from the passes to the writes
        held = guard.enter_context(signals_held())  # (the model's restore runs to its end: see interrupts)
        try:
            stats = _measure(
                guard,
                walk,
                model,
                loader,
                num_samples="all",
                num_batches=None,
                forward=forward,
                layers=selected,
                device=device,
                progress=False,
                _mode="all",  # model.train(), as torch's: InstanceNorm layers with running statistics too
            )
        except EmptyDataError:  # torch's returns (its statistics reset to 0/1): a drop-in must not raise here
            warnings.warn(
                "update_bn: the loader yielded no batch; the model's statistics were kept (torch's update_bn "
                "would have reset them to 0 and 1).",
                ShortDataWarning,
                stacklevel=2,
            )
            return
        plan_writes(unwrap(model), stats, modules=walk, shared_checked=True).commit()
        held.done = "update_bn() had completed before this signal: the model holds the new statistics"


def _moved(x: Any, device: Any) -> Any:
    """``x.to(device)``, as torch's ``update_bn`` moves its input; a dict, tuple or list of tensors (which torch's
    cannot move: ``AttributeError``) is moved tensor by tensor. Anything else is refused rather than passed on
    unmoved (the model would meet it on another device, or run where the caller did not ask)."""
    if hasattr(x, "to"):
        return x.to(device)
    if not isinstance(x, (Mapping, list, tuple)):
        raise BatchTypeError(
            f"update_bn: device={device!r} cannot move a batch of type {type(x).__name__} (it has no .to() method, "
            "and is not a dict, tuple or list of tensors); move the data yourself and pass device=None. The model "
            "was left unchanged."
        )
    return to_device(x, torch.device(device))


def _refuse_non_module(model: Any, signature: str, other: Any) -> None:
    """Refuses a ``model`` that is not an ``nn.Module`` — saying so when it is the other argument that is one: the two
    drop-ins take their arguments in opposite orders, as fvcore's and torch's do."""
    if isinstance(model, nn.Module):
        return
    swapped = " (the arguments look swapped)" if isinstance(other, nn.Module) else ""
    raise InvalidArgumentError(
        f"{signature.split('(')[0]}: model must be a torch.nn.Module, got {type(model).__name__}{swapped}; the call is "
        f"{signature}. Nothing was changed."
    )


def _positive(num_iters: Any) -> int:
    """``num_iters`` as an int, refused (before any pass) unless it is a positive integer: fvcore's function
    set every running buffer to 0 for 0, and raised a bare ``TypeError`` after the passes for ``None``."""
    try:
        if isinstance(num_iters, bool):
            raise TypeError
        value = operator.index(num_iters)
    except TypeError:
        value = None
    if value is None or value < 1:
        raise InvalidArgumentError(
            f"update_bn_stats: num_iters must be a positive integer (the number of batches to use), got "
            f"{num_iters!r}. The model was left unchanged."
        )
    return value


def _batches_of(loader: Any, caller: str) -> Any:
    """A tensor given as the loader, as the originals iterate it: its slices along dimension 0."""
    if not isinstance(loader, torch.Tensor):
        return loader
    if loader.dim() == 0:
        raise InvalidArgumentError(
            f"{caller}: the loader is a 0-dimensional tensor, which holds no batches; pass an iterable of batches "
            "(a DataLoader, a list of tensors, or a tensor whose first dimension indexes the batches). The model "
            "was left unchanged."
        )
    return list(loader.unbind(0))  # (what iterating it gives: views of the tensor)


def _measure(guard: contextlib.ExitStack, walk: list[tuple[str, nn.Module]], *args: Any, **options: Any) -> Any:
    """The drop-ins' statistics: :func:`~precisebn.recalibrate._estimate` with this process's data only,
    exact capture, both buffers to be written, the model held in ``guard`` until the caller writes."""
    return _estimate(
        guard,
        *args,
        mode="norm",  # (the flags come from _mode)
        distributed=False,
        process_group=None,
        capture="auto",
        tolerance=None,
        walk=walk,
        writes=WRITTEN["both"],
        # like fvcore's and torch's: the forward gets each batch as the loader gave it — unless the model is a
        # DDP/DataParallel wrapper, which would move it to its device itself (the passes run on its module)
        move=unwrap(args[0]) is not args[0],
        **options,
    )[0]
