"""Tracing (``disco.trace``): what the recorder writes, on real sessions."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import disco_core as disco
from disco_core import protocol
from disco_core.testing import trace_checks
from disco_core.tracing import session_trace
from disco_core.tracing.format import worker_tid
from disco_core.tracing.recorder import (
    K_COLLECTIVE,
    K_COMMAND,
    K_SEND,
    K_SYNC,
    SEND_RECORD,
    SHORT_RECORD,
    CommandRing,
    Recorder,
    SendRing,
)

pytestmark = pytest.mark.timeout(120)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


load = trace_checks.load_trace
track = trace_checks.worker_events


def test_every_worker_records_every_command_in_order_and_collectives_line_up(tmp_path):
    """The issue's test: a 4-worker ProcessSession running the demo with shm."""
    path = tmp_path / "t.json"
    with disco.ProcessSession(4) as sess:
        sess.init_ccl("shm")
        trace_checks.traced_demo(sess, path)
    data = trace_checks.check_trace(path, 4)
    assert data["otherData"]["session"] == {"channel": "process", "num_workers": 4, "num_groups": 1}
    sends = [e for e in data["traceEvents"] if e.get("cat") == "send"]
    for e in sends:  # Disco's collectives say where the user's code sent them
        collective = e["name"] in session_trace.COLLECTIVE_FUNCTIONS
        assert (
            e["args"]["site"].startswith("trace_checks.py:")
            if collective
            else not e["args"]["site"]
        )
    assert sum(e["name"] == "disco.allreduce" for e in sends) == 6
    assert sum(e["cat"] == "copy" for e in track(data, 0)) >= 6  # copies back on worker 0
    flows = [e for e in data["traceEvents"] if e["ph"] in ("s", "t", "f")]
    keys = {
        e["args"]["key"]
        for e in data["traceEvents"]
        if e.get("cat") == "collective" and e["ph"] == "X"
    }
    assert len(flows) == 4 * len(keys)


def test_tracing_off_leaves_nothing_on_the_session_and_workers(tmp_path):
    with disco.ThreadedSession(2) as sess:
        with disco.trace(sess, tmp_path / "t.json"):
            assert "_record_send" in vars(sess)
        assert not {"_record_send", "_sync_worker", "copy_from_worker_0"} & set(vars(sess))
        assert sess._record_send is None
        workers = [link.worker for link in sess.channel.links]
        assert len(workers) == 2
        for worker in workers:
            assert not {"execute", "_record_call", "_record_other"} & set(vars(worker))
            assert worker._record_call is None and worker.ctx.tracer is None


def test_clock_offsets_measured_by_round_trips_are_within_their_precision(tmp_path, monkeypatch):
    """As for workers on another machine: the offset comes from round trips."""
    monkeypatch.setattr(session_trace, "clock_identity", lambda: "another kernel")
    path = tmp_path / "t.json"
    with disco.ProcessSession(2) as sess:
        with disco.trace(sess, path) as t:
            sess.call_packed("disco.worker_id")
            sess.sync_worker_0()
        assert t.shared_clock == [False, False]
    clock = load(path)["otherData"]["clock"]
    for offset, precision in zip(clock["offset_us"], clock["precision_us"]):
        assert precision > 0
        # the truth is 0 (one machine): the measurement says so within its precision
        assert abs(offset) <= precision + 1.0


def test_the_ring_keeps_the_newest_events_and_counts_the_rest(tmp_path):
    path = tmp_path / "t.json"
    with disco.ProcessSession(2) as sess:
        with disco.trace(sess, path, capacity=1024):
            for _ in range(3000):
                sess.call_packed("disco.worker_id")
            sess.sync_worker_0()
    data = load(path)
    for w in range(2):
        kept = track(data, w)
        # the ring's newest record may be the trace's own last sync, which ends after the
        # window closes and is left out of the file
        assert len(kept) in (1023, 1024)
        assert data["otherData"]["dropped"][w] >= 3000 - 1024
        idx = [e["args"]["index"] for e in kept]
        assert idx == list(range(idx[0], idx[0] + len(kept)))  # the newest, still in order


