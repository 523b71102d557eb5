"""Nothing lost: objects and values restored whatever the forward does, one pass per model at
a time, a checked all-or-nothing apply, and clear errors for user mistakes."""

from __future__ import annotations

import collections
import copy
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F
from torch.nn.utils import parametrize

import precisebn
from conftest import (
    assert_unchanged,
    compute_truth,
    ends_in_another_thread,
    interrupt_at_first_line,
    max_rel_error,
    state_snapshot,
)
from precisebn.compat import update_bn_stats
from precisebn.errors import (
    ConcurrentUseError,
    InvalidArgumentError,
    ModelChangedWarning,
    StatsMismatchError,
    UninitializedLayerError,
    UnsupportedLayerError,
)
from precisebn.population import LayerStats, PopulationStats
from precisebn.state import in_memory, overlapping


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3), nn.BatchNorm1d(3))


def data(n: int = 4, size: int = 8) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(size, 4, generator=g) * 2 + 1 for _ in range(n)]


def failing(batches: list[torch.Tensor], after: int = 2):
    for i, b in enumerate(batches):
        if i == after:
            raise OSError("disk read error")
        yield b


# -- buffers that forward reassigns or writes, whatever their strides --------------------


class Averaging(nn.Module):
    """Keeps an average of its inputs by reassigning a buffer (a common pattern)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("avg", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.avg = 0.9 * self.avg + x.mean()
        return x


def averaging_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), Averaging(), nn.BatchNorm1d(6))


@pytest.mark.parametrize("mode", ["norm", "train"])
def test_reassigned_buffer_is_put_back_after_estimate(mode: str) -> None:
    model = averaging_model()
    before = state_snapshot(model)
    avg = model[1].avg
    precisebn.estimate(model, data(), mode=mode)
    assert model[1].avg is avg
    assert_unchanged(model, before)


def test_reassigned_buffer_is_put_back_when_the_loader_raises() -> None:
    model = averaging_model()
    before = state_snapshot(model)
    with pytest.raises(OSError, match="disk read error"):
        precisebn.recalibrate(model, failing(data()))
    assert_unchanged(model, before)


def test_reassigned_buffer_after_recalibrate_is_the_original_object() -> None:
    model = averaging_model()
    avg = model[1].avg
    truth = compute_truth(model, data())
    precisebn.recalibrate(model, data())
    assert model[1].avg is avg and avg.item() == 0.0
    assert max_rel_error(model[2].running_var, truth["2"].var) <= 1e-5


class OddStrides(nn.Module):
    """Buffers that are an expanded view (stride 0) and a transposed view, written in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.base = torch.zeros(1, 6)
        self.register_buffer("expanded", self.base.expand(4, 6))
        self.register_buffer("transposed", torch.arange(24.0).reshape(6, 4).t())
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.base.add_(1.0)  # changes every element of the expanded buffer
        self.transposed.mul_(2.0)
        self.steps += 1
        return x


def test_buffers_of_any_stride_are_restored_after_success_and_failure() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), OddStrides(), nn.BatchNorm1d(6))
    expanded, transposed = model[1].expanded, model[1].transposed
    strides = (expanded.stride(), transposed.stride())
    before = state_snapshot(model)
    precisebn.estimate(model, data())
    assert_unchanged(model, before)
    with pytest.raises(OSError):
        precisebn.recalibrate(model, failing(data()))
    assert_unchanged(model, before)
    precisebn.recalibrate(model, data())
    assert model[1].expanded is expanded and model[1].transposed is transposed
    assert (expanded.stride(), transposed.stride()) == strides
    assert torch.equal(expanded, torch.zeros(4, 6))
    assert torch.equal(transposed, torch.arange(24.0).reshape(6, 4).t())
    assert model[1].steps.item() == 0


