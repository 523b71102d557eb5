"""A model's state around a statistics pass: snapshots that put back objects as well
as values, and the guard that lets one pass at a time work on a model.

:class:`StateSnapshot` records, for every module, its class, its attributes (a shallow
copy of its ``__dict__``) and the contents of the dicts, lists, sets and deques they hold —
which tensor objects its ``_buffers`` and ``_parameters`` hold, its submodules, its hooks,
caches of the model's own — and copies of what the passes can change: every
buffer's values (the whole stretch of storage it can reach, so views, expanded and
non-contiguous buffers restore exactly) and the weights that torch's own modules
renormalise in place (``Embedding``/``EmbeddingBag`` with ``max_norm``). On restore the
original objects go back into their modules — a buffer that ``forward`` reassigned
(``self.avg = 0.9 * self.avg + ...``) is put back as the tensor it was, one it resized in place
(``resize_``, as torch.ao's observers do) gets its shape back — and values are
copied back only where their bits differ (version counters cannot tell: torch's own
BatchNorm kernels update running buffers without bumping them), so untouched tensors
are not even written. Other parameters are not copied (that would double the model's
memory): one changed in place by an operation that bumps its version counter is
reported by :meth:`StateSnapshot.restore`.

:func:`exclusive` refuses a second pass on a model (or on a module it shares) while one
is running, from any thread: two passes would swap the same buffers and restore each
other's scratch tensors.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import math
import operator
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from .errors import ConcurrentUseError, UninitializedLayerError

__all__ = [
    "StateSnapshot",
    "ValueCopies",
    "copy_all",
    "exclusive",
    "geometry",
    "in_memory",
    "let_go",
    "lock_held",
    "overlapping",
    "refuse_uninitialized",
    "renormalised_weights",
    "restore_on_error",
    "to_the_end",
    "version_of",
]

_VERSION = operator.attrgetter("_version")

# lazy modules' tensors (UninitializedParameter, UninitializedBuffer) by their plain mixin class: Parameter's
# metaclass makes isinstance against those slow, and every tensor of the model is tested
_UNINITIALIZED = nn.parameter.UninitializedTensorMixin
RENORMALISED = (nn.Embedding, nn.EmbeddingBag)  # modules whose forward writes their weight (max_norm)


def version_of(t: Tensor) -> int | None:
    """``t``'s version counter (bumped by every in-place change), or ``None`` for an inference
    tensor, which keeps none."""
    try:
        return int(t._version)
    except RuntimeError:  # inference tensors keep no version counter
        return None


def _extent(t: Tensor) -> int:
    """How many storage elements a non-empty strided ``t`` spans, from its first to its last."""
    shape = t.shape
    if len(shape) == 1:
        return 1 + (shape[0] - 1) * t.stride(0)
    return _extent_of(shape, t.stride())


def _extent_of(shape: tuple[int, ...], stride: tuple[int, ...]) -> int:
    """:func:`_extent` of a tensor of ``shape`` and ``stride`` (0 for an empty one)."""
    return 0 if 0 in shape else 1 + sum((n - 1) * s for n, s in zip(shape, stride))


def _span(t: Tensor) -> Tensor | None:
    """A flat view of every storage element ``t`` can reach (``None`` if it holds none, or if its storage is
    too small for its shape: freed by ``untyped_storage().resize_(0)`` and not put back)."""
    if t.layout != torch.strided or t.is_meta or t.numel() == 0:
        return None
    try:
        return t.as_strided((_extent(t),), (1,), t.storage_offset())
    except RuntimeError:
        return None


def in_memory(t: Tensor) -> bool:
    """Whether the storage under a non-empty strided ``t`` holds every element ``t`` can reach (``False`` if it was
    freed by ``untyped_storage().resize_(0)`` and not put back): whether its values can be read, without making a
    view of them (three times the cost, for every running buffer of a model, twice per recalibration).

    >>> import torch
    >>> t = torch.zeros(8)
    >>> tail, every_other = t[2:], t.view(2, 4)[:, ::2]
    >>> in_memory(tail), in_memory(every_other)
    (True, True)
    >>> _ = t.untyped_storage().resize_(0)
    >>> in_memory(tail), in_memory(every_other)
    (False, False)
    """
    try:
        return t.untyped_storage().nbytes() >= (t.storage_offset() + _extent(t)) * t.element_size()
    except (RuntimeError, NotImplementedError):  # (a tensor subclass without a storage of its own: as the view says)
        return _span(t) is not None


def overlapping(tensors: list[Tensor]) -> list[tuple[int, int]]:
    """Pairs ``(i, j)``, ``i < j``, of ``tensors`` that share memory (the same tensor twice,
    a view and its base, two views with an element's bytes in common): writing one of a pair
    changes the other.

    >>> import torch
    >>> a = torch.zeros(6)
    >>> overlapping([a[:3], a[3:], torch.zeros(2), a[::2], a[1::2], a])  # a[::2], a[1::2] share no byte
    [(0, 3), (0, 4), (0, 5), (1, 3), (1, 4), (1, 5), (3, 5), (4, 5)]
    """
    by_device: dict[int, list[tuple[int, int, int]]] = {}  # addresses are unique on a device (-1: the CPU)
    for k, t in enumerate(tensors):
        start = t.data_ptr() if t.layout == torch.strided else 0
        if not start:  # no memory (meta, empty) or no strides (sparse...)
            continue
        by_device.setdefault(t.get_device(), []).append((start, start + _extent(t) * t.element_size(), k))
    pairs = []
    for ranges in by_device.values():
        ranges.sort()
        active: list[tuple[int, int]] = []  # (end, index) of the tensors whose span reaches this far
        for start, end, k in ranges:
            active = [(e, i) for e, i in active if e > start]
            for _, i in active:
                if _share_bytes(tensors[i], tensors[k]):
                    pairs.append((min(i, k), max(i, k)))
            active.append((end, k))
    return sorted(pairs)


_EXACT = 1 << 16  # elements: tensors this large or smaller whose spans overlap are compared byte by byte


def _share_bytes(a: Tensor, b: Tensor) -> bool:
    """Whether two tensors whose spans overlap have a byte in common (assumed for large ones)."""
    if a.numel() > _EXACT or b.numel() > _EXACT:
        return True
    return not _byte_addresses(a).isdisjoint(_byte_addresses(b))


def _byte_addresses(t: Tensor) -> set[int]:
    positions = (
        torch.arange(_extent(t), dtype=torch.int64, device="cpu")
        .as_strided(t.shape, t.stride(), 0)
        .reshape(-1)
        .tolist()
    )
    size, base = t.element_size(), t.data_ptr()
    return {base + p * size + byte for p in positions for byte in range(size)}


def _bytes(t: Tensor) -> Tensor | None:
    try:
        return t.view(torch.uint8)  # compared as bytes: NaN == NaN, -0.0 != 0.0
    except RuntimeError:  # dtypes without a byte view (quantized...)
        return None


@dataclass
class _Saved:
    name: str
    tensor: Tensor
    version: int | None
    copy: Tensor | None  # the span's values (own copy), or None when in a blob or not copied
    blob: tuple[torch.device, int, int] | None = None  # (device, start, length) in that device's blob
    # (dtype, device, shape, strides, storage offset, storage) of a strided tensor: a forward may resize it in
    # place (resize_: torch.ao's observers grow an empty min_val to one value per channel) or point it at other
    # memory (set_, .data =: its saved values must then go back into its own storage, not into that memory)
    geometry: tuple[Any, ...] | None = None
    storage: Any = None  # its storage (kept: a forward that points the tensor elsewhere may drop it otherwise)
    nbytes: int = 0  # that storage's size (resize_ may grow it: a model saved afterwards would carry the rest)


class ValueCopies:
    """Exact copies of a few tensors' values and geometry, to tell later whether any changed and put them
    back: for tensors taken out of the model for the passes, which nothing of the model should write — but
    code holding references to them (an attribute list, a parent module) still can, in place or by
    ``resize_``/``set_``. Contiguous tensors are copied and compared by one concatenation per device, dtype
    and rank (bitwise: NaN equals NaN), others one by one, element by element.

    >>> import torch
    >>> a, b = torch.zeros(2), torch.ones(3)
    >>> kept = ValueCopies([a, b])
    >>> _ = b.add_(1)
    >>> kept.changed(), kept.restore(), b.tolist()
    ([1], None, [1.0, 1.0, 1.0])
    """

    def __init__(self, tensors: list[Tensor]) -> None:
        self._tensors = tensors
        self._groups: dict[tuple[torch.device, torch.dtype, int], list[int]] = {}  # (by dimensions: 0, 1, more)
        self._own: dict[int, _Saved] = {}  # the other tensors: geometry, storage and a copy of their values
        # the contiguous ones: (storage, offset, shape, address, storage size), to undo resize_/set_ first
        self._where: dict[int, tuple[Any, int, torch.Size, int, int]] = {}
        for k, t in enumerate(tensors):
            if _plain(t):
                self._groups.setdefault((t.device, t.dtype, min(t.dim(), 2)), []).append(k)
                storage = t.untyped_storage()
                self._where[k] = (storage, t.storage_offset(), t.shape, t.data_ptr(), storage.nbytes())
                continue
            saved = _Saved("", t, version_of(t), None, geometry=geometry(t))
            if saved.geometry is not None:
                saved.storage = t.untyped_storage()
                saved.nbytes = saved.storage.nbytes()
                saved.copy = t.detach().clone()
            self._own[k] = saved
        with torch.no_grad():
            self._blobs = {key: self._joined(key, ids) for key, ids in self._groups.items()}

    def _joined(self, key: tuple[torch.device, torch.dtype, int], ids: list[int]) -> Tensor:
        tensors = [self._tensors[k] for k in ids]
        if key[2] == 1:  # (running statistics: one cat; reshaping each first costs as much again)
            return torch.cat(tensors)
        if key[2] == 0:  # (counters)
            return torch.stack(tensors)
        return torch.cat([t.reshape(-1) for t in tensors])

    def changed(self) -> list[int]:
        """The indices of the tensors whose values, shape or memory changed: one comparison per device, dtype
        and rank when none did."""
        out = []
        with torch.no_grad():
            for key, ids in self._groups.items():
                try:  # (a tensor resized, of another dtype or device: another length, dtype, or no cat at all)
                    if all(self._tensors[k].data_ptr() == self._where[k][3] for k in ids) and _bitwise_equal(
                        self._joined(key, ids), self._blobs[key]
                    ):
                        continue
                except RuntimeError:
                    pass
                at = 0
                for k in ids:  # (something changed: which)
                    t, size = self._tensors[k], math.prod(self._where[k][2])
                    if self._moved(k) or not _bitwise_equal(t.detach().reshape(-1), self._blobs[key][at : at + size]):
                        out.append(k)
                    at += size
            for k, saved in self._own.items():
                t = self._tensors[k]
                if geometry(t) != saved.geometry or (
                    saved.copy is not None and not _bitwise_equal(t.detach(), saved.copy)
                ):
                    out.append(k)
        return sorted(out)

    def _moved(self, k: int) -> bool:
        """Whether contiguous tensor ``k`` has another dtype, device, shape, layout or memory than it had."""
        t, (_, _, shape, address, _) = self._tensors[k], self._where[k]
        key = next(g for g, ids in self._groups.items() if k in ids)
        return (t.device, t.dtype) != key[:2] or t.shape != shape or not _plain(t) or t.data_ptr() != address

    def restore(self) -> None:
        """Puts back each changed tensor's geometry (on its own storage, see :func:`_reshape`), then its values."""
        changed = self.changed()
        if not changed:
            return
        starts = {}
        for ids in self._groups.values():
            at = 0
            for k in ids:
                starts[k] = at
                at += math.prod(self._where[k][2])
        with torch.no_grad():
            for k in changed:
                t = self._tensors[k]
                if k in self._own:
                    saved = self._own[k]
                    if saved.geometry is None or (geometry(t) != saved.geometry and not _reshape(saved)):
                        continue
                    values = saved.copy
                else:
                    group = next(g for g, ids in self._groups.items() if k in ids)
                    storage, offset, shape, _, nbytes = self._where[k]
                    if self._moved(k):
                        saved = _Saved("", t, version_of(t), None, storage=storage)
                        saved.geometry = (group[1], group[0], tuple(shape), _contiguous(shape), offset, storage._cdata)
                        saved.nbytes = nbytes
                        if not _reshape(saved):
                            continue
                    values = self._blobs[group][starts[k] : starts[k] + math.prod(shape)].view(shape)
                if values is None:
                    continue
                with torch.inference_mode() if version_of(t) is None else contextlib.nullcontext():
                    t.copy_(values)


def _contiguous(shape: torch.Size) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


_VIEWED = {torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16}
_VIEWED |= {torch.int8, torch.uint8, torch.bool}


def _plain(t: Tensor) -> bool:
    """A strided, contiguous tensor in memory, of a dtype that an integer type of its size can view."""
    return t.dtype in _VIEWED and t.layout == torch.strided and not t.is_meta and t.is_contiguous()


def _bitwise_equal(a: Tensor, b: Tensor) -> bool:
    """Whether two tensors of one dtype and shape hold the same bits (NaN equals NaN, -0.0 differs from 0.0)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.is_floating_point:
        ints = _INTS[a.element_size()]
        a, b = a.contiguous().view(ints), b.contiguous().view(ints)
    return torch.equal(a, b)


def _addresses(tensors: list[Tensor]) -> list[int | None]:
    """Where each tensor's data are (``None`` for a tensor without storage): at C speed where every one has."""
    try:
        return list(map(Tensor.data_ptr, tensors))
    except RuntimeError:
        return [_address(t) for t in tensors]


def _versions(tensors: list[Tensor]) -> list[int | None]:
    """:func:`version_of` each tensor: at C speed where none is an inference tensor."""
    try:
        return list(map(int, map(_VERSION, tensors)))
    except RuntimeError:
        return list(map(version_of, tensors))


def _storage(t: Tensor) -> int | None:
    """``t``'s storage (its ``_cdata``; ``None`` for a tensor without one)."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


def _shared_since(t: Tensor, storage: int | None) -> bool:
    """Whether tensor ``t``, whose data moved, holds the same storage (``storage``), now in shared memory: moved
    there by ``share_memory_()`` — what pickling it for another process does (a loader's spawn or forkserver
    worker given the model), copying its values — rather than pointed at other data (``.data =``)."""
    return storage is not None and _storage(t) == storage and t.is_shared()


def _address(t: Tensor) -> int | None:
    try:
        return t.data_ptr()
    except RuntimeError:
        return None


class StateSnapshot:
    """Objects and values of a model's modules — their classes, attributes, the containers those hold, their
    buffers' values — to be put back later: by identity (never ``==``), one shallow level deep.

    Args:
        modules: The model's ``named_modules()``.
        uncopied: ``id()`` of buffers whose values need no copy (they are swapped out of
            the model for the duration, and only their objects are put back).

    Memory: one copy of every other buffer's storage span (kept as one byte blob per
    device, compared at the end in one operation), plus the weights of
    ``Embedding``/``EmbeddingBag`` modules with ``max_norm``; parameters otherwise
    cost nothing.
    """

    def __init__(self, modules: list[tuple[str, nn.Module]], uncopied: set[int] | None = None) -> None:
        # per module (parallel lists, not tuples: a snapshot makes few objects for the gc to track): the module;
        # then every module's attributes (its __dict__) and the containers they hold — its buffer, parameter,
        # child-module and hook dicts, a cache dict or list of the model's own — with a shallow copy of each (the
        # empty ones apart). A forward that caches something on a module during the passes (a view of its
        # scratch buffers: its recalibrated ones went unused, a probe), registers a hook or builds a head on its
        # first call (probe 22: the hooks piled up, ``model.head`` was None beside a Linear in ``_modules``)
        # leaves it behind otherwise
        self._modules: list[nn.Module] = []
        self._classes: list[type] = []
        self._containers: list[Any] = []
        self._contents: list[Any] = []
        self._empty: list[Any] = []
        self._dict_flags: list[bool] = []  # (which of them are dicts, whose values are compared too)
        self._saved: list[_Saved] = []  # tensors whose values are copied
        # parameters not copied, whose version counters tell whether they changed (parallel lists; each one's name
        # is made from its module's prefix and its key only if it is reported: most calls report none)
        self._watched_prefixes: list[str] = []
        self._watched_keys: list[str] = []
        self._watched: list[Tensor] = []
        skip = set(uncopied or ())
        # the weights a forward renormalises in place, whichever module holds them first (the review of probe 42: a
        # Linear tied to an Embedding with max_norm, registered before it, had the shared weight only watched — the
        # passes renormalised it, 5.6 off, and it could not be put back)
        renormalised = renormalised_weights(modules)
        pieces: dict[torch.device, list[Tensor]] = {}
        sizes: dict[torch.device, int] = {}
        with torch.no_grad():
            for prefix, module in modules:  # (each module's buffers, then its parameters: the first holder names one)
                self._modules.append(module)
                for key, t in module._buffers.items():
                    if id(t) not in skip and isinstance(t, Tensor):
                        skip.add(id(t))
                        self._save(f"{prefix}.{key}" if prefix else key, t, pieces, sizes)
                for key, t in module._parameters.items():
                    if id(t) in skip or not isinstance(t, Tensor):
                        continue
                    skip.add(id(t))
                    if id(t) in renormalised:
                        self._save(f"{prefix}.{key}" if prefix else key, t, pieces, sizes)
                    else:
                        self._watched_prefixes.append(prefix)
                        self._watched_keys.append(key)
                        self._watched.append(t)
            # (the containers among all attributes picked out at C speed — subclasses too: a defaultdict cache
            # kept precisebn's scratch, probe 23 — the module dicts first, which bind them; and each module's
            # class, which torch's parametrize swaps, probe 23: restored without it, a model that registered one
            # in its forward kept ParametrizedConv2d without its parametrizations, and raised on its next call)
            self._classes = list(map(type, self._modules))
            attributes = list(map(_DICT_OF, self._modules))
            values = list(itertools.chain.from_iterable(map(dict.values, attributes)))
            held = list(itertools.compress(values, map(_IS_CONTAINER.__getitem__, map(type, values))))
            others = list(filter(None, held))
            self._containers = attributes + others
            self._empty = list(itertools.filterfalse(None, held))
            # (copies of the base type, never by a subclass's own copy(), which may copy deeper: put back, its
            # copies would replace the model's objects; a __dict__ is always a dict)
            self._contents = list(map(dict.copy, attributes)) + list(map(_base_copy, others))
            self._dict_flags = [True] * len(attributes) + list(map(isinstance, others, itertools.repeat(dict)))
            self._blobs = {device: torch.cat(raws) for device, raws in pieces.items()}
        # the watched parameters' versions, and where their data are: a forward assigning ``p.data`` (clipping
        # weights, ``module.double()``) moves no version counter (probe 33b: unwarned, a model left with float64
        # weights and float32 buffers)
        self._watched_versions = _versions(self._watched)
        self._watched_addresses = _addresses(self._watched)
        self._watched_storages = list(map(_storage, self._watched))

    def _save(
        self, name: str, t: Tensor, pieces: dict[torch.device, list[Tensor]], sizes: dict[torch.device, int]
    ) -> None:
        """Records buffer (or renormalised weight) ``t``: its geometry and storage, and its span's bytes as a piece
        of its device's blob (``pieces``, ``sizes``: the pieces so far and their length), else a copy of its own."""
        saved = _Saved(name, t, version_of(t), None)
        saved.geometry = geometry(t)
        if saved.geometry is not None:
            saved.storage = t.untyped_storage()
            saved.nbytes = saved.storage.nbytes()
        self._saved.append(saved)
        span = _span(t)
        if span is None:
            return
        raw = _bytes(span)
        if raw is None:
            saved.copy = span.clone()
            return
        start = sizes.get(span.device, 0)
        saved.blob = (span.device, start, raw.numel())
        sizes[span.device] = start + raw.numel()
        pieces.setdefault(span.device, []).append(raw)

    def restore(self) -> list[str]:
        """Puts every object and changed value back.

        Returns:
            The names of parameters that the passes changed in place and that could not
            be restored (not copied); empty when the model is bitwise as it was.
        """
        modules, attributes = self._modules, self._containers[: len(self._modules)]
        if not (
            all(map(operator.is_, map(type, modules), self._classes))
            and all(map(operator.is_, map(_DICT_OF, modules), attributes))
            and _unchanged(self._containers, self._contents, self._dict_flags)
        ):  # (then in order: a module's class and dict, which bind the containers after them)
            for module, cls, held in zip(modules, self._classes, attributes):
                if type(module) is not cls:
                    module.__class__ = cls
                if module.__dict__ is not held:  # (a forward replacing its __dict__ whole)
                    object.__setattr__(module, "__dict__", held)
            for container, contents in zip(self._containers, self._contents):
                _restore_contents(container, contents)
        if any(self._empty):
            for container in self._empty:
                if container:
                    container.clear()
        lost = []
        addresses = _addresses(self._watched)
        if _versions(self._watched) != self._watched_versions or addresses != self._watched_addresses:
            lost = [  # (one comparison of each list at C speed when none changed, the common case)
                f"{prefix}.{key}" if prefix else key
                for prefix, key, t, version, address, now, storage in zip(
                    self._watched_prefixes,
                    self._watched_keys,
                    self._watched,
                    self._watched_versions,
                    self._watched_addresses,
                    addresses,
                    self._watched_storages,
                )  # a parameter: only its version and where its data are tell
                if (version is not None and version_of(t) != version)
                or (now != address and not _shared_since(t, storage))
            ]
        with torch.no_grad():
            for s in self._saved:  # first the shapes (a forward may resize a buffer in place), then the values
                if s.geometry is not None and geometry(s.tensor) != s.geometry and not _reshape(s):
                    lost.append(s.name)
            for s, span in self._changed_in_blobs():
                device, start, length = s.blob  # type: ignore[misc]
                # (a copy of the bytes: viewed as the dtype, a slice of the blob may start misaligned)
                self._write(s, span, self._blobs[device][start : start + length].clone().view(span.dtype))
            for s in self._saved:
                if s.blob is not None:
                    continue
                if s.copy is not None and (span := _span(s.tensor)) is not None:  # a dtype without a byte view
                    if not torch.equal(span, s.copy):
                        self._write(s, span, s.copy)
                elif s.version is not None and version_of(s.tensor) != s.version and s.tensor.numel():
                    lost.append(s.name)  # a copied tensor with no span (an empty one, its shape back, holds nothing)
        return lost

    def _changed_in_blobs(self) -> list[tuple[_Saved, Tensor]]:
        """The copied tensors whose bytes changed, with their spans: one comparison per device when none did,
        and then the changed bytes located at once (torch.ao's observers change ~400 of a QAT model's ~1,400
        buffers in every call: one comparison each took 30-80 ms). A tensor whose bytes no longer line up with
        its copy (its shape could not be put back) is left out."""
        now: dict[torch.device, list[tuple[_Saved, Tensor, Tensor]]] = {}
        odd: set[torch.device] = set()  # devices with such a tensor
        for s in self._saved:
            if s.blob is not None:
                span = _span(s.tensor)
                raw = _bytes(span) if span is not None else None
                if span is None or raw is None or raw.numel() != s.blob[2]:
                    odd.add(s.blob[0])
                else:
                    now.setdefault(s.blob[0], []).append((s, span, raw))
        out: list[tuple[_Saved, Tensor]] = []
        for device, held in now.items():
            blob = self._blobs[device]
            joined = torch.cat([raw for _, _, raw in held])
            copies = blob
            if device in odd:  # (a tensor left out: the others' copies, side by side)
                copies = torch.cat([blob[start : start + n] for _, start, n in (s.blob for s, _, _ in held)])  # type: ignore[misc]
            if torch.equal(joined, copies):
                continue
            starts = torch.tensor(
                list(itertools.accumulate((raw.numel() for *_, raw in held), initial=0))[:-1], device="cpu"
            )
            where = torch.searchsorted(starts.to(blob.device), joined.ne(copies).nonzero().flatten(), right=True)
            out += [held[i][:2] for i in where.sub_(1).unique().tolist()]
        return out

    @staticmethod
    def _write(s: _Saved, span: Tensor, values: Tensor) -> None:
        with torch.inference_mode() if s.version is None else contextlib.nullcontext():
            span.copy_(values)


