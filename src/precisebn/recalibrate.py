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

import contextlib
import itertools
import logging
import math
import numbers
import operator
import sys
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

import torch
from torch import nn

from . import distributed as _dist
from .adapt import WRITTEN, Adapt, check_adapt
from .data import Forward, default_forward, model_device
from .errors import InvalidArgumentError, PreciseBNWarning, UninitializedLayerError, caller_stacklevel
from .interrupts import signals_held, signals_let_through
from .layers import (
    Capture,
    LayerSelection,
    Mode,
    find_norm_layers,
    has_running_stats,
    refuse_shared_buffers,
    unwrap,
)
from .loaders import independent
from .measure import AUTO_MAX_SAMPLES, AUTO_MIN_BATCHES, AUTO_MIN_SAMPLES, Pass
from .population import PopulationStats
from .report import Report
from .state import exclusive
from .writing import Writes, plan_writes

__all__ = ["DEFAULT_NUM_SAMPLES", "DEFAULT_TOLERANCE", "apply", "check_options", "estimate", "recalibrate"]

logger = logging.getLogger("precisebn")


DEFAULT_TOLERANCE = 0.02
"""``num_samples="auto"`` stops once, in every layer, the median channel's standard error is
at most this: 2 % of the variance and 0.02 standard deviations of the mean (see the
README's "How precise?" section for why)."""

DEFAULT_NUM_SAMPLES = 8192
"""Samples used when neither ``num_samples`` nor ``num_batches`` is given (pycls' and
mmcls' default; Wu & Johnson 2021 find 10³–10⁴ samples enough)."""

_MODES = ("norm", "train")
_CAPTURES = ("auto", "float64")


def check_options(
    *,
    num_samples: Any = None,
    num_batches: Any = None,
    forward: Any = None,
    mode: Any = "norm",
    capture: Any = "auto",
    prior: Any = None,
    adapt: Any = "both",
    tolerance: Any = None,
) -> None:
    """Raises :class:`~precisebn.errors.InvalidArgumentError` for an option that
    :func:`estimate` or :func:`recalibrate` would refuse (for callers that take options
    long before using them)."""
    check_adapt(prior, adapt)
    for name, value in (("num_samples", num_samples), ("num_batches", num_batches)):
        if value is None or (name == "num_samples" and isinstance(value, str) and value in ("all", "auto")):
            continue
        if _as_count(value) is None:
            raise InvalidArgumentError(
                f"{name} must be a positive integer or None"
                + (", 'all' or 'auto'" if name == "num_samples" else "")
                + f", got {value!r}"
            )
    if forward is not None and not callable(forward):
        raise InvalidArgumentError(f"forward must be a callable forward(model, batch), got {forward!r}")
    if mode not in _MODES:
        raise InvalidArgumentError(f"mode must be 'norm' or 'train', got {mode!r}")
    if capture not in _CAPTURES:
        raise InvalidArgumentError(f"capture must be 'auto' or 'float64', got {capture!r}")
    if tolerance is not None:
        if isinstance(tolerance, bool) or not isinstance(tolerance, numbers.Real) or not 0 < tolerance < 1:
            raise InvalidArgumentError(f"tolerance must be a number between 0 and 1 (e.g. 0.02), got {tolerance!r}")
        if not (isinstance(num_samples, str) and num_samples == "auto"):
            raise InvalidArgumentError(
                f"tolerance= applies to num_samples='auto' only (got num_samples={num_samples!r}); pass both."
            )


def _as_count(value: Any) -> int | None:
    """A positive integer (numpy integers included, bools not), or None."""
    if isinstance(value, bool):
        return None
    try:
        n = operator.index(value)
    except TypeError:
        return None
    return n if n >= 1 else None


def _not_materialised(model: nn.Module) -> UninitializedLayerError:
    """The model's first tensor, whose device the batches go to, is on the meta device."""
    name = next((n for n, t in itertools.chain(model.named_parameters(), model.named_buffers()) if t.is_meta), "?")
    return UninitializedLayerError(
        f"the model's first tensor, {name!r}, is on the meta device: it holds no values, and the batches would be "
        "moved there (to the model's device). Materialise the model first (e.g. model.to_empty(device='cpu'), "
        "then load its weights), or pass device= to say where the batches go. The model was left unchanged."
    )


