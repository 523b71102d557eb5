"""Finding layers, and the one context manager that restores everything."""

from __future__ import annotations

import copy
import subprocess
import sys
import warnings
from typing import Any

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings
from torch import nn

import precisebn
from conftest import (
    assert_unchanged,
    compute_truth,
    ends_in_another_thread,
    interrupt_at_first_line,
    max_rel_error,
    state_snapshot,
)
from precisebn.errors import LayerNotFoundError, PreciseBNWarning
from precisebn.layers import ScratchGroup, find_norm_layers, has_running_stats, recalibration_state, unwrap


def test_has_running_stats() -> None:
    assert has_running_stats(nn.BatchNorm2d(3))
    assert has_running_stats(nn.SyncBatchNorm(3))
    assert has_running_stats(nn.InstanceNorm2d(3, track_running_stats=True))
    assert not has_running_stats(nn.InstanceNorm2d(3))
    assert not has_running_stats(nn.BatchNorm2d(3, track_running_stats=False))
    assert not has_running_stats(nn.LayerNorm(3))
    assert not has_running_stats(nn.GroupNorm(1, 3))


def test_shared_layer_is_found_once() -> None:
    bn = nn.BatchNorm1d(3)
    model = nn.Sequential(bn, nn.ReLU(), bn)
    assert [layer.name for layer in find_norm_layers(model)] == ["0"]


@pytest.mark.parametrize("mode", ["norm", "train", "keep"])
def test_state_inside_and_restored_after(mode: str) -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Dropout(), nn.BatchNorm1d(3), nn.Identity())
    model[0].training = False
    model[3].momentum = None
    before = state_snapshot(model)
    layers = find_norm_layers(model, ["1"])
    with recalibration_state(model, layers, mode) as state:  # type: ignore[arg-type]
        assert model[1].momentum == 1.0
        assert model[1].running_mean is state.views[0][0]
        if mode == "norm":
            assert [m.training for m in model] == [False, True, False, False, False]
        elif mode == "train":
            assert [m.training for m in model] == [True, True, True, False, True]
        state.add_pre_hook(model[1], lambda m, a, k: None)
        model(torch.randn(4, 3))
    assert_unchanged(model, before)


def test_restored_when_the_block_raises() -> None:
    model = nn.Sequential(nn.BatchNorm1d(3), nn.BatchNorm1d(3))
    before = state_snapshot(model)

    def interrupted() -> None:
        with recalibration_state(model, find_norm_layers(model), "norm") as state:
            state.add_pre_hook(model[0], lambda m, a, k: None)
            model(torch.randn(4, 3) * 100)
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        interrupted()
    assert_unchanged(model, before)


def test_train_override_is_not_called() -> None:
    class Stubborn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn = nn.BatchNorm1d(2)
            self.calls = 0

        def train(self, mode: bool = True) -> Stubborn:
            self.calls += 1
            return super().train(mode)

    model = Stubborn()
    with recalibration_state(model, find_norm_layers(model), "norm"):
        pass
    assert model.calls == 0


def test_unwrap_data_parallel() -> None:
    inner = nn.BatchNorm1d(2)
    assert unwrap(nn.DataParallel(inner)) is inner


def test_unwrap_compiled_module() -> None:
    inner = nn.Sequential(nn.BatchNorm1d(2))
    compiled = torch.compile(inner)
    assert unwrap(compiled) is inner


