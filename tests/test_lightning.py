"""The Lightning callbacks, driven by a real ``lightning.pytorch.Trainer`` on CPU.

Every statistics check loads the weights the Trainer had at that moment (a snapshot
taken in ``validation_step``, or a checkpoint file) into a fresh module and compares
the running statistics with the float64 ground truth over the training data.
"""

from __future__ import annotations

import copy
import csv
import importlib
import sys
import warnings
from pathlib import Path
from typing import Any, ClassVar

import lightning.pytorch as L  # the 'lightning' extra, part of precisebn[dev]
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, StochasticWeightAveraging, WeightAveraging
from lightning.pytorch.loggers import CSVLogger
from torch.optim.swa_utils import get_ema_multi_avg_fn

from conftest import (
    NormEval,
    assert_adapted,
    assert_frozen_run,
    compute_truth,
    max_rel_error,
    set_statistics,
)
from precisebn.errors import InvalidArgumentError, MissingDependencyError, PreciseBNWarning
from precisebn.integrations.lightning import PreciseBN, PreciseWeightAveraging

BN = "net.1"
SHIFT = torch.tensor([3.0, -1.0, 0.0, 2.0])
SCALE = torch.tensor([1.0, 2.0, 0.5, 3.0])


def make_data(n: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g) * SCALE + SHIFT
    y = x @ torch.tensor([0.5, -1.0, 2.0, 0.3]) + 0.1 * torch.randn(n, generator=g)
    return x, y


def loader(x: torch.Tensor, y: torch.Tensor, batch_size: int = 16, shuffle: bool = False, generator: Any = None) -> Any:
    dataset = torch.utils.data.TensorDataset(x, y)
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, generator=generator)


class TinyNet(L.LightningModule):
    """Linear -> BatchNorm1d -> ReLU -> Dropout -> Linear; records losses and, at the
    first validation batch, the weights and statistics validation runs with."""

    def __init__(self, dropout: float = 0.0, norm: bool = True) -> None:
        super().__init__()
        layers = [torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8) if norm else torch.nn.Identity()]
        layers += [torch.nn.ReLU(), torch.nn.Dropout(dropout)]
        self.net = torch.nn.Sequential(*layers, torch.nn.Linear(8, 1))
        self.losses: list[torch.Tensor] = []
        self.validated: list[tuple[int, dict[str, torch.Tensor]]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.losses.append(loss.detach().clone())
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if batch_idx == 0 and not self.trainer.sanity_checking:
            self.validated.append((self.trainer.global_step, {k: v.clone() for k, v in self.state_dict().items()}))
        self.log("val_seen", float(batch_idx))  # (a validation metric: the step Lightning logs it at)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.02, momentum=0.9)


class RankDump(L.Callback):
    """Saves each rank's final weights and statistics (for the multi-process test)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        torch.save(pl_module.state_dict(), Path(self.directory) / f"rank{trainer.global_rank}.pt")


class Probe(L.Callback):
    """Snapshots what a recalibration must not touch, at the hooks PreciseBN uses."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def _snap(self, trainer: Any, pl_module: Any, hook: str) -> None:
        params = list(pl_module.parameters())
        self.events.append(
            {
                "hook": hook,
                "step": trainer.global_step,
                "grads": [None if p.grad is None else p.grad.clone() for p in params],
                "params": [p.detach().clone() for p in params],
                "optimizer": copy.deepcopy(trainer.optimizers[0].state_dict()),
                "flags": [m.training for m in pl_module.modules()],
                "grad_enabled": torch.is_grad_enabled(),
                "inference": torch.is_inference_mode_enabled(),
                "rng": torch.get_rng_state(),
                "stats": pl_module.net[1].running_mean.clone(),
            }
        )

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._snap(trainer, pl_module, "validation")

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        self._snap(trainer, pl_module, "checkpoint")


def make_trainer(tmp_path: Path, **kwargs: Any) -> Any:
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": 3,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "default_root_dir": tmp_path,
    }
    options.update(kwargs)
    return L.Trainer(**options)


def precision_errors(float64_truth: Any, state: dict[str, torch.Tensor], x: torch.Tensor) -> tuple[float, float]:
    """Largest |mean - truth|/σ and |var - truth|/var of the statistics in ``state``,
    against the float64 truth of the inputs the weights in ``state`` give on ``x``."""
    net = TinyNet()
    net.load_state_dict(state)
    truth = float64_truth(net, [x])[BN]
    mean = state[f"{BN}.running_mean"].double()
    var = state[f"{BN}.running_var"].double()
    return (
        float(((mean - truth.mean).abs() / truth.var.sqrt()).max()),
        float(((var - truth.var).abs() / truth.var).max()),
    )


def assert_precise(float64_truth: Any, state: dict[str, torch.Tensor], x: torch.Tensor) -> None:
    mean_error, var_error = precision_errors(float64_truth, state, x)
    assert mean_error < 1e-5 and var_error < 1e-5, (mean_error, var_error)


def logged_steps(path: Path, key: str = "precisebn/seconds") -> list[int]:
    with open(path / "metrics.csv") as f:
        return [int(row["step"]) for row in csv.DictReader(f) if row.get(key)]


def test_before_validation_and_checkpoint_once_per_step(tmp_path: Path, float64_truth: Any) -> None:
    x, y = make_data()
    precise = PreciseBN(num_samples="all")
    by_steps = ModelCheckpoint(dirpath=tmp_path / "steps", every_n_train_steps=3, save_top_k=-1)
    by_epochs = ModelCheckpoint(dirpath=tmp_path / "epochs", save_top_k=-1)  # at the end of each validation
    logger = CSVLogger(tmp_path, name="log", version=0)
    model = TinyNet()
    trainer = make_trainer(tmp_path, callbacks=[precise, by_steps, by_epochs], enable_checkpointing=True, logger=logger)
    trainer.fit(model, loader(x, y), loader(x[:32], y[:32]))  # 4 steps per epoch, 12 in all

    # Checkpoints at steps 3, 6, 9, 12 (before validation at 12) and after each validation
    # (4, 8, 12); validations at 4, 8, 12: six distinct steps, six computations.
    assert precise.computations == 6
    # logged at Lightning's own logging step (one behind global_step in an epoch's last batch), so that the
    # figures of the computations for validation share a row's step with that validation's metrics (probe 41:
    # they were logged at global_step, one after): validation metrics at 3, 7, 11
    assert logged_steps(tmp_path / "log" / "version_0") == [2, 3, 5, 7, 8, 11]
    assert logged_steps(tmp_path / "log" / "version_0", "val_seen") == [3, 7, 11]
    assert precise.last_step == 12
    assert [step for step, _ in model.validated] == [4, 8, 12]
    for _, state in model.validated:
        assert_precise(float64_truth, state, x)
    files = sorted((tmp_path / "steps").glob("*.ckpt")) + sorted((tmp_path / "epochs").glob("*.ckpt"))
    assert len(files) == 7
    for path in files:
        checkpoint = torch.load(path, weights_only=False)
        assert_precise(float64_truth, checkpoint["state_dict"], x)
        assert checkpoint["callbacks"][precise.state_key]["last_step"] == checkpoint["global_step"]
    with open(tmp_path / "log" / "version_0" / "metrics.csv") as f:
        row = next(r for r in csv.DictReader(f) if r.get("precisebn/seconds"))
    assert float(row["precisebn/samples"]) == 64
    assert float(row["precisebn/mean_shift"]) > 0 and float(row["precisebn/var_ratio"]) > 0


