"""Writing statistics into a model's running buffers: every check first, then the writes.

``plan_writes(...).commit()`` is what :func:`~precisebn.apply` and :func:`~precisebn.recalibrate`
end with: :func:`plan_writes` matches each layer's statistics to the model (names, shapes, dtypes, the meta
device), pools them with a prior if asked (:mod:`~precisebn.adapt`), checks that they are
finite also after the cast to each buffer's dtype and that no two written buffers share
memory and builds the report; :meth:`Writes.commit` then writes — putting the old values back
if the writes are interrupted.
"""

from __future__ import annotations

import logging
import math
import zlib
from collections.abc import Mapping

import torch
from torch import nn

from ._table import times as _times
from .adapt import WRITTEN, Adapt, mean_error_in_kept_sd, with_prior
from .calls import PerCallBatchNorm, call_indices
from .errors import StatsMismatchError
from .layers import has_running_stats, refuse_freed, refuse_shared_buffers
from .population import LayerStats, PopulationStats
from .report import LayerReport, Report
from .state import copy_all, restore_on_error

logger = logging.getLogger("precisebn")

__all__ = ["Writes", "plan_writes"]

_BUFFERS = ("running_mean", "running_var")


class Writes:
    """What :func:`plan_writes` checked and will write: :meth:`commit` writes it (a distributed
    caller first makes sure that every rank got this far)."""

    def __init__(
        self, report: Report, targets: list[torch.Tensor], new: list[torch.Tensor], kept: list[tuple[str, int]]
    ) -> None:
        self.report, self._targets, self._new, self._kept = report, targets, new, kept

    def digest(self) -> int:
        """A checksum of every value to be written (on the host: after the passes), which every rank of a
        distributed recalibration must share."""
        if not self._new:
            return len(self._targets)
        raw = torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in self._new])
        return zlib.crc32(raw.cpu().numpy().tobytes()) ^ len(self._targets)  # (one copy to the host)

    def announce(self) -> None:
        """Logs what the writes will leave as it is (once): before :meth:`commit`, so that a logging handler that
        raises fails the call with nothing written (a probe: after the writes, the call raised with the model
        changed) — and, with several ranks, before they agree to write (probe 40: a filter raising on one rank
        left it unchanged and the others written)."""
        kept, self._kept = self._kept, []
        for name, calls in kept:
            logger.warning(
                "precisebn: layer %r %s; its statistics are kept",
                name,
                f"was called {_times(calls)} but never normalised with its running buffers (or only empty inputs)"
                if calls
                else "was not reached by any forward pass",
            )

    def commit(self) -> Report:
        """Writes every value at once (the old values put back if that is interrupted), after :meth:`announce`."""
        self.announce()
        with torch.no_grad(), restore_on_error(self._targets):
            copy_all(self._targets, self._new)
        return self.report


def _misfit(t: object, shape: tuple[int, ...]) -> str | None:
    """What is wrong with statistics ``t`` for buffers of ``shape``, if anything (probe 33b: an integer mean of the
    right shape was said to have "shape (4,)" for 4 channels; one on the meta device got torch's raw error)."""
    if not isinstance(t, torch.Tensor):
        return f"is a {type(t).__name__}, not a tensor"
    if tuple(t.shape) != shape:
        return f"has shape {tuple(t.shape)}"
    if not t.is_floating_point():
        return f"is of dtype {t.dtype}, not floating point"
    return "is on the meta device (it holds no values)" if t.is_meta else None


def _other_kind(m: nn.Module, type_name: str) -> bool:
    """Whether statistics measured on a layer of class ``type_name`` are of another kind than module ``m``'s: an
    InstanceNorm's (each sample normalised apart) against a BatchNorm's, or the reverse — told where the name is
    torch's own class, or says InstanceNorm; a class of another name (a subclass) is taken as ``m``'s own kind."""
    if type_name == type(m).__name__:
        return False
    known = getattr(nn, type_name, None)
    if isinstance(known, type) and issubclass(known, nn.Module):
        theirs = issubclass(known, nn.modules.instancenorm._InstanceNorm)
    elif "InstanceNorm" in type_name:
        theirs = True
    else:
        return False
    return theirs != isinstance(m, nn.modules.instancenorm._InstanceNorm)


