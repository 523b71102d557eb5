"""Drop-in replacements for fvcore's update_bn_stats and torch's update_bn."""

from __future__ import annotations

import inspect
import linecache
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim import swa_utils

import precisebn
from conftest import assert_unchanged, compute_truth, max_rel_error, state_snapshot
from precisebn import compat
from precisebn.errors import BatchTypeError, InvalidArgumentError, ShortDataWarning

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from fvcore.nn import precise_bn as fvcore_precise_bn


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Dropout(0.3), nn.ReLU(), nn.Linear(6, 5), nn.BatchNorm1d(5)
    )


def data(n: int = 8, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(int(s), 4, generator=g) * 3 + 2 for s in torch.randint(3, 9, (n,), generator=g)]


def test_signatures_match_the_originals() -> None:
    def params(f):
        return [(p.name, p.default) for p in inspect.signature(f).parameters.values()]

    assert params(compat.update_bn_stats) == params(fvcore_precise_bn.update_bn_stats)
    assert params(compat.update_bn) == params(swa_utils.update_bn)


def test_update_bn_stats_touches_only_training_bn_and_keeps_flags() -> None:
    model = net().train()
    model[5].eval()  # fvcore leaves eval-mode BN layers alone
    flags = [m.training for m in model.modules()]
    frozen = model[5].running_var.clone()
    batches = data()
    truth = compute_truth(model, batches, mode="keep", select=lambda n, m: m.training, seed=7)
    torch.manual_seed(7)  # dropout is on (train mode): same mask as the truth
    compat.update_bn_stats(model, batches, num_iters=len(batches))
    assert [m.training for m in model.modules()] == flags
    assert torch.equal(model[5].running_var, frozen)
    t = truth["1"]
    assert max_rel_error(model[1].running_mean, t.mean, t.var.sqrt()) <= 1e-5
    assert max_rel_error(model[1].running_var, t.var) <= 1e-5


@pytest.mark.parametrize("progress", [False, True, "none", "", 0])
def test_update_bn_stats_reads_progress_as_fvcore_does(progress: Any) -> None:
    """Found by probe 43: every value but None and "tqdm" was refused before any pass; fvcore's reads only
    ``progress == "tqdm"`` (a bar), anything else as none — a drop-in takes what it takes."""
    model = net().train()
    batches = data()
    truth = compute_truth(model, batches, mode="keep", seed=7)
    torch.manual_seed(7)  # (dropout is on: the truth's masks)
    compat.update_bn_stats(model, batches, num_iters=len(batches), progress=progress)
    for name in ("1", "5"):
        t = truth[name]
        assert max_rel_error(model.get_submodule(name).running_mean, t.mean, t.var.sqrt()) <= 1e-5
        assert max_rel_error(model.get_submodule(name).running_var, t.var) <= 1e-5


def test_update_bn_moves_dict_and_nested_batches_to_device_and_refuses_what_it_cannot_move() -> None:
    """Found by probe 43: with ``device=``, a batch without ``.to()`` (a dict: torch's raises ``AttributeError``)
    reached the model unmoved, silently — on a GPU, on another device than asked. A dict, tuple or list of tensors
    is moved tensor by tensor now (reaching the model as a copy holding the moved tensors, on the CPU the same
    ones); anything else is refused by name, the model unchanged."""

    seen: list[Any] = []  # (outside the model: what a pass leaves in the model's own containers is put back)

    class DictNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn = nn.BatchNorm1d(4)

        def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
            seen.append(batch)
            return self.bn(batch["x"])

    xs = data()
    batches = [{"x": x} for x in xs]
    model = DictNet()
    truth = compute_truth(model, batches, mode="train")["bn"]
    seen.clear()
    compat.update_bn(batches, model, device="cpu")
    assert len(seen) == len(batches)
    assert all(got is not given and got["x"] is given["x"] for got, given in zip(seen, batches))
    assert max_rel_error(model.bn.running_var, truth.var) <= 1e-5
    assert max_rel_error(model.bn.running_mean, truth.mean, truth.var.sqrt()) <= 1e-5

    class Opaque:  # neither a tensor nor a container of them, no .to()
        pass

    model = DictNet()
    before = state_snapshot(model)
    with pytest.raises(BatchTypeError, match=r"device='cpu' cannot move a batch of type Opaque"):
        compat.update_bn([Opaque()], model, device="cpu")
    assert_unchanged(model, before)


