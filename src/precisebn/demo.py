"""``precisebn demo``: what precise statistics change, measured on scikit-learn's digits.

Four experiments on one small BatchNorm CNN trained on CPU with a deliberately
aggressive learning rate (everything bundled, nothing downloaded):

1. **Validation curve** — after every epoch, validation accuracy with the EMA running
   statistics the training left in the model vs with precise statistics computed by
   :func:`precisebn.recalibrate` on a deep copy (training itself is untouched).
2. **Weight averaging** — SWA over the last epochs (``torch.optim.swa_utils.AveragedModel``):
   the averaged weights with the statistics the averaged model carries vs after
   :func:`precisebn.recalibrate`.
3. **Domain shift** — validation images with lower contrast and higher brightness:
   the statistics of the training domain vs statistics re-estimated on unlabelled
   shifted training images (AdaBN).
4. **Few-shot adaptation** — the same from only a few unlabelled shifted images (random
   draws), plain re-estimation vs the training statistics kept as a prior of ``N``
   pseudo-samples (``recalibrate(..., prior=N)``, Schneider et al. 2020), for the shift
   of part 3 and a moderate one.

:func:`run_demo` returns everything as a JSON-ready dict; :func:`format_results`
turns it into the printed tables.
"""

from __future__ import annotations

import copy
import platform
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim.swa_utils import AveragedModel

from ._optional import require
from ._table import format_table
from ._version import __version__
from .recalibrate import recalibrate

__all__ = ["DemoConfig", "build_model", "format_results", "load_digits", "run_demo"]


@dataclass(frozen=True)
class DemoConfig:
    """The demo's settings (all recorded in ``results.json``).

    Attributes:
        epochs: Training epochs.
        seed: Seed of the split, the initialisation and the batch order.
        quick: Use a small subset (for tests: a few seconds).
        lr: SGD learning rate — deliberately aggressive.
        momentum: SGD momentum.
        weight_decay: SGD weight decay (the usual 5e-4; it keeps the weights moving).
        batch_size: Training batch size.
        swa_epochs: Epochs averaged at the end (default: the last half), once per epoch.
            ``AveragedModel`` keeps its buffers in sync with the trained model, so the
            averaged weights come with the last model's EMA statistics ("stale").
        contrast: Contrast factor of the shifted domain.
        brightness: Brightness offset of the shifted domain (inputs are in [0, 1]).
        threads: Torch CPU threads used while the demo runs.
        few_shot_counts: Numbers of unlabelled shifted images adapted from (part 4).
        few_shot_priors: Prior weights ``N`` (in samples) compared with plain re-estimation.
        few_shot_draws: Random draws of the images per count (the accuracies are averaged).
        moderate_contrast: Contrast factor of part 4's moderate shift.
        moderate_brightness: Brightness offset of part 4's moderate shift.
    """

    epochs: int = 12
    seed: int = 0
    quick: bool = False
    lr: float = 0.5
    momentum: float = 0.9
    weight_decay: float = 5e-4
    batch_size: int = 16
    swa_epochs: int | None = None
    contrast: float = 0.5
    brightness: float = 0.4
    threads: int = 1
    few_shot_counts: tuple[int, ...] = (1, 2, 4, 8, 16, 64)
    few_shot_priors: tuple[float, ...] = (2.0, 16.0)
    few_shot_draws: int = 5
    moderate_contrast: float = 0.7
    moderate_brightness: float = 0.2

    @property
    def averaged_epochs(self) -> int:
        return self.swa_epochs if self.swa_epochs is not None else max(1, self.epochs // 2)

    @property
    def shot_plan(self) -> tuple[tuple[int, ...], int]:
        """Part 4's counts and draws; ``quick`` keeps two counts and one draw."""
        if self.quick:
            return tuple(sorted(self.few_shot_counts))[1:3] or self.few_shot_counts, 1
        return self.few_shot_counts, self.few_shot_draws


def load_digits(seed: int, quick: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """scikit-learn's bundled digits (1797 8×8 images), scaled to [0, 1], split 1400/397.

    Returns:
        ``(x_train, y_train, x_val, y_val)``; images are ``(N, 1, 8, 8)`` float32.
        ``quick`` keeps 320 training and 200 validation images.
    """
    datasets = require("sklearn.datasets", "demo", "precisebn demo (scikit-learn's digits data set)")
    digits = datasets.load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32, device="cpu").unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long, device="cpu")
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    n_train, n_val = (320, 200) if quick else (1400, len(x) - 1400)
    return x[:n_train], y[:n_train], x[1400 : 1400 + n_val], y[1400 : 1400 + n_val]