class Observed(nn.Module):
    """Buffers a forward writes as torch.ao's observers and fake-quantizers do: a 1-byte flag first (the
    others then start at odd byte offsets in a packed copy), an average updated in place, an empty
    ``min_val`` and a one-element ``scale`` resized to one value per channel, and a cache shrunk to nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("enabled", torch.tensor([1], dtype=torch.uint8))
        self.register_buffer("average", torch.zeros(3))
        self.register_buffer("min_val", torch.tensor([]))
        self.register_buffer("scale", torch.tensor([1.0]))
        self.register_buffer("cache", torch.arange(5.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.average.mul_(0.9).add_(0.1 * x.mean())
        self.min_val.resize_(x.shape[1]).copy_(x.amin(0))
        self.scale.resize_(x.shape[1]).fill_(2.0)
        self.cache.resize_(0)
        return x


@pytest.mark.parametrize("how", ["estimate", "recalibrate", "failing"])
def test_buffers_resized_or_at_odd_offsets_are_put_back(how: str) -> None:
    """A probe: a changed float buffer after a 1-byte one failed to restore ("storage_offset() must be divisible
    by 4"), leaving the rest changed; a buffer resized in place kept its new shape silently (torchvision's QAT
    resnet18 before its first forward: 84 state_dict entries), or failed to restore when shrunk."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), Observed(), nn.BatchNorm1d(6))
    before = state_snapshot(model)
    observed = {k: (t, t.clone()) for k, t in model[1]._buffers.items()}
    sizes = {k: t.untyped_storage().nbytes() for k, t in model[1]._buffers.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (nothing lost: no ModelChangedWarning)
        if how == "estimate":
            precisebn.estimate(model, data())
        elif how == "recalibrate":
            precisebn.recalibrate(model, data())
        else:
            with pytest.raises(OSError):
                precisebn.recalibrate(model, failing(data()))
    if how != "recalibrate":
        assert_unchanged(model, before)
    for k, (t, values) in observed.items():
        assert model[1]._buffers[k] is t and t.shape == values.shape and torch.equal(t, values), k
        assert t.untyped_storage().nbytes() == sizes[k], k  # (a grown one's memory too: a probe, round 16)


class PointsElsewhere(nn.Module):
    """A buffer (with a view of it registered too) that forward points at other memory: a parameter's, another
    buffer's, a fresh tensor's, or one of another dtype."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.w = nn.Parameter(torch.arange(6.0))
        self.register_buffer("buf", torch.arange(100.0, 106.0))
        self.register_buffer("view", self.buf[2:5])
        self.register_buffer("other", torch.arange(200.0, 206.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            if self.how == "parameter":
                self.buf.set_(self.w.data)
            elif self.how == "other buffer":
                self.buf.set_(self.other)
            elif self.how == "fresh":
                self.buf.data = torch.zeros(6)
            else:
                self.buf.data = torch.zeros(6, dtype=torch.float64)
            if self.how != "parameter":  # (written where it points now; a parameter written so is the model's doing)
                self.buf.add_(1.0)
        return x


@pytest.mark.parametrize("how", ["parameter", "other buffer", "fresh", "float64"])
def test_a_buffer_pointed_at_other_memory_gets_its_own_back(how: str) -> None:
    """A probe: the snapshot's values went into whatever the buffer pointed at after forward — a parameter
    (then overwritten) or another buffer — and a view of it no longer shared its memory."""
    model = nn.Sequential(nn.Linear(4, 6), PointsElsewhere(how), nn.BatchNorm1d(6))
    before = state_snapshot(model)
    module = model[1]
    w, buf, view, other = module.w, module.buf, module.view, module.other
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        precisebn.estimate(model, data())
    assert_unchanged(model, before)
    assert torch.equal(w, torch.arange(6.0)) and torch.equal(other, torch.arange(200.0, 206.0))
    assert module.buf is buf and buf.dtype == torch.float32 and torch.equal(buf, torch.arange(100.0, 106.0))
    assert module.view is view and view.data_ptr() == buf.data_ptr() + 2 * 4  # (a view of it again)
    assert buf.untyped_storage().data_ptr() != w.untyped_storage().data_ptr()


def test_torch_ao_observers_are_put_back() -> None:
    """torch.ao's per-channel observer resizes its empty min_val/max_val at its first forward."""
    observer = torch.ao.quantization.PerChannelMinMaxObserver(ch_axis=1)
    model = nn.Sequential(nn.Linear(4, 6), observer, nn.BatchNorm1d(6))
    before = state_snapshot(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        precisebn.estimate(model, data())
    assert_unchanged(model, before)
    assert observer.min_val.shape == (0,) and observer.max_val.shape == (0,)


def test_unselected_batchnorm_in_keep_mode_is_restored() -> None:
    """torch's BatchNorm kernel updates running buffers without bumping their version
    counters: the restore compares bits, not versions."""
    model = mlp().train()
    before = state_snapshot(model)
    stats = precisebn.estimate(model, data(), layers=["1"], _mode="keep")
    assert list(stats) == ["1"]
    assert_unchanged(model, before)


# -- parameters and lazy modules ----------------------------------------------------------


def test_embedding_max_norm_weights_are_restored() -> None:
    torch.manual_seed(0)

    class Embed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 6, max_norm=0.5)
            self.bn = nn.BatchNorm1d(6)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return self.bn(self.emb(idx))

    model = Embed()
    with torch.no_grad():
        model.emb.weight.mul_(10)  # rows longer than max_norm: forward renormalises them in place
    before = state_snapshot(model)
    batches = [torch.randint(0, 10, (8,)) for _ in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        precisebn.estimate(model, batches)
    assert_unchanged(model, before)


def test_parameter_changed_in_place_is_named_in_a_warning() -> None:
    torch.manual_seed(0)

    class Drifting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 6)
            self.bn = nn.BatchNorm1d(6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.lin.bias.add_(1.0)
            return self.bn(self.lin(x))

    model = Drifting()
    with pytest.warns(ModelChangedWarning, match=r"'lin\.bias'"):
        precisebn.estimate(model, data())


@pytest.mark.parametrize("how", ["weights clipped through .data", "module.double()"])
def test_parameter_data_assigned_in_forward_is_named_in_a_warning(how: str) -> None:
    """Found by probe 33b: a forward assigning a parameter's ``.data`` (clipping its weights; ``self.double()``
    on its first call) moves no version counter, and went unwarned — after ``.double()`` the model was left with
    float64 weights and its float32 buffers put back, and could not run. Where its data are is compared too."""
    torch.manual_seed(0)

    class Assigns(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 6)
            self.bn = nn.BatchNorm1d(6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if how == "module.double()":
                if self.lin.weight.dtype != torch.float64:
                    self.lin.double()
                return self.bn(self.lin(x.double()).float())
            self.lin.weight.data = self.lin.weight.data.clamp(-0.01, 0.01)
            return self.bn(self.lin(x))

    model = Assigns()
    with pytest.warns(ModelChangedWarning, match=r"'lin\.weight'.* \(or assigned their \.data\)"):
        precisebn.estimate(model, data())


@pytest.mark.parametrize("lazy", [nn.LazyLinear(6), nn.LazyBatchNorm1d()])
def test_uninitialised_lazy_module_anywhere_is_refused(lazy: nn.Module) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), lazy)
    before = state_snapshot(model[:2])  # (uninitialised tensors cannot be copied)
    with pytest.raises(UninitializedLayerError, match=r"'2'.*Run one forward pass first"):
        precisebn.recalibrate(model, data(), layers=["1"])
    assert_unchanged(model[:2], before)
    assert type(model[2]) is type(lazy)  # not materialised
    assert nn.parameter.is_lazy(model[2].weight)


# -- one pass per model at a time ---------------------------------------------------------


def test_second_thread_is_refused_and_the_first_finishes_exactly() -> None:
    model = mlp()
    reference = copy.deepcopy(model)
    batches = data(6)
    inside, release = threading.Event(), threading.Event()

    def slow():
        for i, b in enumerate(batches):
            if i == 2:
                inside.set()
                release.wait(10)
            yield b

    results: dict[str, object] = {}

    def first() -> None:
        try:
            results["report"] = precisebn.recalibrate(model, slow())
        except BaseException as exc:  # pragma: no cover - reported below
            results["error"] = exc

    t = threading.Thread(target=first)
    t.start()
    assert inside.wait(10)
    flags = [m.training for m in model.modules()]
    for call in (
        lambda: precisebn.recalibrate(model, batches),
        lambda: precisebn.estimate(model[1], batches),  # a module of the busy model
        lambda: precisebn.apply(model, precisebn.estimate(reference, batches)),
    ):
        with pytest.raises(ConcurrentUseError, match="already being recalibrated"):
            call()
    assert [m.training for m in model.modules()] == flags  # the refused calls touched nothing
    release.set()
    t.join(10)
    assert "error" not in results
    precisebn.recalibrate(reference, batches)
    for a, b in zip(model.buffers(), reference.buffers()):
        assert torch.equal(a, b)
    assert [m.momentum for m in model.modules() if isinstance(m, nn.BatchNorm1d)] == [0.1, 0.1]
    assert all("forward" not in m.__dict__ for m in model.modules())
    model.eval()
    model(batches[0])  # works: nothing left behind


def test_recalibrating_from_inside_forward_is_refused() -> None:
    model = mlp()
    before = state_snapshot(model)

    def forward(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        precisebn.recalibrate(m, [x])
        return m(x)

    with pytest.raises(ConcurrentUseError):
        precisebn.recalibrate(model, data(), forward=forward)
    assert_unchanged(model, before)


def test_two_models_recalibrate_in_parallel_threads() -> None:
    models = [mlp(), mlp()]
    errors: list[BaseException] = []

    def run(m: nn.Module) -> None:
        try:
            precisebn.recalibrate(m, data(20))
        except BaseException as exc:  # pragma: no cover
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(m,)) for m in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    truth = compute_truth(mlp(), data(20))
    for m in models:
        assert max_rel_error(m[1].running_var, truth["1"].var) <= 1e-5


# -- apply: everything checked first, all or nothing --------------------------------------


def stats_for(model: nn.Module, **override: torch.Tensor) -> PopulationStats:
    stats = precisebn.estimate(model, data())
    layers = dict(stats.layers)
    s = layers["1"]
    layers["1"] = LayerStats(
        override.get("mean", s.mean), override.get("var", s.var), s.count, s.calls, s.layer_type, s.path
    )
    return PopulationStats(layers, stats.samples, stats.batches, stats.mode)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"mean": torch.tensor([float("nan")] + [0.0] * 5, dtype=torch.float64)}, "NaN/Inf"),
        ({"var": -torch.ones(6, dtype=torch.float64)}, "negative variance"),
        ({"var": torch.ones(1, dtype=torch.float64)}, r"var has shape \(1,\)"),
        ({"mean": torch.tensor(0.0, dtype=torch.float64)}, r"mean has shape \(\)"),
        ({"var": torch.ones(7, dtype=torch.float64)}, r"var has shape \(7,\)"),
    ],
    ids=["nan-mean", "negative-var", "one-element-var", "0-d-mean", "longer-var"],
)
def test_apply_refuses_bad_statistics_and_writes_nothing(override: dict, message: str) -> None:
    model = mlp()
    stats = stats_for(model, **override)
    before = state_snapshot(model)
    with pytest.raises(StatsMismatchError, match=message):
        precisebn.apply(model, stats)
    assert_unchanged(model, before)


