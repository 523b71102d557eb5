"""The mmengine hook, driven by a real ``mmengine.runner.Runner`` on CPU.

Every statistics check loads the weights the Runner had at that moment (a snapshot
taken when validation starts, or a checkpoint file) into a fresh model and compares the
running statistics with the float64 truth that ``conftest.compute_truth`` computes over
the training data.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import uuid
import warnings
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from mmengine.evaluator import BaseMetric, Evaluator
from mmengine.hooks import Hook
from mmengine.model import BaseModel
from mmengine.registry import HOOKS, Registry
from mmengine.runner import Runner

from conftest import NormEval, assert_adapted, assert_frozen_run, set_statistics
from precisebn.errors import InvalidArgumentError, MissingDependencyError, PreciseBNWarning
from precisebn.integrations.mmengine import ExactPreciseBNHook, register_mmpretrain_name

BN = "net.1"


def make_data(n: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g) * torch.tensor([1.0, 2.0, 0.5, 3.0]) + torch.tensor([3.0, -1.0, 0.0, 2.0])
    y = x @ torch.tensor([0.5, -1.0, 2.0, 0.3]) + 0.1 * torch.randn(n, generator=g)
    return x, y


def loader(x: torch.Tensor, y: torch.Tensor, shuffle: bool = False, batch_size: int = 16) -> Any:
    records = [{"inputs": x[i], "data_samples": y[i]} for i in range(len(x))]
    return torch.utils.data.DataLoader(records, batch_size=batch_size, shuffle=shuffle)


class TinyNet(BaseModel):
    """Linear -> BatchNorm1d -> ReLU -> Dropout -> Linear, mmengine's forward convention."""

    def __init__(self, dropout: float = 0.0, norm: bool = True) -> None:
        super().__init__()
        layers = [torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8) if norm else torch.nn.Identity()]
        self.net = torch.nn.Sequential(*layers, torch.nn.ReLU(), torch.nn.Dropout(dropout), torch.nn.Linear(8, 1))
        self.losses: list[torch.Tensor] = []

    def forward(self, inputs: torch.Tensor, data_samples: Any = None, mode: str = "tensor") -> Any:
        out = self.net(inputs).squeeze(1)
        if mode == "loss":
            loss = torch.nn.functional.mse_loss(out, data_samples)
            self.losses.append(loss.detach().clone())
            return {"loss": loss}
        if mode == "predict":
            return [(out, data_samples)]
        return out


class MSE(BaseMetric):
    def process(self, data_batch: Any, data_samples: Any) -> None:
        for out, target in data_samples:
            self.results.append(float(torch.nn.functional.mse_loss(out, target)))

    def compute_metrics(self, results: list[float]) -> dict[str, float]:
        return {"mse": sum(results) / len(results)}


class AtValidation(Hook):
    """The iteration and the model's state when each validation epoch starts."""

    priority = "LOW"

    def __init__(self) -> None:
        self.seen: list[tuple[int, dict[str, torch.Tensor]]] = []

    def before_val_epoch(self, runner: Any) -> None:
        self.seen.append((runner.iter, {k: v.clone() for k, v in runner.model.state_dict().items()}))


class CopiedCheckpoints(Hook):
    """Replaces the checkpoint's tensors with copies before the precise-BN hook sees it,
    as ``weights_to_cpu`` does for a model on a GPU."""

    priority = "HIGHEST"

    def before_save_checkpoint(self, runner: Any, checkpoint: dict[str, Any]) -> None:
        checkpoint["state_dict"] = {k: v.clone() for k, v in checkpoint["state_dict"].items()}


def run(
    tmp_path: Path,
    model: TinyNet,
    train: Any,
    *,
    hooks: list[Any],
    train_cfg: dict[str, Any],
    val: Any = None,
    checkpoint: dict[str, Any] | None = None,
    metric: BaseMetric | None = None,
    **options: Any,
) -> Runner:
    runner = Runner(
        model=model,
        work_dir=str(tmp_path),
        experiment_name=uuid.uuid4().hex,
        train_dataloader=train,
        train_cfg=train_cfg,
        optim_wrapper={"optimizer": {"type": "SGD", "lr": 0.02, "momentum": 0.9}},
        val_dataloader=val,
        val_cfg={} if val is not None else None,
        val_evaluator=Evaluator(metric or MSE()) if val is not None else None,
        default_hooks={"checkpoint": checkpoint, "logger": {"type": "LoggerHook", "interval": 1}},
        custom_hooks=hooks,
        randomness={"seed": 0},
        log_level="ERROR",
        **options,
    )
    runner.train()
    return runner


def logged(runner: Runner, prefix: str = "precisebn") -> int:
    """How many computations the hook logged in ``runner.message_hub`` (``train/{prefix}/samples``; the EMA
    weights': ``prefix="precisebn_ema"``)."""
    history = runner.message_hub.log_scalars.get(f"train/{prefix}/samples")
    return 0 if history is None else len(history.data[0])


def assert_precise(float64_truth: Any, state: dict[str, torch.Tensor], x: torch.Tensor) -> None:
    net = TinyNet()
    net.load_state_dict(state)
    truth = float64_truth(net, [x])[BN]
    mean_error = float(((state[f"{BN}.running_mean"].double() - truth.mean).abs() / truth.var.sqrt()).max())
    var_error = float(((state[f"{BN}.running_var"].double() - truth.var).abs() / truth.var).max())
    assert mean_error < 1e-5 and var_error < 1e-5, (mean_error, var_error)


def test_epoch_based_interval_validation_and_checkpoints(tmp_path: Path, float64_truth: Any) -> None:
    x, y = make_data()
    hook, probe = ExactPreciseBNHook(num_samples="all", interval=2), AtValidation()
    runner = run(
        tmp_path,
        TinyNet(),
        loader(x, y),
        hooks=[hook, probe, CopiedCheckpoints()],
        train_cfg={"by_epoch": True, "max_epochs": 3, "val_interval": 1},
        val=loader(x[:32], y[:32]),
        checkpoint={"type": "CheckpointHook", "interval": 1},
    )
    # 4 iterations per epoch. At each epoch end (4, 8, 12): the checkpoint, the interval
    # (epoch 2) and validation all fall on one iteration: one computation each.
    assert hook.computations == 3 and hook.last_step == 12
    assert [it for it, _ in probe.seen] == [4, 8, 12]
    for _, state in probe.seen:
        assert_precise(float64_truth, state, x)
    for epoch in (1, 2, 3):
        saved = torch.load(tmp_path / f"epoch_{epoch}.pth", weights_only=False)
        assert saved["meta"]["iter"] == 4 * epoch
        assert_precise(float64_truth, saved["state_dict"], x)
    history = runner.message_hub.get_scalar("train/precisebn/samples")
    assert list(history.data[0]) == [64, 64, 64]


