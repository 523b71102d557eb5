"""The Ignite handler, driven by real ``ignite.engine.Engine`` objects on CPU.

Statistics are checked on the weights the engines had at that moment (a snapshot taken
when the evaluator starts, or a checkpoint file written by Ignite's ``Checkpoint``)
against the float64 truth that ``conftest.compute_truth`` computes over the training
data.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from ignite.engine import Engine, Events
from ignite.handlers import Checkpoint, DiskSaver

from conftest import NormEval, assert_adapted, assert_frozen_run, set_statistics
from precisebn.errors import InvalidArgumentError, MissingDependencyError, PreciseBNWarning
from precisebn.integrations.ignite import PreciseBN

BN = "1"


def make_data(n: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g) * torch.tensor([1.0, 2.0, 0.5, 3.0]) + torch.tensor([3.0, -1.0, 0.0, 2.0])
    y = x @ torch.tensor([0.5, -1.0, 2.0, 0.3]) + 0.1 * torch.randn(n, generator=g)
    return x, y


def make_model(dropout: float = 0.0, norm: bool = True) -> torch.nn.Module:
    norm_layer = torch.nn.BatchNorm1d(8) if norm else torch.nn.Identity()
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8), norm_layer, torch.nn.ReLU(), torch.nn.Dropout(dropout), torch.nn.Linear(8, 1)
    )


def loader(x: torch.Tensor, y: torch.Tensor, shuffle: bool = False, batch_size: int = 16) -> Any:
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch_size, shuffle=shuffle)


def engines(model: torch.nn.Module) -> tuple[Engine, Engine, list[torch.Tensor], list[Any]]:
    """A trainer, an evaluator that snapshots the model when it starts, the losses and the snapshots."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    losses: list[torch.Tensor] = []
    seen: list[tuple[int, dict[str, torch.Tensor]]] = []

    def train_step(engine: Engine, batch: Any) -> float:
        model.train()
        x, y = batch
        loss = torch.nn.functional.mse_loss(model(x).squeeze(1), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.detach().clone())
        return loss.item()

    def eval_step(engine: Engine, batch: Any) -> None:
        model.eval()
        with torch.no_grad():
            model(batch[0])

    trainer, evaluator = Engine(train_step), Engine(eval_step)
    evaluator.add_event_handler(
        Events.EPOCH_STARTED,  # after Events.STARTED
        lambda e: seen.append((trainer.state.iteration, {k: v.clone() for k, v in model.state_dict().items()})),
    )
    return trainer, evaluator, losses, seen


