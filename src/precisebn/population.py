"""Population statistics of a model's normalization layers, and their file format."""

from __future__ import annotations

import ctypes
import hashlib
import json
import math
import os
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from ._equality import equal_fields, hash_fields
from ._optional import require
from ._table import times
from ._version import __version__
from .errors import InvalidArgumentError, MissingFileError, PreciseBNError, PreciseBNWarning, StatsMismatchError
from .files import atomic_path
from .stats import RunningMoments

__all__ = ["FORMAT", "LayerStats", "PopulationStats", "buffer_key"]

FORMAT = "precisebn.population_stats/1"


@dataclass(frozen=True)
class LayerStats:
    """One layer's population statistics.

    Attributes:
        mean: Mean of every value the layer received, per channel (float64).
        var: Population (biased) variance of those values, per channel (float64).
        count: Values counted per channel (samples x positions x calls); 0 when the
            layer was never reached, and then ``mean``/``var`` are NaN.
        calls: Forward calls of the layer during the passes (all ranks).
        layer_type: The layer's class name.
        path: How it was measured: ``"fast"`` (the layer's own batch figures, verified
            against float64), ``"float64"`` (what it normalises, reduced in float64),
            ``"none"`` (never normalised with its running buffers: not reached) or ``"mixed"``
            (ranks, or merged files, that read it on different paths).
        se_mean: Standard error of ``mean`` per channel, in units of the standard
            deviation (jackknife over batches dealt into folds; NaN with fewer than two
            batches; ``None`` when unknown).
        se_var: Standard error of ``var`` per channel, relative to ``var``.
        per_forward: The most calls of the layer in one forward pass (batch); above 1
            the statistics pool all its calls (``estimate(..., per_call=True)`` gives
            one entry per call instead, ``"<layer>.calls.<i>"``, each with 1 here).
        samples: The samples of the data this layer was measured on, where that is not all of the
            statistics' ``samples``: a merge of statistics that selected different layers
            (:meth:`PopulationStats.merge`) measured a layer missing from some inputs on the others' samples
            only. ``None``: all of them. (What ``prior=`` converts to values per channel by.)
    """

    mean: Tensor
    var: Tensor
    count: int
    calls: int
    layer_type: str
    path: str = "fast"
    se_mean: Tensor | None = None
    se_var: Tensor | None = None
    per_forward: int = 1
    samples: int | None = None

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return equal_fields(self, other)

    def __hash__(self) -> int:
        return hash_fields(self)

    @property
    def reached(self) -> bool:
        """Whether the layer saw any value."""
        return self.count > 0

    @property
    def channels(self) -> int:
        return int(self.mean.shape[0])


def buffer_key(layer: str, buffer: str) -> str:
    """The state_dict name of ``layer``'s ``buffer`` (``layer`` ``""``: the model itself)."""
    return f"{layer}.{buffer}" if layer else buffer


