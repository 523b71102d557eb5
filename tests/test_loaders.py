"""Reading a training loader for a computation without taking anything from training's own reading of it."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from mmengine.dataset import InfiniteSampler  # (mmengine and timm are part of precisebn[dev])
from timm.data.loader import MultiEpochsDataLoader
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, Sampler, TensorDataset

import precisebn
from conftest import compute_truth, max_rel_error
from precisebn.errors import InvalidArgumentError
from precisebn.loaders import independent


class Wrapped(Sampler[int]):
    """A sampler around another (here mmengine's InfiniteSampler)."""

    def __init__(self, inner: Sampler[int]) -> None:
        self.inner = inner

    def __iter__(self) -> Iterator[int]:
        yield from self.inner

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]


class CycledSubset(Sampler[int]):
    """One pass over a subset per epoch, continuing one cycle it keeps (an iterator among its attributes)."""

    def __init__(self, indices: list[int]) -> None:
        self.indices, self.cycle = indices, itertools.cycle(indices)

    def __iter__(self) -> Iterator[int]:
        return (next(self.cycle) for _ in self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def dataset(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 10, generator=g) * 2 + 1
    x[: n // 2] += 5  # (a subset in the dataset's order is not the whole's)
    return TensorDataset(x)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 8), nn.BatchNorm1d(8))


def assert_exact(net: nn.Module, inputs: torch.Tensor) -> None:
    truth = compute_truth(net, [inputs])["1"]
    assert max_rel_error(net[1].running_mean, truth.mean, truth.var.sqrt()) < 1e-5
    assert max_rel_error(net[1].running_var, truth.var) < 1e-5


def first_epoch(n: int, seed: int, rank: int = 0, world: int = 1) -> list[int]:
    """InfiniteSampler's first epoch, by its definition (a seeded randperm, every world-th from rank)."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()[rank::world]


@pytest.mark.parametrize("where", ["sampler", "batch_sampler"])
def test_an_infinite_sampler_keeps_trainings_order_and_all_is_its_first_epoch(where: str) -> None:
    """mmengine's InfiniteSampler (its iteration-based loops'): a computation read training's next samples
    from its one generator, and closing its iterator closed the generator — training then stopped with
    StopIteration; num_samples="all" never ended (a probe). Given as batch_sampler=BatchSampler(it), its
    seed was not read and the twin read the dataset in order (a later probe: 2.86 off)."""
    data = dataset()

    def loader() -> DataLoader:
        sampler = InfiniteSampler(data, shuffle=True, seed=7)
        if where == "sampler":
            return DataLoader(data, batch_size=16, sampler=sampler)
        return DataLoader(data, batch_sampler=BatchSampler(sampler, 16, drop_last=False))

    training, reference = loader(), iter(loader())
    batches = iter(training)
    assert torch.equal(next(batches)[0], next(reference)[0])
    report = precisebn.PreciseBNScheduler(model(), training, num_samples=32).update(1)
    assert report is not None and report.samples == 32
    for _ in range(6):  # (more than one epoch: training's sequence goes on where it was)
        assert torch.equal(next(batches)[0], next(reference)[0])
    net = model()
    report = precisebn.recalibrate(net, training, num_samples=32)  # the first 32 of the first epoch
    assert report.samples == 32
    assert_exact(net, data.tensors[0][first_epoch(64, 7)[:32]])
    report = precisebn.recalibrate(net, training, num_samples="all")
    assert (report.samples, report.batches) == (64, 4)
    assert_exact(net, data.tensors[0])


def test_the_twin_reads_this_ranks_share_and_a_last_sample_joins_the_batch_before() -> None:
    """Training with an InfiniteSampler never ends an epoch, so never sees a batch of one sample; the
    twin's one pass ended with one (101 samples in 4s), which BatchNorm refused, with advice
    (drop_last=True) that does not apply (a probe): it joins the batch before."""
    data = dataset(101)
    for rank in (0, 1, 2):
        sampler = InfiniteSampler(data, shuffle=True, seed=7)
        sampler.rank, sampler.world_size = rank, 3
        sampler.indices = sampler._indices_of_rank()  # (what __init__ builds from the process group)
        twin = independent(DataLoader(data, batch_size=None, sampler=sampler))
        read = [item[0] for item in twin]
        assert torch.equal(torch.stack(read), data.tensors[0][first_epoch(101, 7, rank, 3)])
    net = model()
    report = precisebn.recalibrate(
        net, DataLoader(data, batch_size=4, sampler=InfiniteSampler(data)), num_samples="all"
    )
    assert (report.samples, report.batches) == (101, 25)  # (24 batches of 4, the last of 5)
    assert_exact(net, data.tensors[0])


def test_an_infinite_sampler_that_cannot_be_read_around_is_refused_before_anything_is_read() -> None:
    """Inside another sampler: not found before, and training's iterator then raised StopIteration (a probe)."""
    data = dataset()
    loader = DataLoader(data, batch_size=8, sampler=Wrapped(InfiniteSampler(data, shuffle=True, seed=1)))
    with pytest.raises(InvalidArgumentError, match=r"InfiniteSampler through Wrapped\.inner"):
        precisebn.estimate(model(), loader)
    assert len(next(iter(loader))[0]) == 8  # (nothing was read from it)