def test_apply_refuses_values_that_overflow_the_buffer_dtype() -> None:
    model = mlp()
    stats = stats_for(model, mean=torch.full((6,), 1e6, dtype=torch.float64))
    model.half()
    before = state_snapshot(model)
    with pytest.raises(StatsMismatchError, match=r"up to 1e\+06, beyond float16's largest 6.55e\+04.*layer.double"):
        precisebn.apply(model, stats)
    assert_unchanged(model, before)


@pytest.mark.parametrize("writes_with", ["foreach", "copy_"])
def test_apply_interrupted_while_writing_restores_everything(monkeypatch: pytest.MonkeyPatch, writes_with: str) -> None:
    """Ctrl-C after some buffers are written (by torch._foreach_copy_, or copy_ by copy_ where
    torch has no foreach copy) puts every buffer back."""
    model = mlp()
    stats = precisebn.estimate(model, data())
    before = state_snapshot(model)
    original = torch.Tensor.copy_
    writes = {"n": 0}

    def copy_(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        writes["n"] += 1
        if writes["n"] == 3:  # after the first layer's two buffers
            raise KeyboardInterrupt
        return original(self, src, non_blocking)

    def foreach_copy_(targets: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        for target, value in zip(targets, values):
            copy_(target, value)

    if writes_with == "foreach":
        assert hasattr(torch, "_foreach_copy_")  # what apply uses on this torch
        monkeypatch.setattr(torch, "_foreach_copy_", foreach_copy_)
    else:
        monkeypatch.delattr(torch, "_foreach_copy_")
        monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    with pytest.raises(KeyboardInterrupt):
        precisebn.apply(model, stats)
    monkeypatch.undo()
    assert writes["n"] >= 3
    assert_unchanged(model, before)


def test_apply_interrupted_while_building_the_report_writes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    model = mlp()
    stats = precisebn.estimate(model, data())
    before = state_snapshot(model)

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(sys.modules["precisebn.writing"], "Report", interrupted)
    with pytest.raises(KeyboardInterrupt):
        precisebn.apply(model, stats)
    assert_unchanged(model, before)


# -- layers whose figures were never produced ---------------------------------------------


def test_instance_level_forward_that_ignores_the_buffers_is_not_updated() -> None:
    model = mlp()
    model[1].forward = lambda x: x * 1.0  # replaced on the instance: running buffers never used
    before = state_snapshot(model[1])
    truth = compute_truth(model, data(), select=lambda n, _: n == "4")
    report = precisebn.recalibrate(model, data())
    assert not report["1"].updated and report["1"].calls == 4
    assert precisebn.estimate(model, data())["1"].path == "none"
    assert_unchanged(model[1], before)
    assert max_rel_error(model[4].running_var, truth["4"].var) <= 1e-5  # the others are measured


def test_instance_level_forward_that_delegates_keeps_the_fast_path() -> None:
    model = mlp()
    original = model[1].forward
    model[1].forward = lambda x: original(x)  # e.g. a logging or profiling wrapper
    truth = compute_truth(model, data())
    stats = precisebn.estimate(model, data())
    assert stats["1"].path == "fast"
    assert max_rel_error(stats["1"].var, truth["1"].var) <= 1e-5


def test_layer_that_never_tracks_is_not_updated() -> None:
    model = mlp()
    before = state_snapshot(model[1])

    def forward(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        m[1].track_running_stats = False  # its forward now normalises without its running buffers
        try:
            return m(x)
        finally:
            m[1].track_running_stats = True

    report = precisebn.recalibrate(model, data(), forward=forward)
    assert not report["1"].updated and report["4"].updated
    assert_unchanged(model[1], before)


def test_layer_that_stops_tracking_after_verification_is_an_error_not_an_update() -> None:
    model = mlp()
    before = state_snapshot(model)
    batches = iter(range(100))

    def forward(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        m[1].track_running_stats = next(batches) == 0  # writes its buffers in the first batch only
        try:
            return m(x)
        finally:
            m[1].track_running_stats = True

    with pytest.raises(UnsupportedLayerError, match=r"'1' \(BatchNorm1d\) changed its num_batches_tracked by 0"):
        precisebn.recalibrate(model, data(), forward=forward)
    assert_unchanged(model, before)


# -- smaller ones -------------------------------------------------------------------------


def test_keyword_input_is_measured() -> None:
    model = mlp()

    def forward(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m[1](input=m[0](x))

    truth = compute_truth(model, data(), forward=lambda m, x: m[1](m[0](x)), select=lambda n, _: n == "1")
    precisebn.recalibrate(model, data(), forward=forward, layers=["1"])
    assert max_rel_error(model[1].running_var, truth["1"].var) <= 1e-5


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"layers": 123}, "layers= takes qualified layer names"),
        ({"device": "nonsense"}, "device must be a torch.device"),
        ({"num_samples": 2.5}, "num_samples must be a positive integer"),
        ({"num_batches": np.int64(0)}, "num_batches must be a positive integer"),
    ],
)
def test_user_mistakes_are_clear_errors(options: dict, message: str) -> None:
    model = mlp()
    before = state_snapshot(model)
    with pytest.raises(InvalidArgumentError, match=message):
        precisebn.recalibrate(model, data(), **options)
    assert_unchanged(model, before)


def test_numpy_integers_are_accepted() -> None:
    stats = precisebn.estimate(mlp(), data(4, 8), num_samples=np.int64(16), num_batches=np.int32(5))
    assert stats.samples == 16 and stats.batches == 2


# -- torch.inference_mode -------------------------------------------------------------------


def conv_model() -> nn.Sequential:
    from timm.layers import BatchNormAct2d

    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Conv2d(4, 5, 1), BatchNormAct2d(5))


def images(n: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randn(4, 3, 6, 6, generator=g) * 2 + 1 for _ in range(n)]


def assert_exact(model: nn.Module, truth: dict) -> None:
    for name in ("1", "3"):
        t = truth[name]
        assert max_rel_error(model.get_submodule(name).running_mean, t.mean, t.var.sqrt()) <= 1e-6
        assert max_rel_error(model.get_submodule(name).running_var, t.var) <= 1e-5


@pytest.mark.parametrize("built_inside", [False, True])
def test_recalibrate_inside_inference_mode_is_exact(built_inside: bool) -> None:
    """Called inside torch.inference_mode() (the passes' own tensors would then keep no version
    counter), with data made there; and on a model built there, whose buffers are inference tensors
    that only that mode may write: exact against float64 truths (computed here, outside the mode),
    in one call, through estimate + apply, and through fvcore's drop-in."""
    if built_inside:
        with torch.inference_mode():
            model = conv_model()
    else:
        model = conv_model()
    with torch.inference_mode():
        batches = images()
    truth = compute_truth(model, [b.clone() for b in batches])
    twin, drop_in = copy.deepcopy(model), copy.deepcopy(model)
    with torch.inference_mode():
        precisebn.recalibrate(model, batches)
        precisebn.apply(twin, precisebn.estimate(twin, batches))
        update_bn_stats(drop_in, batches, num_iters=len(batches))
    for m in (model, twin, drop_in):
        assert_exact(m, truth)
    assert model[1].running_mean.is_inference() == built_inside  # the same buffer objects, written in place


