"""Exact statistics of the union of all ranks' data, over ``torch.distributed``.

A no-op without an initialised process group of more than one rank. Otherwise, after
each rank's own passes, four collective calls per estimate (five per recalibration),
whatever the model's depth or the data's size — all of them after the batch loop:

1. ``all_reduce`` of a small status table (one row per rank: ok/failed, samples,
   batches, digests of the selected layers and of their per-call statistics, seconds), so
   that every rank learns at once whether any rank failed or selected other layers — and if
   so all raise the same :class:`~precisebn.errors.DistributedError` before anything is written;
2. ``all_reduce`` (sum) of one flat float64 buffer holding every channel's count
   ``n_r`` and ``n_r·μ_r`` per fold (and each layer's calls, counts, and whether this rank
   read it through its figures or in float64): gives the global count and mean of each fold
   (each rank's folds moved by the batches of the ranks before it, so that the union's folds are
   those of its batches in rank order, and the standard errors those of one process over them),
   and each layer's path over the ranks ("mixed" where they differ);
3. ``all_reduce`` (sum) of ``M2_r + n_r·(μ_r − μ)²``: gives the global M2;
4. ``all_reduce`` (max) of each layer's most calls in one batch: every rank reports the same.

Step 3 sums squared deviations from the *global* mean, never raw sums of squares,
so it is as stable as Chan's pairwise merge. Every rank computes the result from the
same reduced buffers, so all ranks hold bit-identical statistics. A recalibration then
checks what it will write into this rank's model (with a prior, pooled with that model's
own statistics) and exchanges the status table once more (:meth:`RankContext.agree`): all
ranks write, or none.

A rank that fails during its passes (its data or model raises, Ctrl-C, non-finite
statistics, no data) writes its error to the process group's key-value store and
joins step 1 at once; the other ranks look at the store at most every
:data:`POLL_SECONDS` between batches (a host-only lookup, no device sync), stop, and
join step 1 too — so a failure surfaces on every rank within about a second plus one
batch, not at the process group's timeout. A rank that dies without raising
(killed) cannot report; the others then wait for the process group's timeout.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import signal
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, NoReturn

import torch

from .calls import call_indices, call_name
from .capture import FOLDS
from .errors import DistributedError, InvalidArgumentError
from .measure import Measurement
from .stats import RunningMoments

__all__ = ["COLLECTIVES", "LET_GO_SECONDS", "POLL_SECONDS", "RankContext", "interrupts_held"]

COLLECTIVES = 5
"""Collective calls per distributed recalibration (1 status + 2 statistics + 1 calls per forward + 1
status before the writes); an estimate makes the first 4."""

POLL_SECONDS = 0.5
"""How often, at most, a rank checks between batches whether another rank failed."""

LET_GO_SECONDS = 1.0
"""How long, at most, a rank waits after a CPU collective for the backend to let go of
the tensor it reduced (see :meth:`RankContext.all_reduce`)."""

_OK, _FAILED, _STOPPED, _VOTE = 0.0, 1.0, 2.0, 3.0
_STATUSES = frozenset((_OK, _FAILED, _STOPPED, _VOTE))
_ROW = 8  # status, samples, batches, layer digest, seconds, weighted precision, has data, per-call digest


class _FailedAtVote(Exception):
    """A vote's exchange showed another rank's failure: that exchange was the status
    exchange, so the error is raised without another collective."""

    def __init__(self, error: DistributedError) -> None:
        super().__init__(str(error))
        self.error = error


class _PeerFailed(Exception):
    """Raised inside the batch loop when the store says another rank failed."""


def _default_store() -> Any:
    try:
        return torch.distributed.distributed_c10d._get_default_store()
    except Exception:  # private API; without it failures surface after the loop
        return None


def _describe(exc: BaseException) -> str:
    """``"Type: message"`` of a rank's error, at most 2,000 characters, always storable: a message that
    cannot be formatted, or holds what UTF-8 cannot encode (a lone surrogate from an undecodable file
    name), is described or escaped rather than lost (the others would wait for it until the timeout)."""
    try:
        text = f"{type(exc).__name__}: {exc}"
    except Exception:
        text = f"{type(exc).__name__} (its message could not be formatted)"
    return text[:2000].encode("utf-8", "backslashreplace").decode("utf-8")


class RankContext:
    """This rank's part in one distributed recalibration."""

    _calls: ClassVar[dict[tuple[int, ...], int]] = {}

    def __init__(self, group: Any, rank: int, world_size: int, device: torch.device, ranks: tuple[int, ...]) -> None:
        self.group, self.rank, self.world_size, self.device = group, rank, world_size, device
        self.ranks = ranks  # each group rank's global rank (named in messages: a subgroup's 1 is not global 1)
        n = RankContext._calls.get(ranks, 0) + 1
        RankContext._calls[ranks] = n
        self.prefix = f"precisebn/{zlib.crc32(repr(ranks).encode())}/{n}"
        self.store = _default_store()
        self._last_poll = time.monotonic()

    @classmethod
    def resolve(cls, distributed: Any, process_group: Any = None) -> RankContext | None:
        """The context for this call, or ``None`` when statistics stay local."""
        if distributed is False:
            return None
        if distributed not in ("auto", True):
            raise InvalidArgumentError(f"distributed must be 'auto', True or False, got {distributed!r}")
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            if distributed is True:
                raise InvalidArgumentError(
                    "distributed=True needs an initialised process group; call "
                    "torch.distributed.init_process_group() first (e.g. under torchrun), or pass "
                    "distributed='auto'."
                )
            return None
        group = process_group if process_group is not None else dist.group.WORLD
        try:
            world_size, rank = dist.get_world_size(group), dist.get_rank(group)
        except (AttributeError, TypeError, ValueError, RuntimeError) as exc:
            raise InvalidArgumentError(
                f"process_group must be a torch.distributed process group (e.g. from dist.new_group()), got "
                f"{process_group!r} ({type(exc).__name__}: {exc})"
            ) from None
        if rank < 0:  # (checked first: a group's size is -1 for a process outside it)
            raise InvalidArgumentError("this process is not a member of process_group; pass a group it belongs to.")
        if world_size <= 1:
            return None
        backend = str(dist.get_backend(group))
        device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")
        return cls(group, rank, world_size, device, tuple(dist.get_process_group_ranks(group)))

    def release(self) -> None:
        """Drops this context's references to the process group and its store.

        Called when the call ends, however it ends. A failed call's traceback holds this
        context in reference cycles, which would otherwise keep the group alive until the
        garbage collector runs, perhaps only while the interpreter shuts down.
        """
        self.group = self.store = None

    # -- failure -----------------------------------------------------------------------

    def poll(self) -> None:
        """Raises if another rank has reported a failure (checked every POLL_SECONDS)."""
        now = time.monotonic()
        if self.store is None or now - self._last_poll < POLL_SECONDS:
            return
        self._last_poll = now
        if self.store.check([f"{self.prefix}/failed"]):
            raise _PeerFailed()

    def fail(self, exc: BaseException) -> NoReturn:
        """Reports this rank's failure, learns everyone's status, raises on every rank."""
        if isinstance(exc, _FailedAtVote):
            raise exc.error from None
        peer = isinstance(exc, _PeerFailed)
        if not peer and self.store is not None:
            try:  # (before the flag: a rank that reads the flag may read the message)
                self.store.set(f"{self.prefix}/error/{self.rank}", _describe(exc))
            except Exception:
                pass
            try:  # (apart: a message the store refused must not keep the others from stopping early)
                self.store.set(f"{self.prefix}/failed", str(self.rank))
            except Exception:
                pass
        try:
            table = self._exchange(_STOPPED if peer else _FAILED, 0, 0, 0, 0.0)
        except Exception as comm_exc:
            if peer:
                raise DistributedError(
                    f"rank {self._global(self.rank)}: another rank failed, and the status exchange failed too "
                    f"({comm_exc}); this rank's model was left unchanged."
                ) from comm_exc
            raise exc from None
        err = self._failure_error(table)
        if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit: keep their meaning here
            raise exc
        raise err from (None if peer else exc)

    def _failure_error(self, table: list[list[float]]) -> DistributedError:
        failed = tuple(r for r, row in enumerate(table) if row[0] == _FAILED)
        if not failed:  # (every rank in a failure exchange stopped for another's failure: not expected)
            stopped = [self._global(r) for r, row in enumerate(table) if row[0] == _STOPPED]
            return DistributedError(
                f"precisebn stopped on rank{'s' if len(stopped) > 1 else ''} {', '.join(map(str, stopped))} of "
                f"{self.world_size} without an error of its own (see the other ranks' logs). No rank's model was "
                "changed; call again on every rank.",
                (),
            )
        details = []
        for r in failed:
            message = "see that rank's log"
            key = f"{self.prefix}/error/{r}"
            if self.store is not None:
                try:  # (set before that rank's exchange, which has ended: a key missing now never comes, and
                    if self.store.check([key]):  # get() would wait for it until the group's timeout)
                        message = self.store.get(key).decode("utf-8", "backslashreplace")
                except Exception:
                    pass
            details.append(f"rank {self._global(r)}: {message}")
        of = (
            f"{self.world_size}"
            if self._global(0) == 0 and self._global(self.world_size - 1) == self.world_size - 1
            else (f"the group of ranks {', '.join(map(str, self.ranks))}")
        )
        return DistributedError(
            f"precisebn failed on rank{'s' if len(failed) > 1 else ''} "
            f"{', '.join(str(self._global(r)) for r in failed)} of {of} ({'; '.join(details)}). No rank's model was "
            "changed; fix the cause on that rank and call again on every rank.",
            tuple(map(self._global, failed)),  # (global ranks, as named: a subgroup's 1 is not global 1)
        )

    def _global(self, r: int) -> int:
        """Group rank ``r`` as a global rank (what the processes' logs and torchrun call it)."""
        return self.ranks[r] if 0 <= r < len(self.ranks) else r

    # -- collectives -------------------------------------------------------------------

    def _exchange(
        self,
        status: float,
        samples: int,
        batches: int,
        digest: int,
        seconds: float,
        precision: float = 0.0,
        data: bool = False,
        calls_digest: int = 0,
    ) -> list[list[float]]:
        table = torch.zeros(self.world_size, _ROW, dtype=torch.float64, device=self.device)
        row = [status, samples, batches, digest, seconds, precision, float(data), calls_digest]
        table[self.rank] = torch.tensor(row, dtype=torch.float64, device="cpu")
        self.all_reduce(table)  # collective 1 (and each vote)
        rows = table.tolist()
        if any(row[0] not in _STATUSES for row in rows):  # (a rank's own collective paired with this one: probe 40
            # read its values as votes, "rank  uses num_samples='auto'")
            raise DistributedError(
                f"rank {self._global(self.rank)}: precisebn's status exchange received values no rank of precisebn "
                "sent: a collective of the program's own, on another rank, paired with it (a rank that skipped the "
                "precisebn call, or ran its own collectives meanwhile). Call the same precisebn function at the same "
                "point on every rank of the group. This rank's model was left unchanged."
            )
        return rows

    def all_reduce(self, tensor: torch.Tensor, op: Any = None) -> None:
        """Sums ``tensor`` over the ranks in place (or reduces it by ``op``); on CPU, returns once the
        backend has let go of it.

        Gloo finishes a collective on a worker thread, which drops its references to the
        tensor just *after* the caller has been woken. A tensor's last reference from C++
        releases its Python object, which needs the GIL; if the interpreter has begun to shut
        down by then, that thread cannot take it and the process aborts ("terminate called
        without an active exception", exit code -6: torch's bug, seen after a call that was
        the program's last collective). Waiting here, with the GIL released, until the
        reference count is back where it was before the call (microseconds; at most
        :data:`LET_GO_SECONDS`) leaves no such release behind. NCCL's tensors are let go by
        its watchdog only after the device finishes, so on CUDA there is no wait (it would
        be a host synchronisation).
        """
        count = getattr(tensor, "_use_count", None)  # private API: without it, no wait
        before = count() if count is not None and tensor.device.type == "cpu" else None
        op = torch.distributed.ReduceOp.SUM if op is None else op
        try:
            torch.distributed.all_reduce(tensor, op=op, group=self.group)
        except RuntimeError as exc:  # (the backend's own error, e.g. gloo's timeout: a probe's rank never called)
            if isinstance(exc, DistributedError):
                raise
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            raise DistributedError(
                f"rank {self._global(self.rank)}: a collective of precisebn's failed ({first}). Another rank of the "
                "group has exited, or has not called the same precisebn function (a rank that skips it, or runs "
                "collectives of its own meanwhile); call it on every rank of the group, with the same arguments, or "
                "pass distributed=False to measure each rank on its own. This rank's model was left unchanged."
            ) from exc
        if before is None:
            return
        deadline = time.monotonic() + LET_GO_SECONDS
        while count() > before and time.monotonic() < deadline:
            time.sleep(1e-4)

    def vote(
        self, tolerance: float, min_samples: int, max_samples: int, min_batches: int = 1
    ) -> Callable[[float, int, bool, int], bool]:
        """The ranks' common stopping decision for ``num_samples="auto"``.

        Each call is one small ``all_reduce`` of the status table (so that a rank that
        fails meanwhile is seen at once, in the same exchange). Each rank brings its own
        precision ``p_r`` over its ``n_r`` samples; the union's is taken as
        ``max_r(p_r·√n_r) / √N`` (standard errors shrink as 1/√samples when ranks see
        alike data), over the ranks that know their error: a rank whose error is unknown
        (not finite) with fewer than ``min_batches`` batches holding values — one batch, only
        empty ones — has no say, and its samples do not count in ``N`` (probe 45: its unknown
        error made the union's unknown, and every rank ran to the cap, 32 times the samples).
        A rank whose error is unknown after that many batches (a layer reached in one of them)
        still keeps the others going, as one process would go on. The ranks stop together when
        the union's error is within ``tolerance`` and its ``N`` ≥ ``min_samples``, when all
        samples reach ``max_samples``, or when no rank has data left.
        """

        tolerance = float(tolerance)  # (a NumPy float alike)
        rule = zlib.crc32(f"{tolerance!r} {min_samples} {max_samples} {min_batches}".encode())  # (alike everywhere)

        def vote(precision: float, samples: int, has_data: bool, filled: int) -> bool:
            """``filled``: this rank's batches that held values (a sample or more)."""
            weighted = precision * math.sqrt(samples) if math.isfinite(precision) else float("inf")
            table = self._exchange(_VOTE, samples, filled, rule, tolerance, min(weighted, 1e300), has_data)
            if any(row[0] in (_FAILED, _STOPPED) for row in table):
                raise _FailedAtVote(self._failure_error(table))
            if any(row[0] != _VOTE for row in table):  # a rank not voting: this was its status exchange
                raise _FailedAtVote(self._auto_mismatch(table))
            if len({row[3] for row in table}) > 1:
                given = ", ".join(f"rank {self._global(r)}: {row[4]!r}" for r, row in enumerate(table))
                raise _FailedAtVote(
                    DistributedError(
                        f"ranks disagree on when to stop num_samples='auto': tolerance ({given}) or num_samples "
                        "limits differ. Pass the same tolerance=, num_samples and num_batches on every rank. "
                        "No rank's model was changed.",
                        (),
                    )
                )
            total = sum(row[1] for row in table)
            # (a rank that cannot know its error yet says nothing about the others' data: the union's error is theirs)
            voters = [row for row in table if row[5] < 1e300 or row[2] >= min_batches]
            known = sum(row[1] for row in voters)
            union = max((row[5] for row in voters), default=math.inf) / math.sqrt(max(known, 1.0))
            no_data = not any(row[6] for row in table)
            return no_data or total >= max_samples or (known >= min_samples and union <= tolerance)

        return vote

    def _auto_mismatch(self, table: list[list[float]]) -> DistributedError:
        voting = [self._global(r) for r, row in enumerate(table) if row[0] == _VOTE]
        others = [self._global(r) for r, row in enumerate(table) if row[0] != _VOTE]
        return DistributedError(
            f"ranks disagree on num_samples: rank{'s' if len(voting) > 1 else ''} {', '.join(map(str, voting))} "
            f"use{'' if len(voting) > 1 else 's'} num_samples='auto' (the ranks vote on when to stop), "
            f"rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} "
            f"{'do' if len(others) > 1 else 'does'} not (or stopped voting earlier: a different num_batches). Pass the "
            "same num_samples, num_batches and tolerance on every rank. No rank's model was changed.",
            (),
        )

    def agree(self, digest: int = 0) -> None:
        """One more status exchange, after the merge: raises the same error on every rank if any
        failed since (:meth:`fail` on that rank), so that none goes on alone, or if the ranks' ``digest``
        of what they are about to write differs (each rank pools the merged statistics with its own model's
        as a prior: different prior=, adapt=, or running statistics that differ between the ranks)."""
        table = self._exchange(_OK, 0, 0, digest, 0.0)
        if any(row[0] != _OK for row in table):
            raise self._failure_error(table)
        if len({int(row[3]) for row in table}) > 1:
            raise DistributedError(
                "the ranks would write different statistics: the merged ones are the same on every rank, but "
                "pooled with each rank's own model (prior=), written in part (adapt=) or into buffers of another "
                "dtype they differ — a different prior= or adapt= on some rank, running statistics that differ "
                "between the ranks' models (e.g. DDP with broadcast_buffers=False) used as the prior, or models "
                "whose buffers differ in dtype (float32 on one rank, float64 on another). Pass the same prior= and "
                "adapt= everywhere, give every rank the same statistics first (e.g. broadcast them from rank 0), "
                "and the same model in the same dtype. No model was changed.",
                (),
            )

    def merge(self, local: Measurement, options: str = "") -> Measurement:
        """Merges every rank's moments exactly; the same result on every rank. ``options``: what every rank
        must have passed alike besides the mode (which function was called, per_call...): in the layers'
        digest (a different function, e.g. estimate on one rank and recalibrate on another, would make
        different collectives after this one: every rank would wait for the others)."""
        with interrupts_held():  # (Ctrl-C between this rank's collectives would leave the others waiting)
            return self._merge(local, options)

    def _merge(self, local: Measurement, options: str) -> Measurement:
        digest = zlib.crc32(f"mode={local.mode}\n{options}\n{_layout(local)}".encode())  # (one slot for all)
        calls_digest = zlib.crc32("\n".join(layer.name for layer in local.layers).encode())
        table = self._exchange(_OK, local.samples, local.batches, digest, local.seconds, calls_digest=calls_digest)
        if any(row[0] in (_FAILED, _STOPPED) for row in table):
            raise self._failure_error(table)
        if any(row[0] != _OK for row in table):  # a rank voting: this was its stopping vote
            raise self._auto_mismatch(table)
        digests = {int(row[3]) for row in table}
        if len(digests) > 1:
            per_rank = ", ".join(f"rank {self._global(r)}: {int(row[3]):08x}" for r, row in enumerate(table))
            raise DistributedError(
                f"ranks selected different normalization layers or passed different options (digests {per_rank}; "
                f"this rank: mode={local.mode!r}, {options or 'no other options'}): every rank must pass the same "
                "model architecture (the same layer classes), the same layers= selection and the same mode= and "
                "per_call=, and call the same function (estimate on every rank, or recalibrate, or the same "
                "integration). No model was changed."
            )
        if len({int(row[7]) for row in table}) > 1:
            split = call_indices(layer.name for layer in local.layers)
            here = ", ".join(f"{name or 'the model'!r} {len(calls)}" for name, calls in split.items()) or "none"
            raise DistributedError(
                "per_call=True: the ranks' forwards called some layer a different number of times per batch (or "
                "never, on some rank), so their per-call statistics do not match up (call i of a layer is merged "
                f"with call i on every rank); rank {self._global(self.rank)}'s layers called more than once per "
                f"batch, with their calls: {here}. Feed every rank's batches the same way, or estimate without "
                "per_call to pool all calls. No model was changed."
            )
        # fold k of this rank's is fold (k + offset) of the union's, offset the batches of the ranks before it: the
        # folds the union's batches would fall in, in rank order (probe 38: merged fold by fold, 3 ranks of one
        # batch each filled one fold, and every standard error was NaN; uneven shards' were 27-68 % off)
        offset = int(sum(row[2] for row in table[: self.rank])) % FOLDS
        moments = [_all_folds(m, offset) for m in local.moments]  # a rank with few batches keeps fewer folds
        sizes = [m.mean.numel() for m in moments]
        shapes = [m.mean.shape for m in moments]  # (FOLDS, channels): folds merge fold by fold
        home = [m.mean.device for m in moments]
        count = torch.cat([m.count.reshape(-1).to(self.device) for m in moments])
        mean = torch.cat([m.mean.reshape(-1).to(self.device) for m in moments])
        m2 = torch.cat([m.m2.reshape(-1).to(self.device) for m in moments])
        # per layer: calls, counts, and how many ranks read it on each path (a rank that never reached it: none)
        fast = [float(p == "fast" and c > 0) for p, c in zip(local.paths, local.counts)]
        exact = [float(p == "float64" and c > 0) for p, c in zip(local.paths, local.counts)]
        per_layer = torch.tensor(local.calls + local.counts + fast + exact, dtype=torch.float64, device=self.device)
        first = torch.cat([count, count * mean, per_layer])
        self.all_reduce(first)  # collective 2
        g, n = count.numel(), len(local.layers)
        total, weighted = first[:g], first[g : 2 * g]
        per_layer_all = [int(v) for v in first[2 * g :].tolist()]
        on_paths = zip(local.paths, per_layer_all[2 * n : 3 * n], per_layer_all[3 * n :])
        paths = [_merged_path(path, fast_ranks, exact_ranks) for path, fast_ranks, exact_ranks in on_paths]
        safe = torch.where(total > 0, total, torch.ones_like(total))
        global_mean = torch.where(total > 0, weighted / safe, torch.zeros_like(total))
        dev = torch.where(count > 0, mean - global_mean, torch.zeros_like(mean))
        second = m2 + count * dev * dev
        self.all_reduce(second)  # collective 3
        merged = [
            RunningMoments(c.view(shape), mu.view(shape), s.view(shape)).to(d)
            for c, mu, s, shape, d in zip(
                total.split(sizes), global_mean.split(sizes), second.split(sizes), shapes, home
            )
        ]
        return Measurement(
            local.layers,
            merged,
            per_layer_all[:n],
            per_layer_all[n:],
            int(sum(row[1] for row in table)),
            int(sum(row[2] for row in table)),
            local.mode,
            paths,
            seconds=max(row[4] for row in table),
            world_size=self.world_size,
            per_forward=self._most(local.per_forward),
        )

    def _most(self, per_forward: list[int]) -> list[int]:
        """Each entry's most calls in one batch over the ranks (``[]`` stays ``[]``: derived later)."""
        if not per_forward:
            return []
        most = torch.tensor(per_forward, dtype=torch.float64, device=self.device)
        self.all_reduce(most, torch.distributed.ReduceOp.MAX)  # collective 4
        return [int(v) for v in most.tolist()]


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """Ctrl-C (SIGINT) held until the block ends, then raised: a rank interrupted between the merge's
    collectives would leave the other ranks waiting in the next one (a probe: 30 minutes, the group's
    timeout), and one interrupted between the last exchange and its writes would leave them writing alone (a
    probe: the ranks' models differed). Only in the main thread, with Python's own handler in place (else as it
    is); a block that raises keeps its own exception."""
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    held: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if held:
        raise KeyboardInterrupt