class _Shared(nn.Module):
    """A BatchNorm called twice per forward, and one fed inputs with a large mean."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 8, 3), nn.Conv2d(8, 8, 3, padding=1)
        self.bn, self.bn2 = nn.BatchNorm2d(8), nn.BatchNorm2d(8, affine=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn(self.c1(x)).relu()
        return self.bn2(self.bn(self.c2(y)) * 2 + 50)


@pytest.mark.parametrize("how", ["submodule", "fullgraph submodule", "module.compile"])
@pytest.mark.parametrize("batches", [3, 12])
def test_compiled_code_runs_eagerly_during_the_passes(how: str, batches: int) -> None:
    """Compiled code runs as plain PyTorch during the passes (set_stance("force_eager")):
    nothing is compiled for them, fullgraph=True is no obstacle, the statistics are exact,
    and the stance is put back. (Traced, the bookkeeping's counters became guards: 23
    graphs per call, ~7 s with inductor for 12 batches; fullgraph=True failed.)"""
    import torch._dynamo

    torch.manual_seed(0)
    plain = _Shared()
    data = [torch.randn(4, 3, 10, 10) * 3 + 1 for _ in range(batches)]
    truth = compute_truth(plain, data)
    graphs = 0

    def counting_backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        nonlocal graphs
        graphs += 1
        return gm.forward

    torch._dynamo.reset()
    model = copy.deepcopy(plain)
    if how == "module.compile":
        model.compile(backend=counting_backend)
        inner = model
    else:
        model = nn.Sequential(torch.compile(model, backend=counting_backend, fullgraph=how.startswith("fullgraph")))
        inner = model[0]._orig_mod
    try:
        model(data[0])  # compiled, as in training
        before = graphs
        assert before > 0
        precisebn.recalibrate(model, data, num_samples="all")
        assert graphs == before  # nothing compiled for the passes
        torch.compile(lambda x: x + 1, backend=counting_backend)(data[0])
        assert graphs == before + 1  # the stance is back: compiled code compiles again
    finally:
        torch._dynamo.reset()
    for name, t in truth.items():
        bn = inner.get_submodule(name)
        assert max_rel_error(bn.running_mean, t.mean, t.var.sqrt()) < 1e-5, name
        assert max_rel_error(bn.running_var, t.var) < 1e-5, name


@pytest.mark.filterwarnings("ignore::UserWarning:torch._dynamo")  # dynamo on tracing the bookkeeping: expected here
def test_compiled_submodule_before_torch_2_6_is_still_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch < 2.6 has no set_stance (precisebn needs torch >= 2.1): the passes then run
    compiled, tracing the bookkeeping (slow), and the statistics are still exact."""
    import torch._dynamo

    monkeypatch.delattr(torch.compiler, "set_stance")
    torch.manual_seed(0)
    plain = _Shared()
    data = [torch.randn(4, 3, 10, 10) * 3 + 1 for _ in range(3)]
    truth = compute_truth(plain, data)
    model = nn.Sequential(torch.compile(copy.deepcopy(plain), backend="eager"))
    try:
        precisebn.recalibrate(model, data, num_samples="all")
    finally:
        torch._dynamo.reset()
    for name, t in truth.items():
        bn = model[0]._orig_mod.get_submodule(name)
        assert max_rel_error(bn.running_mean, t.mean, t.var.sqrt()) < 1e-5, name
        assert max_rel_error(bn.running_var, t.var) < 1e-5, name


def test_ctrl_c_while_the_stance_is_put_back_still_puts_it_back() -> None:
    """Probe 38: Ctrl-C landing as the compile stance was put back (entering set_stance's __exit__) left it at
    "force_eager" for the rest of the process: every torch.compile afterwards ran eagerly, silently."""
    import sys

    import torch._dynamo
    import torch._dynamo.eval_frame as eval_frame

    fired: list[bool] = []

    def calls(frame: Any, event: str, arg: Any) -> Any:
        caller = frame.f_back.f_code.co_name if frame.f_back is not None else ""
        if event == "call" and frame.f_code.co_name == "__exit__" and not fired and "eager" in caller:
            fired.append(True)
            raise KeyboardInterrupt  # (what Python's SIGINT handler raises as the call starts)
        return None

    before = eval_frame._stance.stance
    sys.settrace(calls)
    try:
        with pytest.raises(KeyboardInterrupt):
            precisebn.recalibrate(nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)), [torch.randn(8, 4)])
    finally:
        sys.settrace(None)
    assert fired
    assert eval_frame._stance.stance == before


