"""Writing files safely: every output planned before any work, staged, then committed together.

* **Planned.** :class:`OutputPlan` resolves each output to its real absolute path —
  following symlinks and ``..``, whether or not its folder exists yet — and refuses
  one that is an input, another output, a folder, or under a folder that cannot be
  written, before anything is computed.
* **Staged.** :meth:`OutputPlan.staged` gives a temporary file next to each target
  (``.NAME.precisebn-MARK-PID-RANDOM.tmp``, in the target's own folder; ``MARK`` names
  the machine and PID namespace of process ``PID``); the work writes there. One that
  disappears before it is renamed (another process removed it) is a
  :class:`~precisebn.errors.ConcurrentUseError` that says so.
* **Committed together.** When the block ends without error, every temporary file is
  renamed onto its target (``os.replace``); if one rename fails, the targets already
  replaced get their old content back. On any error, ``SIGINT`` (Ctrl-C), ``SIGTERM``
  or ``SIGHUP`` (a closed terminal), every temporary file is removed and the targets are
  left as they were; ``SIGTERM`` or ``SIGHUP`` then ends the process as it would have.
* **Permissions and links.** A replaced file keeps its permission bits (a new one gets
  ``0666 & ~umask``). A symlink is written *through*: its target gets the new content
  and the link stays a link.

``SIGKILL`` cannot be caught: a killed run may leave ``.NAME.precisebn-MARK-PID-*.tmp``
files; the next write to the same target from the same machine and PID namespace (the
same ``MARK``) removes those whose process is gone. Those of another ``MARK`` (another
host sharing the folder, another container) are left alone: their process cannot be
seen from here. Those without a mark (``.NAME.precisebn-PID-*.tmp``, written by versions
before it) are removed when their process is gone here *and* they were last modified a
day ago or more.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import secrets
import shutil
import signal
import socket
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import FrameType

from .errors import ConcurrentUseError, InvalidArgumentError, NotWritableError

__all__ = ["OutputPlan", "Terminated", "atomic_path", "real_path"]

_UMASK = os.umask(0)
os.umask(_UMASK)
_MARK = ".precisebn-"
_NAME_MAX = 255  # bytes in a file name: the limit of ext4, xfs, btrfs, tmpfs, APFS and NTFS (UTF-16 units there)
# what a temporary adds after its prefix: the machine's mark, a process id, a token, the suffix
_OWN = 8 + 1 + 7 + 1 + 8 + len(".old.tmp")
_UNMARKED_AGE = 24 * 3600  # seconds untouched after which a temporary without a mark is taken as left by a kill


def _machine_mark() -> str:
    """Eight hex digits naming this machine and PID namespace: a hash of the host name, ``/etc/machine-id`` and
    ``/proc/self/ns/pid`` (those that can be read). A temporary's process id means something only where its mark
    is this one: another host writing to the same NFS folder, or another container, has process ids that
    ``os.kill`` cannot see from here (probe 45: such a run's live temporary was removed as "stale", and its
    work lost)."""
    parts = [socket.gethostname()]
    for read in (lambda: Path("/etc/machine-id").read_text().strip(), lambda: os.readlink("/proc/self/ns/pid")):
        try:
            parts.append(read())
        except (OSError, ValueError):  # (no such file: macOS, Windows, a container without it)
            parts.append("")
    return hashlib.sha256("\0".join(parts).encode("utf-8", "surrogateescape")).hexdigest()[:8]


def _prefix(target: Path) -> str:
    """``.NAME.precisebn-``, the start of ``target``'s temporaries, ``NAME`` cut short where a temporary would be
    longer than a file name can be (a legal 243-byte name failed at the write, after all the work)."""
    name = target.name
    while name and len(os.fsencode(f".{name}{_MARK}")) + _OWN > _NAME_MAX:
        name = name[:-1]
    return f".{name}{_MARK}"


_WRITE_ERRNOS = {getattr(errno, n) for n in ("ENOSPC", "EFBIG", "EDQUOT", "EIO") if hasattr(errno, n)}  # failed writes


def real_path(path: str | os.PathLike[str]) -> Path:
    """The absolute path ``path`` names once its folders exist: symlinks and ``..`` resolved.

    Example:
        >>> import os
        >>> real_path("missing-dir/../x.pt") == real_path("x.pt") == real_path(os.path.abspath("x.pt"))
        True
    """
    return Path(os.path.realpath(os.fspath(path)))  # (abspath first would drop "link/.." before resolving link)


def _same(a: Path, b: Path) -> bool:
    if a == b:
        return True
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def _refuse_imported(label: str, text: str, real: Path, done: bool = False) -> None:
    """Refuses an output that is the file of a module this process has imported (``done``: when the outputs are
    about to be written, after the work): the inputs' checks name the --model/--data modules' own files, but not
    what those import (a probe: ``--out helpers.py`` replaced the model's helper module with a checkpoint)."""
    try:
        target = os.stat(real)
    except OSError:  # (not there: nothing to replace)
        return
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if not isinstance(file, str):
            continue
        try:
            found = os.stat(file)
        except OSError:
            continue
        if (found.st_ino, found.st_dev) == (target.st_ino, target.st_dev):
            raise InvalidArgumentError(
                f"{label} {text!r} is the file of the module {name!r}, which this run imported (the code of --model "
                "or --data, or code that imports); writing it would replace that code. Choose another path"
                + ("; nothing was written." if done else ".")
            )


class Terminated(BaseException):
    """SIGTERM (or SIGHUP: the terminal closed) arrived while files were staged; ``signum`` says which."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(signum)
        self.signum = signum


_ENDING = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))
"""The signals that end the process by default and that staging turns into :class:`Terminated` (SIGHUP: a
closed terminal or ssh session left a partial checkpoint and empty temporaries, a probe)."""


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise Terminated(signum)


@contextlib.contextmanager
def _sigterm_as_exception(note: Callable[[], str | None] = lambda: None) -> Iterator[None]:
    """Turns SIGTERM and SIGHUP into an exception for the block (main thread, default handlers only), then ends the
    process by that signal, as it would have, once the files are clean — saying ``note()`` first, if anything (the
    outputs were all in place: a job scheduler's SIGTERM just then ended the command without a word, a probe)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    # (a signal the program handles itself, or ignores, is left to it)
    ours = [signum for signum in _ENDING if signal.getsignal(signum) is signal.SIG_DFL]
    for signum in ours:
        signal.signal(signum, _raise_terminated)
    try:
        yield
    except Terminated as exc:
        for signum in ours:
            signal.signal(signum, signal.SIG_DFL)
        with contextlib.suppress(Exception):
            said = note()
            if said:
                print(said, file=sys.stderr, flush=True)
        os.kill(os.getpid(), exc.signum)  # die as the signal meant, now that the files are clean
        raise
    finally:
        for signum in ours:
            signal.signal(signum, signal.SIG_DFL)


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Holds Ctrl-C (SIGINT) and SIGTERM back until the block is done (main thread, and only where the signal
    raises an exception: Python's own SIGINT handler; SIGTERM while files are staged, see
    :func:`_sigterm_as_exception`), then delivers them: ``KeyboardInterrupt`` if the block ended without an error
    of its own, SIGTERM in any case (the process still ends). For the commit of the outputs and its rollback: a
    second Ctrl-C during the rollback stopped it half-way, and the backups it had not put back were then deleted
    (probe 35a: a checkpoint replaced in place, its old content gone, "no output was written"); a SIGTERM there
    did the same."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    ours = ((signal.SIGINT, signal.default_int_handler), *((signum, _raise_terminated) for signum in _ENDING))
    held = [(signum, handler) for signum, handler in ours if signal.getsignal(signum) is handler]
    pressed: list[int] = []

    def hold(signum: int, frame: FrameType | None) -> None:
        pressed.append(signum)

    for signum, _ in held:
        signal.signal(signum, hold)
    try:
        yield
    finally:
        for signum, handler in held:
            signal.signal(signum, handler)
        for signum in _ENDING:
            if signum in pressed:
                signal.raise_signal(signum)  # (its handler raises Terminated here, the files in order)
    if signal.SIGINT in pressed:
        raise KeyboardInterrupt


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError, ValueError):  # (no such process; no process can have that number)
        return False
    except OSError:  # e.g. another user's process
        return True
    return True


def _remove_stale_temporaries(target: Path) -> None:
    """Removes ``.NAME.precisebn-MARK-PID-*.tmp`` (and ``*.old.tmp`` backups) left by a killed run of this machine
    and PID namespace (``MARK``, :func:`_machine_mark`) whose process is gone. Another mark's are another host's
    or container's, whose processes cannot be seen: left alone. Unmarked ones (``.NAME.precisebn-PID-*.tmp``,
    written before marks, by any machine) are removed only when their process is gone here and they were left
    untouched for a day (a live run writes its temporary within minutes of creating it)."""
    prefix = re.escape(_prefix(target))
    marked = re.compile(prefix + re.escape(_machine_mark()) + r"-(\d+)-[0-9a-f]+(?:\.old)?\.tmp")
    unmarked = re.compile(prefix + r"(\d+)-[0-9a-f]+(?:\.old)?\.tmp")
    with contextlib.suppress(OSError), os.scandir(target.parent) as entries:
        for entry in entries:
            found = marked.fullmatch(entry.name)
            if found is None:
                found = unmarked.fullmatch(entry.name)
                if found is None or not _untouched_for(entry, _UNMARKED_AGE):
                    continue
            if int(found.group(1)) != os.getpid() and not _pid_alive(int(found.group(1))):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)


