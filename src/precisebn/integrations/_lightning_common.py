"""The Lightning callbacks' behaviour, written once for both Lightning packages.

The classes here are mixins that use the Trainer through its public attributes (two
private names: the LightningModule's ``_on_before_batch_transfer``, which Lightning's
training loop calls the same way, and ``WeightAveraging._average_model``, the averaged
model its subclasses work on); :mod:`precisebn.integrations.lightning` combines them with ``lightning.pytorch``'s
``Callback``/``WeightAveraging`` and :mod:`precisebn.integrations.pytorch_lightning`
with the legacy ``pytorch_lightning`` package's. Importing this module imports neither.

Hook points (Lightning runs callbacks in list order but always moves checkpoint
callbacks to the end, and runs validation at the end of an epoch before
``on_train_epoch_end``):

* ``on_validation_start`` — before every validation loop of ``fit`` (not the sanity
  check, not ``trainer.validate``): the validation loop sees the new statistics.
* ``on_save_checkpoint`` — every checkpoint written during ``fit`` (ModelCheckpoint at
  any trigger, ``save_last``, ``trainer.save_checkpoint``). The checkpoint's
  ``state_dict`` was taken just before, but ``Module.state_dict()`` holds references
  to the buffers, and precisebn writes the statistics in place, so the saved
  ``running_mean``/``running_var`` are the new ones; the callback also refreshes its
  own entry in ``checkpoint["callbacks"]``.
* ``on_train_end`` — the end of ``fit`` (unless the last computation is current): the
  module ``fit`` leaves holds its statistics (``trainer.test(model)``, a checkpoint saved
  after ``fit``).
* ``on_train_batch_end`` / ``on_train_epoch_end`` — the optional ``every_n_train_steps``
  / ``every_n_epochs`` schedules; they run before ModelCheckpoint's saves in the same
  hooks, which then reuse the computation.

The guard is the one every integration shares (``_trigger.Trigger``, a
:class:`~precisebn.PreciseBNScheduler`): one computation per ``trainer.global_step``.
A training batch that ends without an optimizer step after a computation at the
same step (gradient accumulation) moves the running statistics, so it invalidates that
computation. Like the scheduler, a computation puts back the global random number
generators and the training data's own (a DataLoader's ``generator``, its sampler's),
so the batch order of later epochs is unchanged. A model without any
normalization layer with running statistics gets one warning and no computation.

The averaging companion recomputes the averaged copy's statistics in
``on_validation_start`` (before ``WeightAveraging`` swaps the averaged weights in, in
``on_validation_epoch_start``), in ``on_save_checkpoint`` (before ``WeightAveraging``
puts the averaged state into the checkpoint) and in ``on_train_end`` (before it copies
the averaged weights and buffers into the module); its guard is the averaged model's
``n_averaged``, which changes exactly when the average does. Until the first average
exists (``n_averaged == 0``, e.g. before ``swa_epoch_start``) the averaged copy holds
only the module's initial weights, so validation, checkpoints and the end of training
use the live module instead, as Lightning's ``StochasticWeightAveraging`` does before
averaging starts: no weights are swapped and nothing is computed.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import warnings
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import torch
from torch import nn

from ..data import Forward
from ..errors import InvalidArgumentError, PreciseBNWarning
from ..interrupts import signals_held
from ..layers import LayerSelection
from ..report import Report
from ..scheduler import Data, MappedBatches, PreciseBNScheduler, fresh_batches
from ._trigger import Trigger, check_every, report_metrics

__all__ = ["AveragingMixin", "PreciseBNMixin"]


def _fitting(trainer: Any) -> bool:
    """Inside ``trainer.fit()``, outside the sanity check, and not handling an exception.

    Lightning marks the run ``"interrupted"`` before calling ``on_exception``, so a
    checkpoint saved on an exception (``ModelCheckpoint(save_on_exception=True)``) starts
    no forward passes on a failing run — nor a collective call that the other ranks
    would never join.
    """
    state = trainer.state
    return state.fn == "fit" and state.status == "running" and not trainer.sanity_checking


def _modes_before_validating(trainer: Any) -> dict[str, bool] | None:
    """The ``training`` flags of the LightningModule's modules by qualified name as its validation loop recorded
    them before putting it in eval mode — the modes it trained in: a layer frozen by a hook after this callback's
    last ``on_train_batch_end`` (the module's own, a later callback's) is frozen there (a probe). Lightning's
    private record (``_ModuleMode``); ``None`` where it keeps none."""
    loop = getattr(getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None), "val_loop", None)
    mode = getattr(getattr(loop, "_module_mode", None), "mode", None)
    return dict(mode) if isinstance(mode, dict) and mode else None


def _training_loader(trainer: Any) -> Iterable[Any]:
    loader = trainer.train_dataloader
    if loader is None:
        raise InvalidArgumentError(
            "the Trainer has no training dataloader to measure on; pass data= (an iterable of batches, or a "
            "zero-argument callable returning one) to the callback."
        )
    if isinstance(loader, (Mapping, list, tuple)):
        raise InvalidArgumentError(
            f"the Trainer's training data is a {type(loader).__name__} of {len(loader)} dataloader(s), not one "
            "dataloader; pass data= (the batches to measure on) and, if the module cannot take them as they are, "
            "forward="
        )
    return loader


def _has_forward(module: nn.Module) -> bool:
    """Whether ``module`` has a ``forward`` of its own: not the LightningModule's (of either package) nor torch's,
    which only raise ``NotImplementedError`` (a probe: a module without one, which Lightning trains, ended ``fit`` with
    that raw error at the first validation, after a whole epoch)."""
    if "forward" in vars(module):  # (set on the instance)
        return True
    own = getattr(type(module), "forward", None)
    bases = [vars(nn.Module).get("forward")]
    bases += [
        vars(cls).get("forward")
        for cls in type(module).__mro__
        if cls.__name__ == "LightningModule" and cls.__module__.endswith(".core.module")
    ]
    return own is not None and all(own is not base for base in bases)


def _copies_state_dict(strategy: Any) -> bool:
    """Whether the strategy builds the checkpoint's ``state_dict`` other than as
    ``lightning_module.state_dict()`` (sharded strategies gather copies)."""
    for cls in type(strategy).__mro__:
        if "lightning_module_state_dict" in vars(cls):
            return cls.__name__ != "Strategy"
    return False


class _Recalibrator:
    """Options and the computation shared by both callbacks: a :class:`Trigger` (the
    scheduler every integration shares) fed with Lightning's batches."""

    _log_prefix = "precisebn"
    _without_layers = "training goes on without them"

    def _init_options(
        self,
        *,
        num_samples: int | Literal["all"] | None,
        num_batches: int | None,
        data: Data | None,
        forward: Forward | None,
        mode: Literal["norm", "train"],
        layers: LayerSelection,
        progress: bool,
        log: bool,
        capture: Literal["auto", "float64"] = "auto",
        tolerance: float | None = None,
        prior: float | None = None,
        adapt: Literal["both", "mean", "var"] = "both",
        frozen: Literal["skip", "include"] = "skip",
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
            without_layers=self._without_layers,
        )
        self.num_samples = num_samples
        self.num_batches = num_batches
        self.data = data
        self.forward = forward
        self.mode = mode
        self.capture = capture
        self.tolerance = tolerance
        self.prior = prior
        self.adapt = adapt
        self.frozen = frozen
        self.layers = layers
        self.progress = progress
        self.log = log

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        super().on_train_start(trainer, pl_module)  # type: ignore[misc]
        if self.data is None:  # none or several training dataloaders: said before training, not after an epoch
            _training_loader(trainer)
        if self.forward is None and not _has_forward(pl_module):  # (the same: not a raw error after an epoch)
            raise InvalidArgumentError(
                f"{type(self).__name__}: {type(pl_module).__name__} defines no forward() (Lightning does not require "
                "one), and the computations feed the training batches to it; pass forward= (e.g. "
                "forward=lambda module, batch: module.net(batch[0])) to say how the module takes a batch."
            )

    @property
    def _scheduler(self) -> PreciseBNScheduler | None:
        return self._trigger.scheduler

    def _make_scheduler(self, trainer: Any, model: nn.Module) -> PreciseBNScheduler:
        return self._trigger.bind(
            model, functools.partial(self._batches, trainer), progress=self.progress and trainer.is_global_zero
        )

    def _batches(self, trainer: Any) -> Iterable[Any]:
        """The batches of one computation, moved as the Trainer moves training batches
        (a :class:`MappedBatches`, through which the scheduler finds the data's own
        random number generators to put back)."""
        source = self.data if self.data is not None else _training_loader(trainer)
        module = trainer.lightning_module
        # What the training loop does to each batch: the precision plugin's convert_input (the batch in the
        # model's dtype under "64-true"/"bf16-true"), the (datamodule's or module's) on_before_batch_transfer,
        # then transfer_batch_to_device and on_after_batch_transfer.
        before = getattr(module, "_on_before_batch_transfer", None)
        convert = getattr(trainer.precision_plugin, "convert_input", None)

        def move(batch: Any) -> Any:
            # in the training stage, whatever triggered the computation: the transfer hooks see
            # trainer.training (Lightning's documented place for GPU augmentation is on_after_batch_transfer under
            # `if self.trainer.training`: a computation before validation measured un-augmented batches, one before
            # a checkpoint augmented ones)
            stage = trainer.state.stage
            trainer.training = True
            try:
                if convert is not None:
                    batch = convert(batch)
                if before is not None:
                    batch = before(batch, dataloader_idx=0)
                return self._in_dtype(trainer.strategy.batch_to_device(batch))
            finally:
                trainer.state.stage = stage

        return MappedBatches(fresh_batches(source), move)

    def _in_dtype(self, batch: Any) -> Any:
        """A batch as the model measured takes it (here: as the training loop gives it)."""
        return batch

    def _compute(self, trainer: Any, step: int) -> Report | None:
        """Recalibrates unless current for ``step``; logs the figures of a computation."""
        if self._trigger.scheduler is None:  # (current or not: decided by every rank alike, see Trigger.compute)
            return None
        report = self._trigger.compute(
            step, context=trainer.precision_plugin.forward_context(), warn=trainer.is_global_zero
        )
        if report is not None and self.log:
            self._log_report(trainer, report)
        return report

    def _log_report(self, trainer: Any, report: Report) -> None:
        if not trainer.loggers or not trainer.is_global_zero:
            return
        metrics = report_metrics(report, self._log_prefix)
        step = _logging_step(trainer)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
            logger.save()

    def _warn_uncovered_saves(self, trainer: Any) -> None:
        if not trainer.is_global_zero:
            return
        weights_only = [cb for cb in trainer.checkpoint_callbacks if getattr(cb, "save_weights_only", False)]
        if weights_only:
            warnings.warn(
                f"{type(self).__name__}: ModelCheckpoint(save_weights_only=True) saves without calling the "
                "callbacks' on_save_checkpoint, so precisebn cannot recalibrate right before those saves; they "
                "hold the statistics of the last recalibration (before validation, or every_n_train_steps / "
                "every_n_epochs).",
                PreciseBNWarning,
                stacklevel=2,
            )
        if _copies_state_dict(trainer.strategy):
            warnings.warn(
                f"{type(self).__name__}: strategy {type(trainer.strategy).__name__} builds checkpoints from "
                "copies of the weights, so statistics recalibrated while a checkpoint is saved may not reach it; "
                "precisebn supports single-device and DDP-style strategies.",
                PreciseBNWarning,
                stacklevel=2,
            )

    def _scheduler_state(self) -> dict[str, Any]:
        return self._trigger.state_dict()

    def _load_scheduler_state(self, state: Any) -> None:
        # refused now, not at setup; Lightning restores a checkpoint after a fit's setup (bound), or for validate/test
        # (no fit): for that stage only, never for a later fit without a checkpoint
        self._trigger.load_state_dict(state, for_next_run=False)

    def _refresh_own_state(self, checkpoint: dict[str, Any]) -> None:
        # The callbacks' states were collected before on_save_checkpoint runs.
        states = checkpoint.get("callbacks")
        if isinstance(states, dict) and self.state_key in states:  # type: ignore[attr-defined]
            states[self.state_key] = self.state_dict()  # type: ignore[attr-defined]

    @property
    def last_step(self) -> int | None:
        """The ``global_step`` of the last recalibration."""
        return self._trigger.last_step

    @property
    def computations(self) -> int:
        """How many recalibrations ran (including those before a restored checkpoint)."""
        return self._trigger.computations

    @property
    def last_report(self) -> Report | None:
        """The :class:`~precisebn.Report` of the last recalibration in this process."""
        return self._trigger.last_report


