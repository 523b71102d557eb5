"""Figures recomputed where torch's CPU kernel sums a channel in float32 (precisebn.figures).

Found by probe 36a: on the CPU, torch's BatchNorm kernel for channels_last and ``(N, C)`` inputs
sums each channel in float32, one value after another; on values that repeat (blank frames,
padding) every rounding goes the same way. A later batch of such values, the layer verified on an
ordinary first batch, was read 1.0e-4 of the variance off (a channels_last efficientnet_b0 on
near-blank frames: 1.1e-5 to 2.8e-5), past the 1e-5 the README promises, unwarned.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import precisebn
from conftest import compute_truth, max_rel_error
from precisebn.figures import EXACT_UP_TO, refigure

TOL = 1e-5


def repeated(n: int, channels: int, *rest: int) -> torch.Tensor:
    """Each channel ``+a`` on half of its values and ``-a`` on the other half (``a`` not exact in binary)."""
    a = (1.1 + 0.01 * torch.arange(channels, dtype=torch.float32)).view(1, channels, *[1] * len(rest))
    x = a.expand(n, channels, *rest).clone()
    x[1::2] *= -1  # (every other sample: mean 0 per channel)
    return x


def torch_figures(t: torch.Tensor) -> torch.Tensor:
    """What torch's own kernel leaves with momentum 1: the batch mean and unbiased variance, ``(2, C)``."""
    mean, var = torch.zeros(t.shape[1]), torch.ones(t.shape[1])
    F.batch_norm(t, mean, var, None, None, True, 1.0, 1e-5)
    return torch.stack([mean, var])


def float64_figures(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = t.detach().double().movedim(1, 0).reshape(t.shape[1], -1)
    return x.mean(1), x.var(1)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: repeated(8, 8, 32, 32).contiguous(memory_format=torch.channels_last), id="channels_last"),
        pytest.param(lambda: repeated(4096, 16), id="(N, C)"),
        pytest.param(lambda: torch.randn(6, 5, 40, 41)[..., 1:] * 3 + 7, id="cropped"),
        pytest.param(lambda: (torch.randn(4, 3, 600, 300) * 2 - 5).bfloat16(), id="bf16, several slices"),
        pytest.param(lambda: torch.randn(3, 4, 7).contiguous(memory_format=torch.contiguous_format), id="small"),
    ],
)
def test_refigure_matches_the_float64_figures(make) -> None:
    t = make()
    mean, var = float64_figures(t)
    pair = torch_figures(t.float())
    refigure(t, pair)
    assert max_rel_error(pair[0], mean, var.sqrt()) <= 1e-6
    assert max_rel_error(pair[1], var) <= 1e-6


def test_torchs_own_figures_on_repeated_values_are_what_refigure_is_for() -> None:
    """The premise, measured here so that a torch that stops rounding so shows: its figures are off by more than
    the tolerance, refigure's are not; and up to EXACT_UP_TO values per channel torch's are within it."""
    t = repeated(8, 8, 32, 32).contiguous(memory_format=torch.channels_last)
    _, var = float64_figures(t)
    assert max_rel_error(torch_figures(t)[1], var) > TOL
    small = repeated(EXACT_UP_TO, 64)
    assert max_rel_error(torch_figures(small)[1], float64_figures(small)[1]) <= TOL / 2


