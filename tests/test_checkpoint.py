"""Checkpoint files, model/data specifications and stored-statistics health (the CLI's building blocks)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import compute_truth, max_rel_error
from precisebn.checkpoint import (
    CheckpointError,
    CheckpointMismatchError,
    load_checkpoint,
    load_into,
    save_checkpoint,
)
from precisebn.errors import EmptyDataError, InvalidArgumentError, StatsMismatchError
from precisebn.health import NormEntry, diff_stats, health_flags, norm_entries
from precisebn.specs import SpecError, batch_indices, load_object, parse_kwargs, resolve_data, resolve_model


def _net() -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.LazyLinear(2))


def _sd() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Linear(4, 2))
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_errors_are_library_errors():
    assert issubclass(CheckpointError, InvalidArgumentError) and issubclass(CheckpointError, ValueError)
    assert issubclass(CheckpointMismatchError, StatsMismatchError)
    assert issubclass(SpecError, InvalidArgumentError)


@pytest.mark.parametrize("layout", ["plain", "state_dict", "model"])
def test_torch_roundtrip_replaces_only_named_tensors(layout, tmp_path):
    sd = _sd()
    obj = sd if layout == "plain" else {layout: sd, "epoch": 3, "optimizer": {"lr": 0.1}}
    torch.save(obj, tmp_path / "in.pt")
    ckpt = load_checkpoint(tmp_path / "in.pt")
    assert ckpt.format == "torch" and ckpt.key == (None if layout == "plain" else layout)
    new_var = torch.arange(4, dtype=torch.float64)
    save_checkpoint(ckpt, {"1.running_var": new_var}, tmp_path / "out.pt")
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    written = out if layout == "plain" else out[layout]
    if layout != "plain":
        assert out["epoch"] == 3 and out["optimizer"] == {"lr": 0.1}
    assert written["1.running_var"].dtype == torch.float32  # the stored dtype, not the replacement's
    assert torch.equal(written["1.running_var"], new_var.float())
    for key in sd.keys() - {"1.running_var"}:
        assert torch.equal(written[key], sd[key])


def test_a_legacy_torch_file_is_written_back_in_its_format(tmp_path):
    """A checkpoint saved before zip archives (``_use_new_zipfile_serialization=False``) came back as a zip
    archive (a probe), against "the input's format"; now in its own."""
    import zipfile

    sd = _sd()
    torch.save(sd, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    torch.save(sd, tmp_path / "zip.pt")
    for name, archive in (("legacy.pt", False), ("zip.pt", True)):
        ckpt = load_checkpoint(tmp_path / name)
        save_checkpoint(ckpt, {"1.running_var": torch.arange(4.0)}, tmp_path / f"out-{name}")
        assert zipfile.is_zipfile(tmp_path / f"out-{name}") == archive
        written = torch.load(tmp_path / f"out-{name}", weights_only=True)
        assert torch.equal(written["1.running_var"], torch.arange(4.0))
        assert all(torch.equal(written[k], v) for k, v in sd.items() if k != "1.running_var")


def test_safetensors_roundtrip_keeps_metadata(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    sd = _sd()
    st.save_file(sd, str(tmp_path / "in.safetensors"), metadata={"source": "test"})
    ckpt = load_checkpoint(tmp_path / "in.safetensors")
    assert ckpt.format == "safetensors" and ckpt.metadata == {"source": "test"}
    save_checkpoint(ckpt, {"1.running_mean": torch.ones(4)}, tmp_path / "out.safetensors")
    (tmp_path / "plain.txt").write_text("x")  # the mode an ordinary new file gets under this umask
    assert (tmp_path / "out.safetensors").stat().st_mode & 0o777 == (tmp_path / "plain.txt").stat().st_mode & 0o777
    again = load_checkpoint(tmp_path / "out.safetensors")
    assert again.metadata == {"source": "test"}
    assert torch.equal(again.state_dict["1.running_mean"], torch.ones(4))
    assert torch.equal(again.state_dict["0.weight"], sd["0.weight"])


def test_failed_save_leaves_no_file(tmp_path):
    torch.save(_sd(), tmp_path / "in.pt")
    ckpt = load_checkpoint(tmp_path / "in.pt")
    with pytest.raises(InvalidArgumentError, match="missing from the checkpoint"):
        save_checkpoint(ckpt, {"nope": torch.zeros(1)}, tmp_path / "out.pt")
    ckpt.container, ckpt.key = {"x": lambda: None}, "model"  # a lambda cannot be pickled: torch.save fails midway
    with pytest.raises(Exception, match=r"(?i)pickle"):
        save_checkpoint(ckpt, {}, tmp_path / "out.pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.pt"]


def test_unreadable_files(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "missing.pt")
    with pytest.raises(CheckpointError, match="not a file"):
        load_checkpoint(tmp_path)
    (tmp_path / "empty.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="cannot read"):
        load_checkpoint(tmp_path / "empty.pt")
    torch.save({"epoch": 1, "weights": [1, 2]}, tmp_path / "nosd.pt")
    with pytest.raises(CheckpointError, match=r"a dict without a state_dict \(keys: 'epoch', 'weights'\)"):
        load_checkpoint(tmp_path / "nosd.pt")
    from safetensors.torch import save_file

    save_file(_sd(), tmp_path / "renamed.pt")
    with pytest.raises(CheckpointError, match=r"is a safetensors file .* rename it to renamed\.safetensors"):
        load_checkpoint(tmp_path / "renamed.pt")


def test_trusted_whole_model_is_refused_with_advice(tmp_path):
    torch.save(nn.BatchNorm1d(2), tmp_path / "whole.pt")
    with pytest.raises(CheckpointError, match="--trust-checkpoint"):
        load_checkpoint(tmp_path / "whole.pt")
    with pytest.raises(CheckpointError, match="whole pickled model"):
        load_checkpoint(tmp_path / "whole.pt", trust=True)


def test_load_into_strips_wrapper_prefixes(tmp_path):
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Linear(4, 2))
    for prefix in ("module.", "model.", "_orig_mod.module."):
        torch.save({prefix + k: v for k, v in _sd().items()}, tmp_path / "p.pt")
        assert load_into(model, load_checkpoint(tmp_path / "p.pt")) == prefix
        assert torch.equal(model[0].weight, _sd()["0.weight"])


def test_load_into_reports_every_kind_of_mismatch(tmp_path):
    sd = _sd()
    sd["extra.weight"] = torch.zeros(1)
    del sd["1.running_var"]
    sd["2.weight"] = torch.zeros(3, 4)
    torch.save(sd, tmp_path / "bad.pt")
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Linear(4, 2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointMismatchError) as info:
        load_into(model, load_checkpoint(tmp_path / "bad.pt"))
    message = str(info.value)
    assert "1 missing (1.running_var)" in message
    assert "1 unexpected (extra.weight)" in message
    assert "1 shape mismatch (2.weight: checkpoint (3, 4), model (2, 4))" in message
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # nothing loaded


def test_parse_kwargs():
    assert parse_kwargs(None) == {}
    assert parse_kwargs("a=1, b=x, c=[1,2], d=true") == {"a": 1, "b": "x", "c": [1, 2], "d": True}
    assert parse_kwargs("sizes=[1, 2],name=a,b") == {"sizes": [1, 2], "name": "a,b"}
    assert parse_kwargs('{"a": {"b": 2}}') == {"a": {"b": 2}}
    for bad in ("a", "1=2", "[1]", "{bad"):
        with pytest.raises(SpecError):
            parse_kwargs(bad)


def test_user_factory_and_data_function(tmp_path, monkeypatch):
    (tmp_path / "spec_user_code.py").write_text(
        "import torch\n"
        "class Zoo:\n"
        "    @staticmethod\n"
        "    def make(width=2):\n"
        "        return torch.nn.BatchNorm1d(width)\n"
        "instance = torch.nn.BatchNorm1d(5)\n"
        "def batches(n=2):\n"
        "    return [torch.zeros(4, 3)] * n\n"
    )
    monkeypatch.chdir(tmp_path)
    assert resolve_model("spec_user_code:Zoo.make", {"width": 3}).num_features == 3
    assert resolve_model("spec_user_code:instance").num_features == 5
    data, size = resolve_data("spec_user_code:batches", kwargs={"n": 3})
    assert len(list(data)) == 3 and size is None
    with pytest.raises(SpecError, match="not of the form"):
        load_object("spec_user_code", "--model")


def test_torchvision_names():
    pytest.importorskip("torchvision")
    model = resolve_model("torchvision:resnet18", {"num_classes": 3})
    assert model.fc.out_features == 3
    with pytest.raises(SpecError, match="did you mean resnet18"):
        resolve_model("torchvision:resnet81")


def test_image_folder_order_and_files(tmp_path):
    pytest.importorskip("torchvision")
    image = pytest.importorskip("PIL.Image")
    for rel in ("a/1.png", "a/2.jpg", "b/deep/3.png", ".hidden/4.png", "notes.txt"):
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if rel.endswith("txt"):
            path.write_text("x")
        else:
            image.new("RGB", (10, 12), color=(10, 200, 30)).save(path)
    from precisebn.images import Preprocessing

    data, size = resolve_data(str(tmp_path), batch_size=2, preprocessing=Preprocessing("test", resize=8, crop=8))
    assert size == 3
    batches = list(data)
    assert [tuple(b.shape) for b in batches] == [(3, 3, 8, 8)]  # 2 + a last single image joined
    with pytest.raises(SpecError, match="no such folder"):
        resolve_data(str(tmp_path / "missing"), batch_size=2)
    (tmp_path / "none").mkdir()
    with pytest.raises(EmptyDataError, match="no images found"):
        resolve_data(str(tmp_path / "none"))


def test_batch_indices_cover_everything_once():
    for n, size in [(1, 4), (9, 4), (12, 4), (13, 4), (100, 7)]:
        batches = batch_indices(n, size, seed=1)
        assert sorted(i for b in batches for i in b) == list(range(n))
        assert all(len(b) >= 2 for b in batches) or n == 1
    assert batch_indices(10, 3, seed=5) == batch_indices(10, 3, seed=5) != batch_indices(10, 3, seed=6)


def test_norm_entries_and_flags():
    model = nn.Sequential(nn.BatchNorm1d(3), nn.Linear(3, 3), nn.InstanceNorm1d(3, track_running_stats=True))
    entries = norm_entries(model.state_dict())
    assert [(e.name, e.channels, e.batches) for e in entries] == [("0", 3, 0), ("2", 3, 0)]
    assert health_flags(entries[0]) == ["never updated"]

    def entry(var):
        return NormEntry(
            "x", torch.zeros(len(var), dtype=torch.float64) + 0.5, torch.tensor(var, dtype=torch.float64), 1
        )

    assert health_flags(entry([1.0, 2.0, 0.5])) == []
    assert health_flags(entry([1.0, float("inf"), -2.0])) == ["non-finite: 1 ch", "var<=0: 1 ch"]
    assert health_flags(entry([1.0, 1.0, 1e-3])) == []
    assert health_flags(entry([1.0, 1.0, 1e-3]), collapse_ratio=1e-2) == ["collapsed: 1 ch"]


def test_diff_stats_against_direct_formulas():
    a, b = _sd(), _sd()
    b["1.running_mean"] = torch.tensor([1.0, -1.0, 0.0, 2.0])
    b["1.running_var"] = torch.tensor([4.0, 1.0, 0.25, 1.0])
    b["2.weight"] = b["2.weight"] + 1
    diff = diff_stats(a, b)
    row = diff.report["1"]
    shift = (b["1.running_mean"].double() - a["1.running_mean"].double()).abs() / (
        b["1.running_var"].double() + 1e-5
    ).sqrt()
    assert row.mean_shift == pytest.approx(float(shift.mean()))
    ratio = (b["1.running_var"].double() + 1e-5) / (a["1.running_var"].double() + 1e-5)
    assert row.var_ratio == pytest.approx(float(ratio.log().mean().exp()))
    assert (diff.other_same, diff.other_differ) == (5, 1)  # conv, BatchNorm affine and linear bias; linear weight
    c = {k: v for k, v in a.items() if not k.startswith("1.")}
    c["9.running_mean"], c["9.running_var"] = torch.zeros(2), torch.ones(2)
    assert (diff_stats(a, c).only_a, diff_stats(a, c).only_b) == (["1"], ["9"])
    d = dict(a, **{"1.running_mean": torch.zeros(5), "1.running_var": torch.ones(5)})
    assert diff_stats(a, d).mismatched == ["1"]


def test_blocked_global_names_the_option_and_runs_nothing(tmp_path):
    import os

    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"a": torch.zeros(2), "x": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(CheckpointError, match="--trust-checkpoint") as info:
        load_checkpoint(tmp_path / "evil.pt")
    assert "system" in str(info.value) and "Is it complete" not in str(info.value)
    assert not marker.exists()


def test_write_alias_names_and_verify(tmp_path):
    from precisebn.checkpoint import buffer_names, verify_written, write_checkpoint

    bn = nn.BatchNorm2d(4)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), bn, nn.Sequential(bn))
    names = buffer_names(model, ["1"], ("running_mean", "running_var"), "module.")
    assert names == {
        "module.1.running_mean": "1.running_mean",
        "module.1.running_var": "1.running_var",
        "module.2.0.running_mean": "2.0.running_mean",
        "module.2.0.running_var": "2.0.running_var",
    }
    torch.save({"module." + k: v for k, v in model.state_dict().items()}, tmp_path / "in.pt")
    ckpt = load_checkpoint(tmp_path / "in.pt")
    replace = {k: torch.full((4,), 3.0) for k in names}
    write_checkpoint(ckpt, replace, tmp_path / "out.pt")
    verify_written(ckpt, replace, tmp_path / "out.pt")
    with pytest.raises(CheckpointError, match="does not hold the new values"):
        verify_written(ckpt, {**replace, "module.2.0.running_var": torch.zeros(4)}, tmp_path / "out.pt")


def test_a_failed_torch_save_is_an_os_error_naming_the_file(tmp_path, monkeypatch) -> None:
    """Found by a hostile probe: a full disk while writing a .pt came out of the CLI as "unexpected
    RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos ..."."""
    from precisebn import checkpoint

    path = tmp_path / "in.pt"
    torch.save({"bn.running_mean": torch.zeros(2)}, path)
    ckpt = checkpoint.load_checkpoint(path)

    def full(obj, f, **options):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1133248 vs 1133144")

    monkeypatch.setattr(checkpoint.torch, "save", full)
    with pytest.raises(OSError, match="a full disk") as raised:
        checkpoint.write_checkpoint(ckpt, {}, tmp_path / "out.pt")
    assert raised.value.filename == str(tmp_path / "out.pt")


