"""Batch handling."""

from __future__ import annotations

from collections import OrderedDict, namedtuple
from typing import Any

import pytest
import torch
from torch import nn

from precisebn.data import batch_size, default_forward, model_device, to_device
from precisebn.errors import BatchTypeError


def _assert_exact(stats, truth) -> None:
    """A layer's statistics against the float64 truth of its inputs (conftest.compute_truth)."""
    from conftest import max_rel_error

    assert stats.count == truth.count
    assert max_rel_error(stats.mean, truth.mean, truth.var.sqrt()) < 1e-6
    assert max_rel_error(stats.var, truth.var) < 1e-6


def test_batch_size() -> None:
    x = torch.zeros(7, 3)
    assert batch_size(x) == 7
    assert batch_size((x, torch.zeros(7))) == 7
    assert batch_size([x]) == 7
    assert batch_size({"a": "meta", "x": x}) == 7
    assert batch_size({"x": [x, x]}) == 7
    assert batch_size([{"image": torch.zeros(3, 5, 5)}] * 4) == 4  # detectron2-style list of records
    assert batch_size(torch.tensor(1.0)) == 1
    assert batch_size(object()) is None


def test_to_device_keeps_structure() -> None:
    Pair = namedtuple("Pair", "x y")
    batch = {"p": Pair(torch.zeros(2), [torch.ones(1), "s"]), "o": OrderedDict(a=torch.zeros(1))}
    moved = to_device(batch, torch.device("cpu"))
    assert isinstance(moved["p"], Pair) and moved["p"].y[1] == "s"
    assert isinstance(moved["o"], OrderedDict)
    assert to_device(batch, None) is batch


def test_default_forward() -> None:
    model = nn.Identity()
    x = torch.randn(2)
    assert default_forward(model, x) is x
    assert default_forward(model, (x, 1)) is x
    assert default_forward(lambda input: input, {"input": x}) is x  # type: ignore[arg-type]
    with pytest.raises(BatchTypeError, match="forward="):
        default_forward(model, 3)
    with pytest.raises(BatchTypeError):
        default_forward(model, ())


def test_model_device() -> None:
    assert model_device(nn.Linear(2, 2)) == torch.device("cpu")
    assert model_device(nn.BatchNorm1d(2, affine=False)) == torch.device("cpu")
    assert model_device(nn.ReLU()) is None


def test_a_forward_that_changes_its_batch_leaves_the_data_as_it_was() -> None:
    """Found by a regression probe: batches with nothing to move were handed over as the data's own objects
    for a while, so a forward popping the label emptied the user's list for the next pass."""
    import precisebn

    data = [{"x": torch.randn(4, 3), "label": torch.zeros(4)} for _ in range(3)]

    def forward(model: torch.nn.Module, batch: dict) -> torch.Tensor:
        batch.pop("label")
        return model(batch["x"])

    model = torch.nn.BatchNorm1d(3)
    for _ in range(2):
        precisebn.recalibrate(model, data, forward=forward)
    assert all(set(b) == {"x", "label"} for b in data)


def test_a_mapping_that_keeps_its_items_elsewhere_is_not_written_into() -> None:
    """Found by a regression probe: a shallow copy of a MutableMapping holding its items in an inner dict shares
    that dict, so filling the copy wrote the moved tensors into the user's own batch."""
    from collections.abc import MutableMapping

    class Store(MutableMapping):
        def __init__(self, items: dict | None = None) -> None:
            self._d = dict(items or {})

        def __getitem__(self, k):
            return self._d[k]

        def __setitem__(self, k, v) -> None:
            self._d[k] = v

        def __delitem__(self, k) -> None:
            del self._d[k]

        def __iter__(self):
            return iter(self._d)

        def __len__(self) -> int:
            return len(self._d)

    x = torch.randn(2, 3)
    batch = Store({"x": x})
    moved = to_device(batch, torch.device("meta"))
    assert type(moved) is Store and moved["x"].is_meta
    assert batch["x"] is x  # the user's batch as it was
    d = OrderedDict(x=x)
    assert to_device(d, torch.device("meta"))["x"].is_meta and d["x"] is x