def test_a_failing_pass_inside_inference_mode_leaves_the_model_as_it_was() -> None:
    with torch.inference_mode():
        model = conv_model()
    before = state_snapshot(model)
    with torch.inference_mode(), pytest.raises(OSError, match="disk read error"):
        precisebn.recalibrate(model, failing(images(4)))
    assert_unchanged(model, before)


class _StepCounted(nn.Module):
    """A forward that writes in place what inference mode lets it: a step counter of its own (an inference tensor
    in a model built there) and its input (``ReLU(inplace=True)`` first: an inference tensor made there)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = conv_model()
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        return self.body(torch.relu_(x))


def test_a_forward_that_writes_inference_tensors_runs_inside_inference_mode_as_called() -> None:
    """Found by probe 49: the passes left inference mode whole, so a forward that writes in place an inference tensor
    — a counter buffer of a model built in that mode, or its input made there — which runs inside the mode, raised
    torch's "Inplace update to inference tensor outside InferenceMode" under recalibrate called there (a mode the
    README supports). Now ``forward`` runs in the caller's inference mode (precisebn's own tensors stay outside it):
    exact against the float64 truth, the counter put back, nothing left inference-only that was not."""
    with torch.inference_mode():
        model = _StepCounted()
        batches = images()
        truth = compute_truth(model, [b.clone() for b in batches])  # (its forward runs there only)
    truth = {name.removeprefix("body."): t for name, t in truth.items()}
    twin = copy.deepcopy(model)  # (a copy made outside the mode: its buffers are not inference tensors)
    kinds = [m.steps.is_inference() for m in (model, twin)]
    with torch.inference_mode():
        precisebn.recalibrate(model, [b.clone() for b in batches])
        precisebn.apply(twin, precisebn.estimate(twin, [b.clone() for b in batches], capture="float64"))
        update_bn_stats(copy.deepcopy(model), [b.clone() for b in batches], num_iters=len(batches))
    for m, kind in zip((model, twin), kinds):
        assert_exact(m.body, truth)
        assert int(m.steps) == 0 and m.steps.is_inference() == kind


# -- memory shared between tensors -------------------------------------------------------------

_views = st.tuples(st.integers(0, 11), st.integers(1, 12), st.integers(1, 4), st.booleans())


@settings(max_examples=200, deadline=None)
@given(st.lists(_views, min_size=2, max_size=6), st.booleans())
def test_overlapping_lists_exactly_the_pairs_that_share_a_byte(specs: list, as_bytes: bool) -> None:
    """Against a brute force: views (slices, strided, some viewed as bytes) of one base, plus a
    separate tensor; a pair shares memory iff some element of one has a byte of the other."""
    base, other = torch.zeros(12, dtype=torch.float32), torch.zeros(3)
    tensors, owned = [], []
    for start, length, step, raw in specs:
        view = base[start : start + length : step]
        if raw and as_bytes and view.stride(-1) == 1:
            view = view.view(torch.uint8)
        tensors.append(view)
        index = torch.arange(12 * 4).view(12, 4)[start : start + length : step].reshape(-1)  # bytes of base
        owned.append(set(index.tolist()) if view.numel() else set())
    tensors.append(other)
    owned.append({-1 - i for i in range(12)})  # bytes of nothing in base
    expected = [(i, j) for i in range(len(tensors)) for j in range(i + 1, len(tensors)) if owned[i] & owned[j]]
    assert overlapping(tensors) == expected


def _interrupted(calls: Any, model: nn.Module, data: list[torch.Tensor]) -> None:
    """Recalibrates under the trace function ``calls`` (which raises KeyboardInterrupt somewhere: as a signal
    handler would), expecting it to come through."""
    import sys

    import precisebn

    sys.settrace(calls)
    try:
        with pytest.raises(KeyboardInterrupt):
            precisebn.recalibrate(model, data)
    finally:
        sys.settrace(None)


@pytest.mark.parametrize(
    ("function", "line"),
    [
        ("_restore_momenta", '_set_attributes(modules, "momentum", momenta)'),
        ("_unwrap_forwards", 'module.__dict__.pop("forward", None)'),
        ("_restore_flags", '_set_attributes(modules, "training", flags)'),
        ("_release", "del _busy[i]"),
        ("__call__", "owner = stack[-1] if stack else c._last"),  # a layer's call, before its bookkeeping
    ],
)
def test_ctrl_c_while_restoring_still_restores_everything(function: str, line: str) -> None:
    """Ctrl-C (simulated: raised by a trace function at one line, as a signal handler would) that lands in a
    restore used to leave momentum 1.0, a forward wrapper on the instance, or the model 'in use' forever."""
    import linecache
    import os

    import precisebn

    package = os.path.dirname(precisebn.__file__)
    fired: list[bool] = []

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "line" and not fired and line in linecache.getline(frame.f_code.co_filename, frame.f_lineno):
            fired.append(True)
            raise KeyboardInterrupt
        return local

    def calls(frame: Any, event: str, arg: Any) -> Any:
        code = frame.f_code
        return local if code.co_filename.startswith(package) and code.co_name == function else None

    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    data = [torch.randn(8, 4) for _ in range(3)]
    done = copy.deepcopy(model)
    precisebn.recalibrate(done, data)
    before = state_snapshot(model)
    after = {**state_snapshot(done), "buffer_ids": before["buffer_ids"]}  # (Ctrl-C after the writes: all written)
    _interrupted(calls, model, data)
    assert fired
    assert_unchanged(model, after if function == "_release" else before)
    precisebn.recalibrate(model, data)  # not left "in use"


def test_ctrl_c_while_marking_the_model_in_use_leaves_nothing_marked() -> None:
    """Probe 38: Ctrl-C (a real one, at a random moment, 1 in 30-270 tries on a model of 9,000 modules) landing
    between the marks that hold a model's modules left some marked: every later call on the model — re-running an
    interrupted notebook cell — was refused as "already being recalibrated by another call". Simulated here at the
    first line run once a mark is made."""

    import precisebn
    from precisebn import state

    model = nn.Sequential(*[nn.Sequential(nn.Identity(), nn.Identity()) for _ in range(50)], nn.BatchNorm1d(4))
    data = [torch.randn(8, 4) for _ in range(2)]
    before = state_snapshot(model)
    code = state.exclusive.__wrapped__.__code__
    assert interrupt_at_first_line(code, lambda: bool(state._busy), lambda: precisebn.recalibrate(model, data))
    assert not state._busy
    assert_unchanged(model, before)
    precisebn.recalibrate(model, data)  # not left "in use"
    # nor the lock behind the marks held by this thread (the interrupt came as the marking's `with` ended): a call
    # from another thread waited for it forever
    assert not state.lock_held(state._busy_lock)
    assert ends_in_another_thread(lambda: precisebn.recalibrate(copy.deepcopy(model), data)), "a later call hung"


class _HeldStatistics(nn.BatchNorm2d):
    """Keeps its running buffers in a list from __init__ and normalises with those (a probe)."""

    def __init__(self, channels: int) -> None:
        super().__init__(channels)
        self.stats = [self.running_mean, self.running_var]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean, var = self.stats
        return nn.functional.batch_norm(x, mean, var, self.weight, self.bias, self.training, self.momentum, self.eps)


class _ParentHoldsStatistics(nn.Module):
    """A fused conv+bn parent normalising with references to its child's buffers (a probe)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)
        self.rm, self.rv = self.bn.running_mean, self.bn.running_var

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = self.bn
        return nn.functional.batch_norm(self.conv(x), self.rm, self.rv, b.weight, b.bias, b.training, b.momentum, b.eps)