def _untouched_for(entry: os.DirEntry[str], seconds: float) -> bool:
    try:
        return time.time() - entry.stat(follow_symlinks=False).st_mtime >= seconds
    except OSError:
        return False


class OutputPlan:
    """The outputs of one operation, checked up front and written all together or not at all.

    Args:
        inputs: Files the operation reads, by label (``{"CHECKPOINT": path}``); no
            output may be one of them unless :meth:`add` says it replaces it.
        folders: Folders whose files the operation reads (``{"--data": path}``); no output may be in one.

    Example:
        >>> import tempfile, pathlib
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> plan = OutputPlan({"input": folder / "in.txt"})
        >>> _ = plan.add("--out", folder / "out.txt")
        >>> _ = plan.add("--log", folder / "sub" / ".." / "out.txt")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        precisebn.errors.InvalidArgumentError: --log ... is the same file as --out ...
        >>> with plan.staged() as tmp:
        ...     _ = tmp["--out"].write_text("done")
        >>> (folder / "out.txt").read_text()
        'done'
        >>> import shutil; shutil.rmtree(folder)
    """

    def __init__(
        self,
        inputs: Mapping[str, str | os.PathLike[str]] | None = None,
        folders: Mapping[str, str | os.PathLike[str]] | None = None,
    ) -> None:
        self.inputs = {label: (os.fspath(p), real_path(p)) for label, p in (inputs or {}).items()}
        self.folders = {label: (os.fspath(p), real_path(p)) for label, p in (folders or {}).items()}
        # each input file as it is now (device, inode, size, modification time): one an output replaces must still
        # be that file when the output is put in its place (another job may have saved a newer one meanwhile)
        self._stamps = {label: _stamp(real) for label, (_, real) in self.inputs.items()}
        self._replaces: dict[str, str] = {}  # output label: the input label it replaces
        self.outputs: dict[str, tuple[str, Path]] = {}
        self.committed = False  # every output is in place (an interrupt after this changes nothing)

    def add(self, label: str, path: str | os.PathLike[str], *, replaces: str | None = None) -> Path:
        """Plans one output; returns its real path.

        Args:
            label: How the message names it (the option, e.g. ``"--report"``).
            path: Where it goes.
            replaces: The label of the input it may replace (``--in-place``).

        Raises:
            InvalidArgumentError: It is an input (other than ``replaces``), another
                output, a folder, or under a file or a folder that cannot be written.
        """
        text, real = os.fspath(path), real_path(path)
        for place in (Path(text), *Path(text).parents):  # (realpath leaves a symlink loop as it is)
            try:
                os.stat(place)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise InvalidArgumentError(
                        f"{label} {text!r}: {str(place)!r} is a loop of symbolic links; give a path that resolves."
                    ) from None
                continue
            break
        if text.endswith((os.sep, "/")) or (os.altsep and text.endswith(os.altsep)):
            raise InvalidArgumentError(f"{label} {text!r} names a folder (it ends with a slash); give a file path.")
        if len(os.fsencode(real.name)) > _NAME_MAX:
            raise InvalidArgumentError(
                f"{label} {text!r}: its file name is {len(os.fsencode(real.name))} bytes long, more than the "
                f"{_NAME_MAX} a file name can have; give a shorter one."
            )
        for other, (other_text, other_real) in self.inputs.items():
            if other != replaces and _same(real, other_real):
                in_place = other in self._replaces.values()
                hint = "" if other != "CHECKPOINT" or in_place else ", or pass --in-place to replace the checkpoint"
                raise InvalidArgumentError(
                    f"{label} {text!r} is the input {other} {other_text!r} ({real}); writing it would destroy the "
                    f"input. Choose another path{hint}."
                )
        for other, (other_text, other_real) in self.folders.items():
            if real.is_relative_to(other_real):
                raise InvalidArgumentError(
                    f"{label} {text!r} is inside the input folder {other} {other_text!r} ({real}); writing it would "
                    "change (or add to) what is read. Choose a path outside that folder."
                )
        _refuse_imported(label, text, real)
        for other, (other_text, other_real) in self.outputs.items():
            if _same(real, other_real):
                raise InvalidArgumentError(
                    f"{label} {text!r} is the same file as {other} {other_text!r} ({real}); give each output its "
                    "own path."
                )
        if real.is_dir():
            raise InvalidArgumentError(f"{label} {text!r} is a folder; give a file path.")
        if real.exists() and not real.is_file():  # a device, a pipe, a socket: renaming a file onto it replaces it
            raise InvalidArgumentError(
                f"{label} {text!r} is not a regular file (a device, a pipe or a socket); precisebn writes a file "
                "and renames it into place, which would replace it. Give a file path."
            )
        ancestor = real.parent
        while not ancestor.exists():
            ancestor = ancestor.parent
        if not ancestor.is_dir():
            raise InvalidArgumentError(f"{label} {text!r}: {str(ancestor)!r} is a file, not a folder.")
        if not os.access(ancestor, os.W_OK | os.X_OK):
            raise NotWritableError(
                f"{label} {text!r}: the folder {str(ancestor)!r} is not writable; choose another path."
            )
        self.outputs[label] = (text, real)
        if replaces is not None:
            self._replaces[label] = replaces
        return real

    @contextlib.contextmanager
    def staged(self) -> Iterator[dict[str, Path]]:
        """Yields a temporary path per output (by label); commits them all when the block succeeds."""
        temps: dict[str, Path] = {}
        created: list[Path] = []
        for label, (text, target) in self.outputs.items():  # (the code imported since add(): a --model's helpers)
            _refuse_imported(label, text, target, done=True)
        with _sigterm_as_exception(self._note_if_committed):
            try:
                for label, (_, target) in self.outputs.items():
                    created += _make_parents(target.parent)
                    _remove_stale_temporaries(target)
                    try:
                        fd, name = _mkstemp(target)
                    except OSError as exc:
                        raise OSError(exc.errno, exc.strerror, str(target)) from None
                    os.close(fd)
                    temps[label] = Path(name)  # (its mode is the target's at commit: a writer may need to write it)
                try:
                    yield temps
                except Exception as exc:
                    vanished = self._vanished(temps)
                    if vanished is not None:  # (what the writer made of it: "checkpoint '.x.tmp' does not exist")
                        raise vanished from exc
                    if not isinstance(exc, OSError):
                        raise
                    renamed = self._renamed(exc, temps)  # name the output, not its hidden temporary file
                    if renamed is exc:
                        raise
                    raise renamed from exc
                vanished = self._vanished(temps)
                if vanished is not None:
                    raise vanished
                self._commit(temps)  # (sets self.committed once the last output is in place)
            finally:
                for tmp in temps.values():  # (each: an append-only folder refuses every unlink, and the error that
                    with contextlib.suppress(OSError):  # ended the block is the one to report, a probe)
                        tmp.unlink()
                if not self.committed:
                    for folder in reversed(created):
                        with contextlib.suppress(OSError):
                            folder.rmdir()

    def described(self) -> str:
        """The outputs, as given (``"out.pt, report.json"``)."""
        return ", ".join(text for text, _ in self.outputs.values())

    def _note_if_committed(self) -> str | None:
        if not self.committed:
            return None
        return f"precisebn: ended by a signal after every output was written ({self.described()}: complete)."

    def _renamed(self, exc: OSError, temps: dict[str, Path]) -> OSError:
        """``exc`` naming the output whose temporary file it names (by the temporary's own name: two long names
        may share a shortened prefix), or the only output for a failed write that names no file (a full disk at
        a close: ``Report.to_json`` and the plots said "File too large" of nothing, probe 41); else ``exc`` itself
        (another error of the block: of another file, a socket's)."""
        if exc.filename is None and exc.errno in _WRITE_ERRNOS and len(temps) == 1:
            (label,) = temps
            return OSError(exc.errno, exc.strerror or str(exc), self.outputs[label][0])
        name = Path(os.fspath(exc.filename)).name if exc.filename else ""
        for label, tmp in temps.items():
            if name in (tmp.name, tmp.name[:-4] + ".old.tmp"):
                return OSError(exc.errno, exc.strerror, self.outputs[label][0])
        return exc

    def _vanished(self, temps: dict[str, Path], only: str | None = None) -> ConcurrentUseError | None:
        """The error for the first temporary file (of ``only``'s output, if given) that is no longer there, if any:
        another process removed it while the work wrote it (an older precisebn on another host or in another
        container took it as left by a killed run, probe 45; a clean-up job), which its writer reported as a
        missing file of a hidden name ("checkpoint '.out.pt.precisebn-....tmp' does not exist")."""
        for label, tmp in temps.items():
            if (only is None or label == only) and not os.path.lexists(tmp):
                text = self.outputs[label][0]
                return ConcurrentUseError(
                    f"{label} {text!r}: the temporary file {tmp.name!r} it was being written to (in "
                    f"{str(tmp.parent)!r}) disappeared before it could be renamed into place; another process "
                    "removed it: most likely another run writing the same output (an older precisebn on another "
                    "machine or in another container removes the temporary files whose process it cannot see) or "
                    f"a clean-up job. Nothing was written: make sure one run at a time writes {text!r}, then run "
                    "again."
                )
        return None

    def _commit(self, temps: dict[str, Path]) -> None:
        with _signals_deferred():  # (all of the renames, or the rollback of all of them)
            self._commit_all(temps)

    def _commit_all(self, temps: dict[str, Path]) -> None:
        # (target, a copy of its old content or None, whether it existed): what a rollback puts back
        done: list[tuple[Path, Path | None, bool]] = []
        backups: list[Path] = []  # removed whatever happens (also when the rename fails)
        try:
            for label, tmp in temps.items():
                target = self.outputs[label][1]
                replaced = self._replaces.get(label)
                if replaced is not None and _stamp(target) != self._stamps[replaced]:
                    raise ConcurrentUseError(
                        f"{label}: {self.inputs[replaced][0]!r} changed while precisebn was working on it (another "
                        "job saved a new version?); replacing it would lose that version. Nothing was written: run "
                        "again on the new file, or write elsewhere with --out."
                    )
                try:
                    os.chmod(tmp, _mode_for(target))  # the writer may have recreated the file
                except FileNotFoundError:
                    raise self._vanished(temps, label) or OSError(errno.ENOENT, "No such file", str(tmp)) from None
                _same_owner(tmp, target)
                existed, backup = target.exists(), None
                if existed:
                    backup = tmp.with_name(tmp.name[:-4] + ".old.tmp")
                    try:
                        os.link(target, backup)
                    except OSError:  # a file system without hard links: a copy, else no way back for this one
                        try:
                            shutil.copy2(target, backup)
                        except OSError:
                            with contextlib.suppress(OSError):
                                backup.unlink()  # (a partial copy)
                            backup = None
                    if backup is not None:
                        backups.append(backup)
                try:
                    os.replace(tmp, target)
                except OSError as exc:  # named by the output, not by the hidden temporary file
                    vanished = self._vanished(temps, label) if isinstance(exc, FileNotFoundError) else None
                    raise vanished or OSError(exc.errno, exc.strerror, str(target)) from exc
                done.append((target, backup, existed))
            # every output in place: committed — a Ctrl-C from here on (removing the backups below frees a whole
            # old checkpoint under --in-place, which takes time) changes nothing (probe 34b: exit 130 and "no
            # output was written" for a replaced file)
            self.committed = True
        except BaseException:
            if self.committed:  # (an interrupt just after the last rename: nothing to put back)
                raise
            for target, backup, existed in reversed(done):  # put the old contents back
                with contextlib.suppress(OSError):
                    if backup is not None:
                        os.replace(backup, target)
                    elif not existed:  # (an existing file without a copy is left as written, never deleted)
                        target.unlink()
            raise
        finally:
            interrupted: KeyboardInterrupt | None = None
            for backup in backups:  # (put back by a rollback: gone already)
                try:
                    with contextlib.suppress(OSError):
                        backup.unlink()
                except KeyboardInterrupt as exc:  # (after the unlink returned: the others are removed all the same)
                    interrupted = exc
            if interrupted is not None:
                raise interrupted


