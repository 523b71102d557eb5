"""Scenarios run on every rank of a real multi-process (gloo, CPU) group.

Each scenario returns a dict of tensors/numbers per rank; ``test_distributed.py``
starts the processes, collects the dicts and checks them against the float64 truth
over the union of all ranks' data.
"""

from __future__ import annotations

import datetime
import gc
import itertools
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

import precisebn
from precisebn.errors import DistributedError

Result = dict[str, Any]


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 5),
        nn.BatchNorm1d(5),
    )


def shard(rank: int, world_size: int) -> list[torch.Tensor]:
    """Uneven shards: rank r has 2 + r batches of growing size; the last rank one batch of 2."""
    g = torch.Generator().manual_seed(100 + rank)
    if rank == world_size - 1:
        return [torch.randn(2, 3, 6, 6, generator=g) * 2 + rank]
    return [torch.randn(3 + i + rank, 3, 6, 6, generator=g) * 2 + rank for i in range(2 + rank)]


def buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Bitwise (a NaN equals itself)."""
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))
        for k in a
    )


def _error(exc: BaseException) -> Result:
    return {
        "error": type(exc).__name__,
        "message": str(exc),
        "failed_ranks": list(getattr(exc, "failed_ranks", ())),
        "raised_at": time.time(),
    }


# -- scenarios --------------------------------------------------------------------------


def union(rank: int, world_size: int) -> Result:
    model = make_model()
    report = precisebn.recalibrate(model, shard(rank, world_size), num_samples="all")
    return {
        "state": buffers(model),
        "samples": report.samples,
        "batches": report.batches,
        "counts": {r.name: r.count for r in report.layers},
        "calls": {r.name: r.calls for r in report.layers},
        "world_size": report.world_size,
    }


def independent(rank: int, world_size: int) -> Result:
    model = make_model()
    report = precisebn.recalibrate(model, shard(rank, world_size), distributed=False)
    return {"state": buffers(model), "world_size": report.world_size, "samples": report.samples}


def global_num_samples(rank: int, world_size: int) -> Result:
    stream = (torch.randn(4, 3, 6, 6) for _ in itertools.count())
    stats = precisebn.estimate(make_model(), stream, num_samples=20)
    return {"samples": stats.samples, "batches": stats.batches}


def ddp(rank: int, world_size: int) -> Result:
    model = nn.parallel.DistributedDataParallel(make_model(), broadcast_buffers=True)
    precisebn.recalibrate(model, shard(rank, world_size), num_samples="all")
    after_recalibrate = buffers(model.module)
    model.eval()
    model(torch.randn(2, 3, 6, 6))  # DDP broadcasts rank 0's buffers before this forward
    return {"state": after_recalibrate, "kept_after_ddp_forward": same_state(after_recalibrate, buffers(model.module))}


def frozen_one_rank_evaluating(rank: int, world_size: int) -> Result:
    """A DDP model whose layer "1" is frozen for training (eval mode while the model trains); rank 0 has
    evaluated alone through ``model.module`` (its wrapper still says training), the others train: every rank
    must leave "1" out and measure "6" (no rank may skip the computation: the others would wait for it)."""
    model = make_model()
    model.train()
    model[1].eval()
    wrapped = nn.parallel.DistributedDataParallel(model)
    if rank == 0:
        wrapped.module.eval()
    kept = {k: v.clone() for k, v in model[1].named_buffers()}
    report = precisebn.PreciseBNScheduler(wrapped, shard(rank, world_size), num_samples="all").update(1)
    return {
        "updated": report.updated if report is not None else None,
        "state": buffers(model),
        "kept": all(torch.equal(v, getattr(model[1], k)) for k, v in kept.items()),
    }


def frozen_option_mismatch(rank: int, world_size: int) -> Result:
    """frozen="skip" on rank 0 and "include" on the others, with layer "1" frozen for training: the ranks select
    different layers, which every rank must be told (the gathering of frozen layers must not leave one waiting)."""
    model = make_model()
    model.train()
    model[1].eval()
    scheduler = precisebn.PreciseBNScheduler(model, shard(rank, world_size), frozen="skip" if rank == 0 else "include")
    try:
        scheduler.update(1)
    except precisebn.PreciseBNError as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"error": None}


def wrong_process_group(rank: int, world_size: int) -> Result:
    """process_group=123: a clear error on every rank (was a raw AttributeError)."""
    try:
        precisebn.recalibrate(make_model(), shard(rank, world_size), process_group=123)
    except precisebn.PreciseBNError as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"error": None}


def outside_the_group(rank: int, world_size: int) -> Result:
    """A group of ranks 0 and 1; the last rank, outside it, passes it too: refused there (it computed on its own
    data alone, silently), while the members merge between themselves."""
    group = torch.distributed.new_group([0, 1])  # (every rank takes part in creating it)
    model = make_model()
    try:
        report = precisebn.recalibrate(model, shard(rank, world_size), num_samples="all", process_group=group)
    except precisebn.PreciseBNError as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"error": None, "world_size": report.world_size}


def failure_in_a_subgroup(rank: int, world_size: int) -> Result:
    """A group of global ranks 1 and 2; a bad batch on global rank 2 (a probe: both were told "rank 1 of 2"
    failed, global rank 1 being told it failed itself — the number was the rank within the group)."""
    group = torch.distributed.new_group([1, 2])
    result: Result = {"error": None}
    if rank > 0:
        data = shard(rank, world_size)
        if rank == 2:
            data[0] = data[0][:1]  # (one sample: one value per channel)
        model = make_model()
        before = buffers(model)
        try:
            precisebn.recalibrate(model, data, process_group=group)
        except DistributedError as exc:
            result = {**_error(exc), "unchanged": same_state(before, buffers(model))}
    torch.distributed.barrier()  # (rank 0 hosts the store the failure messages go through: it waits)
    return result


def scheduler_data_fails(rank: int, world_size: int) -> Result:
    """Probe 38: a scheduler's data callable raising on rank 1 (a missing shard) raised there before the passes,
    and the other ranks waited in the passes' first collective until the process group's timeout."""
    model = make_model()
    before = buffers(model)

    def data() -> list[torch.Tensor]:
        if rank == 1:
            raise FileNotFoundError("shard-1.tar on rank 1")
        return shard(rank, world_size)

    start = time.time()
    try:
        precisebn.PreciseBNScheduler(model, data, num_samples="all").update(1)
    except DistributedError as exc:
        return {**_error(exc), "unchanged": same_state(before, buffers(model)), "seconds": time.time() - start}
    return {"error": None}


def mismatch_in_a_subgroup(rank: int, world_size: int) -> Result:
    """A group of global ranks 1 and 2 passing different tolerances to num_samples="auto" (probe 38: named "rank 0"
    and "rank 1", the ranks within the group — global rank 0 is not in it)."""
    group = torch.distributed.new_group([1, 2])
    result: Result = {"error": None}
    if rank > 0:
        result = expect_failure(_stream(rank), num_samples="auto", tolerance=[1e-9, 0.5][rank - 1], process_group=group)
    torch.distributed.barrier()
    return result


def standard_errors(rank: int, world_size: int) -> Result:
    """The standard errors of the union's statistics (probe 38: each rank's folds merged with the same-numbered
    folds of the others, three ranks of one batch each filled one fold, and every error was NaN)."""
    stats = precisebn.estimate(make_model(), shard(rank, world_size), num_samples="all")
    return {name: (s.se_mean, s.se_var) for name, s in stats.items()}


def expect_failure(data: Any, **options: Any) -> Result:
    """Recalibrates a fresh model expecting every rank to raise; records the error and
    whether the model kept its exact state."""
    model = make_model()
    before = buffers(model)
    try:
        precisebn.recalibrate(model, data, **options)
    except (DistributedError, KeyboardInterrupt) as exc:
        return {**_error(exc), "unchanged": same_state(before, buffers(model))}
    return {"error": None}


def float64_union(rank: int, world_size: int) -> Result:
    model = make_model().double()
    precisebn.recalibrate(model, [b.double() for b in shard(rank, world_size)], num_samples="all")
    return {"state": buffers(model)}


def _stream(rank: int, fail_at: int | None = None) -> Iterator[torch.Tensor]:
    g = torch.Generator().manual_seed(200 + rank)
    for i in itertools.count():
        if i == fail_at:
            raise OSError(f"disk read error on rank {rank}")
        yield torch.randn(4, 3, 6, 6, generator=g) * 2 + rank


def auto_union(rank: int, world_size: int) -> Result:
    """num_samples="auto" on endless streams (rank r's batches differ): one common stop."""
    model = make_model()
    stats = precisebn.estimate(model, _stream(rank), num_samples="auto", tolerance=0.05)
    return {
        "samples": stats.samples,
        "batches": stats.batches,
        "mean": {k: v.mean for k, v in stats.items()},
        "var": {k: v.var for k, v in stats.items()},
        "se": max(float(max(v.se_var.nanmedian(), v.se_mean.nanmedian())) for v in stats.values()),
    }


def small_share(kind: str) -> Any:
    """Rank 1's data in :func:`auto_small_share`: ``"one"`` batch of 4, ``"empty"``: three empty batches, or
    ``"imprecise"``: an endless stream whose batches each repeat one sample 4 times (its values correlated
    within each batch: its error per sample twice as large, genuinely)."""
    g = torch.Generator().manual_seed(400)
    if kind == "one":
        return [torch.randn(4, 3, 6, 6, generator=g) * 2 + 1]
    if kind == "empty":
        return [torch.empty(0, 3, 6, 6) for _ in range(3)]
    return (torch.randn(1, 3, 6, 6, generator=g).repeat(4, 1, 1, 1) * 2 + 1 for _ in itertools.count())


def auto_small_share(rank: int, world_size: int) -> Result:
    """num_samples="auto" (tolerance 0.02) with rank 0 on an endless stream and rank 1 on :func:`small_share`'s
    data: a rank of one batch or only empty ones, whose error is unknown, made the union's unknown (probe 45:
    32,768 samples on rank 0, the cap, instead of the 6,592 it needs alone)."""
    out = {}
    for kind in ("one", "empty", "imprecise"):
        stats = precisebn.estimate(make_model(), small_share(kind) if rank == 1 else _stream(rank), num_samples="auto")
        out[kind] = {
            "samples": stats.samples,
            "batches": stats.batches,
            "mean": {k: v.mean for k, v in stats.items()},
            "var": {k: v.var for k, v in stats.items()},
            "se": max(float(max(v.se_var.nanmedian(), v.se_mean.nanmedian())) for v in stats.values()),
        }
    return out


def auto_failure(rank: int, world_size: int) -> Result:
    """Rank 1's stream fails after 13 batches while the others vote: every rank raises."""
    return expect_failure(_stream(rank, fail_at=13 if rank == 1 else None), num_samples="auto", tolerance=1e-3)


def argument_error(rank: int, world_size: int) -> Result:
    """A mistake on one rank only (data=None) must reach every rank as a DistributedError."""
    return expect_failure(None if rank == 1 else shard(rank, world_size))


def recalibrate_argument_error(rank: int, world_size: int) -> Result:
    """recalibrate()'s own options (prior=, adapt=, distributed=) wrong on one rank only: every rank
    raises at once (these were checked outside the failure protocol: the other ranks hung)."""
    out = {}
    for option, value in (("prior", -1), ("adapt", "bogus"), ("distributed", "yes")):
        out[option] = expect_failure(shard(rank, world_size), **({option: value} if rank == 1 else {}))
    return out


def auto_on_one_rank(rank: int, world_size: int) -> Result:
    """num_samples="auto" on rank 0, a fixed num_batches on the others: the votes would pair with
    the others' status exchange (a blank error there, a hang on rank 0)."""
    start = time.time()
    if rank == 0:
        out = expect_failure(_stream(rank), num_samples="auto", tolerance=1e-9)
    else:
        out = expect_failure(_stream(rank), num_batches=9)
    return {**out, "seconds": time.time() - start}


def paths_over_ranks(rank: int, world_size: int) -> Result:
    """Layer a read fast on rank 0, measured in float64 on rank 1 (|mean| 1e4 fails verification); layer b
    never called on rank 1: each rank's report said its own path (rank 1: b "none" though updated) and its
    own most calls per forward (a probe). Now the same on every rank: a "mixed", b "fast"."""
    g = torch.Generator().manual_seed(rank)
    model = nn.ModuleDict({"a": nn.BatchNorm1d(3), "b": nn.BatchNorm1d(3)})
    if rank == 0:
        data = [("a", torch.randn(8, 3, generator=g)), ("b", torch.randn(8, 3, generator=g))]
    else:
        data = [("a", torch.randn(8, 3, generator=g) + 1e4)]
    report = precisebn.recalibrate(model, data, forward=lambda m, batch: m[batch[0]](batch[1]), num_samples="all")
    return {"layers": {r.name: (r.path, r.per_forward, r.status) for r in report.layers}}


def tolerance_mismatch(rank: int, world_size: int) -> Result:
    """num_samples="auto" on every rank with different tolerances: the ranks stopped at different votes, and
    the error said rank 1 did not use "auto" (a probe). Refused at the first vote, naming the tolerances."""
    return expect_failure(_stream(rank), num_samples="auto", tolerance=[1e-9, 0.5][rank % 2])


def prior_fails_on_one_rank(rank: int, world_size: int) -> Result:
    """recalibrate(prior=4) where only rank 1's own statistics (pooled with the measured ones) hold
    a NaN: all or nothing — every rank raises, no model changes (rank 0 used to write alone)."""
    model = make_model()
    if rank == 1:
        model[1].running_var[2] = float("nan")
    before = buffers(model)
    try:
        precisebn.recalibrate(model, shard(rank, world_size), prior=4)
    except DistributedError as exc:
        return {**_error(exc), "unchanged": same_state(before, buffers(model))}
    return {"error": None, "unchanged": same_state(before, buffers(model))}


def auto_empty_rank(rank: int, world_size: int) -> Result:
    """num_samples="auto" with no data on rank 1: raised at the others' next vote, not after their
    whole pass (the empty rank used to join the votes first)."""
    start = time.time()
    data = [] if rank == 1 else _stream(rank)
    return {**expect_failure(data, num_samples="auto", tolerance=1e-9), "seconds": time.time() - start}


class _Unprintable(RuntimeError):
    def __str__(self) -> str:
        raise ValueError("no message")


def unprintable_errors(rank: int, world_size: int) -> Result:
    """Rank 0's data raises at batch 2 an error whose message UTF-8 cannot encode (a lone surrogate, as
    os.fsdecode makes of an undecodable file name), then one whose __str__ raises: every rank raises at once
    (both used to wait for the message until the group's timeout), the message escaped or described."""
    out = {}
    for name, error in (
        ("surrogate", RuntimeError("cannot decode " + os.fsdecode(b"/data/img_\xff.jpg"))),
        ("unprintable", _Unprintable()),
    ):

        def data(error: BaseException = error) -> Iterator[torch.Tensor]:
            for i, batch in enumerate(_stream(rank)):
                if rank == 0 and i == 2:
                    raise error
                yield batch

        start = time.time()
        out[name] = {**expect_failure(data(), num_batches=6), "seconds": time.time() - start}
    return out


def per_call_mismatch(rank: int, world_size: int) -> Result:
    """per_call=True, every layer called once per batch on rank 0 and twice on the others."""

    def forward(m: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
        return [m(x) for _ in range(1 if rank == 0 else 2)]

    try:
        precisebn.estimate(make_model(), shard(rank, world_size), forward=forward, per_call=True)
    except DistributedError as exc:
        return _error(exc)
    return {"error": None}


def writes_differ(rank: int, world_size: int) -> Result:
    """A probe (round 15): with prior=/adapt= differing, or the ranks' models holding different running
    statistics as the prior, each rank wrote other statistics; and estimate on one rank with recalibrate on
    another hung (a different number of collectives). Each case is now refused on every rank."""
    out: dict[str, Result] = {}
    out["prior"] = expect_failure(shard(rank, world_size), prior=None if rank == 0 else 100)
    out["adapt"] = expect_failure(shard(rank, world_size), adapt="both" if rank == 0 else "mean")
    model = make_model()
    with torch.no_grad():
        model[1].running_mean.add_(float(rank))  # (DDP with broadcast_buffers=False: the ranks' own statistics)
    before = buffers(model)
    try:
        precisebn.recalibrate(model, shard(rank, world_size), prior=100)
        out["own statistics"] = {"error": None}
    except DistributedError as exc:
        out["own statistics"] = {**_error(exc), "unchanged": same_state(before, buffers(model))}
    model = make_model()
    before = buffers(model)
    try:
        if rank == 0:
            precisebn.estimate(model, shard(rank, world_size))
        else:
            precisebn.recalibrate(model, shard(rank, world_size))
        out["functions"] = {"error": None}
    except DistributedError as exc:
        out["functions"] = {**_error(exc), "unchanged": same_state(before, buffers(model))}
    model = make_model() if rank == 0 else make_model().double()  # (probe 38: "a different prior= or adapt=")
    before = buffers(model)
    try:
        precisebn.recalibrate(model, [b.to(next(model.parameters()).dtype) for b in shard(rank, world_size)])
        out["dtypes"] = {"error": None}
    except DistributedError as exc:
        out["dtypes"] = {**_error(exc), "unchanged": same_state(before, buffers(model))}
    return out


def interrupted_in_the_merge(rank: int, world_size: int) -> Result:
    """Ctrl-C on rank 1 while the merge's collectives run (a probe: the others then waited in the next one
    until the group's timeout): held until they are done, then raised there, reaching every rank."""
    import signal

    from precisebn import distributed

    original = distributed.RankContext.all_reduce
    seen = itertools.count()

    def all_reduce(self, tensor, op=None):  # type: ignore[no-untyped-def]
        if rank == 1 and next(seen) == 1:  # (the status exchange was the first; the merge's data next)
            os.kill(os.getpid(), signal.SIGINT)
        return original(self, tensor, op)

    distributed.RankContext.all_reduce = all_reduce  # type: ignore[method-assign]
    try:
        return expect_failure(shard(rank, world_size))
    finally:
        distributed.RankContext.all_reduce = original  # type: ignore[method-assign]


def interrupted_before_the_writes(rank: int, world_size: int) -> Result:
    """Ctrl-C on rank 1 as the last exchange (all ranks agreeing to write) begins (probe 38: rank 1 raised at once
    and wrote nothing while rank 0 wrote — or waited for it until the group's timeout): held until this rank's
    writes are done too, then raised there. Every rank writes, or none."""
    import signal

    from precisebn import distributed

    original = distributed.RankContext.agree

    def agree(self, digest=0):  # type: ignore[no-untyped-def]
        if rank == 1:
            os.kill(os.getpid(), signal.SIGINT)
        return original(self, digest)

    distributed.RankContext.agree = agree  # type: ignore[method-assign]
    model = make_model()
    try:
        precisebn.recalibrate(model, shard(rank, world_size), num_samples="all")
        raised = None
    except KeyboardInterrupt:
        raised = "KeyboardInterrupt"
    finally:
        distributed.RankContext.agree = original  # type: ignore[method-assign]
    return {"raised": raised, "state": buffers(model)}


def layer_mismatch(rank: int, world_size: int) -> Result:
    return expect_failure(shard(rank, world_size), layers=None if rank == 0 else ["1"])


def type_mismatch(rank: int, world_size: int) -> Result:
    """A layer of another class under the same name and channels on one rank (probe 44c: BatchNorm2d beside
    InstanceNorm2d was merged into one mixed population, silently; ``PopulationStats.merge`` refuses it)."""
    model = make_model()
    if rank == 1:
        model[1] = nn.InstanceNorm2d(4, track_running_stats=True)
    before = buffers(model)
    try:
        precisebn.recalibrate(model, shard(rank, world_size))
    except DistributedError as exc:
        return {**_error(exc), "unchanged": same_state(before, buffers(model))}
    return {"error": None}


def mode_mismatch(rank: int, world_size: int) -> Result:
    """mode= differing across ranks: statistics of different activations (was merged silently)."""
    return expect_failure(shard(rank, world_size), mode="norm" if rank == 0 else "train")


def empty_rank(rank: int, world_size: int) -> Result:
    return expect_failure([] if rank == 1 else shard(rank, world_size))


def non_finite(rank: int, world_size: int) -> Result:
    data = shard(rank, world_size)
    if rank == 0:
        data[0][0, 0, 0, 0] = float("inf")
    return expect_failure(data)


def ctrl_c(rank: int, world_size: int) -> Result:
    calls = itertools.count()

    def forward(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if rank == 0 and next(calls) == 1:
            raise KeyboardInterrupt
        return m(x)

    return expect_failure(shard(rank, world_size) * 3, forward=forward)


SLOW_BATCHES = 400
SLOW_SECONDS = 0.02


def failure_surfaces_fast(rank: int, world_size: int) -> Result:
    """Rank 1's loader raises after 2 batches; the others have SLOW_BATCHES slow batches."""
    model = make_model()
    before = buffers(model)
    failed_at = []

    def data() -> Iterator[torch.Tensor]:
        g = torch.Generator().manual_seed(rank)
        for i in itertools.count():
            if rank == 1 and i == 2:
                failed_at.append(time.time())
                raise OSError("disk read error on rank 1")
            if i == SLOW_BATCHES:
                return
            yield torch.randn(4, 3, 6, 6, generator=g)

    def forward(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        time.sleep(SLOW_SECONDS)
        return m(x)

    start = time.time()
    try:
        precisebn.recalibrate(model, data(), forward=forward, num_samples="all")
    except DistributedError as exc:
        out = {**_error(exc), "unchanged": same_state(before, buffers(model)), "start": start}
        out["failed_at"] = failed_at[0] if failed_at else None
        out["cause"] = type(exc.__cause__).__name__ if exc.__cause__ else None
        return out
    return {"error": None}


def group_released(rank: int, world_size: int) -> Result:
    """After a call, successful or failed, nothing of precisebn's holds the process group:
    a failed call's traceback cycles would otherwise keep it until the interpreter shuts
    down, where destroying it sometimes aborts the process (seen with gloo). After the
    calls, reference counts are read without collecting garbage, as a program's exit would
    find them."""
    group = torch.distributed.group.WORLD
    gc.collect()  # no earlier garbage holds the group: a collection during the calls cannot lower the count
    before = sys.getrefcount(group)
    precisebn.recalibrate(make_model(), shard(rank, world_size), num_samples="all")
    after_success = sys.getrefcount(group)
    failed = expect_failure(_stream(rank, fail_at=3 if rank == 1 else None), num_samples="auto", tolerance=1e-3)
    return {
        "before": before,
        "after_success": after_success,
        "after_failure": sys.getrefcount(group),
        "failed": failed.get("error"),
    }


HOLD_SECONDS = 0.2  # well under LET_GO_SECONDS (1.0), however loaded the machine


def collectives_let_go(rank: int, world_size: int) -> Result:
    """Every collective's tensor is let go of by the backend before precisebn goes on.

    Gloo's worker thread drops its references to a reduced tensor just after waking the
    caller, and releasing the last one needs the GIL, which aborts the process when the
    interpreter is shutting down by then. Here a stand-in for a slow worker keeps a
    reference to each reduced tensor for HOLD_SECONDS after the collective returns; the
    result records whether it had let go by the next collective and by the end of each
    call (through a success and a failure)."""
    real = torch.distributed.all_reduce
    holds: list[dict[str, Any]] = []
    late: list[str] = []

    def check(when: str) -> None:
        late.extend(f"{when}: collective {i} still held" for i, h in enumerate(holds) if h["held"])

    def slow_backend(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        check(f"collective {len(holds)} began")
        out = real(tensor, *args, **kwargs)
        view = tensor[:]  # a view keeps a reference to the tensor itself, counted by _use_count
        hold = {"ref": view, "held": True, "took_a_reference": view._base is tensor}

        def let_go() -> None:
            hold["held"] = False  # first: precisebn may go on the moment the reference goes
            hold["ref"] = None

        holds.append(hold)
        threading.Timer(HOLD_SECONDS, let_go).start()
        return out

    torch.distributed.all_reduce = slow_backend
    try:
        precisebn.recalibrate(make_model(), shard(rank, world_size), num_samples="all")
        check("success returned")
        failed = expect_failure(_stream(rank, fail_at=3 if rank == 1 else None), num_samples="auto", tolerance=1e-3)
        check("failure raised")
    finally:
        torch.distributed.all_reduce = real
    return {
        "collectives": len(holds),
        "stand_in_took_references": all(h["took_a_reference"] for h in holds),
        "late": late,
        "failed": failed.get("error"),
    }


def _timed_failure(rank: int, call: Callable[[nn.Module], Any], model: nn.Module | None = None) -> Result:
    """Runs ``call(model)`` expecting it to raise; the error, whether the model kept its exact state, and how long
    it took (a rank waiting for another until the group's timeout: 60 s here)."""
    model = make_model() if model is None else model
    before = buffers(model)
    start = time.time()
    try:
        call(model)
    except Exception as exc:
        return {**_error(exc), "unchanged": same_state(before, buffers(model)), "seconds": time.time() - start}
    return {"error": None, "seconds": time.time() - start}


def adapt_unhashable_on_one_rank(rank: int, world_size: int) -> Result:
    """Probe 40: adapt=["mean"] on rank 1 raised a bare TypeError there before the failure protocol, and rank 0
    waited in the first collective until the group's timeout."""
    adapt: Any = ["mean"] if rank == 1 else "mean"
    return _timed_failure(rank, lambda m: precisebn.recalibrate(m, shard(rank, world_size), adapt=adapt))


def num_samples_differ(rank: int, world_size: int) -> Result:
    """Probe 40: num_samples=8 on rank 0 and 40 on rank 1 (a global number: each rank takes its share) used 4 + 20
    samples, neither, silently."""
    n = 8 if rank == 0 else 40
    data = [torch.randn(4, 3, 6, 6) for _ in range(12)]
    return _timed_failure(rank, lambda m: precisebn.recalibrate(m, data, num_samples=n))


def warning_as_error_on_one_rank(rank: int, world_size: int) -> Result:
    """Probe 40: the far-from-zero PreciseBNWarning, raised after the merge (when the statistics are put together),
    that rank 0 alone turns into an error (warnings filters are the process's) was raised there alone; the others
    waited in the last exchange until the group's timeout. Raised so on rank 0 here."""
    from precisebn import measure

    original = measure.Measurement.to_population

    def to_population(self):  # type: ignore[no-untyped-def]
        raise precisebn.errors.PreciseBNWarning("far from zero (an error on rank 0)")

    if rank == 0:
        measure.Measurement.to_population = to_population  # type: ignore[method-assign]
    try:
        return _timed_failure(rank, lambda m: precisebn.recalibrate(m, shard(rank, world_size), num_samples="all"))
    finally:
        measure.Measurement.to_population = original  # type: ignore[method-assign]


class _Refuse(Exception):
    pass


class _WithUnused(nn.Module):
    """The scenarios' model beside a layer its forward never reaches."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_model()
        self.unused = nn.BatchNorm1d(7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def logging_fails_on_one_rank(rank: int, world_size: int) -> Result:
    """Probe 40: a layer no forward reached (so the writes log that it keeps its statistics) and a logging filter
    raising on rank 0: it raised with its model unchanged, after rank 1 had written its own."""
    import logging

    class Failing(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            raise _Refuse("log sink down on rank 0")

    model = _WithUnused()
    logger = logging.getLogger("precisebn")
    failing = Failing()
    if rank == 0:
        logger.addFilter(failing)
    try:
        return _timed_failure(
            rank, lambda m: precisebn.recalibrate(m, shard(rank, world_size), num_samples="all"), model
        )
    finally:
        logger.removeFilter(failing)


def scheduler_invalidated_on_one_rank(rank: int, world_size: int) -> Result:
    """Probe 40: update(10) on every rank after rank 0 alone called invalidate(): rank 1, current, returned while
    rank 0 waited in the gathering of frozen layers until the group's timeout. Every rank recomputes now."""
    model = make_model()
    scheduler = precisebn.PreciseBNScheduler(model, shard(rank, world_size), num_samples="all")
    scheduler.update(10)
    if rank == 0:
        scheduler.invalidate()
    start = time.time()
    report = scheduler.update(10)
    return {"recomputed": report is not None, "seconds": time.time() - start, "state": buffers(model)}


def trigger_invalidated_on_one_rank(rank: int, world_size: int) -> Result:
    """The review of probe 40: the same through the integrations' Trigger (Lightning, mmengine, transformers,
    ignite), which returned on a rank whose statistics were current before the scheduler's vote."""
    from precisebn.integrations._trigger import Trigger

    model = make_model()
    trigger = Trigger("test", num_samples="all")
    trigger.bind(model, shard(rank, world_size))
    trigger.compute(10)
    if rank == 0:
        trigger.invalidate_at(10)
    start = time.time()
    report = trigger.compute(10)
    return {"recomputed": report is not None, "seconds": time.time() - start, "state": buffers(model)}


def ctrl_c_after_the_passes_of_estimate(rank: int, world_size: int) -> Result:
    """The review of probe 40: Ctrl-C on rank 0 just after its passes (held there, raised before the merge) in
    estimate(): rank 0 raised alone and rank 1 waited in the merge until the group's timeout."""
    import signal

    from precisebn import layers

    original = layers.RecalibrationState.refuse_written_elsewhere

    def refuse_written_elsewhere(self):  # type: ignore[no-untyped-def]
        os.kill(os.getpid(), signal.SIGINT)
        return original(self)

    if rank == 0:
        layers.RecalibrationState.refuse_written_elsewhere = refuse_written_elsewhere  # type: ignore[method-assign]
    start = time.time()
    try:
        precisebn.estimate(make_model(), shard(rank, world_size), num_samples="all")
    except (DistributedError, KeyboardInterrupt) as exc:
        return {**_error(exc), "seconds": time.time() - start}
    finally:
        layers.RecalibrationState.refuse_written_elsewhere = original  # type: ignore[method-assign]
    return {"error": None}


SCENARIOS: dict[str, Callable[[int, int], Result]] = {
    f.__name__: f
    for f in (
        union,
        independent,
        global_num_samples,
        ddp,
        frozen_one_rank_evaluating,
        frozen_option_mismatch,
        wrong_process_group,
        outside_the_group,
        failure_in_a_subgroup,
        float64_union,
        auto_union,
        auto_failure,
        auto_small_share,
        argument_error,
        layer_mismatch,
        type_mismatch,
        mode_mismatch,
        recalibrate_argument_error,
        auto_on_one_rank,
        tolerance_mismatch,
        paths_over_ranks,
        prior_fails_on_one_rank,
        auto_empty_rank,
        per_call_mismatch,
        writes_differ,
        interrupted_in_the_merge,
        unprintable_errors,
        empty_rank,
        non_finite,
        ctrl_c,
        failure_surfaces_fast,
        group_released,
        collectives_let_go,
        scheduler_data_fails,
        mismatch_in_a_subgroup,
        interrupted_before_the_writes,
        standard_errors,
        adapt_unhashable_on_one_rank,
        num_samples_differ,
        warning_as_error_on_one_rank,
        logging_fails_on_one_rank,
        scheduler_invalidated_on_one_rank,
        trigger_invalidated_on_one_rank,
        ctrl_c_after_the_passes_of_estimate,
    )
}


def main(rank: int, world_size: int, init_method: str, names: list[str], out_dir: str) -> None:
    """Process entry point: join the group, run the scenarios in order, save the results."""
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=60)
    )
    results: dict[str, Result] = {}
    try:
        for name in names:
            try:
                results[name] = SCENARIOS[name](rank, world_size)
            except Exception as exc:
                results[name] = {"error": "unexpected " + type(exc).__name__, "message": traceback.format_exc()}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4].split(","), sys.argv[5])