def plan_writes(
    model: nn.Module,
    stats: PopulationStats,
    prior: float | None = None,
    adapt: Adapt = "both",
    modules: list[tuple[str, nn.Module]] | None = None,
    shared_checked: bool = False,
) -> Writes:
    """:func:`~precisebn.apply` on an unwrapped model that the caller holds, up to the writes: every
    check, the report; nothing written (:meth:`Writes.commit` writes, restoring the old values if
    that is interrupted). ``prior`` is checked (:func:`~precisebn.adapt.check_adapt`). ``modules``:
    the model's ``named_modules()``, if the caller has walked it already. ``shared_checked``: the
    caller has refused buffers that share memory already (``_estimate(writes=...)``; the passes put
    every buffer object back).

    Raises:
        StatsMismatchError: As :func:`~precisebn.apply`.
    """
    problems = []
    entries = []
    found = dict(modules or model.named_modules())  # a name the walk does not give (an alias) is looked up
    for name, s in stats.items():
        m = found[name] if name in found else _submodule(model, name)
        if m is None:
            problems.append(f"{name!r} is not in the model" + (_call_hint(name, found) or _prefix_hint(name, found)))
        elif not has_running_stats(m):
            problems.append(f"{name!r} ({type(m).__name__}) has no running statistics")
        elif _other_kind(m, s.layer_type):
            problems.append(
                f"{name!r} ({type(m).__name__}) was given statistics measured on a {s.layer_type}, a layer of the "
                "other kind (InstanceNorm and BatchNorm), which a model of this one's does not hold there: apply "
                "statistics measured on this model (merge refuses such a pair as well)"
            )
        elif (running_mean := m.running_mean).is_meta:
            problems.append(f"{name!r} is on the meta device (not materialised: nothing to write to)")
        else:
            shape = tuple(running_mean.shape)
            bad = [f"{what} {why}" for what, t in (("mean", s.mean), ("var", s.var)) if (why := _misfit(t, shape))]
            if bad:
                problems.append(f"{name!r} has {shape[0]} channels, but the statistics' {' and '.join(bad)}")
            else:
                entries.append((name, m, s))
    _refuse("the statistics do not fit this model", problems)
    refuse_freed(  # (their values are read next — by the prior first: freed memory crashed the process)
        [
            (f"layer {name!r} ({type(m).__name__})", k, t)
            for name, m, _ in entries
            for k in _BUFFERS
            if isinstance(t := m._buffers.get(k), torch.Tensor)
        ]
    )
    if prior is not None:  # the current statistics as `prior` samples of pseudo-data, pooled exactly
        entries, problems = with_prior(entries, prior, stats.samples, adapt)
        unknown = (
            "precisebn counts a batch's samples by the first dimension of its input tensor and could not tell it for "
            "these batches (a custom batch type?): give batches as tensors, or tuples, lists or dicts of tensors, or "
            "pass prior=None. Nothing was written."
        )
        # (the problems say what to do: the default hint, about statistics of another model, would mislead)
        _refuse(
            "the statistics cannot be pooled with the model's",
            problems,
            unknown if stats.samples <= 0 else "Nothing was written.",
        )
    write = tuple(name in WRITTEN[adapt] for name in _BUFFERS)  # running_mean, running_var
    buffers = [(m.running_mean, m.running_var) for _, m, _ in entries]  # read once: Module.__getattr__ is slow
    updated = [(pair, s) for pair, (_, _, s) in zip(buffers, entries) if s.reached]
    # every written mean, then every written variance (the variances' checks then read one stretch)
    written = [(s.mean, pair[0]) for pair, s in updated] if write[0] else []
    written += [(s.var, pair[1]) for pair, s in updated] if write[1] else []
    new = _converted(written)
    old = [pair[0] for pair in buffers] + [pair[1] for pair in buffers]
    host = _cpu64(old + new)
    values = {}
    n_means = len(updated) if write[0] else 0
    at_mean, at_var = len(old), len(old) + n_means
    for k, (name, _, s) in enumerate(entries):
        old_mean, old_var = host[k], host[len(entries) + k]
        mean, var = old_mean, old_var
        if s.reached:
            if write[0]:
                mean, at_mean = host[at_mean], at_mean + 1
            if write[1]:
                var, at_var = host[at_var], at_var + 1
        values[name] = (old_mean, old_var, mean, var)
    overflow: list[str] = []
    if new and not _all_fine(host[len(old) :], n_means, write[1]):  # checked at once; layer by layer to name them
        for name, m, s in entries:
            mean, var = values[name][2:]
            if s.reached and not all(bool(t.isfinite().all()) for t, w in zip((mean, var), write) if w):
                dtype = str(m.running_mean.dtype).removeprefix("torch.")
                sources = [t for t, w in zip((s.mean, s.var), write) if w]
                if all(bool(torch.as_tensor(t).isfinite().all()) for t in sources):
                    largest = max(float(torch.as_tensor(t).abs().max()) for t in sources)
                    overflow.append(
                        f"{name!r} has values up to {largest:.3g}, beyond {dtype}'s largest "
                        f"{torch.finfo(m.running_mean.dtype).max:.3g}"
                    )
                problems.append(f"{name!r} has NaN/Inf values (as {dtype})")
            elif s.reached and write[1] and bool((var < 0).any()):
                problems.append(f"{name!r} has a negative variance")
    unheld = [f"{p} (NaN/Inf values as written)" for p in overflow] if len(overflow) == len(problems) else []
    if not problems and write[1] and updated:  # (probe 45: a positive variance written as 0, inspect --strict failed)
        unheld = _underflowed(entries, values, host[len(old) + n_means :])
    if unheld:  # finite statistics that the buffers' dtype cannot hold
        _refuse(
            "the statistics cannot be written",
            unheld,
            "Keep those layers in a dtype that holds them (e.g. layer.float() for a float16 layer: its parameters "
            "and its input must then be float32 too; layer.double() for a float32 one), or rescale what they "
            "receive. Nothing was written.",
        )
    _refuse("the statistics cannot be written", problems)
    rows = [
        LayerReport(
            name,
            type(m).__name__,  # (the layer written: statistics measured on a SyncBatchNorm may go into a BatchNorm2d)
            int(rm.shape[0]),
            s.count,
            s.calls,
            *values[name],
            float(m.eps),
            s.reached,
            s.path,
            # (a buffer not written keeps its value: its error is unknown; a mean written beside the kept variance:
            # its error in the kept σ, as mean_shift is)
            (s.se_mean if write[1] else _kept_sd(s, values[name][3], m.eps)) if write[0] else None,
            s.se_var if write[1] else None,
            s.per_forward,
            # (the channels the data vary in, where new_var is not the measured variance: adapt="mean")
            None if write[1] or not s.reached else s.var.detach().to("cpu", torch.float64) > 0,
        )
        for (name, m, s), (rm, _) in zip(entries, buffers)
    ]
    report = Report(rows, stats.samples, stats.batches, stats.seconds, stats.mode, stats.world_size)
    targets = [buffer for _, buffer in written]
    if not shared_checked:
        refuse_shared_buffers(
            [
                (name, what, t)
                for (name, _, s), pair in zip(entries, buffers)
                if s.reached
                for what, t, w in zip(_BUFFERS, pair, write)
                if w
            ]
        )
    return Writes(report, targets, new, [(name, s.calls) for name, _, s in entries if not s.reached])


