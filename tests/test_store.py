"""The rendezvous store (``disco_core.store``; ``current().store`` on every worker)."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import uuid

import pytest

import disco_core as disco
from disco_core import plugins
from disco_core import protocol as P
from disco_core.ccl.base import CCL, Rendezvous
from disco_core.errors import CCLError
from disco_core.spi import ControllerStore, StoreTimeoutError
from disco_core.testing.funcs import machine_identity  # noqa: F401  (registers testing.*)
from disco_core.wire_values import decode_untrusted, encode_for_network

FUNCS = "disco_core.testing.funcs"
SESSIONS = {
    "threaded": lambda n: disco.ThreadedSession(n),
    "process": lambda n: disco.ProcessSession(n),
}


@pytest.fixture(params=sorted(SESSIONS))
def make(request):
    made: list[disco.Session] = []

    def factory(n: int = 3) -> disco.Session:
        sess = SESSIONS[request.param](n)
        made.append(sess)
        sess.import_python_module(FUNCS)
        return sess

    yield factory
    for sess in made:
        sess.shutdown()


def _all(ref: disco.DRef, n: int) -> list:
    return [ref.debug_get_from_remote(w) for w in range(n)]


# ---------------------------------------------------------------------------- sessions
@pytest.mark.timeout(60)
def test_every_worker_sets_then_gets_all(make):
    sess = make(3)
    ref = sess.get_global_func("testing.store_exchange")("ex", 10.0)
    want = [b"value of %d" % w for w in range(3)]
    assert _all(ref, 3) == [want] * 3


@pytest.mark.timeout(60)
def test_add_counts_every_worker(make):
    sess = make(4)
    ref = sess.get_global_func("testing.store_add")("count")
    assert sorted(_all(ref, 4)) == [1, 2, 3, 4]  # atomic: every worker saw its own step
    got = sess.get_global_func("testing.store_get")("count", 5.0)
    assert _all(got, 4) == [b"4"] * 4


@pytest.mark.timeout(60)
def test_get_timeout_names_the_key(make):
    sess = make(3)
    t0 = time.monotonic()
    sess.get_global_func("testing.store_get")("never/set", 0.3)
    with pytest.raises(StoreTimeoutError, match="never/set") as info:
        sess.sync_worker_0()
        sess._sync_all()
    assert time.monotonic() - t0 < 10
    assert "DISCO_STORE_TIMEOUT" in str(info.value)


@pytest.mark.timeout(60)
def test_wait_timeout_names_only_the_missing_keys(make):
    sess = make(2)
    sess.get_global_func("testing.store_set")("here", b"x")
    sess._sync_all()
    store = sess._store
    with pytest.raises(StoreTimeoutError, match="'gone'") as info:
        store.wait(["here", "gone"], timeout=0.1)
    assert info.value.missing == ("gone",)
    assert "'here'" not in str(info.value)


@pytest.mark.timeout(60)
def test_bad_keys_and_values_fail_at_the_call_site(make):
    sess = make(2)
    ref = sess.get_global_func("testing.store_bad_calls")()
    for results in _all(ref, 2):
        kinds = {name: kind for name, kind, _ in results}
        assert kinds == {
            "set(int key)": "DiscoTypeError",
            "set(empty key)": "DiscoValueError",
            "set(long key)": "DiscoValueError",
            "set(str value)": "DiscoTypeError",
            "set(big value)": "DiscoValueError",
            "get(bytes key)": "DiscoTypeError",
            "get(negative timeout)": "DiscoValueError",
            "wait(str keys)": "DiscoTypeError",
            "add(float amount)": "DiscoTypeError",
        }
        texts = {name: text for name, _, text in results}
        assert "key" in texts["set(int key)"] and "int" in texts["set(int key)"]
        assert "1048576" in texts["set(big value)"]


@pytest.mark.timeout(60)
def test_commands_set_aside_during_a_wait_run_in_order(make):
    sess = make(3)
    sess.get_global_func("testing.store_wait_then_log")("go", 0.5)
    log = sess.get_global_func("testing.store_log")
    for i in range(5):  # reach the waiting workers while they read for their answer
        log(i)
    ref = sess.get_global_func("testing.store_read_log")()
    assert _all(ref, 3) == [["waited", 0, 1, 2, 3, 4]] * 3


@pytest.mark.timeout(60)
def test_secret_value_never_logged(make, caplog, capfd, monkeypatch):
    monkeypatch.setenv("DISCO_LOG_LEVEL", "DEBUG")  # the worker processes log everything too
    secret = b"s3cr3t-t0ken-%d" % os.getpid()
    with caplog.at_level(logging.DEBUG):
        sess = make(3)
        ref = sess.get_global_func("testing.store_exchange")("sec", 10.0, secret)
        assert all(secret in v for vals in _all(ref, 3) for v in vals)
        sess.get_global_func("testing.store_get")("sec/none", 0.2)
        with pytest.raises(StoreTimeoutError) as info:
            sess._sync_all()
        sess.shutdown()
    assert secret.decode() not in str(info.value)
    assert "session started" in caplog.text  # the capture works
    assert secret.decode() not in caplog.text
    out, err = capfd.readouterr()
    if sess.channel.kind == "process":
        assert "worker 1 of 3 started" in err  # the workers' own DEBUG logs are here
    assert secret.decode() not in out + err
    text = P.describe_command((P.STORE_REPLY, 3, True, secret))
    assert secret.decode() not in text and f"<{len(secret)} bytes>" in text


def _unused(self, *args):
    raise NotImplementedError("only initialisation is tested here")


class _StoreJoinCCL(CCL):
    """Meets through the store: each worker publishes its key, then waits for all."""

    allreduce = allgather = broadcast = scatter = gather = send = recv = barrier = _unused

    @classmethod
    def rendezvous(cls, channel, device_ids, **options):
        return Rendezvous(uuid.uuid4().hex)  # this init_ccl's prefix for its keys

    def __init__(self, ctx, payload, device_ids=(), broken_on=(), **options):
        super().__init__(ctx, payload, device_ids)
        if ctx.worker_id in broken_on:
            time.sleep(0.2)  # the others wait in the store by now
            raise CCLError(f"worker {ctx.worker_id} cannot initialise")
        ctx.store.set(f"{payload}/{ctx.worker_id}", b"address of %d" % ctx.worker_id)
        keys = [f"{payload}/{w}" for w in range(ctx.num_workers)]
        self.addresses = [ctx.store.get(k, 30.0) for k in keys]


class _Provides:
    @disco.hookimpl
    def disco_register_ccls(self):
        return {"store-join": _StoreJoinCCL}


@pytest.fixture
def store_join_ccl():
    name = plugins.register_plugin(_Provides(), "store-test")
    yield
    plugins.unregister_plugin(name)


@pytest.mark.timeout(60)
def test_failed_init_ccl_releases_store_waiters_and_resets(store_join_ccl):
    with disco.ThreadedSession(3) as sess:
        sess.import_python_module(FUNCS)
        sess.get_global_func("testing.store_set")("old", b"1")
        sess._sync_all()
        t0 = time.monotonic()
        with pytest.raises(disco.WorkerError, match="worker 2 cannot initialise"):
            sess.init_ccl("store-join", broken_on=(2,))
        assert time.monotonic() - t0 < 10, "the other workers waited out the store timeout"
        assert "old" not in sess._store._data  # a new init_ccl starts from an empty store
        sess.init_ccl("store-join")  # the store works again
        ref = sess.get_global_func("testing.store_exchange")("after", 5.0)
        assert _all(ref, 3)[2] == [b"value of %d" % w for w in range(3)]


@pytest.mark.timeout(60)
def test_worker_death_aborts_the_waiters(tmp_path):
    with disco.ProcessSession(3) as sess:
        sess.import_python_module(FUNCS)
        pids = _all(sess.get_global_func("testing.pid")(), 3)
        sess.get_global_func("testing.store_get_or_note")("never", 30.0, str(tmp_path))
        time.sleep(0.5)  # every worker is waiting now
        t0 = time.monotonic()
        os.kill(pids[2], signal.SIGKILL)
        deadline = t0 + 8
        while time.monotonic() < deadline and len(os.listdir(tmp_path)) < 2:
            time.sleep(0.05)
        notes = {name: (tmp_path / name).read_text() for name in os.listdir(tmp_path)}
        assert set(notes) >= {"0", "1"}, f"waiters still waiting: {sorted(notes)}"
        for text in (notes["0"], notes["1"]):
            assert "died" in text and "rendezvous store aborted" in text
            assert float(text.split("\n")[0]) - t0 < 5
        with pytest.raises(disco.WorkerDiedError):
            sess._sync_all()


@pytest.mark.timeout(60)
def test_shutdown_releases_remote_waiters():
    sess = disco.ProcessSession(2)
    sess.import_python_module(FUNCS)
    pids = _all(sess.get_global_func("testing.pid")(), 2)
    sess.get_global_func("testing.store_get")("never", 30.0)
    time.sleep(0.3)
    t0 = time.monotonic()
    sess.shutdown()
    assert time.monotonic() - t0 < 4  # no kill after the shutdown timeout
    from disco_core.testing.procfs import wait_gone

    assert not wait_gone(pids[1:], 5)


# ---------------------------------------------------------------------------- the store itself
@pytest.mark.timeout(30)
def test_controller_store_remote_protocol():
    sent: list[tuple[int, tuple]] = []
    got = threading.Event()

    def reply(w: int, cmd: tuple) -> None:
        sent.append((w, cmd))
        got.set()

    store = ControllerStore(reply)

    def answer(msg: tuple, worker: int = 1) -> tuple:
        got.clear()
        n = len(sent)
        store.handle(worker, msg)
        assert got.wait(5)
        while len(sent) <= n:
            time.sleep(0.001)
        return sent[n][1]

    assert answer(("store", 1, "set", "k", b"v")) == (P.STORE_REPLY, 1, True, None)
    assert answer(("store", 2, "get", "k", 1.0)) == (P.STORE_REPLY, 2, True, b"v")
    assert answer(("store", 3, "add", "c", 5)) == (P.STORE_REPLY, 3, True, 5)
    # strict types: a bad field is an error answer, never a crash of the reader thread
    for seq, msg in enumerate(
        [
            ("store", 10, "set", 5, b"v"),
            ("store", 11, "set", "k", "str"),
            ("store", 12, "get", "k", "soon"),
            ("store", 13, "drop", "k", None),
            ("store", 14, "wait", "not a tuple", 1.0),
        ]
    ):
        cmd = answer(msg)
        assert cmd[:3] == (P.STORE_REPLY, 10 + seq, False) and cmd[3][0] == "value"
    store.handle(1, ("store", "no seq", "set", "k", b"v"))  # dropped, logged
    store.handle(1, ("store",))
    # a waiter answered when its key is set, another when its timeout passes
    store.handle(2, ("store", 20, "get", "later", 10.0))
    store.handle(3, ("store", 21, "wait", ("later", "never"), 0.2))
    time.sleep(0.05)
    store.set("later", b"L")
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and len([s for s in sent if s[1][1] in (20, 21)]) < 2:
        time.sleep(0.01)
    answers = {cmd[1]: (w, cmd) for w, cmd in sent if cmd[1] in (20, 21)}
    assert answers[20] == (2, (P.STORE_REPLY, 20, True, b"L"))
    assert answers[21][0] == 3 and answers[21][1][2:] == (False, ("timeout", 0.2, ("never",)))
    # abort: waiting and later requests fail with the reason
    store.handle(4, ("store", 30, "get", "x", 10.0))
    time.sleep(0.05)
    store.abort("worker(s) [9] died")
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not any(cmd[1] == 30 for _, cmd in sent):
        time.sleep(0.01)
    assert [cmd for _, cmd in sent if cmd[1] == 30] == [
        (P.STORE_REPLY, 30, False, ("abort", "worker(s) [9] died"))
    ]
    cmd = answer(("store", 31, "set", "k", b"v"))
    assert cmd[2] is False and "died" in cmd[3][1]
    with pytest.raises(disco.DiscoError, match=r"aborted: worker\(s\) \[9\] died"):
        store.get("k")
    store.close()


@pytest.mark.timeout(30)
def test_local_waiter_released_by_abort():
    store = ControllerStore()
    handed: list[int] = []
    client = store.client(lambda: handed.append(1))
    errors: list[BaseException] = []

    def waiter() -> None:
        try:
            client.get("k", 30.0)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.1)
    store.abort("init_ccl failed")
    store.reset()  # a reset right after must not let the waiter sleep on
    t.join(5)
    assert not t.is_alive()
    assert handed == [1]  # the peers' commands went out before it waited
    assert len(errors) == 1 and "init_ccl failed" in str(errors[0])
    client.set("k", b"v")  # after the reset the store works again
    assert client.get("k") == b"v"
    assert client.add("n", 2) == 2 and client.add("n") == 3
    store.close()


@pytest.mark.timeout(60)
def test_worker_process_store_only_from_its_own_thread():
    with disco.ProcessSession(2) as sess:
        sess.import_python_module(FUNCS)
        ref = sess.get_global_func("testing.store_from_thread")("t")
        assert ref.debug_get_from_remote(0) == "ok"  # the controller's process: any thread
        text = ref.debug_get_from_remote(1)
        assert text.startswith("DiscoError") and "own thread" in text
        # the worker's stream is intact: it goes on
        assert _all(sess.get_global_func("testing.store_exchange")("after", 5.0), 2)[1][1] == (
            b"value of 1"
        )


@pytest.mark.timeout(30)
def test_infinite_timeout_waits_until_set():
    store = ControllerStore()
    threading.Timer(0.2, store.set, ("k", b"v")).start()
    assert store.get("k", float("inf")) == b"v"
    store.close()


@pytest.mark.timeout(10)
def test_store_messages_cross_a_socket_as_plain_values():
    """What a socket carries is the network format, rebuilt by decode_untrusted, never unpickled."""
    for value in [
        ("store", 1, "set", "k", b"\x00secret"),
        ("store", 2, "wait", ("a", "b"), 1.5),
        (P.STORE_REPLY, 3, True, b"v" * (1 << 20)),  # the largest value
        (P.STORE_REPLY, 4, False, ("timeout", 0.2, ("never",))),
        (P.STORE_REPLY, 5, False, ("abort", "worker(s) [2] died")),
    ]:
        assert decode_untrusted(*encode_for_network(value)) == value


@pytest.mark.timeout(60)
def test_largest_value_reaches_every_worker(make):
    sess = make(2)
    big = bytes(range(256)) * 4096  # 1 MiB, the limit
    sess.get_global_func("testing.store_set")("big", big, 1)  # set by worker 1 only
    got = sess.get_global_func("testing.store_get")("big", 10.0)
    assert got.debug_get_from_remote(0) == big and got.debug_get_from_remote(1) == big


@pytest.mark.timeout(60)
def test_a_wrapping_channel_that_passes_no_store_refuses_at_once():
    """A channel that wraps the process channel without passing ``attach_store`` through
    (as the docs tutorial's ``trace`` channel did): a worker process's store call is
    answered with why, at once, instead of waiting for an answer nobody sends."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "plugin_tutorial"))
    try:
        from disco_tutorial.channel import TraceChannel
    finally:
        sys.path.pop(0)

    class ForgetsTheStore(TraceChannel):  # a wrapper written before the store existed
        has_store = False  # type: ignore[assignment]

        def attach_store(self, store):
            pass

    inner = plugins.lookup("channel", "process")(num_workers=2)
    with disco.Session(ForgetsTheStore(inner)) as sess:
        sess.import_python_module(FUNCS)
        t0 = time.monotonic()
        ref = sess.get_global_func("testing.store_get")("k", 30.0)
        with pytest.raises(disco.WorkerError) as info:
            ref.debug_get_from_remote(1)
        assert time.monotonic() - t0 < 10
        by_worker = {e.worker_id: e.remote_message for e in [info.value, *info.value.others]}
        assert "attach_store" in by_worker[1], by_worker  # the worker process: told why
        assert "no rendezvous store" in by_worker[0], by_worker  # worker 0: refused at use


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["threaded", "process"])
def test_counters_stay_in_64_bits_and_always_get_an_answer(kind):
    """A huge amount, or a sum leaving the 64-bit range, is a DiscoValueError at once
    (a 5,000-digit total used to leave a worker process waiting for ever)."""
    cls = disco.ThreadedSession if kind == "threaded" else disco.ProcessSession
    with cls(2) as sess:
        sess.import_python_module(FUNCS)
        f = sess.get_global_func("testing.store_add_error")
        t0 = time.monotonic()
        huge = f("c1", 10**5000)
        assert huge.debug_get_from_remote(1).startswith("DiscoValueError: store add() amount")
        f("c2", 2**63 - 1)
        sess._sync_all()
        over = f("c2", 1)
        for w in (0, 1):
            assert "64-bit range" in over.debug_get_from_remote(w)
        assert time.monotonic() - t0 < 20