def test_a_workers_commands_and_collectives_read_back_in_one_stream_after_the_ring_went_round():
    """A worker writes its commands apart (six fields, the offset in a closure) and its
    collectives in the recorder; export() rebuilds full records, in order of their end,
    a collective before the command it ran in, and drops collectives of lost commands."""
    rec = Recorder(1024)
    ring = rec.commands = CommandRing(1024)
    written = 0
    ring.position = lambda: written
    for i in range(1536):  # 1.5 laps: calls, and every fourth command a sync (no call)
        t0 = 10 * i
        call = i % 4 != 3
        others_before = i // 4
        if call and i % 8 == 1:  # a collective inside this call
            rec.add(K_COLLECTIVE, 5, t0 + 2, t0 + 5, i, 64, -1, 0)
        row = (K_COMMAND | 6 << 8, t0, t0 + 8, 40 + i, others_before if call else -1,
               protocol.CALL_PACKED if call else protocol.SYNC_WORKER)  # fmt: skip
        SHORT_RECORD.pack_into(ring.ring, (written % 1024) * 48, *row)
        written += 1
    out = rec.export()
    ev = out["events"]
    # one stream of the newest 1024 events, as one ring kept them: 1536 commands and
    # 192 collectives were recorded, every one left out is counted
    assert len(ev) == 1024 and out["dropped"] == 1536 + 192 - 1024
    cmds = ev[ev[:, 0] == K_COMMAND]
    first = cmds[0, 6]
    assert (cmds[:, 6] == np.arange(first, 1536)).all()  # index: the place in the stream
    assert (cmds[:, 1] == 6).all() and (cmds[:, 5] == 40 + cmds[:, 6]).all()
    is_call = cmds[:, 7] == protocol.CALL_PACKED
    assert (cmds[is_call, 4] == cmds[is_call, 6] - cmds[is_call, 6] // 4).all()  # the seq
    assert (cmds[~is_call, 4] == -1).all()
    # each kept collective comes right before the command it ran in; none of a lost one
    coll = np.flatnonzero(ev[:, 0] == K_COLLECTIVE)
    assert len(coll) in (len(cmds[cmds[:, 6] % 8 == 1]) - 1, len(cmds[cmds[:, 6] % 8 == 1]))
    assert (ev[coll, 4] == ev[coll + 1, 6]).all() and (ev[coll + 1, 0] == K_COMMAND).all()


def test_the_controllers_sends_read_back_with_their_seq_after_the_ring_went_round():
    """The controller writes its sends apart (three fields, the offset in a closure);
    a send's seq is its place among them, and export() puts them among the syncs by time."""
    rec = Recorder(1024)
    ring = rec.sends = SendRing(1024)
    written = 0
    ring.position = lambda: written
    for i in range(1500):
        SEND_RECORD.pack_into(ring.ring, (written % 1024) * 24, 2, 10 * i, 3)
        written += 1
        if i % 100 == 0:
            rec.add(K_SYNC, 1, 10 * i + 2, 10 * i + 5, -1, 0, 1, 0)  # after this send
    out = rec.export()
    ev = out["events"]
    sends = ev[ev[:, 0] == K_SEND]
    assert len(sends) == 1024 and out["dropped"] == 1500 - 1024
    assert (sends[:, 4] == np.arange(1500 - 1024, 1500)).all()  # seq
    assert (sends[:, 2] == 10 * sends[:, 4]).all() and (sends[:, 3] == sends[:, 2]).all()
    assert (sends[:, 1] == 2).all() and (sends[:, 5] == 3).all() and (sends[:, 6:] == 0).all()
    assert (np.diff(ev[:, 3]) >= 0).all()  # one stream, in order of the events' ends
    syncs = np.flatnonzero(ev[:, 0] == K_SYNC)
    assert len(syncs) == 15  # the syncs' ring did not go round: all kept
    later = syncs[ev[syncs, 2] > sends[0, 2]]  # those after the first kept send
    assert len(later) == 10 and (ev[later - 1, 0] == K_SEND).all()


def test_mixed_commands_keep_their_places_when_the_ring_goes_round(tmp_path):
    """call_packed (short records) and syncs (long ones) interleaved past the ring's end:
    every kept command has the next index, and each call the controller's seq."""
    path = tmp_path / "t.json"
    with disco.ProcessSession(2) as sess:
        f = sess.get_global_func("disco.worker_id")
        with disco.trace(sess, path, capacity=1024):
            for i in range(1500):
                f()
                if i % 3 == 0:
                    sess._sync_worker(1)
            sess._sync_all()
    data = load(path)
    sent = {e["args"]["seq"] for e in data["traceEvents"] if e.get("cat") == "send"}
    for w in range(2):
        kept = track(data, w)
        assert len(kept) >= 1000
        idx = [e["args"]["index"] for e in kept]
        assert idx == list(range(idx[0], idx[0] + len(kept)))
        seqs = [e["args"]["seq"] for e in kept if e["name"] == "disco.worker_id"]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        assert 1499 in seqs and 1499 in sent  # the last call: among the newest, kept on both sides


def test_a_million_events_stay_in_a_fixed_ring():
    rec = Recorder(4096)
    size = len(rec._ring)
    for i in range(1_000_000):
        rec.add(K_COMMAND, 0, i, i + 1, i)
    assert len(rec._ring) == size == 4096 * 64
    assert rec.dropped == 1_000_000 - 4096
    ev = rec.events()
    assert ev.shape == (4096, 8)
    assert ev[0, 4] == 1_000_000 - 4096 and ev[-1, 4] == 999_999


def test_a_worker_that_dies_leaves_its_track_empty_with_a_note(tmp_path):
    path = tmp_path / "t.json"
    with disco.ProcessSession(3) as sess:
        t = session_trace.Trace(sess, path).start()
        sess.import_python_module("disco_core.testing.funcs")
        victim = sess.call_packed("testing.pid").debug_get_from_remote(2)
        os.kill(victim, 9)
        with pytest.raises(disco.WorkerDiedError):
            for _ in range(200):
                sess.call_packed("disco.worker_id")
                sess._sync_all()
        t.stop()
    data = load(path)
    notes = data["otherData"]["notes"]
    assert "worker 2: no events (it died)" in notes
    # worker 0 lives in this process: its events are read directly; worker 1 is asked
    # alone (once it was lost too: after a death every wait of the session raised)
    assert track(data, 0) and track(data, 1) and not track(data, 2)


def test_bad_arguments_are_refused_at_the_call(tmp_path):
    with disco.ThreadedSession(1) as sess:
        with pytest.raises(disco.DiscoValueError, match="does not exist"):
            disco.trace(sess, tmp_path / "missing" / "t.json").__enter__()
        (tmp_path / "a_file").write_text("")
        with pytest.raises(disco.DiscoValueError, match="is a file, not a folder"):
            disco.trace(sess, tmp_path / "a_file" / "t.json").__enter__()
        with pytest.raises(disco.DiscoTypeError, match="file name"):
            disco.trace(sess, 3).__enter__()
        with pytest.raises(disco.DiscoValueError, match="capacity"):
            disco.trace(sess, tmp_path / "t.json", capacity=10).__enter__()
        with pytest.raises(disco.DiscoTypeError, match="Session"):
            disco.trace("not a session", tmp_path / "t.json").__enter__()
        with disco.trace(sess, tmp_path / "t.json"):
            with pytest.raises(disco.DiscoError, match="already being traced"):
                disco.trace(sess, tmp_path / "u.json").__enter__()


def test_session_create_traces_until_shutdown(tmp_path):
    path = tmp_path / "whole.json"
    sess = disco.Session.create("process", num_workers=2, trace=path)
    sess.call_packed("disco.worker_id")
    sess.sync_worker_0()
    assert not path.exists()
    sess.shutdown()
    assert [e["name"] for e in track(load(path), 1) if e["args"]["seq"] >= 0] == ["disco.worker_id"]


def test_disco_trace_traces_a_whole_program(tmp_path):
    script = textwrap.dedent(
        """
        import disco_core as disco
        a = disco.ProcessSession(2)
        a.call_packed("disco.worker_id"); a.sync_worker_0(); a.shutdown()
        b = disco.ThreadedSession(2)            # never shut down: written at exit
        b.call_packed("disco.worker_id"); b.sync_worker_0()
        """
    )
    env = dict(os.environ, DISCO_TRACE=str(tmp_path / "prog.json"))
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=60, cwd=REPO)
    first, second = load(tmp_path / "prog.json"), load(tmp_path / "prog.1.json")
    assert first["otherData"]["session"]["channel"] == "process"
    assert second["otherData"]["session"]["channel"] == "threaded"
    for data in (first, second):
        assert any(e["name"] == "disco.worker_id" for e in track(data, 1))


