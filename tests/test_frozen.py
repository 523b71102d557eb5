"""Layers frozen for training (kept in eval mode while the model trains): the scheduler
leaves them as they are, and measures the others as training runs them — with the
frozen ones normalising with their own statistics."""

from __future__ import annotations

import logging
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

import precisebn
from conftest import NormEval, max_rel_error
from precisebn.errors import InvalidArgumentError, LayerNotFoundError, PreciseBNWarning
from precisebn.frozen import FrozenLayers, core_model

FROZEN, TRAINED = "body.1", "head.1"


def batches(n: int = 4, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(16, 4, generator=g) * 3 + 1 for _ in range(n)]


def statistics(bn: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    return bn.running_mean.clone(), bn.running_var.clone()


def test_observes_only_a_model_in_training_mode() -> None:
    model = NormEval().train()
    frozen = FrozenLayers()
    assert frozen.observe(model) and frozen.names == (FROZEN,)
    model.eval()
    assert not frozen.observe(model) and frozen.names == (FROZEN,)  # evaluating says nothing
    model.frozen = False
    model.train()
    assert frozen.observe(model) and frozen.names == ()  # unfrozen: noted again


def test_the_names_of_a_trained_model_are_found_in_its_averaged_copy() -> None:
    model = NormEval().train()
    averaged = AveragedModel(model)
    assert core_model(averaged) is averaged.module
    frozen = FrozenLayers()
    frozen.observe(model)
    layers, skipped = frozen.excluding(None, averaged)
    assert skipped == [FROZEN]
    names = dict(averaged.named_modules())
    assert callable(layers)
    assert not layers(f"module.{FROZEN}", names[f"module.{FROZEN}"])
    assert layers(f"module.{TRAINED}", names[f"module.{TRAINED}"])


def test_the_scheduler_leaves_frozen_layers_and_measures_the_others_as_training_runs_them(
    float64_truth: Any, snapshot: Any
) -> None:
    model = NormEval().train()
    data = batches()
    kept = statistics(model.body[1])
    scheduler = precisebn.PreciseBNScheduler(model, data, num_samples="all")
    report = scheduler.update(1)
    assert report is not None and [r.name for r in report.layers] == [TRAINED]
    assert scheduler.frozen_layers == (FROZEN,)
    assert all(torch.equal(a, b) for a, b in zip(kept, statistics(model.body[1])))
    # the truth: the frozen layer normalising with its own statistics, as in training
    truth = float64_truth(model, data, select=lambda name, m: name == TRAINED)[TRAINED]
    assert max_rel_error(model.head[1].running_mean, truth.mean, truth.var.sqrt()) < 1e-6
    assert max_rel_error(model.head[1].running_var, truth.var) < 1e-5
    assert model.training and not model.body[1].training  # the modes are as they were


def test_include_recalibrates_frozen_layers_too(float64_truth: Any) -> None:
    model = NormEval().train()
    data = batches()
    scheduler = precisebn.PreciseBNScheduler(model, data, num_samples="all", frozen="include")
    report = scheduler.update(1)
    assert report is not None and [r.name for r in report.layers] == [FROZEN, TRAINED]
    truth = float64_truth(model, data)  # every layer measured in training mode
    for name in (FROZEN, TRAINED):
        bn = model.get_submodule(name)
        assert max_rel_error(bn.running_mean, truth[name].mean, truth[name].var.sqrt()) < 1e-6
        assert max_rel_error(bn.running_var, truth[name].var) < 1e-5
    assert max_rel_error(model.body[1].running_mean, torch.full((6,), 0.5, dtype=torch.float64)) > 0.1


def test_observations_made_in_training_hold_when_update_runs_in_eval_mode() -> None:
    model = NormEval().train()
    scheduler = precisebn.PreciseBNScheduler(model, batches(), num_samples="all")
    assert scheduler.observe()
    kept = statistics(model.body[1])
    model.eval()  # e.g. update() called after model.eval(), right before evaluating
    report = scheduler.update(1)
    assert report is not None and [r.name for r in report.layers] == [TRAINED]
    assert all(torch.equal(a, b) for a, b in zip(kept, statistics(model.body[1])))


def test_a_model_whose_every_layer_is_frozen_is_left_as_it_is_with_one_warning(snapshot: Any, unchanged: Any) -> None:
    model = NormEval().train()
    model.head[1].eval()
    before = snapshot(model)
    scheduler = precisebn.PreciseBNScheduler(model, batches(), num_samples="all")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert scheduler.update(1) is None
        assert scheduler.update(1) is None  # said once
    unchanged(model, before)
    assert scheduler.computations == 0 and scheduler.last_step is None
    notes = [str(w.message) for w in caught if issubclass(w.category, PreciseBNWarning)]
    assert len(notes) == 1 and "nothing to recompute" in notes[0] and "'body.1', 'head.1'" in notes[0]
    assert "frozen='include'" in notes[0]


def test_other_frozen_layers_are_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    scheduler = precisebn.PreciseBNScheduler(NormEval().train(), batches(), num_samples="all")
    with caplog.at_level(logging.INFO, logger="precisebn"), warnings.catch_warnings():
        warnings.simplefilter("error")
        scheduler.update(1)
        scheduler.update(2)
    notes = [r.getMessage() for r in caplog.records if "frozen" in r.getMessage()]
    assert len(notes) == 1 and f"'{FROZEN}'" in notes[0]


def test_frozen_layers_are_taken_out_of_the_users_selection() -> None:
    model = NormEval().train()
    data = batches()
    named = precisebn.PreciseBNScheduler(model, data, num_samples="all", layers=[FROZEN, TRAINED])
    with pytest.warns(PreciseBNWarning, match=f"layers= names '{FROZEN}', frozen for training"):
        report = named.update(1)
    assert report is not None and [r.name for r in report.layers] == [TRAINED]
    typed = precisebn.PreciseBNScheduler(model, data, num_samples="all", layers=lambda name, m: name == FROZEN)
    with pytest.warns(PreciseBNWarning, match="nothing to recompute"):
        assert typed.update(1) is None  # its only layer is frozen
    wrong = precisebn.PreciseBNScheduler(model, data, num_samples="all", layers=["body.9"])
    with pytest.raises(LayerNotFoundError, match=r"body\.9"):
        wrong.update(1)


def test_a_wrapped_model_is_observed_through_its_wrapper() -> None:
    model = NormEval().train()
    wrapped = nn.DataParallel(model)  # (on the CPU: the module itself is called)
    scheduler = precisebn.PreciseBNScheduler(wrapped, batches(), num_samples="all")
    report = scheduler.update(1)
    assert report is not None and [r.name for r in report.layers] == [TRAINED]
    assert scheduler.frozen_layers == (FROZEN,)


def test_an_averaged_copy_is_recalibrated_with_the_frozen_layers_of_the_model_trained() -> None:
    model = NormEval(frozen=False)
    averaged = AveragedModel(model)  # made before the model was frozen: its flags say nothing
    model.frozen = True
    model.train()
    kept = statistics(averaged.module.body[1])
    scheduler = precisebn.PreciseBNScheduler(averaged, batches(), num_samples="all")
    assert averaged.training and averaged.module.body[1].training
    assert scheduler.observe(model) and scheduler.frozen_layers == (FROZEN,)
    report = scheduler.update(1)
    assert report is not None and report.updated == [f"module.{TRAINED}"]
    assert all(torch.equal(a, b) for a, b in zip(kept, statistics(averaged.module.body[1])))


def test_a_copy_of_the_model_named_by_trains_leaves_its_frozen_layers_before_any_observation(
    float64_truth: Any,
) -> None:
    """``trains(model)`` (Ignite's ``trained_model=``) names the model trained without observing it, and update()
    read no modes at all then: a computation before any observation (an evaluation at the trainer's start, a loop
    that never calls observe()) recalibrated the copy's frozen layer (a probe: mean 5 → -0.13, var 9 → 0.27 in an
    EMA copy). update() now reads the frozen layers off the model trained, when that model is in training mode."""
    model = NormEval(frozen=False)
    averaged = AveragedModel(model)  # made before the model was frozen: its flags say nothing
    model.frozen = True
    model.train()
    data = batches()
    kept = statistics(averaged.module.body[1])
    scheduler = precisebn.PreciseBNScheduler(averaged, data, num_samples="all")
    scheduler.trains(model)
    report = scheduler.update(1)
    assert report is not None and report.updated == [f"module.{TRAINED}"]
    assert scheduler.frozen_layers == (FROZEN,)
    assert all(torch.equal(a, b) for a, b in zip(kept, statistics(averaged.module.body[1])))
    # the truth: the frozen layer normalising with its own statistics, the trained one measured in training mode
    name = f"module.{TRAINED}"
    truth = float64_truth(averaged, data, select=lambda n, m: n == name)[name]
    assert max_rel_error(averaged.module.head[1].running_mean, truth.mean, truth.var.sqrt()) < 1e-6
    assert max_rel_error(averaged.module.head[1].running_var, truth.var) < 1e-5
    model.eval()  # evaluating: says nothing, and the observation holds
    assert scheduler.update(2, force=True).updated == [f"module.{TRAINED}"]  # type: ignore[union-attr]


def test_a_wrapper_still_training_around_a_model_in_eval_mode_says_nothing() -> None:
    # e.g. a rank that evaluates alone through ddp_model.module: the wrapper's flag stays True
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 5), nn.BatchNorm1d(5))
    wrapped = nn.DataParallel(model)
    model.eval()
    scheduler = precisebn.PreciseBNScheduler(wrapped, batches(), num_samples="all")
    report = scheduler.update(1)  # (was None: every layer in eval mode looked frozen)
    assert report is not None and report.updated == ["1", "4"] and scheduler.frozen_layers == ()