def sgd_trainer(model: torch.nn.Module, losses: list[float] | None = None) -> Engine:
    """An Engine training ``model`` in training mode by SGD (lr 0.05) on MSE of ``(x, y)`` batches, each loss appended
    to ``losses`` if given."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

    def step(engine: Engine, batch: Any) -> None:
        model.train()
        loss = torch.nn.functional.mse_loss(model(batch[0]), batch[1])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if losses is not None:
            losses.append(loss.item())

    return Engine(step)


def assert_precise(float64_truth: Any, state: dict[str, torch.Tensor], x: torch.Tensor) -> None:
    net = make_model()
    net.load_state_dict(state)
    truth = float64_truth(net, [x])[BN]
    mean_error = float(((state[f"{BN}.running_mean"].double() - truth.mean).abs() / truth.var.sqrt()).max())
    var_error = float(((state[f"{BN}.running_var"].double() - truth.var).abs() / truth.var).max())
    assert mean_error < 1e-5 and var_error < 1e-5, (mean_error, var_error)


def test_before_evaluation_and_checkpoints_once_per_iteration(tmp_path: Path, float64_truth: Any) -> None:
    x, y = make_data()
    model = make_model()
    trainer, evaluator, _, seen = engines(model)
    precise = PreciseBN(model, num_samples="all")  # the trainer's own data
    precise.attach(trainer, Events.ITERATION_COMPLETED(every=3))  # before the checkpoint handler
    saver = Checkpoint({"model": model, "precise": precise}, DiskSaver(str(tmp_path)), n_saved=None)
    trainer.add_event_handler(Events.ITERATION_COMPLETED(every=3), saver)
    precise.attach(evaluator, Events.STARTED, step_engine=trainer)  # before the evaluator's snapshot
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda e: evaluator.run(loader(x[:32], y[:32])))
    trainer.run(loader(x, y), max_epochs=3)  # 4 iterations per epoch

    # Checkpoints at 3, 6, 9, 12 and evaluations at 4, 8, 12: six distinct iterations.
    assert precise.computations == 6 and precise.last_step == 12
    assert [it for it, _ in seen] == [4, 8, 12]
    for _, state in seen:
        assert_precise(float64_truth, state, x)
    files = sorted(tmp_path.glob("*.pt"))
    assert len(files) == 4
    for path in files:
        saved = torch.load(path, weights_only=False)
        assert_precise(float64_truth, saved["model"], x)
        assert saved["precise"]["last_step"] == int(path.stem.rsplit("_", 1)[1])


def test_training_is_untouched() -> None:
    x, y = make_data()

    def train(with_handler: bool) -> tuple[torch.nn.Module, list[torch.Tensor], PreciseBN | None]:
        torch.manual_seed(0)
        model = make_model(dropout=0.5)
        trainer, evaluator, losses, _ = engines(model)
        precise = None
        if with_handler:
            precise = PreciseBN(model, num_samples=40, mode="train")  # dropout on, a partial shuffled pass
            precise.attach(trainer, Events.ITERATION_COMPLETED(every=3) | Events.EPOCH_COMPLETED)
        trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda e: evaluator.run(loader(x[:16], y[:16])))
        trainer.run(loader(x, y, shuffle=True, batch_size=8), max_epochs=2)  # the global generator shuffles
        return model, losses, precise

    model, losses, precise = train(True)
    reference, expected, _ = train(False)
    assert precise is not None and precise.computations == 7  # 3, 6, 8, 9, 12, 15 and 16
    assert len(losses) == 16 and torch.equal(torch.stack(losses), torch.stack(expected))
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)


def test_a_model_without_normalization_layers_trains_with_one_warning() -> None:
    x, y = make_data()

    def train(with_handler: bool) -> tuple[torch.nn.Module, list[torch.Tensor], PreciseBN | None]:
        torch.manual_seed(0)
        model = make_model(norm=False)
        trainer, _, losses, _ = engines(model)
        precise = PreciseBN(model, num_samples="all") if with_handler else None
        if precise is not None:
            precise.attach(trainer, Events.ITERATION_COMPLETED(every=2))
        trainer.run(loader(x, y, shuffle=True), max_epochs=2)
        return model, losses, precise

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, losses, precise = train(True)
    messages = [str(w.message) for w in caught if issubclass(w.category, PreciseBNWarning)]
    assert len(messages) == 1 and "no normalization layer" in messages[0], messages
    assert precise is not None and precise.computations == 0
    reference, expected, _ = train(False)
    assert torch.equal(torch.stack(losses), torch.stack(expected))
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)


def test_a_failing_data_loader_leaves_the_model_unchanged(snapshot: Any, unchanged: Any) -> None:
    x, y = make_data()

    def failing() -> Any:
        yield x[:16]
        raise OSError("disk on fire")

    model = make_model()
    trainer, _, _, _ = engines(model)
    before: dict[str, Any] = {}
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda e: before.update(snapshot(model)))
    PreciseBN(model, failing, num_samples="all").attach(trainer, Events.EPOCH_COMPLETED)
    with pytest.raises(OSError, match="disk on fire"):
        trainer.run(loader(x, y), max_epochs=2)
    unchanged(model, before)


def test_options_and_data_are_checked() -> None:
    model = make_model()
    with pytest.raises(InvalidArgumentError, match="one-shot iterator"):
        PreciseBN(model, iter([torch.zeros(2, 4)]))
    with pytest.raises(InvalidArgumentError, match="mode"):
        PreciseBN(model, mode="eval")
    with pytest.raises(InvalidArgumentError, match=r"torch\.nn\.Module"):
        PreciseBN("model")  # type: ignore[arg-type]
    x, y = make_data(16)
    trainer, _, _, _ = engines(model)
    PreciseBN(model).attach(trainer, Events.EPOCH_COMPLETED)
    with pytest.raises(InvalidArgumentError, match=r"one-shot iterator.*pass data="):
        trainer.run(iter(loader(x, y)), max_epochs=1, epoch_length=1)  # the trainer's data cannot be re-read


def test_missing_ignite_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in sys.modules if n == "ignite" or n.startswith("ignite.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delitem(sys.modules, "precisebn.integrations.ignite", raising=False)
    monkeypatch.setitem(sys.modules, "ignite", None)
    with pytest.raises(MissingDependencyError, match=r"pip install 'precisebn\[ignite\]'"):
        importlib.import_module("precisebn.integrations.ignite")


@pytest.mark.parametrize("adapt", ["both", "mean"])
def test_prior_and_adapt_reach_each_computation(adapt: str) -> None:
    """prior=N pools the statistics the layer holds when the handler runs, as N samples, with the
    data's (a first BatchNorm with momentum 0: its statistics are the prior set here, and its inputs
    are the data whatever the weights); adapt="mean" leaves the variance bitwise as it was."""
    x, y = make_data()
    model = torch.nn.Sequential(torch.nn.BatchNorm1d(4, momentum=0.0), torch.nn.Linear(4, 1))
    bn = model[0]
    before = set_statistics(bn, [-2.0, 4.0, 1.0, 0.0], [0.5, 9.0, 2.0, 0.1])
    trainer, _, _, _ = engines(model)
    precise = PreciseBN(model, num_samples="all", prior=24, adapt=adapt)
    precise.attach(trainer, Events.COMPLETED)
    trainer.run(loader(x, y), max_epochs=1)
    assert precise.computations == 1
    assert_adapted(bn, before, 24, x.double().t(), adapt)  # one value per sample and channel


@pytest.mark.parametrize("frozen", ["skip", "include"])
def test_layers_frozen_for_training_are_left_as_they_are(frozen: str) -> None:
    x, y = make_data()

    def train(with_handler: bool) -> tuple[torch.nn.Module, list[torch.Tensor], PreciseBN | None]:
        torch.manual_seed(0)
        model = NormEval()
        trainer, evaluator, losses, _ = engines(model)
        precise = None
        if with_handler:
            precise = PreciseBN(model, num_samples="all", frozen=frozen)
            precise.attach(evaluator, Events.STARTED, step_engine=trainer)  # the model is in eval mode by then
        trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda e: evaluator.run(loader(x[:16], y[:16])))
        trainer.run(loader(x, y), max_epochs=2)
        return model, losses, precise

    model, losses, precise = train(True)
    reference, expected, _ = train(False)
    assert precise is not None and precise.computations == 2
    assert_frozen_run(frozen, torch.equal(torch.stack(losses), torch.stack(expected)), model, reference, [x])


def test_an_ema_copy_leaves_the_layers_frozen_in_the_model_trained() -> None:
    # Ignite's EMAHandler keeps ema_model in eval mode, and its buffers share storage with the model's
    # (handle_buffers="copy"): recalibrating the copy's frozen layer would change the model's training
    from ignite.handlers import EMAHandler

    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(16, 4, generator=g) * 3 + 1, torch.randn(16, 1, generator=g)) for _ in range(4)]

    def run(with_handler: bool) -> tuple[torch.nn.Module, list[float], PreciseBN | None]:
        torch.manual_seed(0)
        model = NormEval()
        losses: list[float] = []
        trainer = sgd_trainer(model, losses)
        ema = EMAHandler(model, momentum=0.5)
        ema.attach(trainer, name="ema_momentum")
        precise = None
        if with_handler:
            precise = PreciseBN(ema.ema_model, [x for x, _ in data], num_samples="all", trained_model=model)
            precise.attach(trainer, Events.EPOCH_COMPLETED)
        trainer.run(data, max_epochs=3)
        return model, losses, precise

    model, losses, precise = run(True)
    reference, expected, _ = run(False)
    assert precise is not None and precise.computations == 3 and precise.last_report is not None
    assert precise.last_report.updated == ["head.1"]
    assert losses == expected
    for name in ("running_mean", "running_var"):
        assert torch.equal(getattr(model.body[1], name), getattr(reference.body[1], name))
    with pytest.raises(InvalidArgumentError, match="trained_model must be"):
        PreciseBN(model, trained_model="model")  # type: ignore[arg-type]


def test_an_evaluation_at_the_start_leaves_the_frozen_layers_of_an_ema_copy() -> None:
    """An evaluation at the trainer's STARTED, before any step, recalibrated the EMA copy's frozen layer (a probe:
    mean 5 → -0.13, var 9 → 0.27): trained_model was named but not yet observed. The model trained is in training
    mode by then, and its frozen layers are read off it."""
    from ignite.handlers import EMAHandler

    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(16, 4, generator=g) * 3 + 1, torch.randn(16, 1, generator=g)) for _ in range(4)]
    torch.manual_seed(0)
    model = NormEval()  # body.1 frozen (statistics 0.5 and 4.0), in training mode before the run
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

    def step(engine: Engine, batch: Any) -> None:
        loss = torch.nn.functional.mse_loss(model(batch[0]), batch[1])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    trainer = Engine(step)
    ema = EMAHandler(model, momentum=0.5)
    ema.attach(trainer, name="ema_momentum")
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    evaluator = Engine(
        lambda e, b: seen.append(
            (ema.ema_model.body[1].running_mean.clone(), ema.ema_model.body[1].running_var.clone())
        )
    )
    precise = PreciseBN(ema.ema_model, [x for x, _ in data], num_samples="all", trained_model=model)
    precise.attach(evaluator, Events.STARTED, step_engine=trainer)
    trainer.add_event_handler(Events.STARTED, lambda e: evaluator.run(data[:1]))
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda e: evaluator.run(data[:1]))
    trainer.run(data, max_epochs=2)
    assert precise.computations == 3 and precise.last_report is not None
    assert precise.last_report.updated == ["head.1"]
    assert len(seen) == 3
    for mean, var in seen:
        assert torch.equal(mean, torch.full((6,), 0.5)) and torch.equal(var, torch.full((6,), 4.0))


def test_an_evaluation_before_the_first_iteration_leaves_frozen_layers() -> None:
    # the evaluator runs at the trainer's STARTED, before any iteration noted what training freezes
    x, y = make_data()

    def train(with_handler: bool) -> tuple[torch.nn.Module, list[torch.Tensor]]:
        torch.manual_seed(0)
        model = NormEval().eval()  # (from a checkpoint, evaluated first): what training freezes is unknown then
        trainer, evaluator, losses, _ = engines(model)
        if with_handler:
            PreciseBN(model, num_samples="all").attach(evaluator, Events.STARTED, step_engine=trainer)
        trainer.add_event_handler(Events.STARTED, lambda e: evaluator.run(loader(x[:16], y[:16])))
        trainer.run(loader(x, y), max_epochs=1)
        return model, losses

    with pytest.warns(PreciseBNWarning, match="no training step has been seen yet"):
        model, losses = train(True)
    reference, expected = train(False)
    assert torch.equal(torch.stack(losses), torch.stack(expected))
    assert torch.equal(model.body[1].running_mean, reference.body[1].running_mean)


def test_a_second_run_of_the_trainer_recomputes_at_its_own_steps(float64_truth: Any) -> None:
    """The last step carried over: a second trainer.run() restarts at iteration 0, and its computations at the
    first run's steps were skipped (statistics ~1.2 off the truth)."""
    x, y = make_data()
    model = make_model()
    trainer, *_ = engines(model)
    precise = PreciseBN(model, num_samples="all")
    precise.attach(trainer, Events.COMPLETED)
    trainer.run(loader(x, y), max_epochs=1)
    assert precise.computations == 1 and precise.last_step == 4
    trainer.run(loader(x, y), max_epochs=1)  # a new run: iterations 1..4 again
    assert precise.computations == 2
    assert_precise(float64_truth, model.state_dict(), x)


