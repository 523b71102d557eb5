"""Shared pieces of the benchmarks: models, batches, the tools compared, a float64
ground truth, model-state save/restore, timers, memory meters and the machine description.

Nothing here is imported by precisebn; fvcore is needed only by the benchmarks
(``pip install -e '.[bench]'``).
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import gc
import math
import os
import platform
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"

# ---------------------------------------------------------------------------------------
# Models and batches
# ---------------------------------------------------------------------------------------


class TabularMLP(nn.Module):
    """A BatchNorm1d MLP for tabular data: ``BatchNorm1d`` on the raw features (a common
    first layer for tabular models), then 8 x (Linear 512, BatchNorm1d, ReLU), then a head."""

    def __init__(self, features: int = 256, width: int = 512, depth: int = 8, classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.BatchNorm1d(features)]
        d = features
        for _ in range(depth):
            layers += [nn.Linear(d, width), nn.BatchNorm1d(width), nn.ReLU(inplace=True)]
            d = width
        layers.append(nn.Linear(d, classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


def _torchvision(name: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import torchvision

        if name == "r3d_18":
            return torchvision.models.video.r3d_18(weights=None)
        return getattr(torchvision.models, name)(weights=None)

    return build


def _timm(name: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import timm

        return timm.create_model(name, pretrained=False)

    return build


class ChannelsLast(nn.Module):
    """A model run in the channels_last memory format (its input converted in forward)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner.to(memory_format=torch.channels_last)

    def forward(self, x: Tensor) -> Tensor:
        return self.inner(x.contiguous(memory_format=torch.channels_last))


MODELS: dict[str, Callable[[], nn.Module]] = {
    "resnet18": _torchvision("resnet18"),
    "resnet50": _torchvision("resnet50"),
    "mobilenet_v3_large": _torchvision("mobilenet_v3_large"),
    "r3d_18": _torchvision("r3d_18"),
    "mlp": TabularMLP,
    "densenet121": _torchvision("densenet121"),
    "resnet18_cl": lambda: ChannelsLast(_torchvision("resnet18")()),
    "timm_efficientnet_b0": _timm("efficientnet_b0"),
    "timm_mobilenetv3_large_100": _timm("mobilenetv3_large_100"),
    "timm_resnet26d": _timm("resnet26d"),
    "timm_mnasnet_small": _timm("mnasnet_small"),
}


# (sample shape, [(batch size, batches per run), ...]) per model. CPU sizes are chosen so
# that one run of the floor takes about a second on one thread of a 2-core x86 VM.
SIZES: dict[str, dict[str, tuple[tuple[int, ...], list[tuple[int, int]]]]] = {
    "cpu": {
        "resnet18": ((3, 64, 64), [(4, 24), (16, 8)]),
        "resnet50": ((3, 64, 64), [(4, 10), (16, 4)]),
        "mobilenet_v3_large": ((3, 96, 96), [(4, 24), (16, 10)]),
        "r3d_18": ((3, 4, 56, 56), [(2, 7), (8, 2)]),
        "mlp": ((256,), [(32, 200), (256, 60)]),
        "densenet121": ((3, 32, 32), [(16, 8)]),
        "resnet18_cl": ((3, 64, 64), [(16, 8)]),
        "timm_efficientnet_b0": ((3, 64, 64), [(8, 8)]),
        "timm_mobilenetv3_large_100": ((3, 64, 64), [(8, 12)]),
        "timm_resnet26d": ((3, 64, 64), [(8, 6)]),
        "timm_mnasnet_small": ((3, 64, 64), [(8, 16)]),
    },
    "cuda": {  # sized for a few tenths of a second per run on a current data-centre GPU
        "resnet18": ((3, 224, 224), [(32, 20), (128, 10)]),
        "resnet50": ((3, 224, 224), [(32, 20), (128, 10)]),
        "mobilenet_v3_large": ((3, 224, 224), [(32, 20), (128, 10)]),
        "r3d_18": ((3, 16, 112, 112), [(4, 20), (16, 8)]),
        "mlp": ((256,), [(256, 100), (4096, 30)]),
        "densenet121": ((3, 64, 64), [(64, 20)]),
        "resnet18_cl": ((3, 224, 224), [(64, 20)]),
        "timm_efficientnet_b0": ((3, 224, 224), [(64, 20)]),
        "timm_mobilenetv3_large_100": ((3, 224, 224), [(64, 20)]),
        "timm_resnet26d": ((3, 224, 224), [(64, 20)]),
        "timm_mnasnet_small": ((3, 224, 224), [(64, 20)]),
    },
}
# --quick: same models, fewer batches (a smoke test of the harness, not a measurement).
QUICK_BATCHES = {"cpu": 0.34, "cuda": 0.25}


