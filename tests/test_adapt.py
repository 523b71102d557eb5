"""``prior=`` and ``adapt=``: the current statistics as pseudo-data, pooled exactly; partial updates.

Every truth here is computed in the test: the layers' inputs are recorded by hooks on a
copy of the model and concatenated with pseudo-values built to have exactly the prior's
mean and variance, or the pooled statistics are written out from their closed form.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import precisebn
from conftest import assert_unchanged, max_rel_error, pooled_with_prior, state_snapshot
from precisebn.cli import main
from precisebn.errors import InvalidArgumentError, StatsMismatchError
from precisebn.recalibrate import check_options

F64 = torch.float64


def net(dtype: torch.dtype = F64) -> nn.Module:
    """Conv → BN2d (16 positions per sample) → ReLU → flatten → Linear → BN1d (1 value per sample), with
    'trained' running statistics far from the data's (the prior)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.BatchNorm2d(3),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(3 * 16, 4),
        nn.BatchNorm1d(4),
    ).to(dtype)
    with torch.no_grad():
        for m in (model[1], model[5]):
            m.running_mean.uniform_(-3, 3)
            m.running_var.uniform_(0.2, 5)
    return model


def data(n_batches: int = 3, size: int = 5, seed: int = 1, dtype: torch.dtype = F64) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 2, 4, 4, generator=g) * 1.5 + 0.7).to(dtype) for _ in range(n_batches)]