def test_a_head_trained_on_a_backbone_in_eval_mode_is_seen_training() -> None:
    model = NormEval(frozen=False)
    model.eval()
    model.head.train()  # a linear probe / head-only fine-tuning
    kept = statistics(model.body[1])
    scheduler = precisebn.PreciseBNScheduler(model, batches(), num_samples="all")
    report = scheduler.update(1)
    assert report is not None and report.updated == [TRAINED] and scheduler.frozen_layers == (FROZEN,)
    assert all(torch.equal(a, b) for a, b in zip(kept, statistics(model.body[1])))


def test_a_layer_replaced_during_training_is_seen_as_it_is() -> None:
    model = NormEval().train()
    scheduler = precisebn.PreciseBNScheduler(model, batches(), num_samples="all")
    assert scheduler.update(1).updated == [TRAINED]  # type: ignore[union-attr]
    model.frozen = False
    model.body[1] = nn.SyncBatchNorm.convert_sync_batchnorm(model.body[1])  # a new module, now trained
    model.train()
    assert scheduler.update(2).updated == [FROZEN, TRAINED]  # type: ignore[union-attr]
    model.body[1] = nn.BatchNorm1d(6).eval()  # a pretrained layer put in frozen
    assert scheduler.update(3).updated == [TRAINED]  # type: ignore[union-attr]