def test_batch_size_of_detection_batches_and_named_inputs() -> None:
    images = tuple(torch.zeros(3, 10 + i, 12) for i in range(8))  # torchvision's detection batches
    targets = tuple({"boxes": torch.zeros(2, 4), "labels": torch.zeros(2)} for _ in range(8))
    assert batch_size((images, targets)) == 8  # (was 3: the first image's channels)
    assert batch_size([list(images), list(targets)]) == 8
    assert batch_size((list(images), torch.zeros(8))) == 8  # stacked labels (was 3)
    assert batch_size(({"x": torch.zeros(16, 4), "mask": torch.zeros(16)}, torch.zeros(16))) == 16  # (was 2)
    assert batch_size(((torch.zeros(16, 4), torch.zeros(16, 2)), torch.zeros(16))) == 16  # batched inputs
    assert batch_size(((torch.zeros(16, 4), torch.zeros(16, 2)), (torch.zeros(16), torch.zeros(16)))) == 16
    assert batch_size([{"image": torch.zeros(3, 4, 4)}] * 5) == 5  # detectron2's per-sample records
    boxes = tuple(torch.zeros(2 + i % 2, 4) for i in range(8))  # per-image boxes
    assert batch_size((images, boxes)) == 8
    hidden = (torch.zeros(8, 4), torch.zeros(2, 8, 16))  # (x, h0 of an RNN: layers x batch x hidden)
    assert batch_size((hidden, (torch.zeros(8), torch.zeros(8)))) == 8
    assert batch_size(((torch.zeros(8, 4), torch.zeros(8)), (torch.zeros(8), None))) == 8
    assert batch_size({"inputs": [torch.zeros(3, 5, 5)] * 8, "data_samples": [object()] * 8}) == 8  # mmengine
    gray = tuple(torch.zeros(1, 8, 8) for _ in range(6))  # per-sample grayscale images and masks
    assert batch_size((gray, gray)) == 6
    assert batch_size({"step": torch.tensor(3), "x": torch.zeros(5, 2)}) == 5  # a 0-d value says nothing


def test_batch_size_with_per_sample_metadata_first() -> None:
    x = torch.zeros(8, 4)
    names = [f"img{i}.png" for i in range(8)]
    assert batch_size((names, x)) == 8  # default_collate of (path, image) samples (was 2: the tuple's length)
    assert batch_size(("task", x)) == 8
    assert batch_size((names, names, {"x": x})) == 8
    assert batch_size((names,)) == 8  # nothing else tells: one name per sample
    assert batch_size(["a", "b", "c"]) == 3  # a batch of texts
    images = tuple(torch.zeros(3, 6, 6) for _ in range(8))  # per-sample images (a probe: counted as 3)
    targets = tuple({"boxes": torch.zeros(1, 4)} for _ in range(8))
    assert batch_size((tuple(names), images, targets)) == 8  # tuple(zip(*samples)) of (path, image, target)
    assert batch_size(("task", images, targets)) == 8
    assert batch_size((names, torch.eye(3), x)) == 8
    assert batch_size((list(range(8)), x)) == 8  # ids first
    assert batch_size(("task", {"x": x})) == 8
    assert batch_size((["cat", "dog"], x)) == 8  # names not one per sample (was 2): no tensor has as many
    assert batch_size((["cat", "dog"], torch.eye(3), x)) == 3  # (the first tensor then counts)


def test_a_prior_is_weighted_by_the_samples_of_batches_with_file_names_first() -> None:
    import precisebn

    torch.manual_seed(0)
    xs = [torch.randn(8, 4) + 2 for _ in range(10)]
    batches = [([f"img{i}_{j}.png" for j in range(8)], x) for i, x in enumerate(xs)]
    bn = nn.BatchNorm1d(4)
    bn.running_mean.fill_(5.0)
    bn.running_var.fill_(3.0)
    report = precisebn.recalibrate(bn, batches, forward=lambda m, b: m(b[1]), num_samples=64, prior=8)
    data = torch.cat(xs[:8]).double()  # 64 samples: 8 batches, not 32
    expected = (8 * 5.0 + 64 * data.mean(0)) / (8 + 64)  # the prior as 8 samples of pseudo-data
    assert (report.samples, report.batches) == (64, 8)
    torch.testing.assert_close(bn.running_mean.double(), expected, rtol=0, atol=1e-6)