@dataclass
class PopulationStats(Mapping[str, LayerStats]):
    """What :func:`precisebn.estimate` measured: a mapping from a layer's qualified
    name to its :class:`LayerStats`, with provenance.

    Attributes:
        layers: The statistics, keyed by qualified layer name.
        samples: Samples (batch items) used, summed over ranks.
        batches: Batches used, summed over ranks.
        mode: ``"norm"`` or ``"train"``.
        seconds: Wall time of the passes.
        world_size: Number of ranks merged.
        versions: ``{"precisebn": ..., "torch": ...}`` that produced them.
    """

    layers: dict[str, LayerStats]
    samples: int
    batches: int
    mode: str
    seconds: float = 0.0
    world_size: int = 1
    versions: dict[str, str] = field(default_factory=lambda: {"precisebn": __version__, "torch": torch.__version__})

    def __eq__(self, other: object) -> bool:
        """Equal statistics and provenance; the wall time (``seconds``) is not compared."""
        if type(other) is not type(self):
            return NotImplemented
        return equal_fields(self, other, but=("seconds",))

    __hash__ = None  # type: ignore[assignment]  (mutable)

    def __getitem__(self, name: str) -> LayerStats:
        return self.layers[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.layers)

    def __len__(self) -> int:
        return len(self.layers)

    def __repr__(self) -> str:
        return (
            f"PopulationStats({len(self.layers)} layers, samples={self.samples}, batches={self.batches}, "
            f"mode={self.mode!r}, world_size={self.world_size})"
        )

    def to(self, device: torch.device | str) -> PopulationStats:
        """A copy with every tensor on ``device`` (float64 still: a dtype is refused — probe 41 found
        ``to(torch.float16)`` rounding the statistics silently)."""
        if isinstance(device, torch.dtype):
            raise InvalidArgumentError(
                f"PopulationStats.to takes a device, got the dtype {device}; the statistics stay float64 (apply() "
                "converts them to each layer's dtype)."
            )
        moved = {
            k: LayerStats(
                v.mean.to(device),
                v.var.to(device),
                v.count,
                v.calls,
                v.layer_type,
                v.path,
                None if v.se_mean is None else v.se_mean.to(device),
                None if v.se_var is None else v.se_var.to(device),
                v.per_forward,
                v.samples,
            )
            for k, v in self.layers.items()
        }
        return PopulationStats(
            moved, self.samples, self.batches, self.mode, self.seconds, self.world_size, dict(self.versions)
        )

    def merge(self, *others: PopulationStats) -> PopulationStats:
        """The exact statistics of the union of the data behind ``self`` and ``others``.

        For statistics measured on **disjoint** data — shards measured by separate jobs,
        machines without a common process group, a nightly job adding data — the result
        is what :func:`precisebn.estimate` would have measured on all of it at once (the
        same batches): per layer, counts and calls add and the mean and population
        variance are pooled in float64 with the between-group term (Chan's merge: the
        pooled mean first, then ``Σ M2ᵢ + Σ nᵢ·(μᵢ − μ)²``), whatever the order of the
        inputs up to float64 rounding. A layer present (or reached) in only some inputs
        keeps what those measured; one missing from some (selected otherwise there) keeps the
        samples of those that hold it (:attr:`LayerStats.samples`, what ``prior=`` converts
        by). ``samples``, ``batches``, ``seconds`` and
        ``world_size`` (the processes whose statistics are merged) add. Merging data with
        itself counts it twice. Standard errors are not merged (``None``: measure the
        union at once for those). The inputs are not changed; the result is on the CPU.

        Raises:
            InvalidArgumentError: An input is not a ``PopulationStats``, or one object is given
                twice, or two equal ones that reached a layer (a copied file): its data would count twice.
            StatsMismatchError: A layer has different channel counts or layer types in
                two inputs, is pooled over its calls in one and per call in another, or the
                inputs were measured in different modes.

        Example:
            >>> import torch, precisebn
            >>> model = torch.nn.Sequential(torch.nn.BatchNorm1d(1, dtype=torch.float64))
            >>> a = precisebn.estimate(model, [torch.tensor([[1.0], [3.0]], dtype=torch.float64)])
            >>> b = precisebn.estimate(model, [torch.tensor([[5.0], [7.0], [9.0], [11.0]], dtype=torch.float64)])
            >>> both = a.merge(b)  # the union {1, 3, 5, 7, 9, 11}
            >>> both["0"].count, both["0"].mean.item(), both["0"].var.item(), both.samples, both.batches
            (6, 6.0, 11.666666666666666, 6, 2)
        """
        inputs = (self, *others)
        for i, other in enumerate(inputs):
            if not isinstance(other, PopulationStats):
                raise InvalidArgumentError(
                    f"PopulationStats.merge: input {i} is a {type(other).__name__}, not a PopulationStats "
                    "(from estimate() or PopulationStats.load())"
                )
        for i, other in enumerate(inputs):
            twice = next((j for j in range(i) if inputs[j] is other), None)
            if twice is not None:
                raise InvalidArgumentError(
                    f"PopulationStats.merge: inputs {twice} and {i} are the same statistics object; merging data "
                    "with itself counts it twice (the counts and samples double, the standard errors shrink). "
                    "Merge statistics of disjoint data, each once."
                )
        for i, other in enumerate(inputs):  # (equal values, not the same object: a copied file, probe 37 — unless
            # no layer was reached in it: shards whose batches all missed the layers selected are alike, and hold
            # no values that could count twice, only samples — which prior= converts by: a warning, probe 41)
            twice = next((j for j in range(i) if equal_fields(inputs[j], other, but=("seconds", "versions"))), None)
            if twice is not None and not any(layer.reached for layer in other.values()):
                warnings.warn(
                    f"PopulationStats.merge: inputs {twice} and {i} are alike and reached none of their layers "
                    "(parts whose batches all missed the layers selected); merged as parts of disjoint data. If one "
                    "is a copy of the other, its samples count twice, which weighs a prior= applied with the result.",
                    PreciseBNWarning,
                    stacklevel=2,
                )
            elif twice is not None:
                raise InvalidArgumentError(
                    f"PopulationStats.merge: inputs {twice} and {i} hold the same statistics (every layer's counts, "
                    "means and variances, and the samples and batches): the same measurement twice — a copied "
                    "file, a shard saved under two names — whose data would count twice. Merge statistics of "
                    "disjoint data, each once."
                )
        modes = sorted({s.mode for s in inputs})
        if len(modes) > 1:
            raise StatsMismatchError(
                f"PopulationStats.merge: the inputs were measured in different modes ({', '.join(modes)}); "
                "statistics of mode='norm' and mode='train' describe different activations. Measure every part "
                "with the same mode."
            )
        layers: dict[str, list[LayerStats]] = {}
        for stats in inputs:
            for name, layer in stats.items():
                layers.setdefault(name, []).append(layer)
        from .calls import call_indices  # (calls.py imports this module)

        calls_of: dict[str, dict[int, set[int]]] = {}  # per layer kept per call: per input, its call indices
        for k, stats in enumerate(inputs):
            for base, indices in call_indices(stats).items():
                calls_of.setdefault(base, {})[k] = indices
        for base in calls_of.keys() & layers.keys():  # an input that never reached it holds no data of it
            if all(part.count == 0 for part in layers[base]):
                del layers[base]
        for base, per_input in sorted(calls_of.items()):
            (first, calls), *rest = per_input.items()
            other = next(((k, c) for k, c in rest if c != calls), None)
            if other is not None:  # (a warning, not a refusal: the names alone cannot tell per-call statistics
                # from layers in a container named `calls`, whose inputs may hold different ones of them)
                here = f"'{base + '.' if base else ''}calls"
                warnings.warn(
                    f"PopulationStats.merge: {here}.<i>' are {times(len(calls))} in input {first} but "
                    f"{times(len(other[1]))} in input {other[0]}. If they are per-call statistics of layer "
                    f"{base or '(model)'!r} (statistics i are those of call i), the parts called it a different "
                    "number of times per forward, which estimate() refuses as one data set: the merged calls each "
                    "hold only the parts that made them. Estimate every part with the same calls per forward, or "
                    f"without per_call. (Layers in a container named {here}' are merged as usual.)",
                    PreciseBNWarning,
                    stacklevel=2,
                )
        both = sorted(calls_of.keys() & layers.keys())
        if both:
            name = both[0]
            raise StatsMismatchError(
                f"PopulationStats.merge: layer {name or '(model)'!r} is pooled over its calls (or was called once "
                f"per forward) in some inputs and kept per call ('{name + '.' if name else ''}calls.<i>') in others; "
                "the result would hold both, and fit no model. Estimate every part the same way (per_call=True for "
                "all, or for none), on data that calls the layer as often per forward."
            )
        merged = {name: _merge_layer(name, parts) for name, parts in layers.items()}
        total = sum(s.samples for s in inputs)
        for name in merged:  # (a layer missing from some inputs: measured on the others' samples only)
            held = sum(
                s.samples if s.layers[name].samples is None else s.layers[name].samples
                for s in inputs
                if name in s.layers
            )
            if held != total:
                merged[name] = replace(merged[name], samples=held)
        # what produced the inputs: per package, its version where they agree, else each of them (probe 37: this
        # version's stamp replaced theirs)
        keys = sorted({k for s in inputs for k in s.versions})
        versions = {k: " + ".join(dict.fromkeys(s.versions.get(k, "?") for s in inputs)) for k in keys}
        return PopulationStats(
            merged,
            total,
            sum(s.batches for s in inputs),
            self.mode,
            sum(s.seconds for s in inputs),
            sum(s.world_size for s in inputs),
            versions,
        )

    def _header(self) -> dict[str, object]:
        return {
            "samples": self.samples,
            "batches": self.batches,
            "mode": self.mode,
            "seconds": self.seconds,
            "world_size": self.world_size,
            "versions": self.versions,
            "layers": {
                k: {
                    "count": v.count,
                    "calls": v.calls,
                    "type": v.layer_type,
                    "path": v.path,
                    "per_forward": v.per_forward,
                    **({} if v.samples is None else {"samples": v.samples}),
                }
                for k, v in self.layers.items()
            },
        }

    def state_dict(self, prefix: str = "") -> dict[str, Tensor]:
        """The statistics as a model's state_dict entries: ``running_mean`` and ``running_var``.

        Only layers that were reached are included (the others have no statistics);
        tensors are float64 — ``load_state_dict`` and :func:`precisebn.apply` cast them
        to the buffers' dtype.

        Args:
            prefix: Put before every name (``"module."`` for a DDP-wrapped model's checkpoint).

        Example:
            >>> import torch, precisebn
            >>> model = torch.nn.Sequential(torch.nn.BatchNorm1d(2))
            >>> stats = precisebn.estimate(model, [torch.tensor([[0.0, 1.0], [2.0, 5.0]])])
            >>> {k: v.tolist() for k, v in stats.state_dict("module.").items()}
            {'module.0.running_mean': [1.0, 3.0], 'module.0.running_var': [1.0, 4.0]}
        """
        out = {}
        for name, s in self.layers.items():
            if s.reached:
                out[prefix + buffer_key(name, "running_mean")] = s.mean
                out[prefix + buffer_key(name, "running_var")] = s.var
        return out

    def save(self, path: str | os.PathLike[str], format: str | None = None) -> None:
        """Writes the statistics to a safetensors file, atomically (no pickle).

        Tensors are ``"<layer>.mean"`` and ``"<layer>.var"`` (float64); counts, calls,
        layer types and provenance are JSON in the file's metadata. An existing file
        keeps its permission bits; a symlink is written through to its target.

        Args:
            path: The file; its name must end in ``.safetensors`` unless ``format`` is given.
            format: ``"safetensors"`` (the only format) to write it under any name.

        Raises:
            InvalidArgumentError: Another extension (``.pt`` would suggest a
                ``torch.load``-able pickle, which this is not), or an unknown format.
        """
        if format not in (None, "safetensors"):
            raise InvalidArgumentError(f"PopulationStats.save(format={format!r}): the only format is 'safetensors'.")
        if os.fspath(path).endswith(("/", os.sep)) or os.path.isdir(path):  # (probe 37: "does not say safetensors")
            raise InvalidArgumentError(f"PopulationStats.save({os.fspath(path)!r}) names a folder; give a file path.")
        if format is None and not os.fspath(path).lower().endswith(".safetensors"):
            raise InvalidArgumentError(
                f"PopulationStats.save({os.fspath(path)!r}): statistics are written as safetensors, which that "
                "name does not say. Name the file *.safetensors, or pass format='safetensors' to keep the name."
            )
        st = require("safetensors.torch", "io", "PopulationStats.save()")
        tensors = {}
        for name, s in self.layers.items():
            tensors[f"{name}.mean"] = s.mean.detach().to("cpu", torch.float64).contiguous()
            tensors[f"{name}.var"] = s.var.detach().to("cpu", torch.float64).contiguous()
            for key in ("se_mean", "se_var"):
                value = getattr(s, key)
                if value is not None:
                    tensors[f"{name}.{key}"] = value.detach().to("cpu", torch.float64).contiguous()
        header = json.dumps(self._header())
        metadata = {"format": FORMAT, "precisebn": header, "sha256": _digest(header, tensors)}
        try:
            with atomic_path(path) as tmp:  # save() to bytes: save_file() would recreate tmp as 0600
                tmp.write_bytes(st.save(tensors, metadata=metadata))
        except PreciseBNError:  # (refused before anything was written: a NotWritableError is an OSError too)
            raise
        except OSError as exc:  # named by the file asked for (a full disk names no file, the temporary one is gone)
            raise OSError(exc.errno, exc.strerror or str(exc), os.fspath(path)) from exc

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> PopulationStats:
        """Reads statistics written by :meth:`save`.

        Raises:
            InvalidArgumentError: The file is not a precisebn statistics file.
            StatsMismatchError: A layer's mean and variance do not have one value
                per channel each (a damaged or hand-edited file).
        """
        require("safetensors.torch", "io", "PopulationStats.load()")
        from safetensors import safe_open

        if not os.path.exists(path):
            raise MissingFileError(f"statistics file {os.fspath(path)!r} does not exist; check the path.")
        if os.path.isdir(path):
            raise InvalidArgumentError(
                f"{os.fspath(path)!r} is a folder; pass a statistics file written by PopulationStats.save()."
            )
        try:
            with safe_open(str(path), framework="pt") as f:
                metadata = f.metadata() or {}
                found = metadata.get("format")
                if isinstance(found, str) and found.startswith(FORMAT.rpartition("/")[0] + "/") and found != FORMAT:
                    raise InvalidArgumentError(  # (probe 34b: "not precisebn statistics" for a newer version's file)
                        f"{os.fspath(path)!r} holds precisebn statistics in format {found!r}, which this version of "
                        f"precisebn ({__version__}) does not read (it reads {FORMAT!r}); load it with the version "
                        "that wrote it, or a newer one."
                    )
                if found != FORMAT:
                    raise InvalidArgumentError(
                        f"{os.fspath(path)!r} is a safetensors file but not precisebn statistics "
                        f"(format {metadata.get('format')!r}, expected {FORMAT!r}); write it with "
                        "PopulationStats.save()."
                    )
                keys = set(f.keys())
                if "sha256" in metadata and metadata["sha256"] != _digest(
                    metadata["precisebn"], {k: f.get_tensor(k) for k in keys}
                ):  # (files written before probe 37 have none)
                    raise StatsMismatchError(
                        f"{os.fspath(path)!r}: its contents do not match the checksum written with them (sha256 of "
                        "its statistics and their counts): the file is damaged (a flipped bit, a partial copy) or was "
                        "edited. Measure it again."
                    )
                header = json.loads(metadata["precisebn"])
                batches = _whole(header["batches"], "batches")
                layers = {
                    name: LayerStats(
                        f.get_tensor(f"{name}.mean"),
                        f.get_tensor(f"{name}.var"),
                        _whole(info["count"], f"layer {name!r}'s count"),
                        _whole(info["calls"], f"layer {name!r}'s calls"),
                        str(info["type"]),
                        _one_of(
                            info.get("path", "fast"), ("fast", "float64", "none", "mixed"), f"layer {name!r}'s path"
                        ),
                        f.get_tensor(f"{name}.se_mean") if f"{name}.se_mean" in keys else None,
                        f.get_tensor(f"{name}.se_var") if f"{name}.se_var" in keys else None,
                        _whole(info.get("per_forward", _per_forward(int(info["calls"]), batches)), "per_forward"),
                        None if info.get("samples") is None else _whole(info["samples"], f"layer {name!r}'s samples"),
                    )
                    for name, info in header["layers"].items()
                }
            for name, layer in layers.items():
                _check_layer(path, name, layer)
            seconds = float(header["seconds"])
            if not (math.isfinite(seconds) and seconds >= 0):
                raise ValueError(f"seconds is {seconds!r}")
            world_size = _whole(header["world_size"], "world_size")
            if world_size < 1:
                raise ValueError(f"world_size is {world_size}")
            versions = header["versions"]
            if not isinstance(versions, dict):
                raise ValueError(f"versions is a {type(versions).__name__}")
            return cls(
                layers,
                _whole(header["samples"], "samples"),
                batches,
                _one_of(header["mode"], ("norm", "train", "keep", "all"), "mode"),
                seconds,
                world_size,
                dict(versions),
            )
        except (InvalidArgumentError, StatsMismatchError):
            raise
        except Exception as exc:  # safetensors' own error type, bad JSON, missing keys or wrong values
            raise InvalidArgumentError(
                f"cannot read precisebn statistics from {os.fspath(path)!r}: {type(exc).__name__}: {exc}. "
                "Is it a file written by PopulationStats.save(), undamaged?"
            ) from exc