@pytest.mark.timeout(60)
def test_the_store_holds_a_bounded_total(monkeypatch):
    """Workers cannot fill the controller's memory through the store."""
    from disco_core import store as store_module

    monkeypatch.setattr(store_module, "MAX_TOTAL_BYTES", (3 << 20) - 1)
    with disco.ProcessSession(2) as sess:
        sess.import_python_module(FUNCS)
        setf = sess.get_global_func("testing.store_set")
        setf("a", b"x" * (1 << 20), 1)
        setf("b", b"x" * (1 << 20), 1)
        sess._sync_all()
        setf("c", b"x" * (1 << 20), 1)  # over the total: refused, on worker 1
        with pytest.raises(disco.WorkerError, match="over its limit"):
            sess._sync_all()
        setf("a", b"y" * (1 << 20), 1)  # replacing a value keeps the total
        sess._sync_all()


@pytest.mark.timeout(60)
def test_a_malformed_reply_is_dropped_and_the_session_goes_on(monkeypatch):
    """A reply that decodes but is not a message (an empty tuple, a number) used to end
    the controller's reader thread, and the next sync waited for ever."""
    monkeypatch.setenv("DISCO_LIVENESS_TIMEOUT", "3")
    with disco.ProcessSession(2) as sess:
        sess.import_python_module(FUNCS)
        send = sess.get_global_func("testing.send_raw_reply")
        t0 = time.monotonic()
        for bad in ((), 42):
            ref = send(bad, 1)
            assert ref.debug_get_from_remote(1) is None
        sess._sync_all()
        assert time.monotonic() - t0 < 10


@pytest.mark.timeout(60)
def test_the_tutorial_trace_channel_passes_the_store_through():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "plugin_tutorial"))
    try:
        from disco_tutorial.channel import TraceChannel
    finally:
        sys.path.pop(0)
    inner = plugins.lookup("channel", "process")(num_workers=3)
    with disco.Session(TraceChannel(inner)) as sess:
        sess.import_python_module(FUNCS)
        ref = sess.get_global_func("testing.store_exchange")("trace", 20.0)
        want = [b"value of %d" % w for w in range(3)]
        assert [ref.debug_get_from_remote(w) for w in range(3)] == [want] * 3