@pytest.mark.parametrize("signal", ["Ctrl-C", "SIGTERM"])
def test_ctrl_c_inside_torch_save_is_an_interrupt_not_a_full_disk(tmp_path, monkeypatch, signal: str) -> None:
    """Found by probe 34b: a Ctrl-C while torch.save wrote a large checkpoint was raised in the file's write(),
    which torch's zip writer turned into its "enforce fail" RuntimeError — reported as "a full disk", exit 1
    instead of 130. The interrupt is raised again. Probe 37: so is a SIGTERM there (the exception precisebn's
    handler raises while files are staged, which then ends the process by the signal): it was "a full disk", exit
    1, and the process lived on."""
    import builtins

    from precisebn import checkpoint
    from precisebn.files import Terminated

    signalled = KeyboardInterrupt if signal == "Ctrl-C" else Terminated

    path = tmp_path / "in.pt"
    torch.save({"bn.running_mean": torch.zeros(100_000)}, path)
    ckpt = checkpoint.load_checkpoint(path)
    real_open = builtins.open

    class Interrupted:
        def __init__(self, f) -> None:
            self.f, self.writes = f, 0

        def write(self, data) -> int:
            self.writes += 1
            if self.writes == 3:
                raise signalled
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            self.f.close()

    monkeypatch.setattr(checkpoint, "open", lambda *a, **k: Interrupted(real_open(*a, **k)), raising=False)
    with pytest.raises(signalled):
        checkpoint.write_checkpoint(ckpt, {}, tmp_path / "out.pt")