class _OwnForward2d(nn.BatchNorm2d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (a forward of its own: watched, then read as verified)
        return super().forward(x)


class _OwnForward1d(nn.BatchNorm1d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


@pytest.mark.parametrize("own", [False, True])
@pytest.mark.parametrize("layout", ["channels_last", "(N, C)"])
@pytest.mark.parametrize("capture", ["auto", "float64"])
def test_later_batches_of_repeated_values_are_exact(layout: str, capture: str, own: bool) -> None:
    """An ordinary first batch verifies the layer; later ones of repeated values had been read through torch's
    figures: 4.2e-5 (channels_last), 2.3e-5 ((N, C)) of the variance off; now 2.6e-7 and 3.9e-7. A layer with a
    forward of its own too (its figures recomputed from its input where it was seen to normalise it, and taken
    since probe 38 only where they agree with its own within the kernel's rounding: they do here)."""
    g = torch.Generator().manual_seed(0)
    if layout == "channels_last":
        model: nn.Module = nn.Sequential(nn.Identity(), _OwnForward2d(8) if own else nn.BatchNorm2d(8))
        batches = [torch.randn(8, 8, 32, 32, generator=g)] + [repeated(8, 8, 32, 32) for _ in range(8)]
        batches = [b.contiguous(memory_format=torch.channels_last) for b in batches]
    else:
        model = nn.Sequential(nn.Identity(), _OwnForward1d(16) if own else nn.BatchNorm1d(16))
        batches = [torch.randn(4096, 16, generator=g)] + [repeated(4096, 16) for _ in range(6)]
    truth = compute_truth(model, batches)["1"]
    stats = precisebn.estimate(model, batches, num_samples="all", capture=capture)
    got = stats["1"]
    assert got.path == ("fast" if capture == "auto" else "float64")
    assert max_rel_error(got.mean, truth.mean, truth.var.add(1e-5).sqrt()) <= TOL
    assert max_rel_error(got.var, truth.var, truth.var + 1e-5) <= TOL


class _WritesItsInput(nn.Module):
    """Runs ``layer``, then writes its input in place without changing a value (an in-place activation of a tensor a
    branch has read)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        out = self.layer(x)
        x.add_(0.0)
        return out


@pytest.mark.parametrize("written", [False, True], ids=["", "input written after"])
@pytest.mark.parametrize("own", [False, True])
@pytest.mark.parametrize("layout", ["channels_last", "(N, C)"])
def test_batch_means_of_few_values_far_from_zero_are_summed_again(layout: str, own: bool, written: bool) -> None:
    """Found by a probe: up to EXACT_UP_TO values per channel in these layouts, torch's float32 sum makes each batch
    mean err by several u·|mean|, which the spread between batches' means multiplies by |mean|/σ in the pooled
    variance — 3.4e-5 to 5.7e-5 of it off, unwarned, at |mean|/σ = 75 (a calibration set of two batches, 1 σ either
    side, fed 16 times, after a first batch that verifies the layer). Their means are summed in float64 now — at the
    call: a review found a forward of its own's mean, summed at the end of the batch, lost to a later in-place write
    into its input (4.6e-5 again)."""
    g = torch.Generator().manual_seed(0)
    mu, channels = 75.0, 64
    if layout == "channels_last":  # 64 values per channel: one 8x8 map
        shape: tuple[int, ...] = (1, channels, 8, 8)
        layer: nn.Module = _OwnForward2d(channels) if own else nn.BatchNorm2d(channels)
    else:
        shape = (84, channels)
        layer = _OwnForward1d(channels) if own else nn.BatchNorm1d(channels)
    n = math.prod(shape) // channels
    signs = torch.stack([torch.randperm(n, generator=g) % 2 * 2.0 - 1.0 for _ in range(channels)])  # half each
    first = mu + 0.125 * signs.reshape(channels, shape[0], *shape[2:]).movedim(0, 1)  # (exact figures: verifies)
    a = mu + 1 + 0.1 * torch.randn(shape, generator=g)
    b = mu - 1 + 0.1 * torch.randn(shape, generator=g)
    batches = [first] + [a, b] * 16
    if layout == "channels_last":
        batches = [x.contiguous(memory_format=torch.channels_last) for x in batches]
    model = nn.Sequential(nn.Identity(), _WritesItsInput(layer) if written else layer)
    name = "1.layer" if written else "1"
    truth = compute_truth(model, batches)[name]
    got = precisebn.estimate(model, batches, num_samples="all")[name]
    assert got.path == "fast"
    assert max_rel_error(got.mean, truth.mean, truth.var.add(1e-5).sqrt()) <= TOL
    assert max_rel_error(got.var, truth.var, truth.var + 1e-5) <= TOL


class _Transposed(nn.BatchNorm1d):  # (B, L, C) sequences, normalised as (B, C, L): channels adjacent in memory
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.transpose(1, 2)).transpose(1, 2)


class _Scaled(nn.BatchNorm1d):  # normalises its input in the verifying batch, then a tensor a little off it
    def __init__(self, channels: int) -> None:
        super().__init__(channels)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return super().forward(x if self.calls == 1 else x * 1.01)


@pytest.mark.parametrize("kind", ["transposed", "scaled", "times one"])
def test_a_forward_of_its_own_with_few_values_in_layout_1_is_measured_in_float64(kind: str) -> None:
    """A review of the fix above: a layer with a forward of its own normalising a tensor made from its input (a
    transpose, x * 1.0) kept torch's float32 means (2.7e-5 of the variance off at |mean|/σ = 75, unwarned): at so
    few values such calls are watched and measured in float64. One seen to normalise its input itself, then x * 1.01
    (state its arguments do not show), keeps its own figures where its input's mean disagrees with them (the input's
    would be 0.75 σ off). A change within the kernel's rounding bound (x * (1 + 5e-6): 3.8e-4 σ) is not told apart,
    as the README says."""
    g = torch.Generator().manual_seed(0)
    mu, channels = 75.0, 16
    shape = (8, 8, channels) if kind == "transposed" else (64, channels)
    signs = torch.stack([torch.randperm(64, generator=g) % 2 * 2.0 - 1.0 for _ in range(channels)], 1)
    first = (mu + 0.125 * signs).reshape(shape)  # (exact figures: the layer verifies)
    a = mu + 1 + 0.1 * torch.randn(shape, generator=g)
    b = mu - 1 + 0.1 * torch.randn(shape, generator=g)
    batches = [first] + [a, b] * 16
    if kind == "transposed":
        layer: nn.Module = _Transposed(channels)
    elif kind == "scaled":
        layer = _Scaled(channels)
    else:
        layer = _OwnForward1d(channels)
        layer.forward = lambda x: nn.BatchNorm1d.forward(layer, x * 1.0)  # type: ignore[method-assign]
    normalised = [(x * 1.01 if kind == "scaled" and k else x).double() for k, x in enumerate(batches)]
    values = torch.cat([x.reshape(-1, channels) for x in normalised])  # what it normalised, channel last
    mean, var = values.mean(0), values.var(0, unbiased=False)
    got = precisebn.estimate(nn.Sequential(nn.Identity(), layer), batches, num_samples="all")["1"]
    if kind == "scaled":  # (its own float32 figures: torch's rounding of a mean 75 σ from 0)
        assert max_rel_error(got.mean, mean, var.add(1e-5).sqrt()) <= 1e-3
        return
    assert max_rel_error(got.mean, mean, var.add(1e-5).sqrt()) <= 1e-7
    assert max_rel_error(got.var, var, var + 1e-5) <= TOL / 10


def test_a_call_of_no_values_keeps_its_figures() -> None:
    """A review of the fix above: a head normalising the rows a mask keeps, none in one batch, divided by zero
    summing its mean again — a false NonFiniteError ("the inputs contain NaN/Inf") where the fast path was exact."""
    g = torch.Generator().manual_seed(1)
    bn = nn.BatchNorm1d(4)
    xs = [torch.randn(6, 4, generator=g) + 3 for _ in range(5)]
    keeps = [torch.tensor([True, False, True, True, False, True])] * 2 + [torch.zeros(6, dtype=torch.bool)] * 3
    batches = list(zip(xs, keeps))
    stats = precisebn.estimate(nn.Sequential(bn), batches, num_samples="all", forward=lambda m, b: m(b[0][b[1]]))["0"]
    rows = torch.cat([x[k] for x, k in batches]).double()
    assert max_rel_error(stats.mean, rows.mean(0), rows.var(0, unbiased=False).sqrt()) <= 1e-6
    assert max_rel_error(stats.var, rows.var(0, unbiased=False)) <= 1e-6


@pytest.mark.parametrize("own", [False, True])
@pytest.mark.parametrize("size", ["held", "at once"])
def test_the_verifying_calls_figures_checked_on_every_channel_are_the_float64_ones(size: str, own: bool) -> None:
    """Found by probe 40: in the verifying batch, a call in layout 1 whose own float32 figures passed their check on
    every channel kept them, up to the tolerance off; over later batches those errors add up — a timm mobileone_s0
    layer in channels_last read 9.3e-6 σ and 9.9e-6 of the variance off in that batch ended 1.13e-5 off, past the
    README's 1e-5, unwarned. The check's float64 reference is at hand: the figures are its now, whether checked at
    once (a large input) or held with others (a small one). (One thread: torch's reduction, and so its error,
    depends on the number of threads.)"""
    shape = (4, 8, 64, 64) if size == "at once" else (4, 8, 16, 16)
    g = torch.Generator().manual_seed(0)
    first = torch.randn(*shape, generator=g) + (2.0 if size == "at once" else 4.0)
    later = first[:, :, :8, :8].clone() - 1.4  # (a second batch whose mean is some σ away: the errors add up)
    batches = [b.contiguous(memory_format=torch.channels_last) for b in (first, later)]
    model = nn.Sequential(nn.Identity(), _OwnForward2d(8) if own else nn.BatchNorm2d(8))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        mean, var = float64_figures(batches[0])
        own_figures = torch_figures(batches[0])  # the premise: torch's own are off by more than the rounding
        assert max_rel_error(own_figures[0], mean, var.add(1e-5).sqrt()) > 2e-6
        for data in (batches[:1], batches):
            truth = compute_truth(model, data)["1"]
            got = precisebn.estimate(model, data, num_samples="all")["1"]
            assert got.path == "fast"
            assert max_rel_error(got.mean, truth.mean, truth.var.add(1e-5).sqrt()) <= 3e-7
            assert max_rel_error(got.var, truth.var, truth.var + 1e-5) <= 3e-7
    finally:
        torch.set_num_threads(threads)