class PreciseBNMixin(_Recalibrator):
    """The behaviour of ``PreciseBN`` (see :class:`precisebn.integrations.lightning.PreciseBN`)."""

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
        on_validation: bool = True,
        on_checkpoint: bool = True,
        on_train_end: bool | None = None,
        every_n_train_steps: int | None = None,
        every_n_epochs: int | None = None,
        progress: bool = False,
        log: bool = True,
    ) -> None:
        super().__init__()
        self._init_options(
            num_samples=num_samples,
            num_batches=num_batches,
            data=data,
            forward=forward,
            mode=mode,
            layers=layers,
            progress=progress,
            log=log,
            capture=capture,
            tolerance=tolerance,
            prior=prior,
            adapt=adapt,
            frozen=frozen,
        )
        self.on_validation = on_validation
        self.on_checkpoint = on_checkpoint
        # (the hook of that name is a method) default: as the validations' and checkpoints' (a callback that
        # computes only on a schedule adds no computation at the end)
        self.at_train_end = bool(on_validation or on_checkpoint) if on_train_end is None else bool(on_train_end)
        self.every_n_train_steps = check_every("every_n_train_steps", every_n_train_steps)
        self.every_n_epochs = check_every("every_n_epochs", every_n_epochs)
        self._last_scheduled_step: int | None = None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        super().setup(trainer, pl_module, stage)  # type: ignore[misc]
        if stage == "fit":
            self._make_scheduler(trainer, pl_module)
            # (an earlier run's: a callback used again skipped the new run's computation at that step, probe 42;
            # a checkpoint's state, restored after setup, sets it again: see load_state_dict)
            self._last_scheduled_step = self._trigger.last_step
            if self.on_checkpoint:
                self._warn_uncovered_saves(trainer)
            self._warn_weight_averaging(trainer)

    def _warn_weight_averaging(self, trainer: Any) -> None:
        """Lightning's own ``WeightAveraging`` (SWA, EMA) beside this callback: its validations, its checkpoints'
        ``state_dict`` and the module at the end of ``fit`` are the averaged weights, with the averaged copy's
        buffers (averages of the module's statistics, or the copy's initial ones), which no computation here is
        for (probe 48: 0.5-1.7 σ / 28-270 % off the float64 truth of the averaged weights, silently).
        ``PreciseWeightAveraging`` computes the average's own."""
        if not trainer.is_global_zero:
            return
        for callback in trainer.callbacks:
            averaging = any(
                cls.__name__ == "WeightAveraging" and cls.__module__.endswith("callbacks.weight_averaging")
                for cls in type(callback).__mro__
            )
            if averaging and not isinstance(callback, AveragingMixin):
                warnings.warn(
                    f"{type(self).__name__}: {type(callback).__name__} (Lightning's weight averaging) validates, "
                    "checkpoints and ends training with the averaged weights and the averaged copy's buffers, "
                    f"not with statistics {type(self).__name__} computes (those are the live module's): use "
                    "precisebn's PreciseWeightAveraging instead of both, which computes the averaged weights' own.",
                    PreciseBNWarning,
                    stacklevel=2,
                )
                return

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self._trigger.unbind()  # keep the state, drop the references to the Trainer and the module
        super().teardown(trainer, pl_module, stage)  # type: ignore[misc]

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        self._trigger.observe(pl_module)  # the layers it keeps in eval mode while training: frozen
        self._trigger.invalidate_at(step)  # a batch ran without stepping the optimizer since the computation
        n = self.every_n_train_steps
        if n is not None and step > 0 and step % n == 0 and step != self._last_scheduled_step and _fitting(trainer):
            self._last_scheduled_step = step
            self._compute(trainer, step)
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)  # type: ignore[misc]

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if self.on_validation and _fitting(trainer):
            self._trigger.observe(pl_module, modes=_modes_before_validating(trainer))  # (it is in eval mode now)
            self._compute(trainer, trainer.global_step)
        super().on_validation_start(trainer, pl_module)  # type: ignore[misc]

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        n = self.every_n_epochs
        if n is not None and (trainer.current_epoch + 1) % n == 0 and _fitting(trainer):
            self._compute(trainer, trainer.global_step)
        super().on_train_epoch_end(trainer, pl_module)  # type: ignore[misc]

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        if self.on_checkpoint and _fitting(trainer) and self._compute(trainer, trainer.global_step) is not None:
            self._refresh_own_state(checkpoint)
        super().on_save_checkpoint(trainer, pl_module, checkpoint)  # type: ignore[misc]

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        # The module fit() leaves: trainer.test(model), trainer.save_checkpoint() after fit, the weights saved by
        # hand. Training steps after the last computation (val_check_interval not dividing the epoch,
        # check_val_every_n_epoch, max_steps mid-epoch, no validation) left it the moving averages (probe 48:
        # 0.1-0.75 σ / 24-73 % off the float64 truth). Nothing when the last computation is current (the usual
        # validation at the last step).
        if self.at_train_end and _fitting(trainer):
            self._compute(trainer, trainer.global_step)
        super().on_train_end(trainer, pl_module)  # type: ignore[misc]

    @property
    def state_key(self) -> str:
        """Where the Trainer's checkpoints keep this callback's state: the class name and the options
        that say when it computes and what, so that two callbacks of one Trainer (e.g. one before
        validation, one every epoch on other layers) each keep their own (Lightning refuses two
        stateful callbacks with one key, at the Trainer's construction)."""
        options = {name: _stable(getattr(self, name)) for name in _KEYED}
        if self.at_train_end != bool(self.on_validation or self.on_checkpoint):  # (only when not the default: the
            options["on_train_end"] = self.at_train_end  # keys of earlier checkpoints stay as they were)
        return self._generate_state_key(**options)  # type: ignore[attr-defined, no-any-return]

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        # A checkpoint of precisebn 0.1.0, whose state key was the class name alone (Lightning then loads
        # the state by state_key, right after this hook, where there is one).
        states = checkpoint.get("callbacks")
        alone = sum(isinstance(c, type(self)) for c in trainer.callbacks) == 1  # (0.1.0 allowed only one)
        if alone and isinstance(states, dict) and self.state_key not in states:
            state = states.get(type(self).__qualname__)
            if isinstance(state, dict) and state:
                self.load_state_dict(copy.deepcopy(state))
        super().on_load_checkpoint(trainer, pl_module, checkpoint)  # type: ignore[misc]

    def state_dict(self) -> dict[str, Any]:
        return self._scheduler_state()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._load_scheduler_state(state_dict)
        # A computation at the checkpoint's last step came first at that step, in on_train_batch_end (validations and
        # ModelCheckpoint's saves follow it): a scheduled step there was computed already, as in the run not resumed.
        self._last_scheduled_step = self._trigger.last_step


