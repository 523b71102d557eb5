"""PreciseBNScheduler: one computation per step, exact statistics, training left alone."""

from __future__ import annotations

import copy
import random
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import precisebn
from conftest import compute_truth, max_rel_error
from precisebn.errors import EmptyDataError, InvalidArgumentError, PreciseBNWarning


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(5, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Dropout(0.5), nn.Linear(6, 3), nn.BatchNorm1d(3)
    )


def make_batches(n: int = 6, size: int = 8, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 5, generator=g) * 3 + 2, torch.randn(size, 3, generator=g)) for _ in range(n)]


def assert_precise(model: nn.Module, truth: dict[str, Any]) -> None:
    for name, t in truth.items():
        layer = model.get_submodule(name)
        mean_error = ((layer.running_mean.double() - t.mean).abs() / t.var.sqrt()).max()
        var_error = ((layer.running_var.double() - t.var).abs() / t.var).max()
        assert mean_error < 1e-5 and var_error < 1e-5, (name, float(mean_error), float(var_error))


def test_one_computation_per_step_in_a_training_loop(float64_truth: Any) -> None:
    model, data = make_model(), make_batches()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scheduler = precisebn.PreciseBNScheduler(model, data, num_samples="all")
    # Each step may ask several times (evaluation, checkpoint...); steps may repeat or go back.
    steps = [1, 1, 2, 2, 2, 5, 5, 3, 3]
    done = []
    for step in steps:
        if step != scheduler.last_step:
            x, y = data[step % len(data)]  # weights change between distinct steps
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        report = scheduler.update(step)
        done.append(report is not None)
        if report is not None:
            assert_precise(model, float64_truth(model, data))
    assert done == [True, False, True, False, False, True, False, True, False]
    assert scheduler.computations == 4 and scheduler.last_step == 3
    assert scheduler.last_report is not None and scheduler.last_report.samples == 48


def test_force_and_invalidate_recompute_at_the_same_step() -> None:
    model, data = make_model(), make_batches(2)
    scheduler = precisebn.PreciseBNScheduler(model, data, num_samples="all")
    assert scheduler.update(7) is not None
    assert scheduler.update(7) is None and scheduler.is_current(7)
    assert scheduler.update(7, force=True) is not None
    scheduler.invalidate()
    assert not scheduler.is_current(7)
    assert scheduler.update(7) is not None
    assert scheduler.update(7) is None
    assert scheduler.computations == 3


def test_weights_changed_since_are_not_current_at_the_same_step(float64_truth: Any) -> None:
    """The step a caller gives may not move with the weights — a loop run again after one that raised counts from 0
    again, a step counter that moves per epoch, a checkpoint loaded — and update(step) took such statistics as
    current (probe 42 found the integrations doing it). The parameters, by identity and version counter, say so."""
    model, data = make_model(), make_batches()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scheduler = precisebn.PreciseBNScheduler(model, data, num_samples="all")

    def train_one_step() -> None:
        x, y = data[0]
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    train_one_step()
    assert scheduler.update(1) is not None
    assert scheduler.update(1) is None  # nothing changed since: shared
    train_one_step()  # the same step number given again (the loop started over)
    assert not scheduler.is_current(1)
    assert scheduler.update(1) is not None
    assert_precise(model, float64_truth(model, data))
    other = make_model()
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(1.5)
    model.load_state_dict(other.state_dict())  # (copies in place: the versions move)
    assert scheduler.update(1) is not None
    assert_precise(model, float64_truth(model, data))
    assert scheduler.computations == 3 and scheduler.update(1) is None


def test_state_dict_round_trip() -> None:
    model, data = make_model(), make_batches(2)
    first = precisebn.PreciseBNScheduler(model, data)
    first.update(4)
    resumed = precisebn.PreciseBNScheduler(model, data)
    resumed.load_state_dict(first.state_dict())
    assert resumed.update(4) is None  # the checkpoint at step 4 already holds these statistics
    assert (resumed.last_step, resumed.computations) == (4, 1)
    assert resumed.update(5) is not None and resumed.computations == 2


def test_failure_records_nothing_and_leaves_the_model(snapshot: Any, unchanged: Any) -> None:
    model = make_model()
    fail = {"on": True}

    def data() -> Any:
        if fail["on"]:
            yield make_batches(1)[0]
            raise RuntimeError("disk on fire")
        yield from make_batches(2)

    scheduler = precisebn.PreciseBNScheduler(model, data)
    before = snapshot(model)
    with pytest.raises(RuntimeError, match="disk on fire"):
        scheduler.update(3)
    unchanged(model, before)
    assert (scheduler.last_step, scheduler.computations) == (None, 0)
    fail["on"] = False
    assert scheduler.update(3) is not None  # the callable gives fresh batches every time
    assert scheduler.update(3) is None