def test_a_one_sample_batch_of_inputs_and_targets_counts_one_sample() -> None:
    import precisebn

    torch.manual_seed(0)
    sizes = [3, 3, 1, 3]
    xs = [torch.randn(k, 4, 3) + 2 for k in sizes]  # (three values per channel in a sample)
    batches = [  # ((x, mask), (labels, weights)): a batch's fields, not two per-sample inputs (was counted as 2)
        ((x, torch.ones(len(x), dtype=torch.bool)), (torch.zeros(len(x), dtype=torch.long), torch.ones(len(x))))
        for x in xs
    ]
    assert [batch_size(b) for b in batches] == sizes
    bn = nn.BatchNorm1d(4)
    bn.running_mean.fill_(5.0)
    report = precisebn.recalibrate(bn, batches, forward=lambda m, b: m(b[0][0]), num_samples=8, prior=8)
    data = torch.cat(xs).double()  # 3 + 3 + 1 < 8: the fourth batch is used too (was not: 3 + 3 + 2)
    expected = (8 * 5.0 + len(data) * data.mean((0, 2))) / (8 + len(data))  # the prior as 8 samples
    assert (report.samples, report.batches) == (10, 4)
    torch.testing.assert_close(bn.running_mean.double(), expected, rtol=0, atol=1e-6)
    gray = tuple(torch.zeros(1, 8, 8) for _ in range(2))  # per-sample grayscale images and masks: alike
    assert batch_size((gray, gray)) == 2
    mixed = (torch.zeros(1, 8, 8), torch.zeros(3, 8, 8))  # not every first dimension 1: per-sample
    assert batch_size((mixed, (torch.zeros(1), torch.zeros(1, dtype=torch.long)))) == 2


_X = [torch.randn(8, 3, 4, 4, generator=torch.Generator().manual_seed(k)) * 2 + 1 for k in range(6)]


@pytest.mark.parametrize(
    ("make", "forward"),
    [  # each counted 2, 3, 5 or 1 per batch before (a probe)
        (lambda x: ({"x": x}, {"y": torch.zeros(len(x))}), lambda m, b: m(b[0]["x"])),  # named inputs and targets
        (lambda x: [{"x": x}, {"y": torch.zeros(len(x))}], lambda m, b: m(b[0]["x"])),  # the same, collated
        (lambda x: [(x[i], i % 2) for i in range(len(x))], lambda m, b: m(torch.stack([s[0] for s in b]))),  # records
        (  # (boxes per image, as many as it has objects)
            lambda x: {"boxes": [torch.zeros(2 + i % 3, 4) for i in range(len(x))], "image": x},
            lambda m, b: m(b["image"]),
        ),
        (lambda x: (torch.tensor(7), x), lambda m, b: m(b[1])),  # a step count first
    ],
    ids=["dict-pair", "dict-pair-list", "records", "boxes-first", "step-first"],
)
def test_num_samples_counts_the_samples_of_every_batch_form(make: Any, forward: Any) -> None:
    import precisebn

    batches = [make(x) for x in _X]
    assert [batch_size(b) for b in batches] == [8] * 6
    bn = nn.BatchNorm2d(3)
    bn.running_mean.fill_(0.5)
    report = precisebn.recalibrate(bn, batches, forward=forward, num_samples=16, prior=16)
    data = torch.cat(_X[:2]).double()  # 16 samples: two batches
    expected = (16 * 0.5 + 16 * data.mean((0, 2, 3))) / 32  # the prior as 16 samples of pseudo-data
    assert (report.samples, report.batches) == (16, 2)
    torch.testing.assert_close(bn.running_mean.double(), expected, rtol=0, atol=1e-6)


