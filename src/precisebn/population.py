"""Population statistics of a model's normalization layers, and their file format."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ._optional import require
from ._version import __version__
from .errors import InvalidArgumentError
from .files import atomic_path

__all__ = ["FORMAT", "LayerStats", "PopulationStats"]

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
    """

    mean: Tensor
    var: Tensor
    count: int
    calls: int
    layer_type: str

    @property
    def reached(self) -> bool:
        """Whether the layer saw any value."""
        return self.count > 0

    @property
    def channels(self) -> int:
        return int(self.mean.shape[0])


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
        """A copy with every tensor on ``device``."""
        moved = {
            k: LayerStats(v.mean.to(device), v.var.to(device), v.count, v.calls, v.layer_type)
            for k, v in self.layers.items()
        }
        return PopulationStats(
            moved, self.samples, self.batches, self.mode, self.seconds, self.world_size, dict(self.versions)
        )

    def _header(self) -> dict[str, object]:
        return {
            "samples": self.samples,
            "batches": self.batches,
            "mode": self.mode,
            "seconds": self.seconds,
            "world_size": self.world_size,
            "versions": self.versions,
            "layers": {k: {"count": v.count, "calls": v.calls, "type": v.layer_type} for k, v in self.layers.items()},
        }

    def save(self, path: str | os.PathLike[str]) -> None:
        """Writes the statistics to a safetensors file, atomically (no pickle).

        Tensors are ``"<layer>.mean"`` and ``"<layer>.var"`` (float64); counts, calls,
        layer types and provenance are JSON in the file's metadata.
        """
        st = require("safetensors.torch", "io", "PopulationStats.save()")
        tensors = {}
        for name, s in self.layers.items():
            tensors[f"{name}.mean"] = s.mean.detach().to("cpu", torch.float64).contiguous()
            tensors[f"{name}.var"] = s.var.detach().to("cpu", torch.float64).contiguous()
        metadata = {"format": FORMAT, "precisebn": json.dumps(self._header())}
        with atomic_path(path) as tmp:  # save() to bytes: save_file() would recreate tmp as 0600
            tmp.write_bytes(st.save(tensors, metadata=metadata))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> PopulationStats:
        """Reads statistics written by :meth:`save`.

        Raises:
            InvalidArgumentError: The file is not a precisebn statistics file.
        """
        require("safetensors.torch", "io", "PopulationStats.load()")
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                metadata = f.metadata() or {}
                if metadata.get("format") != FORMAT:
                    raise InvalidArgumentError(
                        f"{os.fspath(path)!r} is a safetensors file but not precisebn statistics "
                        f"(format {metadata.get('format')!r}, expected {FORMAT!r}); write it with "
                        "PopulationStats.save()."
                    )
                header = json.loads(metadata["precisebn"])
                layers = {
                    name: LayerStats(
                        f.get_tensor(f"{name}.mean"),
                        f.get_tensor(f"{name}.var"),
                        int(info["count"]),
                        int(info["calls"]),
                        str(info["type"]),
                    )
                    for name, info in header["layers"].items()
                }
        except (InvalidArgumentError, FileNotFoundError):
            raise
        except Exception as exc:  # safetensors' own error type, bad JSON, missing keys
            raise InvalidArgumentError(
                f"cannot read precisebn statistics from {os.fspath(path)!r}: {exc}. "
                "Is it a file written by PopulationStats.save()?"
            ) from exc
        return cls(
            layers,
            int(header["samples"]),
            int(header["batches"]),
            str(header["mode"]),
            float(header["seconds"]),
            int(header["world_size"]),
            dict(header["versions"]),
        )