def renormalised_weights(modules: Iterable[tuple[str, nn.Module]], parametrized: bool = True) -> set[int]:
    """``id()`` of the weights of a model's ``Embedding``/``EmbeddingBag`` layers with ``max_norm``, which their
    forward renormalises in place (``torch.embedding_renorm_``), whichever other module holds them too; with
    ``parametrized``, also every original of a parametrized one (``original``, ``original0``...), which the forward
    renormalises when the parametrization gives a view of it — never evaluating the parametrization."""
    out = set()
    for _, m in modules:
        if not (isinstance(m, RENORMALISED) and m.max_norm is not None):
            continue
        weight = m._parameters.get("weight")
        if isinstance(weight, Tensor):
            out.add(id(weight))
        elif parametrized:  # (the review of probe 42: a view's original was left renormalised, 13.7 off)
            plist = getattr(m, "parametrizations", None)
            if plist is not None and "weight" in plist:
                out.update(id(t) for t in plist["weight"]._parameters.values() if isinstance(t, Tensor))
    return out


def geometry(t: Tensor) -> tuple[Any, ...] | None:
    """``t``'s dtype, device, shape, strides, storage offset, storage (its address: ``resize_`` may move
    the memory of the same storage) and that storage's size (``untyped_storage().resize_(0)`` frees it under
    the same shape, as FSDP does: its values could no longer be read, probe 26) — ``None`` unless strided and
    in memory."""
    if t.layout != torch.strided or t.is_meta:
        return None
    storage = t.untyped_storage()
    return (t.dtype, t.device, tuple(t.shape), t.stride(), t.storage_offset(), storage._cdata, storage.nbytes())