def test_update_bn_stats_passes_batches_raw() -> None:
    class ListModel(nn.Module):  # detectron2-style: the model takes the list of records
        def __init__(self) -> None:
            super().__init__()
            self.bn = nn.BatchNorm1d(3)

        def forward(self, records: list[dict]) -> torch.Tensor:
            return self.bn(torch.stack([r["x"] for r in records]))

    records = [[{"x": torch.randn(3) + i} for i in range(4)] for _ in range(3)]
    model = ListModel().train()
    compat.update_bn_stats(model, records, num_iters=3)
    xs = torch.stack([r["x"] for batch in records for r in batch]).double()
    assert max_rel_error(model.bn.running_var, xs.var(0, unbiased=False)) <= 1e-5


@pytest.mark.parametrize("loader", [[], [torch.randn(4, 4)] * 3], ids=["empty", "short"])
def test_update_bn_stats_short_loader_raises_assertion_and_leaves_model(loader) -> None:
    model = net().train()
    before = state_snapshot(model)
    with pytest.raises(AssertionError, match="meant to run for 5 iterations"):
        compat.update_bn_stats(model, loader, num_iters=5)
    assert_unchanged(model, before)


def test_update_bn_stats_exact_where_fvcore_is_not() -> None:
    """|mean|/std = 1e4 in float32 (facts.md): fvcore's variance is off by orders of magnitude."""
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(32, 8, generator=g, dtype=torch.float64) + 1e4).float() for _ in range(20)]
    truth = compute_truth(nn.BatchNorm1d(8), batches)[""]
    ours, theirs = nn.BatchNorm1d(8).train(), nn.BatchNorm1d(8).train()
    compat.update_bn_stats(ours, batches, num_iters=20)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fvcore_precise_bn.update_bn_stats(theirs, batches, num_iters=20)
    assert max_rel_error(ours.running_var, truth.var) <= 1e-3
    assert max_rel_error(theirs.running_var, truth.var) > 1.0


def test_update_bn_uses_whole_loader_in_train_mode() -> None:
    model = net().eval()
    model[1].momentum = 0.2
    model[3].training = True  # odd per-module flags come back exactly (torch restores only the top)
    flags = [m.training for m in model.modules()]
    batches = [(x, torch.zeros(len(x))) for x in data(12)]
    truth = compute_truth(model, batches, mode="train", seed=3)
    torch.manual_seed(3)
    compat.update_bn(batches, model, device="cpu")
    assert [m.training for m in model.modules()] == flags
    assert model[1].momentum == 0.2 and model[5].momentum == 0.1
    for name in ("1", "5"):
        t = truth[name]
        assert max_rel_error(model.get_submodule(name).running_var, t.var) <= 1e-5
        assert max_rel_error(model.get_submodule(name).running_mean, t.mean, t.var.sqrt()) <= 1e-5


