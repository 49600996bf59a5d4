"""An exception that a signal handler of the program raises inside Disco's own steps.

Python runs a handler (``SIGALRM`` raising ``TimeoutError``: the usual way to put a
time limit on a call) between two bytecodes of the main thread, wherever it is. Ctrl-C
is held back in the steps that must not be cut (``disco_core._interrupts``); another
handler's exception is not. It used to be taken for a dead worker (``TimeoutError`` is
an ``OSError``: "worker 1 died: worker 1 command pipe broke (alarm)"), to be reported
as bad arguments ("the arguments cannot be sent to the workers: alarm"), or, cut
between two workers' queues, to leave the workers disagreeing on what ran, silently
(a check read 375, 375 and 374 from one counter). Now the program gets its
own exception, and where a step was cut the workers are given up with that reason.
"""

from __future__ import annotations

import fcntl
import functools
import signal
import sys

import numpy as np
import pytest

import disco_core as disco
from disco_core import _interrupts
from disco_core.spi import as_dtype

_F_GETPIPE_SZ = getattr(fcntl, "F_GETPIPE_SZ", 1032)


class Boom(Exception):
    pass


@pytest.fixture
def alarm_raises():
    """SIGALRM's handler raises ``exc`` (set ``box[0]``); restored after the test."""
    box: list[BaseException] = [TimeoutError("the program's own timeout")]

    def handler(signum, frame):
        raise box[0]

    old = signal.signal(signal.SIGALRM, handler)
    try:
        yield box
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_the_handler_s_frames_tell_its_exceptions_apart(alarm_raises):
    class Handler:
        def __call__(self, signum, frame):
            raise Boom("object")

        def method(self, signum, frame):
            raise Boom("method")

    def function(signum, frame):
        raise Boom("function")

    def helper():
        raise Boom("helper")

    handlers = [function, Handler(), Handler().method, functools.partial(function)]
    handlers.append(lambda signum, frame: helper())  # raised below the handler
    for handler in handlers:
        signal.signal(signal.SIGALRM, handler)
        with pytest.raises(Boom) as info:
            signal.raise_signal(signal.SIGALRM)
        assert _interrupts.raised_by_signal_handler(info.value), handler

    # One-shot timeouts remove their handler before they raise: the handler's frame,
    # code of the program inside one of Disco's steps, still tells
    def one_shot(signum, frame):
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        raise Boom("once")

    signal.signal(signal.SIGALRM, one_shot)
    with pytest.raises(Boom) as info:
        signal.raise_signal(signal.SIGALRM)
    assert not _interrupts.raised_by_signal_handler(info.value)  # no longer in place
    inside = info.value.with_traceback(info.value.__traceback__.tb_next)
    assert _interrupts.cut_by_program(inside)  # as one of Disco's steps sees it
    # Disco's own error, as a step that caught it sees it (its traceback starts there)
    with pytest.raises(TypeError) as info:
        as_dtype("not a dtype")
    own = info.value.with_traceback(info.value.__traceback__.tb_next)
    assert not _interrupts.cut_by_program(own)
    assert not _interrupts.raised_by_signal_handler(own)