def test_batch_forms_the_review_of_the_counting_rules_found_miscounted() -> None:
    """A review of the rules above: batched fields of one kind were taken for two records, a list of batched tensors
    beside a tensor of as many as it has items for per-sample tensors, records with optional keys for a pair."""
    n, z = 5, torch.zeros
    assert batch_size(((z(n, 4), z(n, 4)), (z(n, 2), z(n, 2)))) == n  # multi-input, multi-output (was 2)
    assert batch_size([[z(n, 4), z(n, 4)], [z(n, 2), z(n, 2)]]) == n
    assert batch_size(((z(n, 3, 8, 8), z(n, 1, 8, 8)), (z(n, 3, 8, 8), z(n, 1, 8, 8)))) == n  # inpainting
    assert batch_size({"features": [z(8, 4, 8 >> k, 8 >> k) for k in range(5)], "strides": z(5)}) == 8  # (was 5)
    assert batch_size({"crops": [z(n, 3, 4, 4)] * 2, "crop_scale": z(2)}) == n  # (was 2)
    records = [{"image": z(3, 8, 8)}, {"image": z(3, 8, 8), "annotations": []}] * 2  # optional keys
    assert batch_size(records) == 4  # (was 3)
    gray = [(z(1, 8, 8), torch.tensor(i % 2)) for i in range(n)]  # records with 0-d labels
    assert batch_size(gray) == n  # (was 2)
    assert batch_size([(z(3, 8, 8), 1)]) == 1  # one record (was 3)
    assert batch_size([(z(3, 8, 8), torch.tensor([1]))] * 2) == 2  # a one-element label tensor (was 3, a probe)
    assert batch_size([(z(3, 8, 8), z(1, 8, 8))]) == 1  # an image and its mask: not one batch's fields
    assert batch_size(((z(1, 3, 4, 4), z(1, 4, 4)), (z(1), torch.tensor(0.5)))) == 1  # one sample, a 0-d weight
    assert batch_size([torch.tensor(1.0)] * n) == n  # one value per sample


def test_batches_of_unknown_size_are_named_in_the_errors() -> None:
    import dataclasses

    import precisebn
    from precisebn.errors import InvalidArgumentError, StatsMismatchError

    @dataclasses.dataclass
    class Batch:
        x: torch.Tensor

    bn = nn.BatchNorm1d(4)
    batches = [Batch(torch.randn(8, 4)) for _ in range(4)]
    forward = lambda m, b: m(b.x)  # noqa: E731
    with pytest.raises(InvalidArgumentError, match=r"num_samples=8192 \(the default\) cannot be counted"):
        precisebn.recalibrate(bn, batches, forward=forward)  # (said "instead of num_samples=": none was given)
    with pytest.raises(InvalidArgumentError, match=r"holds, so num_samples= cannot be counted"):
        precisebn.recalibrate(bn, batches, forward=forward, num_samples=16)
    before = bn.running_mean.clone()
    with pytest.raises(StatsMismatchError, match="could not tell it for these batches"):
        precisebn.recalibrate(bn, batches, forward=forward, num_batches=4, prior=8)
    assert torch.equal(bn.running_mean, before)


@pytest.mark.parametrize("call", ["estimate", "recalibrate"])
def test_model_calls_made_by_the_data_are_refused_not_counted(call: str) -> None:
    """Found by probe 33b: a generator that ran the model being recalibrated between batches (hard-example
    mining, pseudo-labels: ``model(x * 10)``) had those calls pooled with the batches' — twice the values
    per channel, the variance 50x the data's, written as "pooled over 2 calls per forward". The data's calls
    are refused by name, the model unchanged; the same data without them is measured as its batches give."""
    import precisebn
    from conftest import assert_unchanged, compute_truth, max_rel_error, state_snapshot
    from precisebn.errors import InvalidArgumentError

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    batches = [torch.randn(8, 3, 8, 8) * 2 + 1 for _ in range(4)]

    def data(scores: bool):
        for x in batches:
            if scores:
                with torch.no_grad():
                    model(x * 10)
            yield x

    before = state_snapshot(model)
    with pytest.raises(InvalidArgumentError, match=r"layer '1' \(BatchNorm2d\) was called while the next batch"):
        getattr(precisebn, call)(model, data(True))
    assert_unchanged(model, before)
    truth = compute_truth(model, batches)["1"]
    stats = precisebn.estimate(model, data(False))["1"]
    assert stats.count == truth.count
    assert max_rel_error(stats.var, truth.var) < 1e-6


