"""How precise are the statistics? Calibration of precisebn's standard errors, and what
``num_samples="auto"`` spends.

Usage (from the repository root)::

    python -m benchmarks.precision            # about 10 minutes on 2 CPU cores
    python -m benchmarks.precision --quick    # a smoke test (~1 minute)

Set-up: the quality study's (``benchmarks/quality.py``): natural-image patches 3x32x32
cropped from the photographs that ship with scikit-learn and matplotlib, read by
torchvision's resnet18 and mobilenet_v3_small (random initialisation, no download).

For each model, batch size and repetition (a random order of the data set):

* the reference: ``precisebn.estimate(capture="float64")`` over the whole data set in
  that order (deeper layers' statistics depend on how the data fall into batches, so the
  reference shares the estimates' batches);
* estimates over the first n samples of the same order, each with its standard errors;
  the measured error of a channel is |v − v*| / v* for the variance and |m − m*| / σ*
  for the mean; the predicted one is the standard error times √(1 − n/N), since the
  estimate's data are part of the reference's (N samples);
* calibration: z = measured / predicted over every channel of every layer. For
  well-calibrated errors |z| has the median of a standard normal's absolute value,
  0.674; the table reports median |z| / 0.674 (1: calibrated; < 1: errors smaller than
  predicted; > 1: larger);
* ``num_samples="auto"`` (default tolerance 0.02): samples and seconds it spends, and the
  worst layer's median measured error against the reference, next to the fixed default
  of 8192 samples.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

import precisebn
from precisebn.recalibrate import DEFAULT_NUM_SAMPLES, DEFAULT_TOLERANCE

from . import common
from .quality import patches

MODELS = ("resnet18", "mobilenet_v3_small")
HALF_NORMAL_MEDIAN = 0.6745


def build(name: str) -> torch.nn.Module:
    import torchvision

    torch.manual_seed(0)
    return getattr(torchvision.models, name)(weights=None)


def errors(est: precisebn.PopulationStats, ref: precisebn.PopulationStats, shrink: float) -> dict[str, Tensor]:
    """Measured and predicted errors of every channel of every layer."""
    out: dict[str, list[Tensor]] = {"var": [], "mean": [], "pred_var": [], "pred_mean": [], "layer_var": []}
    for name, r in ref.items():
        e = est[name]
        keep = r.var > 0
        var_err = ((e.var - r.var).abs() / r.var)[keep]
        out["var"].append(var_err)
        out["mean"].append(((e.mean - r.mean).abs() / r.var.sqrt())[keep])
        out["pred_var"].append((e.se_var * shrink)[keep])  # type: ignore[operator]
        out["pred_mean"].append((e.se_mean * shrink)[keep])  # type: ignore[operator]
        out["layer_var"].append(var_err.median().reshape(1))
    return {k: torch.cat(v) for k, v in out.items()}


def calibration(measured: Tensor, predicted: Tensor) -> float:
    ok = predicted > 0
    return float((measured[ok] / predicted[ok]).median()) / HALF_NORMAL_MEDIAN


def study(model_name: str, data: Tensor, batch_sizes: Sequence[int], budgets: Sequence[int], reps: int) -> Any:
    model = build(model_name)
    n_total = data.shape[0]
    rows, auto_rows = [], []
    for batch in batch_sizes:
        for rep in range(reps):
            order = torch.randperm(n_total, generator=torch.Generator().manual_seed(rep))
            batches = list(data[order].split(batch))
            ref = precisebn.estimate(model, batches, num_samples="all", capture="float64")
            for n in budgets:
                est = precisebn.estimate(model, batches, num_samples=n)
                e = errors(est, ref, math.sqrt(1 - est.samples / n_total))
                rows.append(
                    {
                        "batch": batch,
                        "rep": rep,
                        "samples": est.samples,
                        "var_measured": float(e["var"].median()),
                        "var_predicted": float(e["pred_var"].median()) * HALF_NORMAL_MEDIAN,
                        "var_calibration": calibration(e["var"], e["pred_var"]),
                        "mean_measured": float(e["mean"].median()),
                        "mean_predicted": float(e["pred_mean"].median()) * HALF_NORMAL_MEDIAN,
                        "mean_calibration": calibration(e["mean"], e["pred_mean"]),
                    }
                )
            start = time.perf_counter()
            auto = precisebn.estimate(model, iter(batches), num_samples="auto")
            seconds = time.perf_counter() - start
            e = errors(auto, ref, 1.0)
            worst_layer_var = float(e["layer_var"].max())
            auto_rows.append(
                {
                    "batch": batch,
                    "rep": rep,
                    "samples": auto.samples,
                    "seconds": seconds,
                    "seconds_per_8192": seconds / auto.samples * DEFAULT_NUM_SAMPLES,
                    "worst_layer_median_var_error": worst_layer_var,
                    "median_mean_error": float(e["mean"].median()),
                    "met": worst_layer_var <= DEFAULT_TOLERANCE,
                }
            )
            print(f"  {model_name} b{batch} rep {rep}: auto {auto.samples} samples, {seconds:.1f} s", flush=True)
    return {"rows": rows, "auto": auto_rows, "data": n_total}


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean over repetitions, per (batch, samples)."""
    keys = sorted({(r["batch"], r["samples"]) for r in rows})
    out = []
    for batch, samples in keys:
        group = [r for r in rows if (r["batch"], r["samples"]) == (batch, samples)]
        row: dict[str, Any] = {"batch": batch, "samples": samples}
        for k in group[0]:
            if k not in ("batch", "samples", "rep"):
                row[k] = sum(r[k] for r in group) / len(group)
        out.append(row)
    return out


