"""Each layer's path chosen by verifying what it does: the statistics of what a layer
normalises with its running buffers, against float64 truths computed here."""

from __future__ import annotations

import re

import pytest
import timm
import torch
from timm.layers import BatchNormAct2d
from torch import nn
from torch.nn import functional as F

import precisebn
from conftest import compute_truth, max_rel_error


def images(sizes: tuple[int, ...] = (4, 6, 3), seed: int = 0, hw: int = 8) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, 3, hw, hw, generator=g) * 2 + 1 for n in sizes]


def stats_of(xs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 mean and population variance per channel (dimension 1) of all of ``xs``."""
    flat = torch.cat([x.detach().to(torch.float64).transpose(0, 1).reshape(x.shape[1], -1) for x in xs], 1)
    return flat.mean(1), flat.var(1, unbiased=False)


def assert_close(layer: nn.Module, mean: torch.Tensor, var: torch.Tensor, tol: float = 1e-5) -> None:
    assert max_rel_error(layer.running_mean, mean, torch.maximum(mean.abs(), var.sqrt())) <= tol
    assert max_rel_error(layer.running_var, var) <= tol


def test_timm_batchnormact_takes_the_fast_path_exactly() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3), BatchNormAct2d(8), nn.Conv2d(8, 8, 1), BatchNormAct2d(8, act_layer="silu")
    )
    data = images()
    truth = compute_truth(model, data)
    stats = precisebn.estimate(model, data)
    assert {s.path for s in stats.values()} == {"fast"}
    precisebn.apply(model, stats)
    for name, t in truth.items():
        assert_close(model.get_submodule(name), t.mean, t.var)


def test_real_timm_model_every_layer_fast_and_exact() -> None:
    torch.manual_seed(0)
    model = timm.create_model("mobilenetv3_small_050", pretrained=False, num_classes=10)
    data = images((4, 4), hw=32)
    truth = compute_truth(model, data)
    stats = precisebn.estimate(model, data)
    assert len(stats) == len(truth) > 20
    assert {s.path for s in stats.values()} == {"fast"}
    for name, t in truth.items():
        scale = torch.maximum(t.mean.abs(), t.var.sqrt())
        assert max_rel_error(stats[name].mean, t.mean, scale) <= 1e-5, name
        assert max_rel_error(stats[name].var, t.var) <= 1e-5, name


class BiasedVariance(nn.BatchNorm2d):
    """Stores the *biased* batch variance in its running buffer (as detectron2's
    NaiveSyncBatchNorm does); normalises its input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = nn.functional.batch_norm(
            x, self.running_mean, self.running_var, self.weight, self.bias, self.training, self.momentum, self.eps
        )
        if self.training:  # then puts the biased variance where torch put the unbiased one
            with torch.no_grad():
                n = x.numel() // x.shape[1]
                self.running_var.sub_(torch.var(x, dim=(0, 2, 3), correction=0), alpha=self.momentum / (n - 1))
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_subclass_storing_a_biased_variance_falls_back_exactly(dtype: torch.dtype) -> None:
    """float32 figures are checked with other calls' (spotcheck), float64 ones at once: both
    find the bias and measure what the layer normalised in float64."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), BiasedVariance(4)).to(dtype)
    data = [x.to(dtype) for x in images((2, 3, 2), hw=4)]  # 4 values per sample and channel: a bias of 1/(n-1)
    stats = precisebn.estimate(model, data)
    assert stats["1"].path == "float64"
    precisebn.apply(model, stats)
    with torch.no_grad():
        mean, var = stats_of([model[0](x) for x in data])
    assert_close(model[1], mean, var, 1e-6 if dtype == torch.float32 else 1e-12)


class NormalisesWithItsStatistics(nn.BatchNorm2d):
    """Normalises its input with its running buffers in training mode too (``training=False``):
    its buffers never hold figures of a batch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False)