# the options that say when a PreciseBN computes and what (its state key; the same in every run of a script)
_KEYED = (
    "on_validation",
    "on_checkpoint",
    "every_n_train_steps",
    "every_n_epochs",
    "num_samples",
    "num_batches",
    "mode",
    "layers",
    "capture",
    "tolerance",
    "prior",
    "adapt",
    "frozen",
    "data",
    "forward",
)


def _stable(option: Any) -> Any:
    """An option (``layers=``, ``data=``, ``forward=``) as the same text in every run of a script, and as
    different texts for different options where it can tell: a function by where it is defined (lambdas
    included), a class by its qualified name, a collection by its items, data by its type and length."""
    if option is None or isinstance(option, (str, int, float, bool)):
        return option
    if isinstance(option, type):
        return f"{option.__module__}.{option.__qualname__}"
    if isinstance(option, (list, tuple, set, frozenset)):
        items = [_stable(x) for x in option]
        return tuple(sorted(items, key=repr) if isinstance(option, (set, frozenset)) else items)
    code = getattr(option, "__code__", None)
    if code is not None:  # a function or lambda: its module, name, line and a digest of its code (two on one line)
        consts = [c for c in code.co_consts if not hasattr(c, "co_code")]  # (a nested code object's repr has its id)
        body = code.co_code + repr((consts, code.co_names)).encode()
        where = f"{getattr(option, '__module__', '')}.{getattr(option, '__qualname__', '')}:{code.co_firstlineno}"
        return f"{where}:{hashlib.sha256(body).hexdigest()[:8]}"
    description = f"{type(option).__module__}.{type(option).__qualname__}"
    dataset = getattr(option, "dataset", None)  # a DataLoader: its dataset's type and length
    for what in (dataset, option) if dataset is not None else (option,):
        try:
            description += f"[{type(what).__qualname__} of {len(what)}]"
        except TypeError:  # (no length)
            pass
    return description


