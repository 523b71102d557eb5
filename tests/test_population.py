"""PopulationStats: the mapping, the file format, and round trips."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import precisebn
from precisebn.errors import InvalidArgumentError, StatsMismatchError


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.Linear(5, 3), nn.BatchNorm1d(3), nn.BatchNorm1d(9))


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(6, 4, generator=g) for _ in range(3)]


def forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model[3](model[2](model[1](model[0](x))))  # layer "4" is never reached


def test_save_load_round_trip(tmp_path) -> None:
    stats = precisebn.estimate(net(), batches(), forward=forward)
    path = tmp_path / "stats.safetensors"
    stats.save(path)
    assert [p.name for p in tmp_path.iterdir()] == ["stats.safetensors"]  # no temporary file left
    loaded = precisebn.PopulationStats.load(path)
    assert list(loaded) == list(stats) == ["1", "3", "4"]
    for name in stats:
        a, b = stats[name], loaded[name]
        assert (a.count, a.calls, a.layer_type) == (b.count, b.calls, b.layer_type)
        assert torch.equal(a.mean, b.mean) or (a.count == 0 and b.mean.isnan().all())
        assert torch.equal(a.var, b.var) or (a.count == 0 and b.var.isnan().all())
    assert (loaded.samples, loaded.batches, loaded.mode, loaded.world_size) == (18, 3, "norm", 1)
    assert loaded.versions["torch"] == torch.__version__
    assert loaded.versions["precisebn"] == precisebn.__version__
    assert not loaded["4"].reached


def test_loaded_statistics_apply_like_recalibrate(tmp_path) -> None:
    a, b = net(), net()
    precisebn.estimate(a, batches(), forward=forward).save(tmp_path / "s.safetensors")
    precisebn.apply(a, precisebn.PopulationStats.load(tmp_path / "s.safetensors"))
    precisebn.recalibrate(b, batches(), forward=forward)
    for (k, v), w in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(v, w), k


def test_file_has_no_pickle_and_documented_keys(tmp_path) -> None:
    from safetensors import safe_open

    path = tmp_path / "s.safetensors"
    precisebn.estimate(net(), batches(), forward=forward).save(path)
    with safe_open(str(path), framework="pt") as f:
        fields = ("mean", "var", "se_mean", "se_var")
        assert set(f.keys()) == {f"{n}.{k}" for n in ("1", "3", "4") for k in fields}
        assert f.get_tensor("1.mean").dtype == torch.float64
        header = json.loads(f.metadata()["precisebn"])
    assert header["layers"]["1"] == {"count": 18, "calls": 3, "type": "BatchNorm1d", "path": "fast", "per_forward": 1}


def test_load_rejects_other_files(tmp_path) -> None:
    other = tmp_path / "weights.safetensors"
    save_file({"w": torch.zeros(2)}, str(other))
    with pytest.raises(InvalidArgumentError, match="not precisebn statistics"):
        precisebn.PopulationStats.load(other)
    newer = tmp_path / "newer.safetensors"  # (probe 34b: called "not precisebn statistics")
    save_file({"w": torch.zeros(2)}, str(newer), metadata={"format": "precisebn.population_stats/2"})
    with pytest.raises(InvalidArgumentError, match=r"holds precisebn statistics in format .*/2', which this version"):
        precisebn.PopulationStats.load(newer)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    with pytest.raises(InvalidArgumentError, match="cannot read"):
        precisebn.PopulationStats.load(junk)
    with pytest.raises(FileNotFoundError):
        precisebn.PopulationStats.load(tmp_path / "missing.safetensors")


def _damaged(tmp_path, tensors=None, **header_changes):
    """A saved statistics file with its tensors or header edited by hand — its checksum written again, as an editor
    who knows the format would (else the checksum refuses it first: see the test after the next)."""
    from safetensors import safe_open
    from safetensors.torch import save

    from precisebn.population import _digest

    good = tmp_path / "good.safetensors"
    precisebn.estimate(net(), batches(), forward=forward).save(good)
    with safe_open(str(good), "pt") as f:
        metadata, content = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    header = json.loads(metadata["precisebn"])
    for key, value in header_changes.items():
        if key.startswith("layer_"):
            header["layers"]["1"][key.removeprefix("layer_")] = value
        else:
            header[key] = value
    content.update(tensors or {})
    bad = tmp_path / "bad.safetensors"
    text = json.dumps(header)
    bad.write_bytes(save(content, metadata={**metadata, "precisebn": text, "sha256": _digest(text, content)}))
    return bad


DAMAGE = {
    "negative variance": ({"1.var": -torch.ones(5, dtype=torch.float64)}, {}, "negative variances"),
    "NaN variance": ({"1.var": torch.full((5,), float("nan"), dtype=torch.float64)}, {}, "NaN/Inf"),
    "Inf mean": ({"1.mean": torch.full((5,), float("inf"), dtype=torch.float64)}, {}, "NaN/Inf"),
    "integer mean": ({"1.mean": torch.zeros(5, dtype=torch.int64)}, {}, "not floating point"),
    "standard error of another shape": ({"1.se_var": torch.ones(7, dtype=torch.float64)}, {}, "se_var has shape"),
    "negative count": ({}, {"layer_count": -5}, "count is -5"),
    "fractional count": ({}, {"layer_count": 3.7}, "count is 3.7"),
    "count of 401 digits": ({}, {"layer_count": 10**400}, "count has 401 digits"),  # (was a raw OverflowError later)
    "unknown path": ({}, {"layer_path": "banana"}, "path is 'banana'"),
    "unknown mode": ({}, {"mode": "banana"}, "mode is 'banana'"),
    "no world size": ({}, {"world_size": 0}, "world_size is 0"),
    "NaN seconds": ({}, {"seconds": float("nan")}, "seconds is nan"),
}


@pytest.mark.parametrize("case", DAMAGE)
def test_a_damaged_file_is_refused_by_name(tmp_path, case) -> None:
    """Found by a hostile probe: negative, NaN and Inf variances, negative or fractional counts, unknown
    modes... loaded without a word, and the CLI's apply then wrote them into a checkpoint (exit 0)."""
    tensors, header, phrase = DAMAGE[case]
    bad = _damaged(tmp_path, tensors, **header)
    with pytest.raises((StatsMismatchError, InvalidArgumentError), match=phrase) as raised:
        precisebn.PopulationStats.load(bad)
    assert str(bad) in str(raised.value)