def test_a_programs_own_trace_block_works_under_disco_trace(tmp_path):
    """A program that used ``disco.trace`` itself failed under ``DISCO_TRACE`` ("this
    session is already being traced"): a whole-program trace changed what the program
    did (outside check). The block writes its file; the session's DISCO_TRACE file ends
    as it starts, and the next numbered one starts as it ends."""
    script = textwrap.dedent(
        f"""
        import disco_core as disco
        with disco.ThreadedSession(2) as s:
            s.call_packed("disco.worker_id"); s.sync_worker_0()
            with disco.trace(s, {str(tmp_path / "own.json")!r}):
                s.call_packed("disco.world_size"); s.sync_worker_0()
            s.call_packed("disco.worker_id"); s.sync_worker_0()
        print("done")
        """
    )
    env = dict(os.environ, DISCO_TRACE=str(tmp_path / "prog.json"))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60, cwd=REPO)  # fmt: skip
    assert out.returncode == 0 and out.stdout == "done\n", out.stderr
    before, own, after = (load(tmp_path / n) for n in ("prog.json", "own.json", "prog.1.json"))
    names = [
        [e["name"] for e in track(d, 1) if e["args"]["seq"] >= 0] for d in (before, own, after)
    ]
    assert names == [["disco.worker_id"], ["disco.world_size"], ["disco.worker_id"]]