def _collate_running(model: nn.Module):  # (module level: pickled for the worker processes where fork is not used)
    def collate(items: list[tuple[torch.Tensor]]) -> torch.Tensor:
        x = torch.stack([item[0] for item in items])
        with torch.no_grad():
            model(x)  # (pseudo-labels, in the worker process: its own copy of the model)
            model.eval()  # (as pseudo-labelling does: probe 35a found this refused as a mode change)
            model(x)
            model.train()
        return x

    return collate


def test_model_calls_in_a_loaders_worker_processes_are_not_refused() -> None:
    """Found by probe 34a in the refusal above: a DataLoader whose workers (processes forked during the pass, the
    wrappers on) run the model in their collate_fn was refused, where those calls touch only the workers'
    copies and the statistics had been exact."""
    import multiprocessing

    from torch.utils.data import DataLoader, TensorDataset

    import precisebn
    from conftest import compute_truth

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6))
    images = torch.randn(24, 3, 12, 12) + 1
    ctx = multiprocessing.get_context("fork")  # (the workers copy the model with the pass on, as on Linux)
    loader = DataLoader(
        TensorDataset(images),
        batch_size=8,
        collate_fn=_collate_running(model),
        num_workers=2,
        multiprocessing_context=ctx,
    )
    truth = compute_truth(model, [images[k : k + 8] for k in range(0, 24, 8)])["1"]
    stats = precisebn.estimate(model, loader, num_batches=3)["1"]
    _assert_exact(stats, truth)


class _Scoring:
    """A collate function running the model, or its submodule ``part`` (pseudo-labels): picklable, for spawned
    workers."""

    def __init__(self, model: nn.Module, part: str = "") -> None:
        self.model, self.part = model, part

    def __call__(self, items: list[tuple[torch.Tensor]]) -> torch.Tensor:
        x = torch.stack([item[0] for item in items])
        with torch.no_grad():
            self.model.get_submodule(self.part)(x * 3 + 1)  # (in the worker: its own copy of the model)
        return x


@pytest.mark.slow
@pytest.mark.parametrize("capture", ["auto", "float64"])
def test_model_calls_in_a_loaders_spawned_worker_processes_are_not_refused(capture: str) -> None:
    """Left over from probe 36a: a loader whose workers are spawned (the start method of macOS, Windows and of
    Python 3.14 on Linux: forkserver) gets the model pickled — and the wrapped forwards could not be ("Can't
    pickle local object"), after which a ModelChangedWarning said the parameters had been changed in place
    (pickling had moved them into shared memory, values and all). The workers' copies run the model's own
    forward, as forked ones do, and the statistics are exact. (Their copies share the layers' counters' memory:
    with capture="float64" their counts read as calls around the wrapper, a review found.)"""
    import multiprocessing
    import warnings

    from torch.utils.data import DataLoader, TensorDataset

    import precisebn
    from conftest import assert_unchanged, compute_truth, state_snapshot
    from precisebn.errors import ModelChangedWarning

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6))
    images = torch.randn(24, 3, 12, 12) + 1
    loader = DataLoader(
        TensorDataset(images),
        batch_size=8,
        collate_fn=_Scoring(model),
        num_workers=1,
        multiprocessing_context=multiprocessing.get_context("spawn"),
    )
    truth = compute_truth(model, [images[k : k + 8] for k in range(0, 24, 8)])["1"]
    before = state_snapshot(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ModelChangedWarning)
        stats = precisebn.estimate(model, loader, num_batches=3, capture=capture)["1"]
    assert_unchanged(model, before)
    _assert_exact(stats, truth)


