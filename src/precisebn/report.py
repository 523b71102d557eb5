"""What a recalibration changed: per-layer old and new statistics, and totals."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from ._equality import equal_fields, hash_fields
from ._table import format_table
from .files import atomic_path

__all__ = ["LayerReport", "Report"]


@dataclass(frozen=True)
class LayerReport:
    """One layer's statistics before and after.

    Attributes:
        name: Qualified layer name.
        layer_type: Class name of the layer.
        channels: Number of channels.
        count: Values counted per channel (0: never reached, statistics kept).
        calls: Forward calls of the layer seen during the passes.
        old_mean, old_var: The running statistics before (float64, CPU).
        new_mean, new_var: The running statistics after (float64, CPU; equal to the
            old ones when the layer was not updated).
        eps: The layer's epsilon.
        updated: Whether new statistics were written.
        path: How the layer was measured: ``"fast"`` (its own batch figures, verified
            against float64), ``"float64"`` (what it normalises, reduced in float64),
            ``"none"`` (never normalised with its running buffers, or never called), ``"mixed"``
            (ranks, or merged files, that read it on different paths).
        se_mean, se_var: Per-channel standard errors of the new mean (in standard
            deviations) and of the new variance (relative), from the jackknife over
            batches (see :func:`precisebn.stats.fold_errors`); ``None`` when unknown.
            The mean's standard deviation is the one the layer normalises with after the
            write: the measured one, or with ``adapt="mean"`` the kept
            ``sqrt(new_var + eps)`` — the unit of :attr:`mean_shift`, so that the two
            compare (the statistics' own ``se_mean`` stays in the measured one).
        per_forward: The most calls of the layer in one forward pass (batch). Above 1
            its new statistics pool every call, although training normalised each call
            with that call's own batch statistics (see :func:`precisebn.untie_calls`).
        varies: Per channel, whether the measured values vary (their variance > 0): the
            channels the standard errors' medians are taken over. ``None``: those where
            ``new_var > 0`` — the measured variance, where it was written; with
            ``adapt="mean"`` the kept variance says nothing of the data's, and this is given.
    """

    name: str
    layer_type: str
    channels: int
    count: int
    calls: int
    old_mean: Tensor
    old_var: Tensor
    new_mean: Tensor
    new_var: Tensor
    eps: float
    updated: bool
    path: str = "fast"
    se_mean: Tensor | None = None
    se_var: Tensor | None = None
    per_forward: int = 1
    varies: Tensor | None = None

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return equal_fields(self, other)

    def __hash__(self) -> int:
        return hash_fields(self)

    @property
    def pooled_calls(self) -> bool:
        """Whether the layer was called several times per forward, its statistics pooling
        all calls."""
        return self.per_forward > 1

    def _se(self, values: Tensor | None, how: str) -> float:
        if values is None or not self.updated or values.numel() == 0:
            return float("nan")
        if how == "median":  # over the channels that vary: a constant channel's errors are 0
            # (in the data: with adapt="mean" new_var is the kept variance — probe 47: a channel constant in the new
            # data, its error 0, counted where the kept variance was positive, and the median fell 2.3 times)
            varies = (self.new_var.reshape(-1) > 0) if self.varies is None else self.varies.reshape(-1)
            if varies.shape == values.shape and bool(varies.any()):
                values = values[varies]
            return float(values.double().quantile(0.5))  # (torch's median: the lower)
        return float(values.max())

    @property
    def se_mean_median(self) -> float:
        """Median over the channels that vary of the mean's standard error, in standard
        deviations (NaN: unknown)."""
        return self._se(self.se_mean, "median")

    @property
    def se_mean_max(self) -> float:
        """Largest over channels of the mean's standard error, in standard deviations."""
        return self._se(self.se_mean, "max")

    @property
    def se_var_median(self) -> float:
        """Median over the channels that vary of the variance's relative standard error (NaN: unknown)."""
        return self._se(self.se_var, "median")

    @property
    def se_var_max(self) -> float:
        """Largest over channels of the variance's relative standard error."""
        return self._se(self.se_var, "max")

    @property
    def _shift(self) -> Tensor:
        return (self.new_mean - self.old_mean).abs() / (self.new_var.clamp_min(0) + self.eps).sqrt()

    @property
    def mean_shift(self) -> float:
        """Mean over channels of ``|Δmean| / sqrt(new_var + eps)``: how far, in the new
        standard deviations (the kept ones with ``adapt="mean"``, as :attr:`se_mean`), the
        stored mean moved."""
        return float(self._shift.mean()) if self.channels else 0.0

    @property
    def max_mean_shift(self) -> float:
        """Largest ``|Δmean| / sqrt(new_var + eps)`` over channels."""
        return float(self._shift.max()) if self.channels else 0.0

    @property
    def var_ratio(self) -> float:
        """Geometric mean over channels of ``(new_var + eps) / (old_var + eps)``."""
        if not self.channels:
            return 1.0
        ratio = (self.new_var.clamp_min(0) + self.eps) / (self.old_var.clamp_min(0) + self.eps)
        return float(ratio.log().mean().exp())

    @property
    def status(self) -> str:
        if self.updated:
            return f"updated (pooled over {self.per_forward} calls per forward)" if self.pooled_calls else "updated"
        if self.calls:
            return "buffers never used (kept)"
        return "not reached (kept)"

    def to_dict(self, values: bool = True) -> dict[str, Any]:
        d: dict[str, Any] = {
            "name": self.name,
            "type": self.layer_type,
            "channels": self.channels,
            "count": self.count,
            "calls": self.calls,
            "per_forward": self.per_forward,
            "updated": self.updated,
            "path": self.path,
            "se_mean_median": _finite_or_none(self.se_mean_median),
            "se_mean_max": _finite_or_none(self.se_mean_max),
            "se_var_median": _finite_or_none(self.se_var_median),
            "se_var_max": _finite_or_none(self.se_var_max),
            "mean_shift": _finite_or_none(self.mean_shift),
            "max_mean_shift": _finite_or_none(self.max_mean_shift),
            "var_ratio": _finite_or_none(self.var_ratio),
        }
        if values:
            for key in ("old_mean", "old_var", "new_mean", "new_var", "se_mean", "se_var"):
                t = getattr(self, key)
                if t is not None:
                    d[key] = [_finite_or_none(v) for v in t.tolist()]
        return d


def _percent(v: float) -> str:
    return "–" if not math.isfinite(v) else f"{100 * v:.2g}%"


def _finite_or_none(v: float) -> float | None:
    return v if math.isfinite(v) else None


@dataclass
class Report(Mapping[str, LayerReport]):
    """The result of :func:`precisebn.recalibrate` / :func:`precisebn.apply`.

    A read-only mapping of qualified layer name to :class:`LayerReport`, in module
    order: ``report["layer1.0.bn1"]``, ``"bn" in report``, ``len(report)``,
    ``for name in report``, ``report.items()``... (:attr:`layers` is the same rows as
    a list). ``str(report)`` is a table, one row per layer; :meth:`to_dict` is
    JSON-serialisable.

    Example:
        >>> import torch, precisebn
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.BatchNorm1d(4))
        >>> report = precisebn.recalibrate(model, [torch.randn(8, 3)], num_samples="all")
        >>> len(report), list(report), "1" in report, "0" in report
        (2, ['1', '2'], True, False)
        >>> {name: row.count for name, row in report.items()}
        {'1': 8, '2': 8}

    Attributes:
        layers: One :class:`LayerReport` per selected layer, in module order.
        samples: Samples (batch items) used, over all ranks.
        batches: Batches used, over all ranks.
        seconds: Wall time of the passes.
        mode: ``"norm"`` or ``"train"``.
        world_size: Number of ranks merged.
    """

    layers: list[LayerReport]
    samples: int
    batches: int
    seconds: float
    mode: str
    world_size: int = 1

    def __eq__(self, other: object) -> bool:
        """Equal statistics and provenance; the wall time (``seconds``) is not compared."""
        if type(other) is not type(self):
            return NotImplemented
        return equal_fields(self, other, but=("seconds",))

    __hash__ = None  # type: ignore[assignment]  (mutable)

    def __getitem__(self, name: str) -> LayerReport:
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        return (layer.name for layer in self.layers)

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def updated(self) -> list[str]:
        """Names of the layers whose statistics were written."""
        return [r.name for r in self.layers if r.updated]

    @property
    def not_reached(self) -> list[str]:
        """Names of the selected layers whose statistics were kept: no forward pass reached them, or
        none normalised with their running buffers (the summary counts those apart)."""
        return [r.name for r in self.layers if not r.updated]

    @property
    def pooled_calls(self) -> list[str]:
        """Names of the updated layers called several times per forward, whose statistics
        pool all their calls (see :func:`precisebn.untie_calls`)."""
        return [r.name for r in self.layers if r.updated and r.pooled_calls]

    def to_dict(self, values: bool = True) -> dict[str, Any]:
        """A JSON-serialisable dict; ``values=False`` leaves out per-channel lists."""
        return {
            "samples": self.samples,
            "batches": self.batches,
            "seconds": self.seconds,
            "mode": self.mode,
            "world_size": self.world_size,
            "layers": [r.to_dict(values) for r in self.layers],
        }

    def to_json(self, path: str | os.PathLike[str], values: bool = True) -> None:
        """Writes :meth:`to_dict` as JSON, atomically."""
        with atomic_path(path) as tmp:
            tmp.write_text(json.dumps(self.to_dict(values), indent=1) + "\n")

    def plot(self, path_or_ax: Any = None) -> Any:
        """Draws per-layer shifts (needs ``pip install 'precisebn[plot]'``).

        Args:
            path_or_ax: A file path to save the figure to, in the format its extension
                names (``.png``, ``.svg``, ``.pdf``...), a matplotlib ``Axes`` to draw on, or
                ``None`` for a new figure.

        Returns:
            The matplotlib ``Figure``.
        """
        from .plotting import plot_report

        return plot_report(self, path_or_ax)

    def __str__(self) -> str:
        header = [
            "layer",
            "type",
            "ch",
            "values/ch",
            "calls",
            "path",
            "|Δμ|/σ mean",
            "max",
            "var new/old",
            "±var",
            "status",
        ]
        rows = [
            [
                r.name or "(model)",
                r.layer_type,
                str(r.channels),
                str(r.count),
                str(r.calls),
                r.path,
                f"{r.mean_shift:.3g}",
                f"{r.max_mean_shift:.3g}",
                f"{r.var_ratio:.3g}",
                _percent(r.se_var_median),
                r.status,
            ]
            for r in self.layers
        ]
        kept = len(self.not_reached)
        unused = sum(1 for r in self.layers if not r.updated and r.calls)  # called, never normalised with buffers
        how = (
            f"{kept} not reached"
            if not unused
            else f"{kept} kept ({kept - unused} not reached, {unused} with buffers never used)"
        )
        updated = len(self.layers) - kept
        lines = [format_table(header, rows, right={2, 3, 4, 6, 7, 8, 9})]
        lines.append(
            f"{updated} {'layer' if updated == 1 else 'layers'} updated, {how}; {self.samples} samples in "
            f"{self.batches} batches, {self.seconds:.2f} s, mode={self.mode!r}"
            + (f", {self.world_size} ranks" if self.world_size > 1 else "")
        )
        # (each error where it is known: adapt="var" writes no mean, whose error is then unknown — NaN, which
        # max() would show or hide by the layers' order — and adapt="mean" no variance)
        se_vars = [(r.se_var_median, r.name) for r in self.layers if math.isfinite(r.se_var_median)]
        se_means = [r.se_mean_median for r in self.layers if math.isfinite(r.se_mean_median)]
        means = f"the means ±{max(se_means):.2g}σ at worst" if se_means else ""
        if se_vars:
            se_var, name = max(se_vars)
            lines.append(
                f"±var: median standard error of the new variance (jackknife over batches); worst layer "
                f"{name or '(model)'!r} ±{100 * se_var:.2g}%" + (f", {means}" if means else "")
            )
        elif means:
            lines.append(f"median standard error of the new means (jackknife over batches): {means}")
        pooled = self.pooled_calls
        if pooled:
            shown = ", ".join(repr(n or "(model)") for n in pooled[:3]) + (
                f" and {len(pooled) - 3} more" if len(pooled) > 3 else ""
            )
            lines.append(
                f"pooled calls: {shown} {'is' if len(pooled) == 1 else 'are'} called several times per forward; "
                "training normalised each call with its own batch statistics, but one running buffer pools them "
                "all, which fits no call when their statistics differ (e.g. a head shared by feature levels). "
                "estimate(..., per_call=True) gives each call its own statistics, precisebn.untie_calls(model, "
                "stats) a layer for them (README: 'Layers called several times per forward')."
            )
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"Report({len(self.layers)} layers, samples={self.samples}, batches={self.batches}, "
            f"seconds={self.seconds:.3g})"
        )