class MomentumOfItsOwn(nn.BatchNorm2d):
    """Passes a momentum of its own (0.1, not the layer's): its buffers move a tenth of the
    way to each batch's figures."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.batch_norm(
            x, self.running_mean, self.running_var, self.weight, self.bias, self.training, 0.1, self.eps
        )


@pytest.mark.parametrize("cls", [NormalisesWithItsStatistics, MomentumOfItsOwn])
@pytest.mark.parametrize("capture", ["auto", "float64"])
def test_a_layer_whose_call_does_not_overwrite_its_buffers_is_measured_in_float64_even_when_they_fit(
    cls: type, capture: str
) -> None:
    """The passes start the layer's scratch from its own statistics (see test_capture's
    ReadsRunningStd). Here they are the first batch's own figures, so comparing the buffers
    with the float64 statistics of the first batch would pass, and every later batch would
    count figures that are not its own: the call itself says so (training=False, or a
    momentum other than the layer's 1.0)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), cls(4))
    data = images((4, 6, 3))
    with torch.no_grad():
        first = model[0](data[0]).transpose(0, 1).reshape(4, -1).double()
        model[1].running_mean.copy_(first.mean(1))
        model[1].running_var.copy_(first.var(1))  # unbiased: what a BatchNorm leaves with momentum 1
        mean, var = stats_of([model[0](x) for x in data])
    stats = precisebn.estimate(model, data, capture=capture)
    assert stats["1"].path == "float64"
    precisebn.apply(model, stats)
    assert_close(model[1], mean, var, 1e-6)


class TransformsItsInput(nn.BatchNorm2d):
    """Normalises ``2x + 1`` (same size as its input) with its running buffers."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x * 2 + 1)


class SubsamplesItsInput(nn.BatchNorm2d):
    """Normalises every other column of its input (a smaller tensor) with its running buffers."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x[..., ::2])


@pytest.mark.parametrize(
    ("cls", "transform", "path"),
    [
        (TransformsItsInput, lambda h: h * 2 + 1, "fast"),
        (SubsamplesItsInput, lambda h: h[..., ::2], "float64"),
    ],
)
def test_statistics_of_what_the_layer_normalises(cls, transform, path: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), cls(4))
    data = images()
    with torch.no_grad():
        normalised = [transform(model[0](x)) for x in data]
    mean, var = stats_of(normalised)
    report = precisebn.recalibrate(model, data)
    assert report["1"].count == sum(t.numel() // 4 for t in normalised)
    assert precisebn.estimate(model, data)["1"].path == path
    assert_close(model[1], mean, var)
    # so that its eval-mode output is the float64 normalisation of what it normalises
    model.eval()
    with torch.no_grad():
        out = model(data[0]).double()
        h = normalised[0].double()
        shape = (1, -1, 1, 1)
        expected = (h - mean.view(shape)) / (var.view(shape) + model[1].eps).sqrt()
        expected = expected * model[1].weight.double().view(shape) + model[1].bias.double().view(shape)
    assert float((out - expected).abs().max()) <= 1e-4


def test_float64_option_is_exact_on_channels_last_resnet18() -> None:
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None).to(memory_format=torch.channels_last)
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(2, 3, 224, 224, generator=g).to(memory_format=torch.channels_last) for _ in range(2)]
    truth = compute_truth(model, data)
    exact = precisebn.estimate(model, data, capture="float64")
    auto = precisebn.estimate(model, data)
    assert {s.path for s in exact.values()} == {"float64"}
    for name, t in truth.items():
        scale = torch.maximum(t.mean.abs(), t.var.sqrt())
        assert max_rel_error(exact[name].mean, t.mean, scale) <= 1e-7, name
        assert max_rel_error(exact[name].var, t.var) <= 1e-7, name
        assert max_rel_error(auto[name].mean, t.mean, scale) <= 1e-5, name
        assert max_rel_error(auto[name].var, t.var) <= 1e-5, name


def test_large_mean_over_std_falls_back_where_float32_figures_are_off() -> None:
    """|mean|/std = 1e4 with batches of 2: torch's float32 figures are off by percents, so the
    verification moves the layer to float64, which is exact."""
    layer = nn.BatchNorm1d(4)
    g = torch.Generator().manual_seed(4)
    batches = [(torch.randn(2, 4, generator=g, dtype=torch.float64) * 1e-2 + 1e4).float() for _ in range(20)]
    truth = compute_truth(layer, batches)[""]
    stats = precisebn.estimate(layer, batches)[""]
    assert stats.path == "float64"
    assert max_rel_error(stats.var, truth.var) <= 1e-9


