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

Usage::

    git worktree add /tmp/old <commit>
    python -m benchmarks.ab /tmp/old/src src --models timm_efficientnet_b0,mlp --pairs 3

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


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ab", description=__doc__.split("\n\n")[0])
    p.add_argument("a", help="source folder of version A (the folder that holds the precisebn package)")
    p.add_argument("b", help="source folder of version B")
    p.add_argument("--models", default="timm_efficientnet_b0", help="comma-separated benchmark models")
    p.add_argument("--pairs", type=int, default=3, help="A/B process pairs per model")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds per process")
    p.add_argument("--_measure", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._measure:
        _measure(args._measure[0], args._measure[1], args.rounds)
        return 0
    for model_name in [m.strip() for m in args.models.split(",") if m.strip()]:
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
    raise SystemExit(main())
