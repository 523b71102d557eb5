"""Dev script: a BatchNorm head shared by three feature levels, pooled vs per-call statistics.

A small multi-scale classifier on scikit-learn's digits (1400 training, 397 validation
8×8 images; nothing is downloaded): a conv stem gives a feature map, three levels are
made from it at 8×8, 4×4 and 2×2 with a 1×1 convolution each and very different scales
and offsets (as the levels of a feature pyramid differ), and one conv–BatchNorm–ReLU–conv
head is shared by all three (called three times per forward, as RetinaNet/FCOS heads
are); the class scores are the sum of the levels' pooled outputs.

Training normalises each call of the shared BatchNorm with that call's batch statistics.
Validated with:

* ``running (EMA)`` — the running statistics training leaves: torch's exponential moving
  average over every call, which weighs the later levels more;
* ``precise, pooled`` — ``precisebn.recalibrate``: the exact statistics of all three
  levels pooled (what one running buffer can hold);
* ``precise, per call`` — ``precisebn.estimate(per_call=True)``, ``precisebn.untie_calls``,
  ``precisebn.apply``: each level normalised with its own exact statistics;
* ``batch statistics`` — a reference, not a method: every call normalised with the
  statistics of the whole validation set's own batch (as in training).

Run with ``.venv/bin/python scripts/shared_head.py`` (about 30 s on 2 cores, CPU, one
thread); prints the table quoted in the README's "Layers called several times per
forward".
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import precisebn
from precisebn.demo import load_digits

SCALES = (1.0, 4.0, 0.25)
OFFSETS = (0.0, 3.0, -2.0)


class Head(nn.Module):
    """conv–BatchNorm–ReLU–conv, shared by every level."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(width)
        self.out = nn.Conv2d(width, 10, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(F.relu(self.bn(self.conv(x))))


class SharedHeadNet(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
        )
        self.lateral = nn.ModuleList(nn.Conv2d(width, width, 1) for _ in SCALES)
        self.head = Head(width)

    def forward(self, x: Tensor) -> Tensor:
        f = self.stem(x)
        levels = [f, F.avg_pool2d(f, 2), F.avg_pool2d(f, 4)]  # 8×8, 4×4, 2×2
        scores = 0
        for level, lateral, scale, offset in zip(levels, self.lateral, SCALES, OFFSETS):
            scores = scores + self.head(lateral(level) * scale + offset).mean((2, 3))
        return scores  # type: ignore[return-value]


@torch.no_grad()
def evaluate(model: nn.Module, x: Tensor, y: Tensor, batch_statistics: bool = False) -> tuple[float, float]:
    """(accuracy, cross-entropy) on the whole validation set in one batch."""
    model.eval()
    if batch_statistics:
        model = copy.deepcopy(model)
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.train()
    logits = model(x)
    return float((logits.argmax(1) == y).float().mean()), float(F.cross_entropy(logits, y))


def run(seed: int, epochs: int) -> dict[str, tuple[float, float]]:
    x_train, y_train, x_val, y_val = load_digits(seed)
    torch.manual_seed(seed)
    model = SharedHeadNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    g = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        model.train()
        for idx in torch.randperm(len(x_train), generator=g).split(32):
            if len(idx) < 2:
                continue
            loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    train_batches = list(x_train.split(64))
    results = {"running (EMA)": evaluate(model, x_val, y_val)}
    pooled = copy.deepcopy(model)
    report = precisebn.recalibrate(pooled, train_batches, num_samples="all")
    assert report.pooled_calls == ["head.bn"], report.pooled_calls
    results["precise, pooled"] = evaluate(pooled, x_val, y_val)
    per_call = copy.deepcopy(model)
    stats = precisebn.estimate(per_call, train_batches, num_samples="all", per_call=True)
    precisebn.untie_calls(per_call, stats)
    precisebn.apply(per_call, stats)
    results["precise, per call"] = evaluate(per_call, x_val, y_val)
    results["batch statistics (reference)"] = evaluate(model, x_val, y_val, batch_statistics=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    start = time.perf_counter()
    runs = [run(seed, args.epochs) for seed in range(args.seeds)]
    print(f"seeds 0–{args.seeds - 1}; mean (per seed)")
    print("| statistics of the shared head's BatchNorm | validation accuracy | validation loss |")
    print("|---|---:|---:|")
    for name in runs[0]:
        accs = [r[name][0] for r in runs]
        losses = [r[name][1] for r in runs]
        acc = " / ".join(f"{100 * a:.1f}" for a in accs)
        loss = " / ".join(f"{v:.3f}" for v in losses)
        print(f"| {name} | {100 * sum(accs) / len(accs):.1f} % ({acc}) | {sum(losses) / len(losses):.3f} ({loss}) |")
    print(f"{args.seeds} seeds × {args.epochs} epochs in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