def test_a_resumed_run_keeps_its_last_step() -> None:
    from precisebn.integrations._trigger import Trigger

    model = make_model()
    trigger = Trigger("test", num_samples="all")
    trigger.bind(model, [torch.randn(8, 4)])
    assert trigger.compute(7) is not None and trigger.last_step == 7
    trigger.unbind()
    assert trigger.last_step == 7  # readable after the run
    trigger.bind(model, [torch.randn(8, 4)])  # a new run: its step 7 is not the last run's
    assert trigger.last_step is None and trigger.computations == 1
    trigger.unbind()
    trigger.load_state_dict({"last_step": 7, "stale": False, "computations": 1})  # a checkpoint's, for a resume
    trigger.bind(model, [torch.randn(8, 4)])
    assert trigger.last_step == 7 and trigger.compute(7) is None
    # a run that raised is never unbound: the next run starts afresh all the same (probe 42)
    trigger.bind(model, [torch.randn(8, 4)])
    assert trigger.last_step is None
    # bound (an Ignite handler is, between its runs): a state loaded goes on in the next run...
    trigger.load_state_dict({"last_step": 7, "stale": False, "computations": 1})
    trigger.new_run()
    assert trigger.last_step == 7
    trigger.new_run()  # ...only in that one
    assert trigger.last_step is None
    trigger.load_state_dict({"last_step": 7, "stale": False, "computations": 1})
    trigger.new_run(resumed=False)  # and not in a run from step 0 (a finished run's state, the engine restarted)
    assert trigger.last_step is None
    # Lightning restores a checkpoint after binding the run: for that run only
    trigger.bind(model, [torch.randn(8, 4)])
    trigger.load_state_dict({"last_step": 7, "stale": False, "computations": 1}, for_next_run=False)
    assert trigger.last_step == 7
    trigger.bind(model, [torch.randn(8, 4)])
    assert trigger.last_step is None
    trigger.unbind()  # (Lightning's validate/test restore a state with no fit bound: not for the next fit either)
    trigger.load_state_dict({"last_step": 7, "stale": False, "computations": 1}, for_next_run=False)
    trigger.bind(model, [torch.randn(8, 4)])
    assert trigger.last_step is None


