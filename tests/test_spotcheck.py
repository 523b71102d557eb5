"""The CPU check of layers' own float32 figures: its reference against exact moments, its
decisions, and what happens to a call that fails after its input changed."""

from __future__ import annotations

import math

import hypothesis.strategies as st
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from torch import nn

import precisebn
from conftest import BiasedVariance1d, compute_truth, max_rel_error
from precisebn.errors import UnsupportedLayerError
from precisebn.spotcheck import AT_ONCE, SpotChecks, _passes_one, checked_channels, passes, references
from precisebn.watch import TOLERANCE

F32 = TOLERANCE[torch.float32]
UNIT32 = torch.finfo(torch.float32).eps / 2


def exact_moments(row: list[float]) -> tuple[float, float]:
    """Mean and unbiased variance, to float64 rounding (math.fsum, two passes)."""
    n = len(row)
    m = math.fsum(row) / n
    return m, math.fsum((a - m) ** 2 for a in row) / (n - 1)


def channel_rows(x: torch.Tensor) -> torch.Tensor:
    """Every value of each channel (dimension 1), exactly, as float64 rows."""
    return x.double().transpose(0, 1).reshape(x.shape[1], -1)


@settings(max_examples=40, deadline=None)
@given(
    shape=st.sampled_from([(2, 4), (3, 4, 5), (2, 4, 3, 3), (5, 4, 7, 2), (8, 4, 32, 32)]),
    log_offset=st.floats(min_value=-3.0, max_value=5.0),
    log_std=st.floats(min_value=-6.0, max_value=3.0),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    shift=st.sampled_from(["figure", "zero", "far"]),
    seed=st.integers(0, 2**16),
)
def test_the_reference_is_within_its_bounds_whatever_the_shift(shape, log_offset, log_std, dtype, shift, seed) -> None:
    """The reference the check compares figures with, from the sums the workspace makes,
    against the exact moments of what the sample holds: within the bounds it reports, whether
    the shift is the (float32) mean, zero or 100 σ away; and the bounds are small when the
    shift is near the mean, whatever |mean|/σ."""
    g = torch.Generator().manual_seed(seed)
    std = 10**log_std
    if dtype == torch.float16:  # stay finite in float16 (largest 65504)
        std, log_offset = min(std, 10.0), min(log_offset, 3.0)
    x = (torch.randn(*shape, generator=g, dtype=torch.float64) * std + 10**log_offset * std).to(dtype)
    rows = channel_rows(x)
    n = rows.shape[1]
    truth = [exact_moments(rows[c].tolist()) for c in range(shape[1])]
    shifts = {
        "figure": [float(torch.tensor(m, dtype=torch.float32)) for m, _ in truth],
        "zero": [0.0] * shape[1],
        "far": [float(torch.tensor(m + 100 * math.sqrt(v), dtype=torch.float32)) for m, v in truth],
    }[shift]
    refs = references(rows.reshape(-1).clone(), [n] * shape[1], torch.tensor(shifts, dtype=torch.float64))
    for (m, v), (mean, var, bound_mean, bound_var) in zip(truth, zip(*(r.tolist() for r in refs))):
        assert abs(mean - m) <= bound_mean
        assert abs(var - v) <= bound_var
        if shift == "figure":
            scale = v + (m - mean) ** 2 + 1e-300
            assert bound_var <= 5 * (n + 3) * 2.0**-53 * scale * n / (n - 1)