@pytest.fixture(
    params=["checked together (CPU)", "checked as each call returns (CPU, large inputs)", "deferred to the end (CUDA)"]
)
def verification(request, monkeypatch):
    """Every way of verifying: on the CPU each call is checked on a few channels, together with
    other calls (small inputs) or as it returns (inputs above spotcheck.AT_ONCE, forced here for
    all); on accelerators every call is reduced in float64 and compared at the end of the batch."""
    if "as each call returns" in request.param:
        monkeypatch.setattr("precisebn.spotcheck.AT_ONCE", -1)
    if request.param.startswith("deferred"):
        from precisebn.capture import Collector

        monkeypatch.setattr(
            Collector,
            "_check_on_cpu",
            lambda self, i, trial, seen, x, n, pair: trial.add(seen, x, self.layers[i].channels, n),
        )
    return request.param


class TwoBranches(nn.Module):
    """Independent branches, so that one layer's behaviour does not change another's inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(3, 4, 3), BiasedVariance(4))
        self.b = nn.Sequential(nn.Conv2d(3, 6, 1), BatchNormAct2d(6))
        self.c = nn.Sequential(nn.Conv2d(3, 5, 1), TransformsItsInput(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x).sum() + self.b(x).sum() + self.c(x).sum()


def test_every_verification_chooses_the_same_paths_exactly(verification) -> None:
    torch.manual_seed(0)
    model = TwoBranches()
    data = images((2, 3, 2), hw=5)
    truth = compute_truth(model, data)
    stats = precisebn.estimate(model, data)
    assert [stats[n].path for n in ("a.1", "b.1", "c.1")] == ["float64", "fast", "fast"]
    for name, tol in (("a.1", 1e-12), ("b.1", 1e-5)):  # their inputs are what they normalise
        t = truth[name]
        scale = torch.maximum(t.mean.abs(), t.var.sqrt())
        assert max_rel_error(stats[name].mean, t.mean, scale) <= tol
        assert max_rel_error(stats[name].var, t.var) <= tol
    layer = nn.BatchNorm1d(4)
    g = torch.Generator().manual_seed(4)
    batches = [(torch.randn(2, 4, generator=g, dtype=torch.float64) * 1e-2 + 1e4).float() for _ in range(20)]
    exact = compute_truth(layer, batches)[""]
    offset = precisebn.estimate(layer, batches)[""]
    assert offset.path == "float64" and max_rel_error(offset.var, exact.var) <= 1e-9


def test_watch_records_what_syncbatchnorm_normalises_across_processes() -> None:
    """SyncBatchNorm with world size > 1 never calls F.batch_norm: its autograd function hands its
    input and running buffers to torch.batch_norm_gather_stats_with_counts (CUDA-only: the whole
    path is run by benchmarks/gpu_check.py (d); here, meta tensors reach the call, which is
    recorded before torch refuses to run it on them)."""
    from precisebn.watch import Watch

    bn = nn.BatchNorm2d(4).to("meta")
    x = torch.empty(8, 4, 3, 3, device="meta")
    stats = torch.empty(2, 4, device="meta")  # every rank's batch mean / invstd
    counts = torch.empty(2, device="meta")
    with Watch(bn) as watch:
        for running_mean in (torch.empty(4, device="meta"), bn.running_mean):  # another layer's, then its own
            with pytest.raises(NotImplementedError):
                torch.batch_norm_gather_stats_with_counts(
                    x, stats, stats, running_mean, bn.running_var, 0.1, 1e-5, counts
                )
    assert len(watch.seen) == 1 and watch.seen[0] is x


def test_torch_forward_is_recognised_only_when_it_is_torch_s(monkeypatch: pytest.MonkeyPatch) -> None:
    from precisebn.watch import normalises_its_input

    plain, overridden, wrapped = nn.BatchNorm2d(3), BatchNormAct2d(3), nn.BatchNorm2d(3)
    wrapped.forward = lambda x: nn.BatchNorm2d.forward(wrapped, x)  # an instance-level forward: watched
    assert normalises_its_input(plain) and normalises_its_input(nn.SyncBatchNorm(3))
    assert not normalises_its_input(overridden) and not normalises_its_input(wrapped)
    assert not normalises_its_input(nn.InstanceNorm2d(3, track_running_stats=True))
    original = torch.nn.functional.batch_norm
    monkeypatch.setattr(torch.nn.functional, "batch_norm", lambda *a, **k: original(*a, **k))
    assert not normalises_its_input(plain)  # F.batch_norm replaced: what runs is not known


def test_buffer_swapped_by_a_pre_hook_is_watched_and_measured_exactly() -> None:
    """torch's own forward, but a pre-hook gives the layer a fresh running_mean before each call: the
    figures go to that buffer, not precisebn's, so verification fails and the input is measured in
    float64, exactly (a regression guard: a trusted or a watched call both end there)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6))
    bn = model[1]

    def swap(module: nn.Module, args: tuple) -> None:
        module.running_mean = torch.zeros(6)

    data = images()
    truth = compute_truth(model, data)
    bn.register_forward_pre_hook(swap)
    stats = precisebn.estimate(model, data)
    assert stats["1"].path == "float64"
    assert max_rel_error(stats["1"].mean, truth["1"].mean, truth["1"].var.sqrt()) <= 1e-12
    assert max_rel_error(stats["1"].var, truth["1"].var) <= 1e-12