def test_ctrl_c_as_the_stance_is_taken_leaves_the_lock_to_other_threads() -> None:
    """An interrupt raised as the block that takes the stance ended, before the lock's __exit__, left this thread
    holding the lock: every later pass from another thread waited for it forever (a review: a test hung)."""
    import torch._dynamo  # (the stance is taken only with dynamo loaded)

    from precisebn import layers as layers_module
    from precisebn.state import lock_held

    model, data = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)), [torch.randn(8, 4)]
    assert interrupt_at_first_line(
        layers_module._compiled_code_runs_eagerly.__wrapped__.__code__,
        lambda: bool(layers_module._eager_holders),
        lambda: precisebn.recalibrate(model, data),
    )
    assert not lock_held(layers_module._eager_lock) and not layers_module._eager_holders
    assert ends_in_another_thread(lambda: precisebn.recalibrate(model, data)), "a later pass in another thread hung"


def test_the_eager_stance_is_put_back_by_the_last_of_concurrent_passes() -> None:
    """Two threads recalibrating two models at once: the global stance is set once and put
    back when the last pass ends, not when the first does."""
    import threading

    import torch._dynamo

    from precisebn import layers as layers_module

    started, release = threading.Barrier(3), threading.Event()

    class Waits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn = nn.BatchNorm1d(2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            started.wait(timeout=30)
            release.wait(timeout=30)
            return self.bn(x)

    errors: list[BaseException] = []

    def run() -> None:
        try:
            precisebn.recalibrate(Waits(), [torch.randn(4, 2)], num_samples="all")
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    started.wait(timeout=30)
    assert len(layers_module._eager_holders) == 2
    release.set()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    assert not layers_module._eager_holders and layers_module._eager_stance is None
    graphs = 0

    def counting_backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        nonlocal graphs
        graphs += 1
        return gm.forward

    torch.compile(lambda x: x * 2, backend=counting_backend)(torch.ones(2))
    torch._dynamo.reset()
    assert graphs == 1  # compiling again: no pass left the eager stance behind


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:FutureWarning")
@pytest.mark.parametrize("how", ["script", "trace"])
def test_torchscript_model_is_refused_with_the_reason(how: str) -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))
    x = torch.randn(2, 3, 4, 4)
    scripted = torch.jit.script(model) if how == "script" else torch.jit.trace(model, x)
    with pytest.raises(
        LayerNotFoundError, match=r"layer '1' of \w+ is TorchScript .* recalibrate the nn.Module before"
    ):
        precisebn.recalibrate(scripted, [x])


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:FutureWarning")
def test_torchscript_submodule_is_named_in_a_warning_and_kept() -> None:
    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.eager = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))
            self.frozen = torch.jit.script(nn.Sequential(nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4)))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.frozen(self.eager(x))

    model = Mixed()
    kept = model.frozen.state_dict()
    with pytest.warns(PreciseBNWarning, match=r"layer 'frozen.1' of Mixed is TorchScript .* Its statistics are kept"):
        report = precisebn.recalibrate(model, [torch.randn(2, 3, 4, 4) * 3 for _ in range(3)])
    assert report.updated == ["eager.1"]
    assert all(torch.equal(v, kept[k]) for k, v in model.frozen.state_dict().items())