def test_disco_trace_overwrites_no_file_of_a_programs_own_block(tmp_path):
    """Under DISCO_TRACE, a block into the DISCO_TRACE file itself overwrote it, one
    into the next numbered name was overwritten by the trace started after the block,
    and a block refused as it started ended the program's trace for good (outside
    check). The first is refused, the next numbered file skips names the program
    used, and the program's trace goes on after a refused block."""
    script = textwrap.dedent(
        f"""
        import disco_core as disco
        folder = {str(tmp_path)!r}
        with disco.ThreadedSession(2) as s:
            s.call_packed("disco.worker_id"); s.sync_worker_0()
            try:
                with disco.trace(s, folder + "/prog.json"):
                    pass
            except disco.DiscoValueError as exc:
                print("refused:", "DISCO_TRACE" in str(exc))
            with disco.trace(s, folder + "/prog.1.json"):  # the next name DISCO_TRACE would take
                s.call_packed("disco.world_size"); s.sync_worker_0()
            s.call_packed("disco.group_id"); s.sync_worker_0()  # into prog.2.json
            with disco.ThreadedSession(1) as o, disco.trace(o, folder + "/other.json"):
                try:  # refused after s's trace (prog.2.json) ended: it starts again
                    with disco.trace(s, folder + "/other.json"):
                        pass
                except disco.DiscoValueError:
                    print("in use")
                s.call_packed("disco.worker_rank"); s.sync_worker_0()
        """
    )
    env = dict(os.environ, DISCO_TRACE=str(tmp_path / "prog.json"))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60, cwd=REPO)  # fmt: skip
    assert out.returncode == 0 and out.stdout == "refused: True\nin use\n", out.stderr
    calls = {
        name: [e["name"] for e in track(load(tmp_path / name), 1) if e["args"]["seq"] >= 0]
        for name in sorted(os.listdir(tmp_path))
        if name != "other.json"  # (o's block: one worker)
    }
    assert calls == {
        "prog.json": ["disco.worker_id"],  # the refused block did not end it; the next did
        "prog.1.json": ["disco.world_size"],  # the block's, not overwritten
        "prog.2.json": ["disco.group_id"],  # skipped prog.1.json
        "prog.3.json": [],  # o's, ended by its block at once
        "prog.4.json": ["disco.worker_rank"],  # s's again, after the refused block
        "prog.5.json": [],  # o's again, after its block
    }


@pytest.mark.parametrize("late", [2, 0])
def test_summary_names_the_worker_made_late_as_the_straggler(tmp_path, late):
    """The issue's test: a sleep on one worker before an allreduce, named by ``disco trace summary``."""
    path = tmp_path / "late.json"
    with disco.ProcessSession(4) as sess:
        sess.init_ccl("shm")
        trace_checks.traced_demo(sess, path, late_worker=late, late_s=0.2)
    trace_checks.check_trace(path, 4)
    trace_checks.check_straggler(path, late, 0.2)
    out = subprocess.run(
        [sys.executable, "-m", "disco_core", "trace", "summary", str(path)],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0].startswith(f"worker {late} arrived last at ")


def test_a_worker_that_answers_garbage_gets_a_note_not_a_crash(tmp_path, monkeypatch):
    """A remote worker's answer is checked before it is used (it may be anyone's)."""
    from disco_core import builtins, registry
    from disco_core.worker import current

    real = builtins.trace_stop
    answers = {
        1: {"names": ["x"], "events": np.zeros((2, 8), np.int64) + 5, "dropped": 0},  # bad name id
        2: {"names": "x", "events": np.zeros((0, 8), np.int64), "dropped": 0},
    }

    def lying_stop():
        got = real()
        return answers.get(current().worker_id, got)

    registry.register_func("disco.trace_stop", lying_stop, override=True)
    try:
        path = tmp_path / "t.json"
        with disco.ThreadedSession(3) as sess, disco.trace(sess, path):
            sess.call_packed("disco.worker_id")
    finally:
        registry.register_func("disco.trace_stop", real, override=True)
    data = load(path)
    notes = " ".join(data["otherData"]["notes"])
    assert "worker 1: no events" in notes and "strings it did not send" in notes
    assert "worker 2: no events" in notes and "list of str" in notes
    assert track(data, 0) and not track(data, 1) and not track(data, 2)


def test_a_send_and_its_recv_are_one_exchange_split_into_waiting_and_moving(tmp_path):
    """The k-th send from a to b and the k-th recv on b from a share a key: the one that
    came early waited for the other, like at a collective."""
    from disco_core.tracing import summary

    path = tmp_path / "p2p.json"
    with disco.ProcessSession(2) as sess:
        sess.init_ccl("shm")
        sess.import_python_module("disco_core.testing.funcs")
        sess.import_python_module("disco_core.testing.ccl_funcs")
        buf = sess.call_packed("ccl_kit.input", (256,), "float32", 7)
        out = sess.empty((256,), "float32")
        with disco.trace(sess, path):
            sess.call_packed("testing.sleep", 0.2, 1)  # worker 1 comes late to the exchange
            peer = sess.call_packed("ccl_kit.peer", "next")  # the other worker, on each
            sess.call_packed("ccl_kit.exchange", buf, out, peer, peer)
            sess._sync_all()
    data = load(path)
    keys = {w: [e["args"]["key"] for e in track(data, w, "collective")] for w in range(2)}
    assert sorted(keys[0]) == sorted(keys[1]) == ["p2p:0>1:0", "p2p:1>0:0"]
    s = summary.summarize(summary.load(path))
    assert s.headline.startswith("worker 1 ")
    assert s.workers[0].waiting_ms >= 150  # it waited for worker 1's sleep
    assert [row.op for row in s.call_sites] == ["send/recv"]


