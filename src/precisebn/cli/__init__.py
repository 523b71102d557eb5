"""The ``precisebn`` command line: ``demo``, ``recalibrate``, ``apply``, ``merge``, ``inspect``, ``diff``.

A thin layer over the library: every command checks all its arguments first (the
output paths included) before anything is loaded, calls :mod:`precisebn` and prints.
Any error — a wrong argument, an unreadable or mismatched checkpoint, an empty image
folder, a factory that raises — is printed as one paragraph on stderr (what went
wrong, what to do) with a non-zero exit code and no output file written; ``--debug``
shows the traceback instead.

Example:
    >>> main(["--version"])  # doctest: +ELLIPSIS
    precisebn ...
    0
"""

from __future__ import annotations

import codecs
import contextlib
import io
import os
import signal
import sys
import traceback
import warnings
from collections.abc import Iterator
from typing import Any

from ..errors import InvalidArgumentError, PreciseBNError
from .arguments import build_parser
from .commands import EXIT_FAILED, EXIT_FLAGGED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE

__all__ = ["EXIT_FAILED", "EXIT_FLAGGED", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_USAGE", "build_parser", "main", "run"]


def main(argv: list[str] | None = None) -> int:
    """Runs the command line; returns the exit code (0 done, 1 failed, 2 usage, 3 flagged, 130 interrupted
    before any output was written)."""
    parsed: list[Any] = []  # the command's arguments, once parsed (their plan tells what was written)
    try:
        with _encodable_output(), _closed_stdout_ignored():
            return _main(argv, parsed)
    except KeyboardInterrupt:  # (during the command, or after it returned: freeing a large checkpoint takes time)
        return _interrupted(parsed[0] if parsed else None)


def run() -> None:
    """The ``precisebn`` script and ``python -m precisebn``: :func:`main`, then exit with its code — Ctrl-C
    ignored from then on (the command is done; Python would otherwise die of the signal while it frees a
    large checkpoint, and the shell would read "interrupted" for a command that completed)."""
    code = main()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(code)


def _interrupted(args: Any) -> int:
    """Ctrl-C: exit 130 and "no output was written" — unless every output was written already."""
    plan = getattr(args, "plan", None)
    if plan is not None and getattr(plan, "committed", False):
        text = f"precisebn: interrupted after the output was written ({plan.described()}: complete)."
        print(_printable(text), file=sys.stderr)
        return EXIT_OK
    print("precisebn: interrupted; no output was written.", file=sys.stderr)
    return EXIT_INTERRUPTED


def _main(argv: list[str] | None, parsed: list[Any]) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, usage errors (already printed)
        return int(exc.code or 0) if not isinstance(exc.code, str) else EXIT_USAGE
    parsed.append(args)
    debug, quiet = getattr(args, "debug", False), getattr(args, "quiet", False)
    with _warnings_as_notes(), _quiet(quiet), _threads(getattr(args, "threads", None)):
        try:
            if args.check is not None:
                args.plan = args.check(args)
        except InvalidArgumentError as exc:  # found before anything was loaded: a usage error
            if debug:
                raise
            args.parser.print_usage(sys.stderr)
            print(_error_paragraph(args.command, exc), file=sys.stderr)
            return EXIT_USAGE
        except Exception as exc:
            if debug:
                raise
            print(_error_paragraph(args.command, exc), file=sys.stderr)
            return EXIT_FAILED
        try:
            return int(args.func(args))
        except SystemExit as exc:  # from the user's code (a model factory, a script parsing its arguments)
            if debug:
                traceback.print_exc()  # (re-raised, the exit would look like the command's own)
            print(
                f"precisebn {args.command}: error: the code of --model/--data called sys.exit({exc.code!r}) while "
                "precisebn was running it (e.g. a script that parses its own arguments on import); point --model "
                "and --data at functions that build the model and the data without exiting. Nothing was written.",
                file=sys.stderr,
            )
            return EXIT_FAILED
        except Exception as exc:
            if debug:
                raise
            plan = getattr(args, "plan", None)
            if plan is not None and getattr(plan, "committed", False):  # (printing what was written failed)
                print(
                    _printable(
                        f"precisebn {args.command}: every output was written ({plan.described()}: complete); then: "
                        f"{type(exc).__name__}: {exc}"
                    ),
                    file=sys.stderr,
                )
                return EXIT_OK
            print(_error_paragraph(args.command, exc), file=sys.stderr)
            return EXIT_FAILED


def _printable(text: str) -> str:
    """``text`` as standard error can encode it (a file name that is not valid UTF-8 holds surrogates that even a
    strict UTF-8 stream refuses: printing what was written then raised after the writes, a probe)."""
    encoding = getattr(sys.stderr, "encoding", None) or "utf-8"
    try:
        return text.encode(encoding, "backslashreplace").decode(encoding)
    except LookupError:
        return text


def _error_paragraph(command: str, exc: Exception) -> str:
    if isinstance(exc, PreciseBNError):
        text = str(exc)
    elif isinstance(exc, OSError):
        what = f"{exc.strerror or exc}" + (f": {exc.filename!r}" if exc.filename else "")
        text = f"{what}. Check the path and its permissions (and free disk space); nothing was written."
    else:
        text = (
            f"unexpected {type(exc).__name__}: {exc}. Nothing was written; run again with "
            "`precisebn --debug ...` for the traceback."
        )
    return f"precisebn {command}: error: " + " ".join(text.split())


_ESCAPING = ("backslashreplace", "replace", "xmlcharrefreplace", "namereplace")


@contextlib.contextmanager
def _encodable_output() -> Iterator[None]:
    """Output streams in an encoding other than UTF-8/16/32 (cp1252 or cp932 when redirected on Windows,
    ASCII under the C locale) write what they cannot encode (Δ, σ, –, × ...) escaped for the command's
    duration, instead of failing after the work (``--help`` included)."""
    changed = []
    for stream in (sys.stdout, sys.stderr):
        encoding, errors = getattr(stream, "encoding", None), getattr(stream, "errors", None)
        if encoding is None or not hasattr(stream, "reconfigure") or errors in _ESCAPING:
            continue
        try:
            if codecs.lookup(encoding).name.startswith("utf"):  # (every character the output holds)
                continue
        except LookupError:
            continue
        with contextlib.suppress(Exception):
            stream.reconfigure(errors="backslashreplace")
            changed.append((stream, errors))
    try:
        yield
    finally:
        for stream, errors in changed:
            with contextlib.suppress(Exception):
                stream.reconfigure(errors=errors)


class _Tolerant(io.TextIOBase):
    """Standard output that a reader closed early (``precisebn inspect ... | head``) stops, silently: what the
    command prints only reports on its work (the files are the work), which goes on and ends as it would."""

    def __init__(self, stream: Any) -> None:
        self.stream, self.closed_by_reader = stream, False

    def write(self, text: str) -> int:
        if not self.closed_by_reader:
            try:
                self.stream.write(text)
            except BrokenPipeError:
                self._gone()
        return len(text)

    def flush(self) -> None:
        if not self.closed_by_reader:
            try:
                self.stream.flush()
            except BrokenPipeError:
                self._gone()

    def _gone(self) -> None:
        self.closed_by_reader = True
        with contextlib.suppress(Exception):  # (what is left in its buffer must not fail at exit either)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self.stream.fileno())
            os.close(devnull)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


@contextlib.contextmanager
def _closed_stdout_ignored() -> Iterator[None]:
    """Runs the command with :class:`_Tolerant` standard output (the real one's, when it has a file)."""
    stream = sys.stdout
    if not hasattr(stream, "fileno"):
        yield
        return
    sys.stdout = _Tolerant(stream)  # type: ignore[assignment]
    try:
        yield
    finally:
        if sys.stdout.__class__ is _Tolerant:
            sys.stdout = stream


@contextlib.contextmanager
def _warnings_as_notes() -> Iterator[None]:
    def show(message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
        print(f"precisebn: warning: {message}", file=sys.stderr)

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        yield


@contextlib.contextmanager
def _quiet(on: bool) -> Iterator[None]:
    if not on:
        yield
        return
    with contextlib.redirect_stdout(io.StringIO()):
        yield


@contextlib.contextmanager
def _threads(n: int | None) -> Iterator[None]:
    if n is None:
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