@pytest.mark.parametrize("shuffling", ["global generator", "loader's own generator"])
def test_training_is_untouched(tmp_path: Path, shuffling: str) -> None:
    x, y = make_data()

    def run(callbacks: list[Any], directory: Path) -> TinyNet:
        torch.manual_seed(0)
        model = TinyNet(dropout=0.5)
        every3 = ModelCheckpoint(dirpath=directory, every_n_train_steps=3, save_top_k=-1)
        trainer = make_trainer(directory, max_epochs=2, callbacks=[*callbacks, every3], enable_checkpointing=True)
        own = torch.Generator().manual_seed(0) if shuffling == "loader's own generator" else None
        trainer.fit(model, loader(x, y, batch_size=8, shuffle=True, generator=own), loader(x[:16], y[:16]))
        return model

    before, after = Probe(), Probe()
    precise = PreciseBN(num_samples=40, mode="train")  # dropout active, shuffled loader: both draw random numbers
    with_callback = run([before, precise, after], tmp_path / "with")
    without = run([], tmp_path / "without")

    assert len(with_callback.losses) == 16
    assert torch.equal(torch.stack(with_callback.losses), torch.stack(without.losses))
    for p, q in zip(with_callback.parameters(), without.parameters()):
        assert torch.equal(p, q)
    assert len(before.events) == len(after.events) > precise.computations >= 6
    recomputed = 0
    for b, a in zip(before.events, after.events):
        assert b["hook"] == a["hook"] and b["step"] == a["step"]
        assert len(b["grads"]) == len(a["grads"]) and all(
            (g is None and h is None) or torch.equal(g, h) for g, h in zip(b["grads"], a["grads"])
        )
        assert all(torch.equal(p, q) for p, q in zip(b["params"], a["params"]))
        assert b["optimizer"]["param_groups"] == a["optimizer"]["param_groups"]
        for i, s in b["optimizer"]["state"].items():
            assert torch.equal(s["momentum_buffer"], a["optimizer"]["state"][i]["momentum_buffer"])
        assert b["flags"] == a["flags"]
        assert (b["grad_enabled"], b["inference"]) == (a["grad_enabled"], a["inference"])
        assert torch.equal(b["rng"], a["rng"])
        recomputed += not torch.equal(b["stats"], a["stats"])
    assert recomputed == precise.computations  # the probes did see every computation
    assert {e["hook"] for e in before.events} == {"validation", "checkpoint"}
    assert any(all(e["flags"]) for e in before.events) and any(not e["flags"][0] for e in before.events)


def test_resumes_from_a_checkpoint(tmp_path: Path, float64_truth: Any) -> None:
    x, y = make_data()
    first = PreciseBN(num_samples="all")
    checkpoints = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    make_trainer(tmp_path, max_epochs=2, callbacks=[first, checkpoints], enable_checkpointing=True).fit(
        TinyNet(), loader(x, y), loader(x[:16], y[:16])
    )
    assert (first.computations, first.last_step) == (2, 8)

    class AtStart(L.Callback):
        seen: tuple[Any, ...] = ()

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            AtStart.seen = (resumed.last_step, resumed.computations)

    resumed = PreciseBN(num_samples="all")
    model = TinyNet()
    checkpoints = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    callbacks = [resumed, AtStart(), checkpoints]
    trainer = make_trainer(tmp_path, max_epochs=3, callbacks=callbacks, enable_checkpointing=True)
    trainer.fit(model, loader(x, y), loader(x[:16], y[:16]), ckpt_path=tmp_path / "last.ckpt")
    assert AtStart.seen == (8, 2)
    assert (resumed.computations, resumed.last_step) == (3, 12)
    assert [step for step, _ in model.validated] == [12]
    assert_precise(float64_truth, model.validated[0][1], x)
    last = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert last["global_step"] == 12
    assert_precise(float64_truth, last["state_dict"], x)


def test_two_callbacks_in_one_trainer_keep_their_own_state(tmp_path: Path, float64_truth: Any) -> None:
    """Two PreciseBN with different schedules in one Trainer: Lightning refused the Trainer ("more than one
    stateful callback of type PreciseBN", one state key) before. Each now keeps its own state in the
    checkpoint and gets it back on resume; a checkpoint of 0.1.0 (the state under the class name) still
    resumes."""
    x, y = make_data()

    def pair() -> tuple[PreciseBN, PreciseBN]:
        return PreciseBN(num_samples="all"), PreciseBN(
            num_samples=32, on_validation=False, on_checkpoint=False, every_n_epochs=2
        )

    first, second = pair()
    checkpoints = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    trainer = make_trainer(tmp_path, max_epochs=2, callbacks=[first, second, checkpoints], enable_checkpointing=True)
    trainer.fit(TinyNet(), loader(x, y), loader(x[:16], y[:16]))
    # At step 8 the second (every 2 epochs, on 32 samples) rewrites the layer after the first computed for the
    # validation; the first, before the checkpoint at that step, sees statistics that are no longer its own and
    # computes again (it took the second's as current before, probe 42): the checkpoint holds the first's.
    assert (first.computations, first.last_step) == (3, 8)
    assert (second.computations, second.last_step) == (1, 8)
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert first.state_key != second.state_key and {first.state_key, second.state_key} <= set(saved["callbacks"])
    assert_precise(float64_truth, saved["state_dict"], x)

    resumed = pair()
    trainer = make_trainer(tmp_path / "again", max_epochs=2, callbacks=list(resumed))
    trainer.fit(TinyNet(), loader(x, y), loader(x[:16], y[:16]), ckpt_path=tmp_path / "last.ckpt")
    assert [(c.computations, c.last_step) for c in resumed] == [(3, 8), (1, 8)]

    old = torch.load(tmp_path / "last.ckpt", weights_only=False)  # as 0.1.0 saved it: one callback, its class name
    old["callbacks"] = {"PreciseBN": old["callbacks"][first.state_key]}
    torch.save(old, tmp_path / "old.ckpt")
    alone = PreciseBN(num_samples="all")
    make_trainer(tmp_path / "old", max_epochs=2, callbacks=[alone]).fit(
        TinyNet(), loader(x, y), loader(x[:16], y[:16]), ckpt_path=tmp_path / "old.ckpt"
    )
    assert (alone.computations, alone.last_step) == (3, 8)
    both = pair()  # (0.1.0 could hold only one: which it was is unknown, so neither takes it)
    make_trainer(tmp_path / "old2", max_epochs=2, callbacks=list(both)).fit(
        TinyNet(), loader(x, y), loader(x[:16], y[:16]), ckpt_path=tmp_path / "old.ckpt"
    )
    assert [(c.computations, c.last_step) for c in both] == [(0, None), (0, None)]