def test_values_beyond_the_checkpoints_dtype_are_refused_before_writing(tmp_path):
    sd = {k: v.half() if v.is_floating_point() else v for k, v in _sd().items()}
    torch.save(sd, tmp_path / "half.pt")
    ckpt = load_checkpoint(tmp_path / "half.pt")
    with pytest.raises(InvalidArgumentError, match=r"'1.running_var'.*float16"):
        save_checkpoint(ckpt, {"1.running_var": torch.full((4,), 3.3e5)}, tmp_path / "out.pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["half.pt"]
    save_checkpoint(ckpt, {"1.running_var": torch.full((4,), 6.0e4)}, tmp_path / "out.pt")  # representable


def test_variances_below_a_float16_checkpoints_smallest_normal_are_written_as_float16_rounds_them(tmp_path, capsys):
    """Probe 45 asked whether ``precisebn apply`` into a float16 checkpoint should refuse a positive variance of
    ~7e-11 (a near-dead channel) that float16 holds as 0. A checkpoint does not hold its layers' eps, and with
    torch's default (1e-5) that changes ``var + eps`` by 7e-6 relative: it is written as float16 rounds it (exit
    0), a layer loaded from the file normalises as the float64 truth does (to float16 precision), a float32 copy
    gets the variance exactly, and ``inspect`` flags the channel in both (it is near-constant)."""
    import precisebn
    from precisebn.cli import main

    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(16, 3, generator=g) * torch.tensor([1e-5, 1e-2, 1.0])).half() for _ in range(4)]
    model = nn.Sequential(nn.BatchNorm1d(3)).half()
    truth = compute_truth(model, batches)["0"]
    stats = precisebn.estimate(model, batches)
    assert max_rel_error(stats["0"].var, truth.var) < 1e-12 and float(truth.var[0]) < 1e-9
    stats.save(tmp_path / "s.safetensors")
    for name, dtype in (("half", torch.float16), ("wide", torch.float32)):
        torch.save(
            {k: v.to(dtype) if v.is_floating_point() else v for k, v in model.state_dict().items()},
            tmp_path / f"{name}.pt",
        )
        out = tmp_path / f"{name}-out.pt"
        assert main(["apply", str(tmp_path / f"{name}.pt"), str(tmp_path / "s.safetensors"), "--out", str(out)]) == 0
        written = torch.load(out, weights_only=True)
        assert torch.equal(written["0.running_var"], truth.var.to(dtype))
        assert torch.equal(written["0.running_mean"], truth.mean.to(dtype))
        layer = nn.BatchNorm1d(3).to(dtype).eval()
        layer.load_state_dict({k.removeprefix("0."): v for k, v in written.items()})
        x = batches[0].to(dtype)
        want = (x.double() - truth.mean) / (truth.var + 1e-5).sqrt()
        assert max_rel_error(layer(x), want, torch.ones_like(want)) < (2e-3 if dtype == torch.float16 else 1e-6)
        capsys.readouterr()
        main(["inspect", str(out)])
        assert ("var<=0: 1 ch" if dtype == torch.float16 else "collapsed: 1 ch") in capsys.readouterr().out