def to_markdown(res: dict[str, Any]) -> str:
    lines = [
        "# How precise are the statistics? Standard errors against measured errors",
        "",
        f"Data: {res['data']} natural-image patches 3x32x32 (the quality study's). Command: `{res['command']}` "
        f"({res['elapsed_s'] / 60:.0f} min); {common.describe_machine(res['machine'])}.",
        "",
        "Each cell: median over every channel of every BatchNorm layer, mean over "
        f"{res['reps']} random orders. Measured: |v − v*| / v* (variance) and |m − m*| / σ* (mean) against "
        "the float64 statistics of the whole data set in the same order. Predicted: 0.674 × standard error × "
        "√(1 − n/N). Calibration: median |measured / predicted| ÷ 0.674 (1 = calibrated).",
        "",
        "| model | batch | samples | var measured | var predicted | var calibration "
        "| mean measured (σ) | mean predicted (σ) | mean calibration |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    worst = 0.0
    for model, r in res["models"].items():
        for row in summarise(r["rows"]):
            worst = max(worst, row["var_calibration"], 1 / row["var_calibration"])
            worst = max(worst, row["mean_calibration"], 1 / row["mean_calibration"])
            lines.append(
                f"| {model} | {row['batch']} | {row['samples']} | {100 * row['var_measured']:.2f}% "
                f"| {100 * row['var_predicted']:.2f}% | {row['var_calibration']:.2f} "
                f"| {row['mean_measured']:.4f} | {row['mean_predicted']:.4f} | {row['mean_calibration']:.2f} |"
            )
    lines += [
        "",
        f"Largest disagreement between predicted and measured errors over these rows: a factor of {worst:.2f}.",
        "",
        f'## `num_samples="auto"` (tolerance {DEFAULT_TOLERANCE}) against the fixed {DEFAULT_NUM_SAMPLES} samples',
        "",
        "Worst layer's median measured error of the variance against the whole data set; time per "
        f"{DEFAULT_NUM_SAMPLES} samples shows what the fixed default would cost at the same speed.",
        "",
        "| model | batch | auto: samples | auto: seconds | fixed 8192: seconds (same speed) "
        "| worst layer, median var error | median mean error (σ) | tolerance met |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for model, r in res["models"].items():
        for row in r["auto"]:
            lines.append(
                f"| {model} | {row['batch']} | {row['samples']} | {row['seconds']:.1f} | {row['seconds_per_8192']:.1f} "
                f"| {100 * row['worst_layer_median_var_error']:.2f}% | {row['median_mean_error']:.4f} "
                f"| {'yes' if row['met'] else '**no**'} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.precision", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a smoke test (~1 minute)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=None, help="output folder (default benchmarks/results[/quick])")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    data_size, batch_sizes, budgets, reps = (
        (2048, (32,), (256, 512), 1) if args.quick else (16384, (8, 32), (512, 1024, 2048, 4096), 1)
    )
    folder = args.out or (common.RESULTS / "quick" if args.quick else common.RESULTS)
    folder.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    data = patches(data_size)
    res: dict[str, Any] = {"data": data_size, "reps": reps, "models": {}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in MODELS:
            res["models"][name] = study(name, data, batch_sizes, budgets, reps)
    res["command"] = " ".join(["python -m benchmarks.precision", shlex.join(argv or [])]).strip()
    res["elapsed_s"] = time.perf_counter() - start
    res["machine"] = common.machine(torch.device("cpu"), torch.get_num_threads())
    (folder / "precision.json").write_text(json.dumps(res, indent=1) + "\n")
    (folder / "precision.md").write_text(to_markdown(res))
    print(to_markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