def test_random_number_generators_are_put_back() -> None:
    model, data = make_model(), make_batches()
    dataset = torch.utils.data.TensorDataset(*map(torch.cat, zip(*data)))
    loader = torch.utils.data.DataLoader(dataset, batch_size=8, shuffle=True)

    def draws() -> tuple[Any, ...]:
        return torch.rand(3), random.random(), np.random.rand()

    def seed() -> None:
        torch.manual_seed(5)
        random.seed(5)
        np.random.seed(5)

    seed()
    expected = draws()
    scheduler = precisebn.PreciseBNScheduler(model, loader, num_samples=24, mode="train")  # shuffles, dropout on
    seed()
    scheduler.update(1)
    got = draws()
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]
    leaky = precisebn.PreciseBNScheduler(model, loader, num_samples=24, mode="train", preserve_rng=False)
    seed()
    leaky.update(1)
    assert not torch.equal(torch.rand(3), expected[0])  # the passes did draw random numbers


def test_persistent_workers_do_not_restart_the_training_epoch() -> None:
    x = torch.arange(48, dtype=torch.float32).reshape(12, 4)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x), batch_size=3, num_workers=1, persistent_workers=True
    )
    model = nn.Sequential(nn.BatchNorm1d(4))
    scheduler = precisebn.PreciseBNScheduler(model, loader, num_samples="all")
    epoch = iter(loader)
    seen = [next(epoch)[0]]
    scheduler.update(1)  # in the middle of the epoch
    seen += [b[0] for b in epoch]
    assert torch.equal(torch.cat(seen), x)
    assert scheduler.last_report.samples == 12


def test_persistent_workers_without_batching_keep_the_loaders_sampler() -> None:
    """Found by a hostile probe: with batch_size=None the twin loader of a persistent-workers loader dropped
    its sampler, so batches the sampler never gives (here 4-7, mean 10) were measured too."""
    batches = torch.stack([torch.randn(8, 2) + (10.0 if i >= 4 else 0.0) for i in range(8)])
    loader = torch.utils.data.DataLoader(
        batches,
        batch_size=None,
        sampler=torch.utils.data.SubsetRandomSampler([0, 1, 2, 3], generator=torch.Generator().manual_seed(0)),
        num_workers=1,
        persistent_workers=True,
    )
    model = nn.Sequential(nn.BatchNorm1d(2))
    scheduler = precisebn.PreciseBNScheduler(model, loader, num_samples="all")
    scheduler.update(1)
    x = batches[:4].reshape(-1, 2).double()
    assert scheduler.last_report.samples == 32
    assert max_rel_error(model[0].running_var, x.var(0, unbiased=False)) <= 1e-5


def test_bad_arguments_are_refused_at_construction() -> None:
    model, data = make_model(), make_batches(1)
    with pytest.raises(InvalidArgumentError, match="one-shot iterator"):
        precisebn.PreciseBNScheduler(model, iter(data))
    with pytest.raises(InvalidArgumentError, match="re-iterable"):
        precisebn.PreciseBNScheduler(model, torch.zeros(4, 5))
    with pytest.raises(InvalidArgumentError, match="mode"):
        precisebn.PreciseBNScheduler(model, data, mode="eval")
    with pytest.raises(InvalidArgumentError, match="num_samples"):
        precisebn.PreciseBNScheduler(model, data, num_samples=0)
    with pytest.raises(InvalidArgumentError, match="forward"):
        precisebn.PreciseBNScheduler(model, data, forward="model")
    with pytest.raises(InvalidArgumentError, match=r"torch\.nn\.Module"):
        precisebn.PreciseBNScheduler(data, data)
    scheduler = precisebn.PreciseBNScheduler(model, list)
    with pytest.raises(EmptyDataError):
        scheduler.update(1)


def _indexed_loader(kind: str, seed: int) -> torch.utils.data.DataLoader:
    """A shuffling loader over 40 samples whose randomness is its own generator's, held
    where ``kind`` says; each batch's second tensor holds the samples' indices."""
    dataset = torch.utils.data.TensorDataset(torch.randn(40, 5) * 3 + 2, torch.arange(40))
    g = torch.Generator().manual_seed(seed)
    if kind == "loader":
        return torch.utils.data.DataLoader(dataset, batch_size=8, shuffle=True, generator=g)
    if kind == "sampler":
        sampler = torch.utils.data.RandomSampler(dataset, generator=g)
        return torch.utils.data.DataLoader(dataset, batch_size=8, sampler=sampler)
    if kind == "batch_sampler":
        batches = torch.utils.data.BatchSampler(torch.utils.data.RandomSampler(dataset, generator=g), 8, False)
        return torch.utils.data.DataLoader(dataset, batch_sampler=batches)
    if kind in ("numpy", "random"):  # a custom sampler shuffling with a generator of its own (not torch's)
        return torch.utils.data.DataLoader(dataset, batch_size=8, sampler=_OwnShuffle(len(dataset), kind, seed))
    if kind in ("in a dict", "in a state object"):  # the sampler's generator held one level down (a probe)
        sampler = _OwnShuffle(len(dataset), "numpy", seed)
        rng, sampler.rng = sampler.rng, _Held()
        sampler.rng.state = {"rng": rng} if kind == "in a dict" else _Held(rng=rng)
        return torch.utils.data.DataLoader(dataset, batch_size=8, sampler=sampler)
    if kind == "transform":  # the generator in a transform inside torchvision's Compose
        from torchvision.transforms import Compose

        jittered = _Jittered(dataset, seed)
        jittered.transform, jittered.rng = Compose([_Noise(jittered.rng)]), None
        return torch.utils.data.DataLoader(jittered, batch_size=8, shuffle=True, generator=g)
    if kind == "epoch property":  # a read-only epoch (the set_epoch pattern): AttributeError after the writes before
        sampler = _EpochProperty(len(dataset))
        return torch.utils.data.DataLoader(dataset, batch_size=8, sampler=sampler)
    if kind == "dataset":  # a dataset drawing in __getitem__ from a generator of its own (an augmentation), wrapped
        wrapped = torch.utils.data.Subset(_Jittered(dataset, seed), list(range(40)))
        return torch.utils.data.DataLoader(wrapped, batch_size=8, shuffle=True, generator=g)
    assert kind == "persistent_workers"  # measured through a twin loader
    return torch.utils.data.DataLoader(
        dataset, batch_size=8, shuffle=True, generator=g, num_workers=1, persistent_workers=True
    )


