"""Figures: per-layer shifts of a :class:`~precisebn.Report`, and the demo's three panels.

Needs ``pip install 'precisebn[plot]'`` (matplotlib), imported only when a figure is
drawn. Figures saved to a file are drawn on a bare ``matplotlib.figure.Figure`` (the
Agg canvas; no pyplot state, no display needed); ``path_or_ax=None`` goes through
pyplot so that notebooks show the figure.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any

from ._optional import require
from .files import atomic_path

if TYPE_CHECKING:
    from .report import Report

__all__ = ["plot_demo", "plot_report"]

_EMA, _PRECISE, _OTHER = "#d9534f", "#1f77b4", "#7f7f7f"


def _new_figure(purpose: str, size: tuple[float, float], interactive: bool) -> Any:
    if interactive:
        return require("matplotlib.pyplot", "plot", purpose).figure(figsize=size)
    figure = require("matplotlib.figure", "plot", purpose)
    return figure.Figure(figsize=size)


def _save(fig: Any, path: str | os.PathLike[str], format: str | None = None) -> None:
    """Saves in ``format``, else the one the file's extension names (``.pdf``, ``.svg``...) if matplotlib
    writes it, else as a PNG (an unknown or missing extension), atomically."""
    suffix = (format or os.path.splitext(os.fspath(path))[1][1:]).lower()
    kind = suffix if suffix in fig.canvas.get_supported_filetypes() else "png"
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format=kind, dpi=110)


def plot_report(report: Report, path_or_ax: Any = None, *, title: str | None = None, format: str | None = None) -> Any:
    """Draws how far each layer's statistics moved: ``|Δmean|/σ`` and the variance ratio.

    Args:
        report: A :class:`~precisebn.Report` (``old`` = before, ``new`` = after).
        path_or_ax: A path to save the figure to (written atomically; in the format its
            extension names, e.g. ``.pdf`` or ``.svg``, else PNG), a matplotlib
            ``Axes`` to draw on (the variance ratio then goes on a twin axis), or
            ``None`` for a new pyplot figure.
        title: The figure's title; default says how many layers and samples.
        format: The file format (``"pdf"``, ``"svg"``, ``"png"``...) when saving to a path; default: the one
            its extension names.

    Returns:
        The matplotlib ``Figure``.

    Raises:
        MissingDependencyError: matplotlib is not installed.
    """
    is_ax = hasattr(path_or_ax, "bar") and hasattr(path_or_ax, "figure")
    title = title or f"precisebn: {len(report.layers)} layers, {report.samples} samples"
    if is_ax:
        ax = path_or_ax
        _draw_shift(ax, report)
        _draw_var_ratio(ax.twinx(), report, twin=True)
        ax.set_title(title)
        return ax.figure
    width = min(18.0, max(7.0, 0.22 * len(report.layers) + 3))
    fig = _new_figure("Report.plot()", (width, 6.5), interactive=path_or_ax is None)
    top, bottom = fig.subplots(2, 1, sharex=True)
    _draw_shift(top, report)
    _draw_var_ratio(bottom, report, twin=False)
    _layer_ticks(bottom, report)
    fig.suptitle(title)
    fig.tight_layout()
    if path_or_ax is not None:
        _save(fig, path_or_ax, format)
    return fig


def _draw_shift(ax: Any, report: Report) -> None:
    xs = range(len(report.layers))
    ax.bar(xs, [r.mean_shift for r in report.layers], color=_PRECISE, label="|Δmean|/σ, mean over channels")
    ax.plot(xs, [r.max_mean_shift for r in report.layers], "v", color=_EMA, ms=4, label="max over channels")
    ax.set_ylabel("|Δmean| / σ_new")
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(axis="y", alpha=0.3)


def _draw_var_ratio(ax: Any, report: Report, twin: bool) -> None:
    xs = range(len(report.layers))
    ratios = [r.var_ratio for r in report.layers]
    ax.axhline(1.0, color=_OTHER, lw=0.8, ls="--")
    ax.plot(xs, ratios, "o-" if not twin else "o", color=_OTHER if twin else _PRECISE, ms=3, label="var new/old")
    errors = [(x, r, ratio) for x, r, ratio in zip(xs, report.layers, ratios) if math.isfinite(r.se_var_median)]
    if errors:  # the median channel's standard error (and the worst channel's, thin)
        ex = [x for x, _, _ in errors]
        ey = [ratio for _, _, ratio in errors]
        worst = [ratio * min(r.se_var_max, 0.99) for _, r, ratio in errors]
        ax.errorbar(ex, ey, yerr=worst, fmt="none", ecolor=_OTHER, elinewidth=0.5, alpha=0.6)
        ax.errorbar(
            ex, ey, yerr=[ratio * r.se_var_median for _, r, ratio in errors], fmt="none", ecolor=_EMA,
            elinewidth=1.5, capsize=2, label="± standard error (median / worst channel)",
        )  # fmt: skip
    if all(r > 0 for r in ratios):
        ax.set_yscale("log")
    ax.set_ylabel("var new / old (geometric mean)")
    if twin:
        ax.legend(loc="upper right", fontsize=8)
    else:
        ax.grid(alpha=0.3)


def _layer_ticks(ax: Any, report: Report) -> None:
    names = [r.name or "(model)" for r in report.layers]
    step = max(1, len(names) // 40)
    ticks = list(range(0, len(names), step))
    ax.set_xticks(ticks)
    ax.set_xticklabels([names[i] for i in ticks], rotation=90, fontsize=7)
    ax.set_xlabel("layer")


def plot_demo(results: dict[str, Any], path: str | os.PathLike[str] | None = None) -> Any:
    """The demo's figure: validation curve, weight averaging, domain shift and, when the
    results have it, few-shot adaptation (one row).

    Args:
        results: What :func:`precisebn.demo.run_demo` returned.
        path: Where to save the PNG (atomically); ``None`` for a pyplot figure.

    Returns:
        The matplotlib ``Figure``.
    """
    few = results.get("few_shot")
    widths = [1.6, 1, 1] + [1.5] * bool(few)
    fig = _new_figure("precisebn demo's figure", (15.0 + 6.0 * bool(few), 4.6), interactive=path is None)
    curve_ax, swa_ax, shift_ax, *few_ax = fig.subplots(1, len(widths), gridspec_kw={"width_ratios": widths})
    curve = results["validation_curve"]
    pct = [100 * a for a in curve["ema"]], [100 * a for a in curve["precise"]]
    curve_ax.plot(curve["epoch"], pct[0], "o-", color=_EMA, label="EMA running statistics")
    curve_ax.plot(curve["epoch"], pct[1], "s-", color=_PRECISE, label="precise statistics (precisebn)")
    curve_ax.set(xlabel="epoch", ylabel="validation accuracy (%)", title="1. Validation curve during training")
    curve_ax.set_ylim(0, 105)
    curve_ax.xaxis.set_major_locator(require("matplotlib.ticker", "plot", "plot_demo()").MaxNLocator(integer=True))
    curve_ax.legend(loc="lower right", fontsize=9)
    curve_ax.grid(alpha=0.3)
    swa, shift = results["weight_averaging"], results["domain_shift"]
    span = swa["epochs_averaged"]
    _bars(
        swa_ax,
        ["stale\n(last model's EMA)", "recalibrated\n(precisebn)"],
        [swa["stale"], swa["recalibrated"]],
        [_EMA, _PRECISE],
        f"2. SWA of epochs {span[0]}–{span[-1]}" if len(span) > 1 else f"2. SWA of epoch {span[0]}",
    )
    _bars(
        shift_ax,
        ["clean images,\ntrain stats", "shifted images,\ntrain stats", "shifted images,\nre-estimated"],
        [shift["clean"], shift["training_stats"], shift["adapted"]],
        [_OTHER, _EMA, _PRECISE],
        f"3. Domain shift (contrast ×{shift['contrast']:g}, +{shift['brightness']:g})",
    )
    if few:
        _few_shot_panel(few_ax[0], few)
    fig.suptitle(
        f"precisebn demo: scikit-learn digits, small BatchNorm CNN, seed {results['config']['seed']}", fontsize=12
    )
    fig.tight_layout()
    if path is not None:
        _save(fig, path)
    return fig


def _few_shot_panel(ax: Any, few: dict[str, Any]) -> None:
    """Accuracy vs number of images: plain re-estimation and each prior, one line style per shift."""
    counts = few["counts"]
    prior_colors = ["#ff7f0e", _EMA, "#9467bd", "#8c564b"]
    for shift, style in zip(few["shifts"], ["-", "--", ":", "-."]):
        label = shift["name"].split(" ")[0]
        ax.plot(counts, [100 * a for a in shift["plain"]], "o" + style, color=_PRECISE, label=f"{label}: plain")
        for (n, accs), color in zip(shift["prior"].items(), prior_colors):
            ax.plot(counts, [100 * a for a in accs], "s" + style, color=color, ms=4, label=f"{label}: prior N={n}")
        ax.axhline(100 * shift["training_stats"], color=_OTHER, lw=0.8, ls=style)
    if len(counts) > 1:
        ax.set_xscale("log", base=2)
    ax.set_xticks(counts)
    ax.set_xticklabels([str(c) for c in counts])
    ax.set(
        xlabel="unlabelled shifted images",
        ylabel="validation accuracy (%)",
        title="4. Few-shot adaptation (grey: train stats)",
    )
    ax.set_ylim(0, 105)
    ax.legend(loc="lower right", fontsize=7, ncol=2)
    ax.grid(alpha=0.3)


def _bars(ax: Any, labels: list[str], values: list[float], colors: list[str], title: str) -> None:
    heights = [100 * v for v in values]
    bars = ax.bar(range(len(values)), heights, color=colors, width=0.6)
    for bar, h in zip(bars, heights):
        ax.text(bar.get_x() + bar.get_width() / 2, h + 1.5, f"{h:.1f} %", ha="center", fontsize=10)
    ax.set_xticks(range(len(values)))
    ax.set_xticklabels(labels, fontsize=9)
    ax.set_ylim(0, 110)
    ax.set(ylabel="validation accuracy (%)", title=title)
    ax.grid(axis="y", alpha=0.3)
