"""Estimation quality: how close each tool's statistics get to the full-data statistics,
as a function of the samples spent, at batch sizes 2, 8 and 32.

Usage (from the repository root)::

    python -m benchmarks.quality            # 10-15 minutes on 2 CPU cores
    python -m benchmarks.quality --quick    # ~2 minutes, a smoke test

Set-up. A torchvision resnet18 (random initialisation: no weights are downloaded) reads
natural-image patches: random square crops (32-160 px, resized to 32x32, random flips,
ImageNet normalisation) of the photographs that ship with scikit-learn (china.jpg,
flower.jpg) and matplotlib (grace_hopper.jpg) — a fixed data set of ``--data`` patches.

For each batch size B the whole data set is passed twice, each time in its own random
order, BatchNorm layers in training mode as every tool runs them. During each pass:

* the reference: float64 statistics of every value each BatchNorm layer receives
  (a two-pass float64 reduction per call, merged exactly) over the whole data;
* the per-batch figures each tool reads (the layer's own batch mean and unbiased
  variance, momentum 1.0), folded into three estimators, read off after 256, 512, …
  samples:
  - precisebn: count-weighted pooled mean and variance in float64 (within-batch M2 plus
    the spread of the batch means);
  - fvcore ``update_bn_stats``: the same pooled estimator, fvcore's own
    ``_PopulationVarianceEstimator`` class, in float32 (E[x²] − E[x]²);
  - mean of batch variances: torch's ``swa_utils.update_bn`` (momentum None: the running
    average of the per-batch unbiased variances, in float32) — the estimator that drops
    the variance of the batch means.

The estimates of one pass are compared with the reference of the *other* pass, so that
an estimate is never scored against data it was computed from in the same grouping.
The first layer (``bn1``) sees the same inputs whatever the batching, so its reference is
the same for both passes and for every B. Deeper layers receive activations normalised
with each batch's own statistics, so their full-data statistics depend on B (and a little
on how the data fall into batches): there the floor of the error at the full data is that
grouping effect, which no estimator removes.

Each tool's replay is checked against the tool itself: the real ``precisebn.estimate``,
``fvcore.nn.update_bn_stats`` and ``torch.optim.swa_utils.update_bn`` run on the first
batches of a pass, and the largest difference from the replay is reported.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import common

BATCH_SIZES = (2, 8, 32)
TOOLS = ("precisebn", "fvcore", "mean of batch variances")
TOOL_NOTES = {
    "precisebn": "precisebn: pooled estimator, float64",
    "fvcore": "fvcore update_bn_stats: pooled estimator, float32 E[x²]−E[x]²",
    "mean of batch variances": "torch swa_utils.update_bn: mean of per-batch unbiased variances",
}
_F64 = torch.float64
_MEAN = torch.tensor([0.485, 0.456, 0.406])[:, None, None]
_STD = torch.tensor([0.229, 0.224, 0.225])[:, None, None]


# ---------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------


def photographs() -> list[Tensor]:
    """The natural photographs shipped with scikit-learn and matplotlib, as float [3, H, W] in [0, 1]."""
    images = []
    try:
        from sklearn.datasets import load_sample_images

        images += [torch.from_numpy(img.copy()) for img in load_sample_images().images]
    except ImportError:
        pass
    try:
        import matplotlib.cbook
        import matplotlib.image

        with matplotlib.cbook.get_sample_data("grace_hopper.jpg") as f:
            images.append(torch.from_numpy(matplotlib.image.imread(f, format="jpg").copy()))
    except Exception:
        pass
    if not images:
        raise RuntimeError(
            "no sample photographs found: pip install scikit-learn matplotlib (pip install -e '.[bench]')"
        )
    return [img.permute(2, 0, 1).float() / 255.0 for img in images]


def patches(count: int, size: int = 32, seed: int = 0) -> Tensor:
    """``count`` random crops (side 32-160 px, resized to ``size``), flipped at random, normalised."""
    g = torch.Generator().manual_seed(seed)
    images = photographs()
    out = torch.empty(count, 3, size, size)
    for i in range(count):
        img = images[int(torch.randint(len(images), (1,), generator=g))]
        _, h, w = img.shape
        side = int(torch.randint(size, min(5 * size, h, w) + 1, (1,), generator=g))
        top = int(torch.randint(h - side + 1, (1,), generator=g))
        left = int(torch.randint(w - side + 1, (1,), generator=g))
        crop = img[None, :, top : top + side, left : left + side]
        crop = F.interpolate(crop, size=(size, size), mode="area")[0]
        if torch.rand((), generator=g) < 0.5:
            crop = crop.flip(-1)
        out[i] = (crop - _MEAN) / _STD
    return out


# ---------------------------------------------------------------------------------------
# One pass: the reference and the three estimators at every checkpoint
# ---------------------------------------------------------------------------------------


class _Replay:
    """The three estimators over flat per-channel vectors (all layers concatenated)."""

    def __init__(self, size: int) -> None:
        z64 = torch.zeros(size, dtype=_F64)
        # precisebn: shifted float64 sums (exact pooled mean and M2)
        self.n, self.s1, self.s2 = z64.clone(), z64.clone(), z64.clone()
        self.shift: Tensor | None = None
        # fvcore's own estimator class, on flat float32 buffers with per-channel counts
        from fvcore.nn.precise_bn import _PopulationVarianceEstimator

        z32 = torch.zeros(size)
        self.fvcore = _PopulationVarianceEstimator(z32, z32)
        # torch update_bn: momentum None → cumulative average, float32
        self.avg_mean, self.avg_var = z32.clone(), z32.clone()
        self.batches = 0

    def update(self, mean: Tensor, var: Tensor, n: Tensor) -> None:
        if self.shift is None:
            self.shift = mean.to(_F64)
        d = mean.to(_F64) - self.shift
        self.n += n
        self.s1 += n * d
        self.s2 += n * d * d + (n - 1) * var.to(_F64)
        self.fvcore.update(mean, var, n)
        self.batches += 1
        f = 1.0 / self.batches
        self.avg_mean.mul_(1 - f).add_(mean, alpha=f)
        self.avg_var.mul_(1 - f).add_(var, alpha=f)

    def estimates(self) -> dict[str, Tensor]:
        assert self.shift is not None
        return {
            "precisebn": (self.s2 - self.s1 * self.s1 / self.n) / self.n,
            "fvcore": self.fvcore.pop_var.to(_F64),
            "mean of batch variances": self.avg_var.to(_F64),
        }


def one_pass(
    model: nn.Module, data: Tensor, order: Tensor, batch_size: int, checkpoints: Sequence[int]
) -> tuple[Tensor, dict[int, dict[str, Tensor]], list[Tensor]]:
    """Runs ``data[order]`` in batches; returns the float64 reference variance (flat over all
    layers), the estimates at each checkpoint, and the first batches (for the tool check)."""
    bns = [m for _, m in common.bn_layers(model)]
    sizes = [m.num_features for m in bns]
    counts = [0] * len(bns)
    ref: list[list[Any] | None] = [None] * len(bns)

    def hook_for(i: int) -> Any:
        def hook(module: nn.Module, args: tuple[Tensor, ...]) -> None:
            x = args[0].detach().to(_F64).transpose(0, 1).reshape(args[0].shape[1], -1)
            counts[i] = x.shape[1]
            mean = x.mean(1)
            m2 = (x - mean[:, None]).square().sum(1)
            if ref[i] is None:
                ref[i] = [x.shape[1], mean, m2]
                return
            n_a, mean_a, m2_a = ref[i]  # type: ignore[misc]
            n_b, n = x.shape[1], n_a + x.shape[1]
            delta = mean - mean_a
            ref[i] = [n, mean_a + delta * (n_b / n), m2_a + m2 + delta.square() * (n_a * n_b / n)]

        return hook

    common.norm_mode(model)
    momenta = [m.momentum for m in bns]
    for m in bns:
        m.momentum = 1.0
    handles = [m.register_forward_pre_hook(hook_for(i)) for i, m in enumerate(bns)]
    replay = _Replay(sum(sizes))
    count_vectors: dict[tuple[int, ...], Tensor] = {}
    snapshots: dict[int, dict[str, Tensor]] = {}
    first: list[Tensor] = []
    pending = sorted(checkpoints)
    seen = 0
    try:
        with torch.no_grad():
            for start in range(0, len(order) - batch_size + 1, batch_size):
                batch = data[order[start : start + batch_size]]
                if len(first) < 64:
                    first.append(batch)
                model(batch)
                key = tuple(counts)
                n = count_vectors.get(key)
                if n is None:
                    n = torch.cat([torch.full((c,), float(k), dtype=_F64) for c, k in zip(sizes, counts)])
                    count_vectors[key] = n
                replay.update(torch.cat([m.running_mean for m in bns]), torch.cat([m.running_var for m in bns]), n)
                seen += batch_size
                while pending and seen >= pending[0]:
                    snapshots[pending.pop(0)] = replay.estimates()
    finally:
        for h in handles:
            h.remove()
        for m, momentum in zip(bns, momenta):
            m.momentum = momentum
    reference = torch.cat([m2 / n for n, _, m2 in ref])  # type: ignore[misc]
    return reference, snapshots, first


def check_replay(model: nn.Module, batches: list[Tensor], replayed: dict[str, Tensor]) -> dict[str, float]:
    """Largest relative difference between each real tool and its replay on ``batches``."""
    from fvcore.nn import update_bn_stats
    from torch.optim.swa_utils import update_bn

    import precisebn

    state = common.ModelState(model)

    def flat_var() -> Tensor:
        return torch.cat([m.running_var.detach().to(_F64) for _, m in common.bn_layers(model)])

    out = {}
    try:
        stats = precisebn.estimate(model, batches, num_batches=len(batches))
        real = {"precisebn": torch.cat([s.var.to(_F64) for s in stats.values()])}
        model.train()
        update_bn_stats(model, batches, num_iters=len(batches))
        real["fvcore"] = flat_var()
        state.restore()
        update_bn(batches, model)
        real["mean of batch variances"] = flat_var()
    finally:
        state.restore()
    for name, value in real.items():
        out[name] = float(((value - replayed[name]).abs() / replayed[name].abs().clamp_min(1e-30)).max())
    return out


# ---------------------------------------------------------------------------------------
# The study
# ---------------------------------------------------------------------------------------


def study(data_size: int, batch_sizes: Sequence[int], seed: int = 0, log: Any = print) -> dict[str, Any]:
    data = patches(data_size, seed=seed)
    model = common.build_model("resnet18", torch.device("cpu"))
    bns = common.bn_layers(model)
    first_layer = bns[0][1].num_features
    checkpoints = [256 * 2**k for k in range(int(math.log2(data_size / 256)) + 1) if 256 * 2**k <= data_size]
    rows: list[dict[str, Any]] = []
    checks: dict[str, float] = {}
    for bs in batch_sizes:
        t0 = time.perf_counter()
        refs, snaps = [], []
        for p in range(2):
            order = torch.randperm(data_size, generator=torch.Generator().manual_seed(1000 * bs + p))
            ref, snap, first = one_pass(model, data, order, bs, checkpoints)
            refs.append(ref)
            snaps.append(snap)
            if p == 0:
                k = min(len(first), max(1, 512 // bs))
                _, at_k, _ = one_pass(model, data, order[: k * bs], bs, [k * bs])
                for name, diff in check_replay(model, first[:k], at_k[k * bs]).items():
                    checks[name] = max(checks.get(name, 0.0), diff)
        for n in checkpoints:
            row: dict[str, Any] = {"batch_size": bs, "samples": n}
            for tool in TOOLS:
                errs = [(snaps[p][n][tool] - refs[1 - p]).abs() / refs[1 - p] for p in range(2)]
                row[tool] = {
                    "bn1_median": sum(float(e[:first_layer].median()) for e in errs) / 2,
                    "all_median": sum(float(e.median()) for e in errs) / 2,
                    "all_p90": sum(float(e.quantile(0.9)) for e in errs) / 2,
                }
            rows.append(row)
        log(f"  batch size {bs:3d}: {time.perf_counter() - t0:5.1f} s")
    return {
        "model": "torchvision resnet18 (random init, weights=None)",
        "layers": len(bns),
        "channels": sum(m.num_features for _, m in bns),
        "data": f"{data_size} natural-image patches 3x32x32 "
        "(crops of scikit-learn's and matplotlib's sample photographs)",
        "data_size": data_size,
        "checkpoints": checkpoints,
        "batch_sizes": list(batch_sizes),
        "tools": TOOL_NOTES,
        "replay_check_max_rel_diff": checks,
        "rows": rows,
    }


def _pct(x: float) -> str:
    x *= 100
    if x >= 10:
        return f"{x:.0f}%"
    if x >= 0.1:
        return f"{x:.1f}%"
    return f"{x:.0e}%"


def to_markdown(res: dict[str, Any]) -> str:
    out = [
        "# Estimation quality: error against the full-data statistics vs samples spent",
        "",
        f"Model: {res['model']}, {res['layers']} BatchNorm layers, {res['channels']} channels. "
        f"Data: {res['data']}. Command: `{res.get('command', 'python -m benchmarks.quality')}`"
        + (f" ({res['elapsed_s'] / 60:.0f} min)" if "elapsed_s" in res else "")
        + (f"; {common.describe_machine(res['machine'])}" if "machine" in res else "")
        + ".",
        "",
        "Each cell: median over channels of |v − v*| / v*, the relative error of the running variance against"
        " float64 statistics of the whole data set at that batch size (mean of two passes in different random"
        " orders; each pass's estimates scored against the other pass's reference). `bn1`: the first layer,"
        " whose inputs do not depend on the batching; `all`: every BatchNorm layer's channels. Tools:",
        "",
        *(f"- **{k}** — {v}" for k, v in res["tools"].items()),
        "",
        "| batch | samples | bn1: precisebn | bn1: fvcore | bn1: mean of batch vars | all: precisebn | all: fvcore"
        " | all: mean of batch vars |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        out.append(
            f"| {r['batch_size']} | {r['samples']} | "
            + " | ".join(_pct(r[t]["bn1_median"]) for t in TOOLS)
            + " | "
            + " | ".join(_pct(r[t]["all_median"]) for t in TOOLS)
            + " |"
        )
    checks = res["replay_check_max_rel_diff"]
    out += [
        "",
        "Replays checked against the tools themselves on the first batches of a pass (max relative difference of"
        " the variances): " + ", ".join(f"{k} {v:.1e}" for k, v in checks.items()) + ".",
        "",
        "Reading: the pooled estimator (precisebn, and fvcore's in float32) converges to the full-data statistics"
        " as samples grow, at every batch size. The mean of per-batch variances converges to something else: it"
        " leaves out the spread of the batch means, which is large when a batch holds few samples whose"
        " positions are correlated (small batches of images, video clips, detection crops) — more samples do not"
        " fix it. In deeper layers the reference itself depends on the batch size (training-mode normalisation"
        " upstream), so the remaining error at the full data is the grouping effect, the same for every tool.",
        "",
        "![error vs samples](quality.png)",
        "",
    ]
    return "\n".join(out)


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = res["batch_sizes"]
    fig, axes = plt.subplots(2, len(sizes), figsize=(4.2 * len(sizes), 7), sharex=True, sharey="row", squeeze=False)
    styles = {"precisebn": ("C0", "-", "o"), "fvcore": ("C1", "--", "s"), "mean of batch variances": ("C3", "-", "^")}
    for col, bs in enumerate(sizes):
        rows = [r for r in res["rows"] if r["batch_size"] == bs]
        xs = [r["samples"] for r in rows]
        for row_i, (key, title) in enumerate((("bn1_median", "first layer (bn1)"), ("all_median", "all BN layers"))):
            ax = axes[row_i][col]
            for tool in TOOLS:
                color, ls, marker = styles[tool]
                ax.loglog(
                    xs, [max(r[tool][key], 1e-9) for r in rows], color=color, ls=ls, marker=marker, ms=4, label=tool
                )
            ax.set_title(f"batch {bs}: {title}", fontsize=10)
            ax.grid(True, which="both", alpha=0.3)
            if col == 0:
                ax.set_ylabel("median |v − v*| / v*")
            if row_i == 1:
                ax.set_xlabel("samples spent")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"Running-variance error vs samples — {res['model']}, natural-image patches", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None, out: Path | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.quality", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="2048 patches: a smoke test (~2 min)")
    p.add_argument("--data", type=int, default=None, help="patches in the data set (default 16384; 2048 with --quick)")
    p.add_argument("--batch-sizes", default=",".join(map(str, BATCH_SIZES)))
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's default; errors, not time)")
    p.add_argument("--out", type=Path, default=None, help="output folder (default benchmarks/results[/quick])")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    else:
        torch.set_num_threads(max(1, min(4, torch.get_num_threads())))
    data_size = args.data or (2048 if args.quick else 16384)
    folder = args.out or out or (common.RESULTS / "quick" if args.quick else common.RESULTS)
    folder.mkdir(parents=True, exist_ok=True)
    print(f"estimation quality: resnet18, {data_size} patches, batch sizes {args.batch_sizes}", flush=True)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = study(data_size, [int(b) for b in args.batch_sizes.split(",")])
    res["command"] = " ".join(["python -m benchmarks.quality", shlex.join(argv or [])]).strip()
    res["elapsed_s"] = time.perf_counter() - t0
    res["machine"] = common.machine(torch.device("cpu"), torch.get_num_threads())
    (folder / "quality.json").write_text(json.dumps(res, indent=1) + "\n")
    (folder / "quality.md").write_text(to_markdown(res))
    plot(res, folder / "quality.png")
    print(to_markdown(res))
    print(f"written: {folder / 'quality.md'}, quality.png, quality.json ({res['elapsed_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
