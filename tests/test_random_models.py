"""Random models against the float64 truth: a property test over what the capture has to handle at once.

Each example builds a small model from a seed — BatchNorm1d on ``(N, C, L)`` and ``(N, C)`` views,
BatchNorm2d, timm's BatchNormAct2d, subclasses with forwards of their own; layers called once, twice or
only for some batches; inputs pooled, made channels_last, repeated into larger ones or moved far from 0;
batches of varied sizes, shapes, scales and offsets; a float64 model now and then — and compares the
statistics with the float64 mean and population variance of every value each layer received
(:func:`conftest.compute_truth`). A fuzzing run of this kind (500 seeds) found the layout-1 rounding case of
``test_a_later_call_further_from_0_than_any_checked_one_is_measured_in_float64``.

Tolerances: the README's 1e-5 for float32, relative to σ² = var + eps (what the layer divides by), plus, for
the mean, the rounding of a float32 value of that size, ``2⁻²⁴·|mean|/σ`` (the same in every batch's own
figure as in the buffer it is written to); 1e-10 relative to the variance itself for float64 models and for
``capture="float64"``.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import precisebn
from conftest import assert_unchanged, compute_truth, state_snapshot

timm = pytest.importorskip("timm")


class OwnForward(nn.BatchNorm2d):
    """A forward of its own through ``F.batch_norm`` on its input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(
            x, self.running_mean, self.running_var, self.weight, self.bias, self.training, self.momentum, self.eps
        )


class SuperForward(nn.BatchNorm2d):
    """A forward of its own that calls torch's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 1.0


KINDS = ("BatchNorm2d", "BatchNormAct2d", "OwnForward", "SuperForward", "BatchNorm1d", "BatchNorm1d flat")
HOW = ("as is", "pooled", "channels_last", "far from 0", "larger channels_last", "odd batches only")


class RandomModel(nn.Module):
    """Layers called in a random plan, each after a 1x1 convolution of the running features."""

    def __init__(self, rng: random.Random, channels: int) -> None:
        super().__init__()
        n = rng.randint(1, 4)
        self.kinds = [rng.choice(KINDS) for _ in range(n)]
        self.norms = nn.ModuleList(self._layer(kind, channels) for kind in self.kinds)
        self.convs = nn.ModuleList(nn.Conv2d(channels, channels, 1) for _ in range(n))
        self.plan = []
        for k in range(n):
            self.plan.append((k, rng.choice(HOW)))
            if rng.random() < 0.3:  # a layer called again, another way
                self.plan.append((rng.randrange(n), rng.choice(HOW)))

    @staticmethod
    def _layer(kind: str, channels: int) -> nn.Module:
        if kind.startswith("BatchNorm1d"):
            return nn.BatchNorm1d(channels)
        if kind == "BatchNormAct2d":
            return timm.layers.BatchNormAct2d(channels)
        return {"BatchNorm2d": nn.BatchNorm2d, "OwnForward": OwnForward, "SuperForward": SuperForward}[kind](channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for k, how in self.plan:
            y = self.convs[k](x)
            if how == "odd batches only" and y.shape[0] % 2 == 0:
                continue
            if how == "pooled" and y.shape[-1] >= 2:
                y = F.avg_pool2d(y, 2)
            elif how == "channels_last":
                y = y.contiguous(memory_format=torch.channels_last)
            elif how == "far from 0":
                y = y * 3 + 50.0
            elif how == "larger channels_last":
                y = y.repeat(1, 1, 2, 2).contiguous(memory_format=torch.channels_last)
            kind = self.kinds[k]
            if kind.startswith("BatchNorm1d"):
                flat = y.flatten(2)  # (N, C, L); "flat": (N·L, C)
                self.norms[k](flat.transpose(1, 2).reshape(-1, y.shape[1]) if kind.endswith("flat") else flat)
                continue
            out = self.norms[k](y)
            x = x + 0.1 * out if out.shape == x.shape else x
        return x


def build(seed: int) -> tuple[nn.Module, list[torch.Tensor], torch.dtype]:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    channels = rng.choice([2, 3, 8])
    model = RandomModel(rng, channels)
    dtype = torch.float64 if rng.random() < 0.2 else torch.float32
    model = model.to(dtype)
    batches = []
    for b in range(rng.randint(1, 5)):
        n = rng.choice([2, 3, 4, 8])
        size = rng.choice([1, 2, 4, 8, 16, 48]) if b else rng.choice([1, 2, 4])
        scale, offset = rng.choice([1, 10, 0.01]), rng.choice([0, 5, 300, 3000])
        x = torch.randn(n, channels, size, size, dtype=dtype) * scale + offset
        if rng.random() < 0.3:
            x = x.contiguous(memory_format=torch.channels_last)
        batches.append(x)
    return model, batches, dtype


@settings(max_examples=40, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**31 - 1), capture=st.sampled_from(["auto", "float64"]))
def test_random_models_match_the_float64_truth(seed: int, capture: str) -> None:
    model, batches, dtype = build(seed)
    truth = compute_truth(model, batches)
    before = state_snapshot(model)
    stats = precisebn.estimate(model, batches, num_batches=len(batches), capture=capture)
    assert_unchanged(model, before)
    exact = dtype == torch.float64 or capture == "float64"
    for name, t in truth.items():
        s = stats[name]
        assert s.count == t.count, name
        if t.count == 0:
            continue
        # float32: relative to var + eps, what the layer divides by (the README's tolerance); float64: to var
        var = t.var if exact else t.var + model.get_submodule(name).eps
        std = var.sqrt().clamp_min(1e-300)
        rounding = 0.0 if exact else 2.0**-24 * t.mean.abs() / std
        mean_error = float(((s.mean.double() - t.mean).abs() / std - rounding).max())
        var_error = float(((s.var.double() - t.var).abs() / var.clamp_min(1e-300)).max())
        tolerance = 1e-10 if exact else 1e-5
        assert mean_error <= tolerance and var_error <= tolerance, (name, s.path, mean_error, var_error, seed)
