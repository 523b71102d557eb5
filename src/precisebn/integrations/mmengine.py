"""An mmengine hook for OpenMMLab's Runner (``pip install 'precisebn[mmengine]'``).

:class:`ExactPreciseBNHook` is registered in mmengine's ``HOOKS`` registry when this
module is imported, so a config turns it on with::

    custom_imports = dict(imports=["precisebn.integrations.mmengine"], allow_failed_imports=False)
    custom_hooks = [dict(type="ExactPreciseBNHook", num_samples=8192, interval=1)]

It takes mmpretrain's ``PreciseBNHook`` options (``num_samples``, ``interval``), so an
existing config switches by changing ``type``; :func:`register_mmpretrain_name`
registers it under mmpretrain's name ``"PreciseBNHook"`` as well, for configs that
cannot be edited. Unlike that hook, it stores the exact population statistics (not the
mean of per-batch variances), refuses bad options with an error rather than an
``assert``, never leaves the model half-modified, merges ranks exactly, and computes
before every validation and every checkpoint, at most once per iteration. With an
``EMAHook``, the EMA weights are validated, tested and saved with statistics of their own
(``ema="own"``).

Example:
    >>> import tempfile, torch
    >>> from mmengine.model import BaseModel
    >>> from mmengine.runner import Runner
    >>> from precisebn.integrations.mmengine import ExactPreciseBNHook
    >>> class Net(BaseModel):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
    ...     def forward(self, inputs, data_samples=None, mode="tensor"):
    ...         out = self.net(inputs).squeeze(1)
    ...         return {"loss": torch.nn.functional.mse_loss(out, data_samples)} if mode == "loss" else out
    >>> data = [{"inputs": torch.randn(4), "data_samples": torch.randn(())} for _ in range(64)]
    >>> hook = ExactPreciseBNHook(num_samples="all", interval=1)
    >>> work_dir = tempfile.mkdtemp()
    >>> runner = Runner(Net(), work_dir, train_dataloader=torch.utils.data.DataLoader(data, batch_size=16),
    ...                 train_cfg=dict(by_epoch=True, max_epochs=2),
    ...                 optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.1)),
    ...                 custom_hooks=[hook], default_hooks=dict(checkpoint=None), log_level="ERROR")
    >>> _ = runner.train()
    >>> hook.computations, hook.last_step  # at the end of each epoch
    (2, 8)
    >>> import shutil; shutil.rmtree(work_dir)
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable
from typing import Any, Literal

from torch import nn

from .._optional import require
from ..data import Forward
from ..errors import InvalidArgumentError, PreciseBNWarning
from ..layers import LayerSelection
from ..loaders import independent
from ..report import Report
from ..scheduler import Data, MappedBatches, fresh_batches
from ._mmengine_ema import EmaStatistics, share_with_ema
from ._trigger import Trigger, TriggerState, check_every, report_metrics

_hooks = require("mmengine.hooks", "mmengine", "precisebn.integrations.mmengine")
_registry = require("mmengine.registry", "mmengine", "precisebn.integrations.mmengine")
_wrappers = require("mmengine.model", "mmengine", "precisebn.integrations.mmengine")
_loops = require("mmengine.runner", "mmengine", "precisebn.integrations.mmengine")

__all__ = ["ExactPreciseBNHook", "register_mmpretrain_name"]


def mm_forward(model: nn.Module, data: Any) -> Any:
    """mmengine's call convention for a preprocessed batch: ``model(**data, mode="tensor")``
    for a dict, ``model(*data, mode="tensor")`` for a tuple/list (``BaseModel._run_forward``)."""
    if isinstance(data, dict):
        return model(**data, mode="tensor")
    if isinstance(data, (tuple, list)):
        return model(*data, mode="tensor")
    raise InvalidArgumentError(
        f"the model's data_preprocessor returned a {type(data).__name__}; mmengine models expect a dict, tuple or "
        "list. Pass forward=lambda model, data: ... to ExactPreciseBNHook."
    )


@_registry.HOOKS.register_module()
class ExactPreciseBNHook(TriggerState, _hooks.Hook):  # type: ignore[misc,name-defined]
    """Recomputes exact precise statistics during ``runner.train()``.

    Every BatchNorm-style layer's ``running_mean``/``running_var`` becomes the exact
    population mean/variance of its inputs over ``num_samples`` training samples (see
    :func:`precisebn.recalibrate`), computed:

    * every ``interval`` epochs (``EpochBasedTrainLoop``, at the end of the epoch) or
      every ``interval`` iterations (``IterBasedTrainLoop``), as mmpretrain's
      ``PreciseBNHook`` does;
    * before every validation during training (``before_val``);
    * before every checkpoint saved during training (``before_save_checkpoint``: the
      checkpoint gets the new statistics);

    and at most once per iteration (``runner.iter``): an epoch end, its checkpoint and
    its validation share one computation.

    Batches come from the runner's training dataloader, go through the model's
    ``data_preprocessor(batch, training=False)`` (as mmpretrain's hook does: no batch
    augmentations) and into ``model(**data, mode="tensor")`` under
    ``torch.no_grad()``. Gradients, the optimizer, training flags and the random number
    generators (the global ones and the dataloader's own) are left as they were, so
    training is the same as without the hook. A model without normalization layers gets
    one :class:`~precisebn.errors.PreciseBNWarning` and no computation. If the data or
    the model fails, the model is left unchanged and the error propagates out of
    ``runner.train()``. With several processes every rank measures its shard and all
    end with identical statistics over the union (``num_samples`` is the total).

    Each computation logs one line through ``runner.logger`` and puts
    ``train/precisebn/{mean_shift,max_mean_shift,var_ratio,seconds,samples}`` in
    ``runner.message_hub`` (LoggerHook then writes them with the training logs).

    With mmengine's ``EMAHook`` following the model, validation runs the EMA weights
    and the checkpoint's ``state_dict`` holds them (the model's weights go under
    ``ema_state_dict``). With ``ema="own"`` (the default) the EMA weights get statistics
    of their own: before every validation and checkpoint (and at each epoch-based
    ``interval``), once ``EMAHook`` has begun averaging, the EMA module's
    ``running_mean``/``running_var`` become the exact float64 population mean/variance
    of each layer's inputs when the *EMA weights* run over the same batches, as for the
    model (same options, forward call, frozen layers: those of the model trained).
    Contract:

    * validation (``EMAHook``'s swap in ``before_val_epoch`` to its swap back in
      ``after_val_epoch``) runs the EMA weights with those statistics; with
      ``update_buffers=False`` (``EMAHook``'s default, which swaps parameters alone)
      this hook swaps the statistics too, and back, so that afterwards the model's
      buffers are bitwise what they were (training goes on with its own statistics);
    * a validation that raises (the model, a metric, ``KeyboardInterrupt``) gets no
      ``after_val_epoch`` from mmengine: the statistics are swapped back as the error
      leaves the loop's ``run()``, so the model's buffers are bitwise its own and the
      EMA module's its own (``EMAHook`` leaves its parameters swapped: the model then
      holds the EMA weights, which ``ema_hook._swap_ema_parameters()`` puts back);
    * outside training (``runner.test()``, ``runner.val()``), where ``EMAHook`` swaps its
      parameters in too, the statistics its module holds are swapped in beside them,
      and back (with ``update_buffers=False``; nothing is computed). Resumed from a
      checkpoint, those are the EMA weights' own; loaded without resuming, or on a
      runner that trained (``EMAHook`` copies the model again), the model and the EMA
      module are one state and the test runs it;
    * a checkpoint's ``state_dict`` holds the EMA weights with their statistics and
      ``ema_state_dict`` the model's weights with the model's (swapped back on resume,
      as ``EMAHook`` swaps them), whichever of the two hooks runs first;
    * the model's and the EMA weights' computations are one transaction: a failure in
      either (the data, the model, ``KeyboardInterrupt``) leaves both bitwise as they
      were, and propagates;
    * cost: a second computation (the forward passes of a recalibration of the EMA
      weights), at most once per iteration; none before ``EMAHook`` begins
      (``begin_iter``/``begin_epoch``), when its module is a copy of the model, whose
      statistics are copied.

    With ``update_buffers=True`` the EMA module's averaged buffers are replaced by the
    exact statistics, and averaged on from there. ``ema="copy"`` copies the model's
    statistics into the EMA module instead (the behaviour before this option): the EMA
    weights are validated and saved with the statistics of the model's weights (measured
    0.05-1.8 σ off in the mean and 9 %-390 % in the variance, the more the further the
    average lags behind the weights). An iteration-based ``interval`` computes the model's statistics
    alone (``EMAHook`` averages that iteration's weights after this hook); several
    ``EMAHook`` on one model get ``"copy"`` with a warning.

    Args:
        num_samples: Training samples to measure on, over all ranks (``"all"``: a whole
            pass). Default 8192, as mmpretrain's.
        interval: Compute every ``interval`` epochs (epoch-based loops) or iterations
            (iteration-based loops); ``None`` for only before validation/checkpoints.
        num_batches: Or a number of batches per rank.
        data: Batches to measure on instead of the training dataloader, in its format.
        forward: ``forward(model, data)`` on the preprocessed batch; default
            ``model(**data, mode="tensor")``.
        mode: ``"norm"`` (only normalization layers in training mode) or ``"train"``.
        layers: Which layers (names, types or a predicate); default all.
        capture, tolerance, prior, adapt: As for :func:`precisebn.recalibrate`
            (``prior=N``: each computation pools the statistics the layers hold at that
            moment, counted as ``N`` samples, with the measured ones; with ``ema="own"``
            the EMA module's computation pools what it holds: with
            ``update_buffers=False`` ``EMAHook``'s copy of the model's moving averages,
            with ``True`` its averages).
        frozen: Layers the model keeps in eval mode while it trains (frozen for
            training, e.g. ``norm_eval=True``; noted after every training step):
            ``"skip"`` (default) leaves them as they are, ``"include"`` recalibrates
            them too.
        before_val, before_save: Compute before validations / checkpoints.
        ema: With an ``EMAHook``: ``"own"`` (default) gives the EMA weights the exact
            statistics of their own inputs, ``"copy"`` the model's (see above). The
            default is the one whose validation and checkpoints hold statistics
            measured with the weights they go with, which is what precise statistics
            are for; ``"copy"`` halves the cost where the EMA weights are close to the
            model's.
        progress: A progress bar on rank 0 (``precisebn[progress]``).
        log: Log each computation's figures.
        priority: The hook's priority; ``"ABOVE_NORMAL"`` runs it before
            ``CheckpointHook`` and ``EMAHook`` in the same hook points.
    """

    priority = "ABOVE_NORMAL"

    def __init__(
        self,
        num_samples: int | Literal["all"] | None = 8192,
        interval: int | None = 1,
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
        before_val: bool = True,
        before_save: bool = True,
        ema: Literal["own", "copy"] = "own",
        progress: bool = False,
        log: bool = True,
        priority: str | int | None = None,
    ) -> None:
        self.interval = check_every("interval", interval)
        if not isinstance(ema, str) or ema not in ("own", "copy"):
            raise InvalidArgumentError(f"ema must be 'own' or 'copy', got {ema!r}")
        options: dict[str, Any] = {
            "num_samples": num_samples,
            "num_batches": num_batches,
            "forward": forward,
            "mode": mode,
            "layers": layers,
            "capture": capture,
            "tolerance": tolerance,
            "prior": prior,
            "adapt": adapt,
            "frozen": frozen,
            "progress": progress,
            "data": data,
        }
        self._trigger = Trigger(type(self).__name__, **options)
        # the same computation, of the EMA weights in the module of the EMAHook that follows the model (ema="own"),
        # and the swap of the statistics for validation and tests
        self._ema_stats = EmaStatistics(type(self).__name__, options, ema)
        self.ema = ema
        self.num_samples = num_samples
        self.compute_before_val = before_val
        self.compute_before_save = before_save
        self.log = log
        if priority is not None:
            self.priority = priority
        self._training = False
        # runner.iter in after_train_iter (the loop counts the iteration after its hooks): the same number later is
        # still that iteration's end (its checkpoint), another is not — whatever this hook's priority (at "LOWEST"
        # the epoch's checkpoint came before this hook's after_train_epoch, which alone said the iteration had been
        # counted: it computed at iteration 5 for the end of iteration 4, then again at 4)
        self._iter_ending: int | None = None
        self._warned_alone = False

    # -- binding ----------------------------------------------------------------------

    def before_run(self, runner: Any) -> None:
        # Every run of a Runner (train, val, test) starts here. A training run that raised never reached after_train:
        # its flags stayed up, and the same hook in another Runner's val() or test() computed on that run's model
        # (probe 42). Training binds again in before_train. The loops this run built swap the EMA statistics back
        # if they raise (mmengine calls no hook then); a swap still in place (a loop run some other way) goes back.
        self._training, self._iter_ending = False, None
        self._ema_stats.reset()
        self._ema_stats.guard(runner)

    def before_train(self, runner: Any) -> None:
        model = runner.model.module if _wrappers.is_model_wrapper(runner.model) else runner.model
        source = self._trigger.data if self._trigger.data is not None else runner.train_dataloader
        preprocess = getattr(model, "data_preprocessor", None)
        independent(source)  # a loader that cannot be read beside training is refused now, not at the first computation

        def batches() -> Iterable[Any]:
            fresh = fresh_batches(source)
            if preprocess is None:
                return fresh
            return MappedBatches(fresh, lambda batch: preprocess(batch, False))

        progress = self._trigger.progress and runner.rank == 0
        self._trigger.bind(model, batches, forward=mm_forward, progress=progress)
        self._ema_stats.bind(runner, model, batches, mm_forward, progress)
        self._training = True

    def after_train(self, runner: Any) -> None:
        self._ema_stats.swap_back()
        self._training, self._iter_ending = False, None
        self._trigger.unbind()
        self._ema_stats.unbind()

    # -- when -------------------------------------------------------------------------

    def _step(self, runner: Any) -> int:
        # In after_train_iter the loop has not counted the finished iteration yet.
        it = int(runner.iter)
        return it + 1 if self._iter_ending == it else it

    def before_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None) -> None:
        self._iter_ending = None

    def after_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None, outputs: Any = None) -> None:
        self._iter_ending = int(runner.iter)
        self._trigger.observe()  # the layers the model keeps in eval mode while training (norm_eval): frozen
        if self._trigger.scheduler is not None:
            self._ema_stats.trigger.observe(self._trigger.scheduler.model)  # (the EMA module's are those of the model)
        n = self.interval
        if (
            n is not None
            and isinstance(runner.train_loop, _loops.IterBasedTrainLoop)
            and self.every_n_train_iters(runner, n)
        ):
            # (not the EMA weights: EMAHook averages this iteration's weights in after_train_iter, after this hook at
            # the default priorities; they are computed before the next validation or checkpoint)
            self._compute(runner, ema=False)

    def after_train_epoch(self, runner: Any) -> None:
        self._iter_ending = None
        n = self.interval
        if (
            n is not None
            and isinstance(runner.train_loop, _loops.EpochBasedTrainLoop)
            and self.every_n_epochs(runner, n)
        ):
            self._compute(runner)

    def before_val(self, runner: Any) -> None:
        self._iter_ending = None
        if not self._training:
            self._ema_stats.arm_held(runner)  # (runner.val(): nothing computed)
            return
        if self.compute_before_val:
            self._compute(runner)
        if self._trigger.scheduler is not None:
            self._ema_stats.arm(self._trigger.scheduler.model, self._step(runner))

    def before_val_epoch(self, runner: Any) -> None:
        # EMAHook (update_buffers=False) swaps the parameters alone here: the statistics are swapped here too, so
        # that validation runs the EMA weights with their own; after_val_epoch swaps them back, bitwise (and so
        # does the loop if it raises).
        self._ema_stats.swap_in()

    def after_val_epoch(self, runner: Any, metrics: Any = None) -> None:
        self._ema_stats.swap_back()

    def after_val(self, runner: Any) -> None:
        self._ema_stats.swap_back()

    def before_test(self, runner: Any) -> None:
        self._ema_stats.arm_held(runner)  # (EMAHook swaps its parameters in for tests too; nothing computed)

    def before_test_epoch(self, runner: Any) -> None:
        self._ema_stats.swap_in()

    def after_test_epoch(self, runner: Any, metrics: Any = None) -> None:
        self._ema_stats.swap_back()

    def after_test(self, runner: Any) -> None:
        self._ema_stats.swap_back()

    def before_save_checkpoint(self, runner: Any, checkpoint: dict[str, Any]) -> None:
        # (a best checkpoint saved in after_val_epoch by a hook that runs before this one there)
        self._ema_stats.swap_back()
        if not (self.compute_before_save and self._training):
            return
        step = self._step(runner)
        if runner.world_size > 1:  # saving runs on rank 0 alone: a computation there would wait for the others
            stale = not self._trigger.is_current(step) or self._ema_stats.stale(step)
            if stale and not self._warned_alone:
                self._warned_alone = True
                warnings.warn(
                    f"{type(self).__name__}: with {runner.world_size} processes mmengine saves checkpoints on rank 0 "
                    "alone, where a computation (which merges all ranks) cannot run; this checkpoint holds the "
                    "statistics of the last computation (of the model's weights, and of the EMA weights with "
                    "ema='own'). Make checkpoints fall on computations: the hook's interval in epochs, or right "
                    "after validation (before_val computes on every rank).",
                    PreciseBNWarning,
                    stacklevel=2,
                )
            return
        report = self._compute(runner)
        if self._trigger.scheduler is not None:
            self._ema_stats.fill_checkpoint(checkpoint, self._trigger.scheduler.model, report, step)

    # -- computing --------------------------------------------------------------------

    def _compute(self, runner: Any, *, ema: bool = True) -> Report | None:
        """Computes the model's statistics, and (``ema``: the EMA weights are this step's) those of the EMA
        weights with ``ema="own"``, as one transaction."""
        step = self._step(runner)
        ema_report = None
        if ema and self._ema_stats.source() is not None:
            report, ema_report = self._ema_stats.compute(self._trigger, step, warn=runner.rank == 0)
        else:
            report = self._trigger.compute(step, warn=runner.rank == 0)
            if report is not None and self._trigger.scheduler is not None:
                share_with_ema(runner, self._trigger.scheduler.model, report)
        if self.log:
            done_both = ((report, "precisebn", ""), (ema_report, "precisebn_ema", " of the EMA weights"))
            for done, prefix, weights in done_both:
                if done is None:
                    continue
                for key, value in report_metrics(done, prefix).items():
                    runner.message_hub.update_scalar(f"train/{key}", value)
                with contextlib.suppress(Exception):  # logging never fails training
                    runner.logger.info(
                        f"{type(self).__name__}: exact statistics{weights} of {len(done.updated)} layers from "
                        f"{done.samples} samples at iteration {step} in {done.seconds:.2f} s"
                    )
        return report


def register_mmpretrain_name(registry: Any = None, *, force: bool = False) -> None:
    """Registers :class:`ExactPreciseBNHook` also under mmpretrain's name ``"PreciseBNHook"``.

    Args:
        registry: Where to register: mmengine's root ``HOOKS`` by default (configs
            without a scope, or whose scope's registry does not define the name); pass
            ``mmpretrain.registry.HOOKS`` with ``force=True`` to replace mmpretrain's
            own hook in mmpretrain configs.
        force: Replace an existing ``"PreciseBNHook"`` in that registry.

    Raises:
        KeyError: The registry already has a ``"PreciseBNHook"`` and ``force`` is false
            (mmengine's own error).
    """
    target = _registry.HOOKS if registry is None else registry
    if target.get("PreciseBNHook") is ExactPreciseBNHook:
        return
    target.register_module(name="PreciseBNHook", module=ExactPreciseBNHook, force=force)