def test_a_register_taken_over_by_a_collective_gets_its_call_site(tmp_path):
    """The controller remembers which registers are not collectives; a freed register
    taken by a collective cached later in the trace must not keep that answer."""
    import gc

    path = tmp_path / "t.json"
    with disco.ProcessSession(2) as sess:
        sess.init_ccl("shm")
        x = sess.empty((4,), "float32")
        with disco.trace(sess, path):
            f = sess.get_global_func("disco.worker_id")
            r = f()
            old = f.reg_id
            del f
            gc.collect()
            keep = sess.empty((1,), "float32")  # the register's release rides with this one
            assert sess._free_regs[-1] == old  # the next register taken is f's
            sess.allreduce(x, x, "sum")  # the first: cached now, on f's register
            sess._sync_all()
        assert sess._cache["disco.allreduce"].reg_id == old
        del r, keep
    sends = [e for e in load(path)["traceEvents"] if e.get("cat") == "send"]
    (ar,) = [e for e in sends if e["name"] == "disco.allreduce"]
    assert ar["args"]["site"].startswith("test_trace.py:"), ar


def test_a_collective_is_recorded_alike_from_positional_and_keyword_arguments():
    """Positional arguments are read from their places (a dict of them cost ~0.4 us a
    collective) and the names made once per kind of call (str() of a dtype: ~3 us);
    keywords take the general path. Both give the same record."""

    class Ctx:
        group_id = 3

    class FakeCCL:
        ctx = Ctx()

    def op_named(name):
        def op(self, *args, **kwargs):
            return None

        op.__name__ = name
        return op

    a, b = np.ones(8, np.float32), np.zeros(8, np.float32)
    calls = {
        "allreduce": ((a, b, "max", True), dict(src=a, dst=b, op="max", in_group=True)),
        "allgather": ((a, b), dict(src=a, dst=b)),
        "gather": ((a, b, True), dict(src=a, dst=b, in_group=True)),
        "broadcast": ((None, b, False), dict(src=None, dst=b, in_group=False)),
        "scatter": ((None, b), dict(src=None, dst=b)),
        "send": ((a, 1), dict(buf=a, peer=1)),
        "recv": ((b, 0), dict(buf=b, peer=0)),
        "barrier": ((True,), dict(in_group=True)),
    }
    rows = {}
    for how in (0, 1):
        rec = Recorder(1024)
        for name, (args, kwargs) in calls.items():
            for _ in range(2):  # the second from the cache
                if how == 0:
                    rec.collective(FakeCCL(), op_named(name), None, args, {})
                else:
                    rec.collective(FakeCCL(), op_named(name), None, (), kwargs)
        ev = rec.export()["events"]
        rows[how] = [(rec.names[r[1]], r[4], r[5], rec.names[r[7]]) for r in ev.tolist()]
    assert rows[0] == rows[1]
    got = {(name, attrs) for name, _seq, _n, attrs in rows[0]}
    assert ("allreduce", "float32|max|group|3|-1") in got
    assert ("broadcast", "float32||world|3|-1") in got
    assert ("send", "float32||p2p|3|1") in got and ("barrier", "||group|3|-1") in got
    assert [n for name, _s, n, _a in rows[0] if name == "allreduce"] == [32, 32]


def test_calls_of_one_communicator_share_its_seq_however_they_are_written():
    """The cache of a call's names is keyed by how it was written (positional or not,
    in_group given or defaulted, dtype); its seq counter is the communicator's, shared
    by every entry. An argument that cannot be hashed takes the uncached way."""

    class Ctx:
        group_id = 0

    class FakeCCL:
        ctx = Ctx()

    def allreduce(self, *args, **kwargs):
        return None

    a, b = np.ones(4, np.float32), np.zeros(4, np.float32)
    c = np.ones(4, np.int64)
    rec = Recorder(1024)
    writes = [
        ((a, b, "sum"), {}),  # in_group defaulted: world
        ((a, b, "sum", False), {}),  # the same communicator, another cache entry
        ((), dict(src=a, dst=b, op="sum")),
        ((c, c, "max", False), {}),  # another dtype and reduction
        ((a, b, ["sum"], False), {}),  # unhashable: not cached, still counted
        ((a, b, "sum", True), {}),  # the group's own counter
        ((a, b, "sum"), {}),
    ]
    for args, kwargs in writes:
        rec.collective(FakeCCL(), allreduce, None, args, kwargs)
    ev = rec.export()["events"].tolist()
    got = [(r[4], rec.names[r[7]].split("|")[2], r[5]) for r in ev]
    assert got == [
        (0, "world", 16), (1, "world", 16), (2, "world", 16), (3, "world", 32),
        (4, "world", 16), (0, "group", 16), (5, "world", 16),
    ]  # fmt: skip
    assert rec.names[ev[3][7]].startswith("int64|max|")


