"""How precise the statistics are: standard errors against an independent jackknife computed
here from the layers' raw inputs, and num_samples="auto"."""

from __future__ import annotations

import itertools
import sys
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import precisebn
from precisebn.capture import FOLDS
from precisebn.errors import InvalidArgumentError
from precisebn.measure import AUTO_MAX_SAMPLES


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 5), nn.BatchNorm1d(5)
    )


def inputs_per_batch(model: nn.Module, batches: list[torch.Tensor], name: str) -> list[torch.Tensor]:
    """Each batch's input of layer ``name`` as float64 (channels, values), captured here."""
    seen: list[torch.Tensor] = []
    layer = model.get_submodule(name)
    handle = layer.register_forward_pre_hook(
        lambda m, args: seen.append(args[0].detach().double().transpose(0, 1).reshape(args[0].shape[1], -1))
    )
    model.eval()
    for m in model.modules():  # as in mode="norm": every BatchNorm normalises with its batch statistics
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.train()
    with torch.no_grad():
        for b in batches:
            model(b)
    handle.remove()
    return seen


def jackknife_truth(per_batch: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Delete-one-fold jackknife of the mean (in σ) and the population variance (relative),
    from raw values: batch b in fold b mod FOLDS, each estimate recomputed from scratch."""
    folds = [torch.cat(per_batch[k::FOLDS], 1) for k in range(min(FOLDS, len(per_batch)))]
    everything = torch.cat(folds, 1)
    var = everything.var(1, unbiased=False)
    means, variances = [], []
    for k in range(len(folds)):
        rest = torch.cat([f for j, f in enumerate(folds) if j != k], 1)
        means.append(rest.mean(1))
        variances.append(rest.var(1, unbiased=False))
    g = len(folds)
    m, v = torch.stack(means), torch.stack(variances)
    se_mean = ((g - 1) / g * (m - m.mean(0)).square().sum(0)).sqrt()
    se_var = ((g - 1) / g * (v - v.mean(0)).square().sum(0)).sqrt()
    return se_mean / var.sqrt(), se_var / var


@settings(max_examples=10, deadline=None)
@given(sizes=st.lists(st.integers(2, 6), min_size=2, max_size=24), capture=st.sampled_from(["auto", "float64"]))
def test_standard_errors_equal_an_independent_jackknife(sizes: list[int], capture: str) -> None:
    model = net()
    g = torch.Generator().manual_seed(len(sizes))
    batches = [torch.randn(n, 3, 6, 6, generator=g) * 2 + 1 for n in sizes]
    stats = precisebn.estimate(model, batches, num_samples="all", capture=capture)
    # float64 path: to float64 rounding; fast path: the float32 rounding of each batch's figures
    # (about 1e-7 of the variance) shows up in these differences of estimates
    rtol, atol = (1e-9, 1e-12) if capture == "float64" else (1e-3, 1e-5)
    for name in ("1", "5"):
        se_mean, se_var = jackknife_truth(inputs_per_batch(model, batches, name))
        assert torch.allclose(stats[name].se_mean, se_mean, rtol=rtol, atol=atol), name
        assert torch.allclose(stats[name].se_var, se_var, rtol=rtol, atol=atol), name


def test_one_batch_has_no_standard_error_and_the_report_shows_them() -> None:
    model = net()
    one = precisebn.estimate(model, [torch.randn(8, 3, 6, 6)])
    assert bool(one["1"].se_var.isnan().all())
    report = precisebn.recalibrate(model, [torch.randn(8, 3, 6, 6) for _ in range(20)])
    row = report["5"]
    assert 0 < row.se_var_median <= row.se_var_max < 1
    assert "±var" in str(report) and "worst layer" in str(report)
    assert report.to_dict()["layers"][1]["se_var_median"] == row.se_var_median
    assert len(report.to_dict()["layers"][1]["se_var"]) == 5


def stream(seed: int, size: int = 8):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(size, 3, 6, 6, generator=g) * 2 + 1 for _ in itertools.count())


def test_auto_stops_when_precise_enough_and_at_the_same_batch_for_the_same_seed() -> None:
    first = precisebn.estimate(net(), stream(0), num_samples="auto", tolerance=0.05)
    again = precisebn.estimate(net(), stream(0), num_samples="auto", tolerance=0.05)
    assert first.batches == again.batches and first.batches % 8 == 0
    for name in first:
        assert torch.equal(first[name].mean, again[name].mean) and torch.equal(first[name].var, again[name].var)
        assert float(first[name].se_var.nanmedian()) <= 0.05
        assert float(first[name].se_mean.nanmedian()) <= 0.05
    # checked every 8 batches: 8 batches fewer would not have been precise enough
    fewer = precisebn.estimate(net(), stream(0), num_batches=first.batches - 8)
    assert max(float(torch.maximum(s.se_var.nanmedian(), s.se_mean.nanmedian())) for s in fewer.values()) > 0.05
    tighter = precisebn.estimate(net(), stream(0), num_samples="auto", tolerance=0.025)
    assert tighter.samples > first.samples
    import numpy as np  # a NumPy float tolerance (np.float32 was refused as "not a number", a probe)

    same = precisebn.estimate(net(), stream(0), num_samples="auto", tolerance=np.float32(0.05))
    assert same.batches == first.batches


def test_auto_respects_its_cap_and_short_data() -> None:
    capped = precisebn.estimate(net(), stream(1), num_samples="auto", tolerance=1e-4, num_batches=24)
    assert capped.batches == 24
    short = precisebn.estimate(net(), [torch.randn(8, 3, 6, 6) for _ in range(5)], num_samples="auto")
    assert short.batches == 5


def test_auto_stops_at_its_sample_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    assert AUTO_MAX_SAMPLES == 65536  # the documented cap; a smaller one here keeps the test short
    monkeypatch.setattr(sys.modules["precisebn.recalibrate"], "AUTO_MAX_SAMPLES", 96)
    capped = precisebn.estimate(net(), stream(2), num_samples="auto", tolerance=1e-4)
    assert (capped.samples, capped.batches) == (96, 12)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"tolerance": 0.01}, "applies to num_samples='auto' only"),
        ({"num_samples": "auto", "tolerance": 0}, "between 0 and 1"),
        ({"num_samples": "auto", "tolerance": "1%"}, "between 0 and 1"),
    ],
)
def test_tolerance_mistakes(options: dict, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        precisebn.estimate(net(), [torch.randn(8, 3, 6, 6)], **options)


def test_errors_from_the_sums_equal_those_of_the_folds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fast-path layers are pooled straight from their sums (stats.fold_errors_from_sums); the
    same pass with per-fold moments (as kept for a distributed merge) gives the same statistics
    and errors, to float64 rounding."""
    import precisebn.capture as capture

    model = net()
    g = torch.Generator().manual_seed(3)
    batches = [torch.randn(5, 3, 6, 6, generator=g) * 2 + 1 for _ in range(21)]  # 16 folds, some of two batches
    used = []
    original_sums, original_finish = capture.fold_errors_from_sums, capture.Collector.finish
    monkeypatch.setattr(capture, "fold_errors_from_sums", lambda *a, **k: used.append(1) or original_sums(*a, **k))
    pooled = precisebn.estimate(model, batches, num_samples="all")
    assert used, "the pass did not pool from the sums"
    monkeypatch.setattr(capture.Collector, "finish", lambda self, **k: original_finish(self, **{**k, "pool": False}))
    used.clear()
    folds = precisebn.estimate(model, batches, num_samples="all")
    assert not used
    for name in ("1", "5"):
        a, b = pooled[name], folds[name]
        assert a.count == b.count and a.path == b.path == "fast"
        torch.testing.assert_close(a.mean, b.mean, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(a.var, b.var, rtol=1e-10, atol=0)
        torch.testing.assert_close(a.se_mean, b.se_mean, rtol=1e-8, atol=1e-12)
        torch.testing.assert_close(a.se_var, b.se_var, rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("capture", ["auto", "float64"])
def test_constant_channels_do_not_make_auto_stop_early(capture: str) -> None:
    """A constant channel's errors are 0: with 6 of 10 channels constant (dead or pruned filters) the median
    over all channels was 0, so "auto" stopped at its minimum with the live channels' variance ~30 % off."""
    live, dead = 4, 6

    def stream(channels: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        while True:
            x = torch.zeros(16, channels)
            x[:, :live] = torch.randn(16, live, generator=g) ** 3  # heavy-tailed live channels
            yield x

    mixed = precisebn.estimate(nn.BatchNorm1d(live + dead), stream(live + dead), num_samples="auto", capture=capture)
    alone = precisebn.estimate(nn.BatchNorm1d(live), stream(live), num_samples="auto", capture=capture)
    assert mixed.samples == alone.samples > 256  # the live channels decide, as in a layer of their own
    model = nn.Sequential(nn.BatchNorm1d(live + dead))
    report = precisebn.recalibrate(model, stream(live + dead), num_samples=4096, capture=capture)
    se = report["0"].se_var
    assert se is not None and float(se[live:].abs().max()) == 0.0
    assert report["0"].se_var_median == pytest.approx(float(se[:live].double().quantile(0.5)))


class _Queries(nn.Module):
    """A BatchNorm on learned queries (the same values whatever the data) beside one on the data."""

    def __init__(self) -> None:
        super().__init__()
        self.queries = nn.Parameter(torch.randn(6, 3))
        self.fixed, self.data = nn.BatchNorm1d(3), nn.BatchNorm1d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.data(x) + self.fixed(self.queries).mean(0)


@pytest.mark.parametrize("capture", ["auto", "float64"])
def test_one_batch_fed_again_and_again_is_warned_of_its_errors_of_zero(capture: str) -> None:
    """The same batch fed again and again (probe 44b): every fold holds the same values, the errors come out 0
    and num_samples="auto" stops at its minimum — the statistics exact for those values, the errors meaningless.
    A layer whose input does not depend on the data has errors of 0 rightly, and is no cause alone."""
    model = net()
    batch = torch.randn(8, 3, 6, 6) * 2 + 1
    with pytest.warns(precisebn.errors.PreciseBNWarning, match="standard errors are 0") as caught:
        stats = precisebn.estimate(model, [batch] * 20, num_samples="all", capture=capture)
    assert len([w for w in caught if "standard errors are 0" in str(w.message)]) == 1
    truth = inputs_per_batch(model, [batch], "1")[0]  # every batch's input alike: the population is this one's
    torch.testing.assert_close(stats["1"].mean, truth.mean(1), rtol=0, atol=1e-6)
    torch.testing.assert_close(stats["1"].var, truth.var(1, unbiased=False), rtol=1e-5, atol=0)
    assert float(stats["1"].se_mean.abs().max()) <= 1e-9 and float(stats["1"].se_var.abs().max()) <= 1e-6
    with pytest.warns(precisebn.errors.PreciseBNWarning, match="standard errors are 0"):
        auto = precisebn.estimate(model, itertools.repeat(batch), num_samples="auto", capture=capture)
    assert auto.samples == 256  # its minimum
    distinct = [torch.randn(8, 3, 6, 6) for _ in range(20)]
    queries = _Queries()
    x = [torch.randn(8, 3) for _ in range(20)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # neither distinct batches nor a data-free layer beside others
        precisebn.estimate(model, distinct, num_samples="all", capture=capture)
        mixed = precisebn.estimate(queries, x, num_samples="all", capture=capture)
    assert float(mixed["fixed"].se_mean.abs().max()) <= 1e-9 < 1e-3 < float(mixed["data"].se_mean.abs().max())
    with pytest.warns(precisebn.errors.PreciseBNWarning, match="standard errors are 0"):
        precisebn.estimate(queries, [x[0]] * 20, num_samples="all", capture=capture)