def _kept_sd(s: LayerStats, kept_var: torch.Tensor, eps: float) -> torch.Tensor | None:
    """``s.se_mean`` in units of ``sqrt(kept_var + eps)`` (:func:`~precisebn.adapt.mean_error_in_kept_sd`); as it is
    where the layer was not reached or has no error."""
    if not s.reached or s.se_mean is None:
        return s.se_mean
    return mean_error_in_kept_sd(s.se_mean, s.var, kept_var, float(eps))


def _submodule(model: nn.Module, name: str) -> nn.Module | None:
    """The module under qualified ``name`` (``""``: the model), or ``None``."""
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def _call_hint(name: str, modules: Mapping[str, nn.Module]) -> str:
    """What to do about statistics of one call (``estimate(..., per_call=True)``) named ``name`` that the model
    does not hold: untie the layer first, unless it is untied into fewer calls already (then untying refuses)."""
    found = call_indices([name])
    if not found:
        return ""
    (layer, (index,)), *_ = found.items()
    untied = modules.get(layer)
    if isinstance(untied, PerCallBatchNorm):
        return (
            f" (layer {layer!r} is untied into {len(untied.calls)} calls, and these per-call statistics hold call "
            f"{index}: untie the original model with them, or recalibrate this model itself, without per_call)"
        )
    return " (per-call statistics: call precisebn.untie_calls(model, stats) first)"