class AliasedNet(TinyNet):
    """TinyNet whose BatchNorm is also registered as ``alias``: two names in every state_dict."""

    def __init__(self) -> None:
        super().__init__()
        self.alias = self.net[1]


def test_checkpoint_copies_get_the_statistics_under_every_name(tmp_path: Path, float64_truth: Any) -> None:
    """Found by a hostile probe: with the checkpoint holding copies (a GPU model), only the layer's
    first name was refreshed; the alias kept the old statistics, and loading the file (later key
    wins) put them back."""
    x, y = make_data()
    hook = ExactPreciseBNHook(num_samples="all", interval=None, before_val=False)
    run(
        tmp_path,
        AliasedNet(),
        loader(x, y),
        hooks=[hook, CopiedCheckpoints()],
        train_cfg={"by_epoch": True, "max_epochs": 1},
        checkpoint={"type": "CheckpointHook", "interval": 1},
    )
    assert hook.computations == 1
    saved = torch.load(tmp_path / "epoch_1.pth", weights_only=False)["state_dict"]
    for buffer in ("running_mean", "running_var"):
        assert torch.equal(saved[f"alias.{buffer}"], saved[f"{BN}.{buffer}"]), buffer
    assert_precise(float64_truth, {k: v for k, v in saved.items() if not k.startswith("alias.")}, x)


def test_iteration_based_interval_validation_and_checkpoints(tmp_path: Path, float64_truth: Any) -> None:
    x, y = make_data()
    hook, probe = ExactPreciseBNHook(num_samples="all", interval=3), AtValidation()
    run(
        tmp_path,
        TinyNet(),
        loader(x, y),
        hooks=[hook, probe],
        train_cfg={"by_epoch": False, "max_iters": 10, "val_interval": 5},
        val=loader(x[:32], y[:32]),
        checkpoint={"type": "CheckpointHook", "interval": 5, "by_epoch": False},
    )
    # Interval: after iterations 3, 6, 9; checkpoints after 5 and 10, each followed by a
    # validation at the same iteration: five computations.
    assert hook.computations == 5 and hook.last_step == 10
    assert [it for it, _ in probe.seen] == [5, 10]
    for _, state in probe.seen:
        assert_precise(float64_truth, state, x)
    for it in (5, 10):
        saved = torch.load(tmp_path / f"iter_{it}.pth", weights_only=False)
        assert saved["meta"]["iter"] == it
        assert_precise(float64_truth, saved["state_dict"], x)

    only_interval = ExactPreciseBNHook(num_samples="all", interval=2)
    model = TinyNet()
    run(tmp_path, model, loader(x, y), hooks=[only_interval], train_cfg={"by_epoch": True, "max_epochs": 3})
    assert (only_interval.computations, only_interval.last_step) == (1, 8)  # the end of epoch 2


def test_training_is_untouched(tmp_path: Path) -> None:
    x, y = make_data()

    def train(hooks: list[Any], directory: Path) -> TinyNet:
        torch.manual_seed(0)
        model = TinyNet(dropout=0.5)
        run(
            directory,
            model,
            loader(x, y, shuffle=True, batch_size=8),  # the global generator shuffles
            hooks=hooks,
            train_cfg={"by_epoch": True, "max_epochs": 2, "val_interval": 1},
            val=loader(x[:16], y[:16]),
            checkpoint={"type": "CheckpointHook", "interval": 3, "by_epoch": False},
        )
        return model

    hook = ExactPreciseBNHook(num_samples=40, interval=None, mode="train")  # dropout on, a partial shuffled pass
    with_hook = train([hook], tmp_path / "with")
    without = train([], tmp_path / "without")
    assert hook.computations == 7  # checkpoints at 3, 6, 9, 12, 15 and validations at 8, 16
    assert len(with_hook.losses) == 16
    assert torch.equal(torch.stack(with_hook.losses), torch.stack(without.losses))
    for p, q in zip(with_hook.parameters(), without.parameters()):
        assert torch.equal(p, q)


def test_iteration_based_training_with_an_infinite_sampler_is_untouched(tmp_path: Path, float64_truth: Any) -> None:
    """mmengine's iteration-based loops read an InfiniteSampler, one generator for the sampler's life: the
    first computation read from it and closed it, and training stopped with StopIteration at iteration 5 (a
    probe). The hook now reads a twin of the loader (the first epoch's order), and training is as without it."""
    from mmengine.dataset import InfiniteSampler

    x, y = make_data()
    records = [{"inputs": x[i], "data_samples": y[i]} for i in range(len(x))]

    def train(hooks: list[Any], directory: Path) -> TinyNet:
        torch.manual_seed(0)
        model = TinyNet(dropout=0.5)
        sampler = InfiniteSampler(records, shuffle=True, seed=0)
        data = torch.utils.data.DataLoader(records, batch_size=16, sampler=sampler)
        run(directory, model, data, hooks=hooks, train_cfg={"by_epoch": False, "max_iters": 10})
        return model

    hook = ExactPreciseBNHook(num_samples="all", interval=5)
    with_hook = train([hook], tmp_path / "with")
    without = train([], tmp_path / "without")
    assert hook.computations == 2 and hook.last_step == 10  # after iterations 5 and 10
    assert len(with_hook.losses) == 10
    assert torch.equal(torch.stack(with_hook.losses), torch.stack(without.losses))
    for p, q in zip(with_hook.parameters(), without.parameters()):
        assert torch.equal(p, q)
    assert_precise(float64_truth, with_hook.state_dict(), x)  # (every sample: one pass of the first epoch)