def test_callbacks_differing_in_functions_types_or_data_have_their_own_state_keys(tmp_path: Path) -> None:
    """The state key tells apart layers= predicates (each lambda by where it is defined), collections of
    types, and data= loaders of other lengths (a probe: all "<lambda>", "list"... before, and Lightning
    refused the Trainer); the same options give the same key (a resumed run finds its state)."""
    x, y = make_data()

    def make(**options: Any) -> list[PreciseBN]:
        return [PreciseBN(num_samples="all", every_n_epochs=1, **o) for o in options.values()]

    pairs = [
        make(a={"layers": lambda n, m: n == "net.1"}, b={"layers": lambda n, m: n != "net.1"}),
        make(a={"layers": [torch.nn.BatchNorm1d]}, b={"layers": [torch.nn.SyncBatchNorm]}),
        make(a={"data": loader(x, y)}, b={"data": loader(x[:32], y[:32])}),
        make(a={"forward": lambda m, b: m(b[0])}, b={"forward": lambda m, b: m(b[0] * 1)}),
    ]
    for pair in pairs:
        assert pair[0].state_key != pair[1].state_key
        make_trainer(tmp_path, callbacks=pair)  # (Lightning refuses two stateful callbacks with one key)
    same = [PreciseBN(data=loader(x, y), layers=[torch.nn.BatchNorm1d]) for _ in range(2)]
    assert same[0].state_key == same[1].state_key


def test_schedules_and_gradient_accumulation(tmp_path: Path, float64_truth: Any) -> None:
    x, y = make_data()
    # 8 batches of 8, 2 per optimizer step: steps 1..4. A computation after every optimizer
    # step (batches 2, 4, 6, 8); validations after batches 3 and 6. Batch 3 ran a training
    # forward pass at step 1 without stepping, which moved the running statistics, so the
    # validation after it computes again; the one after batch 6 shares step 3's computation,
    # and the epoch end at step 4 shares step 4's.
    precise = PreciseBN(num_samples="all", every_n_train_steps=1, every_n_epochs=1, on_checkpoint=False)
    model = TinyNet()
    trainer = make_trainer(tmp_path, max_epochs=1, callbacks=[precise], accumulate_grad_batches=2, val_check_interval=3)
    trainer.fit(model, loader(x, y, batch_size=8), loader(x[:16], y[:16]))
    assert trainer.global_step == 4
    assert [step for step, _ in model.validated] == [1, 3]
    assert precise.computations == 5

    every2 = PreciseBN(num_samples="all", every_n_epochs=2, on_validation=False, on_checkpoint=False)
    model = TinyNet()
    make_trainer(tmp_path, max_epochs=4, callbacks=[every2]).fit(model, loader(x, y))  # no validation
    assert (every2.computations, every2.last_step) == (2, 16)
    assert_precise(float64_truth, model.state_dict(), x)
    for _, state in model.validated:
        assert_precise(float64_truth, state, x)


def test_user_data_forward_and_batch_transfer(tmp_path: Path, float64_truth: Any) -> None:
    x, y = make_data()

    class DictNet(TinyNet):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return torch.nn.functional.mse_loss(self(batch["x"]), batch["y"])

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            super().validation_step((batch["x"], batch["y"]), batch_idx)

        def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
            return {**batch, "x": batch["x"] * 2}  # applied to training and to precisebn's batches alike

    held_out = [{"x": x[i : i + 10], "y": y[i : i + 10]} for i in range(0, 40, 10)]
    precise = PreciseBN(data=held_out, forward=lambda module, batch: module(batch["x"]), num_samples="all")
    model = DictNet()
    records = [{"x": x[i], "y": y[i]} for i in range(64)]
    train = torch.utils.data.DataLoader(records, batch_size=16)  # collated into {"x": ..., "y": ...}
    make_trainer(tmp_path, max_epochs=1, callbacks=[precise]).fit(model, train, train)
    assert precise.computations == 1 and precise.last_report.samples == 40
    assert_precise(float64_truth, model.validated[0][1], 2 * x[:40])
    mean_error, _ = precision_errors(float64_truth, model.validated[0][1], 2 * x)
    assert mean_error > 1e-3  # the held-out data, not the training data, was used


def test_options_are_checked_early(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="every_n_epochs"):
        PreciseBN(every_n_epochs=0)
    with pytest.raises(InvalidArgumentError, match="mode"):
        PreciseBN(mode="eval")
    with pytest.raises(InvalidArgumentError, match="one-shot iterator"):
        PreciseBN(data=(b for b in [torch.zeros(2, 4)]))
    with pytest.raises(InvalidArgumentError, match="swa_epoch_start"):
        PreciseWeightAveraging(swa_epoch_start=-1)
    # Resuming from a checkpoint whose entry for the callback is not what it saved.
    with pytest.raises(InvalidArgumentError, match="last_step"):
        PreciseBN().load_state_dict({"last_step": 2.5, "stale": False, "computations": 1})
    with pytest.raises(InvalidArgumentError, match="unknown key"):
        PreciseBN().load_state_dict({"latest_update_step": 4})
    with pytest.raises(InvalidArgumentError, match="got a list"):
        PreciseWeightAveraging().load_state_dict({"latest_update_step": 4, "precisebn": [4, False, 1]})

    class TwoLoaders(TinyNet):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return super().training_step(batch["a"], batch_idx)

    x, y = make_data(16)
    trainer = make_trainer(tmp_path, max_epochs=1, callbacks=[PreciseBN(num_samples="all")], limit_val_batches=1)
    with pytest.raises(InvalidArgumentError, match=r"training data is a \w+ of 2 dataloader\(s\), not one"):
        trainer.fit(TwoLoaders(), {"a": loader(x, y), "b": loader(x, y)}, loader(x, y))

    weights_only = ModelCheckpoint(dirpath=tmp_path, save_weights_only=True)
    trainer = make_trainer(tmp_path, max_steps=1, callbacks=[PreciseBN(), weights_only], enable_checkpointing=True)
    with pytest.warns(PreciseBNWarning, match="save_weights_only"):
        trainer.fit(TinyNet(), loader(x, y))


def test_no_computation_for_a_checkpoint_saved_on_an_exception(tmp_path: Path) -> None:
    class Failing(TinyNet):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if self.trainer.global_step == 3:
                raise RuntimeError("diverged")
            return super().training_step(batch, batch_idx)

    x, y = make_data()
    precise = PreciseBN(num_samples="all")
    on_exception = ModelCheckpoint(dirpath=tmp_path, save_on_exception=True)
    trainer = make_trainer(tmp_path, callbacks=[precise, on_exception], enable_checkpointing=True)
    with pytest.raises(RuntimeError, match="diverged"):
        trainer.fit(Failing(), loader(x, y))
    assert len(list(tmp_path.glob("*.ckpt"))) == 1  # the exception's checkpoint was written...
    assert precise.computations == 0  # ...without forward passes on the failing run