def _prefix_hint(name: str, modules: Mapping[str, nn.Module]) -> str:
    """What to do about statistics named ``name`` that the model holds under a shorter or a longer name: statistics
    of a wrapper (``AveragedModel``, an EMA shell: ``module.1``) given to the model it wraps, or the other way round
    (probe 41: the message named neither)."""
    rest = name
    while "." in rest:
        rest = rest.partition(".")[2]
        if rest in modules and has_running_stats(modules[rest]):
            return (
                f" (the model holds {rest!r}: these statistics name it under the prefix "
                f"{name[: len(name) - len(rest)]!r}: perhaps estimated on a wrapper of this model — an "
                "AveragedModel, an EMA shell; if so, apply them to that wrapper)"
            )
    longer = sorted((k for k in modules if k.endswith("." + name) and has_running_stats(modules[k])), key=len)
    if longer:
        return (
            f" (the model holds it as {longer[0]!r}: perhaps these statistics are of the module it holds under the "
            f"prefix {longer[0][: -len(name)]!r}, e.g. an AveragedModel's .module; if so, apply them to that module)"
        )
    return ""


def _refuse(what: str, problems: list[str], hint: str | None = None) -> None:
    if problems:
        raise StatsMismatchError(
            f"{what}: "
            + "; ".join(problems[:5])
            + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
            + ". "
            + (
                hint
                or "Apply statistics to the model (architecture) they were estimated on, each mean and variance of "
                "shape (channels,), finite, variances >= 0. Nothing was written."
            )
        )


