"""Signals held while precisebn changes a model outside its forward passes (precisebn.interrupts).

Found by probe 40: a signal handler's exception (Ctrl-C, a SIGALRM timeout that raises) raised between two
steps of a restore — between two of ``contextlib.ExitStack``'s callbacks, as a context manager's ``__enter__``
returned, at the entry of the function that retries a restore — left the model with precisebn's scratch buffers,
momentum 1.0 and wrapped forwards (every later call on it refused), or its modules marked as in use (every later
recalibration refused as concurrent), or a forward's attribute unrestored. Those restores now run with signals
held; the passes themselves let them through. The sweeps below send a real signal at every few lines of
precisebn's (and contextlib's) code during a call, and check the model after each.
"""

from __future__ import annotations

import copy
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import precisebn
from precisebn import compat
from precisebn import state as _state
from precisebn.errors import InvalidArgumentError
from precisebn.interrupts import signals_held, signals_let_through

SOURCES = (os.path.dirname(precisebn.__file__), "contextlib.py")


def test_a_held_signal_reaches_its_handler_when_the_block_ends() -> None:
    reached: list[int] = []

    def block() -> None:
        with signals_held():
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):  # (Python runs a signal's handler at the next check: many here)
                pass
            reached.append(1)

    with pytest.raises(KeyboardInterrupt):
        block()
    assert reached == [1]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_held_signals_are_held_through_nested_blocks_and_let_through_the_passes() -> None:
    seen: list[str] = []

    def handler(signum: int, frame: Any) -> None:
        seen.append("handled")

    previous = signal.signal(signal.SIGVTALRM, handler)
    try:
        with signals_held():
            with signals_held():
                os.kill(os.getpid(), signal.SIGVTALRM)
                seen.append("inner end")
            seen.append("outer")
            with signals_let_through():  # (the held one first, then as usual)
                seen.append("passes")
                os.kill(os.getpid(), signal.SIGVTALRM)
                for _ in range(1000):
                    pass
                seen.append("passes end")
            os.kill(os.getpid(), signal.SIGVTALRM)
            seen.append("outer end")
        assert seen == ["inner end", "outer", "handled", "passes", "handled", "passes end", "outer end", "handled"]
        assert signal.getsignal(signal.SIGVTALRM) is handler
    finally:
        signal.signal(signal.SIGVTALRM, previous)


def test_a_handler_installed_while_signals_were_let_through_is_held_and_put_back() -> None:
    seen: list[int] = []
    previous = signal.getsignal(signal.SIGPROF)
    try:
        with signals_held():
            with signals_let_through():
                signal.signal(signal.SIGPROF, lambda s, f: seen.append(s))
            os.kill(os.getpid(), signal.SIGPROF)
            for _ in range(1000):
                pass
            assert seen == []
        assert seen == [signal.SIGPROF]
    finally:
        signal.signal(signal.SIGPROF, previous)


def test_nothing_is_held_outside_the_main_thread() -> None:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            with signals_held(), signals_let_through():
                pass
        except BaseException as exc:  # (signal.signal would raise ValueError outside the main thread)
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert errors == []
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


class _Timeout(Exception):
    """What a SIGALRM handler of the user's raises (a time limit)."""


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4))
    return model.eval()


def _state_of(model: nn.Module) -> tuple[dict[str, torch.Tensor], list[tuple[Any, ...]]]:
    values = {k: v.clone() for k, v in model.state_dict().items()}
    flags = [
        (m.training, getattr(m, "momentum", None), "forward" in m.__dict__, len(m._forward_hooks))
        for m in model.modules()
    ]
    return values, flags


def _same(a: tuple[dict[str, torch.Tensor], list[Any]], b: tuple[dict[str, torch.Tensor], list[Any]]) -> bool:
    return a[1] == b[1] and a[0].keys() == b[0].keys() and all(torch.equal(a[0][k], b[0][k]) for k in a[0])


def _watched(code: Any, codes: Any = None) -> bool:
    """Whether a line of ``code`` counts: one of ``codes``, or by default precisebn's or contextlib's."""
    if codes is not None:
        return code in codes
    return code.co_filename.startswith(SOURCES[0]) or code.co_filename.endswith(SOURCES[1])