def test_observe_refuses_what_is_not_a_model_and_keeps_reading_its_own() -> None:
    model = NormEval().train()
    scheduler = precisebn.PreciseBNScheduler(model, batches(), num_samples="all")
    with pytest.raises(InvalidArgumentError, match="observe\\(\\) takes the model being trained, got int"):
        scheduler.observe(123)  # type: ignore[arg-type]
    assert scheduler.update(1).updated == [TRAINED]  # type: ignore[union-attr]


def test_a_copy_that_never_trains_is_recalibrated_at_every_update(recwarn: pytest.WarningsRecorder) -> None:
    """An EMA copy stays in eval mode: with a train() override in it (timm's LeViT clears a cache there), the copy
    was never 'seen training', and every update was skipped as if before training (0 computations in 3 epochs)."""

    class Cached(nn.Sequential):
        def train(self, mode: bool = True) -> Cached:
            self.cache = None  # what timm's attention layers do
            return super().train(mode)

    copy_ = Cached(nn.Linear(4, 6), nn.BatchNorm1d(6)).eval()
    scheduler = precisebn.PreciseBNScheduler(copy_, batches(), num_samples="all")
    assert [scheduler.update(step) is not None for step in (1, 2, 3)] == [True, True, True]
    assert not [w for w in recwarn if issubclass(w.category, PreciseBNWarning)]