@pytest.mark.parametrize(
    "build", [lambda: nn.Sequential(nn.Conv2d(3, 4, 3), _HeldStatistics(4)), _ParentHoldsStatistics]
)
@pytest.mark.parametrize("function", ["estimate", "recalibrate"])
def test_statistics_written_through_references_held_elsewhere_are_refused_and_put_back(build, function) -> None:
    """The layer's own buffers are swapped out for the passes; code holding them apart (a list attribute, a
    parent) normalised with them, and the kernel wrote the last batch's figures there: estimate() left the
    model changed, recalibrate() reported the layer "kept" with its buffers changed (a probe). Now refused by
    name, the model bitwise as it was."""
    torch.manual_seed(0)
    model = build()
    bn = model[1] if isinstance(model, nn.Sequential) else model.bn
    with torch.no_grad():
        bn.running_mean.uniform_(0.5, 2.0)
        bn.running_var.uniform_(0.5, 2.0)
    before = state_snapshot(model)
    data = [torch.randn(4, 3, 10, 10) for _ in range(3)]
    with pytest.raises(UnsupportedLayerError, match="references held apart") as raised:
        getattr(precisebn, function)(model, data, num_batches=3)
    assert repr("1" if isinstance(model, nn.Sequential) else "bn") in str(raised.value)
    assert_unchanged(model, before)


def test_a_counter_written_through_a_held_reference_is_put_back() -> None:
    """A forward that counts its calls in a reference to its num_batches_tracked kept from __init__ writes the
    swapped-out counter: the statistics are unaffected (it normalises with its buffers), and the counter is put
    back bitwise."""

    class Counting(nn.BatchNorm1d):
        def __init__(self, channels: int) -> None:
            super().__init__(channels)
            self.calls = self.num_batches_tracked

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls.add_(10)
            return super().forward(x)

    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(3, 4), Counting(4))
    data = [torch.randn(8, 3) for _ in range(3)]
    truth = compute_truth(model, data)["1"]
    before = state_snapshot(model)
    stats = precisebn.estimate(model, data, num_batches=3)["1"]
    assert_unchanged(model, before)
    assert max_rel_error(stats.mean, truth.mean, truth.var.sqrt()) < 1e-6
    assert max_rel_error(stats.var, truth.var) < 1e-6


@pytest.mark.parametrize(
    "change",
    [lambda t: t.resize_(2, 2), lambda t: t.set_(torch.arange(8.0)), lambda t: t.resize_(2)],
    ids=["same size, new shape", "pointed at other memory", "shrunk"],
)
def test_held_buffers_resized_or_pointed_elsewhere_are_put_back_whole(change) -> None:
    """A reference held apart resized in place or pointed at other memory during the passes: the values went
    back but not the shape or memory — a (2, 2) running_mean, 8 values with garbage (a probe). Now its geometry
    is put back on its own storage first, then its values; the layer is refused by name."""

    class Resizing(nn.BatchNorm1d):
        def __init__(self) -> None:
            super().__init__(4)
            self.held = self.running_mean

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                change(self.held)
            return x

    model = nn.Sequential(nn.Linear(3, 4), Resizing())
    with torch.no_grad():
        model[1].running_mean.copy_(torch.arange(4.0))
    before = state_snapshot(model)
    storage = model[1].running_mean.untyped_storage().data_ptr()
    with pytest.raises(UnsupportedLayerError, match="written during the passes through references held apart"):
        precisebn.estimate(model, [torch.randn(8, 3) for _ in range(2)])
    assert_unchanged(model, before)
    assert model[1].running_mean.shape == (4,) and model[1].running_mean.untyped_storage().data_ptr() == storage


def test_buffers_written_by_a_hook_or_by_some_calls_are_refused_and_put_back() -> None:
    """Written through references held apart, the old buffers cannot say by whom: a mean-teacher hook holding
    list(teacher.buffers()) (an EMA at every student forward), or a parent normalising with them in every
    third call only — which a version refusing only layers that never normalised with their own buffers
    measured from the other calls, 2 batches of 3, 3 σ off, "updated" (probe 21). Both refused, put back."""
    torch.manual_seed(0)
    student = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    teacher = copy.deepcopy(student)
    with torch.no_grad():  # (the teacher's statistics move towards the student's)
        student[1].running_mean.fill_(0.5)
        student[1].running_var.fill_(2.0)
    pairs = list(zip(teacher.buffers(), student.buffers()))

    def ema(module: nn.Module, args: Any, out: Any) -> None:
        with torch.no_grad():
            for t, s in pairs:
                if t.dtype.is_floating_point:
                    t.mul_(0.99).add_(s, alpha=0.01)

    student.register_forward_hook(ema)
    model = nn.ModuleDict({"s": student, "t": teacher})
    before = state_snapshot(model)
    with pytest.raises(UnsupportedLayerError, match=r"'t\.1'.*a hook updating them"):
        precisebn.estimate(
            model, [torch.randn(2, 3, 8, 8) for _ in range(3)], forward=lambda m, x: m["t"](x) + m["s"](x)
        )
    assert_unchanged(model, before)

    class Sometimes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn = nn.BatchNorm1d(4)
            self.stats = [self.bn.running_mean, self.bn.running_var]
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            if self.calls % 3:
                return self.bn(x)
            b = self.bn
            return nn.functional.batch_norm(x, *self.stats, b.weight, b.bias, True, b.momentum, b.eps)

    model = Sometimes()
    before = state_snapshot(model)
    data = [torch.randn(64, 4), torch.randn(64, 4), torch.randn(64, 4) * 3 + 10]
    with pytest.raises(UnsupportedLayerError, match="'bn'"):
        precisebn.recalibrate(model, data)
    assert_unchanged(model, before)


def test_statistics_in_interleaved_columns_of_one_buffer_are_not_refused() -> None:
    """A BatchNorm and a tracked InstanceNorm whose statistics are interleaved columns of one (C, 4) buffer,
    under compat.update_bn (every module in training mode: the InstanceNorm, not selected, updates its columns
    and is restored after): the copy of the BatchNorm's non-contiguous buffers compared the whole stretch of
    memory they span — the InstanceNorm's columns included — and refused it (a probe). Compared element by
    element now."""
    from precisebn.compat import update_bn

    class Packed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.BatchNorm1d(4), nn.InstanceNorm1d(4, track_running_stats=True)
            self.register_buffer("pack", torch.zeros(4, 4))
            self.pack[:, 1] = 1
            self.pack[:, 3] = 1
            for i, bn in enumerate((self.a, self.b)):
                bn._buffers["running_mean"] = self.pack[:, 2 * i]
                bn._buffers["running_var"] = self.pack[:, 2 * i + 1]

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x))

    torch.manual_seed(0)
    model = Packed()
    data = [torch.randn(8, 4, 5) + 3 for _ in range(3)]
    truth = compute_truth(model, data, select=lambda name, m: name == "a")["a"]
    update_bn(data, model)
    assert max_rel_error(model.a.running_var.double(), truth.var) < 1e-6
    assert torch.equal(model.pack[:, 2:], torch.tensor([[0.0, 1.0]]).expand(4, 2))  # the InstanceNorm's, as it was


