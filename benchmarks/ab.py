"""A/B of two precisebn source trees on one benchmark case, in alternating processes.

On a shared machine the medians of one ``benchmarks.run`` move by several percent from
one run to the next, more than most changes are worth. This compares two versions of
the code — typically a ``git worktree`` of an older commit against the working tree —
on the same case, each in its own process, alternating A, B, A, B, ..., so that both
see the same machine. Two figures per process:

* fixed: one recalibration of one batch minus the bare forward of that batch (the
  per-call cost), min over rounds of each;
* ratio: ``recalibrate`` over the case's batches divided by the mean of the floor runs
  just before and after it, median over rounds (what ``benchmarks.run`` reports).

``--paired`` instead imports both versions into one process (A's package copied under
another name; precisebn imports itself only relatively) and times them call by call,
alternating which goes first, on small inputs (2 samples, 16x16 or 32x32 for densenet121)
so that the forward passes are short; it reports the median of the paired differences
B - A with their quartiles. Changes of a few milliseconds that whole-case medians cannot
resolve on a shared machine show there.

Usage::

    git worktree add /tmp/old <commit>
    python -m benchmarks.ab /tmp/old/src src --models timm_efficientnet_b0,mlp --pairs 3
    python -m benchmarks.ab /tmp/old/src src --models densenet121 --paired --rounds 40

Nothing here is imported by precisebn.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks import common

ROOT = Path(__file__).resolve().parent.parent


def _measure(src: str, model_name: str, rounds: int) -> None:
    """One process: import precisebn from ``src``, time the first CPU case of ``model_name``."""
    sys.path.insert(0, src)
    import torch

    import precisebn
    from benchmarks import common

    if not Path(precisebn.__file__).resolve().is_relative_to(Path(src).resolve()):
        raise SystemExit(f"precisebn was imported from {precisebn.__file__}, not from {src}")
    torch.set_num_threads(1)
    case = common.cases_for("cpu", [model_name])[0]
    device = torch.device("cpu")
    model = common.build_model(model_name, device)
    batches = common.make_batches(case, device)
    saved = {k: v.clone() for k, v in model.state_dict().items()}

    def floor(data: Sequence[torch.Tensor]) -> float:
        model.train()
        start = time.perf_counter()
        with torch.no_grad():
            for b in data:
                model(b)
        return time.perf_counter() - start

    def tool(data: Sequence[torch.Tensor]) -> float:
        start = time.perf_counter()
        precisebn.recalibrate(model, data, num_batches=len(data))
        seconds = time.perf_counter() - start
        model.load_state_dict(saved)
        return seconds

    floor(batches[:1]), tool(batches[:1]), floor(batches), tool(batches)  # warm-up
    one_floor, one_tool, ratios = [], [], []
    for _ in range(rounds):
        one_floor.append(floor(batches[:1]))
        one_tool.append(tool(batches[:1]))
        one_floor.append(floor(batches[:1]))
        a, b, c = floor(batches), tool(batches), floor(batches)
        ratios.append(b / ((a + c) / 2))
    fixed = (min(one_tool) - min(one_floor)) * 1e3
    print(f"{fixed:.2f} {statistics.median(ratios):.4f}")


def _paired(a_src: str, b_src: str, models: Sequence[str], rounds: int) -> None:
    """Both versions in this process, timed call by call (see the module's docstring)."""
    import functools
    import gc
    import importlib
    import shutil
    import tempfile

    copy = Path(tempfile.mkdtemp(prefix="precisebn-ab-"))
    try:
        shutil.copytree(Path(a_src) / "precisebn", copy / "precisebn_a")
        sys.path[:0] = [str(copy), b_src]
        import torch

        from benchmarks import common

        torch.set_num_threads(1)
        versions = (importlib.import_module("precisebn_a"), importlib.import_module("precisebn"))
        for model_name in models:
            model = common.build_model(model_name, torch.device("cpu"))
            g = torch.Generator().manual_seed(0)
            side = 32 if model_name == "densenet121" else 16
            shape = (2, 256) if model_name == "mlp" else (2, 3, side, side)
            data = [torch.randn(*shape, generator=g) for _ in range(8)]
            for n in (1, 8):
                batches = data[:n]
                runs = [functools.partial(v.recalibrate, model, batches, num_batches=n) for v in versions]
                for run in runs * 3:  # warm-up
                    run()
                times: tuple[list[float], list[float]] = ([], [])
                gc.collect()
                gc.disable()
                try:
                    for r in range(rounds):
                        for k in (0, 1) if r % 2 == 0 else (1, 0):
                            start = time.perf_counter()
                            runs[k]()
                            times[k].append(time.perf_counter() - start)
                finally:
                    gc.enable()
                d = sorted((b - a) * 1e3 for a, b in zip(*times))
                q = statistics.quantiles(d, n=4)
                print(
                    f"{model_name:28s} {n} batch(es): A median {statistics.median(times[0]) * 1e3:.1f} ms, "
                    f"B median {statistics.median(times[1]) * 1e3:.1f} ms; B - A median {statistics.median(d):+.2f} ms "
                    f"(quartiles {q[0]:+.2f} .. {q[2]:+.2f})",
                    flush=True,
                )
    finally:
        shutil.rmtree(copy, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ab", description=__doc__.split("\n\n")[0])
    p.add_argument("a", help="source folder of version A (the folder that holds the precisebn package)")
    p.add_argument("b", help="source folder of version B")
    p.add_argument("--models", default="timm_efficientnet_b0", help="comma-separated benchmark models")
    p.add_argument("--pairs", type=int, default=3, help="A/B process pairs per model")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds per process")
    p.add_argument("--paired", action="store_true", help="both versions in one process, call by call, small inputs")
    p.add_argument("--_measure", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if args.paired:
        _paired(args.a, str(Path(args.b).resolve()), models, args.rounds)
        return 0
    if args._measure:
        _measure(args._measure[0], args._measure[1], args.rounds)
        return 0
    for model_name in models:
        rows: dict[str, list[tuple[float, float]]] = {"A": [], "B": []}
        for _ in range(args.pairs):
            for label, src in (("A", args.a), ("B", args.b)):
                cmd = [sys.executable, "-m", "benchmarks.ab", args.a, args.b, "--rounds", str(args.rounds)]
                out = subprocess.run([*cmd, "--_measure", src, model_name], cwd=ROOT, capture_output=True, text=True)
                if out.returncode != 0:
                    print(out.stderr, file=sys.stderr)
                    return 1
                fixed, ratio = map(float, out.stdout.split()[-2:])
                rows[label].append((fixed, ratio))
        for label in ("A", "B"):
            fixed = ", ".join(f"{f:.1f}" for f, _ in rows[label])
            ratio = ", ".join(f"{r:.3f}" for _, r in rows[label])
            print(f"{model_name:28s} {label}: fixed ms per call {fixed}; time ÷ floor {ratio}")
    return 0


if __name__ == "__main__":
    common.with_allocator_env(["-m", "benchmarks.ab", *sys.argv[1:]])  # (its measuring processes inherit it)
    raise SystemExit(main())
