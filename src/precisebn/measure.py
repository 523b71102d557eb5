"""One statistics pass over the data on this process, and what it measured."""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from .calls import call_name
from .capture import Collector
from .data import Forward, batch_size, to_device
from .errors import (
    EmptyDataError,
    InvalidArgumentError,
    NonFiniteError,
    PreciseBNWarning,
    ShortDataWarning,
    caller_stacklevel,
)
from .interrupts import signals_let_through
from .layers import Mode, NormLayer, RecalibrationState, recalibration_state
from .population import LayerStats, PopulationStats, _per_forward
from .stats import RunningMoments, fold_errors
from .watch import TOLERANCE

__all__ = ["AUTO_CHECK_EVERY", "AUTO_MAX_SAMPLES", "AUTO_MIN_BATCHES", "AUTO_MIN_SAMPLES", "Measurement", "Pass"]

AUTO_MIN_SAMPLES = 256
"""``num_samples="auto"`` never stops before this many samples (in all)..."""
AUTO_MIN_BATCHES = 8
"""... nor before this many batches (on each rank): the standard errors need several folds."""
AUTO_CHECK_EVERY = 8
"""It looks at the standard errors after every this many batches (one host read each time)."""
AUTO_MAX_SAMPLES = 65536
"""... and stops at this many samples (in all) whatever they say, unless ``num_batches`` is given."""

Vote = Callable[[float, int, bool, int], bool]
"""``vote(precision, samples, has_data, filled) -> stop``: the ranks' common decision in a
distributed ``num_samples="auto"`` (one small collective per call); ``filled``: the rank's
batches that held values."""

logger = logging.getLogger("precisebn")

_KEYS = ("count", "mean", "m2")


def _progress_bar(enabled: bool, total: int | None, unit: str) -> Any:
    if not enabled:
        return None
    from ._optional import require

    tqdm = require("tqdm", "progress", "progress=True")
    return tqdm.tqdm(total=total, unit=unit, desc="precisebn", dynamic_ncols=True)