def test_buffers_removed_by_a_pre_hook_mean_not_updated() -> None:
    """torch's own forward, but a pre-hook takes the running buffers away before each call (so it
    normalises with batch statistics and no running buffers): not taken on trust as "normalises its
    input with its buffers" — the layer is reported never normalised and keeps its statistics."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6), nn.Conv2d(6, 4, 1), nn.BatchNorm2d(4))
    before = {k: v.clone() for k, v in model[1].state_dict().items()}

    def remove(module: nn.Module, args: tuple) -> None:
        module.running_mean = None
        module.running_var = None

    model[1].register_forward_pre_hook(remove)
    report = precisebn.recalibrate(model, images())
    assert report["1"].path == "none" and not report["1"].updated and report["3"].updated
    assert all(torch.equal(v, before[k]) for k, v in model[1].state_dict().items())


class ChangesWhatItNormalised(nn.BatchNorm2d):
    """Normalises its input with its running buffers, then changes that input in place."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        x.mul_(2.0)
        return out


@pytest.mark.parametrize("capture", ["auto", "float64"])
def test_a_layer_that_changes_what_it_normalised_afterwards_is_refused(capture: str) -> None:
    """What such a layer normalised is gone by the end of its forward: measuring what the tensor
    holds then would be silently wrong, so the call is refused, naming the layer, and the model
    is left as it was (the tensor is its input: a copy is passed, so the test's data stay)."""
    model = nn.Sequential(nn.Conv2d(3, 4, 1), ChangesWhatItNormalised(4))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(precisebn.PreciseBNError, match=r"'1' \(ChangesWhatItNormalised\) changed the tensor"):
        precisebn.recalibrate(model, images(), capture=capture)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert "forward" not in model[1].__dict__


# -- the watch itself: an alias of running_mean in place during the layer's forward ----------


def test_watch_records_the_input_and_leaves_the_buffer_object_updated_in_place() -> None:
    """The figures land in the layer's own running_mean object (the alias shares its storage),
    which is back in place afterwards; what was normalised is recorded, checked against a
    float64 mean computed here (momentum 1.0: the buffer holds the batch mean)."""
    from precisebn.watch import Watch

    bn = BatchNormAct2d(3, momentum=1.0)
    running_mean = bn.running_mean
    x = images((5,))[0]
    with torch.no_grad(), Watch(bn) as watch:
        assert bn.running_mean is not running_mean  # the alias, during the forward
        bn(x)
    assert bn._buffers["running_mean"] is running_mean and type(running_mean) is torch.Tensor
    assert len(watch.seen) == 1 and watch.seen[0] is x
    mean, _ = stats_of([x])
    assert max_rel_error(running_mean, mean, mean.abs().clamp_min(1)) <= 1e-6


