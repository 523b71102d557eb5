"""A Hugging Face ``transformers`` ``TrainerCallback`` (``pip install 'precisebn[transformers]'``).

:class:`PreciseBNCallback` recomputes the model's precise statistics on the Trainer's
training data before every evaluation and before every checkpoint of
``trainer.train()``, at most once per ``state.global_step``.

Example:
    >>> import tempfile, torch
    >>> from transformers import PrinterCallback, Trainer, TrainingArguments
    >>> from precisebn.integrations.transformers import PreciseBNCallback
    >>> class Net(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
    ...     def forward(self, x, labels=None):
    ...         out = self.net(x).squeeze(1)
    ...         return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}
    >>> data = [{"x": torch.randn(4), "labels": torch.randn(())} for _ in range(64)]
    >>> output_dir = tempfile.mkdtemp()
    >>> args = TrainingArguments(output_dir, per_device_train_batch_size=16, num_train_epochs=2,
    ...                          eval_strategy="epoch", save_strategy="no", report_to=[], use_cpu=True,
    ...                          disable_tqdm=True)
    >>> precise = PreciseBNCallback(num_samples="all")
    >>> trainer = Trainer(Net(), args, train_dataset=data, eval_dataset=data, callbacks=[precise])
    >>> trainer.remove_callback(PrinterCallback)  # quiet
    >>> _ = trainer.train()
    >>> precise.computations, precise.last_step  # before each of the two evaluations
    (2, 8)
    >>> import shutil; shutil.rmtree(output_dir)
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Literal

from torch import nn

from .._optional import require
from ..data import Forward
from ..errors import InvalidArgumentError, PreciseBNWarning
from ..layers import LayerSelection
from ..report import Report
from ..scheduler import Data
from ._trigger import Trigger, TriggerState, report_metrics

_callback = require("transformers.trainer_callback", "transformers", "precisebn.integrations.transformers")

__all__ = ["PreciseBNCallback"]

logger = logging.getLogger("precisebn.integrations.transformers")


class PreciseBNCallback(TriggerState, _callback.TrainerCallback):  # type: ignore[misc,name-defined]
    """Recomputes precise statistics before each evaluation and each checkpoint of ``train()``.

    Every BatchNorm-style layer's ``running_mean``/``running_var`` becomes the exact
    population mean/variance of its inputs over ``num_samples`` training samples (see
    :func:`precisebn.recalibrate`), computed when the Trainer is about to evaluate or to
    save a checkpoint (``control.should_evaluate``/``should_save`` at the end of an
    optimizer step or of an epoch, whatever the strategies), and at the end of training
    (so that ``trainer.save_model()`` writes precise statistics) — at most once per
    ``state.global_step``: an evaluation and a checkpoint at the same step share one
    computation.

    The batches are the Trainer's training batches — its training dataset, sampler (the
    process's shard) and data collator — fed the way the Trainer feeds them,
    ``model(**batch)``, on the model's device, under ``torch.no_grad()``. Gradients,
    optimizer state, training flags and the random number generators (the global ones
    and the training sampler's) are left as they were: a run with the callback trains
    exactly like one without it. A model without normalization layers gets one
    :class:`~precisebn.errors.PreciseBNWarning` and no computation. If the data or the
    model fails, the model is left unchanged and the error propagates out of
    ``train()``. With several processes every process measures its shard and all end
    with identical statistics over the union (``num_samples`` is the total).

    Each computation is recorded in ``trainer.state.log_history`` as
    ``{"precisebn/mean_shift", "precisebn/max_mean_shift", "precisebn/var_ratio",
    "precisebn/seconds", "precisebn/samples", "step"}`` (saved with every checkpoint's
    ``trainer_state.json``) and logged to the ``precisebn.integrations.transformers``
    logger (callbacks cannot reach ``Trainer.log``).

    Args:
        num_samples: Training samples to measure on, over all processes (``"all"``: a
            whole pass). Default: up to 8192.
        num_batches: Or a number of batches per process.
        data: Batches to measure on instead of the Trainer's training data, in the
            collator's format: a re-iterable or a zero-argument callable returning one.
        forward: ``forward(model, batch)``; default ``model(**batch)`` for a mapping.
        mode: ``"norm"`` (only normalization layers in training mode, dropout off) or
            ``"train"``.
        layers: Which layers (names, types or a predicate); default all.
        capture, tolerance, prior, adapt: As for :func:`precisebn.recalibrate`
            (``prior=N``: each computation pools the statistics the layers hold at that
            moment, counted as ``N`` samples, with the measured ones).
        frozen: Layers the model keeps in eval mode while it trains (frozen for
            training, e.g. ``norm_eval=True``; noted after every training step):
            ``"skip"`` (default) leaves them as they are, ``"include"`` recalibrates
            them too.
        on_evaluate, on_save, on_train_end: Recompute before evaluations / before
            checkpoints / at the end of training (all on by default).
        progress: A progress bar on the main process (``precisebn[progress]``).
        log: Record the figures in ``log_history`` and the logger.

    Attributes:
        computations: How many computations ran.
        last_step: The ``global_step`` of the last computation.
        last_report: The :class:`~precisebn.Report` of the last computation.
    """

    def __init__(
        self,
        num_samples: int | Literal["all"] | None = None,
        *,
        num_batches: int | None = None,
        data: Data | None = None,
        forward: Forward | None = None,
        mode: Literal["norm", "train"] = "norm",
        layers: LayerSelection = None,
        capture: Literal["auto", "float64"] = "auto",
        tolerance: float | None = None,
        prior: float | None = None,
        adapt: Literal["both", "mean", "var"] = "both",
        frozen: Literal["skip", "include"] = "skip",
        on_evaluate: bool = True,
        on_save: bool = True,
        on_train_end: bool = True,
        progress: bool = False,
        log: bool = True,
    ) -> None:
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
        self.before_evaluate = on_evaluate
        self.before_save = on_save
        self.at_train_end = on_train_end
        self.log = log
        # the global_step of this run's last computation, whether it ran or had nothing to do: an evaluation or a
        # checkpoint at another step was asked for after this callback's turn (by a callback listed after it)
        self._attempted: int | None = None
        self._warned: set[str] = set()

    # -- the Trainer's events ---------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model = kwargs.get("model")
        if not isinstance(model, nn.Module):
            raise InvalidArgumentError(f"{type(self).__name__}: the Trainer passed no torch model to its callbacks.")
        loader = kwargs.get("train_dataloader")
        if self._trigger.data is None and loader is None:
            raise InvalidArgumentError(
                f"{type(self).__name__}: the Trainer has no training dataloader to measure on; pass data= (an "
                "iterable of batches, or a zero-argument callable returning one)."
            )
        source = self._trigger.data if self._trigger.data is not None else loader
        progress = self._trigger.progress and state.is_world_process_zero
        self._trigger.bind(model, source, progress=progress)
        self._attempted, self._warned = None, set()
        if self.before_evaluate and getattr(args, "eval_on_start", False):  # evaluated next, with no step before
            self._compute(state, before_training=True)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._trigger.observe()  # the layers the model keeps in eval mode while training: frozen
        self._maybe_compute(args, state, control)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._maybe_compute(args, state, control)

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.before_evaluate:
            self._check_computed(state, "evaluation")

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.before_save:
            self._check_computed(state, "checkpoint")

    def _check_computed(self, state: Any, what: str) -> None:
        """Warns (once per run and kind) when an evaluation or a checkpoint of ``train()`` came at a step this callback
        was not asked about: a callback listed after it set ``control.should_evaluate``/``should_save`` in the same
        event, after this one had looked (probe 46: a checkpoint so forced held the moving averages, 0.45 σ and 50 %
        off the float64 truth of its weights, then 1.2 σ and 190 %), silently before."""
        if self._trigger.scheduler is None or self._attempted == state.global_step or what in self._warned:
            return
        if not self._trigger.has_layers(warn=False):
            return
        self._warned.add(what)
        # (an evaluation by hand after a train() that raised looks alike from here: this callback is still bound, as
        # on_train_end never came — the review of stop 44 found it told to reorder callbacks that were not there)
        by_hand = (
            " Or trainer.evaluate() was called by hand after train() was interrupted: the statistics are then those "
            "of the last computation."
            if what == "evaluation"
            else ""
        )
        if state.is_world_process_zero:
            warnings.warn(
                f"{type(self).__name__}: the {what} at step {state.global_step} ran with statistics not computed for "
                "the current weights: it was requested (control.should_evaluate/should_save) after this callback had "
                "looked at the step, by a callback that runs after it. Put PreciseBNCallback after every callback "
                "that requests evaluations or checkpoints (last in callbacks=, or trainer.add_callback() last)."
                f"{by_hand} This is said once per training run.",
                PreciseBNWarning,
                stacklevel=2,
            )

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        try:
            if self.at_train_end:
                self._compute(state)
        finally:
            self._trigger.unbind()

    def _maybe_compute(self, args: Any, state: Any, control: Any) -> None:
        # DefaultFlowCallback (always first) has decided what happens after this step. With save_strategy="best" the
        # Trainer decides to save after the evaluation (a new best metric), with these weights: a checkpoint may
        # follow every evaluation (on_evaluate=False, on_save=True saved the moving averages: the review of stop 44).
        saves = control.should_save or (control.should_evaluate and getattr(args, "save_strategy", None) == "best")
        if (self.before_evaluate and control.should_evaluate) or (self.before_save and saves):
            self._compute(state)

    def _compute(self, state: Any, before_training: bool = False) -> Report | None:
        self._attempted = state.global_step
        report = self._trigger.compute(
            state.global_step, warn=state.is_world_process_zero, before_training=before_training
        )
        if report is not None and self.log and state.is_world_process_zero:
            metrics = report_metrics(report)
            state.log_history.append({**metrics, "step": state.global_step})
            logger.info("precise BN at step %d: %s", state.global_step, metrics)
        return report
