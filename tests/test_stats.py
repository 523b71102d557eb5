"""The estimator against float64 statistics of the concatenated data."""

from __future__ import annotations

import random

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from precisebn.stats import RunningMoments, chan_merge, fold_errors, fold_errors_from_sums, merge_counted


def reference(x: torch.Tensor, channel_dim: int = 1) -> tuple[int, torch.Tensor, torch.Tensor]:
    """Two passes in float64 (torch's own var is a Welford update, whose M2 carries the rounding of the
    running mean to first order: 1e-8 relative for two values near 1e6 a hundredth apart)."""
    xd = x.double().movedim(channel_dim, 0).reshape(x.shape[channel_dim], -1)
    mean = xd.mean(1)
    return xd.shape[1], mean, (xd - mean[:, None]).square().mean(1)


@pytest.mark.parametrize("shape", [(32, 5), (8, 5, 7), (4, 5, 3, 3), (2, 5, 2, 3, 3)])
def test_from_data_matches_float64(shape: tuple[int, ...]) -> None:
    x = torch.randn(*shape) * 3 + 7
    m = RunningMoments.from_data(x, channel_dim=1)
    n, mean, var = reference(x)
    assert m.count.tolist() == [float(n)] * 5
    torch.testing.assert_close(m.mean, mean, rtol=1e-12, atol=0)
    torch.testing.assert_close(m.var, var, rtol=1e-12, atol=0)
    assert m.mean.dtype == torch.float64


def test_channel_dim_zero() -> None:
    x = torch.randn(6, 40)
    m = RunningMoments.from_data(x, channel_dim=0)
    n, _, var = reference(x, 0)
    assert int(m.count[0]) == n == 40
    torch.testing.assert_close(m.var, var, rtol=1e-12, atol=0)


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 9), min_size=1, max_size=8),
    offset=st.sampled_from([0.0, 1.0, 1e4, -1e6]),
    seed=st.integers(0, 2**16),
)
def test_merge_is_invariant_to_split_and_order(sizes: list[int], offset: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    pieces = [torch.randn(n, 3, 2, generator=g, dtype=torch.float64) + offset for n in sizes]
    whole = torch.cat(pieces)
    n, mean, var = reference(whole)
    random.Random(seed).shuffle(pieces)
    acc = RunningMoments.zeros(3)
    for p in pieces:
        acc.update(p, channel_dim=1)
    scale = var.sqrt()
    assert int(acc.count[0]) == n
    # the mean within 1e-9 σ, or within a few float64 ulps of the values' magnitude: three values at
    # -1e6 may have σ = 0.2, where 2 ulps of 1e6 are 1e-9 σ (a hypothesis find, seed 26101)
    ulps = 8 * torch.finfo(torch.float64).eps * whole.abs().amax(dim=(0, 2))
    assert bool(((acc.mean - mean).abs() <= 1e-9 * scale + ulps).all()), (acc.mean - mean).abs() / scale
    assert float(((acc.var - var).abs() / var).max()) < 1e-9
    # pooling all pieces at once gives the same as merging them one by one
    parts = [RunningMoments.from_data(p) for p in pieces]
    pooled = RunningMoments.from_batches(
        torch.stack([p.count for p in parts]), torch.stack([p.mean for p in parts]), torch.stack([p.m2 for p in parts])
    )
    # (the means' rounding is relative to the values' magnitude, |offset| + σ with σ = 1, not to the mean's:
    # a mean near 0 is not known to 1e-12 of itself)
    torch.testing.assert_close(pooled.mean, acc.mean, rtol=1e-12, atol=1e-12 * (abs(offset) + 1))
    torch.testing.assert_close(pooled.var, acc.var, rtol=1e-9, atol=0)


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 9), min_size=1, max_size=8),
    offset=st.sampled_from([0.0, 1.0, 1e4, -1e6]),
    seed=st.integers(0, 2**16),
)
def test_merge_counted_equals_the_moments_of_everything_merged(sizes: list[int], offset: float, seed: int) -> None:
    """Merging pieces one by one with host counts (empty pieces included, the first ones too, into
    moments that hold garbage while empty) gives the float64 moments of their concatenation."""
    g = torch.Generator().manual_seed(seed)
    pieces = [torch.randn(n, 3, generator=g, dtype=torch.float64) * 2 + offset for n in sizes]
    whole = torch.cat(pieces)
    mean, m2 = torch.full((3,), float("nan"), dtype=torch.float64), torch.full((3,), float("nan"), dtype=torch.float64)
    count = 0
    for p in pieces:
        part = RunningMoments.from_data(p, 1)
        merge_counted(mean, m2, count, part.mean, part.m2, p.shape[0])
        count += p.shape[0]
    if count == 0:
        assert mean.isnan().all() and m2.isnan().all()  # nothing merged: left as it was
        return
    n, truth_mean, truth_var = reference(whole)
    assert n == count
    torch.testing.assert_close(mean, truth_mean, rtol=1e-12, atol=1e-12 * (abs(offset) + 2))  # σ = 2
    if count > 1:
        assert float(((m2 / count - truth_var).abs() / truth_var).max()) < 1e-9


