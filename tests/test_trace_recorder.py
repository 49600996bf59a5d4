"""A worker's two rings (commands apart from collectives) read back as one stream.

Since the commands have a ring of their own, a worker holds up to twice ``capacity``
records; what it exports must still be one stream of at most ``capacity`` events,
the newest, with every collective before the command it ran in and ``dropped``
counting every event left out.
"""

from __future__ import annotations

import numpy as np
import pytest

import disco_core as disco
from disco_core import protocol
from disco_core.builtins import collective
from disco_core.registry import get_global_func, register_func
from disco_core.testing import trace_checks
from disco_core.tracing.recorder import K_COLLECTIVE, K_COMMAND, SHORT_RECORD, CommandRing, Recorder

pytestmark = pytest.mark.timeout(120)

CAPACITY = 1024


@collective
def _collectives(src, k):
    """``k`` allreduces of ``src`` in one command (a thread worker looks it up here)."""
    allreduce = get_global_func("disco.allreduce")
    for _ in range(k):
        allreduce(src, "max", False, src)  # max: no overflow however many


register_func("test_trace_recorder.collectives", _collectives, override=True)


def _check_track(data: dict, w: int, per_command: int, function: str) -> list[dict]:
    """Worker ``w``'s track in file order: at most CAPACITY events, consecutive indexes,
    each collective right before the command it ran in (``cmd_seq``), ``per_command`` of
    them in every command of ``function`` but the oldest kept one."""
    tid = w + 1
    events = [e for e in data["traceEvents"] if e["ph"] == "X" and e["tid"] == tid]
    assert CAPACITY - 1 <= len(events) <= CAPACITY, len(events)
    commands = [e for e in events if e["cat"] != "collective"]
    index = [e["args"]["index"] for e in commands]
    assert index == list(range(index[0], index[0] + len(index)))
    inside: list[dict] = []
    for e in events:
        if e["cat"] == "collective":
            inside.append(e)
            continue
        assert all(c["args"]["cmd_seq"] == e["args"]["seq"] for c in inside), (e, inside)
        if inside:
            assert e["name"] == function, e
        if e["name"] == function and e is not commands[0]:
            assert len(inside) == per_command, (e, len(inside))
        inside = []
    assert not inside  # no collective after the last command
    seqs = [e["args"]["seq"] for e in events if e["cat"] == "collective"]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    return events


def test_a_worker_with_more_events_than_capacity_and_no_ring_full_keeps_its_track(tmp_path):
    """700 allreduces: 700 commands and 700 collectives, neither ring full, 1,400
    events: the worker's track was refused whole (more than its ring holds)."""
    path = tmp_path / "t.json"
    n = 700
    with disco.ProcessSession(2) as sess:
        sess.init_ccl("shm")
        sess.import_python_module("disco_core.testing.funcs")
        x = sess.call_packed("testing.arange", 4)
        sess.allreduce(x, x, "max")  # its function fetched before the trace
        with disco.trace(sess, path, capacity=CAPACITY):
            for _ in range(n):
                sess.allreduce(x, x, "max")
            sess._sync_all()
    data = trace_checks.load_trace(path)
    other = data["otherData"]
    assert other["notes"] == []
    sends = {e["args"]["seq"]: e["name"] for e in data["traceEvents"] if e.get("cat") == "send"}
    for w in range(2):
        events = _check_track(data, w, 1, "disco.allreduce")
        # every event the worker recorded is in the file or counted: the commands and
        # collectives, the trace's start sync (dropped, the oldest), the block's sync,
        # and the trace's own stop sync (in the file unless it ended after the window)
        assert 2 * n + 2 <= len(events) + other["dropped"][w] <= 2 * n + 3
        for e in events:
            if e["cat"] == "command" and e["args"]["seq"] >= 0:
                assert sends[e["args"]["seq"]] == e["name"]
        last = [e for e in events if e["cat"] == "collective"][-1]
        assert last["args"]["cmd_seq"] == max(sends)  # the newest kept


def test_collectives_going_round_faster_than_commands_stay_with_their_commands(tmp_path):
    """Ten collectives per command: the collectives' ring goes round ten times faster
    than the commands', yet the stream is the newest CAPACITY events, in order."""
    path = tmp_path / "t.json"
    with disco.ThreadedSession(3) as sess:
        sess.init_ccl("shm")
        sess.import_python_module("disco_core.testing.funcs")
        x = sess.call_packed("testing.arange", 4)
        many = sess.get_global_func("test_trace_recorder.collectives")
        with disco.trace(sess, path, capacity=CAPACITY):
            for i in range(300):
                many(x, 10)
                if i % 2:
                    sess.call_packed("disco.worker_id")
            sess._sync_all()
    data = trace_checks.load_trace(path)
    assert data["otherData"]["notes"] == []
    for w in range(3):
        events = _check_track(data, w, 10, "test_trace_recorder.collectives")
        assert len(events) + data["otherData"]["dropped"][w] >= 300 * 11 + 150


@pytest.mark.parametrize("every", [1, 3, 40])
def test_export_keeps_the_newest_capacity_events_and_counts_the_rest(every):
    """The recorder alone: a collective in every ``every``-th command, 3,000 commands."""
    rec = Recorder(CAPACITY)
    ring = rec.commands = CommandRing(CAPACITY)
    written = 0
    ring.position = lambda: written
    collectives = 0
    for i in range(3000):
        t0 = 10 * i
        if i % every == 0:
            rec.add(K_COLLECTIVE, 5, t0 + 2, t0 + 5, collectives, 64, -1, 0)
            collectives += 1
        row = (K_COMMAND | 6 << 8, t0, t0 + 8, 40 + i, 0, protocol.CALL_PACKED)
        SHORT_RECORD.pack_into(ring.ring, (written % CAPACITY) * 48, *row)
        written += 1
    out = rec.export()
    ev = out["events"]
    assert len(ev) == CAPACITY and out["dropped"] == 3000 + collectives - CAPACITY
    assert (np.diff(ev[:, 3]) > 0).all()  # by end, the newest
    assert ev[-1, 0] == K_COMMAND and ev[-1, 6] == 2999
    coll = np.flatnonzero(ev[:, 0] == K_COLLECTIVE)
    coll = coll[coll + 1 < len(ev)]
    assert (ev[coll + 1, 0] == K_COMMAND).all() and (ev[coll + 1, 6] % every == 0).all()
