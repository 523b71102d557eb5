"""estimate / apply / recalibrate: options, modes, real models, and the transactional promise."""

from __future__ import annotations

import copy
import itertools
import logging
import re
import warnings
from collections.abc import Iterator

import pytest
import torch
import torchvision
from torch import nn

import precisebn
import precisebn.compat
from conftest import assert_unchanged, compute_truth, max_rel_error, state_snapshot
from precisebn.errors import (
    BatchTypeError,
    EmptyDataError,
    InvalidArgumentError,
    LayerNotFoundError,
    NonFiniteError,
    PreciseBNWarning,
    ShortDataWarning,
    StatsMismatchError,
    UninitializedLayerError,
    UnsupportedLayerError,
)


def small_net(dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Dropout(dropout),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 6),
        nn.BatchNorm1d(6),
    )


def images(n_batches: int = 6, size: int = 4, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(size, 3, 8, 8, generator=g) * 2 + 1 for _ in range(n_batches)]


def assert_matches_truth(model: nn.Module, truth: dict, tol: float = 1e-5) -> None:
    for name, t in truth.items():
        layer = model.get_submodule(name)
        scale = torch.maximum(t.mean.abs(), t.var.sqrt())
        assert max_rel_error(layer.running_mean, t.mean, scale) <= tol, name
        assert max_rel_error(layer.running_var, t.var) <= tol, name


# -- real torchvision models ---------------------------------------------------------


@pytest.mark.parametrize(
    ("factory", "shape"),
    [
        (torchvision.models.resnet18, (4, 3, 64, 64)),
        (torchvision.models.mobilenet_v3_small, (4, 3, 64, 64)),
        (torchvision.models.video.r3d_18, (2, 3, 2, 24, 24)),
    ],
    ids=["resnet18", "mobilenet_v3_small", "r3d_18"],
)
def test_torchvision_models_match_float64_truth(factory, shape) -> None:
    torch.manual_seed(0)
    model = factory(weights=None)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(*shape, generator=g) for _ in range(3)]
    truth = compute_truth(model, batches)
    report = precisebn.recalibrate(model, batches)
    assert len(report.layers) == len(truth) > 10
    assert report.not_reached == []
    assert_matches_truth(model, truth)
    for row in report.layers:
        assert row.count == truth[row.name].count


# -- modes -------------------------------------------------------------------------------


def test_norm_mode_turns_dropout_off_and_restores_flags() -> None:
    model = small_net(dropout=0.5)
    model.train()
    model[3].eval()  # an odd mix of flags that must come back exactly
    model[5].eval()
    flags = [m.training for m in model.modules()]
    batches = images()
    truth = compute_truth(model, batches, mode="norm")  # dropout off
    precisebn.recalibrate(model, batches)
    assert_matches_truth(model, truth)
    assert [m.training for m in model.modules()] == flags


def test_train_mode_runs_everything_in_training_mode() -> None:
    model = small_net(dropout=0.5).eval()
    batches = images()
    truth = compute_truth(model, batches, mode="train", seed=123)
    torch.manual_seed(123)
    precisebn.recalibrate(model, batches, mode="train")
    assert_matches_truth(model, truth)
    norm_truth = compute_truth(model, batches, mode="norm")
    # dropout on changes what the later layers see: the two modes really differ
    assert max_rel_error(norm_truth["9"].var, truth["9"].var) > 1e-3
    assert not any(m.training for m in model.modules())


def test_momentum_and_num_batches_tracked_unchanged() -> None:
    model = small_net()
    model[1].momentum = None
    model[5].momentum = 0.3
    model[1].num_batches_tracked.fill_(17)
    precisebn.recalibrate(model, images())
    assert model[1].momentum is None and model[5].momentum == 0.3
    assert model[1].num_batches_tracked.item() == 17
    assert model[5].num_batches_tracked.item() == 0


# -- layer selection -----------------------------------------------------------------------