@pytest.mark.parametrize("damage", ["a flipped bit", "a layer taken out of the header", "no checksum"])
def test_a_file_that_does_not_match_its_checksum_is_refused(tmp_path, damage: str) -> None:
    """Probe 37: of 200 single-bit flips in a statistics file's values, 196 loaded silently (wrong statistics,
    applied), and a layer taken out of the header loaded one layer short. The file carries the sha256 of its
    header and tensors, checked on load; a file without one (written before) loads as before."""
    from safetensors import safe_open
    from safetensors.torch import save

    stats = precisebn.estimate(net(), batches(), forward=forward)
    good = tmp_path / "good.safetensors"
    stats.save(good)
    assert precisebn.PopulationStats.load(good) == stats
    with safe_open(str(good), "pt") as f:
        metadata, content = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    bad = tmp_path / "bad.safetensors"
    if damage == "a flipped bit":
        raw = bytearray(good.read_bytes())
        at = raw.index(content["1.var"][2].numpy().tobytes())  # (a value of layer '1''s variance)
        raw[at + 3] ^= 0x10
        bad.write_bytes(bytes(raw))
        with safe_open(str(bad), "pt") as f:
            assert not torch.equal(f.get_tensor("1.var"), content["1.var"])  # (the flip is in the values)
    elif damage == "a layer taken out of the header":
        header = json.loads(metadata["precisebn"])
        del header["layers"][next(iter(header["layers"]))]
        bad.write_bytes(save(content, metadata={**metadata, "precisebn": json.dumps(header)}))
    else:
        del metadata["sha256"]
        bad.write_bytes(save(content, metadata=metadata))
        assert precisebn.PopulationStats.load(bad) == stats
        return
    with pytest.raises(StatsMismatchError, match="do not match the checksum written with them"):
        precisebn.PopulationStats.load(bad)


def test_merged_statistics_of_both_paths_load_again(tmp_path) -> None:
    """Found by a regression probe: a merge of capture="auto" and capture="float64" statistics (path "mixed")
    saved, but the stricter load refused it."""
    merged = precisebn.estimate(net(), batches(), forward=forward).merge(
        precisebn.estimate(net(), batches(), forward=forward, capture="float64")
    )
    assert "mixed" in {s.path for s in merged.values()}
    merged.save(tmp_path / "m.safetensors")
    loaded = precisebn.PopulationStats.load(tmp_path / "m.safetensors")
    assert {k: s.path for k, s in loaded.items()} == {k: s.path for k, s in merged.items()}