def _stamp(path: Path) -> tuple[int, ...] | None:
    """A file's device, inode, size and modification time (``None`` if it is not there)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _make_parents(folder: Path) -> list[Path]:
    missing = []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    for f in reversed(missing):
        f.mkdir()
    return list(reversed(missing))


def _mkstemp(target: Path) -> tuple[int, str]:
    mark = _machine_mark()
    for _ in range(100):
        name = target.with_name(f"{_prefix(target)}{mark}-{os.getpid()}-{secrets.token_hex(4)}.tmp")
        try:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            continue
        with contextlib.suppress(OSError):
            os.fchmod(fd, 0o600)  # writable by its writer whatever the umask (0o277 made it read-only)
        return fd, str(name)
    raise FileExistsError(f"cannot create a temporary file next to {target}")


def _same_owner(tmp: Path, target: Path) -> None:
    """Gives the file that replaces ``target`` its owner and group (possible for root, or a group of the
    writer's: ``sudo precisebn recalibrate --in-place`` left the user's checkpoint owned by root)."""
    try:
        st = os.stat(target)
    except OSError:
        return
    with contextlib.suppress(OSError, AttributeError):  # (not permitted; no chown on this platform)
        if (st.st_uid, st.st_gid) != (os.getuid(), os.getgid()):
            os.chown(tmp, st.st_uid, st.st_gid)


def _mode_for(target: Path) -> int:
    try:
        return stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        return 0o666 & ~_UMASK


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yields a temporary path next to ``path``; renames it onto ``path`` on success.

    A one-output :class:`OutputPlan`: whatever the block writes to the temporary path
    replaces ``path`` in one step; if the block raises (or SIGTERM arrives), the
    temporary file is removed and ``path`` is left as it was. An existing file keeps
    its permission bits; a symlink is written through to its target.

    Example:
        >>> import tempfile, pathlib, shutil
        >>> target = pathlib.Path(tempfile.mkdtemp()) / "out.txt"
        >>> with atomic_path(target) as tmp:
        ...     _ = tmp.write_text("done")
        >>> target.read_text()
        'done'
        >>> shutil.rmtree(target.parent)
    """
    plan = OutputPlan()
    plan.add("output", path)
    with plan.staged() as temps:
        yield temps["output"]