class Frozen(nn.Module):
    """torchvision's FrozenBatchNorm2d: buffers, but no running statistics to update."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.inner = torchvision.ops.FrozenBatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


@pytest.mark.parametrize(
    "layers",
    [["1"], nn.BatchNorm2d, (nn.BatchNorm2d,), lambda name, m: isinstance(m, nn.BatchNorm2d) and name == "1"],
    ids=["names", "type", "types", "predicate"],
)
def test_layer_selection(layers) -> None:
    model = small_net()
    model.add_module("frozen", Frozen(6))
    before = state_snapshot(model)
    report = precisebn.recalibrate(model, images(), layers=layers)
    changed = {k for k, v in before["state"].items() if not torch.equal(v, model.state_dict()[k])}
    expected = {"1"} if not isinstance(layers, (type, tuple)) else {"1", "5"}
    assert {r.name for r in report.layers} == expected
    assert {k.rsplit(".", 1)[0] for k in changed} == expected
    assert all(k.endswith(("running_mean", "running_var")) for k in changed)


def test_unknown_layer_name_is_a_clear_error() -> None:
    with pytest.raises(LayerNotFoundError, match=r"'bn9'"):
        precisebn.estimate(small_net(), images(), layers=["bn9"])
    with pytest.raises(InvalidArgumentError, match="not a normalization layer"):
        precisebn.estimate(small_net(), images(), layers=["0"])
    with pytest.raises(LayerNotFoundError, match="no normalization layer"):
        precisebn.estimate(nn.Linear(3, 3), [torch.randn(2, 3)])


def test_uninitialised_lazy_layer_is_a_clear_error() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.LazyBatchNorm1d())
    with pytest.raises(UninitializedLayerError, match="run one forward pass first"):
        precisebn.estimate(model, [torch.randn(4, 3)])


def test_layer_never_reached_keeps_statistics() -> None:
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used = nn.BatchNorm1d(3)
            self.unused = nn.BatchNorm1d(3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(x)

    model = Branchy()
    model.unused.running_mean.fill_(0.25)
    report = precisebn.recalibrate(model, [torch.randn(8, 3) + 2])
    assert report.not_reached == ["unused"]
    assert "not reached" in str(report)
    assert model.unused.running_mean.tolist() == [0.25] * 3
    assert report["unused"].count == 0 and not report["unused"].updated


# -- data --------------------------------------------------------------------------------------


class KwargsNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(3)

    def forward(self, features: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.bn(features * scale)


def test_batch_kinds() -> None:
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(5, 3, generator=g) for _ in range(3)]
    layer = nn.BatchNorm1d(3)
    truth = compute_truth(layer, xs)[""]
    as_tuples = precisebn.estimate(layer, [(x, torch.zeros(5)) for x in xs])[""]
    as_generator = precisebn.estimate(layer, (x for x in xs))[""]
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.cat(xs)), batch_size=5)
    as_loader = precisebn.estimate(layer, loader)[""]
    for s in (as_tuples, as_generator, as_loader):
        assert s.count == 15
        assert max_rel_error(s.var, truth.var) <= 1e-5
    dicts = [{"features": x, "scale": torch.tensor(2.0)} for x in xs]
    as_dicts = precisebn.estimate(KwargsNet(), dicts)["bn"]
    assert max_rel_error(as_dicts.var, 4 * truth.var) <= 1e-5


def test_custom_forward_and_nested_device_move() -> None:
    seen = []

    def forward(model: nn.Module, batch: dict) -> torch.Tensor:
        seen.append(batch["inputs"][0].device)
        return model(batch["inputs"][0])

    batches = [{"inputs": [torch.randn(4, 3)], "meta": "x"} for _ in range(2)]
    stats = precisebn.estimate(nn.BatchNorm1d(3), batches, forward=forward, device="cpu")
    assert stats.samples == 8 and seen == [torch.device("cpu")] * 2


def test_unknown_batch_type_points_at_forward() -> None:
    with pytest.raises(BatchTypeError, match="forward="):
        precisebn.estimate(nn.BatchNorm1d(3), [object()], num_batches=1)


@pytest.mark.parametrize("bad", [torch.randn(4, 3), 3, "data", {"x": torch.randn(4, 3)}])
def test_data_must_be_an_iterable_of_batches(bad) -> None:
    """A dict (probe 43c) was iterated over its keys: the error spoke of batches of type str."""
    hint = {dict: r"\[batch\]", torch.Tensor: r"\[batch\]"}.get(type(bad), "")
    with pytest.raises(InvalidArgumentError, match=f"iterable of batches.*{hint}"):
        precisebn.estimate(nn.BatchNorm1d(3), bad)


def test_num_samples_stops_after_enough_samples_and_uses_last_batch_whole() -> None:
    consumed = []

    def stream() -> Iterator[torch.Tensor]:
        for i in itertools.count():
            consumed.append(i)
            yield torch.randn(10, 3)

    stats = precisebn.estimate(nn.BatchNorm1d(3), stream(), num_samples=25)
    assert (stats.samples, stats.batches) == (30, 3)
    assert consumed == [0, 1, 2]  # no batch fetched beyond the limit
    assert precisebn.estimate(nn.BatchNorm1d(3), stream(), num_batches=4).batches == 4
    both = precisebn.estimate(nn.BatchNorm1d(3), stream(), num_samples=100, num_batches=2)
    assert both.batches == 2


def test_default_is_8192_samples() -> None:
    def stream() -> Iterator[torch.Tensor]:
        while True:
            yield torch.randn(1000, 2)

    stats = precisebn.estimate(nn.BatchNorm1d(2), stream())
    assert stats.samples == 9000


def test_short_data_warns_once_with_the_numbers() -> None:
    with pytest.warns(ShortDataWarning, match=r"after 12 samples in 3 batches, fewer than num_samples=100") as rec:
        stats = precisebn.estimate(nn.BatchNorm1d(3), [torch.randn(4, 3) for _ in range(3)], num_samples=100)
    assert len(rec) == 1 and stats.samples == 12
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        precisebn.estimate(nn.BatchNorm1d(3), [torch.randn(4, 3) for _ in range(3)])  # default limit: no warning
        precisebn.estimate(nn.BatchNorm1d(3), [torch.randn(4, 3) for _ in range(3)], num_samples="all")


@pytest.mark.parametrize(
    ("kw", "value"), [("num_samples", 0), ("num_batches", -1), ("num_samples", 2.5), ("mode", "eval")]
)
def test_bad_options(kw: str, value) -> None:
    with pytest.raises(InvalidArgumentError, match=kw):
        precisebn.estimate(nn.BatchNorm1d(3), [torch.randn(4, 3)], **{kw: value})


# -- transactional ---------------------------------------------------------------------------


class Boom(Exception):
    pass


def failing_loader(after: int, exc: BaseException) -> Iterator[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    for _ in range(after):
        yield torch.randn(4, 3, 8, 8, generator=g)
    raise exc


class FailingForward:
    def __init__(self, at: int, exc: BaseException) -> None:
        self.at, self.exc, self.n = at, exc, 0

    def __call__(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        self.n += 1
        if self.n == self.at:
            raise self.exc
        return model(batch)


def test_empty_data_leaves_model_untouched() -> None:
    model = small_net()
    before = state_snapshot(model)
    with pytest.raises(EmptyDataError, match="no batch"):
        precisebn.recalibrate(model, [])
    assert_unchanged(model, before)


@pytest.mark.parametrize("capture", ["auto", "float64"])
@pytest.mark.parametrize("empty_at", [0, 1, 3])
def test_empty_batches_count_for_nothing(empty_at: int, capture: str) -> None:
    """An empty batch (N = 0) anywhere, the first included (where the fast path is
    verified), adds nothing: the statistics are those of the other batches' values."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))
    data = [torch.randn(n, 3, 4, 4) * 2 + 3 for n in (2, 3, 4)]
    data.insert(empty_at, torch.randn(0, 3, 4, 4))
    truth = compute_truth(model, [b for b in data if len(b)])["1"]
    report = precisebn.recalibrate(model, data, num_samples="all", capture=capture)
    assert report.updated == ["1"] and report["1"].count == truth.count
    assert max_rel_error(model[1].running_mean, truth.mean, truth.var.sqrt()) < 1e-6
    assert max_rel_error(model[1].running_var, truth.var) < 1e-6