class _Noise:
    """A transform drawing from a NumPy Generator of its own."""

    def __init__(self, rng: Any) -> None:
        self.rng = rng

    def __call__(self, x: float) -> float:
        return x + float(self.rng.normal())


class _EpochProperty(torch.utils.data.Sampler[int]):
    """Shuffles with a generator of its own, and has a read-only ``epoch`` (the ``set_epoch`` pattern)."""

    def __init__(self, size: int) -> None:
        self.size, self._epoch = size, 0
        self.generator = torch.Generator().manual_seed(0)

    @property
    def epoch(self) -> int:
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        self._epoch = epoch

    def __iter__(self):
        return iter(torch.randperm(self.size, generator=self.generator).tolist())

    def __len__(self) -> int:
        return self.size


class _Jittered(torch.utils.data.Dataset):
    """Adds noise from a NumPy Generator of its own to each sample; its index is the sample's plus the noise
    rounded to 1e-3, so that the order check also sees the draws."""

    def __init__(self, base: torch.utils.data.TensorDataset, seed: int) -> None:
        import numpy as np

        self.base, self.rng = base, np.random.default_rng(seed)

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, index = self.base[i]
        noise = float(self.rng.normal()) if self.rng is not None else self.transform(0.0)
        return x + noise, index + round(noise, 3)


class _Held:
    """A plain state object; as ``rng``, shuffles with the generator it holds (in a dict or another such object)."""

    def __init__(self, **attributes: Any) -> None:
        self.__dict__.update(attributes)

    def shuffle(self, order: list[int]) -> None:
        state = self.state
        (state["rng"] if isinstance(state, dict) else state.rng).shuffle(order)


class _OwnShuffle(torch.utils.data.Sampler[int]):
    """Shuffles every epoch with NumPy's Generator or Python's random.Random, held by the sampler."""

    def __init__(self, size: int, kind: str, seed: int) -> None:
        import random

        import numpy as np

        self.size = size
        self.rng = np.random.default_rng(seed) if kind == "numpy" else random.Random(seed)

    def __iter__(self):
        order = list(range(self.size))
        self.rng.shuffle(order)
        return iter(order)

    def __len__(self) -> int:
        return self.size


@pytest.mark.parametrize(
    "kind",
    [
        "loader",
        "sampler",
        "batch_sampler",
        "persistent_workers",
        "numpy",
        "random",
        "in a dict",
        "in a state object",
        "dataset",
        "transform",
        "epoch property",
    ],
)
def test_a_loaders_own_generator_keeps_the_training_order(kind: str) -> None:
    def train(with_scheduler: bool) -> list[list[int]]:
        model = make_model()
        loader = _indexed_loader(kind, seed=0)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        scheduler = precisebn.PreciseBNScheduler(model, loader, num_samples=16)
        orders = []
        for _ in range(3):
            order = []
            for i, (x, index) in enumerate(loader):
                order += index.tolist()
                loss = model(x).square().mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                if with_scheduler and i == 1:
                    scheduler.update(len(orders) * 10 + i)  # in the middle of every epoch
            orders.append(order)
        if with_scheduler:
            assert scheduler.computations == 3
        return orders

    without = train(with_scheduler=False)
    assert without[0] != without[1] != without[2]  # the loader does shuffle every epoch
    assert train(with_scheduler=True) == without


def test_steps_must_be_integers() -> None:
    model, data = make_model(), make_batches(2)
    scheduler = precisebn.PreciseBNScheduler(model, data, num_samples="all")
    for bad in (3.0, 2.5, "3", None, True):
        with pytest.raises(InvalidArgumentError, match=r"step must be an integer.*int\(step\)"):
            scheduler.update(bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError, match="step must be an integer"):
            scheduler.is_current(bad)  # type: ignore[arg-type]
    assert scheduler.computations == 0 and scheduler.last_step is None
    assert scheduler.update(np.int64(3)) is not None  # numpy and 0-d integer tensors are integers
    assert scheduler.update(torch.tensor(3)) is None
    assert scheduler.last_step == 3 and type(scheduler.last_step) is int
    assert type(scheduler.state_dict()["last_step"]) is int


