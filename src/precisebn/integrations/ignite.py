"""A PyTorch-Ignite handler (``pip install 'precisebn[ignite]'``).

:class:`PreciseBN` recomputes a model's precise statistics when an engine fires the
events it is attached to, at most once per training iteration: attach it to the
trainer's events *before* the evaluation and checkpoint handlers of the same events
(Ignite runs handlers in the order they were added), or to the evaluator's
``Events.STARTED`` with ``step_engine=trainer``.

Example:
    >>> import torch
    >>> from ignite.engine import Engine, Events
    >>> from precisebn.integrations.ignite import PreciseBN
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
    >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> def step(engine, batch):
    ...     optimizer.zero_grad()
    ...     loss = model(batch).square().mean()
    ...     loss.backward()
    ...     optimizer.step()
    >>> trainer = Engine(step)
    >>> data = [torch.randn(16, 4) for _ in range(4)]
    >>> precise = PreciseBN(model, num_samples="all")  # measures on the data trainer.run() gets
    >>> _ = precise.attach(trainer, Events.EPOCH_COMPLETED)  # add evaluation and checkpoints after it
    >>> _ = precise.attach(trainer, Events.ITERATION_COMPLETED(every=4))  # same iterations: free
    >>> _ = trainer.run(data, max_epochs=2)
    >>> precise.computations, precise.last_step
    (2, 8)
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Iterator
from typing import Any, Literal

import torch
from torch import nn

from .._optional import require
from ..data import Forward
from ..errors import InvalidArgumentError, PreciseBNWarning
from ..layers import LayerSelection, unwrap
from ..report import Report
from ..scheduler import Data
from ._trigger import Trigger, TriggerState, report_metrics

_engine = require("ignite.engine", "ignite", "precisebn.integrations.ignite")

__all__ = ["PreciseBN"]


def _rank_zero() -> bool:
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


class PreciseBN(TriggerState):
    """An Ignite handler that recomputes exact precise statistics, at most once per iteration.

    ``precise(engine)`` (what Ignite calls) recalibrates ``model`` (see
    :func:`precisebn.recalibrate`) unless the statistics were already computed at the
    current iteration of the step engine — the engine it is attached to, or
    ``step_engine`` (the trainer, for a handler attached to an evaluator). Attach it to
    as many events as you like: an evaluation and a checkpoint at the same iteration
    share one computation.

    The forward passes run under ``torch.no_grad()``; gradients, the optimizer,
    training flags and the random number generators (the global ones and the data's
    own) are left as they were, so training goes on exactly as without the handler. A
    model without normalization layers gets one
    :class:`~precisebn.errors.PreciseBNWarning` and no computation. If the data or the
    model fails, the model is left unchanged and the error propagates (Ignite then
    fires ``Events.EXCEPTION_RAISED``). With several processes, every rank must fire
    the same events; all end with identical statistics over the union of their data.

    Each computation is logged through the engine's ``logger`` (INFO).

    Args:
        model: The model to recalibrate.
        data: The batches to measure on: a re-iterable (DataLoader, list) or a
            zero-argument callable returning one. Default: the data the step engine
            runs on (``engine.state.dataloader``), which must then be re-iterable.
        num_samples, num_batches, forward, mode, layers, device, capture, tolerance, prior,
            adapt, progress: As for :func:`precisebn.recalibrate` (``forward(model,
            batch)`` for batches the model cannot take as they are, e.g. ``lambda m, b:
            m(prepare(b)[0])``; ``prior=N``: each computation pools the statistics the
            layers hold at that moment, counted as ``N`` samples, with the measured ones).
        frozen: Layers the model keeps in eval mode while it trains (frozen for
            training): ``"skip"`` (default) leaves them as they are, ``"include"``
            recalibrates them too. They are noted whenever the handler runs with the
            model training, and after every iteration of the step engines it is
            attached to.
        trained_model: The model being trained, when ``model`` is a copy of it that
            does not train (the ``ema_model`` of Ignite's ``EMAHandler``): its frozen
            layers are those left as they are in ``model``.
        log: Log each computation through the engine's logger.

    Attributes:
        computations: How many computations ran.
        last_step: The iteration of the last computation.
        last_report: The :class:`~precisebn.Report` of the last computation.
    """

    def __init__(
        self,
        model: nn.Module,
        data: Data | None = None,
        *,
        num_samples: int | Literal["all"] | None = None,
        num_batches: int | None = None,
        forward: Forward | None = None,
        mode: Literal["norm", "train"] = "norm",
        layers: LayerSelection = None,
        device: torch.device | str | None = None,
        capture: Literal["auto", "float64"] = "auto",
        tolerance: float | None = None,
        prior: float | None = None,
        adapt: Literal["both", "mean", "var"] = "both",
        frozen: Literal["skip", "include"] = "skip",
        trained_model: nn.Module | None = None,
        progress: bool = False,
        log: bool = True,
    ) -> None:
        if trained_model is not None and not isinstance(trained_model, nn.Module):
            raise InvalidArgumentError(
                f"trained_model must be the torch.nn.Module being trained, got {type(trained_model).__name__}"
            )
        self.trained_model = trained_model
        self._model = model
        self._shared_told = False
        self._trigger = Trigger(
            type(self).__name__,
            num_samples=num_samples,
            num_batches=num_batches,
            forward=forward,
            mode=mode,
            layers=layers,
            capture=capture,
            tolerance=tolerance,
            prior=prior,
            adapt=adapt,
            frozen=frozen,
            progress=progress,
            data=data,
        )
        self._data_engine: Any = None
        source: Data = data if data is not None else self._engine_data
        self._trigger.bind(model, source, device=device, progress=progress and _rank_zero())
        if trained_model is not None and self._trigger.scheduler is not None:
            self._trigger.scheduler.trains(trained_model)  # (noted, not observed: it has not trained yet)
        self.log = log

    def _engine_data(self) -> Iterable[Any]:
        engine = self._data_engine
        loader = None if engine is None else getattr(engine.state, "dataloader", None)
        if loader is None:
            raise InvalidArgumentError(
                "PreciseBN: the engine has no data to measure on (it runs without a dataloader, or is not running); "
                "pass data= (an iterable of batches, or a zero-argument callable returning one)."
            )
        if isinstance(loader, Iterator):
            raise InvalidArgumentError(
                f"PreciseBN: the engine runs on a one-shot iterator ({type(loader).__name__}), which cannot be read "
                "again to measure statistics; pass data= to PreciseBN (a DataLoader, a list, or a zero-argument "
                "callable returning a fresh iterable)."
            )
        return loader  # type: ignore[no-any-return]

    def attach(self, engine: Any, event: Any = None, *, step_engine: Any = None) -> Any:
        """Runs the handler when ``engine`` fires ``event`` (default ``Events.EPOCH_COMPLETED``).

        Args:
            engine: The engine whose event triggers a computation.
            event: Any Ignite event, filtered or combined (``Events.ITERATION_COMPLETED(every=100)
                | Events.COMPLETED``).
            step_engine: The engine whose ``state.iteration`` is the step (and whose data
                is measured when ``data`` was not given); default ``engine``. Pass the
                trainer when attaching to an evaluator's ``Events.STARTED``.

        Returns:
            Ignite's handle, whose ``remove()`` detaches the handler.
        """
        if event is None:
            event = _engine.Events.EPOCH_COMPLETED
        steps = step_engine if step_engine is not None else engine
        completed, started = _engine.Events.ITERATION_COMPLETED, _engine.Events.STARTED
        if not steps.has_event_handler(self._observe, completed):  # (once per engine)
            steps.add_event_handler(completed, self._observe)
        if not steps.has_event_handler(self._started, started):
            steps.add_event_handler(started, self._started)
        return engine.add_event_handler(event, self, steps)

    def _started(self, engine: Any) -> None:
        """A run of the step engine starts: the last step means nothing in it unless the run is resumed and this
        handler's state was loaded for it (see :meth:`~precisebn.integrations._trigger.Trigger.new_run`). Without
        ``data``, an engine on a one-shot iterator is refused now, not at the first computation (a probe: after
        the whole first epoch had trained)."""
        if self._trigger.data is None:
            self._data_engine = engine
            try:
                self._engine_data()
            finally:
                self._data_engine = None
        # a new run, or one resumed (from an earlier checkpoint, after a run that raised): the last step is of another
        # run, unless this handler's state was loaded for this one and it goes on from there (probe 42: kept after a
        # failed evaluation, the reloaded run's evaluation at that step ran with moving-average statistics)
        self._trigger.new_run(resumed=int(engine.state.iteration) > 0)

    def _observe(self, engine: Any) -> None:
        """After each training iteration: notes the layers kept in eval mode (frozen)."""
        self._trigger.observe(self.trained_model)

    def __call__(self, engine: Any, step_engine: Any = None) -> Report | None:
        """Recalibrates unless the statistics are current for the step engine's iteration."""
        source = step_engine if step_engine is not None else engine
        self._data_engine = source
        try:
            step = int(source.state.iteration)
            report = self._trigger.compute(step, warn=_rank_zero(), before_training=step == 0)
        finally:
            self._data_engine = None
        if report is not None and self.trained_model is not None and not self._shared_told:
            self._tell_shared(report)
        if report is not None and self.log:
            with contextlib.suppress(Exception):  # logging never fails training
                engine.logger.info("PreciseBN at iteration %d: %s", step, report_metrics(report))
        return report

    def _tell_shared(self, report: Report) -> None:
        """Warns (once) when statistics just written into ``model`` share memory with ``trained_model``'s buffers, as
        the copy of Ignite's ``EMAHandler(handle_buffers="copy")``, its default, does: the model trained then holds
        the copy's statistics, those of the averaged weights (probe 46: 4.7e-2 to 7.4e-2 off its own float64 truth,
        unwarned; the copy's own exact). The statistics written are the copy's, as asked; training, which
        normalises with batch statistics, is untouched — an evaluation or a checkpoint of the model trained is not."""
        theirs = {t.untyped_storage().data_ptr() for t in self.trained_model.buffers() if t.untyped_storage().nbytes()}
        # (a layer of trained_model itself — model is trained_model, wraps it or is part of it — holds its own: the
        # review of stop 44 found the warning said of those)
        own = {id(m) for m in self.trained_model.modules()}
        shared = []
        for name in report.updated:
            try:
                module = unwrap(self._model).get_submodule(name)
            except AttributeError:  # (a name of a call, per_call: its layer's are checked under that name)
                continue
            if id(module) in own:
                continue
            for key in ("running_mean", "running_var"):
                t = module._buffers.get(key)
                storage = t.untyped_storage() if isinstance(t, torch.Tensor) else None
                if storage is not None and storage.nbytes() and storage.data_ptr() in theirs:
                    shared.append(name)
                    break
        if shared:
            self._shared_told = True
            shown = ", ".join(map(repr, shared[:5])) + (f" and {len(shared) - 5} more" if len(shared) > 5 else "")
            warnings.warn(
                f"PreciseBN: the running statistics of layer(s) {shown} share memory with trained_model's (Ignite's "
                "EMAHandler(handle_buffers='copy'), its default, shares them): the statistics just computed for the "
                "averaged weights were written into the model being trained too, whose own evaluations and "
                "checkpoints then use them. Pass EMAHandler(..., handle_buffers='update') or 'ema_train' to keep the "
                "copy's buffers its own. This is said once.",
                PreciseBNWarning,
                stacklevel=2,
            )