def test_only_empty_batches_keep_the_statistics_and_say_why(caplog: pytest.LogCaptureFixture) -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))
    before = state_snapshot(model)
    with pytest.warns(PreciseBNWarning, match=r"none of the 1 selected .* were called, but with empty inputs only"):
        report = precisebn.recalibrate(model, [torch.randn(0, 3, 4, 4)] * 2, num_samples="all")
    assert report.updated == [] and report["1"].count == 0
    assert_unchanged(model, before)
    assert "'1' was called twice but never normalised with its running buffers (or only empty inputs)" in caplog.text


@pytest.mark.parametrize("exc", [Boom("loader broke"), KeyboardInterrupt()], ids=["exception", "ctrl-c"])
def test_loader_failure_leaves_model_untouched(exc: BaseException) -> None:
    model = small_net().train()
    model[5].eval()
    model[1].momentum = None
    before = state_snapshot(model)
    with pytest.raises(type(exc)):
        precisebn.recalibrate(model, failing_loader(3, exc), mode="train")
    assert_unchanged(model, before)


@pytest.mark.parametrize("exc", [Boom("model broke"), KeyboardInterrupt()], ids=["exception", "ctrl-c"])
def test_forward_failure_leaves_model_untouched(exc: BaseException) -> None:
    model = small_net()
    before = state_snapshot(model)
    with pytest.raises(type(exc)):
        precisebn.recalibrate(model, images(), forward=FailingForward(4, exc))
    assert_unchanged(model, before)


def test_non_finite_statistics_name_the_layer_and_leave_model_untouched() -> None:
    model = small_net()
    batches = images()
    batches[2][1, :, 3, 3] = float("nan")
    before = state_snapshot(model)
    with pytest.raises(NonFiniteError, match=r"'1' \(BatchNorm2d") as info:
        precisebn.recalibrate(model, batches)
    assert isinstance(info.value, FloatingPointError)
    assert_unchanged(model, before)


def test_bad_batch_shape_inside_model_leaves_model_untouched() -> None:
    model = small_net()
    before = state_snapshot(model)
    with pytest.raises(RuntimeError):
        precisebn.recalibrate(model, [*images(2), torch.randn(4, 5, 8, 8)])
    assert_unchanged(model, before)


def test_estimate_leaves_buffer_updating_modules_untouched_in_train_mode() -> None:
    model = small_net()
    model[8] = nn.utils.spectral_norm(model[8])  # updates its weight_u buffer in training mode
    before = state_snapshot(model)
    precisebn.estimate(model, images(), mode="train")
    assert_unchanged(model, before)


def test_model_switching_modes_inside_forward_is_an_error() -> None:
    model = small_net()
    before = state_snapshot(model)

    def forward(m: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        m.eval()
        return m(batch)

    with pytest.raises(InvalidArgumentError, match="eval mode"):
        precisebn.recalibrate(model, images(), forward=forward)
    assert_unchanged(model, before)


# -- apply -------------------------------------------------------------------------------------


def test_apply_writes_in_place_and_equals_recalibrate() -> None:
    a, b = small_net(), small_net()
    batches = images()
    buffer = a[1].running_mean
    stats = precisebn.estimate(a, batches)
    report = precisebn.apply(a, stats)
    precisebn.recalibrate(b, batches)
    assert a[1].running_mean is buffer
    for (k, v), w in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(v, w), k
    assert report.samples == stats.samples == 24


def test_apply_rejects_statistics_of_another_model() -> None:
    stats = precisebn.estimate(small_net(), images())
    other = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    before = state_snapshot(other)
    with pytest.raises(StatsMismatchError, match="channels"):
        precisebn.apply(other, stats)
    assert_unchanged(other, before)


def test_apply_refuses_batchnorm_statistics_for_an_instancenorm_and_reports_the_models_types() -> None:
    """Probe 37: BatchNorm2d statistics went into an InstanceNorm2d of the same name and channels unrefused (merge
    refuses the pair: an InstanceNorm's running variance is the mean of each sample's variance), and the report
    called the layer written a BatchNorm2d. Statistics of a SyncBatchNorm go into a BatchNorm2d, reported as such."""
    net = small_net()
    stats = precisebn.estimate(net, images())
    other = copy.deepcopy(net)
    other[1] = nn.InstanceNorm2d(net[1].num_features, track_running_stats=True)
    before = state_snapshot(other)
    with pytest.raises(
        StatsMismatchError, match=r"'1' \(InstanceNorm2d\) was given statistics measured on a BatchNorm2d"
    ):
        precisebn.apply(other, stats)
    assert_unchanged(other, before)

    class AdaNorm(nn.InstanceNorm2d):  # (a subclass of another name: refused by recalibrate itself, a review)
        pass

    other[1] = AdaNorm(net[1].num_features, track_running_stats=True)
    truth = compute_truth(other, images())["1"]
    report = precisebn.recalibrate(other, images())
    assert report["1"].layer_type == "AdaNorm" and max_rel_error(other[1].running_var, truth.var) < 1e-6
    with pytest.raises(StatsMismatchError, match=r"'1' \(AdaNorm\) was given statistics measured on a BatchNorm2d"):
        precisebn.apply(other, stats)
    synced = nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(net))
    truth = compute_truth(net, images())["1"]
    report = precisebn.apply(net, precisebn.estimate(synced, images()))
    assert report["1"].layer_type == "BatchNorm2d"
    assert max_rel_error(net[1].running_var, truth.var) < 1e-6