def _reshape(s: _Saved) -> bool:
    """Puts back the geometry of a tensor that a forward resized in place or pointed at other memory (its
    values follow): on its own storage (kept by the snapshot) where that still holds it — ``resize_`` keeps
    the bytes it had, ``set_`` leaves them — else on fresh memory. Whether that worked."""
    dtype, device, shape, stride, offset, *_ = s.geometry  # type: ignore[misc]
    t, storage = s.tensor, s.storage
    extent = _extent_of(shape, stride)
    needed = (offset + extent) * dtype.itemsize
    try:
        with torch.inference_mode() if s.version is None else contextlib.nullcontext():
            if t.dtype != dtype or t.device != device:  # (.data = a tensor of another dtype or device)
                t.data = torch.empty(0, dtype=dtype, device=device)
            if storage.nbytes() != s.nbytes and s.nbytes >= needed:  # (grown or shrunk, freed: its size back, on
                with contextlib.suppress(RuntimeError):  # the same storage; the values come from the copy)
                    storage.resize_(s.nbytes)
            if storage.nbytes() < needed:  # (still too small — not resizable: fresh memory)
                storage = torch.empty(offset + extent, dtype=dtype, device=device).untyped_storage()
            t.set_(storage, offset, shape, stride)
    except RuntimeError:
        return False
    return geometry(t)[:5] == s.geometry[:5]  # type: ignore[index]


