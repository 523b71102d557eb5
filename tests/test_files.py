"""Atomic writes."""

from __future__ import annotations

import os
import stat

import pytest

from precisebn.files import atomic_path


def test_replaces_existing_file_in_one_step(tmp_path) -> None:
    target = tmp_path / "out.txt"
    target.write_text("old")
    with atomic_path(target) as tmp:
        tmp.write_text("new")
        assert target.read_text() == "old"
    assert target.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.txt"]


def test_failure_keeps_old_content_and_leaves_no_temporary(tmp_path) -> None:
    target = tmp_path / "out.txt"
    target.write_text("old")

    def interrupted_write() -> None:
        with atomic_path(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError):
        interrupted_write()
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.txt"]


def test_creates_parent_folders_and_normal_permissions(tmp_path) -> None:
    target = tmp_path / "a" / "b" / "c.json"
    with atomic_path(target) as tmp:
        tmp.write_text("{}")
    mode = stat.S_IMODE(os.stat(target).st_mode)
    umask = os.umask(0)
    os.umask(umask)
    assert mode == 0o666 & ~umask