# -- running statistics that share memory ------------------------------------------------------


class TiedNet(nn.Module):
    """Two BatchNorm layers whose running buffers are tied as ``tie`` says: ``"both"`` (the
    second layer holds the first's tensors), ``"var"`` (only running_var), or disjoint views
    of one flat tensor, ``"blocks"`` (consecutive) or ``"interleaved"`` (strided)."""

    def __init__(self, tie: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3)
        self.a, self.b = nn.BatchNorm2d(4), nn.BatchNorm2d(4)
        if tie in ("both", "var"):
            self.b.running_var = self.a.running_var
        if tie == "both":
            self.b.running_mean = self.a.running_mean
        if tie in ("blocks", "interleaved"):
            flat = torch.zeros(16)
            for i, bn in enumerate((self.a, self.b)):
                mean, var = (
                    (flat[2 * i :: 4], flat[2 * i + 1 :: 4])
                    if tie == "interleaved"
                    else flat[8 * i : 8 * i + 8].split(4)
                )
                bn.running_mean, bn.running_var = mean, var.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(self.conv(x)) * 3 + 2)


def counted(batches: list[torch.Tensor], drawn: list[int]) -> Iterator[torch.Tensor]:
    for b in batches:
        drawn.append(1)
        yield b


@pytest.mark.parametrize("call", ["recalibrate", "update_bn", "update_bn_stats"])
def test_layers_that_share_running_buffers_are_refused_before_any_pass(call: str) -> None:
    """Writing two layers' statistics into one tensor would keep only the last while the
    report listed both: refused, naming both layers, before a batch is drawn."""
    model = TiedNet("both").train()
    before = state_snapshot(model)
    drawn: list[int] = []
    run = {
        "recalibrate": lambda: precisebn.recalibrate(model, counted(images(), drawn)),
        "update_bn": lambda: precisebn.compat.update_bn(counted(images(), drawn), model),
        "update_bn_stats": lambda: precisebn.compat.update_bn_stats(model, counted(images(), drawn), num_iters=6),
    }[call]
    with pytest.raises(UnsupportedLayerError, match="layer 'a' running_mean and layer 'b' running_mean") as info:
        run()
    assert isinstance(info.value, TypeError)
    assert "layer 'a' running_var and layer 'b' running_var" in str(info.value)
    assert drawn == []
    assert_unchanged(model, before)


def test_apply_refuses_statistics_for_layers_that_share_running_buffers() -> None:
    """estimate() writes nothing, so it measures both layers (each against its float64
    truth); apply() then refuses and leaves the model as it was."""
    model = TiedNet("both")
    batches = images()
    truth = compute_truth(model, batches)
    stats = precisebn.estimate(model, batches)
    for name in ("a", "b"):
        assert max_rel_error(stats[name].mean, truth[name].mean, truth[name].var.sqrt()) <= 1e-6
        assert max_rel_error(stats[name].var, truth[name].var) <= 1e-5
    before = state_snapshot(model)
    with pytest.raises(UnsupportedLayerError, match="share memory"):
        precisebn.apply(model, stats)
    assert_unchanged(model, before)


def test_buffers_shared_where_nothing_is_written_are_allowed() -> None:
    """Only the buffers that a call writes must be apart: adapt="mean" with tied variances,
    or one of the two layers selected."""
    model, batches = TiedNet("var"), images()
    truth = compute_truth(model, batches)
    shared_var = model.a.running_var.clone()
    precisebn.recalibrate(model, batches, adapt="mean")
    for name in ("a", "b"):
        layer = model.get_submodule(name)
        assert max_rel_error(layer.running_mean, truth[name].mean, truth[name].var.sqrt()) <= 1e-6
        assert torch.equal(layer.running_var, shared_var)
    model = TiedNet("both")
    precisebn.recalibrate(model, batches, layers=["a"])
    assert_matches_truth(model, {"a": truth["a"]})


