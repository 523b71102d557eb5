"""The ``precisebn`` command line, driven through ``main([...])`` and once as the installed script."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import precisebn
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
    assert main(_recalibrate_args(files, out)) == 0  # default --num-samples 8192 > 14 images
    captured = capsys.readouterr()
    assert "using all 14 images" in captured.out and "warning" not in captured.err
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
    assert main(["inspect", str(path), "--strict"]) == 1
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
        "bad model kwargs": (rec(("--model-kwargs", "{not json")), "not valid JSON"),
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
        "out is the input": (rec(("--out", str(files["ckpt"]))), "--in-place"),
        "format mismatch": (rec(("--out", str(tmp / "o.safetensors"))), "same kind of extension"),
        "bad device": (rec(extra=("--device", "toaster")), "not a device"),
        "report path is png": (rec(extra=("--report", str(tmp / "r.png"))), "JSON"),
        "inspect garbage": (["inspect", str(tmp / "junk.pt")], "cannot read"),
        "inspect no statistics": (["inspect", str(no_norm)], "no normalization statistics"),
        "diff missing": (["diff", str(files["ckpt"]), str(tmp / "nope.pt")], "does not exist"),
    }


BAD = [
    "missing checkpoint", "garbage checkpoint", "truncated checkpoint", "garbage safetensors", "pickled objects",
    "not a state_dict", "other num_classes", "other model", "unknown model", "bad model kwargs", "unknown kwarg",
    "factory raises", "factory not a model", "module not found", "missing attribute", "empty image folder",
    "no such data folder", "unreadable image", "data function raises", "data not iterable", "model fails on the data",
    "out is the input",
    "format mismatch", "bad device", "report path is png", "inspect garbage", "inspect no statistics", "diff missing",
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
     ["demo", "--epochs", "0"], ["inspect"]],
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