def test_a_freed_function_register_taken_by_a_returned_function_loses_its_old_name(tmp_path):
    """A register that held ``get_global_func("testing.add")`` and, once freed, holds a
    function a call returned names no global function: the worker's errors call it by
    its register and the trace by the function's own name, not "testing.add"."""
    sess = disco.ProcessSession(2)
    try:
        sess.import_python_module("disco_core.testing.funcs")
        echo = sess.get_global_func("testing.echo")
        path = tmp_path / "t.json"
        with disco.trace(sess, path):
            add = sess.get_global_func("testing.add")
            assert add(1, 2).debug_get_from_remote(1) == 3
            freed = add.reg_id
            del add
            echo(0)  # the kill of add's register rides with this command
            held = echo(echo)  # the returned function (echo) lands in the freed register
            assert held.reg_id == freed
            with pytest.raises(disco.WorkerError) as err:
                sess.call_packed(held, 1, 2, 3).debug_get_from_remote(1)  # echo takes one
        assert "testing.add" not in str(err.value)
        assert f"register {freed}" in str(err.value)
        events = json.loads(path.read_text())["traceEvents"]
        names = [e["name"] for e in events if e.get("cat") == "command" and e["tid"] != 0]
        assert names.count("testing.add") == 2  # the call before, on each worker
        assert names.count("echo") == 2  # (its own name: a function no global name reaches)
    finally:
        sess.shutdown()


@pytest.mark.timeout(120)
def _assert_only_worker_1_left_out(path) -> None:
    """Worker 1 (busy) has no track and a note says why; workers 0 and 2 have theirs."""
    data = json.loads(path.read_text())
    notes = data["otherData"]["notes"]
    assert any(n.startswith("worker 1: no events (it did not answer") for n in notes), notes
    tracks = {e["tid"] for e in data["traceEvents"] if e.get("cat") == "command"}
    assert {worker_tid(0), worker_tid(2)} <= tracks
    assert worker_tid(1) not in tracks


def test_a_traced_shutdown_does_not_wait_for_a_worker_busy_for_good(tmp_path, monkeypatch):
    """Stopping the trace at shutdown waits DISCO_SHUTDOWN_TIMEOUT at most, as the rest
    of a shutdown does: a worker busy in a long function is left out of the file, with
    a note, and the others' tracks are written (it waited for the function's end)."""
    monkeypatch.setenv("DISCO_SHUTDOWN_TIMEOUT", "2")
    sess = disco.ProcessSession(3)
    sess.import_python_module("disco_core.testing.funcs")
    path = tmp_path / "t.json"
    session_trace.Trace(sess, path).start()  # on until the shutdown, as DISCO_TRACE is
    echo = sess.get_global_func("testing.echo")
    assert echo(5).debug_get_from_remote(2) == 5
    sess.get_global_func("testing.sleep")(300.0, 1)  # worker 1: busy for 5 minutes
    t0 = time.monotonic()
    sess.shutdown()
    assert time.monotonic() - t0 < 30
    _assert_only_worker_1_left_out(path)


def test_a_block_that_fails_does_not_wait_for_a_stuck_worker(tmp_path, monkeypatch):
    """Ctrl-C (or any exception) in ``with disco.trace`` while a worker is stuck (in a
    collective its controller side left, outside check) waited for the whole CCL
    timeout, 300 s by default: the stop now waits DISCO_SHUTDOWN_TIMEOUT, as a
    shutdown does, and writes the other workers' tracks."""
    monkeypatch.setenv("DISCO_SHUTDOWN_TIMEOUT", "1")
    path = tmp_path / "t.json"
    with disco.ProcessSession(3) as sess:
        sess.import_python_module("disco_core.testing.funcs")
        echo = sess.get_global_func("testing.echo")
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            with disco.trace(sess, path):
                assert echo(5).debug_get_from_remote(2) == 5
                sess.get_global_func("testing.sleep")(300.0, 1)  # worker 1: stuck
                sess.channel.flush()
                raise KeyboardInterrupt
        assert time.monotonic() - t0 < 20
    _assert_only_worker_1_left_out(path)