def test_image_folders_through_symlinked_folders_and_16_bit_images(tmp_path):
    pytest.importorskip("torchvision")
    image = pytest.importorskip("PIL.Image")
    import numpy as np

    from precisebn.images import ImageFiles

    (tmp_path / "store" / "cats").mkdir(parents=True)
    (tmp_path / "data" / "dogs").mkdir(parents=True)
    for rel in ("store/cats/1.png", "store/cats/2.png", "data/dogs/3.png"):
        image.new("RGB", (4, 4), color=(10, 200, 30)).save(tmp_path / rel)
    (tmp_path / "data" / "cats").symlink_to(tmp_path / "store" / "cats")  # a class folder kept elsewhere
    (tmp_path / "data" / "dogs" / "loop").symlink_to(tmp_path / "data")  # a link back up: seen once
    values = np.arange(16, dtype=np.uint16).reshape(4, 4) * 4369  # 0 .. 65535
    image.fromarray(values).save(tmp_path / "data" / "dogs" / "16bit.png")
    assert image.open(tmp_path / "data" / "dogs" / "16bit.png").mode.startswith("I;16")

    files = ImageFiles(tmp_path / "data", lambda im: torch.from_numpy(np.asarray(im).copy()))
    names = sorted(p.relative_to(tmp_path / "data").as_posix() for p in files.files)
    assert names == ["cats/1.png", "cats/2.png", "dogs/16bit.png", "dogs/3.png"]
    loaded, error = files[files.files.index(tmp_path / "data" / "dogs" / "16bit.png")]
    assert error == "" and loaded.shape == (4, 4, 3)
    expected = torch.from_numpy(np.rint(values / 257.0).astype(np.uint8))  # 0, 17, ..., 255: not clipped
    assert all(torch.equal(loaded[..., c], expected) for c in range(3))


