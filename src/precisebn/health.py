"""Normalization-layer statistics stored in a state_dict: health flags and comparisons.

Works on the tensors alone (no model needed): a layer is every prefix ``P`` with both
``P.running_mean`` and ``P.running_var``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ._table import format_table
from .errors import StatsMismatchError
from .population import buffer_key
from .report import LayerReport, Report

__all__ = [
    "DEFAULT_EPS",
    "NormEntry",
    "StatsDiff",
    "diff_stats",
    "format_diff",
    "format_health",
    "health_flags",
    "norm_entries",
]

DEFAULT_EPS = 1e-5
"""BatchNorm's default epsilon; a state_dict does not store the layer's own."""


@dataclass(frozen=True)
class NormEntry:
    """One layer's stored statistics (float64 copies).

    Attributes:
        name: The prefix of ``running_mean``/``running_var`` in the state_dict.
        mean: ``running_mean``.
        var: ``running_var``.
        batches: ``num_batches_tracked`` if stored, else ``None``.
    """

    name: str
    mean: Tensor
    var: Tensor
    batches: int | None

    @property
    def channels(self) -> int:
        return int(self.mean.numel())


def norm_entries(state_dict: Mapping[str, Tensor]) -> list[NormEntry]:
    """Every normalization layer's statistics in ``state_dict``, in stored order.

    Example:
        >>> import torch
        >>> sd = torch.nn.Sequential(torch.nn.BatchNorm1d(3)).state_dict()
        >>> [(e.name, e.channels, e.batches) for e in norm_entries(sd)]
        [('0', 3, 0)]

    Raises:
        StatsMismatchError: A layer holds more (or fewer) running means than variances.
    """
    out = []
    for key in state_dict:
        if not key.endswith("running_mean"):
            continue
        prefix = key[: -len("running_mean")]
        var = state_dict.get(prefix + "running_var")
        if var is None:
            continue
        tracked = state_dict.get(prefix + "num_batches_tracked")
        if state_dict[key].numel() != var.numel():
            raise StatsMismatchError(
                f"layer {prefix.rstrip('.')!r} holds {state_dict[key].numel()} running means but {var.numel()} running "
                "variances: the checkpoint is damaged (or not a normalization layer's); re-save it from the model."
            )
        out.append(
            NormEntry(
                prefix.rstrip("."),
                state_dict[key].detach().to("cpu", torch.float64).flatten(),
                var.detach().to("cpu", torch.float64).flatten(),
                int(tracked) if tracked is not None and tracked.numel() == 1 else None,
            )
        )
    return out


def health_flags(entry: NormEntry, collapse_ratio: float = 1e-4) -> list[str]:
    """What looks wrong with one layer's statistics (empty when nothing does).

    * ``non-finite: k ch`` — NaN or Inf in the mean or variance.
    * ``var<=0: k ch`` — zero or negative variance (negative is impossible for a
      true variance; zero means a constant channel, normalised by eps alone).
    * ``collapsed: k ch`` — positive variance below ``collapse_ratio`` times the
      layer's median (dead or nearly constant channels).
    * ``never updated`` — mean 0 and variance 1 everywhere (initial values).

    Example:
        >>> import torch
        >>> e = NormEntry("bn", torch.zeros(4, dtype=torch.float64), torch.tensor([1.0, 1e-9, 0.0, 2.0]), 10)
        >>> health_flags(e)
        ['var<=0: 1 ch', 'collapsed: 1 ch']
    """
    flags = []
    finite = entry.mean.isfinite() & entry.var.isfinite()
    if not bool(finite.all()):
        flags.append(f"non-finite: {int((~finite).sum())} ch")
    var = entry.var[finite]
    if bool((var <= 0).any()):
        flags.append(f"var<=0: {int((var <= 0).sum())} ch")
    positive = var[var > 0]
    if positive.numel():
        collapsed = int((positive < collapse_ratio * positive.double().quantile(0.5)).sum())
        if collapsed:
            flags.append(f"collapsed: {collapsed} ch")
    if entry.channels and bool((entry.mean == 0).all()) and bool((entry.var == 1).all()):
        flags.append("never updated")
    return flags


def _g(v: float) -> str:
    return f"{v:.3g}"


def format_health(entries: list[NormEntry], collapse_ratio: float = 1e-4) -> tuple[str, int]:
    """The ``inspect`` table and the number of layers with flags."""
    rows, flagged = [], 0
    for e in entries:
        flags = health_flags(e, collapse_ratio)
        flagged += bool(flags)
        finite_var = e.var[e.var.isfinite()]
        var_stats = (
            (finite_var.min(), finite_var.double().quantile(0.5), finite_var.max()) if finite_var.numel() else ()
        )
        finite_mean = e.mean[e.mean.isfinite()]
        rows.append(
            [
                e.name or "(model)",
                str(e.channels),
                f"{_g(finite_mean.min())} … {_g(finite_mean.max())}" if finite_mean.numel() else "-",
                *([_g(v) for v in var_stats] if var_stats else ["-", "-", "-"]),
                "-" if e.batches is None else str(e.batches),
                ", ".join(flags) or "ok",
            ]
        )
    header = ["layer", "ch", "mean min … max", "var min", "var median", "var max", "batches", "health"]
    table = format_table(header, rows, right={1, 3, 4, 5, 6})
    summary = f"{len(entries)} normalization layers, {flagged} flagged"
    return f"{table}\n{summary}", flagged


@dataclass
class StatsDiff:
    """Per-layer comparison of two state_dicts' statistics.

    Attributes:
        report: Common layers as a :class:`~precisebn.Report` (``old`` = A, ``new`` = B),
            for the table's metrics and for :func:`precisebn.plotting.plot_report`.
        only_a: Layers only in A.
        only_b: Layers only in B.
        mismatched: Common layers whose channel counts differ.
        other_same: Other tensors (weights...) present in both and equal.
        other_differ: Other tensors present in both that differ (in values, shape or dtype).
        dtype_differ: ``"name: dtype A vs dtype B"`` for every tensor in both whose dtypes differ.
    """

    report: Report
    only_a: list[str]
    only_b: list[str]
    mismatched: list[str]
    other_same: int
    other_differ: int
    dtype_differ: list[str] = field(default_factory=list)


def diff_stats(a: Mapping[str, Tensor], b: Mapping[str, Tensor]) -> StatsDiff:
    """Compares the normalization statistics (and, in total, the other tensors) of A and B."""
    ea = {e.name: e for e in norm_entries(a)}
    eb = {e.name: e for e in norm_entries(b)}
    rows, mismatched = [], []
    for name, x in ea.items():
        y = eb.get(name)
        if y is None:
            continue
        if x.channels != y.channels:
            mismatched.append(name)
            continue
        rows.append(LayerReport(name, "", x.channels, 0, 0, x.mean, x.var, y.mean, y.var, DEFAULT_EPS, True, ""))
    stat_keys = {buffer_key(n, s) for n in {*ea, *eb} for s in ("running_mean", "running_var")}
    others = [k for k in a if k in b and k not in stat_keys and not k.endswith("num_batches_tracked")]
    same = sum(_same_entry(a[k], b[k]) for k in others)
    tensors = [k for k in a if k in b and isinstance(a[k], Tensor) and isinstance(b[k], Tensor)]
    dtypes = [f"{k}: {a[k].dtype} vs {b[k].dtype}".replace("torch.", "") for k in tensors if a[k].dtype != b[k].dtype]
    return StatsDiff(
        Report(rows, 0, 0, 0.0, "diff"),
        [n for n in ea if n not in eb],
        [n for n in eb if n not in ea],
        mismatched,
        same,
        len(others) - same,
        dtypes,
    )


def _worst_factor(r: LayerReport) -> float:
    """The largest per-channel factor (≥ 1) by which the variance changed, either way."""
    ratio = (r.new_var.clamp_min(0) + r.eps) / (r.old_var.clamp_min(0) + r.eps)
    return float(ratio.log().abs().max().exp())


def format_diff(diff: StatsDiff, name_a: str = "A", name_b: str = "B") -> str:
    """The ``diff`` table: per common layer, how far B's statistics are from A's."""
    rows = [
        [
            r.name or "(model)",
            str(r.channels),
            _g(r.mean_shift),
            _g(r.max_mean_shift),
            _g(r.var_ratio),
            _g(_worst_factor(r)) if r.channels else "-",
        ]
        for r in diff.report.layers
    ]
    header = ["layer", "ch", "|Δμ|/σ_B mean", "max", "var B/A (geo mean)", "max var change ×"]
    lines = [f"A = {name_a}", f"B = {name_b}", format_table(header, rows, right={1, 2, 3, 4, 5})]
    for label, names in (
        ("only in A", diff.only_a),
        ("only in B", diff.only_b),
        ("channel counts differ", diff.mismatched),
    ):
        if names:
            more = f" and {len(names) - 10} more" if len(names) > 10 else ""
            lines.append(f"{label}: {', '.join(names[:10])}{more}")
    if diff.dtype_differ:
        more = f" and {len(diff.dtype_differ) - 10} more" if len(diff.dtype_differ) > 10 else ""
        lines.append(f"dtypes differ: {'; '.join(diff.dtype_differ[:10])}{more}")
    retyped = {d.split(":")[0] for d in diff.dtype_differ}
    identical = sum(
        bool(_same_values(r.old_mean, r.new_mean) and _same_values(r.old_var, r.new_var))
        and not {
            f"{r.name}.running_mean" if r.name else "running_mean",
            f"{r.name}.running_var" if r.name else "running_var",
        }
        & retyped
        for r in diff.report.layers
    )
    lines.append(
        f"{len(diff.report.layers)} layers compared, {identical} identical; other tensors: "
        f"{diff.other_same} identical, {diff.other_differ} differ"
    )
    return "\n".join(lines)


def _same_entry(a: Any, b: Any) -> bool:
    """Whether two state_dict entries are the same: tensors bit for bit, a module's extra state by ``==``."""
    if isinstance(a, Tensor) and isinstance(b, Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and _same_bits(a, b)
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return False
    try:
        return bool(a == b)
    except Exception:  # (an extra state whose == is not a truth value)
        return False


def _same_bits(a: Tensor, b: Tensor) -> bool:
    """Whether two tensors of one dtype and shape hold the same bits (a NaN equals itself)."""
    try:
        return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    except RuntimeError:  # dtypes without a byte view
        return torch.equal(a, b)


def _same_values(a: Tensor, b: Tensor) -> bool:
    """Whether two tensors hold the same values, NaN where the other has NaN."""
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())