def layer_inputs(model: nn.Module, batches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every value each BatchNorm layer receives, as a (channels, values) float64 matrix, with the BatchNorm
    layers in training mode (batch statistics, as during the passes) on a copy of the model."""
    twin = copy.deepcopy(model).eval()
    seen: dict[str, list[torch.Tensor]] = {}
    for name, m in twin.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.train()
            m.register_forward_pre_hook(
                lambda mod, args, name=name: seen.setdefault(name, []).append(
                    args[0].detach().to(F64).transpose(0, 1).reshape(args[0].shape[1], -1)
                )
            )
    with torch.no_grad():
        for b in batches:
            twin(b)
    return {name: torch.cat(xs, dim=1) for name, xs in seen.items()}


def pseudo_values(mean: torch.Tensor, var: torch.Tensor, count: int) -> torch.Tensor:
    """``count`` values per channel whose mean and population variance are exactly ``mean`` and ``var``."""
    z = torch.arange(count, dtype=F64)
    z = (z - z.mean()) / z.std(unbiased=False)
    return mean.to(F64)[:, None] + var.to(F64).sqrt()[:, None] * z[None, :]


@pytest.mark.parametrize("prior", [4, 16])
def test_prior_is_the_exact_pooling_with_pseudo_samples(prior) -> None:
    model, batches = net(), data()
    before = {n: (m.running_mean.clone(), m.running_var.clone()) for n, m in model.named_modules() if n in ("1", "5")}
    inputs = layer_inputs(model, batches)
    samples = sum(len(b) for b in batches)
    report = precisebn.recalibrate(model, batches, prior=prior, capture="float64")
    for name, x in inputs.items():
        per_sample = x.shape[1] // samples  # 16 positions for the BN2d layer, 1 for the BN1d layer
        prior_mean, prior_var = before[name]
        union = torch.cat([pseudo_values(prior_mean, prior_var, prior * per_sample), x], dim=1)
        truth_mean, truth_var = union.mean(1), union.var(1, unbiased=False)
        layer = model.get_submodule(name)
        scale = torch.maximum(truth_mean.abs(), truth_var.sqrt())
        assert max_rel_error(layer.running_mean, truth_mean, scale) < 1e-12, name
        assert max_rel_error(layer.running_var, truth_var) < 1e-12, name
        assert report[name].count == x.shape[1]  # the report counts the data's values, not the prior's
        # and not the plain data statistics: the prior moved them
        assert max_rel_error(layer.running_mean, x.mean(1), scale) > 1e-3


def test_fractional_prior_matches_the_closed_form() -> None:
    """N = 2.5 samples: no pseudo-data set has that size, so the closed form (derived here) is the truth:
    μ = (w μ_s + n μ_t)/(w + n), σ² = (w σ_s² + n σ_t²)/(w + n) + w n (μ_t − μ_s)²/(w + n)², w = N·n/samples."""
    model, batches = net(), data(n_batches=2, size=3)
    old = {n: (model.get_submodule(n).running_mean.clone(), model.get_submodule(n).running_var.clone()) for n in "15"}
    inputs = layer_inputs(model, batches)
    precisebn.recalibrate(model, batches, prior=2.5, capture="float64")
    for name, x in inputs.items():
        n = x.shape[1]
        w = 2.5 * n / 6
        mu_s, var_s = old[name]
        mu_t, var_t = x.mean(1), x.var(1, unbiased=False)
        mu = (w * mu_s + n * mu_t) / (w + n)
        var = (w * var_s + n * var_t) / (w + n) + w * n * (mu_t - mu_s) ** 2 / (w + n) ** 2
        layer = model.get_submodule(name)
        assert max_rel_error(layer.running_mean, mu, torch.maximum(mu.abs(), var.sqrt())) < 1e-12, name
        assert max_rel_error(layer.running_var, var) < 1e-12, name


@pytest.mark.parametrize("prior", [1e300, 1e306, 1e308, sys.float_info.max])
def test_a_huge_prior_gives_the_prior_back(prior: float) -> None:
    """Found by a hostile probe: prior=1e306 (finite, so accepted) overflowed the pooling's product of the
    counts, and the call was refused with advice about the architecture. The pooled statistics are now
    computed from the two groups' shares: a prior this heavy gives the model's statistics back (to the
    float64 rounding of a share of 1 - 1e-300 and less)."""
    model, batches = net(), data()
    old = {n: (model.get_submodule(n).running_mean.clone(), model.get_submodule(n).running_var.clone()) for n in "15"}
    precisebn.recalibrate(model, batches, prior=prior, capture="float64")
    for name, (mean, var) in old.items():
        layer = model.get_submodule(name)
        assert max_rel_error(layer.running_mean, mean, var.sqrt()) < 1e-12, name
        assert max_rel_error(layer.running_var, var) < 1e-12, name


@settings(max_examples=25, deadline=None)
@given(
    split=st.integers(min_value=2, max_value=18),
    prior=st.floats(min_value=0.5, max_value=40, allow_nan=False),
)
def test_adapting_in_two_steps_equals_adapting_at_once(split: int, prior: float) -> None:
    """prior=N on A, then prior=N + |A| on B, equals prior=N on A ∪ B (a layer whose input is the data, so
    that its values do not depend on how they fall into batches)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(split)
    x = torch.randn(20, 3, generator=g, dtype=F64) * torch.tensor([1.0, 5.0, 0.1], dtype=F64) + 3
    once, steps = nn.BatchNorm1d(3).to(F64), nn.BatchNorm1d(3).to(F64)
    for m in (once, steps):
        m.running_mean.copy_(torch.tensor([-1.0, 0.0, 2.0]))
        m.running_var.copy_(torch.tensor([0.5, 4.0, 1.0]))
    precisebn.recalibrate(once, [x[:split], x[split:]], prior=prior)
    precisebn.recalibrate(steps, [x[:split]], prior=prior)
    precisebn.recalibrate(steps, [x[split:]], prior=prior + split)
    scale = torch.maximum(once.running_mean.abs(), once.running_var.sqrt())
    assert max_rel_error(steps.running_mean, once.running_mean, scale) < 1e-12
    assert max_rel_error(steps.running_var, once.running_var) < 1e-12


@pytest.mark.parametrize("prior", [None, 8])
@pytest.mark.parametrize("adapt", ["mean", "var"])
def test_adapt_writes_one_buffer_and_leaves_the_other_bitwise(adapt, prior) -> None:
    model, batches = net(torch.float32), data(dtype=torch.float32)
    both = copy.deepcopy(model)
    precisebn.recalibrate(both, batches, prior=prior)
    partial = copy.deepcopy(model)
    report = precisebn.recalibrate(partial, batches, prior=prior, adapt=adapt)
    kept, written = ("running_var", "running_mean") if adapt == "mean" else ("running_mean", "running_var")
    for name in ("1", "5"):
        new, old, full = (m.get_submodule(name) for m in (partial, model, both))
        assert torch.equal(getattr(new, kept).view(torch.int32), getattr(old, kept).view(torch.int32)), name
        assert torch.equal(getattr(new, written), getattr(full, written)), name  # exactly what "both" writes
        assert not torch.equal(getattr(new, written), getattr(old, written)), name
        row = report[name]
        new_kept = row.new_var if adapt == "mean" else row.new_mean
        old_kept = row.old_var if adapt == "mean" else row.old_mean
        assert torch.equal(new_kept, old_kept)  # the report shows the kept buffer as it was


def test_adapt_mean_reports_the_shift_and_its_error_in_the_same_kept_sigma() -> None:
    """Probe 45: with adapt="mean" the report gave the mean's shift in the kept σ (sqrt(running_var + eps), what the
    layer normalises with) and its standard error in the measured σ — 10 times smaller where the new data's σ was
    10 times the kept one, so the shift looked 80 errors off instead of 8. Both are in the kept σ now, checked
    against the delete-one-batch jackknife (16 batches: each its own fold) and the shift of the float64 truth;
    adapt="both" keeps the measured σ (the statistics' own se_mean)."""
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(32, 2, generator=g) * 10 + 3 for _ in range(16)]  # σ 10; the kept running_var 0.25
    model = nn.Sequential(nn.BatchNorm1d(2))
    with torch.no_grad():
        model[0].running_var.fill_(0.25)
    x = [b.double() for b in batches]
    pooled = torch.cat(x)
    mean, var = pooled.mean(0), pooled.var(0, unbiased=False)
    left_out = torch.stack([(pooled.sum(0) - b.sum(0)) / (len(pooled) - len(b)) for b in x])
    k = len(x)
    jackknife = ((k - 1) / k * (left_out - left_out.mean(0)).square().sum(0)).sqrt()  # the mean's error, absolute
    kept = torch.tensor([0.25, 0.25], dtype=torch.float64) + model[0].eps
    for adapt, unit in (("mean", kept.sqrt()), ("both", var.sqrt())):
        m = copy.deepcopy(model)
        report = precisebn.recalibrate(m, batches, adapt=adapt)
        row = report["0"]
        assert max_rel_error(m[0].running_mean, mean, var.sqrt()) < 1e-6  # (the float64 truth)
        assert max_rel_error(row.se_mean, jackknife / unit) < 1e-6, adapt
        if adapt == "mean":
            assert torch.equal(m[0].running_var, torch.full((2,), 0.25))
            shift = ((mean - 0).abs() / unit).mean()
            assert abs(row.mean_shift - float(shift)) < 1e-5 * float(shift)
            assert 2 < row.mean_shift / row.se_mean_median < 20, (row.mean_shift, row.se_mean_median)  # (before: 80)
            assert f"the means ±{row.se_mean_median:.2g}σ at worst" in str(report)