@pytest.mark.parametrize(("averaging", "checkpointing"), [("swa", True), ("swa", False), ("ema", True)])
def test_precise_weight_averaging(tmp_path: Path, float64_truth: Any, averaging: str, checkpointing: bool) -> None:
    x, y = make_data()

    class Stream(torch.utils.data.IterableDataset):  # StochasticWeightAveraging refuses these
        def __iter__(self) -> Any:
            return iter(zip(x, y))

    if averaging == "swa":
        callback = PreciseWeightAveraging(num_samples="all", swa_epoch_start=1)
    else:
        callback = PreciseWeightAveraging(num_samples="all", multi_avg_fn=get_ema_multi_avg_fn(0.5))
    checkpoints = [ModelCheckpoint(dirpath=tmp_path, save_top_k=-1)] if checkpointing else []
    model = TinyNet()
    callbacks = [callback, *checkpoints]
    trainer = make_trainer(tmp_path, max_epochs=3, callbacks=callbacks, enable_checkpointing=checkpointing)
    trainer.fit(model, torch.utils.data.DataLoader(Stream(), batch_size=16), loader(x[:16], y[:16]))

    assert trainer.global_step == 12 and trainer.current_epoch == 3  # no extra epoch
    # SWA: the first average is taken at the end of epoch 1, after its validation, so the
    # validations see 0, 0 and 1 averaged models: the first two run on the live model (as
    # with Lightning's StochasticWeightAveraging) and cost nothing; training ends with 2
    # averaged models. EMA: a new average at every step, one computation per validation,
    # and the end of training shares the last one.
    live = 2 if averaging == "swa" else 0
    assert callback.computations == 3 - live // 2
    averaged = callback.averaged_model.module
    for p, q in zip(model.parameters(), averaged.parameters()):
        assert torch.equal(p, q)
    assert_precise(float64_truth, model.state_dict(), x)
    assert len(model.validated) == 3
    for _, state in model.validated[live:]:  # validation ran on the averaged weights
        assert_precise(float64_truth, state, x)
    if averaging == "swa":
        assert not torch.equal(model.validated[0][1]["net.0.weight"], model.validated[1][1]["net.0.weight"])
    files = sorted(tmp_path.glob("*.ckpt"))
    assert len(files) == (3 if checkpointing else 0)
    for i, path in enumerate(files):  # saved at the end of each epoch, after its average
        state = torch.load(path, weights_only=False)["state_dict"]
        if i < live // 2:  # no average yet (epoch 0): the live model, which validation saw
            assert state.keys() == model.validated[i][1].keys()
            assert all(torch.equal(v, model.validated[i][1][k]) for k, v in state.items())
        else:
            assert_precise(float64_truth, state, x)  # the averaged weights


def test_legacy_pytorch_lightning_package(tmp_path: Path, float64_truth: Any) -> None:
    import pytorch_lightning as pl  # installed with lightning (which depends on it)

    from precisebn.integrations.pytorch_lightning import PreciseBN as LegacyPreciseBN

    class LegacyNet(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = TinyNet().net
            self.validated: list[dict[str, torch.Tensor]] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x).squeeze(1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return torch.nn.functional.mse_loss(self(batch[0]), batch[1])

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            if batch_idx == 0 and not self.trainer.sanity_checking:
                self.validated.append({k: v.clone() for k, v in self.state_dict().items()})

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.02)

    x, y = make_data()
    precise = LegacyPreciseBN(num_samples="all")
    model = LegacyNet()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=2,
        callbacks=[precise],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, loader(x, y), loader(x[:16], y[:16]))
    assert precise.computations == 2 and len(model.validated) == 2
    for state in model.validated:
        assert_precise(float64_truth, state, x)


def test_missing_lightning_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("lightning", "lightning.pytorch", "precisebn.integrations.lightning"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setitem(sys.modules, "lightning", None)  # makes `import lightning` raise ImportError
    with pytest.raises(MissingDependencyError, match=r"pip install 'precisebn\[lightning\]'"):
        importlib.import_module("precisebn.integrations.lightning")
    monkeypatch.delitem(sys.modules, "precisebn.integrations.pytorch_lightning", raising=False)
    monkeypatch.setitem(sys.modules, "pytorch_lightning", None)
    with pytest.raises(MissingDependencyError, match="pip install pytorch-lightning"):
        importlib.import_module("precisebn.integrations.pytorch_lightning")


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_ddp_spawn_two_ranks_identical_union_statistics(tmp_path: Path, float64_truth: Any) -> None:
    x, y = make_data(128)  # 64 samples, 4 steps of 16 per rank
    trainer = make_trainer(
        tmp_path,
        strategy="ddp_spawn",
        devices=2,
        max_epochs=1,
        num_sanity_val_steps=0,
        callbacks=[PreciseBN(num_samples="all"), RankDump(str(tmp_path))],
    )
    trainer.fit(TinyNet(), loader(x, y), loader(x[:32], y[:32]))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    assert ranks[0].keys() == ranks[1].keys()
    for key in ranks[0]:
        assert torch.equal(ranks[0][key], ranks[1][key]), key
    assert_precise(float64_truth, ranks[0], x)  # the union of both ranks' shards
    mean_error, _ = precision_errors(float64_truth, ranks[0], x[::2])
    assert mean_error > 1e-4  # not one rank's shard alone


def test_swa_validates_the_live_model_until_the_first_average(tmp_path: Path, float64_truth: Any) -> None:
    x, y = make_data()

    def run(callbacks: list[Any], max_epochs: int = 4) -> TinyNet:
        torch.manual_seed(0)
        model = TinyNet()
        trainer = make_trainer(tmp_path, max_epochs=max_epochs, callbacks=callbacks)
        trainer.fit(model, loader(x, y), loader(x[:16], y[:16]))
        return model

    plain = run([])  # validated[i]: the weights and statistics at the end of epoch i
    swa = PreciseWeightAveraging(num_samples="all", swa_epoch_start=2)
    averaged = run([swa])
    assert [step for step, _ in averaged.validated] == [4, 8, 12, 16]

    def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # The validations of epochs 0-2 come before the first average (the end of epoch 2):
    # they see the live model, weights and statistics, exactly as without the callback.
    for i in range(3):
        assert same(averaged.validated[i][1], plain.validated[i][1]), i
    # Epoch 3's validation: the average of one model (the weights at the end of epoch 2)
    # with precise statistics.
    weights = [k for k, _ in averaged.named_parameters()]
    assert all(torch.equal(averaged.validated[3][1][k], plain.validated[2][1][k]) for k in weights)
    assert_precise(float64_truth, averaged.validated[3][1], x)
    # After training: the mean of the weights at the ends of epochs 2 and 3, precise statistics.
    for k in weights:
        mean = (plain.validated[2][1][k].double() + plain.validated[3][1][k].double()) / 2
        assert torch.allclose(averaged.state_dict()[k].double(), mean, rtol=0, atol=1e-6), k
    assert_precise(float64_truth, averaged.state_dict(), x)
    assert swa.computations == 2  # epoch 3's validation and the end of training; nothing for the initial copy

    # Training that ends before the first average keeps its trained weights, and says so.
    late = PreciseWeightAveraging(num_samples="all", swa_epoch_start=5)
    with pytest.warns(PreciseBNWarning, match="ended after 2 epochs before any average"):
        short = run([late], max_epochs=2)
    assert same(short.state_dict(), plain.validated[1][1])
    assert late.computations == 0


def test_lightning_swa_epoch_start_k_is_precise_swa_epoch_start_k_minus_2(tmp_path: Path) -> None:
    """The README's mapping, against the installed Lightning: its ``swa_epoch_start=k``
    (1-based) averages the weights at the start of epochs k-1 ... max_epochs-1 (0-based),
    i.e. at the ends of epochs k-2 ... max_epochs-2; ``PreciseWeightAveraging`` with
    ``swa_epoch_start=k-2`` averages the ends of epochs k-2 ... max_epochs-1 (one more:
    the final weights)."""
    x, y = make_data()

    class Ends(L.Callback):
        def __init__(self) -> None:
            self.weights: list[dict[str, torch.Tensor]] = []

        def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
            self.weights.append({k: p.detach().double().clone() for k, p in pl_module.named_parameters()})

    def run(model: TinyNet, callback: Any) -> tuple[TinyNet, list[dict[str, torch.Tensor]]]:
        ends = Ends()  # before the averaging callback: the live weights
        trainer = make_trainer(tmp_path, max_epochs=6, callbacks=[ends, callback], num_sanity_val_steps=0)
        trainer.fit(model, loader(x, y))
        return model, ends.weights

    def assert_mean_of(model: TinyNet, ends: list[dict[str, torch.Tensor]]) -> None:
        for k, p in model.named_parameters():
            mean = torch.stack([end[k] for end in ends]).mean(0)
            assert torch.allclose(p.double(), mean, rtol=0, atol=1e-6), k

    # Lightning's SWA adds an epoch to models with BatchNorm (and moves the weights during
    # it): a model without BatchNorm shows which weights it averages.
    model, ends = run(TinyNet(norm=False), StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=4))
    assert len(ends) == 6
    assert_mean_of(model, ends[2:5])
    model, ends = run(TinyNet(), PreciseWeightAveraging(num_samples="all", swa_epoch_start=2))
    assert len(ends) == 6
    assert_mean_of(model, ends[2:6])


