"""Exactness of the captured statistics for every kind of layer, against the float64 truth."""

from __future__ import annotations

import copy
import itertools
import re

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings
from torch import nn

import precisebn
from conftest import assert_warned_ratio, compute_truth, max_rel_error
from precisebn.errors import InvalidArgumentError

TOL = 1e-5  # the contract for float32 layers


def check_against_truth(stats: precisebn.PopulationStats, truth: dict, tol: float = TOL) -> None:
    assert set(stats) == set(truth)
    for name, t in truth.items():
        s = stats[name]
        assert s.count == t.count, name
        assert s.calls == t.calls, name
        scale = torch.maximum(t.mean.abs(), t.var.sqrt())
        assert max_rel_error(s.mean, t.mean, scale) <= tol, name
        assert max_rel_error(s.var, t.var) <= tol, name


class BNAct(nn.BatchNorm2d):
    """A BatchNorm + activation subclass that overrides forward (timm's BatchNormAct2d style)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        x = nn.functional.batch_norm(
            x, self.running_mean, self.running_var, self.weight, self.bias, self.training, factor, self.eps
        )
        return torch.relu(x)


class Zoo(nn.Module):
    """One of every supported layer kind, some called twice per forward."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.bn2d = nn.BatchNorm2d(6)
        self.act = BNAct(6)
        self.sync = nn.SyncBatchNorm(6)
        self.in2d = nn.InstanceNorm2d(6, track_running_stats=True, affine=True)
        self.in1d = nn.InstanceNorm1d(6, track_running_stats=True)
        self.bn1d_ncl = nn.BatchNorm1d(6)
        self.conv3 = nn.Conv3d(6, 4, 1)
        self.bn3d = nn.BatchNorm3d(4)
        self.in3d = nn.InstanceNorm3d(4, track_running_stats=True)
        self.lazy = nn.LazyBatchNorm1d()
        self.bn1d = nn.BatchNorm1d(4, momentum=None)
        self.plain = nn.BatchNorm1d(4, track_running_stats=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn2d(self.conv(x))
        y = self.bn2d(y * 1.5 + 0.5)  # called twice
        y = self.act(y)
        y = self.sync(y)
        y = self.in2d(y)
        seq = self.in1d(y.flatten(2))  # (N, C, L)
        seq = self.bn1d_ncl(seq * 2 - 1)
        vol = self.bn3d(self.conv3(seq.view_as(y).unsqueeze(2).expand(-1, -1, 2, -1, -1)))
        vol = self.in3d(vol)
        v = vol.mean((2, 3, 4))
        v = self.lazy(v)
        return self.plain(self.bn1d(v) + self.bn1d(v * 3))  # bn1d called twice


def make_zoo() -> Zoo:
    torch.manual_seed(0)
    model = Zoo()
    model(torch.randn(2, 3, 5, 5))  # initialises the lazy layer
    return model


def test_every_layer_kind_matches_truth() -> None:
    model = make_zoo()
    batches = [torch.randn(n, 3, 5, 5) * 2 + 3 for n in (4, 8, 2, 16, 5, 3)]
    truth = compute_truth(model, batches, select=lambda n, m: n != "plain")
    stats = precisebn.estimate(model, batches, num_samples="all")
    check_against_truth(stats, truth)
    assert stats["bn2d"].calls == 12 and stats["bn1d"].calls == 12
    assert "plain" not in stats


def test_capture_paths_are_verified_not_guessed_from_the_class() -> None:
    model = make_zoo()
    batches = [torch.randn(n, 3, 5, 5) * 2 + 3 for n in (4, 8, 2)]
    paths = {name: s.path for name, s in precisebn.estimate(model, batches).items()}
    # torch's own layers, SyncBatchNorm in one process and a subclass overriding forward that
    # still leaves the batch figures in its buffers: their own figures, verified
    for name in ("bn2d", "bn3d", "bn1d", "bn1d_ncl", "sync", "act", "lazy"):
        assert paths[name] == "fast", name
    # InstanceNorm's running variance is a mean of per-instance variances: measured in float64
    for name in ("in2d", "in1d", "in3d"):
        assert paths[name] == "float64", name
    forced = precisebn.estimate(model, batches, capture="float64")
    assert {s.path for s in forced.values()} == {"float64"}


@pytest.mark.parametrize("path", ["auto", "float64"])
def test_both_capture_paths_agree_with_truth(path: str) -> None:
    torch.manual_seed(1)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.LazyLinear(5), nn.BatchNorm1d(5)
    )
    model(torch.randn(2, 3, 6, 6))
    batches = [torch.randn(n, 3, 6, 6) for n in (3, 7, 2)]
    truth = compute_truth(model, batches)
    stats = precisebn.estimate(model, batches, capture=path)
    check_against_truth(stats, truth)