def test_other_samplers_are_read_as_they_are() -> None:
    """A sampler holding an iterator of another kind (a cycle over a subset; an open file, a probe) was
    replaced by a pass over the whole dataset: 2.52 off. It is read as it is again (what it gives)."""
    data = dataset()
    subset = list(range(32, 64))
    net = model()
    precisebn.recalibrate(net, DataLoader(data, batch_size=8, sampler=CycledSubset(subset)), num_samples="all")
    assert_exact(net, data.tensors[0][subset])
    plain = DataLoader(data, batch_size=16, shuffle=True)
    assert independent(plain) is plain and independent([1, 2]) == [1, 2]
    once = DataLoader(data, batch_size=16, sampler=iter(range(64)))  # (an iterator given as the sampler: read once)
    assert independent(once) is once


def test_timms_multi_epochs_loader_keeps_trainings_batches() -> None:
    """timm's MultiEpochsDataLoader keeps one iterator of its own over a sampler repeated forever: a
    computation took training's next batches, and "all" ran on into the next epoch (a probe)."""
    data = dataset()

    def train(with_scheduler: bool) -> list[list[float]]:
        torch.manual_seed(0)
        loader = MultiEpochsDataLoader(data, batch_size=8, shuffle=True)
        scheduler = precisebn.PreciseBNScheduler(model(), loader, num_samples="all")
        seen = []
        for epoch in range(2):
            for step, (x,) in enumerate(loader):
                seen.append(x[:, 0].tolist())
                if with_scheduler and step == 2:
                    report = scheduler.update(epoch * 10 + step)
                    assert report is not None and (report.samples, report.batches) == (64, 8)
        return seen

    assert train(True) == train(False)


def test_a_loader_subclass_with_persistent_workers_keeps_what_it_does_to_batches() -> None:
    """Its twin was a plain DataLoader, without the subclass's __iter__: the statistics of the raw data,
    825x off in the variance (a probe)."""

    class Scaled(DataLoader):
        def __iter__(self) -> Iterator[Any]:
            for (x,) in super().__iter__():
                yield ((x - 2.5) * 10,)

    data = dataset()
    loader = Scaled(data, batch_size=8, num_workers=1, persistent_workers=True)
    net = model()
    precisebn.recalibrate(net, loader, num_samples="all")
    assert_exact(net, (data.tensors[0] - 2.5) * 10)


class Registered(InfiniteSampler):
    """A subclass that only registers itself (as downstream code does): read as an InfiniteSampler."""


class Weighted(InfiniteSampler):
    """A subclass that draws its own way: its first epoch cannot be replayed."""

    def _infinite_indices(self) -> Iterator[int]:
        while True:
            yield from torch.multinomial(torch.ones(self.size), self.size, replacement=True).tolist()


def test_subclasses_of_the_infinite_sampler_are_read_around_or_refused() -> None:
    """A subclass was not recognised: training stopped with StopIteration at the first computation (a probe)."""
    data = dataset()
    training = DataLoader(data, batch_size=16, sampler=Registered(data, shuffle=True, seed=7))
    reference = iter(DataLoader(data, batch_size=16, sampler=InfiniteSampler(data, shuffle=True, seed=7)))
    batches = iter(training)
    next(batches), next(reference)
    assert precisebn.PreciseBNScheduler(model(), training, num_samples=32).update(1) is not None
    for _ in range(6):
        assert torch.equal(next(batches)[0], next(reference)[0])
    weighted = DataLoader(data, batch_size=16, sampler=Weighted(data, shuffle=True, seed=7))
    with pytest.raises(InvalidArgumentError, match=r"Weighted is an mmengine InfiniteSampler that draws its own way"):
        precisebn.estimate(model(), weighted)


def test_a_dataset_smaller_than_a_dropped_last_batch_is_still_read() -> None:
    """drop_last=True over fewer samples than a batch: training's batches wrap around and are full, the twin's
    one pass was dropped whole — "the data yielded no batch" (a probe)."""
    data = dataset(6)
    loader = DataLoader(data, batch_sampler=BatchSampler(InfiniteSampler(data, seed=3), 8, drop_last=True))
    net = model()
    report = precisebn.recalibrate(net, loader, num_samples="all")
    assert (report.samples, report.batches) == (6, 1)
    assert_exact(net, data.tensors[0])
