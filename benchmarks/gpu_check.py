"""CUDA-only checks of precisebn (``make gpu-check``); a clean skip without a GPU.

    python benchmarks/gpu_check.py            # exits 0 with "skipped: no CUDA" on a machine without one
    python benchmarks/gpu_check.py --dry-run  # runs checks (b) and (c) on CPU, to test this script itself

(a) No host synchronisation inside the batch loop: ``precisebn.recalibrate`` runs over a
    data iterator that turns ``torch.cuda.set_sync_debug_mode`` to "error" when it yields
    its first batch and back off once exhausted, so any synchronising call between the
    first batch and the end of the data raises and is located; then once more in "warn"
    mode to count them. Batches of several sizes (so that new count vectors go to the
    device inside the loop); batches on the GPU, and pinned CPU batches (``DataLoader(pin_memory=True)``). The
    floor (the same forwards, nothing kept) is checked first so that a model that
    synchronises by itself is not blamed on precisebn.
(b) Exactness on CUDA: every layer's statistics against float64 statistics of exactly
    the values the layer received, for a float32 model and under bf16 autocast.
(c) SyncBatchNorm in one process (world size 1): exact, and no host synchronisation
    in the loop.
(d) SyncBatchNorm across two processes (nccl with two GPUs, gloo with CUDA tensors on
    one): every rank ends with the same statistics, equal to the float64 statistics of
    the union of both ranks' inputs (each layer measured once, not twice).

Self-contained (torch, torchvision if installed, precisebn); finishes in well under
three minutes on one GPU. Exit status 1 if any check fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

TOL = {"float32": 1e-4, "bfloat16": 1e-3}  # max relative error of the variance (float32 / bf16 batch figures)
BATCHES = 70  # enough to cross the collector's cache of count vectors with varied batch sizes


def build_model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    try:
        import torchvision

        model = torchvision.models.resnet18(weights=None)
    except ImportError:
        layers: list[nn.Module] = []
        c = 3
        for width in (32, 64, 128, 256):
            layers += [nn.Conv2d(c, width, 3, stride=2, padding=1), nn.BatchNorm2d(width), nn.ReLU()]
            c = width
        model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, 10))
    return model.to(device)


def make_batches(n: int, device: torch.device, pinned: bool = False, size: int = 8) -> list[Tensor]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        x = torch.randn(size + i % 20, 3, 64, 64, generator=g) * 2 + 0.5  # 20 sizes: new count vectors in the loop
        out.append(x.pin_memory() if pinned else x.to(device))
    return out


# -- (a) host synchronisations -----------------------------------------------------------


def guarded(batches: Iterable[Any], mode: str) -> Iterator[Any]:
    """Yields the batches with the sync debug mode set to ``mode`` from the second batch
    until the data is exhausted (the caller's loop body included). The first batch is
    precisebn's verifying batch, which ends with one host read by design (each layer's
    own figures compared with float64, see precisebn.capture)."""
    previous = torch.cuda.get_sync_debug_mode()
    iterator = iter(batches)
    try:
        first = next(iterator)
    except StopIteration:
        return
    yield first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield from iterator
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def _where(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if "precisebn" in f.filename and "gpu_check" not in f.filename]
    f = (ours or frames)[-1]
    return f"{os.path.relpath(f.filename)}:{f.lineno} in {f.name}: {f.line}"


def count_syncs(run: Callable[[Iterable[Any]], None], batches: list[Any]) -> tuple[int, str | None]:
    """(syncs counted in "warn" mode, where the first one raised in "error" mode or None)."""
    where = None
    try:
        run(guarded(batches, "error"))
    except RuntimeError as exc:
        if "synchroniz" not in str(exc):
            raise
        where = _where(exc)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(guarded(batches, "warn"))
    return sum("synchroniz" in str(w.message) for w in caught), where


def check_syncs(device: torch.device) -> list[tuple[str, bool, str]]:
    import precisebn

    model = build_model(device)
    results = []

    def floor(data: Iterable[Any]) -> None:
        model.eval()
        for m in model.modules():
            if isinstance(m, _BatchNorm):
                m.train()
        with torch.no_grad():
            for b in data:
                model(b.to(device, non_blocking=True))

    for label, pinned in (("GPU batches", False), ("pinned CPU batches", True)):
        batches = make_batches(BATCHES, device, pinned=pinned)
        floor(batches)  # warm-up (cuDNN autotuning, allocator)
        n_floor, where_floor = count_syncs(floor, batches)
        if n_floor:
            results.append((f"(a) floor, {label}", False, f"the model itself synchronises ({n_floor}); {where_floor}"))
            continue
        for mode in ("norm", "train"):

            def run(data: Iterable[Any], mode: str = mode) -> None:
                precisebn.recalibrate(model, data, num_samples="all", mode=mode, device=device)

            run(batches)  # warm-up
            n, where = count_syncs(run, batches)
            ok = n == 0 and where is None
            msg = f"{n} syncs in batches 2-{BATCHES} ({n / (BATCHES - 1):.2f} per batch)" + (
                f"; first at {where}" if where else ""
            )
            results.append((f"(a) host syncs in the loop, mode={mode}, {label}", ok, msg))
    return results


# -- (b) exactness -----------------------------------------------------------------------


def float64_truth(
    model: nn.Module, batches: list[Tensor], forward: Callable[[nn.Module, Tensor], Any]
) -> dict[str, Any]:
    """float64 (count, mean, M2) of every value each BatchNorm layer receives, norm mode."""
    acc: dict[str, list[Any]] = {}

    def hook_for(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Tensor, ...]) -> None:
            x = args[0].detach().to(torch.float64)
            x = x.transpose(0, 1).reshape(x.shape[1], -1)
            n_b, mean_b = x.shape[1], x.mean(1)
            m2_b = (x - mean_b[:, None]).square().sum(1)
            if name not in acc:
                acc[name] = [n_b, mean_b, m2_b]
                return
            n_a, mean_a, m2_a = acc[name]
            n = n_a + n_b
            d = mean_b - mean_a
            acc[name] = [n, mean_a + d * (n_b / n), m2_a + m2_b + d.square() * (n_a * n_b / n)]

        return hook

    flags = [(m, m.training) for m in model.modules()]
    saved = {k: v.detach().clone() for k, v in model.named_buffers()}
    model.eval()
    handles = []
    for name, m in model.named_modules():
        if isinstance(m, _BatchNorm):
            m.train()
            handles.append(m.register_forward_pre_hook(hook_for(name)))
    try:
        with torch.no_grad():
            for b in batches:
                forward(model, b)
    finally:
        for h in handles:
            h.remove()
        for m, flag in flags:
            m.training = flag
        with torch.no_grad():
            for k, v in model.named_buffers():
                v.copy_(saved[k])
    return {k: (n, mean, m2 / n) for k, (n, mean, m2) in acc.items()}


def max_errors(stats: Any, truth: dict[str, Any]) -> tuple[float, float, int]:
    worst_var = worst_mean = 0.0
    for name, (n, mean, var) in truth.items():
        s = stats[name]
        if s.count != n:
            raise AssertionError(f"layer {name}: count {s.count} != {n}")
        v = s.var.to(var.device, torch.float64)
        m = s.mean.to(mean.device, torch.float64)
        worst_var = max(worst_var, float(((v - var).abs() / var.clamp_min(1e-30)).max()))
        worst_mean = max(worst_mean, float(((m - mean).abs() / var.clamp_min(1e-30).sqrt()).max()))
    return worst_var, worst_mean, len(truth)


def check_exactness(device: torch.device) -> list[tuple[str, bool, str]]:
    import precisebn

    results = []
    batches = make_batches(12, device)
    for dtype in ("float32", "bfloat16"):
        model = build_model(device)

        def forward(m: nn.Module, b: Tensor, dtype: str = dtype) -> Any:
            if dtype == "float32":
                return m(b)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                return m(b)

        truth = float64_truth(model, batches, forward)
        stats = precisebn.estimate(model, batches, num_samples="all", forward=forward)
        var_err, mean_err, layers = max_errors(stats, truth)
        ok = var_err <= TOL[dtype]
        label = "float32" if dtype == "float32" else "bf16 autocast"
        results.append(
            (
                f"(b) exact vs float64, {label}",
                ok,
                f"{layers} layers: max rel. err. var {var_err:.1e} (tolerance {TOL[dtype]:.0e}), "
                f"max mean err. {mean_err:.1e} σ",
            )
        )
    return results


# -- (c) SyncBatchNorm in one process ----------------------------------------------------


def check_syncbn(device: torch.device) -> list[tuple[str, bool | None, str]]:
    import torch.distributed as dist

    import precisebn

    if not dist.is_available():
        return [("(c) SyncBatchNorm, one process", False, "torch.distributed is not available")]
    if device.type != "cuda":
        return [("(c) SyncBatchNorm, one process", None, "skipped: SyncBatchNorm's forward needs a GPU tensor")]
    results = []
    folder = tempfile.mkdtemp(prefix="precisebn-gpu-check-")
    backend = "nccl" if device.type == "cuda" and dist.is_nccl_available() else "gloo"
    dist.init_process_group(backend, init_method=f"file://{folder}/store", rank=0, world_size=1)
    try:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(build_model(device))
        batches = make_batches(BATCHES if device.type == "cuda" else 6, device)
        truth = float64_truth(model, batches, lambda m, b: m(b))
        stats = precisebn.estimate(model, batches, num_samples="all")
        var_err, mean_err, layers = max_errors(stats, truth)
        results.append(
            (
                f"(c) SyncBatchNorm ({backend}, world size 1): exact vs float64",
                var_err <= TOL["float32"],
                f"{layers} layers: max rel. err. var {var_err:.1e}, max mean err. {mean_err:.1e} σ",
            )
        )
        if device.type == "cuda":

            def run(data: Iterable[Any]) -> None:
                precisebn.recalibrate(model, data, num_samples="all")

            n, where = count_syncs(run, batches)
            results.append(
                (
                    "(c) SyncBatchNorm: host syncs in the loop",
                    n == 0 and where is None,
                    f"{n} syncs in {len(batches)} batches" + (f"; first at {where}" if where else ""),
                )
            )
    finally:
        dist.destroy_process_group()
    return results


# -- (d) SyncBatchNorm across two processes ----------------------------------------------


def _syncbn_model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1),
        nn.BatchNorm2d(16),
    ).to(device)


def _syncbn_shard(rank: int, device: torch.device) -> list[Tensor]:
    g = torch.Generator().manual_seed(10 + rank)
    return [(torch.randn(4 + rank, 3, 16, 16, generator=g) * 2 + rank).to(device) for _ in range(5)]


def _syncbn_worker(rank: int, folder: str, backend: str) -> None:
    import torch.distributed as dist

    import precisebn

    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{folder}/store", rank=rank, world_size=2)
    try:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(_syncbn_model(device))
        report = precisebn.recalibrate(model, _syncbn_shard(rank, device), num_samples="all")
        state = {k: v.cpu() for k, v in model.state_dict().items()}
        torch.save({"state": state, "counts": {r.name: r.count for r in report.layers}}, f"{folder}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def check_syncbn_two_processes(device: torch.device) -> list[tuple[str, bool | None, str]]:
    name = "(d) SyncBatchNorm, two processes"
    if device.type != "cuda":
        return [(name, None, "skipped: needs CUDA")]
    import torch.distributed as dist

    backend = "nccl" if torch.cuda.device_count() >= 2 and dist.is_nccl_available() else "gloo"
    folder = tempfile.mkdtemp(prefix="precisebn-gpu-check-")
    try:
        torch.multiprocessing.spawn(_syncbn_worker, args=(folder, backend), nprocs=2, join=True)
    except Exception as exc:
        if backend == "gloo":
            return [(name, None, f"skipped: gloo with CUDA tensors failed ({type(exc).__name__}); needs two GPUs")]
        raise
    ranks = [torch.load(f"{folder}/rank{r}.pt", weights_only=True) for r in range(2)]
    identical = all(torch.equal(ranks[0]["state"][k], ranks[1]["state"][k]) for k in ranks[0]["state"])
    # SyncBatchNorm normalises with the statistics of both ranks' batch i together: one
    # process running plain BatchNorm on the concatenated batches sees the same inputs.
    shards = [_syncbn_shard(r, device) for r in range(2)]
    union = [torch.cat(pair) for pair in zip(*shards)]
    truth = float64_truth(_syncbn_model(device), union, lambda m, b: m(b))
    worst = 0.0
    counts_ok = True
    for layer, (n, _, var) in truth.items():
        counts_ok &= ranks[0]["counts"][layer] == n
        v = ranks[0]["state"][f"{layer}.running_var"].to(torch.float64)
        worst = max(worst, float(((v - var.cpu()).abs() / var.cpu()).max()))
    ok = identical and counts_ok and worst <= TOL["float32"]
    return [
        (
            f"{name} ({backend})",
            ok,
            f"ranks identical: {identical}; counts = union (no double counting): {counts_ok}; "
            f"max rel. err. var vs float64 union {worst:.1e}",
        )
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="CUDA-only checks of precisebn")
    p.add_argument("--dry-run", action="store_true", help="run checks (b) and (c) on CPU (tests this script)")
    args = p.parse_args(argv)
    if args.dry_run:
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        print("gpu-check skipped: no CUDA device on this machine (torch.cuda.is_available() is False).")
        return 0
    else:
        device = torch.device("cuda")
        torch.backends.cudnn.benchmark = True
        print(f"gpu-check on {torch.cuda.get_device_name(device)}, torch {torch.__version__}", flush=True)
    start = time.perf_counter()
    results: list[tuple[str, bool | None, str]] = []
    checks: list[Callable[[torch.device], list[tuple[str, bool | None, str]]]] = [
        check_exactness,
        check_syncbn,
        check_syncbn_two_processes,
    ]
    if device.type == "cuda":
        checks.insert(0, check_syncs)
    for check in checks:
        try:
            found = check(device)
        except Exception as exc:
            found = [(check.__name__, False, f"raised {type(exc).__name__}: {exc} ({_where(exc)})")]
        for name, ok, msg in found:
            print(f"{'SKIP' if ok is None else 'PASS' if ok else 'FAIL'}  {name}: {msg}", flush=True)
        results += [r for r in found if r[1] is not None]
    failed = sum(not ok for _, ok, _ in results)
    print(f"{len(results) - failed} passed, {failed} failed ({time.perf_counter() - start:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