def _cpu64(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """float64 CPU copies of many small tensors, with one device-to-host copy per device."""
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    out: list[torch.Tensor] = [torch.empty(0, device="cpu")] * len(tensors)
    with torch.no_grad():
        for ids in by_device.values():
            flat = torch.cat([_flat(tensors[i]) for i in ids]).to("cpu", torch.float64)  # cat promotes dtypes
            for i, part in zip(ids, flat.split([tensors[i].numel() for i in ids])):
                out[i] = part
    return out


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t if t.dim() == 1 else t.reshape(-1)


def _converted(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    """Each tensor converted to its buffer's device and dtype: one conversion per (device, dtype)."""
    by_kind: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, (_, buffer) in enumerate(pairs):
        by_kind.setdefault((buffer.device, buffer.dtype), []).append(i)
    out: list[torch.Tensor] = [torch.empty(0, device="cpu")] * len(pairs)
    with torch.no_grad():
        for (device, dtype), ids in by_kind.items():
            sources = [pairs[i][0] for i in ids]
            flat = torch.cat([_flat(t if t.device == device else t.to(device)) for t in sources]).to(dtype)
            for i, t, part in zip(ids, sources, flat.split([t.numel() for t in sources])):
                out[i] = part if t.dim() == 1 else part.view(t.shape)
    return out


UNDERFLOW_TOLERANCE = 0.01
"""The error, relative to ``var + eps`` (what the layer divides by the square root of), beyond which a positive
variance below its buffer dtype's smallest normal number (written as a subnormal, or as 0) is refused. A float16
subnormal is off by at most 3e-8, so a layer with torch's default eps (1e-5) is never refused: its near-dead
channels (variance 1e-9 written as 0: 0.01 % of var + eps) change nothing it computes. A float16 layer with eps
below ~3e-6 can be: eps 1e-9 and a variance of 1e-7, 40 % off."""


def underflow(exact: torch.Tensor, held: torch.Tensor, dtype: torch.dtype, eps: float) -> str | None:
    """What is lost when the positive variances ``exact`` (float64) are held as ``held`` (their values cast to
    ``dtype``, as float64), if anything: a variance below ``dtype``'s smallest normal number that became a
    subnormal or 0 more than :data:`UNDERFLOW_TOLERANCE` of ``exact + eps`` away — a silent wrong statistic for
    a layer of that ``eps`` (probe 45). A normal value is held to the dtype's precision, as everywhere.

    Example:
        >>> import torch
        >>> exact = torch.tensor([1e-9, 1e-7, 1.0], dtype=torch.float64)
        >>> held = exact.half().double()  # 0, a subnormal 40 % off, 1
        >>> underflow(exact, held, torch.float16, eps=1e-5) is None  # 0.01 % and 0.4 % of var + eps
        True
        >>> print(underflow(exact, held, torch.float16, eps=1e-9))  # doctest: +NORMALIZE_WHITESPACE
        has variances down to 1e-09, below float16's smallest normal 6.1e-05: 2 of 3 channels would be
        written as 0 (1) or off by more than 1% of var + eps (eps 1e-09)
    """
    tiny = torch.finfo(dtype).tiny
    low = (exact > 0) & (exact < tiny)
    lost = low & ((held - exact).abs() > UNDERFLOW_TOLERANCE * (exact + eps))
    if not bool(lost.any()):
        return None
    n, zeros = int(lost.sum()), int((lost & (held == 0)).sum())
    off = f"off by more than {UNDERFLOW_TOLERANCE:.0%} of var + eps (eps {eps:.3g})"
    how = f"as 0 ({zeros}) or {off}" if 0 < zeros < n else f"as 0 (eps {eps:.3g})" if zeros else off
    return (
        f"has variances down to {float(exact[exact > 0].min()):.3g}, below {str(dtype).removeprefix('torch.')}'s "
        f"smallest normal {tiny:.3g}: {n} of {exact.numel()} channels would be written {how}"
    )


def _underflowed(
    entries: list[tuple[str, nn.Module, LayerStats]],
    values: dict[str, tuple[torch.Tensor, ...]],
    written: list[torch.Tensor],
) -> list[str]:
    """:func:`underflow` for each reached layer of :func:`plan_writes`: ``written``, the written variances as the
    buffers hold them (host float64), are checked layer by layer only when one of them is below its dtype's
    smallest normal (the common case costs one minimum)."""
    dtypes = {m.running_var.dtype for _, m, s in entries if s.reached}
    if not written or float(torch.cat(written).amin()) >= max(torch.finfo(d).tiny for d in dtypes):
        return []
    found = (
        (name, underflow(s.var.detach().to("cpu", torch.float64), values[name][3], m.running_var.dtype, float(m.eps)))
        for name, m, s in entries
        if s.reached
    )
    return [f"{name!r} {lost}" for name, lost in found if lost]


def _all_fine(new: list[torch.Tensor], means: int, variances: bool) -> bool:
    """Whether the new values (host float64, in the order of :func:`plan_writes`' ``new``: ``means``
    means, then the variances if ``variances``) are all finite and the variances non-negative (a
    sum and a minimum: reductions are far cheaper than element-wise tests; a sum that overflows
    only sends the caller to its exact check)."""
    if not math.isfinite(float(torch.cat(new).sum())):
        return False
    return not variances or float(torch.cat(new[means:]).amin()) >= 0
