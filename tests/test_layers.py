"""Finding layers, and the one context manager that restores everything."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings
from torch import nn

from conftest import assert_unchanged, state_snapshot
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