def test_a_model_without_normalization_layers_trains_with_one_warning(tmp_path: Path) -> None:
    x, y = make_data()

    def train(hooks: list[Any], directory: Path) -> TinyNet:
        torch.manual_seed(0)
        model = TinyNet(norm=False)
        cfg = {"by_epoch": True, "max_epochs": 2, "val_interval": 1}
        run(directory, model, loader(x, y, shuffle=True), hooks=hooks, train_cfg=cfg, val=loader(x[:16], y[:16]))
        return model

    hook = ExactPreciseBNHook(num_samples="all")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = train([hook], tmp_path / "ours")
    messages = [str(w.message) for w in caught if issubclass(w.category, PreciseBNWarning)]
    assert len(messages) == 1 and "no normalization layer" in messages[0], messages
    assert hook.computations == 0
    reference = train([], tmp_path / "reference")
    assert torch.equal(torch.stack(ours.losses), torch.stack(reference.losses))
    for p, q in zip(ours.parameters(), reference.parameters()):
        assert torch.equal(p, q)


def test_a_failing_data_loader_leaves_the_model_unchanged(tmp_path: Path, snapshot: Any, unchanged: Any) -> None:
    x, y = make_data()

    def failing() -> Any:
        yield {"inputs": x[:16], "data_samples": y[:16]}
        raise OSError("disk on fire")

    class Before(Hook):
        priority = "HIGHEST"  # before the precise-BN hook in after_train_epoch
        state: ClassVar[dict[str, Any]] = {}

        def after_train_epoch(self, runner: Any) -> None:
            Before.state.update(snapshot(runner.model))

    model = TinyNet()
    with pytest.raises(OSError, match="disk on fire"):
        run(
            tmp_path,
            model,
            loader(x, y),
            hooks=[Before(), ExactPreciseBNHook(data=failing, num_samples="all")],
            train_cfg={"by_epoch": True, "max_epochs": 2},
        )
    unchanged(model, Before.state)


def test_registry_names_and_options(tmp_path: Path) -> None:
    assert HOOKS.get("ExactPreciseBNHook") is ExactPreciseBNHook
    x, y = make_data(32)
    config = {"type": "ExactPreciseBNHook", "num_samples": 16, "interval": 1}  # mmpretrain's options
    runner = run(tmp_path, TinyNet(), loader(x, y), hooks=[config], train_cfg={"by_epoch": True, "max_epochs": 1})
    built = [h for h in runner.hooks if isinstance(h, ExactPreciseBNHook)]
    assert len(built) == 1 and built[0].computations == 1 and built[0].last_report.samples == 16

    # mmpretrain's name, only when asked, and beside another scope's own PreciseBNHook.
    other = Registry("hook", parent=HOOKS, scope=f"fake{uuid.uuid4().hex[:6]}")

    @other.register_module(name="PreciseBNHook")
    class TheirHook(Hook):
        pass

    if HOOKS.get("PreciseBNHook") is None:
        register_mmpretrain_name()
    register_mmpretrain_name()  # twice is fine
    assert HOOKS.get("PreciseBNHook") is ExactPreciseBNHook
    assert other.get("PreciseBNHook") is TheirHook
    register_mmpretrain_name(other, force=True)
    assert other.get("PreciseBNHook") is ExactPreciseBNHook

    for bad in ({"interval": 0}, {"num_samples": 0}, {"mode": "eval"}, {"interval": 1.5}):
        with pytest.raises(InvalidArgumentError):
            ExactPreciseBNHook(**bad)


