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
``EMAHook``, the EMA weights are validated and saved with statistics of their own
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

import torch
from torch import Tensor, nn

from .._optional import require
from ..checkpoint import buffer_names
from ..data import Forward
from ..errors import InvalidArgumentError, PreciseBNWarning
from ..interrupts import signals_held
from ..layers import LayerSelection, has_running_stats
from ..loaders import independent
from ..report import Report
from ..scheduler import Data, MappedBatches, fresh_batches
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
        # the same computation, of the EMA weights in the module of the EMAHook that follows the model (ema="own")
        self._ema_trigger = Trigger(f"{type(self).__name__} (EMA weights)", **options)
        self.ema = ema
        self._ema_hook: Any = None  # the EMAHook whose module _ema_trigger is bound to (ema="own", one EMAHook)
        self._ema_armed: list[tuple[Tensor, Tensor]] | None = None  # (live, EMA) buffers to swap for validation
        self._ema_swapped: list[tuple[Tensor, Tensor]] | None = None  # swapped now, until validation ends
        self._warned_several = False
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
        # (probe 42). Training binds again in before_train. (A validation that raised left its swap where EMAHook
        # left its own: the model's buffers are not put back under the parameters EMAHook did not put back.)
        self._training, self._iter_ending = False, None
        self._ema_armed = self._ema_swapped = None

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
        self._bind_ema(runner, model, batches, progress)
        self._training = True

    def _bind_ema(self, runner: Any, model: nn.Module, batches: Any, progress: bool) -> None:
        """With ``ema="own"`` and one ``EMAHook`` following ``model`` (built in its ``before_run``, before this):
        binds the second trigger to its EMA module, frozen layers read off ``model`` (the one trained)."""
        self._ema_hook = None
        self._ema_trigger.unbind()
        if self.ema != "own":
            return
        hooks = _ema_hooks(runner, model)
        if len(hooks) > 1:
            if not self._warned_several:
                self._warned_several = True
                warnings.warn(
                    f"{type(self).__name__}: {len(hooks)} EMAHooks follow the model; ema='own' computes the "
                    "statistics of one EMA module only, so none is computed: each EMA module gets the model's "
                    "statistics (ema='copy'). Use one EMAHook.",
                    PreciseBNWarning,
                    stacklevel=2,
                )
            return
        if hooks:
            ema_module = hooks[0].ema_model.module
            scheduler = self._ema_trigger.bind(ema_module, batches, forward=mm_forward, progress=progress)
            scheduler.trains(model)
            self._ema_hook = hooks[0]

    def after_train(self, runner: Any) -> None:
        self._unswap()
        self._training, self._iter_ending = False, None
        self._trigger.unbind()
        self._ema_trigger.unbind()
        self._ema_hook = None

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
            self._ema_trigger.observe(self._trigger.scheduler.model)  # (the EMA module's are those of the model)
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
        self._ema_armed = None
        if not self._training:
            return
        if self.compute_before_val:
            self._compute(runner)
        self._ema_armed = self._ema_pairs(self._step(runner))

    def before_val_epoch(self, runner: Any) -> None:
        # EMAHook (update_buffers=False) swaps the parameters alone here: the buffers are swapped here too, so that
        # validation runs the EMA weights with their own statistics (the two swaps touch different tensors: either
        # order gives the same); after_val_epoch swaps them back, bitwise.
        pairs, self._ema_armed = self._ema_armed, None
        if pairs:
            _swap(pairs)
            self._ema_swapped = pairs

    def after_val_epoch(self, runner: Any, metrics: Any = None) -> None:
        self._unswap()

    def after_val(self, runner: Any) -> None:
        self._unswap()

    def _unswap(self) -> None:
        pairs = self._ema_swapped
        if pairs:
            with signals_held():
                _swap(pairs)
                self._ema_swapped = None

    def before_save_checkpoint(self, runner: Any, checkpoint: dict[str, Any]) -> None:
        self._unswap()  # (a best checkpoint saved in after_val_epoch by a hook that runs before this one there)
        if not (self.compute_before_save and self._training):
            return
        step = self._step(runner)
        if runner.world_size > 1:  # saving runs on rank 0 alone: a computation there would wait for the others
            stale = not self._trigger.is_current(step) or (
                self._ema_source() is not None and not self._ema_trigger.is_current(step)
            )
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
        state = checkpoint.get("state_dict")
        scheduler = self._trigger.scheduler
        if not isinstance(state, dict) or scheduler is None:
            return
        own, ema_state = self._ema_current(step), checkpoint.get("ema_state_dict")
        if own is not None and isinstance(ema_state, dict):
            # EMAHook ran first (a priority above this hook's): it swapped the state_dicts, so that state_dict holds
            # the EMA module's tensors and ema_state_dict's "module.*" the model's. Each gets its own statistics.
            if report is not None:
                _refresh(ema_state, _new_statistics(scheduler.model, report), prefix="module.")
            hook, ema_report = own
            _refresh(state, _new_statistics(hook.ema_model.module, ema_report))
            return
        # Otherwise EMAHook (if any) comes next: it takes the EMA module's buffers, which hold the EMA weights'
        # statistics (ema="own") or the model's (copied), and swaps them with these.
        if report is not None:
            # The checkpoint's state_dict was taken before this computation; on CPU it holds
            # the buffers themselves (written in place), elsewhere CPU copies: refresh those,
            # under every name of a layer (one registered under two parents has two).
            _refresh(state, _new_statistics(scheduler.model, report))

    # -- computing --------------------------------------------------------------------

    def _ema_source(self) -> Any:
        """The ``EMAHook`` whose EMA weights get statistics of their own (``ema="own"``), or ``None``: none,
        several, or one that has not begun averaging — before ``begin_iter``/``begin_epoch`` it copies the whole
        model into its module after each iteration, so the model's statistics are those of its weights."""
        hook, scheduler = self._ema_hook, self._ema_trigger.scheduler
        if hook is None or scheduler is None:
            return None
        ema = getattr(hook, "ema_model", None)
        if getattr(ema, "module", None) is not scheduler.model:
            return None
        steps = getattr(ema, "steps", None)
        if isinstance(steps, Tensor) and int(steps) == 0:
            return None
        return hook

    def _ema_current(self, step: int) -> tuple[Any, Report] | None:
        """The ``EMAHook`` and the report of the EMA weights' statistics, if its module holds them for ``step``."""
        hook, report = self._ema_source(), self._ema_trigger.last_report
        if hook is None or report is None or not self._ema_trigger.is_current(step):
            return None
        return hook, report

    def _ema_pairs(self, step: int) -> list[tuple[Tensor, Tensor]] | None:
        """The (model, EMA module) statistics to swap for validation at ``step``: where the EMA module holds its
        weights' statistics and ``EMAHook`` swaps the parameters alone (``update_buffers=False``)."""
        own = self._ema_current(step)
        scheduler = self._trigger.scheduler
        if own is None or scheduler is None or getattr(own[0].ema_model, "update_buffers", False):
            return None
        hook, report = own
        pairs, seen = [], set()
        for key, value in _new_statistics(hook.ema_model.module, report):
            owner, _, buffer = key.rpartition(".")
            try:
                target = getattr(scheduler.model.get_submodule(owner), buffer, None)
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

    def _compute(self, runner: Any, *, ema: bool = True) -> Report | None:
        """Computes the model's statistics, and (``ema``: the EMA weights are this step's) those of the EMA
        weights with ``ema="own"``, as one transaction."""
        step = self._step(runner)
        source = self._ema_source() if ema else None
        ema_report = None
        if source is None:
            report = self._trigger.compute(step, warn=runner.rank == 0)
            if report is not None and self._trigger.scheduler is not None:
                _share_with_ema(runner, self._trigger.scheduler.model, report)
        else:
            report, ema_report = self._compute_both(step, warn=runner.rank == 0)
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

    def _compute_both(self, step: int, *, warn: bool) -> tuple[Report | None, Report | None]:
        """The model's computation, then the EMA module's; if either fails (the data, the model, a
        ``KeyboardInterrupt``), both are left bitwise as they were and the error propagates."""
        scheduler = self._trigger.scheduler
        if scheduler is None:
            return None, None
        kept = [(b, b.clone()) for b in _statistics_of(scheduler.model)]
        state = {k: scheduler.__dict__[k] for k in _SCHEDULER_STATE if k in scheduler.__dict__}
        last = self._trigger._last_report
        try:
            report = self._trigger.compute(step, warn=warn)
            return report, self._ema_trigger.compute(step, warn=False)  # (recalibrate: the EMA module unchanged)
        except BaseException:
            with torch.no_grad(), signals_held():
                for buffer, value in kept:
                    buffer.copy_(value)
                scheduler.__dict__.update(state)
                self._trigger._last_report = last
            raise