def test_large_offset_does_not_cancel() -> None:
    # |mean|/std = 1e8: E[x²] - E[x]² in float64 loses every digit here; the merge must not.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4000, 2, generator=g, dtype=torch.float64) * 1e-3 + 1e5
    acc = RunningMoments.zeros(2)
    for chunk in x.split(7):
        acc.update(chunk)
    _, _, var = reference(x)
    naive = (x * x).mean(0) - x.mean(0) ** 2
    assert float(((naive - var).abs() / var).max()) > 1e-2  # the naive formula really fails here
    assert float(((acc.var - var).abs() / var).max()) < 1e-6


def test_zero_count_side_is_ignored_even_if_nan() -> None:
    a = RunningMoments(torch.tensor([0.0, 3.0]), torch.tensor([float("nan"), 2.0]), torch.tensor([float("nan"), 6.0]))
    b = RunningMoments(torch.tensor([2.0, 0.0]), torch.tensor([5.0, float("inf")]), torch.tensor([2.0, float("nan")]))
    a.merge(b)
    assert a.count.tolist() == [2.0, 3.0]
    assert a.mean.tolist() == [5.0, 2.0]
    assert a.m2.tolist() == [2.0, 6.0]


def test_from_batches_ignores_absent_rows() -> None:
    counts = torch.tensor([[4.0], [0.0], [4.0]])
    means = torch.tensor([[1.0], [float("nan")], [3.0]])
    m2 = torch.tensor([[4.0], [float("nan")], [4.0]])
    m = RunningMoments.from_batches(counts, means, m2)
    # two groups of 4 values, means 1 and 3, each with M2 4 -> pooled mean 2, M2 = 8 + 8*1
    assert m.count.tolist() == [8.0]
    assert m.mean.tolist() == [2.0]
    assert m.m2.tolist() == [16.0]


def test_chan_merge_formula() -> None:
    x = torch.tensor([1.0, 2.0, 4.0, 8.0, 16.0], dtype=torch.float64)
    a, b = x[:2], x[2:]
    two, three = torch.tensor(2.0, dtype=torch.float64), torch.tensor(3.0, dtype=torch.float64)
    out = chan_merge(two, a.mean(), ((a - a.mean()) ** 2).sum(), three, b.mean(), ((b - b.mean()) ** 2).sum())
    assert out[0].item() == 5.0
    assert out[1].item() == pytest.approx(x.mean().item(), rel=1e-15)
    assert out[2].item() == pytest.approx(((x - x.mean()) ** 2).sum().item(), rel=1e-14)