def test_a_one_shot_iterator_without_data_is_refused_when_the_run_starts() -> None:
    """Found by a probe: the refusal of an engine on a one-shot iterator came at the first computation, after a
    whole epoch (50 iterations) had trained; it now comes when the run starts."""
    model = make_model()
    x, y = make_data(16)
    trainer, _, losses, _ = engines(model)
    PreciseBN(model).attach(trainer, Events.EPOCH_COMPLETED)

    def stream() -> Any:
        while True:
            yield x, y

    with pytest.raises(InvalidArgumentError, match=r"one-shot iterator \(generator\).*pass data="):
        trainer.run(stream(), max_epochs=2, epoch_length=50)
    assert trainer.state.iteration == 0 and losses == []


def test_a_run_without_data_is_refused_in_words_that_fit_it() -> None:
    """Found by a probe: an engine run without data (``run(None, epoch_length=...)``), refused when it starts,
    was said to be "not running"."""
    model = make_model()
    trainer = Engine(lambda engine, batch: None)
    PreciseBN(model).attach(trainer, Events.EPOCH_COMPLETED)
    with pytest.raises(InvalidArgumentError, match=r"no data to measure on \(it runs without a dataloader"):
        trainer.run(None, max_epochs=1, epoch_length=4)
    assert trainer.state.iteration == 0