@dataclass(frozen=True)
class Case:
    """One benchmark case: a model fed ``num_batches`` batches of ``batch_size`` samples."""

    model: str
    batch_size: int
    num_batches: int
    sample_shape: tuple[int, ...]

    @property
    def label(self) -> str:
        return f"{self.model} b{self.batch_size}"

    @property
    def input_desc(self) -> str:
        return "x".join(str(s) for s in (self.batch_size, *self.sample_shape))

    @property
    def samples(self) -> int:
        return self.batch_size * self.num_batches


def cases_for(device: str, models: Sequence[str], quick: bool = False, scale: float = 1.0) -> list[Case]:
    table = SIZES["cuda" if device.startswith("cuda") else "cpu"]
    out = []
    for name in models:
        shape, sizes = table[name]
        for bs, nb in sizes:
            factor = scale * (QUICK_BATCHES["cuda" if device.startswith("cuda") else "cpu"] if quick else 1.0)
            out.append(Case(name, bs, max(2, round(nb * factor)), shape))
    return out


def build_model(name: str, device: torch.device, autocast: str | None = None) -> nn.Module:
    """The model with a fixed random initialisation (no weights are downloaded)."""
    torch.manual_seed(0)
    model = MODELS[name]().to(device)
    if autocast:
        model = Autocast(model, device.type, getattr(torch, autocast))
    return model


class Autocast(nn.Module):
    """Runs the wrapped model under ``torch.autocast`` (every tool sees the same wrapper)."""

    def __init__(self, inner: nn.Module, device_type: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.inner, self.device_type, self.dtype = inner, device_type, dtype

    def forward(self, x: Tensor) -> Tensor:
        with torch.autocast(self.device_type, dtype=self.dtype):
            return self.inner(x)


def make_batches(case: Case, device: torch.device, seed: int = 0) -> list[Tensor]:
    """The batches every tool gets, generated once (fixed seed).

    Images and clips are standard normal noise. The MLP gets tabular-like raw features:
    feature j is ``offset_j + scale_j * z`` with offsets uniform in [-500, 500] and scales
    log-uniform in [0.1, 10] (raw inputs such as years, prices or counts), which the first
    BatchNorm1d normalises.
    """
    g = torch.Generator().manual_seed(seed)
    shape = (case.batch_size, *case.sample_shape)
    if case.model == "mlp":
        features = case.sample_shape[0]
        offset = torch.empty(features).uniform_(-500, 500, generator=g)
        scale = torch.empty(features).uniform_(math.log(0.1), math.log(10), generator=g).exp()
        batches = [offset + scale * torch.randn(shape, generator=g) for _ in range(case.num_batches)]
    else:
        batches = [torch.randn(shape, generator=g) for _ in range(case.num_batches)]
    return [b.to(device) for b in batches]


def small_batches(case: Case, device: torch.device, count: int) -> list[Tensor]:
    """``count`` batches of 2 samples, images and clips at most 32x32 pixels: the cheapest
    input that runs every layer (used to see a tool's own memory, apart from activations)."""
    shape = list(case.sample_shape)
    if len(shape) >= 3:
        shape[-2:] = [min(s, 32) for s in shape[-2:]]
    small = Case(case.model, 2, count, tuple(shape))
    return make_batches(small, device, seed=1)


def bn_layers(model: nn.Module) -> list[tuple[str, _BatchNorm]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, _BatchNorm)]