@settings(max_examples=20, deadline=None)
@given(lengths=st.lists(st.sampled_from([2, 3, 7, 64, 500]), min_size=1, max_size=12), seed=st.integers(0, 2**16))
def test_segments_of_any_lengths_in_any_order_each_get_their_own_reference(lengths: list[int], seed: int) -> None:
    """Runs of equal lengths are reduced together as matrix rows: each segment must still get the
    moments of its own values, whatever the lengths and their order."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randn(n, generator=g, dtype=torch.float64) * (k + 1) + 10 * k for k, n in enumerate(lengths)]
    shifts = torch.tensor([float(r.mean()) + 0.5 for r in rows], dtype=torch.float64)
    mean, var, bound_mean, bound_var = references(torch.cat(rows), lengths, shifts)
    for k, r in enumerate(rows):
        m, v = exact_moments(r.tolist())
        assert abs(float(mean[k]) - m) <= float(bound_mean[k])
        assert abs(float(var[k]) - v) <= float(bound_var[k])


def test_the_check_takes_the_reference_bounds_off_its_tolerance() -> None:
    """Figures inside the tolerance by less than the reference's bound fail; by more, pass."""

    def ok(fig_mean: float, fig_var: float, ref: tuple[float, ...]) -> bool:
        f64 = [torch.tensor([v], dtype=torch.float64) for v in (fig_mean, fig_var, *ref)]
        return bool(passes(f64[0], f64[1], tuple(f64[2:]), eps, F32))

    mean, var, eps = 3.0, 2.0, 1e-5
    margin_var, margin_mean = F32 * (var + eps), F32 * math.sqrt(var + eps)
    bound = 0.2 * margin_var
    assert ok(mean, var + margin_var - 2 * bound, (mean, var, 0.0, bound))
    assert not ok(mean, var + margin_var - bound / 2, (mean, var, 0.0, bound))
    bound = 0.2 * margin_mean
    assert ok(mean + margin_mean - 2 * bound, var, (mean, var, bound, 0.0))
    assert not ok(mean + margin_mean - bound / 2, var, (mean, var, bound, 0.0))
    assert not ok(float("nan"), var, (mean, var, 0.0, 0.0))
    assert not ok(mean, float("nan"), (mean, var, 0.0, 0.0))


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def own_figures(x: torch.Tensor) -> torch.Tensor:
    """What torch's BatchNorm leaves in its buffers with momentum 1: (2, C) float32."""
    c = x.shape[1]
    mean, var = torch.zeros(c), torch.ones(c)
    F.batch_norm(x, mean, var, training=True, momentum=1.0)
    return torch.stack([mean, var])


