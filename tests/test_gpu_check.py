"""benchmarks/gpu_check.py, run on CPU (``--dry-run``) so that the CUDA checks cannot rot between
the rare sessions with a GPU: every CPU-runnable check passes, and its "nothing lost" detector
does see a changed buffer, flag, momentum, hook and wrapped forward."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import gpu_check


def test_dry_run_passes_every_cpu_check(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_check.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "FAIL" not in out
    labels = ("(b) exact vs float64", "(e) resnet18, channels_last, capture=float64", "(f) NaN batch 3, mode=train")
    for label in labels:
        assert f"PASS  {label}" in out, out
    assert "(e) timm efficientnet_b0, channels_last, capture=auto" in out  # timm is in the dev extra


@pytest.mark.parametrize("change", ["buffer", "flag", "momentum", "hook", "forward", "dtype"])
def test_unchanged_sees_every_kind_of_leftover(change: str) -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    before = gpu_check._snapshot(model)
    assert gpu_check._unchanged(model, before) == ""
    bn = model[1]
    if change == "buffer":
        bn.running_var[2] = torch.nextafter(bn.running_var[2], torch.tensor(2.0))
    elif change == "flag":
        bn.eval()
    elif change == "momentum":
        bn.momentum = 1.0
    elif change == "hook":
        bn.register_forward_pre_hook(lambda m, a: None)
    elif change == "forward":
        bn.forward = bn.forward  # an instance attribute, as a wrapper leaves it
    else:
        bn.running_mean.data = bn.running_mean.double()
    assert gpu_check._unchanged(model, before) != ""