def norm_mode(model: nn.Module) -> None:
    """Eval mode everywhere except BatchNorm layers (what the floor and mode="norm" run)."""
    model.eval()
    for _, m in bn_layers(model):
        m.train()


class ModelState:
    """Saves every buffer, momentum and training flag; ``restore()`` puts them back in place.

    The tools replace or reset running buffers (fvcore assigns new tensors, torch's
    ``update_bn`` resets them); restoring between runs keeps every run identical.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
        self.flags = [m.training for m in model.modules()]
        self.momenta = [(m, m.momentum) for _, m in bn_layers(model)]

    def restore(self) -> None:
        with torch.no_grad():
            for k, v in self.model.named_buffers():
                v.copy_(self.buffers[k])
        for m, flag in zip(self.model.modules(), self.flags):
            m.training = flag
        for m, momentum in self.momenta:
            m.momentum = momentum


# ---------------------------------------------------------------------------------------
# The tools compared
# ---------------------------------------------------------------------------------------


def _forward_all(model: nn.Module, batches: Sequence[Tensor]) -> None:
    with torch.no_grad():
        for b in batches:
            model(b)


def _precisebn(mode: str, capture: str = "auto") -> Callable[[nn.Module, Sequence[Tensor]], None]:
    def run(model: nn.Module, batches: Sequence[Tensor]) -> None:
        import precisebn

        precisebn.recalibrate(model, batches, num_batches=len(batches), mode=mode, capture=capture)  # type: ignore[arg-type]

    return run


def _fvcore(model: nn.Module, batches: Sequence[Tensor]) -> None:
    from fvcore.nn import update_bn_stats

    update_bn_stats(model, batches, num_iters=len(batches))


def _torch_update_bn(model: nn.Module, batches: Sequence[Tensor]) -> None:
    from torch.optim.swa_utils import update_bn

    update_bn(batches, model)


def _train_mode(model: nn.Module) -> None:
    model.train()


@dataclass(frozen=True)
class Tool:
    name: str
    run: Callable[[nn.Module, Sequence[Tensor]], None]
    prepare: Callable[[nn.Module], None]  # the model's state before the call (not timed)
    note: str
    estimates: bool = True  # False for the floor: it leaves no statistics to check


FLOOR = Tool(
    "floor",
    _forward_all,
    norm_mode,
    "the same forward passes under no_grad, BatchNorm layers in training mode, nothing kept",
    estimates=False,
)
TOOLS: dict[str, Tool] = {
    "floor (A/A)": Tool(
        "floor (A/A)", _forward_all, norm_mode, "the floor timed as if it were a tool: the harness's noise", False
    ),
    "precisebn norm": Tool(
        "precisebn norm", _precisebn("norm"), norm_mode, "precisebn.recalibrate(mode='norm', num_batches=all)"
    ),
    "precisebn train": Tool(
        "precisebn train", _precisebn("train"), norm_mode, "precisebn.recalibrate(mode='train', num_batches=all)"
    ),
    "precisebn float64": Tool(
        "precisebn float64",
        _precisebn("norm", "float64"),
        norm_mode,
        "precisebn.recalibrate(capture='float64', num_batches=all): every layer reduced in float64",
    ),
    "fvcore": Tool("fvcore", _fvcore, _train_mode, "fvcore.nn.update_bn_stats(num_iters=all), model in train mode"),
    "torch update_bn": Tool(
        "torch update_bn", _torch_update_bn, norm_mode, "torch.optim.swa_utils.update_bn (whole loader)"
    ),
}

DEFAULT_TOOLS = tuple(t for t in TOOLS if t != "precisebn float64")
"""What ``benchmarks.run`` times unless ``--tools`` says otherwise (the float64 option on request)."""


def tool_available(name: str) -> str | None:
    """None when the tool can run, else why not."""
    if name == "fvcore":
        try:
            import fvcore.nn  # noqa: F401
        except ImportError:
            return "fvcore is not installed (pip install -e '.[bench]')"
    return None


# ---------------------------------------------------------------------------------------
# Ground truth (float64, independent of precisebn) and errors
# ---------------------------------------------------------------------------------------


@dataclass
class Truth:
    count: int
    mean: Tensor  # float64, on CPU
    var: Tensor  # population variance, float64, on CPU


def _moments64(x: Tensor) -> tuple[int, Tensor, Tensor]:
    x = x.detach().to(torch.float64)
    x = x.transpose(0, 1).reshape(x.shape[1], -1) if x.dim() > 1 else x.reshape(1, -1)
    mean = x.mean(1)
    m2 = (x - mean[:, None]).square().sum(1)
    return x.shape[1], mean, m2


def ground_truth(model: nn.Module, batches: Sequence[Tensor]) -> dict[str, Truth]:
    """float64 mean and population variance, per BatchNorm layer, of everything the layer
    receives when ``batches`` run with BatchNorm layers in training mode — computed here
    by a two-pass float64 reduction and Chan's merge, independently of precisebn."""
    state = ModelState(model)
    acc: dict[str, list[Any]] = {}
    handles = []

    def hook_for(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            n_b, mean_b, m2_b = _moments64(args[0])
            if name not in acc:
                acc[name] = [n_b, mean_b, m2_b]
                return
            n_a, mean_a, m2_a = acc[name]
            n = n_a + n_b
            delta = mean_b - mean_a
            acc[name] = [n, mean_a + delta * (n_b / n), m2_a + m2_b + delta.square() * (n_a * n_b / n)]

        return hook

    try:
        norm_mode(model)
        for name, m in bn_layers(model):
            handles.append(m.register_forward_pre_hook(hook_for(name)))
        _forward_all(model, batches)
    finally:
        for h in handles:
            h.remove()
        state.restore()
    return {k: Truth(n, mean.cpu(), (m2 / n).cpu()) for k, (n, mean, m2) in acc.items()}


def stats_error(model: nn.Module, truth: dict[str, Truth]) -> dict[str, float]:
    """How far the model's running statistics are from the truth, over all layers/channels:
    ``var``: max |v - v*| / v*; ``mean``: max |m - m*| / sqrt(v*) (in standard deviations)."""
    worst_var = worst_mean = 0.0
    for name, m in bn_layers(model):
        t = truth.get(name)
        if t is None:
            continue
        var = m.running_var.detach().to("cpu", torch.float64)
        mean = m.running_mean.detach().to("cpu", torch.float64)
        tv = t.var.clamp_min(1e-300)
        worst_var = max(worst_var, float(((var - t.var).abs() / tv).max()))
        worst_mean = max(worst_mean, float(((mean - t.mean).abs() / tv.sqrt()).max()))
    return {"max_rel_err_var": worst_var, "max_err_mean_std": worst_mean}


# ---------------------------------------------------------------------------------------
# Timers, memory meters, host-synchronisation counter
# ---------------------------------------------------------------------------------------


def timed(fn: Callable[[], None], device: torch.device) -> tuple[float, float]:
    """(wall seconds, seconds of CPU time of this thread). On CUDA the wall time is
    measured with CUDA events around the call, after a synchronisation."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        c0 = time.thread_time()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1000.0, time.thread_time() - c0
    c0, t0 = time.thread_time(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, time.thread_time() - c0


def _proc_status(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _libc() -> Any:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


_LIBC = _libc()


def cpu_memory_method() -> str | None:
    """The CPU peak-memory method if this system supports it (Linux, /proc writable)."""
    if _proc_status("VmHWM:") is None:
        return None
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    return (
        "peak resident set size (VmHWM) during the call minus the resident size just before it, "
        "after gc and malloc_trim(0); the high-water mark is reset through /proc/self/clear_refs"
    )


def peak_memory(fn: Callable[[], None], device: torch.device) -> float | None:
    """Bytes of peak memory above the level just before the call (None if not measurable).

    CUDA: ``torch.cuda.max_memory_allocated`` (tensor memory). CPU: peak resident set
    size, reset through ``/proc/self/clear_refs`` (Linux), after ``malloc_trim(0)``.
    """
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return float(torch.cuda.max_memory_allocated(device) - base)
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
    base = _proc_status("VmRSS:")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    fn()
    peak = _proc_status("VmHWM:")
    if base is None or peak is None:
        return None
    return float(peak - base)


def count_syncs(fn: Callable[[], None]) -> int:
    """Host synchronisations torch reports during ``fn`` (``set_sync_debug_mode("warn")``)."""
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    return sum("synchroniz" in str(w.message) for w in caught)


@contextlib.contextmanager
def threads(n: int | None) -> Iterator[None]:
    old = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


# ---------------------------------------------------------------------------------------
# The machine
# ---------------------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _version(module: str) -> str:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:
        return "not installed"


# glibc's allocator, set alike for every run (the floor's as much as the tools'): all memory from the
# heap, never handed back. By default free() returns the top of the heap to the kernel once more than a
# threshold is free there, and large blocks come from (and go back to) mmap below another, both moving
# with the sizes freed so far — so whether a pass's activations are refaulted after every batch depends
# on where earlier allocations landed. Measured (one process each): timm efficientnet_b0, 8x3x64x64, 32
# batches: in one layout the floor ran with no page faults and precisebn with ~3,200 per batch (+15%), in
# another the floor had them. Padding the heap instead (MALLOC_TOP_PAD_=64 MiB) slowed resnet50's floor
# from 97 to 162 ms per batch (16x3x64x64); with these settings it is 88, efficientnet_b0's 31 as with
# the defaults. PRECISEBN_BENCH_ALLOCATOR=default runs with glibc's defaults instead (to compare).
ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": str(2**30), "MALLOC_TRIM_THRESHOLD_": str(2**30)}


def with_allocator_env(argv: Sequence[str]) -> None:
    """Re-executes this process (``python`` + ``argv``) with :data:`ALLOCATOR_ENV` set, unless
    it is set already, ``PRECISEBN_BENCH_ALLOCATOR=default`` or this is not Linux (the variables
    are glibc's)."""
    if (
        not sys.platform.startswith("linux")
        or os.environ.get("PRECISEBN_BENCH_ALLOCATOR") == "default"
        or all(os.environ.get(k) == v for k, v in ALLOCATOR_ENV.items())
    ):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *argv], {**os.environ, **ALLOCATOR_ENV})


