"""The Hugging Face callback, driven by a real ``transformers.Trainer`` on CPU.

The model is a real transformers vision model with BatchNorm (a tiny
``ResNetForImageClassification`` built from its config: nothing is downloaded). Every
statistics check loads the weights the Trainer had at that moment (a snapshot taken at
``on_evaluate``, or a checkpoint file) into a fresh model and compares its running
statistics with the float64 truth that ``conftest.compute_truth`` computes over the
same training batches.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from safetensors.torch import load_file
from transformers import ResNetConfig, ResNetForImageClassification, Trainer, TrainerCallback, TrainingArguments

from conftest import NormEval, assert_adapted, assert_frozen_run, set_statistics
from precisebn.errors import MissingDependencyError, PreciseBNWarning
from precisebn.integrations.transformers import PreciseBNCallback

CONFIG = ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3)
N, BATCH = 64, 16  # 4 optimizer steps per epoch


def make_dataset(n: int = N) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    images = torch.randn(n, 3, 16, 16, generator=g) * 2 + 0.5
    labels = torch.randint(0, 3, (n,), generator=g)
    return [{"pixel_values": images[i], "labels": labels[i]} for i in range(n)]


def collate(records: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {key: torch.stack([r[key] for r in records]) for key in records[0]}


def noisy_collate(records: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A random augmentation: draws from torch's global generator for every batch."""
    batch = collate(records)
    batch["pixel_values"] = batch["pixel_values"] + 0.1 * torch.randn_like(batch["pixel_values"])
    return batch


class SequentialTrainer(Trainer):
    """Batches in dataset order, so that the test knows which batches were measured."""

    def _get_train_sampler(self, *args: Any, **kwargs: Any) -> torch.utils.data.Sampler:
        return torch.utils.data.SequentialSampler(self.train_dataset)


class NoNorm(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 16 * 16, 3))

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.net(pixel_values)
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}