_SCHEDULER_STATE = ("_last_step", "_stale", "_last_report", "_weights", "_statistics", "_computations")


def _statistics_of(model: nn.Module) -> list[Tensor]:
    """The running statistics of every normalization layer of ``model`` (once each)."""
    found: dict[int, Tensor] = {}
    for module in model.modules():
        if has_running_stats(module):
            for name in ("running_mean", "running_var"):
                buffer = getattr(module, name, None)
                if isinstance(buffer, Tensor):
                    found.setdefault(id(buffer), buffer)
    return list(found.values())


def _swap(pairs: list[tuple[Tensor, Tensor]]) -> None:
    """Exchanges the values of each pair of tensors, bitwise, all or none (signals held)."""
    with torch.no_grad(), signals_held():
        for a, b in pairs:
            kept = a.clone()
            a.copy_(b)
            b.copy_(kept)


def _refresh(state: dict[str, Any], new: list[tuple[str, Tensor | None]], prefix: str = "") -> None:
    """Puts the ``new`` statistics into a checkpoint's ``state`` under ``prefix + key`` where it holds other
    tensors (CPU copies of a model on a GPU)."""
    for key, value in new:
        name = prefix + key
        if name in state and value is not None and state[name] is not value:
            state[name] = value.detach().cpu()


