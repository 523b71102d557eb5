"""Lightning callbacks (the ``lightning`` package, ``lightning.pytorch``).

* :class:`PreciseBN` recomputes the model's precise statistics on the training data
  before every validation loop and before every checkpoint of ``trainer.fit()`` — at
  most once per ``global_step``, so a validation and a checkpoint at the same step share
  one computation.
* :class:`PreciseWeightAveraging` is Lightning's ``WeightAveraging`` (SWA or EMA of the
  weights) with the averaged model's statistics recomputed by precisebn — no extra
  training epoch, no optimizer involvement, any iterable of batches. It replaces
  ``StochasticWeightAveraging``'s batch-norm epoch and ``update_bn``.

Needs ``pip install 'precisebn[lightning]'``. For the legacy ``pytorch_lightning``
package, import the same classes from :mod:`precisebn.integrations.pytorch_lightning`;
a callback only works with the Trainer of the package it was imported for.

Example:
    >>> import torch
    >>> import lightning.pytorch as L
    >>> from precisebn.integrations.lightning import PreciseBN
    >>> class Net(L.LightningModule):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
    ...     def forward(self, x):
    ...         return self.net(x)
    ...     def training_step(self, batch, batch_idx):
    ...         x, y = batch
    ...         return torch.nn.functional.mse_loss(self(x).squeeze(1), y)
    ...     def validation_step(self, batch, batch_idx):
    ...         pass
    ...     def configure_optimizers(self):
    ...         return torch.optim.SGD(self.parameters(), lr=0.1)
    >>> data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64))
    >>> loader = torch.utils.data.DataLoader(data, batch_size=16)
    >>> precise = PreciseBN(num_samples="all")
    >>> trainer = L.Trainer(max_epochs=2, callbacks=[precise], accelerator="cpu", logger=False,
    ...                     enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    >>> trainer.fit(Net(), loader, loader)
    >>> precise.computations, precise.last_step  # before each of the 2 validations
    (2, 8)
"""

from __future__ import annotations

from typing import Any

from .._optional import require
from ._lightning_common import AveragingMixin, PreciseBNMixin

_pl = require("lightning.pytorch", "lightning", "precisebn.integrations.lightning")
_callbacks = require("lightning.pytorch.callbacks", "lightning", "precisebn.integrations.lightning")

__all__ = ["PreciseBN", "PreciseWeightAveraging"]


class PreciseBN(PreciseBNMixin, _pl.Callback):
    """Recomputes precise statistics before each validation and each checkpoint of ``fit``.

    Every BatchNorm-style layer's ``running_mean``/``running_var`` becomes the exact
    population mean/variance of its inputs over ``num_samples`` training samples (see
    :func:`precisebn.recalibrate`), computed:

    * before every validation loop of ``trainer.fit()`` (not the sanity check);
    * before every checkpoint written during ``fit`` (ModelCheckpoint at any trigger,
      ``save_last``, ``trainer.save_checkpoint``), so that the saved statistics match
      the saved weights;
    * at the end of ``fit``, so that the module it leaves holds its statistics;
    * optionally every ``every_n_train_steps`` optimizer steps and at the end of every
      ``every_n_epochs``-th training epoch;

    and at most once per ``trainer.global_step``: a validation and a checkpoint at the
    same step share one computation (with gradient accumulation, a training batch that
    ends without an optimizer step after a computation moves the running statistics,
    so the next trigger at that step computes again).

    The forward passes run on the LightningModule itself under ``torch.no_grad()``, in
    the precision plugin's forward context, with every batch moved as training batches
    are (``on_before_batch_transfer``, ``transfer_batch_to_device``,
    ``on_after_batch_transfer``). Gradients, optimizer state, training flags, momenta
    and the random number generators (the global ones and the training data's own: a
    DataLoader's ``generator``, its sampler's) are left as they were: a run with the
    callback trains exactly like one without it, unless validation results feed back
    into training. A model without normalization layers gets one
    :class:`~precisebn.errors.PreciseBNWarning` and no computation.

    With ``strategy="ddp"`` every rank measures its own shard of the training data and
    all ranks end with identical statistics over the union (``num_samples`` is the
    total over ranks); the triggers above happen on all ranks together.

    Each computation logs, through the Trainer's loggers at the step Lightning logs its
    own metrics at (a validation's figures share its metrics' step):
    ``precisebn/mean_shift`` (mean over layers of the mean over channels of
    ``|Δmean|/σ``), ``precisebn/max_mean_shift``, ``precisebn/var_ratio`` (geometric
    mean of new/old variance), ``precisebn/seconds`` and ``precisebn/samples``.

    Args:
        num_samples: Training samples to measure on, over all ranks (``"all"``: a whole
            pass over the data). Default: up to 8192.
        num_batches: Or a number of batches per rank.
        data: The batches to measure on instead of the Trainer's training dataloader:
            a re-iterable (DataLoader, list) or a zero-argument callable returning a
            fresh iterable, yielding batches in the training dataloader's format.
        forward: ``forward(module, batch)`` for batches the module cannot take as they
            are; default: the module's own forward on the input part of the batch (a
            tensor as is, the first element of a tuple/list, a mapping as keywords).
        mode: ``"norm"`` (only normalization layers in training mode, dropout off) or
            ``"train"`` (every module in training mode).
        layers: Which layers (names, types or a predicate), e.g. to leave a frozen
            teacher's BatchNorm alone; default all.
        frozen: Layers the module keeps in eval mode while it trains (frozen for
            training, e.g. a frozen backbone's BatchNorm; noted after every training
            batch): ``"skip"`` (default) leaves them as they are, ``"include"``
            recalibrates them too.
        on_validation: Recompute before validation loops.
        on_checkpoint: Recompute before checkpoints.
        on_train_end: Recompute at the end of ``fit`` (``on_train_end``) unless the last
            computation is current, so that the module ``fit`` leaves (for ``trainer.test(model)``,
            ``trainer.save_checkpoint()`` after ``fit``, saving its weights) holds its
            statistics after training steps that no validation or checkpoint followed.
            Default: on when ``on_validation`` or ``on_checkpoint`` is.
        every_n_train_steps: Also recompute after every n-th optimizer step.
        every_n_epochs: Also recompute at the end of every n-th training epoch.
        progress: Show a progress bar on rank 0 (needs ``precisebn[progress]``).
        log: Log the figures of each computation through the Trainer's loggers.

    Attributes:
        computations: How many computations ran (counting those before a resumed
            checkpoint: the count is saved in checkpoints with ``last_step``).
        last_step: The ``global_step`` of the last computation.
        last_report: The :class:`~precisebn.Report` of the last computation.
    """