def test_no_prior_and_zero_prior_are_plain_recalibration() -> None:
    plain, batches = net(torch.float32), data(dtype=torch.float32)
    none, zero = copy.deepcopy(plain), copy.deepcopy(plain)
    precisebn.recalibrate(plain, batches)
    precisebn.recalibrate(none, batches, prior=None)
    precisebn.recalibrate(zero, batches, prior=0)
    for a, b, c in zip(plain.state_dict().values(), none.state_dict().values(), zero.state_dict().values()):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_apply_with_prior_equals_recalibrate_with_prior() -> None:
    model, batches = net(torch.float32), data(dtype=torch.float32)
    twin = copy.deepcopy(model)
    snap = state_snapshot(model)
    stats = precisebn.estimate(model, batches)
    assert_unchanged(model, snap)  # estimate measures the data only; the prior is applied when writing
    precisebn.apply(model, stats, prior=5, adapt="var")
    precisebn.recalibrate(twin, batches, prior=5, adapt="var")
    for (k, v), w in zip(model.state_dict().items(), twin.state_dict().values()):
        assert torch.equal(v, w), k


class Exploding:
    """Data that must not be iterated: the options are checked first."""

    def __iter__(self):
        raise AssertionError("the data was read before the options were checked")


@pytest.mark.parametrize(
    ("prior", "adapt", "match"),
    [
        (-1, "both", "prior must be None or a number of samples >= 0"),
        (float("nan"), "both", "prior must be"),
        (float("inf"), "both", "prior must be"),
        (True, "both", "prior must be"),
        ("16", "both", "prior must be"),
        (4, "scale", "adapt must be 'both', 'mean' or 'var'"),
        (None, None, "adapt must be"),
    ],
)
def test_bad_prior_or_adapt_is_refused_before_any_pass(prior, adapt, match) -> None:
    model = net(torch.float32)
    snap = state_snapshot(model)
    with pytest.raises(InvalidArgumentError, match=match):
        precisebn.recalibrate(model, Exploding(), prior=prior, adapt=adapt)
    with pytest.raises(InvalidArgumentError, match=match):
        check_options(prior=prior, adapt=adapt)
    stats = precisebn.estimate(model, data(dtype=torch.float32))
    with pytest.raises(InvalidArgumentError, match=match):
        precisebn.apply(model, stats, prior=prior, adapt=adapt)
    assert_unchanged(model, snap)


