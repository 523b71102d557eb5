"""Dev script: precisebn's error against the float64 truth, next to fvcore's and torch's.

Run with ``.venv/bin/python scripts/exactness.py`` after ``make test`` (fvcore comes with
the ``dev`` extra; it is never a dependency of precisebn). Prints the figures quoted
in the README's "Exactness" section.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
import torchvision
from torch import nn
from torch.optim import swa_utils

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import precisebn
from conftest import compute_truth, max_rel_error

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from fvcore.nn import update_bn_stats


def worst(model: nn.Module, truth: dict) -> tuple[float, float]:
    mean_err = var_err = 0.0
    for name, t in truth.items():
        layer = model.get_submodule(name)
        scale = torch.maximum(t.mean.abs(), t.var.sqrt())
        mean_err = max(mean_err, max_rel_error(layer.running_mean, t.mean, scale))
        var_err = max(var_err, max_rel_error(layer.running_var, t.var))
    return mean_err, var_err


def resnet18(size: int = 64, batch: int = 8, count: int = 8, channels_last: bool = False) -> None:
    layout = torch.channels_last if channels_last else torch.contiguous_format
    for capture in ("auto", "float64"):
        torch.manual_seed(0)
        model = torchvision.models.resnet18(weights=None).to(memory_format=layout)
        g = torch.Generator().manual_seed(1)
        batches = [
            torch.randn(batch, 3, size, size, generator=g).contiguous(memory_format=layout) for _ in range(count)
        ]
        truth = compute_truth(model, batches)
        report = precisebn.recalibrate(model, batches, capture=capture)
        m, v = worst(model, truth)
        paths = sorted({r.path for r in report.values()})
        print(
            f"resnet18{' channels_last' if channels_last else ''}, {len(truth)} BN layers, {count} batches of "
            f"{batch}x3x{size}x{size}, capture={capture!r} (paths {paths}): max rel. error mean {m:.2e}, var {v:.2e}"
        )


def offset_case(mean: float, std: float, batch: int, batches: int) -> None:
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(batch, 8, generator=g, dtype=torch.float64) * std + mean).float() for _ in range(batches)]
    truth = compute_truth(nn.BatchNorm1d(8), data)
    rows = []
    for tool in ("precisebn", "fvcore update_bn_stats", "torch swa_utils.update_bn"):
        layer = nn.BatchNorm1d(8).train()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if tool == "precisebn":
                precisebn.recalibrate(layer, data)
            elif tool.startswith("fvcore"):
                update_bn_stats(layer, data, num_iters=batches)
            else:
                swa_utils.update_bn(data, layer)
        m, v = worst(nn.Sequential(layer), {"0": truth[""]})
        negative = int((layer.running_var < 0).sum())
        rows.append(f"  {tool:<28} mean {m:.2e}  var {v:.2e}  negative variances: {negative}")
    print(f"BatchNorm1d(8), mean {mean:g}, std {std:g}, {batches} batches of {batch} (float32):")
    print("\n".join(rows))


if __name__ == "__main__":
    resnet18()
    resnet18(size=224, batch=4, count=2, channels_last=True)
    offset_case(1e4, 1.0, 32, 20)
    offset_case(1e4, 1e-2, 2, 20)
    offset_case(0.0, 1.0, 32, 20)