def _digest(header: str, tensors: Mapping[str, Tensor]) -> str:
    """The sha256 of a statistics file's header (its JSON, as written) and of every tensor in it (by name: its
    dtype, shape and bytes), written with them and checked when they are read (probe 37: of 200 single-bit flips in
    a file's statistics, 196 loaded, silently)."""
    h = hashlib.sha256(header.encode())
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        h.update(f"\0{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()) if t.numel() else b"")
    return h.hexdigest()


_LARGEST_COUNT = 2**63 - 1  # (a count is held as a float64 and an int64 too; no measurement comes near)


def _whole(value: Any, what: str) -> int:
    """``value`` if it is a whole number >= 0 (a JSON integer) below 2**63, else ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} is {value!r}, not a whole number >= 0")
    if value > _LARGEST_COUNT:
        raise ValueError(f"{what} has {len(str(value))} digits, more than any measurement can count (2**63 - 1)")
    return value


def _one_of(value: Any, allowed: tuple[str, ...], what: str) -> str:
    if value not in allowed:
        raise ValueError(f"{what} is {value!r}, not one of {', '.join(map(repr, allowed))}")
    return str(value)


def _merge_layer(name: str, parts: list[LayerStats]) -> LayerStats:
    """One layer's statistics pooled over the inputs that hold it (see :meth:`PopulationStats.merge`)."""
    channels = sorted({p.channels for p in parts})
    types = sorted({p.layer_type for p in parts})
    if len(channels) > 1 or len(types) > 1:
        what = f"{' vs '.join(map(str, channels))} channels" if len(channels) > 1 else f"types {' vs '.join(types)}"
        raise StatsMismatchError(
            f"PopulationStats.merge: layer {name!r} has {what} in different inputs; merge statistics of the same "
            "model (architecture) only. Nothing was merged."
        )
    reached = [p for p in parts if p.reached]
    if len(reached) <= 1:  # nothing to pool: the one that measured it (or the first), as it is
        only = (reached or parts)[0]
        return LayerStats(
            only.mean.detach().to("cpu", torch.float64),
            only.var.detach().to("cpu", torch.float64),
            only.count,
            sum(p.calls for p in parts),
            only.layer_type,
            only.path,
            per_forward=max(p.per_forward for p in parts),
        )
    counts = torch.tensor([float(p.count) for p in reached], dtype=torch.float64, device="cpu").unsqueeze(1)
    means = torch.stack([p.mean.detach().to("cpu", torch.float64) for p in reached])
    m2s = counts * torch.stack([p.var.detach().to("cpu", torch.float64) for p in reached])
    pooled = RunningMoments.from_batches(counts.expand_as(means), means, m2s)
    paths = {p.path for p in reached}
    return LayerStats(
        pooled.mean,
        pooled.var,
        sum(p.count for p in parts),
        sum(p.calls for p in parts),
        types[0],
        paths.pop() if len(paths) == 1 else "mixed",
        per_forward=max(p.per_forward for p in parts),
    )


def _per_forward(calls: int, batches: int) -> int:
    """Calls per forward of a layer in a file written before they were recorded."""
    return max(1, calls // max(batches, 1)) if calls else 0


def _check_layer(path: str | os.PathLike[str], name: str, layer: LayerStats) -> None:
    where = f"layer {name!r} of {os.fspath(path)!r}"
    if layer.mean.dim() != 1 or layer.var.dim() != 1:
        raise StatsMismatchError(
            f"{where}: mean and var must be vectors (one value per channel); got shapes "
            f"{tuple(layer.mean.shape)} and {tuple(layer.var.shape)}. The file is damaged; measure it again."
        )
    if layer.mean.shape != layer.var.shape:
        raise StatsMismatchError(
            f"{where}: {layer.mean.shape[0]} means but {layer.var.shape[0]} variances; each channel needs one "
            "of each. The file is damaged; measure it again."
        )
    problems = []
    for what, t in (("mean", layer.mean), ("var", layer.var), ("se_mean", layer.se_mean), ("se_var", layer.se_var)):
        if t is None:
            continue
        if not t.is_floating_point():
            problems.append(f"{what} is {str(t.dtype).removeprefix('torch.')}, not floating point")
        elif t.shape != layer.mean.shape:
            problems.append(f"{what} has shape {tuple(t.shape)}, not {tuple(layer.mean.shape)}")
        elif what.startswith("se_") and bool((t < 0).any()):
            problems.append(f"{what} has negative values")
    if not problems and layer.count > 0:  # measured: finite, variances >= 0 (unreached layers hold NaN)
        if not bool(layer.mean.isfinite().all()) or not bool(layer.var.isfinite().all()):
            problems.append("its statistics hold NaN/Inf")
        elif bool((layer.var < 0).any()):
            problems.append("it has negative variances")
    if problems:
        raise StatsMismatchError(f"{where}: {'; '.join(problems)}. The file is damaged; measure it again.")
