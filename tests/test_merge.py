"""``PopulationStats.merge`` and ``precisebn merge``: the exact union of statistics of disjoint data.

Float64 models with ``capture="float64"``, so that 1e-12 is meaningful; the truths are
estimates on the union, and float64 statistics of the concatenated layer inputs
(``compute_truth``, independent of precisebn).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import itertools
import os
import re
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import precisebn
from conftest import compute_truth, max_rel_error
from precisebn.cli import main
from precisebn.errors import InvalidArgumentError, PreciseBNWarning, StatsMismatchError

F64 = torch.float64


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.BatchNorm2d(3),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(3 * 16, 4),
        nn.BatchNorm1d(4),
        nn.BatchNorm1d(4),  # never reached (see forward)
    ).to(F64)


def forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model[:6](x)


def batches(n: int = 5, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2 + i % 3, 2, 4, 4, generator=g, dtype=F64) * (1 + i) + 10 * i for i in range(n)]


def measure(model: nn.Module, data: list[torch.Tensor], **kw) -> precisebn.PopulationStats:
    return precisebn.estimate(model, data, forward=forward, capture="float64", num_samples="all", **kw)


def assert_close_stats(got: Any, want: Any, tol: float = 1e-12) -> None:
    scale = torch.maximum(want.mean.abs(), want.var.sqrt())
    assert max_rel_error(got.mean, want.mean, scale) <= tol
    assert max_rel_error(got.var, want.var) <= tol


def test_merge_equals_estimate_on_the_union() -> None:
    model, data = net(), batches()
    a, b = measure(model, data[:2]), measure(model, data[2:])
    union = measure(model, data)
    truth = compute_truth(model, data, forward=forward)
    merged = a.merge(b)
    assert list(merged) == list(union) == ["1", "5", "6"]
    for name in ("1", "5"):
        assert_close_stats(merged[name], union[name])
        assert_close_stats(merged[name], truth[name])
        assert (
            (merged[name].count, merged[name].calls)
            == (union[name].count, union[name].calls)
            == (
                truth[name].count,
                truth[name].calls,
            )
        )
        assert merged[name].path == "float64" and merged[name].layer_type == union[name].layer_type
        assert merged[name].mean.dtype == F64 and merged[name].mean.device.type == "cpu"
    assert not merged["6"].reached and merged["6"].count == 0
    assert (merged.samples, merged.batches, merged.mode) == (union.samples, union.batches, "norm")
    assert merged.world_size == 2 and merged.seconds == pytest.approx(a.seconds + b.seconds)
    # the inputs are untouched, and the merged statistics apply like a recalibration on the union
    assert a["1"].count + b["1"].count == merged["1"].count
    m1, m2 = net(), net()
    precisebn.apply(m1, merged)
    precisebn.apply(m2, union)
    for (k, v), w in zip(m1.state_dict().items(), m2.state_dict().values()):
        torch.testing.assert_close(v, w, rtol=1e-12, atol=1e-12, msg=k)


@settings(max_examples=20, deadline=None)
@given(cuts=st.lists(st.integers(min_value=1, max_value=23), max_size=4, unique=True), data=st.data())
def test_any_partition_in_any_order_merges_to_the_union(cuts: list[int], data: st.DataObject) -> None:
    """A layer whose input is the data (so that batching does not change its values): split 24 samples
    anywhere, merge the parts in any order, and get the float64 statistics of all 24."""
    g = torch.Generator().manual_seed(7)
    scale, shift = torch.tensor([0.5, 1.0, 20.0], dtype=F64), torch.tensor([3.0, -1.0, 50.0], dtype=F64)
    x = torch.randn(24, 3, 2, generator=g, dtype=F64) * scale[:, None] + shift[:, None]  # (N, C, L): 2 values/sample
    model = nn.Sequential(nn.BatchNorm1d(3)).to(F64)
    bounds = [0, *sorted(cuts), 24]
    parts = [precisebn.estimate(model, [x[lo:hi]], capture="float64") for lo, hi in itertools.pairwise(bounds)]
    order = data.draw(st.permutations(range(len(parts))))
    merged = parts[order[0]].merge(*(parts[i] for i in order[1:]))
    truth_mean, truth_var = x.mean((0, 2)), x.var((0, 2), unbiased=False)
    assert merged["0"].count == 48 and merged.samples == 24 and merged.batches == len(parts)
    assert max_rel_error(merged["0"].mean, truth_mean, torch.maximum(truth_mean.abs(), truth_var.sqrt())) <= 1e-12
    assert max_rel_error(merged["0"].var, truth_var) <= 1e-12


def test_layers_in_only_some_inputs_keep_theirs() -> None:
    model, data = net(), batches()
    only_first = measure(model, data[:2], layers=["1"])
    both = measure(model, data[2:], layers=["1", "5"])
    merged = only_first.merge(both)
    assert list(merged) == ["1", "5"]
    assert torch.equal(merged["5"].mean, both["5"].mean) and torch.equal(merged["5"].var, both["5"].var)
    assert merged["5"].count == both["5"].count
    assert merged["1"].count == only_first["1"].count + both["1"].count
    # a layer reached in one input and not in the other keeps the reached one's statistics
    unreached = dataclasses.replace(both["1"], mean=torch.full((3,), float("nan"), dtype=F64), count=0)
    other = dataclasses.replace(both, layers={"1": unreached})
    kept = only_first.merge(other)
    assert torch.equal(kept["1"].mean, only_first["1"].mean) and kept["1"].count == only_first["1"].count


def test_mismatches_are_refused() -> None:
    model, data = net(), batches()
    a = measure(model, data[:2])
    wrong = dataclasses.replace(a["5"], mean=torch.zeros(7, dtype=F64), var=torch.ones(7, dtype=F64))
    with pytest.raises(StatsMismatchError, match=r"layer '5' has 4 vs 7 channels"):
        a.merge(dataclasses.replace(a, layers={**a.layers, "5": wrong}))
    with pytest.raises(StatsMismatchError, match=r"layer '1' has types BatchNorm2d vs InstanceNorm2d"):
        a.merge(dataclasses.replace(a, layers={"1": dataclasses.replace(a["1"], layer_type="InstanceNorm2d")}))
    with pytest.raises(StatsMismatchError, match="different modes"):
        a.merge(measure(model, data[2:], mode="train"))
    with pytest.raises(InvalidArgumentError, match="input 1 is a dict"):
        a.merge({"1": a["1"]})
    b = measure(model, data[2:])
    with pytest.raises(InvalidArgumentError, match="inputs 0 and 2 are the same statistics object"):
        a.merge(b, a)
    with pytest.raises(InvalidArgumentError, match="inputs 1 and 2 are the same statistics object"):
        a.merge(b, b)
    # probe 37: equal statistics that are not the same object (a copied file, a deep copy) merged, counted twice
    with pytest.raises(InvalidArgumentError, match="inputs 0 and 2 hold the same statistics"):
        a.merge(b, copy.deepcopy(a))
    with pytest.raises(InvalidArgumentError, match="inputs 0 and 1 hold the same statistics"):
        a.merge(dataclasses.replace(a, seconds=a.seconds + 1, versions={"precisebn": "0.0.1"}))
    assert a.merge(dataclasses.replace(a, samples=a.samples + 1)).samples == 2 * a.samples + 1  # (not the same)
    twice = lambda m, x: m[5](m[:5](x)) + m[5](m[:5](x) * 2)  # noqa: E731
    pooled = precisebn.estimate(model, data[:2], forward=twice, capture="float64")
    per_call = precisebn.estimate(model, data[2:], forward=twice, capture="float64", per_call=True)
    assert {"5", "5.calls.0", "5.calls.1"} <= set(pooled) | set(per_call)  # (was merged into both, fitting no model)
    with pytest.raises(StatsMismatchError, match=r"layer '1' is pooled over its calls \(or was called once per"):
        pooled.merge(per_call)


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_cli_merge(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    model, data = net(), batches()
    parts = [measure(model, data[:2]), measure(model, data[2:4]), measure(model, data[4:])]
    for i, p in enumerate(parts):
        p.save(f"s{i}.safetensors")
    assert main(["merge", "s0.safetensors", "s1.safetensors", "s2.safetensors", "--out", "all.safetensors"]) == 0
    out = capsys.readouterr().out
    assert "merged 3 files" in out and "wrote all.safetensors" in out
    merged = precisebn.PopulationStats.load("all.safetensors")
    expected = parts[0].merge(parts[1], parts[2])
    for name in expected:
        assert torch.equal(merged[name].mean, expected[name].mean) or not expected[name].reached
        assert torch.equal(merged[name].var, expected[name].var) or not expected[name].reached
        assert merged[name].count == expected[name].count
    assert_close_stats(merged["1"], measure(model, data)["1"])
    assert merged.samples == sum(len(b) for b in data)
    os.link(tmp_path / "s0.safetensors", tmp_path / "s0-again.safetensors")  # the same file under another name
    before = {p.name: _sha(p) for p in tmp_path.iterdir()}
    refused = {
        "hard link": (["s0.safetensors", "s0-again.safetensors", "--out", "x.safetensors"], "given twice"),
        "an input": (["s0.safetensors", "s1.safetensors", "--out", "s1.safetensors"], "would destroy the input"),
        "one input": (["s0.safetensors", "--out", "x.safetensors"], "two or more"),
        "twice": (["s0.safetensors", "./s0.safetensors", "--out", "x.safetensors"], "given twice"),
        "extension": (["s0.safetensors", "s1.safetensors", "--out", "x.pt"], r"\*.safetensors"),
    }
    for why, (args, message) in refused.items():
        assert main(["merge", *args]) == 2, why
        assert message.replace("\\", "") in capsys.readouterr().err, why
    (tmp_path / "s0-copy.safetensors").write_bytes((tmp_path / "s0.safetensors").read_bytes())  # (probe 37)
    assert main(["merge", "s0.safetensors", "s1.safetensors", "s0-copy.safetensors", "--out", "x.safetensors"]) == 1
    assert "inputs 0 and 2 hold the same statistics" in capsys.readouterr().err
    assert main(["merge", "s0.safetensors", "missing.safetensors", "--out", "x.safetensors"]) == 1
    assert "does not exist" in capsys.readouterr().err
    other = nn.Sequential(nn.BatchNorm1d(5)).to(F64)
    precisebn.estimate(other, [torch.randn(4, 5, dtype=F64)]).save("other.safetensors")
    renamed = dataclasses.replace(parts[0], layers={"0": dataclasses.replace(parts[0]["5"])})
    renamed.save("four.safetensors")
    assert main(["merge", "four.safetensors", "other.safetensors", "--out", "x.safetensors"]) == 1
    assert "layer '0' has 4 vs 5 channels" in capsys.readouterr().err
    after = {p.name: _sha(p) for p in tmp_path.iterdir() if p.name in before}
    assert after == before and not (tmp_path / "x.safetensors").exists()


class Branchy(nn.Module):
    """A BatchNorm called ``k`` times per forward on some batches (a list of ``k`` inputs), never on others
    (``None``), beside one called once on every batch."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(3, dtype=F64)
        self.other = nn.BatchNorm1d(3, dtype=F64)

    def forward(self, batch: tuple[torch.Tensor, list[torch.Tensor] | None]) -> list[torch.Tensor]:
        x, calls = batch
        return [self.other(x)] + [self.bn(c) for c in calls or []]