@pytest.mark.timeout(60)
def test_a_timeout_error_in_a_write_is_the_program_s_and_gives_the_worker_up(alarm_raises):
    with disco.ProcessSession(2) as sess:
        sess.import_python_module("disco_core.testing.funcs")
        echo, sleep = sess.get_global_func("testing.echo"), sess.get_global_func("testing.sleep")
        pipe = fcntl.fcntl(sess._channel._link_of[1].cmd_w, _F_GETPIPE_SZ)
        sleep(4.0, 1)  # worker 1 reads nothing for 4 s
        sess._sync_worker(0)
        chunk = np.zeros(pipe * 3 // 4, np.uint8)  # < 1 MiB: written on this thread
        echo(chunk)  # fits in worker 1's pipe
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        with pytest.raises(TimeoutError, match="the program's own timeout") as info:
            echo(chunk)  # waits for room: the alarm comes in the middle of the frame
        assert not isinstance(info.value, disco.DiscoError)
        with pytest.raises(disco.WorkerDiedError) as died:
            sess._sync_worker(1)
        text = str(died.value)
        assert "TimeoutError(\"the program's own timeout\") was raised in the middle of a write" in text  # fmt: skip
        assert "pipe broke" not in text and died.value.worker_ids == [1]


class _RaisingQueue:
    """A worker's command queue whose ``extend`` first gets a real SIGALRM, so that the
    handler's exception lands between two workers' queues in ``send_shared``."""

    def __init__(self, inner):
        self.inner = inner

    def extend(self, cmds):
        signal.raise_signal(signal.SIGALRM)
        self.inner.extend(cmds)

    def __len__(self):
        return len(self.inner)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("handler", ["own", "built-in"])
def test_an_exception_between_two_workers_queues_gives_the_workers_up(alarm_raises, handler):
    """Also Python's built-in SIGINT handler put on SIGALRM: it leaves no frame, and its
    KeyboardInterrupt is one Disco's own Ctrl-C handler never raises inside that step."""
    alarm_raises[0] = Boom("alarm")
    if handler == "built-in":
        signal.signal(signal.SIGALRM, signal.default_int_handler)
    expected = Boom if handler == "own" else KeyboardInterrupt
    with disco.ThreadedSession(3) as sess:
        sess.import_python_module("disco_core.testing.funcs")
        echo = sess.get_global_func("testing.echo")
        assert echo(1).debug_get_from_remote(2) == 1
        channel = sess._channel
        real = channel._pendings[1]
        channel._pendings[1] = _RaisingQueue(real)
        try:
            with pytest.raises(expected):
                echo(2)  # worker 0 has the command, workers 1 and 2 do not
        finally:
            channel._pendings[1] = real
        with pytest.raises(disco.WorkerDiedError, match=r"(Boom\('alarm'\)|KeyboardInterrupt\(''\)), raised by a signal handler of the program, cut the hand-over"):  # fmt: skip
            echo(3).debug_get_from_remote(0)


@pytest.mark.timeout(60)
def test_an_exception_handled_before_a_call_does_not_cut_it(alarm_raises):
    """A call made in the program's ``except`` clause for its own timeout still works:
    only an exception passing through Disco's step cuts it."""
    with disco.ProcessSession(2) as sess:
        sess.import_python_module("disco_core.testing.funcs")
        echo = sess.get_global_func("testing.echo")
        try:
            signal.raise_signal(signal.SIGALRM)
        except TimeoutError:
            for k in range(50):
                assert echo(k).debug_get_from_remote(1) == k


@pytest.mark.timeout(60)
def test_errors_being_gathered_when_an_interrupt_comes_are_reported_by_the_next_sync(monkeypatch):
    """A worker's failure, taken off the channel by the gathering of errors that a
    synchronising call does, was dropped when Ctrl-C (or a handler's exception) came
    during that gathering: the failed command was never reported (outside check)."""
    with disco.ThreadedSession(2) as sess:
        sess.import_python_module("disco_core.testing.funcs")
        fail = sess.get_global_func("testing.raise_on")
        fail(1, "ValueError", "boom")  # fails on worker 1 only
        channel = sess._channel
        real, calls = channel.recv, []

        def recv_interrupted_once(*args, **kwargs):
            if _in_gather() and not calls:
                calls.append(1)
                raise KeyboardInterrupt
            return real(*args, **kwargs)

        monkeypatch.setattr(channel, "recv", recv_interrupted_once)
        with pytest.raises(KeyboardInterrupt):
            sess._sync_worker(1)
        monkeypatch.setattr(channel, "recv", real)
        assert calls == [1]
        with pytest.raises(disco.WorkerError, match="boom"):
            sess._sync_worker(1)


def _in_gather() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "_gather_all":
            return True
        frame = frame.f_back
    return False