@pytest.mark.parametrize("mechanism", ["alias", "mode"])
def test_watch_records_only_its_layer_s_calls_while_active(mechanism: str) -> None:
    """Through the alias, and through the mode (a running mean of another tensor subclass): another
    layer's call and a call given other buffers are not recorded, the layer's own is, and nothing
    after the watch."""
    from precisebn.watch import Watch

    bn, other = nn.BatchNorm2d(3), nn.BatchNorm2d(3)
    if mechanism == "mode":
        bn.running_mean = bn.running_mean.as_subclass(Counted)
    x, y, z = images((4, 4, 4))
    with torch.no_grad(), Watch(bn) as watch:
        other(x)  # another layer's buffers
        torch.nn.functional.batch_norm(y, torch.zeros(3), torch.ones(3), training=True)
        bn(z)
    bn(x)  # after the watch
    assert len(watch.seen) == 1 and watch.seen[0] is z


class ReplacesItsBuffer(nn.BatchNorm2d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.running_mean = torch.zeros(self.num_features)
        return super().forward(x)


def test_watch_keeps_a_buffer_the_forward_replaced_and_puts_back_after_an_error() -> None:
    from precisebn.watch import Watch

    bn = ReplacesItsBuffer(3)
    original = bn.running_mean
    with torch.no_grad(), Watch(bn) as watch:
        bn(images((4,))[0])
    assert bn.running_mean is not original and watch.seen == []  # the forward's own buffer stays
    plain = nn.BatchNorm2d(3)
    original = plain.running_mean
    with pytest.raises(RuntimeError), torch.no_grad(), Watch(plain):
        plain(torch.randn(4, 5, 2, 2))  # wrong number of channels
    assert plain._buffers["running_mean"] is original


class Counted(torch.Tensor):
    calls = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        cls.calls += 1
        return super().__torch_function__(func, types, args, kwargs or {})


def test_watch_of_a_running_mean_of_another_subclass_keeps_its_behaviour() -> None:
    """A running_mean that is itself a tensor subclass is watched through a mode: it is never
    replaced, its own __torch_function__ still runs, and the call is still recorded."""
    from precisebn.watch import Watch

    bn = BatchNormAct2d(3)
    bn.running_mean = bn.running_mean.as_subclass(Counted)
    kept = bn.running_mean
    x = images((4,))[0]
    Counted.calls = 0
    with torch.no_grad(), Watch(bn) as watch:
        assert bn.running_mean is kept
        bn(x)
    assert Counted.calls > 0 and len(watch.seen) == 1 and watch.seen[0] is x


class Greedy(torch.Tensor):
    """Runs every call itself, with subclass dispatch disabled, without deferring to other
    subclasses among the arguments (as torchvision's tv_tensors do)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def test_watch_of_a_layer_given_an_input_of_a_tensor_subclass_still_records_it() -> None:
    """An input whose own __torch_function__ runs calls with subclass dispatch disabled would
    hide the call from the alias: such a call is watched by a mode, and recorded; end to end,
    the layer is measured exactly (float64 truth here)."""
    from precisebn.watch import Watch

    bn = BatchNormAct2d(3)
    x = images((4,))[0].as_subclass(Greedy)
    with torch.no_grad(), Watch(bn, x) as watch:
        bn(x)
    assert len(watch.seen) == 1 and watch.seen[0] is x

    class Wrap(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = BatchNormAct2d(3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.norm(x.as_subclass(Greedy))

    model = Wrap()
    data = images()
    stats = precisebn.estimate(model, data)
    mean, var = stats_of(data)
    assert stats["norm"].count == sum(x.numel() // 3 for x in data)
    assert max_rel_error(stats["norm"].mean, mean, var.sqrt()) <= 1e-6
    assert max_rel_error(stats["norm"].var, var) <= 1e-5


class TorchBatchNorm(nn.BatchNorm1d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # the op F.batch_norm calls, called directly
        stats = (self.running_mean, self.running_var, self.training, self.momentum, self.eps)
        return torch.batch_norm(x, self.weight, self.bias, *stats, False)


class NativeBatchNorm(nn.BatchNorm1d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.native_batch_norm(
            x, self.weight, self.bias, self.running_mean, self.running_var, self.training, self.momentum, self.eps
        )
        return out[0]


class TorchInstanceNorm(nn.InstanceNorm1d):
    def __init__(self, channels: int) -> None:
        super().__init__(channels, track_running_stats=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stats = (self.running_mean, self.running_var, self.training, self.momentum, self.eps)
        return torch.instance_norm(x, self.weight, self.bias, *stats, False)


@pytest.mark.parametrize("layer", [TorchBatchNorm, NativeBatchNorm, TorchInstanceNorm])
def test_layers_calling_torchs_normalization_ops_directly_are_measured(layer: type[nn.Module]) -> None:
    """Were reported "buffers never used (kept)": only F.batch_norm/F.instance_norm were watched."""
    g = torch.Generator().manual_seed(0)
    shape = (6, 4, 5) if layer is TorchInstanceNorm else (6, 4)
    data = [torch.randn(*shape, generator=g) * 3 + 2 for _ in range(3)]
    model = nn.Sequential(layer(4))
    report = precisebn.recalibrate(model, data, num_samples="all")
    assert report["0"].updated
    truth = compute_truth(model, data)["0"]
    assert max_rel_error(model[0].running_mean, truth.mean, truth.var.sqrt()) < 1e-5
    assert max_rel_error(model[0].running_var, truth.var) < 1e-5


@pytest.mark.parametrize(
    "alias", [lambda t: t.data, lambda t: t.detach(), lambda t: t.view(-1)], ids=["data", "detach", "view"]
)
def test_a_layer_normalising_with_an_alias_of_its_buffers_is_measured(alias) -> None:
    """``F.batch_norm(x, self.running_mean.data, self.running_var.data, ...)`` (a pattern in public code) updates
    the layer's buffers like torch's own layer: it was reported "buffers never used (kept)", its statistics not
    recomputed (a probe). The alias is seen now, and the statistics are those of its input, exact."""

    class Aliased(nn.BatchNorm2d):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            mean, var = alias(self.running_mean), alias(self.running_var)
            return F.batch_norm(x, mean, var, self.weight, self.bias, self.training, self.momentum, self.eps)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), Aliased(8))
    data = [torch.randn(4, 3, 10, 10) + 2 for _ in range(4)]
    truth = compute_truth(model, data)["1"]
    stats = precisebn.estimate(model, data, num_batches=4)["1"]
    assert stats.count == truth.count and stats.path in ("fast", "float64")
    assert max_rel_error(stats.mean, truth.mean, truth.var.sqrt()) < 1e-6
    assert max_rel_error(stats.var, truth.var) < 1e-6
    report = precisebn.recalibrate(model, data, num_batches=4)
    assert report["1"].updated
    assert max_rel_error(model[1].running_var.double(), truth.var) < 1e-6


VIEWS = {
    "unsqueeze-squeeze": lambda t: t.unsqueeze(0).squeeze(0),
    "view-index": lambda t: t.view(1, -1)[0],
    "chunk": lambda t: t.chunk(1)[0],
    "split": lambda t: t.split(t.numel())[0],
    "unbind": lambda t: t.view(1, -1).unbind(0)[0],
    "dtype-view": lambda t: t.view(torch.int32).view(torch.float32),
    "detach-view-view": lambda t: t.detach().view(1, -1).view(-1),
}


@pytest.mark.parametrize("view", VIEWS.values(), ids=VIEWS.keys())
def test_views_of_the_buffers_reached_in_several_steps_are_followed(view) -> None:
    """Views of exactly the buffers' memory reached through intermediate views or tuples: each step's result
    sharing the buffer's memory stays a tap, so the normalization call is seen (a probe: "never normalised
    with its running buffers", statistics kept)."""

    class Viewed(nn.BatchNorm2d):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            mean, var = view(self.running_mean), view(self.running_var)
            return F.batch_norm(x, mean, var, self.weight, self.bias, self.training, self.momentum, self.eps)

    torch.manual_seed(1)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), Viewed(8))
    data = [torch.randn(4, 3, 10, 10) - 1 for _ in range(4)]
    truth = compute_truth(model, data)["1"]
    stats = precisebn.estimate(model, data, num_batches=4)["1"]
    assert stats.count == truth.count
    assert max_rel_error(stats.mean, truth.mean, truth.var.sqrt()) < 1e-6
    assert max_rel_error(stats.var, truth.var) < 1e-6