@pytest.mark.parametrize("averaging", [False, True])
def test_a_model_without_normalization_layers_trains_with_one_warning(tmp_path: Path, averaging: bool) -> None:
    x, y = make_data()

    def run(callback: Any, directory: Path) -> TinyNet:
        torch.manual_seed(0)
        model = TinyNet(norm=False)
        every3 = ModelCheckpoint(dirpath=directory, every_n_train_steps=3, save_top_k=-1)
        callbacks = [callback, every3]
        trainer = make_trainer(directory, max_epochs=2, callbacks=callbacks, enable_checkpointing=True)
        trainer.fit(model, loader(x, y), loader(x[:16], y[:16]))
        return model

    if averaging:  # compared with Lightning's own WeightAveraging
        ours, reference = PreciseWeightAveraging(num_samples="all"), WeightAveraging(use_buffers=False)
    else:  # compared with no callback
        ours, reference = PreciseBN(num_samples="all", every_n_train_steps=2), L.Callback()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with_ours = run(ours, tmp_path / "ours")
    messages = [str(w.message) for w in caught if issubclass(w.category, PreciseBNWarning)]
    assert len(messages) == 1 and "no normalization layer" in messages[0], messages
    assert ours.computations == 0 and ours.last_report is None
    expected = run(reference, tmp_path / "reference")
    assert torch.equal(torch.stack(with_ours.losses), torch.stack(expected.losses))
    assert len(with_ours.validated) == len(expected.validated) == 2
    for (step, state), (expected_step, expected_state) in zip(with_ours.validated, expected.validated):
        assert step == expected_step and all(torch.equal(v, expected_state[k]) for k, v in state.items())
    for p, q in zip(with_ours.parameters(), expected.parameters()):
        assert torch.equal(p, q)
    files = sorted(p.name for p in (tmp_path / "ours").glob("*.ckpt"))
    assert files == sorted(p.name for p in (tmp_path / "reference").glob("*.ckpt")) and len(files) == 2


class NormFirst(L.LightningModule):
    """A BatchNorm1d with momentum 0 on the inputs: its statistics stay the prior set by the test while
    training, and its inputs are the data whatever the weights."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(4, momentum=0.0)
        self.head = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x)).squeeze(1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        pass

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.02)


@pytest.mark.parametrize("adapt", ["both", "var"])
def test_prior_and_adapt_reach_each_computation(tmp_path: Path, adapt: str) -> None:
    x, y = make_data()
    model = NormFirst()
    before = set_statistics(model.norm, [-2.0, 4.0, 1.0, 0.0], [0.5, 9.0, 2.0, 0.1])
    precise = PreciseBN(num_samples="all", prior=24, adapt=adapt)
    trainer = make_trainer(tmp_path, max_epochs=1, callbacks=[precise], num_sanity_val_steps=0)
    trainer.fit(model, loader(x, y), loader(x[:16], y[:16]))
    assert precise.computations == 1  # before the validation
    assert_adapted(model.norm, before, 24, x.double().t(), adapt)  # one value per sample and channel


class FrozenBackbone(TinyNet):
    """``TinyNet`` with ``conftest.NormEval`` as its net (a backbone BatchNorm kept in eval mode while training)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = NormEval()


@pytest.mark.parametrize("frozen", ["skip", "include"])
def test_layers_frozen_for_training_are_left_as_they_are(tmp_path: Path, frozen: str) -> None:
    x, y = make_data()

    def run(callbacks: list[Any], directory: Path) -> FrozenBackbone:
        torch.manual_seed(0)
        model = FrozenBackbone()
        make_trainer(directory, max_epochs=2, callbacks=callbacks).fit(model, loader(x, y), loader(x[:16], y[:16]))
        return model

    precise = PreciseBN(num_samples="all", frozen=frozen)
    model = run([precise], tmp_path / "with")
    reference = run([], tmp_path / "without")
    assert precise.computations == 2 and precise.frozen == frozen
    same = torch.equal(torch.stack(model.losses), torch.stack(reference.losses))
    assert_frozen_run(frozen, same, model, reference, [x], prefix="net.")


