"""The ``precisebn`` command line, driven through ``main([...])`` and once as the installed script."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import precisebn
from conftest import compute_truth, max_rel_error, pooled_moments
from precisebn.cli import main
from precisebn.specs import IMAGENET_MEAN, IMAGENET_STD

torchvision = pytest.importorskip("torchvision")
Image = pytest.importorskip("PIL.Image")

MODEL = "torchvision:mobilenet_v3_small"
KWARGS = "num_classes=4"
SIZE = 32


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors: one thread is faster, and immune to other processes on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Opaque:
    """Something a weights-only load refuses."""


def _build_model() -> torch.nn.Module:
    return torchvision.models.get_model("mobilenet_v3_small", weights=None, num_classes=4)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny ImageFolder (two classes, odd sizes, bright and dark images) and a checkpoint."""
    root = tmp_path_factory.mktemp("cli")
    rng = np.random.default_rng(0)
    for cls, (low, high) in {"cats": (0, 120), "dogs": (100, 256)}.items():
        (root / "images" / cls).mkdir(parents=True)
        for i in range(7):
            pixels = rng.integers(low, high, size=(30 + 3 * i, 44, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / "images" / cls / f"{i}.png")
    (root / "empty").mkdir()
    torch.manual_seed(0)
    model = _build_model()
    with torch.no_grad():  # trained-looking statistics, so that recalibration changes them
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.normal_()
                m.running_var.uniform_(0.5, 2.0)
    torch.save(model.state_dict(), root / "model.pt")
    return {"root": root, "images": root / "images", "empty": root / "empty", "ckpt": root / "model.pt"}


def _direct(ckpt: dict[str, torch.Tensor], images: Path) -> torch.nn.Module:
    """The same recalibration done by hand: torchvision's ImageFolder and precisebn.recalibrate."""
    t = torchvision.transforms
    transform = t.Compose(
        [t.Resize(round(SIZE / 0.875)), t.CenterCrop(SIZE), t.ToTensor(), t.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    )
    dataset = torchvision.datasets.ImageFolder(str(images), transform=transform)
    # The CLI's documented order: torch.randperm with --seed (0), cut into --batch-size (4) batches. Only the
    # first layer's statistics are independent of the batches (the others see inputs normalised per batch).
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(0))
    batches = [torch.stack([dataset[int(i)][0] for i in chunk]) for chunk in order.split(4)]
    model = _build_model()
    model.load_state_dict(ckpt)
    precisebn.recalibrate(model, batches, num_samples="all")
    return model


def _recalibrate_args(files: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return [
        "recalibrate", str(files["ckpt"]), "--model", MODEL, "--model-kwargs", KWARGS,
        "--data", str(files["images"]), "--out", str(out), "--image-size", str(SIZE),
        "--batch-size", "4", "--no-progress", *extra,
    ]  # fmt: skip


def _check_against_direct(written: dict[str, torch.Tensor], original: dict[str, torch.Tensor], images: Path) -> None:
    expected = _direct(original, images).state_dict()
    assert written.keys() == original.keys()
    changed = 0
    for key, value in written.items():
        assert value.dtype == original[key].dtype, key
        if key.endswith(("running_mean", "running_var")):
            torch.testing.assert_close(value, expected[key], rtol=1e-5, atol=1e-6, msg=key)
            changed += not torch.equal(value, original[key])
        else:  # weights and num_batches_tracked are copied bit for bit
            assert torch.equal(value, original[key]), key
    assert changed == 2 * sum(isinstance(m, torch.nn.BatchNorm2d) for m in _build_model().modules())


def test_recalibrate_matches_direct_call(files, tmp_path, capsys):
    out = tmp_path / "out" / "recalibrated.pt"
    report = tmp_path / "report.json"
    assert main(_recalibrate_args(files, out, "--num-samples", "all", "--report", str(report))) == 0
    printed = capsys.readouterr().out
    assert "34 layers updated, 0 not reached; 14 samples" in printed
    original = torch.load(files["ckpt"], weights_only=True)
    _check_against_direct(torch.load(out, weights_only=True), original, files["images"])
    saved = json.loads(report.read_text())
    assert saved["samples"] == 14 and len(saved["layers"]) == 34
    assert report.with_suffix(".png").read_bytes().startswith(b"\x89PNG")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["out", "recalibrated.pt", "report.json", "report.png"]


def test_recalibrate_uses_all_images_when_fewer_than_num_samples(files, tmp_path, capsys):
    out = tmp_path / "out.pt"
    assert main(_recalibrate_args(files, out, "--num-samples", "100")) == 0
    captured = capsys.readouterr()
    assert "using every image of" in captured.out and "(14 images, fewer than --num-samples 100)" in captured.out
    assert "warning" not in captured.err
    _check_against_direct(
        torch.load(out, weights_only=True), torch.load(files["ckpt"], weights_only=True), files["images"]
    )


def test_recalibrate_safetensors_keeps_format_and_metadata(files, tmp_path):
    st = pytest.importorskip("safetensors.torch")
    from safetensors import safe_open

    original = torch.load(files["ckpt"], weights_only=True)
    src, out = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    st.save_file(original, str(src), metadata={"note": "kept"})
    args = _recalibrate_args(files, out, "--num-samples", "all")
    args[1] = str(src)
    assert main(args) == 0
    with safe_open(str(out), framework="pt") as f:
        assert f.metadata() == {"note": "kept"}
    _check_against_direct(st.load_file(str(out)), original, files["images"])


def test_recalibrate_container_and_prefix_in_place(files, tmp_path):
    original = torch.load(files["ckpt"], weights_only=True)
    path = tmp_path / "train.pth"
    torch.save({"epoch": 7, "model": {f"module.{k}": v for k, v in original.items()}}, path)
    args = _recalibrate_args(files, tmp_path / "unused.pth", "--num-samples", "all")
    args[1] = str(path)
    i = args.index("--out")
    args[i : i + 2] = ["--in-place"]
    assert main(args) == 0
    written = torch.load(path, weights_only=True)
    assert written["epoch"] == 7
    _check_against_direct({k[len("module.") :]: v for k, v in written["model"].items()}, original, files["images"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.pth"]


def test_other_state_dicts_are_named_and_reached_with_key(files, tmp_path, capsys):
    """Found by a hostile probe: timm's checkpoints hold the EMA weights under "state_dict_ema"; they were
    left with stale statistics without a word. Now the CLI says so, and --key reaches them."""
    original = torch.load(files["ckpt"], weights_only=True)  # an OrderedDict with torch's _metadata
    ema = {k: v + 0.01 if v.is_floating_point() and "running" not in k else v.clone() for k, v in original.items()}
    path = tmp_path / "timm.pth.tar"
    torch.save({"epoch": 3, "state_dict": original, "state_dict_ema": ema}, path)
    args = _recalibrate_args(files, tmp_path / "unused.pth", "--num-samples", "all")
    args[1] = str(path)
    i = args.index("--out")
    args[i : i + 2] = ["--in-place"]
    assert main(args) == 0
    assert "also holds the state_dict 'state_dict_ema'" in capsys.readouterr().err
    first = torch.load(path, weights_only=True)
    _check_against_direct(first["state_dict"], original, files["images"])
    assert first["state_dict"]._metadata == original._metadata  # module versions kept
    assert all(torch.equal(first["state_dict_ema"][k], v) for k, v in ema.items())
    assert main([*args, "--key", "state_dict_ema"]) == 0
    assert "also holds the state_dict 'state_dict'" in capsys.readouterr().err
    second = torch.load(path, weights_only=True)
    _check_against_direct(second["state_dict_ema"], ema, files["images"])
    assert all(torch.equal(second["state_dict"][k], v) for k, v in first["state_dict"].items())
    assert second["epoch"] == 3
    assert main([*args, "--key", "model_ema"]) == 1
    assert "no state_dict under 'model_ema'" in capsys.readouterr().err
    assert main(["inspect", str(path), "--key", "state_dict_ema"]) == 0  # inspect and diff take --key too
    captured = capsys.readouterr()
    assert "also holds the state_dict 'state_dict'" in captured.err and "features.0.1" in captured.out
    assert main(["diff", str(path), str(path), "--key", "state_dict_ema"]) == 0
    assert "34 layers compared, 34 identical" in capsys.readouterr().out


def test_inspect_says_a_statistics_file_is_one(files, tmp_path, capsys):
    """Found by a hostile probe: a stats.save() file was 'no normalization statistics... is it a model?'."""
    stats = precisebn.PopulationStats(
        {"bn": precisebn.population.LayerStats(torch.zeros(3), torch.ones(3), 10, 1, "BatchNorm2d")}, 10, 1, "norm"
    )
    path = tmp_path / "bn.safetensors"
    stats.save(path)
    assert main(["inspect", str(path)]) == 1
    assert "is a precisebn statistics file (PopulationStats.save)" in capsys.readouterr().err


def test_recalibrate_with_data_function(files, tmp_path, monkeypatch):
    batches = [torch.randn(3, 3, SIZE, SIZE) * 2 + 1 for _ in range(3)]
    torch.save(batches, tmp_path / "batches.pt")
    (tmp_path / "cli_data_fn.py").write_text(
        "import torch\ndef batches(path):\n    return torch.load(path, weights_only=True)\n"
    )
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out.pt"
    args = _recalibrate_args(files, out, "--data-kwargs", json.dumps({"path": str(tmp_path / "batches.pt")}))
    args[args.index("--data") + 1] = "cli_data_fn:batches"
    for name in ("--image-size", "--batch-size"):  # an image folder's options: refused for a data function (below)
        i = args.index(name)
        del args[i : i + 2]
    assert main(args) == 0
    model = _build_model()
    model.load_state_dict(torch.load(files["ckpt"], weights_only=True))
    precisebn.recalibrate(model, batches)
    written = torch.load(out, weights_only=True)
    for key, value in model.state_dict().items():  # the same batches in the same order: bitwise equal
        assert torch.equal(written[key], value), key


def test_inspect_flags_unhealthy_layers(files, tmp_path, capsys):
    sd = torch.load(files["ckpt"], weights_only=True)
    sd["features.0.1.running_var"][:3] = torch.tensor([float("nan"), -1.0, 0.0])
    sd["features.1.block.0.1.running_var"][0] = 1e-12
    fresh = _build_model().state_dict()
    for key in ("features.12.1.running_mean", "features.12.1.running_var"):
        sd[key] = fresh[key]  # initial 0/1: never updated
    path = tmp_path / "sick.pt"
    torch.save(sd, path)
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("features.")}
    assert len(rows) == 34
    assert "non-finite: 1 ch" in rows["features.0.1"] and "var<=0: 2 ch" in rows["features.0.1"]
    assert "collapsed: 1 ch" in rows["features.1.block.0.1"]
    assert rows["features.12.1"].endswith("never updated")
    assert rows["features.2.block.0.1"].endswith("ok")
    assert "34 normalization layers, 3 flagged" in out
    assert main(["inspect", str(path), "--strict"]) == 3  # problems found: not 1 (failed) nor 2 (usage)
    assert main(["inspect", str(files["ckpt"]), "--strict"]) == 0


def test_diff_two_checkpoints(files, tmp_path, capsys):
    out = tmp_path / "b.pt"
    assert main(_recalibrate_args(files, out, "--num-samples", "all")) == 0
    capsys.readouterr()
    plot = tmp_path / "diff.png"
    assert main(["diff", str(files["ckpt"]), str(out), "--plot", str(plot)]) == 0
    text = capsys.readouterr().out
    a, b = torch.load(files["ckpt"], weights_only=True), torch.load(out, weights_only=True)
    n_other = sum(not k.endswith(("running_mean", "running_var", "num_batches_tracked")) for k in a)
    assert f"34 layers compared, 0 identical; other tensors: {n_other} identical, 0 differ" in text
    row = next(line for line in text.splitlines() if line.startswith("features.0.1 "))
    shift = ((b["features.0.1.running_mean"] - a["features.0.1.running_mean"]).double().abs()
             / (b["features.0.1.running_var"].double() + 1e-5).sqrt())  # fmt: skip
    assert float(row.split()[2]) == pytest.approx(float(shift.mean()), rel=5e-3)  # printed to 3 digits
    assert plot.read_bytes().startswith(b"\x89PNG")
    assert main(["diff", str(out), str(out)]) == 0
    assert "34 layers compared, 34 identical" in capsys.readouterr().out


def test_diff_of_a_file_with_nan_against_itself_is_identical(files, tmp_path, capsys):
    """Found by a hostile probe: NaN (a diverged run) made identical tensors 'differ'."""
    state = torch.load(files["ckpt"], weights_only=True)
    state["features.0.0.weight"].view(-1)[0] = float("nan")
    state["features.0.1.running_var"][1] = float("nan")
    path = tmp_path / "nan.pt"
    torch.save(state, path)
    assert main(["diff", str(path), str(path)]) == 0
    n_other = sum(not k.endswith(("running_mean", "running_var", "num_batches_tracked")) for k in state)
    assert f"34 layers compared, 34 identical; other tensors: {n_other} identical, 0 differ" in capsys.readouterr().out


def _write(path: Path, content: bytes) -> Path:
    path.write_bytes(content)
    return path


def _bad_cases(files: dict[str, Path], tmp: Path) -> dict[str, tuple[list[str], str]]:
    """name → (arguments, a phrase the error must contain)."""
    good = torch.load(files["ckpt"], weights_only=True)
    truncated = tmp / "truncated.pt"
    truncated.write_bytes(files["ckpt"].read_bytes()[:5000])

    pickled = tmp / "pickled.pt"
    torch.save({"state_dict": good, "config": Opaque()}, pickled)
    listed = tmp / "list.pt"
    torch.save([1, 2], listed)
    no_norm = tmp / "linear.pt"
    torch.save(torch.nn.Linear(2, 2).state_dict(), no_norm)
    (tmp / "cli_bad_user.py").write_text(
        "import torch\n"
        "def exploding(**kw):\n    raise RuntimeError('out of coffee')\n"
        "def not_a_model():\n    return 3\n"
        "def data_fails():\n    raise OSError('disk gone')\n"
        "def data_scalar():\n    return 5\n"
        "def wrong_shape():\n    return [torch.zeros(2, 5)]\n"
    )
    (files["images"].parent / "broken").mkdir(exist_ok=True)
    _write(files["images"].parent / "broken" / "x.png", b"not a png at all")
    out = tmp / "out.pt"

    def rec(*replace: tuple[str, str], extra: tuple[str, ...] = ()) -> list[str]:
        args = _recalibrate_args(files, out, *extra)
        for option, value in replace:
            if option == "CHECKPOINT":
                args[1] = value
            else:
                args[args.index(option) + 1] = value
            if option == "--data" and ":" in value:  # a data function: no image folder (or loading) options
                for name in ("--image-size", "--batch-size"):
                    i = args.index(name)
                    del args[i : i + 2]
        return args

    return {
        "missing checkpoint": (rec(("CHECKPOINT", str(tmp / "nope.pt"))), "does not exist"),
        "garbage checkpoint": (rec(("CHECKPOINT", str(_write(tmp / "junk.pt", b"junk" * 50)))), "cannot read"),
        "truncated checkpoint": (rec(("CHECKPOINT", str(truncated))), "cannot read"),
        "garbage safetensors": (
            rec(
                ("CHECKPOINT", str(_write(tmp / "junk.safetensors", b"junk" * 9))),
                ("--out", str(tmp / "o.safetensors")),
            ),
            "cannot read",
        ),
        "pickled objects": (rec(("CHECKPOINT", str(pickled))), "--trust-checkpoint"),
        "not a state_dict": (rec(("CHECKPOINT", str(listed))), "holds a list"),
        "other num_classes": (rec(("--model-kwargs", "num_classes=7")), "shape mismatch"),
        "other model": (rec(("--model", "torchvision:resnet18")), "missing"),
        "unknown model": (rec(("--model", "torchvision:mobilenet_v3_smal")), "did you mean mobilenet_v3_small"),
        "unknown kwarg": (rec(("--model", "torchvision:resnet18"), ("--model-kwargs", "colour=1")), "colour"),
        "factory raises": (rec(("--model", "cli_bad_user:exploding")), "out of coffee"),
        "factory not a model": (
            rec(("--model", "cli_bad_user:not_a_model"), ("--model-kwargs", "")),
            "not a torch.nn.Module",
        ),
        "module not found": (rec(("--model", "no_such_pkg.models:make")), "cannot import 'no_such_pkg.models'"),
        "missing attribute": (rec(("--model", "cli_bad_user:exploder")), "did you mean exploding"),
        "empty image folder": (rec(("--data", str(files["empty"]))), "no images found"),
        "no such data folder": (rec(("--data", str(tmp / "nowhere"))), "no such folder"),
        "unreadable image": (rec(("--data", str(files["images"].parent / "broken"))), "cannot read image"),
        "data function raises": (rec(("--data", "cli_bad_user:data_fails")), "disk gone"),
        "data not iterable": (rec(("--data", "cli_bad_user:data_scalar")), "not an iterable"),
        "model fails on the data": (
            rec(("--data", "cli_bad_user:wrong_shape")),
            "the model failed on a batch of (2, 5)",
        ),
        "inspect garbage": (["inspect", str(tmp / "junk.pt")], "cannot read"),
        "inspect no statistics": (["inspect", str(no_norm)], "no normalization statistics"),
        "diff missing": (["diff", str(files["ckpt"]), str(tmp / "nope.pt")], "does not exist"),
    }


BAD = [
    "missing checkpoint", "garbage checkpoint", "truncated checkpoint", "garbage safetensors", "pickled objects",
    "not a state_dict", "other num_classes", "other model", "unknown model", "unknown kwarg",
    "factory raises", "factory not a model", "module not found", "missing attribute", "empty image folder",
    "no such data folder", "unreadable image", "data function raises", "data not iterable", "model fails on the data",
    "inspect garbage", "inspect no statistics", "diff missing",
]  # fmt: skip


@pytest.mark.parametrize("case", BAD)
def test_bad_input_gives_one_paragraph_and_no_file(case, files, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    args, phrase = _bad_cases(files, tmp_path)[case]
    before = sorted(p.name for p in tmp_path.iterdir())
    ckpt_bytes = files["ckpt"].read_bytes()
    assert main(args) == 1
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    message = err.splitlines()[-1]
    assert message.startswith(f"precisebn {args[0]}: error: ")
    assert phrase in message
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "__pycache__") == before
    assert files["ckpt"].read_bytes() == ckpt_bytes


def test_trust_checkpoint_loads_pickled_objects_with_a_warning(files, tmp_path, capsys):
    good = torch.load(files["ckpt"], weights_only=True)
    path = tmp_path / "pickled.pt"
    torch.save({"state_dict": good, "config": Opaque()}, path)
    assert main(["inspect", str(path)]) == 1
    assert main(["inspect", str(path), "--trust-checkpoint"]) == 0
    assert main(["diff", str(path), str(files["ckpt"]), "--trust-checkpoint"]) == 0
    assert "34 layers compared, 34 identical" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args",
    [["frobnicate"], ["recalibrate", "x.pt"], ["recalibrate", "x.pt", "--model", "m:f", "--data", "d"],
     ["demo", "--epochs", "0"], ["inspect"], ["diff", "a.pt", "b.pt", "--plot", "plots/"],
     ["inspect", "a.pt", "--collapse-ratio", "nan"], ["inspect", "a.pt", "--collapse-ratio", "-1"],
     ["demo", "--seed", "200000000000000"], ["demo", "--seed", "-1"]],
)  # fmt: skip
def test_usage_errors_exit_2(args, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "usage: precisebn" in err and "Traceback" not in err


def test_debug_shows_the_traceback(files, tmp_path):
    from precisebn.checkpoint import CheckpointError

    with pytest.raises(CheckpointError):
        main(["--debug", "inspect", str(tmp_path / "missing.pt")])


def test_installed_script_runs(files):
    script = Path(sys.executable).with_name("precisebn")
    if not script.exists():
        pytest.skip("the console script is not installed next to this interpreter")
    done = subprocess.run(
        [str(script), "inspect", str(files["ckpt"])], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("features.")]
    assert len(rows) == 34 and all(line.endswith("ok") for line in rows)
    assert done.stderr == ""


# --- issue 10: outputs planned up front, all or none; aliases; preprocessing; a consistent CLI --------------

SCRIPT = Path(sys.executable).with_name("precisebn")

TINY_MODULE = '''
import torch
from torch import nn
from torchvision import transforms as T


class Tiny(nn.Module):
    def __init__(self, width=6):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=2)
        self.bn2 = nn.BatchNorm2d(width)
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean((2, 3)))


class Shared(nn.Module):
    """One BatchNorm registered under two parents: state_dict names bn.* and block.1.*."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.block = nn.Sequential(self.conv, self.bn, nn.ReLU())

    def forward(self, x):
        return self.block(x)


def transform(image):
    return T.Normalize((0.1, 0.2, 0.3), (0.5, 0.5, 0.5))(T.ToTensor()(image)) * 1.5


def lazy():
    return nn.Sequential(nn.LazyConv2d(4, 3), nn.LazyBatchNorm2d(), nn.ReLU(), nn.Flatten(), nn.LazyLinear(2))


def exits():
    import sys

    sys.exit(0)  # a script that parses its own arguments on import does this


def batches(n=3):
    g = torch.Generator().manual_seed(3)
    return [torch.randn(5, 3, 12, 12, generator=g) * 2 + 1 for _ in range(n)]


class WithExtraState(nn.Module):
    # a module that keeps a Python value in its state_dict (torch's get_extra_state/set_extra_state)
    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.scale = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), 1.0

    def forward(self, x):
        return self.bn(self.conv(x)) * self.scale

    def get_extra_state(self):
        return {"scale": self.scale}

    def set_extra_state(self, state):
        self.scale = state["scale"]


class Unsaved(nn.BatchNorm2d):
    # running statistics kept out of the state_dict (as some export code does)
    def __init__(self, c):
        super().__init__(c)
        mean, var = self._buffers.pop("running_mean"), self._buffers.pop("running_var")
        self.register_buffer("running_mean", mean, persistent=False)
        self.register_buffer("running_var", var, persistent=False)


def with_unsaved():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), Unsaved(4), nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4))


class Pooled(nn.Module):
    # a BatchNorm1d after global pooling: one value per channel and sample
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm1d(4)

    def forward(self, x):
        return self.bn(self.conv(x).mean((2, 3)))


class UnsavedAlias(nn.Module):
    # the layer of unsaved statistics under a second name
    def __init__(self):
        super().__init__()
        self.body = with_unsaved()
        self.alias = self.body[1]

    def forward(self, x):
        return self.body(x)
'''


def _sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _stray(root: Path) -> list[str]:
    return sorted(p.name for p in root.rglob("*") if ".precisebn-" in p.name or p.name.endswith(".tmp"))


def _scramble(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.normal_()
                m.running_var.uniform_(0.5, 2.0)
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A user module (models, a transform, a data function), a 32x32 image folder and checkpoints."""
    root = tmp_path_factory.mktemp("tiny")
    (root / "cli_tiny.py").write_text(TINY_MODULE)
    rng = np.random.default_rng(1)
    (root / "img32").mkdir()
    for i in range(10):
        pixels = rng.integers(20 * (i % 3), 256 - 30 * (i % 2), size=(32, 32, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(root / "img32" / f"{i}.png")
    sys.path.insert(0, str(root))
    import cli_tiny

    torch.manual_seed(1)
    torch.save(_scramble(cli_tiny.Tiny()).state_dict(), root / "tiny.pt")
    torch.save(_scramble(cli_tiny.Shared()).state_dict(), root / "shared.pt")
    yield {"root": root, "images": root / "img32", "ckpt": root / "tiny.pt", "shared": root / "shared.pt"}
    sys.path.remove(str(root))


def _tiny_args(tiny: dict[str, Path], ckpt: Path, out: Path | str, *extra: str) -> list[str]:
    return [
        "recalibrate", str(ckpt), "--model", "cli_tiny:Tiny", "--data", str(tiny["images"]), "--out", str(out),
        "--batch-size", "4", "--num-samples", "all", "--no-progress", "--device", "cpu", *extra,
    ]  # fmt: skip


def _folder_batches(folder: Path, transform: Any, batch_size: int = 4) -> list[torch.Tensor]:
    """The CLI's documented order, rebuilt here: sorted files, torch.randperm(seed 0), a last single joins."""
    paths = sorted(folder.rglob("*.png"))
    order = torch.randperm(len(paths), generator=torch.Generator().manual_seed(0)).tolist()
    chunks = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    if len(chunks) > 1 and len(chunks[-1]) == 1:
        last = chunks.pop()  # (not `chunks[-2] += chunks.pop()`: that assigns to the new [-2])
        chunks[-1] += last
    return [torch.stack([transform(Image.open(paths[i]).convert("RGB")) for i in c]) for c in chunks]


def _python_recalibrated(factory: Any, ckpt: Path, batches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    model = factory()
    model.load_state_dict(torch.load(ckpt, weights_only=True))
    precisebn.recalibrate(model, batches, num_samples="all")
    return model.state_dict()


def _assert_stats_close(written: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    keys = [k for k in expected if k.endswith(("running_mean", "running_var"))]
    assert keys
    for k in keys:
        torch.testing.assert_close(written[k], expected[k], rtol=1e-5, atol=1e-5, msg=k)


@pytest.fixture
def work(tiny, tmp_path, monkeypatch) -> dict[str, Path]:
    """A private copy of the tiny checkpoint in tmp_path (the cwd), with its sha256."""
    monkeypatch.chdir(tmp_path)
    ckpt = tmp_path / "model.pt"
    ckpt.write_bytes(tiny["ckpt"].read_bytes())
    (tmp_path / "existing_dir").mkdir()
    (tmp_path / "link.pt").symlink_to(ckpt)
    return {"dir": tmp_path, "ckpt": ckpt, "sha": _sha(ckpt)}


REFUSED = {  # name -> (extra arguments / replacements, a phrase of the message); all exit 2 before loading
    "report is the input (1)": (["--report", "model.pt"], "is the input CHECKPOINT"),
    "report is the output (1)": (["--report", "out.pt"], "is the same file as --out"),
    "report's PNG is the output (1)": (["--out", "r.png", "--report", "r.json"], "same file as --out"),
    "out via a missing folder's .. (2)": (["--out", "newdir/../model.pt"], "is the input CHECKPOINT"),
    "out is a symlink to the input (2)": (["--out", "link.pt"], "is the input CHECKPOINT"),
    "out is the input": (["--out", "model.pt"], "--in-place"),
    "out is a folder": (["--out", "existing_dir"], "is a folder"),
    "out ends with a slash": (["--out", "newdir/"], "names a folder"),
    "out ends with /.": (["--out", "x.pt/."], "names a folder ('.' and '..' are folders)"),
    "out is . (a probe: 'it ends with a slash')": (["--out", "."], "names a folder ('.' and '..' are folders)"),
    "format mismatch": (["--out", "o.safetensors"], "same kind of extension"),
    "bad device": (["--device", "toaster"], "not a device"),
    "device gpu (8)": (["--device", "gpu"], "not a device"),
    "device meta (8)": (["--device", "meta"], "cannot hold"),
    "workers -1 (8)": (["--workers", "-1"], "expected 0 or a positive integer"),
    "malformed model kwargs (8)": (["--model-kwargs", "{not json"], "not valid JSON"),
    "bad kwargs pair (8)": (["--model-kwargs", "width"], "is not key=value"),
    "report path is png": (["--report", "r.png"], "JSON"),
    "transform and crop (7)": (["--transform", "cli_tiny:transform", "--crop", "8"], "--transform replaces"),
    "weights without torchvision (7)": (["--weights", "IMAGENET1K_V1"], "torchvision:NAME model"),
    "image size and crop (7)": (["--image-size", "8", "--crop", "8"], "either it or --crop"),
    "bad mean (7)": (["--mean", "0.5,0.5"], "1 or 3 comma-separated numbers"),
    "bad interpolation (7)": (["--interpolation", "cubic"], "invalid choice"),
    "threads 0 (8)": (["--threads", "0"], "positive integer"),
    "folder option for a data function (8)": (
        ["--data", "cli_tiny:batches", "--crop", "16"],
        "apply only to an image folder",
    ),
    "a keyword given twice (probe 12)": (["--model-kwargs", "width=8,width=4"], "'width' is given twice"),
    "a trailing comma (probe 12)": (["--model-kwargs", "width=8,"], "ends with a comma"),
    "num-samples ALL (probe 12)": (["--num-samples", "ALL"], "expected a positive integer, all or auto"),
    "a model spec without a colon (probe 34b: exit 1, after loading)": (
        ["--model", "resnet18"],
        "--model 'resnet18' is not of the form torchvision:NAME",
    ),
    "loading option for a data function (probe 12)": (
        ["--data", "cli_tiny:batches", "--seed", "3"],  # (with --batch-size 4: both would be ignored)
        "--batch-size, --seed apply only to an image folder",
    ),
}


def _refused_args(tiny: dict[str, Path], extra: list[str]) -> list[str]:
    args = _tiny_args(tiny, Path("model.pt"), "out.pt")
    extra = list(extra)
    for option in ("--out", "--data"):
        if option in extra:
            i = extra.index(option)
            args[args.index(option) + 1] = extra[i + 1]
            extra = extra[:i] + extra[i + 2 :]
    return args + extra


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_before_anything_is_loaded(case, tiny, work, capsys):
    extra, phrase = REFUSED[case]
    before = sorted(p.name for p in work["dir"].iterdir())
    assert main(_refused_args(tiny, extra)) == 2
    err = capsys.readouterr().err
    assert "usage: precisebn recalibrate" in err and phrase in err and "Traceback" not in err
    assert _sha(work["ckpt"]) == work["sha"]
    assert sorted(p.name for p in work["dir"].iterdir()) == before  # newdir/ not even created
    assert (work["dir"] / "link.pt").is_symlink()


def test_refusals_through_the_installed_script(tiny, work):
    assert SCRIPT.exists(), "pip install -e . puts the precisebn script next to the interpreter"
    for case in ("report is the input (1)", "out via a missing folder's .. (2)", "device meta (8)"):
        extra, phrase = REFUSED[case]
        done = subprocess.run(
            [str(SCRIPT), *_refused_args(tiny, extra)], cwd=work["dir"], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 2, (case, done.stderr)
        assert phrase in done.stderr, case
        assert _sha(work["ckpt"]) == work["sha"], case
    assert not (work["dir"] / "newdir").exists() and _stray(work["dir"]) == []


def test_a_state_dict_with_a_modules_extra_state_is_recalibrated_and_kept(tiny, work, capsys):
    """A ``model.state_dict()`` holding a module's extra state (a dict, not a tensor) was refused as "a dict
    without a state_dict" (a probe); now recalibrated, the extra state carried over, and ``diff`` reads it."""
    import cli_tiny

    model = cli_tiny.WithExtraState()
    model.scale = 2.5
    source, out = work["dir"] / "extra.pt", work["dir"] / "extra_out.pt"
    torch.save(model.state_dict(), source)
    args = ["recalibrate", str(source), "--model", "cli_tiny:WithExtraState", "--data", "cli_tiny:batches",
            "--out", str(out), "--num-samples", "all", "--no-progress", "--device", "cpu"]  # fmt: skip
    assert main(args) == 0
    written = torch.load(out, weights_only=True)
    assert written["_extra_state"] == {"scale": 2.5}
    truth = compute_truth(model, cli_tiny.batches())["bn"]
    assert max_rel_error(written["bn.running_mean"], truth.mean, truth.var.sqrt()) < 1e-5
    assert max_rel_error(written["bn.running_var"], truth.var) < 1e-5
    capsys.readouterr()
    assert main(["diff", str(source), str(out)]) == 0
    assert "other tensors: 5 identical, 0 differ" in capsys.readouterr().out


def test_every_alias_of_a_shared_layer_is_written(tiny, work, capsys):
    import cli_tiny

    out = work["dir"] / "out.pt"
    args = ["recalibrate", str(tiny["shared"]), "--model", "cli_tiny:Shared", "--data", "cli_tiny:batches",
            "--out", str(out), "--num-samples", "all", "--no-progress", "--device", "cpu"]  # fmt: skip
    assert main(args) == 0
    written = torch.load(out, weights_only=True)
    for buffer in ("running_mean", "running_var"):  # both names hold the new values...
        assert torch.equal(written[f"bn.{buffer}"], written[f"block.1.{buffer}"]), buffer
    truth = cli_tiny.Shared()
    truth.load_state_dict(torch.load(tiny["shared"], weights_only=True))
    precisebn.recalibrate(truth, cli_tiny.batches(), num_samples="all")
    loaded = cli_tiny.Shared()
    loaded.load_state_dict(written)  # ...so loading (which applies block.1.* last) keeps them
    torch.testing.assert_close(loaded.bn.running_mean, truth.bn.running_mean, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(loaded.bn.running_var, truth.bn.running_var, rtol=1e-6, atol=1e-6)
    old = torch.load(tiny["shared"], weights_only=True)
    assert not torch.equal(written["block.1.running_var"], old["block.1.running_var"])
    # one storage under both names, as in the input (probe 41: two storages, the file larger), by apply too
    stats = precisebn.estimate(cli_tiny.Shared(), cli_tiny.batches(), num_samples="all")
    stats.save(work["dir"] / "s.safetensors")
    assert main(["apply", str(tiny["shared"]), "s.safetensors", "--out", "applied.pt"]) == 0
    applied = torch.load(work["dir"] / "applied.pt", weights_only=True)
    for saved in (old, written, applied):
        for buffer in ("running_mean", "running_var"):
            assert saved[f"bn.{buffer}"].data_ptr() == saved[f"block.1.{buffer}"].data_ptr(), buffer


def test_a_model_factory_that_changes_the_working_folder_reads_the_folder_named(tiny, work, capsys):
    """Found by a probe: a factory that called os.chdir made a relative --data folder be read from the new working
    folder — another folder's images, exit 0, unwarned."""
    import shutil

    import cli_tiny

    shutil.copytree(tiny["images"], work["dir"] / "imgs")
    bright = work["dir"] / "other" / "imgs"  # (where the factory goes)
    bright.mkdir(parents=True)
    for i in range(6):
        Image.fromarray(np.full((32, 32, 3), 230 + i, dtype=np.uint8)).save(bright / f"{i}.png")
    factory = "import os\nfrom cli_tiny import Tiny\n\n\ndef model():\n    os.chdir('other')\n    return Tiny()\n"
    (work["dir"] / "wander.py").write_text(factory)
    args = ["recalibrate", "model.pt", "--model", "wander:model", "--data", "imgs", "--out", "out.pt",
            "--transform", "cli_tiny:transform", "--batch-size", "4", "--num-samples", "all", "--no-progress",
            "--device", "cpu"]  # fmt: skip
    assert main(args) == 0
    batches = _folder_batches(work["dir"] / "imgs", cli_tiny.transform)
    written = torch.load(work["dir"] / "out.pt", weights_only=True)
    _assert_stats_close(written, _python_recalibrated(cli_tiny.Tiny, work["ckpt"], batches))
    assert "changed the working folder" in capsys.readouterr().err
    assert Path.cwd() == work["dir"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_apply_writes_every_copy_of_a_shared_layer(tiny, work, capsys, dtype):
    """Found by a probe: a shared layer saved as copies under its two names (safetensors' save_file of clones, a
    state_dict converted to half) got the statistics under one name only, and loading read the other's old ones
    last — the model kept its statistics, exit 0. Copies holding initial statistics (0 and 1, which distinct
    layers share) are left as they are, with a warning."""
    import cli_tiny

    saved = torch.load(tiny["shared"], weights_only=True)
    assert saved["bn.running_mean"].data_ptr() == saved["block.1.running_mean"].data_ptr()  # (one storage there)
    copies = {k: v.to(dtype, copy=True) if v.is_floating_point() else v.clone() for k, v in saved.items()}
    torch.save(copies, work["dir"] / "copies.pt")
    stats = precisebn.estimate(cli_tiny.Shared(), cli_tiny.batches(), num_samples="all")
    assert set(stats) == {"bn"}  # (the layer's first name)
    stats.save(work["dir"] / "s.safetensors")
    assert main(["apply", "copies.pt", "s.safetensors", "--out", "out.pt"]) == 0
    written = torch.load(work["dir"] / "out.pt", weights_only=True)
    for buffer in ("running_mean", "running_var"):
        expected = getattr(stats["bn"], buffer.removeprefix("running_")).to(dtype)
        assert torch.equal(written[f"bn.{buffer}"], expected) and torch.equal(written[f"block.1.{buffer}"], expected)
    loaded = cli_tiny.Shared().to(dtype)
    loaded.load_state_dict(written)  # (block.1.* loads last)
    assert torch.equal(loaded.bn.running_var, stats["bn"].var.to(dtype))
    fresh = {k: v.clone() for k, v in cli_tiny.Shared().state_dict().items()}  # initial statistics: not taken
    torch.save(fresh, work["dir"] / "fresh.pt")
    capsys.readouterr()
    assert main(["apply", "fresh.pt", "s.safetensors", "--out", "out2.pt"]) == 0
    assert "'block.1' (like 'bn'): not in the statistics, and holding the initial" in capsys.readouterr().err
    kept = torch.load(work["dir"] / "out2.pt", weights_only=True)
    assert torch.equal(kept["block.1.running_mean"], fresh["block.1.running_mean"])


class _Towers(torch.nn.Module):
    """Two towers, ``b`` a deep copy of ``a`` (a Siamese model, a teacher kept beside the student); only ``a`` runs."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
        with torch.no_grad():
            self.a[1].running_mean.uniform_(0.5, 2.0)
            self.a[1].running_var.uniform_(0.5, 2.0)
        self.b = copy.deepcopy(self.a)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x)


def test_apply_leaves_a_parameter_saved_as_a_view_of_a_statistic_alone(work):
    """Probe 41: a checkpoint whose weight is saved as the very tensor of the running variance (a saver storing
    equal values once) got the new variance as its weight: the names of one view were all written. Only names of
    the same buffer (a layer under two names) are."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.BatchNorm1d(4))
    stats = precisebn.estimate(model, [torch.randn(16, 4) * 3 + 1])
    stats.save(work["dir"] / "s.safetensors")
    saved = model.state_dict()
    saved["0.weight"] = saved["0.running_var"]  # (both ones: one tensor under both names)
    torch.save(saved, work["dir"] / "aliased.pt")
    assert main(["apply", "aliased.pt", "s.safetensors", "--out", "out.pt"]) == 0
    written = torch.load(work["dir"] / "out.pt", weights_only=True)
    assert torch.equal(written["0.weight"], torch.ones(4))
    assert torch.equal(written["0.running_var"], stats["0"].var.float())


@pytest.mark.parametrize("case", ["never reached", "not selected"])
def test_apply_leaves_a_separate_layer_with_the_same_statistics_alone(work, capsys, case):
    """Probe 41: a layer holding bitwise the statistics of a written layer was taken as its copy under another name
    and written — also a deep-copied tower that the statistics file names as never reached (the report said "left
    as they are"). A layer the file names is never a copy; one it does not name (statistics of some layers only) is
    still written as a copy, with a warning naming it."""
    torch.manual_seed(0)
    model = _Towers()
    torch.save(model.state_dict(), work["dir"] / "towers.pt")
    data = [torch.randn(6, 3, 8, 8) * 3 + 2 for _ in range(2)]
    stats = precisebn.estimate(model, data, num_samples="all", layers=None if case == "never reached" else ["a.1"])
    if case == "never reached":
        assert not stats["b.1"].reached  # (named in the file, as never reached)
    else:
        assert "b.1" not in stats
    stats.save(work["dir"] / "s.safetensors")
    capsys.readouterr()
    assert main(["apply", "towers.pt", "s.safetensors", "--out", "out.pt"]) == 0
    err = capsys.readouterr().err
    before = torch.load(work["dir"] / "towers.pt", weights_only=True)
    after = torch.load(work["dir"] / "out.pt", weights_only=True)
    assert torch.equal(after["a.1.running_var"], stats["a.1"].var.float())
    if case == "never reached":
        for buffer in ("running_mean", "running_var"):
            assert torch.equal(after[f"b.1.{buffer}"], before[f"b.1.{buffer}"]), buffer
        assert "taken as the same layer" not in err
    else:
        assert torch.equal(after["b.1.running_var"], stats["a.1"].var.float())
        assert "'b.1' (as 'a.1'): not in the statistics" in err and "apply statistics that name it" in err


def test_a_failing_report_writes_nothing_and_names_the_output(tiny, work, capsys, monkeypatch):
    import errno

    import precisebn.plotting

    def full_disk(report, path, title=None, format=None):
        Path(path).write_bytes(b"\x89PNG half")
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(precisebn.plotting, "plot_report", full_disk)
    out = work["dir"] / "out.pt"
    assert main(_tiny_args(tiny, work["ckpt"], out, "--crop", "none", "--report", "r.json")) == 1
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert "No space left on device: 'r.png'" in message and "nothing was written" in message
    assert ".tmp" not in message
    assert not out.exists() and not (work["dir"] / "r.json").exists() and _stray(work["dir"]) == []
    assert _sha(work["ckpt"]) == work["sha"]


def test_a_failure_after_the_outputs_are_in_place_says_they_are(tiny, work, capsys, monkeypatch):
    """Found by a probe: printing "wrote ..." failed after --in-place had replaced the checkpoint (a file name that is
    not valid UTF-8, a strict UTF-8 stdout), and the command exited 1 saying "Nothing was written" — a script that
    retried with --prior would have pooled the data twice."""
    import errno

    from precisebn.cli import commands

    said = commands._say

    def failing_say(text: str) -> None:
        if text.startswith("wrote "):
            raise OSError(errno.EIO, "Input/output error")
        said(text)

    ckpt, original = work["ckpt"], work["dir"] / "original.pt"
    original.write_bytes(ckpt.read_bytes())
    assert main(_tiny_args(tiny, original, "reference.pt", "--crop", "none")) == 0  # (what a whole run writes)
    monkeypatch.setattr(commands, "_say", failing_say)
    args = _tiny_args(tiny, ckpt, "unused.pt", "--crop", "none")
    args[args.index("--out") : args.index("--out") + 2] = ["--in-place"]
    capsys.readouterr()
    assert main(args) == 0
    message = capsys.readouterr().err
    assert "every output was written (" in message and "complete); then: OSError" in message
    assert "nothing was written" not in message.lower() and _stray(work["dir"]) == []
    written, reference = torch.load(ckpt, weights_only=True), torch.load("reference.pt", weights_only=True)
    assert written.keys() == reference.keys() and all(torch.equal(written[k], reference[k]) for k in written)
    assert _sha(ckpt) != work["sha"]


def test_in_place_keeps_permission_bits_and_out_writes_through_symlinks(tiny, work):
    ckpt = work["ckpt"]
    ckpt.chmod(0o600)
    args = _tiny_args(tiny, ckpt, "unused.pt", "--crop", "none")
    i = args.index("--out")
    args[i : i + 2] = ["--in-place"]
    assert main(args) == 0
    assert stat.S_IMODE(ckpt.stat().st_mode) == 0o600 and _sha(ckpt) != work["sha"]
    target = work["dir"] / "target.pt"
    target.write_bytes(b"old")
    target.chmod(0o640)
    (work["dir"] / "out-link.pt").symlink_to(target)
    assert main(_tiny_args(tiny, ckpt, "out-link.pt", "--crop", "none")) == 0
    assert (work["dir"] / "out-link.pt").is_symlink()  # the link stays, its target gets the checkpoint
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    assert torch.load(target, weights_only=True).keys() == torch.load(ckpt, weights_only=True).keys()
    assert _stray(work["dir"]) == []


def test_blocked_global_is_refused_with_the_option_and_nothing_runs(tiny, work, capsys):
    marker = work["dir"] / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    evil = work["dir"] / "evil.pt"
    torch.save({"state_dict": torch.load(work["ckpt"], weights_only=True), "x": Evil()}, evil)
    assert main(["inspect", str(evil)]) == 1
    message = capsys.readouterr().err
    assert "--trust-checkpoint" in message and "system" in message and "nothing in the file was run" in message
    assert "Is it complete" not in message and not marker.exists()


def test_corrupt_checkpoint_message_is_whole(tiny, work, capsys):
    corrupt = work["dir"] / "corrupt.pt"
    corrupt.write_bytes(work["ckpt"].read_bytes()[:3000])
    try:
        torch.load(corrupt, weights_only=True)
    except Exception as exc:  # torch's own words, first sentence
        first = " ".join(str(exc).split()).split(". ")[0]
    assert main(["inspect", str(corrupt)]) == 1
    message = capsys.readouterr().err.strip()
    assert first in message and message.endswith("written by torch.save or safetensors?")


def test_32px_folder_with_explicit_preprocessing_matches_python(tiny, work, capsys):
    import cli_tiny

    t = torchvision.transforms
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    out, report = work["dir"] / "out.pt", work["dir"] / "report.json"
    args = _tiny_args(tiny, work["ckpt"], out, "--resize", "none", "--crop", "none", "--mean", "0.5,0.4,0.3",
                      "--std", "0.2,0.25,0.3", "--report", str(report))  # fmt: skip
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "ImageNet default" not in captured.err and "no resize, no crop" in captured.out
    batches = _folder_batches(tiny["images"], t.Compose([t.ToTensor(), t.Normalize(mean, std)]))
    assert all(b.shape[-2:] == (32, 32) for b in batches)
    _assert_stats_close(torch.load(out, weights_only=True), _python_recalibrated(cli_tiny.Tiny, work["ckpt"], batches))
    saved = json.loads(report.read_text())["preprocessing"]
    assert (saved["resize"], saved["crop"], saved["mean"], saved["std"]) == (None, None, list(mean), list(std))

    out2 = work["dir"] / "out2.pt"
    assert main(_tiny_args(tiny, work["ckpt"], out2, "--transform", "cli_tiny:transform")) == 0
    assert "custom transform cli_tiny:transform" in capsys.readouterr().out
    batches = _folder_batches(tiny["images"], cli_tiny.transform)
    _assert_stats_close(torch.load(out2, weights_only=True), _python_recalibrated(cli_tiny.Tiny, work["ckpt"], batches))


def test_imagenet_default_is_named_in_a_warning(tiny, work, capsys):
    assert main(_tiny_args(tiny, work["ckpt"], "out.pt", "--num-batches", "1")) == 0
    captured = capsys.readouterr()
    assert "warning: --data" in captured.err and "ImageNet default" in captured.err
    assert "resize 256 (bilinear), centre crop 224" in captured.out


def test_timm_model_uses_its_own_data_config(tmp_path, monkeypatch, capsys, files):
    timm = pytest.importorskip("timm")
    from timm.data import create_transform, resolve_data_config

    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    model = _scramble(timm.create_model("test_resnet", pretrained=False, num_classes=3))
    torch.save(model.state_dict(), tmp_path / "timm.pt")
    images = tmp_path / "few"
    images.mkdir()
    for i in range(6):
        (images / f"{i}.png").write_bytes((files["images"] / "cats" / f"{i}.png").read_bytes())
    args = ["recalibrate", "timm.pt", "--model", "timm:test_resnet", "--model-kwargs", "num_classes=3",
            "--data", str(images), "--out", "out.pt", "--batch-size", "3", "--no-progress", "--device", "cpu",
            "--report", "r.json", "--threads", "1"]  # fmt: skip
    assert main(args) == 0
    captured = capsys.readouterr()
    config = resolve_data_config({}, model=model)
    saved = json.loads((tmp_path / "r.json").read_text())["preprocessing"]
    assert saved["crop"] == config["input_size"][-1] and saved["mean"] == list(config["mean"])
    assert saved["source"] == "timm data config of test_resnet" and "timm data config" in captured.out
    assert "warning" not in captured.err
    batches = _folder_batches(images, create_transform(**config), batch_size=3)  # timm's own transform
    _assert_stats_close(
        torch.load("out.pt", weights_only=True),
        _python_recalibrated(lambda: timm.create_model("test_resnet", num_classes=3), tmp_path / "timm.pt", batches),
    )


def test_torchvision_weights_transforms_match_the_preset():
    from precisebn.images import resolve_preprocessing

    weights = torchvision.models.get_weight("MobileNet_V3_Small_Weights.IMAGENET1K_V1")
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (50, 70, 3), dtype=np.uint8))
    ours = resolve_preprocessing("torchvision:mobilenet_v3_small", None, weights="IMAGENET1K_V1")
    assert ours.source == "torchvision weights MobileNet_V3_Small_Weights.IMAGENET1K_V1"
    torch.testing.assert_close(ours.build()(image), weights.transforms()(image), rtol=0, atol=1e-6)
    bigger = resolve_preprocessing("torchvision:mobilenet_v3_small", None, weights="IMAGENET1K_V1", image_size=112)
    assert (bigger.crop, bigger.resize) == (112, 128)


def test_common_options_after_the_command(tiny, work, capsys):
    missing = str(work["dir"] / "missing.pt")
    from precisebn.checkpoint import CheckpointError

    with pytest.raises(CheckpointError):
        main(["inspect", missing, "--debug"])
    threads = torch.get_num_threads()
    assert main(["inspect", str(work["ckpt"]), "--quiet", "--threads", "1"]) == 0
    assert capsys.readouterr().out == "" and torch.get_num_threads() == threads
    for command in ("recalibrate", "apply", "inspect", "diff", "demo"):
        assert main([command, "--help"]) == 0
        text = capsys.readouterr().out
        assert "example:" in text and "exit codes:" in text and "--threads" in text, command


def test_layers_num_batches_and_plural(tiny, work, capsys):
    out = work["dir"] / "out.pt"
    assert main(_tiny_args(tiny, work["ckpt"], out, "--crop", "none", "--layers", "bn1", "--num-batches", "1")) == 0
    printed = capsys.readouterr().out
    assert "1 layer updated" in printed
    old, new = torch.load(work["ckpt"], weights_only=True), torch.load(out, weights_only=True)
    assert [k for k in old if not torch.equal(old[k], new[k])] == ["bn1.running_mean", "bn1.running_var"]
    one = work["dir"] / "one"
    one.mkdir()
    (one / "0.png").write_bytes((tiny["images"] / "0.png").read_bytes())
    args = _tiny_args(tiny, work["ckpt"], out, "--crop", "none", "--num-samples", "5")
    args[args.index("--data") + 1] = str(one)
    args.remove("all")
    args.remove("--num-samples")
    assert main(args) == 0
    assert "(1 image, fewer than --num-samples 5)" in capsys.readouterr().out


def test_skip_bad_images_counts_and_lists_them(tiny, work, capsys):
    folder = work["dir"] / "mixed"
    shutil.copytree(tiny["images"], folder)
    (folder / "bad1.png").write_bytes(b"not a png")
    (folder / "bad2.jpg").write_bytes(b"")
    args = _tiny_args(tiny, work["ckpt"], "out.pt", "--crop", "none", "--report", "r.json")
    args[args.index("--data") + 1] = str(folder)
    assert main(args) == 1
    assert "--skip-bad-images" in capsys.readouterr().err and not Path("out.pt").exists()
    assert main([*args, "--skip-bad-images"]) == 0
    captured = capsys.readouterr()
    assert "skipped 2 unreadable images" in captured.err
    assert "bad1.png" in captured.err and "bad2.jpg" in captured.err
    saved = json.loads(Path("r.json").read_text())
    assert saved["samples"] == 10 and len(saved["skipped_images"]) == 2
    # a --num-samples above the folder's size: its files counted as such (probe 41: "12 images", 10 readable)
    args[args.index("all")] = "100"
    assert main([*args, "--skip-bad-images"]) == 0
    said = "(12 image files, fewer than --num-samples 100; unreadable ones are skipped)"
    assert said in capsys.readouterr().out


def test_diff_refuses_unrelated_checkpoints_and_compares_dtypes(tiny, files, work, capsys):
    assert main(["diff", str(work["ckpt"]), str(files["ckpt"])]) == 1
    assert "no layer in common" in capsys.readouterr().err
    sd = torch.load(work["ckpt"], weights_only=True)
    sd["conv1.weight"] = sd["conv1.weight"].double()  # same values, other dtype
    torch.save(sd, work["dir"] / "double.pt")
    assert main(["diff", str(work["ckpt"]), str(work["dir"] / "double.pt")]) == 0
    text = capsys.readouterr().out
    assert "dtypes differ: conv1.weight: float32 vs float64" in text
    n_other = sum(not k.endswith(("running_mean", "running_var", "num_batches_tracked")) for k in sd)
    assert f"other tensors: {n_other - 1} identical, 1 differ" in text


@pytest.mark.parametrize("side", ["A", "B"])
def test_diff_compares_a_checkpoint_with_a_wrapper_prefix(tiny, work, capsys, side):
    """Probe 37: diff of a plain and a DDP checkpoint (every name under module.) refused them as having no layer in
    common, although apply and recalibrate recognise the prefix. The prefix is taken off, and said."""
    sd = torch.load(work["ckpt"], weights_only=True)
    changed = {k: v * 2 if k.endswith("running_var") else v for k, v in sd.items()}  # (every variance doubled)
    torch.save({f"module.{k}": v for k, v in changed.items()}, work["dir"] / "ddp.pt")
    pair = [str(work["ckpt"]), str(work["dir"] / "ddp.pt")]
    assert main(["diff", *(pair if side == "B" else pair[::-1])]) == 0
    text = capsys.readouterr().out
    assert f"{'B' if side == 'B' else 'A'}'s names compared without their prefix 'module.'" in text
    names = {k.removesuffix(".running_var") for k in sd if k.endswith(".running_var")}
    assert f"{len(names)} layers compared, 0 identical" in text
    rows = [line.split() for line in text.splitlines() if line.split()[:1] and line.split()[0] in names]
    assert len(rows) == len(names)
    assert all(row[-2] == ("2" if side == "B" else "0.5") for row in rows)  # the variances' B/A, every layer


def test_an_error_in_the_data_after_the_first_batch_names_the_data(tiny, work, capsys):
    """Probe 37: a --data generator raising at its second batch gave "unexpected RuntimeError: boom" (one raising
    at once names --data: resolve_data calls it)."""
    (work["dir"] / "cli_later.py").write_text(
        "import torch\n\ndef data():\n    yield torch.rand(4, 3, 32, 32)\n    raise RuntimeError('boom in batch 2')\n"
    )
    sys.path.insert(0, str(work["dir"]))
    try:
        args = _tiny_args(tiny, work["ckpt"], "out.pt")
        args[args.index("--data") + 1] = "cli_later:data"
        i = args.index("--batch-size")
        del args[i : i + 2]  # (a data function makes its own batches)
        assert main(args) == 1
        err = capsys.readouterr().err
        assert "the code of --data 'cli_later:data' raised RuntimeError while precisebn ran it: boom in batch 2" in err
        assert not Path("out.pt").exists()
    finally:
        sys.path.remove(str(work["dir"]))
        sys.modules.pop("cli_later", None)


def test_apply_patches_a_checkpoint_from_a_statistics_file(tiny, work, capsys):
    import cli_tiny

    model = cli_tiny.Tiny()
    model.load_state_dict(torch.load(work["ckpt"], weights_only=True))
    batches = [torch.randn(4, 3, 16, 16) for _ in range(3)]
    stats = precisebn.estimate(model, batches)
    stats.save(work["dir"] / "s.safetensors")
    wrapped = work["dir"] / "ddp.pt"  # a DDP checkpoint: every name under module.
    torch.save({"epoch": 2, "model": {f"module.{k}": v for k, v in model.state_dict().items()}}, wrapped)
    sha = _sha(wrapped)
    assert main(["apply", str(wrapped), "s.safetensors", "--out", "patched.pt"]) == 0
    assert "prefix 'module.'" in capsys.readouterr().out and _sha(wrapped) == sha
    precisebn.recalibrate(model, batches)  # the library's own result, for the same batches
    written = torch.load("patched.pt", weights_only=True)
    assert written["epoch"] == 2
    for key, value in model.state_dict().items():
        assert torch.equal(written["model"][f"module.{key}"], value), key
    # refused: a statistics file of another width, and the statistics file as --out
    other = cli_tiny.Tiny(width=4)
    precisebn.estimate(other, batches).save(work["dir"] / "other.safetensors")
    assert main(["apply", str(wrapped), "other.safetensors", "--out", "p2.pt"]) == 1
    assert "shape mismatch" in capsys.readouterr().err and not Path("p2.pt").exists()
    assert main(["apply", str(wrapped), "s.safetensors", "--out", "s.safetensors"]) == 2
    assert "is the input STATS" in capsys.readouterr().err and _sha(wrapped) == sha
    assert main(["apply", "s.safetensors", str(wrapped), "--out", "p3.safetensors"]) == 1  # swapped
    assert "(swapped?)" in capsys.readouterr().err and not Path("p3.safetensors").exists()


def test_capture_float64_is_passed_and_reported(tiny, work, capsys):
    out = work["dir"] / "out.pt"
    args = _tiny_args(tiny, work["ckpt"], out, "--crop", "none", "--capture", "float64", "--report", "r.json")
    assert main(args) == 0
    assert "float64" in capsys.readouterr().out
    saved = json.loads((work["dir"] / "r.json").read_text())
    assert {layer["path"] for layer in saved["layers"]} == {"float64"}


def test_num_samples_auto_with_a_tolerance(tiny, work, capsys):
    out = work["dir"] / "out.pt"
    args = _tiny_args(tiny, work["ckpt"], out, "--crop", "none", "--report", "r.json")
    args[args.index("--num-samples") + 1] = "auto"
    assert main([*args, "--tolerance", "5%"]) == 0
    printed = capsys.readouterr().out
    assert "±var" in printed
    saved = json.loads((work["dir"] / "r.json").read_text())
    assert all(layer["se_var_median"] is not None for layer in saved["layers"])
    assert main(_tiny_args(tiny, work["ckpt"], "o2.pt", "--tolerance", "0.02")) == 2  # without auto: usage
    assert "--tolerance goes with --num-samples auto" in capsys.readouterr().err


@pytest.mark.parametrize(("prior", "adapt"), [(8.0, "both"), (8.0, "var"), (None, "mean")])
def test_apply_with_a_prior_and_adapt_pools_with_the_checkpoint(tiny, work, capsys, prior, adapt):
    """`apply --prior N --adapt A` writes the data's statistics (float64, from the layers' inputs) pooled with
    the checkpoint's as N samples, and bitwise what recalibrate(prior=N, adapt=A) writes into the model loaded
    from that checkpoint; the buffer adapt leaves out stays as the checkpoint had it, the other tensors too."""
    import cli_tiny

    model = cli_tiny.Tiny()
    original = torch.load(work["ckpt"], weights_only=True)
    model.load_state_dict(original)
    g = torch.Generator().manual_seed(3)
    batches = [torch.randn(4, 3, 16, 16, generator=g) * 2 + 1 for _ in range(3)]
    precisebn.estimate(model, batches).save(work["dir"] / "s.safetensors")
    extra = (["--prior", str(prior)] if prior else []) + ["--adapt", adapt]
    assert main(["apply", str(work["ckpt"]), "s.safetensors", "--out", "adapted.pt", *extra]) == 0
    assert "adapted: " in capsys.readouterr().out
    written = torch.load("adapted.pt", weights_only=True)
    for name, t in compute_truth(model, batches).items():  # float64, from the layers' inputs, here
        before = (original[f"{name}.running_mean"], original[f"{name}.running_var"])
        mean, var = t.mean, t.var
        if prior:  # the prior in values per channel: N samples at the layer's values per sample
            mean, var = pooled_moments(*before, prior * t.count / sum(b.shape[0] for b in batches), mean, var, t.count)
        if adapt != "var":
            assert max_rel_error(written[f"{name}.running_mean"], mean, var.sqrt()) <= 1e-6
        if adapt != "mean":
            assert max_rel_error(written[f"{name}.running_var"], var) <= 1e-5
    precisebn.recalibrate(model, batches, prior=prior, adapt=adapt)
    for key, value in model.state_dict().items():
        assert torch.equal(written[key], value), key
    changed = {k for k in original if not torch.equal(original[k], written[k])}
    kinds = {"both": ("running_mean", "running_var"), "mean": ("running_mean",), "var": ("running_var",)}[adapt]
    assert changed and {k.rpartition(".")[2] for k in changed} == set(kinds)


def test_apply_refuses_a_prior_that_is_not_finite(tiny, work, capsys):
    import cli_tiny

    sd = torch.load(work["ckpt"], weights_only=True)
    model = cli_tiny.Tiny()
    model.load_state_dict(sd)
    precisebn.estimate(model, [torch.randn(4, 3, 16, 16)]).save(work["dir"] / "s.safetensors")
    name = next(k for k in sd if k.endswith("running_var"))
    sd[name][0] = float("nan")
    torch.save(sd, work["dir"] / "nan.pt")
    assert main(["apply", "nan.pt", "s.safetensors", "--out", "x.pt", "--prior", "4"]) == 1
    err = capsys.readouterr().err
    assert "cannot be pooled" in err and name.rpartition(".")[0] in err and not Path("x.pt").exists()
    assert main(["apply", "nan.pt", "s.safetensors", "--out", "x.pt"]) == 0  # no prior: nothing to pool with


def test_adapt_leaves_the_other_buffer_bit_for_bit(tiny, work):
    # a float64 checkpoint loaded into the float32 model: rewriting running_var would round it
    state = {k: v.double() * (1 + 1e-10) if v.is_floating_point() else v for k, v in torch.load(work["ckpt"]).items()}
    torch.save(state, "double.pt")
    assert main(_tiny_args(tiny, Path("double.pt"), "adapted.pt", "--adapt", "mean", "-q")) == 0
    written = torch.load("adapted.pt", weights_only=True)
    for name in ("bn1", "bn2"):
        assert torch.equal(written[f"{name}.running_var"], state[f"{name}.running_var"])
        assert not torch.equal(written[f"{name}.running_mean"], state[f"{name}.running_mean"])


@pytest.mark.parametrize("debug", [False, True])
def test_model_code_that_exits_is_an_error_and_writes_nothing(tiny, work, capsys, debug):
    args = _tiny_args(tiny, work["ckpt"], "out.pt", *(["--debug"] if debug else []))
    args[args.index("cli_tiny:Tiny")] = "cli_tiny:exits"
    assert main(args) == 1  # (with --debug it was re-raised: exit 0, silent)
    err = capsys.readouterr().err
    assert "called sys.exit(0)" in err and (("Traceback" in err) == debug)
    assert not Path("out.pt").exists() and _stray(work["dir"]) == []


@pytest.mark.parametrize(("encoding", "errors"), [("cp1252", "strict"), ("ascii", "surrogateescape")])
def test_an_output_encoding_without_the_reports_letters_still_writes(tiny, work, monkeypatch, encoding, errors):
    # Windows with output redirected (cp1252 lacks Δ and σ), the C locale
    import io

    stdout = io.TextIOWrapper(io.BytesIO(), encoding=encoding, errors=errors)
    monkeypatch.setattr(sys, "stdout", stdout)
    assert main(_tiny_args(tiny, work["ckpt"], "out.pt")) == 0
    assert Path("out.pt").exists() and stdout.errors == errors  # (put back)
    assert main(["merge", "--help"]) == 0  # (its help holds non-ASCII too)
    stdout.flush()
    assert b"\\u" in stdout.buffer.getvalue()  # escaped


def test_wildcards_matching_no_layer_are_named_and_a_folder_is_no_statistics_file(tiny, work, capsys):
    assert main(_tiny_args(tiny, work["ckpt"], "out.pt", "--layers", "zz*")) == 1
    err = capsys.readouterr().err
    assert "(model Tiny, --layers 'zz*')" in err and "lambda" not in err
    assert main(["apply", str(work["ckpt"]), ".", "--out", "x.pt"]) == 1
    assert "is a folder" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["lazy modules", "no num_batches_tracked"])
def test_checkpoints_torch_loads_are_recalibrated(tiny, work, float64_truth, kind):
    import cli_tiny

    torch.manual_seed(0)
    if kind == "lazy modules":  # a factory of lazy modules, with the checkpoint of the materialised model
        factory, name = cli_tiny.lazy, "cli_tiny:lazy"
        trained = _scramble(cli_tiny.lazy())
        trained(cli_tiny.batches(1)[0])
        state = trained.state_dict()
    else:  # the format before torch 0.4.1 (and some old model zoos): torch's load_state_dict accepts it
        factory, name = cli_tiny.Tiny, "cli_tiny:Tiny"
        state = {k: v for k, v in torch.load(work["ckpt"]).items() if not k.endswith("num_batches_tracked")}
    torch.save(state, "in.pt")
    args = ["recalibrate", "in.pt", "--model", name, "--data", "cli_tiny:batches", "--out", "out.pt",
            "--num-samples", "all", "--no-progress", "--device", "cpu", "-q"]  # fmt: skip
    assert main(args) == 0
    written = torch.load("out.pt", weights_only=True)
    assert written.keys() == state.keys()
    model = factory()
    model.load_state_dict(state)
    truth = float64_truth(model, cli_tiny.batches())
    assert truth
    for layer, t in truth.items():
        assert max_rel_error(written[f"{layer}.running_mean"], t.mean, t.var.sqrt()) < 1e-5
        assert max_rel_error(written[f"{layer}.running_var"], t.var) < 1e-5


def test_an_encoding_that_holds_greek_letters_but_not_dashes_is_escaped_too(monkeypatch):
    """cp932 (Japanese Windows) encodes Δ and σ, which the first check looked for, but not the "–" that merge's
    table and the demo print: merge failed after its work."""
    import io

    from precisebn.cli import _encodable_output

    stdout = io.TextIOWrapper(io.BytesIO(), encoding="cp932")
    monkeypatch.setattr(sys, "stdout", stdout)
    with _encodable_output():
        print("a \u2013 b")
    assert stdout.errors == "strict"
    stdout.flush()
    assert stdout.buffer.getvalue().startswith(b"a \\u2013 b")


@pytest.mark.parametrize("when", ["before the write", "after the write", "after the command"])
def test_ctrl_c_says_whether_the_output_was_written(files, tmp_path, capsys, monkeypatch, when):
    """Ctrl-C before the commit: exit 130, nothing written. After it — while the command prints, or while
    a large checkpoint is freed once it returned — the output is complete: exit 0, saying so (a probe: exit
    130 or death by SIGINT with the file replaced, and 130 is documented as "nothing was written")."""
    import precisebn.cli as cli
    import precisebn.cli.commands as commands

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    if when == "before the write":
        monkeypatch.setattr("precisebn.checkpoint.write_checkpoint", interrupt)
    elif when == "after the write":
        say = commands._say  # ("wrote ...", printed after the commit)
        monkeypatch.setattr(commands, "_say", lambda text: interrupt() if text.startswith("wrote") else say(text))
    else:
        real = cli._main
        monkeypatch.setattr(cli, "_main", lambda argv, parsed: (real(argv, parsed), interrupt()))
    out = tmp_path / "out.pt"
    code = main(_recalibrate_args(files, out, "--num-samples", "all"))
    err = capsys.readouterr().err
    if when == "before the write":
        assert (code, out.exists()) == (130, False) and "no output was written" in err
        assert sorted(p.name for p in tmp_path.iterdir()) == []
    else:
        assert code == 0 and f"interrupted after the output was written ({out}: complete)" in err
        _check_against_direct(
            torch.load(out, weights_only=True), torch.load(files["ckpt"], weights_only=True), files["images"]
        )


# --- outputs that would have destroyed something (a probe, round 12) --------------------------------------------


def test_outputs_that_are_not_regular_files_are_refused(tiny, work, capsys):
    """A FIFO (or a device: /dev/null became a regular file) as --out or --plot was replaced by the output."""
    os.mkfifo("fifo")
    assert main(_tiny_args(tiny, work["ckpt"], "fifo")) == 2
    assert "is not a regular file" in capsys.readouterr().err
    assert main(["diff", str(work["ckpt"]), str(work["ckpt"]), "--plot", "fifo"]) == 2
    assert stat.S_ISFIFO(os.stat("fifo").st_mode)


def test_outputs_inside_the_data_folder_or_onto_the_model_module_are_refused(tiny, work, capsys):
    """--out into the image folder replaced a training image (--report too); --out onto the --model module's
    source file replaced it."""
    before = sorted(p.name for p in tiny["images"].iterdir())
    for extra in (["--out", str(tiny["images"] / "0.png")], ["--report", str(tiny["images"] / "r.json")]):
        args = _tiny_args(tiny, work["ckpt"], "out.pt")
        i = args.index(extra[0]) if extra[0] in args else len(args)
        args[i : i + 2] = extra
        assert main(args) == 2
        assert "is inside the input folder --data" in capsys.readouterr().err
    assert sorted(p.name for p in tiny["images"].iterdir()) == before
    source = tiny["root"] / "cli_tiny.py"
    text = source.read_text()
    assert main(_tiny_args(tiny, work["ckpt"], str(source))) == 2  # (found on sys.path, as the import finds it)
    assert "is the input --model's module" in capsys.readouterr().err
    assert source.read_text() == text


@pytest.mark.parametrize("output", ["--out", "--report"])
def test_outputs_onto_a_module_that_the_model_module_imports_are_refused(tiny, work, capsys, output):
    """Probe 37: the --model module's own file was refused as an output, but not the helper module it imports:
    ``--out helpers.py`` replaced the helper with a checkpoint, exit 0. Refused when the outputs are about to be
    written (the helper is imported with the model, after the checks up front): exit 1, nothing written."""
    helper, models = f"cli_helper_{output[2:]}", f"cli_models_{output[2:]}"
    (work["dir"] / f"{helper}.py").write_text(
        "from torch import nn\n\ndef block():\n    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))\n"
    )
    (work["dir"] / f"{models}.py").write_text(f"from {helper} import block\n\ndef net():\n    return block()\n")
    sys.path.insert(0, str(work["dir"]))
    try:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
        torch.save(net.state_dict(), "net.pt")
        before = {p.name: p.read_bytes() for p in work["dir"].iterdir() if p.is_file()}
        args = _tiny_args(tiny, work["dir"] / "net.pt", "out.pt", output, f"{helper}.py")
        if output == "--out":
            args = _tiny_args(tiny, work["dir"] / "net.pt", f"{helper}.py")
        args[args.index("--model") + 1] = f"{models}:net"
        assert main(args) == 1  # (found after loading: not a usage error found up front)
        err = capsys.readouterr().err
        assert f"is the file of the module {helper!r}, which this run imported" in err
        assert "nothing was written" in err
        after = {p.name: p.read_bytes() for p in work["dir"].iterdir() if p.is_file()}
        assert after == before
    finally:
        sys.path.remove(str(work["dir"]))
        for name in (helper, models):
            sys.modules.pop(name, None)


def test_in_place_does_not_replace_a_checkpoint_saved_meanwhile(tiny, work, capsys):
    """Another job saving the checkpoint during the run: --in-place replaced it with the old one recalibrated."""
    (work["dir"] / "cli_race.py").write_text(
        "import torch\n"
        "def data(ckpt):\n"
        "    sd = torch.load(ckpt, weights_only=True)\n"
        "    torch.save({k: v + 1 if v.is_floating_point() else v for k, v in sd.items()}, ckpt)  # a newer one\n"
        "    g = torch.Generator().manual_seed(0)\n"
        "    return [torch.rand(4, 3, 32, 32, generator=g) for _ in range(2)]\n"
    )
    args = _tiny_args(tiny, work["ckpt"], "unused.pt", "--data-kwargs", json.dumps({"ckpt": str(work["ckpt"])}))
    args[args.index("--data") + 1] = "cli_race:data"
    for name in ("--out", "--batch-size"):
        i = args.index(name)
        del args[i : i + 2]
    newer = None
    assert main([*args, "--in-place"]) == 1
    assert "changed while precisebn was working on it" in capsys.readouterr().err
    newer = torch.load(work["ckpt"], weights_only=True)
    original = torch.load(tiny["ckpt"], weights_only=True)
    assert all(torch.equal(newer[k], v + 1 if v.is_floating_point() else v) for k, v in original.items())


def test_a_figure_is_written_in_the_format_its_extension_names(tiny, work):
    """diff --plot x.pdf wrote PNG bytes (the format was taken from the temporary file's name)."""
    pytest.importorskip("matplotlib")
    for name, magic in (("d.pdf", b"%PDF"), ("d.svg", b"<?xml"), ("d.png", b"\x89PNG")):
        assert main(["diff", str(work["ckpt"]), str(tiny["ckpt"]), "--plot", name]) == 0
        assert Path(name).read_bytes().startswith(magic), name


def test_apply_refuses_a_checkpoint_holding_two_copies_of_the_model(tiny, work, capsys):
    """A file with model.* and ema_model.*: the statistics went under the first key's prefix, silently."""
    import cli_tiny

    model = cli_tiny.Tiny()
    model.load_state_dict(torch.load(work["ckpt"], weights_only=True))
    stats = precisebn.estimate(model, [torch.rand(4, 3, 32, 32) for _ in range(2)])
    stats.save("stats.safetensors")
    sd = model.state_dict()
    torch.save({**{f"model.{k}": v for k, v in sd.items()}, **{f"ema_model.{k}": v for k, v in sd.items()}}, "two.pt")
    assert main(["apply", "two.pt", "stats.safetensors", "--out", "applied.pt"]) == 1
    err = capsys.readouterr().err
    assert "several prefixes ('ema_model.', 'model.'" in err or "several prefixes ('model.', 'ema_model.'" in err
    assert not Path("applied.pt").exists()


def test_the_same_command_writes_the_same_bytes(tiny, work):
    """torch.save named the archive's folder after the temporary file: a new hash every run."""
    hashes = []
    for _ in range(2):
        assert main(_tiny_args(tiny, work["ckpt"], "same.pt")) == 0
        hashes.append(_sha(Path("same.pt")))
    assert hashes[0] == hashes[1]


def test_a_crop_larger_than_the_image_is_refused(tiny, work, capsys):
    """torchvision's centre crop pads a smaller image with black, which the statistics counted."""
    assert main(_tiny_args(tiny, work["ckpt"], "o.pt", "--resize", "16", "--crop", "24")) == 1
    assert "would pad every image with black borders" in capsys.readouterr().err
    assert main(_tiny_args(tiny, work["ckpt"], "o.pt", "--resize", "none", "--crop", "40")) == 1
    assert "an image of 32×32 is smaller than the centre crop of 40" in capsys.readouterr().err
    assert not Path("o.pt").exists()


def test_a_reader_closing_stdout_early_does_not_lose_the_work(tiny, work):
    """``precisebn recalibrate ... | head -1``: the run failed with "Broken pipe ... nothing was written"."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(precisebn.__file__).parents[1]), str(tiny["root"])])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "precisebn", *_tiny_args(tiny, work["ckpt"], "piped.pt")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    proc.stdout.close()  # (the reader is gone before the first line)
    err = proc.stderr.read().decode()
    proc.stderr.close()
    assert proc.wait(timeout=300) == 0, err
    assert "Broken pipe" not in err
    assert Path("piped.pt").is_file()


def test_messages_that_said_the_wrong_thing(tiny, work, capsys):
    """Probe 12: a folder of unreadable images with --skip-bad-images spoke of "a non-empty iterable";
    --key on a plain state_dict said "pass one of those" with none listed; an output through a symlink loop
    failed after the whole run (exit 1)."""
    bad = work["dir"] / "allbad"
    bad.mkdir()
    (bad / "a.png").write_bytes(b"not a png")
    args = _tiny_args(tiny, work["ckpt"], "o.pt", "--skip-bad-images")
    args[args.index("--data") + 1] = str(bad)
    assert main(args) == 1
    assert "every image was unreadable and skipped (1 image" in capsys.readouterr().err
    assert main(_tiny_args(tiny, work["ckpt"], "o.pt", "--key", "state_dict")) == 1
    assert "Drop --key" in capsys.readouterr().err
    args = _tiny_args(tiny, work["ckpt"], "o.pt", "--report", "model.pt")
    i = args.index("--out")
    args[i : i + 2] = ["--in-place"]
    assert main(args) == 2  # (the hint "or pass --in-place" was given with --in-place)
    err = capsys.readouterr().err
    assert "destroy the input. Choose another path." in err and "pass --in-place" not in err
    os.symlink("loop_b", "loop_a")
    os.symlink("loop_a", "loop_b")
    assert main(_tiny_args(tiny, work["ckpt"], "loop_a")) == 2
    assert "is a loop of symbolic links" in capsys.readouterr().err
    assert not Path("o.pt").exists()


def test_layers_named_as_inspect_shows_them_for_a_prefixed_checkpoint(tiny, work, capsys):
    """A Lightning checkpoint's names carry ``model.``: inspect lists ``model.bn1``, which --layers refused."""
    sd = torch.load(work["ckpt"], weights_only=True)
    torch.save({f"model.{k}": v for k, v in sd.items()}, "lightning.pt")
    norms = sorted({k.rpartition(".")[0] for k in sd if k.endswith("running_mean")})
    assert main(_tiny_args(tiny, Path("lightning.pt"), "o.pt", "--layers", f"model.{norms[0]}")) == 0
    written, before = torch.load("o.pt", weights_only=True), torch.load("lightning.pt", weights_only=True)
    changed = {k for k in written if not torch.equal(written[k], before[k])}
    assert changed == {f"model.{norms[0]}.running_mean", f"model.{norms[0]}.running_var"}


NESTED_MODULE = """
import torch
from torch import nn


class Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)
        self.bn = nn.BatchNorm2d(3)
        self.model = nn.Sequential()
        self.model.bn = nn.BatchNorm2d(3)

    def forward(self, x):
        return self.model.bn(self.bn(self.conv(x)))
"""


def test_a_package_module_and_its_init_files_are_inputs(tiny, work, capsys):
    """Probe 16: --model pkg.sub.mods:Nested protected pkg/sub/mods.py, but --out pkg/__init__.py replaced the
    package's __init__ with a checkpoint."""
    (work["dir"] / "pkg" / "sub").mkdir(parents=True)
    (work["dir"] / "pkg" / "__init__.py").write_text("")
    (work["dir"] / "pkg" / "sub" / "__init__.py").write_text("")
    (work["dir"] / "pkg" / "sub" / "mods.py").write_text(NESTED_MODULE)
    for target in ("pkg/__init__.py", "pkg/sub/__init__.py", "pkg/sub/mods.py"):
        args = _tiny_args(tiny, work["ckpt"], target)
        args[args.index("--model") + 1] = "pkg.sub.mods:Nested"
        assert main(args) == 2, target
        assert "is the input --model's" in capsys.readouterr().err
    assert (work["dir"] / "pkg" / "__init__.py").read_text() == ""


def test_layers_named_as_the_model_names_them_whatever_the_checkpoints_prefix(tiny, work, capsys):
    """Probe 16: with a ``model.``-prefixed checkpoint, --layers model.bn (the model's own submodule ``model``)
    had its prefix taken off and selected the top-level ``bn``: the same flag chose other layers depending on
    how the checkpoint was saved."""
    (work["dir"] / "cli_nested.py").write_text(NESTED_MODULE)
    namespace: dict[str, Any] = {}
    exec(NESTED_MODULE, namespace)  # (the same class the CLI imports from cli_nested.py)
    nested = namespace["Nested"]()
    sd = nested.state_dict()
    torch.save(sd, "plain.pt")
    torch.save({f"model.{k}": v for k, v in sd.items()}, "prefixed.pt")
    for ckpt, prefix in (("plain.pt", ""), ("prefixed.pt", "model.")):
        args = _tiny_args(tiny, Path(ckpt), f"out_{ckpt}", "--layers", "model.bn")
        args[args.index("--model") + 1] = "cli_nested:Nested"
        assert main(args) == 0, capsys.readouterr().err
        written = torch.load(f"out_{ckpt}", weights_only=True)
        changed = {k for k in written if not torch.equal(written[k], sd[k[len(prefix) :]])}
        assert changed == {f"{prefix}model.bn.running_mean", f"{prefix}model.bn.running_var"}, ckpt


def test_layers_whose_statistics_are_not_saved_are_left_out_up_front(tiny, work, capsys):
    """Found by a probe: a layer whose running buffers are registered persistent=False was recalibrated with
    the rest, then the write failed ("unexpected KeyError: '1.running_mean'") after all the passes. It is left
    out, with a warning, and the others are written; named in --layers, it is refused before any pass."""
    import cli_tiny

    model = cli_tiny.with_unsaved()
    source, out = work["dir"] / "unsaved.pt", work["dir"] / "unsaved_out.pt"
    torch.save(model.state_dict(), source)
    args = ["recalibrate", str(source), "--model", "cli_tiny:with_unsaved", "--data", "cli_tiny:batches",
            "--out", str(out), "--num-samples", "all", "--no-progress", "--device", "cpu"]  # fmt: skip
    assert main(args) == 0
    assert "layer(s) '1' keep their running statistics out of the model's state_dict" in capsys.readouterr().err
    written = torch.load(out, weights_only=True)
    truth = compute_truth(model, cli_tiny.batches(), select=lambda name, m: name == "3")["3"]  # ('1' in eval mode)
    assert max_rel_error(written["3.running_mean"], truth.mean, truth.var.sqrt()) < 1e-5
    assert max_rel_error(written["3.running_var"], truth.var) < 1e-5
    assert sorted(written) == sorted(model.state_dict())
    out.unlink()
    calls = []
    cli_tiny_batches = cli_tiny.batches
    try:
        cli_tiny.batches = lambda: calls.append(1) or cli_tiny_batches()
        assert main([*args, "--layers", "1,3"]) != 0
    finally:
        cli_tiny.batches = cli_tiny_batches
    assert "--layers '1', '3': layer(s) '1' keep their running statistics out" in capsys.readouterr().err
    assert calls == [] and not out.exists()
    model = cli_tiny.UnsavedAlias()  # (probe 28: its second name got it past the check, to a KeyError at the end)
    torch.save(model.state_dict(), source)
    args = [a.replace("cli_tiny:with_unsaved", "cli_tiny:UnsavedAlias") for a in args]
    assert main(args) == 0
    assert "layer(s) 'body.1' keep their running statistics out" in capsys.readouterr().err
    written = torch.load(out, weights_only=True)
    assert not torch.equal(written["body.3.running_var"], model.state_dict()["body.3.running_var"])
    for layers, said in (("alias", "--layers 'alias': layer(s) 'body.1'"), ("body.1*", "no other layer is selected")):
        assert main([*args, "--layers", layers]) != 0
        assert said in capsys.readouterr().err


def test_a_checkpoint_in_another_dtype_than_the_model_built_is_said(tiny, work, capsys):
    """Found by a probe: a float64 checkpoint loaded into the float32 modules --model builds was converted, the
    passes measured that float32 copy, and its statistics (2.6e-7 from the float64 model's) went into the
    float64 buffers without a word."""
    import cli_tiny

    model = cli_tiny.WithExtraState()
    out = work["dir"] / "dtype_out.pt"
    for dtype, said in ((torch.float64, True), (torch.float32, False)):
        source = work["dir"] / f"{dtype}.pt"
        torch.save(model.to(dtype).state_dict(), source)
        args = ["recalibrate", str(source), "--model", "cli_tiny:WithExtraState", "--data", "cli_tiny:batches",
                "--out", str(out), "--num-samples", "all", "--no-progress", "--device", "cpu"]  # fmt: skip
        assert main(args) == 0
        err = capsys.readouterr().err
        assert ("6 tensors of the checkpoint (e.g. 'conv.weight') are float64, but the model --model builds holds "
                "them as float32") in err if said else "converted on loading" not in err  # fmt: skip
        assert torch.load(out, weights_only=True)["bn.running_var"].dtype == dtype


def test_no_output_goes_where_a_symlinked_folder_of_the_data_leads(tiny, work, capsys):
    """Found by a probe: with a class folder of --data a symlink to a folder elsewhere, --report there was
    accepted, and the next run of the same command read its PNG as a training image (6 samples became 7)."""
    data, outside = work["dir"] / "imgs", work["dir"] / "outside"
    data.mkdir()
    outside.mkdir()
    for image in sorted(tiny["images"].glob("*.png"))[:6]:
        (outside / image.name).write_bytes(image.read_bytes())
    (data / "cls").symlink_to(outside, target_is_directory=True)
    out = work["dir"] / "out.pt"

    def args(report: Path) -> list[str]:
        given = _tiny_args(tiny, work["ckpt"], out, "--report", str(report))
        return [str(data) if a == str(tiny["images"]) else a for a in given]

    for report in (outside / "rep.json", data / "cls" / "rep.json"):
        assert main(args(report)) == 2
        err = capsys.readouterr().err
        assert f"is inside the input folder --data (through {str(data / 'cls')!r})" in err
        assert not out.exists() and sorted(p.name for p in outside.iterdir()) == [f"{i}.png" for i in range(6)]
    assert main(args(work["dir"] / "rep.json")) == 0
    assert "6 samples" in capsys.readouterr().out  # (the linked folder's images are read)


def test_no_output_goes_where_a_symlinked_image_of_the_data_leads(tiny, work, capsys):
    """Probe 41: an image of --data that is a symlink to a file elsewhere (a training image kept in a shared
    folder) was overwritten by --report's PNG or by --out (exit 0); a dangling one's target was written by
    --report and read as a training image by the next run. Both are refused before any work."""
    data, shared = work["dir"] / "imgs", work["dir"] / "shared"
    (data / "cls").mkdir(parents=True)
    shared.mkdir()
    images = sorted(tiny["images"].glob("*.png"))[:6]
    for image in images[:5]:
        (data / "cls" / image.name).write_bytes(image.read_bytes())
    (shared / "kept.png").write_bytes(images[5].read_bytes())
    (data / "cls" / "linked.png").symlink_to(shared / "kept.png")
    (data / "cls" / "zz_dangling.png").symlink_to(shared / "later.png")
    before = (shared / "kept.png").read_bytes()
    out = work["dir"] / "out.pt"

    def args(*extra: str, to: Path = out) -> list[str]:  # (the dangling link: an unreadable image, skipped)
        given = _tiny_args(tiny, work["ckpt"], to, *extra, "--skip-bad-images")
        return [str(data) if a == str(tiny["images"]) else a for a in given]

    refused = [
        (args("--report", str(shared / "kept.json")), "--report's PNG"),
        (args(to=shared / "kept.png"), "--out"),
        (args("--report", str(shared / "later.json")), "--report's PNG"),
    ]
    for given, label in refused:
        assert main(given) == 2
        err = capsys.readouterr().err
        assert f"{label} " in err and "of --data links to" in err, err
        assert not out.exists() and (shared / "kept.png").read_bytes() == before
        assert sorted(p.name for p in shared.iterdir()) == ["kept.png"]
    assert main(args("--report", str(work["dir"] / "rep.json"))) == 0
    assert "6 samples" in capsys.readouterr().out  # (the linked image is read; the dangling one skipped)


def _dead_pid() -> int:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    return dead.pid


def test_the_temporaries_of_a_run_on_another_machine_survive_a_run(tiny, work, capsys):
    """Found by a probe: a run in another container (or on another host of an NFS folder) writing the same output
    had its live temporary removed by this one, its process id being "gone" here; it then failed, its work lost.
    Another machine's mark is left alone, and so is a fresh temporary without a mark (an older precisebn's)."""
    from precisebn.files import _machine_mark

    dead, mark = _dead_pid(), _machine_mark()
    foreign = "0" * 8 if mark != "0" * 8 else "1" * 8
    theirs = [
        work["dir"] / f".out.pt.precisebn-{foreign}-{dead}-0123abcd.tmp",
        work["dir"] / f".out.pt.precisebn-{dead}-4567abcd.tmp",
    ]
    for path in theirs:
        path.write_bytes(b"another run's checkpoint, being written")
    assert main(_tiny_args(tiny, work["ckpt"], "out.pt", "--crop", "none")) == 0, capsys.readouterr().err
    assert (work["dir"] / "out.pt").is_file()
    assert _stray(work["dir"]) == sorted(p.name for p in theirs)
    assert all(p.read_bytes() == b"another run's checkpoint, being written" for p in theirs)


def test_a_temporary_that_another_process_removed_is_said_to_have_disappeared(tiny, work, capsys, monkeypatch):
    """Found by a probe: the run whose temporary another process removed failed with "checkpoint
    '.../.out.pt.precisebn-...tmp' does not exist; check the path" (a file the user never named)."""
    import precisebn.checkpoint

    real_write = precisebn.checkpoint.write_checkpoint

    def write_then_lose(ckpt, replace, path):
        real_write(ckpt, replace, path)
        os.unlink(path)  # (as another process does)

    monkeypatch.setattr(precisebn.checkpoint, "write_checkpoint", write_then_lose)
    assert main(_tiny_args(tiny, work["ckpt"], "out.pt", "--crop", "none", "--report", "r.json")) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "precisebn recalibrate: error: --out 'out.pt': the temporary file '.out.pt.precisebn-" in err
    assert "disappeared before it could be renamed into place; another process removed it" in err
    assert "make sure one run at a time writes 'out.pt', then run again" in err and "does not exist" not in err
    assert sorted(p.name for p in work["dir"].iterdir()) == ["existing_dir", "link.pt", "model.pt"]


@pytest.mark.parametrize("case", ["--batch-size 1", "a folder of one image"])
def test_a_batch_of_one_image_is_told_what_to_change_on_the_command_line(tiny, work, capsys, case):
    """Found by a probe: a BatchNorm1d given a batch of one image said to use DataLoader(drop_last=True), which a
    command-line user cannot pass."""
    import cli_tiny

    torch.save(cli_tiny.Pooled().state_dict(), "pooled.pt")
    args = _tiny_args(tiny, work["dir"] / "pooled.pt", "out.pt", "--crop", "none")
    args[args.index("--model") + 1] = "cli_tiny:Pooled"
    if case == "--batch-size 1":
        args[args.index("--batch-size") + 1] = "1"
        hint = "--batch-size 1 makes batches of a single image: pass --batch-size 2 or more"
    else:
        (work["dir"] / "one" / "cls").mkdir(parents=True)
        shutil.copy(sorted(tiny["images"].glob("*.png"))[0], work["dir"] / "one" / "cls")
        args[args.index("--data") + 1] = str(work["dir"] / "one")
        hint = "--data '" + str(work["dir"] / "one") + "' holds a single image, a batch of one whatever --batch-size is"
    assert main(args) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "layer 'bn' (BatchNorm1d) received one value per channel (input of shape (1, 4))" in err
    assert hint in err and "Nothing was written" in err
    assert "drop_last" not in err and "DataLoader" not in err
    assert not (work["dir"] / "out.pt").exists() and _stray(work["dir"]) == []


SHADOWED = {  # the --model module's files, its name, --out, and the module and folder the message names
    "an extension module beside it": (["shadow_m.py"], "shadow_m", "shadow_m.so", "shadow_m", "the working folder"),
    "a module found further down the path": (
        ["lib/shadow_m.py"],
        "shadow_m",
        "shadow_m.py",
        "shadow_m",
        "the working folder",
    ),
    "a module of a namespace package": (
        ["ns_pkg/shadow_m.py"],
        "ns_pkg.shadow_m",
        "ns_pkg.py",
        "ns_pkg",
        "the working folder",
    ),
    "a module in its package": (
        ["pkg/__init__.py", "pkg/shadow_m.py"],
        "pkg.shadow_m",
        "pkg/shadow_m.so",
        "pkg.shadow_m",
        "its package's folder",
    ),
}


@pytest.mark.parametrize("case", list(SHADOWED))
def test_an_output_that_would_be_imported_as_the_model_module_is_refused(tiny, work, capsys, monkeypatch, case):
    """Found by a probe: ``--model shadow_m:net --out shadow_m.so`` (or ``--out shadow_m.py`` where the module is
    found further down the import path) was written, and the next run imported the checkpoint instead of the
    model's code. The checks compared files; the output is not the module's file until it is written."""
    sources, name, out, module, where = SHADOWED[case]
    for source in sources:
        (work["dir"] / source).parent.mkdir(exist_ok=True)
        (work["dir"] / source).write_text("from cli_tiny import Tiny as net\n")
    monkeypatch.syspath_prepend(str(work["dir"] / "lib"))
    args = _tiny_args(tiny, work["ckpt"], out, "--crop", "none")
    args[args.index("--model") + 1] = f"{name}:net"
    before = sorted(p.name for p in work["dir"].rglob("*"))
    assert main(args) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "usage: precisebn recalibrate" in err
    assert f"--out {out!r} would be imported as the module {module!r} of --model '{name}:net'" in err
    assert f"Python looks for {module!r} in {where} " in err and "Give the output another name or folder." in err
    assert sorted(p.name for p in work["dir"].rglob("*")) == before
    args[args.index("--out") + 1] = "net.pt"  # (the same module, an output of another name: written)
    try:
        assert main(args) == 0, capsys.readouterr().err
    finally:
        for loaded in ("shadow_m", "ns_pkg", "ns_pkg.shadow_m", "pkg", "pkg.shadow_m"):
            sys.modules.pop(loaded, None)
