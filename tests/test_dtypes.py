"""Exact for every floating dtype a layer may hold, on every capture path and entry point.

Each case compares with the float64 statistics of the layer's actual inputs, computed here
(``conftest.compute_truth``): float64 layers within 1e-12, float32 within 1e-5, float16 and
bfloat16 within one rounding of their dtype.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import precisebn
from conftest import compute_truth, max_rel_error
from precisebn.compat import update_bn, update_bn_stats
from precisebn.errors import PreciseBNWarning

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]


def tolerance(dtype: torch.dtype) -> float:
    """float64 1e-12, float32 1e-5; half types: one rounding (a unit in the last place)."""
    return {torch.float64: 1e-12, torch.float32: 1e-5}.get(dtype, torch.finfo(dtype).eps)


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3)
        self.bn = nn.BatchNorm2d(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x))


class CalledTwice(nn.Module):
    """One layer called several times per forward, with different inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3)
        self.bn = nn.BatchNorm2d(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)
        return self.bn(h).sum() + self.bn(h * 3 + 2).sum() + self.bn(h[:, :, :2]).sum()


class SharedByTwoParents(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        bn = nn.BatchNorm2d(6)
        self.a = nn.Sequential(nn.Conv2d(3, 6, 3), bn)
        self.b = nn.Sequential(nn.Conv2d(3, 6, 1), bn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x).sum() + self.b(x).sum()


class Instance(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(3, 6, 1)
        self.norm = nn.InstanceNorm1d(6, track_running_stats=True, affine=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.conv(x.flatten(2)))


STRUCTURES = {"plain": Plain, "called_twice": CalledTwice, "shared": SharedByTwoParents, "instance": Instance}


def build(structure: str, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return STRUCTURES[structure]().to(dtype)


def batches(dtype: torch.dtype, sizes: tuple[int, ...] = (4, 2, 5), offset: float = 3.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(n, 3, 6, 6, generator=g, dtype=torch.float64) * 2 + offset).to(dtype) for n in sizes]


def assert_exact(model: nn.Module, truth: dict, dtype: torch.dtype) -> None:
    assert truth, "no layer selected"
    tol = tolerance(dtype)
    for name, t in truth.items():
        layer = model.get_submodule(name)
        assert layer.running_mean.dtype == dtype
        scale = torch.maximum(t.mean.abs(), t.var.sqrt())
        assert max_rel_error(layer.running_mean, t.mean, scale) <= tol, (name, dtype)
        assert max_rel_error(layer.running_var, t.var) <= tol, (name, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("structure", list(STRUCTURES))
@pytest.mark.parametrize("mode", ["norm", "train"])
def test_recalibrate_every_dtype(structure: str, dtype: torch.dtype, mode: str) -> None:
    model, data = build(structure, dtype), batches(dtype)
    truth = compute_truth(model, data, mode=mode)
    report = precisebn.recalibrate(model, data, mode=mode)
    assert_exact(model, truth, dtype)
    expected_calls = {"called_twice": 3 * len(data), "shared": 2 * len(data)}.get(structure, len(data))
    assert [r.calls for r in report.layers] == [expected_calls]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("structure", ["plain", "called_twice", "shared"])
def test_compat_functions_every_dtype(structure: str, dtype: torch.dtype) -> None:
    data = batches(dtype)
    model = build(structure, dtype).train()
    truth = compute_truth(model, data, mode="keep")
    update_bn_stats(model, data, num_iters=len(data))
    assert_exact(model, truth, dtype)

    model = build(structure, dtype)
    truth = compute_truth(model, data, mode="train")
    update_bn([(x, torch.zeros(len(x))) for x in data], model)
    assert_exact(model, truth, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_estimate_leaves_every_dtype_untouched_and_matches(dtype: torch.dtype) -> None:
    model, data = build("called_twice", dtype), batches(dtype)
    before = copy.deepcopy(model.state_dict())
    stats = precisebn.estimate(model, data)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    truth = compute_truth(model, data)["bn"]
    scale = torch.maximum(truth.mean.abs(), truth.var.sqrt())
    # float64 statistics: half-precision and float64 layers are reduced in float64 (no rounding of
    # their dtype); float32 layers carry the float32 rounding of each batch's figures
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    assert max_rel_error(stats["bn"].mean, truth.mean, scale) <= tol
    assert max_rel_error(stats["bn"].var, truth.var) <= tol


def test_float64_example_from_the_issue() -> None:
    """Two batches [[0],[2]] and [[10],[12]]: mean 6, population variance 26."""
    bn = nn.BatchNorm1d(1).double()
    data = [torch.tensor([[0.0], [2.0]], dtype=torch.float64), torch.tensor([[10.0], [12.0]], dtype=torch.float64)]
    precisebn.recalibrate(bn, data)
    values = torch.cat(data)
    assert bn.running_mean.item() == values.mean().item() == 6.0
    assert bn.running_var.item() == values.var(unbiased=False).item() == 26.0


@settings(max_examples=30, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    structure=st.sampled_from(list(STRUCTURES)),
    sizes=st.lists(st.integers(2, 6), min_size=1, max_size=5).map(tuple),
    offset=st.floats(-50, 50),
    mode=st.sampled_from(["norm", "train"]),
)
def test_any_split_any_dtype(
    dtype: torch.dtype, structure: str, sizes: tuple[int, ...], offset: float, mode: str
) -> None:
    model, data = build(structure, dtype), batches(dtype, sizes, offset)
    truth = compute_truth(model, data, mode=mode)
    precisebn.recalibrate(model, data, mode=mode)
    assert_exact(model, truth, dtype)


def test_float64_figures_far_from_0_are_checked_on_every_channel_and_warned_of() -> None:
    """Found by probe 33a: torch's CPU kernel sums a float64 NCHW input in float64, rounding each channel's mean
    by about √n·2⁻⁵³·|mean| — far more than one rounding. Checked on a few spread channels (near 0 here), a
    float64 layer's figures were 2e-9 σ off on its channels at |mean|/σ = 1e5, 20 times the 1e-10 the README
    holds float64 buffers to, unwarned. The verifying batch checks every channel now (the layer is measured in
    float64, exactly); later calls with more values or further from 0 are read at any size, as before (treated
    like channels_last float32, float64 layers with a transformed or later-changed input were refused, probe
    34a), and the warning at the end estimates their kernel's rounding."""
    torch.manual_seed(0)
    far = torch.tensor([0.0, 1e5] * 4, dtype=torch.float64).view(1, 8, 1, 1)
    data = [torch.randn(16, 8, 64, 64, dtype=torch.float64) + far for _ in range(2)]
    model = nn.Sequential(nn.BatchNorm2d(8).double())
    truth = compute_truth(model, data)["0"]
    stats = precisebn.estimate(model, data, num_samples="all")["0"]
    assert stats.count == truth.count
    assert max_rel_error(stats.mean, truth.mean, truth.var.sqrt()) <= 1e-10
    assert max_rel_error(stats.var, truth.var) <= 1e-10
    # a small first batch near 0... then 4096 times as many values per channel, read through their figures: warned
    later = [torch.randn(1, 8, 4, 4, dtype=torch.float64) + 1e5] + [
        torch.randn(16, 8, 64, 64, dtype=torch.float64) + 1e5 for _ in range(2)
    ]
    with pytest.warns(PreciseBNWarning, match=r"layer\(s\) '0' \(\|mean\|/σ up to"):
        precisebn.estimate(model, later, num_samples="all")


class _Doubled(nn.BatchNorm2d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x * 2.0)


class _ChangedLater(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)
        y = self.bn(h)
        h.relu_()  # (what the layer normalised, changed in place after its call)
        return y


@pytest.mark.parametrize("model", [nn.Sequential(_Doubled(3)), _ChangedLater()], ids=["transformed", "changed later"])
def test_float64_layers_whose_input_is_not_at_hand_later_are_measured(model: nn.Module) -> None:
    """Found by probe 34a in a first fix of the above that read float64 inputs like channels_last float32 ones:
    a later batch slightly further from 0 than the first was beyond what it vouched for, and a float64 layer
    normalising a transform of its input (``super().forward(x * 2)``, the README's example), or whose input the
    model changed in place after the call, was refused where it had been exact."""
    torch.manual_seed(0)
    model = model.double()
    data = [torch.randn(8, 3, 16, 16, dtype=torch.float64) + 30 * k for k in range(8)]
    truth = compute_truth(model, data)
    name = "0" if "0" in truth else "bn"
    scale = 2.0 if name == "0" else 1.0  # (the statistics of what it normalises: its input times 2)
    mean, var = truth[name].mean * scale, truth[name].var * scale**2
    stats = precisebn.estimate(model, data, num_samples="all")[name]
    assert stats.count == truth[name].count
    assert max_rel_error(stats.mean, mean, var.sqrt()) <= 1e-10
    assert max_rel_error(stats.var, var) <= 1e-10