def test_load_state_dict_refuses_what_state_dict_does_not_write() -> None:
    model, data = make_model(), make_batches(2)
    scheduler = precisebn.PreciseBNScheduler(model, data, num_samples="all")
    scheduler.update(4)
    good = scheduler.state_dict()
    bad_states = [
        ([4, False, 1], "got a list"),
        (model.state_dict(), "unknown key"),  # the model's state instead of the scheduler's
        ({"last_step": 4, "computations": 1}, "missing key.*'stale'"),
        ({**good, "last_step": 4.5}, "last_step"),
        ({**good, "last_step": "4"}, "last_step"),
        ({**good, "stale": "no"}, "stale"),
        ({**good, "computations": -1}, "computations"),
        ({**good, "computations": 1.0}, "computations"),
    ]
    for state, message in bad_states:
        with pytest.raises(InvalidArgumentError, match=message):
            scheduler.load_state_dict(state)  # type: ignore[arg-type]
    assert scheduler.state_dict() == good  # a refused state changes nothing
    scheduler.load_state_dict({"last_step": np.int64(9), "stale": False, "computations": np.int64(5)})
    assert (scheduler.last_step, scheduler.computations) == (9, 5)
    assert scheduler.update(9) is None
    scheduler.load_state_dict({"last_step": None, "stale": False, "computations": 0})
    assert scheduler.update(9) is not None and scheduler.computations == 1


def test_capture_option_reaches_every_computation() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6))
    data = [torch.randn(8, 4) for _ in range(3)]
    scheduler = precisebn.PreciseBNScheduler(model, data, capture="float64")
    report = scheduler.update(1)
    assert report is not None and report["1"].path == "float64"
    with pytest.raises(precisebn.errors.InvalidArgumentError, match="capture must be"):
        precisebn.PreciseBNScheduler(model, data, capture="exact")


def test_num_samples_auto_and_tolerance_reach_the_computation() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6))
    data = [torch.randn(16, 4) for _ in range(64)]
    report = precisebn.PreciseBNScheduler(model, data, num_samples="auto", tolerance=0.2).update(1)
    assert report is not None and report.batches % 8 == 0 and report.batches < 64
    assert report["1"].se_var_median <= 0.2
    with pytest.raises(InvalidArgumentError, match="applies to num_samples='auto' only"):
        precisebn.PreciseBNScheduler(model, data, tolerance=0.2)


class _OddDataset(torch.utils.data.Dataset):
    """A dataset with an array named ``datasets`` (every update crashed: "truth value of an array is ambiguous")."""

    def __init__(self) -> None:
        self.x, self.datasets = torch.randn(40, 5), np.zeros((2, 2))

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.x[i]


class _PassCounting(torch.utils.data.Sampler[int]):
    """Counts its passes in a read-only ``epoch`` (or, ``refusing``, one whose setter refuses going back)."""

    def __init__(self, refusing: bool) -> None:
        self._epoch, self.refusing = 0, refusing

    @property
    def epoch(self) -> int:
        return self._epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        if not self.refusing or value < self._epoch:
            raise ValueError("epoch cannot go back")
        self._epoch = value

    def __iter__(self):
        self._epoch += 1
        return iter(range(40))

    def __len__(self) -> int:
        return 40


def test_odd_data_objects_neither_crash_a_computation_nor_raise_after_its_writes() -> None:
    """Probes: an array named `datasets` (ValueError: ambiguous truth value) crashed every update; an epoch that
    moved and cannot be put back raised after the statistics were written
    (the model changed, the call raising). Now the computation completes, with a warning for the epoch."""
    model = make_model()
    loader = torch.utils.data.DataLoader(_OddDataset(), batch_size=8)
    assert precisebn.PreciseBNScheduler(model, loader, num_samples="all").update(1) is not None
    for refusing in (False, True):
        sampler = _PassCounting(refusing)
        loader = torch.utils.data.DataLoader(torch.randn(40, 5), batch_size=8, sampler=sampler)
        scheduler = precisebn.PreciseBNScheduler(make_model(), loader, num_samples="all")
        with pytest.warns(PreciseBNWarning, match=r"_PassCounting.epoch moved from 0 .* cannot be put back"):
            assert scheduler.update(1) is not None
        assert scheduler.is_current(1)


def test_another_model_assigned_is_read_afresh(float64_truth: Any) -> None:
    """Probe 41: with ``scheduler.model`` assigned another model, the frozen layers were still read off the old
    one: the new model's frozen layer was recalibrated and its trained one kept its statistics. The new model's
    own modes count now, and its statistics are not current at the step already computed."""

    def make() -> nn.Module:
        return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.BatchNorm1d(4))

    torch.manual_seed(0)
    data = [torch.randn(8, 3) for _ in range(4)]
    old = make().train()
    old[2].eval()  # frozen for training
    scheduler = precisebn.PreciseBNScheduler(old, data, num_samples="all")
    assert scheduler.update(1).updated == ["1"] and scheduler.frozen_layers == ("2",)
    new = make().train()
    new[1].eval()  # here '1' is frozen, '2' trains
    kept = new[1].running_mean.clone()
    scheduler.model = new
    assert not scheduler.is_current(1)
    truth = float64_truth(new, data, select=lambda name, m: name == "2")  # (the frozen one normalises as it is)
    report = scheduler.update(1)
    assert report is not None and report.updated == ["2"] and scheduler.frozen_layers == ("1",)
    assert torch.equal(new[1].running_mean, kept)
    assert max_rel_error(new[2].running_var, truth["2"].var) < 1e-5
    with pytest.raises(InvalidArgumentError, match=r"model must be a torch\.nn\.Module"):
        scheduler.model = "resnet"  # type: ignore[assignment]