def build_model(width: int = 32) -> nn.Sequential:
    """Four conv–BatchNorm–ReLU blocks, global average pooling and a linear classifier."""

    def block(c_in: int, c_out: int) -> list[nn.Module]:
        return [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU()]

    return nn.Sequential(
        *block(1, width),
        *block(width, width),
        nn.MaxPool2d(2),
        *block(width, 2 * width),
        *block(2 * width, 2 * width),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(2 * width, 10),
    )


def _batches(x: Tensor, size: int = 200) -> list[Tensor]:
    return list(x.split(size))


@torch.no_grad()
def accuracy(model: nn.Module, x: Tensor, y: Tensor) -> float:
    """Top-1 accuracy of ``model`` in eval mode (its training flag is restored)."""
    was_training = model.training
    model.eval()
    try:
        correct = sum(int((model(xb).argmax(1) == yb).sum()) for xb, yb in zip(x.split(500), y.split(500)))
    finally:
        model.train(was_training)
    return correct / len(y)


def _precise_copy(model: nn.Module, images: Tensor) -> nn.Module:
    twin = copy.deepcopy(model)
    recalibrate(twin, _batches(images), num_samples="all")
    return twin


def _shift(x: Tensor, contrast: float, brightness: float) -> Tensor:
    return x * contrast + brightness


def _few_shot(
    cfg: DemoConfig, source: nn.Module, x_train: Tensor, x_val: Tensor, y_val: Tensor, strong: dict[str, float]
) -> dict[str, Any]:
    """Part 4: adaptation from a few unlabelled shifted training images, drawn at random
    (the same images for every method and both shifts), plain vs with a prior."""
    counts, draws = cfg.shot_plan
    shifts = [
        {"name": "strong (part 3)", "contrast": cfg.contrast, "brightness": cfg.brightness},
        {"name": "moderate", "contrast": cfg.moderate_contrast, "brightness": cfg.moderate_brightness},
    ]
    for shift in shifts:
        pool = _shift(x_train, shift["contrast"], shift["brightness"])
        val = _shift(x_val, shift["contrast"], shift["brightness"])
        if shift["contrast"] == cfg.contrast and shift["brightness"] == cfg.brightness:
            shift["training_stats"], shift["all_images"] = strong["training_stats"], strong["adapted"]
        else:
            shift["training_stats"] = accuracy(source, val, y_val)
            shift["all_images"] = accuracy(_precise_copy(source, pool), val, y_val)
        runs: dict[str, list[list[float]]] = {"plain": []} | {f"{n:g}": [] for n in cfg.few_shot_priors}
        for count in counts:
            for key in runs:
                runs[key].append([])
            for draw in range(draws):
                generator = torch.Generator().manual_seed(cfg.seed * 100_003 + count * 1_000 + draw)
                images = pool[torch.randperm(len(pool), generator=generator)[:count]]
                for key, prior in [("plain", None)] + [(f"{n:g}", n) for n in cfg.few_shot_priors]:
                    twin = copy.deepcopy(source)
                    recalibrate(twin, [images], num_samples="all", prior=prior)
                    runs[key][-1].append(accuracy(twin, val, y_val))
        shift["plain"] = [sum(a) / len(a) for a in runs.pop("plain")]
        shift["prior"] = {key: [sum(a) / len(a) for a in accs] for key, accs in runs.items()}
    return {"counts": list(counts), "draws": draws, "priors": list(cfg.few_shot_priors), "shifts": shifts}


def _epoch_batches(n: int, size: int, generator: torch.Generator) -> Iterator[Tensor]:
    yield from torch.randperm(n, generator=generator).split(size)


def run_demo(config: DemoConfig | None = None, log: Any = None) -> dict[str, Any]:
    """Trains the model and measures the four experiments.

    The global RNG state and the thread count are restored afterwards.

    Args:
        config: Settings; default :class:`DemoConfig()`.
        log: Called with a line of text after each epoch (``print`` to follow along).

    Returns:
        A JSON-serialisable dict with the configuration, the per-epoch curve
        (``"validation_curve"``), ``"weight_averaging"``, ``"domain_shift"`` and
        ``"few_shot"`` (per shift: mean accuracy per count, plain and per prior).
    """
    config = config or DemoConfig()
    threads = torch.get_num_threads()
    start = time.perf_counter()
    with torch.random.fork_rng(devices=[]):
        torch.set_num_threads(config.threads)
        try:
            torch.manual_seed(config.seed)
            results = _run(config, log or (lambda line: None))
        finally:
            torch.set_num_threads(threads)
    results["wall_seconds"] = round(time.perf_counter() - start, 2)
    return results


