"""Signals held while precisebn changes a model outside its forward passes.

A signal's Python handler (Ctrl-C's ``KeyboardInterrupt``, a ``SIGALRM`` timeout that raises, a ``SIGTERM``
handler calling ``sys.exit``) runs between any two bytecodes of the main thread, and so can raise anywhere —
also between two steps of a restore, where nothing can catch it in time: probe 40 found a Ctrl-C between two of
``contextlib.ExitStack``'s callbacks, or as a context manager's ``__enter__`` returned, leaving the model with
precisebn's scratch buffers, momentum 1.0 and wrapped forwards, and one in ``exclusive``'s release leaving every
later call on the model refused as concurrent.

So :func:`signals_held` replaces, for the length of a public call, the Python-level handlers of ``SIGINT`` and
of the timer signals (:data:`_SIGNALS`) by one that only records the signal; the recorded signals are handed to
their own handlers, in order, once the call has put everything back (or finished its writes), and whatever
those raise is raised then. The forward passes, which run
the user's code and may take long, let signals through as usual (:func:`signals_let_through`). A call that
completed before a held signal's handler raised says so in a note on that exception.

Only the main thread runs Python signal handlers, so only there is anything held; elsewhere these do nothing.
Signals handled by the operating system's default (``SIG_DFL``: termination) or ignored are left alone, and so are
the others (``SIGTERM``, ``SIGHUP``, ``SIGUSR1``...: see :data:`_SIGNALS`).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

__all__ = ["signals_held", "signals_let_through"]

# The signals whose Python handlers raise in a process that goes on: Ctrl-C (an interactive session, a notebook),
# and the timers a time limit is built on. Others are left alone: re-installing a handler through signal.signal
# replaces a C-level one chained over it (faulthandler.register(signal.SIGTERM, chain=True), which ML jobs use to
# dump their stacks when preempted, was lost for good: the review of probe 40), and a SIGTERM or SIGHUP ends the
# process anyway (precisebn's command line removes its temporary files then: see files).
_SIGNALS = [signal.SIGINT] + [getattr(signal, n) for n in ("SIGALRM", "SIGVTALRM", "SIGPROF") if hasattr(signal, n)]

_engaged = False  # whether the recorder is in place (in the main thread)
_holds: list[bool] = []  # the holds open in the main thread, innermost last: whether each put the recorder in place
_saved: dict[int, Callable[..., Any]] = {}  # the handlers replaced while held
_pending: list[tuple[int, FrameType | None]] = []  # the signals recorded meanwhile


def _record(signum: int, frame: FrameType | None) -> None:
    _pending.append((signum, frame))


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _engage() -> None:
    """Puts the recorder in place of every Python-level handler (as they are now: a handler installed while
    signals were let through is held too, and put back after)."""
    global _engaged
    try:  # (the flag inside: a signal as the try was entered left it raised with no recorder in place, and every
        # later hold in the process took itself as nested, holding nothing — a test's signal at every line)
        _engaged = True
        for s in _SIGNALS:
            handler = signal.getsignal(s)
            if callable(handler) and handler is not _record:
                _saved[s] = handler  # (first: a signal handled right after the swap must find it to put back)
                signal.signal(s, _record)
    except BaseException:  # (a signal handled before the recorder was in place: nothing is left half-held)
        _disengage()
        raise


def _disengage() -> None:
    """Puts the replaced handlers back, every one of them even if a signal's handler raises meanwhile (one put
    back already, for a signal arriving now); that exception is raised after."""
    global _engaged
    _engaged = False
    raised: BaseException | None = None
    while _saved:
        try:
            for s in list(_saved):
                if signal.getsignal(s) is _record:
                    signal.signal(s, _saved[s])
                del _saved[s]
        except BaseException as exc:
            raised = raised or exc
    if raised is not None:
        raise raised


def _dispatch() -> None:
    """Hands the recorded signals to their handlers (those in place now), in order; the first that raises ends it
    (the others are dropped, as a second Ctrl-C during the first one's exception would be)."""
    pending = _pending[:]
    _pending.clear()
    for signum, frame in pending:
        handler = signal.getsignal(signum)
        if callable(handler) and handler is not _record:
            handler(signum, frame)


class signals_held:
    """Holds signals until the block ends (see the module's docstring); re-entrant: a block inside another's does
    nothing more, one inside another call's passes (its forward recalibrating another model) holds them for its
    own length. Set ``done`` to a sentence
    once the call's result is complete: a held signal's exception raised at the end then carries it as a note.

    >>> import os, signal
    >>> seen = []
    >>> previous = signal.signal(signal.SIGVTALRM, lambda signum, frame: seen.append("handled"))
    >>> with signals_held():
    ...     os.kill(os.getpid(), signal.SIGVTALRM)  # (held: the block goes on)
    ...     seen.append("block")
    >>> seen
    ['block', 'handled']
    >>> _ = signal.signal(signal.SIGVTALRM, previous)
    """

    def __init__(self) -> None:
        self.done: str | None = None
        self._open = self._held = False

    def __enter__(self) -> signals_held:
        if _in_main_thread():
            engaging = not _engaged  # (inside another call's hold: nothing more to do)
            if engaging:
                _engage()
            _holds.append(engaging)
            self._open, self._held = True, engaging
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if not self._open:
            return
        self._open = False
        if _holds:
            _holds.pop()
        if not self._held:
            return
        self._held = False
        try:  # (one try: a signal between two, its handler back in place, left the held ones for a later call)
            _disengage()
            _dispatch()
        except BaseException as raised:  # (a signal let through meanwhile, or a held one's handler: the others
            _pending.clear()  # are dropped with it, as a second Ctrl-C during the first one's exception would be)
            if self.done is not None and exc is None:
                raised.add_note(f"precisebn: {self.done}")
            raise


class signals_let_through:
    """Within :func:`signals_held`: signals reach their handlers as usual for the block (the forward passes),
    the ones held so far first; held again after it."""

    def __init__(self) -> None:
        self._let = False

    def __enter__(self) -> None:
        if not _in_main_thread() or not _engaged or not (_holds and _holds[-1]):
            return  # (signals are let through only by the call whose hold put the recorder in place: one run
            # inside another's hold — a __del__ or a signal handler recalibrating another model — would hand that
            # call's held Ctrl-C to its own passes, where the finaliser swallows it: the review of probe 40)
        try:  # (one try: a signal as it was entered, the handlers back, left the rest of the call unheld)
            _disengage()
            self._let = True
            _dispatch()
        except BaseException:
            self._let = False
            _engage()
            raise

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._let:
            self._let = False
            _engage()