@pytest.mark.parametrize("seed", range(4))
def test_skipping_a_bad_image_never_leaves_a_batch_of_one(tmp_path, seed):
    pytest.importorskip("torchvision")
    image = pytest.importorskip("PIL.Image")
    from precisebn.images import ImageFiles, image_batches

    for i in range(5):
        image.new("RGB", (4, 4), color=(i, 2 * i, 3 * i)).save(tmp_path / f"{i}.png")
    (tmp_path / "bad.png").write_bytes(b"garbage")
    skipped: list[str] = []
    files = ImageFiles(tmp_path, lambda im: torch.zeros(3, 4, 4))
    sizes = [len(b) for b in image_batches(files, 4, seed=seed, skipped=skipped)]  # 4 + 2, one of them with bad.png
    assert sum(sizes) == 5 and min(sizes) >= 2 and len(skipped) == 1


def test_a_layer_with_more_means_than_variances_is_named():
    sd = {"d.running_mean": torch.zeros(3), "d.running_var": torch.ones(4)}
    with pytest.raises(StatsMismatchError, match="layer 'd' holds 3 running means but 4"):
        norm_entries(sd)


def test_images_are_read_as_batches_are_used_and_batches_of_one_kept(tmp_path):
    pytest.importorskip("torchvision")
    image = pytest.importorskip("PIL.Image")
    from precisebn.images import ImageFiles, image_batches

    for i in range(6):
        image.new("RGB", (4, 4), color=(i, 2 * i, 3 * i)).save(tmp_path / f"{i}.png")
    files = ImageFiles(tmp_path, lambda im: torch.zeros(3, 4, 4))
    assert [len(b) for b in image_batches(files, 1)] == [1, 1, 1, 1, 2]  # as batch_indices cuts them (were 2, 2, 2)
    from precisebn.images import batch_indices as image_order

    second = image_order(6, 3)[1]
    files.files[second[0]] = tmp_path / "missing.png"  # unreadable, in the second batch
    batches = image_batches(files, 3)
    assert len(next(batches)) == 3  # the first batch, without reading the second (it raised: read ahead)
    with pytest.raises(InvalidArgumentError, match="cannot read image"):
        next(batches)