def allocator() -> str:
    """How glibc's allocator was set up for this process (see :data:`ALLOCATOR_ENV`)."""
    set_ = [f"{k}={os.environ[k]}" for k in ALLOCATOR_ENV if k in os.environ]
    return "glibc allocator: heap only, never trimmed (" + ", ".join(set_) + ")" if set_ else "allocator defaults"


def machine(device: torch.device, num_threads: int) -> dict[str, Any]:
    """What the numbers were measured on."""
    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": num_threads,
        "load_average_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "torch": torch.__version__,
        "torchvision": _version("torchvision"),
        "fvcore": _version("fvcore"),
        "precisebn": _version("precisebn"),
        "git_commit": _git("rev-parse", "--short", "HEAD"),
        "git_dirty": bool(_git("status", "--porcelain", "--", "src")),
        "device": str(device),
        "allocator": allocator(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = f"{props.name}, {props.total_memory / 2**30:.0f} GiB"
        info["cuda"] = torch.version.cuda
        info["cudnn"] = torch.backends.cudnn.version()
    return info


def describe_machine(info: dict[str, Any]) -> str:
    parts = [
        f"{info['cpu']} ({info['cores']} cores, {info['torch_threads']} torch thread(s))",
        info.get("gpu", ""),
        f"{info['platform']}",
        f"Python {info['python']}, torch {info['torch']}, torchvision {info['torchvision']}, fvcore {info['fvcore']}",
        f"precisebn {info['precisebn']} (git {info['git_commit']}{', src modified' if info['git_dirty'] else ''})",
        f"{info['date']}",
        info.get("allocator", ""),
    ]
    load = info.get("load_average_start")
    if load:
        end = info.get("load_average_end")
        parts.append(f"load average at start {load[0]:.2f}" + (f", at end {end[0]:.2f}" if end else ""))
    return "; ".join(p for p in parts if p)