def _unchanged(containers: list[Any], contents: list[Any], dict_flags: list[bool]) -> bool:
    """Whether dicts, lists and sets still hold what their shallow copies do, in one pass at C speed: the same
    lengths, keys (or items) and dict values, in the same order, by identity (never ``==``: a tensor would
    answer with a tensor). A set whose copy iterates in another order reads as changed: it is put back."""
    chain, values = itertools.chain.from_iterable, operator.methodcaller("values")
    return (
        list(map(len, containers)) == list(map(len, contents))
        and all(map(operator.is_, chain(containers), chain(contents)))
        and all(
            map(
                operator.is_,
                chain(map(values, itertools.compress(containers, dict_flags))),
                chain(map(values, itertools.compress(contents, dict_flags))),
            )
        )
    )


_CONTAINERS = (dict, list, set, collections.deque)


class _IsContainer(dict):  # type: ignore[type-arg]
    """Whether a type is one of :data:`_CONTAINERS` (a subclass too), asked once per type and kept across calls: a
    snapshot looks at the type of every attribute of every module (7,000 on efficientnet_b0), of a few dozen types.
    Emptied when it grows large (classes made on the fly: torch's parametrize makes one per parametrized module)."""

    def __missing__(self, cls: type) -> bool:
        if len(self) >= 4096:
            self.clear()
        verdict = self[cls] = issubclass(cls, _CONTAINERS)
        return verdict