def test_missing_mmengine_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in sys.modules if n == "mmengine" or n.startswith("mmengine.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delitem(sys.modules, "precisebn.integrations.mmengine", raising=False)
    monkeypatch.setitem(sys.modules, "mmengine", None)
    with pytest.raises(MissingDependencyError, match=r"pip install 'precisebn\[mmengine\]'"):
        importlib.import_module("precisebn.integrations.mmengine")


class NormFirst(BaseModel):
    """A BatchNorm1d with momentum 0 on the inputs: its statistics stay the prior set by the test while
    training, and its inputs are the data whatever the weights."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(4, momentum=0.0)
        self.head = torch.nn.Linear(4, 1)

    def forward(self, inputs: torch.Tensor, data_samples: Any = None, mode: str = "tensor") -> Any:
        out = self.head(self.norm(inputs)).squeeze(1)
        return {"loss": torch.nn.functional.mse_loss(out, data_samples)} if mode == "loss" else out


@pytest.mark.parametrize("adapt", ["both", "mean"])
def test_prior_and_adapt_reach_each_computation(tmp_path: Path, adapt: str) -> None:
    x, y = make_data()
    model = NormFirst()
    before = set_statistics(model.norm, [-2.0, 4.0, 1.0, 0.0], [0.5, 9.0, 2.0, 0.1])
    hook = ExactPreciseBNHook(num_samples="all", interval=1, prior=24, adapt=adapt, before_save=False)
    run(tmp_path, model, loader(x, y), hooks=[hook], train_cfg={"by_epoch": True, "max_epochs": 1})
    assert hook.computations == 1  # at the end of the epoch
    assert_adapted(model.norm, before, 24, x.double().t(), adapt)  # one value per sample and channel


class FrozenBackbone(TinyNet):
    """``TinyNet`` with ``conftest.NormEval`` as its net (a backbone BatchNorm kept in eval mode while training, as
    ``norm_eval=True``)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = NormEval()


@pytest.mark.parametrize("frozen", ["skip", "include"])
def test_layers_frozen_for_training_are_left_as_they_are(tmp_path: Path, frozen: str) -> None:
    x, y = make_data()

    def train(hooks: list[Any], directory: Path) -> FrozenBackbone:
        torch.manual_seed(0)
        model = FrozenBackbone()
        cfg = {"by_epoch": True, "max_epochs": 2, "val_interval": 1}
        run(directory, model, loader(x, y), hooks=hooks, train_cfg=cfg, val=loader(x[:16], y[:16]))
        return model

    hook = ExactPreciseBNHook(num_samples="all", interval=None, frozen=frozen)
    model = train([hook], tmp_path / "with")
    reference = train([], tmp_path / "without")
    assert hook.computations == 2
    same = torch.equal(torch.stack(model.losses), torch.stack(reference.losses))
    assert_frozen_run(frozen, same, model, reference, [x], prefix="net.")


def test_a_checkpoint_saved_by_rank_0_alone_computes_nothing_and_says_so() -> None:
    """mmengine saves on rank 0 only: a computation there (which merges every rank) left rank 0 waiting alone."""
    from types import SimpleNamespace

    hook = ExactPreciseBNHook(num_samples="all", interval=None)
    hook._training = True
    runner = SimpleNamespace(world_size=2, rank=0, iter=3)
    with pytest.warns(PreciseBNWarning, match="saves checkpoints on rank 0 alone"):
        hook.before_save_checkpoint(runner, {"state_dict": {}})
    hook.before_save_checkpoint(runner, {"state_dict": {}})  # said once
    assert hook.computations == 0


def test_with_ema_the_checkpoint_holds_the_statistics_validation_used(tmp_path: Path, float64_truth: Any) -> None:
    """Probe 41: EMAHook (buffers copied from the model after each iteration, its default) fills the checkpoint's
    state_dict from its EMA module; statistics computed at an epoch's end, after the last copy, reached validation
    but not that state_dict (0.91 off). Each checkpoint's state_dict now holds the statistics validation ran with,
    which are exact for the trained model's weights (kept under ema_state_dict, as EMAHook swaps them)."""
    x, y = make_data()
    # (ema="copy", the behaviour before ema="own": see the tests at the end of this file)
    hook, probe = ExactPreciseBNHook(num_samples="all", interval=1, ema="copy"), AtValidation()
    run(
        tmp_path,
        TinyNet(),
        loader(x, y),
        hooks=[hook, {"type": "EMAHook", "momentum": 0.5}, probe],
        train_cfg={"by_epoch": True, "max_epochs": 2, "val_interval": 1},
        val=loader(x[:32], y[:32]),
        checkpoint={"type": "CheckpointHook", "interval": 1},
    )
    assert [it for it, _ in probe.seen] == [4, 8]
    for epoch, (_, validated) in zip((1, 2), probe.seen):
        saved = torch.load(tmp_path / f"epoch_{epoch}.pth", weights_only=False)
        trained = {k.removeprefix("module."): v for k, v in saved["ema_state_dict"].items() if k.startswith("module.")}
        assert_precise(float64_truth, trained, x)  # the statistics: exact for the trained weights
        for buffer in ("running_mean", "running_var"):
            key = f"{BN}.{buffer}"
            assert torch.equal(saved["state_dict"][key], validated[key]), (epoch, buffer)
            assert torch.equal(saved["state_dict"][key], trained[key]), (epoch, buffer)
        assert not torch.equal(saved["state_dict"][f"{BN}.weight"], trained[f"{BN}.weight"])  # (EMA weights there)


@pytest.mark.parametrize("interval", [1, None])  # (None: computed in before_val, where the loop counted the epoch)
def test_with_ema_averaging_buffers_not_yet_begun_validation_gets_the_statistics(
    tmp_path: Path, float64_truth: Any, interval: int | None
) -> None:
    """The review of probe 41: before EMAHook begins averaging (begin_epoch), it copies the whole model into its
    EMA module after each iteration, buffers too, even with update_buffers=True, and validation runs that module's
    weights and buffers: the statistics computed at the epoch's end did not reach validation. They are copied as
    the next iteration would."""
    x, y = make_data()
    probe = AtValidation()
    run(
        tmp_path,
        TinyNet(),
        loader(x, y),
        hooks=[
            ExactPreciseBNHook(num_samples="all", interval=interval),
            {"type": "EMAHook", "momentum": 0.5, "update_buffers": True, "begin_epoch": 2},
            probe,
        ],
        train_cfg={"by_epoch": True, "max_epochs": 2, "val_interval": 1},
        val=loader(x[:32], y[:32]),
    )
    assert [it for it, _ in probe.seen] == [4, 8]
    assert_precise(float64_truth, probe.seen[0][1], x)  # (epoch 1: before averaging; from epoch 2 it averages them)


class FailingOnce(MSE):
    """A metric with a bug in the first validation it computes."""

    failures: ClassVar[list[int]] = [1]

    def compute_metrics(self, results: list[float]) -> dict[str, float]:
        if self.failures:
            self.failures.pop()
            raise RuntimeError("a bug in the metric")
        return super().compute_metrics(results)


def test_a_run_after_one_that_raised_computes_at_its_own_steps(tmp_path: Path, float64_truth: Any) -> None:
    """Probe 42: the run that raised (in its first validation, after the computation at iteration 4) never reached
    after_train, and the same hook in the next run — a new Runner, a new model — took that run's iteration 4 as
    computed: its validation and epoch_1.pth held the moving averages (~1.1 σ off the truth)."""
    x, y = make_data()
    hook = ExactPreciseBNHook(num_samples="all", interval=None)  # before validations and checkpoints only
    probe = AtValidation()
    FailingOnce.failures[:] = [1]

    def attempt(name: str) -> None:
        Runner(
            model=TinyNet(),
            work_dir=str(tmp_path / name),
            train_dataloader=loader(x, y),
            train_cfg={"by_epoch": True, "max_epochs": 2, "val_interval": 1},
            optim_wrapper={"optimizer": {"type": "SGD", "lr": 0.02, "momentum": 0.9}},
            val_dataloader=loader(x[:32], y[:32]),
            val_cfg={},
            val_evaluator=Evaluator(FailingOnce()),
            default_hooks={"checkpoint": {"type": "CheckpointHook", "interval": 1}},
            custom_hooks=[hook, probe],
            randomness={"seed": 0},
            log_level="ERROR",
        ).train()

    with pytest.raises(RuntimeError, match="a bug in the metric"):
        attempt("first")
    assert hook.last_step == 4 and hook.computations == 1
    probe.seen.clear()
    attempt("again")
    assert hook.computations == 3 and [it for it, _ in probe.seen] == [4, 8]
    for _, state in probe.seen:
        assert_precise(float64_truth, state, x)
    for epoch in (1, 2):
        assert_precise(
            float64_truth, torch.load(tmp_path / "again" / f"epoch_{epoch}.pth", weights_only=False)["state_dict"], x
        )


def test_a_validation_after_a_training_run_that_raised_computes_nothing(tmp_path: Path) -> None:
    """Probe 42: a training run that raised never reached after_train, and the same hook in another Runner's val()
    computed on the failed run's model (its statistics rewritten from a validation of another model)."""
    x, y = make_data()
    hook = ExactPreciseBNHook(num_samples="all", interval=None)
    failed = TinyNet()

    def runner(model: TinyNet, metric: BaseMetric) -> Runner:
        return Runner(
            model=model,
            work_dir=str(tmp_path),
            experiment_name=uuid.uuid4().hex,
            train_dataloader=loader(x, y),
            train_cfg={"by_epoch": True, "max_epochs": 1, "val_interval": 1},
            optim_wrapper={"optimizer": {"type": "SGD", "lr": 0.02}},
            val_dataloader=loader(x[:32], y[:32]),
            val_cfg={},
            val_evaluator=Evaluator(metric),
            default_hooks={"checkpoint": None},
            custom_hooks=[hook],
            log_level="ERROR",
        )

    FailingOnce.failures[:] = [1]
    with pytest.raises(RuntimeError, match="a bug in the metric"):
        runner(failed, FailingOnce()).train()
    assert hook.computations == 1
    with torch.no_grad():
        failed.net[0].weight.mul_(2.0)  # (its statistics are stale now: a computation would rewrite them)
    before = {k: v.clone() for k, v in failed.state_dict().items()}
    runner(TinyNet(), MSE()).val()
    assert hook.computations == 1
    assert all(torch.equal(v, before[k]) for k, v in failed.state_dict().items())


# -- ema="own": the EMA weights get statistics of their own ---------------------------------------------------------


TENSOR_CALLS: list[int] = []


class SpiedNet(TinyNet):
    """TinyNet that records its state at every validation batch (``mode="predict"``): the weights and statistics
    validation ran with, whatever the hooks' order. ``explode``: its ``mode="tensor"`` passes raise it;
    ``explode_predict``: its next ``mode="predict"`` pass (validation, test) raises it."""

    def __init__(self) -> None:
        super().__init__()
        self.in_validation: list[dict[str, torch.Tensor]] = []
        self.explode: BaseException | None = None
        self.explode_predict: BaseException | None = None

    def forward(self, inputs: torch.Tensor, data_samples: Any = None, mode: str = "tensor") -> Any:
        if mode == "predict":
            self.in_validation.append({k: v.clone() for k, v in self.state_dict().items()})
            error, self.explode_predict = self.explode_predict, None
            if error is not None:
                raise error
        if mode == "tensor":
            TENSOR_CALLS.append(id(self))  # (outside the model: precisebn puts the model's attributes back)
            if self.explode is not None:
                raise self.explode
        return super().forward(inputs, data_samples, mode)


class AroundValidation(Hook):
    """After every other hook's ``before_val`` and ``after_val``: the model's state, and the EMA module's, as
    validation starts and once it is over."""

    priority = "LOWEST"

    def __init__(self) -> None:
        self.before: list[dict[str, torch.Tensor]] = []
        self.after: list[dict[str, torch.Tensor]] = []
        self.ema_before: list[dict[str, torch.Tensor]] = []
        self.ema_hook: Any = None

    def before_val(self, runner: Any) -> None:
        self.before.append({k: v.clone() for k, v in runner.model.state_dict().items()})
        (ema,) = [h for h in runner.hooks if type(h).__name__ == "EMAHook"]
        self.ema_hook = ema
        self.ema_before.append({k: v.clone() for k, v in ema.ema_model.module.state_dict().items()})

    def after_val(self, runner: Any) -> None:
        self.after.append({k: v.clone() for k, v in runner.model.state_dict().items()})


def errors_to_truth(state: dict[str, torch.Tensor], x: torch.Tensor) -> tuple[float, float]:
    """The largest |error| of the state's running mean (in σ) and variance (relative) against the float64 truth
    of ``conftest.compute_truth`` for the state's own weights over the training data."""
    from conftest import compute_truth, max_rel_error

    net = TinyNet()
    net.load_state_dict(state)
    truth = compute_truth(net, [x])[BN]
    return (
        max_rel_error(state[f"{BN}.running_mean"], truth.mean, truth.var.sqrt()),
        max_rel_error(state[f"{BN}.running_var"], truth.var),
    )


def weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if not k.endswith(("running_mean", "running_var", "num_batches_tracked"))}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(v, b[k]) for k, v in a.items())


