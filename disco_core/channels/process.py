"""The ``process`` channel: worker 0 is a thread, workers 1..N-1 are child processes.

Children are started as ``python -m <entrypoint>`` and spoken to over two pipes
each (commands down, replies up). Frames are written with the arrays' memory as
the source and read straight into the receiving buffers: no extra copy. One reader
thread in the controller drains every reply pipe, so a worker never blocks on a
full reply pipe, and a pipe's end of file is a dead worker, seen at once.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import pickletools
import resource
import selectors
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from .. import _interrupts
from ..commandline import level_for_workers
from ..errors import DiscoError, DiscoValueError, UntrustedValueError, WorkerDiedError, WorkerError
from ..net.io import grow_pipe
from ..net.spawn import spawn_worker, worker_argv
from ..protocol import FrameReader, decode
from ..settings import env_seconds
from .base import BatchingLink, LinkChannel, ReaderGate, ReplyHub, ThreadWorkerLink
from .stderr_tee import StderrTee, with_stderr

logger = logging.getLogger("disco_core.channels")

__all__ = [
    "ProcessChannel",
    "ProcessWorkerLink",
    "start_timeout",
    "tee_stderr",
    "start_worker_processes",
    "exit_reason",
    "stop_worker",
]


#: Seconds a dead worker's report waits for the end of its stderr (its last words):
#: at once when the tee thread runs; 0.5 s was too short on a loaded 2-CPU machine (a
#: suite run beside two chaos runs reported a worker that failed to start without why).
_STDERR_WAIT = 2.0


def start_timeout() -> float:
    """Seconds to wait for workers to start (``DISCO_START_TIMEOUT``, default 60; > 0)."""
    value = env_seconds("DISCO_START_TIMEOUT", 60.0)
    if not value > 0:  # (no worker starts in no time: refused before one is started)
        raise DiscoValueError("DISCO_START_TIMEOUT=0: workers need a number of seconds > 0")
    return value


def describe_exit(code: int | None) -> str:
    if code is None:
        return "its pipe closed"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def exit_reason(proc: subprocess.Popen, worker_id: int, wait: float = 0.0) -> str | None:
    """Why worker ``worker_id``'s process ``proc`` ended (waiting up to ``wait`` s), or None."""
    try:
        code = proc.wait(wait) if wait else proc.poll()
    except subprocess.TimeoutExpired:
        code = None
    if code is None:
        return None
    return f"worker {worker_id} (pid {proc.pid}) {describe_exit(code)}"


def stop_worker(proc: subprocess.Popen, cmd_w: int, deadline: float) -> None:
    """Close the command pipe (an idle worker exits at its end), then wait; kill a laggard."""
    try:
        os.close(cmd_w)
    except OSError:
        pass
    _wait_or_kill(proc, deadline)