_IS_CONTAINER = _IsContainer()
_DICT_OF = operator.attrgetter("__dict__")


def _base_copy(container: Any) -> Any:
    """A shallow copy of a dict (as a dict) or of another container's items (as a list), in order."""
    return dict.copy(container) if isinstance(container, dict) else list(container)


def _restore_contents(container: Any, contents: Any) -> None:
    """Puts a dict, list or set back as ``contents`` (its shallow copy) was: the same items, bound to the same
    objects, in the same order (compared by identity, never by ``==``: a tensor key or item would answer with a
    tensor)."""
    if not _unchanged([container], [contents], [isinstance(container, dict)]):
        container.clear()
        (container.extend if isinstance(container, (list, collections.deque)) else container.update)(contents)


def refuse_uninitialized(modules: list[tuple[str, nn.Module]]) -> None:
    """Raises :class:`UninitializedLayerError` if any of a model's ``named_modules()`` still
    has lazy (uninitialised) parameters or buffers: the passes would materialise them."""
    lazy = [
        name or type(m).__name__
        for name, m in modules
        if (m._parameters or m._buffers)
        and any(isinstance(t, _UNINITIALIZED) for t in (*m._parameters.values(), *m._buffers.values()))
    ]
    if lazy:
        shown = ", ".join(map(repr, lazy[:5])) + (f" and {len(lazy) - 5} more" if len(lazy) > 5 else "")
        raise UninitializedLayerError(
            f"module {shown} is a lazy module that has not been initialised; a statistics pass would "
            "materialise it and so change the model. Run one forward pass first (e.g. model(example_batch)) "
            "so that its shapes are known, then recalibrate. Nothing was changed."
        )