def test_unbiased_var_and_slicing() -> None:
    x = torch.randn(10, 4)
    m = RunningMoments.from_data(x)
    torch.testing.assert_close(m.unbiased_var, x.double().var(0, unbiased=True))
    sub = m[1:3]
    assert sub.mean.shape == (2,)
    assert torch.equal(sub.mean, m.mean[1:3])


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(2, 9), min_size=1, max_size=8),
    offset=st.sampled_from([0.0, 1e4, -1e6]),
    shift=st.sampled_from(["first", "zero"]),
    seed=st.integers(0, 2**16),
)
def test_shifted_sums_match_the_pooled_statistics(sizes: list[int], offset: float, shift: str, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    pieces = [torch.randn(n, 3, generator=g, dtype=torch.float64) + offset for n in sizes]
    k = pieces[0].mean(0) if shift == "first" else torch.zeros(3, dtype=torch.float64)
    s1 = sum((p - k).sum(0) for p in pieces)
    s2 = sum(((p - k) ** 2).sum(0) for p in pieces)
    n = torch.full((3,), float(sum(sizes)), dtype=torch.float64)
    m = RunningMoments.from_shifted_sums(n, k, s1, s2)
    _, mean, var = reference(torch.cat(pieces))
    eps = torch.finfo(torch.float64).eps
    # within 1e-9 σ or a few ulps of the mean's magnitude (σ of three values may be 0.04 at -1e6, where
    # one ulp is 2.9e-9 σ: a hypothesis find, seed 488)
    assert bool(((m.mean - mean).abs() <= 1e-9 * var.sqrt() + 8 * eps * mean.abs()).all())
    # the documented precision: the cancellation costs ~2^-53 ((mean - shift) / std)^2 relative
    bound = 1e-9 + 16 * eps * ((mean - k) ** 2 + mean**2 * eps) / var
    assert bool(((m.var - var).abs() / var <= bound).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
@pytest.mark.parametrize(("shape", "channel_dim"), [((40, 5, 6, 6), 1), ((5, 40, 9), 0), ((30, 7, 5), -1)])
def test_from_data_in_slices_matches_float64_and_leaves_the_input(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, shape: tuple[int, ...], channel_dim: int
) -> None:
    """A tensor above CHUNK_VALUES is reduced slice by slice (bounded float64 copies): same
    statistics, and the input — float64 included, which is reduced without a copy — unchanged."""
    from precisebn import stats

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(*shape, generator=g, dtype=torch.float64) * 3 + 50).to(dtype)
    before = x.clone()
    monkeypatch.setattr(stats, "CHUNK_VALUES", 37)  # slices of a few rows (or one row when a row is larger)
    m = RunningMoments.from_data(x, channel_dim)
    n, mean, var = reference(x, channel_dim)
    assert torch.equal(x, before)
    assert m.count.tolist() == [float(n)] * x.shape[channel_dim]
    torch.testing.assert_close(m.mean, mean, rtol=1e-13, atol=0)
    torch.testing.assert_close(m.var, var, rtol=1e-11, atol=0)


def test_from_data_leaves_a_float64_input_unchanged() -> None:
    """A float64 tensor is reduced without a copy: its centring must not happen in place."""
    x = torch.randn(6, 3, 4, dtype=torch.float64) * 2 + 5
    before = x.clone()
    m = RunningMoments.from_data(x, 1)
    n, mean, var = reference(x)
    assert torch.equal(x, before)
    assert m.count.tolist() == [float(n)] * 3
    torch.testing.assert_close(m.mean, mean, rtol=1e-13, atol=0)
    torch.testing.assert_close(m.var, var, rtol=1e-12, atol=0)


def jackknife_from_values(folds: list[list[torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Delete-one-fold jackknife per channel, recomputed from the raw values: ``folds[k][c]`` holds
    channel c's values in fold k (possibly none). Folds without values of a channel are left out
    of its jackknife; NaN with fewer than two such folds."""
    se_mean, se_var = [], []
    for c in range(len(folds[0])):
        present = [f[c] for f in folds if f[c].numel()]
        everything = torch.cat(present)
        var = everything.var(unbiased=False)
        if len(present) < 2:
            se_mean.append(torch.tensor(float("nan"), dtype=torch.float64))
            se_var.append(torch.tensor(float("nan"), dtype=torch.float64))
            continue
        rest = [torch.cat([p for j, p in enumerate(present) if j != k]) for k in range(len(present))]
        m = torch.stack([r.mean() for r in rest])
        v = torch.stack([r.var(unbiased=False) for r in rest])
        g = len(present)
        se_mean.append(((g - 1) / g * (m - m.mean()).square().sum()).sqrt() / var.sqrt())
        se_var.append(((g - 1) / g * (v - v.mean()).square().sum()).sqrt() / var)
    return torch.stack(se_mean), torch.stack(se_var)


@settings(max_examples=40, deadline=None)
@given(
    folds=st.integers(1, 6),
    sizes=st.lists(st.integers(0, 5), min_size=18, max_size=18),
    offset=st.sampled_from([0.0, 1e4]),
    every_fold=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_fold_errors_equal_a_jackknife_of_the_raw_values(
    folds: int, sizes: list[int], offset: float, every_fold: bool, seed: int
) -> None:
    """Both of fold_errors' paths (every fold holding values, and folds without values, which
    must be left out) against the jackknife recomputed from the values of each fold."""
    g = torch.Generator().manual_seed(seed)
    channels = 3
    if every_fold:  # the dense path (with two folds or more)
        sizes = [max(s, 1) for s in sizes]
    else:  # the general path: fold 1 holds no value of channel 0 (one fold alone: no error either way)
        sizes[channels] = 0
    values = [
        [torch.randn(max(sizes[k * channels + c], 1 if k == 0 else 0), generator=g, dtype=torch.float64) * (c + 1)
         + offset for c in range(channels)]
        for k in range(folds)
    ]  # fmt: skip
    stacked = RunningMoments(
        *(
            torch.stack([torch.stack([getattr(RunningMoments.from_data(v[:, None]), key)[0] if v.numel()
                                      else torch.tensor(0.0, dtype=torch.float64) for v in fold]) for fold in values])
            for key in ("count", "mean", "m2")
        )
    )  # fmt: skip
    pooled, se_mean, se_var = fold_errors(stacked)
    truth_mean, truth_var = jackknife_from_values(values)
    everything = [torch.cat([fold[c] for fold in values]) for c in range(channels)]
    torch.testing.assert_close(pooled.mean, torch.stack([e.mean() for e in everything]), rtol=1e-12, atol=1e-9)
    torch.testing.assert_close(pooled.var, torch.stack([e.var(unbiased=False) for e in everything]), rtol=1e-9, atol=0)
    torch.testing.assert_close(se_mean, truth_mean, rtol=1e-6, atol=1e-9, equal_nan=True)
    torch.testing.assert_close(se_var, truth_var, rtol=1e-6, atol=1e-9, equal_nan=True)


def test_fold_errors_of_a_constant_channel() -> None:
    """Variance 0 and no spread: errors 0 (not NaN), on both paths."""
    for counts in ([4.0, 4.0], [4.0, 0.0, 4.0]):
        k = len(counts)
        count = torch.tensor(counts, dtype=torch.float64)[:, None]
        folds = RunningMoments(
            count, torch.full((k, 1), 3.0, dtype=torch.float64), torch.zeros(k, 1, dtype=torch.float64)
        )
        _, se_mean, se_var = fold_errors(folds)
        assert se_mean.tolist() == [0.0] and se_var.tolist() == [0.0]


@settings(max_examples=40, deadline=None)
@given(
    folds=st.integers(2, 7),
    sizes=st.lists(st.integers(1, 6), min_size=21, max_size=21),
    offset=st.sampled_from([0.0, 1e4, -3e5]),
    shift=st.sampled_from(["first", "zero"]),
    overwrite=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_fold_errors_from_sums_equal_a_jackknife_of_the_raw_values(
    folds: int, sizes: list[int], offset: float, shift: str, overwrite: bool, seed: int
) -> None:
    """Every fold holding values (the function's precondition): the pooled moments and both
    errors against the jackknife recomputed from each fold's values; the inputs untouched
    unless overwrite=True."""
    g = torch.Generator().manual_seed(seed)
    channels = 3
    values = [
        [
            torch.randn(sizes[k * channels + c], generator=g, dtype=torch.float64) * (c + 1) + offset
            for c in range(channels)
        ]
        for k in range(folds)
    ]
    everything = [torch.cat([fold[c] for fold in values]) for c in range(channels)]
    k = (
        torch.stack([values[0][c].mean() for c in range(channels)])
        if shift == "first"
        else torch.zeros(channels, dtype=torch.float64)
    )
    count = torch.tensor([[float(v.numel()) for v in fold] for fold in values], dtype=torch.float64)
    s1 = torch.stack([torch.stack([(v - k[c]).sum() for c, v in enumerate(fold)]) for fold in values])
    s2 = torch.stack([torch.stack([(v - k[c]).square().sum() for c, v in enumerate(fold)]) for fold in values])
    inputs = [t.clone() for t in (count, s1, s2)]
    pooled, se_mean, se_var = fold_errors_from_sums(count, k, s1, s2, overwrite=overwrite)
    if not overwrite:
        assert all(torch.equal(a, b) for a, b in zip(inputs, (count, s1, s2)))
    truth_mean, truth_var = jackknife_from_values(values)
    mean = torch.stack([e.mean() for e in everything])
    var = torch.stack([e.var(unbiased=False) for e in everything])
    # the documented cancellation: ~2^-53 ((mean - shift) / std)^2 relative to the variance
    eps = torch.finfo(torch.float64).eps
    cancel = 16 * eps * (mean - k).square() / var
    assert bool(((pooled.mean - mean).abs() <= 1e-12 * (abs(offset) + 3)).all())
    assert bool(((pooled.var - var).abs() / var <= 1e-9 + cancel).all())
    assert bool(((se_mean - truth_mean).abs() <= 1e-6 * truth_mean + 1e-9 + cancel.sqrt()).all())
    assert bool(((se_var - truth_var).abs() <= 1e-6 * truth_var + 1e-9 + cancel).all())


@pytest.mark.parametrize("scale", [1e-150, 1e-100, 1.0, 1e100, 1e150])
@pytest.mark.parametrize("dense", [True, False])
def test_fold_errors_do_not_depend_on_the_scale_of_the_data(scale: float, dense: bool) -> None:
    """The errors are relative (in σ, and to the variance): scaling the data changes none of them. Squared in the
    data's units, the jackknife's variances overflowed float64 from about 1e78 times these values and underflowed
    below about 1e-80: every error reported infinite, or 0 ("±0%") where it is about 15% (a probe's float64 layer).
    Both paths (every fold holding values; a fold without a channel's values), against the jackknife of the raw
    values computed at scale 1 (the relative errors of the scaled data)."""
    g = torch.Generator().manual_seed(0)
    values = [[torch.randn(8, generator=g, dtype=torch.float64) + c for c in range(3)] for _ in range(4)]
    if not dense:
        values[1][0] = values[1][0][:0]
    truth_mean, truth_var = jackknife_from_values(values)
    stacked = RunningMoments(
        *(
            torch.stack([torch.stack([getattr(RunningMoments.from_data(v[:, None] * scale), key)[0] if v.numel()
                                      else torch.tensor(0.0, dtype=torch.float64) for v in fold]) for fold in values])
            for key in ("count", "mean", "m2")
        )
    )  # fmt: skip
    _, se_mean, se_var = fold_errors(stacked)
    torch.testing.assert_close(se_mean, truth_mean, rtol=1e-9, atol=0)
    torch.testing.assert_close(se_var, truth_var, rtol=1e-9, atol=0)