class Pass:
    """Forward passes over the data with every selected layer measured (this process only)."""

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
        tolerance: float | None = None,
        vote: Vote | None = None,
        per_call: bool = False,
        samples_given: bool = True,
        inferring: bool = False,
    ) -> None:
        self.model, self.data, self.forward = model, data, forward
        # the caller's inference mode, which the call leaves (its own tensors need version counters): forward runs in
        # it, as the model runs there (probe 49: a forward writing in place an inference tensor — a counter buffer of
        # a model built in that mode, its input made there — raised torch's "Inplace update to inference tensor
        # outside InferenceMode"); the layers' bookkeeping leaves it again (see layers._Routed)
        self.inferring = inferring
        self.num_samples, self.num_batches = num_samples, num_batches
        self.device, self.progress, self.mode = device, progress, mode
        self.warn_short = warn_short
        self.tolerance = tolerance  # num_samples="auto": stop once the standard errors are this small
        self.vote = vote
        self.per_call = per_call  # one set of statistics per call index for layers called several times per batch
        self.precision = float("nan")  # the last precision looked at (auto)
        self._decided = False  # the ranks voted to stop
        self._filled = 0  # batches that held values (a sample or more, or an unknown number): the votes say it
        self.samples_given = samples_given  # num_samples was the caller's (else the default, named so in errors)

    def measure(
        self,
        selected: list[NormLayer],
        abort: Any = None,
        modules: list[tuple[str, nn.Module]] | None = None,
        keep_folds: bool = False,
    ) -> Measurement:
        """One pass. ``keep_folds``: every layer's moments stay per fold (to be merged across
        processes fold by fold); else layers the collector can pool come pooled, with their
        errors (see :meth:`Collector.finish`)."""
        start = time.perf_counter()
        with torch.no_grad(), recalibration_state(self.model, selected, self.mode, modules, self._collector) as state:
            collector = state.prepared
            try:
                samples, batches = self._loop(collector, abort)
                state.refuse_written_elsewhere()
                parts = collector.finish(pool=not keep_folds, overwrite=True)
            finally:
                collector.over = True  # (a wrapper left in a shallow copy of a layer says so: see LayerCall)
        entries: list[tuple[NormLayer, RunningMoments, int, int, str, int]] = []
        pooled = {}
        for i, (layer, per_call) in enumerate(zip(selected, parts)):
            path = collector.paths[i] if collector.paths[i] != "verify" else "none"  # "verify": never called
            if len(per_call) == 1:
                if i in collector.pooled:
                    pooled[len(entries)] = collector.pooled[i]
                entries.append((layer, per_call[0], collector.calls[i], collector.counts[i], path, collector.most[i]))
                continue
            k = len(per_call)  # per_call: one entry per call index, named as untie_calls names them
            values = collector.call_counts[i] + [0] * (k - len(collector.call_counts[i]))
            for j, m in enumerate(per_call):
                part = NormLayer(call_name(layer.name, j), layer.module, layer.path)
                entries.append((part, m, collector.calls[i] // k, values[j], path, 1))
        layers, moments, calls, counts, paths, most = (list(column) for column in zip(*entries))
        result = Measurement(
            layers, moments, calls, counts, samples, batches, self.mode, paths, per_forward=most, pooled=pooled
        )
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

    def _collector(self, state: RecalibrationState) -> Collector:
        """The pass's collector, made by :func:`recalibration_state` before it sets the training flags."""
        return Collector(state, per_call=self.per_call)

    def _loop(self, collector: Collector, abort: Any) -> tuple[int, int]:
        limit, unit = (self.num_samples, "sample") if self.num_batches is None else (self.num_batches, "batch")
        bar = _progress_bar(self.progress, limit, unit)
        try:
            with signals_let_through():  # (the passes run the user's code: signals reach it at once, see interrupts)
                samples, batches, limited = self._passes(collector, abort, bar)
        finally:
            if bar is not None:
                bar.close()
        if (
            self.warn_short
            and not limited
            and (self.num_samples, self.num_batches) != (None, None)
            and not self.tolerance
        ):
            asked = " / ".join(
                f"{k}={v}" for k, v in (("num_samples", self.num_samples), ("num_batches", self.num_batches)) if v
            )
            warnings.warn(
                f"the data ran out after {samples} samples in {batches} batches, fewer than {asked}; "
                "the statistics use all of them.",
                ShortDataWarning,
                stacklevel=caller_stacklevel(),
            )
        return samples, batches

    def _passes(self, collector: Collector, abort: Any, bar: Any) -> tuple[int, int, bool]:
        unit = "sample" if self.num_batches is None else "batch"
        samples = batches = 0
        limited = False
        for batch in self.data:
            size = batch_size(batch)
            if size is None and self.num_samples is not None:
                given = "num_samples=" if self.samples_given else f"num_samples={self.num_samples} (the default)"
                raise InvalidArgumentError(
                    f"cannot tell how many samples a batch of type {type(batch).__name__} holds, so {given} "
                    "cannot be counted; pass num_batches= (a number of batches) instead. The model was left "
                    "unchanged."
                )
            collector.in_forward = True  # (layers called otherwise are refused: see Collector.in_forward)
            try:
                batch = to_device(batch, self.device)
                # (never torch.inference_mode(False): leaving the mode turns grad mode on, whatever no_grad said)
                with torch.inference_mode() if self.inferring else contextlib.nullcontext():
                    self.forward(self.model, batch)
            finally:
                collector.in_forward = False
            collector.end_batch()
            batches += 1
            samples += size or 0
            self._filled += size != 0
            if bar is not None:
                bar.update(size if unit == "sample" and size is not None else 1)
            if abort is not None:
                abort()
            if (self.num_batches is not None and batches >= self.num_batches) or (
                self.num_samples is not None and samples >= self.num_samples
            ):
                limited = True
                break
            if self._precise_enough(collector, samples, batches):
                limited = True
                break
        if batches == 0:  # (before the votes: the other ranks learn of it at their next one)
            raise EmptyDataError(
                "the data yielded no batch, so there is nothing to measure; pass a non-empty "
                "iterable of batches (the model was left unchanged)."
            )
        if self.vote is not None and not self._decided:  # out of data or at its cap: join the others' votes
            while not self.vote(self._precision(collector), samples, False, self._filled):
                pass
        return samples, batches, limited

    def _precise_enough(self, collector: Collector, samples: int, batches: int) -> bool:
        if self.tolerance is None or batches < AUTO_MIN_BATCHES or batches % AUTO_CHECK_EVERY:
            return False
        if self.vote is not None:
            self._decided = self.vote(self._precision(collector), samples, True, self._filled)
            return self._decided
        return samples >= AUTO_MIN_SAMPLES and self._precision(collector) <= self.tolerance

    def _precision(self, collector: Collector) -> float:
        self.precision = collector.precision()
        return self.precision


@dataclass
class Measurement:
    """Per-layer moments of one rank's passes (or of all ranks, once merged).

    ``moments`` are kept per fold, shape ``(FOLDS, channels)`` (batches dealt round-robin
    into folds; see :func:`precisebn.stats.fold_errors`). ``counts`` (values per channel)
    and ``calls`` are host integers, known without reading the device. With per-call
    statistics a layer called k > 1 times per batch is k entries, ``"<layer>.calls.<i>"``.
    ``per_forward`` is each entry's most calls in one batch (on this rank; empty when
    unknown, and then derived from ``calls`` and ``batches``).
    """

    layers: list[NormLayer]
    moments: list[RunningMoments]
    calls: list[int]
    counts: list[int]
    samples: int
    batches: int
    mode: str
    paths: list[str]  # per layer: "fast", "float64" or "none" (never normalised with its running buffers)
    seconds: float = 0.0
    world_size: int = 1
    per_forward: list[int] = field(default_factory=list)
    # entries whose pooled (moments, population variance, se_mean, se_var) are known (their
    # ``moments`` are those pooled moments as one fold)
    pooled: dict[int, tuple[RunningMoments, Tensor, Tensor, Tensor]] = field(default_factory=dict, repr=False)

    def check(self) -> None:
        """Raises :class:`NonFiniteError` naming the layers whose statistics hold NaN/Inf
        (one host read per device, at the end)."""
        bad = []
        for ids, joined in self._joined:
            # one sum: NaN/Inf anywhere make it non-finite (so may finite values that overflow it, which
            # the check layer by layer then clears); far cheaper than isfinite() over every value
            if not bool(joined.mean.sum().add_(joined.m2.sum()).isfinite()):
                bad += [
                    i
                    for i in ids
                    if self.counts[i] > 0
                    and not bool((self.moments[i].mean.isfinite() & self.moments[i].m2.isfinite()).all())
                ]
        if bad:
            bad.sort()
            raise NonFiniteError(
                _non_finite_message(
                    [self.layers[i] for i in bad], [self.moments[i] for i in bad], [self.paths[i] for i in bad]
                )
            )

    def to_population(self) -> PopulationStats:
        layers = {}
        per_forward = self.per_forward or [_per_forward(calls, self.batches) for calls in self.calls]
        for layer, (mean, var, se_mean, se_var), count, calls, path, most in zip(
            self.layers, self._fold_errors(), self.counts, self.calls, self.paths, per_forward
        ):
            if count <= 0:
                mean, var = torch.full_like(mean, float("nan")), torch.full_like(mean, float("nan"))
            layers[layer.name] = LayerStats(
                mean, var, count, calls, layer.type_name, path if count > 0 else "none", se_mean, se_var, most
            )
        _warn_far_from_zero([(layer, layers[layer.name]) for layer in self.layers])
        _warn_repeated(list(layers.values()))
        return PopulationStats(layers, self.samples, self.batches, self.mode, self.seconds, self.world_size)

    @functools.cached_property
    def _joined(self) -> list[tuple[list[int], RunningMoments]]:
        """Every layer's moments side by side (with the indices of its layers, in order), one
        set per device, number of folds and whether they are pooled already: the checks and
        the folds' errors then take a few kernels in all rather than a few per layer."""
        by_kind: dict[tuple[torch.device, int, bool], list[int]] = {}
        for i, m in enumerate(self.moments):
            by_kind.setdefault((m.mean.device, m.mean.shape[0], i in self.pooled), []).append(i)
        return [
            (ids, RunningMoments(*(torch.cat([getattr(self.moments[i], k) for i in ids], -1) for k in _KEYS)))
            for ids in by_kind.values()
        ]

    def _fold_errors(self) -> list[tuple[Tensor, Tensor, Tensor, Tensor]]:
        """Each layer's pooled mean, population variance and :func:`fold_errors` (views of a few joined
        tensors: the pooled counts and M2 are not split by layer, nothing reads them)."""
        out: list[Any] = [
            None if p is None else (p[0].mean, *p[1:]) for p in map(self.pooled.get, range(len(self.moments)))
        ]
        for ids, joined in self._joined:
            if ids[0] in self.pooled:  # (a kind is pooled throughout or not at all)
                continue
            sizes = [self.moments[i].mean.shape[-1] for i in ids]
            pooled, se_mean, se_var = fold_errors(joined)
            parts = zip(*(t.split(sizes) for t in (pooled.mean, pooled.var, se_mean, se_var)))
            for i, part in zip(ids, parts):
                out[i] = part
        return out


def _warn_far_from_zero(entries: list[tuple[NormLayer, LayerStats]]) -> None:
    """Warns of fast-path layers with a channel so far from 0, in standard deviations (``r = |mean|/σ``, σ² =
    var + eps, of the pooled statistics), that rounding each batch's (or call's) mean to the buffers' dtype —
    by up to ``u·|mean|``, u its unit roundoff — may have moved the pooled variance by more than the tolerance.

    The bound: with means ``μ_b`` rounded by ``δ_b``, the pooled variance moves by ``2·Σ w_b (μ_b − μ)·δ_b +
    Σ w_b (δ_b − δ̄)²``, at most ``u·r·(2·s + u·r)`` of σ² (Cauchy–Schwarz), ``s`` the spread of the means in σ
    — at most ``sqrt(var / σ²)``, the spread of all the values, which holds theirs. An estimate from the
    means' standard error (roundings adding up like a random walk, u·r·(4·se + u·r)) missed batches that
    recur (a calibration set fed 16 times: each batch's rounding the same every time, the folds' spread 0;
    5.4e-5 of the variance unwarned at r = 2,300, probe 25); this bound takes none of it on trust, and is what
    probes measured within a factor 2–3 (1.2e-4 at r = 3e4 over 16 batches; 1.3e-4 for two crops 6 σ apart).
    For float32 buffers it warns from r ≈ 84 on channels that vary (a BatchNorm shared by two towers at r = 50
    is not warned of, probe 22), never for a constant channel (its means cannot spread); no layer of
    efficientnet_b0, mobilenetv3, resnet18, densenet121, regnetx_002 or hrnet_w18_small came within 1/14 of it
    on random or 0..255 inputs (random weights). Fast-path layers' checks covered other channels, or a
    verifying batch nearer 0. For float64 buffers u is taken as ``√n·2⁻⁵³``, n a call's values per channel (on
    average): torch's kernels sum a float64 input in float64, and its figures' means round as a random walk of n
    roundings (probe 33a measured 2.1e-9 σ at r = 1e5 and 262,144 values, 21 times the float64 tolerance) — an
    estimate, not a bound. One look at the end, all layers at once."""
    fast = [
        (layer, s)
        for layer, s in entries
        if s.path == "fast" and s.count > 0 and isinstance(layer.module._buffers.get("running_mean"), Tensor)
    ]
    if not fast:
        return
    per_layer = []  # per layer, spread over its channels in one go: eps, the buffers' unit roundoff, the tolerance
    units: dict[torch.dtype, tuple[float, float]] = {}
    for layer, s in fast:
        dtype = layer.module._buffers["running_mean"].dtype  # type: ignore[union-attr]
        if dtype not in units:
            units[dtype] = (torch.finfo(dtype).eps / 2 if dtype.is_floating_point else 0.0, TOLERANCE.get(dtype, 1e-5))
        unit, limit = units[dtype]
        if dtype == torch.float64:  # torch sums a float64 input in float64: its mean rounds by about √n·u·|mean|
            unit *= math.sqrt(max(1.0, s.count / max(1, s.calls)))  # (probe 33a: 1.8e-9 σ, unwarned, at r = 1e5)
        per_layer.append((float(layer.module.eps), unit, limit))
    sizes = [s.mean.numel() for _, s in fast]
    lengths = torch.tensor(sizes, device="cpu")
    eps: Tensor | float
    unit_: Tensor | float
    limit_: Tensor | float
    if len(set(per_layer)) == 1:  # (the usual case: the same for every layer, as numbers — the same arithmetic)
        eps, unit_, limit_ = per_layer[0]
    else:
        eps, unit_, limit_ = torch.tensor(per_layer, dtype=torch.float64, device="cpu").repeat_interleave(lengths, 0).T
    one_device = len({s.mean.device for _, s in fast}) == 1

    def joined(key: str) -> Tensor:  # (one cat and one copy to the host where all are on one device)
        parts = [getattr(s, key) for _, s in fast]
        if not one_device:
            parts = [t.cpu() for t in parts]
        return torch.cat(parts).to("cpu", torch.float64, copy=True)  # (each (channels,): see LayerStats)

    mean, var = joined("mean"), joined("var")
    sigma2 = var.clamp_min(0.0).add_(eps)
    ratio = mean.abs_().div_(sigma2.sqrt())  # r per channel
    spread = var.clamp_min_(0.0).div_(sigma2).sqrt_()  # the means' spread in σ, at most
    rounding = ratio * unit_  # u·r
    excess = rounding.mul_(spread.mul_(2).add_(rounding)).div_(limit_)  # (the variance moved, in tolerances)
    excess.nan_to_num_(0.0, float("inf"), 0.0)
    if not excess.numel() or not float(excess.amax()) > 1:  # (the usual case: no layer to name, one maximum)
        return
    owner = torch.arange(len(fast), device="cpu").repeat_interleave(lengths)
    largest = torch.zeros(2, len(fast), dtype=torch.float64, device="cpu")  # (both are >= 0: as a maximum per layer)
    largest[0].scatter_reduce_(0, owner, excess, "amax")
    largest[1].scatter_reduce_(0, owner, ratio.nan_to_num_(0.0, 0.0, 0.0), "amax")
    worst = largest.T.tolist()
    over = [(layer.name, r) for (layer, _), (w, r) in zip(fast, worst) if w > 1]
    if over:
        shown = ", ".join(f"{name!r} (|mean|/σ up to {r:.3g})" for name, r in over[:5])
        shown += f" and {len(over) - 5} more" if len(over) > 5 else ""
        warnings.warn(
            f"precisebn: layer(s) {shown} read their own batch figures on channels so far from 0 that the "
            "rounding of each batch's mean to the buffers' dtype may have moved their variances by more than "
            "the tolerance; capture='float64' (an option of precisebn.recalibrate and precisebn.estimate) measures "
            "them exactly.",
            PreciseBNWarning,
            stacklevel=caller_stacklevel(),
        )


REPEATED = (1e-9, 1e-6)
"""Standard errors of the mean (in σ) and of the variance (relative to it) at most this small on every channel
that varies, in every layer reached, are taken as the same values in every fold (see :func:`_warn_repeated`). The
error of a mean over ``n`` independent values is ``1/√n`` σ: 1e-9 would take 1e18 of them. The variance's is
looser: its errors from the fast path's shifted sums, of identical folds, came out at ~5e-9 rather than 0."""


def _warn_repeated(stats: list[LayerStats]) -> None:
    """Warns when every reached layer's standard errors are 0 to rounding on every channel that varies: the
    folds of batches held the same values — one batch fed again and again (probe 44b: ``[batch] * 40`` reported
    ±0 %, and ``num_samples="auto"`` stopped at its minimum), or a small set cycled until every fold held all of it
    (3 batches 16 times). The statistics are those of the values given, but
    the errors then say nothing of the data's. A layer whose input does not depend on the data (a learned
    constant) has errors of 0 rightly: the warning needs every reached layer to agree, so such a layer beside
    others that vary does not set it off. One host read per device, at the end."""
    by_device: dict[torch.device, list[LayerStats]] = {}
    for s in stats:
        if s.count > 0 and s.se_mean is not None and s.se_var is not None:
            by_device.setdefault(s.var.device, []).append(s)
    varying = repeated = False
    for parts in by_device.values():
        var = torch.cat([s.var for s in parts])
        se_mean, se_var = torch.cat([s.se_mean for s in parts]), torch.cat([s.se_var for s in parts])
        kept = (var > 0) & se_mean.isfinite() & se_var.isfinite()  # (NaN: one fold; a constant channel: 0 rightly)
        zero = se_mean.new_zeros(())
        largest_mean, largest_var, count = torch.stack(
            [torch.where(kept, se_mean, zero).amax(), torch.where(kept, se_var, zero).amax(), kept.sum().to(zero)]
        ).tolist()
        if count == 0:
            continue
        varying = True
        if largest_mean > REPEATED[0] or largest_var > REPEATED[1]:
            return
        repeated = True
    if varying and repeated:
        warnings.warn(
            "precisebn: every layer's standard errors are 0 (to rounding): every fold of batches gave the layers "
            "the same values (one batch fed again and again, or a small set cycled until each fold held all of it?). "
            "The statistics are exact for those values, but "
            "their errors (and num_samples='auto', which stops at its minimum on them) say nothing of how far they "
            "are from the statistics of your data: feed distinct batches.",
            PreciseBNWarning,
            stacklevel=caller_stacklevel(),
        )


def _non_finite_message(bad: list[NormLayer], moments: list[RunningMoments], paths: list[str]) -> str:
    parts = []
    for layer, m in zip(bad[:5], moments[:5]):
        channels = (
            (~(m.mean.isfinite() & m.m2.isfinite())).reshape(-1, layer.channels).any(0).nonzero().flatten().tolist()
        )
        where = f"{len(channels)} of {layer.channels} channels, first channel {channels[0]}"
        parts.append(f"{layer.name!r} ({layer.type_name}, {where})")
    more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
    # a layer on the fast path sums its batch's squares in its own dtype: finite values beyond about
    # sqrt(float32's largest / values per channel) overflow there (probe 32a: |x| ~ 1e18, variance 1e36)
    fast = [layer.name for layer, path in zip(bad, paths) if path == "fast"]
    overflow = (
        (
            f" — or, for {', '.join(map(repr, fast[:5]))}{' and more' if len(fast) > 5 else ''}, which read "
            "their own batch figures, finite values so large that those figures overflowed (|x| beyond about "
            "1e18 in float32); capture='float64' (of precisebn.recalibrate and estimate) measures such values in "
            "float64"
        )
        if fast
        else ""
    )
    return (
        f"non-finite statistics (NaN or Inf) in layer {', '.join(parts)}{more}: the inputs of these layers "
        f"contain NaN/Inf values{overflow}. Check the data and the model's weights (a diverged checkpoint?). "
        "The model was left unchanged."
    )