def _run(cfg: DemoConfig, log: Any) -> dict[str, Any]:
    x_train, y_train, x_val, y_val = load_digits(cfg.seed, cfg.quick)
    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    loss_fn = nn.CrossEntropyLoss()
    generator = torch.Generator().manual_seed(cfg.seed)
    first_averaged = cfg.epochs - min(cfg.averaged_epochs, cfg.epochs) + 1
    swa: AveragedModel | None = None
    curve: dict[str, list[Any]] = {"epoch": [], "train_loss": [], "ema": [], "precise": []}
    for epoch in range(1, cfg.epochs + 1):
        model.train()
        total, seen = 0.0, 0
        for idx in _epoch_batches(len(x_train), cfg.batch_size, generator):
            if len(idx) < 2:  # BatchNorm needs two samples in training mode
                continue
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x_train[idx]), y_train[idx])
            loss.backward()
            optimizer.step()
            total += float(loss.detach()) * len(idx)
            seen += len(idx)
        ema_acc = accuracy(model, x_val, y_val)
        precise_acc = accuracy(_precise_copy(model, x_train), x_val, y_val)
        for key, value in zip(curve, (epoch, total / max(seen, 1), ema_acc, precise_acc)):
            curve[key].append(value)
        if epoch >= first_averaged:
            if swa is None:  # averages parameters; its buffers follow the trained model's
                swa = AveragedModel(model)
            # every averaged epoch through update_parameters, the first too: AveragedModel counts from its
            # first update, which copies the model (probe 47: created at epoch 7 and updated from epoch 8,
            # the average of "epochs 7–12" held epochs 8–12 only, epoch 7's weights overwritten)
            swa.update_parameters(model)
        log(
            f"epoch {epoch:>3}/{cfg.epochs}: loss {curve['train_loss'][-1]:.3f}, "
            f"val acc EMA {ema_acc:.3f}, precise {precise_acc:.3f}"
        )
    assert swa is not None
    averaged = swa.module
    stale = accuracy(averaged, x_val, y_val)
    recalibrate(averaged, _batches(x_train), num_samples="all")
    swa_precise = accuracy(averaged, x_val, y_val)

    shifted_val = _shift(x_val, cfg.contrast, cfg.brightness)
    adapted = _precise_copy(averaged, _shift(x_train, cfg.contrast, cfg.brightness))
    domain_shift = {
        "contrast": cfg.contrast,
        "brightness": cfg.brightness,
        "clean": swa_precise,
        "training_stats": accuracy(averaged, shifted_val, y_val),
        "adapted": accuracy(adapted, shifted_val, y_val),
    }
    log("part 4: few-shot adaptation")
    return {
        "precisebn": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "config": asdict(cfg),
        "data": {"name": "scikit-learn digits", "train": len(x_train), "val": len(x_val)},
        "validation_curve": curve,
        "weight_averaging": {
            "epochs_averaged": list(range(first_averaged, cfg.epochs + 1)),
            "last_model_ema": curve["ema"][-1],
            "stale": stale,
            "recalibrated": swa_precise,
        },
        "domain_shift": domain_shift,
        "few_shot": _few_shot(cfg, averaged, x_train, x_val, y_val, domain_shift),
    }


def _pct(v: float) -> str:
    return f"{100 * v:.1f} %"


def summaries(results: dict[str, Any]) -> dict[str, str]:
    """One sentence per experiment saying what its numbers show (worded from the numbers)."""
    curve = results["validation_curve"]
    ema, precise = curve["ema"], curve["precise"]
    wins = sum(p > e for p, e in zip(precise, ema))
    swa, shift = results["weight_averaging"], results["domain_shift"]
    swa_gain, shift_gain = swa["recalibrated"] - swa["stale"], shift["adapted"] - shift["training_stats"]
    return {
        "validation_curve": (
            f"With the EMA statistics validation accuracy ranged {_pct(min(ema))}–{_pct(max(ema))} over the "
            f"epochs, with precise statistics on the same weights {_pct(min(precise))}–{_pct(max(precise))} "
            f"(higher after {wins} of {len(ema)} epochs)"
            + (
                ": much of the EMA curve's swing comes from its running statistics, not from the weights."
                if wins > len(ema) / 2
                else ": here the EMA statistics tracked the weights about as well as precise ones."
            )
        ),
        "weight_averaging": (
            f"The averaged weights scored {_pct(swa['stale'])} with the EMA statistics AveragedModel kept from "
            f"the last model and {_pct(swa['recalibrated'])} after precisebn.recalibrate ({_fmt_delta(swa_gain)})"
            + (
                ": averaged weights need statistics measured for them."
                if swa_gain >= 0.01
                else ": here the carried statistics happened to fit the averaged weights."
            )
        ),
        "domain_shift": (
            f"On shifted images (contrast ×{shift['contrast']:g}, brightness +{shift['brightness']:g}) the model "
            f"scored {_pct(shift['training_stats'])} with training-domain statistics and {_pct(shift['adapted'])} "
            f"after re-estimating them on unlabelled shifted images ({_fmt_delta(shift_gain)}; "
            f"clean: {_pct(shift['clean'])})"
            + (", without any retraining." if shift_gain >= 0.01 else ": re-estimating did not help here.")
        ),
        **({"few_shot": _few_shot_summary(results["few_shot"])} if "few_shot" in results else {}),
    }


