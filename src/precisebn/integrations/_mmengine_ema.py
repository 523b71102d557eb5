"""The statistics of mmengine's EMA weights, for :mod:`precisebn.integrations.mmengine`.

mmengine's ``EMAHook`` keeps an averaged copy of the model (its EMA module, ``ema_model.module``),
swaps its parameters into the model for every validation and test (``before_val_epoch``/
``before_test_epoch``, and back in ``after_*_epoch``), and saves it as the checkpoint's ``state_dict``
(the model going under ``ema_state_dict``). With ``update_buffers=False``, its default, it swaps
the parameters alone: the EMA weights run with the model's statistics.
:class:`EmaStatistics` is what ``ExactPreciseBNHook`` does about it:

* ``ema="own"``: a second :class:`~precisebn.integrations._trigger.Trigger`, bound to the EMA
  module, computes the EMA weights' exact statistics in one transaction with the model's
  (:meth:`EmaStatistics.compute`);
* for validation and tests the hook swaps the EMA module's statistics into the model beside
  ``EMAHook``'s parameters, and back afterwards — also when the loop raises, which mmengine
  tells no hook of (:meth:`EmaStatistics.guard`);
* a checkpoint gets each set of statistics under its weights (:meth:`EmaStatistics.fill_checkpoint`);
* ``ema="copy"``, or several ``EMAHook``: the model's statistics are copied into each EMA
  module (:func:`share_with_ema`).
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from .._optional import require
from ..checkpoint import buffer_names
from ..errors import PreciseBNWarning
from ..interrupts import signals_held
from ..layers import has_running_stats
from ..report import Report
from ._trigger import Trigger

_hooks = require("mmengine.hooks", "mmengine", "precisebn.integrations.mmengine")
_wrappers = require("mmengine.model", "mmengine", "precisebn.integrations.mmengine")
_loops = require("mmengine.runner", "mmengine", "precisebn.integrations.mmengine")

__all__ = ["EmaStatistics", "new_statistics", "refresh", "share_with_ema"]

Pairs = list[tuple[Tensor, Tensor]]
_STATISTICS = ("running_mean", "running_var")
_SCHEDULER_STATE = ("_last_step", "_stale", "_last_report", "_weights", "_statistics", "_computations")


class EmaStatistics:
    """The EMA side of one ``ExactPreciseBNHook``: its trigger, the ``EMAHook`` it follows, the swap.

    Args:
        owner: The hook's class name, for messages.
        options: The hook's :class:`~precisebn.integrations._trigger.Trigger` options.
        ema: ``"own"`` or ``"copy"`` (see ``ExactPreciseBNHook``).
    """

    def __init__(self, owner: str, options: dict[str, Any], ema: str) -> None:
        self.owner = owner
        self.own = ema == "own"
        self.trigger = Trigger(f"{owner} (EMA weights)", **options)
        self.hook: Any = None  # the EMAHook whose module the trigger is bound to (ema="own", one EMAHook)
        self._armed: Pairs | None = None  # (model, EMA module) statistics to swap in the next *_epoch
        self._swapped: Pairs | None = None  # swapped now, until the loop's epoch ends (or it raises)
        self._guarded: weakref.WeakSet[Any] = weakref.WeakSet()  # loops whose run() swaps back on failure
        self._warned_several = False

    # -- binding ----------------------------------------------------------------------

    def bind(self, runner: Any, model: nn.Module, batches: Any, forward: Any, progress: bool) -> None:
        """With ``ema="own"`` and one ``EMAHook`` following ``model`` (built in its ``before_run``, before this):
        binds the trigger to its EMA module, frozen layers read off ``model`` (the one trained)."""
        self.unbind()
        if not self.own:
            return
        hooks = ema_hooks(runner, model)
        if len(hooks) > 1:
            if not self._warned_several:
                self._warned_several = True
                warnings.warn(
                    f"{self.owner}: {len(hooks)} EMAHooks follow the model; ema='own' computes the statistics of "
                    "one EMA module only, so none is computed: each EMA module gets the model's statistics "
                    "(ema='copy'). Use one EMAHook.",
                    PreciseBNWarning,
                    stacklevel=2,
                )
            return
        if hooks:
            scheduler = self.trigger.bind(hooks[0].ema_model.module, batches, forward=forward, progress=progress)
            scheduler.trains(model)
            self.hook = hooks[0]

    def unbind(self) -> None:
        self.trigger.unbind()
        self.hook = None

    def source(self) -> Any:
        """The ``EMAHook`` whose EMA weights get statistics of their own (``ema="own"``), or ``None``: none,
        several, or one that has not begun averaging — before ``begin_iter``/``begin_epoch`` it copies the whole
        model into its module after each iteration, so the model's statistics are those of its weights."""
        hook, scheduler = self.hook, self.trigger.scheduler
        if hook is None or scheduler is None:
            return None
        ema = getattr(hook, "ema_model", None)
        if getattr(ema, "module", None) is not scheduler.model:
            return None
        steps = getattr(ema, "steps", None)
        if isinstance(steps, Tensor) and int(steps) == 0:
            return None
        return hook

    def current(self, step: int) -> tuple[Any, Report] | None:
        """The ``EMAHook`` and the report of the EMA weights' statistics, if its module holds them for ``step``."""
        hook, report = self.source(), self.trigger.last_report
        if hook is None or report is None or not self.trigger.is_current(step):
            return None
        return hook, report

    def stale(self, step: int) -> bool:
        """Whether the EMA weights get statistics of their own that are not those of ``step``."""
        return self.source() is not None and not self.trigger.is_current(step)

    # -- swapping ---------------------------------------------------------------------

    def arm(self, model: nn.Module, step: int) -> None:
        """During training (``before_val``): the next ``*_epoch`` swaps the EMA module's statistics into
        ``model``, where they are those of its weights at ``step`` and ``EMAHook`` swaps the parameters alone
        (``update_buffers=False``); nothing otherwise."""
        self._armed = None
        own = self.current(step)
        if own is not None and not getattr(own[0].ema_model, "update_buffers", False):
            hook, report = own
            self._armed = _pairs(model, new_statistics(hook.ema_model.module, report))

    def arm_held(self, runner: Any) -> None:
        """Outside training (``runner.val()``, ``runner.test()``): the next ``*_epoch`` swaps whatever statistics
        the EMA module holds into the model, beside ``EMAHook``'s parameters (``update_buffers=False``,
        ``ema="own"``, one ``EMAHook``). The EMA module holds the statistics loaded with its weights (a resumed
        ``ema_state_dict``) or a copy of the model (``EMAHook.before_run``), whose swap changes nothing."""
        self._armed = None
        if not self.own:
            return
        model = runner.model.module if _wrappers.is_model_wrapper(runner.model) else runner.model
        hooks = ema_hooks(runner, model)
        if len(hooks) == 1 and not getattr(hooks[0].ema_model, "update_buffers", False):
            self._armed = _pairs(model, _named_statistics(hooks[0].ema_model.module))

    def swap_in(self) -> None:
        """``before_val_epoch``/``before_test_epoch``: swaps the armed statistics in (``EMAHook`` swaps its
        parameters there too: the two swaps touch different tensors, and either order gives the same)."""
        pairs, self._armed = self._armed, None
        if pairs:
            with signals_held():  # (one hold: a Ctrl-C held during the swap, raised as its own hold ended, left
                _swap(pairs)  # before the swap was recorded, and the loop's guard found nothing to swap back)
                self._swapped = pairs

    def reset(self) -> None:
        """Swaps the statistics back (:meth:`swap_back`) and forgets any armed."""
        self._armed = None
        self.swap_back()

    def swap_back(self) -> None:
        """Swaps the statistics back, bitwise, if they are swapped in."""
        pairs = self._swapped
        if pairs:
            with signals_held():
                _swap(pairs)
                self._swapped = None

    def guard(self, runner: Any) -> None:
        """Makes the validation and test loops built for this run swap the statistics back when they raise.

        mmengine calls no hook when a loop raises (no ``after_val_epoch``, no ``after_run``), and ``EMAHook``
        leaves its parameters swapped; the model's own statistics are put back here, bitwise, as the error
        leaves the loop's ``run()`` (wrapped on the loop object, once per hook and loop). Only loops built
        already (``runner.train()`` builds its validation loop, ``val()`` and ``test()`` theirs, before
        ``before_run``): ``runner.val_loop`` and ``runner.test_loop`` are properties that build a loop from its
        configuration, and training built the test loop it never runs (its dataset, its evaluator: one that
        cannot be built made training fail, the review of stop 44)."""
        for loop in (getattr(runner, "_val_loop", None), getattr(runner, "_test_loop", None)):
            if not isinstance(loop, _loops.BaseLoop) or loop in self._guarded:
                continue
            self._guarded.add(loop)
            loop.run = _swapping_back_on_failure(loop.run, self.reset)

    # -- computing --------------------------------------------------------------------

    def compute(self, trigger: Trigger, step: int, *, warn: bool) -> tuple[Report | None, Report | None]:
        """The model's computation (``trigger``), then the EMA module's; if either fails (the data, the model, a
        ``KeyboardInterrupt``), both are left bitwise as they were and the error propagates."""
        scheduler = trigger.scheduler
        if scheduler is None:
            return None, None
        kept = [(b, b.clone()) for _, b in _named_statistics(scheduler.model, unique=True)]
        state = {k: scheduler.__dict__[k] for k in _SCHEDULER_STATE if k in scheduler.__dict__}
        last = trigger._last_report
        try:
            report = trigger.compute(step, warn=warn)
            return report, self.trigger.compute(step, warn=False)  # (recalibrate: the EMA module unchanged)
        except BaseException:
            with torch.no_grad(), signals_held():
                for buffer, value in kept:
                    buffer.copy_(value)
                scheduler.__dict__.update(state)
                trigger._last_report = last
            raise

    def fill_checkpoint(self, checkpoint: dict[str, Any], model: nn.Module, report: Report | None, step: int) -> None:
        """Puts the statistics computed for ``step`` into the checkpoint's state dicts, where they hold copies
        (CPU copies of a model on a GPU), under every name of a layer (one registered under two parents has
        two): ``report``'s (the model's) and, with ``ema="own"``, the EMA weights'."""
        state = checkpoint.get("state_dict")
        if not isinstance(state, dict):
            return
        own, ema_state = self.current(step), checkpoint.get("ema_state_dict")
        if own is not None and isinstance(ema_state, dict):
            # EMAHook ran first (a priority above the hook's): it swapped the state_dicts, so that state_dict holds
            # the EMA module's tensors and ema_state_dict's "module.*" the model's. Each gets its own statistics.
            if report is not None:
                refresh(ema_state, new_statistics(model, report), prefix="module.")
            hook, ema_report = own
            refresh(state, new_statistics(hook.ema_model.module, ema_report))
        elif report is not None:
            # Otherwise EMAHook (if any) comes next: it takes the EMA module's buffers, which hold the EMA
            # weights' statistics (ema="own") or the model's (copied), and swaps them with these.
            refresh(state, new_statistics(model, report))