class _TwoHeads(nn.Module):
    """A body the passes run, and an auxiliary head only a loader's worker runs (pseudo-labels)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6))
        self.aux = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


@pytest.mark.slow
def test_a_spawned_worker_running_a_layer_the_passes_never_reach_is_not_refused() -> None:
    """Found reviewing probe 38's refusal of layers written around their forward: a spawned worker's copy shares the
    memory that layers hold between calls, and running a layer the passes never reach wrote it — refused as
    normalised around its forward, where it was rightly "not reached (kept)" before. Writes by another process are
    not this one's."""
    import multiprocessing

    from torch.utils.data import DataLoader, TensorDataset

    import precisebn
    from conftest import compute_truth, max_rel_error

    torch.manual_seed(0)
    model = _TwoHeads()
    images = torch.randn(24, 3, 12, 12) + 1
    loader = DataLoader(
        TensorDataset(images),
        batch_size=8,
        collate_fn=_Scoring(model, "aux"),
        num_workers=1,
        multiprocessing_context=multiprocessing.get_context("spawn"),
    )
    kept = model.aux[1].running_mean.clone()
    truth = compute_truth(model, [images[k : k + 8] for k in range(0, 24, 8)])["body.1"]
    report = precisebn.recalibrate(model, loader, num_batches=3)
    assert report["aux.1"].status == "not reached (kept)" and report.updated == ["body.1"]
    assert torch.equal(model.aux[1].running_mean, kept)
    assert max_rel_error(model.body[1].running_var, truth.var) < 1e-5


@pytest.mark.parametrize("how", ["copy.deepcopy", "torch.save"])
def test_a_copy_of_the_model_made_during_the_passes_is_a_model_of_its_own(how: str) -> None:
    """Found reviewing the test above: a copy made during the passes (a teacher made in forward) carried the
    wrapped forwards, so its layers ran the original's forward on the teacher's input, counted in its
    statistics (twice the values: a mean 3 times the data's), and the copy refused every call after the passes.
    A copy gets the layers' own forward: not counted, and a working model afterwards."""
    import copy
    import io

    import precisebn
    from conftest import compute_truth, max_rel_error

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    batches = [torch.randn(4, 3, 8, 8) + k for k in range(3)]
    reference = copy.deepcopy(model).eval()
    copies: list[nn.Module] = []

    def forward(m: nn.Module, x: torch.Tensor) -> None:
        if how == "copy.deepcopy":
            teacher = copy.deepcopy(m)
        else:
            saved = io.BytesIO()
            torch.save(m, saved)
            assert b"precisebn" not in saved.getvalue()  # (probe 37: it loaded only where precisebn is installed)
            teacher = torch.load(io.BytesIO(saved.getvalue()), weights_only=False)
        copies.append(teacher)
        with torch.no_grad():
            teacher(x * 5)  # (its own statistics: in training mode, it updates them)
        m(x)

    truth = compute_truth(model, batches)["1"]
    stats = precisebn.estimate(model, batches, forward=forward)["1"]
    _assert_exact(stats, truth)
    teacher = copies[0].eval()
    # its own call (training mode, momentum 1 as the passes held it) left the batch figures of its own input in its
    # own buffers, not the original's (float64 truth of that input, computed here)
    with torch.no_grad():
        seen = reference[0](batches[0] * 5).double().transpose(0, 1).reshape(4, -1)
    assert max_rel_error(teacher[1].running_mean, seen.mean(1), seen.std(1)) < 1e-5
    assert max_rel_error(teacher[1].running_var, seen.var(1)) < 1e-5
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        teacher(x)  # (refused as "called while the next batch was being drawn" before)
    teacher.load_state_dict(reference.state_dict())
    with torch.no_grad():
        assert torch.equal(teacher(x), reference(x))


