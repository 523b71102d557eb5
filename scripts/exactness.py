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


def resnet18() -> None:
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(8, 3, 64, 64, generator=g) for _ in range(8)]
    truth = compute_truth(model, batches)
    precisebn.recalibrate(model, batches)
    m, v = worst(model, truth)
    print(f"resnet18, {len(truth)} BN layers, 8 batches of 8x3x64x64: max rel. error mean {m:.2e}, var {v:.2e}")


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
    offset_case(1e4, 1.0, 32, 20)
    offset_case(1e4, 1e-2, 2, 20)
    offset_case(0.0, 1.0, 32, 20)
