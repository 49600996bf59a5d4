"""Tracing a session from the controller: :func:`trace`, ``Session.create(trace=)``, ``DISCO_TRACE``.

While a trace is on, every worker records the commands it runs and the CCL
operations inside them into a bounded ring of its own (``disco.trace_start``);
the controller records each ``call_packed`` it sends (with the caller's source
line) and each synchronising call. Nothing crosses the control plane per event:
at the end the controller fetches each worker's ring once (``disco.trace_stop``)
and writes one Chrome trace-event JSON file (:mod:`disco_core.tracing.format`).

Workers' clocks are put on the controller's with an offset measured at the start
and at the end of the trace, from the fastest of several round trips to each
worker (the offset is within half that round trip of the truth; the file says
how precise each worker's is). Between the two, the offset is interpolated.

While tracing is off nothing of this runs: the recording functions are put on
the session and worker *instances* when a trace starts and taken off when it ends.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import logging
import os
import stat
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from .. import _interrupts
from .. import protocol as P
from .._locks import owned, release_if_left
from ..errors import (
    DiscoError,
    DiscoFileNotFoundError,
    DiscoPermissionError,
    DiscoTimeoutError,
    DiscoTypeError,
    DiscoValueError,
    WorkerDiedError,
    WorkerError,
)
from ..settings import shutdown_timeout
from . import chrome, worker_side
from .recorder import (
    FIELDS,
    K_COLLECTIVE,
    K_SYNC,
    Recorder,
    SendRing,
    capacity_from_env,
    check_capacity,
    clock_identity,
    now,
)

__all__ = ["Trace", "trace", "start_from_env", "CLOCK_ROUNDS", "explicit"]

logger = logging.getLogger("disco_core.tracing")

#: Round trips per worker when a clock offset is measured (the fastest one counts).
CLOCK_ROUNDS = 8

#: Modules whose frames stand between the user's code and ``Session._call``: a send's
#: ``site`` is the first frame outside them (the demo and the kits are users, too).
_SESSION_MODULES = ("disco_core.session", "disco_core.host_array")
#: The controller's synchronising methods a trace records (by the name the trace shows).
_SYNC_METHODS = {
    "_sync_worker": "sync_worker",
    "_sync_all": "sync_all",
    "_debug_get": "debug_get_from_remote",
    "_debug_set": "debug_set_register",
    "copy_from_worker_0": "copy_from_worker_0",
    "copy_to_worker_0": "copy_to_worker_0",
}
#: True while ``Session.create(trace=...)`` builds its session: DISCO_TRACE then stays out.
explicit: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "disco_explicit_trace", default=False
)
#: The global functions whose sends carry the caller's source line (``site``): Disco's
#: collectives, which ``disco trace summary`` groups by it.
COLLECTIVE_FUNCTIONS = frozenset(
    f"{prefix}.{name}"
    for prefix in ("disco", "runtime.disco")
    for name in (
        "allreduce", "allgather", "broadcast_from_worker0", "scatter_from_worker0",
        "gather_to_worker0", "barrier", "send_to_worker", "recv_from_worker",
        "recv_from_worker0", "send_to_next_group", "recv_from_prev_group",
        "share_with_group_roots",
    )
)  # fmt: skip
_env_sessions = [0]  # sessions traced through DISCO_TRACE so far (for their file names)
#: DISCO_TRACE's traces still running (the exit handler writes them); a trace leaves
#: the set when it stops, so a shut-down session is not kept alive until exit
_at_exit: set[Trace] = set()
_env_lock = threading.Lock()
_claim_lock = threading.Lock()
#: The files of the traces running in this process (by real path), so that a second
#: trace into one file is refused at its start: the last to stop would overwrite the
#: other's file silently. (Under _claim_lock.)
_files_in_use: dict[str, Trace] = {}
#: The files every trace of this process was started into (by real path): a later
#: DISCO_TRACE file skips them, so that it overwrites no file of a ``disco.trace``
#: block (or of an earlier session) of the same program. (Added to under _claim_lock.)
_files_used: set[str] = set()


class Trace:
    """One trace of one session, written to ``path`` when it stops.

    Made by :func:`trace` (a context manager), by ``Session.create(..., trace=path)``
    and by ``DISCO_TRACE=path``; a session that shuts down stops its trace first.

    Parameters
    ----------
    session : Session
        The session to trace (one trace at a time).
    path : str or os.PathLike
        The JSON file to write.
    capacity : int, optional
        Events kept per worker and for the controller (the newest ones; default
        ``DISCO_TRACE_EVENTS`` or 65,536: 4 MiB of records, 7 MiB for a worker's
        two rings; 1,024 to 16,777,216).
    """

    def __init__(self, session: Any, path: str | os.PathLike, capacity: int | None = None) -> None:
        # (the tracing layer sits below the session module: no isinstance of Session)
        if not all(hasattr(session, a) for a in ("call_packed", "_state", "_sync_all")):
            raise DiscoTypeError(f"trace: session must be a disco_core Session, got {type(session).__name__}")  # fmt: skip
        path = self.check_path(path)
        if capacity is None:
            capacity = capacity_from_env()
        else:
            capacity = check_capacity(capacity, "trace: capacity")
        self.session = session
        self.path = path
        # where check_path looked: a later chdir (a library's, a daemon's) moves nothing
        self._target = os.path.abspath(path)
        self.capacity = capacity
        self.active = False
        self._rec: Recorder | None = None
        self._clocks: list[chrome.ClockFit | None] = []
        self._t_start = 0
        self._lock = threading.RLock()  # re-entrant: it knows its owner (disco_core._locks)
        #: the ``with disco.trace`` block of this trace has ended (its stop may have been cut)
        self.ended = False
        self._key = ""  # the file's real path, in _files_in_use while the trace runs
        self._stopped: Any = None  # while stopping: the disco.trace_stop call, once sent
        self._t_end = 0  # while stopping: the window's end
        #: For each worker, True when it reads the controller's own clock (offset 0 exactly).
        self.shared_clock = [False] * session.num_workers
        #: Started by ``DISCO_TRACE`` (``start_from_env``): a ``disco.trace`` block
        #: on the session ends it and starts the next one after the block.
        self.from_env = False
        #: This trace ended a ``DISCO_TRACE`` one as it started (see ``trace``).
        self.took_over_env = False

    @staticmethod
    def check_path(path: Any) -> str:
        """``path`` as a str, if a trace file can be written there; else a clear error."""
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
            raise DiscoTypeError(f"trace: path must be a file name, got {path!r}")
        path = os.fspath(path)
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            # (a name under a file said "does not exist" of a folder that exists as a file)
            what = "is a file, not a folder" if os.path.exists(folder) else "does not exist"
            raise DiscoValueError(f"trace: the folder of {path!r} ({folder}) {what}")
        if os.path.isdir(path):
            raise DiscoValueError(f"trace: {path!r} is a folder, not a file name")
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            info = None
        except OSError as exc:
            raise DiscoValueError(f"trace: cannot look at {path!r}: {exc}") from None
        if info is not None and not stat.S_ISREG(info.st_mode):
            # the file is written whole and renamed over the name: a device (/dev/null),
            # a pipe or a symlink there would be replaced by a plain file
            raise DiscoValueError(
                f"trace: {path!r} exists and is not a regular file ({_file_kind(info.st_mode)}); "
                "a trace replaces the file at its path: choose another name"
            )
        # Writable, tried for real (os.access says yes to root in /proc, where no file
        # can be made): now, not when the file is written at the end of the run.
        try:
            chrome.probe_folder(folder)
        except OSError as exc:
            # a permission error only when it is one: /proc refuses new files with ENOENT
            error = DiscoPermissionError if isinstance(exc, PermissionError) else DiscoValueError
            raise error(
                f"trace: no file can be written in the folder of {path!r}: {exc.strerror or exc}"
            ) from None
        # In a sticky folder (/tmp) a name another user made (a file) cannot be
        # replaced: say so now, not when the file is written at the end of the run.
        if info is None:
            return path
        owner = info.st_uid
        me = os.geteuid()
        info = os.stat(folder)
        if info.st_mode & stat.S_ISVTX and me not in (0, owner, info.st_uid):
            raise DiscoPermissionError(
                f"trace: {path!r} belongs to another user (uid {owner}) in a sticky folder: "
                "it cannot be replaced; choose another name"
            )
        return path

    # ------------------------------------------------------------------ start / stop
    def start(self) -> Trace:
        """Start recording on the controller and every worker; return ``self``."""
        session = self.session
        state = session._state
        key = _real_key(self._target)
        running = state.get("trace")
        if running is not None and running.ended:
            # Its ``with`` block ended, and Ctrl-C cut the stop before it began: written now
            running.stop()
        elif running is not None and running.from_env:
            # A whole-program trace must not change what the program does: one that
            # used disco.trace itself failed under DISCO_TRACE, "already being traced"
            # (outside check). That trace's file ends here; the next starts after the block.
            if running._key == key:
                raise DiscoValueError(
                    f"trace: {self.path!r} is the file of this session's DISCO_TRACE trace: "
                    "choose another name"
                )
            logger.info(
                "trace %s: ends as a disco.trace block starts (%s)", running.path, self.path
            )
            running.stop()
            self.took_over_env = True
        try:
            return self._claim_and_start(key)
        except BaseException:
            if self.took_over_env:  # refused, or cut as it started: the program's trace goes on
                self.took_over_env = False
                try:
                    start_from_env(session)
                except Exception as exc:  # noqa: BLE001 - the block's own error is the one to see
                    logger.warning("DISCO_TRACE could not start again: %s", exc)
            raise

    def _claim_and_start(self, key: str) -> Trace:
        session = self.session
        state = session._state
        with _claim_lock:  # the check and the claim at once: two threads may start a trace
            running = state.get("trace")
            if running is not None:
                raise DiscoError(f"this session is already being traced (into {running.path!r})")
            other = _files_in_use.get(key)
            if other is not None:
                raise DiscoValueError(
                    f"trace: {self.path!r} is the file of another running trace (of "
                    f"{'this' if other.session is session else 'another'} session); "
                    "the last to stop would overwrite the other's: choose another name"
                )
            state["trace"] = self
            _files_in_use[key] = self
            _files_used.add(key)
        self._key = key
        try:
            return self._start()
        except BaseException:
            state["trace"] = None
            self._release_file()
            self._uninstall()
            if self._rec is not None:  # trace_start went out: the workers that took it
                with contextlib.suppress(Exception):  # would record until the next trace
                    session.call_packed("disco.trace_stop")
                    session._sync_all()
            raise

    def _release_file(self) -> None:
        with _claim_lock:
            if _files_in_use.get(self._key) is self:
                del _files_in_use[self._key]

    def _start(self) -> Trace:
        session = self.session
        session._check_open()
        start = session._get_cached_method("disco.trace_start")
        session._get_cached_method("disco.trace_stop")
        session._get_cached_method("disco.trace_clock")
        session._sync_all()  # every earlier command (and error) before the trace
        clocks = self._measure_clocks()
        self._rec = rec = Recorder(self.capacity)
        # The workers number their commands from trace_start on, and the controller its
        # sends from the same command: both at once under the send lock, so no other
        # thread's send falls between them (it would shift every later number).
        with session._lock:
            session.call_packed(start, self.capacity)
            self._install(rec)
        type(session)._sync_all(session)  # every worker records from here (not recorded)
        # The window opens once every worker records: what the workers did for the
        # trace's own start (that sync) ends before it and is left out of the file.
        self._t_start = now()
        self._clocks = [
            chrome.ClockFit(t, off, prec) if off is not None else None for t, off, prec in clocks
        ]
        self.active = True
        logger.info("trace started: %s, %d events per worker at most", self.path, self.capacity)
        return self

    def stop(self, within: float | None = None) -> str:
        """Stop recording, gather every worker's events and write the file; return its path.

        A worker that cannot answer (it died) leaves its track empty, with a note in
        the file; the rest is still written.

        Parameters
        ----------
        within : float, optional
            Seconds to wait for the workers in all (what a shutdown allows): a worker
            that has not answered by then (busy in a long function, stopped) leaves
            its track empty, with a note, and the end of the trace is not measured
            again on the clocks. None (the default) waits for every worker.

        Raises
        ------
        WorkerError
            A command sent while tracing failed (the error the next synchronising call
            would have raised); the file is written first, with every worker's events.
        """
        # A bounded stop (a shutdown's) waits for another thread's stop no longer than
        # it allows; the session's state names this trace until the file is written,
        # so that a shutdown from another thread waits for it.
        lock = self._lock
        owned_before = owned(lock)
        try:
            if not lock.acquire(timeout=-1 if within is None else max(0.0, within)):
                return self.path
            try:
                if not self.active:
                    return self.path
                try:
                    return self._stop(within)
                finally:
                    # (an interrupt before _stop began leaves the trace running: the
                    # next trace of the session, or its shutdown, stops it)
                    if not self.active:
                        if self.session._state.get("trace") is self:
                            self.session._state["trace"] = None
                        self._release_file()  # only now: another trace may start into the file
            finally:
                lock.release()
        except BaseException:
            # Ctrl-C right after the acquire left the lock taken, and every later trace
            # of the session said "already being traced" (outside check)
            release_if_left(lock, owned_before)
            raise

    def _stop(self, within: float | None) -> str:
        """:meth:`stop`'s work, under its lock: marks the trace stopped and writes its file.

        What was gathered is written even when the gathering is cut short: by a
        worker's death (the live workers are still asked, :meth:`_gather_after_death`)
        or by Ctrl-C (the file is written with what is here, then the
        ``KeyboardInterrupt`` goes on).
        """
        notes: list[str] = []
        workers: list[dict | None] = [None] * self.session.num_workers
        pending: DiscoError | None = None
        try:
            # Inside the try: Ctrl-C anywhere from here on still writes the file
            # (outside check: one in the uninstall below lost it for good)
            self.active = False
            self._stopped = None  # the disco.trace_stop call, once sent
            self._t_end = now()  # the window's end: moved once the workers ran everything
            with _env_lock:
                _at_exit.discard(self)
            # The sends are recorded until the stop goes out (_send_stop): the workers
            # number every command before it, another thread's included
            self._uninstall(sends=False)
            if within is not None:
                self._gather_within(within, notes, workers)
            else:
                pending = self._gather(notes, workers)
            self._uninstall()  # (if the stop never went out)
        except KeyboardInterrupt:
            self.active = False
            with _env_lock:
                _at_exit.discard(self)
            self._uninstall()  # finished, if the interrupt cut it
            self._t_end = self._t_end or now()
            self.session._abandon_answers()  # what it asked for may still come (ReplyHub)
            notes.append("the stop was interrupted (KeyboardInterrupt): the events of the workers not gathered by then are missing")  # fmt: skip
            if within is None:  # the wait had no bound: one more try, bounded as a shutdown is
                with contextlib.suppress(KeyboardInterrupt):
                    self._gather_within(shutdown_timeout(), notes, workers)
            self._in_process_events(workers, self._stopped, keep=True)
            self._write(workers, self._t_end, notes, None)
            self.session._abandon_answers()  # the retry's, too
            raise
        try:
            return self._write(workers, self._t_end, notes, pending)
        except KeyboardInterrupt:
            # Ctrl-C while the file was written (outside check: 4-7 of 95 stops lost it
            # for good): written again, whole, then the interrupt goes on
            self._write(workers, self._t_end, notes, None)
            raise

    def _gather(self, notes: list[str], workers: list[dict | None]) -> DiscoError | None:
        """The events of every worker, waiting as long as they take (the block ended
        normally), into ``workers``; returns the error to raise once the file is
        written: a command's failure, or a worker's death met here."""
        session = self.session
        pending: DiscoError | None = None
        # a death the session knew of before is no news to the program (it raised it,
        # or its next call will): a death met here is
        hub = getattr(session._channel, "hub", None)
        known_dead = hub is not None and bool(hub.dead or hub.write_failed)
        try:
            # The block's own commands first: their error is the program's, raised
            # after the file is written (as the next sync would), not the trace's.
            session._sync_all()
        except WorkerError as exc:  # not WorkerDiedError: the session still runs
            pending = exc
        except Exception:  # noqa: BLE001, S110 - the gathering below meets it and notes it
            pass
        # The window closes when every worker has run every command sent in it.
        self._t_end = now()
        try:
            stopped = self._send_stop()
            session._sync_all()
            try:
                for w, (t, off, prec) in enumerate(self._measure_clocks()):
                    fit = self._clocks[w]
                    if fit is not None and off is not None:
                        fit.t_end, fit.offset_end, fit.precision_end = t, off, prec
            except WorkerDiedError:
                raise
            except Exception as exc:  # noqa: BLE001
                notes.append(f"the clocks were not measured again at the end ({type(exc).__name__}: {exc})")  # fmt: skip
            for w in range(session.num_workers):
                try:
                    workers[w] = _checked_export(stopped.debug_get_from_remote(w), self.capacity)
                except WorkerDiedError:
                    raise
                except Exception as exc:  # noqa: BLE001 - one worker's loss is a note
                    notes.append(f"worker {w}: no events ({type(exc).__name__}: {exc})")
        except WorkerDiedError as exc:
            self._gather_after_death(workers, self._stopped, shutdown_timeout(), notes, exc)
            return None if known_dead else exc  # news: the block ended without meeting it
        except Exception as exc:  # noqa: BLE001 - what can be had is still written
            notes.append(f"the worker processes' events could not be gathered ({type(exc).__name__}: {exc})")  # fmt: skip
            self._in_process_events(workers, self._stopped)
        return pending

    def _write(self, workers: list[dict | None], t_end: int, notes: list[str], pending: DiscoError | None) -> str:  # fmt: skip
        """Write the file from the gathered events; raise ``pending`` after."""
        session = self.session
        for w, got in enumerate(workers):
            if got is not None and self._clocks[w] is None:
                notes.append(f"worker {w}: no events (its clock answer was not a clock, so its times cannot be placed)")  # fmt: skip
        rec = self._rec
        assert rec is not None
        data = chrome.TraceData(
            session={
                "channel": session.channel.kind,
                "num_workers": session.num_workers,
                "num_groups": session.num_groups,
            },
            t_start=self._t_start,
            t_end=t_end,
            controller=rec.export(),
            workers=workers,
            clocks=[c if workers[w] is not None else None for w, c in enumerate(self._clocks)],
            method=(
                "workers on the controller's kernel clock (same boot id, no time "
                "namespace offset): offset 0 exactly; the others: the fastest of "
                f"{CLOCK_ROUNDS} round trips (a disco.trace_clock call and its reply) at "
                "the start and at the end, offset = worker clock - midpoint of the round "
                "trip, precision = half that round trip, interpolated in between"
            ),
            notes=notes,
        )
        try:
            chrome.write(data, self._target)
        except OSError as exc:  # the folder went away, became read-only, the disk filled
            cls = (
                DiscoFileNotFoundError if isinstance(exc, FileNotFoundError)
                else DiscoPermissionError if isinstance(exc, PermissionError)
                else DiscoError
            )  # fmt: skip
            raise cls(f"trace: could not write {self.path!r}: {exc.strerror or exc}") from exc
        logger.info("trace written: %s", self.path)
        for note in notes:
            logger.warning("trace %s: %s", self.path, note)
        if pending is not None:
            raise pending
        return self.path

    def _in_process_ids(self) -> set[int]:
        """The ids of the workers that run in this process."""
        return {
            link.worker.ctx.worker_id
            for link in getattr(self.session.channel, "links", ())
            if getattr(link, "in_process", False) and getattr(link, "worker", None) is not None
        }

    def _in_process_events(self, workers: list[dict | None], stopped: Any, keep: bool = False) -> None:  # fmt: skip
        """Read the events of the workers in this process straight from them (the
        session cannot ask: a worker died), into ``workers`` (``keep``: not over
        events already there)."""
        for link in getattr(self.session.channel, "links", ()):
            worker = getattr(link, "worker", None)
            if getattr(link, "in_process", False) and worker is not None:
                w = worker.ctx.worker_id
                if keep and workers[w] is not None:
                    continue
                got = worker_side.stop(worker.ctx)  # (the stop may already have run)
                if got is None and stopped is not None:
                    got = worker.regs.get(stopped.reg_id)
                workers[w] = got if isinstance(got, dict) else None

    def _gather_after_death(self, workers: list[dict | None], stopped: Any, within: float, notes: list[str], death: WorkerDiedError) -> None:  # fmt: skip
        """After a worker died: the events of every worker still alive, into ``workers``.

        The session asks its workers nothing once one is dead (every wait raises), so
        the in-process workers are read directly and the live worker processes are
        asked through the channel's ``recv_despite_deaths`` (a channel without it
        keeps only the in-process tracks), all at once, ``within`` seconds in all.
        """
        notes.append(f"a worker died during the trace: {death}")
        self._in_process_events(workers, stopped, keep=True)
        session = self.session
        channel = session._channel
        recv = getattr(channel, "recv_despite_deaths", None)
        dead = set(getattr(getattr(channel, "hub", None), "dead", ())) | set(death.worker_ids)
        ask = [w for w in range(session.num_workers) if workers[w] is None and w not in dead]
        for w in sorted(dead):
            workers[w] = None
            notes.append(f"worker {w}: no events (it died)")
        if not ask:
            return
        if recv is None:
            for w in ask:
                notes.append(f"worker {w}: no events (the {channel.kind} channel cannot ask one worker while another is dead)")  # fmt: skip
            return
        deadline = time.monotonic() + within
        try:
            if stopped is None:  # the stop was not sent: to the live workers only
                func = session._cache["disco.trace_stop"]  # cached when the trace started
                with session._lock:
                    reg = session._free_regs.pop() if session._free_regs else session._alloc()
                for w in ask:
                    session._send((P.CALL_PACKED, reg, func.reg_id, ()), [w])
            else:
                reg = stopped.reg_id
        except Exception as exc:  # noqa: BLE001 - what can be had is written
            notes.append(f"the live workers' events could not be asked for ({type(exc).__name__}: {exc})")  # fmt: skip
            return
        late = f"it did not answer within {within:g} s: busy, maybe in a collective with the dead worker"  # fmt: skip
        self._fetch(ask, reg, deadline, recv, workers, notes, late, after_death=True)

    def _fetch(self, ask: list[int], reg: int, deadline: float, recv: Any, workers: list[dict | None], notes: list[str], late: str, after_death: bool = False) -> None:  # fmt: skip
        """Ask each worker of ``ask`` for the events in register ``reg``, all at once, and
        take the answers as they come until ``deadline`` (one slow worker does not use
        up the others' time); ``recv(worker, timeout)`` takes an answer.

        ``after_death``: a reply that is not events is one to a wait the death cut
        short (skipped), and a worker's own death is a note, not an error.
        """
        session = self.session
        waiting = []
        for w in ask:
            try:
                session._send((P.DEBUG_GET_FROM_REMOTE, reg, w), [w])
                waiting.append(w)
            except WorkerDiedError:
                if not after_death:
                    raise
                notes.append(f"worker {w}: no events (it died)")
            except Exception as exc:  # noqa: BLE001 - one worker's loss is a note
                notes.append(f"worker {w}: no events ({type(exc).__name__}: {exc})")
        while waiting:
            for w in list(waiting):
                try:
                    got = recv(w, 0.01)
                except DiscoTimeoutError:
                    if time.monotonic() > deadline:
                        waiting.remove(w)
                        self._give_up(w)
                        notes.append(f"worker {w}: no events ({late})")
                    continue
                except WorkerError as exc:
                    if after_death:
                        continue  # the failure of a wait the death cut short
                    # the answer itself: the register holds the stop's failure (it did
                    # not wait 5 s more for an answer that would never come: re-check)
                    waiting.remove(w)
                    notes.append(f"worker {w}: no events (its stop failed: {str(exc).splitlines()[0]})")  # fmt: skip
                    continue
                except WorkerDiedError:
                    if not after_death:
                        raise
                    waiting.remove(w)
                    notes.append(f"worker {w}: no events (it died)")
                    continue
                except Exception as exc:  # noqa: BLE001 - one worker's loss is a note
                    waiting.remove(w)
                    notes.append(f"worker {w}: no events ({type(exc).__name__}: {exc})")
                    continue
                if after_death and not isinstance(got, dict):
                    continue
                waiting.remove(w)
                try:
                    workers[w] = _checked_export(got, self.capacity)
                except Exception as exc:  # noqa: BLE001 - one worker's loss is a note
                    notes.append(f"worker {w}: no events ({type(exc).__name__}: {exc})")

    def _gather_within(self, within: float, notes: list[str], workers: list[dict | None]) -> None:  # fmt: skip
        """The workers' events into ``workers`` and the window's end, waiting ``within``
        seconds at most for each step (a sync, the stop, the events): a worker that
        does not answer in time is left out (with a note), and is asked nothing more
        (its answers that come late are dropped: :meth:`_give_up`)."""
        session = self.session
        n = session.num_workers
        lock = session._sync_lock
        owned_before = owned(lock)
        try:
            if not lock.acquire(timeout=max(0.0, within)):
                notes.append(f"no worker's events: another thread's synchronising call held the session for {within:g} s")  # fmt: skip
                return
        except BaseException:
            # a signal handler's exception right after the acquire left the session's
            # lock taken, and its next synchronising call waited for ever
            release_if_left(lock, owned_before)
            raise
        try:
            try:
                live = self._answering(range(n), within)
                skip: set[int] = set()
                if self._stopped is None:
                    self._t_end = now()  # the window closes when the live workers ran everything
                    self._send_stop()
                else:
                    # A retry after Ctrl-C cut the gathering. The workers that ran the
                    # first stop would answer a second one with nothing: its register is
                    # read. The workers of this process ran it on this thread, where the
                    # interrupt may have cut it: the caller reads them directly.
                    skip = self._in_process_ids()
                live = self._answering(live, within)
                for w in range(n):
                    if w not in live:
                        notes.append(f"worker {w}: no events (it did not answer within {within:g} s: busy, stopped or gone)")  # fmt: skip
                late = f"it did not answer within {within:g} s"
                recv = session._channel.recv
                ask = [w for w in live if w not in skip]
                self._fetch(ask, self._stopped.reg_id, time.monotonic() + within, recv, workers, notes, late)  # fmt: skip
            except WorkerDiedError as exc:
                self._gather_after_death(workers, self._stopped, within, notes, exc)
            except Exception as exc:  # noqa: BLE001 - what can be had is written
                notes.append(f"the worker processes' events could not be gathered ({type(exc).__name__}: {exc})")  # fmt: skip
                self._in_process_events(workers, self._stopped, keep=True)
        finally:
            lock.release()

    @_interrupts.protect(blocking=True)
    def _send_stop(self) -> Any:
        """Send ``disco.trace_stop`` and keep its register in ``_stopped``: Ctrl-C waits
        for both (a retry must read that register, as a worker that ran the stop has
        nothing more to give; outside check: 59 of 126 interrupted stops noted "no
        events" for workers that had answered). The sends stop being recorded in the
        same step, under the send lock: another thread's commands sent before the stop
        were recorded by the workers and not by the controller (re-check: ~230 a
        trace under a flood)."""
        session = self.session
        try:
            with session._lock:  # the last send recorded is the last before the stop
                session.__dict__.pop("_record_send", None)
                self._stopped = session.call_packed("disco.trace_stop")
            return self._stopped
        finally:
            _interrupts.deliver()

    def _give_up(self, worker: int) -> None:
        """Wait for no answer of ``worker`` asked so far: one that comes late is dropped
        (it would be taken for the program's next call's)."""
        hub = getattr(self.session._channel, "hub", None)
        if hub is not None:
            hub.abandon([worker])

    def _answering(self, among: Any, within: float) -> list[int]:
        """The workers of ``among`` that answer a sync within ``within`` seconds (all
        waited for at once: one busy worker does not use up the others' time)."""
        session = self.session
        waiting = list(among)
        for w in waiting:
            session._send((P.SYNC_WORKER, w), [w], shared=True)
        deadline = time.monotonic() + within
        live = []
        while waiting:
            for w in list(waiting):
                try:
                    session._channel.recv(w, timeout=0.01)
                except DiscoTimeoutError:
                    if time.monotonic() > deadline:
                        waiting.remove(w)  # busy or stopped: left out
                        self._give_up(w)
                    continue
                except WorkerError:
                    pass  # it answered, with an earlier command's failure
                except WorkerDiedError:
                    raise  # the session asks no worker anything more (the caller's note)
                except Exception:  # noqa: BLE001 - gone: left out
                    waiting.remove(w)
                    continue
                waiting.remove(w)
                live.append(w)
        return sorted(live)

    # ------------------------------------------------------------------ clocks
    def _measure_clocks(self) -> list[tuple[int, int | None, int]]:
        """Per worker: (controller time, worker - controller offset, precision), all in ns.

        A worker on this kernel's clock (same boot id, no shifting time namespace)
        has offset 0 exactly; the others get the offset of the fastest of
        :data:`CLOCK_ROUNDS` round trips, within half that round trip.
        """
        session = self.session
        clock = session._get_cached_method("disco.trace_clock")
        mine = clock_identity()
        out: list[tuple[int, int | None, int]] = []
        for w in range(session.num_workers):
            best: tuple[int, int, int] | None = None
            for _ in range(CLOCK_ROUNDS):
                t0 = now()
                value = session.call_packed(clock).debug_get_from_remote(w)
                t1 = now()
                if not (
                    isinstance(value, tuple)
                    and len(value) == 2
                    and type(value[0]) is int
                    and -_INT64 <= value[0] < _INT64  # a clock the file's floats can hold
                ):
                    break  # not our worker function's answer: no offset for this worker
                mid = (t0 + t1) // 2
                if mine and value[1] == mine:
                    best = (mid, 0, 0)
                    self.shared_clock[w] = True
                    break
                if best is None or t1 - t0 < best[2] * 2:
                    best = (mid, value[0] - mid, (t1 - t0) // 2)
            out.append(best if best is not None else (now(), None, 0))
        return out

    # ------------------------------------------------------------------ controller hooks
    def _install(self, rec: Recorder) -> None:
        """Put the send recorder and the recording methods on the session instance."""
        session = self.session
        Session = type(session)  # its class's own methods, under the recording ones
        intern = rec.intern
        cache = session._cache
        # func register -> its name id, or ~id (< 0) for a collective: the functions the
        # session caches; the others' names come from worker 0's events when the file is
        # written. A register not in the cache is remembered as unknown too (a lookup per
        # command cost ~0.1 us). The cache only grows (``_get_cached_method``): when it
        # did, ``known`` is forgotten, so a register freed and taken by a newly cached
        # function is renamed.
        known: dict[int, int] = {}
        unknown = intern("")
        no_site = unknown
        cached = 0  # the cache's size when ``known`` was filled

        def lookup(reg: int) -> int:
            nonlocal cached
            if len(cache) != cached:
                known.clear()
                cached = len(cache)
            if not known:
                for name, d in cache.items():
                    i = intern(name)
                    known[d.reg_id] = ~i if name in COLLECTIVE_FUNCTIONS else i
            found = known[reg] = known.get(reg, unknown)
            return found

        # A collective's call site: (code's id, instruction) -> site id. The codes are
        # kept alive meanwhile, so an id is not reused (hashing a code object hashes
        # its contents: ~0.1 us). The session's own modules are told by their globals.
        sites: dict[tuple[int, int], int] = {}
        codes: list[Any] = []
        inner_a, inner_b = (sys.modules[m].__dict__ for m in _SESSION_MODULES)

        def new_site(frame: Any) -> int:
            """The site id of ``frame``'s instruction, first seen (None: no user frame)."""
            if frame is None:
                return intern("?")
            code = frame.f_code
            codes.append(code)
            found = sites[(id(code), frame.f_lasti)] = intern(
                f"{os.path.basename(code.co_filename)}:{frame.f_lineno}"
            )
            return found

        getframe = sys._getframe
        sends = rec.sends = SendRing(rec.capacity)
        ring, step, size, pack = sends.writer()
        offset = 0  # where the next send goes in the ring
        sends.track(lambda: offset)
        lap = sends.lap

        def record_send(func_reg: int, t0: int) -> None:
            # The hot path of a traced session, every step counted: ``Session._call``
            # calls this under its send lock, after the send (its time read before),
            # and a three-field record is written; its seq is its place in the ring,
            # and no counter but the write offset is kept.
            nonlocal offset
            name = known.get(func_reg)
            if name is None or len(cache) != cached:
                name = lookup(func_reg)
            o = offset
            if name >= 0:
                pack(ring, o, name, t0, no_site)
            else:
                # A collective: where in the user's code it was called, the first
                # frame outside the session's modules (told by their globals: one
                # identity test a frame), keyed by the code's id and instruction (a
                # frame's line number is computed from it each time it is read)
                frame: Any = getframe(2)  # 0: this function, 1: _call, 2: its caller
                while frame is not None and (
                    frame.f_globals is inner_a or frame.f_globals is inner_b
                ):
                    frame = frame.f_back
                site = None if frame is None else sites.get((id(frame.f_code), frame.f_lasti))  # fmt: skip
                pack(ring, o, ~name, t0, new_site(frame) if site is None else site)
            o += step
            offset = o if o < size else lap()

        session._record_send = record_send
        # one flag for all the methods: a second thread's first call of any of them
        shared = [False]
        for method, shown in _SYNC_METHODS.items():
            session.__dict__[method] = self._recording_sync(getattr(Session, method), shown, rec, shared)  # fmt: skip

    def _recording_sync(self, method: Any, shown: str, rec: Recorder, shared: list[bool]) -> Any:  # fmt: skip
        session = self.session
        name = rec.intern(shown)
        ring, pack, cap = rec._ring, rec._pack, rec.capacity
        # which argument names the worker (None: worker 0) and which holds the bytes
        at = {"sync_worker": 0, "debug_get_from_remote": 1, "debug_set_register": 1}.get(shown)
        copies = shown.startswith("copy_")

        # The controller's track holds one thread's calls at a time: these calls take the
        # session's sync lock, and one timed from before the lock (while another
        # thread's call held it) overlapped that call's slice without nesting, which
        # Perfetto cannot show (outside check: 31 overlaps, two threads). Once a second
        # thread uses the session, each call is timed while it holds the lock (an
        # RLock: the method takes it again); until then no lock is taken here (a call's
        # ~0.1 us). A call of the first thread already under way when a second thread
        # first calls is left out of the track: it may overlap that call (re-check).
        lock = session._sync_lock
        first = threading.get_ident()

        def locked(call: Any, *args: Any) -> Any:
            shared[0] = True
            owned_before = owned(lock)
            try:
                if not lock.acquire(False):
                    session._wait_for_sync_lock()
                try:
                    return call(*args)
                finally:
                    lock.release()
            except BaseException:
                release_if_left(lock, owned_before)
                raise

        if shown == "sync_worker":  # the common one (sync_worker_0): no *args to build

            def timed_sync_worker(worker_id: int) -> Any:
                t0 = now()
                try:
                    return method(session, worker_id)
                finally:
                    t1 = now()
                    n = rec.count  # the recorder's add() inlined: once per sync
                    pack(ring, (n % cap) * 64, K_SYNC, name, t0, t1, -1, 0, worker_id if type(worker_id) is int else 0, 0)  # fmt: skip
                    rec.count = n + 1

            def recording_sync_worker(worker_id: int) -> Any:
                if shared[0] or threading.get_ident() != first:
                    return locked(timed_sync_worker, worker_id)
                t0 = now()
                try:
                    return method(session, worker_id)
                finally:
                    if not shared[0]:
                        t1 = now()
                        n = rec.count
                        pack(ring, (n % cap) * 64, K_SYNC, name, t0, t1, -1, 0, worker_id if type(worker_id) is int else 0, 0)  # fmt: skip
                        rec.count = n + 1

            return recording_sync_worker

        def record(t0: int, args: tuple) -> None:
            t1 = now()
            worker = args[at] if at is not None and len(args) > at else 0
            nbytes = getattr(args[0], "nbytes", 0) if copies and args else 0
            rec.add(K_SYNC, name, t0, t1, -1, 0, worker if type(worker) is int else 0, nbytes if type(nbytes) is int else 0)  # fmt: skip

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = now()
            try:
                return method(session, *args, **kwargs)
            finally:
                record(t0, args)

        def recording(*args: Any, **kwargs: Any) -> Any:
            if shared[0] or threading.get_ident() != first:
                return locked(lambda: timed(*args, **kwargs))
            t0 = now()
            try:
                return method(session, *args, **kwargs)
            finally:
                if not shared[0]:
                    record(t0, args)

        return recording

    def _uninstall(self, sends: bool = True) -> None:
        """Take the recording methods off the session; ``sends``: the send recorder too
        (else :meth:`_send_stop` takes it off, as the stop goes out)."""
        d = self.session.__dict__
        if sends:
            d.pop("_record_send", None)
        for method in _SYNC_METHODS:
            d.pop(method, None)


#: The longest event name a worker's answer may hold. Its recorder makes function names,
#: ``register N`` and a collective's attributes; every event repeats its name in the
#: file, so one long name would multiply into gigabytes on the controller's disk.
MAX_NAME_CHARS = 1024
_INT64 = 1 << 63


def _checked_export(value: Any, capacity: int) -> dict[str, Any]:
    """A worker's ``disco.trace_stop`` answer, if it is one (a remote worker may be anything).

    Everything :func:`chrome.build` and the readers use is checked here: no more rows
    than the worker's ring holds (``capacity``), short printable names (no terminal
    escapes for ``disco trace summary`` to print), counts a JSON writer can write, and
    collectives' attributes that parse.
    """
    if not isinstance(value, dict):
        raise DiscoValueError(f"the worker sent {type(value).__name__}, not its events")
    names, events, dropped = value.get("names"), value.get("events"), value.get("dropped")
    if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        raise DiscoValueError("the worker's event names are not a list of str")
    if not all(len(n) <= MAX_NAME_CHARS and n.isprintable() for n in names):
        raise DiscoValueError(
            f"the worker's event names are not all printable and at most {MAX_NAME_CHARS} chars"
        )
    if not (
        isinstance(events, np.ndarray)
        and events.dtype == np.dtype("<i8")
        and events.ndim == 2
        and events.shape[1] == FIELDS
    ):
        raise DiscoValueError(f"the worker's events are not an int64 array of {FIELDS} columns")
    if len(events) > capacity:
        raise DiscoValueError(f"the worker sent {len(events)} events, more than its ring holds ({capacity})")  # fmt: skip
    if type(dropped) is not int or not 0 <= dropped < _INT64:
        raise DiscoValueError("the worker's dropped count is not a count")
    if len(events):
        ids = events[:, 1]
        attrs = events[events[:, 0] == K_COLLECTIVE, 7]
        if ids.min() < 0 or ids.max() >= len(names) or (len(attrs) and (attrs.min() < 0 or attrs.max() >= len(names))):  # fmt: skip
            raise DiscoValueError("the worker's events name strings it did not send")
        for i in np.unique(attrs):
            try:
                chrome.parse_attrs(names[int(i)])
            except ValueError:
                raise DiscoValueError("a collective's attributes are malformed") from None
    return {"names": names, "events": events, "dropped": dropped}


def _file_kind(mode: int) -> str:
    for test, kind in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a named pipe"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return kind
    return "not a plain file"


@contextlib.contextmanager
def trace(session: Any, path: str | os.PathLike, *, capacity: int | None = None) -> Iterator[Trace]:
    """Trace ``session`` inside the ``with`` block; write ``path`` at its end.

    Parameters
    ----------
    session : Session
        The session to trace.
    path : str or os.PathLike
        The Chrome trace-event JSON file to write (``disco trace summary`` reads it;
        Perfetto and ``chrome://tracing`` open it).
    capacity : int, optional
        Events kept per worker (the newest; see :class:`~disco_core.tracing.session_trace.Trace`).

    Examples
    --------
    >>> with disco.ProcessSession(2) as sess, disco.trace(sess, "run.json"):  # doctest: +SKIP
    ...     sess.init_ccl("shm")
    ...     ...
    """
    t = Trace(session, path, capacity).start()
    try:
        try:
            yield t
        finally:
            t.ended = True  # stopped by the next trace, if an interrupt cuts the stop below
    except BaseException:
        if not session.is_closed:
            # The block failed (an error, Ctrl-C): the workers may be stuck in a
            # collective its controller side left, until the CCL's timeout. Wait as
            # a shutdown does; a worker that has not answered by then leaves its
            # track empty, with a note.
            try:
                t.stop(within=shutdown_timeout())
                if t.took_over_env:
                    start_from_env(session)
            except Exception as exc:  # noqa: BLE001 - the block's own exception is the one to see
                logger.warning("trace %s could not be written: %s", t.path, exc)
        raise
    if not session.is_closed:
        t.stop()
        if t.took_over_env:
            start_from_env(session)


def start_from_env(session: Any) -> Trace | None:
    """Start the trace ``DISCO_TRACE`` asks for (None when unset).

    The first session of a program writes ``DISCO_TRACE`` itself, the next ones
    ``name.1.json``, ``name.2.json``...; each file is written when its session
    shuts down, or at the program's exit. A ``disco.trace`` block on a session writes
    its own file: the session's ``DISCO_TRACE`` file ends as the block starts, and the
    next numbered one starts as it ends.
    """
    path = os.environ.get("DISCO_TRACE", "").strip()
    if not path:
        return None
    stem, ext = os.path.splitext(path)
    with _env_lock:
        while True:
            k = _env_sessions[0]
            _env_sessions[0] = k + 1
            # (a name without a suffix keeps none: "run", "run.1"; it was "run.1.json")
            name = f"{stem}.{k}{ext}" if k else path
            if k == 0 or _real_key(name) not in _files_used:
                break  # else a file this program wrote already (a disco.trace block's)
    path = name
    try:
        t = Trace(session, path)
    except DiscoError as exc:  # say where the path came from
        raise type(exc)(f"DISCO_TRACE: {exc}") from None
    t.from_env = True
    t.start()
    with _env_lock:
        if not _at_exit:
            atexit.register(_stop_at_exit)
        _at_exit.add(t)  # until it stops: a session never shut down is written at exit
    return t


def _real_key(path: str) -> str:
    """A trace file's key in :data:`_files_used` (its folder's real path and its name)."""
    target = os.path.abspath(path)
    return os.path.join(os.path.realpath(os.path.dirname(target)), os.path.basename(target))


def _stop_at_exit() -> None:
    with _env_lock:
        running = list(_at_exit)
    for t in running:
        try:
            if t.active and not t.session.is_closed:
                t.stop(within=shutdown_timeout())
        except Exception as exc:  # noqa: BLE001 - at exit: say it, never raise
            logger.warning("trace %s could not be written at exit: %s", t.path, exc)
