"""Where precisebn's per-batch time goes on a GPU: kernels and wall time against the floor.

    python -m benchmarks.cuda_profile [--model resnet50] [--batch 128] [--batches 40]

Wall time: one call over ``batches`` batches minus one call over a single batch (the fixed
cost cancels), synchronised, min of 5 interleaved rounds, for the floor (the same forwards,
nothing kept) and precisebn; then torch.profiler's CUDA kernel table of one call of each
over 10 batches (kernel time, launches). Prints a report; exits 0. Needs CUDA.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from benchmarks.common import MODELS


def floor(model: nn.Module, batches: list[Tensor]) -> None:
    model.eval()
    for m in model.modules():
        if isinstance(m, _BatchNorm):
            m.train()
    with torch.no_grad():
        for b in batches:
            model(b)


def main(argv: list[str] | None = None) -> int:
    import precisebn

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet50", choices=sorted(MODELS))
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--batches", type=int, default=40)
    p.add_argument("--capture", default="auto")
    p.add_argument("--device", default="cuda", help="cuda (default), or cpu to test this script")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("cuda_profile skipped: no CUDA device")
        return 0
    torch.backends.cudnn.benchmark = True
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    model = MODELS[args.model]().to(device)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(args.batch, 3, args.size, args.size, generator=g).to(device) for _ in range(args.batches)]

    def tool(data: list[Tensor]) -> None:
        precisebn.estimate(model, data, num_samples="all", capture=args.capture)

    runs: dict[str, Callable[[list[Tensor]], None]] = {"floor": lambda d: floor(model, d), "precisebn": tool}
    for run in runs.values():  # warm-up: cuDNN autotuning, allocator
        run(batches[:3])

    def timed(run: Callable[[list[Tensor]], None], data: list[Tensor]) -> float:
        sync()
        t = time.perf_counter()
        run(data)
        sync()
        return time.perf_counter() - t

    best: dict[tuple[str, int], float] = {}
    for _ in range(5):
        for name, run in runs.items():
            for n in (1, args.batches):
                best[name, n] = min(best.get((name, n), float("inf")), timed(run, batches[:n]))
    print(f"{args.model}, {args.batches} batches of {args.batch}x3x{args.size}x{args.size}, capture={args.capture}")
    per = {}
    for name in runs:
        per[name] = (best[name, args.batches] - best[name, 1]) / (args.batches - 1) * 1e3
        print(
            f"  {name:10s} one batch {best[name, 1] * 1e3:8.1f} ms; {args.batches} batches "
            f"{best[name, args.batches] * 1e3:8.1f} ms; per extra batch {per[name]:.2f} ms"
        )
    print(f"  precisebn per extra batch ÷ floor: {per['precisebn'] / per['floor']:.3f}")
    from torch.profiler import ProfilerActivity, profile

    for name, run in runs.items():
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run(batches[:10])
            sync()
        events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        kernel_us = sum(e.self_device_time_total for e in events)
        launches = sum(e.count for e in events)
        print(f"\n===== {name}, 10 batches: CUDA kernel time {kernel_us / 1e3:.2f} ms, {launches} kernels")
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=18, max_name_column_width=70))
    return 0


if __name__ == "__main__":
    sys.exit(main())