@pytest.mark.parametrize("copies", [False, True])  # (True: the checkpoint holds copies, as for a model on a GPU)
@pytest.mark.parametrize("priority", ["ABOVE_NORMAL", "LOWEST"])  # before EMAHook (its default), after every hook
@pytest.mark.parametrize("update_buffers", [False, True])
def test_with_ema_validation_and_checkpoints_get_the_ema_weights_own_statistics(
    tmp_path: Path, update_buffers: bool, priority: str, copies: bool
) -> None:
    """Probe 45: validation ran EMAHook's weights with the statistics of the model's weights (0.05-0.08 σ off in
    the mean, ~9 % in the variance; with update_buffers=True ~2 σ: its averages of the moving averages), and the
    checkpoint's state_dict (the EMA weights) held them too. With ema="own" (the default) the EMA weights get the
    float64 statistics of their own layer inputs, for validation and in the checkpoint; the model trains on with
    its own, bitwise, and they are in the checkpoint's ema_state_dict (EMAHook's swap of the two)."""
    x, y = make_data()
    hook, around = ExactPreciseBNHook(num_samples="all", interval=1, priority=priority), AroundValidation()
    model = SpiedNet()
    ema_hook = {"type": "EMAHook", "momentum": 0.5, "update_buffers": update_buffers}
    runner = run(
        tmp_path,
        model,
        loader(x, y),
        hooks=[hook, ema_hook, around] + ([CopiedCheckpoints()] if copies else []),
        train_cfg={"by_epoch": True, "max_epochs": 2, "val_interval": 1},
        val=loader(x[:32], y[:32]),
        checkpoint={"type": "CheckpointHook", "interval": 1},
    )
    assert len(around.before) == len(around.after) == 2 and len(model.in_validation) == 4  # 2 batches each
    for epoch in (1, 2):
        live, ema = around.before[epoch - 1], around.ema_before[epoch - 1]
        assert not same(weights(live), weights(ema))  # (the EMA weights differ from the model's)
        # (1) validation ran the EMA weights with the float64 statistics of their own layer inputs
        for validated in model.in_validation[2 * epoch - 2 : 2 * epoch]:
            assert same(weights(validated), weights(ema))
            mean_error, var_error = errors_to_truth(validated, x)
            assert mean_error < 1e-6 and var_error < 1e-6, (epoch, mean_error, var_error)
        # (the model's own statistics are far from the EMA weights' truth: the check can tell them apart)
        assert max(errors_to_truth({**validated, **{k: live[k] for k in live if "running" in k}}, x)) > 1e-3
        # (2) the model's statistics, exact for its weights, are bitwise what they were once validation is over
        assert max(errors_to_truth(live, x)) < 1e-6
        assert same(around.after[epoch - 1], live)
        # (3) the checkpoint: the EMA weights with their statistics; the model's under ema_state_dict
        saved = torch.load(tmp_path / f"epoch_{epoch}.pth", weights_only=False)
        assert same(weights(saved["state_dict"]), weights(ema))
        assert max(errors_to_truth(saved["state_dict"], x)) < 1e-6
        for key in (f"{BN}.running_mean", f"{BN}.running_var"):
            assert torch.equal(saved["state_dict"][key], validated[key])
        trained = {k.removeprefix("module."): v for k, v in saved["ema_state_dict"].items() if k.startswith("module.")}
        assert same(trained, live)
        # resuming swaps them back (EMAHook.after_load_checkpoint): the EMA module gets the EMA weights with their
        # statistics, the model its own
        resumed = {"state_dict": dict(saved["state_dict"]), "ema_state_dict": dict(saved["ema_state_dict"])}
        from mmengine.hooks import EMAHook

        EMAHook._swap_ema_state_dict(None, resumed)  # type: ignore[arg-type]
        back = {k.removeprefix("module."): v for k, v in resumed["ema_state_dict"].items() if k.startswith("module.")}
        assert same(weights(back), weights(ema)) and max(errors_to_truth(back, x)) < 1e-6
        assert same(resumed["state_dict"], live)
    assert hook.computations == 2 and logged(runner, "precisebn_ema") == 2  # one of each per epoch