@pytest.mark.parametrize("tie", ["blocks", "interleaved"])
def test_disjoint_views_of_one_tensor_are_not_shared(tie: str) -> None:
    model, batches = TiedNet(tie), images()
    assert model.a.running_mean.untyped_storage().data_ptr() == model.b.running_var.untyped_storage().data_ptr()
    truth = compute_truth(model, batches)
    precisebn.recalibrate(model, batches)
    assert_matches_truth(model, truth)


def test_statistics_beyond_the_buffers_dtype_are_refused_saying_so() -> None:
    """Inputs of magnitude 1e20: their variance, 1e40, is finite in float64 but not in float32.
    The error says so (not "apply statistics to the model they were estimated on"); in float64
    buffers the same data is recalibrated exactly."""
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(8, 3, generator=g) * 1e20 for _ in range(3)]
    model = nn.Sequential(nn.BatchNorm1d(3))
    before = state_snapshot(model)
    with pytest.raises(StatsMismatchError, match=r"'0' has values up to .*e\+40, beyond float32's largest") as info:
        precisebn.recalibrate(model, batches)
    assert "estimated on" not in str(info.value)
    assert "layer.float() for a float16 layer" in str(info.value)  # (advised layer.double() alone: float16 inputs
    assert_unchanged(model, before)  # cannot run a float64 layer)
    model.double()
    truth = compute_truth(model, [b.double() for b in batches])
    precisebn.recalibrate(model, [b.double() for b in batches])
    assert_matches_truth(model, truth, 1e-12)


def test_float16_variances_below_the_smallest_normal_are_refused_only_where_they_change_var_plus_eps() -> None:
    """Probe 45: a float16 layer with eps 1e-9 got a variance of ~1e-7 written as a subnormal 40 % off, and one of
    ~7e-11 as 0, silently — what it divides by. Refused now as overflow is, naming the layer, the model
    unchanged. With torch's default eps (1e-5) the same variances are written (off by at most 3e-8, 0.3 % of
    var + eps): the layer's eval-mode output matches the float64 truth's normalisation to float16 precision, and
    a float32 layer gets them all exactly."""
    g = torch.Generator().manual_seed(0)
    scale = torch.tensor([1e-5, 3e-4, 3e-3, 1.0])
    batches = [(torch.randn(16, 4, generator=g) * scale).half() for _ in range(4)]
    model = nn.Sequential(nn.BatchNorm1d(4, eps=1e-9)).half()
    truth = compute_truth(model, batches)
    stats = precisebn.estimate(model, batches)
    assert max_rel_error(stats["0"].var, truth["0"].var) < 1e-12  # (measured exactly: only the writes fail)
    assert max_rel_error(stats["0"].mean, truth["0"].mean, truth["0"].var.sqrt()) < 1e-12
    assert float(truth["0"].var[0]) < 1e-9 and 1e-8 < float(truth["0"].var[1]) < 3e-7  # (as the docstring says)
    before = state_snapshot(model)
    for call in (lambda: precisebn.recalibrate(model, batches), lambda: precisebn.apply(model, stats)):
        with pytest.raises(StatsMismatchError) as info:
            call()
        message = str(info.value)
        assert re.search(
            r"'0' has variances down to \S+e-11, below float16's smallest normal 6.1e-05: 2 of 4 channels would be "
            r"written as 0 \(1\) or off by more than 1% of var \+ eps \(eps 1e-09\)",
            message,
        ), message
        assert "layer.float() for a float16 layer" in message and "Nothing was written" in message
        assert_unchanged(model, before)
    usual = nn.Sequential(nn.BatchNorm1d(4)).half()  # eps 1e-5: every variance written, as float16 rounds it
    precisebn.recalibrate(usual, batches)
    assert torch.equal(usual[0].running_var, truth["0"].var.half())
    assert float(usual[0].running_var[0]) == 0.0 and float(truth["0"].var[0]) > 0
    usual.eval()
    x = batches[0]
    want = (x.double() - truth["0"].mean) / (truth["0"].var + 1e-5).sqrt()
    assert max_rel_error(usual(x), want, torch.ones_like(want)) < 2e-3  # (float16's own rounding of the output)
    wide = copy.deepcopy(model).float()  # (the same values, exactly: a float32 layer holds them all)
    precisebn.recalibrate(wide, [b.float() for b in batches])
    assert_matches_truth(wide, truth)


def test_a_layer_on_the_meta_device_is_refused_by_name() -> None:
    """A model not fully materialised: its meta layer has no values to measure with or write to."""
    model = small_net()
    model[5] = nn.BatchNorm2d(8, device="meta")
    before = state_snapshot(nn.Sequential(*list(model)[:5]))
    with pytest.raises(UninitializedLayerError, match=r"layer '5' \(BatchNorm2d\) is on the meta device"):
        precisebn.recalibrate(model, images())
    assert_unchanged(nn.Sequential(*list(model)[:5]), before)
    stats = precisebn.estimate(small_net(), images())
    with pytest.raises(StatsMismatchError, match=r"'5' is on the meta device"):
        precisebn.apply(model, stats)
    # one tensor of the layer on the meta device: torch's own errors before ("Cannot copy out of meta tensor", a probe)
    for where, key in (("_buffers", "running_var"), ("_parameters", "weight")):
        model = small_net()
        getattr(model[5], where)[key] = torch.empty(8, device="meta")
        before = state_snapshot(nn.Sequential(*list(model)[:5]))
        with pytest.raises(
            UninitializedLayerError, match=rf"layer '5' \(BatchNorm2d\) is on the meta device \(its {key}\)"
        ):
            precisebn.estimate(model, images())
        assert_unchanged(nn.Sequential(*list(model)[:5]), before)


