"""The chaos suite's engine: scenarios, a watchdog per iteration, resource snapshots.

Used by ``tests/chaos/test_chaos.py`` (a few iterations in CI, ``--long`` for 200)
and by ``bench/chaos.py`` (hundreds, with a summary table). Every iteration:

* starts a small session (2-3 workers) and checks it computes correctly,
* picks a victim (worker, agent, controller) and a moment (an allreduce loop, a
  copy of a few MiB in and out, idle) at random from a seeded generator,
* SIGKILLs or SIGSTOPs it (or makes a ThreadedSession worker raise or hang),
* asserts the documented error type and worker ids, the time to that error,
  that later calls raise too, that ``shutdown()`` returns in time, and that no
  process is left,

and the runner checks that no iteration blocks past its deadline (a watchdog that
dumps every thread's stack), and that open fds, memfds, threads, ``/dev/shm``
entries and child processes do not grow compared with a snapshot taken after a
warm-up iteration.
"""

from __future__ import annotations

import collections
import faulthandler
import importlib.util
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import disco_core as disco
from disco_core.testing.procfs import shm_in_use

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))


def _load_test_helpers():
    """The process helpers of the core's tests (tests/conftest.py), also outside pytest."""
    spec = importlib.util.spec_from_file_location(
        "_disco_tests_conftest", HERE.parent / "conftest.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_helpers = _load_test_helpers()
pid_gone = _helpers.pid_gone
wait_gone = _helpers.wait_gone
children_of = _helpers.children_of

# --------------------------------------------------------------------------- bounds
#: What the suite sets for the sessions it starts (read when a session or worker starts).
ENV = {
    "DISCO_LIVENESS_TIMEOUT": "2",
    "DISCO_GATHER_TIMEOUT": "3",
    "DISCO_HEARTBEAT_TIMEOUT": "2",
    "DISCO_SHUTDOWN_TIMEOUT": "3",
}
LIVENESS = float(ENV["DISCO_LIVENESS_TIMEOUT"])
GATHER = float(ENV["DISCO_GATHER_TIMEOUT"])
HEARTBEAT = float(ENV["DISCO_HEARTBEAT_TIMEOUT"])
SHUTDOWN = float(ENV["DISCO_SHUTDOWN_TIMEOUT"])
#: slack on every bound: a 2-core machine shared with other jobs
SLACK = 2.0
#: a killed worker is reported "within about a second or two"
DEATH_BOUND = 2.0 + SLACK
#: workers send something at least every second; silence for LIVENESS is unresponsive
LIVENESS_BOUND = LIVENESS + 1.0 + SLACK
HEARTBEAT_BOUND = HEARTBEAT + 1.0 + SLACK
GATHER_BOUND = GATHER + SLACK
SHUTDOWN_BOUND = SHUTDOWN + SLACK
#: processes must be gone this long after shutdown() (or their controller's death)
GONE_WITHIN = 5.0
TOKEN = "chaos-suite-token"
MiB = 1 << 20


def set_env(env: dict | None = None) -> dict:
    """Set the suite's environment; return what to restore."""
    old = {}
    for k, v in (env or ENV).items():
        old[k] = os.environ.get(k)
        os.environ[k] = v
    return old


def restore_env(old: dict) -> None:
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def unresponsive_error() -> type:
    """``disco.WorkerUnresponsiveError`` (NEW in the contract; fails clearly while missing)."""
    cls = getattr(disco, "WorkerUnresponsiveError", None)
    assert cls is not None, "disco_core.WorkerUnresponsiveError does not exist"
    assert issubclass(cls, disco.WorkerDiedError), "WorkerUnresponsiveError is no WorkerDiedError"
    return cls


# --------------------------------------------------------------------------- resources
def _fd_targets() -> dict[int, str]:
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass  # the fd of the listdir itself
    return out


def _dev_shm() -> set[str]:
    uid = os.getuid()
    out = set()
    try:
        for e in os.scandir("/dev/shm"):
            try:
                # a segment is a file of ours (a folder made there is somebody else's)
                if e.is_file(follow_symlinks=False) and e.stat(follow_symlinks=False).st_uid == uid:
                    out.add(e.name)
            except OSError:
                pass
    except OSError:
        pass
    return out


def _unused_shm(names: set[str]) -> set[str]:
    """Those of ``names`` in /dev/shm that no live process maps or holds open.

    A segment some live process still uses is not a leak of this run (another test
    suite may run beside this one, see scripts/test.sh); one left behind by a killed
    worker is used by nobody. A live child of ours is reported as a child anyway.
    """
    used = shm_in_use(names)
    return {n for n in names if n not in used and os.path.exists(f"/dev/shm/{n}")}


@dataclass
class Snapshot:
    fds: dict[int, str]
    threads: collections.Counter
    tasks: int
    shm: set[str]
    children: set[int]

    @property
    def memfds(self) -> int:
        return sum(1 for t in self.fds.values() if t.startswith("/memfd:"))


def snapshot() -> Snapshot:
    return Snapshot(
        fds=_fd_targets(),
        threads=collections.Counter(t.name for t in threading.enumerate()),
        tasks=len(os.listdir("/proc/self/task")),
        shm=_dev_shm(),
        children=children_of(os.getpid()),
    )


def growth(base: Snapshot, now: Snapshot) -> list[str]:
    """What ``now`` holds more of than ``base``: one line per kind of leak."""
    out = []
    if len(now.fds) > len(base.fds):
        new = sorted(set(now.fds.values()) - set(base.fds.values()))
        out.append(f"fds {len(base.fds)} -> {len(now.fds)} (new: {new[:8]})")
    if now.memfds > base.memfds:
        out.append(f"memfds {base.memfds} -> {now.memfds}")
    if sum(now.threads.values()) > sum(base.threads.values()) or now.tasks > base.tasks:
        extra = now.threads - base.threads
        out.append(
            f"threads {sum(base.threads.values())} -> {sum(now.threads.values())} "
            f"(tasks {base.tasks} -> {now.tasks}; new: {dict(extra)})"
        )
    new_shm = _unused_shm(now.shm - base.shm)
    if new_shm:
        out.append(f"/dev/shm entries: {sorted(new_shm)}")
    if now.children - base.children:
        out.append(f"child processes: {sorted(now.children - base.children)}")
    return out


def settled_growth(base: Snapshot, wait: float = 3.0) -> list[str]:
    """:func:`growth`, given threads and reapers up to ``wait`` seconds to finish."""
    deadline = time.monotonic() + wait
    while True:
        leaks = growth(base, snapshot())
        if not leaks or time.monotonic() > deadline:
            return leaks
        time.sleep(0.05)


# --------------------------------------------------------------------------- iteration
class ChaosFailure(AssertionError):
    pass


@dataclass
class Iteration:
    scenario: str
    index: int
    seed: int
    rng: random.Random
    #: processes this iteration started (directly or not): all must be gone at the end
    pids: set[int] = field(default_factory=set)
    #: processes SIGSTOPped (continued or killed if the iteration fails)
    stopped: set[int] = field(default_factory=set)
    cleanups: list[Callable[[], None]] = field(default_factory=list)
    time_to_error: float | None = None
    notes: list[str] = field(default_factory=list)

    def check(self, cond: Any, message: str) -> None:
        if not cond:
            raise ChaosFailure(message)

    def signal(self, pid: int, sig: int) -> float:
        os.kill(pid, sig)
        if sig == signal.SIGSTOP:
            self.stopped.add(pid)
        return time.monotonic()

    def emergency_cleanup(self) -> None:
        """After a failure or a hang: end every process of the iteration (no orphans)."""
        for pid in list(self.pids) + list(self.stopped):
            if pid == os.getpid():
                continue
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for fn in self.cleanups:
            try:
                fn()
            except Exception:
                pass


def wait_for_error(
    it: Iteration,
    step: Callable[[], None],
    expected: type | tuple,
    bound: float,
    t_fault: Callable[[], float | None],
) -> BaseException:
    """Run ``step`` until it raises; check the type and the time since the fault."""
    hard = time.monotonic() + bound + 30.0  # the watchdog catches a step that blocks
    while True:
        try:
            step()
        except BaseException as exc:  # noqa: BLE001 - checked below
            t_err = time.monotonic()
            t0 = t_fault()
            if t0 is None:
                raise ChaosFailure(
                    f"error before the fault was injected: {type(exc).__name__}: {exc}"
                ) from exc
            if not isinstance(exc, expected):
                raise ChaosFailure(
                    f"expected {_names(expected)}, got {type(exc).__name__}: {exc}"
                ) from exc
            it.time_to_error = t_err - t0
            it.check(
                it.time_to_error <= bound,
                f"{type(exc).__name__} came {it.time_to_error:.2f} s after the fault "
                f"(bound {bound:.1f} s)",
            )
            return exc
        t0 = t_fault()
        if t0 is not None and time.monotonic() - t0 > bound + 1.0:
            raise ChaosFailure(
                f"no error {bound + 1.0:.1f} s after the fault (calls still succeed)"
            )
        if time.monotonic() > hard:
            raise ChaosFailure("no fault and no error")


def _names(t: type | tuple) -> str:
    ts = t if isinstance(t, tuple) else (t,)
    return " or ".join(x.__name__ for x in ts)


class Injector:
    """Sends ``sig`` to ``pid`` after ``delay`` seconds, from another thread."""

    def __init__(self, it: Iteration, pid: int, sig: int, delay: float) -> None:
        self.t: float | None = None
        self.it, self.pid, self.sig = it, pid, sig
        self.thread = threading.Timer(delay, self._fire)
        self.thread.daemon = True

    def _fire(self) -> None:
        self.t = self.it.signal(self.pid, self.sig)

    def start(self) -> Injector:
        if self.thread.interval <= 0:
            self._fire()
        else:
            self.thread.start()
        return self

    def time(self) -> float | None:
        return self.t

    def join(self) -> None:
        if self.thread.is_alive():
            self.thread.join()


def timed_shutdown(it: Iteration, sess: disco.Session, bound: float = SHUTDOWN_BOUND) -> float:
    t0 = time.monotonic()
    sess.shutdown()
    took = time.monotonic() - t0
    it.check(took <= bound, f"shutdown() took {took:.2f} s (bound {bound:.1f} s)")
    return took


def check_gone(it: Iteration, pids, what: str = "processes") -> None:
    left = wait_gone(pids, GONE_WITHIN)
    it.check(not left, f"{what} still running {GONE_WITHIN:.0f} s later: {left}")


def later_calls_raise(it: Iteration, sess: disco.Session) -> None:
    try:
        sess.sync_worker_0()
        for w in range(sess.num_workers):
            sess.get_global_func("disco.worker_id")().debug_get_from_remote(w)
    except disco.WorkerDiedError:
        return
    except disco.DiscoError as exc:
        raise ChaosFailure(
            f"a later call raised {type(exc).__name__}, not WorkerDiedError: {exc}"
        ) from exc
    raise ChaosFailure("calls after the failure succeed: the session does not report the death")


# --------------------------------------------------------------------------- workloads
class Workload:
    """Steps that keep every worker busy: allreduce, copies of a few MiB in and out, calls."""

    def __init__(self, sess: disco.Session, it: Iteration, ccl: bool) -> None:
        self.sess, self.it, self.ccl = sess, it, ccl
        n = sess.num_workers
        sess.import_python_module("disco_core.testing.funcs")
        self.f_arange = sess.get_global_func("testing.arange")
        self.f_checksum = sess.get_global_func("testing.checksum")
        size = it.rng.choice([1, 2, 4]) * MiB // 4  # float32 elements: 1 to 4 MiB
        self.size = size
        self.host = np.arange(size, dtype="float32") % 1000
        self.x = self.f_arange(1024)
        self.expected = np.arange(1024, dtype="float32") * sum(range(1, n + 1))
        if ccl:
            self.y = sess.empty((1024,), "float32")
            self.buf = sess.empty((size,), "float32")
            self.buf0 = sess.empty((size,), "float32", worker0_only=True)
        self.out = np.empty(size, dtype="float32")
        self.big = None

    def allreduce(self, check_worker: int | None = None) -> None:
        sess = self.sess
        sess.allreduce(self.x, self.y, "sum")
        w = self.it.rng.randrange(sess.num_workers) if check_worker is None else check_worker
        got = self.y.debug_get_from_remote(w)
        if not np.array_equal(got, self.expected):
            raise ChaosFailure(f"allreduce gave a wrong result on worker {w}")

    def copy(self, victim: int) -> None:
        """A few MiB into worker 0, out to every worker, back from worker 0 and the victim."""
        sess = self.sess
        if self.ccl:
            sess.copy_to_worker_0(self.host, self.buf0)
            sess.broadcast_from_worker0(self.buf0, self.buf)
            sess.copy_from_worker_0(self.out, self.buf0)
            ck = self.f_checksum(self.buf).debug_get_from_remote(victim)
        else:  # no CCL across nodes: the array goes to every worker by value
            ck = self.f_checksum(self.host).debug_get_from_remote(victim)
            self.big = self.f_arange(self.size)
            got = self.big.debug_get_from_remote(victim)
            if not np.array_equal(got, np.arange(self.size, dtype="float32") * (victim + 1)):
                raise ChaosFailure(f"a copy from worker {victim} came back wrong")
            self.out[...] = self.host
        import zlib

        want = (self.host.shape, self.host.dtype.str, zlib.crc32(self.host.view(np.uint8)))
        if tuple(ck) != want or not np.array_equal(self.out, self.host):
            raise ChaosFailure(f"a copy of {self.size * 4 / MiB:.0f} MiB came back wrong")

    def calls(self, victim: int) -> None:
        got = self.x.debug_get_from_remote(victim)
        if not np.array_equal(got, np.arange(1024, dtype="float32") * (victim + 1)):
            raise ChaosFailure(f"worker {victim} returned a wrong array")

    def step_for(self, moment: str, victim: int) -> Callable[[], None]:
        if moment == "allreduce":
            return lambda: self.allreduce(victim)
        if moment == "copy":
            return lambda: self.copy(victim)
        return lambda: self.calls(victim)


def _pids(sess: disco.Session, workers) -> dict[int, int]:
    """The pids of ``workers`` that are processes of their own (not threads of this one)."""
    f = sess.get_global_func("testing.pid")()
    pids = {w: f.debug_get_from_remote(w) for w in workers}
    return {w: p for w, p in pids.items() if p != os.getpid()}


# --------------------------------------------------------------------------- scenarios
def _fault_during(
    it: Iteration,
    sess: disco.Session,
    wl: Workload,
    moments: list[str],
    victim_worker: int,
    pid: int,
    sig: int,
    expected: type,
    bound: float,
) -> BaseException:
    """Inject ``sig`` into ``pid`` at a random moment; wait for ``expected``."""
    moment = it.rng.choice(moments)
    it.notes.append(f"moment={moment}")
    if moment == "idle":
        step = wl.step_for(
            it.rng.choice([m for m in moments if m != "idle"] or ["calls"]), victim_worker
        )
        inj = Injector(it, pid, sig, 0.0).start()
    else:
        step = wl.step_for(moment, victim_worker)
        inj = Injector(it, pid, sig, it.rng.uniform(0.02, 0.4)).start()
    try:
        return wait_for_error(it, step, expected, bound, inj.time)
    finally:
        inj.join()


def scenario_process_signal(it: Iteration, sig: int) -> None:
    """SIGKILL or SIGSTOP a child worker of a ProcessSession during a collective, a copy or idle."""
    n = it.rng.choice([2, 3])
    sess = disco.ProcessSession(n)
    try:
        sess.init_ccl("shm")
        wl = Workload(sess, it, ccl=True)
        pids = _pids(sess, range(1, n))
        it.pids.update(pids.values())
        wl.allreduce()
        victim = it.rng.randrange(1, n)
        it.notes.append(f"workers={n} victim={victim}")
        if sig == signal.SIGKILL:
            expected, bound = disco.WorkerDiedError, DEATH_BOUND
        else:
            expected, bound = unresponsive_error(), LIVENESS_BOUND
        exc = _fault_during(
            it, sess, wl, ["allreduce", "copy", "idle"], victim, pids[victim], sig, expected, bound
        )
        it.check(
            victim in exc.worker_ids, f"{type(exc).__name__} names {exc.worker_ids}, not {victim}"
        )
        later_calls_raise(it, sess)
    finally:
        timed_shutdown(it, sess)
    check_gone(it, it.pids, "worker processes")


def scenario_process_sigkill(it: Iteration) -> None:
    scenario_process_signal(it, signal.SIGKILL)


def scenario_process_sigstop(it: Iteration) -> None:
    scenario_process_signal(it, signal.SIGSTOP)


def _session(it: Iteration, n: int) -> disco.Session:
    kind = it.rng.choice(["threaded", "process"])
    it.notes.append(f"{kind} workers={n}")
    return disco.ThreadedSession(n) if kind == "threaded" else disco.ProcessSession(n)


def scenario_worker_raises(it: Iteration) -> None:
    """A worker raises before an allreduce: the very next sync_worker_0 raises it, every time;
    the session goes on with correct results."""
    n = it.rng.choice([2, 3])
    sess = _session(it, n)
    try:
        sess.init_ccl("shm")
        wl = Workload(sess, it, ccl=True)
        it.pids.update(_pids(sess, range(1, n)).values())
        wl.allreduce()
        f_raise = sess.get_global_func("testing.raise_on")
        times = []
        for rnd in range(8):
            victim = it.rng.randrange(n)
            for _ in range(it.rng.randrange(3)):
                it.rng.choice([wl.allreduce, lambda: wl.copy(it.rng.randrange(n))])()
            f_raise(victim, "ValueError", f"chaos round {rnd}")
            sess.allreduce(wl.x, wl.y)
            t0 = time.monotonic()
            try:
                sess.sync_worker_0()
            except disco.WorkerError as exc:
                times.append(time.monotonic() - t0)
                it.check(
                    exc.worker_id == victim,
                    f"round {rnd}: WorkerError of worker {exc.worker_id}, expected {victim}",
                )
                it.check(
                    exc.exc_type.endswith("ValueError"), f"round {rnd}: exc_type {exc.exc_type}"
                )
                it.check(f"chaos round {rnd}" in str(exc), f"round {rnd}: message {exc}")
                it.check("raise_on" in exc.remote_traceback, f"round {rnd}: no remote traceback")
            else:
                raise ChaosFailure(
                    f"round {rnd}: worker {victim} raised before an allreduce, but the "
                    "sync_worker_0() after the allreduce did not raise"
                )
            # The error surfaced once, here: the next syncs are clean, results correct.
            try:
                sess.sync_worker_0()
                wl.allreduce()
            except disco.WorkerError as exc:
                raise ChaosFailure(f"round {rnd}: the error surfaced again, late: {exc}") from exc
        it.time_to_error = statistics.median(times)
    finally:
        timed_shutdown(it, sess)
    check_gone(it, it.pids, "worker processes")


def scenario_ccl_timeout(it: Iteration) -> None:
    """A worker arrives late to an allreduce with timeout=0.5: CCLTimeoutError (a WorkerError);
    afterwards collectives fail with CCLError and plain calls still work."""
    n = it.rng.choice([2, 3])
    sess = _session(it, n)
    try:
        sess.init_ccl("shm", timeout=0.5)
        wl = Workload(sess, it, ccl=True)
        it.pids.update(_pids(sess, range(1, n)).values())
        wl.allreduce()
        victim = it.rng.randrange(1, n)
        it.notes.append(f"victim={victim}")
        sess.get_global_func("testing.sleep")(1.0, victim)
        sess.allreduce(wl.x, wl.y)
        t0 = time.monotonic()
        try:
            sess.sync_worker_0()
        except disco.CCLTimeoutError as exc:
            it.time_to_error = time.monotonic() - t0
            it.check(isinstance(exc, disco.WorkerError), f"{type(exc).__mro__} is no WorkerError")
            it.check(exc.worker_id != victim, f"the late worker {victim} is blamed: {exc}")
            it.check(exc.worker_id in range(n), f"worker_id {exc.worker_id}")
            it.check(exc.remote_traceback, "no remote traceback")
        except BaseException as exc:
            raise ChaosFailure(
                f"expected an error that `except CCLTimeoutError` catches, got "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        else:
            raise ChaosFailure("the allreduce did not time out")
        it.check(it.time_to_error <= 1.5 + GATHER_BOUND, f"took {it.time_to_error:.2f} s")
        # The session is usable; its CCL is not.
        wl.calls(it.rng.randrange(n))
        sess.allreduce(wl.x, wl.y)
        try:
            sess.sync_worker_0()
            sess.get_global_func("disco.worker_id")().debug_get_from_remote(n - 1)
        except disco.CCLError as exc:
            it.check(isinstance(exc, disco.WorkerError), f"{type(exc).__mro__} is no WorkerError")
        except BaseException as exc:
            raise ChaosFailure(
                f"a collective after the timeout: expected CCLError, got {type(exc).__name__}: {exc}"
            ) from exc
        else:
            raise ChaosFailure("a collective after a timeout succeeded")
        wl.calls(it.rng.randrange(n))
    finally:
        timed_shutdown(it, sess)
    check_gone(it, it.pids, "worker processes")


def scenario_threaded_hang(it: Iteration) -> None:
    """A ThreadedSession worker hangs while another raises: after DISCO_GATHER_TIMEOUT the
    hung one is reported unresponsive; shutdown() still returns promptly."""
    import chaos_funcs

    n = 3
    sess = disco.ThreadedSession(n)
    key = uuid.uuid4().hex
    chaos_funcs.event(key)
    it.cleanups.append(lambda: chaos_funcs.release(key))
    try:
        sess.import_python_module("chaos_funcs")
        sess.import_python_module("disco_core.testing.funcs")
        sess.sync_worker_0()
        hung = it.rng.randrange(1, n)
        raiser = it.rng.choice([w for w in range(n) if w != hung])
        it.notes.append(f"hung={hung} raiser={raiser}")
        sess.get_global_func("chaos.hang")(hung, key, GATHER + 15.0)
        if it.rng.random() < 0.5:
            time.sleep(it.rng.uniform(0.0, 0.3))
        sess.get_global_func("testing.raise_on")(raiser, "ValueError", "chaos")
        t0 = time.monotonic()
        exc = wait_for_error(
            it, lambda: (sess.sync_worker_0(), time.sleep(0.02)), unresponsive_error(),
            GATHER_BOUND, lambda: t0,
        )  # fmt: skip
        it.check(hung in exc.worker_ids, f"{type(exc).__name__} names {exc.worker_ids}, not {hung}")
        later_calls_raise(it, sess)
    finally:
        timed_shutdown(it, sess)
        chaos_funcs.release(key)


# ---- socket sessions
def _socket_session(it: Iteration, per_node: int) -> tuple[disco.Session, list[subprocess.Popen]]:
    from disco_socket import start_local_agents

    agents: list[subprocess.Popen] = []

    def on_listen(host: str, port: int) -> None:
        agents.extend(start_local_agents(host, port, 1, per_node, token=TOKEN, extra_args=("-q",)))
        it.pids.update(a.pid for a in agents)

    try:
        sess = disco.SocketSession(
            2, per_node, 1, "127.0.0.1", 0, on_listen=on_listen, token=TOKEN, timeout=30
        )
    except BaseException:
        for a in agents:
            a.kill()
            a.wait()
        raise

    def reap() -> None:
        for a in agents:
            try:
                a.wait(GONE_WITHIN)
            except subprocess.TimeoutExpired:
                a.kill()
                a.wait()

    it.cleanups.append(reap)
    return sess, agents


def _reap_agents(it: Iteration, agents: list[subprocess.Popen]) -> None:
    for a in agents:
        try:
            a.wait(GONE_WITHIN)
        except subprocess.TimeoutExpired:
            it.stopped.add(a.pid)
            raise ChaosFailure(
                f"agent {a.pid} still running {GONE_WITHIN:.0f} s after shutdown()"
            ) from None


def scenario_socket(it: Iteration, target: str, sig: int) -> None:
    """SIGKILL/SIGSTOP a remote worker (or its node agent) of a 2-node SocketSession."""
    per_node = it.rng.choice([1, 2])
    sess, agents = _socket_session(it, per_node)
    agent = agents[0]
    try:
        wl = Workload(sess, it, ccl=False)
        n = sess.num_workers
        pids = _pids(sess, range(1, n))
        it.pids.update(pids.values())
        remote = list(range(per_node, n))
        victim = it.rng.choice(remote) if target == "agent" else it.rng.randrange(1, n)
        it.notes.append(f"per_node={per_node} target={target} victim_worker={victim}")
        wl.calls(victim)
        if target == "agent":
            pid, names = agent.pid, remote
            expected = disco.WorkerDiedError
            bound = DEATH_BOUND if sig == signal.SIGKILL else HEARTBEAT_BOUND
        else:
            pid, names = pids[victim], [victim]
            if sig == signal.SIGKILL:
                expected, bound = disco.WorkerDiedError, DEATH_BOUND
            else:
                expected, bound = unresponsive_error(), LIVENESS_BOUND
        exc = _fault_during(
            it, sess, wl, ["copy", "calls", "idle"], victim, pid, sig, expected, bound
        )
        it.check(
            set(names) <= set(exc.worker_ids),
            f"{type(exc).__name__} names {exc.worker_ids}, expected {names}",
        )
        later_calls_raise(it, sess)
    finally:
        timed_shutdown(it, sess)
        if target == "agent" and sig == signal.SIGSTOP:
            # The agent wakes up to a closed connection: it must stop its workers and exit.
            if it.rng.random() < 0.5:
                it.notes.append("agent continued")
                os.kill(agent.pid, signal.SIGCONT)
            else:
                it.notes.append("agent killed")
                os.kill(agent.pid, signal.SIGKILL)
            it.stopped.discard(agent.pid)
    _reap_agents(it, agents)
    check_gone(it, it.pids, "agents or worker processes")


def scenario_socket_kill_worker(it: Iteration) -> None:
    scenario_socket(it, "worker", signal.SIGKILL)


def scenario_socket_stop_worker(it: Iteration) -> None:
    scenario_socket(it, "worker", signal.SIGSTOP)


def scenario_socket_kill_agent(it: Iteration) -> None:
    scenario_socket(it, "agent", signal.SIGKILL)


def scenario_socket_stop_agent(it: Iteration) -> None:
    scenario_socket(it, "agent", signal.SIGSTOP)


# ---- the controller dies
_CONTROLLER = r"""
import os, sys, time
import numpy as np
import disco_core as disco
kind = sys.argv[1]
agents = []
if kind == "process":
    sess = disco.ProcessSession(int(sys.argv[2]))
    sess.init_ccl("shm")
else:
    from disco_socket import start_local_agents
    sess = disco.SocketSession(2, int(sys.argv[2]), 1, "127.0.0.1", 0, token=sys.argv[3],
        on_listen=lambda h, p: agents.extend(start_local_agents(h, p, 1, int(sys.argv[2]),
                                                                token=sys.argv[3], extra_args=("-q",))))
sess.import_python_module("disco_core.testing.funcs")
n = sess.num_workers
f = sess.get_global_func("testing.pid")()
pids = [f.debug_get_from_remote(w) for w in range(1, n)] + [a.pid for a in agents]
print("PIDS", *pids, flush=True)
x = sess.get_global_func("testing.arange")(1 << 18)
host = np.ones(1 << 20, dtype="float32")
while True:
    if kind == "process":
        y = sess.empty((1 << 18,), "float32")
        sess.allreduce(x, y)
        sess.broadcast(host)
        sess.sync_worker_0()
    else:
        sess.get_global_func("testing.checksum")(host).debug_get_from_remote(n - 1)
"""


def scenario_controller(it: Iteration, sig: int) -> None:
    """Kill the controller (a subprocess) mid-collective or mid-copy: every worker process,
    agent and agent's worker is gone within a few seconds."""
    kinds = ["process", "socket"] if importlib.util.find_spec("disco_socket") else ["process"]
    kind = it.rng.choice(kinds)
    arg = str(it.rng.choice([2, 3])) if kind == "process" else str(it.rng.choice([1, 2]))
    it.notes.append(f"{kind} {arg}")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    proc = subprocess.Popen(
        [sys.executable, "-c", _CONTROLLER, kind, arg, TOKEN],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    it.pids.add(proc.pid)

    def end() -> None:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()

    it.cleanups.append(end)
    line = proc.stdout.readline()
    if not line.startswith("PIDS"):
        proc.kill()
        _, err = proc.communicate(timeout=10)
        raise ChaosFailure(f"the controller did not start: {line!r} {err[-2000:]}")
    pids = [int(p) for p in line.split()[1:]]
    it.pids.update(pids)
    time.sleep(it.rng.uniform(0.05, 0.5))
    if proc.poll() is not None:
        raise ChaosFailure(f"the controller ended early: {proc.communicate(timeout=10)[1][-2000:]}")
    t0 = it.signal(proc.pid, signal.SIGKILL)
    proc.wait(10)
    # Time to the last process gone (the workers hold the controller's stdout and stderr).
    left = wait_gone(pids, GONE_WITHIN + HEARTBEAT)
    it.time_to_error = time.monotonic() - t0
    it.check(not left, f"processes outlived their controller ({kind}): {left}")
    proc.communicate(timeout=10)


def scenario_controller_kill(it: Iteration) -> None:
    scenario_controller(it, signal.SIGKILL)


#: name -> (function, seconds one iteration may take before the watchdog calls it a hang)
SCENARIOS: dict[str, tuple[Callable[[Iteration], None], float]] = {
    "process-sigkill": (scenario_process_sigkill, 30.0),
    "process-sigstop": (scenario_process_sigstop, 30.0),
    "worker-raises": (scenario_worker_raises, 40.0),
    "ccl-timeout": (scenario_ccl_timeout, 30.0),
    "threaded-hang": (scenario_threaded_hang, 40.0),
    "socket-kill-worker": (scenario_socket_kill_worker, 40.0),
    "socket-stop-worker": (scenario_socket_stop_worker, 40.0),
    "socket-kill-agent": (scenario_socket_kill_agent, 40.0),
    "socket-stop-agent": (scenario_socket_stop_agent, 40.0),
    "controller-kill": (scenario_controller_kill, 40.0),
}


# --------------------------------------------------------------------------- runner
@dataclass
class Stats:
    scenario: str
    seed: int
    iterations: int = 0
    hangs: int = 0
    orphans: int = 0
    leaks: int = 0
    failures: list[str] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    wall: float = 0.0

    @property
    def ok(self) -> bool:
        return not (self.hangs or self.orphans or self.leaks or self.failures)

    def row(self) -> dict:
        return {
            "scenario": self.scenario,
            "iterations": self.iterations,
            "failures": len(self.failures),
            "hangs": self.hangs,
            "orphans": self.orphans,
            "leaks": self.leaks,
            "median_s": statistics.median(self.times) if self.times else None,
            "max_s": max(self.times) if self.times else None,
            "wall_s": self.wall,
        }


def _dump_stacks(out) -> None:
    out.write("==== chaos watchdog: stacks of every thread ====\n")
    out.flush()
    try:
        faulthandler.dump_traceback(file=out, all_threads=True)
    except (AttributeError, ValueError, OSError):  # e.g. pytest's captured stream has no fileno
        for tid, frame in sys._current_frames().items():
            out.write(f"-- thread {tid}\n{''.join(traceback.format_stack(frame))}")
    out.flush()


def run_scenario(
    name: str,
    iterations: int,
    seed: int,
    log: Callable[[str], None] = print,
    stop_on_failure: bool = True,
) -> Stats:
    """Run ``iterations`` of scenario ``name`` (iteration 0 is the warm-up for leak checks)."""
    func, deadline = SCENARIOS[name]
    stats = Stats(name, seed)
    base: Snapshot | None = None
    start = time.monotonic()
    log(f"chaos: scenario {name} seed {seed} iterations {iterations}")
    for i in range(iterations):
        it = Iteration(name, i, seed, random.Random(f"{seed}:{name}:{i}"))
        before = children_of(os.getpid())
        box: dict[str, Any] = {}

        def body(it: Iteration = it, box: dict = box) -> None:
            try:
                func(it)
            except BaseException as exc:  # noqa: BLE001 - reported by the runner
                box["exc"] = exc
                box["tb"] = traceback.format_exc()

        t0 = time.monotonic()
        th = threading.Thread(target=body, name=f"chaos-{name}-{i}", daemon=True)
        th.start()
        th.join(deadline)
        stats.iterations += 1
        where = f"{name} iteration {i} (seed {seed}; {'; '.join(it.notes)})"
        failed = False
        if th.is_alive():
            stats.hangs += 1
            _dump_stacks(sys.stderr)
            it.emergency_cleanup()
            th.join(10)
            msg = f"HANG: {where} did not finish within {deadline:.0f} s (stacks above)"
            stats.failures.append(msg)
            log(msg)
            # A hung iteration leaves state behind: no point going on with this scenario.
            break
        if "exc" in box:
            failed = True
            it.emergency_cleanup()
            msg = f"FAIL: {where}: {box['exc']}\n{box['tb']}"
            stats.failures.append(msg)
            log(msg)
        else:
            for fn in it.cleanups:
                fn()
        if it.time_to_error is not None and not failed:
            stats.times.append(it.time_to_error)
        # No process of this iteration may be left.
        left = wait_gone(it.pids, 0 if failed else GONE_WITHIN)
        extra = children_of(os.getpid()) - before
        if (left or extra) and not failed:
            stats.orphans += 1
            msg = f"ORPHANS: {where}: still running {sorted(set(left) | extra)}"
            stats.failures.append(msg)
            log(msg)
        for pid in set(left) | extra:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if i == 0:
            time.sleep(0.2)
            base = snapshot()
        elif not failed:
            leaks = settled_growth(base)
            if leaks:
                stats.leaks += 1
                msg = f"LEAK: {where}: " + "; ".join(leaks)
                stats.failures.append(msg)
                log(msg)
                base = snapshot()  # report each growth once
        log(
            f"chaos: {name} #{i} {'failed' if failed else 'ok'} in {time.monotonic() - t0:.2f} s"
            + (f", error after {it.time_to_error:.2f} s" if it.time_to_error is not None else "")
            + f" [{'; '.join(it.notes)}]"
        )
        if stats.failures and stop_on_failure:
            break
    stats.wall = time.monotonic() - start
    return stats