def test_unbatched_instance_norm_input() -> None:
    layer = nn.InstanceNorm1d(3, track_running_stats=True)
    batches = [torch.randn(3, 10) + 4, torch.randn(3, 7) - 1]  # (C, L): no batch dimension

    truth = compute_truth(layer, batches, forward=lambda m, b: m(b))
    stats = precisebn.estimate(layer, batches, num_batches=2, forward=lambda m, b: m(b))
    assert stats[""].count == 17
    check_against_truth(stats, truth)


def test_many_distinct_batch_sizes() -> None:
    # more distinct per-layer count combinations than the collector keeps on the device
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 6), nn.BatchNorm1d(6))
    batches = [torch.randn(n, 4) * 5 + 2 for n in [*range(2, 40), *range(39, 1, -3)]]
    truth = compute_truth(model, batches)
    check_against_truth(precisebn.estimate(model, batches, num_samples="all"), truth)


def test_large_mean_over_std_float32() -> None:
    # |mean|/std = 1e4 in float32: fvcore's E[x²]−E[x]² is off by ~1,700 % here.
    torch.manual_seed(3)
    layer = nn.BatchNorm1d(8)
    batches = [(torch.randn(32, 8, dtype=torch.float64) + 1e4).float() for _ in range(20)]
    truth = compute_truth(layer, batches)[""]
    stats = precisebn.estimate(layer, batches)[""]
    assert max_rel_error(stats.mean, truth.mean) <= 1e-5
    assert max_rel_error(stats.var, truth.var) <= 1e-3


def _sixteen_channels(offset: float, std: float, dead: bool = False) -> list[torch.Tensor]:
    """Batches for a BatchNorm1d(16) whose channel 7, one the CPU check does not sample (it takes
    channels 0, 5, 10, 15), has mean ``offset`` and standard deviation ``std``; channel 3 is
    constant 0 if ``dead``."""
    g = torch.Generator().manual_seed(11)
    out = []
    for _ in range(10):
        x = torch.randn(32, 16, generator=g, dtype=torch.float64)
        x[:, 7] = x[:, 7] * std + offset
        if dead:
            x[:, 3] = 0.0
        out.append(x.float())
    return out


def test_an_unchecked_channel_with_a_huge_mean_moves_the_layer_to_float64() -> None:
    """|mean|/std = 1e6 on an unsampled channel: float32 batch figures are far off there; the
    rounding term, taken over every channel, catches it and the layer is measured in float64."""
    layer = nn.BatchNorm1d(16)
    control = precisebn.estimate(layer, _sixteen_channels(0.0, 1.0))[""]
    assert control.path == "fast"  # the same layer keeps its own figures without the offset
    batches = _sixteen_channels(1e5, 0.1)
    truth = compute_truth(layer, batches)[""]
    stats = precisebn.estimate(layer, batches)[""]
    assert stats.path == "float64"
    assert max_rel_error(stats.mean, truth.mean) <= 1e-12
    assert max_rel_error(stats.var, truth.var) <= 1e-9