def test_data_parallel_wrapper_is_looked_through() -> None:
    model = small_net()
    plain = copy.deepcopy(model)
    batches = images()
    stats = precisebn.estimate(nn.DataParallel(model), batches)
    assert set(stats) == {"1", "5", "9"}
    precisebn.recalibrate(plain, batches)
    precisebn.apply(nn.DataParallel(model), stats)
    for v, w in zip(model.state_dict().values(), plain.state_dict().values()):
        assert torch.equal(v, w)
    # layers= by the wrapper's own names (refused as "not found in the model" before, a probe): the module's
    assert set(precisebn.estimate(nn.DataParallel(model), batches, layers=["module.5", "9"])) == {"5", "9"}
    with pytest.raises(LayerNotFoundError, match=r"'module\.12'"):  # (a name found under neither: named as given)
        precisebn.estimate(nn.DataParallel(model), batches, layers=["module.12"])


@pytest.mark.parametrize("capture", ["auto", "float64"])
def test_single_value_per_channel_is_a_clear_error(capture: str) -> None:
    """(capture="float64": torch's own ValueError, without the layer's name, before a hostile probe.)"""
    model = small_net()
    before = state_snapshot(model)
    with pytest.raises(InvalidArgumentError, match=r"layer '9' \(BatchNorm1d\) received one value per channel"):
        precisebn.recalibrate(model, [*images(2), torch.randn(1, 3, 8, 8)], capture=capture)
    assert_unchanged(model, before)


@pytest.mark.parametrize("kind", ["subclass", "timm"])
def test_a_forward_of_its_own_given_one_value_per_channel_is_named(kind: str) -> None:
    """Found by a probe: a subclass with a forward of its own (timm's BatchNormAct2d: efficientnet_b0 at batch 1 on
    32x32 inputs) let torch's bare ValueError out, without the layer's name. A model that catches it still can: the
    error is a ValueError."""

    class Sub(nn.BatchNorm2d):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x)

    if kind == "timm":
        layer: nn.Module = pytest.importorskip("timm.layers").BatchNormAct2d(8)
    else:
        layer = Sub(8)
    model = nn.Sequential(nn.Conv2d(3, 8, 1), layer)
    before = state_snapshot(model)
    with pytest.raises(InvalidArgumentError, match=r"layer '1' \(\w+\) received one value per channel"):
        precisebn.recalibrate(model, [torch.randn(4, 3, 2, 2), torch.randn(1, 3, 1, 1)])
    assert_unchanged(model, before)

    class Skips(nn.Module):  # (catches the error and leaves the layer out for such inputs)
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Conv2d(3, 8, 1), Sub(8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            try:
                return self.body(x)
            except ValueError:
                return self.body[0](x)

    skips = Skips()
    batches = [torch.randn(4, 3, 2, 2) for _ in range(3)] + [torch.randn(1, 3, 1, 1)]
    truth = compute_truth(skips.body, batches[:3])["1"]
    stats = precisebn.estimate(skips, batches, num_samples="all")["body.1"]
    assert max_rel_error(stats.mean, truth.mean, truth.var.sqrt()) < 1e-5
    assert max_rel_error(stats.var, truth.var) < 1e-5


@pytest.mark.parametrize("capture", ["auto", "float64"])
@pytest.mark.parametrize("unbatched", [False, True])
def test_an_instance_norm_given_maps_of_one_value_is_a_clear_error(capture: str, unbatched: bool) -> None:
    """Found by a probe: torch's own ValueError ("Expected more than 1 spatial element"), without the layer's name."""
    if unbatched:
        model: nn.Module = nn.Sequential(nn.Identity(), nn.InstanceNorm1d(4, track_running_stats=True))
        batches = [torch.randn(4, 6), torch.randn(4, 6), torch.randn(4, 1)]  # (C, L): one sample each
    else:
        model = nn.Sequential(nn.Conv2d(4, 4, 1), nn.InstanceNorm2d(4, track_running_stats=True))
        batches = [torch.randn(8, 4, 2, 2)] * 3 + [torch.randn(8, 4, 1, 1)]
    before = state_snapshot(model)
    with pytest.raises(InvalidArgumentError, match=r"layer '1' \(InstanceNorm[12]d\) received maps of one value"):
        precisebn.recalibrate(model, batches, capture=capture, forward=lambda m, b: m(b))
    assert_unchanged(model, before)


def test_an_instance_norm_given_an_input_of_another_rank_keeps_torchs_error() -> None:
    """A review: (8, 4) into an InstanceNorm2d was told it "received maps of one value"; torch says what is wrong."""
    model = nn.Sequential(nn.Identity(), nn.InstanceNorm2d(4, track_running_stats=True))
    before = state_snapshot(model)
    with pytest.raises(ValueError, match="expected 3D or 4D input"):
        precisebn.recalibrate(model, [torch.randn(8, 4)] * 2)
    assert_unchanged(model, before)


def test_progress_bar_counts_samples(capsys: pytest.CaptureFixture[str]) -> None:
    precisebn.estimate(nn.BatchNorm1d(3), [torch.randn(4, 3)] * 5, num_samples=12, progress=True)
    err = capsys.readouterr().err
    assert "precisebn" in err and "12/12" in err


@pytest.mark.parametrize("device", ["cuda:99", "xpu:7"])
def test_a_device_this_machine_cannot_allocate_on_is_refused_before_any_batch(device: str) -> None:
    """Was a raw RuntimeError from torch ("Found no NVIDIA driver...") out of the first batch's move."""
    model = nn.Sequential(nn.BatchNorm1d(2))
    before = state_snapshot(model)
    drawn = []

    def batches():
        drawn.append(1)
        yield torch.randn(4, 2)

    for call in (precisebn.recalibrate, precisebn.estimate):
        with pytest.raises(InvalidArgumentError, match=f"device '{device}' cannot be used on this machine"):
            call(model, batches(), device=device)
    with pytest.raises(InvalidArgumentError, match="cannot be used on this machine"):
        precisebn.compat.update_bn(batches(), model, device=device)
    assert not drawn
    assert_unchanged(model, before)


def test_a_pass_without_random_layers_draws_no_random_numbers(monkeypatch) -> None:
    """The check of torch's kernels (once per device type, see capture._kernels_bump_versions) used a random
    input: the first pass of a process moved torch's global generator."""
    import precisebn.capture as capture

    monkeypatch.setattr(capture, "_BUMPS", {})
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    state = torch.get_rng_state()
    precisebn.recalibrate(model, [torch.ones(4, 3) * torch.arange(4.0)[:, None] for _ in range(2)])
    assert capture._BUMPS == {"cpu": False}
    assert torch.equal(torch.get_rng_state(), state)


def test_a_module_as_layers_and_the_meta_device_are_refused_by_name() -> None:
    """Were a raw TypeError (the module called as a predicate) and a raw RuntimeError inside the model."""
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    before = state_snapshot(model)
    data = [torch.randn(6, 4) for _ in range(2)]
    with pytest.raises(InvalidArgumentError, match=r"layers= got a module \(BatchNorm1d\).*layers=\['1'\]"):
        precisebn.recalibrate(model, data, layers=model[1])
    with pytest.raises(InvalidArgumentError, match="device='meta' holds no values"):
        precisebn.recalibrate(model, data, device="meta")
    assert_unchanged(model, before)


def test_a_buffer_whose_elements_share_memory_is_refused_before_any_batch() -> None:
    """An expand()ed running_var (torch trains with it) failed only at the write, after every pass, with a raw
    RuntimeError; estimate, which writes nothing, measures it."""
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model[1].running_var = torch.ones(1).expand(4)
    before = state_snapshot(model)
    drawn: list[int] = []

    def batches():
        for _ in range(3):
            drawn.append(1)
            yield torch.randn(6, 4)

    with pytest.raises(UnsupportedLayerError, match=r"layer '1' running_var: its 4 elements share memory"):
        precisebn.recalibrate(model, batches())
    assert drawn == []
    assert_unchanged(model, before)
    assert precisebn.estimate(model, batches())["1"].reached


def test_apply_says_which_layers_of_the_model_the_statistics_do_not_cover(caplog) -> None:
    """A probe applied resnet18's statistics to resnet34: 20 of its 36 layers were written and the other 16
    appeared nowhere (the report lists the written ones)."""
    small = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    large = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 4), nn.BatchNorm1d(4))
    stats = precisebn.estimate(small, [torch.randn(8, 3) for _ in range(2)])
    with caplog.at_level("WARNING", logger="precisebn"):
        report = precisebn.apply(large, stats)
    assert [row.name for row in report.layers] == ["1"]
    said = "1 of the model's normalization layers have no statistics in those applied and keep theirs: '3'"
    assert said in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="precisebn"):
        precisebn.apply(small, stats)  # every layer covered: nothing said
    assert "no statistics" not in caplog.text