def test_16_bit_netpbm_images_and_folders_walked_in_order(tmp_path):
    pytest.importorskip("torchvision")
    image = pytest.importorskip("PIL.Image")
    import numpy as np

    from precisebn.images import ImageFiles

    values = (np.arange(16).reshape(4, 4) * 4369).astype(np.uint16)
    header = b"P5 4 4 65535\n"  # a 16-bit PGM: Pillow opens it as mode "I"
    (tmp_path / "data" / "b").mkdir(parents=True)
    (tmp_path / "data" / "b" / "16bit.pgm").write_bytes(header + values.astype(">u2").tobytes())
    image.new("RGB", (4, 4)).save(tmp_path / "outside.png")  # beside the data folder
    (tmp_path / "data" / "a").symlink_to(tmp_path / "data" / "b")  # two ways to one folder: "a" comes first
    (tmp_path / "data" / "b" / "up").symlink_to(tmp_path)  # a link up to what holds the data: not followed
    files = ImageFiles(tmp_path / "data", lambda im: torch.from_numpy(np.asarray(im).copy()))
    assert [p.relative_to(tmp_path / "data").as_posix() for p in files.files] == ["a/16bit.pgm"]
    loaded, error = files[0]
    assert error == "" and torch.equal(loaded[..., 0], torch.from_numpy(np.rint(values / 257.0).astype(np.uint8)))