_WeightAveraging = getattr(_callbacks, "WeightAveraging", None)

if _WeightAveraging is not None:

    class PreciseWeightAveraging(AveragingMixin, _WeightAveraging):  # type: ignore[misc,valid-type]
        """Lightning's ``WeightAveraging`` (SWA or EMA) with precise statistics for the average.

        The averaged model (a ``torch.optim.swa_utils.AveragedModel`` of the
        LightningModule) gets its normalization statistics recomputed by precisebn on
        the training data before every validation loop (which Lightning runs on the
        averaged weights), before every checkpoint (whose ``state_dict`` holds the
        averaged weights) and at the end of training (when the averaged weights and
        statistics are copied into the module) — only when the average changed since
        the last computation. Unlike ``StochasticWeightAveraging`` there is no extra
        training epoch (so ``max_epochs=-1``, AMP's GradScaler and iterable datasets
        are fine), the optimizer is not involved, and the statistics are exact.

        Averaging: by default after every optimizer step (``WeightAveraging``'s
        default), or, with ``swa_epoch_start=k``, at the end of every epoch from the
        (0-based) epoch ``k`` on, as in classic SWA; override :meth:`should_update` for
        anything else. Pass ``avg_fn``/``multi_avg_fn`` for EMA, e.g.
        ``multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.999)``. Keep the
        SWA learning-rate schedule in ``configure_optimizers`` (e.g.
        ``torch.optim.swa_utils.SWALR``) if you want one.

        Needs Lightning 2.6 or later (``WeightAveraging``). Options shared with
        :class:`PreciseBN` (``num_samples``, ``num_batches``, ``data``, ``forward`` —
        which receives the averaged copy of the module —, ``mode``, ``layers``,
        ``progress``, ``log``) mean the same; the figures are logged as
        ``precisebn_averaged/...``. Use it instead of :class:`PreciseBN`, not with it:
        validation and checkpoints see the averaged model.

        Until the first average exists (``averaged_model.n_averaged == 0``, e.g. before
        the end of epoch ``swa_epoch_start``), the averaged copy holds only the initial
        weights: validation, checkpoints and the end of training then use the live
        module, as ``StochasticWeightAveraging`` does before averaging starts (nothing is
        swapped or measured; a training that ends before any average keeps its trained
        weights, with a :class:`~precisebn.errors.PreciseBNWarning`). Lightning's
        ``StochasticWeightAveraging(swa_epoch_start=k)`` counts epochs from 1 and
        averages at the start of epoch ``k``: the weights at the end of the 0-based
        epochs ``k - 2`` to ``max_epochs - 2``; ``swa_epoch_start=k - 2`` here averages
        the same weights and those of the last epoch.

        Args:
            swa_epoch_start: Average at the end of every epoch from this epoch on
                (``None``: after every optimizer step).
            device: Where the averaged model lives (default: the module's device).
            use_buffers: Also average the buffers. Default ``False``: precisebn
                recomputes the normalization statistics of the averaged weights, and
                averaging the recomputed statistics into later averages would be
                meaningless.
            frozen: Layers the module keeps in eval mode while it trains (frozen for
                training): ``"skip"`` (default) leaves them as they are in the averaged
                copy, ``"include"`` recalibrates them too.
            **averaging: Passed to ``AveragedModel`` (``avg_fn``, ``multi_avg_fn``).

        Attributes:
            averaged_model: The ``AveragedModel`` (during ``fit``).
        """

else:  # lightning < 2.6

    class PreciseWeightAveraging:  # type: ignore[no-redef]
        """Needs Lightning 2.6 or later (``lightning.pytorch.callbacks.WeightAveraging``)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            from ..errors import MissingDependencyError

            raise MissingDependencyError(
                f"PreciseWeightAveraging needs lightning>=2.6 (WeightAveraging), found {_pl.__version__}: "
                "pip install --upgrade 'precisebn[lightning]' 'lightning>=2.6'"
            )