def test_the_schedulers_warnings_name_the_users_line() -> None:
    """The review of probe 41: warnings about frozen layers were attributed to precisebn's own lines (stack levels
    fixed for one depth); they name the line of the caller outside precisebn."""
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.BatchNorm1d(4)).train()
    model[1].eval()  # frozen, and the only layer selected
    scheduler = precisebn.PreciseBNScheduler(model, [torch.randn(8, 4)], layers=["1"])
    scheduler.observe(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scheduler.update(1)
    ours = [w for w in caught if issubclass(w.category, PreciseBNWarning)]
    assert ours and all(w.filename == __file__ for w in ours), [(w.filename, str(w.message)[:60]) for w in caught]


class Embedded(nn.Module):
    """``make_model()`` fed its input plus one row of an Embedding with ``max_norm`` (whose forward renormalises its
    weight in place), the weight tied to a Linear registered before it if ``tied``; batches as ``make_batches``."""

    def __init__(self, max_norm: float = 1.0, tied: bool = False) -> None:
        super().__init__()
        if tied:
            self.head = nn.Linear(5, 4, bias=False)
        self.embedding = nn.Embedding(4, 5, max_norm=max_norm)
        if tied:
            self.embedding.weight = self.head.weight
        self.net = make_model()

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, _ = batch
        return self.net(x + self.embedding(torch.zeros(len(x), dtype=torch.long)))


def embedded_scheduler(model: Embedded, data: list[Any]) -> precisebn.PreciseBNScheduler:
    return precisebn.PreciseBNScheduler(model, data, num_samples="all", forward=lambda m, b: m(b))


def test_a_forward_that_renormalises_an_embedding_in_place_leaves_the_statistics_current() -> None:
    """The review of the weights check: an Embedding with max_norm renormalises its weight in place in every forward
    (torch.embedding_renorm_), moving its version counter whether or not a row changed, so an evaluation between two
    update(step) at one step made the second compute again (6 computations instead of 3 in a Lightning run)."""

    model, data = Embedded(max_norm=100.0), make_batches(2)
    scheduler = embedded_scheduler(model, data)
    assert scheduler.update(3) is not None
    version = model.embedding.weight._version
    model.eval()
    with torch.no_grad():
        model(data[0])  # an evaluation: the weight's counter moves, its values do not
    assert model.embedding.weight._version > version
    assert scheduler.update(3) is None and scheduler.computations == 1


def test_statistics_another_computation_wrote_since_are_not_current(float64_truth: Any) -> None:
    """Probe 42: "current" looked at the step and the weights only, so statistics another computation wrote into the
    same buffers at that step — a second scheduler, an averaged copy sharing the model's buffers (Ignite's EMAHandler
    by default) — were taken as this scheduler's own: 5.4 σ off its data's truth, and a checkpoint 0.035 σ off."""
    model = make_model()
    mine, theirs = make_batches(seed=1), make_batches(seed=2)
    first = precisebn.PreciseBNScheduler(model, mine, num_samples="all")
    second = precisebn.PreciseBNScheduler(model, theirs, num_samples="all")
    assert first.update(4) is not None and second.update(4) is not None
    assert not first.is_current(4)
    assert first.update(4) is not None
    assert_precise(model, float64_truth(model, mine))
    assert first.update(4) is None  # its own again: current
    model.eval()
    with torch.no_grad():
        model(mine[0][0])  # an evaluation writes nothing
    assert first.is_current(4)
    model.float()  # a dtype change in place (no version counter moves) that leaves the values: still current
    assert first.is_current(4)
    model.double()
    assert not first.is_current(4)  # other tensors now


def test_another_computation_on_later_layers_leaves_the_statistics_current() -> None:
    """The review: the bitwise check covered every layer, so a scheduler on some layers computed again whenever
    another wrote other layers at its step (two callbacks on disjoint layers, as the README suggests: 6 computations
    for 3 steps). Since probe 43 the layers called before the updated ones in the model's first forward count too
    (they fed them): the scheduler on the earlier layer is left current by the other's writes; the one on the later
    layer computes again once, after the earlier one first changed — then its statistics fit the float64 truth."""
    model, data = make_model(), make_batches()
    first = precisebn.PreciseBNScheduler(model, data, num_samples="all", layers=["1"])
    second = precisebn.PreciseBNScheduler(model, data, num_samples="all", layers=["5"])
    for step in (1, 2, 3):
        for scheduler in (first, second, first, second):  # (an evaluation, then a checkpoint, at each step)
            scheduler.update(step)
    assert (first.computations, second.computations) == (3, 3)
    model, data = make_model(), make_batches()
    first = precisebn.PreciseBNScheduler(model, data, num_samples="all", layers=["1"])
    second = precisebn.PreciseBNScheduler(model, data, num_samples="all", layers=["5"])
    for step in (1, 2, 3):
        for scheduler in (second, first, second, first):  # (the later layer's first)
            scheduler.update(step)
    assert (first.computations, second.computations) == (3, 4)  # (later steps: the same data and weights, the same
    truth = compute_truth(model, data, select=lambda name, m: name == "5")["5"]  # values, bitwise)
    assert max_rel_error(model[5].running_var, truth.var) <= 1e-5
    assert max_rel_error(model[5].running_mean, truth.mean, truth.var.sqrt()) <= 1e-5


def _two_layers() -> tuple[nn.Module, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4))
    g = torch.Generator().manual_seed(2)
    return model, [torch.randn(4, 3, 6, 6, generator=g) * 2 + 1 for _ in range(3)]