def test_a_non_finite_prior_names_the_layer_and_writes_nothing() -> None:
    model, batches = net(torch.float32), data(dtype=torch.float32)
    with torch.no_grad():
        model[5].running_var[2] = float("nan")
    snap = state_snapshot(model)
    with pytest.raises(StatsMismatchError, match=r"'5': its current running statistics, the prior, are NaN") as raised:
        precisebn.recalibrate(model, batches, prior=4)
    assert_unchanged(model, snap)
    # (not the hint about statistics of another model, which said to apply them to their own: a probe)
    assert str(raised.value).endswith("recalibrate it without prior= first. Nothing was written."), str(raised.value)
    precisebn.recalibrate(model, batches, prior=4, layers=["1"])  # the other layer is fine
    assert not torch.equal(model[1].running_mean, snap["state"]["1.running_mean"])
    # probe 41: adapt="mean" pools the mean alone, which needs no variance, and leaves the NaN variance as it is
    model5 = copy.deepcopy(model)
    inputs: list[torch.Tensor] = []  # the layer's inputs (as it runs in the recalibration: the others in eval mode)
    copy5 = copy.deepcopy(model5).eval()
    copy5[5].train()
    copy5[5].momentum = 0.0
    hook = copy5[5].register_forward_pre_hook(lambda m, a: inputs.append(a[0].detach().double()))
    with torch.no_grad():
        for b in batches:
            copy5(b)
    hook.remove()
    values = torch.cat([x.transpose(0, 1).reshape(x.shape[1], -1) for x in inputs], 1)
    samples = sum(len(b) for b in batches)
    prior_mean = model5[5].running_mean
    truth, _ = pooled_with_prior(prior_mean, torch.zeros_like(prior_mean), 4 * values.shape[1] / samples, values)
    precisebn.recalibrate(model, batches, prior=4, adapt="mean", layers=["5"])
    assert torch.isnan(model[5].running_var[2]) and not torch.equal(model[5].running_mean, model5[5].running_mean)
    assert max_rel_error(model[5].running_mean.double(), truth) < 1e-5
    with torch.no_grad():
        model[5].running_mean[0] = float("nan")
    with pytest.raises(StatsMismatchError, match=r"'5': its current running_mean, the prior, is NaN"):
        precisebn.recalibrate(model, batches, prior=4, adapt="mean", layers=["5"])