def _device(device: Any) -> torch.device | None:
    if device is None:
        return None
    try:
        checked = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise InvalidArgumentError(
            "device must be a torch.device or a device string such as 'cpu', 'cuda' or 'cuda:1', "
            f"got {device!r} ({exc})"
        ) from None
    if checked.type == "meta":
        raise InvalidArgumentError(
            "device='meta' holds no values, so batches moved there cannot be measured; pass device=None (the "
            "model's own device) or a device such as 'cpu' or 'cuda'."
        )
    if checked.type != "cpu":
        try:
            torch.empty(0, device=checked)  # no GPU, no driver, an index past the last device...
        except (RuntimeError, AssertionError, ValueError) as exc:
            raise InvalidArgumentError(
                f"device {device!r} cannot be used on this machine ({str(exc).strip().splitlines()[0]}); pass "
                "device=None to use the model's own device, or one that torch can allocate on here."
            ) from None
    return checked


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
    capture: Capture = "auto",
    tolerance: float | None = None,
    per_call: bool = False,
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
            distributed: each of W ranks uses ``ceil(num_samples / W)``. ``"auto"``
            stops once every layer's statistics are precise to ``tolerance`` (see
            ``tolerance``), between 256 and 65536 samples in all (or ``num_batches``
            batches at most, when given). ``"all"``
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
        capture: ``"auto"``: each layer's own batch figures where they verify (on the
            batch that first calls the layer) against a float64 reduction of what it
            normalises — costing little more than the forward passes — and a float64
            reduction of that tensor on every call where they do not. ``"float64"``:
            the float64 reduction for every layer (exact to float64 rounding, slower).

        tolerance: With ``num_samples="auto"``: stop once, in every layer, the median
            channel's standard error (jackknife over batches) is at most this — as a
            fraction of the variance and in standard deviations of the mean (default
            0.02). Looked at every 8 batches (one host read each time); distributed,
            every rank stops at the same batch.
        per_call: For a layer called k > 1 times per forward (per batch), k sets of
            statistics instead of one pooled over all calls: ``"<layer>.calls.<i>"``
            holds those of call i (in call order), the names the layer's parts get
            from :func:`precisebn.untie_calls` (so that :func:`apply` writes them
            there). Such a layer must be called equally often in every batch that
            calls it. Layers called once per forward are keyed as usual.

    Returns:
        The statistics, keyed by qualified layer name (relative to the unwrapped model).

    Raises:
        EmptyDataError: The data yielded no batch.
        NonFiniteError: A layer's statistics are NaN or infinite (names the layer).
        DistributedError: Another rank failed, or ranks disagree (names the rank).
        LayerNotFoundError: The selection matches nothing or names unknown layers.
        InvalidArgumentError: An option has a wrong value; with ``per_call``, a layer
            was called a different number of times in two batches (names the layer
            and the counts).

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

        One layer called twice per forward, with per-call statistics:

        >>> bn = torch.nn.BatchNorm1d(1)
        >>> twice = lambda model, batch: [model(x) for x in batch]
        >>> batch = (torch.tensor([[0.0], [2.0]]), torch.tensor([[10.0], [14.0]]))
        >>> stats = precisebn.estimate(bn, [batch], forward=twice, per_call=True)
        >>> {name: (s.mean.item(), s.var.item()) for name, s in stats.items()}
        {'calls.0': (1.0, 1.0), 'calls.1': (12.0, 4.0)}
    """
    with contextlib.ExitStack() as guard:
        guard.enter_context(signals_held())  # (the model's restore runs to its end: see interrupts)
        return _estimate(
            guard,
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
            capture=capture,
            tolerance=tolerance,
            per_call=per_call,
            _mode=_mode,
        )[0]


def _estimate(
    guard: contextlib.ExitStack,
    model: Any,
    data: Any,
    *,
    num_samples: Any,
    num_batches: Any,
    forward: Any,
    mode: Any,
    layers: LayerSelection,
    device: Any,
    progress: bool,
    distributed: Any,
    process_group: Any,
    capture: Any,
    tolerance: Any,
    _mode: Mode | None,
    per_call: Any = False,
    walk: list[tuple[str, nn.Module]] | None = None,
    writes: tuple[str, ...] = (),
    check: Callable[[], None] | None = None,
    plan: Callable[[PopulationStats], Writes] | None = None,
    move: bool = True,
    warn_short: bool = True,
) -> tuple[PopulationStats, Writes | None]:
    """:func:`estimate`, holding the model in ``guard`` (so that :func:`recalibrate` can
    keep it until its statistics are written), and ``torch.inference_mode(False)`` with it:
    called inside ``torch.inference_mode()``, the passes' own tensors would be inference
    tensors, which keep no version counter (the passes run under ``torch.no_grad()`` anyway).
    Every check runs on every rank inside the distributed failure protocol, so a mistake on
    one rank reaches all of them.
    ``walk``, if given, receives the unwrapped model's ``named_modules()`` (for
    :func:`~precisebn.writing.plan_writes`: the model is walked once per call). ``writes``: the buffers that the
    caller will write (``running_mean``, ``running_var``), refused before any pass if they
    share memory across the selected layers (see :func:`~precisebn.writing.plan_writes`).
    ``check``: the caller's own checks of its arguments, run first. ``plan``: what the caller
    will write, checked (:func:`~precisebn.writing.plan_writes`), returned with the statistics;
    with several ranks every rank then learns whether every other got that far, so that either
    all write or none does."""
    inferring = torch.is_inference_mode_enabled()  # (the caller's: forward runs in it, see Pass)
    guard.enter_context(torch.inference_mode(False))
    try:
        ctx, mistake = _dist.RankContext.resolve(distributed, process_group), None
    except InvalidArgumentError as exc:  # a wrong `distributed`: still reported to the other ranks, if any
        ctx, mistake = _dist.RankContext.resolve("auto", process_group), exc
    try:
        if mistake is not None:
            raise mistake
        if check is not None:
            check()
        check_options(
            num_samples=num_samples,
            num_batches=num_batches,
            forward=forward,
            mode=mode,
            capture=capture,
            tolerance=tolerance,
        )
        if not isinstance(per_call, bool):
            raise InvalidArgumentError(f"per_call must be True or False, got {per_call!r}")
        use_all = isinstance(num_samples, str) and num_samples == "all"
        auto = isinstance(num_samples, str) and num_samples == "auto"
        if auto:
            tolerance = DEFAULT_TOLERANCE if tolerance is None else float(tolerance)
            num_samples = None if num_batches is not None else AUTO_MAX_SAMPLES
        num_samples = None if use_all or num_samples is None else operator.index(num_samples)
        num_batches = None if num_batches is None else operator.index(num_batches)
        if not isinstance(model, nn.Module):
            raise InvalidArgumentError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if isinstance(data, (torch.Tensor, str, bytes, Mapping)) or not isinstance(data, Iterable):
            raise InvalidArgumentError(
                f"data must be an iterable of batches (a DataLoader, a list, a generator), got {type(data).__name__}"
                + ("; wrap a single tensor batch in a list: [batch]" if isinstance(data, torch.Tensor) else "")
                + (  # (probe 43c: iterated, a dict gave its keys, and the error spoke of batches of type str)
                    ", whose iteration gives its keys; wrap a single dict batch in a list: [batch]"
                    if isinstance(data, Mapping)
                    else ""
                )
            )
        explicit = num_samples is not None or num_batches is not None
        if not explicit and not use_all:
            num_samples = DEFAULT_NUM_SAMPLES
        vote = None
        if ctx is not None and auto:
            vote = ctx.vote(tolerance, AUTO_MIN_SAMPLES, num_samples or sys.maxsize, AUTO_MIN_BATCHES)  # type: ignore[arg-type]
        shared = "auto" if auto else "all" if num_samples is None else num_samples  # (as every rank must pass it)
        if ctx is not None and num_samples is not None:
            num_samples = math.ceil(num_samples / ctx.world_size)
        given, model = model, unwrap(model)
        target = _device(device) or model_device(model)
        if not move:  # (the drop-ins: batches reach the forward as the very objects the data gave)
            target = None
        if device is None and target is not None and target.type == "meta":
            raise _not_materialised(model)
        run = Pass(
            model,
            independent(data),  # (a twin of a loader whose iterators share state: training's reading stays whole)
            forward or default_forward,
            num_samples,
            num_batches,
            target,
            progress,
            _mode or mode,
            warn_short and explicit and not auto,  # (warn_short=False: a caller that says so itself, the drop-ins)
            tolerance if auto else None,
            vote,
            per_call,
            samples_given=explicit or use_all,
            inferring=inferring,
        )
        modules = list(model.named_modules())  # one walk of the model for the whole call
        if walk is not None:
            walk[:] = modules
        guard.enter_context(exclusive(model, modules))
        selected = find_norm_layers(model, layers, capture=capture, modules=modules, root=given)
        if writes:  # (statistics held otherwise than as buffers: refused by the passes, see recalibration_state)
            refuse_shared_buffers(
                [
                    (layer.name, b, t)
                    for layer in selected
                    for b in writes
                    if isinstance(t := layer.module._buffers.get(b), torch.Tensor)
                ]
            )
        abort = ctx.poll if ctx is not None else None
        local = run.measure(selected, abort=abort, modules=modules, keep_folds=ctx is not None)
    except BaseException as exc:
        if ctx is None:
            raise
        ctx.fail(exc)  # always raises, on every rank
        raise
    else:
        if ctx is not None:  # (num_samples: this rank's share of the global number, alike on every rank)
            options = f"per_call={per_call!r}, {'writes' if plan is not None else 'no writes'}, num_samples={shared}"
            merging = False
            try:  # (Ctrl-C reaches the merge as it reaches the passes: see merge, and interrupts)
                with signals_let_through():  # (a Ctrl-C held since the passes is raised here, before the merge)
                    merging = True
                    local = ctx.merge(local, options)  # (paths and per_forward over the ranks, as the statistics)
            except KeyboardInterrupt as exc:  # (held until the merge's collectives were done: see merge)
                if plan is not None or not merging:  # the others go on to agree(), or wait in the merge: they
                    ctx.fail(exc)  # learn of it there (the review of probe 40: estimate's others waited)
                raise
            local.check()  # the same verdict on every rank: they all hold the same values
        try:
            stats = local.to_population()  # (its warning may be an error on one rank: warnings filters are per rank)
            _warn_none_reached(stats)
        except BaseException as exc:
            if ctx is not None and plan is not None:  # the others wait in agree(): they learn of it there
                ctx.fail(exc)
            raise
        if plan is None:
            return stats, None
        if ctx is None:
            return stats, plan(stats)
        try:
            planned = plan(stats)  # e.g. a prior pooled with this rank's own statistics: may fail here only
            planned.announce()  # (its logging too: a handler raising on one rank is that rank's failure)
        except BaseException as exc:
            ctx.fail(exc)
            raise
        # Ctrl-C held from the last exchange to the end of the writes (guard closes after them), then raised: once
        # every rank has agreed, each writes — one interrupted in between would leave the others writing alone
        guard.enter_context(_dist.interrupts_held())
        ctx.agree(planned.digest())  # raises on every rank if any failed to plan its writes, or would write otherwise
        return stats, planned
    finally:
        if ctx is not None:
            ctx.release()  # no reference to the group outlives the call (see RankContext.release)


def _warn_none_reached(stats: PopulationStats) -> None:
    """Warns when the passes reached none of the selected layers (probe 43c: a ``forward=`` that never called the model
    returned a report of every layer "not reached (kept)", and a log line at INFO)."""
    if not stats.layers or any(s.count > 0 for s in stats.layers.values()):
        return
    why = (
        "they were called, but with empty inputs only, or never normalised with their running buffers"
        if any(s.calls for s in stats.layers.values())
        else "no forward pass called them: check that forward= calls the model on each batch, and that they run in "
        "the mode of the passes (mode='norm' runs the rest of the model in eval mode: a branch that runs only in "
        "training, an auxiliary head, needs mode='train')"
    )
    warnings.warn(
        f"precisebn: none of the {len(stats.layers)} selected normalization layers was reached in {stats.batches} "
        f"batches, so their statistics are kept as they were; {why}.",
        PreciseBNWarning,
        stacklevel=caller_stacklevel(),
    )


def apply(model: nn.Module, stats: PopulationStats, *, prior: float | None = None, adapt: Adapt = "both") -> Report:
    """Writes population statistics into the model's running buffers.

    ``running_mean`` gets the mean, ``running_var`` the population variance, both cast
    to the buffer's dtype and written in place (references held elsewhere — DDP,
    optimizers, averaged models — stay valid). ``momentum`` and
    ``num_batches_tracked`` are not changed. Layers the statistics never reached
    (count 0) keep their statistics. Everything is checked before anything is written.

    With ``prior=N`` the layer's current running statistics count as ``N`` samples of
    pseudo-data: each layer gets the exact pooled mean and population variance of those
    and the measured values (Schneider et al. 2020; see :mod:`precisebn.adapt`). ``N``
    counts samples, converted to values per channel at the layer's values per sample
    (``count / stats.samples``). ``adapt="mean"``/``"var"`` writes only that buffer and
    leaves the other bitwise as it was.

    The whole call is all-or-nothing: every layer is checked and the report is built
    before the first write, and an interruption during the writes (even
    ``KeyboardInterrupt``) puts the old values back.

    Args:
        model: The model (a DDP/DataParallel wrapper is looked through).
        stats: What :func:`estimate` returned, or :meth:`PopulationStats.load` read.
        prior: ``None`` (default) or ``0``: the measured statistics as they are. A
            number ``N > 0``: pooled with the current running statistics weighted as
            ``N`` samples.
        adapt: ``"both"`` (default), ``"mean"`` or ``"var"``: which buffers to write.

    Raises:
        StatsMismatchError: A layer is missing from the model, is not a normalization
            layer with running statistics, or its mean/variance is not of shape
            ``(channels,)``, not finite (also after the cast to the buffer's dtype) or
            negative, or a positive variance that the buffer's dtype would hold as 0 or
            more than 1 % off (below its smallest normal: float16's 6.1e-5); with
            ``prior``, a layer's current statistics are not finite.
        InvalidArgumentError: ``prior`` or ``adapt`` has a wrong value.
        ConcurrentUseError: Another call is recalibrating the model.

    Example:
        >>> import torch, precisebn
        >>> model = torch.nn.Sequential(torch.nn.BatchNorm1d(2))
        >>> stats = precisebn.estimate(model, [torch.tensor([[1.0, 2.0], [3.0, 6.0]])])
        >>> report = precisebn.apply(model, stats)
        >>> model[0].running_mean.tolist(), model[0].running_var.tolist()
        ([2.0, 4.0], [1.0, 4.0])
    """
    if not isinstance(stats, PopulationStats):
        raise InvalidArgumentError(
            f"stats must be a precisebn.PopulationStats (from estimate() or PopulationStats.load()), got "
            f"{type(stats).__name__}"
        )
    if not isinstance(model, nn.Module):
        raise InvalidArgumentError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    checked_prior = check_adapt(prior, adapt)
    model = unwrap(model)
    with signals_held() as held, exclusive(model), torch.inference_mode(False):
        writes = plan_writes(model, stats, checked_prior, adapt)
        others = [name for name, m in model.named_modules() if has_running_stats(m) and name not in stats]
        if others:  # (statistics of another model, or of some layers: said, as the report lists only those written;
            # before the writes, as Writes.commit logs: a logging handler that raises leaves nothing written)
            shown = ", ".join(map(repr, others[:5])) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
            logger.warning(
                "precisebn: %d of the model's normalization layers have no statistics in those applied and keep "
                "theirs: %s",
                len(others),
                shown,
            )
        report = writes.commit()
        held.done = "apply() had completed before this signal: the model holds the new statistics"
        return report


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
    capture: Capture = "auto",
    tolerance: float | None = None,
    prior: float | None = None,
    adapt: Adapt = "both",
) -> Report:
    """Recomputes the running statistics of the model's normalization layers exactly.

    ``recalibrate(model, data, prior=..., adapt=..., **options)`` is ``apply(model,
    estimate(model, data, **options), prior=..., adapt=...)``: forward passes under
    ``torch.no_grad()``, then each selected layer's ``running_mean``/``running_var``
    becomes the exact population mean/variance of its inputs (see :func:`estimate` for
    the options, :func:`apply` for ``prior`` and ``adapt``: the layers' current
    statistics as ``prior`` samples of pseudo-data, pooled exactly; which buffers to
    write). If anything fails — the data, the model, ``KeyboardInterrupt``, non-finite
    statistics, another rank — the model is left bitwise as it was.

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
    walk: list[tuple[str, nn.Module]] = []

    def check() -> None:  # before any forward pass, inside the failure protocol: a mistake on one rank reaches all
        check_adapt(prior, adapt)

    def plan(stats: PopulationStats) -> Writes:
        return plan_writes(unwrap(model), stats, check_adapt(prior, adapt), adapt, walk, shared_checked=True)

    with contextlib.ExitStack() as guard:
        held = guard.enter_context(signals_held())  # (the model's restore runs to its end: see interrupts)
        _, writes = _estimate(
            guard,
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
            capture=capture,
            tolerance=tolerance,
            _mode=None,
            walk=walk,
            # (a wrong adapt is refused by check(), on every rank: an unhashable one too, probe 40's hang)
            writes=WRITTEN.get(adapt, ()) if isinstance(adapt, str) else (),
            check=check,
            plan=plan,
        )
        assert writes is not None  # (plan was given)
        report = writes.commit()
        held.done = "recalibrate() had completed before this signal: the model holds the new statistics"
        return report
