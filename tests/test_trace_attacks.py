"""Attacks on tracing: a lying worker, chaos during a trace, a hostile file system.

A compromised worker is a real worker process whose ``disco.trace_stop`` or
``disco.trace_clock`` is replaced (by a module it imports) with one that answers
what the attacker wants; the controller under test is untouched.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

import disco_core as disco
from disco_core.tracing import _trace as trace_reader
from disco_core.tracing import session_trace

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _real_trace_functions():
    """The attackers' modules are imported by worker 0 too, i.e. by this process: the
    real trace functions are put back after each test (later tests' in-process workers)."""
    from disco_core import builtins, registry

    real = {
        f"disco.{f}": getattr(builtins, f) for f in ("trace_start", "trace_stop", "trace_clock")
    }
    yield
    for name, func in real.items():
        registry.register_func(name, func, override=True)


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Worker 1 answers ``disco.trace_stop`` / ``disco.trace_clock`` with ANSWER / CLOCK,
# built from the real answer ``real`` and the worker clock ``now()``.
_LIAR = """
import numpy as np
from disco_core import builtins
from disco_core.registry import register_func
from disco_core.tracing.recorder import now
from disco_core.worker import current

_stop, _clock = builtins.trace_stop, builtins.trace_clock

def ev(rows, name=0, attr=0, kind=1, t0=None, t1=None):
    t = now()
    e = np.zeros((rows, 8), np.int64)
    e[:, 0], e[:, 1], e[:, 4], e[:, 7] = kind, name, -1, attr
    e[:, 2], e[:, 3] = t - 1000 if t0 is None else t0, t if t1 is None else t1
    return e

def stop():
    real = _stop()
    if current().worker_id != 1:
        return real
    return {ANSWER}

def clock():
    real = _clock()
    return {CLOCK} if current().worker_id == 1 else real

register_func("disco.trace_stop", stop, override=True)
register_func("disco.trace_clock", clock, override=True)
"""


def lying_session(
    tmp_path, monkeypatch, answer: str = "real", clock: str = "real"
) -> disco.Session:
    """A 3-worker ProcessSession whose worker 1 is compromised (see ``_LIAR``)."""
    name = f"trace_liar_{abs(hash((answer, clock)))}"
    (tmp_path / f"{name}.py").write_text(
        _LIAR.replace("{ANSWER}", answer).replace("{CLOCK}", clock)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    )
    sess = disco.ProcessSession(3)
    sess.import_python_module(name)
    return sess


def traced(sess: disco.Session, path) -> dict:
    with sess, disco.trace(sess, path):
        sess.call_packed("disco.worker_id")
    with open(path) as f:
        return json.load(f)


def worker_events(data: dict, w: int) -> list[dict]:
    return [e for e in data["traceEvents"] if e["ph"] == "X" and e["tid"] == w + 1]


@pytest.mark.parametrize(
    "answer, note",
    [
        # a collective whose attributes have 4 '|' but a group id / peer that is no int:
        # int() raised inside chrome.build and no file was written at all
        ('{"names": ["allreduce", "float32|sum|group|abc|-1"], "events": ev(1, 0, 1, kind=4), "dropped": 0}',
         "attributes are malformed"),
        ('{"names": ["send", "float32||p2p|0|zz"], "events": ev(1, 0, 1, kind=4), "dropped": 0}',
         "attributes are malformed"),
        # a dropped count past 4300 digits: json.dump raised, no file
        ('dict(real, dropped=10**5000)', "dropped count"),
        # past float's range: the file was written, then 'disco trace summary' crashed
        ('dict(real, dropped=10**400)', "dropped count"),
        # one 1 MiB name repeated by 100 events made a 100 MB file (x100 amplification)
        ('{"names": ["A" * (1 << 20)], "events": ev(100), "dropped": 0}', "at most 1024 chars"),
        # terminal escapes and newlines printed by 'disco trace summary' (forged lines)
        ('{"names": ["evil\\n\\x1b[31mworker 0 arrived last", "float32|sum|world|0|-1"], '
         '"events": ev(1, 0, 1, kind=4), "dropped": 0}', "printable"),
        ('{"names": ["bad\\ud800"], "events": ev(1), "dropped": 0}', "printable"),
        # more rows than the ring it was given: 400 MB of controller memory per 32 MB sent
        ('{"names": ["x"], "events": ev(300_000), "dropped": 0}', "more than its ring holds"),
    ],
    ids=["group-id", "peer", "dropped-4300-digits", "dropped-past-float", "long-name",
         "escapes", "surrogate", "rows-past-capacity"],
)  # fmt: skip
def test_a_lying_worker_costs_its_own_track_not_the_file(tmp_path, monkeypatch, answer, note):
    path = tmp_path / "t.json"
    data = traced(lying_session(tmp_path, monkeypatch, answer=answer), path)
    notes = " ".join(data["otherData"]["notes"])
    assert "worker 1: no events" in notes and note in notes
    assert worker_events(data, 0) and worker_events(data, 2) and not worker_events(data, 1)
    assert os.path.getsize(path) < 1 << 20
    out = subprocess.run(
        [sys.executable, "-m", "disco_core", "trace", "summary", str(path)],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "\x1b" not in out.stdout


def test_a_clock_past_int64_costs_the_track_not_the_file(tmp_path, monkeypatch):
    """A trace_clock answer of 10**400 made chrome.build raise OverflowError: no file."""
    path = tmp_path / "t.json"
    data = traced(lying_session(tmp_path, monkeypatch, clock="(10**400, 'x')"), path)
    assert any("worker 1" in n and "clock" in n for n in data["otherData"]["notes"])
    assert worker_events(data, 0) and worker_events(data, 2) and not worker_events(data, 1)


def test_the_reader_takes_a_count_past_floats_range(tmp_path):
    """A file (from anywhere) whose dropped count is 10**400 is read, not an OverflowError."""
    path = tmp_path / "t.json"
    big = "1" + "0" * 400
    other = {"disco_trace": 1, "session": {"num_workers": 1}}
    text = json.dumps({"traceEvents": [], "otherData": other})
    path.write_text(
        text[:-2] + f', "dropped": [{big}], "controller_dropped": {big}, "duration_us": {big}}}}}'
    )
    got = trace_reader.load(path)
    assert got.dropped == [0] and got.controller_dropped == 0 and got.duration_us == 0.0


def test_build_survives_what_the_check_misses():
    """Defence in depth: an answer that breaks chrome.build costs its track, with a note."""
    import numpy as np

    from disco_core.tracing import chrome

    bad = {"names": ["op", "a|b|group|x|y"], "events": np.array([[4, 0, 5, 6, 0, 0, -1, 1]]), "dropped": 0}  # fmt: skip
    good = {"names": ["f"], "events": np.array([[1, 0, 5, 6, 0, 0, 0, 0]]), "dropped": 0}
    data = chrome.TraceData(
        session={"channel": "x", "num_workers": 2, "num_groups": 1}, t_start=0, t_end=10,
        controller={"names": [], "events": np.zeros((0, 8), np.int64), "dropped": 0},
        workers=[good, bad], clocks=[chrome.ClockFit(0, 0, 0), chrome.ClockFit(0, 0, 0)],
        method="m",
    )  # fmt: skip
    out = chrome.build(data)
    assert [e["tid"] for e in out["traceEvents"] if e["ph"] == "X"] == [1]
    assert "worker 1: events left out (ValueError" in out["otherData"]["notes"][0]


# ---------------------------------------------------------------------------- chaos
def test_a_failed_command_in_the_block_is_raised_not_swallowed_and_every_track_kept(tmp_path):
    """The trace's stop used to meet the block's pending WorkerError: it became a note,
    the program never saw it, and every worker process's events were lost."""
    path = tmp_path / "t.json"
    with disco.ProcessSession(3) as sess:
        with pytest.raises(disco.WorkerError, match="no_such_function"):
            with disco.trace(sess, path):
                sess.call_packed("disco.worker_id")
                sess.call_packed("disco.no_such_function")
        sess._sync_all()  # raised once, as without a trace; the session goes on
        assert sess.call_packed("disco.worker_id").debug_get_from_remote(2) == 2
    with open(path) as f:
        data = json.load(f)
    assert data["otherData"]["notes"] == []
    for w in range(3):
        assert "disco.worker_id" in [e["name"] for e in worker_events(data, w)]


def test_the_blocks_own_exception_wins_over_a_failed_command(tmp_path):
    path = tmp_path / "t.json"
    with disco.ProcessSession(2) as sess:
        with pytest.raises(KeyError, match="mine"):
            with disco.trace(sess, path):
                sess.call_packed("disco.no_such_function")
                raise KeyError("mine")
    assert worker_events(json.loads(path.read_text()), 1)


def test_two_threads_cannot_both_start_a_trace_of_one_session(tmp_path):
    """Both starts used to pass the 'already traced' check (the claim came after the
    clock round trips); the second trace_start replaced the first on every worker and
    the first file lost every track, silently."""
    import threading

    with disco.ProcessSession(2) as sess:
        barrier = threading.Barrier(2)
        # The trace that started is held open until the other thread has tried:
        # under load one thread's whole trace could end before the other began,
        # and two traces one after the other are allowed.
        both_tried = threading.Barrier(2, timeout=30)
        got: list[str] = []

        def start(i: int) -> None:
            barrier.wait()
            try:
                with disco.trace(sess, tmp_path / f"t{i}.json"):
                    both_tried.wait()
                    sess.call_packed("disco.worker_id")
                    sess._sync_all()
                got.append("traced")
            except disco.DiscoError as exc:
                got.append(str(exc))
                both_tried.wait()

        threads = [threading.Thread(target=start, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert sorted(got)[1] == "traced" and "already being traced" in sorted(got)[0]
    (written,) = [p for p in tmp_path.glob("t*.json")]
    data = json.loads(written.read_text())
    assert data["otherData"]["notes"] == [] and worker_events(data, 1)


# ---------------------------------------------------------------------------- file system
def test_a_name_another_user_made_in_a_sticky_folder_is_refused_at_the_start(tmp_path, monkeypatch):
    """In /tmp another user may pre-create the trace's name (a file or a symlink): the
    rename at the end failed with a bare PermissionError after the whole run. The
    check is at the start now. (Seen as root dropping to uid 1000: EPERM on os.replace.)"""
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    (sticky / "theirs.json").write_text("someone else's")
    os.symlink("/etc/passwd", sticky / "link.json")
    # this process plays a user who owns neither the folder nor the names in it
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(sticky).st_uid + 4242)
    with pytest.raises(disco.DiscoPermissionError, match="another user"):
        session_trace.Trace.check_path(sticky / "theirs.json")
    with pytest.raises(disco.DiscoValueError, match="not a regular file"):
        session_trace.Trace.check_path(sticky / "link.json")  # refused whoever made it
    assert session_trace.Trace.check_path(sticky / "new.json")  # a free name is fine
    (tmp_path / "theirs.json").write_text("in a folder that is not sticky: replaceable")
    assert session_trace.Trace.check_path(tmp_path / "theirs.json")


def test_a_path_that_is_not_a_regular_file_is_refused_never_replaced(tmp_path):
    """The file is written whole, then renamed over its path: a symlink, a pipe or a
    device there was replaced by a plain file (as root, ``/dev/null`` itself; outside
    check). They are refused at the start now, and again when the file is written."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    os.symlink(victim, tmp_path / "link.json")
    os.mkfifo(tmp_path / "fifo.json")  # opening it to write would block until a reader came
    for name in ("link.json", "fifo.json"):
        with disco.ThreadedSession(2) as sess:
            with pytest.raises(disco.DiscoValueError, match="not a regular file"):
                disco.trace(sess, tmp_path / name).__enter__()
            sess.call_packed("disco.worker_id")  # the session is untouched
            sess.sync_worker_0()
    for path, kind in (("/dev/null", "character device"), (tmp_path / "link.json", "symbolic link")):  # fmt: skip
        with pytest.raises(disco.DiscoValueError, match=kind):
            session_trace.Trace.check_path(path)
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    assert os.path.islink(tmp_path / "link.json") and victim.read_text() == "precious"
    assert stat.S_ISFIFO(os.lstat(tmp_path / "fifo.json").st_mode)
    # made while the trace ran: the write refuses it too, and leaves no file of its own
    later = tmp_path / "later.json"
    with disco.ThreadedSession(2) as sess:
        with pytest.raises(disco.DiscoError, match="could not write .*not a regular file"):
            with disco.trace(sess, later):
                sess.call_packed("disco.worker_id")
                os.mkfifo(later)
    assert stat.S_ISFIFO(os.lstat(later).st_mode)
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".disco-trace")]


def test_a_folder_where_no_file_can_be_made_is_refused_at_the_start():
    """``os.access`` says yes to root in /proc, where no file can be made: the run went
    to its end, then failed with a bare OSError naming a hidden temporary file. It
    refuses with ENOENT, which is no permission error (an outside check)."""
    with pytest.raises(disco.DiscoValueError, match="no file can be written") as info:
        session_trace.Trace.check_path("/proc/trace.json")
    assert not isinstance(info.value, PermissionError)


def test_a_failed_write_is_a_disco_error_naming_the_trace(tmp_path):
    gone = tmp_path / "gone"
    gone.mkdir()
    with disco.ThreadedSession(2) as sess:
        with pytest.raises(disco.DiscoFileNotFoundError, match=r"could not write '.*gone/t\.json'"):
            with disco.trace(sess, gone / "t.json"):
                sess.call_packed("disco.worker_id")
                gone.rmdir()
        sess.call_packed("disco.worker_id")
        sess.sync_worker_0()  # still usable, and traced again
        with disco.trace(sess, tmp_path / "again.json"):
            sess.call_packed("disco.worker_id")
    assert (tmp_path / "again.json").stat().st_size > 0
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".disco-trace")]


# ---------------------------------------------------------------------------- memory
def _rss_mib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20


def test_a_ring_costs_only_the_memory_its_events_use(tmp_path):
    """The ring was a bytearray, which CPython memsets whole: 16 MiB of every traced
    process at the default capacity, and capacity=10**8 took 12 GiB of the controller
    (worker 0's ring and its own) while worker 1, memsetting 6 GiB, missed the liveness
    timeout and the session died."""
    from disco_core.tracing.recorder import Recorder

    before = _rss_mib()
    rec = Recorder(1 << 22)  # 256 MiB of records
    assert _rss_mib() - before < 32
    for i in range(1000):
        rec.add(1, 0, i, i + 1)
    assert rec.events()[-1, 2] == 999
    path = tmp_path / "t.json"
    before = _rss_mib()
    with disco.ProcessSession(2) as sess, disco.trace(sess, path, capacity=1 << 24):  # 1 GiB each
        sess.call_packed("disco.worker_id").debug_get_from_remote(1)
    assert _rss_mib() - before < 200
    assert worker_events(json.loads(path.read_text()), 1)


def test_a_relative_path_is_where_it_was_when_the_trace_started(tmp_path, monkeypatch):
    """A chdir inside the block used to move the file (or fail at the end if the new
    folder had no such sub-folder): the path is checked at the start, so it counts then."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    with disco.ThreadedSession(2) as sess, disco.trace(sess, "rel.json") as t:
        sess.call_packed("disco.worker_id")
        os.chdir(tmp_path / "b")
    assert t.path == "rel.json"
    assert os.listdir(tmp_path / "a") == ["rel.json"] and os.listdir(tmp_path / "b") == []


_REFUSER = """
from disco_core import builtins
from disco_core.registry import register_func
from disco_core.worker import current

_start = builtins.trace_start

def start(capacity):
    if current().worker_id == 1:
        raise RuntimeError("this worker refuses to trace")
    return _start(capacity)

register_func("disco.trace_start", start, override=True)
register_func("testing.is_tracing", lambda: current().tracer is not None, override=True)
"""


def test_a_start_that_fails_on_one_worker_stops_the_others(tmp_path, monkeypatch):
    """The workers that took trace_start went on recording (hooks on, ring held) for the
    rest of the session when another worker refused it."""
    (tmp_path / "trace_refuser.py").write_text(_REFUSER)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))  # fmt: skip
    with disco.ProcessSession(3) as sess:
        sess.import_python_module("trace_refuser")
        with pytest.raises(disco.WorkerError, match="refuses to trace"):
            disco.trace(sess, tmp_path / "t.json").__enter__()
        tracing = sess.call_packed("testing.is_tracing")
        assert [tracing.debug_get_from_remote(w) for w in range(3)] == [False] * 3
        assert "_call" not in sess.__dict__
    assert not (tmp_path / "t.json").exists()


# ---------------------------------------------------------------------------- socket
def test_a_compromised_token_holding_agent_over_a_real_socket(tmp_path, monkeypatch):
    """The same lies over a sealed SocketSession (agents on loopback, token set): one
    agent's worker answers a 1 MiB name and a malformed collective; the file keeps the
    other tracks, stays small, and nothing is left behind (agents, threads, fds)."""
    disco_socket = pytest.importorskip("disco_socket", reason="the socket plugin is not installed")
    answer = (
        '{"names": ["allreduce", "f|s|group|x|-1", "A" * (1 << 20)], '
        '"events": np.concatenate([ev(1, 0, 1, kind=4), ev(100, 2)]), "dropped": 0}'
    )
    name = "trace_liar_socket"
    (tmp_path / f"{name}.py").write_text(
        _LIAR.replace("{ANSWER}", answer).replace("{CLOCK}", "real")
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))  # fmt: skip
    import threading

    fds, threads = len(os.listdir("/proc/self/fd")), threading.active_count()
    agents: list = []
    path = tmp_path / "t.json"
    sess = disco.SocketSession(
        3, 1, 1, "127.0.0.1", 0, token="trace-attack", timeout=30,
        on_listen=lambda h, p: agents.extend(
            disco_socket.start_local_agents(h, p, 2, 1, token="trace-attack", extra_args=("-q",))
        ),
    )  # fmt: skip
    try:
        sess.import_python_module(name)
        data = traced(sess, path)
    finally:
        sess.shutdown()
        for a in agents:
            a.wait(20)
    assert any("worker 1: no events" in n for n in data["otherData"]["notes"])
    assert worker_events(data, 0) and worker_events(data, 2) and not worker_events(data, 1)
    assert os.path.getsize(path) < 1 << 20
    assert [a.returncode for a in agents] == [0, 0]
    assert len(os.listdir("/proc/self/fd")) == fds and threading.active_count() == threads


def test_two_running_traces_into_one_file_are_refused(tmp_path, monkeypatch):
    """The second trace into a file is refused at its start (by any spelling of the
    path): the last one to stop overwrote the other's file, silently."""
    path = tmp_path / "t.json"
    with disco.ThreadedSession(1) as a, disco.ThreadedSession(1) as b:
        with disco.trace(a, path):
            monkeypatch.chdir(tmp_path)
            for spelling in (path, "t.json", f"../{tmp_path.name}/t.json"):
                with pytest.raises(disco.DiscoValueError, match="another running trace"):
                    disco.trace(b, spelling).__enter__()
            with disco.trace(b, tmp_path / "other.json"):
                pass
        with disco.trace(b, path):  # free again once the first stopped
            pass
