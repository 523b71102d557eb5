"""Figures: ``Report.plot`` / ``plot_report`` / ``plot_demo``, and the hint when matplotlib is missing."""

from __future__ import annotations

import sys

import pytest
import torch

import precisebn
from precisebn.cli import main
from precisebn.errors import MissingDependencyError
from precisebn.plotting import plot_demo, plot_report

pytest.importorskip("matplotlib")


@pytest.fixture
def report() -> precisebn.Report:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(), torch.nn.BatchNorm2d(4)
    )
    return precisebn.recalibrate(model, [torch.randn(4, 3, 8, 8) * 3 + 2 for _ in range(3)])


def test_report_plot_saves_a_png(report, tmp_path):
    path = tmp_path / "sub" / "report.png"
    fig = report.plot(path)
    assert path.read_bytes().startswith(b"\x89PNG")
    top, bottom = fig.axes[:2]
    heights = [bar.get_height() for bar in top.patches]
    assert heights == pytest.approx([r.mean_shift for r in report.layers])
    (ratio,) = [line for line in bottom.lines if line.get_label() == "var new/old"]
    assert list(ratio.get_ydata()) == pytest.approx([r.var_ratio for r in report.layers])
    median_bars = bottom.containers[-1]  # the standard errors: median channel (and the worst, thinner)
    segments = median_bars.lines[2][0].get_segments()
    expected = [r.var_ratio * r.se_var_median for r in report.layers]
    assert [abs(seg[1][1] - seg[0][1]) / 2 for seg in segments] == pytest.approx(expected)
    assert [t.get_text() for t in bottom.get_xticklabels()] == ["1", "3"]
    assert sorted(p.name for p in path.parent.iterdir()) == ["report.png"]  # no temporary file left


@pytest.mark.parametrize(
    ("name", "magic"), [("r.pdf", b"%PDF"), ("r.svg", b"<?xml"), ("r", b"\x89PNG"), ("r.xyz", b"\x89PNG")]
)
def test_the_figure_is_saved_in_the_format_its_extension_names(report, tmp_path, name, magic):
    """A .pdf or .svg name got a PNG (a probe); an unknown or missing extension still gets one."""
    report.plot(tmp_path / name)
    assert (tmp_path / name).read_bytes().startswith(magic)


def test_plot_report_on_given_axes(report):
    from matplotlib.figure import Figure

    fig = Figure()
    ax = fig.subplots()
    assert plot_report(report, ax) is fig
    assert len(ax.patches) == len(report.layers)
    assert len(fig.axes) == 2  # the variance ratio on a twin axis


def test_report_to_json_roundtrip(report, tmp_path):
    import json

    path = tmp_path / "r.json"
    report.to_json(path)
    assert json.loads(path.read_text()) == json.loads(json.dumps(report.to_dict()))


def test_plot_demo(tmp_path):
    results = {
        "config": {"seed": 0},
        "validation_curve": {"epoch": [1, 2, 3], "ema": [0.4, 0.8, 0.6], "precise": [0.8, 0.9, 0.95]},
        "weight_averaging": {"epochs_averaged": [2, 3], "stale": 0.7, "recalibrated": 0.97},
        "domain_shift": {"contrast": 0.5, "brightness": 0.4, "clean": 0.97, "training_stats": 0.2, "adapted": 0.9},
    }
    fig = plot_demo(results, tmp_path / "demo.png")
    assert (tmp_path / "demo.png").read_bytes().startswith(b"\x89PNG")
    curve, swa, shift = fig.axes
    assert list(curve.lines[0].get_ydata()) == pytest.approx([40, 80, 60])
    assert [b.get_height() for b in swa.patches] == pytest.approx([70, 97])
    assert [b.get_height() for b in shift.patches] == pytest.approx([97, 20, 90])


@pytest.fixture
def no_matplotlib(monkeypatch):
    for name in list(sys.modules):
        if name == "matplotlib" or name.startswith("matplotlib."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError


def test_missing_matplotlib_gives_the_pip_hint(report, tmp_path, no_matplotlib):
    with pytest.raises(MissingDependencyError, match=r"pip install 'precisebn\[plot\]'"):
        report.plot(tmp_path / "r.png")
    assert list(tmp_path.iterdir()) == []


def test_cli_without_matplotlib_fails_before_work(tmp_path, capsys, no_matplotlib):
    assert main(["demo", "--quick", "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "pip install 'precisebn[plot]'" in err and "--no-plot" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()
