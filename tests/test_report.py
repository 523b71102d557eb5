"""Report: the table, the dict, the JSON."""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Mapping

import pytest
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
    assert any("1 layer updated, 1 not reached; 32 samples in 4 batches" in line for line in lines[-2:])
    assert lines[-1].startswith("±var: median standard error of the new variance")


def test_totals_tell_unused_buffers_from_unreached_layers_and_unwritten_errors_are_unknown() -> None:
    """Found by a hostile probe: a layer called but never normalising with its buffers was counted as "not
    reached", and with adapt="mean" the table showed the standard error of a variance never written."""

    class Skip(torch.nn.BatchNorm1d):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x  # never normalises with its running buffers

    model = torch.nn.Sequential(torch.nn.BatchNorm1d(2), Skip(2), torch.nn.Sequential(torch.nn.BatchNorm1d(2)))
    data = [torch.randn(8, 2) for _ in range(3)]
    r = precisebn.recalibrate(model, data, forward=lambda m, b: m[1](m[0](b)), adapt="mean")
    assert "1 layer updated, 2 kept (1 not reached, 1 with buffers never used)" in str(r)
    assert r["0"].se_var is None and r["0"].se_mean is not None and torch.equal(r["0"].new_var, r["0"].old_var)
    assert "±var: median" not in str(r)  # (the column header stays; its cells show "–")


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


def test_report_is_a_read_only_mapping_of_layer_names() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 5, 1), nn.BatchNorm2d(5))
    model.add_module("head", nn.Sequential(nn.Flatten(), nn.LazyLinear(2), nn.BatchNorm1d(2)))
    batches = [torch.randn(4, 3, 6, 6) for _ in range(3)]
    model(batches[0])  # initialises the lazy layer
    r = precisebn.recalibrate(model, batches, num_samples="all")
    names = [name for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert names == ["1", "4", "head.2"]

    assert isinstance(r, Mapping)
    assert len(r) == 3
    assert list(r) == names and list(r.keys()) == names  # module order
    assert "4" in r and "head.2" in r and "3" not in r and "nope" not in r and 1 not in r
    assert [row.name for row in r.values()] == names
    assert dict(r.items()) == {row.name: row for row in r.layers}
    assert r.get("nope") is None and r.get("1") is r["1"]
    assert {name: row.channels for name, row in r.items()} == {"1": 4, "4": 5, "head.2": 2}
    assert r["head.2"].count == 12 and r["1"].count == 3 * 4 * 4 * 4  # values per channel
    with pytest.raises(KeyError):
        r["nope"]
    with pytest.raises(TypeError):
        r["1"] = r["4"]  # type: ignore[index]
    with pytest.raises(TypeError):
        del r["1"]  # type: ignore[attr-defined]
    # what it had before is unchanged
    assert r.updated == names and r.not_reached == [] and r.samples == 12 and r.batches == 3
    assert [row["name"] for row in r.to_dict()["layers"]] == names
    assert any(line.startswith("3 layers updated") for line in str(r).splitlines()[-2:])


def test_medians_are_the_usual_median() -> None:
    """Found by a hostile probe: torch's median is the lower one, so a 2-channel layer's "median" error
    was its better channel's (and num_samples="auto" stopped on it)."""
    z = torch.zeros(2, dtype=torch.float64)
    row = precisebn.report.LayerReport(
        "bn", "BatchNorm1d", 2, 10, 1, z, z + 1, z, z + 1, 1e-5, True, "fast",
        torch.tensor([0.01, 0.03], dtype=torch.float64), torch.tensor([0.019, 0.369], dtype=torch.float64),
    )  # fmt: skip
    assert row.se_var_median == pytest.approx(0.194) and row.se_mean_median == pytest.approx(0.02)


def test_reports_and_statistics_compare_by_value() -> None:
    """``==`` raised on a Report, a LayerReport, PopulationStats and LayerStats of more than one channel (the
    generated equality compared tensors element by element, a probe). Equal now when the statistics and their
    provenance are (the wall time aside), unequal when a value differs; a layer never reached (NaN) equals itself."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3), torch.nn.BatchNorm1d(3))
    data = [torch.randn(5, 3) for _ in range(3)]
    forward = lambda m, x: m[:2](x)  # noqa: E731 (the last layer is never reached: NaN statistics)
    s1, s2 = precisebn.estimate(model, data, forward=forward), precisebn.estimate(model, data, forward=forward)
    assert s1 == s2 and s1["2"] == s2["2"] and not s1["2"].reached
    assert hash(s1["1"]) == hash(s2["1"])
    other = precisebn.estimate(model, data[:2], forward=forward)
    assert s1 != other and s1["1"] != other["1"]
    r1 = precisebn.recalibrate(copy.deepcopy(model), data, forward=forward)
    r2 = precisebn.recalibrate(copy.deepcopy(model), data, forward=forward)
    assert r1 == r2 and r1["1"] == r2["1"] and dict(r1) == dict(r2)
    assert r1 != precisebn.recalibrate(copy.deepcopy(model), data[:2], forward=forward)


@pytest.mark.parametrize("adapt", ["var", "mean", "both"])
def test_the_footer_states_only_the_standard_errors_that_are_known(adapt: str) -> None:
    """Found by a probe: with adapt="var" (the means not written: their error unknown, NaN) the footer read
    "the means ±nanσ at worst" — or not, as max() over a NaN depends on the layers' order."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm1d(3), nn.BatchNorm1d(3))
    r = precisebn.recalibrate(model, [torch.randn(8, 3) + 2 for _ in range(4)], adapt=adapt)
    footer = str(r).splitlines()[-1]
    assert "nan" not in footer.lower()
    means = max(row.se_mean_median for row in r.layers) if adapt != "var" else None
    if adapt == "mean":
        said = f"median standard error of the new means (jackknife over batches): the means ±{means:.2g}σ at worst"
        assert footer == said
        return
    worst = max(r.layers, key=lambda row: row.se_var_median)
    assert footer.startswith(
        "±var: median standard error of the new variance (jackknife over batches); "
        f"worst layer {worst.name!r} ±{100 * worst.se_var_median:.2g}%"
    )
    assert footer.endswith(f", the means ±{means:.2g}σ at worst" if means is not None else "%")


def test_a_report_written_to_a_full_disk_names_the_file(tmp_path) -> None:
    """Probe 41: Report.to_json and Report.plot on a full disk (a file size limit here) raised an OSError of no
    file, as PopulationStats.save did before probe 37; every atomic write now names the file asked for."""
    import resource

    model = nn.Sequential(nn.BatchNorm1d(64))
    report = precisebn.recalibrate(model, [torch.randn(8, 64) for _ in range(3)])
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1000, hard))  # (Python ignores SIGXFSZ: writes fail with EFBIG)
    try:
        for write, name in ((report.to_json, "r.json"), (report.plot, "r.png")):
            with pytest.raises(OSError) as caught:
                write(tmp_path / name)
            assert caught.value.filename == str(tmp_path / name)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # (no partial file, no temporary)