def to_the_end(fn: Callable[..., Any], *args: Any) -> None:
    """Runs ``fn(*args)`` to its end even if Ctrl-C arrives meanwhile: a ``KeyboardInterrupt``
    raised inside it runs it again from the start (``fn`` must be idempotent: a restore), and
    is raised once it has completed. A restore cut short would leave the model half-modified."""
    interrupted: BaseException | None = None
    while True:
        try:
            fn(*args)
            break
        except KeyboardInterrupt as exc:
            interrupted = exc
    if interrupted is not None:
        raise interrupted


class _Owner:
    """Who holds a model (see :func:`exclusive`): one object per call, so that a call releases only what it holds."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __str__(self) -> str:
        return self.name


_busy: dict[int, _Owner] = {}
# re-entrant: a signal handler or a __del__ (a garbage collection) running precisebn on another model while this
# thread holds it would otherwise wait for itself forever (a probe: a hang)
_busy_lock = threading.RLock()


@contextlib.contextmanager
def exclusive(model: nn.Module, modules: list[tuple[str, nn.Module]] | None = None) -> Iterator[None]:
    """Marks every module of ``model`` (``modules``: its ``named_modules()``, if the caller has
    them) as in use for the duration of the block.

    Raises:
        ConcurrentUseError: Another pass (any thread, or a call from inside this
            model's own forward) is using the model or one of its modules.
    """
    ids = {id(m) for _, m in modules} if modules is not None else {id(m) for m in model.modules()}
    owner = _Owner(f"thread {threading.current_thread().name!r}")
    # whether this thread holds the lock already (a call from a signal handler or a __del__ run inside another call's
    # marking): then that call releases it, not this one
    nested = lock_held(_busy_lock)
    try:  # (marked in one operation, released by owner: Ctrl-C anywhere here leaves no module marked, a probe: a
        # Ctrl-C between the marks left thousands behind, and every later call on the model was refused)
        with _busy_lock:
            clash = ids & _busy.keys()
            if clash:
                holder = _busy[next(iter(clash))]
                raise ConcurrentUseError(
                    f"model {type(model).__name__} (or a module it shares) is already being recalibrated by another "
                    f"call ({holder}; this call: {owner}). A pass swaps the model's buffers for scratch tensors, so "
                    "two at once would corrupt it. Wait for the other call to return, or work on a copy "
                    "(copy.deepcopy(model)). Nothing was changed."
                )
            _busy.update(dict.fromkeys(ids, owner))
        yield
    finally:
        to_the_end(_release, ids, owner, nested)


def _release(ids: set[int], owner: _Owner, nested: bool = True) -> None:
    """Unmarks what ``owner`` marked of ``ids`` (idempotent: run to the end, see :func:`to_the_end`), and lets go of
    the lock unless the call is ``nested`` (see :func:`let_go`)."""
    with _busy_lock:
        for i in ids:
            if _busy.get(i) is owner:
                del _busy[i]
    let_go(_busy_lock, nested)


def lock_held(lock: Any) -> bool:
    """Whether this thread holds ``lock``, an ``RLock`` (``RLock._is_owned``, what ``threading.Condition`` asks)."""
    return bool(lock._is_owned())


def let_go(lock: Any, nested: bool) -> None:
    """Releases ``lock`` (an ``RLock``) as often as this thread holds it, unless the caller is ``nested`` (it held the
    lock when it began: an outer call of the same thread releases it). For the end of a call that took it in a
    ``with`` block: an interrupt raised as the block ended, before its ``__exit__``, leaves it held, and every later
    call from another thread waits for it forever (a review: a test hung)."""
    while not nested and lock._is_owned():
        lock.release()


@contextlib.contextmanager
def restore_on_error(tensors: list[Tensor]) -> Iterator[None]:
    """Copies ``tensors`` and puts their values back if the block raises (anything,
    ``KeyboardInterrupt`` included). One copy per device and dtype, not one per tensor."""
    by_kind: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.device, t.dtype), []).append(t)
    saved = [(group, torch.cat([t.detach().reshape(-1) for t in group])) for group in by_kind.values()]
    try:
        yield
    except BaseException:
        with torch.no_grad():
            for group, flat in saved:
                copy_all(group, [old.view(t.shape) for t, old in zip(group, flat.split([t.numel() for t in group]))])
        raise


def copy_all(targets: list[Tensor], values: list[Tensor]) -> None:
    """``target.copy_(value)`` for each pair, in one call where torch has one (inside
    ``torch.inference_mode()`` if a target is an inference tensor, e.g. of a model built in
    that mode: such a tensor can be written only there)."""
    inference = any(t.is_inference() for t in targets)
    with torch.inference_mode() if inference else contextlib.nullcontext():
        foreach = getattr(torch, "_foreach_copy_", None)
        if foreach is not None and targets:
            foreach(targets, values)
            return
        for target, value in zip(targets, values):
            target.copy_(value)
