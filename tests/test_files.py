"""Atomic writes."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from precisebn import files
from precisebn.errors import ConcurrentUseError, InvalidArgumentError, NotWritableError
from precisebn.files import OutputPlan, atomic_path, real_path


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


def _names(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def _write_both(plan: OutputPlan, then: Callable[[], object] = lambda: None) -> None:
    """Stages "new a" and "new b" for the plan's outputs "a" and "b", calls ``then``, and commits."""
    with plan.staged() as tmp:
        tmp["a"].write_text("new a")
        tmp["b"].write_text("new b")
        then()


def _over_old_files(tmp_path: Path) -> OutputPlan:
    """A plan whose outputs "a" and "b" replace a.txt and b.txt, which hold "old a.txt" and "old b.txt"."""
    plan = OutputPlan()
    for label in ("a", "b"):
        (tmp_path / f"{label}.txt").write_text(f"old {label}.txt")
        plan.add(label, tmp_path / f"{label}.txt")
    return plan


def test_real_path_follows_links_and_dotdot_of_missing_folders(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model.pt").write_text("x")
    (tmp_path / "link.pt").symlink_to(tmp_path / "model.pt")
    expected = os.path.join(os.path.realpath(tmp_path), "model.pt")
    for spelling in ("model.pt", "newdir/../model.pt", "a/b/../../link.pt", str(tmp_path / "link.pt")):
        assert str(real_path(spelling)) == expected, spelling


def test_plan_refuses_inputs_duplicates_and_folders_before_creating_anything(tmp_path) -> None:
    (tmp_path / "in.pt").write_text("input")
    (tmp_path / "folder").mkdir()
    plan = OutputPlan({"CHECKPOINT": tmp_path / "in.pt"})
    with pytest.raises(InvalidArgumentError, match="is the input CHECKPOINT"):
        plan.add("--out", tmp_path / "missing" / ".." / "in.pt")
    plan.add("--out", tmp_path / "out.pt")
    with pytest.raises(InvalidArgumentError, match="is the same file as --out"):
        plan.add("--report", tmp_path / "sub" / ".." / "out.pt")
    with pytest.raises(InvalidArgumentError, match="is a folder"):
        plan.add("--report", tmp_path / "folder")
    with pytest.raises(InvalidArgumentError, match="is a file, not a folder"):
        plan.add("--report", tmp_path / "in.pt" / "r.json")
    assert _names(tmp_path) == ["folder", "in.pt"]
    assert plan.add("--out2", tmp_path / "in.pt", replaces="CHECKPOINT") == real_path(tmp_path / "in.pt")


def test_existing_permissions_kept_and_symlinks_written_through(tmp_path) -> None:
    target = tmp_path / "secret.json"
    target.write_text("old")
    target.chmod(0o600)
    with atomic_path(target) as tmp:
        tmp.write_text("new")
    assert stat.S_IMODE(target.stat().st_mode) == 0o600 and target.read_text() == "new"
    link = tmp_path / "link.json"
    link.symlink_to(target)
    with atomic_path(link) as tmp:
        tmp.write_text("through")
    assert link.is_symlink() and target.read_text() == "through"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert _names(tmp_path) == ["link.json", "secret.json"]


def test_all_or_none_when_a_commit_fails(tmp_path, monkeypatch) -> None:
    import precisebn.files as files

    (tmp_path / "a.txt").write_text("old a")
    plan = OutputPlan()
    plan.add("a", tmp_path / "a.txt")
    plan.add("b", tmp_path / "b.txt")
    real_replace, calls = os.replace, []

    def failing_second(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(28, "No space left on device", str(dst))
        real_replace(src, dst)

    monkeypatch.setattr(files.os, "replace", failing_second)
    with pytest.raises(OSError, match="No space"):
        _write_both(plan)
    monkeypatch.setattr(files.os, "replace", real_replace)
    assert (tmp_path / "a.txt").read_text() == "old a"  # put back
    assert _names(tmp_path) == ["a.txt"]


def test_a_failed_commit_never_deletes_an_existing_file_without_hard_links(tmp_path, monkeypatch) -> None:
    """Found by a hostile probe: where the old file's backup hard link could not be made (a file system
    without hard links, a file at its link limit), a later failure's rollback deleted the existing output.
    The error named the hidden temporary file, not the output."""
    import precisebn.files as files

    (tmp_path / "a.txt").write_text("old a")
    (tmp_path / "b.txt").mkdir()
    (tmp_path / "b.txt" / "x").write_text("")  # the second output is a non-empty folder by the time of the commit
    plan = OutputPlan()
    plan.add("a", tmp_path / "a.txt")
    plan.add("b", tmp_path / "c.txt")

    def no_links(src, dst):
        raise OSError(31, "Too many links")

    monkeypatch.setattr(files.os, "link", no_links)
    plan.outputs["b"] = (plan.outputs["b"][0], tmp_path / "b.txt")  # (after the plan's own checks)

    with pytest.raises(OSError, match=r"b\.txt"):
        _write_both(plan)
    assert (tmp_path / "a.txt").read_text() == "old a"  # put back from a copy
    assert _names(tmp_path) == ["a.txt", "b.txt"]


def test_interrupt_leaves_no_temporary_and_removes_created_folders(tmp_path) -> None:
    plan = OutputPlan()
    plan.add("out", tmp_path / "new" / "deeper" / "out.txt")

    def interrupted() -> None:
        with plan.staged() as tmp:
            tmp["out"].write_text("half")
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        interrupted()
    assert _names(tmp_path) == []


def test_an_interrupt_while_the_old_content_is_removed_leaves_the_output_committed(tmp_path, monkeypatch) -> None:
    """Found by probe 34b: with --in-place, removing the backup of the replaced file frees a whole old checkpoint;
    a Ctrl-C then escaped the commit before it was marked done — exit 130 and "no output was written" for a file
    that had been replaced. The commit is marked once the last output is in place, and every backup is still
    removed."""

    plan = _over_old_files(tmp_path)
    unlink = Path.unlink

    def slow_unlink(self: Path, missing_ok: bool = False) -> None:
        unlink(self, missing_ok)
        if self.name.endswith(".old.tmp"):  # (the interrupt lands as the first backup's removal returns)
            monkeypatch.setattr(Path, "unlink", unlink)
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _write_both(plan, then=lambda: monkeypatch.setattr(Path, "unlink", slow_unlink))
    assert plan.committed
    assert (tmp_path / "a.txt").read_text() == "new a" and (tmp_path / "b.txt").read_text() == "new b"
    assert _names(tmp_path) == ["a.txt", "b.txt"]  # (both backups gone, no temporary left)


def test_a_ctrl_c_during_the_rollback_still_puts_every_old_content_back(tmp_path, monkeypatch) -> None:
    """Found by probe 35a: a second Ctrl-C while a failed commit was rolled back stopped the rollback half-way, and
    the backups it had not put back were deleted — a checkpoint replaced in place kept its new content, its old
    content gone, and the CLI said "no output was written". Ctrl-C waits until the commit or its rollback is done."""
    from precisebn import files

    plan = _over_old_files(tmp_path)
    real_replace = os.replace

    def replace(src, dst) -> None:
        if str(dst).endswith("b.txt"):
            raise OSError(28, "No space left on device", str(src))  # the second output fails: a rollback
        if str(src).endswith(".old.tmp"):  # the rollback putting a.txt back: Ctrl-C, a real SIGINT
            os.kill(os.getpid(), signal.SIGINT)
        real_replace(src, dst)

    monkeypatch.setattr(files.os, "replace", replace)

    with pytest.raises(OSError, match="No space left"):  # (the Ctrl-C held back: the rollback ran to its end)
        _write_both(plan)
    assert not plan.committed
    assert (tmp_path / "a.txt").read_text() == "old a.txt" and (tmp_path / "b.txt").read_text() == "old b.txt"
    assert _names(tmp_path) == ["a.txt", "b.txt"]


SIGTERM_SCRIPT = """
import sys, time
from pathlib import Path
from precisebn.files import OutputPlan
plan = OutputPlan()
plan.add("a", sys.argv[1])
plan.add("b", sys.argv[2])
with plan.staged() as tmp:
    tmp["a"].write_text("new")
    print("staged", flush=True)
    time.sleep(60)
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_sigterm_removes_temporaries_and_ends_the_process(tmp_path, signum: int) -> None:
    """SIGHUP (a closed terminal or ssh session) too: it left the temporaries, a partial checkpoint (a probe)."""
    (tmp_path / "a.txt").write_text("old")
    proc = subprocess.Popen(
        [sys.executable, "-c", SIGTERM_SCRIPT, str(tmp_path / "a.txt"), str(tmp_path / "b.txt")],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "staged"
    assert any(".precisebn-" in n for n in _names(tmp_path))
    proc.send_signal(signum)
    assert proc.wait(timeout=60) == -signum  # still killed by the signal, as without precisebn
    assert _names(tmp_path) == ["a.txt"] and (tmp_path / "a.txt").read_text() == "old"


TWO_OUTPUTS_SCRIPT = """
import os, signal, sys
from precisebn import files
real_replace = os.replace
def replace(src, dst):
{body}
files.os.replace = replace
plan = files.OutputPlan()
plan.add("a", sys.argv[1])
plan.add("b", sys.argv[2])
with plan.staged() as tmp:
    tmp["a"].write_text("new a")
    tmp["b"].write_text("new b")
"""


def _two_outputs(tmp_path: Path, replace_body: str) -> subprocess.CompletedProcess[str]:
    """Stages "new a" and "new b" for a.txt and b.txt in a subprocess whose ``os.replace`` runs ``replace_body``."""
    script = TWO_OUTPUTS_SCRIPT.format(body=replace_body)
    return subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "a.txt"), str(tmp_path / "b.txt")],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_sigterm_during_the_rollback_still_puts_every_old_content_back(tmp_path) -> None:
    """Left by probe 35a, the SIGTERM twin of the Ctrl-C case above: a SIGTERM while a failed commit was rolled
    back stopped the rollback half-way, and the backups not yet put back were deleted (a.txt kept its new
    content). It waits until the rollback is done, and then still ends the process."""
    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_text(f"old {name}")
    proc = _two_outputs(
        tmp_path,
        """    if str(dst).endswith("b.txt"):
        raise OSError(28, "No space left on device", str(src))  # the second output fails: a rollback
    if str(src).endswith(".old.tmp"):  # the rollback putting a.txt back: a real SIGTERM
        os.kill(os.getpid(), signal.SIGTERM)
    real_replace(src, dst)""",
    )
    assert proc.returncode == -signal.SIGTERM, proc.stderr
    assert (tmp_path / "a.txt").read_text() == "old a.txt" and (tmp_path / "b.txt").read_text() == "old b.txt"
    assert _names(tmp_path) == ["a.txt", "b.txt"]


def test_a_sigterm_as_the_outputs_are_committed_says_they_are_complete(tmp_path) -> None:
    """Found by a probe: a job scheduler's SIGTERM just as the outputs were committed ended the command without a
    word (exit -15), the checkpoint replaced."""
    proc = _two_outputs(
        tmp_path,
        """    real_replace(src, dst)
    if str(dst).endswith("b.txt"):  # the last rename done: a SIGTERM (held until the commit is over)
        os.kill(os.getpid(), signal.SIGTERM)""",
    )
    assert proc.returncode == -signal.SIGTERM, proc.stderr
    assert "ended by a signal after every output was written" in proc.stderr and "complete" in proc.stderr
    assert (tmp_path / "a.txt").read_text() == "new a" and (tmp_path / "b.txt").read_text() == "new b"
    assert _names(tmp_path) == ["a.txt", "b.txt"]


def _dead_pid() -> int:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    return dead.pid


def test_stale_temporaries_of_killed_runs_are_removed(tmp_path) -> None:
    dead, mark = _dead_pid(), files._machine_mark()
    stale = tmp_path / f".out.pt.precisebn-{mark}-{dead}-0123abcd.tmp"
    backup = tmp_path / f".out.pt.precisebn-{mark}-{dead}-0123abcd.old.tmp"  # a killed commit's copy of the old file
    alive = tmp_path / f".out.pt.precisebn-{mark}-{os.getppid()}-0123abcd.tmp"  # a running process: kept
    other = tmp_path / f".other.pt.precisebn-{mark}-{dead}-0123abcd.tmp"
    impossible = tmp_path / f".out.pt.precisebn-{mark}-99999999999999999999-ab.tmp"  # (OverflowError before)
    for p in (stale, backup, alive, other, impossible):
        p.write_text("left by a SIGKILL")
    with atomic_path(tmp_path / "out.pt") as tmp:
        assert tmp.name.startswith(f".out.pt.precisebn-{mark}-{os.getpid()}-")
        tmp.write_text("new")
    assert _names(tmp_path) == sorted([alive.name, other.name, "out.pt"])


def test_temporaries_of_another_machine_or_of_an_older_version_are_not_taken_for_stale(tmp_path) -> None:
    """Found by a probe: a run in another container (or on another host of an NFS folder) writing the same output
    had its live temporary removed, its process id being "gone" here — and failed, its work lost. A temporary of
    another machine's mark is never removed; one without a mark (written before marks, by any machine) only once
    it has been left untouched for a day."""
    dead, mark = _dead_pid(), files._machine_mark()
    assert len(mark) == 8 and mark == files._machine_mark()
    foreign = "0" * 8 if mark != "0" * 8 else "1" * 8
    elsewhere = tmp_path / f".out.pt.precisebn-{foreign}-{dead}-0123abcd.tmp"  # another host's, being written
    elsewhere_backup = tmp_path / f".out.pt.precisebn-{foreign}-{dead}-0123abcd.old.tmp"
    unmarked = tmp_path / f".out.pt.precisebn-{dead}-0123abcd.tmp"  # an older precisebn's, being written
    abandoned = tmp_path / f".out.pt.precisebn-{dead}-4567abcd.tmp"  # an older precisebn's, killed two days ago
    for p in (elsewhere, elsewhere_backup, unmarked, abandoned):
        p.write_text("work in progress")
    two_days_ago = os.stat(abandoned).st_mtime - 2 * 24 * 3600
    os.utime(abandoned, (two_days_ago, two_days_ago))
    with atomic_path(tmp_path / "out.pt") as tmp:
        tmp.write_text("new")
    assert _names(tmp_path) == sorted([elsewhere.name, elsewhere_backup.name, unmarked.name, "out.pt"])
    assert all(p.read_text() == "work in progress" for p in (elsewhere, elsewhere_backup, unmarked))


@pytest.mark.parametrize("when", ["before the block ends", "as the writer reads it back", "as it is renamed"])
def test_a_temporary_that_another_process_removes_is_said_to_have_disappeared(tmp_path, monkeypatch, when) -> None:
    """Found by a probe: a run whose temporary another process removed (an older precisebn elsewhere) failed with
    "checkpoint '.../.out.pt.precisebn-...tmp' does not exist; check the path", a file the user never named."""
    (tmp_path / "b.txt").write_text("old b")
    plan = OutputPlan()
    plan.add("--out", tmp_path / "out.pt")
    plan.add("--report", tmp_path / "b.txt")
    if when == "as it is renamed":  # (gone after the check that follows the block: at the commit)
        real_chmod = os.chmod

        def chmod(path, mode, **kwargs):
            if Path(path).name.startswith(".out.pt."):
                os.unlink(path)
            return real_chmod(path, mode, **kwargs)

        monkeypatch.setattr(files.os, "chmod", chmod)

    def write() -> None:
        with plan.staged() as tmp:
            tmp["--report"].write_text("new b")
            tmp["--out"].write_text("checkpoint")
            if when != "as it is renamed":
                os.unlink(tmp["--out"])  # (as another process does)
            if when == "as the writer reads it back":
                tmp["--out"].read_text()

    with pytest.raises(ConcurrentUseError) as caught:
        write()
    message = str(caught.value)
    assert message.startswith(f"--out {str(tmp_path / 'out.pt')!r}: the temporary file '.out.pt.precisebn-")
    assert "disappeared before it could be renamed into place; another process removed it" in message
    assert "Nothing was written" in message and "then run again" in message
    assert isinstance(caught.value, RuntimeError)
    assert _names(tmp_path) == ["b.txt"] and (tmp_path / "b.txt").read_text() == "old b"


def test_population_save_and_report_to_json_keep_permissions(tmp_path) -> None:
    import torch

    import precisebn

    model = torch.nn.Sequential(torch.nn.BatchNorm1d(3))
    stats = precisebn.estimate(model, [torch.randn(4, 3)])
    for path, write in (
        (tmp_path / "s.safetensors", stats.save),
        (tmp_path / "r.json", precisebn.apply(model, stats).to_json),
    ):
        path.write_text("old")
        path.chmod(0o600)
        link = path.with_name("link-" + path.name)
        link.symlink_to(path)
        write(link)
        assert link.is_symlink() and path.read_bytes() != b"old" and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert not [n for n in _names(tmp_path) if n.endswith(".tmp")]


def test_dotdot_after_a_symlinked_folder_is_where_the_link_points(tmp_path, monkeypatch) -> None:
    # link -> sub/deep, so for the system link/../f.pt is sub/f.pt (as for open, cp, torch.load), not ./f.pt
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub" / "deep").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "sub" / "deep")
    (tmp_path / "sub" / "f.pt").write_text("input")
    (tmp_path / "f.pt").write_text("unrelated")
    assert real_path("link/../f.pt") == real_path("sub/f.pt") != real_path("f.pt")
    plan = OutputPlan({"CHECKPOINT": "sub/f.pt"})
    with pytest.raises(InvalidArgumentError, match="is the input CHECKPOINT"):
        plan.add("--out", "link/../f.pt")
    with atomic_path("link/../g.pt") as tmp:
        tmp.write_text("new")
    assert (tmp_path / "sub" / "g.pt").read_text() == "new" and not (tmp_path / "g.pt").exists()


def test_a_rename_that_fails_leaves_no_copy_of_the_old_file(tmp_path, monkeypatch) -> None:
    import precisebn.files as files

    (tmp_path / "a.txt").write_text("old a")
    real_replace = os.replace

    def refused(src, dst):
        raise PermissionError(1, "Operation not permitted", str(dst))

    monkeypatch.setattr(files.os, "replace", refused)
    with pytest.raises(PermissionError), atomic_path(tmp_path / "a.txt") as tmp:
        tmp.write_text("new a")
    monkeypatch.setattr(files.os, "replace", real_replace)
    assert _names(tmp_path) == ["a.txt"] and (tmp_path / "a.txt").read_text() == "old a"


@pytest.mark.parametrize("umask", [0o022, 0o277])
def test_the_temporary_file_stays_writable_until_it_is_committed(tmp_path, umask) -> None:
    # (as root the bits do not stop the writer, so the test reads them)
    target = tmp_path / "read-only.txt"
    target.write_text("old")
    target.chmod(0o444)
    old = os.umask(umask)
    try:
        with atomic_path(target) as tmp:
            assert os.stat(tmp).st_mode & stat.S_IWUSR  # the writer may reopen it by name
            tmp.write_text("new")
        with atomic_path(tmp_path / "new.txt") as tmp:
            assert os.stat(tmp).st_mode & stat.S_IWUSR
            tmp.write_text("new")
    finally:
        os.umask(old)
    assert target.read_text() == "new" and stat.S_IMODE(target.stat().st_mode) == 0o444


@pytest.mark.parametrize("length", [243, 255])
def test_the_longest_file_names_are_written_and_their_stale_temporaries_removed(tmp_path, length: int) -> None:
    """Found by a probe: a legal 243-byte name was accepted up front, then failed at the write ("File name too
    long"), after all the work, as its temporary added about 30 bytes: the temporaries now take a shortened name."""
    name = "é" * ((length - 3) // 2) + "a" * ((length - 3) % 2) + ".pt"  # (2-byte characters: cut by bytes)
    assert len(os.fsencode(name)) == length
    target = tmp_path / name
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with atomic_path(target) as tmp:
        assert len(os.fsencode(tmp.name)) + len(".old") <= 255
        stale = tmp.with_name(tmp.name.replace(f"-{os.getpid()}-", f"-{dead.pid}-"))
        tmp.write_text("first")
    stale.write_text("left by a SIGKILL")
    with atomic_path(target) as tmp:  # (replacing the first: with a backup, .old.tmp)
        tmp.write_text("second")
    assert _names(tmp_path) == [name]
    assert target.read_text() == "second"


def test_a_file_name_longer_than_a_file_name_can_be_is_refused_up_front(tmp_path) -> None:
    plan = OutputPlan()
    with pytest.raises(InvalidArgumentError, match=r"--out '.*': its file name is 256 bytes long, more than the 255"):
        plan.add("--out", tmp_path / ("a" * 253 + ".pt"))
    assert _names(tmp_path) == []


def test_an_error_on_a_temporary_names_its_own_output_when_long_names_share_a_prefix(tmp_path) -> None:
    """Found by a probe: two long output names whose shortened temporaries share a prefix — an error writing the
    second's temporary was reported under the first's name."""
    import errno

    base = "r" * 235
    plan = OutputPlan()
    plan.add("--out", tmp_path / f"{base}_A.pt")
    plan.add("--report", tmp_path / f"{base}_B.json")
    with pytest.raises(OSError, match="No space left") as caught, plan.staged() as temps:
        raise OSError(errno.ENOSPC, "No space left on device", str(temps["--report"]))
    assert caught.value.filename == str(tmp_path / f"{base}_B.json")
    assert _names(tmp_path) == []


def test_a_folder_that_refuses_removals_reports_the_error_that_stopped_the_writes(tmp_path, monkeypatch) -> None:
    """Found by a probe (an append-only folder, chattr +a): the failed rename's error was replaced by the first
    temporary file's failed removal, naming a hidden .tmp, and the other temporaries were not removed."""
    plan = OutputPlan()
    plan.add("a", tmp_path / "a.txt")
    plan.add("b", tmp_path / "b.txt")
    (tmp_path / "b.txt").write_text("old b")
    real_replace, real_unlink = os.replace, Path.unlink

    def refused_replace(src, dst) -> None:
        if str(dst).endswith("b.txt"):
            raise PermissionError(1, "Operation not permitted", str(src))
        real_replace(src, dst)

    def refused_unlink(self: Path, missing_ok: bool = False) -> None:
        if self.name.startswith(".a.txt"):  # (the first output's temporary: refused, as the folder would)
            raise PermissionError(1, "Operation not permitted", str(self))
        real_unlink(self, missing_ok)

    monkeypatch.setattr(os, "replace", refused_replace)
    monkeypatch.setattr(Path, "unlink", refused_unlink)
    with pytest.raises(PermissionError) as caught:
        _write_both(plan)
    assert caught.value.filename == str(tmp_path / "b.txt")  # the output that could not be written, by its name
    monkeypatch.undo()
    assert (tmp_path / "b.txt").read_text() == "old b" and not (tmp_path / "a.txt").exists()
    assert [n for n in _names(tmp_path) if n.startswith(".b.txt")] == []  # (the other temporaries: removed)


def test_atomic_path_names_the_output_only_for_a_failed_write(tmp_path) -> None:
    """The review of probe 41: naming the file asked for in every OSError of the block (the fix for a full disk's
    error of no file) renamed the block's own errors too — a ConnectionResetError named the output, and
    io.UnsupportedOperation stopped being a ValueError. Only a failed write (no space, too large, I/O) is renamed."""
    import errno
    import io

    def full(raised: BaseException) -> None:
        with atomic_path(tmp_path / "out.json") as tmp:
            tmp.write_text("half")
            raise raised

    for raised in (OSError("network down"), ConnectionResetError(104, "reset"), io.UnsupportedOperation("seek")):
        with pytest.raises(type(raised)) as caught:
            full(raised)
        assert caught.value is raised
    with pytest.raises(OSError) as caught:
        full(OSError(errno.ENOSPC, "No space left on device"))
    assert caught.value.filename == str(tmp_path / "out.json") and caught.value.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []


def test_an_unwritable_folder_is_a_permission_error_before_anything_is_written(tmp_path, monkeypatch) -> None:
    """Code that writes files catches ``OSError``/``PermissionError``: a folder this process may not write is one
    (and still an ``InvalidArgumentError``, the CLI's usage error) — found up front, nothing created. (As root every
    folder is writable, so the check is made to answer no.)"""
    import torch

    import precisebn

    folder = tmp_path / "ro"
    folder.mkdir()
    target = folder / "stats.safetensors"
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == folder else real_access(p, mode))
    stats = precisebn.estimate(torch.nn.BatchNorm1d(3), [torch.randn(4, 3)], num_batches=1)
    with pytest.raises(PermissionError, match="is not writable") as caught:
        stats.save(target)
    assert isinstance(caught.value, NotWritableError) and isinstance(caught.value, InvalidArgumentError)
    assert list(folder.iterdir()) == []