def test_a_loose_rounding_bound_is_computed_exactly_before_leaving_the_fast_path() -> None:
    """Channel 7 has |mean| = 200 (std 1) and channel 3 is constant: the bound from the figures'
    extremes (200² / eps) is too loose, the exact term (200² / 1) is not, so the layer keeps its
    own figures, within the float32 tolerance — and is warned of: at |mean|/σ ≈ 190 the rounding of each batch's
    float32 mean could move the variance by up to 2.3e-5 (here it did not)."""
    layer = nn.BatchNorm1d(16)
    batches = _sixteen_channels(200.0, 1.0, dead=True)
    truth = compute_truth(layer, batches)[""]
    with pytest.warns(precisebn.errors.PreciseBNWarning, match=r"'' \(\|mean\|/σ up to") as caught:
        stats = precisebn.estimate(layer, batches)[""]
    assert_warned_ratio(caught, truth, layer.eps)
    assert stats.path == "fast"
    scale = torch.maximum(truth.mean.abs(), truth.var.sqrt())
    assert max_rel_error(stats.mean, truth.mean, scale) <= 1e-5
    live = torch.arange(16) != 3
    assert max_rel_error(stats.var[live], truth.var[live]) <= 1e-5
    assert float(stats.var[3]) == 0.0


def test_tiny_batches_and_huge_offset_never_negative() -> None:
    torch.manual_seed(4)
    layer = nn.BatchNorm1d(4)
    batches = [(torch.randn(2, 4, dtype=torch.float64) * 1e-2 + 1e4).float() for _ in range(50)]
    stats = precisebn.estimate(layer, batches)[""]
    assert bool((stats.var > 0).all())
    truth = compute_truth(layer, batches)[""]
    assert max_rel_error(stats.mean, truth.mean) <= 1e-5
    # |mean|/std = 1e6: float32 batch means carry ~1e-3 std of rounding; still within a few %
    assert max_rel_error(stats.var, truth.var) <= 0.1
    exact = precisebn.estimate(layer, batches, capture="float64")[""]
    assert max_rel_error(exact.var, truth.var) <= 1e-9


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_models(dtype: torch.dtype) -> None:
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 4), nn.BatchNorm1d(4)).to(dtype)
    batches = [(torch.randn(16, 6) * 2 + 1).to(dtype) for _ in range(6)]
    truth = compute_truth(model, batches)
    report = precisebn.recalibrate(model, batches)
    eps = torch.finfo(dtype).eps
    for name, t in truth.items():
        layer = model.get_submodule(name)
        assert layer.running_mean.dtype == dtype
        scale = torch.maximum(t.mean.abs(), t.var.sqrt())
        # the stored value is the exact statistic rounded once to the buffer's dtype
        assert max_rel_error(layer.running_mean, t.mean, scale) <= eps
        assert max_rel_error(layer.running_var, t.var) <= eps
        assert report[name].count == t.count


@settings(max_examples=25, deadline=None)
@given(
    cuts=st.lists(st.integers(1, 47), min_size=0, max_size=6, unique=True),
    seed=st.integers(0, 1000),
    reverse=st.booleans(),
)
def test_invariant_to_batch_split_and_order(cuts: list[int], seed: int, reverse: bool) -> None:
    """The same 48 samples, split into batches anywhere and in any order, give the same statistics."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randn(48, 5, 3, generator=g) * 4 + 10
    layer = nn.BatchNorm1d(5)
    bounds = [0, *sorted(cuts), 48]
    batches = [data[a:b] for a, b in itertools.pairwise(bounds)]  # (n, 5, 3): 3n values per channel
    if reverse:
        batches = batches[::-1]
    whole = precisebn.estimate(layer, [data])[""]
    split = precisebn.estimate(layer, batches)[""]
    truth = compute_truth(layer, [data])[""]
    assert split.count == whole.count == truth.count == 48 * 3
    assert max_rel_error(split.mean, whole.mean, truth.var.sqrt()) <= 1e-6
    assert max_rel_error(split.var, whole.var) <= 1e-6
    assert max_rel_error(split.var, truth.var) <= TOL


class Late(nn.Module):
    """Calls ``early`` in the first forward, ``late`` in the others."""

    def __init__(self) -> None:
        super().__init__()
        self.early, self.late = nn.BatchNorm1d(4), nn.BatchNorm1d(4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.early(x) if self.calls == 1 else self.late(x)


def test_layer_first_reached_late_with_a_large_mean() -> None:
    """The float64 shift of a channel is the first batch's figure; a layer not reached then
    keeps shift 0, which must still meet the |mean|/std = 1e4 target."""
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(32, 4, generator=g, dtype=torch.float64) + 1e4).float() for _ in range(20)]
    late = precisebn.estimate(Late(), batches)["late"]
    truth = compute_truth(nn.BatchNorm1d(4), batches[1:])[""]
    assert late.count == 19 * 32
    assert max_rel_error(late.mean, truth.mean) <= 1e-5
    assert max_rel_error(late.var, truth.var) <= 1e-3


@pytest.mark.parametrize("stale", [-1e8, float("nan"), float("inf")])
def test_layer_first_reached_late_with_stale_statistics_of_its_own(stale: float) -> None:
    """The passes start each layer's scratch from its own statistics (what code reading them
    before the layer's call must see); a layer not reached in the first batch still gets
    shift 0 — a stale mean of -1e8 as its shift would leave nothing of the variance, and NaN
    or Inf, times a count of 0, would poison its sums."""
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(32, 4, generator=g) * 2 + 3 for _ in range(6)]
    model = Late()
    model.late.running_mean.fill_(stale)
    model.late.running_var.fill_(abs(stale))
    stats = precisebn.estimate(model, batches)
    truth = {"early": compute_truth(nn.BatchNorm1d(4), batches[:1])[""]}
    truth["late"] = compute_truth(nn.BatchNorm1d(4), batches[1:])[""]
    truth["late"].calls = 5
    check_against_truth(stats, truth)
    assert stats["late"].path == "fast"


class SwitchesToEval(nn.Module):
    """Puts its BatchNorm layer in eval mode at the given forward (1-based)."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(3)
        self.at, self.calls = at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at:
            self.bn.eval()
        return self.bn(x)