@pytest.mark.parametrize("when", ["between batches", "after the last batch"])
def test_a_refused_call_caught_by_the_data_still_fails_the_pass(when: str) -> None:
    """Found reviewing the refusal above: the data's call made in a thread of its own (or caught by the data)
    raised there, and the pass went on and returned as if nothing had happened. The refusal is kept and raised
    again at the end of the batch — or at the end of the passes, for a call made as the data ran out."""
    import threading

    import precisebn
    from conftest import assert_unchanged, state_snapshot
    from precisebn.errors import InvalidArgumentError

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    batches = [torch.randn(4, 3, 8, 8) for _ in range(3)]
    caught = []

    def scored(x: torch.Tensor) -> None:  # (in a thread of the data's: what it raises stays there)
        try:
            with torch.no_grad():
                model(x)
        except InvalidArgumentError as exc:
            caught.append(exc)

    def data():
        for k, x in enumerate(batches):
            if when == "between batches" and k == 1:
                worker = threading.Thread(target=scored, args=(x,))
                worker.start()
                worker.join()
            yield x
        if when == "after the last batch":
            scored(batches[0])

    before = state_snapshot(model)
    with pytest.raises(InvalidArgumentError, match=r"layer '1' \(BatchNorm2d\) was called while the next batch"):
        precisebn.estimate(model, data())
    assert len(caught) == 1
    assert_unchanged(model, before)


@pytest.mark.parametrize("who", ["a data thread, during forward", "a thread of forward's own"])
def test_model_calls_from_another_thread_during_forward_are_refused_not_counted(who: str) -> None:
    """Left over from probe 36b: a data thread prefetching with the model (pseudo-labels) while forward(model, batch)
    ran had its calls counted in the statistics as the batch's (and two threads' calls at once mixed in the
    bookkeeping); only calls made between forwards were refused. Calls from any thread but the passes' own are."""
    import threading

    import precisebn
    from conftest import assert_unchanged, state_snapshot
    from precisebn.errors import InvalidArgumentError

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    batches = [torch.randn(4, 3, 8, 8) for _ in range(3)]
    go, done = threading.Event(), threading.Event()
    caught: list[BaseException] = []

    def scored() -> None:  # (what it raises stays in its thread)
        go.wait(10)
        try:
            with torch.no_grad():
                model(batches[0] * 3)
        except InvalidArgumentError as exc:
            caught.append(exc)
        done.set()

    def data():
        if who.startswith("a data thread"):
            threading.Thread(target=scored, name="prefetch", daemon=True).start()
        yield from batches

    def forward(m: nn.Module, x: torch.Tensor) -> None:
        if who.startswith("a thread of forward"):
            threading.Thread(target=scored, name="prefetch", daemon=True).start()
        if not done.is_set():
            go.set()
            done.wait(10)
        m(x)

    before = state_snapshot(model)
    with pytest.raises(InvalidArgumentError, match=r"layer '1' \(BatchNorm2d\) was called in thread 'prefetch'"):
        precisebn.recalibrate(model, data(), forward=forward)
    assert done.is_set() and len(caught) == 1
    assert_unchanged(model, before)


def test_another_thread_running_a_copy_during_forward_leaves_the_statistics_exact() -> None:
    """The remedy the refusal above names: the other thread runs a copy of the model."""
    import copy
    import threading

    import precisebn
    from conftest import compute_truth

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    teacher = copy.deepcopy(model)
    batches = [torch.randn(4, 3, 8, 8) + k for k in range(3)]

    def forward(m: nn.Module, x: torch.Tensor) -> None:
        with torch.no_grad():
            worker = threading.Thread(target=teacher, args=(x * 5,))
            worker.start()
            worker.join()
        m(x)

    truth = compute_truth(model, batches)["1"]
    stats = precisebn.estimate(model, batches, forward=forward)["1"]
    _assert_exact(stats, truth)