def test_a_default_device_elsewhere_leaves_the_passes_alone() -> None:
    """Found by probe 33b: under ``torch.set_default_device(...)`` (here "meta"; "cuda" on a GPU machine) the
    passes' own host vectors were made on that device, and estimating a CPU model ended in torch's "cannot
    repeat_interleave a meta tensor". Every tensor precisebn makes for itself names its device."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(144, 5), nn.BatchNorm1d(5))
    data = [torch.randn(8, 3, 8, 8) + 2 for _ in range(3)]
    last = [d.contiguous(memory_format=torch.channels_last) for d in data]  # (the checks of every channel)
    expected = [precisebn.estimate(model, d, capture=c) for d, c in ((data, "auto"), (last, "auto"), (data, "float64"))]
    truth = compute_truth(model, data)
    torch.set_default_device("meta")
    try:
        got = [precisebn.estimate(model, d, capture=c) for d, c in ((data, "auto"), (last, "auto"), (data, "float64"))]
        report = precisebn.recalibrate(model, data)
    finally:
        torch.set_default_device(None)
    for a, b in zip(expected, got):
        for name in ("1", "4"):
            assert torch.equal(a[name].mean, b[name].mean) and torch.equal(a[name].var, b[name].var)
    assert report["1"].updated
    assert max_rel_error(model[1].running_var, truth["1"].var) < 1e-6


def test_meta_tensors_are_refused_by_name() -> None:
    """Found by probe 33b: a batch on the meta device ended in torch's "Cannot copy out of meta tensor"; a
    model whose first parameter is still on meta (the batches go to the model's device) in "Tensor on device
    cpu is not on the expected device meta"."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    before = state_snapshot(model)
    with pytest.raises(InvalidArgumentError, match=r"a batch holds a tensor of shape \(8, 3, 8, 8\) on the meta"):
        precisebn.recalibrate(model, [torch.empty(8, 3, 8, 8, device="meta")])
    assert_unchanged(model, before)
    partial = nn.Sequential(nn.Linear(3, 4).to("meta"), nn.BatchNorm1d(4))
    with pytest.raises(UninitializedLayerError, match=r"the model's first tensor, '0\.weight', is on the meta device"):
        precisebn.recalibrate(partial, [torch.randn(4, 3)])


def test_statistics_of_the_wrong_dtype_or_on_meta_are_named_for_what_they_are() -> None:
    """Found by probe 33b: an integer mean of the right shape was refused as having "shape (4,)" for a layer of 4
    channels; a mean on the meta device got torch's raw "Cannot copy out of meta tensor"."""
    import dataclasses

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))
    stats = precisebn.estimate(model, [torch.randn(8, 3, 4, 4)])
    before = state_snapshot(model)
    cases = [
        (
            stats["1"].mean.round().to(torch.int64),
            r"'1' has 4 channels, but the statistics' mean is of dtype torch\.int64",
        ),
        (torch.empty(4, dtype=torch.float64, device="meta"), r"mean is on the meta device \(it holds no values\)"),
    ]
    for mean, said in cases:
        bad = precisebn.PopulationStats(
            {"1": dataclasses.replace(stats["1"], mean=mean)}, stats.samples, stats.batches, stats.mode
        )
        with pytest.raises(StatsMismatchError, match=said):
            precisebn.apply(model, bad)
        assert_unchanged(model, before)