def test_an_uncompiled_model_does_not_import_dynamo() -> None:
    """torch._dynamo takes ~2 s to import; a program that compiles nothing should not pay it."""
    code = (
        "import sys, torch, precisebn\n"
        "model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))\n"
        "precisebn.recalibrate(model, [torch.randn(8, 3) for _ in range(3)], num_samples='all')\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out


def test_instance_level_forward_is_put_back() -> None:
    bn = nn.BatchNorm1d(2)
    patched = bn.forward  # e.g. a library that patched forward on this instance
    bn.forward = patched
    layers = find_norm_layers(bn)
    seen = []
    with recalibration_state(bn, layers, "norm") as state:
        state.add_pre_hook(bn, lambda m, a, k: seen.append(a[0].shape))
        bn(torch.randn(3, 2))
    assert seen == [torch.Size([3, 2])]
    assert bn.__dict__["forward"] is patched
    plain = nn.BatchNorm1d(2)
    with recalibration_state(plain, find_norm_layers(plain), "norm") as state:
        state.add_pre_hook(plain, lambda m, a, k: None)
    assert "forward" not in plain.__dict__


@settings(max_examples=30, deadline=None)
@given(channels=st.lists(st.integers(1, 40), min_size=1, max_size=8), data=st.data())
def test_a_scratch_groups_slices_and_positions_follow_its_layout(channels: list[int], data: st.DataObject) -> None:
    """slices() and positions() of a group of layers with unaligned channel counts agree with
    the layout written out by hand: layer i at offsets[i] for channels[i] columns."""
    offsets, at = [], 0
    for c in channels:
        offsets.append(at)
        at += -(-c // 16) * 16
    ids = [10 + i for i in range(len(channels))]
    group = ScratchGroup(torch.zeros(2, at), ids, offsets, channels)
    keep = sorted(data.draw(st.sets(st.sampled_from(ids), min_size=1)))
    by_hand = [col for i, off, c in zip(ids, offsets, channels) if i in keep for col in range(off, off + c)]
    marked = torch.arange(float(at))
    assert [t.tolist() for t in group.slices(marked)] == [
        list(map(float, range(o, o + c))) for o, c in zip(offsets, channels)
    ]
    layer_of = group.positions(keep, other=-1).tolist()
    assert [col for col, i in enumerate(layer_of) if i != -1] == by_hand
    assert all(
        layer_of[col] == i for i, off, c in zip(ids, offsets, channels) if i in keep for col in range(off, off + c)
    )


def test_scratch_starts_from_each_layer_s_statistics_and_is_reset_to_them() -> None:
    """What code reading the buffers during a pass sees (before a layer's call in each batch):
    the layer's own statistics, NaN/Inf replaced (means 0, variances 1, negative variances 0),
    whatever their dtype (a float64 running_var beside a float32 running_mean is converted)."""
    a, b, c = nn.BatchNorm1d(3), nn.BatchNorm1d(2), nn.BatchNorm1d(2)
    with torch.no_grad():
        a.running_mean.copy_(torch.tensor([1.5, -2.0, 0.25]))
        a.running_var.copy_(torch.tensor([4.0, 0.5, 9.0]))
        b.running_mean.copy_(torch.tensor([float("nan"), float("inf")]))
        b.running_var.copy_(torch.tensor([-1.0, float("nan")]))
    c.running_var = torch.tensor([2.0, 3.0], dtype=torch.float64)
    model = nn.Sequential(a, b, c)
    expected = {
        a: ([1.5, -2.0, 0.25], [4.0, 0.5, 9.0]),
        b: ([0.0, 0.0], [0.0, 1.0]),
        c: ([0.0, 0.0], [2.0, 3.0]),
    }
    with torch.no_grad(), recalibration_state(model, find_norm_layers(model), "norm") as state:
        for module, (mean, var) in expected.items():
            assert module.running_mean.tolist() == mean and module.running_var.tolist() == var
        for group in state.groups:
            group.buffer.uniform_()  # a batch's figures
            group.reset()
        for module, (mean, var) in expected.items():
            assert module.running_mean.tolist() == mean and module.running_var.tolist() == var
    assert b.running_mean.isnan()[0] and a.running_var.tolist() == [4.0, 0.5, 9.0]  # the model's, untouched


def test_a_layer_registered_twice_is_selected_by_either_name() -> None:
    class Aliased(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn = nn.BatchNorm1d(4)
            self.sub = nn.Sequential()
            self.sub.alias = self.bn  # get_submodule("sub.alias") is self.bn

    model = Aliased()
    for names in (["sub.alias"], ["bn"], ["bn", "sub.alias"]):
        assert [layer.name for layer in find_norm_layers(model, names)] == ["bn"]
    with pytest.raises(LayerNotFoundError, match=r"sub\.alia"):
        find_norm_layers(model, ["sub.alia"])


def test_a_glob_given_as_a_layer_name_is_told_how_to_select_by_pattern() -> None:
    """The command line's ``--layers`` takes globs; the API takes names, and its error said only "not found"."""
    import fnmatch

    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 4), nn.BatchNorm1d(4))
    with pytest.raises(LayerNotFoundError, match=r"'\[13\]'.* in Python pass a predicate") as raised:
        find_norm_layers(model, ["[13]"])
    assert isinstance(raised.value, LookupError)
    with pytest.raises(LayerNotFoundError) as plain:
        find_norm_layers(model, ["2x"])
    assert "predicate" not in str(plain.value)
    chosen = find_norm_layers(model, lambda name, module: fnmatch.fnmatch(name, "[13]"))  # (as the message says)
    assert [layer.name for layer in chosen] == ["1", "3"]


def test_running_statistics_held_as_parameters_are_refused_clearly() -> None:
    import precisebn
    from precisebn.compat import update_bn, update_bn_stats
    from precisebn.errors import UnsupportedLayerError

    bn = nn.BatchNorm1d(4)
    bn.running_mean = nn.Parameter(torch.zeros(4), requires_grad=False)  # (torch's forward runs with them)
    bn.running_var = nn.Parameter(torch.ones(4), requires_grad=False)
    model = nn.Sequential(nn.Linear(3, 4), bn)
    batches = [torch.randn(8, 3) for _ in range(3)]
    before = copy.deepcopy(model.state_dict())
    calls = [
        lambda: precisebn.recalibrate(model, batches),
        lambda: precisebn.estimate(model, batches),
        lambda: update_bn(batches, model),
        lambda: update_bn_stats(model, batches, num_iters=3),
    ]
    for call in calls:
        with pytest.raises(UnsupportedLayerError, match=r"layer '1' \(BatchNorm1d\) keeps its running_mean and "):
            call()  # (was a bare KeyError: 'running_mean')
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_predicate_finds_a_shared_layer_by_any_of_its_names() -> None:
    """A BatchNorm registered as ``stem.1`` and ``blk.1``: a predicate saw only its first name, so selecting
    ``blk.`` left it out silently and naming ``blk.1`` found nothing (a probe) — while a list of names finds it
    by either. Now the predicate is asked with every name."""
    shared = nn.BatchNorm1d(4)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Sequential(nn.Linear(4, 4), shared)
            self.blk = nn.Sequential(nn.Linear(4, 4), shared, nn.Linear(4, 4), nn.BatchNorm1d(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.blk(self.stem(x))

    model = Model()
    by_prefix = precisebn.layers.find_norm_layers(model, lambda name, module: name.startswith("blk."))
    assert [layer.module for layer in by_prefix] == [shared, model.blk[3]]
    exact = precisebn.layers.find_norm_layers(model, lambda name, module: name == "blk.1")
    assert [layer.module for layer in exact] == [shared]
    listed = precisebn.layers.find_norm_layers(model, ["blk.1", "blk.3"])
    assert [layer.module for layer in listed] == [shared, model.blk[3]]


def test_a_predicate_on_a_wrapped_model_is_asked_with_the_model_s_own_names() -> None:
    """A predicate is asked with the unwrapped model's names, one naming scheme: asked with a DataParallel's
    ``module.`` names as well, ``not name.startswith("head")`` selected the head through ``module.head.1``, and
    a predicate parsing names raised (a probe, on a version that asked both)."""
    model = nn.Sequential()
    model.add_module("backbone", nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)))
    model.add_module("head", nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    data = [torch.randn(8, 3) for _ in range(2)]
    for wrapped in (model, nn.DataParallel(model)):
        stats = precisebn.estimate(wrapped, data, layers=lambda name, module: not name.startswith("head"))
        assert list(stats) == ["backbone.1"]
        parsed = precisebn.estimate(wrapped, data, layers=lambda name, module: name.split(".")[0] == "head")
        assert list(parsed) == ["head.1"]


def test_a_parametrized_running_buffer_is_refused_with_a_remedy_that_works() -> None:
    """Found by a probe: for a running_var under a parametrization the refusal said `del layer.running_var`,
    which raises (a parametrized attribute is a property, with no deleter); it now names
    remove_parametrizations, and that remedy is checked to work."""
    from torch.nn.utils import parametrize

    from precisebn.errors import UnsupportedLayerError

    class Square(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * x

        def right_inverse(self, x: torch.Tensor) -> torch.Tensor:
            return x.sqrt()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    parametrize.register_parametrization(model[1], "running_var", Square())
    batches = [torch.randn(8, 3) * 2 + 1 for _ in range(3)]
    with pytest.raises(UnsupportedLayerError, match=r"remove_parametrizations\(layer, 'running_var'\)") as caught:
        precisebn.recalibrate(model, batches)
    assert "del layer" not in str(caught.value)
    parametrize.remove_parametrizations(model[1], "running_var")  # (the remedy, as said)
    truth = compute_truth(model, batches)["1"]
    precisebn.recalibrate(model, batches)
    assert max_rel_error(model[1].running_var, truth.var) <= 1e-5


def test_an_exported_graph_is_refused_with_the_reason() -> None:
    """Found by a probe: a torch.export'd model (its BatchNorm layers turned into graph operations, their
    buffers kept) was refused with a bare "no normalization layer ... was selected"."""
    from precisebn.errors import LayerNotFoundError

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).eval()
    graph = torch.export.export(model, (torch.randn(2, 3, 8, 8),)).module()
    with pytest.raises(LayerNotFoundError, match=r"Its buffers '1\.running_mean' are running statistics that no"):
        precisebn.estimate(graph, [torch.randn(2, 3, 8, 8)])
    from torchvision.ops import FrozenBatchNorm2d

    for other in (nn.Sequential(nn.Conv2d(3, 4, 3)), nn.Sequential(nn.Conv2d(3, 4, 3), FrozenBatchNorm2d(4))):
        with pytest.raises(LayerNotFoundError) as plain:  # (no word of graphs)
            precisebn.estimate(other, [torch.randn(2, 3, 8, 8)])
        assert "exported" not in str(plain.value)


class _TracedThrough(torch.fx.Tracer):
    """Traces through the BatchNorm layers of the class below (into F.batch_norm operations on their buffers)."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return not isinstance(m, _Inlined) and super().is_leaf_module(m, qualname)


class _Inlined(nn.BatchNorm2d):
    def _check_input_dim(self, input: torch.Tensor) -> None:  # (a branch on the input: not traceable)
        pass


@pytest.mark.parametrize("kept", [True, False])
def test_a_torch_fx_graph_with_layers_traced_into_operations_says_so(kept: bool) -> None:
    """Probe 38: a torch.fx graph in which one BatchNorm was traced through (an operation on its buffers) and
    another kept as a module was recalibrated without a word of the first: its statistics stayed stale. Now a
    warning names its buffers; with no layer kept, the refusal says why — a symbolic_trace result's class is named
    after the module traced (not "GraphModule"), and the refusal had left the reason out."""
    from precisebn.errors import LayerNotFoundError, PreciseBNWarning

    model = nn.Sequential(nn.Conv2d(3, 4, 3), _Inlined(4), nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4) if kept else nn.ReLU())
    graph = torch.fx.GraphModule(model, _TracedThrough().trace(model), "Net")
    assert type(graph).__name__ == "Net"
    batches = [torch.randn(2, 3, 8, 8) for _ in range(2)]
    if not kept:
        with pytest.raises(LayerNotFoundError, match=r"Its buffers '1\.running_mean' are running statistics that no"):
            precisebn.estimate(graph, batches)
        layer = _Inlined(3)  # traced itself: the buffers on the graph's root, whose class is named "_Inlined"
        root = torch.fx.GraphModule(layer, _TracedThrough().trace(layer), "_Inlined")
        with pytest.raises(LayerNotFoundError, match=r"Its buffers 'running_mean' are running statistics that no"):
            precisebn.estimate(root, batches)
        return
    before = graph.get_submodule("1").running_mean.clone()
    with pytest.warns(PreciseBNWarning, match=r"1 running statistics buffer\(s\) of Net, a torch.fx graph, .*'1\.run"):
        report = precisebn.recalibrate(graph, batches)
    assert report.updated == ["3"]
    assert torch.equal(graph.get_submodule("1").running_mean, before)  # (kept, as the warning says)
    from torchvision.ops import FrozenBatchNorm2d

    plain = torch.fx.symbolic_trace(  # (layers kept as modules, a frozen one too: nothing to warn of)
        nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), FrozenBatchNorm2d(4))
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", PreciseBNWarning)
        precisebn.recalibrate(plain, batches)


def test_a_model_whose_only_normalization_is_frozen_says_so() -> None:
    """Found by probe 36a: a model built with FrozenBatchNorm2d only (a torchvision detection backbone) was refused
    with the bare "no normalization layer ... was selected", not a word of its frozen layers."""
    from torchvision.ops import FrozenBatchNorm2d

    from precisebn.errors import LayerNotFoundError

    model = nn.Sequential(nn.Conv2d(3, 4, 3), FrozenBatchNorm2d(4), nn.Conv2d(4, 4, 1), FrozenBatchNorm2d(4))
    with pytest.raises(LayerNotFoundError, match=r"Its 2 FrozenBatchNorm layers \('1' and others\) hold fixed"):
        precisebn.estimate(model, [torch.randn(2, 3, 8, 8)])
    with pytest.raises(LayerNotFoundError) as chosen:  # (layers= chose none of something else: no word of them)
        precisebn.estimate(nn.Sequential(nn.BatchNorm2d(3), FrozenBatchNorm2d(3)), [torch.randn(2, 3, 8, 8)], layers=[])
    assert "FrozenBatchNorm" not in str(chosen.value)


def test_a_predicate_that_does_not_fit_is_refused_by_name() -> None:
    """Found by probe 33b: a ``layers=`` predicate of one argument raised Python's own TypeError, one returning a
    tensor of several values torch's "Boolean value of Tensor with more than one value is ambiguous"."""
    import precisebn
    from precisebn.errors import InvalidArgumentError

    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))
    data = [torch.randn(2, 3, 4, 4)]
    with pytest.raises(InvalidArgumentError, match=r"bool; calling it on '1' raised TypeError"):
        precisebn.estimate(model, data, layers=lambda name: True)
    with pytest.raises(InvalidArgumentError, match=r"on '1' it returned Tensor .* which is not a truth value"):
        precisebn.estimate(model, data, layers=lambda name, m: getattr(m, "running_mean", torch.zeros(1)) == 0)
    assert precisebn.estimate(model, data, layers=lambda name, m: name == "1")["1"].count == 32

    def own_error(name: str, module: nn.Module) -> bool:  # (probe 35a: reworded as a signature problem)
        raise TypeError("the predicate's own")

    with pytest.raises(TypeError, match="the predicate's own") as raised:
        precisebn.estimate(model, data, layers=own_error)
    assert not isinstance(raised.value, InvalidArgumentError)


