"""Cost of recalibration against the floor, fvcore and torch, on identical batches.

Usage (from the repository root)::

    python -m benchmarks.run                 # CPU (or CUDA when available), all models: ~13 min on 2 cores
    python -m benchmarks.run --quick         # a smoke test of the harness (~5 minutes)
    python -m benchmarks.run --models resnet50,mlp --rounds 9
    python -m benchmarks.run --device cuda --autocast bfloat16

Method. For each case (model, batch size) the batches are generated once and every run
gets that same list. The floor is the same forward passes under ``no_grad`` with the
BatchNorm layers in training mode and nothing kept. After warm-up, each round times the
tools in a rotated order, each run sandwiched between two floor runs
(``F T1 F T2 F ...``); a tool's ratio in a round is its time divided by the mean of the
two floor runs around it. Medians over rounds are reported with their min-max spread;
"floor (A/A)" times the floor as if it were a tool and shows the harness's noise. The
model's buffers, momenta and flags are restored (untimed) after every run.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from . import common
from .common import DEFAULT_TOOLS, FLOOR, TOOLS, Case, ModelState

DEFAULT_ROUNDS = {"cpu": 5, "cuda": 7}


LONG_RUN = 65  # small batches in the memory check: precisebn's own memory must not grow with batches


PROJECT_BATCHES = 200  # the usual recalibration length (fvcore's default num_iters)
MB = 2**20


# ---------------------------------------------------------------------------------------
# One case
# ---------------------------------------------------------------------------------------


def bench_case(
    case: Case,
    tools: Sequence[str],
    args: argparse.Namespace,
    device: torch.device,
    model_cache: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    model = common.build_model(case.model, device, args.autocast)
    batches = common.make_batches(case, device)
    truth = common.ground_truth(model, batches)
    channels = sum(m.num_features for _, m in common.bn_layers(model))
    state = ModelState(model)
    chosen = [TOOLS[t] for t in tools]

    def call(tool: common.Tool, data: Sequence[torch.Tensor] = batches) -> None:
        tool.run(model, data)

    def prepared(tool: common.Tool) -> None:
        state.restore()
        tool.prepare(model)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fvcore/torchvision deprecation chatter
        for _ in range(2):  # warm-up
            prepared(FLOOR)
            call(FLOOR)

        # One untimed pass: peak memory, statistics error, host syncs.
        extra: dict[str, dict[str, Any]] = {}
        for tool in [FLOOR, *chosen]:
            prepared(tool)
            mem = common.peak_memory(lambda tool=tool: call(tool), device) if args.memory else None
            row: dict[str, Any] = {"peak_bytes": mem}
            if tool.estimates:
                row.update(common.stats_error(model, truth))
            if device.type == "cuda":
                prepared(tool)
                once = common.count_syncs(lambda tool=tool: call(tool))
                prepared(tool)
                twice = common.count_syncs(lambda tool=tool: call(tool, list(batches) * 2))
                row["syncs_total"] = once
                row["syncs_per_batch"] = (twice - once) / len(batches)
            extra[tool.name] = row
        state.restore()

        # Fixed cost per call: the tool on one batch minus the floor on that batch; measured
        # once per model (on its first case), since it does not depend on the batch size.
        one = batches[:1]
        per_model = model_cache.setdefault(case.model, {"fixed": {}, "chunk": None})
        fixed = per_model["fixed"]
        for tool in chosen:
            if tool.name in fixed:
                continue
            if not tool.estimates:
                fixed[tool.name] = 0.0
                continue
            diffs = []
            for _ in range(args.fixed_reps):
                prepared(FLOOR)
                a = common.timed(lambda: call(FLOOR, one), device)[0]
                prepared(tool)
                x = common.timed(lambda tool=tool: call(tool, one), device)[0]
                prepared(FLOOR)
                b = common.timed(lambda: call(FLOOR, one), device)[0]
                diffs.append(x - (a + b) / 2)
            fixed[tool.name] = statistics.median(diffs)
        state.restore()

        # precisebn's own memory, apart from the activations: LONG_RUN batches of 2 samples
        # (measured once per model).
        if args.memory and per_model["chunk"] is None:
            small = common.small_batches(case, device, 4)
            long = [small[i % len(small)] for i in range(LONG_RUN)]
            prepared(FLOOR)
            call(FLOOR, long)  # warm-up at this shape
            prepared(FLOOR)
            base = common.peak_memory(lambda: call(FLOOR, long), device)
            per_model["chunk"] = {}
            for tool in chosen:
                if tool.name == "precisebn norm":
                    prepared(tool)
                    peak = common.peak_memory(lambda tool=tool: call(tool, long), device)
                    per_model["chunk"][tool.name] = None if peak is None or base is None else peak - base
            state.restore()

        def floor_time() -> tuple[float, float]:
            prepared(FLOOR)
            return common.timed(lambda: call(FLOOR), device)

        walls: dict[str, list[float]] = {t.name: [] for t in chosen}
        ratios: dict[str, list[float]] = {t.name: [] for t in chosen}
        cpu_ratios: dict[str, list[float]] = {t.name: [] for t in chosen}
        floors: list[float] = []
        for r in range(args.rounds):
            order = chosen[r % len(chosen) :] + chosen[: r % len(chosen)]
            prev = floor_time()
            floors.append(prev[0])
            for tool in order:
                prepared(tool)
                wall, cpu = common.timed(lambda tool=tool: call(tool), device)
                nxt = floor_time()
                floors.append(nxt[0])
                walls[tool.name].append(wall)
                ratios[tool.name].append(wall / ((prev[0] + nxt[0]) / 2))
                cpu_ratios[tool.name].append(cpu / ((prev[1] + nxt[1]) / 2))
                prev = nxt
        state.restore()

    floor_wall = statistics.median(floors)
    floor_peak = extra[FLOOR.name]["peak_bytes"]
    out_tools = {}
    for tool in chosen:
        e = extra[tool.name]
        over = None if e["peak_bytes"] is None or floor_peak is None else e["peak_bytes"] - floor_peak
        total_over = (statistics.median(ratios[tool.name]) - 1) * floor_wall
        per_batch = (total_over - fixed[tool.name]) / case.num_batches
        floor_batch = floor_wall / case.num_batches
        out_tools[tool.name] = {
            "ratio_median": statistics.median(ratios[tool.name]),
            "ratio_min": min(ratios[tool.name]),
            "ratio_max": max(ratios[tool.name]),
            "cpu_ratio_median": statistics.median(cpu_ratios[tool.name]) if device.type == "cpu" else None,
            "wall_median_s": statistics.median(walls[tool.name]),
            "samples_per_s": case.samples / statistics.median(walls[tool.name]),
            "fixed_ms": fixed[tool.name] * 1000,
            "per_batch_ms": per_batch * 1000,
            "projected_ratio_200": 1
            + (fixed[tool.name] + PROJECT_BATCHES * per_batch) / (PROJECT_BATCHES * floor_batch),
            "peak_over_floor_bytes": over,
            "chunk_peak_over_floor_bytes": (per_model["chunk"] or {}).get(tool.name),
            "max_rel_err_var": e.get("max_rel_err_var"),
            "max_err_mean_std": e.get("max_err_mean_std"),
            "syncs_per_batch": e.get("syncs_per_batch"),
            "syncs_total": e.get("syncs_total"),
            "ratios": ratios[tool.name],
            "cpu_ratios": cpu_ratios[tool.name],
        }
    return {
        "model": case.model,
        "batch_size": case.batch_size,
        "num_batches": case.num_batches,
        "input": case.input_desc,
        "bn_layers": len(truth),
        "bn_channels": channels,
        "floor": {
            "wall_median_s": floor_wall,
            "ms_per_batch": floor_wall / case.num_batches * 1000,
            "samples_per_s": case.samples / floor_wall,
            "peak_bytes": floor_peak,
            "syncs_per_batch": extra[FLOOR.name].get("syncs_per_batch"),
        },
        "tools": out_tools,
    }


# ---------------------------------------------------------------------------------------
# Distributed: collective calls (2 CPU processes, gloo)
# ---------------------------------------------------------------------------------------

_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "broadcast",
    "broadcast_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "barrier",
    "monitored_barrier",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "send",
    "recv",
    "isend",
    "irecv",
)
DIST_TOOLS = ("precisebn norm", "fvcore", "torch update_bn")


def _dist_worker(rank: int, world: int, folder: str, tools: Sequence[str], num_batches: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world)
    calls = {"n": 0}
    originals = {}
    for name in _COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is None:
            continue
        originals[name] = fn

        def counted(*a: Any, _fn: Any = fn, **k: Any) -> Any:
            calls["n"] += 1
            return _fn(*a, **k)

        setattr(dist, name, counted)
    case = Case("mlp", 32, 2 * num_batches * world, (256,))
    everything = common.make_batches(case, torch.device("cpu"))
    per_rank = [everything[i * 2 * num_batches : (i + 1) * 2 * num_batches] for i in range(world)]
    mine = per_rank[rank]
    model = common.build_model("mlp", torch.device("cpu"))
    state = ModelState(model)
    result: dict[str, Any] = {}
    for name in tools:
        tool = TOOLS[name]
        row: dict[str, Any] = {}
        for n in (num_batches, 2 * num_batches):
            state.restore()
            tool.prepare(model)
            calls["n"] = 0
            tool.run(model, mine[:n])
            row[f"collectives_{n}"] = calls["n"]
        truth = common.ground_truth(model, [b for part in per_rank for b in part])  # union of all ranks' data
        state.restore()
        tool.prepare(model)
        tool.run(model, mine)
        row.update(common.stats_error(model, truth))
        local = torch.cat([m.running_var.detach().double() for _, m in common.bn_layers(model)])
        scale = torch.cat([truth[n].var for n, _ in common.bn_layers(model)]).clamp_min(1e-300)
        gathered = [torch.empty_like(local) for _ in range(world)]
        originals["all_gather"](gathered, local)
        row["max_rel_diff_between_ranks"] = float(max(((g - gathered[0]).abs() / scale).max() for g in gathered))
        result[name] = row
    state.restore()
    Path(folder, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def bench_distributed(tools: Sequence[str], world: int = 2, num_batches: int = 4) -> dict[str, Any] | None:
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not dist.is_available():
        return None
    with tempfile.TemporaryDirectory(prefix="precisebn-bench-") as folder:
        mp.start_processes(_dist_worker, args=(world, folder, tools, num_batches), nprocs=world, start_method="spawn")
        ranks = [json.loads(Path(folder, f"rank{r}.json").read_text()) for r in range(world)]
    out: dict[str, Any] = {
        "world_size": world,
        "backend": "gloo",
        "batches": [num_batches, 2 * num_batches],
        "tools": {},
    }
    for name in tools:
        rows = [r[name] for r in ranks]
        once = max(r[f"collectives_{num_batches}"] for r in rows)
        twice = max(r[f"collectives_{2 * num_batches}"] for r in rows)
        out["tools"][name] = {
            "collectives_per_call": once,
            "collectives_per_batch": (twice - once) / num_batches,
            "max_rel_err_var_vs_union": max(r["max_rel_err_var"] for r in rows),
            "max_rel_diff_between_ranks": max(r["max_rel_diff_between_ranks"] for r in rows),
        }
    return out


# ---------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------


def _fmt_ratio(t: dict[str, Any]) -> str:
    return f"{t['ratio_median']:.3f} ({t['ratio_min']:.3f}–{t['ratio_max']:.3f})"


def _fmt_mb(b: float | None) -> str:
    return "–" if b is None else f"{b / MB:+.1f}"


def _fmt_err(x: float | None) -> str:
    if x is None:
        return "–"
    return f"{x:.1e}" if x < 0.01 else f"{x:.2g}"


def targets(results: dict[str, Any]) -> list[str]:
    """The issue's targets, checked against the medians (stated, never asserted)."""
    lines = []
    cases = results["cases"]
    aa = [c["tools"]["floor (A/A)"] for c in cases if "floor (A/A)" in c["tools"]]
    noise = max((abs(t["ratio_median"] - 1) for t in aa), default=0.0)
    lines.append(f"- Harness noise: A/A medians within ±{noise:.3f} of 1.")
    pbn = [(c, c["tools"]["precisebn norm"]) for c in cases if "precisebn norm" in c["tools"]]
    r50 = [(c, t) for c, t in pbn if c["model"] == "resnet50"]
    if r50:
        worst = max(t["ratio_median"] for _, t in r50)
        projected = max(t["projected_ratio_200"] for _, t in r50)
        ok = worst <= 1.03
        lines.append(
            f"- precisebn / floor ≤ 1.03 for resnet50 ({results['device']}): "
            f"{'met' if ok else 'MISSED'} (worst median {worst:.3f} on these short runs; "
            f"projected to {PROJECT_BATCHES} batches {projected:.3f})."
        )
    if pbn:
        worst_c, worst_t = max(pbn, key=lambda ct: ct[1]["ratio_median"])
        lines.append(
            f"- Within a few percent (≤ 1.05) on every case: {'met' if worst_t['ratio_median'] <= 1.05 else 'MISSED'} "
            f"(worst: {worst_c['model']} b{worst_c['batch_size']}, {worst_t['ratio_median']:.3f})."
        )
        slower = []
        for c, t in pbn:
            for other in ("fvcore", "torch update_bn"):
                o = c["tools"].get(other)
                if o and t["ratio_median"] > o["ratio_median"] + noise:
                    slower.append(
                        f"{c['model']} b{c['batch_size']} vs {other} "
                        f"({t['ratio_median']:.3f} > {o['ratio_median']:.3f})"
                    )
        lines.append(
            "- At least as fast as fvcore and torch's update_bn on every case (medians, A/A noise allowed): "
            + ("met." if not slower else "MISSED: " + "; ".join(slower) + ".")
        )
        if results["device"].startswith("cuda"):
            syncs = [t.get("syncs_per_batch") for _, t in pbn]
            ok = all(s == 0 for s in syncs if s is not None)
            lines.append(f"- Zero host synchronisations per batch on CUDA: {'met' if ok else 'MISSED'} ({syncs}).")
        else:
            lines.append(
                "- Host synchronisations: measured on CUDA only (`make gpu-check`, or this harness with --device cuda)."
            )
        overs = [(c, t["peak_over_floor_bytes"]) for c, t in pbn if t["peak_over_floor_bytes"] is not None]
        if overs:
            worst_c, worst_b = max(overs, key=lambda cb: cb[1])
            own = {}
            for c, t in pbn:
                if t.get("chunk_peak_over_floor_bytes") is not None:
                    own[c["model"]] = (t["chunk_peak_over_floor_bytes"], c["bn_channels"])
            per_channel = ", ".join(f"{m} {b / MB:.1f} MB = {b / ch:.0f} B/channel" for m, (b, ch) in own.items())
            lines.append(
                f"- Peak memory over the floor: largest in the timed cases {worst_b / MB:+.1f} MB "
                f"({worst_c['model']} b{worst_c['batch_size']}, {worst_c['num_batches']} batches). "
                + (
                    f"precisebn's own peak at {LONG_RUN} small batches: {per_channel} — O(channels): a few "
                    "float64 vectors of all channels, whatever the number of batches."
                    if own
                    else ""
                )
            )
    return lines