def test_calls_checked_together_pass_and_fail_as_they_should() -> None:
    """Several calls in one workspace: right figures pass, the others fail, each on its own —
    a biased variance, a NaN, a channel outside the checked ones whose |mean|/σ makes float32
    figures unreliable (the rounding term), figures of another tensor."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(8, c, 5, 5, generator=g) * 3 + 1 for c in (3, 16, 7, 9, 11, 4)]
    pairs = [own_figures(x) for x in xs]
    pairs[1][1] *= (200 - 1) / 200  # biased variance (8·5·5 = 200 values per channel)
    pairs[2][0, 0] = float("nan")
    xs[3][:, 1] = xs[3][:, 1] * 1e-3 + 1e4  # |mean|/σ ≈ 3e6 in an unchecked channel of 9
    assert 1 not in range(9)[checked_channels(9)]
    pairs[3] = own_figures(xs[3])
    pairs[4] = own_figures(xs[4] + 0.01)
    checks = SpotChecks(F32, UNIT32)
    for k, (x, pair) in enumerate(zip(xs, pairs)):
        assert checks.room(x.numel() // x.shape[1], x.numel() * 4, x.shape[1])
        checks.add(f"call {k}", k, x, pair, 1e-5, nbytes(x))
    assert len(checks) == 6 and checks.layers == set(range(6))
    assert checks.run() == [(f"call {k}", k in (0, 5)) for k in range(6)]
    assert len(checks) == 0 and not checks.layers and checks.run() == []


def test_a_call_checked_at_once_gets_the_verdict_it_would_get_waiting() -> None:
    """check_now (a large call, nothing held) and run (calls checked together) agree on each
    case of the test above, and check_now works from the tail of a workspace in use and from
    its own when there is no room (a waiting call's values are left as they were)."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(8, c, 5, 5, generator=g) * 3 + 1 for c in (3, 16, 7, 9, 11, 4)]
    pairs = [own_figures(x) for x in xs]
    pairs[1][1] *= (200 - 1) / 200
    pairs[2][0, 0] = float("nan")
    xs[3][:, 1] = xs[3][:, 1] * 1e-3 + 1e4
    pairs[3] = own_figures(xs[3])
    pairs[4] = own_figures(xs[4] + 0.01)
    expected = [k in (0, 5) for k in range(6)]
    for capacity in (100_000, 700):  # room for the call after the waiting one, then none
        checks = SpotChecks(F32, UNIT32, capacity=capacity)
        checks.add("waiting", 0, xs[0], pairs[0], 1e-5, nbytes(xs[0]))
        held = checks._workspace[: checks._used].clone()
        assert [checks.check_now(x, pair, 1e-5) for x, pair in zip(xs, pairs)] == expected
        assert torch.equal(checks._workspace[: checks._used], held) and checks.run() == [("waiting", True)]
    for k, (x, pair) in enumerate(zip(xs, pairs)):
        checks = SpotChecks(F32, UNIT32)
        checks.add(k, k, x, pair, 1e-5, nbytes(x))
        assert checks.run() == [(k, expected[k])]


@settings(max_examples=200, deadline=None)
@given(
    st.integers(2, 5000),
    st.floats(-6, 6),
    st.floats(-4, 3),
    st.sampled_from([0.0, 0.3, 3.0]),
    st.sampled_from([0.0, 0.3, 3.0]),
    st.integers(0, 2**31),
)
def test_one_channel_on_the_host_passes_as_the_tensor_check_does(
    n: int, log_offset: float, log_std: float, off_mean: float, off_var: float, seed: int
) -> None:
    """_passes_one (check_now's host arithmetic) against reference + passes (run's), on figures
    0.3 or 3 tolerances off each way, clear of the boundary (rounding differs in the last bits)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64) * 10**log_std + 10**log_offset
    mean, var = float(x.mean()), float(x.var())
    shift = float(torch.tensor(mean, dtype=torch.float32))
    shifted = x - shift
    s1, s2 = float(shifted.sum()), float(shifted.square().sum())
    fm = mean + off_mean * F32 * math.sqrt(var + 1e-5)
    fv = var + off_var * F32 * (var + 1e-5)
    f64 = lambda v: torch.tensor([v], dtype=torch.float64)  # noqa: E731
    refs = references(x.clone(), [n], f64(shift))  # (shifts the values itself)
    expected = bool(passes(f64(fm), f64(fv), refs, 1e-5, F32).all())
    assert _passes_one(fm, fv, shift, s1, s2, n, 1e-5, F32) == expected


@pytest.mark.parametrize("n", [0, 1])
def test_fewer_than_two_values_fail_on_the_host_as_in_the_tensor_check(n: int) -> None:
    """An empty call, or one value per channel: the tensor check's variance is NaN or
    infinite, so it fails; the host arithmetic fails too rather than dividing by zero."""
    x = torch.full((n,), 3.0, dtype=torch.float64)
    f64 = lambda v: torch.tensor([v], dtype=torch.float64)  # noqa: E731
    refs = references(x.clone(), [n], f64(3.0))
    assert not bool(passes(f64(3.0), f64(0.0), refs, 1e-5, F32).all())
    assert not _passes_one(3.0, 0.0, 3.0, float(x.sum() - 3.0 * n), 0.0, n, 1e-5, F32)


def test_large_inputs_are_checked_at_once_and_not_held(monkeypatch) -> None:
    """Inputs above AT_ONCE are checked as their call returns: none waits (held inputs make
    the forward passes after them take fresh memory). A failing one is redone in float64 at
    once, so that a later in-place change of its input no longer matters (compare the test
    below, where the input waits), and every layer matches its float64 truth."""
    waited = []
    add = SpotChecks.add
    monkeypatch.setattr(SpotChecks, "add", lambda self, *a: waited.append(a[1]) or add(self, *a))
    g = torch.Generator().manual_seed(2)
    data = [torch.randn(20_000, 5, 3, generator=g) * 2 + 3 for _ in range(3)]  # 1.2 MB per batch
    assert nbytes(data[0]) > AT_ONCE
    cases = ((nn.BatchNorm1d(5), "fast", 1e-5), (BiasedVariance1d(5), "float64", 1e-9))
    for norm, path, tol in (*cases, (BiasedVarianceThroughData1d(5), "float64", 1e-9)):
        model = ChangesItsInputAfterward(norm)
        truth = compute_truth(model, data)["norm"]
        stats = precisebn.estimate(model, data, num_samples="all")["norm"]
        assert stats.path == path and stats.count == truth.count
        assert max_rel_error(stats.mean, truth.mean, truth.var.sqrt()) <= tol
        assert max_rel_error(stats.var, truth.var) <= tol
    assert waited == []


@pytest.mark.parametrize(
    "layout",
    ["contiguous", "channels_last", "channels_last_3d", "offset view", "transposed 3-d", "2-d", "one channel"],
)
def test_each_call_copies_exactly_its_checked_channels_whatever_its_layout(layout: str) -> None:
    """The workspace holds each checked channel's values, channel after channel, whatever the
    input's strides and storage offset; and the figures of such inputs pass."""
    g = torch.Generator().manual_seed(3)
    base = torch.randn(4, 9, 5, 6, generator=g) * 2 + 1
    t = {
        "contiguous": base,
        "channels_last": base.contiguous(memory_format=torch.channels_last),
        "channels_last_3d": torch.randn(2, 9, 3, 4, 5, generator=g).contiguous(memory_format=torch.channels_last_3d),
        "offset view": base[1:, :, 2:, 1:5],
        "transposed 3-d": torch.randn(7, 9, 3, generator=g).transpose(0, 2).transpose(1, 2).transpose(0, 1),
        "2-d": torch.randn(9, 30, generator=g).t(),
        "one channel": base[:, 3:4],
    }[layout]
    checks = SpotChecks(F32, UNIT32)
    checks.add(
        "first", 0, base, own_figures(base), 1e-5, nbytes(base)
    )  # so that the call under test starts at an offset
    start = checks._used
    checks.add("under test", 1, t, own_figures(t), 1e-5, nbytes(t))
    idx = checked_channels(t.shape[1])
    expected = t[:, idx].transpose(0, 1).double().reshape(-1)
    assert checks._used - start == expected.numel()
    assert torch.equal(checks._workspace[start : checks._used], expected)
    assert checks.run() == [("first", True), ("under test", True)]


def test_the_workspace_is_reused_and_grows_for_a_call_larger_than_it(monkeypatch) -> None:
    g = torch.Generator().manual_seed(1)
    small, large = torch.randn(10, 8, generator=g), torch.randn(100, 8, generator=g)
    checks = SpotChecks(F32, UNIT32, capacity=64)
    checks.add("small", 0, small, own_figures(small), 1e-5, nbytes(small))
    assert not checks.room(10, 320, 8)  # 40 + 40 checked values > 64
    with pytest.raises(RuntimeError, match="run the waiting checks first"):
        checks.add("large", 1, large, own_figures(large), 1e-5, nbytes(large))
    assert checks.run() == [("small", True)]
    checks.add("large", 1, large, own_figures(large), 1e-5, nbytes(large))  # 400 values: a workspace of its own size
    assert checks.run() == [("large", True)]
    monkeypatch.setattr("precisebn.spotcheck.HELD", 400)  # bytes of inputs held: one small call's 320
    checks = SpotChecks(F32, UNIT32, capacity=1000)
    assert checks.room(10, 320, 8)
    checks.add("small", 0, small, own_figures(small), 1e-5, nbytes(small))
    assert not checks.room(10, 320, 8)
    assert checks.run() == [("small", True)] and checks.room(10, 320, 8)


def test_the_default_workspace_is_kept_between_passes_and_never_shared() -> None:
    """A pass gives its workspace back when its checks have run (the next pass finds its pages
    already touched); two passes at once (threads, or one nested in a model's forward) never
    share one, and both decide right: a biased variance fails in either."""
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(6, 5, 3, generator=g), torch.randn(4, 5, 7, generator=g) * 3 + 2
    biased = own_figures(y)
    biased[1] *= (28 - 1) / 28  # 4·7 values per channel
    first, second = SpotChecks(F32, UNIT32), SpotChecks(F32, UNIT32)
    first.add("x", 0, x, own_figures(x), 1e-5, nbytes(x))
    second.add("y", 0, y, biased, 1e-5, nbytes(y))
    assert first._workspace is not None and second._workspace is not None
    assert first._workspace.data_ptr() != second._workspace.data_ptr()
    kept = first._workspace
    assert first.run() == [("x", True)] and second.run() == [("y", False)]
    third = SpotChecks(F32, UNIT32)
    third.add("x", 0, x, own_figures(x), 1e-5, nbytes(x))
    assert third._workspace is kept  # the same tensor, not merely memory at the same address
    assert third.run() == [("x", True)]


def test_a_kept_workspace_is_used_only_at_its_own_size(monkeypatch) -> None:
    """With CAPACITY changed between passes, a pass never gets a kept workspace smaller than its
    capacity (a regression: one then failed with "SpotChecks.add without room")."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(40, 8, generator=g)  # 4 checked channels of 40 values: 160 per call
    for capacity in (1 << 10, 1 << 12, 1 << 10, 1 << 12):
        monkeypatch.setattr("precisebn.spotcheck.CAPACITY", capacity)
        checks = SpotChecks(F32, UNIT32)
        for k in range(capacity // 160):
            assert checks.room(40, nbytes(x), 8)
            checks.add(k, k, x, own_figures(x), 1e-5, nbytes(x))
        assert checks._workspace is not None and checks._workspace.numel() == capacity
        assert all(passed for _, passed in checks.run())


class ChangesItsInputAfterward(nn.Module):
    """Calls the layer, then changes the tensor the layer normalised, in place."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * 1.0
        out = self.norm(x)
        x.mul_(3.0).add_(1.0)
        return out + x


def batches(count: int = 6, seed: int = 2) -> list[torch.Tensor]:
    """(N, C, L) batches: the default layout, which the CPU checks a few channels of (channels adjacent
    in memory, as in (N, C) or channels_last inputs, get every channel checked)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(16, 5, 3, generator=g) * 2 + 3 for _ in range(count)]


def test_an_input_changed_in_place_after_a_passing_call_is_measured_as_it_was() -> None:
    """The checked channels are copied at the call: the change afterwards does not matter."""
    model = ChangesItsInputAfterward(nn.BatchNorm1d(5))
    data = batches()
    stats = precisebn.estimate(model, data)["norm"]
    truth = compute_truth(model, data)["norm"]
    assert stats.path == "fast" and stats.count == truth.count
    assert max_rel_error(stats.mean, truth.mean, truth.var.sqrt()) <= 1e-6
    assert max_rel_error(stats.var, truth.var) <= 1e-5


class BiasedVarianceThroughData1d(nn.BatchNorm1d):
    """BiasedVariance1d writing through ``.data``, which leaves no trace in the buffers' version counter:
    only the check of its figures finds it out."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = nn.functional.batch_norm(
            x, self.running_mean, self.running_var, self.weight, self.bias, self.training, self.momentum, self.eps
        )
        if self.training:
            dims, n = [d for d in range(x.dim()) if d != 1], x.numel() // x.shape[1]
            self.running_var.data.sub_(torch.var(x, dim=dims, correction=0), alpha=self.momentum / (n - 1))
        return out


