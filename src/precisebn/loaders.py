"""Reading a DataLoader for a computation without taking anything from training's own reading of it.

A computation iterates the data it is given, often the training loader while training is in the
middle of an epoch. Some loaders share iteration state between their iterators, so that a second
iterator would take samples out of training's order, or end it:

* persistent workers: ``DataLoader.__iter__`` resets and returns the loader's one iterator (a twin:
  a shallow copy without persistent workers, which keeps a subclass's own ``__iter__``);
* mmengine's ``InfiniteSampler`` (the sampler of its iteration-based loops) yields from one
  generator for its whole life: a computation that read from it took training's next samples, and
  closing its iterator closed that generator (training then stopped with ``StopIteration``), and
  ``num_samples="all"`` never ended. The twin reads one pass in the order of its first epoch (a
  permutation from its ``seed`` unless it does not shuffle, this rank's share by its ``rank`` and
  ``world_size``), in batches of the loader's size — a last batch of one sample joins the one before
  (training, which never ends an epoch, never sees it; BatchNorm cannot take it);
* timm's ``MultiEpochsDataLoader`` keeps one iterator of its own over a sampler repeated forever
  (``_RepeatSampler``): the twin is a plain loader over the batch sampler inside.

Where the shared state cannot be read around — an ``InfiniteSampler`` inside another sampler, or a
subclass of it that draws its own way — the computation is refused by name, before it reads anything
(pass a loader of its own). Other samplers and loaders are read as they are: one whose ``__iter__``
continues a sequence it keeps (as ``InfiniteSampler`` does) moves training's sequence on.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, Sampler

from .errors import InvalidArgumentError

__all__ = ["independent"]

# DataLoader's own attributes: a dataset or sampler that is an iterator (read once) is the user's to give
_STANDARD = frozenset({"_iterator", "dataset", "sampler", "batch_sampler", "collate_fn", "worker_init_fn", "generator"})


def independent(data: Any) -> Any:
    """``data``, or a twin of a DataLoader whose iterators share state (see the module's docstring).

    Raises:
        InvalidArgumentError: The shared state cannot be read around: pass a loader of its own.
    """
    if not isinstance(data, DataLoader):
        return data
    own = [key for key, value in vars(data).items() if key not in _STANDARD and isinstance(value, Iterator)]
    repeated = data.batch_sampler if data.batch_sampler is not None else data.sampler
    if own and type(repeated).__name__ == "_RepeatSampler":  # timm's MultiEpochsDataLoader (other loaders: as they are)
        return _plain_twin(data, repeated.sampler)
    if not isinstance(data.dataset, IterableDataset):
        batches = data.batch_sampler
        if batches is None or type(batches) is BatchSampler:
            sampler = data.sampler if batches is None else batches.sampler
            if _infinite(sampler):
                size = batches.batch_size if batches is not None else None
                drop_last = batches.drop_last if batches is not None else False
                one_pass = _first_epoch(sampler, len(data.dataset), size, drop_last)  # type: ignore[arg-type]
                return _twin(data, batches=one_pass) if batches is not None else _twin(data, sampler=one_pass)
        inside = _infinite_inside(data.sampler) or _infinite_inside(batches)
        if inside:
            raise InvalidArgumentError(
                f"the data loader reads mmengine's InfiniteSampler through {inside}, which keeps one iterator for "
                "its whole life: reading it for the statistics would take samples out of training's order (and "
                "end it). Pass a DataLoader of its own over the same dataset as the data (data= for the hooks "
                "and callbacks). Nothing was changed."
            )
    if data.persistent_workers and data.num_workers > 0:
        return _twin(data)
    return data


def _infinite(sampler: Any) -> bool:
    """Whether ``sampler`` is mmengine's ``InfiniteSampler`` or a subclass of it.

    Raises:
        InvalidArgumentError: A subclass that draws otherwise (its own ``__iter__`` or indices): its
            first epoch cannot be replayed here.
    """
    base = next(
        (k for k in type(sampler).__mro__ if k.__name__ == "InfiniteSampler" and k.__module__.startswith("mmengine")),
        None,
    )
    if base is None:
        return False
    kind = type(sampler)
    changed = [
        name
        for name in ("__iter__", "_infinite_indices", "_indices_of_rank")
        if getattr(kind, name, None) is not getattr(base, name, None)
    ]
    if changed:
        raise InvalidArgumentError(
            f"the data loader's sampler {kind.__name__} is an mmengine InfiniteSampler that draws its own way "
            f"({', '.join(changed)}), keeping one iterator for its whole life: reading it for the statistics would "
            "take samples out of training's order (and end it), and its first epoch cannot be replayed. Pass a "
            "DataLoader of its own over the same dataset as the data (data= for the hooks and callbacks). "
            "Nothing was changed."
        )
    return True


def _infinite_inside(obj: Any, depth: int = 3) -> str | None:
    """How an ``InfiniteSampler`` is reached from ``obj`` through other samplers' attributes (``None``: not)."""
    if depth == 0 or obj is None:
        return None
    for key, value in getattr(obj, "__dict__", {}).items():
        if _infinite(value):
            return f"{type(obj).__name__}.{key}"
        if isinstance(value, Sampler) or (attribute(value, "__iter__") and attribute(value, "sampler") is not None):
            found = _infinite_inside(value, depth - 1)
            if found:
                return f"{type(obj).__name__}.{key}.{found.split('.', 1)[1]}"
    return None


def attribute(obj: Any, name: str) -> Any:
    """``getattr(obj, name, None)``, also when the object's ``__getattr__`` raises something else (a
    dataset's lookup table): the data's objects are the user's."""
    try:
        return getattr(obj, name, None)
    except Exception:
        return None


def _twin(
    loader: DataLoader, *, batches: Sampler[Any] | None = None, sampler: Sampler[Any] | None = None
) -> DataLoader:
    """A shallow copy of ``loader`` (its subclass, dataset, workers, collation and seeding) whose
    iterators are its own: no persistent workers; ``batches`` (or, for a loader without batching,
    ``sampler``) instead of its own if given."""
    twin = copy.copy(loader)  # (its __dict__ as it is: DataLoader's __setattr__ refuses these after __init__)
    object.__setattr__(twin, "persistent_workers", False)
    object.__setattr__(twin, "_iterator", None)
    if batches is not None:
        object.__setattr__(twin, "batch_sampler", batches)
        object.__setattr__(twin, "drop_last", False)  # (the batches say which to keep)
    if sampler is not None:
        object.__setattr__(twin, "sampler", sampler)
    return twin


def _plain_twin(loader: DataLoader, inner: Any) -> DataLoader:
    """A plain loader over ``loader``'s dataset and ``inner``, the batch sampler (or sampler) inside the
    sampler it repeats forever (timm's ``MultiEpochsDataLoader``), with its workers, collation and seeding."""
    common: dict[str, Any] = {
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "prefetch_factor": loader.prefetch_factor,
        "generator": loader.generator,  # as the loader would seed its workers (put back by the scheduler)
    }
    if loader.batch_sampler is None:  # batch_size=None: each item a batch
        return DataLoader(loader.dataset, batch_size=None, sampler=inner, **common)
    return DataLoader(loader.dataset, batch_sampler=inner, **common)


def _first_epoch(sampler: Any, size: int, batch_size: int | None, drop_last: bool) -> Sampler[Any]:
    """The batches of one pass in the order of an ``InfiniteSampler``'s first epoch."""
    world = int(getattr(sampler, "world_size", 1) or 1)
    return _Batches(
        size,
        shuffle=bool(getattr(sampler, "shuffle", True)),
        seed=int(getattr(sampler, "seed", 0) or 0),
        rank=int(getattr(sampler, "rank", 0) or 0) % world,
        world_size=world,
        batch_size=batch_size,
        drop_last=drop_last,
    )


class _Batches(Sampler[Any]):
    """One pass over ``size`` indices — a permutation seeded by ``seed`` (or in order), this rank's share
    (every ``world_size``-th from ``rank``), as mmengine's ``InfiniteSampler`` gives its first epoch — cut
    into batches of ``batch_size`` (a last batch of one joins the one before, or is dropped with
    ``drop_last`` as any partial one); ``batch_size=None``: the indices one by one."""

    def __init__(
        self,
        size: int,
        *,
        shuffle: bool,
        seed: int,
        rank: int,
        world_size: int,
        batch_size: int | None,
        drop_last: bool,
    ) -> None:
        self.size, self.shuffle, self.seed, self.rank, self.world_size = size, shuffle, seed, rank, world_size
        self.batch_size, self.drop_last = batch_size, drop_last

    def _order(self) -> list[int]:
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed)
            return torch.randperm(self.size, generator=generator).tolist()[self.rank :: self.world_size]
        return list(range(self.size))[self.rank :: self.world_size]

    def _batches(self) -> list[Any]:
        order, n = self._order(), self.batch_size
        if n is None:
            return order
        batches = [order[i : i + n] for i in range(0, len(order), n)]
        if (
            len(batches) > 1 and len(batches[-1]) < n and self.drop_last
        ):  # (the only batch is kept: training's are full)
            batches.pop()
        elif len(batches) > 1 and len(batches[-1]) == 1:
            last = batches.pop()  # (not `batches[-2] += batches.pop()`: that assigns to the new [-2])
            batches[-1] += last
        return batches

    def __iter__(self) -> Iterator[Any]:
        return iter(self._batches())

    def __len__(self) -> int:
        return len(self._batches())
