"""Weight-averaged models (``torch.optim.swa_utils.AveragedModel``, SWA and EMA): the
statistics go into the averaged copy and equal the float64 truth of its inputs."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import precisebn
from precisebn.compat import update_bn


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Dropout(0.3),
        nn.Flatten(),
        nn.Linear(4 * 6 * 6, 5),
        nn.BatchNorm1d(5),
    )


def make_batches(n: int = 5, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, 3, 8, 8, generator=g) * 2 + 1, torch.zeros(6)) for _ in range(n)]


def averaged_after_training(kind: str, use_buffers: bool) -> tuple[nn.Module, AveragedModel]:
    model = make_model()
    options: dict[str, Any] = {"use_buffers": use_buffers}
    if kind == "ema":
        options["multi_avg_fn"] = get_ema_multi_avg_fn(0.8)
    averaged = AveragedModel(model, **options)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, _ in make_batches(4, seed=2):
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        averaged.update_parameters(model)
    return model, averaged


def assert_precise(module: nn.Module, truth: dict[str, Any]) -> None:
    assert truth
    for name, t in truth.items():
        layer = module.get_submodule(name)
        mean_error = ((layer.running_mean.double() - t.mean).abs() / t.var.sqrt()).max()
        var_error = ((layer.running_var.double() - t.var).abs() / t.var).max()
        assert mean_error < 1e-5 and var_error < 1e-5, (name, float(mean_error), float(var_error))


@pytest.mark.parametrize("use_buffers", [False, True])
@pytest.mark.parametrize("kind", ["swa", "ema"])
def test_recalibrate_writes_into_the_averaged_copy(
    float64_truth: Any, snapshot: Any, unchanged: Any, kind: str, use_buffers: bool
) -> None:
    model, averaged = averaged_after_training(kind, use_buffers)
    data = make_batches()
    truth = float64_truth(averaged, data)
    assert set(truth) == {"module.1", "module.6"}
    source = snapshot(model)
    counted = averaged.n_averaged.clone()
    weights = [p.detach().clone() for p in averaged.parameters()]

    report = precisebn.recalibrate(averaged, data, num_samples="all")

    assert report.updated == ["module.1", "module.6"]
    assert_precise(averaged, truth)
    unchanged(model, source)  # the training model keeps its own statistics
    assert torch.equal(averaged.n_averaged, counted)
    assert all(torch.equal(p, q) for p, q in zip(averaged.parameters(), weights))
    # The statistics belong to the averaged weights, not to the training model's.
    assert not torch.allclose(averaged.module[1].running_mean, model[1].running_mean)


def test_compat_update_bn_is_a_drop_in_for_torch_swa_utils(float64_truth: Any) -> None:
    _, averaged = averaged_after_training("swa", use_buffers=False)
    data = make_batches()
    truth = float64_truth(averaged, data, mode="train")  # update_bn runs in training mode
    flags = [m.training for m in averaged.modules()]
    update_bn(data, averaged)  # the call torch.optim.swa_utils.update_bn(loader, swa_model) takes
    assert_precise(averaged, {"module.1": truth["module.1"]})  # upstream of the dropout: no random masks
    assert [m.training for m in averaged.modules()] == flags


def test_statistics_of_a_wrapper_given_to_the_model_it_wraps_say_so() -> None:
    """Probe 41: statistics estimated on an AveragedModel (named 'module.1') given to the bare model, or the other
    way round, were refused without a word of the prefix; the message now says which name the model holds."""
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    averaged = AveragedModel(model)
    data = [torch.randn(8, 4) for _ in range(3)]
    of_wrapper, of_model = precisebn.estimate(averaged, data), precisebn.estimate(model, data)
    with pytest.raises(precisebn.PreciseBNError, match=r"'module\.1' is not in the model \(the model holds '1': "):
        precisebn.apply(model, of_wrapper)
    with pytest.raises(precisebn.PreciseBNError, match=r"'1' is not in the model \(the model holds it as 'module\.1'"):
        precisebn.apply(averaged, of_model)
    with pytest.raises(precisebn.PreciseBNError) as unrelated:  # no such name at any depth: no hint
        precisebn.apply(nn.Sequential(nn.BatchNorm1d(4)), of_wrapper)
    assert "the model holds" not in str(unrelated.value)