@pytest.mark.parametrize("at", [1, 3], ids=["verifying batch", "fast path"])
def test_a_layer_switched_to_eval_during_the_passes_is_refused_by_name(at: int) -> None:
    model = SwitchesToEval(at)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batches = [torch.randn(8, 3) for _ in range(5)]
    with pytest.raises(InvalidArgumentError, match=r"layer 'bn' was switched to eval mode"):
        precisebn.recalibrate(model, batches)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model.bn.training  # the flags the model had are back


@pytest.mark.parametrize("mode", ["norm", "train"])
@pytest.mark.parametrize("at", [1, 3], ids=["verifying batch", "fast path"])
def test_a_model_put_in_training_mode_during_the_passes_is_refused_by_name(at: int, mode: str) -> None:
    """Probe 37: model.train() in forward was not refused (model.eval() is, by the layer it switches): the
    dropout and the normalization layer left out ran as in training, and the selected layer measured other
    inputs than its mode gives (0.59 σ and 3.5 times off in the probe), reported "updated"."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm1d(3), nn.Dropout(0.5), nn.Linear(3, 3), nn.BatchNorm1d(3))
    batches = [torch.randn(8, 3) * 2 + 1 for _ in range(5)]
    calls = []

    def forward(m: nn.Module, x: torch.Tensor) -> None:
        calls.append(x)
        if len(calls) == at:
            m.train()
        m(x)

    before = {k: v.clone() for k, v in model.state_dict().items()}
    flags = [m.training for m in model.modules()]
    with pytest.raises(
        InvalidArgumentError, match=r"module '(\(the model\)|0)' \((Sequential|BatchNorm1d)\) was put in training"
    ) as caught:
        precisebn.recalibrate(model, batches, layers=["3"], mode=mode, forward=forward)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert [m.training for m in model.modules()] == flags
    # (probe 43c: it also suggested mode='keep', which recalibrate refuses) every mode it names is one to pass
    assert set(re.findall(r"mode='(\w+)'", str(caught.value))) == {"train"}


class TakesADict(nn.BatchNorm1d):
    def forward(self, inputs: dict) -> torch.Tensor:  # type: ignore[override]
        return super().forward(inputs["x"])


def test_a_layer_called_without_a_tensor_is_refused_by_name() -> None:
    model = nn.Sequential()
    model.add_module("norm", TakesADict(3))
    with pytest.raises(InvalidArgumentError, match=r"layer 'norm' was called without a tensor input \(dict\)"):
        precisebn.recalibrate(model, [{"x": torch.randn(4, 3)}], forward=lambda m, b: m.norm(b))


def test_keyword_calls_are_measured_on_both_paths() -> None:
    """``bn(input=x)``: routed through the full checks on every batch, verifying and fast."""

    class Keyword(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn = nn.BatchNorm1d(3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.bn(input=x)

    g = torch.Generator().manual_seed(5)
    batches = [torch.randn(8, 3, generator=g) * 2 + 1 for _ in range(5)]
    stats = precisebn.estimate(Keyword(), batches)["bn"]
    values = torch.cat(batches).double()  # what the layer normalised: its inputs, (40, 3)
    assert stats.path == "fast" and stats.count == 40
    assert max_rel_error(stats.mean, values.mean(0), values.var(0).sqrt()) <= 1e-6
    assert max_rel_error(stats.var, values.var(0, correction=0)) <= TOL


# -- code that reads a layer's running buffers during the passes -------------------------------


class ReadsRunningStd(nn.Module):
    """Scales the conv's output by the BatchNorm's running std before calling it, like the
    weight folding of torch.ao's QAT ConvBn2d: what the layer receives depends on its own
    running statistics, which must be the model's while it is measured."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        with torch.no_grad():
            self.bn.running_mean.copy_(torch.tensor([0.5, -1.0, 2.0, 0.0]))
            self.bn.running_var.copy_(torch.tensor([4.0, 0.25, 9.0, 1.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        std = (self.bn.running_var + self.bn.eps).sqrt() + self.bn.running_mean.abs()
        return self.bn(self.conv(x) * std[None, :, None, None])


def frozen_truth(model: nn.Module, batches: list, **kw) -> dict:
    """The float64 truth with every BatchNorm's statistics held where the model has them
    (momentum 0 in the copy the truth runs on): what the model's own forward computes."""
    frozen = copy.deepcopy(model)
    for m in frozen.modules():
        if isinstance(m, nn.modules.batchnorm._NormBase):
            m.momentum = 0.0
    return compute_truth(frozen, batches, **kw)


@pytest.mark.parametrize("capture", ["auto", "float64"])
@pytest.mark.parametrize("mode", ["norm", "train"])
def test_reads_of_running_buffers_during_the_passes_see_the_models_statistics(capture: str, mode: str) -> None:
    """Before, such a read saw precisebn's scratch: zeros and ones in the first batch, then
    the previous batch's figures, and the layer's statistics were those of inputs the model
    never produces (off by up to 8x in the variance here)."""
    model = ReadsRunningStd()
    batches = [torch.randn(4, 3, 8, 8) * 2 + 1 for _ in range(5)]
    truth = frozen_truth(model, batches, mode=mode)
    before = model.bn.running_var.clone()
    stats = precisebn.estimate(model, batches, capture=capture, mode=mode)
    check_against_truth(stats, truth)
    assert torch.equal(model.bn.running_var, before)
    precisebn.recalibrate(model, batches, capture=capture, mode=mode)
    t = truth["bn"]
    assert max_rel_error(model.bn.running_mean, t.mean, t.var.sqrt()) <= TOL
    assert max_rel_error(model.bn.running_var, t.var) <= TOL


def test_qat_conv_bn_is_measured_with_its_own_statistics_folded_in() -> None:
    """torch.ao's QAT ConvBn2d (weight fake-quantised after scaling by the running std)."""
    from torch.ao.nn.intrinsic.qat import ConvBn2d
    from torch.ao.quantization import get_default_qat_qconfig

    torch.manual_seed(0)
    model = nn.Sequential(ConvBn2d(3, 8, 3, qconfig=get_default_qat_qconfig("fbgemm")))
    with torch.no_grad():
        model[0].bn.running_var.uniform_(0.2, 5.0)
        model[0].bn.running_mean.uniform_(-1.0, 1.0)
    batches = [torch.randn(4, 3, 10, 10) for _ in range(4)]
    truth = frozen_truth(model, batches)
    check_against_truth(precisebn.estimate(model, batches), truth)


class InferenceInForward(nn.Module):
    """A forward that runs its layers under ``torch.inference_mode()``."""

    def __init__(self, spatial: bool) -> None:
        super().__init__()
        self.layer = nn.Conv2d(3, 8, 3, padding=1) if spatial else nn.Linear(4, 8)
        self.bn = nn.BatchNorm2d(8) if spatial else nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return self.bn(self.layer(x))


def test_layers_run_in_inference_mode_by_the_forward_are_exact_and_leave_nothing_behind() -> None:
    """Found by a probe: what precisebn kept of a layer's call made in inference mode (its float64 moments, the
    checks' workspace) were inference tensors, written later outside it: a raw "Inplace update to inference
    tensor outside InferenceMode" (an (N, C) layer whose second batch was larger than the first), and the
    workspace kept for the next pass made every later estimate() in the process fail, on any model."""
    from precisebn import spotcheck

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    cases = [
        (InferenceInForward(False), [torch.randn(8, 4, generator=g) + 3, torch.randn(512, 4, generator=g) * 3 + 5]),
        (InferenceInForward(True), [torch.randn(4, 3, 10, 10, generator=g) * 2 + 1 for _ in range(3)]),
    ]
    for model, data in cases:
        truth = compute_truth(model, data)["bn"]
        stats = precisebn.estimate(model, data)["bn"]
        assert max_rel_error(stats.mean, truth.mean, truth.var.sqrt()) <= 1e-5
        assert max_rel_error(stats.var, truth.var) <= 1e-5
        assert not any(w.is_inference() for w in spotcheck._spare)
    plain = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8))  # a later pass on another model
    data = cases[1][1]
    truth = compute_truth(plain, data)["1"]
    stats = precisebn.estimate(plain, data)["1"]
    assert max_rel_error(stats.var, truth.var) <= 1e-5


@pytest.mark.parametrize("mode", ["pass-through TorchDispatchMode", "FlopCounterMode"])
def test_estimate_inside_a_torch_dispatch_mode_is_exact(mode: str) -> None:
    """Found by a probe: inside a TorchDispatchMode (torch's FlopCounterMode, a profiling tool's mode) the reset of
    the layers' counters after each batch bumps no version counter; counted as one, every layer was refused as
    "called 3 times, but its forward computed batch statistics 0 times"."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import FlopCounterMode

    class PassThrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8))
    g = torch.Generator().manual_seed(2)
    data = [torch.randn(4, 3, 10, 10, generator=g) * 2 + 1 for _ in range(3)]
    truth = compute_truth(model, data)
    with PassThrough() if mode.startswith("pass") else FlopCounterMode(display=False):
        stats = precisebn.estimate(model, data)
    for name in ("1", "4"):
        assert stats[name].path == "fast"
        assert max_rel_error(stats[name].mean, truth[name].mean, truth[name].var.sqrt()) <= 1e-5
        assert max_rel_error(stats[name].var, truth[name].var) <= 1e-5


class WarmedUp(nn.BatchNorm2d):
    """Scales its output by a factor that its ``num_batches_tracked`` warms up (as Batch Renormalization's r_max and
    d_max do): 1 at step 0, 3 once trained."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        warm = float(self.num_batches_tracked.clamp(max=1000)) / 1000
        return super().forward(x) * (1 + 2 * warm)


@pytest.mark.parametrize("capture", ["auto", "float64"])
def test_a_forward_reading_its_num_batches_tracked_reads_the_models_count(capture: str) -> None:
    """Probe 37: during the passes a layer's num_batches_tracked read 0 (precisebn's counter, reset every batch), so
    a layer whose forward depends on it ran as at step 0: the next layer was 0.64 σ and 87 % off in the probe,
    reported "updated". It reads the model's own count (and the calls of the batch so far, as in training)."""
    from conftest import compute_truth, max_rel_error

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), WarmedUp(4), nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4))
    model[1].num_batches_tracked.fill_(100_000)
    before = model[1].num_batches_tracked.clone()
    batches = [torch.randn(4, 3, 8, 8) + 1 for _ in range(4)]
    truth = compute_truth(model, batches)["3"]
    stats = precisebn.estimate(model, batches, capture=capture)["3"]
    assert max_rel_error(stats.mean, truth.mean, truth.var.sqrt()) < 1e-6
    assert max_rel_error(stats.var, truth.var) < 1e-6
    assert torch.equal(model[1].num_batches_tracked, before)