@pytest.mark.parametrize("keep", [lambda t: t.detach(), lambda t: t], ids=["detach", "itself"])
def test_buffers_kept_from_the_first_call_are_followed_in_later_watched_calls(keep) -> None:
    """A forward keeping its buffers (or an alias) from its first call and normalising with them ever after:
    the first call's watch saw them, the later calls' watches (each batch larger than the verified one, in the
    (N, C) layout) did not — the layer was "fast" with the first batch's 16 values of 64, 1.35 σ off (a
    probe). A kept tap is matched to the watch active on its memory now."""

    class Kept(nn.BatchNorm1d):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if getattr(self, "kept", None) is None:
                self.kept = (keep(self.running_mean), keep(self.running_var))
            mean, var = self.kept
            return F.batch_norm(x, mean, var, self.weight, self.bias, True, self.momentum, self.eps)

    torch.manual_seed(0)
    data = [torch.randn(16 * (k + 1), 3) + 5 * k for k in range(4)]
    model = nn.Sequential(Kept(3))
    truth = compute_truth(model, data)["0"]
    stats = precisebn.estimate(model, data, num_samples="all")["0"]
    assert stats.count == truth.count
    assert max_rel_error(stats.mean, truth.mean, truth.var.sqrt()) < 1e-6
    assert max_rel_error(stats.var, truth.var) < 1e-6