def test_a_run_reloaded_after_one_that_raised_computes_at_its_own_steps(tmp_path: Path, float64_truth: Any) -> None:
    """Probe 42: the evaluation at iteration 8 raised after the computation for it; the user reloaded the checkpoint
    of iteration 4 (the handler's state not in it) into new engines with the same handler. The reloaded run started
    at iteration 4, not 0, so it kept the failed run's last step, and its evaluation at iteration 8 ran with the
    moving averages (~0.1 σ off the truth)."""
    x, y = make_data()
    model = make_model()
    precise = PreciseBN(model, num_samples="all")
    failures = [1]

    def build() -> tuple[Engine, list[Any]]:
        trainer, evaluator, _, seen = engines(model)
        precise.attach(evaluator, Events.STARTED, step_engine=trainer)

        def evaluate(engine: Engine) -> None:
            evaluator.run(loader(x[:32], y[:32]))
            if engine.state.iteration == 8 and failures:
                failures.pop()
                raise RuntimeError("a bug in the evaluation")

        trainer.add_event_handler(Events.EPOCH_COMPLETED, evaluate)
        saver = Checkpoint({"model": model, "trainer": trainer}, DiskSaver(str(tmp_path), require_empty=False))
        trainer.add_event_handler(Events.EPOCH_COMPLETED, saver)
        return trainer, seen

    trainer, _ = build()
    with pytest.raises(RuntimeError, match="a bug in the evaluation"):
        trainer.run(loader(x, y), max_epochs=3)  # 4 iterations per epoch
    assert precise.last_step == 8
    trainer, seen = build()
    Checkpoint.load_objects({"model": model, "trainer": trainer}, torch.load(tmp_path / "checkpoint_4.pt"))
    trainer.run(loader(x, y), max_epochs=3)
    assert [it for it, _ in seen] == [8, 12]
    for _, state in seen:
        assert_precise(float64_truth, state, x)


