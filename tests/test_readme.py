"""The README's "Use it in your training loop" snippets run as written.

Every ```python block between ``<!-- training-loop:start -->`` and
``<!-- training-loop:end -->`` is executed on its own, in a fresh namespace and an empty
working directory; the snippets check their own claims with ``assert``. The detectron2
recipe runs against a stand-in for ``detectron2.engine.hooks`` (detectron2 is not on
PyPI) that calls ``update_bn_stats`` the way detectron2's ``PreciseBN`` hook does.
"""

from __future__ import annotations

import copy
import re
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"
SECTION = re.compile(r"<!-- training-loop:start -->(.*?)<!-- training-loop:end -->", re.S)
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def snippets() -> list[str]:
    match = SECTION.search(README.read_text(encoding="utf-8"))
    assert match, "the README lost its training-loop markers"
    return BLOCK.findall(match.group(1))


def test_the_section_covers_every_case() -> None:
    section = SECTION.search(README.read_text(encoding="utf-8")).group(1)
    assert "## Use it in your training loop" in section
    code = snippets()
    assert any("PreciseBNScheduler" in c for c in code)
    assert any("integrations.lightning import PreciseBN" in c for c in code)
    assert any("AveragedModel" in c for c in code)
    assert any("PreciseWeightAveraging" in c for c in code)
    assert any("integrations.mmengine import ExactPreciseBNHook" in c for c in code)
    assert any("integrations.transformers import PreciseBNCallback" in c for c in code)
    assert any("integrations.ignite import PreciseBN" in c for c in code)
    assert any("accelerator.prepare" in c for c in code)
    assert any("ModelEmaV3" in c for c in code)
    assert any("detectron2" in c for c in code)


def _run(index: int) -> dict[str, Any]:
    namespace: dict[str, Any] = {"__name__": "readme_snippet"}
    exec(compile(snippets()[index], f"README.md (training-loop snippet {index + 1})", "exec"), namespace)
    return namespace


@pytest.mark.parametrize("index", [i for i, code in enumerate(snippets()) if "detectron2" not in code])
def test_snippet_runs_as_written(index: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # checkpoints and logs land here
    _run(index)


# What detectron2's engine/hooks.py does, reduced to the calling pattern the recipe relies on:
# the module imports update_bn_stats from fvcore into its own namespace at import time, and its
# PreciseBN hook calls it with (model, a generator drawing from a reused iterator, num_iter) on a
# model whose BatchNorm layers are in training mode, with batches that are lists of dicts.
STAND_IN = """
import itertools

from fvcore.nn.precise_bn import get_bn_modules, update_bn_stats


class PreciseBN:
    def __init__(self, period, model, data_loader, num_iter):
        self._disabled = len(get_bn_modules(model)) == 0
        self._model, self._data_loader, self._num_iter, self._period = model, data_loader, num_iter, period
        self._data_iter = None

    def update_stats(self):
        if self._disabled:
            return
        if self._data_iter is None:
            self._data_iter = iter(self._data_loader)

        def data_loader():
            for _ in itertools.count(1):
                yield next(self._data_iter)

        update_bn_stats(self._model, data_loader(), self._num_iter)
"""


def test_detectron2_recipe_makes_its_hook_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, float64_truth: Any
) -> None:
    package = tmp_path / "site" / "detectron2"
    (package / "engine").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "engine" / "__init__.py").write_text("")
    (package / "engine" / "hooks.py").write_text(textwrap.dedent(STAND_IN))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    for name in ("detectron2", "detectron2.engine", "detectron2.engine.hooks"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.chdir(tmp_path)

    (index,) = [i for i, code in enumerate(snippets()) if "detectron2" in code]
    import detectron2.engine.hooks as hooks  # the stand-in

    monkeypatch.setattr(hooks, "update_bn_stats", hooks.update_bn_stats)  # undone after the test
    _run(index)
    import precisebn.compat

    assert hooks.update_bn_stats is precisebn.compat.update_bn_stats

    class Detector(torch.nn.Module):  # detectron2's convention: model(list of per-image dicts)
        def __init__(self) -> None:
            super().__init__()
            self.backbone = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU())

        def forward(self, batched_inputs: list[dict[str, torch.Tensor]]) -> torch.Tensor:
            return self.backbone(torch.stack([record["image"] for record in batched_inputs]))

    g = torch.Generator().manual_seed(0)
    # A large mean and a small spread: where fvcore's E[x^2] - E[x]^2 in float32 goes wrong.
    batches = [[{"image": 1000 + 0.01 * torch.randn(3, 8, 8, generator=g)} for _ in range(4)] for _ in range(6)]
    model = Detector().train()
    fvcore_model = copy.deepcopy(model)
    hooks.PreciseBN(0, model, batches, num_iter=5).update_stats()
    truth = float64_truth(model, batches[:5], forward=lambda m, b: m(b), mode="keep")["backbone.1"]

    def errors(layer: torch.nn.Module) -> tuple[float, float]:
        scale = torch.maximum(truth.mean.abs(), truth.var.sqrt())  # the README's measure for the mean
        return (
            float(((layer.running_mean.double() - truth.mean).abs() / scale).max()),
            float(((layer.running_var.double() - truth.var).abs() / truth.var).max()),
        )

    mean_error, var_error = errors(model.backbone[1])
    assert mean_error < 1e-6 and var_error < 1e-4, (mean_error, var_error)
    # The same hook with fvcore's function (what the one line replaces) on the same batches.
    from fvcore.nn.precise_bn import update_bn_stats as fvcore_update_bn_stats

    monkeypatch.setattr(hooks, "update_bn_stats", fvcore_update_bn_stats)
    hooks.PreciseBN(0, fvcore_model, batches, num_iter=5).update_stats()
    assert errors(fvcore_model.backbone[1])[1] > 0.1