def test_update_bn_runs_the_whole_model_in_training_mode_and_takes_batches_as_torch_does() -> None:
    """Found by a hostile probe: an InstanceNorm with running statistics stayed in eval mode (torch's
    update_bn calls model.train()), so the BatchNorm after it was measured on other inputs (90% off);
    dict and other non-tuple batches were unpacked (torch passes them to the model as they are)."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.conv, self.inorm = nn.Conv1d(2, 3, 1), nn.InstanceNorm1d(3, track_running_stats=True)
            self.bn = nn.BatchNorm1d(3)

        def forward(self, x: torch.Tensor | dict[str, torch.Tensor]) -> torch.Tensor:
            x = x["x"] if isinstance(x, dict) else x
            return self.bn(self.inorm(self.conv(x)) * 2 + 1)

    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(4, 2, 5, generator=g) * 3 + 1 for _ in range(5)]
    model = Net()
    model.inorm.running_var.fill_(9.0)  # far from the instance statistics: eval mode would show
    truth = compute_truth(model.train(), xs, mode="keep", select=lambda name, m: name == "bn")["bn"]
    for batches in (xs, [{"x": x} for x in xs], [[x, 0] for x in xs]):
        m = Net().eval()
        m.inorm.running_var.fill_(9.0)
        inorm_before = state_snapshot(m.inorm)
        compat.update_bn(batches, m)
        assert max_rel_error(m.bn.running_var, truth.var) <= 1e-5
        assert max_rel_error(m.bn.running_mean, truth.mean, truth.var.sqrt()) <= 1e-5
        assert_unchanged(m.inorm, inorm_before)  # its own statistics: restored with the rest
        assert not m.training and not m.inorm.training


def test_update_bn_stats_gives_the_model_batches_of_their_own_type() -> None:
    """Found by a hostile probe: a defaultdict batch reached the model as a plain dict (KeyError where
    fvcore works). Batches now reach the model as the loader's own objects, as with fvcore."""
    import collections

    class DictModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn = nn.BatchNorm1d(3)
            self.seen: list[object] = []

        def forward(self, batch: dict) -> torch.Tensor:
            self.seen.append(batch)
            return self.bn(batch["x"] * batch["scale"])

    batches = []
    for i in range(3):
        b = collections.defaultdict(lambda: 1.0)
        b["x"] = torch.randn(4, 3) + i
        batches.append(b)
    model = DictModel().train()
    compat.update_bn_stats(model, batches, num_iters=3)
    assert all(seen is b and seen["other"] == 1.0 for seen, b in zip(model.seen, batches))
    xs = torch.cat([b["x"] for b in batches]).double()
    assert max_rel_error(model.bn.running_var, xs.var(0, unbiased=False)) <= 1e-5


def test_update_bn_keeps_the_variance_of_batch_means() -> None:
    # torch averages per-batch variances; with shifted batches that misses most of the variance
    batches = [torch.randn(16, 2) + 10 * i for i in range(4)]
    truth = compute_truth(nn.BatchNorm1d(2), batches)[""]
    ours, theirs = nn.BatchNorm1d(2), nn.BatchNorm1d(2)
    compat.update_bn(batches, ours)
    swa_utils.update_bn(batches, theirs)
    assert max_rel_error(ours.running_var, truth.var) <= 1e-5
    assert max_rel_error(theirs.running_var, truth.var) > 0.5


def test_update_bn_failure_leaves_model_untouched() -> None:
    model = net()
    before = state_snapshot(model)

    def loader():
        yield torch.randn(4, 4)
        raise RuntimeError("broken loader")

    with pytest.raises(RuntimeError, match="broken loader"):
        compat.update_bn(loader(), model)
    assert_unchanged(model, before)


def test_update_bn_on_an_empty_loader_returns_as_torchs_does_and_keeps_the_model() -> None:
    """torch's returns (its statistics reset to 0/1); the drop-in raised EmptyDataError, which can break an
    SWA script that torch's does not (a probe). Now a warning, and the model as it was."""
    model = net()
    before = state_snapshot(model)
    assert torch.optim.swa_utils.update_bn([], net()) is None
    with pytest.warns(ShortDataWarning, match="yielded no batch"):
        assert compat.update_bn([], model) is None
    assert_unchanged(model, before)


def test_models_without_batchnorm_are_a_no_op() -> None:
    # like the originals, only BatchNorm layers count; the tracked InstanceNorm stays as it is
    model = nn.Sequential(nn.Conv1d(2, 2, 1), nn.InstanceNorm1d(2, track_running_stats=True)).train()
    before = state_snapshot(model)
    compat.update_bn([torch.randn(3, 2, 4) + 5], model)
    compat.update_bn_stats(model, [torch.randn(3, 2, 4) + 5], num_iters=1)
    assert_unchanged(model, before)