class AveragingMixin(_Recalibrator):
    """The behaviour of ``PreciseWeightAveraging``, on top of Lightning's ``WeightAveraging``."""

    _log_prefix = "precisebn_averaged"
    _without_layers = "weight averaging goes on as in Lightning's WeightAveraging"

    def _in_dtype(self, batch: Any) -> Any:
        """The batch's floating-point tensors in the averaged copy's dtype where the module's differs: Lightning
        builds the copy before a "64-true"/"bf16-true" precision plugin converts the module, so it stays float32
        while the training loop casts batches to the module's dtype (a probe: a raw "mat1 and mat2 must have the
        same dtype" at the first validation after an average)."""
        copy = self._average_model.module  # type: ignore[attr-defined]
        dtype = next((p.dtype for p in copy.parameters() if p.is_floating_point()), None)
        if dtype is None:
            return batch
        from lightning_utilities.core.apply_func import apply_to_collection

        return apply_to_collection(batch, torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t)

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
        swa_epoch_start: int | None = None,
        device: torch.device | str | int | None = None,
        use_buffers: bool = False,
        progress: bool = False,
        log: bool = True,
        **averaging: Any,
    ) -> None:
        super().__init__(device=device, use_buffers=use_buffers, **averaging)  # type: ignore[call-arg]
        self._init_options(
            num_samples=num_samples,
            num_batches=num_batches,
            data=data,
            forward=forward,
            mode=mode,
            layers=layers,
            progress=progress,
            log=log,
            capture=capture,
            tolerance=tolerance,
            prior=prior,
            adapt=adapt,
            frozen=frozen,
        )
        if swa_epoch_start is not None and (
            isinstance(swa_epoch_start, bool) or not isinstance(swa_epoch_start, int) or swa_epoch_start < 0
        ):
            raise InvalidArgumentError(
                f"swa_epoch_start must be a non-negative integer or None, got {swa_epoch_start!r}"
            )
        self.swa_epoch_start = swa_epoch_start
        self._swapped = False

    def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
        if self.swa_epoch_start is not None:
            return epoch_idx is not None and epoch_idx >= self.swa_epoch_start
        return super().should_update(step_idx=step_idx, epoch_idx=epoch_idx)  # type: ignore[misc]

    @property
    def averaged_model(self) -> nn.Module | None:
        """The ``torch.optim.swa_utils.AveragedModel`` (``None`` outside ``fit``)."""
        return self._average_model  # type: ignore[attr-defined,no-any-return]

    def _averaged_version(self) -> int:
        # The averaged weights change only when AveragedModel.update_parameters()
        # counts one more model (one host read of a scalar, at most once per trigger).
        return int(self._average_model.n_averaged)  # type: ignore[attr-defined]

    def _has_average(self) -> bool:
        """Whether the averaged model holds an average (before the first one, it holds a
        copy of the module's initial weights)."""
        return self._average_model is not None and self._averaged_version() > 0  # type: ignore[attr-defined]

    def _compute_averaged(self, trainer: Any) -> Report | None:
        if not _fitting(trainer) or not self._has_average():
            return None
        return self._compute(trainer, self._averaged_version())

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        super().setup(trainer, pl_module, stage)  # type: ignore[misc]
        if stage == "fit":
            # WeightAveraging keeps when it last averaged from one fit to the next: a callback used again never
            # averaged in its second run (probe 42: n_averaged 0, the trained weights kept, "ended before any
            # average"). Each run starts as a new callback's; a checkpoint's state, restored after setup, goes on.
            self._latest_update_step, self._latest_update_epoch = 0, -1
            self._make_scheduler(trainer, self._average_model.module)  # type: ignore[attr-defined]

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self._trigger.unbind()
        super().teardown(trainer, pl_module, stage)  # type: ignore[misc]

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._trigger.observe(pl_module)  # frozen in the module: frozen in its averaged copy too
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)  # type: ignore[misc]

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        # Before WeightAveraging swaps the averaged weights in (on_validation_epoch_start).
        if _fitting(trainer):
            self._trigger.observe(pl_module, modes=_modes_before_validating(trainer))  # (it is in eval mode now)
        self._compute_averaged(trainer)
        super().on_validation_start(trainer, pl_module)  # type: ignore[misc]

    def on_validation_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        # Without an average yet, validate the live module (as StochasticWeightAveraging
        # does before averaging starts), not the averaged copy's initial weights.
        # The swap and its flag as one hold: on_exception swaps back by the flag, and a Ctrl-C as the swap began,
        # the flag set before it, had on_exception swap the average in (the review of stop 44).
        if self._has_average():
            with signals_held():
                super().on_validation_epoch_start(trainer, pl_module)  # type: ignore[misc]
                self._swapped = True

    def on_validation_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if self._swapped:  # swap back only what on_validation_epoch_start swapped
            with signals_held():  # (a Ctrl-C with the flag down and the swap not done left the average in place)
                super().on_validation_epoch_end(trainer, pl_module)  # type: ignore[misc]
                self._swapped = False

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        # A validation that raised (a metric's bug, the module's forward, Ctrl-C) with the averaged weights swapped in
        # never reached on_validation_epoch_end: the module was left holding the averaged weights and statistics, the
        # averaged copy the live ones (probe 48: weights 1.1-11 off, the copy's statistics 0.44-0.84 σ off its
        # weights' truth; a checkpoint saved on the exception stored the average as the model to resume). Lightning
        # calls on_exception before ModelCheckpoint's own.
        self.on_validation_epoch_end(trainer, pl_module)  # (swaps back only what was swapped)
        super().on_exception(trainer, pl_module, exception)  # type: ignore[misc]

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        # Before WeightAveraging puts the averaged model's state into the checkpoint.
        if self._compute_averaged(trainer) is not None:
            self._refresh_own_state(checkpoint)
        super().on_save_checkpoint(trainer, pl_module, checkpoint)  # type: ignore[misc]
        if "current_model_state" in checkpoint and not self._has_average():
            # No average yet: the weights to use (and those validation measured) are the
            # live module's. The averaging state still goes along, so resuming is unchanged.
            checkpoint["state_dict"] = checkpoint["current_model_state"]

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._average_model is not None and not self._has_average():  # type: ignore[attr-defined]
            if trainer.is_global_zero:
                when = "" if self.swa_epoch_start is None else f" (swa_epoch_start={self.swa_epoch_start})"
                warnings.warn(
                    f"{type(self).__name__}: training ended after {trainer.current_epoch} epochs before any average "
                    f"was taken{when}, so the module keeps its trained weights and statistics; train for more "
                    "epochs or start averaging earlier.",
                    PreciseBNWarning,
                    stacklevel=2,
                )
            return
        # Before WeightAveraging copies the averaged weights and buffers into the module.
        self._compute_averaged(trainer)
        super().on_train_end(trainer, pl_module)  # type: ignore[misc]

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "precisebn": self._scheduler_state()}  # type: ignore[misc]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        ours = state.pop("precisebn", None)
        if ours is not None:
            self._load_scheduler_state(ours)
        super().load_state_dict(state)  # type: ignore[misc]


def _logging_step(trainer: Any) -> int:
    """The step Lightning logs ``self.log`` metrics at (its logger connector's: the training batches that stepped,
    which a validation at the end of an epoch is logged at before the count moves on; an epoch's own metrics one
    below it, logged after the epoch's ``on_train_epoch_end`` hooks — while the loop counts the epoch processed but
    not completed, which is when a computation there, or a checkpoint's that a callback saves there, runs), so that
    each computation's figures share a row with the metrics of the validation or the epoch they were computed for;
    ``global_step`` was one ahead there (probe 41). ``global_step`` where that count is not found."""
    fit_loop = getattr(trainer, "fit_loop", None)
    count = getattr(getattr(fit_loop, "epoch_loop", None), "_batches_that_stepped", None)
    if not isinstance(count, int):
        return int(trainer.global_step)
    progress = getattr(getattr(fit_loop, "epoch_progress", None), "current", None)
    processed, completed = getattr(progress, "processed", 0), getattr(progress, "completed", 0)
    epoch_end = isinstance(processed, int) and isinstance(completed, int) and processed > completed
    return max(0, count - 1) if epoch_end else count
