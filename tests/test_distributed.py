"""Real multi-process runs (gloo on CPU): exact union statistics, identical on every rank,
all-or-nothing failures that surface fast. Each run is bounded by a timeout."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dist_scenarios as sc
import precisebn
from conftest import compute_truth, max_rel_error
from precisebn import distributed
from precisebn.errors import DistributedError

WORKER = Path(__file__).with_name("dist_scenarios.py")


def run_ranks(
    world_size: int, names: list[str], tmp_path: Path, *, tcp: bool = False, timeout: float = 120
) -> list[dict]:
    if tcp:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    else:
        init = f"file://{tmp_path / 'store'}"
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(r), str(world_size), init, ",".join(names), str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world_size)
    ]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"ranks did not finish within {timeout} s (a hang): {names}")
    for r, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {r} exited with {p.returncode}:\n{out}"
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(world_size)]


def union_truth(world_size: int) -> dict:
    batches = [b for r in range(world_size) for b in sc.shard(r, world_size)]
    return compute_truth(sc.make_model(), batches)


def check_union(results: list[dict], world_size: int) -> float:
    """Every rank holds the same bits, equal to the float64 truth of the union; returns the max error."""
    truth = union_truth(world_size)
    first = results[0]["union"]
    worst = 0.0
    for r, res in enumerate(results):
        u = res["union"]
        assert "error" not in u, u
        for k, v in first["state"].items():
            assert torch.equal(u["state"][k], v), f"rank {r} differs from rank 0 in {k}"
        assert u["world_size"] == world_size
        assert u["samples"] == sum(len(b) for q in range(world_size) for b in sc.shard(q, world_size))
        assert u["batches"] == sum(len(sc.shard(q, world_size)) for q in range(world_size))
    for name, t in truth.items():
        assert first["counts"][name] == t.count
        assert first["calls"][name] == t.calls
        scale = torch.maximum(t.mean.abs(), t.var.sqrt())
        worst = max(
            worst,
            max_rel_error(first["state"][f"{name}.running_mean"], t.mean, scale),
            max_rel_error(first["state"][f"{name}.running_var"], t.var),
        )
    assert worst <= 1e-5
    return worst


def test_two_ranks(tmp_path: Path) -> None:
    names = [
        "union",
        "independent",
        "global_num_samples",
        "ddp",
        "frozen_one_rank_evaluating",
        "frozen_option_mismatch",
        "wrong_process_group",
        "float64_union",
        "argument_error",
        "layer_mismatch",
        "type_mismatch",
        "mode_mismatch",
        "empty_rank",
        "non_finite",
        "ctrl_c",
    ]
    results = run_ranks(2, names, tmp_path)
    check_union(results, 2)

    # layers frozen for training: left out on every rank, even one that evaluated alone (was a hang)
    frozen = [res["frozen_one_rank_evaluating"] for res in results]
    assert all(f.get("updated") == ["6"] and f["kept"] for f in frozen), frozen
    assert all(torch.equal(v, frozen[1]["state"][k]) for k, v in frozen[0]["state"].items())
    for res in results:  # frozen= differing across ranks: told on every rank, no rank left waiting
        assert res["frozen_option_mismatch"]["error"] == "DistributedError", res["frozen_option_mismatch"]
        assert res["wrong_process_group"]["error"] == "InvalidArgumentError", res["wrong_process_group"]
        assert "process_group must be a torch.distributed process group" in res["wrong_process_group"]["message"]
    model = sc.make_model()
    model.train()
    model[1].eval()
    truth = compute_truth(model, [b for r in range(2) for b in sc.shard(r, 2)], select=lambda n, m: n == "6")["6"]
    assert max_rel_error(frozen[0]["state"]["6.running_mean"], truth.mean, truth.var.sqrt()) <= 1e-5
    assert max_rel_error(frozen[0]["state"]["6.running_var"], truth.var) <= 1e-5

    # float64 layers: the union to float64 precision, bit-identical on both ranks
    truth64 = compute_truth(sc.make_model().double(), [b.double() for r in range(2) for b in sc.shard(r, 2)])
    for res in results:
        state = res["float64_union"]["state"]
        for name, t in truth64.items():
            assert torch.equal(
                state[f"{name}.running_var"], results[0]["float64_union"]["state"][f"{name}.running_var"]
            )
            scale = torch.maximum(t.mean.abs(), t.var.sqrt())
            assert max_rel_error(state[f"{name}.running_mean"], t.mean, scale) <= 1e-12, name
            assert max_rel_error(state[f"{name}.running_var"], t.var) <= 1e-12, name

    # an argument error on one rank reaches every rank as the same DistributedError
    for res in results:
        a = res["argument_error"]
        assert a["error"] == "DistributedError" and a["failed_ranks"] == [1] and a["unchanged"], a
        assert "rank 1: InvalidArgumentError" in a["message"] and "data must be an iterable" in a["message"]

    # distributed=False: each rank only its own shard
    for r, res in enumerate(results):
        own = compute_truth(sc.make_model(), sc.shard(r, 2))
        state = res["independent"]["state"]
        assert res["independent"]["world_size"] == 1
        assert max_rel_error(state["1.running_var"], own["1"].var) <= 1e-5
    assert not torch.equal(
        results[0]["independent"]["state"]["1.running_var"], results[1]["independent"]["state"]["1.running_var"]
    )

    # num_samples is global: 20 over 2 ranks -> 10 each -> 3 batches of 4 per rank
    for res in results:
        assert res["global_num_samples"] == {"samples": 24, "batches": 6}

    # DDP wrapper: union statistics, and DDP's buffer broadcast keeps them
    truth = union_truth(2)
    for res in results:
        d = res["ddp"]
        assert d["kept_after_ddp_forward"]
        assert max_rel_error(d["state"]["6.running_var"], truth["6"].var) <= 1e-5
        assert torch.equal(d["state"]["6.running_var"], results[0]["ddp"]["state"]["6.running_var"])

    for res in results:
        m = res["layer_mismatch"]
        assert m["error"] == "DistributedError" and "different normalization layers" in m["message"] and m["unchanged"]
        m = res["type_mismatch"]
        assert m["error"] == "DistributedError" and "different normalization layers" in m["message"] and m["unchanged"]
        m = res["mode_mismatch"]
        assert (
            m["error"] == "DistributedError"
            and "passed different options" in m["message"]
            and "mode=" in m["message"]
            and m["unchanged"]
        )
        e = res["empty_rank"]
        assert e["error"] == "DistributedError" and e["failed_ranks"] == [1] and e["unchanged"]
        assert "rank 1: EmptyDataError" in e["message"]
        n = res["non_finite"]
        assert n["error"] == "DistributedError" and n["failed_ranks"] == [0] and n["unchanged"]
        assert "NonFiniteError" in n["message"] and "'1'" in n["message"]
    assert results[0]["ctrl_c"]["error"] == "KeyboardInterrupt" and results[0]["ctrl_c"]["unchanged"]
    assert results[1]["ctrl_c"]["error"] == "DistributedError" and results[1]["ctrl_c"]["failed_ranks"] == [0]
    assert results[1]["ctrl_c"]["unchanged"]


def test_auto_stops_at_the_same_batch_on_every_rank(tmp_path: Path) -> None:
    results = run_ranks(2, ["auto_union", "auto_failure"], tmp_path)
    first = results[0]["auto_union"]
    assert "error" not in first, first
    assert first["batches"] % 8 == 0 and first["se"] <= 0.05
    for res in results:
        a = res["auto_union"]
        assert (a["samples"], a["batches"]) == (first["samples"], first["batches"])
        for name in first["mean"]:
            assert torch.equal(a["mean"][name], first["mean"][name]) and torch.equal(a["var"][name], first["var"][name])
        f = res["auto_failure"]
        assert f["error"] == "DistributedError" and f["failed_ranks"] == [1] and f["unchanged"], f
        assert "disk read error on rank 1" in f["message"]


def test_auto_is_not_held_up_by_a_rank_whose_error_is_unknown_for_want_of_data(tmp_path: Path) -> None:
    """Probe 45: under num_samples="auto", a rank that saw one batch, or only empty batches, reported its error as
    unknown, and the vote (the largest over ranks) kept every rank going to the cap (32,768 samples per rank).
    Such a rank has no say now: rank 0 stops at the very batch it stops at alone (1,648 batches, 6,592 samples),
    and the statistics are the float64 truth of the union. A rank whose error is genuinely large (each batch one
    sample repeated) still keeps the others going: more samples than two alike ranks need."""
    import itertools

    torch.set_num_threads(1)
    alone = precisebn.estimate(sc.make_model(), sc._stream(0), num_samples="auto")
    results = run_ranks(2, ["auto_small_share"], tmp_path, timeout=300)
    for kind in ("one", "empty", "imprecise"):
        first = results[0]["auto_small_share"][kind]
        assert "error" not in results[0]["auto_small_share"], results[0]
        for res in results:
            a = res["auto_small_share"][kind]
            assert (a["samples"], a["batches"]) == (first["samples"], first["batches"]), kind
            for name in first["mean"]:
                assert torch.equal(a["mean"][name], first["mean"][name]) and torch.equal(
                    a["var"][name], first["var"][name]
                )
        if kind == "imprecise":  # (both ranks on endless streams: the same batches each)
            assert first["batches"] % 2 == 0 and first["samples"] > 2 * alone.samples, (first["samples"], alone.samples)
            k = first["batches"] // 2
            theirs = list(itertools.islice(sc.small_share(kind), k))
        else:
            theirs = sc.small_share(kind)
            k = first["batches"] - len(theirs)
            assert k == alone.batches, (kind, k, alone.batches)  # (before: 8,192, the cap)
        assert first["se"] <= 0.02 * 1.05, (kind, first["se"])
        truth = compute_truth(sc.make_model(), list(itertools.islice(sc._stream(0), k)) + list(theirs))
        for name, t in truth.items():
            assert max_rel_error(first["mean"][name], t.mean, t.var.sqrt()) < 1e-5, (kind, name)
            assert max_rel_error(first["var"][name], t.var) < 1e-5, (kind, name)


def test_no_reference_to_the_process_group_outlives_a_call(tmp_path: Path) -> None:
    """A failed call's traceback cycles must not keep the group alive until shutdown. (CI
    saw this scenario abort at exit, "terminate called without an active exception"; the
    cause was gloo's late release of a tensor: see the test below.)"""
    for res in run_ranks(2, ["group_released"], tmp_path):
        r = res["group_released"]
        assert r["failed"] == "DistributedError", r
        assert r["after_success"] == r["before"] and r["after_failure"] == r["before"], r