def test_a_finished_runs_state_loaded_does_not_reach_a_run_from_iteration_0(float64_truth: Any) -> None:
    """The review of probe 42: the handler's state loaded with a finished run's last checkpoint, the trainer run again
    (Ignite restarts a finished engine from iteration 0), kept the loaded last step in that new run: its evaluation at
    that iteration ran with the moving averages (0.47 σ off)."""
    x, y = make_data()
    model = make_model()
    precise = PreciseBN(model, num_samples="all")
    trainer, evaluator, _, seen = engines(model)
    precise.attach(evaluator, Events.STARTED, step_engine=trainer)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda e: evaluator.run(loader(x[:32], y[:32])))
    trainer.run(loader(x, y), max_epochs=1)
    state = {"trainer": trainer.state_dict(), "precise": precise.state_dict()}  # (what Checkpoint would save)
    assert state["precise"]["last_step"] == 4
    trainer, evaluator, _, seen = engines(model)
    precise.attach(evaluator, Events.STARTED, step_engine=trainer)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda e: evaluator.run(loader(x[:32], y[:32])))
    Checkpoint.load_objects({"trainer": trainer, "precise": precise}, state)
    trainer.run(loader(x, y), max_epochs=1)  # done: from iteration 0 again, on the trained weights
    assert precise.computations == 2 and [it for it, _ in seen] == [4]
    assert_precise(float64_truth, seen[0][1], x)