class HidesItsCall(nn.BatchNorm2d):
    """torch's BatchNorm forward run with torch functions disabled for tensor subclasses (as code wrapped for
    tracing does): it normalises with its running buffers, out of sight of precisebn's watch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch._C.DisableTorchFunctionSubclass():
            return super().forward(x)


class HidesItsChild(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3), BatchNormAct2d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch._C.DisableTorchFunctionSubclass():
            return self.bn(self.conv(x))


@pytest.mark.parametrize("capture", ["auto", "float64"])
@pytest.mark.parametrize("where", ["its own forward", "its parent's"])
def test_a_layer_whose_normalization_is_hidden_from_the_watch_is_refused(where: str, capture: str) -> None:
    """Found by a probe: under torch._C.DisableTorchFunctionSubclass() the watch sees no normalization, and a
    layer that normalised with its running buffers was reported "buffers never used (kept)", its statistics
    (5.0 and 9.0 where the data gave -0.27 and 1.29) kept. Its num_batches_tracked, which torch's forward
    increments when it normalises with batch statistics, moved: it is refused by name."""
    from conftest import assert_unchanged, state_snapshot
    from precisebn.errors import UnsupportedLayerError

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), HidesItsCall(8)) if where == "its own forward" else HidesItsChild()
    name = "1" if where == "its own forward" else "bn"
    data = [torch.randn(4, 3, 10, 10) * 2 + 1 for _ in range(3)]
    before = state_snapshot(model)
    with pytest.raises(UnsupportedLayerError, match=rf"layer '{name}' \(\w+\) wrote its running buffers during"):
        precisebn.recalibrate(model, data, capture=capture)
    assert_unchanged(model, before)


class NormalisesASlice(nn.BatchNorm2d):
    """A universally slimmable network's BatchNorm: normalises an input of fewer channels (a narrower width)
    with the first channels of its running buffers — slices, written in place with its batch figures."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = x.shape[1]
        rm, rv = self.running_mean[:c], self.running_var[:c]
        return F.batch_norm(x, rm, rv, self.weight[:c], self.bias[:c], self.training, self.momentum, self.eps)