class _Raising(logging.Handler):
    def emit(self, record: object) -> None:
        raise RuntimeError("the log is full")


@pytest.mark.parametrize("call", ["recalibrate", "apply"])
def test_a_logging_handler_that_raises_leaves_the_model_unchanged(call: str) -> None:
    """Probe 38: the warnings logged about layers kept (not reached; not in the statistics applied) were logged after
    the writes: a handler that raises made the call fail with every buffer changed. They are logged before."""
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.BatchNorm1d(3))
    data = [torch.randn(8, 4) for _ in range(2)]

    def forward(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m[1](m[0](x))  # (layer 2 never reached)

    stats = precisebn.estimate(model, data, forward=forward, layers=["1"])  # (for apply: layer 2 not in them)
    before = state_snapshot(model)
    handler = _Raising(level=logging.WARNING)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        run = (lambda: precisebn.recalibrate(model, data, forward=forward)) if call == "recalibrate" else None
        with pytest.raises(RuntimeError, match="the log is full"):
            run() if run is not None else precisebn.apply(model, stats)
    finally:
        root.removeHandler(handler)
    assert_unchanged(model, before)


def test_running_statistics_whose_memory_was_freed_are_refused_not_read() -> None:
    """The review of probe 42: a running buffer whose storage was freed (untyped_storage().resize_(0), as FSDP frees
    what it shards) crashed the process (a segmentation fault) in recalibrate, estimate, apply and the drop-ins,
    which read its values; and the scheduler, which read them to tell whether its statistics were current. Run in a
    process of its own, so that a crash fails the test rather than the suite."""
    import subprocess
    import sys

    script = """
import warnings, torch, precisebn, precisebn.compat
from torch import nn
from precisebn.errors import UnsupportedLayerError
warnings.simplefilter("ignore")
data = [torch.randn(4, 3, 8, 8) for _ in range(3)]
model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
stats = precisebn.estimate(model, data, num_samples="all")
scheduler = precisebn.PreciseBNScheduler(model, data, num_samples="all")
scheduler.update(1)
model[1].running_var.untyped_storage().resize_(0)
calls = {
    "recalibrate": lambda: precisebn.recalibrate(model, data),
    "estimate": lambda: precisebn.estimate(model, data),
    "apply": lambda: precisebn.apply(model, stats),
    "update_bn": lambda: precisebn.compat.update_bn(data, model),
    "update_bn_stats": lambda: precisebn.compat.update_bn_stats(model, data),
    "apply with prior": lambda: precisebn.apply(model, stats, prior=16),
    "untie_calls": lambda: precisebn.untie_calls(model, {"1": 2}),
}
for name, call in calls.items():
    try:
        call()
        print(name, "no error")
    except UnsupportedLayerError as exc:
        print(name, "refused" if "the running_var of layer '1' (BatchNorm2d)" in str(exc) else str(exc))
print("current", scheduler.is_current(1))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    names = ("recalibrate", "estimate", "apply", "update_bn", "update_bn_stats", "apply with prior", "untie_calls")
    assert done.stdout.split("\n")[:8] == [*(f"{name} refused" for name in names), "current False"], done.stdout


@pytest.mark.parametrize("call", ["recalibrate", "estimate"])
def test_passes_that_reach_no_selected_layer_say_so(call: str) -> None:
    """Found by probe 43c: a ``forward=`` that never called the model gave a report of every layer "not reached
    (kept)" and no warning (``estimate``: not even a log line). A ``PreciseBNWarning`` says so, the model unchanged;
    one layer reached is enough for none."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2), nn.BatchNorm1d(2))
    before = state_snapshot(model)
    batches = [torch.randn(4, 3) for _ in range(2)]
    with pytest.warns(
        PreciseBNWarning, match=r"none of the 2 selected normalization layers was reached in 2 batches.*no forw"
    ):
        getattr(precisebn, call)(model, batches, forward=lambda m, b: None)
    assert_unchanged(model, before)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PreciseBNWarning)
        getattr(precisebn, call)(model, batches, forward=lambda m, b: m[1](m[0](b)))
