"""Reading and writing model checkpoints (``.pt``/``.pth`` and ``.safetensors``) for the CLI.

A checkpoint is a state_dict (names → tensors), saved by ``torch.save`` — alone or
under a ``"state_dict"``/``"model"`` key of a larger dict (epoch, optimizer...) — or
by ``safetensors``. :func:`load_checkpoint` reads it with ``weights_only=True``
unless told to trust the file; :func:`save_checkpoint` writes a copy with some
tensors replaced, in the same format and layout, atomically.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import os
import re
import warnings
import zipfile
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn

from ._optional import require
from .adapt import WRITTEN
from .errors import InvalidArgumentError, PreciseBNWarning, StatsMismatchError, caller_stacklevel
from .files import Terminated, atomic_path
from .population import buffer_key
from .state import geometry

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "CheckpointMismatchError",
    "best_prefix",
    "buffer_names",
    "checkpoint_format",
    "load_checkpoint",
    "load_into",
    "save_checkpoint",
    "stats_replacement",
    "verify_written",
    "write_checkpoint",
]

Format = Literal["torch", "safetensors"]
_CONTAINER_KEYS = ("state_dict", "model")
_EXTRA = "_extra_state"  # torch's suffix for a module's get_extra_state() in its state_dict


class CheckpointError(InvalidArgumentError):
    """A checkpoint file that cannot be read, or does not hold a state_dict."""


class CheckpointMismatchError(StatsMismatchError):
    """A checkpoint whose names or shapes do not fit the model."""


@dataclass
class Checkpoint:
    """A loaded checkpoint.

    Attributes:
        path: The file.
        format: ``"torch"`` or ``"safetensors"``.
        state_dict: The tensors, by name, as stored.
        container: The enclosing dict when the state_dict sat under ``key``.
        key: ``"state_dict"``, ``"model"`` or the key asked for, or ``None``.
        metadata: The safetensors header metadata (kept on save).
        others: The enclosing dict's other keys that hold a state_dict (e.g. timm's
            ``"state_dict_ema"``): left as they are.
        versions: The state_dict's ``_metadata`` (module versions, which
            ``load_state_dict`` reads), kept on save.
        legacy: A torch file in the format before zip archives (``torch.save(...,
            _use_new_zipfile_serialization=False)``): written back in it.
    """

    path: Path
    format: Format
    state_dict: dict[str, Tensor]
    container: dict[str, Any] | None = None
    key: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    others: list[str] = field(default_factory=list)
    versions: Any = None
    legacy: bool = False


def checkpoint_format(path: str | os.PathLike[str]) -> Format:
    """``"safetensors"`` for a ``.safetensors`` file, ``"torch"`` otherwise.

    Example:
        >>> checkpoint_format("model.safetensors"), checkpoint_format("model.pth")
        ('safetensors', 'torch')
    """
    return "safetensors" if Path(path).suffix.lower() == ".safetensors" else "torch"


def load_checkpoint(path: str | os.PathLike[str], *, trust: bool = False, key: str | None = None) -> Checkpoint:
    """Reads a state_dict from a ``torch.save`` or safetensors file.

    Args:
        path: The file.
        trust: Unpickle arbitrary Python objects (``weights_only=False``). Only for
            files from a trusted source: unpickling can run code.
        key: The key of the state_dict in the file's dict (e.g. ``"state_dict_ema"``);
            default: the file itself, else its ``"state_dict"`` or ``"model"``.

    Raises:
        CheckpointError: The file is missing, unreadable, or holds no state_dict.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist; check the path.")
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} is not a file; pass a .pt/.pth/.safetensors file.")
    if checkpoint_format(path) == "safetensors":
        if key is not None:
            raise CheckpointError(
                f"checkpoint {str(path)!r} is a safetensors file, a flat state_dict: it has no {key!r}."
            )
        return _load_safetensors(path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's FutureWarnings about weights_only
            obj = torch.load(path, map_location="cpu", weights_only=not trust)
    except Exception as exc:  # zip/pickle errors of every kind: UnpicklingError, EOFError, RuntimeError...
        raise _unreadable(path, exc, trust) from None
    sd, container, key = _find_state_dict(obj, path, key)
    others = [k for k, v in (container or {}).items() if k != key and isinstance(k, str) and _is_state_dict(v)]
    versions = getattr(obj if container is None else container[key], "_metadata", None)  # type: ignore[index]
    legacy = not zipfile.is_zipfile(path)
    return Checkpoint(path, "torch", sd, container, key, others=others, versions=versions, legacy=legacy)


def _first_sentence(text: str, limit: int = 300) -> str:
    """The first sentence of ``text`` (whole, or shortened at a word with an ellipsis)."""
    text = " ".join(text.split())
    end = re.search(r"[.!?](\s|$)", text)
    sentence = text[: end.start() + 1] if end else text
    if len(sentence) > limit:
        sentence = sentence[:limit].rsplit(" ", 1)[0] + " …"
    return sentence.rstrip(".")


def _looks_like_safetensors(path: Path) -> bool:
    """A safetensors file: an 8-byte little-endian header length, then a JSON header."""
    try:
        with open(path, "rb") as f:
            head = f.read(9)
            size = int.from_bytes(head[:8], "little")
        return len(head) == 9 and head[8:9] == b"{" and 0 < size <= path.stat().st_size - 8
    except OSError:
        return False


def _unreadable(path: Path, exc: BaseException, trust: bool) -> CheckpointError:
    text = str(exc)
    if _looks_like_safetensors(path):
        return CheckpointError(
            f"checkpoint {str(path)!r} is a safetensors file with a PyTorch file's name; rename it to "
            f"{path.stem}.safetensors (precisebn reads a file by its extension)."
        )
    if "Weights only load failed" in text and not trust:
        found = re.search(r"(?:GLOBAL|global:? GLOBAL) ([\w.]+)", text)
        if found:
            return CheckpointError(
                f"checkpoint {str(path)!r} references the Python object {found.group(1)}, which the safe "
                "(weights_only) load refuses; nothing in the file was run. Save model.state_dict() with "
                "torch.save instead, or, only if you trust the file's source, pass --trust-checkpoint "
                "(unpickling can run arbitrary code)."
            )
        detail = re.search(r"WeightsUnpickler error:\s*(.+?)\s*(?:\n|$)", text.strip())
        why = f" ({_first_sentence(detail.group(1))})" if detail else ""
        return CheckpointError(
            f"checkpoint {str(path)!r} cannot be read by the safe (weights_only) loader{why}: it is not a "
            "torch.save file of tensors (corrupt, or a plain pickle holding Python objects). Re-save it with "
            "torch.save(model.state_dict(), path), or, only if you trust its source, pass --trust-checkpoint "
            "(unpickling can run arbitrary code)."
        )
    first = _first_sentence(text) or type(exc).__name__
    return CheckpointError(
        f"cannot read checkpoint {str(path)!r} as a PyTorch file ({type(exc).__name__}: {first}). "
        "Is it complete, and written by torch.save or safetensors?"
    )


def _load_safetensors(path: Path) -> Checkpoint:
    require("safetensors", "io", "reading .safetensors checkpoints")
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = dict(f.metadata() or {})
            sd = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    except Exception as exc:  # safetensors' own SafetensorError
        raise CheckpointError(
            f"cannot read checkpoint {str(path)!r} as safetensors ({exc}). Is the file complete? A PyTorch "
            "pickle needs a .pt/.pth name."
        ) from None
    if not sd:
        raise CheckpointError(f"checkpoint {str(path)!r} holds no tensors.")
    return Checkpoint(path, "safetensors", sd, metadata=metadata)


def _is_state_dict(obj: Any) -> bool:
    """Names → tensors (and, under names ending in ``_extra_state``, whatever a module's
    ``get_extra_state`` returns: carried over as it is)."""
    return (
        isinstance(obj, Mapping)
        and any(isinstance(v, Tensor) for v in obj.values())
        and all(isinstance(k, str) and (isinstance(v, Tensor) or k.endswith(_EXTRA)) for k, v in obj.items())
    )


def _find_state_dict(
    obj: Any, path: Path, key: str | None = None
) -> tuple[dict[str, Tensor], dict[str, Any] | None, str | None]:
    if key is not None:
        if isinstance(obj, Mapping) and _is_state_dict(obj.get(key)):
            return dict(obj[key]), dict(obj), key
        found = [k for k, v in obj.items() if _is_state_dict(v)] if isinstance(obj, Mapping) else []
        raise CheckpointError(
            f"checkpoint {str(path)!r} has no state_dict under {key!r}"
            + (
                f"; its state_dicts are under {', '.join(map(repr, found))}. Pass one of those with --key, or none "
                "for the file's main state_dict."
                if found
                else " (it holds no state_dict under any key: it is one itself, or holds none). Drop --key."
            )
        )
    if _is_state_dict(obj):
        return dict(obj), None, None
    if isinstance(obj, Mapping):
        for key in _CONTAINER_KEYS:
            if _is_state_dict(obj.get(key)):
                return dict(obj[key]), dict(obj), key
    if isinstance(obj, nn.Module):
        what = f"a whole pickled model ({type(obj).__name__})"
    elif isinstance(obj, Mapping):
        keys = ", ".join(repr(k) for k in list(obj)[:8]) + (", ..." if len(obj) > 8 else "")
        what = f"a dict without a state_dict (keys: {keys or 'none'})"
    else:
        what = f"a {type(obj).__name__}"
    raise CheckpointError(
        f"checkpoint {str(path)!r} holds {what}; precisebn needs a state_dict (names → tensors), alone or "
        f"under a {' or '.join(map(repr, _CONTAINER_KEYS))} key. Save it with torch.save(model.state_dict(), path)."
    )


def _replaced(ckpt: Checkpoint, replace: Mapping[str, Tensor]) -> dict[str, Tensor]:
    unknown = [k for k in replace if k not in ckpt.state_dict]
    if unknown:
        raise InvalidArgumentError(f"cannot replace tensors missing from the checkpoint: {unknown[:5]}")
    sd = dict(ckpt.state_dict)
    shared: dict[tuple[Any, ...], Tensor] = {}  # (one new tensor for names that held one view and get one value:
    # a layer under two names stays one storage, as in the input — probe 41 found two, the file larger)
    for k, v in replace.items():
        view = geometry(sd[k]) if isinstance(sd[k], Tensor) else None
        key = (geometry(v) or id(v), view)  # (the same value: one tensor, or views of one: detach() of one buffer)
        if view is not None and key in shared:
            sd[k] = shared[key]
            continue
        value = v.detach().to("cpu")
        sd[k] = value.to(sd[k].dtype).clone()
        if view is not None:
            shared[key] = sd[k]
        if sd[k].is_floating_point() and not bool(sd[k].isfinite().all()) and bool(value.isfinite().all()):
            largest = float(value.abs().max())
            raise InvalidArgumentError(
                f"{k!r}: the new values reach {largest:.3g}, beyond the largest {sd[k].dtype} the checkpoint stores "
                f"it in ({torch.finfo(sd[k].dtype).max:.3g}); writing them would store inf. Convert the checkpoint "
                "to float32 first (e.g. {k: v.float() for k, v in state_dict.items()}), or rescale the layer's "
                "input. Nothing was written."
            )
    return sd


def write_checkpoint(ckpt: Checkpoint, replace: Mapping[str, Tensor], path: str | os.PathLike[str]) -> None:
    """Writes ``ckpt`` with the tensors in ``replace`` swapped in to ``path`` directly.

    Same format and layout as the input (the enclosing dict and safetensors metadata
    are kept); replaced tensors take the dtype of the ones they replace. Use
    :func:`save_checkpoint`, or a :class:`~precisebn.files.OutputPlan`'s staged
    path, for an atomic write.
    """
    sd = _replaced(ckpt, replace)
    if ckpt.versions is not None:  # the state_dict's module versions, as torch.save wrote them
        sd = collections.OrderedDict(sd)
        sd._metadata = ckpt.versions  # type: ignore[attr-defined]
    if ckpt.format == "safetensors":
        st = require("safetensors.torch", "io", "writing .safetensors checkpoints")
        # save() to bytes, not save_file(): the latter recreates the file with mode 0600
        Path(path).write_bytes(st.save({k: v.contiguous() for k, v in sd.items()}, metadata=ckpt.metadata or None))
    else:
        obj: Any = sd if ckpt.container is None else {**ckpt.container, ckpt.key: sd}
        try:
            # (through a file object: a path names the archive's folder after the file, here a temporary one,
            # and the same command would not give the same bytes)
            with open(path, "wb") as f:
                torch.save(obj, f, _use_new_zipfile_serialization=not ckpt.legacy)  # (the input's format)
        except RuntimeError as exc:  # torch's zip writer reports a failed write as "enforce fail ... unexpected pos"
            signalled = _interruption(exc)  # Ctrl-C (or SIGTERM, see files) in the file's write(), which torch's
            if signalled is not None:  # writer turned into its error (probes 34b, 37: "a full disk", exit 1)
                raise signalled from None
            why = f"torch.save failed ({_first_sentence(str(exc)).strip()}): a full disk, or a file size limit"
            raise OSError(errno.EIO, why, str(path)) from exc
        except OSError as exc:  # (the last write, at the file's close: no file name, a probe's full disk)
            if exc.filename is not None:
                raise
            raise OSError(exc.errno, exc.strerror, str(path)) from exc


def _interruption(exc: BaseException) -> BaseException | None:
    """The signal's exception that ``exc`` was raised while handling (its context, at any depth), if any: a
    ``KeyboardInterrupt``, or the exception precisebn's SIGTERM handler raises while files are staged."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, (KeyboardInterrupt, Terminated)):
            return exc
        seen.add(id(exc))
        exc = exc.__context__  # type: ignore[assignment]
    return None


def save_checkpoint(ckpt: Checkpoint, replace: Mapping[str, Tensor], path: str | os.PathLike[str]) -> None:
    """Writes ``ckpt`` with the tensors in ``replace`` swapped in, atomically.

    As :func:`write_checkpoint`; if anything fails, ``path`` is left as it was.
    """
    _replaced(ckpt, replace)  # refuse unknown names before creating anything
    with atomic_path(path) as tmp:
        write_checkpoint(ckpt, replace, tmp)


def verify_written(
    ckpt: Checkpoint, replace: Mapping[str, Tensor], path: str | os.PathLike[str], *, trust: bool = False
) -> None:
    """Reloads the checkpoint written to ``path`` and checks every replaced tensor.

    Raises:
        CheckpointError: A replaced tensor (an alias, say) does not hold its new value.
    """
    if ckpt.format == "torch":
        written = load_checkpoint(Path(path), trust=trust, key=ckpt.key).state_dict
    else:
        written = require("safetensors.torch", "io", "reading .safetensors checkpoints").load_file(str(path))
    expected = _replaced(ckpt, replace)
    wrong = [k for k in replace if k not in written or not _bitwise_equal(written[k], expected[k])]
    if wrong:
        raise CheckpointError(
            f"the checkpoint written for {str(ckpt.path)!r} does not hold the new values of {len(wrong)} tensor(s) "
            f"({', '.join(wrong[:4])}); nothing was written. Please report this with --debug's output."
        )


def _bitwise_equal(a: Tensor, b: Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def buffer_names(model: nn.Module, modules: list[str], buffers: tuple[str, ...], prefix: str = "") -> dict[str, str]:
    """Every state_dict name of the ``buffers`` of the named ``modules``, aliases included.

    A module registered under two parents has two names in ``model.state_dict()``;
    both are returned. Maps checkpoint name (``prefix`` + state_dict name) to the
    buffer's name in ``model.state_dict()``.
    """
    wanted = {id(m) for n, m in model.named_modules() if n in set(modules)}
    out = {}
    for name, module in model.named_modules(remove_duplicate=False):
        if id(module) in wanted:
            for buffer in buffers:
                if getattr(module, buffer, None) is not None:
                    key = f"{name}.{buffer}" if name else buffer
                    out[prefix + key] = key
    return out


def stats_replacement(
    ckpt: Checkpoint, stats: Mapping[str, Any], *, prior: float | None = None, adapt: str = "both"
) -> tuple[dict[str, Tensor], str]:
    """The checkpoint tensors that a statistics file replaces, checked by name and shape.

    Args:
        ckpt: The checkpoint.
        stats: A :class:`~precisebn.PopulationStats`.
        prior, adapt: As for :func:`precisebn.apply`, with the checkpoint's statistics as
            the prior (checked: :func:`~precisebn.adapt.check_adapt`).

    Returns:
        ``{checkpoint name: tensor}`` for every reached layer's ``running_mean`` and
        ``running_var`` (only the one ``adapt`` names), and the prefix found on the
        checkpoint's names (``module.``...).

    Raises:
        CheckpointMismatchError: A layer is missing from the checkpoint, or its channels differ.
        StatsMismatchError: With ``prior``, a layer's statistics in the checkpoint are
            NaN/Inf or negative (or the file records no samples).
    """
    wanted = stats.state_dict()  # type: ignore[attr-defined]
    if not wanted:
        raise CheckpointMismatchError("the statistics file has no layer that was reached; nothing to apply.")
    prefix = best_prefix(list(ckpt.state_dict), set(wanted))
    missing = [prefix + k for k in wanted if prefix + k not in ckpt.state_dict]
    shapes = [
        f"{prefix + k}: checkpoint {tuple(ckpt.state_dict[prefix + k].shape)}, statistics {tuple(v.shape)}"
        for k, v in wanted.items()
        if prefix + k in ckpt.state_dict and tuple(ckpt.state_dict[prefix + k].shape) != tuple(v.shape)
    ]
    if missing or shapes:
        parts = []
        for label, items in (("missing from the checkpoint", missing), ("shape mismatch", shapes)):
            if items:
                more = f" and {len(items) - 4} more" if len(items) > 4 else ""
                parts.append(f"{len(items)} {label} ({'; '.join(items[:4])}{more})")
        raise CheckpointMismatchError(
            f"the statistics do not fit checkpoint {str(ckpt.path)!r}: {', '.join(parts)}. Apply statistics "
            "measured on the model this checkpoint belongs to."
        )
    if prior:
        wanted = _pooled_with_checkpoint(ckpt, stats, prefix, prior, adapt).state_dict()
    if adapt != "both":
        wanted = {k: v for k, v in wanted.items() if k.rpartition(".")[2] in WRITTEN[adapt]}
    named = {prefix + name for name in stats}  # (every layer the file names, reached or not: a layer of its own)
    return _with_aliases(ckpt.state_dict, {prefix + k: v for k, v in wanted.items()}, named), prefix


def _with_aliases(sd: Mapping[str, Any], replace: dict[str, Tensor], named: Collection[str] = ()) -> dict[str, Tensor]:
    """``replace`` with the same values under every other name of ``sd`` that holds the very tensor a replaced
    name holds: a layer registered under two names (a shared layer, ``self.head = nn.Sequential(self.bn2)``) is
    saved once, and loads as two views of one storage — given new values under one name only, loading the
    written checkpoint read the other's old ones last (probe 37: ``apply`` exited 0, and the model kept them)."""
    by_view: dict[tuple[Any, ...], list[str]] = {}  # (the same geometry: the same storage, offset, shape, strides)
    for name, t in sd.items():
        if isinstance(t, Tensor) and (key := geometry(t)) is not None:
            by_view.setdefault(key, []).append(name)
    out = dict(replace)
    for name in replace:
        t = sd.get(name)
        key = geometry(t) if isinstance(t, Tensor) else None
        kind = name.rpartition(".")[2]  # (only a buffer of the same kind: a weight saved as a view of the same
        # memory as a running_var, which a saver storing equal values once may write, got the new variance, probe 41)
        for other in by_view.get(key, []) if key is not None else []:
            if other.rpartition(".")[2] == kind:
                out.setdefault(other, replace[name])
    _with_copies(sd, out, named)
    return out


_STATS = (".running_mean", ".running_var")


def _statistics_of(sd: Mapping[str, Any], layer: str) -> tuple[Any, ...] | None:
    """A layer's saved running statistics, by value (dtype, shape, bytes): ``None`` unless it has both."""
    found = [sd.get(layer + suffix) for suffix in _STATS]
    if not all(isinstance(t, Tensor) and not t.is_meta for t in found):
        return None
    return tuple(
        (t.dtype, tuple(t.shape), t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        for t in found
    )


def _with_copies(sd: Mapping[str, Any], out: dict[str, Tensor], named: Collection[str] = ()) -> None:
    """Adds to ``out`` (names of ``sd`` -> new values) the same values under every other layer of ``sd`` that holds
    bitwise the very statistics a replaced layer held and is not replaced itself: a layer registered under two names
    (a shared layer) saved as copies — ``safetensors.save_file({k: v.clone()})``, a state_dict converted to another
    dtype — loads the name written last, so given new values under one name only, the model kept the old ones (a
    probe: ``apply`` exited 0). Statistics still at their initial values (mean 0, variance 1), which distinct layers
    share, are not taken as a copy: such a layer is left as it is, with a warning.

    A layer the statistics name (``named``: reached or not) is a layer of its own, never a copy: a tower deep-copied
    from another, never reached, got the other's new statistics (probe 41, "left as they are" said the report). A
    layer they do not name may still be a separate one (statistics estimated on some layers only): each copy written
    is named in a warning."""
    replaced = {name[: -len(suffix)] for name in out for suffix in _STATS if name.endswith(suffix)}
    by_value: dict[tuple[Any, ...], list[str]] = {}
    for name in sd:
        if name.endswith(_STATS[0]) and (layer := name[: -len(_STATS[0])]) not in replaced and layer not in named:
            value = _statistics_of(sd, layer)
            if value is not None:
                by_value.setdefault(value, []).append(layer)
    doubtful, written = [], []
    for layer in sorted(replaced):
        value = _statistics_of(sd, layer)
        copies = by_value.get(value, []) if value is not None else []
        if not copies:
            continue
        mean, var = (sd[layer + suffix] for suffix in _STATS)
        if bool((mean == 0).all()) and bool((var == 1).all()):
            doubtful += [f"{other!r} (like {layer!r})" for other in copies]
            continue
        for other in copies:
            written.append(f"{other!r} (as {layer!r})")
            for suffix in _STATS:
                if layer + suffix in out:
                    out.setdefault(other + suffix, out[layer + suffix])
    if written:
        warnings.warn(
            f"{', '.join(written[:5])}{' and more' if len(written) > 5 else ''}: not in the statistics, and holding "
            "bitwise the statistics of the layer written, so taken as the same layer saved under another name (a "
            "shared layer saved as copies) and written too. If one is a separate layer (a deep copy: a second "
            "tower, a teacher), its old statistics were replaced: apply statistics that name it (estimated on the "
            "whole model).",
            PreciseBNWarning,
            stacklevel=caller_stacklevel(),
        )
    if doubtful:
        warnings.warn(
            f"{', '.join(doubtful)}: not in the statistics, and holding the initial statistics (mean 0, variance 1) "
            "as the layer written does — the same layer saved under two names, or another layer never trained; "
            "left as it is. If it is the same layer, write its name's statistics too (estimate on a model that "
            "names it, or recalibrate the checkpoint).",
            stacklevel=caller_stacklevel(),
        )


def _pooled_with_checkpoint(ckpt: Checkpoint, stats: Any, prefix: str, prior: float, adapt: str = "both") -> Any:
    """``stats`` with each reached layer's statistics pooled with the checkpoint's own, as ``prior``
    samples (:func:`~precisebn.adapt.with_prior`, given the checkpoint's tensors for the layer's buffers)."""
    from types import SimpleNamespace

    from .adapt import with_prior

    sd = ckpt.state_dict
    both = WRITTEN["both"]
    entries = [  # the layer as with_prior reads it: its two buffers (unreached layers are passed through)
        (name, SimpleNamespace(**{b: sd[prefix + buffer_key(name, b)] for b in both}) if s.reached else None, s)
        for name, s in stats.items()
    ]
    pooled, problems = with_prior(entries, prior, stats.samples, adapt)
    if problems:
        more = f"; and {len(problems) - 5} more" if len(problems) > 5 else ""
        raise StatsMismatchError(
            f"the statistics cannot be pooled with checkpoint {str(ckpt.path)!r}'s: {'; '.join(problems[:5])}{more}. "
            "Nothing was written."
        )
    return dataclasses.replace(stats, layers={name: s for name, _, s in pooled})


def load_into(model: nn.Module, ckpt: Checkpoint) -> str:
    """Loads the checkpoint's tensors into ``model``, strictly.

    A prefix that wraps every name (``module.`` from DistributedDataParallel,
    ``model.`` from a Lightning module, ``_orig_mod.`` from ``torch.compile``) is
    recognised and stripped.

    Returns:
        The prefix stripped (``""`` for none); checkpoint name = prefix + model name.

    Raises:
        CheckpointMismatchError: Missing or unexpected names, or shapes that differ.
    """
    expected = model.state_dict()
    prefix = best_prefix(list(ckpt.state_dict), set(expected))
    stripped = {k[len(prefix) :]: v for k, v in ckpt.state_dict.items() if k.startswith(prefix)}
    # (torch's own load accepts a BatchNorm without num_batches_tracked, as written before torch 0.4.1)
    missing = [k for k in expected if k not in stripped and not k.endswith("num_batches_tracked")]
    unexpected = [prefix + k for k in stripped if k not in expected] + [
        k for k in ckpt.state_dict if not k.startswith(prefix)
    ]
    shapes = [
        f"{k}: checkpoint {tuple(stripped[k].shape)}, model {tuple(v.shape)}"
        for k, v in expected.items()
        if k in stripped
        and isinstance(v, Tensor)  # (not a module's extra state)
        and isinstance(stripped[k], Tensor)
        and not isinstance(v, nn.parameter.UninitializedTensorMixin)  # (lazy: the load gives it its shape)
        and tuple(stripped[k].shape) != tuple(v.shape)
    ]
    if missing or unexpected or shapes:
        parts = []
        for label, items in (("missing", missing), ("unexpected", unexpected), ("shape mismatch", shapes)):
            if items:
                more = f" and {len(items) - 4} more" if len(items) > 4 else ""
                parts.append(f"{len(items)} {label} ({'; '.join(items[:4])}{more})")
        hint = " (a different num_classes? pass it with --model-kwargs)" if shapes else ""
        raise CheckpointMismatchError(
            f"checkpoint {str(ckpt.path)!r} does not fit the model {type(model).__name__}: {', '.join(parts)}. "
            f"Pass the --model (and --model-kwargs) the checkpoint was trained with{hint}."
        )
    model.load_state_dict(stripped, strict=True)
    return prefix


def best_prefix(names: list[str], expected: set[str]) -> str:
    """The dotted prefix (``""``, ``module.``, ``model.``...) whose removal from the checkpoint's names
    matches the most names in ``expected``. Among prefixes that match as many: the one that every name of the
    checkpoint carries (a wrapper's: ``module.``, Lightning's ``model.`` — then ``model.bn`` is the model's
    ``bn`` even if the model has a ``model.bn`` of its own), else none (the names as they are) — statistics of a
    few layers also match the ends of other layers' names (``bn1`` and ``layer1.0.bn1``).

    Raises:
        CheckpointMismatchError: Two prefixes match as many and neither rule picks one (the file holds two
            copies of the model, e.g. ``model.`` and ``ema_model.``): which one is meant cannot be told.
    """
    hits: dict[str, int] = {}
    for name in names:
        at = -1
        while True:
            if name[at + 1 :] in expected:
                prefix = name[: at + 1]
                hits[prefix] = hits.get(prefix, 0) + 1
            at = name.find(".", at + 1)
            if at < 0:
                break
    if not hits:
        return ""
    ranked = sorted(hits.items(), key=lambda item: (-item[1], len(item[0])))
    if len(ranked) > 1 and ranked[1][1] == ranked[0][1]:
        tied = [prefix for prefix, n in ranked if n == ranked[0][1]]
        wrapping = [prefix for prefix in tied if prefix and all(name.startswith(prefix) for name in names)]
        if len(wrapping) == 1:  # (a wrapper's: its names then also end in the model's, e.g. model.model.bn)
            return wrapping[0]
        if not wrapping and "" in tied:
            return ""
        shown = ", ".join(repr(p) if p else "'' (no prefix)" for p in tied[:4])
        raise CheckpointMismatchError(
            f"the checkpoint holds the model's names under several prefixes ({shown}, {ranked[0][1]} names each): "
            "it holds more than one copy of the model (e.g. its weights and an EMA of them), and which one is meant "
            "cannot be told. Save the one you mean as its own state_dict (or under its own key, for --key)."
        )
    return ranked[0][0]