class UpdatesByHand(nn.BatchNorm1d):
    """A BatchNorm written from scratch (a masked BatchNorm, BatchRenorm): computes its batch statistics
    itself and moves its running buffers by its momentum, its num_batches_tracked left alone."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean, var = x.mean((0, 2)), x.var((0, 2))
        m = self.momentum if self.momentum is not None else 0.1
        self.running_mean.mul_(1 - m).add_(mean, alpha=m)
        self.running_var.mul_(1 - m).add_(var, alpha=m)
        return (x - mean[:, None]) / (var[:, None] + self.eps).sqrt()


@pytest.mark.parametrize("capture", ["auto", "float64"])
@pytest.mark.parametrize("layer", ["slice of its buffers", "by hand"])
def test_a_layer_writing_its_buffers_out_of_sight_without_counting_is_refused(layer: str, capture: str) -> None:
    """Found by probe 33a: a layer that wrote its running buffers in place while the watch saw no
    normalization with them whole, and left its num_batches_tracked alone — a slimmable network's BatchNorm
    normalising with ``running_mean[:c]``, a BatchNorm updating its buffers by hand — was reported "buffers
    never used (kept)", its old statistics (0 and 1, where its data gave 0..11 and 4) kept with only a log line.
    It is refused by name, the model unchanged."""
    from conftest import assert_unchanged, state_snapshot
    from precisebn.errors import UnsupportedLayerError

    torch.manual_seed(0)
    if layer == "by hand":
        model = nn.Sequential(UpdatesByHand(8))
        data = [torch.randn(16, 8, 10) * 2 + 5 for _ in range(3)]
    else:
        model = nn.Sequential(NormalisesASlice(16))
        data = [torch.randn(8, 12, 8, 8) * 2 + torch.arange(12.0).view(1, -1, 1, 1) for _ in range(3)]
    before = state_snapshot(model)
    with pytest.raises(UnsupportedLayerError, match=r"layer '0' \(\w+\) wrote its running buffers during its forward"):
        precisebn.recalibrate(model, data, capture=capture)
    assert_unchanged(model, before)


class CallsItself(nn.BatchNorm2d):
    """Folds a clip's frames into the batch and calls itself on them (a video model's 2D BatchNorm)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 5:
            n, t = x.shape[:2]
            return self(x.flatten(0, 1)).unflatten(0, (n, t))
        return super().forward(x)


class CountsWithoutBuffers(nn.BatchNorm2d):
    """Counts its calls, but normalises with batch statistics alone (its running buffers neither used nor
    written): as torch's own forward with its buffers taken away."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.num_batches_tracked += 1
        return F.batch_norm(x, None, None, self.weight, self.bias, True, 0.1, self.eps)


def test_what_the_hidden_call_refusal_leaves_alone() -> None:
    """Found by a probe of the refusal above: a layer calling itself (its inner call normalises, seen; the outer
    call saw nothing, and the inner call's increment moved the counter) was refused where it had been measured
    exactly; a layer counting calls while normalising without its buffers was refused where it had been
    reported unused. Now: a call with calls inside it, or one that wrote none of its buffers, is not refused;
    and an input whose channels are not the layer's gets torch's own error, not 'one value per channel'."""
    torch.manual_seed(0)
    clips = [torch.randn(2, 3, 4, 5, 5) * 2 + 1 for _ in range(3)]  # (N, T, C, H, W)
    model = CallsItself(4)
    truth = compute_truth(model, clips, forward=lambda m, b: m(b.flatten(0, 1)))[""]
    for capture in ("auto", "float64"):
        stats = precisebn.estimate(model, clips, capture=capture)[""]
        assert stats.count == truth.count
        assert max_rel_error(stats.mean, truth.mean, truth.var.sqrt()) <= 1e-5
        assert max_rel_error(stats.var, truth.var) <= 1e-5
    unused = nn.Sequential(nn.Conv2d(3, 4, 1), CountsWithoutBuffers(4))
    report = precisebn.recalibrate(unused, [torch.randn(4, 3, 5, 5) for _ in range(2)])
    assert report["1"].path == "none" and not report["1"].updated
    cases = [(nn.BatchNorm2d(10), (2, 3, 1, 1), RuntimeError, "running_mean should contain 3 elements not 10")]
    cases += [(nn.BatchNorm1d(3), (3, 1), RuntimeError, "running_mean should contain 1 elements not 3")]  # (probe 29)
    cases += [(nn.BatchNorm1d(3), (3,), ValueError, "expected 2D or 3D input")]
    for layer, shape, error, said in cases:  # (torch's own error, which a model may catch)
        with pytest.raises(error, match=re.escape(said)):
            precisebn.estimate(layer, [torch.randn(*shape)])