class Nested(nn.Module):
    """A model with a submodule of its own called ``model`` (``bn`` and ``model.bn``)."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(3)
        self.model = nn.Sequential()
        self.model.bn = nn.BatchNorm1d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.bn(self.bn(x))


def test_statistics_of_a_few_layers_apply_to_a_plain_or_wrapped_checkpoint(tmp_path):
    """A probe: statistics of ``bn`` alone also match ``model.bn`` by its end, and apply refused the plain
    checkpoint as "holding the model under several prefixes"; a Lightning-style ``model.`` checkpoint of such a
    model must still take them under ``model.``; two copies of the model (``model.`` and ``ema_model.``) are
    still refused."""
    import precisebn
    from precisebn.checkpoint import stats_replacement

    net = Nested()
    stats = precisebn.estimate(net, [torch.randn(8, 3) for _ in range(2)], layers=["bn"])
    sd = net.state_dict()
    torch.save(sd, tmp_path / "plain.pt")
    replace, prefix = stats_replacement(load_checkpoint(tmp_path / "plain.pt"), stats)
    assert prefix == "" and sorted(replace) == ["bn.running_mean", "bn.running_var"]
    torch.save({f"model.{k}": v for k, v in sd.items()}, tmp_path / "wrapped.pt")
    replace, prefix = stats_replacement(load_checkpoint(tmp_path / "wrapped.pt"), stats)
    assert prefix == "model." and sorted(replace) == ["model.bn.running_mean", "model.bn.running_var"]
    torch.save(
        {**{f"model.{k}": v for k, v in sd.items()}, **{f"ema_model.{k}": v for k, v in sd.items()}},
        tmp_path / "two.pt",
    )
    with pytest.raises(CheckpointMismatchError, match="several prefixes"):
        stats_replacement(load_checkpoint(tmp_path / "two.pt"), stats)


class Wrapped(nn.Module):
    """A model with a submodule named like a wrapper (``model``, ``module``, ``_orig_mod``) holding the
    BatchNorm the forward reaches, and a top-level ``bn`` it never reaches."""

    def __init__(self, inner: str) -> None:
        super().__init__()
        self.inner = inner
        self.bn = nn.BatchNorm1d(3)
        self.add_module(inner, nn.Sequential())
        getattr(self, inner).bn = nn.BatchNorm1d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.inner).bn(x)


@pytest.mark.parametrize("wrapper", ["model.", "module.", "_orig_mod."])
def test_statistics_named_like_a_wrapper_go_under_the_wrapper(tmp_path, wrapper):
    """A probe (17): statistics of ``model.bn`` alone, for a checkpoint saved under a wrapper of the same name
    (``model.bn.*`` is then the top-level ``bn``, ``model.model.bn.*`` the one measured), went into the
    top-level ``bn`` — the names as they are won the tie; the prefix every name carries wins it now."""
    import precisebn
    from precisebn.checkpoint import stats_replacement

    inner = wrapper[:-1]
    net = Wrapped(inner)
    stats = precisebn.estimate(net, [torch.randn(8, 3) for _ in range(2)])
    reached = precisebn.population.PopulationStats(
        {f"{inner}.bn": stats[f"{inner}.bn"]}, stats.samples, stats.batches, stats.mode
    )
    torch.save({f"{wrapper}{k}": v for k, v in net.state_dict().items()}, tmp_path / "w.pt")
    replace, prefix = stats_replacement(load_checkpoint(tmp_path / "w.pt"), reached)
    assert prefix == wrapper
    assert sorted(replace) == [f"{wrapper}{inner}.bn.running_mean", f"{wrapper}{inner}.bn.running_var"]


def test_a_floating_point_image_is_named_in_one_sentence(tmp_path):
    """Found by probe 34b: "... pass --transform a preprocessing that reads it.. Remove or replace the file"."""
    image = pytest.importorskip("PIL.Image")
    import numpy as np

    from precisebn.images import ImageFiles, image_batches

    image.fromarray(np.zeros((4, 4), dtype=np.float32), mode="F").save(tmp_path / "depth.tiff")
    files = ImageFiles(tmp_path, lambda im: torch.zeros(3, 4, 4))
    with pytest.raises(InvalidArgumentError, match=r"reads it\. Remove or replace the file") as raised:
        next(image_batches(files, 1))
    assert ".." not in str(raised.value)


def test_a_dangling_link_to_an_image_is_named_not_skipped(tmp_path):
    """Found by probe 34b: a symlink in --data whose image is gone was skipped silently, not listed with the
    unreadable images (an error, or skipped and named with --skip-bad-images)."""
    image = pytest.importorskip("PIL.Image")
    from precisebn.images import ImageFiles, image_batches

    for i in range(2):
        image.new("RGB", (4, 4), color=(i, i, i)).save(tmp_path / f"{i}.png")
    (tmp_path / "gone.png").symlink_to(tmp_path / "deleted.png")
    files = ImageFiles(tmp_path, lambda im: torch.zeros(3, 4, 4))
    assert [p.name for p in files.files] == ["0.png", "1.png", "gone.png"]
    with pytest.raises(InvalidArgumentError, match=r"cannot read image .*gone\.png"):
        list(image_batches(files, 3))


class _SharedLayer(nn.Module):
    """A BatchNorm registered under two names (``bn`` and ``head.0``): one tensor each in the state_dict."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Sequential(self.bn, nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv(x))


