"""Recalibrating at fixed moments of a training loop, at most once per training step.

:class:`PreciseBNScheduler` is the framework-free piece: call ``update(step)``
wherever exact statistics are needed (before evaluating, before saving) and it
recalibrates only when the step differs from the last one it computed, so an
evaluation and a checkpoint at the same step share one computation (as the
original Caffe2 helper did). The Lightning callbacks in
:mod:`precisebn.integrations.lightning` are built on it.

A recalibration never changes the course of training: the forward passes run under
``torch.no_grad()`` with the model's flags, momenta and other buffers restored (see
:func:`precisebn.recalibrate`), and by default the random number generators
(torch's on the CPU and on the model's CUDA devices, Python's ``random``, NumPy's
global one) are put back as they were, so that a shuffling loader, random
augmentations or dropout during the passes do not shift what training draws next. The
data's own generators are put back too: a DataLoader's ``generator=``, its sampler's
and its batch sampler's (and a sampler's own ``epoch`` counter), so that a loader that
shuffles with its own generator keeps the order of the epochs to come.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import operator
import random
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Literal

import torch
from torch import nn

from .data import Forward
from .errors import InvalidArgumentError, PreciseBNError, PreciseBNWarning, caller_stacklevel
from .frozen import FrozenLayers, agreed_names, any_rank, train_override
from .interrupts import signals_held
from .layers import LayerSelection, find_norm_layers, running_statistics, unwrap
from .loaders import attribute, independent
from .recalibrate import check_options, recalibrate
from .report import Report
from .state import ValueCopies, in_memory, renormalised_weights, version_of

__all__ = ["PreciseBNScheduler", "check_frozen"]

logger = logging.getLogger("precisebn")

Data = Iterable[Any] | Callable[[], Iterable[Any]]
"""Batches for one recalibration: a re-iterable (a DataLoader, a list) or a
zero-argument callable that returns a fresh iterable each time."""


class PreciseBNScheduler:
    """Recomputes a model's precise statistics at most once per training step.

    :meth:`update` recalibrates (:func:`precisebn.recalibrate`) when the step it is
    given differs from the step of the last computation, or the model's parameters
    changed since (see :meth:`is_current`), and otherwise does nothing:
    the two lines before ``evaluate()`` and before ``torch.save`` cost one
    computation when they fall on the same step::

        scheduler = precisebn.PreciseBNScheduler(model, train_loader, num_samples=4096)
        for step, (x, y) in enumerate(batches, start=1):
            ...  # forward, backward, optimizer step
            if step % eval_every == 0:
                scheduler.update(step)
                evaluate(model)
            if step % save_every == 0:
                scheduler.update(step)  # free when the evaluation just ran at this step
                torch.save(model.state_dict(), "checkpoint.pt")

    Distributed: every rank must call :meth:`update` with the same step (the default
    ``distributed="auto"`` merges all ranks' statistics, so all ranks take part or
    none does); all ranks end with identical statistics.

    Args:
        model: The model to recalibrate (a DDP/DataParallel wrapper, or a
            ``torch.optim.swa_utils.AveragedModel``, is fine).
        data: The batches to measure on, iterated afresh at every computation: a
            DataLoader, a list, or a zero-argument callable that returns a fresh
            iterable (for streams). A one-shot iterator (a generator) is refused,
            since a second computation would find it empty. A DataLoader with
            ``persistent_workers=True`` is iterated through a twin loader with
            non-persistent workers, so that a computation in the middle of an
            epoch does not reset the training loop's iterator.
        num_samples, num_batches, forward, mode, layers, device, progress,
            distributed, process_group, capture, prior, adapt: As for
            :func:`precisebn.recalibrate`.
        frozen: What to do with layers frozen for training — kept in eval mode while
            the model trains (mmdetection's ``norm_eval``, a frozen backbone), whose
            statistics training normalises with as they are: ``"skip"`` (default) leaves
            them as they are; ``"include"`` recalibrates them too. They are noted
            whenever :meth:`update` (or :meth:`observe`) sees the model in training mode.
        preserve_rng: Put the random number generators back as they were after
            each computation (default): torch's global ones, Python's ``random``,
            NumPy's global one, and the data's own (a DataLoader's ``generator``, its
            sampler's, its batch sampler's), so that training draws the same random
            numbers, and sees the same batch order, as without the recalibration.

    Example:
        >>> import torch, precisebn
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
        >>> data = [torch.randn(8, 3) for _ in range(4)]
        >>> scheduler = precisebn.PreciseBNScheduler(model, data, num_samples="all")
        >>> [scheduler.update(step) is not None for step in (10, 10, 20, 20, 20)]
        [True, False, True, False, False]
        >>> scheduler.computations, scheduler.last_step
        (2, 20)
        >>> scheduler.update(20, force=True).samples
        32
    """

    def __init__(
        self,
        model: nn.Module,
        data: Data,
        *,
        num_samples: int | Literal["all"] | None = None,
        num_batches: int | None = None,
        forward: Forward | None = None,
        mode: Literal["norm", "train"] = "norm",
        layers: LayerSelection = None,
        device: torch.device | str | None = None,
        progress: bool = False,
        distributed: Literal["auto"] | bool = "auto",
        process_group: Any = None,
        capture: Literal["auto", "float64"] = "auto",
        tolerance: float | None = None,
        prior: float | None = None,
        adapt: Literal["both", "mean", "var"] = "both",
        frozen: Literal["skip", "include"] = "skip",
        preserve_rng: bool = True,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise InvalidArgumentError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        check_data(data)
        check_frozen(frozen)
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
        self.model = model
        self.data = data
        self.frozen = frozen
        self.preserve_rng = preserve_rng
        self._frozen = FrozenLayers()
        self._trained: nn.Module = model  # the model being trained, whose modes update() reads (see observe)
        self._skipped: list[str] | None = None  # the frozen layers last logged
        self._unsure_noted = False
        self._options: dict[str, Any] = {
            "num_samples": num_samples,
            "num_batches": num_batches,
            "forward": forward,
            "mode": mode,
            "layers": layers,
            "device": device,
            "progress": progress,
            "distributed": distributed,
            "process_group": process_group,
            "capture": capture,
            "tolerance": tolerance,
            "prior": prior,
            "adapt": adapt,
        }
        self._last_step: int | None = None
        self._stale = False
        self._weights: tuple[tuple[int, int | None], ...] | None = None  # the parameters computed with (see is_current)
        self._statistics: _Written | None = None  # and the statistics the computation wrote
        self._computations = 0
        self._last_report: Report | None = None

    @property
    def last_step(self) -> int | None:
        """The step of the last computation (``None`` before the first one)."""
        return self._last_step

    @property
    def computations(self) -> int:
        """How many times the statistics were computed (restored by :meth:`load_state_dict`)."""
        return self._computations

    @property
    def last_report(self) -> Report | None:
        """The :class:`~precisebn.Report` of the last computation in this process."""
        return self._last_report

    @property
    def frozen_layers(self) -> tuple[str, ...]:
        """The layers last seen in eval mode while the model was in training mode (qualified
        names in the model, without its wrappers): left as they are with ``frozen="skip"``."""
        return self._frozen.names

    def observe(self, model: nn.Module | None = None, *, modes: Mapping[str, bool] | None = None) -> bool:
        """Notes which normalization layers are in eval mode while ``model`` (default: the
        scheduler's) is in training mode: the layers frozen for training, left as they are
        by the next computations (``frozen="skip"``). :meth:`update` does so itself; call
        this during training when :meth:`update` runs with the model in eval mode (after
        ``model.eval()``), or with the trained model when the scheduler recalibrates an
        averaged copy of it (:meth:`update` then reads that model's flags, never the copy's own).
        A host-only scan of the layers' flags.

        Args:
            model: The model being trained (default: the scheduler's).
            modes: The ``training`` flags of ``model``'s modules by qualified name as they were
                before something put it in eval mode (Lightning records them before validating),
                read instead of the modules' own.

        Returns:
            Whether ``model`` was in training mode (else nothing was noted).
        """
        if model is None or model is self.model:
            return self._frozen.observe(self.model, modes=modes)
        seen = self._frozen.observe(model, modes=modes)  # (refuses a non-module first)
        self._trained = model  # from now on the modes that count are those of the model trained
        return seen

    def _forget_frozen(self) -> None:
        """Forgets the layers noted frozen (a run starting over from step 0 with the same scheduler: an Ignite handler
        is bound once): the next computation reads them afresh, as a new scheduler's first would."""
        self._frozen = FrozenLayers()
        self._skipped = None
        self._unsure_noted = False

    def trains(self, model: nn.Module) -> None:
        """Names the model being trained, when it is not the scheduler's (an averaged copy of it), without
        observing it yet: :meth:`update` then reads the frozen layers off ``model`` — its modes at the computation if
        it is in training mode then (an evaluation before the first step included), else its last observation."""
        if not isinstance(model, nn.Module):
            raise InvalidArgumentError(f"trains() takes the model being trained, got {type(model).__name__}")
        self._trained = model

    def is_current(self, step: int) -> bool:
        """Whether the statistics were computed at ``step``, nothing invalidated them since, and the model's
        parameters are still the ones they were computed with — the same tensors, none changed in place since (an
        optimizer step, ``load_state_dict``, another model: a caller's step number may not move with them, as a
        run started again after one that raised does not). A write through ``.data`` is not seen. And the layers
        the computation updated still hold bitwise what it wrote (not another computation's: a second scheduler on
        them, an averaged copy sharing their buffers), and every other module's running statistics are bitwise what
        they were then (those before the updated layers fed them: a frozen layer adapted since, another scheduler's
        layers rewritten; see :meth:`_Calls.feeding` — a call that bypasses ``Module.__call__`` is not seen)."""
        if self._last_step != check_step(step, "step") or self._stale:
            return False
        weights = self.__dict__.get("_weights")  # (None: loaded from a checkpoint, or a scheduler pickled before)
        if weights is None:
            return True
        written = self.__dict__.get("_statistics")
        try:
            same = weights == _weights_of(self.model)
        except Exception:  # (a model whose parameters cannot be listed now: computed again)
            return False
        return same and (written is None or written.held_by(self.model))

    def update(self, step: int, *, force: bool = False) -> Report | None:
        """Recalibrates unless the statistics were already computed at ``step``.

        Args:
            step: The current training step (any integer that changes whenever the
                weights do, e.g. the number of optimizer steps taken).
            force: Recalibrate even if the statistics are current for ``step``.

        Returns:
            The :class:`~precisebn.Report` of the computation, or ``None`` when
            nothing was done.

        Raises:
            InvalidArgumentError: ``step`` is not an integer.
            PreciseBNError: Whatever :func:`precisebn.recalibrate` raises; the model is
                then unchanged and the step is not recorded, so the next call tries again.
        """
        return self._update(step, force=force, before_training=False)

    def _update(self, step: int, *, force: bool, before_training: bool) -> Report | None:
        """:meth:`update`; ``before_training``: the caller knows no training step has run yet (an
        integration's evaluation on start), so that a model not seen training may not be in its
        training modes yet (see :func:`~precisebn.frozen.train_override`)."""
        step = check_step(step, "step")
        due = force or not self.is_current(step)
        if not any_rank(due, self._options["distributed"], self._options["process_group"]):  # (alike on every rank)
            return None
        options = self._without_frozen(before_training)
        if options is None:
            return None
        with _calls_seen(self.model) as calls:  # (which modules holding buffers the passes ran, in what order)
            if self.preserve_rng:
                with preserved_rng(self.model):
                    batches = _batches_or_failure(self.data)
                    with (
                        preserved_generators(data_generators(self.data, batches)),
                        preserved_epochs(self.data, batches),
                    ):
                        report = recalibrate(self.model, batches, **options)
            else:
                report = recalibrate(self.model, _batches_or_failure(self.data), **options)
        self._last_step, self._stale, self._last_report = step, False, report
        # (after the writes nothing may raise: a model that cannot be read so is judged by the step alone — or by its
        # weights alone, where its statistics cannot be read: the review of probe 43, a TorchScript submodule)
        try:
            self._weights = _weights_of(self.model)
        except Exception:
            self._weights = None
        try:
            self._statistics = _Written(self.model, report.updated, calls) if self._weights is not None else None
        except Exception:
            self._statistics = None
        self._computations += 1
        return report

    def _without_frozen(self, before_training: bool) -> dict[str, Any] | None:
        """The options of this computation, its ``layers=`` without the layers frozen for training
        (``frozen="skip"``); ``None`` when there is nothing to compute — every selected layer frozen, or,
        before training, which are frozen unknown (see :meth:`_update`). Every rank takes part in the one
        gathering of frozen layers, whatever ``frozen=`` says, so that no rank waits for another."""
        options, frozen = self._options, self._frozen
        override = None  # a train() override that may freeze layers
        if self.frozen == "skip":
            unseen = not frozen.seen
            # the modes of the model trained (this one, or the one trains()/observe() named: an averaged copy's own
            # flags say nothing), if it is training now; else the last observation holds
            seen_now = frozen.observe(self._trained, relist=True)
            if before_training and unseen and not seen_now:
                override = train_override(self._trained)
        names, unsure = agreed_names(
            frozen.names if self.frozen == "skip" else (),
            options["distributed"],
            options["process_group"],
            override is not None,
        )
        if self.frozen != "skip":
            return options
        if unsure:
            self._note_unsure(override)
            return None
        frozen.names = names
        try:
            layers, skipped = frozen.excluding(options["layers"], self.model)
            everything = skipped and not find_norm_layers(unwrap(self.model), layers, require=False)
        except PreciseBNError:  # a wrong layers=: raised by recalibrate, on every rank together
            return options
        if not skipped:
            return options
        self._note_skipped(skipped, everything)
        return None if everything else {**options, "layers": layers}

    def _note_unsure(self, override: str | None) -> None:
        if self._unsure_noted:
            return
        self._unsure_noted = True
        whose = f"{override}.train()" if override else "a train() override (on another rank)"
        warnings.warn(
            "precisebn: nothing was recomputed: no training step has been seen yet and the model is in eval mode, "
            f"so which layers training keeps frozen (in eval mode) is unknown — {whose} may keep some, and "
            "running it to look would run its side effects. The computation runs once a training step has been "
            "seen (or after scheduler.observe() with the model in training mode); pass frozen='include' to "
            "recompute every layer now.",
            PreciseBNWarning,
            stacklevel=caller_stacklevel(),
        )

    def _note_skipped(self, skipped: list[str], everything: bool) -> None:
        """Says once per set which frozen layers are left out: a log line, or a warning when that
        leaves nothing to compute or when ``layers=`` named one of them."""
        if skipped == self._skipped:
            return
        self._skipped = skipped
        shown = ", ".join(repr(n) for n in skipped[:8]) + (f" and {len(skipped) - 8} more" if len(skipped) > 8 else "")
        text = (
            f"{len(skipped)} layer(s) kept in eval mode while the model trains (frozen for training) are left as they "
            f"are: {shown}. Pass frozen='include' to recalibrate them too."
        )
        named = self._options["layers"]
        names = {named} if isinstance(named, str) else set(named) if isinstance(named, (list, tuple, set)) else set()
        asked = sorted(names & set(skipped))
        if everything:
            warnings.warn(f"precisebn: nothing to recompute: {text}", PreciseBNWarning, stacklevel=caller_stacklevel())
        elif asked:
            warnings.warn(
                f"precisebn: layers= names {', '.join(map(repr, asked))}, frozen for training: {text}",
                PreciseBNWarning,
                stacklevel=caller_stacklevel(),
            )
        else:
            logger.info("precisebn: %s", text)

    @property
    def model(self) -> nn.Module:
        """The model whose statistics are recomputed. Another one assigned here starts afresh: its statistics are
        not current, and, unless another model was named as the one trained (:meth:`observe`, :meth:`trains`), its
        own layers' modes are the ones read — the frozen layers noted on the model before were read on (probe 41:
        the new model's frozen layer was recalibrated, and its trained one kept its statistics)."""
        try:
            return self._model
        except AttributeError:  # (a scheduler pickled before this was a property holds it as "model")
            return self.__dict__["model"]  # type: ignore[no-any-return]

    @model.setter
    def model(self, model: nn.Module) -> None:
        if not isinstance(model, nn.Module):
            raise InvalidArgumentError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        old = self.__dict__.get("_model", self.__dict__.pop("model", None))
        self._model = model
        if old is not None and old is not model:
            if self._trained is old:
                self._trained = model
                self._frozen = FrozenLayers()
                self._skipped = None
            self._stale = True

    def invalidate(self) -> None:
        """Marks the statistics as out of date, so that the next :meth:`update` recomputes
        even at the same step (e.g. after training forward passes that did not step the
        optimizer, which moved the running statistics)."""
        self._stale = True

    def state_dict(self) -> dict[str, Any]:
        """What to save with a checkpoint: the last step and the number of computations."""
        return {"last_step": self._last_step, "stale": self._stale, "computations": self._computations}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores what :meth:`state_dict` returned (together with the model's weights
        and statistics saved at the same time).

        Raises:
            InvalidArgumentError: ``state`` is not what :meth:`state_dict` returns (keys
                missing or unknown, values of the wrong type); nothing is changed.
        """
        checked = check_state(state, f"{type(self).__name__}.load_state_dict")
        self._last_step, self._stale, self._computations = (
            checked["last_step"],
            checked["stale"],
            checked["computations"],
        )
        self._weights = None  # (the step alone says whether they are current: the weights were saved with them)

    def __repr__(self) -> str:
        return (
            f"PreciseBNScheduler(model={type(self.model).__name__}, last_step={self._last_step}, "
            f"computations={self._computations})"
        )


# -- helpers shared with the training-loop integrations -------------------------------------

_STATE_KEYS = ("last_step", "stale", "computations")


def _weights_of(model: nn.Module) -> tuple[tuple[int, int | None], ...]:
    """Which tensors a model's parameters are, and their version counters (which in-place changes move) — but for the
    weights of an ``Embedding``/``EmbeddingBag`` with ``max_norm``, whose every forward renormalises them in place,
    moving the counter whether or not a row changed (the review of this check: a validation made every checkpoint at
    its step compute again)."""
    # (whichever module holds them first; a parametrized one's originals keep their counters: its forward renormalises
    # them only through a view, and a change made to them otherwise would go unseen — the review of probe 42)
    renormalised = renormalised_weights(list(model.named_modules()), parametrized=False)
    return tuple((id(p), None if id(p) in renormalised else version_of(p)) for p in model.parameters())


class _Written:
    """The running statistics a computation wrote — its updated layers' ``running_mean``/``running_var``, named in the
    model without its wrappers — and what it read: every buffer of every other module its passes ran (``ran``) before
    the updated layers (see :meth:`_Calls.feeding`) — the running statistics of the layers not selected, frozen or
    left out, which normalised with them then (probe 43c: a scheduler on a layer after one that another scheduler or
    ``apply`` then rewrote took its statistics as current, 0.96 σ and 263 % off), and any other buffer their outputs
    depend on (the review of probe 43: a layer pruned again, with a new ``weight_mask`` and its ``weight_orig``
    untouched, 0.97 σ and 82 % off). As tensors and, in a :class:`~precisebn.state.ValueCopies`, bitwise copies of
    their values. Not version counters: DDP's buffer broadcast rewrites them with the same values, moving the
    counters; another computation — a second scheduler on the model, an averaged copy sharing its buffers — writes
    other values at the same step (probe 42: a checkpoint at that step kept them, 0.035 σ and 5.4 σ off). Modules
    the passes did not run — an auxiliary head that runs in training only, whose buffers DDP broadcasts from rank 0
    at the next forward; an averaged copy held beside the network — cannot have fed them, and are left out (the
    review: every step computed twice), and so are those called after the updated layers in every forward: of two
    schedulers on disjoint layers, the one on the later layers computes again after the other wrote the earlier
    ones, not the reverse. A buffer whose memory is freed is compared by identity only. (A buffer a module changes
    in every call, in eval mode too — a quantization observer's range — makes every check after an evaluation
    compute again: the statistics measured depend on it.)"""

    def __init__(self, model: nn.Module, names: list[str], calls: _Calls) -> None:
        self.names = names
        core = unwrap(model)
        self.ran = calls.feeding({id(core.get_submodule(name)) for name in names})
        self.tensors = _read_by(model, names, self.ran)
        self.copies = ValueCopies([t for t in self.tensors if _readable(t)])

    def held_by(self, model: nn.Module) -> bool:
        """Whether the layers still hold them: the same tensors, values, shapes and memory. Never raises: a model that
        cannot be read so (a layer gone — ``get_submodule`` raises what the model's ``__getattr__`` raises — its
        memory freed) does not hold them, and is computed again."""
        try:
            now = _read_by(model, self.names, self.ran)
            return (
                len(now) == len(self.tensors)
                and all(map(operator.is_, now, self.tensors))
                and not self.copies.changed()
            )
        except Exception:
            return False


def _own_buffers(module: nn.Module) -> list[torch.Tensor]:
    """Every buffer ``module`` holds itself (not its children's), a TorchScript module's too."""
    return [t for _, t in module._buffers.items() if isinstance(t, torch.Tensor)]


def _read_by(model: nn.Module, names: list[str], ran: set[int]) -> list[torch.Tensor]:
    """The running statistics of the layers ``names``, then every buffer of the other modules whose ``id`` is in
    ``ran``."""
    core = unwrap(model)
    layers = [core.get_submodule(name) for name in names]
    written = {id(m) for m in layers}
    others = [m for m in core.modules() if id(m) in ran and id(m) not in written]
    return [t for m in layers for t in running_statistics(m)] + [t for m in others for t in _own_buffers(m)]


def _readable(t: torch.Tensor) -> bool:
    """Whether ``t``'s values can be copied: not on the meta device, its memory not freed (reading it crashed the
    process, the review found)."""
    return t.layout == torch.strided and not t.is_meta and (t.numel() == 0 or in_memory(t))


class _Calls:
    """Which modules holding buffers (``watched``: their ``id``) a computation's passes called (``ran``),
    and in each forward of the model (``root``) when each was called first and last (a count of such calls) — kept
    once per distinct order — from which those that can have fed the layers it updated: :meth:`feeding`."""

    def __init__(self, root: nn.Module, watched: set[int]) -> None:
        self.root = id(root)
        self.watched = watched
        self.ran: set[int] = set()
        self.orders: list[tuple[dict[int, int], dict[int, int]]] = []  # (first, last) per distinct forward order
        self._first: dict[int, int] = {}
        self._last: dict[int, int] = {}
        self._count = 0
        self._depth = 0  # forwards of the model running (one calling itself: more)
        self.unordered = False  # a watched module called outside the model's forward (a forward= calling submodules)

    def before(self, module: nn.Module, args: Any) -> None:
        key = id(module)
        if key == self.root:
            if not self._depth:
                self._first, self._last, self._count = {}, {}, 0
            self._depth += 1
        if key in self.watched:
            self.ran.add(key)
            if not self._depth:
                self.unordered = True
                return
            self._count += 1
            self._first.setdefault(key, self._count)
            self._last[key] = self._count

    def after(self, module: nn.Module, args: Any, output: Any) -> None:
        if id(module) == self.root and self._depth:
            self._depth -= 1
            if not self._depth and (self._first, self._last) not in self.orders:
                self.orders.append((self._first, self._last))

    def feeding(self, updated: set[int]) -> set[int]:
        """The modules called that can have fed the ``updated`` ones: each called, in some forward of the model, before
        the last call of an updated one in that forward — every module called where a call was seen outside the
        model's forward (a ``forward=`` that calls submodules) or no forward called an updated one. A module called
        only after them normalised nothing they measured (the review: two schedulers on disjoint layers, each computed
        again after the other's writes); every forward's order counts (the review: a forward that called two layers in
        another order from its second batch on was judged by its first, 1.49 σ and 187 % off)."""
        feeding: set[int] = set()
        seen = False
        for first, last in self.orders:
            horizon = max((last[key] for key in updated if key in last), default=None)
            if horizon is not None:
                seen = True
                feeding.update(key for key, at in first.items() if at < horizon)
        if self.unordered or not seen:
            return set(self.ran)
        return feeding & self.ran


@contextlib.contextmanager
def _calls_seen(model: nn.Module) -> Iterator[_Calls]:
    """The :class:`_Calls` of the modules holding buffers while the block runs: seen through torch's global
    module hooks, removed at the block's end whatever happens — hooks on the modules themselves would go with a copy
    made meanwhile (a teacher deep-copied in ``forward``, ``torch.save`` of the model) and stay there. A TorchScript
    module counts as called, in no known order. The modules stay referenced by the model, so their ``id`` are not
    reused meanwhile; modules of other models, called meanwhile in other threads, are not watched."""
    core = unwrap(model)
    watched: set[int] = set()
    scripted: set[int] = set()
    for m in core.modules():
        if _own_buffers(m):
            (scripted if isinstance(m, torch.jit.ScriptModule) else watched).add(id(m))
    calls = _Calls(core, watched)
    calls.ran |= scripted
    handles: list[Any] = []
    try:
        with signals_held():  # (a Ctrl-C between a hook's registration and its handle's keeping would leave it)
            handles.append(nn.modules.module.register_module_forward_pre_hook(calls.before))
            handles.append(nn.modules.module.register_module_forward_hook(calls.after))
        yield calls  # (not held: the passes let signals through, which they do only under their own hold)
    finally:
        with signals_held():
            for handle in handles:
                handle.remove()


def check_frozen(frozen: Any) -> None:
    """Refuses a ``frozen=`` value other than ``"skip"`` or ``"include"``."""
    if not isinstance(frozen, str) or frozen not in ("skip", "include"):
        raise InvalidArgumentError(
            f"frozen must be 'skip' (leave layers kept in eval mode during training as they are) or 'include' "
            f"(recalibrate them too), got {frozen!r}"
        )


def check_step(step: Any, name: str, hint: str = "pass int(step) if it holds a whole number of steps") -> int:
    """``step`` as an ``int``: a Python or NumPy integer, or a 0-d integer tensor (anything
    with ``__index__``); floats (even integral ones: a float step is usually a mistake, and
    ``int()`` is one call away), bools and strings are refused."""
    value = _integer(step)
    if value is not None:
        return value
    raise InvalidArgumentError(
        f"{name} must be an integer (e.g. the number of optimizer steps taken), got {step!r} "
        f"({type(step).__name__}); {hint}."
    )


def _integer(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def check_state(state: Any, where: str) -> dict[str, Any]:
    """The scheduler state ``state`` (what :meth:`PreciseBNScheduler.state_dict`
    returns) with plain Python values, or an :class:`InvalidArgumentError` saying what
    does not fit."""
    expected = "the dict that state_dict() returned, with keys 'last_step', 'stale' and 'computations'"
    if not isinstance(state, Mapping):
        raise InvalidArgumentError(f"{where}: expected {expected}; got a {type(state).__name__}.")
    unknown = [key for key in state if key not in _STATE_KEYS]
    missing = [key for key in _STATE_KEYS if key not in state]
    if unknown or missing:
        found = []
        if unknown:
            shown = ", ".join(repr(k) for k in unknown[:5]) + (", ..." if len(unknown) > 5 else "")
            found.append(f"unknown key(s) {shown}")
        if missing:
            found.append(f"missing key(s) {', '.join(map(repr, missing))}")
        raise InvalidArgumentError(
            f"{where}: expected {expected}; found {' and '.join(found)}. Pass the state saved from the same "
            "kind of object (not, e.g., the model's state_dict)."
        )
    last = state["last_step"]
    stale = state["stale"]
    computations = state["computations"]
    if last is not None:
        last = check_step(last, f"{where}: 'last_step'", "pass the state that state_dict() returned")
    if not isinstance(stale, bool):
        raise InvalidArgumentError(f"{where}: 'stale' must be True or False, got {stale!r} ({type(stale).__name__}).")
    count = _integer(computations)
    if count is None or count < 0:
        raise InvalidArgumentError(
            f"{where}: 'computations' must be a non-negative integer, got {computations!r} "
            f"({type(computations).__name__})."
        )
    return {"last_step": last, "stale": stale, "computations": count}


def check_data(data: Any) -> None:
    """Refuses data that cannot be iterated afresh for every computation."""
    if isinstance(data, Iterator):
        raise InvalidArgumentError(
            f"data is a one-shot iterator ({type(data).__name__}), which a second recalibration would find "
            "empty; pass a DataLoader or a list, or a zero-argument callable that returns a fresh iterable "
            "(e.g. data=lambda: make_stream())."
        )
    if isinstance(data, (torch.Tensor, str, bytes)) or not (isinstance(data, Iterable) or callable(data)):
        raise InvalidArgumentError(
            "data must be a re-iterable of batches (a DataLoader, a list) or a zero-argument callable "
            f"returning one, got {type(data).__name__}"
        )


class MappedBatches(Iterable[Any]):
    """The batches of ``source`` with ``fn`` applied to each, iterated lazily.

    ``source`` stays visible to :func:`data_generators`, so that its generators are
    put back after a computation that iterated these batches.
    """

    def __init__(self, source: Iterable[Any], fn: Callable[[Any], Any]) -> None:
        self.source = source
        self.fn = fn

    def __iter__(self) -> Iterator[Any]:
        for batch in self.source:
            yield self.fn(batch)


def _data_holders(source: Any) -> list[Any]:
    """A DataLoader's own objects that may hold random state: itself, its dataset (augmentations
    drawn in ``__getitem__`` without workers), its sampler, its batch sampler and the batch
    sampler's sampler (through :class:`MappedBatches`)."""
    while isinstance(source, MappedBatches):
        source = source.source
    if not isinstance(source, torch.utils.data.DataLoader):
        return []
    batch_sampler = source.batch_sampler
    return [source, *_datasets(source.dataset), source.sampler, batch_sampler, getattr(batch_sampler, "sampler", None)]


def _transforms(transform: Any) -> list[Any]:
    """A transform and, for a composition (torchvision's ``Compose``: a ``transforms`` list), its parts."""
    parts = attribute(transform, "transforms")
    return [transform, *(parts[:32] if isinstance(parts, (list, tuple)) else [])]


def _datasets(dataset: Any, depth: int = 4) -> list[Any]:
    """A dataset, its transforms and the datasets it wraps (``Subset.dataset``, ``ConcatDataset.datasets``...),
    a few levels down."""
    out = [dataset]
    for key in ("transform", "transforms", "target_transform"):
        out += _transforms(attribute(dataset, key))
    if depth > 1:
        inner = attribute(dataset, "dataset")
        children = attribute(dataset, "datasets")
        if isinstance(inner, torch.utils.data.Dataset):
            out += _datasets(inner, depth - 1)
        elif isinstance(children, (list, tuple)):
            for child in children[:16]:
                if isinstance(child, torch.utils.data.Dataset):
                    out += _datasets(child, depth - 1)
    return [d for d in out if d is not None]


@contextlib.contextmanager
def preserved_epochs(*sources: Any) -> Iterator[None]:
    """Puts back the integer ``epoch`` of the data's samplers on exit: samplers that seed
    each pass from their epoch and count the passes themselves (Accelerate's
    ``SeedableRandomSampler``, used by the Hugging Face Trainer) would otherwise count a
    computation's pass as an epoch of training."""
    saved: dict[int, tuple[Any, int]] = {}
    for source in sources:
        for holder in _data_holders(source):
            epoch = attribute(holder, "epoch")
            if holder is not None and isinstance(epoch, int) and not isinstance(epoch, bool):
                saved.setdefault(id(holder), (holder, epoch))
    try:
        yield
    finally:
        for holder, epoch in saved.values():
            if attribute(holder, "epoch") == epoch:
                continue
            try:
                holder.epoch = epoch
            except Exception:  # (a read-only property, or a setter that refuses going back): never after the writes
                warnings.warn(
                    f"precisebn: the data's {type(holder).__name__}.epoch moved from {epoch} during the computation "
                    "and cannot be put back (read-only, or its setter refused); training's next pass may differ. "
                    "Give the computations data of their own (data=), or let the sampler count passes otherwise.",
                    PreciseBNWarning,
                    stacklevel=caller_stacklevel(),
                )


def data_generators(*sources: Any) -> list[Any]:
    """The random number generators that iterating ``sources`` draws from, besides the
    global ones: the ``torch.Generator``, NumPy ``Generator``/``RandomState`` and
    ``random.Random`` objects held by each DataLoader (its ``generator``: worker seeds and the
    default shuffling sampler), its sampler, its batch sampler and the batch sampler's sampler
    (a custom sampler shuffling with ``np.random.default_rng(seed)`` of its own: its next epoch's
    order would otherwise move on by a computation's pass) — as attributes, or inside them (a dict of
    generators, a state object), see :func:`_generators_in`."""
    found: dict[int, Any] = {}
    seen: dict[int, int] = {}
    for source in sources:
        for holder in _data_holders(source):
            _generators_in(holder, found, seen, _DEPTH)
    return list(found.values())


_DEPTH = 3  # a holder's attributes, and two levels of state inside them (a dict of generators, a state object)
_WIDE = 64  # a container with more items is data (samples, file names), not state: not searched


def _generators_in(value: Any, found: dict[int, Any], seen: dict[int, int], depth: int) -> None:
    """Adds to ``found`` the generators (:func:`_is_generator`) that ``value`` is or holds: in its attributes
    (``__dict__``), the items of a dict, list, tuple or set, down to ``depth`` levels (each object once).
    Tensors, strings, numbers and classes are not searched, nor containers of more than :data:`_WIDE`
    items. ``seen``: the depth each object was searched to (searched again only deeper)."""
    if _is_generator(value):
        found.setdefault(id(value), value)
        return
    if depth <= seen.get(id(value), 0) or isinstance(value, _LEAVES):
        return
    seen[id(value)] = depth
    if isinstance(value, dict):
        items: Any = value.values()
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = value
    else:
        state = attribute(value, "__dict__")
        items = state.values() if isinstance(state, dict) else ()
    if len(items) > _WIDE:
        return
    for item in list(items):
        _generators_in(item, found, seen, depth - 1)


_LEAVES = (str, bytes, bytearray, int, float, complex, bool, type(None), torch.Tensor, type)


def _is_generator(value: Any) -> bool:
    numpy = sys.modules.get("numpy")
    kinds = (numpy.random.Generator, numpy.random.RandomState) if numpy is not None else ()
    return isinstance(value, (torch.Generator, *kinds)) or (
        isinstance(value, random.Random) and not isinstance(value, random.SystemRandom)  # (no state)
    )


def _restorer(generator: Any) -> Callable[[], None]:
    """A function that puts ``generator`` (one of :func:`_is_generator`'s kinds) back in its state now."""
    if isinstance(generator, torch.Generator):
        torch_state = generator.get_state()
        return lambda: generator.set_state(torch_state)
    if isinstance(generator, random.Random):
        python_state = generator.getstate()
        return lambda: generator.setstate(python_state)
    if hasattr(generator, "bit_generator"):  # a NumPy Generator
        numpy_state = copy.deepcopy(generator.bit_generator.state)
        return lambda: setattr(generator.bit_generator, "state", numpy_state)
    legacy_state = generator.get_state()  # a NumPy RandomState
    return lambda: generator.set_state(legacy_state)


@contextlib.contextmanager
def preserved_generators(generators: Iterable[Any]) -> Iterator[None]:
    """Puts each generator's state back on exit (:func:`data_generators`' kinds)."""
    restorers = [_restorer(generator) for generator in generators]
    try:
        yield
    finally:
        for restore in restorers:
            restore()


class _Failed(Iterable[Any]):
    """Data whose iteration raises ``error``, what getting a computation's data raised (:func:`_batches_or_failure`)."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def __iter__(self) -> Iterator[Any]:
        raise self.error


def _batches_or_failure(data: Data) -> Iterable[Any]:
    """:func:`fresh_batches`, or, if that raises (a data callable that fails), data that raise the same error once
    the passes iterate them: inside :func:`~precisebn.recalibrate`, where every rank learns of a rank's failure at
    once (raised before it, the other ranks waited in the passes' first collective until the process group's
    timeout, a probe: 30 minutes by default), and the model is left unchanged as for any failure of the data."""
    try:
        return fresh_batches(data)
    except Exception as exc:
        return _Failed(exc)


def fresh_batches(data: Data) -> Iterable[Any]:
    """The iterable to use for one computation (see :class:`PreciseBNScheduler`'s ``data``):
    a callable's result, the loader an Accelerate wrapper holds, or a twin of a loader whose
    iterators share state (persistent workers, a sampler keeping a live iterator: see
    :mod:`~precisebn.loaders`)."""
    if callable(data) and not isinstance(data, Iterable):
        data = data()
    # An Accelerate-prepared loader (DataLoaderShard/DataLoaderDispatcher, as the Hugging
    # Face Trainer uses) is read through the DataLoader it wraps (the process's shard):
    # iterating the wrapper counts an epoch and registers it in Accelerate's
    # gradient-accumulation state. The batches then go to the model's device as usual.
    base = getattr(data, "base_dataloader", None)
    if isinstance(base, torch.utils.data.DataLoader) and base is not data:
        data = base
    return independent(data)


@contextlib.contextmanager
def preserved_rng(model: nn.Module) -> Iterator[None]:
    """Restores torch's CPU and CUDA generators (of the model's devices), Python's
    ``random`` and NumPy's global generator on exit."""
    cuda = sorted({t.device.index or 0 for t in (*model.parameters(), *model.buffers()) if t.device.type == "cuda"})
    python_state = random.getstate()
    numpy = sys.modules.get("numpy")
    numpy_state = numpy.random.get_state() if numpy is not None else None
    try:
        with torch.random.fork_rng(devices=cuda):
            yield
    finally:
        random.setstate(python_state)
        if numpy is not None:
            numpy.random.set_state(numpy_state)