def _swapping_back_on_failure(run: Callable[..., Any], reset: Callable[[], None]) -> Callable[..., Any]:
    @functools.wraps(run)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        try:
            return run(*args, **kwargs)
        except BaseException:
            reset()
            raise

    return guarded


def _named_statistics(model: nn.Module, *, unique: bool = False) -> list[tuple[str, Tensor]]:
    """``(state_dict key, buffer)`` of the running statistics of every normalization layer of ``model`` (each
    tensor once with ``unique``)."""
    found, seen = [], set()
    for name, module in model.named_modules(remove_duplicate=unique):
        if not has_running_stats(module):
            continue
        for buffer in _STATISTICS:
            value = getattr(module, buffer, None)
            if isinstance(value, Tensor) and not (unique and id(value) in seen):
                seen.add(id(value))
                found.append((f"{name}.{buffer}" if name else buffer, value))
    return found


def _pairs(model: nn.Module, ema: list[tuple[str, Tensor | None]]) -> Pairs | None:
    """``(model's buffer, EMA module's)`` under each of the EMA module's keys ``ema`` that ``model`` has alike."""
    pairs, seen = [], set()
    for key, value in ema:
        owner, _, buffer = key.rpartition(".")
        try:
            target = getattr(model.get_submodule(owner), buffer, None)
        except AttributeError:
            continue
        if (
            isinstance(value, Tensor)
            and isinstance(target, Tensor)
            and target.shape == value.shape
            and target.dtype == value.dtype
            and id(target) not in seen  # (a layer under two names: swapped once)
        ):
            seen.add(id(target))
            pairs.append((target, value))
    return pairs or None