def test_applying_statistics_to_a_checkpoint_of_a_shared_layer_writes_every_name_of_it(tmp_path) -> None:
    """Probe 37: ``apply`` wrote a shared layer's new statistics under the name the statistics file gives it only;
    the checkpoint's other name for it (saved once, loaded as a view of the same storage) kept the old ones, and
    loading the written checkpoint read those last — exit 0, the model's statistics unchanged."""
    import precisebn
    from conftest import compute_truth, max_rel_error
    from precisebn.checkpoint import stats_replacement

    torch.manual_seed(0)
    model = _SharedLayer()
    sd = model.state_dict()
    assert {"bn.running_var", "head.0.running_var"} <= set(sd)
    torch.save(sd, tmp_path / "in.pt")
    batches = [torch.randn(4, 3, 8, 8) * 2 + 1 for _ in range(3)]
    truth = compute_truth(model, batches)["bn"]
    stats = precisebn.estimate(model, batches)
    assert list(stats) == ["bn"]
    ckpt = load_checkpoint(tmp_path / "in.pt")
    replace, _ = stats_replacement(ckpt, stats)
    save_checkpoint(ckpt, replace, tmp_path / "out.pt")
    loaded = _SharedLayer()
    loaded.load_state_dict(torch.load(tmp_path / "out.pt", weights_only=True))
    assert max_rel_error(loaded.bn.running_mean, truth.mean, truth.var.sqrt()) < 1e-6
    assert max_rel_error(loaded.bn.running_var, truth.var) < 1e-6


def test_a_write_that_fails_for_a_full_disk_names_the_file(tmp_path) -> None:
    """Found by a probe: a full disk or a file size limit reached at the file's last write (its close) raised an
    OSError without a file name, and the CLI said "File too large" without saying of what."""
    import resource

    from precisebn.checkpoint import write_checkpoint

    torch.save({"w": torch.randn(1000)}, tmp_path / "in.pt")  # (about 5 kB: written at the close)
    ckpt = load_checkpoint(tmp_path / "in.pt")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (3000, hard))  # (Python ignores SIGXFSZ: writes fail with EFBIG)
    try:
        with pytest.raises(OSError) as caught:
            write_checkpoint(ckpt, {}, tmp_path / "out.pt")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert caught.value.filename == str(tmp_path / "out.pt")