def test_the_drop_ins_pass_each_batch_as_the_loader_gave_it() -> None:
    """Were moved to the model's first parameter's device and shallow-copied (a detectron2-style list of dicts
    reached the model as new objects; a parameter on another device moved every batch there)."""
    from precisebn.compat import update_bn, update_bn_stats

    seen: list[Any] = []

    class Detection(nn.Module):  # detectron2's convention: a list of per-image dicts
        def __init__(self) -> None:
            super().__init__()
            self.bn = nn.BatchNorm2d(3)

        def forward(self, inputs: list[dict[str, torch.Tensor]]) -> torch.Tensor:
            seen.append(inputs)
            return self.bn(torch.stack([d["image"] for d in inputs]))

    batches = [[{"image": torch.randn(3, 4, 4)} for _ in range(2)] for _ in range(3)]
    update_bn_stats(Detection().train(), batches, num_iters=3)
    assert all(a is b and a[0] is b[0] for a, b in zip(seen, batches))

    seen.clear()

    class Named(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.unused = nn.Parameter(torch.empty(1, device="meta"))  # the first parameter: not where batches go
            self.bn = nn.BatchNorm1d(3)

        def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
            seen.append(batch)
            return self.bn(batch["x"])

    loader = [{"x": torch.randn(4, 3)} for _ in range(2)]
    update_bn(loader, Named())
    assert all(a is b for a, b in zip(seen, loader))


def test_a_wrapped_model_gets_batches_moved_to_its_device_as_its_wrapper_would() -> None:
    """DDP (device_ids) and DataParallel move a loader's CPU batches to the model's device; the drop-ins run
    the wrapped module, so they move them themselves (on the CPU: the containers are copies, not the loader's)."""
    from precisebn.compat import update_bn_stats

    seen: list[Any] = []

    class Listed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn = nn.BatchNorm1d(3)

        def forward(self, batch: list[torch.Tensor]) -> torch.Tensor:
            seen.append(batch)
            return self.bn(batch[0])

    batches = [[torch.randn(4, 3)] for _ in range(2)]
    update_bn_stats(nn.DataParallel(Listed().train()), batches, num_iters=2)
    assert len(seen) == 2 and all(a is not b and torch.equal(a[0], b[0]) for a, b in zip(seen, batches))
    seen.clear()
    update_bn_stats(Listed().train(), batches, num_iters=2)
    assert all(a is b for a, b in zip(seen, batches))


@pytest.mark.parametrize("num_iters", [0, -3, None, 2.0, True, "5"])
def test_update_bn_stats_refuses_a_num_iters_that_is_not_a_positive_integer_before_any_pass(num_iters) -> None:
    """Found by a probe: 0 was refused in the words of another function ("num_batches must be a positive
    integer or None", an argument the caller never passed), and None ran every pass, then raised a bare
    TypeError comparing the batches with it (fvcore set every buffer to 0 for 0)."""
    model = net().train()
    calls = []
    model.register_forward_pre_hook(lambda m, args: calls.append(1))
    before = state_snapshot(model)
    with pytest.raises(InvalidArgumentError, match=r"update_bn_stats: num_iters must be a positive integer"):
        compat.update_bn_stats(model, data(), num_iters)
    assert calls == []
    assert_unchanged(model, before)


@pytest.mark.parametrize("drop_in", ["update_bn", "update_bn_stats"])
def test_a_tensor_given_as_the_loader_is_iterated_as_the_originals_do(drop_in: str) -> None:
    """Found by a probe: torch's update_bn (and fvcore's loop) iterate a tensor given as the loader over its
    first dimension, one batch per slice; the drop-ins refused it ("data must be an iterable of batches")."""
    g = torch.Generator().manual_seed(3)
    loader = torch.randn(5, 7, 4, generator=g) * 2 + 1  # 5 batches of 7 samples
    model = net().train()
    truth = compute_truth(model, list(loader), mode="keep" if drop_in == "update_bn_stats" else "train", seed=11)
    torch.manual_seed(11)  # (dropout is on: the truth's masks)
    if drop_in == "update_bn":
        compat.update_bn(loader, model)
    else:
        compat.update_bn_stats(model, loader, num_iters=5)
    for name in ("1", "5"):
        t = truth[name]
        assert max_rel_error(model.get_submodule(name).running_var, t.var) <= 1e-5
        assert max_rel_error(model.get_submodule(name).running_mean, t.mean, t.var.sqrt()) <= 1e-5


def test_a_zero_dimensional_tensor_as_the_loader_is_refused_with_the_model_unchanged() -> None:
    model = net()
    before = state_snapshot(model)
    with pytest.raises(InvalidArgumentError, match="0-dimensional tensor"):
        compat.update_bn(torch.tensor(1.0), model)
    assert_unchanged(model, before)


def test_the_drop_ins_refuse_a_model_that_is_not_a_module_and_say_when_the_arguments_look_swapped() -> None:
    """The two drop-ins take their arguments in opposite orders (fvcore's model first, torch's loader first): mixed
    up, they raised a bare AttributeError from deep inside (a probe)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).train()
    loader = [torch.randn(8, 4) for _ in range(2)]
    before = state_snapshot(model)
    with pytest.raises(InvalidArgumentError, match=r"update_bn: model must be a torch.nn.Module, got list \(the arg"):
        compat.update_bn(model, loader)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match=r"update_bn_stats: model must be .*got list \(the arguments look"):
        compat.update_bn_stats(loader, model, num_iters=2)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match=r"got str; the call is update_bn\(loader, model, device=None\)"):
        compat.update_bn(loader, "model")  # type: ignore[arg-type]
    assert_unchanged(model, before)


def test_update_bn_stats_leaves_the_warning_filters_alone_during_its_passes() -> None:
    """Probe 38: update_bn_stats silenced ShortDataWarning with warnings.catch_warnings(), which changes the
    process-wide filters: another thread's recalibration lost its warning meanwhile, and two overlapping calls left
    the filter in place for good. The filters are now those of the caller throughout."""
    import warnings

    seen: list[list[Any]] = []

    class Looks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn = nn.BatchNorm1d(3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(list(warnings.filters))
            return self.bn(x)

    model = Looks().train()
    before = list(warnings.filters)
    compat.update_bn_stats(model, [torch.randn(8, 3) for _ in range(2)], num_iters=2)
    assert seen and all(filters == before for filters in seen)
    assert list(warnings.filters) == before


class _FarFromZero(nn.Module):
    """A BatchNorm1d whose input sits 390 σ from 0 (probe 41's case): its own float32 figures are warned of."""

    def __init__(self) -> None:
        super().__init__()
        self.c, self.bn, self.bn1 = nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn(self.bn(self.c(x) * 4 + 30) * 2 + 1)
        return self.bn1(y.mean((2, 3)) * 3 + 100)


@pytest.mark.parametrize("call", ["update_bn_stats", "update_bn", "recalibrate"])
def test_a_warning_names_the_users_line_and_an_option_the_user_can_pass(call: str) -> None:
    """Probe 41: the drop-ins' far-from-zero warning was attributed to compat.py (a stacklevel fixed for
    recalibrate's depth) and told the user to pass capture='float64', which the drop-ins do not take."""
    torch.manual_seed(0)
    model = _FarFromZero().to(memory_format=torch.channels_last).train()
    data = [(torch.randn(n, 3, 9, 9) * 2 + 1).contiguous(memory_format=torch.channels_last) for n in (6, 2, 6, 3)]
    threads = torch.get_num_threads()  # (one thread: the layer's own figures pass the check, and are warned of)
    torch.set_num_threads(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if call == "update_bn_stats":
            compat.update_bn_stats(model, data, num_iters=4)
        elif call == "update_bn":
            compat.update_bn(data, model)
        else:
            precisebn.recalibrate(model, data)
    torch.set_num_threads(threads)
    far = [w for w in caught if "so far from 0" in str(w.message)]
    assert len(far) == 1, [str(w.message) for w in caught]
    assert far[0].filename == __file__
    assert f"{call}(" in linecache.getline(__file__, far[0].lineno)  # this test's line that called precisebn
    assert "capture='float64' (an option of precisebn.recalibrate" in str(far[0].message)