class Snapshots(TrainerCallback):
    """The model's state at every evaluation, and at every step end (before PreciseBN)."""

    def __init__(self) -> None:
        self.evaluated: list[tuple[int, dict[str, torch.Tensor]]] = []
        self.step_ends: list[Any] = []

    def on_evaluate(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self.evaluated.append((state.global_step, {k: v.clone() for k, v in model.state_dict().items()}))


def arguments(tmp_path: Path, **kwargs: Any) -> TrainingArguments:
    options: dict[str, Any] = {
        "output_dir": str(tmp_path),
        "per_device_train_batch_size": BATCH,
        "per_device_eval_batch_size": 32,
        "num_train_epochs": 2,
        "learning_rate": 0.05,
        "eval_strategy": "no",
        "save_strategy": "no",
        "logging_steps": 1,
        "report_to": [],
        "use_cpu": True,
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        "seed": 0,
    }
    options.update(kwargs)
    return TrainingArguments(**options)


def train(trainer_type: type[Trainer], model: torch.nn.Module, args: TrainingArguments, **kwargs: Any) -> Trainer:
    from transformers import PrinterCallback

    trainer = trainer_type(model, args, **kwargs)
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    return trainer


def assert_precise(float64_truth: Any, state: dict[str, torch.Tensor], batches: list[Any]) -> None:
    model = ResNetForImageClassification(CONFIG)
    model.load_state_dict(state)
    truth = float64_truth(model, batches, forward=lambda m, b: m(pixel_values=b["pixel_values"]))
    assert len(truth) == 8  # every BatchNorm2d of the tiny ResNet
    for name, t in truth.items():
        mean_error = float(((state[f"{name}.running_mean"].double() - t.mean).abs() / t.var.sqrt()).max())
        var_error = float(((state[f"{name}.running_var"].double() - t.var).abs() / t.var).max())
        assert mean_error < 1e-5 and var_error < 1e-5, (name, mean_error, var_error)


def train_precise(
    tmp_path: Path, callbacks: list[Any], **kwargs: Any
) -> tuple[Trainer, torch.nn.Module, list[dict[str, torch.Tensor]]]:
    """A SequentialTrainer on the shared dataset (evaluated on its first 32 records) with ``callbacks`` and
    ``arguments(tmp_path, **kwargs)``; returns the trainer, its model and the batches the sequential sampler
    gives (what the float64 truth is computed from)."""
    data = make_dataset()
    model = ResNetForImageClassification(CONFIG)
    trainer = train(
        SequentialTrainer,
        model,
        arguments(tmp_path, **kwargs),
        train_dataset=data,
        eval_dataset=data[:32],
        data_collator=collate,
        callbacks=callbacks,
    )
    return trainer, model, [collate(data[i : i + BATCH]) for i in range(0, N, BATCH)]


def test_before_evaluation_and_save_once_per_step(tmp_path: Path, float64_truth: Any) -> None:
    precise, snapshots = PreciseBNCallback(num_samples="all"), Snapshots()
    trainer, _, batches = train_precise(
        tmp_path, [precise, snapshots], eval_strategy="steps", eval_steps=4, save_strategy="steps", save_steps=2
    )
    # 8 steps; saves at 2, 4, 6, 8 and evaluations at 4, 8: four distinct steps, four
    # computations (the end of training, at step 8, shares the last one).
    assert trainer.state.global_step == 8
    assert precise.computations == 4 and precise.last_step == 8
    logged = [e for e in trainer.state.log_history if "precisebn/samples" in e]
    assert [e["step"] for e in logged] == [2, 4, 6, 8]
    assert all(e["precisebn/samples"] == N and e["precisebn/var_ratio"] > 0 for e in logged)
    assert [step for step, _ in snapshots.evaluated] == [4, 8]
    for _, state in snapshots.evaluated:
        assert_precise(float64_truth, state, batches)
    for step in (2, 4, 6, 8):
        saved = load_file(tmp_path / f"checkpoint-{step}" / "model.safetensors")
        assert_precise(float64_truth, saved, batches)
    assert not torch.equal(
        snapshots.evaluated[0][1]["classifier.1.weight"], snapshots.evaluated[1][1]["classifier.1.weight"]
    )


def test_the_evaluation_on_start_is_precise_too(tmp_path: Path, float64_truth: Any) -> None:
    """Found by a hostile probe: eval_on_start=True evaluated before any callback event that computes,
    with the model's never-updated statistics."""
    precise, snapshots = PreciseBNCallback(num_samples="all"), Snapshots()
    _, _, batches = train_precise(
        tmp_path, [precise, snapshots], eval_strategy="steps", eval_steps=4, eval_on_start=True, max_steps=4
    )
    assert [step for step, _ in snapshots.evaluated] == [0, 4]
    assert precise.computations == 2
    for _, state in snapshots.evaluated:
        assert_precise(float64_truth, state, batches)


def test_epoch_strategies_and_the_end_of_training(tmp_path: Path, float64_truth: Any) -> None:
    precise = PreciseBNCallback(num_samples="all", on_evaluate=False)  # only before saves and at the end
    trainer, model, batches = train_precise(
        tmp_path, [precise], eval_strategy="epoch", save_strategy="epoch", max_steps=6, num_train_epochs=3
    )
    # Saves at the ends of epoch 1 (step 4) and at the last step (6); the end of training shares step 6.
    assert trainer.state.global_step == 6
    assert (precise.computations, precise.last_step) == (2, 6)
    assert_precise(float64_truth, model.state_dict(), batches)


def test_training_is_untouched(tmp_path: Path) -> None:
    data = make_dataset()

    def run(callbacks: list[Any], directory: Path) -> Trainer:
        torch.manual_seed(0)
        model = ResNetForImageClassification(CONFIG)
        args = arguments(directory, num_train_epochs=3, eval_strategy="steps", eval_steps=3)
        # Shuffled batches (the Trainer's own sampler) and a random augmentation: both draw random numbers.
        return train(
            Trainer,
            model,
            args,
            train_dataset=data,
            eval_dataset=data[:16],
            data_collator=noisy_collate,
            callbacks=callbacks,
        )

    precise = PreciseBNCallback(num_samples=40, mode="train")
    with_callback = run([precise], tmp_path / "with")
    without = run([], tmp_path / "without")
    assert precise.computations == 4  # evaluations at 3, 6, 9, 12; the end of training shares step 12
    losses = [e["loss"] for e in with_callback.state.log_history if "loss" in e]
    assert len(losses) == 12
    assert losses == [e["loss"] for e in without.state.log_history if "loss" in e]
    for (name, p), q in zip(with_callback.model.named_parameters(), without.model.parameters()):
        assert torch.equal(p, q), name


def test_a_model_without_normalization_layers_trains_with_one_warning(tmp_path: Path) -> None:
    data = make_dataset()

    def run(callbacks: list[Any], directory: Path) -> Trainer:
        torch.manual_seed(0)
        args = arguments(directory, eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=3)
        return train(
            Trainer,
            NoNorm(),
            args,
            train_dataset=data,
            eval_dataset=data[:16],
            data_collator=collate,
            callbacks=callbacks,
        )

    precise = PreciseBNCallback(num_samples="all")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = run([precise], tmp_path / "ours")
    messages = [str(w.message) for w in caught if issubclass(w.category, PreciseBNWarning)]
    assert len(messages) == 1 and "no normalization layer" in messages[0], messages
    assert precise.computations == 0 and precise.last_report is None
    reference = run([], tmp_path / "reference")
    assert [e.get("loss") for e in ours.state.log_history] == [e.get("loss") for e in reference.state.log_history]
    for p, q in zip(ours.model.parameters(), reference.model.parameters()):
        assert torch.equal(p, q)


def test_a_failing_data_loader_leaves_the_model_unchanged(tmp_path: Path, snapshot: Any, unchanged: Any) -> None:
    data = make_dataset()

    def failing() -> Any:
        yield collate(data[:BATCH])
        raise OSError("disk on fire")

    class Before(TrainerCallback):  # runs before PreciseBN: the state the failure must leave
        state: ClassVar[dict[str, Any]] = {}

        def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
            Before.state.update(snapshot(model))

    model = ResNetForImageClassification(CONFIG)
    args = arguments(tmp_path, eval_strategy="steps", eval_steps=2)
    with pytest.raises(OSError, match="disk on fire"):
        train(
            Trainer,
            model,
            args,
            train_dataset=data,
            eval_dataset=data[:16],
            data_collator=collate,
            callbacks=[Before(), PreciseBNCallback(data=failing, num_samples="all")],
        )
    unchanged(model, Before.state)


def test_missing_transformers_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in sys.modules if n == "transformers" or n.startswith("transformers.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delitem(sys.modules, "precisebn.integrations.transformers", raising=False)
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(MissingDependencyError, match=r"pip install 'precisebn\[transformers\]'"):
        importlib.import_module("precisebn.integrations.transformers")


class NormFirst(torch.nn.Module):
    """A BatchNorm2d with momentum 0 on the pixels: its statistics stay the prior set by the test
    while training, and its inputs are the data whatever the weights."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.BatchNorm2d(3, momentum=0.0)
        self.head = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 16 * 16, 3))

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.head(self.norm(pixel_values))
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}


@pytest.mark.parametrize("adapt", ["both", "var"])
def test_prior_and_adapt_reach_each_computation(tmp_path: Path, adapt: str) -> None:
    data = make_dataset()
    model = NormFirst()
    before = set_statistics(model.norm, [3.0, -1.0, 0.0], [0.25, 16.0, 1.0])
    precise = PreciseBNCallback(num_samples="all", prior=4, adapt=adapt, on_evaluate=False, on_save=False)
    train(
        Trainer,
        model,
        arguments(tmp_path, num_train_epochs=1),
        train_dataset=data,
        data_collator=collate,
        callbacks=[precise],
    )
    assert precise.computations == 1  # at the end of training
    pixels = torch.stack([r["pixel_values"] for r in data]).double().transpose(0, 1).reshape(3, -1)
    assert_adapted(model.norm, before, 4 * 16 * 16, pixels, adapt)  # 16 x 16 values per sample and channel


class FrozenBackbone(torch.nn.Module):
    """``conftest.NormEval`` (a backbone BatchNorm kept in eval mode while training) with the Trainer's
    convention: keyword batches, a loss in the output."""

    def __init__(self) -> None:
        super().__init__()
        self.net = NormEval()

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.net(x).squeeze(1)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


def frozen_data() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(N, 4, generator=g) * 2 + 1


def train_frozen(directory: Path, callbacks: list[Any], eval_mode: bool = False, **options: Any) -> Trainer:
    """A SequentialTrainer on ``FrozenBackbone`` (in eval mode first if ``eval_mode``, as from_pretrained gives
    it) on ``frozen_data()``, evaluated every epoch on its first 16 records."""
    torch.manual_seed(0)
    model = FrozenBackbone()
    if eval_mode:
        model.eval()
    x = frozen_data()
    records = [{"x": x[i], "labels": x[i].sum()} for i in range(N)]
    args = arguments(directory, eval_strategy="epoch", learning_rate=0.02, **options)
    return train(
        SequentialTrainer, model, args, train_dataset=records, eval_dataset=records[:16], data_collator=collate,
        callbacks=callbacks,
    )  # fmt: skip


def logged_losses(trainer: Trainer) -> list[float]:
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


@pytest.mark.parametrize("frozen", ["skip", "include"])
def test_layers_frozen_for_training_are_left_as_they_are(tmp_path: Path, frozen: str) -> None:
    precise = PreciseBNCallback(num_samples="all", frozen=frozen)
    with_callback = train_frozen(tmp_path / "with", [precise])
    without = train_frozen(tmp_path / "without", [])
    assert precise.computations == 2  # the evaluations after epochs 1 and 2; the end of training shares the last
    losses = logged_losses(with_callback)
    assert len(losses) == 8
    same = losses == logged_losses(without)
    model, reference = with_callback.model, without.model
    assert_frozen_run(frozen, same, model, reference, [frozen_data()], "net.", forward=lambda m, b: m.net(b))


def test_the_evaluation_on_start_leaves_frozen_layers_too(tmp_path: Path) -> None:
    # before the Trainer's first model.train(), on a model in eval mode (as from_pretrained gives it) whose train()
    # override keeps a layer in eval mode: what training freezes is unknown, so nothing is computed then
    precise = PreciseBNCallback(num_samples="all")
    with pytest.warns(PreciseBNWarning, match="no training step has been seen yet"):
        with_callback = train_frozen(tmp_path / "with", [precise], eval_mode=True, eval_on_start=True)
    without = train_frozen(tmp_path / "without", [], eval_mode=True, eval_on_start=True)
    assert precise.computations == 2  # after epochs 1 and 2 (not on start)
    losses = logged_losses(with_callback)
    assert len(losses) == 8 and losses == logged_losses(without)
    model, reference = with_callback.model, without.model
    assert torch.equal(model.net.body[1].running_mean, reference.net.body[1].running_mean)
    assert torch.equal(model.net.body[1].running_var, reference.net.body[1].running_var)


def test_a_run_after_one_that_raised_computes_at_its_own_steps(tmp_path: Path, float64_truth: Any) -> None:
    """Probe 42: a run that raised (in its first evaluation, after the computation at step 4) never reached
    on_train_end, and the next trainer.train() took its own step 4 as computed: checkpoint-4 and that evaluation
    held the moving averages (~0.6 σ off the truth)."""
    failures = [1]

    def metrics(prediction: Any) -> dict[str, float]:
        if failures:
            failures.pop()
            raise RuntimeError("a bug in compute_metrics")
        return {"seen": 1.0}

    data = make_dataset()
    precise, snapshots = PreciseBNCallback(num_samples="all"), Snapshots()
    args = arguments(tmp_path, eval_strategy="steps", eval_steps=4, save_strategy="steps", save_steps=4)
    trainer = SequentialTrainer(
        ResNetForImageClassification(CONFIG),
        args,
        train_dataset=data,
        eval_dataset=data[:32],
        data_collator=collate,
        callbacks=[precise, snapshots],
        compute_metrics=metrics,
    )
    with pytest.raises(RuntimeError, match="a bug in compute_metrics"):
        trainer.train()
    assert precise.last_step == 4 and precise.computations == 1
    snapshots.evaluated.clear()
    trainer.train()  # the bug fixed: from step 0 again, on the weights the failed run left
    assert precise.computations == 3 and [step for step, _ in snapshots.evaluated] == [4, 8]
    batches = [collate(data[i : i + BATCH]) for i in range(0, N, BATCH)]
    for _, state in snapshots.evaluated:
        assert_precise(float64_truth, state, batches)
    for step in (4, 8):
        assert_precise(float64_truth, load_file(tmp_path / f"checkpoint-{step}" / "model.safetensors"), batches)


class SaveAtStep3(TrainerCallback):
    """A callback that asks for a checkpoint of its own (at step 3: no strategy saves there)."""

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == 3:
            control.should_save = True


@pytest.mark.parametrize("precise_first", [True, False])
def test_a_checkpoint_asked_for_after_the_callback_looked_is_named(
    tmp_path: Path, float64_truth: Any, precise_first: bool
) -> None:
    """Probe 46: a callback listed after PreciseBNCallback that set control.should_save in on_step_end got a
    checkpoint with the moving averages (0.45 σ / 50 % and 1.2 σ / 190 % off the float64 truth of its weights in
    the probe), silently. Now a PreciseBNWarning says so and how to order the callbacks; listed after it, the
    checkpoint is precise."""
    precise, forcing = PreciseBNCallback(num_samples="all"), SaveAtStep3()
    callbacks = [precise, forcing] if precise_first else [forcing, precise]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, _, batches = train_precise(tmp_path, callbacks, num_train_epochs=1)
    named = [w for w in caught if issubclass(w.category, PreciseBNWarning) and "checkpoint at step 3" in str(w.message)]
    saved = load_file(tmp_path / "checkpoint-3" / "model.safetensors")
    if precise_first:
        assert len(named) == 1 and "after every callback" in str(named[0].message)
        with pytest.raises(AssertionError):
            assert_precise(float64_truth, saved, batches)
    else:
        assert not named and precise.computations == 2  # step 3 and the end of training
        assert_precise(float64_truth, saved, batches)


def test_checkpoints_of_save_strategy_best_get_the_statistics_without_on_evaluate(
    tmp_path: Path, float64_truth: Any
) -> None:
    """Review of stop 44: with save_strategy="best" the Trainer decides to save after an evaluation (a new best
    metric), after this callback's turn; with on_evaluate=False (on_save=True) nothing was computed before it, so
    every checkpoint held the moving averages (1.2-2.1 σ off the float64 truth of its weights) and the warning blamed
    the callbacks' order. It computes before every evaluation such a checkpoint may follow now, and says nothing."""
    precise = PreciseBNCallback(num_samples="all", on_evaluate=False)
    options = {"eval_strategy": "steps", "eval_steps": 2, "save_strategy": "best", "metric_for_best_model": "loss"}
    with warnings.catch_warnings():
        warnings.simplefilter("error", PreciseBNWarning)
        _, _, batches = train_precise(tmp_path, [precise], num_train_epochs=1, greater_is_better=False, **options)
    saved = sorted(tmp_path.glob("checkpoint-*"))
    assert saved
    for checkpoint in saved:
        assert_precise(float64_truth, load_file(checkpoint / "model.safetensors"), batches)


class InterruptAtStep3(TrainerCallback):
    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == 3:
            raise KeyboardInterrupt


def test_an_evaluation_by_hand_after_an_interrupted_train_is_not_blamed_on_the_callbacks_order(
    tmp_path: Path,
) -> None:
    """Review of stop 44: Ctrl-C in train() (no on_train_end: the callback stays bound), then trainer.evaluate() by
    hand — the warning said the evaluation was requested by a callback listed after PreciseBNCallback and to reorder
    the callbacks, with no such callback. It names the evaluation by hand too."""
    precise = PreciseBNCallback(num_samples="all")
    with pytest.raises(KeyboardInterrupt):
        train_precise(tmp_path, [precise, InterruptAtStep3()], eval_strategy="epoch")
    trainer = SequentialTrainer(
        ResNetForImageClassification(CONFIG),
        arguments(tmp_path),
        eval_dataset=make_dataset()[:32],
        data_collator=collate,
        callbacks=[precise],
    )
    trainer.state.global_step = 3
    with pytest.warns(PreciseBNWarning, match="evaluation at step 3") as caught:
        trainer.evaluate()
    assert "called by hand after train() was interrupted" in str(caught[0].message)
