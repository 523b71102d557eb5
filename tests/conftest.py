"""Shared fixtures. ``float64_truth`` is the ground truth every statistics test compares to."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _NormBase
from torch.nn.modules.instancenorm import _InstanceNorm


@dataclass
class Truth:
    """float64 statistics of everything one layer received."""

    count: int
    mean: Tensor
    var: Tensor  # population (biased)
    calls: int


def _channels_first(module: nn.Module, x: Tensor) -> Tensor:
    x = x.detach().to(torch.float64)
    if isinstance(module, _InstanceNorm) and x.dim() == module._get_no_batch_dim():
        x = x.unsqueeze(0)
    if x.dim() == 1:
        x = x.unsqueeze(0)
    return x.transpose(0, 1).reshape(x.shape[1], -1)


def compute_truth(
    model: nn.Module,
    batches: Iterable[Any],
    *,
    forward: Callable[[nn.Module, Any], Any] | None = None,
    mode: str = "norm",
    select: Callable[[str, nn.Module], bool] | None = None,
    seed: int | None = None,
) -> dict[str, Truth]:
    """Runs a deep copy of ``model`` over ``batches`` in the given mode and returns, per
    selected normalization layer, the float64 mean and population variance of the
    concatenation of all its inputs — computed here, independently of precisebn."""
    model = copy.deepcopy(model)
    forward = forward or (lambda m, b: m(b[0] if isinstance(b, (tuple, list)) else b))
    select = select or (lambda name, m: True)
    chosen = {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, _NormBase) and m.track_running_stats and select(name, m)
    }
    if mode != "keep":  # "keep": flags as they are (fvcore's convention)
        for m in model.modules():
            m.training = mode == "train"
            if isinstance(m, _NormBase) and m.track_running_stats:
                m.training = False
        for m in chosen.values():
            m.training = True
    seen: dict[str, list[Tensor]] = {name: [] for name in chosen}
    handles = [
        m.register_forward_pre_hook(lambda mod, args, name=name: seen[name].append(_channels_first(mod, args[0])))
        for name, m in chosen.items()
    ]
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        for batch in batches:
            forward(model, batch)
    for h in handles:
        h.remove()
    out = {}
    for name, xs in seen.items():
        if not xs:
            out[name] = Truth(0, torch.empty(0), torch.empty(0), 0)
            continue
        x = torch.cat(xs, dim=1)
        out[name] = Truth(x.shape[1], x.mean(1), x.var(1, unbiased=False), len(xs))
    return out


class BiasedVariance1d(nn.BatchNorm1d):
    """Stores the *biased* batch variance (detectron2's NaiveSyncBatchNorm does): torch writes
    its figures, then the layer replaces the unbiased variance by the biased one, so that its
    own figures fail verification and it is measured on the float64 path."""

    def forward(self, x: Tensor) -> Tensor:
        out = nn.functional.batch_norm(
            x, self.running_mean, self.running_var, self.weight, self.bias, self.training, self.momentum, self.eps
        )
        if self.training:
            with torch.no_grad():
                dims, n = [d for d in range(x.dim()) if d != 1], x.numel() // x.shape[1]
                self.running_var.sub_(torch.var(x, dim=dims, correction=0), alpha=self.momentum / (n - 1))
        return out


class NormEval(nn.Module):
    """A backbone whose BatchNorm (``body.1``) stays in eval mode whenever the model trains
    (mmdetection's ``norm_eval=True``: frozen for training, normalising with statistics of its
    own), and a head whose BatchNorm (``head.1``) trains. Takes ``(N, 4)``."""

    def __init__(self, frozen: bool = True) -> None:
        super().__init__()
        self.frozen = frozen
        self.body = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU())
        self.head = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 1))
        with torch.no_grad():  # statistics far from what the data gives
            self.body[1].running_mean.fill_(0.5)
            self.body[1].running_var.fill_(4.0)
        self.train()  # (a training loop may not call train() on a model built in training mode)

    def train(self, mode: bool = True) -> NormEval:
        super().train(mode)
        if mode and self.frozen:
            self.body[1].eval()
        return self

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(x))


def assert_frozen_run(
    frozen: str,
    same_losses: bool,
    model: nn.Module,
    reference: nn.Module,
    batches: Iterable[Any],
    prefix: str = "",
    **truth: Any,
) -> None:
    """After training ``model`` with an integration (``frozen=``) and ``reference`` without it, from the same seeds:
    with ``"include"``, training differed and so did the frozen layer's statistics (what every version did before
    frozen layers were told apart); with ``"skip"``, the losses and weights are bitwise those of ``reference``,
    the frozen layer (``{prefix}body.1``) is bitwise ``reference``'s, and the trained layer (``{prefix}head.1``)
    holds the float64 truth of its inputs on ``batches`` with the frozen layer normalising with its own statistics,
    as in training (``truth``: ``compute_truth``'s options)."""
    frozen_layer, trained = model.get_submodule(f"{prefix}body.1"), f"{prefix}head.1"
    kept = reference.get_submodule(f"{prefix}body.1")
    if frozen == "include":
        assert not same_losses and not torch.equal(frozen_layer.running_mean, kept.running_mean)
        return
    assert same_losses and all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        assert torch.equal(getattr(frozen_layer, name), getattr(kept, name))
    result = compute_truth(model, batches, select=lambda name, m: name == trained, **truth)[trained]
    bn = model.get_submodule(trained)
    assert max_rel_error(bn.running_mean, result.mean, result.var.sqrt()) < 1e-5
    assert max_rel_error(bn.running_var, result.var) < 1e-5


def assert_warned_ratio(caught: pytest.WarningsRecorder, truth: Any, eps: float) -> None:
    """The one far-from-0 ``PreciseBNWarning`` in ``caught`` states the largest |mean|/σ (σ² = var + eps) of the
    float64 truth, within 1 % (the fast figures it read carry the rounding it warns of)."""
    ratio = float((truth.mean.abs() / (truth.var + eps).sqrt()).max())
    found = [re.search(r"\|mean\|/σ up to ([0-9.e+]+)\)", str(w.message)) for w in caught]
    (shown,) = [m for m in found if m is not None]  # (others: e.g. errors of 0, the same values in every fold)
    assert shown is not None and float(shown.group(1)) == pytest.approx(ratio, rel=1e-2)


def max_rel_error(estimate: Tensor, truth: Tensor, scale: Tensor | None = None) -> float:
    """max |estimate - truth| / scale (scale defaults to |truth|), in float64."""
    est = estimate.detach().to("cpu", torch.float64)
    scale = truth.abs() if scale is None else scale
    return float(((est - truth).abs() / scale.clamp_min(1e-300)).max())


def pooled_with_prior(
    prior_mean: Tensor, prior_var: Tensor, prior_values: float, values: Tensor
) -> tuple[Tensor, Tensor]:
    """The mean and population variance per channel of ``values`` (a float64 ``(channels, n)``
    matrix) pooled with ``prior_values`` pseudo-values per channel whose mean and population
    variance are ``prior_mean`` and ``prior_var`` (the union's moments, written out in float64)."""
    mean, var = values.mean(1), values.var(1, unbiased=False)
    return pooled_moments(prior_mean, prior_var, prior_values, mean, var, values.shape[1])


def pooled_moments(
    prior_mean: Tensor, prior_var: Tensor, prior_values: float, mean: Tensor, var: Tensor, n: int
) -> tuple[Tensor, Tensor]:
    """:func:`pooled_with_prior` of ``n`` values per channel of float64 ``mean`` and population ``var``."""
    p = float(prior_values)
    mu0, v0 = prior_mean.detach().double(), prior_var.detach().double()
    total = p + n
    return (p * mu0 + n * mean) / total, (p * v0 + n * var + p * n / total * (mean - mu0) ** 2) / total


def set_statistics(bn: nn.Module, mean: list[float], var: list[float]) -> tuple[Tensor, Tensor]:
    """Gives ``bn`` these running statistics (the prior in the tests of ``prior=``); returns copies."""
    with torch.no_grad():
        bn.running_mean.copy_(torch.tensor(mean))
        bn.running_var.copy_(torch.tensor(var))
    return bn.running_mean.clone(), bn.running_var.clone()


def assert_adapted(
    bn: nn.Module, before: tuple[Tensor, Tensor], prior_values: float, values: Tensor, adapt: str = "both"
) -> None:
    """``bn``'s buffers are the data ``values`` (``(channels, n)``, float64) pooled with its statistics
    ``before`` counted as ``prior_values`` values per channel, and a buffer that ``adapt`` leaves out is
    bitwise as it was."""
    mean, var = pooled_with_prior(*before, prior_values, values)
    if adapt == "var":
        assert torch.equal(bn.running_mean, before[0])
    else:
        assert max_rel_error(bn.running_mean, mean, var.sqrt()) <= 1e-6
    if adapt == "mean":
        assert torch.equal(bn.running_var, before[1])
    else:
        assert max_rel_error(bn.running_var, var) <= 1e-5
    assert max_rel_error(mean, values.mean(1), var.sqrt()) > 1e-2  # the prior moved them


@pytest.fixture
def float64_truth() -> Callable[..., dict[str, Truth]]:
    """``float64_truth(model, batches, forward=None, mode="norm", select=None, seed=None)``."""
    return compute_truth


def state_snapshot(model: nn.Module) -> dict[str, Any]:
    """Everything that must stay bitwise unchanged: state_dict, flags, momenta, hooks."""
    return {
        "state": {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()},
        "flags": [m.training for m in model.modules()],
        "momenta": [getattr(m, "momentum", None) for m in model.modules()],
        "hooks": [
            (len(m._forward_pre_hooks), len(m._forward_hooks), len(m._backward_hooks), m.__dict__.get("forward"))
            for m in model.modules()
        ],
        "buffer_ids": [id(b) for b in model.buffers()],
    }


def assert_unchanged(model: nn.Module, snapshot: dict[str, Any]) -> None:
    now = state_snapshot(model)
    assert now["flags"] == snapshot["flags"], "training flags changed"
    assert now["momenta"] == snapshot["momenta"], "momentum changed"
    assert now["hooks"] == snapshot["hooks"], "hooks left behind"
    assert now["buffer_ids"] == snapshot["buffer_ids"], "buffer tensors replaced"
    assert now["state"].keys() == snapshot["state"].keys()
    for k, v in snapshot["state"].items():
        w = now["state"][k]
        assert v.dtype == w.dtype and v.shape == w.shape, k
        # bitwise: compare raw bytes so that NaN == NaN and -0.0 != 0.0
        assert torch.equal(_raw(v), _raw(w)), f"{k} changed"


def _raw(t: Tensor) -> Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


@pytest.fixture
def snapshot() -> Callable[[nn.Module], dict[str, Any]]:
    return state_snapshot


@pytest.fixture
def unchanged() -> Callable[[nn.Module, dict[str, Any]], None]:
    return assert_unchanged


def interrupt_at_first_line(code: Any, ready: Callable[[], bool], run: Callable[[], Any]) -> bool:
    """Runs ``run()`` under a trace that raises ``KeyboardInterrupt`` (as a signal handler would) at the first line
    of ``code`` (a function's ``__code__``) executed once ``ready()`` holds, and expects it to come through; returns
    whether it fired."""
    import sys

    fired: list[bool] = []

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "line" and not fired and ready():
            fired.append(True)
            raise KeyboardInterrupt
        return local

    sys.settrace(lambda frame, event, arg: local if frame.f_code is code else None)
    try:
        with pytest.raises(KeyboardInterrupt):
            run()
    finally:
        sys.settrace(None)
    return bool(fired)


def ends_in_another_thread(run: Callable[[], Any], timeout: float = 60.0) -> bool:
    """Whether ``run()``, started in a thread of its own (a daemon: one that hangs is left behind), returns within
    ``timeout`` seconds."""
    import threading

    done: list[bool] = []

    def target() -> None:
        run()
        done.append(True)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout=timeout)
    return done == [True]