def test_mc_dropout_evaluation_is_not_training() -> None:
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Dropout(0.2), nn.Linear(6, 1))
    scheduler = precisebn.PreciseBNScheduler(model.train(), batches(), num_samples="all")
    assert scheduler.update(1).updated == ["1"]  # type: ignore[union-attr]
    model.eval()
    model[3].train()  # dropout on for MC-dropout evaluation: no module with parameters trains
    report = scheduler.update(2)  # (was None: "nothing to recompute", every BatchNorm frozen)
    assert report is not None and report.updated == ["1"] and scheduler.frozen_layers == ()


def test_a_linear_probe_on_a_frozen_backbone_leaves_every_batchnorm() -> None:
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 1))
    model.eval()
    model[3].train()  # only the head (no BatchNorm) trains
    scheduler = precisebn.PreciseBNScheduler(model, batches(), num_samples="all")
    with pytest.warns(PreciseBNWarning, match="nothing to recompute"):
        assert scheduler.update(1) is None
    assert scheduler.frozen_layers == ("1",)


def test_timm_ema_copies_find_the_layers_frozen_in_the_model_trained() -> None:
    from timm.utils import ModelEmaV3

    model = NormEval().train()
    ema = ModelEmaV3(model, decay=0.9)
    kept = statistics(ema.module.body[1])
    scheduler = precisebn.PreciseBNScheduler(ema, batches(), num_samples="all")
    assert scheduler.observe(model)
    report = scheduler.update(1)
    assert report is not None and report.updated == [f"module.{TRAINED}"]  # (the frozen one was recalibrated)
    assert all(torch.equal(a, b) for a, b in zip(kept, statistics(ema.module.body[1])))


def test_observing_a_model_without_those_layers_warns() -> None:
    model = NormEval().train()
    other = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6)).train()
    other[1].eval()
    scheduler = precisebn.PreciseBNScheduler(model, batches(), num_samples="all")
    scheduler.observe(other)
    with pytest.warns(PreciseBNWarning, match=r"noted as frozen for training \('1'\) are not in the model"):
        report = scheduler.update(1)
    assert report is not None and report.updated == [FROZEN, TRAINED]


def test_a_layer_swapped_in_right_before_a_computation_is_seen() -> None:
    model = NormEval(frozen=False).train()
    scheduler = precisebn.PreciseBNScheduler(model, batches(), num_samples="all")
    assert scheduler.observe() and scheduler.frozen_layers == ()
    model.body[1] = nn.BatchNorm1d(6).eval()  # a pretrained layer put in, frozen
    report = scheduler.update(1)
    assert report is not None and report.updated == [TRAINED]


@pytest.mark.parametrize("value", ["yes", None, True, 1, ["skip"]])
def test_bad_values_are_refused_at_construction(value: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="frozen must be 'skip'"):
        precisebn.PreciseBNScheduler(NormEval(), batches(), frozen=value)


def test_every_integration_refuses_a_bad_value_at_construction() -> None:
    from precisebn.integrations.ignite import PreciseBN as IgniteHandler
    from precisebn.integrations.lightning import PreciseBN, PreciseWeightAveraging
    from precisebn.integrations.mmengine import ExactPreciseBNHook
    from precisebn.integrations.transformers import PreciseBNCallback

    makers = [PreciseBN, PreciseWeightAveraging, ExactPreciseBNHook, PreciseBNCallback]
    makers.append(lambda frozen: IgniteHandler(NormEval(), batches(), frozen=frozen))
    for make in makers:
        with pytest.raises(InvalidArgumentError, match="frozen must be 'skip'"):
            make(frozen="eval")  # type: ignore[operator]