def _merged_path(local: str, fast: int, exact: int) -> str:
    """A layer's path over the ranks that reached it: theirs if they agree, else ``"mixed"``
    (``"none"``: no rank normalised with its buffers)."""
    if fast and exact:
        return "mixed"
    if fast:
        return "fast"
    if exact:
        return "float64"
    return local if local not in ("fast", "float64") else "none"


def _layout(local: Measurement) -> str:
    """The selected layers, one line each (name, channels and class: a BatchNorm2d on one rank and an InstanceNorm2d
    on another were merged into one mixed population, probe 44c), a layer with per-call statistics (consecutive
    entries of one module, ``call_name(layer, i)``) once, under its own name."""
    lines = []
    for _, run in itertools.groupby(local.layers, key=lambda layer: id(layer.module)):
        entries = list(run)
        name = entries[0].name
        if len(entries) > 1:
            name = name.removesuffix(call_name("", 0)).removesuffix(".")
        lines.append(f"{name}:{entries[0].channels}:{entries[0].type_name}")  # (as PopulationStats.merge compares)
    return "\n".join(lines)


def _all_folds(m: RunningMoments, offset: int = 0) -> RunningMoments:
    """``m`` (shape ``(K, channels)``, K <= FOLDS) with empty folds appended up to FOLDS, fold k moved to
    ``(k + offset) % FOLDS``."""
    missing = FOLDS - m.count.shape[0]
    if missing > 0:
        m = RunningMoments(*(torch.cat([t, t.new_zeros((missing, *t.shape[1:]))]) for t in (m.count, m.mean, m.m2)))
    if offset:
        m = RunningMoments(*(t.roll(offset, 0) for t in (m.count, m.mean, m.m2)))
    return m