@pytest.mark.parametrize("capture", ["auto", "float64"])
def test_tracing_the_model_during_the_passes_is_refused(capture: str) -> None:
    """Probe 37: torch.jit.trace(model, x, check_trace=False) in forward recorded precisebn's bookkeeping into the
    traced module the user kept (and the layers in training mode, momentum 1), and its count came back a tensor,
    which stats.save() could not write. Refused by name; the model is left as it was."""
    import precisebn
    from conftest import assert_unchanged, state_snapshot
    from precisebn.errors import UnsupportedLayerError

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    batches = [torch.randn(2, 3, 8, 8) for _ in range(3)]
    kept = []

    def forward(m: nn.Module, x: torch.Tensor) -> None:
        if not kept:
            kept.append(torch.jit.trace(m, x, check_trace=False))
        m(x)

    before = state_snapshot(model)
    with pytest.raises(UnsupportedLayerError, match=r"layer '1' \(BatchNorm2d\) was called by torch.jit.trace"):
        precisebn.estimate(model, batches, forward=forward, capture=capture)
    assert_unchanged(model, before)


class _HandWrittenNorm(nn.Module):
    """A normalization of another class that keeps a running variance as a buffer (as timm's EvoNorm2dB0 does)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.register_buffer("running_var", torch.ones(1, channels, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            var = x.var(dim=(0, 2, 3), keepdim=True)
            self.running_var.mul_(0.9).add_(var, alpha=0.1)
        else:
            var = self.running_var
        return x / (var + 1e-5).sqrt()


def test_a_module_of_another_class_keeping_running_statistics_is_named_and_kept() -> None:
    """Found by probe 43b: a module that keeps running statistics but is not a subclass of torch's _NormBase (timm's
    EvoNorm2dB0, a hand-written BatchNorm) was left out without a word — beside BatchNorm layers, its statistics
    stayed stale unwarned; alone, the refusal named TorchScript and FrozenBatchNorm, not it. It is named now, in a
    warning (its statistics kept, bitwise) and in the refusal; the BatchNorm beside it is recalibrated exactly."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), _HandWrittenNorm(4))
    batches = [torch.randn(4, 3, 8, 8) * 2 + 1 for _ in range(3)]
    truth = compute_truth(model, batches)["1"]
    kept = model[2].running_var.clone()
    with pytest.warns(PreciseBNWarning, match=r"'2' \(_HandWrittenNorm\) keeps running statistics but is not a Bat"):
        report = precisebn.recalibrate(model, batches)
    assert report.updated == ["1"]
    assert torch.equal(model[2].running_var, kept)
    assert max_rel_error(model[1].running_var, truth.var) <= 1e-5
    assert max_rel_error(model[1].running_mean, truth.mean, truth.var.sqrt()) <= 1e-5
    with pytest.raises(LayerNotFoundError, match=r"The model's '0' \(_HandWrittenNorm\) keeps running statistics"):
        precisebn.estimate(nn.Sequential(_HandWrittenNorm(3)), [torch.randn(2, 3, 8, 8)])
    with warnings.catch_warnings():  # layers= chosen by the caller: nothing to warn of
        warnings.simplefilter("error", PreciseBNWarning)
        precisebn.recalibrate(model, batches, layers=["1"])