class FrozenAtStep2(TinyNet):
    """``TinyNet`` with ``conftest.NormEval`` as its net, whose backbone BatchNorm its own ``on_train_batch_end``
    freezes at step 2: after PreciseBN's ``on_train_batch_end`` of that step (callbacks run first)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = NormEval(frozen=False)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.trainer.global_step == 2:
            self.net.frozen = True
            self.net.body[1].eval()


def test_a_layer_frozen_by_a_later_hook_of_the_step_a_validation_follows_is_left_as_it_is(tmp_path: Path) -> None:
    """Found by a probe: Lightning puts the module in eval mode before on_validation_start, so the computation before
    that validation saw no modes of training, and the layer frozen after PreciseBN's last look was recalibrated (the
    losses then differed from a run without it). The modes Lightning recorded before eval() count."""
    x, y = make_data()

    def run(callbacks: list[Any], directory: Path) -> FrozenAtStep2:
        torch.manual_seed(0)
        model = FrozenAtStep2()
        trainer = make_trainer(directory, max_epochs=1, val_check_interval=2, callbacks=callbacks)
        trainer.fit(model, loader(x, y), loader(x[:16], y[:16]))
        return model

    precise = PreciseBN(num_samples="all")
    model = run([precise], tmp_path / "with")
    reference = run([], tmp_path / "without")
    assert precise.computations == 2  # at steps 2 and 4
    same = torch.equal(torch.stack(model.losses), torch.stack(reference.losses))
    assert_frozen_run("skip", same, model, reference, [x], prefix="net.")


def test_the_averaged_copy_keeps_the_layers_frozen_in_the_module(tmp_path: Path) -> None:
    x, y = make_data()
    torch.manual_seed(0)
    model = FrozenBackbone()
    initial = {k: v.clone() for k, v in model.net.body[1].named_buffers()}
    callback = PreciseWeightAveraging(num_samples="all", multi_avg_fn=get_ema_multi_avg_fn(0.5))
    make_trainer(tmp_path, max_epochs=2, callbacks=[callback]).fit(model, loader(x, y), loader(x[:16], y[:16]))
    assert callback.computations == 2
    # at the end of training the averaged weights and statistics were copied into the module
    for key, value in model.net.body[1].named_buffers():
        assert torch.equal(value, initial[key]), key
    truth = compute_truth(model, [x], select=lambda name, m: name == "net.head.1")["net.head.1"]
    assert max_rel_error(model.net.head[1].running_mean, truth.mean, truth.var.sqrt()) < 1e-5
    assert max_rel_error(model.net.head[1].running_var, truth.var) < 1e-5


@pytest.mark.parametrize("precision", ["64-true", "bf16-true"])
def test_true_precision_batches_are_converted_as_training_batches(tmp_path: Path, precision: str) -> None:
    """The batches reached a float64/bf16 module as float32 (a raw dtype error at the first validation)."""
    x, y = make_data()
    precise = PreciseBN(num_samples="all")
    trainer = make_trainer(tmp_path, max_epochs=1, precision=precision, callbacks=[precise])
    model = TinyNet()
    trainer.fit(model, loader(x, y), loader(x[:16], y[:16]))
    assert precise.computations == 1
    dtype = torch.float64 if precision == "64-true" else torch.bfloat16
    assert model.net[1].running_var.dtype == dtype
    truth = compute_truth(model, [x.to(dtype)])[BN]
    tolerance = 1e-9 if dtype == torch.float64 else 1e-2
    assert max_rel_error(model.net[1].running_var, truth.var) < tolerance


def test_batches_are_transferred_in_the_training_stage_whatever_triggers_the_computation(
    tmp_path: Path, float64_truth: Any
) -> None:
    """Found by a probe: augmentation in on_after_batch_transfer under `if self.trainer.training` (Lightning's
    documented place for it) applied to a computation triggered by a checkpoint, not to one triggered before
    validation (the trainer validating then): the statistics validation ran with were those of un-augmented
    batches, 0.68 σ off here; a checkpoint at the same step held the others."""
    x, y = make_data()
    stages: list[tuple[bool, bool]] = []

    class Augmented(TinyNet):
        def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
            stages.append((self.trainer.training, self.trainer.validating))
            if self.trainer.training:
                return batch[0] * 2 + 1, batch[1]
            return batch

    precise = PreciseBN(num_samples="all")
    model = Augmented()
    make_trainer(tmp_path, max_epochs=1, callbacks=[precise]).fit(model, loader(x, y), loader(x, y))
    assert precise.computations == 1
    assert_precise(float64_truth, model.validated[0][1], 2 * x + 1)
    assert (False, True) in stages  # (validation batches themselves: not augmented, not changed by precisebn)


@pytest.mark.parametrize("callback", ["PreciseBN", "PreciseWeightAveraging"])
def test_several_training_loaders_without_data_are_refused_before_training(tmp_path: Path, callback: str) -> None:
    """Found by a probe: with a dict of training dataloaders and no data=, the refusal came at the first
    validation, after a whole epoch of training, and ended fit."""
    from precisebn.errors import InvalidArgumentError
    from precisebn.integrations.lightning import PreciseWeightAveraging

    x, y = make_data()
    model = TinyNet()
    precise = PreciseBN(num_samples="all") if callback == "PreciseBN" else PreciseWeightAveraging()
    trainer = make_trainer(tmp_path, max_epochs=1, callbacks=[precise])
    with pytest.raises(InvalidArgumentError, match=r"training data is a \w+ of 2 dataloader\(s\), not one"):
        trainer.fit(model, {"a": loader(x, y), "b": loader(x, y)}, loader(x, y))
    assert model.losses == []


class WithoutForward(TinyNet):
    """TinyNet whose steps call its layers directly, without a forward() of its own (Lightning does not require one)."""

    forward = L.LightningModule.forward  # (TinyNet's own taken away: the base class's, which raises)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x).squeeze(1), y)
        self.losses.append(loss.detach().clone())
        return loss


@pytest.mark.parametrize("callback", ["PreciseBN", "PreciseWeightAveraging"])
def test_a_module_without_forward_is_refused_before_training_unless_forward_is_given(
    tmp_path: Path, float64_truth: Any, callback: str
) -> None:
    """Found by probe 45: a LightningModule without a forward() of its own trained a whole epoch, and fit then ended
    at the first validation with Lightning's raw NotImplementedError ("missing the required forward function")."""
    x, y = make_data()
    model = WithoutForward()
    make = PreciseBN if callback == "PreciseBN" else PreciseWeightAveraging
    trainer = make_trainer(tmp_path, max_epochs=1, callbacks=[make(num_samples="all")])
    with pytest.raises(InvalidArgumentError, match="defines no forward"):
        trainer.fit(model, loader(x, y), loader(x, y))
    assert model.losses == []
    model = WithoutForward()  # with forward=: trains and validates with precise statistics
    precise = make(num_samples="all", forward=lambda module, batch: module.net(batch[0]))
    make_trainer(tmp_path, max_epochs=1, callbacks=[precise]).fit(model, loader(x, y), loader(x, y))
    assert precise.computations == 1 and len(model.losses) == 4
    if callback == "PreciseBN":
        assert_precise(float64_truth, model.validated[0][1], x)


@pytest.mark.parametrize("precision", ["64-true", "bf16-true"])
def test_precise_weight_averaging_under_true_precision(tmp_path: Path, float64_truth: Any, precision: str) -> None:
    """Found by a probe: Lightning builds the averaged copy before a "64-true"/"bf16-true" precision plugin
    converts the module, so the copy stays float32 while batches are cast to the module's dtype: the first
    validation after an average died with a raw "mat1 and mat2 must have the same dtype". The copy is measured
    with the batches in its own dtype."""
    x, y = make_data()
    callback = PreciseWeightAveraging(num_samples="all")  # (Lightning's EMA update itself fails across dtypes)
    model = TinyNet()
    trainer = make_trainer(tmp_path, max_epochs=2, callbacks=[callback], precision=precision)
    trainer.fit(model, loader(x, y), loader(x[:16], y[:16]))
    assert callback.computations >= 1
    averaged = callback.averaged_model.module
    assert next(averaged.parameters()).dtype == torch.float32
    if precision == "64-true":
        assert_precise(float64_truth, averaged.state_dict(), x)
    else:  # (batches rounded to bfloat16 by the training loop, computed under its forward context)
        errors = precision_errors(float64_truth, averaged.state_dict(), x.to(torch.bfloat16).float())
        assert max(errors) < 2e-2, errors  # bfloat16's own rounding (2⁻⁸ ≈ 4e-3 per value)


