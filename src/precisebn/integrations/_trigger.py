"""The trigger every training-loop integration shares (imports no framework).

:class:`Trigger` is what the Lightning callbacks, the mmengine hook, the Hugging Face
``TrainerCallback`` and the Ignite handler all run when their framework reaches a
moment that needs exact statistics (before validation, before a checkpoint, at an
interval). It owns a :class:`~precisebn.PreciseBNScheduler`, so that:

* the statistics are computed **at most once per step** — a validation and a
  checkpoint at the same step share one computation — and a failed computation records
  nothing (the next trigger tries again);
* the random number generators (torch's, Python's, NumPy's) and the data's own
  generators are put back after each computation, so training draws the same random
  numbers and sees the same batch order as without the integration;
* the model is left bitwise as it was when anything fails (see
  :func:`precisebn.recalibrate`), and the error propagates.

The framework-specific part is only *when* to fire, *which step* it is, *which batches*
and *how* to call the model; it binds the trigger to a model and data when training
starts (:meth:`Trigger.bind`) and unbinds it at the end, keeping the state (last step,
number of computations), which frameworks save in checkpoints. A model without any
normalization layer with running statistics gets one warning and no computation.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import torch
from torch import nn

from ..data import Forward
from ..errors import InvalidArgumentError, PreciseBNWarning
from ..layers import LayerSelection, has_running_stats
from ..recalibrate import check_options
from ..report import Report
from ..scheduler import Data, PreciseBNScheduler, check_data, check_frozen, check_state

__all__ = ["Trigger", "check_every", "report_metrics"]


def check_every(name: str, value: Any) -> int | None:
    """``value`` if it is a positive integer, ``None`` if it is ``None``; otherwise an
    :class:`~precisebn.errors.InvalidArgumentError` naming the option."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(f"{name} must be a positive integer or None, got {value!r}")
    return value


def report_metrics(report: Report, prefix: str = "precisebn") -> dict[str, float]:
    """The figures every integration logs after a computation.

    ``{prefix}/seconds``, ``{prefix}/samples`` and, over the updated layers,
    ``{prefix}/mean_shift`` (mean of the per-layer mean ``|Δmean|/σ``),
    ``{prefix}/max_mean_shift`` and ``{prefix}/var_ratio`` (geometric mean of the
    per-layer new/old variance ratios).
    """
    rows = [r for r in report.layers if r.updated]
    metrics = {f"{prefix}/seconds": float(report.seconds), f"{prefix}/samples": float(report.samples)}
    shifts = [r.mean_shift for r in rows if math.isfinite(r.mean_shift)]
    ratios = [r.var_ratio for r in rows if math.isfinite(r.var_ratio) and r.var_ratio > 0]
    if shifts:
        metrics[f"{prefix}/mean_shift"] = sum(shifts) / len(shifts)
        metrics[f"{prefix}/max_mean_shift"] = max(r.max_mean_shift for r in rows)
    if ratios:
        metrics[f"{prefix}/var_ratio"] = math.exp(sum(math.log(v) for v in ratios) / len(ratios))
    return metrics