def test_attributes_a_forward_sets_during_the_passes_are_taken_back() -> None:
    """A layer caching a view of its buffers on its first call (``self.cache = self.running_mean.view(1, -1)[0]``)
    cached precisebn's scratch during the passes: after recalibrate() its eval output ignored the new statistics
    (off by 1.44) while the report said "updated", and the cached tap broke copy.deepcopy (probe 21). The
    modules' attributes are put back as they were: the cache is made again, from the real buffers."""

    class Cached(nn.BatchNorm2d):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if "cache" not in self.__dict__:
                self.cache = (self.running_mean.view(1, -1)[0], self.running_var.view(1, -1)[0])
            mean, var = self.cache
            return F.batch_norm(x, mean, var, self.weight, self.bias, self.training, self.momentum, self.eps)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), Cached(4))
    data = [torch.randn(4, 3, 8, 8) * 2 + 1 for _ in range(3)]
    truth = compute_truth(model, data)["1"]
    before = state_snapshot(model)
    precisebn.estimate(model, data)
    assert_unchanged(model, before)
    assert "cache" not in model[1].__dict__
    copy.deepcopy(model)
    precisebn.recalibrate(model, data)
    model.eval()
    x = torch.randn(2, 3, 8, 8)
    reference = nn.BatchNorm2d(4).eval()
    reference.load_state_dict(model[1].state_dict())
    with torch.no_grad():
        assert torch.allclose(model(x), reference(model[0](x)))
        assert max_rel_error(model[1].running_var.double(), truth.var) < 1e-6
    copy.deepcopy(model)


def test_a_hook_a_forward_registers_on_its_first_call_does_not_pile_up() -> None:
    """A forward registering a hook on its first call and keeping the handle (``self.handle = ...``): with only
    the attributes put back, the handle went and the hook stayed, and every recalibrate() added one more hook
    (probe 22). The modules' hook dicts are put back with their attributes: one hook, however many passes."""
    calls: list[int] = []

    class Hooked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn = nn.BatchNorm1d(3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if "handle" not in self.__dict__:
                self.handle = self.bn.register_forward_hook(lambda *_: calls.append(1))
            return self.bn(x)

    torch.manual_seed(0)
    model = Hooked()
    data = [torch.randn(8, 3) for _ in range(2)]
    truth = compute_truth(model, data)["bn"]
    before = state_snapshot(model)
    for _ in range(3):
        precisebn.estimate(model, data)
    assert_unchanged(model, before)
    assert not model.bn._forward_hooks and "handle" not in model.__dict__
    precisebn.recalibrate(model, data)
    assert not model.bn._forward_hooks
    assert max_rel_error(model.bn.running_var.double(), truth.var) < 1e-6
    calls.clear()
    model(torch.randn(4, 3))
    assert calls == [1]


def test_a_submodule_a_forward_builds_on_its_first_call_is_taken_back_whole() -> None:
    """A head built on the first call (``self.head = None`` in ``__init__``, an ``nn.Linear`` assigned in forward):
    with only the attributes put back, ``__dict__['head']`` was None again while ``_modules['head']`` kept the
    Linear — ``model.head`` None beside a Linear in ``state_dict()`` (probe 22). The child modules are put back
    too: the model is as it was, the head made again on its next call."""

    class LazyHead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn = nn.BatchNorm1d(3)
            self.head: nn.Module | None = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.head is None:
                self.head = nn.Linear(3, 2)
            return self.head(self.bn(x))

    torch.manual_seed(0)
    model = LazyHead()
    data = [torch.randn(8, 3) for _ in range(2)]
    truth = compute_truth(model, data)["bn"]
    before = state_snapshot(model)
    precisebn.estimate(model, data)
    assert_unchanged(model, before)
    assert model.head is None and "head" not in model._modules
    assert [k.split(".")[0] for k in model.state_dict()] == ["bn"] * 5
    precisebn.recalibrate(model, data)
    assert model.head is None and "head" not in model._modules
    assert max_rel_error(model.bn.running_var.double(), truth.var) < 1e-6
    model(torch.randn(4, 3))
    assert isinstance(model.head, nn.Linear) and model._modules["head"] is model.head


def test_a_cache_dict_a_forward_fills_is_emptied_again() -> None:
    """The probe-21 cache kept in a dict attribute the module already had (``self.cache = {}`` in ``__init__``,
    filled in forward with views of its buffers): the attribute is the same object, its contents were left —
    precisebn's scratch — and the recalibrated layer normalised with them. Containers held in the attributes
    are put back one level deep."""

    class Cached(nn.BatchNorm1d):
        def __init__(self, channels: int) -> None:
            super().__init__(channels)
            self.cache: dict[str, torch.Tensor] = {}

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if not self.cache:
                self.cache.update(mean=self.running_mean[:], var=self.running_var[:])
            mean, var = self.cache["mean"], self.cache["var"]
            return F.batch_norm(x, mean, var, self.weight, self.bias, self.training, self.momentum, self.eps)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), Cached(4))
    data = [torch.randn(8, 3) * 2 + 1 for _ in range(3)]
    truth = compute_truth(model, data)["1"]
    before = state_snapshot(model)
    precisebn.estimate(model, data)
    assert_unchanged(model, before)
    assert model[1].cache == {}
    precisebn.recalibrate(model, data)
    assert model[1].cache == {}
    model.eval()
    x = torch.randn(5, 3)
    reference = nn.BatchNorm1d(4).eval()
    reference.load_state_dict(model[1].state_dict())
    with torch.no_grad():
        assert torch.allclose(model(x), reference(model[0](x)))
    assert max_rel_error(model[1].running_var.double(), truth.var) < 1e-6


