"""Report: the table, the dict, the JSON."""

from __future__ import annotations

import json
import math

import torch
from torch import nn

import precisebn


def report() -> precisebn.Report:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.BatchNorm1d(4))
    model[1].running_mean.fill_(1.0)
    model[1].running_var.fill_(4.0)
    return precisebn.recalibrate(model, [torch.randn(8, 3) * 3 for _ in range(4)], forward=lambda m, b: m[1](m[0](b)))


def test_shift_figures_follow_their_definition() -> None:
    r = report()
    row = r["1"]
    shift = (row.new_mean - row.old_mean).abs() / (row.new_var + row.eps).sqrt()
    assert math.isclose(row.mean_shift, float(shift.mean()), rel_tol=1e-12)
    assert math.isclose(row.max_mean_shift, float(shift.max()), rel_tol=1e-12)
    ratio = (row.new_var + row.eps) / (row.old_var + row.eps)
    assert math.isclose(row.var_ratio, float(ratio.log().mean().exp()), rel_tol=1e-12)
    assert row.old_mean.tolist() == [1.0] * 4 and row.old_var.tolist() == [4.0] * 4


def test_table_lists_every_layer_and_totals() -> None:
    text = str(report())
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["layer", "type", "ch"]
    assert any(line.startswith("1 ") and "updated" in line for line in lines)
    assert any(line.startswith("2 ") and "not reached" in line for line in lines)
    assert "1 layers updated, 1 not reached; 32 samples in 4 batches" in lines[-1]


def test_to_dict_is_json_serialisable_and_complete(tmp_path) -> None:
    r = report()
    d = json.loads(json.dumps(r.to_dict()))
    assert d["samples"] == 32 and d["batches"] == 4 and d["mode"] == "norm"
    row = d["layers"][0]
    assert set(row) >= {
        "name",
        "type",
        "channels",
        "count",
        "calls",
        "old_mean",
        "old_var",
        "new_mean",
        "new_var",
        "mean_shift",
        "var_ratio",
        "updated",
    }
    assert row["count"] == 32 and row["calls"] == 4 and len(row["new_var"]) == 4
    r.to_json(tmp_path / "r.json", values=False)
    saved = json.loads((tmp_path / "r.json").read_text())
    assert "new_var" not in saved["layers"][0]
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]