def test_a_worker_that_dies_in_a_traced_block_loses_only_its_own_track(tmp_path):
    """The block's WorkerDiedError stays the one raised; the file is written with a
    note, and every live worker's track is kept: worker 0's (in this process) and
    worker 1's (a live process, asked despite worker 2's death)."""
    path = tmp_path / "t.json"
    with disco.ProcessSession(3) as sess:
        sess.import_python_module("disco_core.testing.funcs")
        echo = sess.get_global_func("testing.echo")
        with pytest.raises(disco.WorkerDiedError):
            with disco.trace(sess, path):
                assert echo(5).debug_get_from_remote(2) == 5
                os.kill(sess.channel.links[2].proc.pid, signal.SIGKILL)
                for _ in range(100):
                    echo(1)
                    sess._sync_all()
                    time.sleep(0.05)
    data = json.loads(path.read_text())
    notes = data["otherData"]["notes"]
    assert any("a worker died during the trace" in n for n in notes), notes
    assert "worker 2: no events (it died)" in notes
    assert not any(n.startswith(("worker 0", "worker 1")) for n in notes), notes
    tracks = {e["tid"] for e in data["traceEvents"] if e.get("cat") == "command"}
    assert {worker_tid(0), worker_tid(1)} <= tracks
    assert worker_tid(2) not in tracks
    # the summary says why worker 2 looks idle
    from disco_core.tracing import summary

    text = summary.format_summary(summary.summarize(summary.load(path)))
    assert "note: worker 2: no events (it died)" in text


def test_a_worker_that_dies_in_a_collective_leaves_the_live_workers_tracks(tmp_path):
    """Worker 2 exits while workers 0 and 1 wait for it in an shm allreduce: the CCL
    is aborted, and both live tracks keep the failed allreduce."""
    path = tmp_path / "t.json"
    with disco.ProcessSession(3) as sess:
        sess.init_ccl("shm")
        sess.import_python_module("disco_core.testing.funcs")
        die = sess.get_global_func("testing.die")
        x, y = sess.empty((16,), "float32"), sess.empty((16,), "float32")
        with pytest.raises(disco.WorkerDiedError):
            with disco.trace(sess, path):
                die("exit", 2, os.getpid(), 0.3)
                sess.allreduce(x, y, "sum")
                sess._sync_all()
    data = json.loads(path.read_text())
    notes = data["otherData"]["notes"]
    assert "worker 2: no events (it died)" in notes
    assert not any(n.startswith(("worker 0", "worker 1")) for n in notes), notes
    ops = {e["tid"] for e in data["traceEvents"] if e.get("cat") == "collective"}
    assert ops == {worker_tid(0), worker_tid(1)}


@pytest.mark.parametrize("kind", ["process", "threaded"])
def test_another_threads_sends_are_numbered_alike_on_both_sides_when_a_trace_starts(tmp_path, kind):
    """The workers number commands from trace_start on; the controller numbered its sends
    only from after the start's sync, so another thread's sends in between shifted every
    later number (outside check: 19 of 20 traces, sends timed after their commands)."""
    sess = disco.ProcessSession(2) if kind == "process" else disco.ThreadedSession(2)
    with sess:
        sess.import_python_module("disco_core.testing.funcs")
        fa, fb = sess.get_global_func("testing.echo"), sess.get_global_func("disco.worker_id")
        stop = threading.Event()

        def flood():
            i = 0
            while not stop.is_set():
                fa(1)
                fb()
                i += 1
                if i % 200 == 0:
                    sess.sync_worker_0()

        th = threading.Thread(target=flood, daemon=True)
        th.start()
        try:
            for k in range(3):
                with disco.trace(sess, tmp_path / f"t{k}.json", capacity=8192):
                    time.sleep(0.01)
        finally:
            stop.set()
            th.join(30)
        assert sess._record_send is None  # untraced sends record nothing again
    checked = 0
    for k in range(3):
        events = json.loads((tmp_path / f"t{k}.json").read_text())["traceEvents"]
        sends = {e["args"]["seq"]: e for e in events if e.get("cat") == "send"}
        for w in range(2):
            cmds = {
                e["args"]["seq"]: e
                for e in events
                if e.get("cat") == "command" and e["tid"] == worker_tid(w) and e["args"]["seq"] >= 0
            }
            # every command the workers numbered was sent while the controller recorded
            # (its sends end with the trace's stop, as the workers' numbering does)
            assert max(cmds) <= max(sends), (k, w, max(cmds), max(sends))
            for seq in set(sends) & set(cmds):
                send, cmd = sends[seq], cmds[seq]
                # a command cannot start before it was sent (clocks: +-100 us here)
                assert send["ts"] <= cmd["ts"] + 100, (k, w, seq, send, cmd)
                if send["name"] != "call_packed":  # else its name was in a dropped event
                    assert send["name"] == cmd["name"], (k, w, seq)
                checked += 1
    assert checked > 100