def _signalled_at(line: int, signum: int, call: Callable[[], Any], codes: Any = None) -> BaseException | None:
    """Runs ``call``, sending ``signum`` to this process at its ``line``-th line event in precisebn's or
    contextlib's code (or in the functions of ``codes``); returns what it raised (of a signal's handler)."""
    count = [0]

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if not _watched(frame.f_code, codes):
            return None

        def local(frame: Any, event: str, arg: Any) -> Any:
            if event == "line":
                count[0] += 1
                if count[0] == line:
                    os.kill(os.getpid(), signum)
            return local

        return local

    sys.settrace(tracer)
    try:
        call()
    except (KeyboardInterrupt, _Timeout) as exc:
        return exc
    finally:
        sys.settrace(None)
    return None


@pytest.mark.parametrize("kind", ["Ctrl-C", "a SIGALRM handler raising"])
@pytest.mark.parametrize("function", ["recalibrate", "apply", "estimate", "update_bn", "update_bn_stats"])
def test_a_signal_anywhere_leaves_the_model_as_it_was_or_recalibrated_whole(function: str, kind: str) -> None:
    """The model after each: bitwise as it was (the flags, momenta, wrappers and hooks too), or — the signal
    handled after the writes — recalibrated whole, the exception saying so; no module left marked as in use;
    and a recalibration after it gives what one on a fresh copy gives."""
    signum = signal.SIGINT if kind == "Ctrl-C" else signal.SIGALRM
    previous = signal.getsignal(signal.SIGALRM)

    def timeout(signum: int, frame: Any) -> None:
        raise _Timeout

    signal.signal(signal.SIGALRM, timeout)
    try:
        template = _model()
        if function == "update_bn_stats":  # (it recalibrates the layers in training mode only)
            template.train()
        g = torch.Generator().manual_seed(1)
        data = [torch.randn(4, 3, 8, 8, generator=g) for _ in range(2)]
        done = copy.deepcopy(template)
        stats = precisebn.estimate(done, data)
        precisebn.apply(done, stats)
        before, after = _state_of(template), _state_of(done)
        calls: dict[str, Callable[[nn.Module], Any]] = {
            "recalibrate": lambda m: precisebn.recalibrate(m, data),
            "apply": lambda m: precisebn.apply(m, stats),
            "estimate": lambda m: precisebn.estimate(m, data),
            # the drop-ins (probe 41: they held no signals, and left the model marked in use, or with the scratch
            # buffers, momentum 1.0 and wrapped forwards)
            "update_bn": lambda m: compat.update_bn(data, m),
            "update_bn_stats": lambda m: compat.update_bn_stats(m, data, num_iters=len(data)),
        }
        call = calls[function]
        count, noted = [0], [0]
        lines = _count_lines(lambda: call(copy.deepcopy(template)))
        step = max(1, lines // 150)  # (about 150 places, spread over the whole call, and each of its last lines:
        # after the writes, before the end of the call)
        for line in sorted({*range(1, lines + 1, step), *range(max(1, lines - 80), lines + 1)}):
            m = copy.deepcopy(template)
            raised = _signalled_at(line, signum, lambda m=m: call(m))
            now = _state_of(m)
            if raised is not None and not _same(now, before):  # (a signal after the writes: raised after them)
                assert function != "estimate" and _same(now, after), f"{function}, signal at line {line}"
                noted[0] += any("had completed" in note for note in getattr(raised, "__notes__", []))
            else:
                assert _same(now, before) or (raised is None and function != "estimate" and _same(now, after))
            assert not _state._busy, f"modules left marked as in use (signal at line {line})"
            precisebn.recalibrate(m, data, num_samples="all")
            assert _same(_state_of(m), after), f"a recalibration after a signal at line {line}"
            count[0] += 1
        assert count[0] >= 100
        assert function == "estimate" or noted[0], "no signal held past the writes said that the call had completed"
    finally:
        signal.signal(signal.SIGALRM, previous)


def _count_lines(call: Callable[[], Any]) -> int:
    count = [0]

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if not _watched(frame.f_code):
            return None

        def local(frame: Any, event: str, arg: Any) -> Any:
            if event == "line":
                count[0] += 1
            return local

        return local

    sys.settrace(tracer)
    try:
        call()
    finally:
        sys.settrace(None)
    return count[0]


def test_a_call_from_another_thread_while_the_flags_are_set_is_refused() -> None:
    """Probe 40: a call from another thread after the training flags were set and before the forward wrappers were
    in place (or after they came off and before the flags were back) ran in training mode on the scratch buffers:
    its output silently the batch's (3.2 off the eval output). Here another thread runs the model at every line of
    the pass's set-up and restore: each of its calls is refused, or gives the eval-mode output."""
    model = _model()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.add_(1.0)
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(x)
    data = [torch.randn(4, 3, 8, 8) for _ in range(2)]
    outputs: list[torch.Tensor] = []
    refused: list[BaseException] = []

    def infer() -> None:
        try:
            with torch.no_grad():
                outputs.append(model(x))
        except precisebn.PreciseBNError as exc:
            refused.append(exc)

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code.co_name != "recalibration_state":
            return None

        def local(frame: Any, event: str, arg: Any) -> Any:
            if event == "line":
                t = threading.Thread(target=infer)
                t.start()
                t.join()
            return local

        return local

    before = _state_of(model)
    sys.settrace(tracer)
    try:
        with pytest.raises(InvalidArgumentError, match="called in thread"):  # (so is the pass)
            precisebn.estimate(model, data)
    finally:
        sys.settrace(None)
    assert _same(_state_of(model), before)
    assert len(outputs) + len(refused) > 20 and refused
    for out in outputs:
        assert torch.equal(out, expected)


def test_ctrl_c_while_the_checks_workspace_changes_hands_leaves_later_passes_able_to_take_it() -> None:
    """Probe 40's sweep hung: a Ctrl-C as the spot checks' kept workspace was taken or given back, inside ``with
    lock:``, left the lock held, and the next pass in the process waited for it forever. A Ctrl-C at each line of
    those two functions, then a pass in another thread that must end."""
    from precisebn import spotcheck

    model = nn.Sequential(nn.BatchNorm2d(8))
    data = [torch.randn(2, 8, 8, 8).contiguous(memory_format=torch.channels_last) for _ in range(2)]
    codes = {spotcheck._take_workspace.__code__, spotcheck._give_back.__code__}
    for line in range(1, 12):
        _signalled_at(line, signal.SIGINT, lambda: precisebn.estimate(model, data), codes)
        assert _ends(lambda: precisebn.estimate(model, data)), f"a pass after a Ctrl-C at line {line} did not end"


def _ends(call: Callable[[], Any], seconds: float = 60.0) -> bool:
    """Whether ``call``, run in another thread, returns within ``seconds``."""
    ended: list[bool] = []
    t = threading.Thread(target=lambda: ended.append(call() is not None), daemon=True)
    t.start()
    t.join(timeout=seconds)
    return ended == [True]


def test_a_call_inside_another_calls_passes_holds_signals_for_its_own_restore(monkeypatch: pytest.MonkeyPatch) -> None:
    """The review of probe 40: a forward that recalibrates another model (inside the outer call's passes, where
    signals are let through) ran that call's restore with signals not held."""
    from precisebn import layers

    under: list[Any] = []  # the SIGINT handler at each set-up and restore, and in the outer passes
    for name in ("_set_modes", "_restore_flags"):
        monkeypatch.setattr(layers, name, _spied(getattr(layers, name), under))
    inner = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))

    def forward(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        under.append(signal.getsignal(signal.SIGINT))
        precisebn.estimate(inner, [torch.randn(8, 4)])
        under.append(signal.getsignal(signal.SIGINT))
        return model(batch)

    precisebn.estimate(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), [torch.randn(8, 4)], forward=forward)
    held, through = [h is not signal.default_int_handler for h in under], signal.default_int_handler
    # outer set-up, passes, inner set-up and restore, passes again, outer restore
    assert held == [True, False, True, True, False, True], under
    assert signal.getsignal(signal.SIGINT) is through


