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
before every validation and every checkpoint, at most once per iteration.

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
from ..layers import LayerSelection
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
            moment, counted as ``N`` samples, with the measured ones).
        frozen: Layers the model keeps in eval mode while it trains (frozen for
            training, e.g. ``norm_eval=True``; noted after every training step):
            ``"skip"`` (default) leaves them as they are, ``"include"`` recalibrates
            them too.
        before_val, before_save: Compute before validations / checkpoints.
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
        progress: bool = False,
        log: bool = True,
        priority: str | int | None = None,
    ) -> None:
        self.interval = check_every("interval", interval)
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
        self.num_samples = num_samples
        self.compute_before_val = before_val
        self.compute_before_save = before_save
        self.log = log
        if priority is not None:
            self.priority = priority
        self._training = False
        self._iter_ending = False  # inside after_train_iter, before the loop counts the iteration
        self._warned_alone = False

    # -- binding ----------------------------------------------------------------------

    def before_run(self, runner: Any) -> None:
        # Every run of a Runner (train, val, test) starts here. A training run that raised never reached after_train:
        # its flags stayed up, and the same hook in another Runner's val() or test() computed on that run's model
        # (probe 42). Training binds again in before_train.
        self._training = self._iter_ending = False

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

        self._trigger.bind(model, batches, forward=mm_forward, progress=self._trigger.progress and runner.rank == 0)
        self._training = True

    def after_train(self, runner: Any) -> None:
        self._training = self._iter_ending = False
        self._trigger.unbind()

    # -- when -------------------------------------------------------------------------

    def _step(self, runner: Any) -> int:
        # In after_train_iter the loop has not counted the finished iteration yet.
        return int(runner.iter) + (1 if self._iter_ending else 0)

    def before_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None) -> None:
        self._iter_ending = False

    def after_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None, outputs: Any = None) -> None:
        self._iter_ending = True
        self._trigger.observe()  # the layers the model keeps in eval mode while training (norm_eval): frozen
        n = self.interval
        if (
            n is not None
            and isinstance(runner.train_loop, _loops.IterBasedTrainLoop)
            and self.every_n_train_iters(runner, n)
        ):
            self._compute(runner)

    def after_train_epoch(self, runner: Any) -> None:
        self._iter_ending = False
        n = self.interval
        if (
            n is not None
            and isinstance(runner.train_loop, _loops.EpochBasedTrainLoop)
            and self.every_n_epochs(runner, n)
        ):
            self._compute(runner)

    def before_val(self, runner: Any) -> None:
        self._iter_ending = False
        if self.compute_before_val and self._training:
            self._compute(runner)

    def before_save_checkpoint(self, runner: Any, checkpoint: dict[str, Any]) -> None:
        if not (self.compute_before_save and self._training):
            return
        if runner.world_size > 1:  # saving runs on rank 0 alone: a computation there would wait for the others
            if not self._trigger.is_current(self._step(runner)) and not self._warned_alone:
                self._warned_alone = True
                warnings.warn(
                    f"{type(self).__name__}: with {runner.world_size} processes mmengine saves checkpoints on rank 0 "
                    "alone, where a computation (which merges all ranks) cannot run; this checkpoint holds the "
                    "statistics of the last computation. Make checkpoints fall on computations: the hook's "
                    "interval, or right after validation (before_val computes on every rank).",
                    PreciseBNWarning,
                    stacklevel=2,
                )
            return
        report = self._compute(runner)
        state = checkpoint.get("state_dict")
        if report is None or not isinstance(state, dict) or self._trigger.scheduler is None:
            return
        # The checkpoint's state_dict was taken before this computation; on CPU it holds
        # the buffers themselves (written in place), elsewhere CPU copies: refresh those,
        # under every name of a layer (one registered under two parents has two).
        for key, value in _new_statistics(self._trigger.scheduler.model, report):
            if key in state and value is not None and state[key] is not value:
                state[key] = value.detach().cpu()

    # -- computing --------------------------------------------------------------------

    def _compute(self, runner: Any) -> Report | None:
        step = self._step(runner)
        report = self._trigger.compute(step, warn=runner.rank == 0)
        if report is not None and self._trigger.scheduler is not None:
            _share_with_ema(runner, self._trigger.scheduler.model, report)
        if report is not None and self.log:
            metrics = report_metrics(report)
            for key, value in metrics.items():
                runner.message_hub.update_scalar(f"train/{key}", value)
            with contextlib.suppress(Exception):  # logging never fails training
                runner.logger.info(
                    f"{type(self).__name__}: exact statistics of {len(report.updated)} layers from "
                    f"{report.samples} samples at iteration {step} in {report.seconds:.2f} s"
                )
        return report


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