def test_mean_errors_median_with_adapt_mean_is_over_the_channels_the_data_vary_in() -> None:
    """With adapt="mean" the kept variance is no guide to which channels vary in the data (probe 47): a channel
    constant in the new data (error 0) where the kept variance is positive was counted in the median, and one
    that varies where the kept variance is 0 left out — "the means ±0.0073σ" where the median is 0.017σ."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm2d(6))
    with torch.no_grad():
        model[0].running_var.copy_(torch.tensor([4.0, 4.0, 4.0, 0.0, 4.0, 4.0]))
    batches = []
    for _ in range(10):  # fewer than 16 batches: each its own fold
        x = torch.randn(8, 6, 4, 4, dtype=torch.float64)
        x[:, 4:] = 2.0  # constant in the new data, kept variance 4
        batches.append(x)
    model.double()
    row = precisebn.recalibrate(model, batches, num_samples="all", adapt="mean")["0"]
    # the delete-one-batch jackknife of each channel's mean, in float64, in the kept σ sqrt(var + eps)
    values = [b.transpose(0, 1).reshape(6, -1) for b in batches]
    without = torch.stack([torch.cat(values[:k] + values[k + 1 :], 1).mean(1) for k in range(len(values))])
    k = len(values)
    se = ((k - 1) / k * (without - without.mean(0)).square().sum(0)).sqrt()
    kept = torch.tensor([4.0, 4.0, 4.0, 0.0, 4.0, 4.0], dtype=torch.float64)
    se_kept = se / (kept + model[0].eps).sqrt()
    varies = torch.cat(values, 1).var(1) > 0
    truth = float(se_kept[varies].quantile(0.5))
    assert varies.tolist() == [True, True, True, True, False, False]
    assert row.se_mean_median == pytest.approx(truth, rel=1e-6)
    assert f"the means ±{truth:.2g}σ at worst" in str(precisebn.Report([row], 80, 10, 0.0, "norm"))
