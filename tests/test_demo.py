"""``precisebn demo``: the reduced run through ``main``, determinism, and the demo's building blocks."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

from precisebn.cli import main
from precisebn.demo import DemoConfig, _precise_copy, build_model, run_demo, summaries

pytest.importorskip("sklearn")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("demo") / "out"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = main(["demo", "--quick", "--epochs", "2", "--seed", "3", "--out", str(out)])
    return {"code": code, "out": out, "stdout": stdout.getvalue()}


def test_demo_writes_the_four_parts(quick_run):
    assert quick_run["code"] == 0
    results = json.loads((quick_run["out"] / "results.json").read_text())
    assert results["config"]["epochs"] == 2 and results["config"]["seed"] == 3 and results["config"]["quick"]
    curve = results["validation_curve"]
    assert curve["epoch"] == [1, 2]
    for key in ("ema", "precise"):
        assert len(curve[key]) == 2 and all(0 <= a <= 1 for a in curve[key])
    swa = results["weight_averaging"]
    assert swa["epochs_averaged"] == [2]
    shift = results["domain_shift"]
    for value in (swa["stale"], swa["recalibrated"], shift["training_stats"], shift["adapted"]):
        assert 0 <= value <= 1
    # the clean reference of part 3 is the recalibrated averaged model of part 2
    assert shift["clean"] == swa["recalibrated"]
    # accuracies are counts over the validation set
    n_val = results["data"]["val"]
    assert all(abs(a * n_val - round(a * n_val)) < 1e-9 for a in curve["ema"] + curve["precise"])
    few = results["few_shot"]
    assert few["counts"] == [2, 4] and few["draws"] == 1 and few["priors"] == [2.0, 16.0]
    assert [s["name"] for s in few["shifts"]] == ["strong (part 3)", "moderate"]
    strong = few["shifts"][0]
    assert (strong["training_stats"], strong["all_images"]) == (shift["training_stats"], shift["adapted"])
    for s in few["shifts"]:
        assert list(s["prior"]) == ["2", "16"]
        for accs in (s["plain"], *s["prior"].values()):  # one draw: counts over the validation set
            assert len(accs) == 2 and all(abs(a * n_val - round(a * n_val)) < 1e-9 for a in accs)
    assert results["wall_seconds"] > 0
    assert (quick_run["out"] / "demo.png").read_bytes().startswith(b"\x89PNG")
    text = quick_run["stdout"]
    for heading in ("1. Validation curve", "2. Weight averaging (SWA)", "3. Domain shift", "4. Few-shot", "wall time"):
        assert heading in text
    assert text.count("→ ") == 4  # one sentence per part


def test_demo_is_deterministic(quick_run):
    first = json.loads((quick_run["out"] / "results.json").read_text())
    again = run_demo(DemoConfig(epochs=2, seed=3, quick=True))
    for part in ("validation_curve", "weight_averaging", "domain_shift", "few_shot"):
        assert again[part] == first[part], part


def test_demo_restores_global_state():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    threads = torch.get_num_threads()
    run_demo(DemoConfig(epochs=1, seed=0, quick=True))
    assert torch.get_num_threads() == threads
    assert torch.equal(torch.rand(3), expected)


def test_no_plot_writes_json_only(tmp_path, capsys, monkeypatch):
    import precisebn.demo as demo

    seen = []
    run = demo._run
    monkeypatch.setattr(demo, "_run", lambda *a, **k: seen.append(torch.get_num_threads()) or run(*a, **k))
    before = torch.get_num_threads()
    args = ["--threads", "2", "demo", "--quick", "--epochs", "1", "--no-plot", "--out", str(tmp_path)]
    assert main(args) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]
    out = capsys.readouterr().out
    assert "figure:" not in out and "CPU (2 threads)" in out
    assert seen == [2] and torch.get_num_threads() == before  # (--threads was ignored by the demo: 1, a probe)
    assert main([*args, "--quiet"]) == 0  # (its per-epoch lines, on stderr, were printed with --quiet: a probe)
    captured = capsys.readouterr()
    assert captured.out == "" and "epoch" not in captured.err


def test_precise_copy_leaves_training_untouched(snapshot, unchanged):
    torch.manual_seed(0)
    model = build_model(width=4)
    images = torch.rand(40, 1, 8, 8)
    model.train()
    model(images)  # EMA statistics that differ from the precise ones
    before = snapshot(model)
    twin = _precise_copy(model, images)
    unchanged(model, before)
    assert not torch.equal(twin[1].running_var, model[1].running_var)
    # the first layer's precise statistics are those of its input, computed independently in float64
    first_input = model[0](images).double()
    torch.testing.assert_close(twin[1].running_mean.double(), first_input.mean((0, 2, 3)), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        twin[1].running_var.double(), first_input.var((0, 2, 3), unbiased=False), rtol=1e-5, atol=1e-6
    )


def _results(ema, precise, stale, recalibrated, shifted, adapted):
    return {
        "validation_curve": {"epoch": list(range(1, len(ema) + 1)), "ema": ema, "precise": precise},
        "weight_averaging": {"stale": stale, "recalibrated": recalibrated},
        "domain_shift": {
            "contrast": 0.5,
            "brightness": 0.4,
            "clean": 0.9,
            "training_stats": shifted,
            "adapted": adapted,
        },
    }


def test_summaries_follow_the_numbers():
    good = summaries(_results([0.5, 0.6], [0.9, 0.95], 0.5, 0.9, 0.2, 0.8))
    assert "not from the weights" in good["validation_curve"] and "50.0 %–60.0 %" in good["validation_curve"]
    assert "need statistics measured" in good["weight_averaging"] and "+40.0 points" in good["weight_averaging"]
    assert "without any retraining" in good["domain_shift"]
    flat = summaries(_results([0.9, 0.95], [0.9, 0.94], 0.9, 0.9, 0.5, 0.45))
    assert "about as well as precise" in flat["validation_curve"]
    assert "happened to fit" in flat["weight_averaging"]
    assert "did not help" in flat["domain_shift"]


def _few(plain_strong, prior_strong, plain_moderate, prior_moderate):
    def shift(name, train, plain, prior):
        return {"name": name, "training_stats": train, "all_images": 0.99, "plain": [plain, 0.98],
                "prior": {"2": [prior, 0.97], "16": [0.1, 0.9]}}  # fmt: skip

    return {
        "few_shot": {
            "counts": [1, 64],
            "draws": 5,
            "shifts": [
                shift("strong (part 3)", 0.4, plain_strong, prior_strong),
                shift("moderate", 0.8, plain_moderate, prior_moderate),
            ],
        }
    }


def test_few_shot_summary_follows_the_numbers():
    from precisebn.demo import _few_shot_summary

    mixed = _few_shot_summary(_few(0.75, 0.42, 0.80, 0.90)["few_shot"])
    assert "From 1 unlabelled image (mean of 5 draws)" in mixed
    assert "strong shift the best prior (N=2) lost to plain re-estimation (42.0 % vs 75.0 %" in mixed
    assert "moderate shift the best prior (N=2) beat plain re-estimation (90.0 % vs 80.0 %" in mixed
    assert "paid off where the training statistics were already closer" in mixed
    assert "with 64 images plain re-estimation reaches 98.0 % and 98.0 % (all images: 99.0 % and 99.0 %)" in mixed
    assert "never paid off" in _few_shot_summary(_few(0.75, 0.42, 0.80, 0.70)["few_shot"])
    assert "paid off at the fewest images" in _few_shot_summary(_few(0.5, 0.6, 0.80, 0.90)["few_shot"])
    assert "depends on the shift" in _few_shot_summary(_few(0.5, 0.6, 0.80, 0.70)["few_shot"])


def test_swa_stale_statistics_are_the_last_models():
    """What the demo calls 'stale': AveragedModel keeps its buffers in sync with the trained model."""
    from torch.optim.swa_utils import AveragedModel

    model = build_model(width=4)
    swa = AveragedModel(model)
    model.train()
    model(torch.rand(8, 1, 8, 8))
    swa.update_parameters(model)
    assert torch.equal(swa.module[1].running_mean, model[1].running_mean)
    assert model[1].running_mean.abs().sum() > 0  # not the initial zeros


def test_swa_averages_every_epoch_it_names(monkeypatch):
    """Part 2's averaged weights are the mean of the weights after every epoch in ``epochs_averaged`` (probe 47:
    AveragedModel created at the first of them and updated from the next held the later ones only — "epochs 7–12"
    averaged epochs 8–12)."""
    import precisebn.demo as demo

    cfg = DemoConfig(epochs=2, seed=1, quick=True, swa_epochs=2, few_shot_counts=(1,), few_shot_priors=(2.0,))
    after_epoch: list[dict[str, torch.Tensor]] = []
    averaged: list[torch.nn.Module] = []
    precise_copy, averaged_model = demo._precise_copy, demo.AveragedModel

    def record_epoch(model, images):  # called once per epoch on the model trained, then on others
        if len(after_epoch) < cfg.epochs:
            after_epoch.append({k: p.detach().double().clone() for k, p in model.named_parameters()})
        return precise_copy(model, images)

    class Recorded(averaged_model):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            averaged.append(self)

    monkeypatch.setattr(demo, "_precise_copy", record_epoch)
    monkeypatch.setattr(demo, "AveragedModel", Recorded)
    results = run_demo(cfg)
    epochs = results["weight_averaging"]["epochs_averaged"]
    assert epochs == [1, 2] and len(averaged) == 1
    held = dict(averaged[0].module.named_parameters())
    for name in after_epoch[0]:
        truth = torch.stack([after_epoch[e - 1][name] for e in epochs]).mean(0)  # float64
        assert torch.allclose(held[name].double(), truth, rtol=1e-5, atol=1e-6), name