def _ema_hooks(runner: Any, model: nn.Module) -> list[Any]:
    """The ``EMAHook``s of ``runner`` that follow ``model`` (``src_model``), with an EMA module."""
    return [
        hook
        for hook in getattr(runner, "hooks", ())
        if isinstance(hook, _hooks.EMAHook)
        and getattr(hook, "src_model", None) is model
        and isinstance(getattr(getattr(hook, "ema_model", None), "module", None), nn.Module)
    ]


def _share_with_ema(runner: Any, model: nn.Module, report: Report) -> None:
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
    for hook in getattr(runner, "hooks", ()):
        ema = getattr(hook, "ema_model", None)
        if not isinstance(hook, _hooks.EMAHook) or getattr(hook, "src_model", None) is not model or ema is None:
            continue
        if not isinstance(getattr(ema, "module", None), nn.Module):
            continue
        if getattr(ema, "update_buffers", True):
            # (begun: update_parameters ran — not EMAHook's clock, which in before_val already answers for the
            # next epoch or iteration, a review found: 1.6 σ off in the mean at the first validation)
            steps = getattr(ema, "steps", None)
            if not isinstance(steps, Tensor) or int(steps) > 0:
                continue
        new = _new_statistics(model, report) if new is None else new
        with torch.no_grad(), signals_held():
            for key, value in new:
                owner, _, buffer = key.rpartition(".")
                try:
                    target = getattr(ema.module.get_submodule(owner), buffer, None)
                except AttributeError:
                    continue
                if isinstance(value, Tensor) and isinstance(target, Tensor) and target.shape == value.shape:
                    target.copy_(value)


def _new_statistics(model: nn.Module, report: Report) -> list[tuple[str, Tensor | None]]:
    """The running statistics ``report`` wrote, under every name of their layer (one registered under two
    parents has two): ``(state_dict key, the buffer now)``."""
    found = []
    for key in buffer_names(model, report.updated, ("running_mean", "running_var")):
        owner, _, buffer = key.rpartition(".")
        found.append((key, getattr(model.get_submodule(owner), buffer, None)))
    return found


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