@pytest.mark.parametrize("forward_of", ["the class", "a partial"])
def test_a_model_pickled_during_the_passes_names_nothing_of_precisebn(forward_of: str) -> None:
    """Probe 37 and its review: pickled during the passes, a layer's forward was precisebn's wrapper, then a
    function of precisebn's; the pickle loaded only where precisebn is installed. It pickles as the layer's own
    forward would: a bound method, or a forward the instance holds (a functools.partial)."""
    import functools
    import pickle

    import precisebn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    if forward_of == "a partial":
        model[1].forward = functools.partial(nn.BatchNorm2d.forward, model[1])
    assert b"precisebn" not in pickle.dumps(model)  # (the premise: before the passes)
    reference = pickle.loads(pickle.dumps(model)).eval()
    pickled = []

    def forward(m: nn.Module, x: torch.Tensor) -> None:
        pickled.append(pickle.dumps(m))
        m(x)

    precisebn.estimate(model, [torch.randn(2, 3, 8, 8)], forward=forward)
    assert b"precisebn" not in pickled[0]
    copy = pickle.loads(pickled[0]).eval()  # (the model as the passes held it: its statistics, its own forward)
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        assert torch.equal(copy(x), reference(x))


def test_a_shallow_copy_of_a_layer_made_during_the_passes_says_why_it_is_refused_after_them() -> None:
    """Review of probe 37: copy.copy(layer) in forward keeps precisebn's wrapper in the copy's own attributes
    (documented); called after the passes it was refused as "called while the next batch was being drawn"."""
    import copy

    import precisebn
    from precisebn.errors import InvalidArgumentError

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    kept = []

    def forward(m: nn.Module, x: torch.Tensor) -> None:
        kept.append(copy.copy(m[1]))
        m(x)

    precisebn.estimate(model, [torch.randn(2, 3, 8, 8)], forward=forward)
    with pytest.raises(InvalidArgumentError, match=r"after the passes that put it there had ended: .* shallow copy"):
        kept[0](torch.randn(2, 4, 6, 6))
    del kept[0].forward  # (the remedy the message names)
    y = torch.randn(2, 4, 6, 6)
    with torch.no_grad():
        assert torch.equal(kept[0].eval()(y), model[1].eval()(y))  # (a shallow copy: the layer's own buffers)


def test_a_batch_the_model_does_not_take_gets_a_note_saying_how_it_was_passed() -> None:
    """A probe: a dict batch (``{"x": images, "y": labels}``) given to a model that takes one tensor failed with
    only "forward() got an unexpected keyword argument 'x'". The model's own TypeError still propagates,
    unchanged, the model untouched; a note says how precisebn called it and to pass ``forward=``, which then
    gives the statistics of what the layer received (against the float64 truth)."""
    import precisebn
    from conftest import assert_unchanged, compute_truth, state_snapshot

    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    batches = [{"x": torch.randn(8, 3, 6, 6, generator=g) * 2 + 1, "y": torch.zeros(8)} for _ in range(4)]
    before = state_snapshot(model)
    with pytest.raises(TypeError, match="unexpected keyword argument") as info:
        precisebn.recalibrate(model, batches)
    notes = getattr(info.value, "__notes__", [])
    assert any("model(**batch), a dict batch's keys (x, y)" in n and "forward=lambda" in n for n in notes), notes
    assert_unchanged(model, before)
    with pytest.raises(TypeError, match="positional argument") as info:
        default_forward(nn.Bilinear(3, 3, 2), (torch.randn(4, 3), torch.randn(4, 3)))
    assert any("model(batch[0]), the first element" in n for n in getattr(info.value, "__notes__", []))
    truth = compute_truth(model, [b["x"] for b in batches])
    stats = precisebn.estimate(model, batches, forward=lambda m, b: m(b["x"]))
    _assert_exact(stats["1"], truth["1"])

    class Odd(nn.Module):
        def forward(self, x: Any) -> Any:
            return x + "1"  # a TypeError of the model's own, not about its arguments: no note

    with pytest.raises(TypeError) as info:
        default_forward(Odd(), {"x": torch.zeros(2)})
    assert not getattr(info.value, "__notes__", [])