def test_containers_keyed_by_tensors_are_compared_by_identity() -> None:
    """A module holding a dict keyed by tensors (a memo keyed by its inputs) and a list of tensors: comparing
    them with ``==`` raises ("Boolean value of Tensor with more than one value is ambiguous") — every call
    failed in the first version of the containers' restore (on a dict it left alone). Compared by identity, the
    entries the forward added are taken back and the old ones kept."""

    class Memo(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn = nn.BatchNorm1d(3)
            self.key = torch.zeros(2)
            self.seen: dict[torch.Tensor, int] = {self.key: 0}
            self.inputs: list[torch.Tensor] = [torch.ones(2)]
            self.table = {torch.ones(2): "left alone"}  # (unchanged: compared item by item)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.seen[x] = len(self.seen)
            self.inputs.append(x)
            return self.bn(x)

    torch.manual_seed(0)
    model = Memo()
    data = [torch.randn(6, 3) + 1 for _ in range(3)]
    truth = compute_truth(model, data)["bn"]
    seen, inputs, table = dict(model.seen), list(model.inputs), model.table
    precisebn.recalibrate(model, data)
    assert list(model.seen) == list(seen) and model.seen[model.key] == 0
    assert len(model.inputs) == 1 and model.inputs[0] is inputs[0]
    assert model.table is table and len(table) == 1
    assert max_rel_error(model.bn.running_mean.double(), truth.mean) < 1e-6
    assert max_rel_error(model.bn.running_var.double(), truth.var) < 1e-6


def test_a_plain_model_is_found_as_it_was_in_one_look(monkeypatch: pytest.MonkeyPatch) -> None:
    """What precisebn itself changed (flags, momenta, the swapped buffers) is put back before the snapshot
    looks: a model whose forward changes nothing needs no module-by-module restore (taken for all 613
    containers of efficientnet_b0 on every call in a first version, 3 ms)."""
    restored: list[object] = []
    monkeypatch.setattr(precisebn.state, "_restore_contents", lambda container, _: restored.append(container))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.BatchNorm1d(64))
    model.eval()
    data = [torch.randn(4, 3, 6, 6) for _ in range(3)]
    truth = compute_truth(model, data)
    before = state_snapshot(model)
    precisebn.estimate(model, data)
    assert_unchanged(model, before)
    precisebn.recalibrate(model, data)
    assert restored == []
    assert not model.training and model[1].momentum == 0.1
    for name in ("1", "4"):
        assert max_rel_error(model.get_submodule(name).running_var.double(), truth[name].var) < 1e-6


class _Cache(dict):  # type: ignore[type-arg]
    """A dict subclass of the model's own."""


@pytest.mark.parametrize(
    "make",
    [lambda: collections.defaultdict(lambda: None), lambda: _Cache(), lambda: collections.deque()],
    ids=["defaultdict", "dict subclass", "deque"],
)
def test_a_cache_of_a_container_subclass_is_put_back_too(make: Callable[[], Any]) -> None:
    """Probe 23: the cache of the test above kept in a defaultdict, a dict subclass or a deque (containers were
    picked by exact type): it kept precisebn's scratch, and the recalibrated layer's eval output was 11.8 off."""

    class Cached(nn.BatchNorm1d):
        def __init__(self, channels: int) -> None:
            super().__init__(channels)
            self.cache = make()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if not self.cache:
                stats = (self.running_mean, self.running_var)
                self.cache.extend(stats) if isinstance(self.cache, collections.deque) else self.cache.update(s=stats)
            mean, var = tuple(self.cache) if isinstance(self.cache, collections.deque) else self.cache["s"]
            return F.batch_norm(x, mean, var, self.weight, self.bias, self.training, self.momentum, self.eps)

    torch.manual_seed(0)
    layer = Cached(4)
    data = [torch.randn(64, 4) * 3 + 5 for _ in range(4)]
    truth = compute_truth(layer, data)[""]
    precisebn.recalibrate(layer, data, num_samples="all")
    assert len(layer.cache) == 0 and type(layer.cache) is type(make())
    assert max_rel_error(layer.running_mean.double(), truth.mean) < 1e-6
    layer.eval()
    x = torch.randn(5, 4) * 3 + 5
    expected = (x.double() - truth.mean) / (truth.var + layer.eps).sqrt()
    with torch.no_grad():
        assert max_rel_error(layer(x).double(), expected, torch.ones(())) < 1e-5


def test_a_parametrization_a_forward_registers_is_taken_back_whole() -> None:
    """Probe 23: a forward registering a parametrization on its first call (torch swaps the module's class for
    ParametrizedConv2d and moves its weight into ``parametrizations``): with its dicts put back but not its
    class, the conv raised KeyError: 'weight' on the next call. Its class is put back too."""

    class Identity(nn.Module):
        def forward(self, w: torch.Tensor) -> torch.Tensor:
            return w

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)
            self.bn = nn.BatchNorm2d(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if not parametrize.is_parametrized(self.conv):
                parametrize.register_parametrization(self.conv, "weight", Identity())
            return self.bn(self.conv(x))

    torch.manual_seed(0)
    model = Model()
    weight = model.conv.weight
    data = [torch.randn(8, 3, 8, 8) for _ in range(2)]
    truth = compute_truth(copy.deepcopy(model), data)["bn"]
    before = state_snapshot(model)
    # (registering it sets the weight to itself, in place: torch bumps its version, which is all precisebn sees)
    with pytest.warns(ModelChangedWarning, match="'conv.weight'"):
        precisebn.estimate(model, data, num_samples="all")
    assert_unchanged(model, before)
    with pytest.warns(ModelChangedWarning, match="'conv.weight'"):
        precisebn.recalibrate(model, data, num_samples="all")
    assert (
        type(model.conv) is nn.Conv2d and model.conv.weight is weight and "parametrizations" not in model.conv._modules
    )
    assert max_rel_error(model.bn.running_var.double(), truth.var) < 1e-6
    model(torch.randn(1, 3, 8, 8))


def test_a_forward_replacing_its_dict_whole_gets_the_old_one_back() -> None:
    """Probe 23: a forward replacing ``self.__dict__`` by another dict (with a cache of its scratch buffers)
    kept it: the snapshot put back the old dict object, which the module no longer used."""

    class Swapping(nn.BatchNorm1d):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if "cache" not in self.__dict__:
                object.__setattr__(self, "__dict__", {**self.__dict__, "cache": self.running_mean})
            return super().forward(x)

    torch.manual_seed(0)
    layer = Swapping(3)
    attributes = layer.__dict__
    data = [torch.randn(16, 3) + 2 for _ in range(3)]
    truth = compute_truth(layer, data)[""]
    precisebn.recalibrate(layer, data, num_samples="all")
    assert layer.__dict__ is attributes and "cache" not in attributes
    assert max_rel_error(layer.running_var.double(), truth.var) < 1e-6


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    sizes=st.lists(st.integers(0, 5), min_size=1, max_size=8),
    touched=st.lists(st.tuples(st.integers(0, 7), st.integers(0, 4)), max_size=6),
)
def test_the_snapshot_writes_back_exactly_the_buffers_that_changed(
    sizes: list[int], touched: list[tuple[int, int]]
) -> None:
    """Buffers of several sizes and dtypes (empty ones too) in one blob; some elements changed in place: those
    buffers, and only those, are written back (the others keep their version counters) — the changed bytes are
    located in one pass, not buffer by buffer."""
    module = nn.Module()
    dtypes = (torch.float32, torch.float64, torch.int64, torch.float16)
    for i, n in enumerate(sizes):
        module.register_buffer(f"b{i}", (torch.arange(n) + 10 * i).to(dtypes[i % 4]))
    buffers = [module._buffers[f"b{i}"] for i in range(len(sizes))]
    values = [b.clone() for b in buffers]
    snapshot = precisebn.state.StateSnapshot([("", module)])
    changed = set()
    for i, j in touched:
        if i < len(sizes) and j < sizes[i]:
            buffers[i][j] += 1
            changed.add(i)
    versions = [b._version for b in buffers]
    assert snapshot.restore() == []
    for i, (b, v) in enumerate(zip(buffers, values)):
        assert module._buffers[f"b{i}"] is b and torch.equal(b, v)
        assert (b._version != versions[i]) == (i in changed), i