def test_a_layer_changing_its_buffers_in_place_is_measured_before_its_input_changes() -> None:
    """A forward that changes its buffers in place after normalising (seen through their version counter)
    is reduced in float64 at once, before the model changes what it normalised: exact."""
    model = ChangesItsInputAfterward(BiasedVariance1d(5))
    stats = precisebn.estimate(model, batches())["norm"]
    truth = compute_truth(model, batches())["norm"]
    assert stats.path == "float64" and max_rel_error(stats.var, truth.var) <= 1e-12


def test_an_input_changed_in_place_after_a_failing_call_is_refused_and_nothing_changes() -> None:
    """A call whose figures fail is reduced in float64 from what it normalised; if that was
    changed since, there is nothing exact left to measure: a clear error, the model as it was."""
    model = ChangesItsInputAfterward(BiasedVarianceThroughData1d(5))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UnsupportedLayerError, match=r"'norm'.*changed in place.*capture='float64'"):
        precisebn.recalibrate(model, batches())
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not model.norm._forward_pre_hooks and not model.norm._forward_hooks
    assert "forward" not in model.norm.__dict__
    exact = precisebn.estimate(model, batches(), capture="float64")["norm"]
    truth = compute_truth(model, batches())["norm"]
    assert max_rel_error(exact.var, truth.var) <= 1e-12


