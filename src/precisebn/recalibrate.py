"""The public entry points: :func:`estimate`, :func:`apply` and :func:`recalibrate`.

The statistical contract, stated once:

    For every selected normalization layer, the new ``running_mean`` and
    ``running_var`` are the mean and the population (biased) variance, per channel,
    of every value the layer received during the passes — pooled over batches,
    calls, samples and spatial/temporal positions, and over all ranks when
    distributed — exactly as computed in float64 on the concatenation of all those
    inputs. Each value weighs the same: a batch of 8 counts four times a batch of 2,
    a (N, C, T, H, W) input adds N·T·H·W values per channel.

Accumulation is in float64 with Chan's merge of (count, mean, M2); the only rounding
left is that of the per-batch figures in the layer's own dtype (see the README's
"Exactness" section for measured errors).
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from . import distributed as _dist
from .capture import Collector
from .data import Forward, batch_size, default_forward, model_device, to_device
from .errors import EmptyDataError, InvalidArgumentError, NonFiniteError, ShortDataWarning, StatsMismatchError
from .layers import (
    Capture,
    LayerSelection,
    Mode,
    NormLayer,
    find_norm_layers,
    has_running_stats,
    recalibration_state,
    unwrap,
)
from .population import LayerStats, PopulationStats
from .report import LayerReport, Report, _cpu64
from .stats import RunningMoments

__all__ = ["DEFAULT_NUM_SAMPLES", "Measurement", "apply", "estimate", "recalibrate"]

logger = logging.getLogger("precisebn")

DEFAULT_NUM_SAMPLES = 8192
"""Samples used when neither ``num_samples`` nor ``num_batches`` is given (pycls' and
mmcls' default; Wu & Johnson 2021 find 10³–10⁴ samples enough)."""

_MODES = ("norm", "train")


def _check_count(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(
            f"{name} must be a positive integer or None"
            + (" or 'all'" if name == "num_samples" else "")
            + f", got {value!r}"
        )
    return value


def _progress_bar(enabled: bool, total: int | None, unit: str) -> Any:
    if not enabled:
        return None
    from ._optional import require

    tqdm = require("tqdm", "progress", "progress=True")
    return tqdm.tqdm(total=total, unit=unit, desc="precisebn", dynamic_ncols=True)


def estimate(
    model: nn.Module,
    data: Iterable[Any],
    *,
    num_samples: int | Literal["all"] | None = None,
    num_batches: int | None = None,
    forward: Forward | None = None,
    mode: Literal["norm", "train"] = "norm",
    layers: LayerSelection = None,
    device: torch.device | str | None = None,
    progress: bool = False,
    distributed: Literal["auto"] | bool = "auto",
    process_group: Any = None,
    _capture: Capture | None = None,
    _mode: Mode | None = None,
) -> PopulationStats:
    """Measures the population statistics of the model's normalization layers.

    Runs forward passes under ``torch.no_grad()`` and returns every selected layer's
    exact population mean and variance; the model is left bitwise as it was (flags,
    buffers, momentum, hooks), also when anything raises.

    Args:
        model: The model. A ``DistributedDataParallel``/``DataParallel`` wrapper is
            looked through (forwards run on the wrapped module).
        data: Any iterable of batches (DataLoader, generator, list).
        num_samples: Stop once this many samples (first dimension of the batch's
            input) have been used; the last batch is used whole. Global when
            distributed: each of W ranks uses ``ceil(num_samples / W)``. ``"all"``
            uses the whole data. Default: when neither limit is given, up to 8192
            samples (shorter data is then used whole without a warning).
        num_batches: Stop after this many batches (per rank). With both limits the
            first one reached stops.
        forward: ``forward(model, batch)`` runs one batch. Default: a tensor goes in
            as is, a tuple/list gives its first element, a mapping becomes keyword
            arguments.
        mode: ``"norm"``: only the selected normalization layers run in training
            mode, everything else in eval mode (dropout off, as at test time).
            ``"train"``: every module in training mode (as fvcore and
            ``torch.optim.swa_utils.update_bn`` do), except unselected normalization
            layers.
        layers: Which layers: ``None`` (all with running statistics), qualified names,
            a type or tuple of types, or a predicate ``(name, module) -> bool``.
        device: Where batches go; default the model's device. Tensors in nested
            tuples/lists/dicts are moved with ``non_blocking=True``.
        progress: Show a progress bar (needs ``pip install 'precisebn[progress]'``).
        distributed: ``"auto"`` merges the statistics of all ranks when a process
            group of more than one rank is initialised; ``False`` keeps ranks apart.
        process_group: The group to merge over (default: the default group).

    Returns:
        The statistics, keyed by qualified layer name (relative to the unwrapped model).

    Raises:
        EmptyDataError: The data yielded no batch.
        NonFiniteError: A layer's statistics are NaN or infinite (names the layer).
        DistributedError: Another rank failed, or ranks disagree (names the rank).
        LayerNotFoundError: The selection matches nothing or names unknown layers.

    Example:
        >>> import torch
        >>> import precisebn
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
        >>> data = [torch.randn(16, 3) for _ in range(4)]
        >>> stats = precisebn.estimate(model, data)
        >>> stats["1"].count, stats.samples
        (64, 64)
        >>> bool(model[1].running_var.eq(1).all())  # the model is untouched
        True
    """
    use_all = num_samples == "all"
    num_samples = None if use_all else _check_count("num_samples", num_samples)
    num_batches = _check_count("num_batches", num_batches)
    if _mode is None:
        if mode not in _MODES:
            raise InvalidArgumentError(f"mode must be 'norm' or 'train', got {mode!r}")
        _mode = mode
    if forward is not None and not callable(forward):
        raise InvalidArgumentError(f"forward must be a callable forward(model, batch), got {forward!r}")
    if not isinstance(model, nn.Module):
        raise InvalidArgumentError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(data, (torch.Tensor, str, bytes)) or not isinstance(data, Iterable):
        raise InvalidArgumentError(
            f"data must be an iterable of batches (a DataLoader, a list, a generator), got {type(data).__name__}"
            + ("; wrap a single tensor batch in a list: [batch]" if isinstance(data, torch.Tensor) else "")
        )
    explicit = num_samples is not None or num_batches is not None
    if not explicit and not use_all:
        num_samples = DEFAULT_NUM_SAMPLES
    ctx = _dist.RankContext.resolve(distributed, process_group)
    if ctx is not None and num_samples is not None:
        num_samples = math.ceil(num_samples / ctx.world_size)
    model = unwrap(model)
    target = torch.device(device) if device is not None else model_device(model)
    run = _Run(model, data, forward or default_forward, num_samples, num_batches, target, progress, _mode, explicit)
    try:
        selected = find_norm_layers(model, layers, capture=_capture)
        local = run.measure(selected, abort=ctx.poll if ctx is not None else None)
    except BaseException as exc:
        if ctx is None:
            raise
        ctx.fail(exc)  # always raises, on every rank
        raise
    if ctx is not None:
        local = ctx.merge(local)
    return local.to_population()


class _Run:
    """One estimation pass over the data on this process."""

    def __init__(
        self,
        model: nn.Module,
        data: Iterable[Any],
        forward: Forward,
        num_samples: int | None,
        num_batches: int | None,
        device: torch.device | None,
        progress: bool,
        mode: Mode,
        warn_short: bool = True,
    ) -> None:
        self.model, self.data, self.forward = model, data, forward
        self.num_samples, self.num_batches = num_samples, num_batches
        self.device, self.progress, self.mode = device, progress, mode
        self.warn_short = warn_short

    def measure(self, selected: list[NormLayer], abort: Any = None) -> Measurement:
        start = time.perf_counter()
        with torch.no_grad(), recalibration_state(self.model, selected, self.mode) as state:
            collector = Collector(state)
            samples, batches = self._loop(collector, abort)
            moments = collector.finish()
        result = Measurement(selected, moments, list(collector.calls), samples, batches, self.mode)
        result.check()
        result.seconds = time.perf_counter() - start
        logger.info(
            "precisebn: measured %d layers on %d samples in %d batches (%.2f s)",
            len(selected),
            samples,
            batches,
            result.seconds,
        )
        return result

    def _loop(self, collector: Collector, abort: Any) -> tuple[int, int]:
        limit, unit = (self.num_samples, "sample") if self.num_batches is None else (self.num_batches, "batch")
        bar = _progress_bar(self.progress, limit, unit)
        samples = batches = 0
        limited = False
        try:
            for batch in self.data:
                size = batch_size(batch)
                if size is None and self.num_samples is not None:
                    raise InvalidArgumentError(
                        f"cannot tell how many samples a batch of type {type(batch).__name__} holds; "
                        "pass num_batches= instead of num_samples=."
                    )
                self.forward(self.model, to_device(batch, self.device))
                collector.end_batch()
                batches += 1
                samples += size or 0
                if bar is not None:
                    bar.update(size if unit == "sample" else 1)
                if abort is not None:
                    abort()
                if (self.num_batches is not None and batches >= self.num_batches) or (
                    self.num_samples is not None and samples >= self.num_samples
                ):
                    limited = True
                    break
        finally:
            if bar is not None:
                bar.close()
        if batches == 0:
            raise EmptyDataError(
                "the data yielded no batch, so there is nothing to measure; pass a non-empty "
                "iterable of batches (the model was left unchanged)."
            )
        if self.warn_short and not limited and (self.num_samples, self.num_batches) != (None, None):
            asked = " / ".join(
                f"{k}={v}" for k, v in (("num_samples", self.num_samples), ("num_batches", self.num_batches)) if v
            )
            warnings.warn(
                f"the data ran out after {samples} samples in {batches} batches, fewer than {asked}; "
                "the statistics use all of them.",
                ShortDataWarning,
                stacklevel=4,
            )
        return samples, batches


@dataclass
class Measurement:
    """Per-layer moments of one rank's passes (or of all ranks, once merged)."""

    layers: list[NormLayer]
    moments: list[RunningMoments]
    calls: list[int]
    samples: int
    batches: int
    mode: str
    seconds: float = 0.0
    world_size: int = 1
    _counts: list[int] | None = None

    def check(self) -> list[int]:
        """Reads counts and finiteness (one host read per device); raises on NaN/Inf.

        Returns:
            The number of values per channel of each layer.
        """
        summary = [
            torch.stack([m.count[:1].sum(), (m.mean.isfinite() & m.m2.isfinite()).all().double()]) for m in self.moments
        ]
        by_device: dict[torch.device, list[int]] = {}
        for i, row in enumerate(summary):
            by_device.setdefault(row.device, []).append(i)
        host: list[list[float]] = [[0.0, 1.0]] * len(summary)
        for ids in by_device.values():
            for i, row in zip(ids, torch.stack([summary[i] for i in ids]).tolist()):
                host[i] = row
        bad = [i for i, (count, finite) in enumerate(host) if count > 0 and not finite]
        if bad:
            raise NonFiniteError(_non_finite_message([self.layers[i] for i in bad], [self.moments[i] for i in bad]))
        self._counts = [int(count) for count, _ in host]
        return self._counts

    def to_population(self) -> PopulationStats:
        counts = self._counts if self._counts is not None else self.check()
        layers = {}
        for layer, m, count, calls in zip(self.layers, self.moments, counts, self.calls):
            if count > 0:
                mean, var = m.mean, m.var
            else:
                mean, var = torch.full_like(m.mean, float("nan")), torch.full_like(m.mean, float("nan"))
            layers[layer.name] = LayerStats(mean, var, count, calls, layer.type_name)
        return PopulationStats(layers, self.samples, self.batches, self.mode, self.seconds, self.world_size)


def _non_finite_message(bad: list[NormLayer], moments: list[RunningMoments]) -> str:
    parts = []
    for layer, m in zip(bad[:5], moments[:5]):
        channels = (~(m.mean.isfinite() & m.m2.isfinite())).nonzero().flatten().tolist()
        where = f"{len(channels)} of {layer.channels} channels, first channel {channels[0]}"
        parts.append(f"{layer.name!r} ({layer.type_name}, {where})")
    more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
    return (
        f"non-finite statistics (NaN or Inf) in layer {', '.join(parts)}{more}: the inputs of these layers "
        "contain NaN/Inf values. Check the data and the model's weights (a diverged checkpoint?). "
        "The model was left unchanged."
    )


def apply(model: nn.Module, stats: PopulationStats) -> Report:
    """Writes population statistics into the model's running buffers.

    ``running_mean`` gets the mean, ``running_var`` the population variance, both cast
    to the buffer's dtype and written in place (references held elsewhere — DDP,
    optimizers, averaged models — stay valid). ``momentum`` and
    ``num_batches_tracked`` are not changed. Layers the statistics never reached
    (count 0) keep their statistics. Everything is checked before anything is written.

    Raises:
        StatsMismatchError: A layer is missing from the model, is not a normalization
            layer with running statistics, or has another number of channels.

    Example:
        >>> import torch, precisebn
        >>> model = torch.nn.Sequential(torch.nn.BatchNorm1d(2))
        >>> stats = precisebn.estimate(model, [torch.tensor([[1.0, 2.0], [3.0, 6.0]])])
        >>> report = precisebn.apply(model, stats)
        >>> model[0].running_mean.tolist(), model[0].running_var.tolist()
        ([2.0, 4.0], [1.0, 4.0])
    """
    model = unwrap(model)
    modules = dict(model.named_modules(remove_duplicate=False))
    problems = []
    for name, s in stats.items():
        m = modules.get(name)
        if m is None:
            problems.append(f"{name!r} is not in the model")
        elif not has_running_stats(m):
            problems.append(f"{name!r} ({type(m).__name__}) has no running statistics")
        elif m.running_mean.shape[0] != s.channels:
            problems.append(f"{name!r} has {m.running_mean.shape[0]} channels, the statistics {s.channels}")
    if problems:
        raise StatsMismatchError(
            "the statistics do not fit this model: "
            + "; ".join(problems[:5])
            + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
            + ". Apply statistics to the model (architecture) they were estimated on. Nothing was written."
        )
    entries = [(name, modules[name], s) for name, s in stats.items()]
    old = [(m.running_mean.detach().clone(), m.running_var.detach().clone()) for _, m, _ in entries]
    try:
        with torch.no_grad():
            for _, m, s in entries:
                if s.reached:
                    m.running_mean.copy_(s.mean.to(m.running_mean.device, m.running_mean.dtype))
                    m.running_var.copy_(s.var.to(m.running_var.device, m.running_var.dtype))
    except BaseException:
        with torch.no_grad():
            for (_, m, _), (mean, var) in zip(entries, old):
                m.running_mean.copy_(mean)
                m.running_var.copy_(var)
        raise
    rows = [
        LayerReport(
            name,
            s.layer_type,
            s.channels,
            s.count,
            s.calls,
            _cpu64(mean),
            _cpu64(var),
            _cpu64(m.running_mean),
            _cpu64(m.running_var),
            float(m.eps),
            s.reached,
        )
        for (name, m, s), (mean, var) in zip(entries, old)
    ]
    for name in (r.name for r in rows if not r.updated):
        logger.warning("precisebn: layer %r was not reached by any forward pass; its statistics were kept", name)
    return Report(rows, stats.samples, stats.batches, stats.seconds, stats.mode, stats.world_size)


def recalibrate(
    model: nn.Module,
    data: Iterable[Any],
    *,
    num_samples: int | Literal["all"] | None = None,
    num_batches: int | None = None,
    forward: Forward | None = None,
    mode: Literal["norm", "train"] = "norm",
    layers: LayerSelection = None,
    device: torch.device | str | None = None,
    progress: bool = False,
    distributed: Literal["auto"] | bool = "auto",
    process_group: Any = None,
) -> Report:
    """Recomputes the running statistics of the model's normalization layers exactly.

    ``recalibrate(model, data, **options)`` is ``apply(model, estimate(model, data,
    **options))``: forward passes under ``torch.no_grad()``, then each selected layer's
    ``running_mean``/``running_var`` becomes the exact population mean/variance of its
    inputs (see :func:`estimate` for the options). If anything fails — the data, the
    model, ``KeyboardInterrupt``, non-finite statistics, another rank — the model is
    left bitwise as it was.

    Returns:
        A :class:`Report` of old and new statistics per layer.

    Example:
        >>> import torch, precisebn
        >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU())
        >>> data = [torch.randn(4, 3, 16, 16) for _ in range(8)]
        >>> report = precisebn.recalibrate(model, data)
        >>> report.samples, report["1"].count  # 8 batches of 4 images, 14x14 positions each
        (32, 6272)
    """
    stats = estimate(
        model,
        data,
        num_samples=num_samples,
        num_batches=num_batches,
        forward=forward,
        mode=mode,
        layers=layers,
        device=device,
        progress=progress,
        distributed=distributed,
        process_group=process_group,
    )
    return apply(model, stats)