def test_statistics_of_layers_before_the_updated_ones_written_since_make_them_stale() -> None:
    """Found by probe 43c: a scheduler on a layer after another (a head after a backbone) took its statistics as
    current after another scheduler on the earlier layer — or ``apply`` on it — rewrote that one at the same step:
    the later layer had been measured with the earlier one normalising by its old statistics (0.19 σ and 20 % off;
    0.96 σ and 263 % with the earlier layer frozen and adapted to other data). What the others hold is compared
    bitwise too: such a write makes it compute again, and its statistics fit the float64 truth then."""
    model, data = _two_layers()
    head = precisebn.PreciseBNScheduler(model, data, layers=["4"])
    backbone = precisebn.PreciseBNScheduler(model, data, layers=["1"])
    assert head.update(10) is not None
    assert backbone.update(10) is not None  # (the head's inputs change)
    assert head.update(10) is not None
    truth = compute_truth(model, data, select=lambda name, m: name == "4")["4"]
    assert max_rel_error(model[4].running_var, truth.var) <= 1e-5
    assert max_rel_error(model[4].running_mean, truth.mean, truth.var.sqrt()) <= 1e-5
    assert backbone.update(10) is None and head.update(10) is None  # (layer 4 comes after layer 1: it fed nothing)

    model, data = _two_layers()
    model.train()
    model[1].eval()  # a frozen backbone layer (frozen="skip": left out)
    scheduler = precisebn.PreciseBNScheduler(model, data)
    assert scheduler.update(10) is not None and scheduler.last_report.updated == ["4"]
    other = [x * 3 - 2 for x in data]
    precisebn.apply(model, precisebn.estimate(model, other, layers=["1"]))  # the frozen layer adapted (AdaBN)
    assert scheduler.update(10) is not None
    truth = compute_truth(model, data, select=lambda name, m: name == "4")["4"]
    assert max_rel_error(model[4].running_var, truth.var) <= 1e-5
    assert max_rel_error(model[4].running_mean, truth.mean, truth.var.sqrt()) <= 1e-5


def test_buffers_of_modules_before_the_updated_layers_changed_since_make_them_stale() -> None:
    """Found by the review of probe 43: pruning again between a computation and a checkpoint (Lightning's
    ``ModelPruning`` prunes at an epoch's end) gives the pruned layer a new ``weight_mask`` buffer and leaves its
    parameter ``weight_orig`` as it was: the scheduler compared parameters and running statistics only, and took the
    statistics of the layer after it as current (0.97 σ and 82 % off in the review). Every buffer of the modules the
    passes ran before the updated layers is compared now — replaced, or changed in place."""
    from torch.nn.utils import prune

    model, data = _two_layers()
    with torch.no_grad():  # (a weight computed with a graph cannot be deep-copied, as the truth does)
        prune.l1_unstructured(model[3], "weight", amount=0.25)
    scheduler = precisebn.PreciseBNScheduler(model, data, layers=["4"])
    assert scheduler.update(10) is not None and scheduler.update(10) is None
    with torch.no_grad():
        prune.l1_unstructured(model[3], "weight", amount=0.5)  # a new mask; weight_orig untouched
    assert scheduler.update(10) is not None
    truth = compute_truth(model, data, select=lambda name, m: name == "4")["4"]
    assert max_rel_error(model[4].running_var, truth.var) <= 1e-5
    assert max_rel_error(model[4].running_mean, truth.mean, truth.var.sqrt()) <= 1e-5
    assert scheduler.update(10) is None
    with torch.no_grad():
        model[3].weight_mask[0].zero_()  # the mask changed in place
    assert scheduler.update(10) is not None
    truth = compute_truth(model, data, select=lambda name, m: name == "4")["4"]
    assert max_rel_error(model[4].running_var, truth.var) <= 1e-5
    assert max_rel_error(model[4].running_mean, truth.mean, truth.var.sqrt()) <= 1e-5