@pytest.mark.parametrize("error", [RuntimeError("the EMA copy fails"), KeyboardInterrupt()])
def test_with_ema_a_failure_in_the_ema_computation_leaves_both_models_unchanged(
    tmp_path: Path, snapshot: Any, unchanged: Any, error: BaseException
) -> None:
    """The model's statistics are computed first, then the EMA weights': a failure in the second (the data, the
    model, Ctrl-C) puts the first back too — the model and the EMA module bitwise as they were, no hook left."""
    x, y = make_data()

    class Explode(Hook):
        priority = "HIGHEST"  # before the precise-BN hook in before_val
        states: ClassVar[list[dict[str, Any]]] = []

        def before_val(self, runner: Any) -> None:
            (ema,) = [h for h in runner.hooks if type(h).__name__ == "EMAHook"]
            ema.ema_model.module.explode = error
            Explode.states[:] = [snapshot(runner.model), snapshot(ema.ema_model.module), ema.ema_model.module]

    model = SpiedNet()
    hook = ExactPreciseBNHook(num_samples="all", interval=None)  # computed in before_val alone
    TENSOR_CALLS.clear()
    with pytest.raises(type(error)):
        run(
            tmp_path,
            model,
            loader(x, y),
            hooks=[Explode(), hook, {"type": "EMAHook", "momentum": 0.5}],
            train_cfg={"by_epoch": True, "max_epochs": 1, "val_interval": 1},
            val=loader(x[:32], y[:32]),
        )
    live, ema, ema_module = Explode.states
    assert [id(model)] * 4 + [id(ema_module)] == TENSOR_CALLS  # the model's computation ran (and was undone)
    unchanged(model, live)
    unchanged(ema_module, ema)
    assert hook.computations == 0 and hook.last_step is None


def test_with_ema_copy_and_bad_values() -> None:
    with pytest.raises(InvalidArgumentError, match="ema must be 'own' or 'copy'"):
        ExactPreciseBNHook(ema="both")  # type: ignore[arg-type]
    assert ExactPreciseBNHook().ema == "own"


def test_with_ema_iteration_based_validation_and_checkpoints_get_the_ema_weights_own_statistics(
    tmp_path: Path,
) -> None:
    """Iteration-based: the hook's interval falls inside an iteration, before EMAHook averages that iteration's
    weights; the EMA weights' statistics are computed at the checkpoint and validation that follow."""
    x, y = make_data()
    hook, around = ExactPreciseBNHook(num_samples="all", interval=3), AroundValidation()
    model = SpiedNet()
    runner = run(
        tmp_path,
        model,
        loader(x, y),
        hooks=[hook, {"type": "EMAHook", "momentum": 0.5}, around],
        train_cfg={"by_epoch": False, "max_iters": 10, "val_interval": 5},
        val=loader(x[:32], y[:32]),
        checkpoint={"type": "CheckpointHook", "interval": 5, "by_epoch": False},
    )
    assert len(model.in_validation) == 4
    for i, it in enumerate((5, 10)):
        ema, live = around.ema_before[i], around.before[i]
        for validated in model.in_validation[2 * i : 2 * i + 2]:
            assert same(weights(validated), weights(ema)) and max(errors_to_truth(validated, x)) < 1e-6
        assert same(around.after[i], live) and max(errors_to_truth(live, x)) < 1e-6
        saved = torch.load(tmp_path / f"iter_{it}.pth", weights_only=False)
        assert same(weights(saved["state_dict"]), weights(ema)) and max(errors_to_truth(saved["state_dict"], x)) < 1e-6
    # the model: after iterations 3, 6, 9 and at 5, 10; the EMA weights at 5 and 10 (checkpoint and validation)
    assert (hook.computations, logged(runner), logged(runner, "precisebn_ema")) == (5, 5, 2)


def statistics(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if k.endswith(("running_mean", "running_var"))}


