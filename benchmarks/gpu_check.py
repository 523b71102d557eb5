"""CUDA-only checks of precisebn (``make gpu-check``); a clean skip without a GPU.

    python benchmarks/gpu_check.py            # exits 0 with "skipped: no CUDA" on a machine without one
    python benchmarks/gpu_check.py --dry-run  # runs checks (b), (c), (e), (f) on CPU, to test this script

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
(e) Layouts and capture paths on CUDA: resnet18 and (with timm) efficientnet_b0, whose
    ``BatchNormAct2d`` has a forward of its own, in the default layout and channels_last,
    with ``capture="auto"`` and ``capture="float64"``, against float64 statistics of the
    values each layer received (cuDNN deterministic, so both runs see the same values).
(f) Nothing lost on CUDA: a Ctrl-C from the data, an exception in the model's forward
    and a NaN batch, in both modes and through ``compat.update_bn``, leave every parameter and buffer bitwise as it was,
    the training flags as they were, and no hook or wrapped ``forward`` behind.

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
        configs = [("norm", "auto"), ("train", "auto")] + ([("norm", "float64")] if not pinned else [])
        for mode, capture in configs:

            def run(data: Iterable[Any], mode: str = mode, capture: str = capture) -> None:
                precisebn.recalibrate(model, data, num_samples="all", mode=mode, device=device, capture=capture)

            run(batches)  # warm-up
            n, where = count_syncs(run, batches)
            ok = n == 0 and where is None
            msg = f"{n} syncs in batches 2-{BATCHES} ({n / (BATCHES - 1):.2f} per batch)" + (
                f"; first at {where}" if where else ""
            )
            what = f"mode={mode}" + (f", capture={capture}" if capture != "auto" else "")
            results.append((f"(a) host syncs in the loop, {what}, {label}", ok, msg))
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


# -- (e) layouts and capture paths ------------------------------------------------------


def _layout_models(device: torch.device) -> list[tuple[str, Callable[[], nn.Module]]]:
    models: list[tuple[str, Callable[[], nn.Module]]] = [("resnet18", lambda: build_model(device))]
    try:
        import timm
    except ImportError:
        return models

    def effnet() -> nn.Module:
        torch.manual_seed(0)
        return timm.create_model("efficientnet_b0", pretrained=False).to(device)

    models.append(("timm efficientnet_b0", effnet))
    return models


def check_layouts(device: torch.device) -> list[tuple[str, bool | None, str]]:
    import precisebn

    tol = {"auto": 1e-5, "float64": 1e-7}  # the README's float32 claim; issue 11's float64 figure
    size = 224 if device.type == "cuda" else 32
    g = torch.Generator().manual_seed(1)
    base = [torch.randn(8, 3, size, size, generator=g) * 2 + 0.5 for _ in range(6 if device.type == "cuda" else 2)]
    results: list[tuple[str, bool | None, str]] = []
    saved = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        for name, make in _layout_models(device):
            for layout in ("contiguous", "channels_last"):
                fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
                model = make().to(memory_format=fmt)
                batches = [b.to(device).contiguous(memory_format=fmt) for b in base]
                truth = float64_truth(model, batches, lambda m, b: m(b))
                for capture in ("auto", "float64"):
                    stats = precisebn.estimate(model, batches, num_samples="all", capture=capture)
                    var_err, mean_err, layers = max_errors(stats, truth)
                    results.append(
                        (
                            f"(e) {name}, {layout}, capture={capture}",
                            var_err <= tol[capture] and mean_err <= tol[capture],
                            f"{layers} layers: max rel. err. var {var_err:.1e}, max mean err. {mean_err:.1e} σ "
                            f"(tolerance {tol[capture]:.0e})",
                        )
                    )
    finally:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved
    return results


# -- (f) nothing lost --------------------------------------------------------------------


class _Raising(nn.Module):
    """Wraps a model; its forward raises on the ``at``-th call."""

    def __init__(self, inner: nn.Module, at: int) -> None:
        super().__init__()
        self.inner, self.at, self.calls = inner, at, 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        if self.calls == self.at:
            raise RuntimeError("planted failure in the model's forward")
        return self.inner(x)


def _snapshot(model: nn.Module) -> dict[str, Any]:
    return {
        "tensors": {k: v.detach().clone() for k, v in [*model.named_parameters(), *model.named_buffers()]},
        "flags": [m.training for m in model.modules()],
        "momenta": [getattr(m, "momentum", None) for m in model.modules()],
    }


def _unchanged(model: nn.Module, before: dict[str, Any]) -> str:
    """'' when the model is as ``before`` and carries nothing of precisebn's, else what differs."""
    now = dict([*model.named_parameters(), *model.named_buffers()])
    if set(now) != set(before["tensors"]):
        return f"tensors added or removed: {sorted(set(now) ^ set(before['tensors']))[:3]}"
    for k, v in before["tensors"].items():
        t = now[k]
        if t.dtype != v.dtype or t.device != v.device or not torch.equal(t.detach(), v):
            return f"{k} changed"
    if [m.training for m in model.modules()] != before["flags"]:
        return "training flags changed"
    if [getattr(m, "momentum", None) for m in model.modules()] != before["momenta"]:
        return "a momentum changed"
    for name, m in model.named_modules():
        if m._forward_hooks or m._forward_pre_hooks or "forward" in m.__dict__:
            return f"a hook or wrapped forward left on {name or 'the model'}"
    return ""


def check_nothing_lost(device: torch.device) -> list[tuple[str, bool | None, str]]:
    import precisebn
    from precisebn.errors import NonFiniteError

    results: list[tuple[str, bool | None, str]] = []
    batches = make_batches(6, device)

    def interrupted() -> Iterator[Tensor]:
        yield from batches[:3]
        raise KeyboardInterrupt

    nan = [*batches[:2], torch.full_like(batches[2], float("nan")), *batches[3:]]
    cases: list[tuple[str, Callable[[], Iterable[Any]], int, type[BaseException]]] = [
        ("Ctrl-C from the data at batch 4", interrupted, 0, KeyboardInterrupt),
        ("exception in the model's forward at batch 3", lambda: batches, 3, RuntimeError),
        ("NaN batch 3", lambda: nan, 0, NonFiniteError),
    ]
    from precisebn.compat import update_bn

    for mode in ("norm", "train", "compat.update_bn"):
        for label, data, at, expected in cases:
            model = build_model(device)
            model.train()
            for m in model.modules():
                if isinstance(m, _BatchNorm):
                    m.eval()  # mixed flags: each must come back as it was
                    break
            wrapped = _Raising(model, at) if at else model
            before = _snapshot(wrapped)
            raised: BaseException | None = None
            try:
                if mode == "compat.update_bn":
                    update_bn(data(), wrapped)
                else:
                    precisebn.recalibrate(wrapped, data(), num_samples="all", mode=mode)
            except BaseException as exc:  # Ctrl-C included, on purpose
                raised = exc
            if device.type == "cuda":
                torch.cuda.synchronize()
            diff = _unchanged(wrapped, before)
            ok = isinstance(raised, expected) and not diff
            what = type(raised).__name__ if raised else "nothing"
            msg = f"raised {what}; " + (diff or "model bitwise unchanged, no hooks")
            what = mode if mode.startswith("compat") else f"mode={mode}"
            results.append((f"(f) {label}, {what}", ok, msg))
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
    p.add_argument("--dry-run", action="store_true", help="run checks (b), (c), (e) and (f) on CPU (tests this script)")
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
        check_layouts,
        check_nothing_lost,
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