def test_figures_of_an_epoch_end_computation_share_the_epochs_metrics_step(tmp_path: Path) -> None:
    """Probe 41: the figures were logged at global_step, one step after Lightning's own metrics of the validation
    (see test_before_validation_and_checkpoint_once_per_step) and of the epoch they were computed for."""

    class EpochLogged(TinyNet):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            self.log("train_epoch_loss", loss, on_step=False, on_epoch=True)
            return loss

    x, y = make_data()
    for version, options in enumerate([{"every_n_epochs": 1}, {"on_checkpoint": True}]):  # (the second: a
        # checkpoint another callback saves at the epoch's end, without validation: a review of probe 41)
        precise = PreciseBN(num_samples="all", on_validation=False, **{"on_checkpoint": False, **options})
        logger = CSVLogger(tmp_path, name="log", version=version)
        saves = [ModelCheckpoint(dirpath=tmp_path / f"ckpt{version}")] if "on_checkpoint" in options else []
        trainer = make_trainer(
            tmp_path, callbacks=[precise, *saves], logger=logger, max_epochs=2, limit_val_batches=0,
            enable_checkpointing=bool(saves),
        )  # fmt: skip
        trainer.fit(EpochLogged(), loader(x, y))
        folder = tmp_path / "log" / f"version_{version}"
        assert logged_steps(folder) == logged_steps(folder, "train_epoch_loss") == [3, 7], options
        assert trainer.global_step == 8


def every_4_steps() -> PreciseBN:
    """A PreciseBN that computes every 4 steps only (one epoch of ``make_data`` in batches of 16)."""
    return PreciseBN(num_samples="all", every_n_train_steps=4, on_validation=False, on_checkpoint=False)


def assert_a_new_fit_computes_at_step_4(tmp_path: Path, float64_truth: Any, precise: PreciseBN, seed: int = 1) -> None:
    """A new model fit for one epoch (steps 1-4) with ``precise``: its scheduled computation at step 4 runs, and the
    model ends with the statistics of the float64 truth."""
    x, y = make_data()
    computations = precise.computations
    torch.manual_seed(seed)
    model = TinyNet()
    make_trainer(tmp_path, max_epochs=1, callbacks=[precise]).fit(model, loader(x, y))
    assert precise.computations == computations + 1 and precise.last_step == 4
    assert_precise(float64_truth, model.state_dict(), x)


def test_a_callback_used_again_computes_at_the_new_runs_scheduled_steps(tmp_path: Path, float64_truth: Any) -> None:
    """Probe 42: the step of the last scheduled computation was kept from one fit to the next, so a PreciseBN used
    for a second fit (a retry loop, a trial run before the real one) skipped its computation at that step: the
    second model ended with its moving averages (1.6 σ, 5.4 of the variance off the truth)."""
    precise = every_4_steps()
    for seed in (0, 1):
        assert_a_new_fit_computes_at_step_4(tmp_path, float64_truth, precise, seed)
    assert precise.computations == 2


def test_a_fit_after_one_that_raised_computes_at_its_scheduled_steps(tmp_path: Path, float64_truth: Any) -> None:
    """A fit that raises (at step 5, after the scheduled computation at 4) never reaches the callbacks' teardown; the
    same callback's next fit computes at its own step 4 all the same (it skipped it: 1.6 σ off, probe 42)."""

    class FailingOnce(TinyNet):
        failures: ClassVar[list[int]] = [1]

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if self.trainer.global_step == 4 and self.failures:
                self.failures.pop()
                raise RuntimeError("a bug in the training step")
            return super().training_step(batch, batch_idx)

    x, y = make_data()
    precise = every_4_steps()
    with pytest.raises(RuntimeError, match="a bug in the training step"):
        make_trainer(tmp_path, max_epochs=2, callbacks=[precise]).fit(FailingOnce(), loader(x, y))
    assert (precise.last_step, precise.computations) == (4, 1)
    assert_a_new_fit_computes_at_step_4(tmp_path, float64_truth, precise)


@pytest.mark.parametrize("stage", ["validate", "test"])
def test_a_checkpoint_restored_for_validate_or_test_does_not_reach_the_next_fit(
    tmp_path: Path, float64_truth: Any, stage: str
) -> None:
    """Lightning restores the callbacks' state for trainer.validate/test(ckpt_path=) too, with no fit bound: the next
    fit() without a checkpoint took that checkpoint's step as computed (the review of probe 42: 1.3 σ off)."""

    class Tested(TinyNet):
        def test_step(self, batch: Any, batch_idx: int) -> None:
            pass

    x, y = make_data()
    precise = every_4_steps()
    saver = ModelCheckpoint(dirpath=tmp_path, filename="first")
    first = Tested()
    make_trainer(tmp_path, max_epochs=1, callbacks=[precise, saver], enable_checkpointing=True).fit(first, loader(x, y))
    run = getattr(make_trainer(tmp_path, callbacks=[precise]), stage)
    run(first, loader(x[:16], y[:16]), ckpt_path=tmp_path / "first.ckpt")
    assert (precise.last_step, precise.computations) == (4, 1)
    assert_a_new_fit_computes_at_step_4(tmp_path, float64_truth, precise)


@pytest.mark.parametrize("averaging", ["swa", "ema"])
def test_weight_averaging_used_again_averages_in_the_new_run(
    tmp_path: Path, float64_truth: Any, averaging: str
) -> None:
    """Probe 42: Lightning's WeightAveraging keeps when it last averaged from one fit to the next, so a
    PreciseWeightAveraging used for a second fit never averaged there (n_averaged 0, the trained weights kept,
    "ended before any average"). Each fit now averages as a new callback would, bitwise."""
    x, y = make_data()

    def callback() -> PreciseWeightAveraging:
        if averaging == "swa":
            return PreciseWeightAveraging(num_samples="all", swa_epoch_start=1)
        return PreciseWeightAveraging(num_samples="all", multi_avg_fn=get_ema_multi_avg_fn(0.5))

    def fit(averager: PreciseWeightAveraging) -> TinyNet:
        torch.manual_seed(0)
        model = TinyNet()
        make_trainer(tmp_path, max_epochs=3, callbacks=[averager]).fit(model, loader(x, y))
        return model

    reused = callback()
    fit(reused)
    again, fresh = fit(reused), fit(callback())
    assert int(reused.averaged_model.n_averaged) == (2 if averaging == "swa" else 12)
    assert all(torch.equal(v, fresh.state_dict()[k]) for k, v in again.state_dict().items())
    assert_precise(float64_truth, again.state_dict(), x)