def test_an_evaluation_that_moves_a_quantization_observer_makes_the_statistics_stale() -> None:
    """Quantization-aware training: a fake-quantize module's observer takes in every call's range, in eval mode too,
    and its scale then quantizes the layers' inputs otherwise. An evaluation between a computation and a checkpoint
    left statistics measured under the old ranges taken as current (0.0096 σ and 0.8 % off, measured); its
    buffers are compared as any other's now, and the update computes again."""
    import torch.ao.quantization as quantization

    torch.manual_seed(0)
    model = nn.Sequential(
        quantization.QuantStub(), nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(),
        nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4), quantization.DeQuantStub(),
    )  # fmt: skip
    model.qconfig = quantization.get_default_qat_qconfig("fbgemm")
    quantization.prepare_qat(model.train(), inplace=True)
    data = [torch.randn(4, 3, 8, 8) for _ in range(3)]
    scheduler = precisebn.PreciseBNScheduler(model, data, num_samples="all")
    assert scheduler.update(1) is not None and scheduler.update(1) is None
    model.eval()
    with torch.no_grad():
        model(torch.randn(4, 3, 8, 8) * 5)  # (its ranges grow)
    model.train()
    assert scheduler.update(1) is not None
    truth = compute_truth(model, data)
    assert_precise(model, {name: truth[name] for name in ("2", "5")})


def test_a_tied_renormalised_embedding_weight_leaves_the_statistics_current() -> None:
    """The review: an Embedding with max_norm whose weight a Linear registered before it holds too had that weight's
    version counter read (the first module seen decided), and an evaluation between two triggers made every second
    one compute again."""

    model, data = Embedded(tied=True), make_batches(2)
    assert model.head.weight is model.embedding.weight and next(iter(model._modules)) == "head"
    scheduler = embedded_scheduler(model, data)
    for step in (1, 2):
        assert scheduler.update(step) is not None
        model.eval()
        with torch.no_grad():
            model(data[0])  # an evaluation renormalises the weight in place
        assert scheduler.update(step) is None
    assert scheduler.computations == 2


def test_a_model_that_cannot_be_read_as_before_is_computed_again_not_raised_on() -> None:
    """The review: a layer gone from a model whose __getattr__ raises KeyError on a miss (a dict fallback, which torch's
    get_submodule lets through) made is_current, and update() at a current step, raise — where update() had done
    nothing before the check existed. Such a model is judged not current, and computed again."""

    class WithExtras(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.extras: dict[str, Any] = {}
            self.linear, self.bn = nn.Linear(5, 6), nn.BatchNorm1d(6, affine=False)
            self.head, self.bn2 = nn.Linear(6, 3), nn.BatchNorm1d(3)

        def __getattr__(self, name: str) -> Any:
            try:
                return super().__getattr__(name)
            except AttributeError:
                return self.__dict__["extras"][name]

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.linear(x)
            return self.bn2(self.head(self.bn(x) if "bn" in self._modules else x))

    model, data = WithExtras(), make_batches(2)
    scheduler = precisebn.PreciseBNScheduler(model, data, num_samples="all")
    assert scheduler.update(1) is not None
    del model.bn  # (no parameters: the weights alone did not change)
    assert not scheduler.is_current(1)
    assert scheduler.update(1) is not None and scheduler.computations == 2


def test_a_parametrized_embedding_weight_changed_in_place_is_seen() -> None:
    """The review: the originals of a parametrized Embedding with max_norm were read by identity only, as a plain
    weight is (its forward renormalises it in place in every call); a parametrization that is not a view leaves the
    original alone in the forward, and a change made to it went unseen: the statistics taken as current."""
    from torch.nn.utils import parametrize

    class Doubled(nn.Module):
        def forward(self, weight: torch.Tensor) -> torch.Tensor:
            return weight * 2.0

    model, data = Embedded(), make_batches(2)
    parametrize.register_parametrization(model.embedding, "weight", Doubled())
    scheduler = embedded_scheduler(model, data)
    assert scheduler.update(1) is not None and scheduler.is_current(1)
    with torch.no_grad():
        model.embedding.parametrizations.weight.original.mul_(0.01)
    assert not scheduler.is_current(1)


def test_statistics_whose_memory_was_freed_in_a_module_before_the_updated_layers_are_not_read() -> None:
    """The review of probe 43: the statistics of the modules before the updated layers are copied after each
    computation; a freed one (``untyped_storage().resize_(0)``, as FSDP frees what it shards) crashed the process in
    the copy (a segmentation fault, which no ``except`` catches). It is compared by identity only. In a subprocess,
    so that a crash fails this test, not the suite."""
    import subprocess
    import sys

    code = """
import warnings, torch, precisebn
from torch import nn
warnings.simplefilter("ignore")
class Keeps(nn.Module):  # keeps running statistics its forward does not read
    def __init__(self):
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(8))
    def forward(self, x):
        return x
model = nn.Sequential(nn.Linear(6, 8), Keeps(), nn.BatchNorm1d(8))
model[1].running_mean.untyped_storage().resize_(0)
scheduler = precisebn.PreciseBNScheduler(model, [torch.randn(16, 6) for _ in range(2)], num_samples="all")
print(scheduler.update(1) is not None, scheduler.update(1) is None)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "True"]


def test_a_torchscript_submodule_leaves_the_checks_on() -> None:
    """The review of probe 43: a TorchScript submodule's buffer dict has no ``get``: reading the statistics failed, and
    with them the weights' record — every later trigger at the step was taken as current, whatever changed (0.68 σ
    and 75 % off after an in-place change of a weight)."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # (torch.jit.script is deprecated)
        relu = torch.jit.script(nn.ReLU())
    model = nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), relu, nn.Linear(6, 3), nn.BatchNorm1d(3))
    data = [x for x, _ in make_batches()]
    scheduler = precisebn.PreciseBNScheduler(model, data, num_samples="all")
    assert scheduler.update(1) is not None and scheduler.update(1) is None
    with torch.no_grad():
        model[3].weight.mul_(2.0)
    assert scheduler.update(1) is not None
    truth = compute_truth(model, data)
    assert_precise(model, {name: truth[name] for name in ("1", "4")})