def test_a_buffer_whose_storage_a_forward_frees_gets_it_back() -> None:
    """Probe 26: a forward freeing a buffer's storage (``untyped_storage().resize_(0)``, as FSDP does to its
    parameters) under the same shape: restore raised ("out of bounds for storage of size 0") and stopped there —
    another buffer the same forward changed kept its new values. A forward growing a storage and then
    shrinking the tensor back left the storage 200 times its size (``torch.save`` writes all of it). The
    storage's size is part of what is compared and put back now."""

    class Freeing(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn = nn.BatchNorm1d(4)
            self.register_buffer("freed", torch.arange(5.0))
            self.register_buffer("grown", torch.arange(5.0) + 10)
            self.register_buffer("other", torch.zeros(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.other.add_(1)
            self.freed.untyped_storage().resize_(0)
            self.grown.resize_(1000).resize_(5).fill_(9)
            return self.bn(x)

    torch.manual_seed(0)
    model = Freeing()
    data = [torch.randn(8, 4) for _ in range(2)]
    truth = compute_truth(copy.deepcopy(model), data)["bn"]
    before = state_snapshot(model)
    precisebn.estimate(model, data)
    assert_unchanged(model, before)
    assert [model.freed.untyped_storage().nbytes(), model.grown.untyped_storage().nbytes()] == [20, 20]
    precisebn.recalibrate(model, data)
    assert model.freed.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0] and model.other.tolist() == [0.0] * 3
    assert model.grown.untyped_storage().nbytes() == 20
    assert max_rel_error(model.bn.running_var.double(), truth.var) < 1e-6


@pytest.mark.parametrize("how", ["share_memory_", ".data = shared", ".data = other"])
def test_parameters_moved_into_shared_memory_are_not_changed_but_replaced_data_is(how: str) -> None:
    """Pickling a model for a spawned worker moves its parameters into shared memory (``share_memory_()``, values
    and all, the same storage): that is no change, and was warned of as one. Data pointed elsewhere still is,
    shared memory or not."""
    module = nn.Linear(3, 2)
    weight = module.weight.detach().clone()
    snapshot = precisebn.state.StateSnapshot([("", module)])
    if how == "share_memory_":
        module.weight.share_memory_()
    elif how == ".data = shared":
        module.weight.data = torch.zeros(2, 3).share_memory_()
    else:
        module.weight.data = torch.zeros(2, 3)
    lost = snapshot.restore()
    assert module.weight.is_shared() == (how != ".data = other")
    assert lost == ([] if how == "share_memory_" else ["weight"])
    assert torch.equal(module.weight.detach(), weight) == (how == "share_memory_")


def test_a_pass_started_by_a_signal_handler_inside_another_does_not_wait_for_itself() -> None:
    """Probe 38: a signal handler (or a __del__ run by a garbage collection) running precisebn on another model,
    landing while this thread held the lock that marks models in use, waited for that lock forever: a hang. Run in a
    process of its own, the handler's call simulated at a line inside the lock."""
    import subprocess
    import sys

    script = """
import sys, torch
from torch import nn
import precisebn
from precisebn import state
other = nn.Sequential(nn.BatchNorm1d(2))
done = []
def local(frame, event, arg):
    line = open(frame.f_code.co_filename).readlines()[frame.f_lineno - 1]
    if event == "line" and not done and "clash = ids & _busy.keys()" in line:
        done.append(True)
        precisebn.estimate(other, [torch.randn(4, 2)])  # (what the handler runs)
    return local
def calls(frame, event, arg):
    return local if frame.f_code is state.exclusive.__wrapped__.__code__ else None
sys.settrace(calls)
precisebn.estimate(nn.Sequential(nn.BatchNorm1d(3)), [torch.randn(4, 3)])
sys.settrace(None)
print("ok" if done else "not reached")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stdout + out.stderr


@pytest.mark.parametrize("head_first", [True, False])
def test_an_embedding_weight_renormalised_in_place_is_put_back_whichever_module_holds_it_first(
    head_first: bool,
) -> None:
    """The review of probe 42: the weight of an Embedding with max_norm, which its forward renormalises in place, is
    copied so that it can be put back — but only when the Embedding held it first: tied to a Linear registered
    before it, it was only watched, and a computation left it renormalised (5.6 off, a ModelChangedWarning)."""

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            if head_first:
                self.head = nn.Linear(4, 20, bias=False)
            self.embedding = nn.Embedding(20, 4, max_norm=1.0)
            self.bn = nn.BatchNorm1d(4)
            if not head_first:
                self.head = nn.Linear(4, 20, bias=False)
            self.head.weight = self.embedding.weight  # (tied, as language models tie their input and output)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.head(self.bn(self.embedding(tokens)))

    torch.manual_seed(0)
    model = Tied()
    with torch.no_grad():
        model.embedding.weight.mul_(3.0)  # rows beyond max_norm: the forward renormalises them
    before = model.embedding.weight.detach().clone()
    data = [torch.randint(0, 20, (16,)) for _ in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        precisebn.recalibrate(model, data, num_samples="all")
    assert torch.equal(model.embedding.weight, before)


@pytest.mark.parametrize("originals", [1, 2])
def test_a_parametrized_embedding_weight_renormalised_through_a_view_is_put_back(originals: int) -> None:
    """The review of probe 42: under a parametrization that returns a view of its original, an Embedding's
    max_norm renormalises the original itself in place, which was only watched: a computation left it 13.7 off,
    with a ModelChangedWarning. The original is copied and put back."""
    from torch.nn.utils import parametrize

    class View(nn.Module):
        def forward(self, weight: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
            return weight.view(weight.shape)

        def right_inverse(self, weight: torch.Tensor) -> Any:  # (2: original0 and original1, the review's case)
            return weight if originals == 1 else (weight, torch.zeros(1))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embedding = nn.Embedding(20, 4, max_norm=1.0)
            self.bn = nn.BatchNorm1d(4)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.bn(self.embedding(tokens))

    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():
        model.embedding.weight.mul_(3.0)  # rows beyond max_norm
    parametrize.register_parametrization(model.embedding, "weight", View())
    plist = model.embedding.parametrizations.weight
    original = plist.original if originals == 1 else plist.original0
    before = original.detach().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        precisebn.recalibrate(model, [torch.randint(0, 20, (16,)) for _ in range(3)], num_samples="all")
    assert torch.equal(original, before)


@settings(max_examples=200, deadline=None)
@given(
    rows=st.integers(1, 5),
    cols=st.integers(1, 6),
    start=st.integers(0, 3),
    step=st.integers(1, 3),
    transpose=st.booleans(),
    kept=st.integers(0, 40),
)
def test_in_memory_says_whether_the_storage_still_holds_every_element_a_view_reaches(
    rows: int, cols: int, start: int, step: int, transpose: bool, kept: int
) -> None:
    """The cheap storage-size check that refuses freed running buffers (FSDP's ``resize_(0)``) agrees with
    torch's own bound check of a view over everything the tensor reaches, whatever the view and the size left."""
    base = torch.arange(40.0)
    t = base[start:].view(-1)[: rows * cols * step : step] if rows * cols * step <= 40 - start else base[start:]
    t = t.view(rows, -1) if t.numel() % rows == 0 else t
    t = t.t() if transpose and t.dim() == 2 else t
    extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    t.untyped_storage().resize_(kept * 4)
    try:
        t.as_strided((extent,), (1,), t.storage_offset())
        reachable = True
    except RuntimeError:
        reachable = False
    assert in_memory(t) is reachable