def _fmt_delta(d: float) -> str:
    return f"{100 * d:+.1f} points"


def _few_shot_summary(few: dict[str, Any]) -> str:
    counts, first = few["counts"], few["counts"][0]
    clauses, won, lost = [], [], []
    for shift in few["shifts"]:
        prior, best = max(shift["prior"].items(), key=lambda item: item[1][0])
        gain = best[0] - shift["plain"][0]
        verdict = "beat" if gain > 0.005 else "lost to" if gain < -0.005 else "tied with"
        (won if gain > 0.005 else lost).append(shift["training_stats"])
        clauses.append(
            f"on the {shift['name'].split(' ')[0]} shift the best prior (N={prior}) {verdict} plain re-estimation "
            f"({_pct(best[0])} vs {_pct(shift['plain'][0])}; training statistics alone {_pct(shift['training_stats'])})"
        )
    if won and lost:
        lesson = (
            ": a prior paid off where the training statistics were already closer to the new domain's"
            if min(won) > max(lost)
            else ": whether a prior pays off depends on the shift"
        )
    else:
        lesson = ": a prior paid off at the fewest images" if won else ": here a prior never paid off"
    return (
        f"From {first} unlabelled image{'s' if first != 1 else ''} (mean of {few['draws']} draws), "
        + "; ".join(clauses)
        + lesson
        + f"; with {counts[-1]} images plain re-estimation reaches "
        + " and ".join(f"{_pct(s['plain'][-1])}" for s in few["shifts"])
        + " (all images: "
        + " and ".join(f"{_pct(s['all_images'])}" for s in few["shifts"])
        + ")."
    )


def format_results(results: dict[str, Any]) -> str:
    """The tables (three, or four with the few-shot part), each followed by its one-sentence summary."""
    curve, swa, shift = results["validation_curve"], results["weight_averaging"], results["domain_shift"]
    said = summaries(results)
    cfg = results["config"]
    part1 = format_table(
        ["epoch", "train loss", "val acc (EMA stats)", "val acc (precise stats)"],
        [
            [str(e), f"{loss:.3f}", _pct(a), _pct(b)]
            for e, loss, a, b in zip(curve["epoch"], curve["train_loss"], curve["ema"], curve["precise"])
        ],
        right={0, 1, 2, 3},
    )
    averaged = swa["epochs_averaged"]
    part2 = format_table(
        ["model", "statistics", "val acc"],
        [
            [f"last epoch ({cfg['epochs']})", "EMA from training", _pct(swa["last_model_ema"])],
            [
                f"SWA of epochs {averaged[0]}–{averaged[-1]}",
                "stale: last model's EMA (kept by AveragedModel)",
                _pct(swa["stale"]),
            ],
            [f"SWA of epochs {averaged[0]}–{averaged[-1]}", "precisebn.recalibrate", _pct(swa["recalibrated"])],
        ],
        right={2},
    )
    part3 = format_table(
        ["validation images", "statistics", "val acc"],
        [
            ["clean", "clean training images", _pct(shift["clean"])],
            ["shifted", "clean training images", _pct(shift["training_stats"])],
            ["shifted", "re-estimated on shifted images (AdaBN)", _pct(shift["adapted"])],
        ],
        right={2},
    )
    parts = [
        f"1. Validation curve (SGD lr {cfg['lr']}, momentum {cfg['momentum']}, batch {cfg['batch_size']})\n"
        f"{part1}\n→ {said['validation_curve']}",
        f"2. Weight averaging (SWA)\n{part2}\n→ {said['weight_averaging']}",
        f"3. Domain shift\n{part3}\n→ {said['domain_shift']}",
    ]
    if "few_shot" in results:
        few = results["few_shot"]
        priors = list(few["shifts"][0]["prior"])
        part4 = format_table(
            ["shift", "images", "plain re-estimation", *(f"prior N={n}" for n in priors)],
            [
                [f"{s['name']}: ×{s['contrast']:g}, +{s['brightness']:g}", str(count), _pct(s["plain"][i])]
                + [_pct(s["prior"][n][i]) for n in priors]
                for s in few["shifts"]
                for i, count in enumerate(few["counts"])
            ],
            right=set(range(1, 3 + len(priors))),
        )
        references = "; ".join(
            f"{s['name'].split(' ')[0]}: training statistics {_pct(s['training_stats'])}, all "
            f"{results['data']['train']} images {_pct(s['all_images'])}"
            for s in few["shifts"]
        )
        parts.append(
            f"4. Few-shot adaptation (mean val acc over {few['draws']} random draws of unlabelled shifted training "
            f"images; {references})\n{part4}\n→ {said['few_shot']}"
        )
    return "\n\n".join(parts)