CLI_MODULE = """
import torch

def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                               torch.nn.Conv2d(4, 4, 3), torch.nn.BatchNorm2d(4))

def batches():
    g = torch.Generator().manual_seed(5)
    return [torch.randn(3, 3, 8, 8, generator=g) * 2 + 1 for _ in range(3)]
"""


def test_cli_prior_and_adapt(tmp_path, monkeypatch, capsys) -> None:
    (tmp_path / "precisebn_adapt_cli.py").write_text(CLI_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    import precisebn_adapt_cli as user

    model = user.model()
    with torch.no_grad():
        for m in (model[1], model[4]):
            m.running_mean.uniform_(-2, 2)
            m.running_var.uniform_(0.5, 2)
    torch.save(model.state_dict(), tmp_path / "model.pt")
    args = ["recalibrate", "model.pt", "--model", "precisebn_adapt_cli:model", "--data", "precisebn_adapt_cli:batches",
            "--out", "out.pt", "--no-progress", "--device", "cpu", "--prior", "6", "--adapt", "mean"]  # fmt: skip
    assert main(args) == 0
    assert (
        "adapted: the mean only, pooled with the checkpoint's statistics counted as 6 samples"
        in capsys.readouterr().out
    )
    precisebn.recalibrate(model, user.batches(), prior=6, adapt="mean")  # the same in Python
    written, original = torch.load("out.pt", weights_only=True), torch.load("model.pt", weights_only=True)
    for key, value in model.state_dict().items():
        assert torch.equal(written[key], value), key
        if key.endswith("running_var"):
            assert torch.equal(written[key], original[key]), key
    assert main([*args[:-4], "--prior", "-2"]) == 2
    assert "expected a number >= 0" in capsys.readouterr().err
    assert main([*args[:-2], "--adapt", "scale"]) == 2
    sys.modules.pop("precisebn_adapt_cli", None)


def test_scheduler_and_lightning_callbacks_pass_prior_and_adapt_through() -> None:
    from precisebn.integrations.lightning import PreciseBN, PreciseWeightAveraging

    model, batches = net(torch.float32), data(dtype=torch.float32)
    expected = copy.deepcopy(model)
    precisebn.recalibrate(expected, batches, prior=3, adapt="var")
    by_scheduler, by_callback = copy.deepcopy(model), copy.deepcopy(model)
    precisebn.PreciseBNScheduler(by_scheduler, batches, prior=3, adapt="var").update(1)
    callback = PreciseBN(prior=3, adapt="var")
    assert (callback.prior, callback.adapt) == (3, "var")
    callback._trigger.bind(by_callback, batches).update(1)  # what setup() binds to the Trainer's data
    for (k, v), w, x in zip(
        expected.state_dict().items(), by_scheduler.state_dict().values(), by_callback.state_dict().values()
    ):
        assert torch.equal(v, w) and torch.equal(v, x), k
    for make in (
        precisebn.PreciseBNScheduler,
        lambda m, d, **kw: PreciseBN(**kw),
        lambda m, d, **kw: PreciseWeightAveraging(**kw),
    ):
        with pytest.raises(InvalidArgumentError, match="prior must be"):
            make(model, batches, prior=-1)
        with pytest.raises(InvalidArgumentError, match="adapt must be"):
            make(model, batches, adapt="scale")


def test_a_layer_reached_by_some_batches_converts_the_prior_at_its_share_of_the_samples() -> None:
    """``prior=N`` is N samples of pseudo-data at each layer's values per sample of the whole measurement: a
    layer called on half the samples gets half their values from the prior too, so ``prior=16`` next to 16 new
    samples weighs half and half in it as everywhere (what the README says). Steps with different shares of a
    layer do not add up to one step (a probe: 2nd decimal): the README says when steps are exact."""

    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.BatchNorm1d(2).double(), nn.BatchNorm1d(2).double()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.a(x)
            return self.b(x) + y if x.shape[0] == 8 else y  # (only the batches of 8 reach b)

    torch.manual_seed(0)
    model = Branchy()
    with torch.no_grad():
        model.b.running_mean.fill_(10.0)
        model.b.running_var.fill_(4.0)
    data = [torch.randn(8, 2, dtype=torch.float64) * 3 + 1, torch.randn(4, 2, dtype=torch.float64) - 2]
    data.append(torch.randn(4, 2, dtype=torch.float64))
    prior_mean, prior_var = model.b.running_mean.clone(), model.b.running_var.clone()
    precisebn.recalibrate(model, data, num_samples="all", prior=16)
    reached = data[0].T  # 8 of the 16 samples reach b: at its 0.5 values per sample, 16 samples are 8 values
    mean, var = pooled_with_prior(prior_mean, prior_var, 16 * reached.shape[1] / 16, reached)
    assert max_rel_error(model.b.running_mean, mean) < 1e-12
    assert max_rel_error(model.b.running_var, var) < 1e-12


@pytest.mark.parametrize("how", ["merge", "precisebn merge, then apply --prior"])
def test_a_layer_missing_from_some_merged_inputs_converts_the_prior_at_the_others_samples(
    tmp_path, monkeypatch, how: str
) -> None:
    """Probe 37: shards measured with different layer selections (A: layer '1' only, B: both), merged, then applied
    with ``prior=8``: layer '5', missing from A, was measured on B's samples alone, but its prior was converted at
    the merged file's samples (A's and B's) — 8·5/15 pseudo-samples instead of 8, its mean off by up to 79 % in the
    probe. A merge keeps such a layer's own samples (saved with it), and the prior converts by them."""
    model = net()
    a, b = data(1, seed=1), data(2, seed=2)
    sa = precisebn.estimate(model, a, num_samples="all", layers=["1"])
    sb = precisebn.estimate(model, b, num_samples="all")
    merged = sa.merge(sb)
    assert merged.samples == 15 and merged["5"].samples == 10 and merged["1"].samples is None
    before = {
        n: (model.get_submodule(n).running_mean.clone(), model.get_submodule(n).running_var.clone()) for n in "15"
    }
    target = copy.deepcopy(model)
    if how == "merge":
        precisebn.apply(target, merged, prior=8)
    else:
        monkeypatch.chdir(tmp_path)
        sa.save("a.safetensors")
        sb.save("b.safetensors")
        torch.save(model.state_dict(), "model.pt")
        assert main(["merge", "a.safetensors", "b.safetensors", "--out", "ab.safetensors"]) == 0
        assert precisebn.PopulationStats.load("ab.safetensors")["5"].samples == 10
        assert main(["apply", "model.pt", "ab.safetensors", "--out", "out.pt", "--prior", "8"]) == 0
        target.load_state_dict(torch.load("out.pt", weights_only=True))
    inputs_a, inputs_b = layer_inputs(model, a), layer_inputs(model, b)
    for name, x in (("1", torch.cat([inputs_a["1"], inputs_b["1"]], dim=1)), ("5", inputs_b["5"])):
        samples = 15 if name == "1" else 10  # (the samples whose data the layer was measured on)
        prior_mean, prior_var = before[name]
        union = torch.cat([pseudo_values(prior_mean, prior_var, 8 * x.shape[1] // samples), x], dim=1)
        truth_mean, truth_var = union.mean(1), union.var(1, unbiased=False)
        layer = target.get_submodule(name)
        scale = torch.maximum(truth_mean.abs(), truth_var.sqrt())
        assert max_rel_error(layer.running_mean, truth_mean, scale) < 1e-12, name
        assert max_rel_error(layer.running_var, truth_var) < 1e-12, name