class CallsItTwice(nn.Module):
    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x) + self.norm(x * 2 - 1)


@pytest.mark.parametrize("norm", [nn.BatchNorm1d, BiasedVariance1d, "through data"])
def test_a_layer_called_again_is_checked_before_its_figures_are_overwritten(norm) -> None:
    """A layer called twice per batch: its first call's check is made before the second call
    overwrites its figures (exact either way; a biased variance fails on both calls)."""
    model = CallsItTwice(BiasedVarianceThroughData1d(5) if norm == "through data" else norm(5))
    data = batches()
    stats = precisebn.estimate(model, data)["norm"]
    truth = compute_truth(model, data)["norm"]
    assert stats.path == ("fast" if norm is nn.BatchNorm1d else "float64")
    assert stats.count == truth.count == 2 * 16 * 3 * 6
    assert max_rel_error(stats.mean, truth.mean, truth.var.sqrt()) <= 1e-6
    assert max_rel_error(stats.var, truth.var) <= 1e-5


def test_many_layers_fill_the_workspace_several_times(monkeypatch) -> None:
    """More checked values than the workspace holds: the waiting checks are made whenever it is
    full, and every layer (one of them failing) is still exact."""
    monkeypatch.setattr("precisebn.spotcheck.CAPACITY", 256)
    runs = []
    run = SpotChecks.run_graded  # (what the collector calls)
    monkeypatch.setattr(SpotChecks, "run_graded", lambda self: runs.append(len(self)) or run(self))
    layers: list[nn.Module] = [nn.BatchNorm1d(5) for _ in range(12)]
    layers[7] = BiasedVarianceThroughData1d(5)  # found by its check (no version trace)
    model = nn.Sequential(*layers)
    data = batches(4)
    stats = precisebn.estimate(model, data)
    truth = compute_truth(model, data)
    assert len(runs) >= 3 and sum(runs) == 12  # 12 calls of 192 checked values in the first batch, 1 per run
    for k in range(12):
        s, t = stats[str(k)], truth[str(k)]
        assert s.path == ("float64" if k == 7 else "fast"), k
        assert max_rel_error(s.mean, t.mean, t.var.sqrt()) <= 1e-6, k
        assert max_rel_error(s.var, t.var) <= 1e-5, k