def test_failed_save_leaves_no_file(tmp_path, monkeypatch) -> None:
    import safetensors.torch

    def broken(tensors, metadata=None):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save", broken)
    stats = precisebn.estimate(net(), batches(), forward=forward)
    with pytest.raises(OSError, match="disk full"):
        stats.save(tmp_path / "s.safetensors")
    assert list(tmp_path.iterdir()) == []


def test_mapping_and_repr() -> None:
    stats = precisebn.estimate(net(), batches(), forward=forward)
    assert len(stats) == 3 and "1" in stats
    assert "3 layers" in repr(stats)
    assert stats.to("cpu")["1"].mean.device.type == "cpu"
    assert stats.to(torch.device("cpu"))["1"].mean.dtype == torch.float64
    with pytest.raises(InvalidArgumentError, match=r"takes a device, got the dtype torch\.float16"):
        stats.to(torch.float16)  # probe 41: rounded the statistics to float16, silently


def test_saved_file_has_normal_permissions(tmp_path) -> None:
    import os
    import stat

    precisebn.estimate(net(), batches(), forward=forward).save(tmp_path / "s.safetensors")
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(os.stat(tmp_path / "s.safetensors").st_mode) == 0o666 & ~umask


def test_save_refuses_an_extension_it_does_not_honour(tmp_path) -> None:
    stats = precisebn.estimate(net(), batches(), forward=forward)
    for name in ("stats.pt", "stats.pth", "stats"):
        with pytest.raises(InvalidArgumentError, match=r"\*\.safetensors"):
            stats.save(tmp_path / name)
    assert list(tmp_path.iterdir()) == []
    stats.save(tmp_path / "stats.bin", format="safetensors")
    assert precisebn.PopulationStats.load(tmp_path / "stats.bin").samples == stats.samples
    with pytest.raises(InvalidArgumentError, match="only format"):
        stats.save(tmp_path / "s.safetensors", format="torch")


def test_state_dict_names_reached_layers_with_a_prefix() -> None:
    model = net()
    stats = precisebn.estimate(model, batches(), forward=forward)
    sd = stats.state_dict(prefix="module.")
    assert list(sd) == [f"module.{n}.running_{b}" for n in ("1", "3") for b in ("mean", "var")]  # "4" never ran
    x = torch.cat(batches()).double()
    first = model[0].double()(x)  # the first layer's inputs, computed here
    torch.testing.assert_close(sd["module.1.running_mean"], first.mean(0))
    torch.testing.assert_close(sd["module.1.running_var"], first.var(0, unbiased=False))
    target = net()
    target.load_state_dict(stats.state_dict(), strict=False)
    assert torch.allclose(target[1].running_mean, first.mean(0).float())


@pytest.mark.parametrize(("mean", "var"), [(torch.zeros(3), torch.ones(4)), (torch.tensor(0.0), torch.tensor(1.0))])
def test_load_refuses_mean_and_var_that_do_not_pair(tmp_path, mean, var) -> None:
    good = tmp_path / "good.safetensors"
    precisebn.estimate(net(), batches(), forward=forward).save(good)
    from safetensors import safe_open

    with safe_open(str(good), framework="pt") as f:
        metadata = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    tensors["1.mean"], tensors["1.var"] = mean.double(), var.double()
    from precisebn.population import _digest  # (the checksum written again: the pairing check is tested)

    metadata["sha256"] = _digest(metadata["precisebn"], tensors)
    save_file(tensors, str(tmp_path / "bad.safetensors"), metadata=metadata)
    with pytest.raises(StatsMismatchError, match=r"layer '1' of .*bad\.safetensors"):
        precisebn.PopulationStats.load(tmp_path / "bad.safetensors")


@pytest.mark.parametrize("name", ["x.safetensors/", "folder"])
def test_saving_to_a_folder_says_so(tmp_path, name: str) -> None:
    """Probe 37: ``save("x.safetensors/")`` said the name "does not say safetensors"."""
    (tmp_path / "folder").mkdir()
    stats = precisebn.estimate(net(), batches(), forward=forward)
    with pytest.raises(InvalidArgumentError, match="names a folder"):
        stats.save(tmp_path / name if name == "folder" else f"{tmp_path}/{name}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder"]