@pytest.mark.parametrize("kind", ["threaded", "process"])
def test_commands_in_the_same_batch_as_trace_start_are_numbered(tmp_path, monkeypatch, kind):
    """An in-process worker runs its queued commands in batches, and read its execute
    once a batch: commands behind trace_start in the same batch ran unrecorded and
    unnumbered, and every later command's seq was off (outside check: 13 of 100 traces
    with two sending threads). Here another "thread" sends right after the start."""
    sess = disco.ThreadedSession(2) if kind == "threaded" else disco.ProcessSession(2)
    with sess:
        sess.import_python_module("disco_core.testing.funcs")
        echo = sess.get_global_func("testing.echo")
        install = session_trace.Trace._install

        def install_then_send(self, rec):
            install(self, rec)
            for i in range(3):  # queued behind trace_start, before the start's sync
                echo(i)

        monkeypatch.setattr(session_trace.Trace, "_install", install_then_send)
        path = tmp_path / "t.json"
        with disco.trace(sess, path):
            for i in range(4):
                echo(i)
    events = json.loads(path.read_text())["traceEvents"]
    sends = sorted(e["args"]["seq"] for e in events if e.get("cat") == "send")
    assert sends == [3, 4, 5, 6]  # the first three ran before the window opened
    for w in range(2):
        ran = sorted(
            e["args"]["seq"]
            for e in events
            if e.get("cat") == "command" and e["tid"] == worker_tid(w) and e["args"]["seq"] >= 0
        )
        assert ran == sends, (w, ran)


def test_each_collective_gets_its_own_call_site_whichever_way_it_was_called(tmp_path):
    """A collective's call site is the user's line, however many session functions lie
    between it and the send, and from whatever depth of the user's stack: a guard for
    any shortcut in the walk (one that reused the depth of the last call was tried)."""
    path = tmp_path / "t.json"
    lines: list[int] = []

    def here() -> int:
        return sys._getframe(1).f_lineno

    with disco.ProcessSession(2) as sess:
        sess.init_ccl("shm")
        x = sess.empty((4,), "float32")
        sess.allreduce(x, x, "sum")
        # the session's own handle: a send of it is known as a collective's (has a site)
        ar = sess._cache["disco.allreduce"]

        def deeper(n: int) -> None:
            if n:
                return deeper(n - 1)
            lines.append(here() + 1)
            sess.allreduce(x, x, "sum")

        with disco.trace(sess, path):
            for _ in range(2):
                lines.append(here() + 1)
                sess.allreduce(x, x, "sum")  # through Session.allreduce, _collective, call_packed
                lines.append(here() + 1)
                sess.call_packed("disco.allreduce", x, "sum", True, x)  # call_packed: shallower
                lines.append(here() + 1)
                ar(x, "sum", True, x)  # through DPackedFunc.__call__
                deeper(3)  # the same session path from a deeper stack
            sess._sync_all()
    sends = [e for e in load(path)["traceEvents"] if e.get("cat") == "send"]
    sites = [e["args"]["site"] for e in sends if e["name"] == "disco.allreduce"]
    assert sites == [f"test_trace.py:{n}" for n in lines]


@pytest.mark.timeout(120)
def test_controller_slices_of_threads_sharing_a_session_nest(tmp_path):
    """Two controller threads syncing and copying at once: each call was timed from
    before it took the session's sync lock, so a call waiting for the other thread's
    overlapped that one's slice on the controller's track without nesting, which
    Perfetto cannot show (outside check: 31 overlaps)."""
    path = tmp_path / "t.json"
    with disco.ProcessSession(2) as sess:
        sess.import_python_module("disco_core.testing.funcs")
        sleep, wid = sess.get_global_func("testing.sleep"), sess.get_global_func("disco.worker_id")
        arr = sess.empty((1 << 16,), "float32")

        def syncs() -> None:
            for _ in range(30):
                sess.call_packed(sleep, 0.002)
                sess.sync_worker_0()

        def gets() -> None:
            host = np.empty(1 << 16, "float32")
            for _ in range(30):
                sess.call_packed(wid).debug_get_from_remote(1)
                sess.copy_from_worker_0(host, arr)

        with disco.trace(sess, str(path)):
            threads = [threading.Thread(target=gets)]
            for t in threads:
                t.start()
            syncs()  # the thread that started the trace too, with other methods than theirs
            for t in threads:
                t.join()
    slices = sorted(
        (e["ts"], e["ts"] + e["dur"])
        for e in json.loads(path.read_text())["traceEvents"]
        if e.get("ph") == "X" and e.get("tid") == 0 and e["dur"] > 0
    )
    assert len(slices) >= 60
    open_ends: list[float] = []
    for start, end in slices:
        while open_ends and open_ends[-1] <= start:
            open_ends.pop()
        assert not open_ends or end <= open_ends[-1], "a slice overlaps another without nesting"
        open_ends.append(end)


@pytest.mark.parametrize("kind", ["threaded", "process"])
def test_a_loaded_modules_function_is_named_in_the_trace(tmp_path, kind):
    """``mod["twice"]`` of a loaded file has no global name: its commands were named
    "register 29" on every worker (outside check). They carry its qualified name."""
    src = tmp_path / "named_mod.py"
    src.write_text("def twice(x):\n    return 2 * x\n")
    path = tmp_path / "t.json"
    session = disco.ThreadedSession if kind == "threaded" else disco.ProcessSession
    with session(2) as sess:
        twice = sess.load_vm_module(str(src))["twice"]
        with disco.trace(sess, str(path)):
            assert twice(3).debug_get_from_remote(1) == 6
    for w in (0, 1):
        assert "twice" in [e["name"] for e in track(load(path), w)]