class Backbone(torch.nn.Module):
    """Two BatchNorm1d; ``freeze_backbone`` keeps the first in eval mode while the model trains (a train()
    override, as fine-tuning code does)."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.bn1 = torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8)
        self.l2, self.bn2 = torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8)
        self.out = torch.nn.Linear(8, 1)
        self.freeze_backbone = False

    def train(self, mode: bool = True) -> Backbone:
        super().train(mode)
        if mode and self.freeze_backbone:
            self.bn1.eval()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.bn2(self.l2(torch.relu(self.bn1(self.l1(x)))))))


def test_a_run_from_iteration_0_reads_the_frozen_layers_afresh() -> None:
    """Probe 42: the handler, bound once, kept the first run's notes of which layers training keeps frozen. A
    second run (fine-tuning on new data) that froze bn1 had it rewritten by a computation before its first step
    (1.2 off), which a new handler — and the README — leave alone (the frozen layers are unknown before a training
    step: nothing computed, with a warning); its training then differed from one without precisebn."""
    x, y = make_data()
    model = Backbone()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

    def step(engine: Engine, batch: Any) -> None:
        model.train()
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(batch[0]).squeeze(1), batch[1]).backward()
        optimizer.step()

    trainer = Engine(step)
    precise = PreciseBN(model, num_samples="all")
    precise.attach(trainer, Events.STARTED)
    precise.attach(trainer, Events.EPOCH_COMPLETED)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda e: model.eval())  # (an evaluation leaves it so)
    trainer.run(loader(x, y), max_epochs=1)
    assert precise.computations == 2  # (at STARTED, the model in training mode then, and at the epoch's end)
    model.freeze_backbone = True
    kept = model.bn1.running_mean.clone(), model.bn1.running_var.clone()
    trainer = Engine(step)  # (the same handler: it is bound to the model)
    precise.attach(trainer, Events.STARTED)
    seen = []
    trainer.add_event_handler(Events.STARTED, lambda e: seen.append(model.bn1.running_mean.clone()))
    with pytest.warns(PreciseBNWarning, match="no training step has been seen yet"):
        trainer.run(loader(x * 2 + 1, y), max_epochs=1)
    assert torch.equal(seen[0], kept[0])
    assert torch.equal(model.bn1.running_mean, kept[0]) and torch.equal(model.bn1.running_var, kept[1])


@pytest.mark.parametrize("handle_buffers", ["copy", "update"])
def test_statistics_written_into_buffers_the_model_trained_shares_are_told(
    handle_buffers: str, float64_truth: Any
) -> None:
    """Probe 46: the copy of Ignite's EMAHandler(handle_buffers="copy"), its default, shares its buffers with the model
    trained, so the statistics computed for the averaged weights were written into the model trained too (4.7e-2 to
    7.4e-2 off its own truth), unwarned. Told once; with buffers of its own ("update"), nothing is said."""
    from ignite.handlers import EMAHandler

    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(16, 4, generator=g) * 3 + 1, torch.randn(16, 1, generator=g)) for _ in range(4)]
    torch.manual_seed(0)
    model = make_model()
    trainer = sgd_trainer(model)
    ema = EMAHandler(model, momentum=0.5, handle_buffers=handle_buffers)
    ema.attach(trainer, name="ema_momentum")
    precise = PreciseBN(ema.ema_model, [x for x, _ in data], num_samples="all", trained_model=model)
    precise.attach(trainer, Events.EPOCH_COMPLETED)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.run(data, max_epochs=3)
    told = [w for w in caught if issubclass(w.category, PreciseBNWarning) and "share memory" in str(w.message)]
    assert precise.computations == 3
    truth = float64_truth(ema.ema_model, [x for x, _ in data])[BN]  # the copy's statistics: exact either way
    written = ema.ema_model[1]
    assert float(((written.running_mean.double() - truth.mean).abs() / truth.var.sqrt()).max()) < 1e-5
    assert float(((written.running_var.double() - truth.var).abs() / truth.var).max()) < 1e-5
    shared = written.running_mean.untyped_storage().data_ptr() == model[1].running_mean.untyped_storage().data_ptr()
    assert shared == (handle_buffers == "copy")
    if handle_buffers == "copy":
        assert len(told) == 1 and "'1'" in str(told[0].message) and "handle_buffers='update'" in str(told[0].message)
        assert torch.equal(model[1].running_var, written.running_var)  # (what it says: the model's are the copy's)
    else:
        assert told == []


@pytest.mark.parametrize("given", ["the model itself", "a wrapper of it", "a model holding it"])
def test_a_model_that_is_part_of_trained_model_is_not_told_of_shared_buffers(given: str) -> None:
    """Review of stop 44: the new warning compared storages only, so a model whose layers are trained_model's own
    (trained_model=model, a DataParallel of it, the model inside a larger trained_model) was told that its
    statistics were "written into the model being trained too" and to change EMAHandler's handle_buffers — there
    is no copy. Only a layer that is not trained_model's, sharing its buffers, is told (the test above)."""
    g = torch.Generator().manual_seed(0)
    data = [torch.randn(16, 4, generator=g) * 3 + 1 for _ in range(2)]
    model = make_model()
    recalibrated: torch.nn.Module = torch.nn.DataParallel(model) if given == "a wrapper of it" else model
    trained = torch.nn.Sequential(model) if given == "a model holding it" else model
    engine = Engine(lambda engine, batch: None)
    PreciseBN(recalibrated, data, num_samples="all", trained_model=trained).attach(engine, Events.EPOCH_COMPLETED)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PreciseBNWarning)
        engine.run(data, max_epochs=1)