@pytest.mark.parametrize("ending", ["val_check_interval", "max_steps mid-epoch"])
def test_the_module_fit_leaves_holds_its_statistics(tmp_path: Path, float64_truth: Any, ending: str) -> None:
    """Probe 48: training steps after the last computation (a validation every 3 steps of a 4-step epoch, max_steps
    ending an epoch without validation or checkpoint) left the module fit() returns the moving averages —
    trainer.test(model), trainer.save_checkpoint() after fit and the weights saved by hand got statistics 0.1-0.75 σ /
    24-73 % off the float64 truth. A computation at the end of fit gives it its own; none when the last is current;
    on_train_end=False keeps the old behaviour (and a state key of its own)."""
    x, y = make_data()
    options = {"val_check_interval": 3, "max_epochs": 1} if ending == "val_check_interval" else {"max_steps": 6}
    precise = PreciseBN(num_samples="all")
    model = TinyNet()
    trainer = make_trainer(tmp_path, callbacks=[precise], **options)
    trainer.fit(model, loader(x, y), loader(x[:16], y[:16]))
    assert trainer.global_step == (4 if ending == "val_check_interval" else 6)
    trainer.save_checkpoint(tmp_path / "after.ckpt")
    assert_precise(float64_truth, model.state_dict(), x)
    assert_precise(float64_truth, torch.load(tmp_path / "after.ckpt", weights_only=False)["state_dict"], x)
    assert (precise.computations, precise.last_step) == (2, trainer.global_step)  # one validation, the end

    off = PreciseBN(num_samples="all", on_train_end=False)
    assert off.state_key != precise.state_key and PreciseBN(num_samples="all", on_train_end=True).state_key == (
        precise.state_key
    )
    model = TinyNet()
    make_trainer(tmp_path, callbacks=[off], **options).fit(model, loader(x, y), loader(x[:16], y[:16]))
    assert off.computations == 1
    assert precision_errors(float64_truth, model.state_dict(), x)[0] > 1e-3  # the moving averages


def test_lightnings_own_weight_averaging_beside_precise_bn_is_told(tmp_path: Path, float64_truth: Any) -> None:
    """Probe 48: PreciseBN with Lightning's WeightAveraging (SWA, EMA) validated, checkpointed and ended fit with
    the averaged weights and the averaged copy's buffers, none of which PreciseBN computes (0.5-1.7 σ / 28-270 % off
    the float64 truth of the averaged weights), silently. One PreciseBNWarning names PreciseWeightAveraging; none
    beside PreciseWeightAveraging or StochasticWeightAveraging (which validates the live module)."""
    x, y = make_data()
    model = TinyNet()
    with pytest.warns(PreciseBNWarning, match="PreciseWeightAveraging instead") as caught:
        make_trainer(tmp_path, max_epochs=1, callbacks=[PreciseBN(num_samples="all"), WeightAveraging()]).fit(
            model, loader(x, y), loader(x[:16], y[:16])
        )
    assert sum(issubclass(w.category, PreciseBNWarning) for w in caught) == 1
    ((_, validated),) = model.validated
    assert precision_errors(float64_truth, validated, x)[0] > 1e-2  # what it warns of: the averaged weights' own
    for other in (PreciseWeightAveraging(num_samples="all"), StochasticWeightAveraging(swa_lrs=0.01)):
        with warnings.catch_warnings():
            warnings.simplefilter("error", PreciseBNWarning)
            make_trainer(tmp_path, max_epochs=1, callbacks=[PreciseBN(num_samples="all"), other]).fit(
                TinyNet(), loader(x, y), loader(x[:16], y[:16])
            )


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_validation_that_raises_swaps_the_averaged_weights_back(
    tmp_path: Path, float64_truth: Any, error: type[BaseException]
) -> None:
    """Probe 48: a validation that raised (a metric's bug, the forward, Ctrl-C) with PreciseWeightAveraging's
    averaged weights swapped in never reached on_validation_epoch_end: the module was left holding the averaged
    weights (1.1-11 off its own, largest difference) and the averaged copy the live ones, with the live module's
    moving averages (0.44-0.84 σ off their truth); a checkpoint saved on the exception stored the average as the
    model to resume. on_exception swaps back (before ModelCheckpoint's own): the module is bitwise its own, the
    copy holds the average and its exact statistics."""
    x, y = make_data()

    class Failing(TinyNet):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            if self.trainer.global_step == 8:  # the second validation, with an average swapped in
                raise error("a metric's bug")
            super().validation_step(batch, batch_idx)

    class Live(L.Callback):  # the module's own state, before the averaged weights are swapped in
        def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
            self.state = {k: v.clone() for k, v in pl_module.state_dict().items()}

    model, live = Failing(), Live()
    averaging = PreciseWeightAveraging(num_samples="all", swa_epoch_start=0)
    saving = ModelCheckpoint(dirpath=tmp_path, save_on_exception=True, save_top_k=0)
    trainer = make_trainer(tmp_path, callbacks=[live, averaging, saving], enable_checkpointing=True)
    with pytest.raises((RuntimeError, SystemExit)):  # (Lightning turns Ctrl-C into SystemExit)
        trainer.fit(model, loader(x, y), loader(x[:16], y[:16]))
    for name, value in model.state_dict().items():
        assert torch.equal(value, live.state[name]), name
    averaged = {
        k[len("module.") :]: v for k, v in averaging.averaged_model.state_dict().items() if k.startswith("module.")
    }
    assert_precise(float64_truth, averaged, x)
    (saved,) = tmp_path.glob("*.ckpt")
    for name, value in torch.load(saved, weights_only=False)["current_model_state"].items():
        assert torch.equal(value, live.state[name]), name


@pytest.mark.parametrize("during", ["swap in", "swap back"])
def test_a_ctrl_c_during_the_swap_of_the_averaged_weights_leaves_the_module_its_own(
    tmp_path: Path, float64_truth: Any, during: str
) -> None:
    """Review of stop 44: the flag on_exception swaps back by was set before Lightning's swap (a Ctrl-C as it began:
    nothing swapped, then on_exception swapped the average in, the module ended holding the averaged weights) and
    cleared before the swap back (a Ctrl-C then: the module kept the averaged weights). The swap and the flag are
    one hold now: the module is bitwise its own after the KeyboardInterrupt, the copy the average, exact."""
    import os
    import signal

    x, y = make_data()

    class Live(L.Callback):  # the module's own state, before the averaged weights are swapped in
        def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
            self.state = {k: v.clone() for k, v in pl_module.state_dict().items()}

    model, live = TinyNet(), Live()
    averaging = PreciseWeightAveraging(num_samples="all", swa_epoch_start=0)
    original, calls = averaging._swap_models, []

    def swap(pl_module: Any) -> None:
        calls.append(pl_module.trainer.global_step)
        if len(calls) == (1 if during == "swap in" else 2):
            os.kill(os.getpid(), signal.SIGINT)  # (Ctrl-C as Lightning's swap begins)
        original(pl_module)

    averaging._swap_models = swap  # type: ignore[method-assign]
    trainer = make_trainer(tmp_path, callbacks=[live, averaging])
    with pytest.raises((KeyboardInterrupt, SystemExit)):  # (Lightning turns Ctrl-C into SystemExit)
        trainer.fit(model, loader(x, y), loader(x[:16], y[:16]))
    assert calls == [8, 8]  # (the first validation: no average yet)
    for name, value in model.state_dict().items():
        assert torch.equal(value, live.state[name]), name
    averaged = {
        k[len("module.") :]: v for k, v in averaging.averaged_model.state_dict().items() if k.startswith("module.")
    }
    assert_precise(float64_truth, averaged, x)
    assert max(float((averaged[k] - v).abs().max()) for k, v in live.state.items() if k in averaged) > 1e-2