@pytest.mark.parametrize("where", ["metric", "forward"])
def test_with_ema_a_validation_that_raises_gives_the_model_its_own_statistics_back(tmp_path: Path, where: str) -> None:
    """Validation swapped the EMA weights' statistics into the model (beside EMAHook's parameters) and swapped them
    back in after_val_epoch, which mmengine does not call when validation raises: the model's buffers were left
    holding the EMA weights' statistics (training's own lost) and the EMA module the model's. Now the hook swaps them
    back as the error leaves the validation loop — a metric's bug or Ctrl-C in the model's forward: the model's
    statistics are bitwise its own again (exact for its own weights), the EMA module's its own (exact for the EMA
    weights)."""
    x, y = make_data()
    hook, around, model = ExactPreciseBNHook(num_samples="all", interval=None), AroundValidation(), SpiedNet()
    error: type[BaseException] = RuntimeError
    if where == "forward":
        model.explode_predict, error = KeyboardInterrupt(), KeyboardInterrupt
    else:
        FailingOnce.failures[:] = [1]
    with pytest.raises(error):
        run(
            tmp_path,
            model,
            loader(x, y),
            hooks=[hook, {"type": "EMAHook", "momentum": 0.5}, around],
            train_cfg={"by_epoch": True, "max_epochs": 1, "val_interval": 1},
            val=loader(x[:32], y[:32]),
            metric=FailingOnce() if where == "metric" else None,
        )
    live, ema = around.before[0], around.ema_before[0]  # (after the computations, before the swap)
    assert len(model.in_validation) == (2 if where == "metric" else 1) and not around.after
    validated = model.in_validation[0]
    assert same(weights(validated), weights(ema)) and same(statistics(validated), statistics(ema))  # (swapped)
    assert same(statistics(model.state_dict()), statistics(live))  # the model's own, bitwise
    assert max(errors_to_truth(live, x)) < 1e-6
    assert same(statistics(around.ema_hook.ema_model.module.state_dict()), statistics(ema))
    assert max(errors_to_truth(ema, x)) < 1e-6
    assert max(errors_to_truth({**weights(ema), **statistics(live)}, x)) > 1e-3  # (the check tells them apart)


def test_with_ema_a_ctrl_c_during_the_swap_into_validation_still_swaps_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review of stop 44: a Ctrl-C that arrived while the EMA weights' statistics were being swapped into the model
    (held there, raised as the swap's hold ended) left before the swap was recorded: the loop's guard found nothing
    to swap back, and the model kept the EMA weights' statistics (the EMA module the model's). The swap and its
    record are one hold now: the model's statistics are bitwise its own after the KeyboardInterrupt."""
    import os
    import signal

    from precisebn.integrations import _mmengine_ema
    from precisebn.interrupts import signals_held

    x, y = make_data()
    hook, around, model = ExactPreciseBNHook(num_samples="all", interval=None), AroundValidation(), SpiedNet()
    original, calls = _mmengine_ema._swap, []

    def swap(pairs: Any) -> None:
        calls.append(len(pairs))
        with signals_held():
            if len(calls) == 1:  # (the swap in: Ctrl-C pressed meanwhile)
                os.kill(os.getpid(), signal.SIGINT)
            original(pairs)

    monkeypatch.setattr(_mmengine_ema, "_swap", swap)
    with pytest.raises(KeyboardInterrupt):
        run(
            tmp_path,
            model,
            loader(x, y),
            hooks=[hook, {"type": "EMAHook", "momentum": 0.5}, around],
            train_cfg={"by_epoch": True, "max_epochs": 1, "val_interval": 1},
            val=loader(x[:32], y[:32]),
        )
    live, ema = around.before[0], around.ema_before[0]  # (after the computations, before the swap)
    assert not model.in_validation and calls
    assert same(statistics(model.state_dict()), statistics(live))  # the model's own, bitwise
    assert same(statistics(around.ema_hook.ema_model.module.state_dict()), statistics(ema))
    assert max(errors_to_truth(ema, x)) < 1e-6 and max(errors_to_truth(live, x)) < 1e-6


