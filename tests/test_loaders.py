"""Reading a training loader for a computation without taking anything from training's own reading of it."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import torch
from mmengine.dataset import InfiniteSampler  # (mmengine is part of precisebn[dev])
from torch import nn

import precisebn
from conftest import compute_truth, max_rel_error
from precisebn.errors import InvalidArgumentError
from precisebn.loaders import independent


class Endless(torch.utils.data.Sampler[int]):
    """A sampler with one live generator for its whole life (as mmengine's InfiniteSampler)."""

    def __init__(self, size: int) -> None:
        self.indices = itertools.cycle(range(size))

    def __iter__(self) -> Iterator[int]:
        yield from self.indices


class LiveBatches(torch.utils.data.Sampler[list[int]]):
    """A custom batch sampler holding a live iterator."""

    def __init__(self, size: int) -> None:
        self.batches = itertools.cycle([list(range(i, min(i + 4, size))) for i in range(0, size, 4)])

    def __iter__(self) -> Iterator[list[int]]:
        yield from self.batches


def dataset(n: int = 64) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(n, 10, generator=g) * 2 + 1)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 8), nn.BatchNorm1d(8))


@pytest.mark.parametrize("sampler", ["mmengine", "endless"])
def test_a_sampler_with_a_live_iterator_keeps_trainings_order_and_all_ends(sampler: str) -> None:
    """mmengine's InfiniteSampler (its iteration-based loops'): a computation read training's next samples
    from its one generator, and closing its iterator closed the generator — training then stopped with
    StopIteration; num_samples="all" never ended (a probe). Now read through a twin: one pass of the first
    epoch's order."""
    data = dataset()

    def loader() -> torch.utils.data.DataLoader:
        chosen = InfiniteSampler(data, shuffle=True, seed=0) if sampler == "mmengine" else Endless(len(data))
        return torch.utils.data.DataLoader(data, batch_size=16, sampler=chosen)

    training, reference = loader(), iter(loader())
    batches = iter(training)
    first = next(batches)
    report = precisebn.PreciseBNScheduler(model(), training, num_samples=32).update(1)
    assert report is not None and report.samples == 32
    assert torch.equal(first[0], next(reference)[0])
    for _ in range(6):  # (more than one epoch: training's sequence goes on where it was)
        assert torch.equal(next(batches)[0], next(reference)[0])
    net = model()
    truth = compute_truth(net, [data.tensors[0]])["1"]
    report = precisebn.recalibrate(net, training, num_samples="all")
    assert (report.samples, report.batches) == (64, 4)
    assert max_rel_error(net[1].running_mean, truth.mean, truth.var.sqrt()) < 1e-5
    assert max_rel_error(net[1].running_var, truth.var) < 1e-5


def test_the_twin_reads_the_first_epoch_of_an_infinite_sampler_and_this_ranks_share() -> None:
    data = dataset(10)
    for rank in (0, 1, 2):
        sampler = InfiniteSampler(data, shuffle=True, seed=7)
        sampler.rank, sampler.world_size = rank, 3
        sampler.indices = sampler._indices_of_rank()  # (what __init__ builds from the process group)
        loader = torch.utils.data.DataLoader(data, batch_size=None, sampler=sampler)
        twin = independent(loader)
        assert twin is not loader
        expected = torch.randperm(10, generator=torch.Generator().manual_seed(7)).tolist()[rank::3]
        assert list(twin.sampler) == expected and len(twin.sampler) == len(expected)


def test_loaders_without_shared_state_are_read_as_they_are_and_a_live_batch_sampler_is_refused() -> None:
    data = dataset()
    plain = torch.utils.data.DataLoader(data, batch_size=16, shuffle=True)
    assert independent(plain) is plain
    assert independent([1, 2]) == [1, 2]
    live = torch.utils.data.DataLoader(data, batch_sampler=LiveBatches(len(data)))
    with pytest.raises(InvalidArgumentError, match=r"LiveBatches.*keeps a live iterator"):
        precisebn.estimate(model(), live)
