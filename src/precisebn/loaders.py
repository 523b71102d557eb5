"""Reading a DataLoader for a computation without taking anything from training's own reading of it.

A computation iterates the data it is given, often the training loader while training is in the
middle of an epoch. Two kinds of loaders share iteration state between their iterators, so that a
second iterator would take samples out of training's order (or end it):

* persistent workers: ``DataLoader.__iter__`` resets and returns the loader's one iterator;
* a sampler (or batch sampler) that keeps a live iterator between calls of ``__iter__`` — mmengine's
  ``InfiniteSampler``, the sampler of its iteration-based loops, yields from one generator for its
  whole life: a computation that read from it took training's next samples, and closing its iterator
  closed that generator (training then stopped with ``StopIteration``), and ``num_samples="all"``
  never ended.

:func:`independent` gives such a loader's twin, reading the same dataset with nothing shared: the same
workers, collation and batch size, non-persistent workers, and for a live sampler one pass in the
order of the first epoch such a sampler gives (a permutation from its ``seed``, or 0, unless its
``shuffle`` is false; this rank's share by its ``rank``/``world_size``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, Sampler

from .errors import InvalidArgumentError

__all__ = ["independent"]


def independent(data: Any) -> Any:
    """``data``, or a twin of a DataLoader whose iterators share state (see the module's docstring).

    Raises:
        InvalidArgumentError: A custom batch sampler keeps a live iterator (its twin cannot be made
            from its parts): pass a loader of its own as the data.
    """
    if not isinstance(data, DataLoader):
        return data
    sampler, batches = data.sampler, data.batch_sampler
    live = not isinstance(data.dataset, IterableDataset) and (
        _live(sampler) or _live(batches) or _live(getattr(batches, "sampler", None))
    )
    if not live:
        return _twin(data) if data.persistent_workers and data.num_workers > 0 else data
    if batches is not None and type(batches) is not BatchSampler:
        raise InvalidArgumentError(
            f"the data loader's batch sampler ({type(batches).__name__}) keeps a live iterator between "
            "epochs, so reading it for the statistics would take samples out of training's order. Pass a "
            "DataLoader of its own as the data (e.g. data= for the callbacks), over the same dataset. "
            "Nothing was changed."
        )
    one_pass = _OnePass(
        len(data.dataset),  # type: ignore[arg-type]
        shuffle=bool(getattr(sampler, "shuffle", True)),  # (a subset in the dataset's order may be one class's)
        seed=int(getattr(sampler, "seed", 0) or 0),
        rank=int(getattr(sampler, "rank", 0) or 0),
        world_size=int(getattr(sampler, "world_size", 1) or 1),
    )
    if batches is None:  # batch_size=None: each item a batch
        return _twin(data, batch_size=None, sampler=one_pass)
    return _twin(data, batch_size=batches.batch_size, drop_last=batches.drop_last, sampler=one_pass)


def _live(obj: Any) -> bool:
    """Whether ``obj`` keeps an iterator (a generator, an ``itertools`` object...) among its attributes."""
    state = getattr(obj, "__dict__", None)
    return bool(state) and any(isinstance(v, Iterator) for v in state.values())


def _twin(loader: DataLoader, **sampling: Any) -> DataLoader:
    """A loader of ``loader``'s dataset with its workers, collation and seeding, not persistent; its own
    sampling unless ``sampling`` gives another."""
    common: dict[str, Any] = {
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "prefetch_factor": loader.prefetch_factor,
        "persistent_workers": False,
        "generator": loader.generator,  # as the loader would seed its workers (put back afterwards)
    }
    if sampling:
        return DataLoader(loader.dataset, **sampling, **common)
    if isinstance(loader.dataset, IterableDataset):
        return DataLoader(loader.dataset, batch_size=loader.batch_size, drop_last=loader.drop_last, **common)
    if loader.batch_sampler is None:  # batch_size=None: each item a batch, in the loader's own sampler's order
        return DataLoader(loader.dataset, batch_size=None, sampler=loader.sampler, **common)
    return DataLoader(loader.dataset, batch_sampler=loader.batch_sampler, **common)


class _OnePass(Sampler[int]):
    """One pass over ``size`` indices: a permutation seeded by ``seed`` (or in order), this rank's share
    (every ``world_size``-th from ``rank``) — the first epoch of mmengine's ``InfiniteSampler``."""

    def __init__(self, size: int, *, shuffle: bool, seed: int, rank: int, world_size: int) -> None:
        self.size, self.shuffle, self.seed, self.rank, self.world_size = size, shuffle, seed, rank, world_size

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed)
            order = torch.randperm(self.size, generator=generator).tolist()
        else:
            order = list(range(self.size))
        return iter(order[self.rank :: self.world_size])

    def __len__(self) -> int:
        return len(range(self.rank, self.size, self.world_size))