class Trigger:
    """Options, one :class:`~precisebn.PreciseBNScheduler` and its state, for one integration.

    Args:
        owner: The integration's class name, for messages.
        num_samples, num_batches, forward, mode, layers, capture, prior, adapt,
            progress: As for :func:`precisebn.recalibrate`; checked here, at
            construction.
        frozen: As for :class:`~precisebn.PreciseBNScheduler`: layers kept in eval mode
            while the model trains are left as they are (``"skip"``) or recalibrated
            too (``"include"``); the integration calls :meth:`observe` after every
            training step.
        data: Batches given by the user (checked here), or ``None`` for the framework's
            training data, which the integration passes to :meth:`bind`.
        without_layers: What happens to a model without normalization layers, for the
            warning ("training goes on without them").
    """

    def __init__(
        self,
        owner: str,
        *,
        num_samples: int | Literal["all"] | None = None,
        num_batches: int | None = None,
        forward: Forward | None = None,
        mode: Literal["norm", "train"] = "norm",
        layers: LayerSelection = None,
        capture: Literal["auto", "float64"] = "auto",
        tolerance: float | None = None,
        prior: float | None = None,
        adapt: Literal["both", "mean", "var"] = "both",
        frozen: Literal["skip", "include"] = "skip",
        progress: bool = False,
        data: Data | None = None,
        without_layers: str = "training goes on without them",
    ) -> None:
        check_options(
            num_samples=num_samples,
            num_batches=num_batches,
            forward=forward,
            mode=mode,
            capture=capture,
            tolerance=tolerance,
            prior=prior,
            adapt=adapt,
        )
        check_frozen(frozen)
        if data is not None:
            check_data(data)
        self.owner = owner
        self.num_samples = num_samples
        self.num_batches = num_batches
        self.forward = forward
        self.mode = mode
        self.layers = layers
        self.capture = capture
        self.tolerance = tolerance
        self.prior = prior
        self.adapt = adapt
        self.frozen = frozen
        self.progress = progress
        self.data = data
        self.without_layers = without_layers
        self._scheduler: PreciseBNScheduler | None = None
        self._pending_state: dict[str, Any] | None = None
        self._last_report: Report | None = None
        self._warned_no_layers = False
        # whether a state was loaded (a checkpoint's, for the run about to start) since the last run started: only
        # then does that run start from its last step. A run that raised never reached its end (unbind), and its last
        # step, kept, made the next run skip its computation at that step (probe 42: a failed evaluation rerun, a
        # resume from an earlier checkpoint, a new model — evaluated and saved with moving-average statistics)
        self._loaded = False

    # -- binding ----------------------------------------------------------------------

    def bind(
        self,
        model: nn.Module,
        data: Data,
        *,
        forward: Forward | None = None,
        device: torch.device | str | None = None,
        progress: bool | None = None,
    ) -> PreciseBNScheduler:
        """Starts a training run: computations measure ``model`` on ``data``.

        ``forward`` replaces the user's only when the user gave none (the framework's
        call convention); ``progress`` can turn the bar off on ranks other than 0. The
        number of computations carries over; the last step only from a state loaded for this
        run (a checkpoint's, :meth:`load_state_dict`) — not from an earlier run, whether it
        ended (:meth:`unbind`) or raised (never unbound).
        """
        state = self.state_dict()
        if not self._loaded:  # a new run, no checkpoint's state loaded for it: the steps of an earlier one (that
            state = {**state, "last_step": None, "stale": False}  # ended or raised) mean nothing in it
        self._loaded = False
        self._scheduler = PreciseBNScheduler(
            model,
            data,
            num_samples=self.num_samples,
            num_batches=self.num_batches,
            forward=self.forward if self.forward is not None else forward,
            mode=self.mode,
            layers=self.layers,
            capture=self.capture,
            tolerance=self.tolerance,
            prior=self.prior,
            adapt=self.adapt,
            frozen=self.frozen,
            device=device,
            progress=self.progress if progress is None else progress,
        )
        self._scheduler.load_state_dict(state)
        self._pending_state = None
        self._warned_no_layers = False
        return self._scheduler

    def unbind(self) -> None:
        """Ends a training run: keeps the number of computations, drops the references to the model and
        data; the next run forgets the last step — it counts its steps from 0 again, so a step number of
        this run means nothing there (unless a checkpoint's state is loaded for it: a resumed run)."""
        if self._scheduler is not None:  # (its last step stays readable until the next run starts)
            self._pending_state, self._scheduler = self._scheduler.state_dict(), None

    def new_run(self, *, resumed: bool = True) -> None:
        """A bound run starts again (an Ignite engine run again): forgets the last step, unless the run is
        ``resumed`` (goes on from a step other than 0) and a state was loaded for it since the last run started
        (see :meth:`bind`). Forgetting it costs at most one computation that was current already; keeping it after
        a run that raised, before one resumed from an earlier checkpoint, or before one that starts from step 0
        again (a finished run's checkpoint loaded, the engine restarted) skipped a computation the model needed
        (probe 42 and its review)."""
        scheduler = self._scheduler
        if scheduler is not None:
            if not (resumed and self._loaded):
                scheduler.load_state_dict({**scheduler.state_dict(), "last_step": None, "stale": False})
            if not resumed:  # which layers the earlier run kept frozen says nothing of this one's (probe 42: a layer
                scheduler._forget_frozen()  # frozen now was rewritten before its first step, one unfrozen now
                # skipped); a resumed run goes on as it was until its first step is seen
        self._loaded = False

    def observe(self, model: nn.Module | None = None, *, modes: Mapping[str, bool] | None = None) -> None:
        """After a training step: notes the layers frozen for training (in eval mode while
        ``model``, default the bound one, trains; see :meth:`PreciseBNScheduler.observe`)."""
        if self._scheduler is not None and self.frozen == "skip":
            self._scheduler.observe(model, modes=modes)

    @property
    def scheduler(self) -> PreciseBNScheduler | None:
        """The scheduler of the current run (``None`` outside one)."""
        return self._scheduler

    # -- computing --------------------------------------------------------------------

    def has_layers(self, *, warn: bool = True) -> bool:
        """Whether the bound model has a layer to recalibrate; warns once per run (when
        ``warn``, e.g. on rank 0 only) when it has none."""
        scheduler = self._scheduler
        if scheduler is None:
            return False
        model = scheduler.model
        if any(has_running_stats(m) for m in model.modules()):
            return True
        if not self._warned_no_layers and warn:
            warnings.warn(
                f"{self.owner}: the model ({type(model).__name__}) has no normalization layer with running "
                "statistics (BatchNorm*, SyncBatchNorm, InstanceNorm* with track_running_stats=True), so there "
                f"are no statistics to recompute and {self.without_layers}. Remove {self.owner} to silence this "
                "warning.",
                PreciseBNWarning,
                stacklevel=3,
            )
        self._warned_no_layers = True
        return False

    def is_current(self, step: int) -> bool:
        """Whether the statistics were computed at ``step`` (and nothing invalidated them)."""
        return self._scheduler is not None and self._scheduler.is_current(step)

    def compute(
        self,
        step: int,
        *,
        context: contextlib.AbstractContextManager[Any] | None = None,
        warn: bool = True,
        before_training: bool = False,
    ) -> Report | None:
        """Recalibrates unless the statistics are current for ``step`` (or there is no run,
        or nothing to recalibrate); ``context`` wraps the forward passes (autocast...);
        ``before_training``: no training step has run yet (an evaluation on start).

        Returns:
            The :class:`~precisebn.Report` of a computation, ``None`` when nothing ran.

        Raises:
            PreciseBNError: Or whatever the data or the model raised; the model is then
                unchanged and the step is not recorded.
        """
        scheduler = self._scheduler
        # (whether the statistics are current is decided by every rank alike, in the scheduler: one rank whose
        # statistics were invalidated returned here while the others gathered, until the group's timeout — the
        # review of probe 40)
        if scheduler is None or not self.has_layers(warn=warn):
            return None
        # Evaluation may run under inference_mode; leave it so that what the computation
        # creates (the report's tensors) is made of ordinary tensors.
        with torch.inference_mode(False), context if context is not None else contextlib.nullcontext():
            report = scheduler._update(step, force=False, before_training=before_training)
        if report is not None:
            self._last_report = report
        return report

    def invalidate_at(self, step: int) -> None:
        """Marks a computation made at ``step`` stale (training forward passes at that step
        moved the running statistics without an optimizer step)."""
        if self._scheduler is not None and self._scheduler.last_step == step:
            self._scheduler.invalidate()

    # -- state ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The last step, whether it was invalidated, and the number of computations."""
        if self._scheduler is not None:
            return self._scheduler.state_dict()
        return dict(self._pending_state or {"last_step": None, "stale": False, "computations": 0})

    def load_state_dict(self, state: Any, *, for_next_run: bool = True) -> None:
        """Restores :meth:`state_dict`'s output; refuses anything else at once.

        ``for_next_run``: the state is for the run that starts next (:meth:`bind`, :meth:`new_run`), which goes
        on from its last step — loaded before that run, as Ignite's and the user's loads are. ``False``: for the
        run bound now, if any — Lightning restores a checkpoint after its ``setup``, where a fit is bound, and in
        ``validate``/``test`` too, where none is (the review of probe 42: the next ``fit()`` took that
        checkpoint's step as computed) — and a later run starts afresh. Either way it is what
        :meth:`state_dict` gives at once."""
        checked = check_state(state, f"{self.owner}.load_state_dict")
        self._loaded = for_next_run  # (a resumed run: its steps go on from the checkpoint's)
        if self._scheduler is not None:
            self._scheduler.load_state_dict(checked)
        else:
            self._pending_state = checked

    @property
    def last_step(self) -> int | None:
        return self.state_dict()["last_step"]  # type: ignore[no-any-return]

    @property
    def computations(self) -> int:
        return self.state_dict()["computations"]  # type: ignore[no-any-return]

    @property
    def last_report(self) -> Report | None:
        return self._last_report