def test_collectives_are_let_go_of_before_precisebn_goes_on(tmp_path: Path) -> None:
    """CI saw a rank abort at exit: gloo's worker released the last collective's tensor
    (which takes the GIL) while the interpreter was shutting down. Each CPU collective now
    returns only once the backend has let go of its tensor."""
    for res in run_ranks(2, ["collectives_let_go"], tmp_path):
        r = res["collectives_let_go"]
        assert r["failed"] == "DistributedError", r
        assert r["collectives"] >= 4 and r["stand_in_took_references"], r  # status, 2 merges, a vote or failure
        assert r["late"] == [], r


def _jackknife_over_batches(batches: list[torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the delete-one-batch jackknife's standard errors of the pooled mean (in σ) and population variance
    (relative), from each batch's float64 truth: ``sqrt((K - 1) / K · Σ (θ_(-k) - mean θ_(-k))²)``."""
    per_batch = [compute_truth(sc.make_model(), [b]) for b in batches]
    out = {}
    for name in per_batch[0]:
        n = torch.tensor([float(t[name].count) for t in per_batch], dtype=torch.float64)[:, None]
        mean = torch.stack([t[name].mean for t in per_batch])
        square = torch.stack([t[name].var for t in per_batch]) + mean.square()  # each batch's mean square
        rest = n.sum() - n
        mean_out = ((n * mean).sum(0) - n * mean) / rest
        var_out = ((n * square).sum(0) - n * square) / rest - mean_out.square()
        total = n.sum()
        pooled_mean = (n * mean).sum(0) / total
        pooled_var = (n * square).sum(0) / total - pooled_mean.square()
        k = len(batches)

        def spread(values: torch.Tensor, k: int = k) -> torch.Tensor:
            return ((k - 1) / k * (values - values.mean(0)).square().sum(0)).sqrt()

        out[name] = (spread(mean_out) / pooled_var.sqrt(), spread(var_out) / pooled_var)
    return out


def test_three_uneven_ranks(tmp_path: Path) -> None:
    names = ["union", "empty_rank", "outside_the_group", "failure_in_a_subgroup", "mismatch_in_a_subgroup"]
    results = run_ranks(3, [*names, "standard_errors"], tmp_path)
    check_union(results, 3)
    # the standard errors are those of the union's batches in rank order, each its own fold (fewer than 16): the
    # delete-one-batch jackknife, from float64 figures of each batch (probe 38 found the ranks' folds merged by
    # number, 27-71 % off, and NaN for ranks of one batch each)
    truth = _jackknife_over_batches([b for r in range(3) for b in sc.shard(r, 3)])
    for res in results:
        for name, (se_mean, se_var) in res["standard_errors"].items():
            torch.testing.assert_close(se_mean, truth[name][0], rtol=1e-5, atol=0)  # (float32 figures merged)
            torch.testing.assert_close(se_var, truth[name][1], rtol=1e-5, atol=0)
    for res in results:
        assert res["empty_rank"]["failed_ranks"] == [1] and res["empty_rank"]["unchanged"]
    assert [res["outside_the_group"].get("world_size") for res in results[:2]] == [2, 2]
    assert results[2]["outside_the_group"]["error"] == "InvalidArgumentError"
    assert "not a member of process_group" in results[2]["outside_the_group"]["message"]
    for res in results[1:]:  # (named by their global ranks)
        f = res["failure_in_a_subgroup"]
        assert f["error"] == "DistributedError" and f["unchanged"], f
        assert "failed on rank 2 of the group of ranks 1, 2 (rank 2: InvalidArgumentError" in f["message"], f
        assert f["failed_ranks"] == [2], f  # (probe 38: [1], the rank within the group)
        m = res["mismatch_in_a_subgroup"]
        assert m["error"] == "DistributedError" and m["unchanged"], m
        assert "tolerance (rank 1: 1e-09, rank 2: 0.5)" in m["message"], m  # (probe 38: "rank 0", "rank 1")


def test_failure_on_one_rank_surfaces_fast_everywhere(tmp_path: Path) -> None:
    results = run_ranks(2, ["failure_surfaces_fast"], tmp_path, tcp=True)
    failed_at = results[1]["failure_surfaces_fast"]["failed_at"]
    full_loop = sc.SLOW_BATCHES * sc.SLOW_SECONDS
    for r, res in enumerate(results):
        f = res["failure_surfaces_fast"]
        assert f["error"] == "DistributedError", f
        assert f["failed_ranks"] == [1] and "OSError: disk read error on rank 1" in f["message"]
        assert f["unchanged"]
        latency = f["raised_at"] - failed_at
        assert latency < full_loop / 2, f"rank {r} took {latency:.2f} s to raise (its loop alone: {full_loop} s)"
    assert results[1]["failure_surfaces_fast"]["cause"] == "OSError"


def test_mistakes_on_one_rank_reach_every_rank_at_once(tmp_path: Path) -> None:
    """Found by a hostile probe: each of these hung the other ranks until the process group's timeout,
    gave a blank error, let one rank write alone, or surfaced only after the others' whole pass."""
    names = ["recalibrate_argument_error", "auto_on_one_rank", "prior_fails_on_one_rank", "auto_empty_rank"]
    names += [
        "per_call_mismatch",
        "tolerance_mismatch",
        "paths_over_ranks",
        "writes_differ",
        "interrupted_in_the_merge",
    ]
    results = run_ranks(2, names, tmp_path, timeout=100)
    for res in results:
        for option, expected in (
            ("prior", "prior must be"),
            ("adapt", "adapt must be"),
            ("distributed", "distributed"),
        ):
            a = res["recalibrate_argument_error"][option]
            assert a["error"] == "DistributedError" and a["failed_ranks"] == [1] and a["unchanged"], (option, a)
            assert "rank 1: InvalidArgumentError" in a["message"] and expected in a["message"], (option, a)
        m = res["auto_on_one_rank"]
        assert m["error"] == "DistributedError" and m["unchanged"] and m["seconds"] < 30, m
        assert "disagree on num_samples" in m["message"] and "rank 0 uses num_samples='auto'" in m["message"], m
        p = res["prior_fails_on_one_rank"]
        assert p["error"] == "DistributedError" and p["failed_ranks"] == [1] and p["unchanged"], p
        assert "StatsMismatchError" in p["message"], p
        e = res["auto_empty_rank"]
        assert e["error"] == "DistributedError" and e["failed_ranks"] == [1] and e["unchanged"], e
        assert "EmptyDataError" in e["message"] and e["seconds"] < 30, e
        assert res["paths_over_ranks"]["layers"] == {"a": ("mixed", 1, "updated"), "b": ("fast", 1, "updated")}
        t = res["tolerance_mismatch"]
        assert t["error"] == "DistributedError" and t["unchanged"], t
        assert "tolerance (rank 0: 1e-09, rank 1: 0.5)" in t["message"], t
        c = res["per_call_mismatch"]
        assert c["error"] == "DistributedError" and "per_call=" in c["message"], c
        here = "none" if res is results[0] else "'1' 2, '6' 2"  # (probe 38: no layer, no rank named)
        assert (
            f"rank {results.index(res)}'s layers called more than once per batch, with their calls: {here}"
            in (c["message"])
        ), c
        for case in ("prior", "adapt", "own statistics", "functions", "dtypes"):
            w = res["writes_differ"][case]
            assert w["error"] == "DistributedError" and w["unchanged"], (case, w)
        assert "would write different statistics" in res["writes_differ"]["own statistics"]["message"]
        assert "call the same function" in res["writes_differ"]["functions"]["message"]
        assert "whose buffers differ in dtype" in res["writes_differ"]["dtypes"]["message"]
    i0, i1 = results[0]["interrupted_in_the_merge"], results[1]["interrupted_in_the_merge"]
    assert i1["error"] == "KeyboardInterrupt" and i1["unchanged"], i1
    assert i0["error"] == "DistributedError" and i0["failed_ranks"] == [1] and i0["unchanged"], i0


def test_a_scheduler_whose_data_fails_on_one_rank_fails_on_every_rank_at_once(tmp_path: Path) -> None:
    """Probe 38: PreciseBNScheduler's data callable raised on rank 1 before the passes began; rank 0 waited in
    the first collective for the process group's timeout (60 s here, 30 minutes by default) and then raised gloo's
    own error. Now the failure goes through the passes: every rank raises the same DistributedError naming rank 1,
    at once, the models unchanged."""
    results = run_ranks(2, ["scheduler_data_fails"], tmp_path, timeout=100)
    for res in results:
        f = res["scheduler_data_fails"]
        assert f["error"] == "DistributedError" and f["failed_ranks"] == [1] and f["unchanged"], f
        assert "rank 1: FileNotFoundError: shard-1.tar on rank 1" in f["message"] and f["seconds"] < 20, f


def test_what_one_rank_alone_raises_or_decides_reaches_every_rank_at_once(tmp_path: Path) -> None:
    """Probe 40: an unhashable adapt= on one rank, a warning turned into an error on one rank after the merge, and
    a scheduler invalidated on one rank each left the other ranks waiting until the group's timeout (60 s here, 30
    minutes by default), and so did a Ctrl-C held on one rank through the end of estimate()'s passes; a logging
    filter raising on one rank left it unchanged and the other written; different
    global num_samples were taken silently. Now: the same error on every rank at once, every model unchanged — or,
    for the scheduler, every rank recomputing alike."""
    names = [
        "adapt_unhashable_on_one_rank",
        "num_samples_differ",
        "warning_as_error_on_one_rank",
        "logging_fails_on_one_rank",
        "scheduler_invalidated_on_one_rank",
        "trigger_invalidated_on_one_rank",
        "ctrl_c_after_the_passes_of_estimate",
    ]
    results = run_ranks(2, names, tmp_path, timeout=150)
    c0, c1 = (res["ctrl_c_after_the_passes_of_estimate"] for res in results)
    assert c0["error"] == "KeyboardInterrupt" and c0["seconds"] < 30, c0
    assert c1["error"] == "DistributedError" and c1["failed_ranks"] == [0] and c1["seconds"] < 30, c1
    for r, res in enumerate(results):
        a = res["adapt_unhashable_on_one_rank"]
        assert a["error"] == "DistributedError" and a["failed_ranks"] == [1] and a["unchanged"], a
        assert "adapt must be" in a["message"] and a["seconds"] < 30, a
        n = res["num_samples_differ"]
        assert n["error"] == "DistributedError" and n["unchanged"] and "num_samples=" in n["message"], n
        for name, what in (("warning_as_error_on_one_rank", "PreciseBNWarning"), ("logging_fails_on_one_rank", "")):
            w = res[name]
            assert w["error"] is not None and w["unchanged"] and w["seconds"] < 30, (name, w)
            if r == 1:
                assert w["error"] == "DistributedError" and w["failed_ranks"] == [0], (name, w)
                assert what in w["message"], (name, w)
        for name in ("scheduler_invalidated_on_one_rank", "trigger_invalidated_on_one_rank"):
            s = res[name]
            assert s["recomputed"] and s["seconds"] < 30, (name, s)
    for name in ("scheduler_invalidated_on_one_rank", "trigger_invalidated_on_one_rank"):
        states = [res[name]["state"] for res in results]
        assert all(torch.equal(states[0][k], states[1][k]) for k in states[0]), name


def test_ctrl_c_on_one_rank_before_the_writes_leaves_every_rank_written_alike(tmp_path: Path) -> None:
    """Probe 38: Ctrl-C on one rank during the last exchange, once every rank had agreed to write, raised there at
    once: that rank's model was left as it was while the others wrote (or waited for it). Held until its writes
    are done, then raised: every rank holds the union's statistics, bit for bit the same."""
    results = run_ranks(2, ["union", "interrupted_before_the_writes"], tmp_path, timeout=100)
    assert [res["interrupted_before_the_writes"]["raised"] for res in results] == [None, "KeyboardInterrupt"]
    expected = results[0]["union"]["state"]  # (the same data and model: the union's statistics)
    for res in results:
        state = res["interrupted_before_the_writes"]["state"]
        assert all(torch.equal(state[k], v) for k, v in expected.items()), state


def test_an_error_whose_message_cannot_be_stored_still_reaches_every_rank_at_once(tmp_path: Path) -> None:
    """Found by a hostile probe: a rank's error whose message held a lone surrogate (an undecodable file name
    through os.fsdecode), or whose __str__ raised, could not be stored; the other ranks learnt of the failure
    only at the status exchange and then waited for the message until the group's timeout (60 s here, 30 min
    by default), every rank, with no message."""
    results = run_ranks(2, ["unprintable_errors"], tmp_path, timeout=100)
    for res in results:
        for name, expected in (("surrogate", "img_\\udcff.jpg"), ("unprintable", "could not be formatted")):
            e = res["unprintable_errors"][name]
            assert e["error"] == "DistributedError" and e["failed_ranks"] == [0] and e["unchanged"], (name, e)
            assert expected in e["message"] and e["seconds"] < 20, (name, e)


def test_no_process_group_is_a_no_op() -> None:
    assert distributed.RankContext.resolve("auto") is None
    assert distributed.RankContext.resolve(False) is None
    with pytest.raises(ValueError, match="init_process_group"):
        distributed.RankContext.resolve(True)
    with pytest.raises(ValueError, match="distributed must be"):
        distributed.RankContext.resolve("yes")


def test_a_collective_failing_in_the_backend_is_a_distributed_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Probe 40: a rank that never called precisebn (it exited, or slept past the group's timeout) left the others
    with gloo's own RuntimeError ("Connection closed by peer", "Timed out waiting 20000ms"), which named neither
    precisebn nor what to do. It is a DistributedError now (the backend's words in it, and the error chained)."""
    ctx = object.__new__(distributed.RankContext)  # (no process group: the backend's failure is simulated)
    ctx.group, ctx.rank, ctx.world_size, ctx.device, ctx.ranks = None, 1, 2, torch.device("cpu"), (0, 3)

    def closed(*args: object, **kwargs: object) -> None:
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer")

    monkeypatch.setattr(torch.distributed, "all_reduce", closed)
    with pytest.raises(DistributedError, match=r"rank 3: a collective of precisebn's failed") as info:
        ctx.all_reduce(torch.zeros(2))
    assert "Connection closed by peer" in str(info.value) and "call it on every rank" in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError) and isinstance(info.value, RuntimeError)


def test_a_status_exchange_paired_with_a_foreign_collective_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """Probe 40: a rank that skipped precisebn and ran an all_reduce of its own paired it with precisebn's status
    exchange; its values were read as statuses — "ranks disagree on num_samples: rank  uses num_samples='auto'",
    no rank named and nobody had passed 'auto'. Values no rank of precisebn sends are named as such now."""
    ctx = object.__new__(distributed.RankContext)  # (no process group: the other rank's tensor is simulated)
    ctx.group, ctx.rank, ctx.world_size, ctx.device, ctx.ranks = None, 0, 2, torch.device("cpu"), (0, 1)

    def foreign(tensor: torch.Tensor, *args: object, **kwargs: object) -> None:
        tensor.add_(torch.arange(tensor.numel(), dtype=tensor.dtype).view_as(tensor) * 0.37)

    monkeypatch.setattr(torch.distributed, "all_reduce", foreign)
    with pytest.raises(DistributedError, match="received values no rank of precisebn sent"):
        ctx._exchange(0.0, 4, 1, 123, 0.1)