def _spied(fn: Callable[..., Any], under: list[Any]) -> Callable[..., Any]:
    def spy(*args: Any) -> Any:
        under.append(signal.getsignal(signal.SIGINT))
        return fn(*args)

    return spy


def test_a_c_level_handler_on_a_signal_left_alone_survives_a_call(tmp_path: Any) -> None:
    """The review of probe 40: re-installing every Python-level handler through signal.signal replaced a C-level
    one chained over it — faulthandler.register(SIGUSR1 or SIGTERM, chain=True), which training jobs use to dump
    their stacks when preempted — for good. Only SIGINT and the timers are held now."""
    import faulthandler

    signum = signal.SIGUSR1
    previous = signal.signal(signum, lambda s, f: None)
    path = tmp_path / "dump.txt"
    with open(path, "w+") as dump:
        faulthandler.register(signum, file=dump, all_threads=False, chain=True)
        try:
            precisebn.recalibrate(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), [torch.randn(8, 4)])
            os.kill(os.getpid(), signum)
            for _ in range(1000):
                pass
        finally:
            faulthandler.unregister(signum)
            signal.signal(signum, previous)
    assert "most recent call first" in path.read_text(), "faulthandler's handler was lost"


class _Finaliser:
    """Recalibrates another model when collected (a ``__del__`` running precisebn)."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.me = model, self

    def __del__(self) -> None:
        precisebn.estimate(self.model, [torch.randn(8, 4)])


def test_a_finaliser_recalibrating_inside_a_held_call_does_not_swallow_its_ctrl_c() -> None:
    """The review of probe 40: a Ctrl-C held by a call, then a garbage collection running a finaliser that called
    precisebn: that nested call's passes let the outer call's held Ctrl-C through inside the finaliser, where
    Python ignores exceptions — the Ctrl-C was lost. Only the call whose hold engaged lets signals through."""
    import gc
    import logging

    other = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))

    class Collecting(logging.Handler):  # (user code precisebn runs while it holds signals: its logging)
        def emit(self, record: logging.LogRecord) -> None:
            os.kill(os.getpid(), signal.SIGINT)
            _Finaliser(other)
            gc.collect()

    class WithUnused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn, self.unused = nn.BatchNorm1d(4), nn.BatchNorm1d(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.bn(x)

    handler = Collecting()
    logging.getLogger("precisebn").addHandler(handler)
    try:
        with pytest.raises(KeyboardInterrupt) as info:
            precisebn.recalibrate(WithUnused(), [torch.randn(8, 4) for _ in range(2)])
    finally:
        logging.getLogger("precisebn").removeHandler(handler)
    assert any("had completed" in note for note in getattr(info.value, "__notes__", []))


def test_a_signal_at_any_line_of_a_hold_leaves_no_stale_hold_behind() -> None:
    """The sweep above found it when its lines moved (stop 44): a Ctrl-C as ``_engage`` entered its ``try`` left
    the flag up with no recorder in place, so every later hold in the process took itself as nested and held
    nothing (a Ctrl-C in a later call's restore then left its modules marked in use). A signal at each line of the
    hold's own code, in a hold with signals let through inside: the exception raised at once or at the end,
    nothing of the hold left behind, and a later hold holds."""
    from precisebn import interrupts

    codes = {
        f.__code__
        for f in (
            interrupts._engage,
            interrupts._disengage,
            interrupts._dispatch,
            signals_held.__enter__,
            signals_held.__exit__,
            signals_let_through.__enter__,
            signals_let_through.__exit__,
        )
    }
    ran: list[str] = []

    def call() -> None:
        with signals_held():
            ran.append("held")
            with signals_let_through():
                ran.append("let through")
            ran.append("held again")

    tried = 0
    for line in range(1, 1000):
        ran.clear()
        raised = _signalled_at(line, signal.SIGINT, call, codes)
        if raised is None:  # (past the last line: no signal was sent)
            assert ran == ["held", "let through", "held again"]
            break
        tried += 1
        assert not (interrupts._engaged or interrupts._holds or interrupts._saved or interrupts._pending), line
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, line
        order: list[str] = []

        def later(order: list[str] = order) -> None:
            with signals_held():
                os.kill(os.getpid(), signal.SIGINT)
                order.append("the block went on")

        with pytest.raises(KeyboardInterrupt):
            later()
        assert order == ["the block went on"], f"a later hold held nothing (signal at line {line})"
    assert tried > 20