@pytest.mark.filterwarnings("ignore:Environment variable TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
@pytest.mark.parametrize("case", ["test", "val", "test raising"])
def test_with_ema_test_and_validation_outside_training_run_the_ema_weights_with_their_statistics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """EMAHook swaps its parameters in for runner.test() (and runner.val()) too. Resumed from a checkpoint, its
    module holds the EMA weights with their own statistics (ema_state_dict) and the model its weights with its
    own: the test ran the EMA weights with the model's statistics (0.17 σ / 28 % off their truth in a check). The
    hook swaps the statistics in beside the parameters there too, and back. (runner.test() after runner.train() on
    one runner, and a checkpoint loaded without resuming, give the model and EMAHook's module one state: the
    statistics are those of the weights either way.) A test that raises (Ctrl-C in the model's forward) swaps
    them back too: the model's statistics are bitwise its own."""
    loop, raising = case.split()[0], case.endswith("raising")
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")  # (mmengine's torch.load of its own checkpoints)
    x, y = make_data()
    hooks: list[Any] = [ExactPreciseBNHook(num_samples="all", interval=1), {"type": "EMAHook", "momentum": 0.5}]
    model, data = SpiedNet(), loader(x[:32], y[:32])
    loop_options = {f"{loop}_dataloader": data, f"{loop}_cfg": {}, f"{loop}_evaluator": Evaluator(MSE())}
    trained = run(
        tmp_path,
        model,
        loader(x, y),
        hooks=hooks,
        train_cfg={"by_epoch": True, "max_epochs": 1},
        checkpoint={"type": "CheckpointHook", "interval": 1},
        **(loop_options if loop == "test" else {}),
    )
    saved = torch.load(Path(trained.work_dir) / "epoch_1.pth", weights_only=False)
    ema = saved["state_dict"]  # the EMA weights and their statistics (EMAHook's swap)
    own = {k.removeprefix("module."): v for k, v in saved["ema_state_dict"].items() if k.startswith("module.")}
    assert max(errors_to_truth(ema, x)) < 1e-6 and max(errors_to_truth(own, x)) < 1e-6
    if case == "test":  # on the runner that trained: EMAHook's module is a copy of the trained model again
        trained.test()
        assert len(model.in_validation) == 2
        assert all(same(tested, own) for tested in model.in_validation) and same(model.state_dict(), own)
    model = SpiedNet()
    model.explode_predict = KeyboardInterrupt() if raising else None
    resumed = Runner(
        model=model,
        work_dir=str(tmp_path),
        experiment_name=uuid.uuid4().hex,
        train_dataloader=loader(x, y),
        train_cfg={"by_epoch": True, "max_epochs": 1},
        optim_wrapper={"optimizer": {"type": "SGD", "lr": 0.02}},
        **loop_options,
        load_from=str(Path(trained.work_dir) / "epoch_1.pth"),
        resume=True,
        default_hooks={"checkpoint": None},
        custom_hooks=[ExactPreciseBNHook(num_samples="all"), {"type": "EMAHook", "momentum": 0.5}],
        log_level="ERROR",
    )
    with pytest.raises(KeyboardInterrupt) if raising else contextlib.nullcontext():
        getattr(resumed, loop)()
    assert len(model.in_validation) == (1 if raising else 2)
    for tested in model.in_validation:
        assert same(weights(tested), weights(ema))
        assert same(statistics(tested), statistics(ema)) and max(errors_to_truth(tested, x)) < 1e-6
    # afterwards: the model's own statistics, bitwise (and its weights, which EMAHook swaps back unless it raised)
    assert same(statistics(model.state_dict()), statistics(own))
    assert raising or same(model.state_dict(), own)
    (ema_hook,) = [h for h in resumed.hooks if type(h).__name__ == "EMAHook"]
    assert same(statistics(ema_hook.ema_model.module.state_dict()), statistics(ema))


def test_with_several_ema_hooks_each_gets_the_model_statistics_with_one_warning(tmp_path: Path) -> None:
    """ema="own" computes one EMA module's statistics: with two EMAHooks on the model, neither is computed (no
    ``train/precisebn_ema`` logs); each EMA module gets the model's statistics, copied (ema="copy"), exact for the
    model's weights, and one PreciseBNWarning says so. (No validation: two EMAHooks swap their parameters back in
    the order they swapped them in, which leaves the model with other weights than it trained.)"""
    x, y = make_data()
    model = TinyNet()
    ema_hooks = [{"type": "EMAHook", "momentum": 0.5}, {"type": "EMAHook", "momentum": 0.25}]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runner = run(
            tmp_path,
            model,
            loader(x, y),
            hooks=[ExactPreciseBNHook(num_samples="all", interval=1), *ema_hooks],
            train_cfg={"by_epoch": True, "max_epochs": 2},
        )
    messages = [str(w.message) for w in caught if issubclass(w.category, PreciseBNWarning)]
    assert len(messages) == 1 and "2 EMAHooks follow the model" in messages[0], messages
    assert (logged(runner), logged(runner, "precisebn_ema")) == (2, 0)
    live = model.state_dict()
    assert max(errors_to_truth(live, x)) < 1e-6
    modules = [h.ema_model.module for h in runner.hooks if type(h).__name__ == "EMAHook"]
    assert len(modules) == 2 and not same(weights(modules[0].state_dict()), weights(modules[1].state_dict()))
    for module in modules:
        assert same(statistics(module.state_dict()), statistics(live))


@pytest.mark.parametrize("update_buffers", [False, True])
def test_with_ema_prior_pools_what_each_module_holds(tmp_path: Path, update_buffers: bool) -> None:
    """prior=N with ema="own": each computation pools, for the model and for the EMA module, the statistics its
    layers hold at that moment (counted as N samples) with the float64 statistics of the inputs its own weights
    give the layer. The EMA module holds EMAHook's copy of the model's moving averages (update_buffers=False) or
    its averages of them (True)."""
    x, y = make_data()

    class Before(Hook):
        priority = "HIGHEST"  # before the precise-BN hook in after_train_epoch
        states: ClassVar[list[dict[str, torch.Tensor]]] = []

        def after_train_epoch(self, runner: Any) -> None:
            (ema,) = [h for h in runner.hooks if type(h).__name__ == "EMAHook"]
            for module in (runner.model, ema.ema_model.module):
                Before.states.append({k: v.clone() for k, v in module.state_dict().items()})
            Before.states.append(ema.ema_model.module)  # type: ignore[arg-type]

    Before.states.clear()
    model = TinyNet()
    hook = ExactPreciseBNHook(num_samples="all", interval=1, prior=24, before_save=False)
    ema_hook = {"type": "EMAHook", "momentum": 0.5, "update_buffers": update_buffers}
    cfg = {"by_epoch": True, "max_epochs": 1}
    runner = run(tmp_path, model, loader(x, y), hooks=[Before(), hook, ema_hook], train_cfg=cfg)
    assert (logged(runner), logged(runner, "precisebn_ema")) == (1, 1)  # at the end of the epoch
    live, ema, ema_module = Before.states
    assert not same(weights(live), weights(ema))
    assert same(statistics(live), statistics(ema)) is not update_buffers  # (EMAHook's copy of the model's, or not)
    for net, before in ((model, live), (ema_module, ema)):
        with torch.no_grad():
            values = net.net[0](x).double().t()  # the layer's inputs with these weights, one value per sample
        prior = (before[f"{BN}.running_mean"], before[f"{BN}.running_var"])
        assert_adapted(net.net[1], prior, 24, values)


def test_a_run_builds_no_loop_it_would_not_build_itself(tmp_path: Path, float64_truth: Any) -> None:
    """The review of stop 44: guarding the loops against failures read ``runner.val_loop`` and ``runner.test_loop``
    in ``before_run`` — properties that build a loop from its configuration — so training built the test loop (its
    dataset, its evaluator) that it never runs: one whose dataset cannot be built made training fail at once. Only
    loops the run has built are guarded now; training is exact, and a test loop is never built."""
    x, y = make_data()
    hook = ExactPreciseBNHook(num_samples="all")
    broken = {"dataset": {"type": "precisebn-no-such-dataset"}, "batch_size": 4}  # (built: a KeyError)
    runner = run(
        tmp_path,
        TinyNet(),
        loader(x, y),
        hooks=[hook, {"type": "EMAHook", "momentum": 0.5}],
        train_cfg={"by_epoch": True, "max_epochs": 1, "val_interval": 1},
        val=loader(x[:32], y[:32]),
        test_dataloader=broken,
        test_cfg={},
        test_evaluator=Evaluator(MSE()),
    )
    assert isinstance(runner._test_loop, dict)  # never built
    assert logged(runner) == 1
    assert_precise(float64_truth, dict(runner.model.state_dict()), x)