def test_modules_the_passes_did_not_run_leave_the_statistics_current() -> None:
    """The review of probe 43: the statistics of every other module were compared, so an auxiliary head that runs in
    training only — whose buffers DDP broadcasts from rank 0 at the next forward, after each rank trained its own —
    and an averaged copy held beside the network made every step compute twice. Only the modules the passes called
    (before the updated layers) count."""

    class WithAux(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.body = nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6))
            self.aux = nn.Sequential(nn.Linear(6, 2), nn.BatchNorm1d(2))  # (training only)
            self.head = nn.Sequential(nn.Linear(6, 3), nn.BatchNorm1d(3))
            self.ema = torch.optim.swa_utils.AveragedModel(self.body)  # (held beside the network, never called)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.body(x)
            return self.head(h) + (self.aux(h).sum() if self.training else 0.0)

    model = WithAux()
    data = [x for x, _ in make_batches()]
    scheduler = precisebn.PreciseBNScheduler(model, data, num_samples="all", layers=["head.1"])
    assert scheduler.update(1) is not None
    for module in (model.aux[1], model.ema.module[1]):
        module.running_mean.add_(1.0)  # (a broadcast from another rank, update_bn on the copy)
    assert scheduler.update(1) is None
    model.body[1].running_var.mul_(2.0)  # (before the head: it fed it)
    assert scheduler.update(1) is not None
    assert scheduler.computations == 2
    truth = compute_truth(model, data, select=lambda name, m: name == "head.1")
    assert_precise(model, truth)


def test_the_calls_are_watched_without_a_hook_left_anywhere() -> None:
    """The passes' calls are watched through torch's global module hooks, held for the passes only: a copy of the model
    made in its forward (a teacher) carries no hook of precisebn's, and none stays behind after a computation, nor
    after one that raised."""
    from torch.nn.modules import module as torch_module

    copies: list[nn.Module] = []

    class Copies(nn.Sequential):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if not copies:
                copies.append(copy.deepcopy(self))
            return super().forward(x)

    torch.manual_seed(0)
    model = Copies(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.Linear(6, 3), nn.BatchNorm1d(3))
    hooks = (len(torch_module._global_forward_pre_hooks), len(torch_module._global_forward_hooks))
    data = [x for x, _ in make_batches()]
    scheduler = precisebn.PreciseBNScheduler(model, data, num_samples="all", layers=["3"])
    assert scheduler.update(1) is not None
    assert (len(torch_module._global_forward_pre_hooks), len(torch_module._global_forward_hooks)) == hooks
    assert copies and all(not m._forward_pre_hooks and not m._forward_hooks for m in copies[0].modules())
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())

    def failing() -> Any:
        yield data[0]
        raise RuntimeError("the data broke")

    broken = precisebn.PreciseBNScheduler(model, failing, num_samples="all", layers=["3"])
    with pytest.raises(RuntimeError, match="the data broke"):
        broken.update(2)
    assert (len(torch_module._global_forward_pre_hooks), len(torch_module._global_forward_hooks)) == hooks

    def interrupted() -> Any:
        yield data[0]
        raise KeyboardInterrupt

    stopped = precisebn.PreciseBNScheduler(model, interrupted, num_samples="all", layers=["3"])
    with pytest.raises(KeyboardInterrupt):
        stopped.update(2)
    assert (len(torch_module._global_forward_pre_hooks), len(torch_module._global_forward_hooks)) == hooks


def test_a_forward_that_calls_layers_in_another_order_from_batch_to_batch_is_judged_by_every_order() -> None:
    """The review of probe 43: the order of the model's first forward was taken for all of them; a forward that called
    a layer after the updated one in its first batch and before it in the others left the updated one "current"
    after that layer changed (1.49 σ and 187 % off). Every forward's order counts."""

    class Swaps(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.lin, self.earlier, self.updated = nn.Linear(4, 4), nn.BatchNorm1d(4), nn.BatchNorm1d(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x)
            if len(x) == 8:  # (the first batch)
                return self.earlier(self.updated(h))
            return self.updated(self.earlier(h))

    model = Swaps()
    g = torch.Generator().manual_seed(3)
    data = [torch.randn(8 if k == 0 else 6, 4, generator=g) * 2 + 1 for k in range(5)]
    scheduler = precisebn.PreciseBNScheduler(model, data, num_samples="all", layers=["updated"])
    assert scheduler.update(1) is not None and scheduler.update(1) is None
    model.earlier.running_mean.add_(1.5)  # (it feeds the updated layer in batches 2 to 5)
    assert scheduler.update(1) is not None
    truth = compute_truth(model, data, select=lambda name, m: name == "updated")
    assert_precise(model, truth)