def to_markdown(results: dict[str, Any]) -> str:
    cases = results["cases"]
    tools = list(cases[0]["tools"]) if cases else []
    cuda = results["device"].startswith("cuda")
    autocast = f", {results['autocast']} autocast" if results.get("autocast") else ""
    out = [
        f"# precisebn benchmarks ({results['device']}{autocast})",
        "",
        f"{'**QUICK RUN — a smoke test of the harness, not a measurement.** ' if results['quick'] else ''}"
        f"Machine: {common.describe_machine(results['machine'])}.",
        "",
        f"Command: `{results['command']}` ({results['elapsed_s'] / 60:.1f} min). {results['rounds']} rounds; "
        "each run sandwiched between two floor runs; median ratio to the floor (min–max over rounds).",
        "Floor: the same forward passes under `no_grad`, BatchNorm layers in training mode, nothing kept.",
        "",
        "## Time / floor",
        "",
        "| model | input (N×…) | batches | floor ms/batch | " + " | ".join(tools) + " |",
        "|---|---|---:|---:|" + "---:|" * len(tools),
    ]
    for c in cases:
        out.append(
            f"| {c['model']} | {c['input']} | {c['num_batches']} | {c['floor']['ms_per_batch']:.1f} | "
            + " | ".join(_fmt_ratio(c["tools"][t]) for t in tools)
            + " |"
        )
    if not cuda and cases and cases[0]["tools"][tools[0]].get("cpu_ratio_median") is not None:
        out += [
            "",
            "Same runs, CPU time of the (single) compute thread instead of wall time — less sensitive to other",
            "processes on the machine (median ratio to the floor):",
            "",
            "| model | batch | " + " | ".join(tools) + " |",
            "|---|---:|" + "---:|" * len(tools),
        ]
        for c in cases:
            out.append(
                f"| {c['model']} | {c['batch_size']} | "
                + " | ".join(f"{c['tools'][t]['cpu_ratio_median']:.3f}" for t in tools)
                + " |"
            )
    est = [t for t in tools if cases and cases[0]["tools"][t]["max_rel_err_var"] is not None]
    if est:
        out += [
            "",
            f"## Overhead per call and per batch, projected to {PROJECT_BATCHES} batches",
            "",
            "Each cell: fixed ms per call (the tool on one batch minus the floor on that batch, median of "
            f"{results.get('fixed_reps', '?')}, measured on each model's first case) / overhead ms per batch"
            " (the rest of the median overhead,"
            " divided by the"
            f" batches) / projected time ÷ floor for a usual recalibration of {PROJECT_BATCHES} batches. Per-batch"
            " figures below the noise of the ratio (see A/A) can come out negative.",
            "",
            "| model | batch | floor ms/batch | " + " | ".join(est) + " |",
            "|---|---:|---:|" + "---:|" * len(est),
        ]
        for c in cases:
            out.append(
                f"| {c['model']} | {c['batch_size']} | {c['floor']['ms_per_batch']:.1f} | "
                + " | ".join(
                    f"{c['tools'][t]['fixed_ms']:.1f} / {c['tools'][t]['per_batch_ms']:.2f} / "
                    f"{c['tools'][t]['projected_ratio_200']:.3f}"
                    for t in est
                )
                + " |"
            )
    out += [
        "",
        "## Per tool",
        "",
        "samples/s: median over rounds. Peak memory over the floor: "
        + (results.get("memory_method") or "not measured")
        + ". max rel. err. var: max over layers and channels of |v − v*| / v*, against float64 statistics of"
        " every value each layer received (v* = pooled population variance); mean err.: max |m − m*| / √v*."
        " torch's update_bn averages per-batch (unbiased) variances, so its var error includes the variance"
        " of the batch means that this estimator drops.",
        "",
        "| model | batch | tool | samples/s | peak MB over floor | max rel. err. var | max mean err. (σ) |"
        + (" host syncs / batch |" if cuda else ""),
        "|---|---:|---|---:|---:|---:|---:|" + ("---:|" if cuda else ""),
    ]
    for c in cases:
        out.append(
            f"| {c['model']} | {c['batch_size']} | floor | {c['floor']['samples_per_s']:.1f} | "
            f"({_fmt_mb(c['floor']['peak_bytes'])} total) | – | – |"
            + (f" {c['floor']['syncs_per_batch']} |" if cuda else "")
        )
        for name in tools:
            t = c["tools"][name]
            out.append(
                f"| | | {name} | {t['samples_per_s']:.1f} | {_fmt_mb(t['peak_over_floor_bytes'])} | "
                f"{_fmt_err(t['max_rel_err_var'])} | {_fmt_err(t['max_err_mean_std'])} |"
                + (f" {t['syncs_per_batch']} |" if cuda else "")
            )
    chunk_tools = [t for t in tools if cases and cases[0]["tools"][t].get("chunk_peak_over_floor_bytes") is not None]
    if chunk_tools:
        out += [
            "",
            f"precisebn's own peak memory over the floor, apart from activations: {LONG_RUN} batches of 2 samples"
            " at most 32x32 pixels (each batch is merged into float64 vectors of all channels as it ends), MB:",
            "",
            "| model | BN channels | " + " | ".join(chunk_tools) + " |",
            "|---|---:|" + "---:|" * len(chunk_tools),
        ]
        seen = set()
        for c in cases:
            if c["model"] in seen:
                continue
            seen.add(c["model"])
            out.append(
                f"| {c['model']} | {c['bn_channels']} | "
                + " | ".join(_fmt_mb(c["tools"][t]["chunk_peak_over_floor_bytes"]) for t in chunk_tools)
                + " |"
            )
    d = results.get("distributed")
    if d:
        out += [
            "",
            f"## Distributed ({d['world_size']} CPU processes, {d['backend']}, BatchNorm1d MLP)",
            "",
            "Collective calls counted by wrapping every `torch.distributed` collective; statistics compared with"
            " float64 statistics of the union of all ranks' data.",
            "",
            "| tool | collectives per call | collectives per batch | max rel. err. var vs all ranks' data "
            "| max diff. of var between ranks (rel.) |",
            "|---|---:|---:|---:|---:|",
        ]
        for name, t in d["tools"].items():
            out.append(
                f"| {name} | {t['collectives_per_call']} | {t['collectives_per_batch']:g} | "
                f"{_fmt_err(t['max_rel_err_var_vs_union'])} | {_fmt_err(t['max_rel_diff_between_ranks'])} |"
            )
    out += ["", "## Targets (stated, not asserted)", "", *targets(results), ""]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (CUDA when available; default)")
    p.add_argument(
        "--models", default=",".join(common.MODELS), help=f"comma-separated subset of {', '.join(common.MODELS)}"
    )
    p.add_argument(
        "--tools",
        default=",".join(DEFAULT_TOOLS),
        help=f"comma-separated, of {', '.join(TOOLS)} (default: all but precisebn float64)",
    )
    p.add_argument(
        "--rounds", type=int, default=None, help="timed rounds per case (default 5 on CPU, 7 on CUDA; 3 with --quick)"
    )
    p.add_argument("--quick", action="store_true", help="fewer batches and rounds: checks the harness in ~5 minutes")
    p.add_argument("--batches-scale", type=float, default=1.0, help="multiply every case's number of batches")
    p.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (default 1: stable CPU numbers; 0: torch's default)"
    )
    p.add_argument(
        "--autocast", choices=["bfloat16", "float16"], default=None, help="run the forwards under torch.autocast"
    )
    p.add_argument(
        "--fixed-reps",
        type=int,
        default=5,
        help="repetitions of the one-batch runs that measure the fixed cost per call",
    )
    p.add_argument("--no-memory", dest="memory", action="store_false", help="skip the peak-memory measurement")
    p.add_argument(
        "--no-distributed", dest="distributed", action="store_false", help="skip the 2-process collective count"
    )
    p.add_argument(
        "--quality",
        action="store_true",
        help="then run the estimation-quality study too (python -m benchmarks.quality; 10-15 min more on 2 cores)",
    )
    p.add_argument(
        "--readme",
        dest="readme",
        action="store_true",
        default=None,
        help="update README's Performance section (default: on for full runs)",
    )
    p.add_argument("--no-readme", dest="readme", action="store_false")
    p.add_argument(
        "--out", type=Path, default=None, help="output folder (default benchmarks/results, or benchmarks/results/quick)"
    )
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available")
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    for m in args.models:
        if m not in common.MODELS:
            p.error(f"unknown model {m!r}; choose from {', '.join(common.MODELS)}")
    for t in args.tools:
        if t not in TOOLS:
            p.error(f"unknown tool {t!r}; choose from {', '.join(TOOLS)}")
    kind = "cuda" if args.device.startswith("cuda") else "cpu"
    if args.rounds is None:
        args.rounds = 3 if args.quick else DEFAULT_ROUNDS[kind]
    if args.out is None:
        args.out = common.RESULTS / "quick" if args.quick else common.RESULTS
    if args.readme is None:
        args.readme = not args.quick and args.models == list(common.MODELS)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    threads = args.threads if args.threads > 0 else torch.get_num_threads()
    torch.set_num_threads(threads)
    tools = []
    for name in args.tools:
        why = common.tool_available(name)
        if why:
            print(f"skipping {name}: {why}", file=sys.stderr)
        else:
            tools.append(name)
    info = common.machine(device, threads)
    print(f"precisebn benchmarks on {common.describe_machine(info)}", flush=True)
    cases = common.cases_for(args.device, args.models, args.quick, args.batches_scale)
    results: dict[str, Any] = {
        "device": args.device,
        "autocast": args.autocast,
        "quick": args.quick,
        "rounds": args.rounds,
        "fixed_reps": args.fixed_reps,
        "command": " ".join(["python -m benchmarks.run", shlex.join(sys.argv[1:] if argv is None else argv)]).strip(),
        "memory_method": (
            "torch.cuda.max_memory_allocated (tensor memory) during the call minus memory allocated before it"
            if device.type == "cuda"
            else common.cpu_memory_method()
        )
        if args.memory
        else None,
        "tools": {name: TOOLS[name].note for name in tools},
        "floor": FLOOR.note,
        "cases": [],
    }
    model_cache: dict[str, dict[str, Any]] = {}
    for case in cases:
        t0 = time.perf_counter()
        print(f"{case.label:24s} {case.input_desc:>16s} x {case.num_batches:3d} batches ...", end="", flush=True)
        res = bench_case(case, tools, args, device, model_cache)
        results["cases"].append(res)
        summary = "  ".join(f"{k}: {v['ratio_median']:.3f}" for k, v in res["tools"].items())
        print(
            f" {time.perf_counter() - t0:5.1f} s | floor {res['floor']['ms_per_batch']:.1f} ms/batch | {summary}",
            flush=True,
        )
    if args.distributed:
        dist_tools = [t for t in DIST_TOOLS if t in tools]
        if dist_tools:
            print("distributed: 2 CPU processes (gloo) ...", flush=True)
            try:
                results["distributed"] = bench_distributed(dist_tools)
            except Exception as exc:  # reported, not fatal: the timing results stand
                print(f"distributed measurement failed: {exc!r}", file=sys.stderr)
    info["load_average_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    results["machine"] = info
    results["elapsed_s"] = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "results" if device.type == "cpu" else "results-cuda"
    if args.autocast:
        stem += f"-{args.autocast}"
    (args.out / f"{stem}.json").write_text(json.dumps(results, indent=1) + "\n")
    (args.out / "machine.json").write_text(json.dumps(info, indent=1) + "\n")
    markdown = to_markdown(results)
    (args.out / f"{stem}.md").write_text(markdown)
    print()
    print(markdown)
    print(f"written: {args.out / (stem + '.md')}, {args.out / (stem + '.json')}")
    if args.quality:
        from . import quality

        quality.main(["--quick"] if args.quick else [], out=args.out)
    if args.readme:
        from . import readme

        readme.update()
        print("README.md: Performance section updated")
    return 0


if __name__ == "__main__":
    common.with_allocator_env(["-m", "benchmarks.run", *sys.argv[1:]])
    sys.exit(main())