def _wait_or_kill(proc: subprocess.Popen, deadline: float) -> None:
    """Wait for ``proc`` until ``deadline``; then kill it and wait for its end."""
    try:
        proc.wait(max(0.01, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def worker_env(num_workers: int = 1) -> dict[str, str]:
    """The environment of worker processes.

    Workers import user modules the way the controller does (its ``sys.path``), and
    unless the user set them, BLAS/OpenMP thread counts are split between the
    workers of this machine, so N workers do not each start one thread per core.
    """
    env = dict(os.environ)
    env["DISCO_SYS_PATH"] = os.pathsep.join(p if p else os.getcwd() for p in sys.path)
    env["DISCO_WORKER_PROCESS"] = "1"
    level = level_for_workers()
    if level:  # the workers log what the controller would (to their stderr, passed on)
        env["DISCO_LOG_LEVEL"] = level
    threads = str(max(1, (os.cpu_count() or 1) // max(1, num_workers)))
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(var, threads)
    return env


class ProcessWorkerLink(BatchingLink):
    """One worker in a child process, behind a command pipe and a reply pipe."""

    heartbeats = True  # disco_core.worker.main sends them

    def __init__(
        self, worker_id: int, num_workers: int, num_groups: int, entrypoint: str, env: dict
    ) -> None:
        super().__init__()
        self.worker_ids = (worker_id,)
        opened: list[int] = []
        try:  # out of descriptors part way: close the pipes already made
            for _ in range(3):
                opened += os.pipe()
        except BaseException:
            for fd in opened:
                os.close(fd)
            raise
        cmd_r, self.cmd_w, self.reply_r, reply_w = opened[:4]
        self.err_r: int | None  # the stderr pipe until tee_stderr takes it
        self.err_r, err_w = opened[4:]
        for fd in (self.cmd_w, reply_w):
            grow_pipe(fd)
        # Writes wait for room in poll(), checking the worker meanwhile (BatchingLink._stalled)
        os.set_blocking(self.cmd_w, False)
        argv = worker_argv(entrypoint, worker_id, num_workers, num_groups, cmd_r, reply_w)
        try:
            self.proc = spawn_worker(argv, (cmd_r, reply_w), env, err_w)
        except BaseException:
            for fd in (self.err_r, self.cmd_w, self.reply_r):  # no link to close them later
                os.close(fd)
            raise
        finally:
            os.close(cmd_r)
            os.close(reply_w)
            os.close(err_w)
        #: The end of the worker's stderr, as ``stderr_tail(wait)`` (set by the channel).
        self.stderr_tail = lambda wait=0.0: ""
        self.reader = FrameReader(self.reply_r)
        self.out_fd = self.cmd_w
        self.dead_reason: str | None = None
        self._pipes_released = False

    def _died(self, exc: OSError) -> WorkerDiedError:
        reason = self.exit_reason(wait=0.5)
        if reason is None:
            return WorkerDiedError(
                self.worker_ids, f"worker {self.worker_ids[0]} command pipe broke ({exc})"
            )
        return WorkerDiedError(self.worker_ids, with_stderr(reason, self.stderr_tail(_STDERR_WAIT)))

    def exit_reason(self, wait: float = 0.0) -> str | None:
        return exit_reason(self.proc, self.worker_ids[0], wait)

    def input_fd(self, worker_id: int) -> int | None:
        return self.reply_r

    def poll(self) -> str | None:
        if self.dead_reason:
            return self.dead_reason
        reason = self.exit_reason()
        if reason is None:
            return None
        # The reply reader may not have seen the pipe's end yet: the first to see the
        # exit gives the reason, so it must carry the worker's last words too (a poll
        # that won this race reported a worker that failed to start without why).
        self.dead_reason = with_stderr(reason, self.stderr_tail(_STDERR_WAIT))
        return self.dead_reason

    def close(self, deadline: float) -> None:
        self._release_pipes()  # the command pipe's end: an idle worker exits at it
        _wait_or_kill(self.proc, deadline)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()

    def reap(self) -> None:
        """After ``kill``, when a Ctrl-C cut the close short: wait for the worker
        process to end, so that no zombie is left, then release the pipes the close
        did not get to (an outside check: one leaked per interrupted shutdown). Under
        the link's lock: a write still under way (the worker is dead: it fails at
        once) must not go on into a descriptor whose number was given out again."""
        self.proc.wait()
        if self.lock.acquire(timeout=5.0):
            try:
                self._release_pipes()
            finally:
                self.lock.release()

    def _release_pipes(self) -> None:
        """Close the command pipe, and the stderr pipe if no tee took it: once (a
        second close could hit a descriptor its number was given to since)."""
        if self._pipes_released:
            return
        self._pipes_released = True
        for fd in (self.cmd_w, self.err_r):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.err_r = None


def tee_stderr(links: list[ProcessWorkerLink]) -> StderrTee:
    """Pass the workers' stderr on to ours; their death reasons then end with its tail."""
    fds = [link.err_r for link in links]
    for link in links:
        link.err_r = None  # the tee's from now on: a clean-up must not close it too
    tee = StderrTee(fds)  # type: ignore[arg-type]  # all still open
    for i, link in enumerate(links):
        link.stderr_tail = functools.partial(tee.tail, i)
    return tee


#: errno values that mean this process or the machine ran out of something, not a bug
_OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.EAGAIN, errno.ENOMEM)


def start_failure(worker_id: int | None, count: int, exc: OSError) -> DiscoError | None:
    """The error to raise when starting worker ``worker_id`` (of ``count`` to start here)
    failed with ``exc`` for want of descriptors, processes or memory (None for any other
    ``exc``): it names the limit and what to do (the socket agent's workers use it too)."""
    if exc.errno not in _OUT_OF_RESOURCES:
        return None
    return DiscoError(_cannot_start(worker_id, count, exc))


def _cannot_start(worker_id: int | None, count: int, exc: OSError) -> str:
    """Why worker ``worker_id`` (of ``count`` to start here) could not start, and what to do."""
    hint = ""
    if exc.errno in (errno.EMFILE, errno.ENFILE):
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        hint = (
            f"; this process may have {soft} open files (ulimit -n), and each worker "
            "process takes a few (its pipes) while it starts and while it runs: raise "
            "the limit or start fewer workers"
        )
    which = "the worker processes" if worker_id is None else f"worker process {worker_id}"
    return f"cannot start {which} ({count} to start here): {exc.strerror or exc}{hint}"


def start_worker_processes(
    hub: ReplyHub,
    worker_ids: range,
    num_workers: int,
    num_groups: int,
    entrypoint: str,
    env: dict,
    procs: list[ProcessWorkerLink],
) -> tuple[StderrTee, ReplyReader]:
    """Start a worker process for each of ``worker_ids``, then their stderr tee and their
    reply reader (started); returns ``(tee, reader)``.

    Each link is appended to ``procs`` as its process starts, so that the caller's
    clean-up finds every process started. Ctrl-C waits for the end of these steps (a
    few ms a worker, with SIGINT blocked at the system's level): cut between a
    worker's start and its place in ``procs``, or as the tee took the pipes, the
    clean-up missed a worker process or closed a pipe twice and stopped before the
    later workers (outside check).
    """
    with _interrupts.sigint_blocked():
        try:
            for w in worker_ids:
                try:
                    procs.append(ProcessWorkerLink(w, num_workers, num_groups, entrypoint, env))
                except OSError as exc:
                    error = start_failure(w, len(worker_ids), exc)
                    if error is None:
                        raise
                    raise error from exc
            tee = tee_stderr(procs)
            reader = ReplyReader(procs, hub)
        except BaseException:
            for link in procs:  # the reply pipes are the reader's to close; there is none
                os.close(link.reply_r)
            raise
        reader.start()
    return tee, reader


class UndecodableReply(ValueError):
    """A worker's message, read whole, that this process could not rebuild (not a reply)."""


def _first_string(header: Any) -> str | None:
    """The first string a pickle pushes (a message's kind), found without unpickling."""
    try:
        for op, arg, _pos in pickletools.genops(bytes(header)):
            if isinstance(arg, str) and "UNICODE" in op.name:
                return arg
    except Exception:  # noqa: BLE001 - a frame this broken is no reply
        return None
    return None


class ReplyReader(threading.Thread):
    """Drains the replies of every worker link into the hub; a link's end means its worker is gone.

    One thread and one selector for all links. Each link has a ``reader`` (a
    :class:`~disco_core.net.framing.FrameReader`) and ``worker_ids``. What differs
    between channels is a few methods: :meth:`link_fd` (what to select on),
    :attr:`decode` (:func:`~disco_core.protocol.decode` for pipes from processes
    this one started; :func:`~disco_core.wire_values.decode_untrusted` for anything
    that crossed a socket), :meth:`on_message` and :meth:`link_ended`. The default
    is the process channel's: reply pipes, and the worker's exit status and last
    stderr lines as the reason of its death.
    """

    decode = staticmethod(decode)

    def __init__(self, links: list, hub: ReplyHub, name: str = "disco-replies") -> None:
        super().__init__(name=name, daemon=True)
        self.hub = hub
        self.selector = selectors.DefaultSelector()
        #: held while frames are read and delivered (the channel's ``settle`` waits on it)
        self.gate = ReaderGate()
        for link in links:
            fd = self.link_fd(link)
            self.selector.register(fd, selectors.EVENT_READ, link)
            self.gate.add(fd)
            # the bytes of a large frame still arriving are a sign of life
            link.reader.progress = functools.partial(hub.touch, link.worker_ids[0])
        self.remaining = len(links)
        # stop(): the channel closes. Waiting only for each link's end left this thread
        # (and its epoll fd) for good where a link was closed before its end was read:
        # a closed socket leaves epoll without a word (an outside check: 22 of 26 busy
        # shutdowns of the rpc channel)
        self._wake = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self.selector.register(self._wake, selectors.EVENT_READ, None)

    def stop(self) -> None:
        """End the thread (the channel is closing): at once, whatever links are left."""
        with contextlib.suppress(OSError):
            os.eventfd_write(self._wake, 1)
        if self.ident is None:  # never started: nothing else will release them
            self._release()

    def _release(self) -> None:
        self.selector.close()
        with contextlib.suppress(OSError):
            os.close(self._wake)

    def link_fd(self, link: Any) -> int:
        """The descriptor a link's replies arrive on."""
        return link.reply_r

    def on_message(self, link: Any, msg: tuple) -> None:
        """A hook for each reply before it is delivered (nothing by default)."""

    def refused(self, worker_id: int, exc: UntrustedValueError) -> tuple:
        """The message to deliver in place of a whole frame :attr:`decode` refused.

        By default the refusal ends the link (a pipe from a process this one started
        that does not decode is broken). A reader whose frames crossed a socket
        answers the waiting call with the refusal instead: the frame was whole, so
        the stream is still in step, and the value was the worker's reply (what a
        function returned), which must not end the session.
        """
        raise exc

    def undecodable(self, worker_id: int, header: Any, exc: Exception) -> tuple:
        """The message to deliver in place of a whole frame that :attr:`decode` could not
        rebuild (an object of a class this process cannot import, one whose
        unpickling raised).

        A reply (a function's result, sent as ``("reply", value)``) is answered with the
        failure: the frame was whole, so the stream is still in step, and the session
        goes on. Anything else (a worker's own message: its kind is read from the
        frame's first string, without rebuilding anything) raises
        ``UndecodableReply``, which ends the link and says why.
        """
        if _first_string(header) == "reply":
            return (
                "fail",
                WorkerError(
                    worker_id,
                    type(exc).__name__,
                    f"the worker's reply could not be rebuilt in the controller: {exc} (a "
                    "value returned to the controller must be of a type it can import)",
                ),
            )
        raise UndecodableReply(f"a message of worker {worker_id} could not be decoded: {type(exc).__name__}: {exc}")  # fmt: skip

    def link_ended(self, link: Any, fd: int, exc: BaseException) -> None:
        """The link ended (end of file, an error, a refused frame): mark its workers dead."""
        link.reader.close()
        os.close(fd)
        if not self.hub.closing:
            reason = link.exit_reason(wait=1.0)
            if reason is None and isinstance(exc, UndecodableReply):
                reason = str(exc)
            elif reason is None:
                reason = f"worker {link.worker_ids[0]} closed its reply pipe"
            else:
                reason = with_stderr(reason, link.stderr_tail(_STDERR_WAIT))
            link.dead_reason = reason
            self.hub.mark_dead(link.worker_ids, reason)

    def run(self) -> None:
        # frames that arrived with an earlier read (a handshake, an RPC reply) come first
        lock = self.gate.lock
        try:
            with lock:
                for key in list(self.selector.get_map().values()):
                    if key.data is not None and key.data.reader.has_buffered():
                        self._drain(key)
            while self.remaining:
                events = self.selector.select()
                with lock:
                    for key, _ in events:
                        if key.data is None:  # stop(): the links left end here
                            self._end_all()
                            return
                        self._drain(key)
        finally:
            self._release()

    def _end_all(self) -> None:
        """End every link not ended yet (:meth:`link_ended`: its descriptor is closed
        where the reader owns it), as the channel closes."""
        for key in list(self.selector.get_map().values()):
            if key.data is None:
                continue
            self.selector.unregister(key.fd)
            self.gate.remove(key.fd)
            self.remaining -= 1
            try:
                self.link_ended(key.data, key.fd, EOFError("the channel closed"))
            except Exception:  # noqa: BLE001 - closing: the next link's end still comes
                logger.debug("ending a link at close failed", exc_info=True)

    def _drain(self, key: Any) -> None:
        """Deliver every frame already there (at least one); the link's end marks death."""
        link = key.data
        reader, deliver, load, wid = link.reader, self.hub.deliver, self.decode, link.worker_ids[0]
        try:
            while True:  # every frame already buffered, not just the first
                header, buffers, _ = reader.read()
                try:
                    msg = load(header, buffers)
                except UntrustedValueError as exc:
                    msg = self.refused(wid, exc)
                except Exception as exc:  # read whole, but it does not rebuild here
                    msg = self.undecodable(wid, header, exc)
                self.on_message(link, msg)
                deliver(wid, msg)
                if not reader.has_buffered():
                    break
        except Exception as exc:  # noqa: BLE001 - a refused or corrupt frame, a MemoryError
            # for a declared size...: the link ends (a reader thread that died silently
            # left every caller waiting for good; outside check)
            self.selector.unregister(key.fd)
            self.gate.remove(key.fd)
            self.remaining -= 1
            self.link_ended(link, key.fd, exc)


class ProcessChannel(LinkChannel):
    """Worker 0 in a thread of the controller; workers 1..N-1 as child processes."""

    kind = "process"

    def __init__(
        self, num_workers: int, num_groups: int = 1, entrypoint: str = "disco_core.worker"
    ) -> None:
        super().__init__(num_workers, num_groups)
        env = worker_env(num_workers)
        procs: list[ProcessWorkerLink] = []
        self.stderr: StderrTee | None = None
        link0: ThreadWorkerLink | None = None
        try:
            self.stderr, self.reader = start_worker_processes(
                self.hub, range(1, num_workers), num_workers, num_groups, entrypoint, env, procs
            )
            self.gates.append(self.reader.gate)
            self.procs = procs
            link0 = ThreadWorkerLink(0, num_workers, num_groups, self.hub)
            # Worker 0 imports the children's entrypoint for a global function it lacks.
            link0.worker.ctx.extra["entrypoint"] = entrypoint
            self._set_links([link0, *procs])
            self.wait_ready(range(1, num_workers), time.monotonic() + start_timeout())
            logger.info(
                "started %d worker process(es) running %s: pids %s",
                len(procs), entrypoint, [link.proc.pid for link in procs],
            )  # fmt: skip
        except BaseException:
            self.hub.closing = True
            # The threads this process already runs stop too: worker 0's and the
            # liveness watch (a Ctrl-C while the workers started left both for good:
            # an outside check, 12 threads after 6 interrupted starts).
            self._stopping = True
            self._closed.set()
            if link0 is not None:
                link0.stopped = True
                with contextlib.suppress(Exception):
                    link0.close(time.monotonic() + 1)
            for link in procs:  # each one, whatever the others do
                try:
                    link.kill()
                    link.close(time.monotonic() + 1)
                except Exception:  # noqa: BLE001 - the error being raised is the one to see
                    logger.debug("clean-up of worker %d failed", link.worker_ids[0], exc_info=True)
            raise

    def close(self, timeout: float = 5.0) -> None:
        super().close(timeout)
        self.reader.stop()
        self.reader.join(timeout=1.0)
        if self.stderr is not None:
            self.stderr.join(timeout=1.0)  # the workers' last words