def data_source(data: Data | None, default: Iterable[Any] | None, owner: str, where: str) -> Data:
    """The user's ``data`` if given, else the framework's ``default`` training data; an
    :class:`~precisebn.errors.InvalidArgumentError` when there is neither."""
    if data is not None:
        return data
    if default is None:
        raise InvalidArgumentError(
            f"{owner}: {where} has no training dataloader to measure on; pass data= (an iterable of batches, or a "
            "zero-argument callable returning one)."
        )
    return default


class TriggerState:
    """What every integration exposes of its :class:`Trigger`: its checkpointable state and
    what the last computation did (mixed into the integrations' classes)."""

    _trigger: Trigger

    def state_dict(self) -> dict[str, Any]:
        """The last step and the number of computations (saved with the framework's checkpoints)."""
        return self._trigger.state_dict()

    def load_state_dict(self, state: Any) -> None:
        """Restores :meth:`state_dict`'s output (e.g. when resuming)."""
        self._trigger.load_state_dict(state)

    @property
    def computations(self) -> int:
        """How many computations ran."""
        return self._trigger.computations

    @property
    def last_step(self) -> int | None:
        """The step of the last computation."""
        return self._trigger.last_step

    @property
    def last_report(self) -> Report | None:
        """The :class:`~precisebn.Report` of the last computation."""
        return self._trigger.last_report