def branchy_data(k: int | None, n: int, seed: int) -> list[tuple[torch.Tensor, list[torch.Tensor] | None]]:
    g = torch.Generator().manual_seed(seed)

    def draw(shift: float) -> torch.Tensor:
        return torch.randn(4, 3, generator=g, dtype=F64) * 2 + shift

    return [(draw(1.0), None if k is None else [draw(5.0 * j) for j in range(k)]) for _ in range(n)]


def per_call_truth(data: list[Any]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Float64 mean and population variance of each call index's inputs of ``bn``, and of ``other``'s."""
    groups: dict[str, list[torch.Tensor]] = {"other": [x for x, _ in data]}
    for _, calls in data:
        for j, c in enumerate(calls or []):
            groups.setdefault(f"bn.calls.{j}", []).append(c)
    return {k: (torch.cat(v).mean(0), torch.cat(v).var(0, unbiased=False)) for k, v in groups.items()}


def test_a_part_that_never_reached_a_per_call_layer_merges_with_the_parts_that_did() -> None:
    """Found by a probe: a part in which a per-call layer was never called holds it under its plain name (count
    0, no data), and merge refused it as "pooled over its calls in some inputs and kept per call in others"."""
    model = Branchy()
    reached, unreached = branchy_data(2, 3, seed=1), branchy_data(None, 2, seed=2)
    parts = [precisebn.estimate(model, d, forward=lambda m, b: m(b), per_call=True) for d in (reached, unreached)]
    assert "bn" in parts[1] and parts[1]["bn"].count == 0
    for merged in (parts[0].merge(parts[1]), parts[1].merge(parts[0])):
        assert sorted(merged) == ["bn.calls.0", "bn.calls.1", "other"]
        for name, (mean, var) in per_call_truth(reached + unreached).items():
            assert_close_stats(merged[name], dataclasses.replace(merged[name], mean=mean, var=var))


@pytest.mark.parametrize("model_is_the_layer", [False, True])
def test_per_call_parts_with_different_calls_per_forward_are_warned_of(model_is_the_layer: bool) -> None:
    """Found by a probe: parts whose layer was called twice per forward in one and 3 times in the other merged
    into calls.0 and calls.1 of both and a calls.2 of one part alone, data that estimate() refuses as one, without
    a word. A warning now says so (a first version refused them, and with them layers of a container named
    `calls` estimated with different selections: probe 29)."""

    model: nn.Module = Branchy()
    forward: Any = lambda m, b: m(b)  # noqa: E731
    if model_is_the_layer:  # (its per-call statistics are named "calls.<i>")
        model, forward = model.bn, lambda m, b: [m(c) for c in b[1]]
    two = precisebn.estimate(model, branchy_data(2, 3, seed=1), forward=forward, per_call=True)
    three = precisebn.estimate(model, branchy_data(3, 3, seed=2), forward=forward, per_call=True)
    both = branchy_data(2, 3, seed=1) + branchy_data(3, 3, seed=2)
    with pytest.raises(InvalidArgumentError):
        precisebn.estimate(model, both, forward=forward, per_call=True)
    name = "'(model)'" if model_is_the_layer else "'bn'"
    said = f"calls.<i>' are twice in input 0 but 3 times in input 1. If they are per-call statistics of layer {name}"
    with pytest.warns(PreciseBNWarning, match=re.escape(said)):
        two.merge(three)
    once = precisebn.estimate(model, branchy_data(1, 3, seed=3), forward=forward, per_call=True)
    calls = "'calls.<i>'" if model_is_the_layer else "'bn.calls.<i>'"
    said = f"layer {name} is pooled over its calls (or was called once per forward) in some inputs and kept per "
    said += f"call ({calls})"
    with pytest.raises(StatsMismatchError, match=re.escape(said)):  # (probe 28: "per_call=True for all", as they were)
        once.merge(two)


def test_layers_in_a_container_named_calls_merge_whatever_each_input_holds() -> None:
    """Found by a probe: layers of a ModuleList named `calls`, estimated with different selections, were refused
    as per-call statistics of different call counts; they merge exactly (with the warning that names can give)."""
    from precisebn.errors import PreciseBNWarning

    torch.manual_seed(0)
    model = nn.Sequential()
    model.calls = nn.ModuleList([nn.BatchNorm1d(2, dtype=F64), nn.BatchNorm1d(2, dtype=F64)])
    forward = lambda m, x: [bn(x) for bn in m.calls]  # noqa: E731
    g = torch.Generator().manual_seed(4)
    a_data = [torch.randn(4, 2, generator=g, dtype=F64) + 1 for _ in range(2)]
    b_data = [torch.randn(4, 2, generator=g, dtype=F64) * 3 for _ in range(2)]
    a = precisebn.estimate(model, a_data, forward=forward, layers=["calls.0", "calls.1"])
    b = precisebn.estimate(model, b_data, forward=forward, layers=["calls.0"])
    with pytest.warns(PreciseBNWarning, match="Layers in a container named 'calls' are merged as usual"):
        merged = a.merge(b)
    assert merged["calls.0"].count == 16 and merged["calls.1"].count == 8
    for name, data in (("calls.0", a_data + b_data), ("calls.1", a_data)):
        x = torch.cat(data)
        want = dataclasses.replace(merged[name], mean=x.mean(0), var=x.var(0, unbiased=False))
        assert_close_stats(merged[name], want)


def test_merged_statistics_keep_what_produced_each_input() -> None:
    """Probe 37: inputs written by other versions merged into statistics stamped with this version's."""
    model, data = net(), batches()
    a, b = measure(model, data[:2]), measure(model, data[2:])
    b = dataclasses.replace(b, versions={"precisebn": "0.0.9", "torch": a.versions["torch"]})
    merged = a.merge(b)
    assert merged.versions == {"precisebn": f"{a.versions['precisebn']} + 0.0.9", "torch": a.versions["torch"]}
    assert a.merge(measure(model, data[2:])).versions == a.versions


def test_disjoint_parts_that_reached_none_of_the_layers_selected_merge() -> None:
    """Probe 41: two parts of disjoint data whose batches all missed the layer selected (a branch taken by rare
    batches) are alike — the same samples and batches, the layer unreached — and were refused as "the same
    statistics" (a copied file), though they hold no values that could count twice."""

    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn, self.rare = nn.BatchNorm1d(3), nn.BatchNorm1d(3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.bn(x)
            return self.rare(y) if bool((x > 3.5).any()) else y

    torch.manual_seed(0)
    model = Branchy()
    parts = [[torch.randn(4, 3).clamp(-3, 3) + shift for _ in range(2)] for shift in (0.0, 0.1)]
    parts.append([torch.randn(4, 3) + 5.0 for _ in range(2)])  # (the one that reaches it)
    a, b, c = (precisebn.estimate(model, p, num_samples="all", layers=["rare"]) for p in parts)
    assert not a["rare"].reached and not b["rare"].reached and c["rare"].reached
    with pytest.warns(PreciseBNWarning, match="inputs 0 and 1 are alike and reached none of their layers"):
        merged = a.merge(b, c)
    # the inputs of 'rare': bn's output, bn not selected so in eval mode (running statistics 0 and 1)
    truth = torch.cat(parts[2]).double() / (1 + 1e-5) ** 0.5
    assert (merged.samples, merged.batches) == (24, 6)
    assert torch.allclose(merged["rare"].mean, truth.mean(0), atol=1e-6)
    assert torch.allclose(merged["rare"].var, truth.var(0, unbiased=False), atol=1e-6)
    with pytest.raises(InvalidArgumentError, match="inputs 0 and 1 hold the same statistics"):
        c.merge(copy.deepcopy(c))  # (one that reached a layer, copied: still refused)
