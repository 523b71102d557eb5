"""Batches: how many samples they hold, moving them to a device, feeding them to a model."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from .errors import BatchTypeError, InvalidArgumentError

__all__ = ["Forward", "batch_size", "default_forward", "model_device", "to_device"]

Forward = Callable[[nn.Module, Any], Any]


def default_forward(model: nn.Module, batch: Any) -> Any:
    """Feeds a batch to ``model`` the usual way.

    A tensor goes in as it is, a tuple or list gives its first element (the
    ``(inputs, targets)`` convention), a mapping is passed as keyword arguments.

    Raises:
        BatchTypeError: For any other kind of batch.
    """
    if isinstance(batch, Tensor):
        return model(batch)
    if isinstance(batch, (tuple, list)):
        if not batch:
            raise BatchTypeError("an empty tuple/list batch cannot be fed to the model; check the data.")
        with _hint("model(batch[0]), the first element of a tuple/list batch"):
            return model(batch[0])
    if isinstance(batch, Mapping):
        with _hint(f"model(**batch), a dict batch's keys ({', '.join(map(str, list(batch)[:4]))}) as keywords"):
            return model(**batch)
    raise BatchTypeError(
        f"don't know how to feed a batch of type {type(batch).__name__} to the model; "
        "pass forward=lambda model, batch: model(...) to say how."
    )


@contextlib.contextmanager
def _hint(how: str) -> Iterator[None]:
    """Adds a note to a ``TypeError`` about the model's arguments raised by a call made as ``how``: the
    model's own error, unchanged, says what the model expected; the note says what was passed and how to
    pass it otherwise (a dict batch given as keywords to a model that takes one tensor said only
    "unexpected keyword argument 'x'", a probe)."""
    try:
        yield
    except TypeError as e:
        if "argument" in str(e):
            e.add_note(
                f"precisebn: the default forward called {how}. If the model takes its batch otherwise, "
                "pass forward=lambda model, batch: model(...) (e.g. model(batch['x']))."
            )
        raise


def batch_size(batch: Any) -> int | None:
    """The number of samples in a batch: the first dimension of its input tensor.

    A tensor counts its first dimension; a tuple/list counts its first element: a tensor (``(inputs,
    targets)``), a tuple of per-sample tensors when the next element holds as many targets
    (``(images, targets)``, torchvision's detection batches) and else a tuple of batched inputs
    (``((x, extra), y)``; with one sample, where its fields differ in kind), a mapping of inputs
    (``({"x": x}, y)``, ``({"x": x}, {"y": y})``); a list of per-sample records (dicts, as detectron2
    uses, or ``(image, label)`` tuples as an identity ``collate_fn`` leaves them: more than two, or
    labelled, or of fields whose first dimensions differ) counts its length; per-sample metadata
    first (a list or tuple of file names, ids) counts its length, unless no tensor beside it has as
    many (class names beside a batch of images: the first tensor beside it counts); a plain value
    first (a task name, a 0-d step count) counts what follows it. A mapping counts its first list of
    tensors beside as many records (per-sample, as mmengine's ``pseudo_collate`` gives) or, of
    different sizes, beside a tensor of as many (per-image boxes beside the images), or its first
    tensor of one dimension or more. ``None`` when nothing tells. Some shapes cannot be told apart (a
    list of per-sample images alone, three boxes per image of three channels, one sample's fields all
    of one kind, two dicts with the same keys): pass ``num_batches=`` rather than ``num_samples=``
    for those.

    Example:
        >>> import torch
        >>> batch_size((torch.zeros(8, 3), torch.zeros(8)))
        8
        >>> batch_size([{"image": torch.zeros(3, 4, 4)}, {"image": torch.zeros(3, 4, 4)}])
        2
        >>> batch_size(((torch.zeros(3, 4, 4),) * 5, ({"boxes": torch.zeros(1, 4)},) * 5))
        5
        >>> batch_size(({"x": torch.zeros(6, 2)}, torch.zeros(6)))
        6
        >>> image, mask = torch.zeros(1, 3, 4, 4), torch.ones(1, 4, 4, dtype=torch.bool)
        >>> batch_size(((image, mask), (torch.zeros(1, dtype=torch.long), torch.ones(1))))  # one sample's fields
        1
        >>> batch_size((["a.png", "b.png", "c.png"], torch.zeros(3, 1, 4, 4)))  # (path, image) samples
        3
        >>> batch_size((["cat", "dog"], torch.zeros(5, 1, 4, 4)))  # names, not one per sample
        5
    """
    if isinstance(batch, Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, (tuple, list)):
        if not batch:
            return 0
        first = batch[0]
        if isinstance(first, Tensor):
            if first.dim() == 0 and len(batch) > 1:
                if all(isinstance(v, Tensor) and v.dim() == 0 for v in batch):
                    return len(batch)  # one value per sample
                return batch_size(batch[1] if len(batch) == 2 else tuple(batch[1:]))  # (a step count first)
            return batch_size(first)
        if _metadata(first):
            if isinstance(first, (tuple, list)):  # (file names, images): what collating (path, image) samples gives
                sizes = [int(v.shape[0]) for v in batch[1:] if isinstance(v, Tensor) and v.dim()]
                if sizes and len(first) not in sizes:  # (class names, images): not one per sample, the tensor tells
                    return sizes[0]
                return len(first)  # one entry per sample
            rest = batch[1:]  # ("task", x): a plain value first, counted by what follows if that holds tensors
            if any(isinstance(v, (Tensor, tuple, list, Mapping)) and not _metadata(v) for v in rest):
                return batch_size(rest[0] if len(rest) == 1 else tuple(rest))
        if isinstance(first, (tuple, list)) and first and isinstance(first[0], Tensor):
            # per-sample (image, label) records, as an identity collate_fn leaves them: more than two (a batch's
            # inputs and targets are two), or with a label (a number, a 0-d tensor) that a batch's fields lack
            if _records(batch) and (len(batch) > 2 or _labelled(first)):
                return len(batch)
            second, n = (batch[1] if len(batch) > 1 else None), len(first)
            if isinstance(second, (tuple, list)) and len(second) == n and not _batched_alike(first, second):
                return n  # per-sample inputs, with their targets (not as many batched inputs as targets)
            if isinstance(second, Tensor) and second.dim() and second.shape[0] == n:
                return n  # per-sample inputs, with their targets stacked (batched inputs: as many as theirs)
            return batch_size(first)
        if isinstance(first, tuple):
            return batch_size(first)
        if (
            isinstance(first, Mapping)
            and len(batch) == 2
            and not (isinstance(batch[1], Mapping) and batch[1].keys() == first.keys())
        ):  # (inputs, targets) with named inputs ({"x": x}, {"y": y}), not two records with the same keys
            counted = batch_size(first)
            if counted is not None:
                return counted
        return len(batch)
    if isinstance(batch, Mapping):
        for value in batch.values():
            if isinstance(value, (list, tuple)) and value and all(isinstance(v, Tensor) for v in value):
                n = len(value)
                # (items of different first dimensions, boxes per image, are per sample; a list of batched
                # tensors, the levels of a feature pyramid, is not, whatever tensor has as many as it has items)
                varied = len({v.shape[0] if v.dim() else None for v in value}) > 1
                for other in batch.values():
                    if other is value:
                        continue
                    if isinstance(value, list) and isinstance(other, (list, tuple)):
                        if len(other) == n:
                            return n  # per-sample tensors with as many records (mmengine's pseudo_collate)
                    elif varied and isinstance(other, Tensor) and other.dim() and len(other) == n:
                        return n  # per-sample tensors (boxes) beside a stacked tensor of as many (the images)
            if (isinstance(value, Tensor) and value.dim()) or (  # (a 0-d value, e.g. a step count, says nothing)
                isinstance(value, (tuple, list)) and value and isinstance(value[0], Tensor)
            ):
                return batch_size(value)
    return None


def _labelled(item: tuple[Any, ...] | list[Any]) -> bool:
    """Whether ``item`` reads as one sample's record, not as a batch's fields (which share their first dimension,
    the batch's): it holds a label — a value that is not a tensor, a 0-d tensor — or tensors whose first dimensions
    differ (an image of 3 channels and a one-element label tensor, a probe)."""
    if any(not isinstance(v, Tensor) or v.dim() == 0 for v in item):
        return True
    return len({v.shape[0] for v in item}) > 1


def _records(batch: tuple[Any, ...] | list[Any]) -> bool:
    """Whether the items of ``batch`` are tuples/lists of one structure: as many fields, each place of one kind
    (:func:`_one_kind`) — per-sample records, not a batch's fields (an image and its mask, labels and weights)."""
    width = len(batch[0])
    if not all(isinstance(item, (tuple, list)) and len(item) == width for item in batch):
        return False
    return all(_one_kind([item[k] for item in batch]) for k in range(width))


def _metadata(value: Any) -> bool:
    """Whether ``value`` is a plain value (a name, an id, a number) or a non-empty list/tuple of
    them, as per-sample metadata beside a batch's tensors is collated."""
    if isinstance(value, (tuple, list)):
        return bool(value) and not any(isinstance(v, (Tensor, tuple, list, Mapping)) for v in value)
    return not isinstance(value, (Tensor, Mapping))


def _batched_alike(first: tuple[Any, ...] | list[Any], second: tuple[Any, ...] | list[Any]) -> bool:
    """Whether ``first`` and ``second`` are a batch's inputs and targets (``((x, mask), (y, weight))``), not
    per-sample ones (grayscale images with their masks): their first tensors share a first dimension above 1,
    or of 1 in every tensor of both where either holds tensors of different kinds (a batch's fields: an image
    and its mask, labels and weights), as items collated side by side are not (one image after another)."""
    x, y = first[0], second[0]
    if not (isinstance(y, Tensor) and y.dim() > 0 and x.dim() > 0 and y.shape[0] == x.shape[0]):
        return False
    if x.shape[0] > 1:
        return True
    tensors = [t for t in (*first, *second) if isinstance(t, Tensor) and t.dim()]  # (a 0-d field: a scalar weight)
    if any(t.shape[0] != 1 for t in tensors):
        return False
    return not (_one_kind(first) and _one_kind(second))


def _one_kind(items: tuple[Any, ...] | list[Any]) -> bool:
    """Whether ``items`` are of one kind, as per-sample items are: tensors of one dtype and number of
    dimensions, or values of one type."""
    head = items[0]
    if isinstance(head, Tensor):
        return all(isinstance(t, Tensor) and t.dim() == head.dim() and t.dtype == head.dtype for t in items)
    return all(type(v) is type(head) for v in items)


def to_device(batch: Any, device: torch.device | None) -> Any:
    """Moves every tensor in a (nested) tuple/list/dict batch to ``device`` without blocking.

    Containers are copied, so that a ``forward`` that changes its batch (``batch.pop("label")``)
    leaves the data as it was, and keep their type: a shallow copy of the batch's own object
    (a ``defaultdict`` keeps its default, a list subclass its attributes), else one built from
    the items, else a plain dict or list.
    """
    if device is None:
        return batch
    if isinstance(batch, Tensor):
        if batch.is_meta and device.type != "meta":  # (torch: "Cannot copy out of meta tensor", no more)
            raise InvalidArgumentError(
                f"a batch holds a tensor of shape {tuple(batch.shape)} on the meta device, which has no values to "
                f"move to {device} and measure; have the data yield materialised tensors (e.g. on the CPU). The "
                "model was left unchanged."
            )
        return batch.to(device, non_blocking=True)
    if isinstance(batch, tuple):
        items = [to_device(b, device) for b in batch]
        return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)  # (a namedtuple)
    if isinstance(batch, list):
        items = [to_device(b, device) for b in batch]
        return _copied(batch, lambda c: c.__setitem__(slice(None), items), lambda: items)
    if isinstance(batch, Mapping):
        moved = {k: to_device(v, device) for k, v in batch.items()}

        def built() -> Any:
            try:
                return type(batch)(moved)  # type: ignore[call-arg]
            except TypeError:
                return moved

        if not isinstance(batch, dict):  # (a copy of another mapping may share its storage with the original)
            return built()
        return _copied(batch, lambda c: c.update(moved), built)
    return batch


def _copied(batch: Any, fill: Callable[[Any], None], otherwise: Callable[[], Any]) -> Any:
    """A shallow copy of a ``list``/``dict`` (subclass) ``batch`` (its own storage: copies of these
    are rebuilt item by item) with ``fill`` applied, else ``otherwise()``."""
    try:
        copied = copy.copy(batch)
        if copied is batch:  # (a __copy__ that returns the object itself)
            return otherwise()
        fill(copied)
        return copied
    except Exception:
        return otherwise()


def model_device(model: nn.Module) -> torch.device | None:
    """The device of the model's first parameter or buffer (``None`` if it has neither)."""
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return None