def _with_untracked_layer() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 5, 1), nn.BatchNorm2d(5))
    model[1].track_running_stats = False  # buffers kept: eval mode still normalises with them
    return model


def test_a_batchnorm_with_tracking_turned_off_but_buffers_kept_is_named() -> None:
    # torch's forward never updates such a layer's buffers in training mode, yet normalises with them in eval
    # mode: left stale by precisebn without a word before (probe 49)
    model = _with_untracked_layer()
    data = [torch.randn(4, 3, 8, 8) * 3 + 2 for _ in range(3)]
    before = state_snapshot(model[1])
    with pytest.warns(PreciseBNWarning, match=r"layer '1' \(BatchNorm2d\) has track_running_stats=False") as caught:
        report = precisebn.recalibrate(model, data)
    assert "module.track_running_stats = True" in str(caught[0].message)
    assert [r.name for r in report.layers] == ["4"]
    assert_unchanged(model[1], before)
    # the advice works: tracking on, the layer gets the float64 statistics of what it normalises
    model[1].track_running_stats = True
    truth = compute_truth(model, data)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PreciseBNWarning)
        precisebn.recalibrate(model, data)
    assert max_rel_error(model[1].running_var.double(), truth["1"].var) <= 1e-5
    assert (model[1].running_mean.double() - truth["1"].mean).abs().max() <= 1e-5 * truth["1"].var.sqrt().max()


def test_tracking_off_without_buffers_or_on_an_instancenorm_is_not_named() -> None:
    model = _with_untracked_layer()
    model[1].running_mean = model[1].running_var = None  # eval mode uses each batch's statistics: nothing stale
    model.append(nn.InstanceNorm2d(5, track_running_stats=True))
    model[5].track_running_stats = False  # normalises with each sample's own statistics in both modes
    with warnings.catch_warnings():
        warnings.simplefilter("error", PreciseBNWarning)
        precisebn.recalibrate(model, [torch.randn(4, 3, 8, 8) for _ in range(2)])


def test_nothing_selected_but_layers_with_tracking_off_says_so() -> None:
    model = _with_untracked_layer()
    model[4].track_running_stats = False
    with pytest.raises(LayerNotFoundError, match=r"Layers '1' \(BatchNorm2d\), '4' \(BatchNorm2d\) have"):
        precisebn.recalibrate(model, [torch.randn(4, 3, 8, 8) for _ in range(2)])