def _swap(pairs: Pairs) -> None:
    """Exchanges the values of each pair of tensors, bitwise, all or none (signals held)."""
    with torch.no_grad(), signals_held():
        for a, b in pairs:
            kept = a.clone()
            a.copy_(b)
            b.copy_(kept)


def refresh(state: dict[str, Any], new: list[tuple[str, Tensor | None]], prefix: str = "") -> None:
    """Puts the ``new`` statistics into a checkpoint's ``state`` under ``prefix + key`` where it holds other
    tensors (CPU copies of a model on a GPU)."""
    for key, value in new:
        name = prefix + key
        if name in state and value is not None and state[name] is not value:
            state[name] = value.detach().cpu()


def ema_hooks(runner: Any, model: nn.Module) -> list[Any]:
    """The ``EMAHook``s of ``runner`` that follow ``model`` (``src_model``), with an EMA module."""
    return [
        hook
        for hook in getattr(runner, "hooks", ())
        if isinstance(hook, _hooks.EMAHook)
        and getattr(hook, "src_model", None) is model
        and isinstance(getattr(getattr(hook, "ema_model", None), "module", None), nn.Module)
    ]


def share_with_ema(runner: Any, model: nn.Module, report: Report) -> None:
    """Copies the new statistics into the EMA module of every ``EMAHook`` that follows ``model``'s buffers.

    ``EMAHook`` (with ``update_buffers=False``, its default) averages the parameters only and copies the model's
    buffers into its EMA module after each training iteration; validation runs the EMA parameters with the model's
    buffers, and a checkpoint's ``state_dict`` is filled from the EMA module. Statistics computed after the last
    iteration — at an epoch's end, before validation or a save — reached that ``state_dict`` as they were before
    (probe 41: 0.91 off the statistics validation ran with); this copies them as the next iteration would. An EMA
    module that averages its buffers too (``update_buffers=True``) keeps its own once averaging has begun (before
    ``begin_iter``/``begin_epoch`` ``EMAHook`` copies the whole model, buffers too: so does this). The copies are
    made with signals held (see :mod:`precisebn.interrupts`): all of them or none."""
    new: list[tuple[str, Tensor | None]] | None = None
    for hook in ema_hooks(runner, model):
        ema = hook.ema_model
        if getattr(ema, "update_buffers", True):
            # (begun: update_parameters ran — not EMAHook's clock, which in before_val already answers for the
            # next epoch or iteration, a review found: 1.6 σ off in the mean at the first validation)
            steps = getattr(ema, "steps", None)
            if not isinstance(steps, Tensor) or int(steps) > 0:
                continue
        new = new_statistics(model, report) if new is None else new
        with torch.no_grad(), signals_held():
            for target, value in _pairs(ema.module, new) or ():
                target.copy_(value)


def new_statistics(model: nn.Module, report: Report) -> list[tuple[str, Tensor | None]]:
    """The running statistics ``report`` wrote, under every name of their layer (one registered under two
    parents has two): ``(state_dict key, the buffer now)``."""
    found = []
    for key in buffer_names(model, report.updated, _STATISTICS):
        owner, _, buffer = key.rpartition(".")
        found.append((key, getattr(model.get_submodule(owner), buffer, None)))
    return found