def test_every_channel_is_checked_when_asked() -> None:
    """A figure off on a channel between the spread ones: missed by the spread check, found when every
    channel is checked, whether the call waits or is checked at once — on a channel with the largest
    mean² / (var + eps) (where a float32 reduction rounds most) or on any other."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(64, 9, generator=g) * 2 + 1
    x[:, 3] += 20  # channel 3: |mean|/σ ~ 10, the largest; not among the spread channels 0, 2, 4, 6
    figures = own_figures(x)
    figures[1, 3] *= 1.001
    assert 3 not in range(9)[checked_channels(9)]
    for every, verdict in ((False, True), (True, False)):
        checks = SpotChecks(F32, UNIT32)
        checks.add("x", 0, x, figures, 1e-5, nbytes(x), every)
        assert checks.run() == [("x", verdict)]
        assert SpotChecks(F32, UNIT32).check_now(x, figures, 1e-5, every) is verdict
    assert SpotChecks(F32, UNIT32).check_now(x, own_figures(x), 1e-5, True)
    quiet = own_figures(x)
    quiet[1, 5] *= 1.001  # off on a channel neither spread nor among the largest |mean|/σ
    checks = SpotChecks(F32, UNIT32)
    checks.add("x", 0, x, quiet, 1e-5, nbytes(x), True)
    assert checks.run() == [("x", False)]
    assert SpotChecks(F32, UNIT32).check_now(x, quiet, 1e-5, True) is False
    assert SpotChecks(F32, UNIT32).check_now(x, quiet, 1e-5, False) is True  # (the spread channels alone)


@pytest.mark.parametrize("layout", ["(N, C)", "channels_last"])
@pytest.mark.parametrize("kind", ["dead ReLU", "two sources"])
def test_a_large_channels_adjacent_input_is_checked_on_every_channel_in_the_verifying_batch(kind, layout) -> None:
    """torch's float32 reduction of channels adjacent in memory errs systematically on repeated values, whatever
    |mean|/σ: mostly dead ReLU channels (97 % exact zeros, |mean|/σ ≈ 0.13), or a channel of +1 in one half of
    the batch and -1 + δ in the other beside channels of {0, 2}. A large such input was checked at once on 8
    channels, which passed within a quarter of the tolerance, and the rest were trusted "alike": the
    verifying batch itself read 2e-5 (dead ReLU) and 1.9e-4 (two sources) of the variance off, on the fast
    path (probe 32a). Every channel is checked now; these channels' figures fail, and the layer is measured
    in float64. (One thread: torch's reduction, and so its error, depends on the number of threads.)"""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        g = torch.Generator().manual_seed(0)
        if kind == "dead ReLU":
            n, C = 4096, 64
            x = torch.randn(n, C, generator=g) + torch.linspace(0.3, 0.6, C)
            x[:, 1:4] = (torch.randn(n, 3, generator=g) - 1.9).relu()
        else:  # the others {0, 2}, balanced and shuffled: exact sums, mean 1, variance 1
            n, C = 16384, 16
            x = torch.zeros(n, C)
            x[n // 2 :] = 2.0
            x = x[torch.argsort(torch.rand(n, C, generator=g), dim=0), torch.arange(C)]
            x[:, 1] = torch.cat([torch.ones(n // 2), torch.full((n // 2,), -1.0 + 2e-4)])
        assert x.numel() * 4 > AT_ONCE and not {1, 2, 3} & set(range(C)[checked_channels(C)])
        if layout == "channels_last":
            x = x.view(n // 64, 8, 8, C).permute(0, 3, 1, 2)
        model = nn.Sequential(nn.BatchNorm1d(C) if x.dim() == 2 else nn.BatchNorm2d(C))
        truth = compute_truth(model, [x])["0"]
        stats = precisebn.estimate(model, [x], num_samples="all")["0"]
    finally:
        torch.set_num_threads(threads)
    assert max_rel_error(stats.mean, truth.mean, truth.var.sqrt()) <= TOLERANCE[torch.float32]
    assert max_rel_error(stats.var, truth.var) <= TOLERANCE[torch.float32]


def test_a_large_channels_last_input_whose_checked_channels_pass_narrowly_is_checked_on_every_channel() -> None:
    """channels_last, 16x64x40x40, every channel |mean|/σ = 3: torch's float32 reduction errs alike on every
    channel (11 of 64 above 1e-5 σ, worst 1.9e-5), so the spread and "worst" channels checked at once
    passed while others did not, and the layer read its figures 1.7e-5 σ off, "fast" (a probe, against the
    README's 1e-5). Such an input is checked on every channel now. (One thread: torch's reduction, and so its
    error, depends on the number of threads; the probe's case is with one.)"""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _check_the_probes_channels_last_case()
    finally:
        torch.set_num_threads(threads)


def _check_the_probes_channels_last_case() -> None:
    C, n, size = 64, 16, 40
    g = torch.Generator().manual_seed(1)
    sign = 3.0 * torch.sign(torch.randn(C, generator=g)).view(1, C, 1, 1)
    batches = [
        (torch.randn(n, C, size, size, generator=g) + sign).contiguous(memory_format=torch.channels_last)
        for _ in range(2)
    ]
    assert batches[0].numel() * 4 > AT_ONCE  # (checked at once, on a few channels)
    model = nn.Sequential(nn.BatchNorm2d(C))
    truth = compute_truth(model, batches)["0"]
    stats = precisebn.estimate(model, batches, num_samples="all")["0"]
    assert max_rel_error(stats.mean, truth.mean, truth.var.sqrt()) <= TOLERANCE[torch.float32]
    assert max_rel_error(stats.var, truth.var) <= TOLERANCE[torch.float32]


class GradInForward(nn.Module):
    """Linear-BatchNorm blocks whose forward runs with autograd on (test-time adaptation computes gradients in
    the forward: TENT), or under forward-mode AD (a dual input, its primal returned)."""

    def __init__(self, how: str, blocks: int = 12) -> None:
        super().__init__()
        self.how = how
        self.net = nn.Sequential(
            *[m for _ in range(blocks) for m in (nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU())]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "forward AD":
            import torch.autograd.forward_ad as fwAD

            with fwAD.dual_level():
                return fwAD.unpack_dual(self.net(fwAD.make_dual(x, torch.ones_like(x)))).primal
        with torch.enable_grad():
            return self.net(x.requires_grad_(self.how == "input requires grad"))


@pytest.mark.parametrize("how", ["enable_grad", "input requires grad", "forward AD"])
def test_checks_made_inside_a_forward_with_autograd_on_stay_out_of_its_graph(how: str) -> None:
    """Found by a probe: with autograd on in the model's forward, the checks made while it ran (the workspace
    filling mid-forward: 12 layers of 512 values) copied what a layer normalised into the workspace with its
    graph, and raised "sum(): functions with out=... arguments don't support automatic differentiation" (under
    forward-mode AD a NotImplementedError): a raw error where plain torch runs."""
    torch.manual_seed(0)
    model = GradInForward(how)
    data = [torch.randn(512, 64) for _ in range(2)]
    truth = compute_truth(model, [x.clone() for x in data])
    stats = precisebn.estimate(model, data)
    assert {s.path for s in stats.values()} == {"fast"}
    for name, t in truth.items():
        assert max_rel_error(stats[name].mean, t.mean, t.var.sqrt()) <= 1e-5, name
        assert max_rel_error(stats[name].var, t.var) <= 1e-5, name


@pytest.mark.parametrize("size", [8, 16])  # 256 KiB: waits for the others' checks; 1 MiB: checked at once
def test_finite_values_whose_own_variance_overflows_on_an_unchecked_channel_are_measured_in_float64(size) -> None:
    """σ = 1e18 on channel 1 (not a spread channel): every value finite, the variance 1e36 within float32, but
    torch's CPU kernel sums the squares in float32 and its figure is Inf. The rounding term, mean² / Inf = 0,
    passed it, and the estimate raised "the inputs contain NaN/Inf" — on a checked channel it was measured in
    float64 (probe 32a). Non-finite figures fail the check now: the layer is measured in float64, exactly."""
    C = 16
    g = torch.Generator().manual_seed(1)
    scale = torch.ones(C, dtype=torch.float64)
    scale[1] = 1e18
    assert 1 not in range(C)[checked_channels(C)]
    data = [(torch.randn(64, C, size, size, generator=g, dtype=torch.float64) * scale.view(1, C, 1, 1)).float()]
    data.append(data[0].flip(0))
    model = nn.Sequential(nn.BatchNorm2d(C))
    own = nn.BatchNorm2d(C, momentum=1.0)
    own(data[0])
    assert all(bool(x.isfinite().all()) for x in data) and own.running_var[1].isinf()  # (the kernel's figure)
    truth = compute_truth(model, data)["0"]
    stats = precisebn.estimate(model, data, num_samples="all")["0"]
    assert stats.path == "float64"
    assert max_rel_error(stats.mean, truth.mean, truth.var.sqrt()) <= 1e-12
    assert max_rel_error(stats.var, truth.var) <= 1e-12


def test_figures_that_overflow_after_the_verifying_batch_are_named_with_the_float64_remedy() -> None:
    """A later batch (read through its figures, unchecked) with finite values whose float32 variance overflows:
    the statistics are non-finite, and the error says so beside NaN/Inf inputs, naming capture='float64', which
    measures them (probe 32a: "the inputs contain NaN/Inf values" alone, for finite inputs)."""
    g = torch.Generator().manual_seed(2)
    data = [torch.randn(64, 4, 8, 8, generator=g) for _ in range(2)]
    data.append(torch.randn(64, 4, 8, 8, generator=g) * torch.tensor([1e18, 1, 1, 1]).view(1, 4, 1, 1))
    model = nn.Sequential(nn.BatchNorm2d(4))
    before = model.state_dict()["0.running_var"].clone()
    with pytest.raises(precisebn.errors.NonFiniteError, match=r"'0' \(BatchNorm2d.*overflowed.*capture='float64'"):
        precisebn.recalibrate(model, data, num_samples="all")
    assert torch.equal(model[0].running_var, before)
    stats = precisebn.estimate(model, data, num_samples="all", capture="float64")["0"]
    truth = compute_truth(model, data)["0"]
    assert max_rel_error(stats.var, truth.var) <= 1e-12
