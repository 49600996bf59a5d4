"""The "rpc" Disco channel (issue 8): Disco sessions whose workers run on RPC servers."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

import disco_core as disco
import disco_rpc as rpc
from disco_core.testing import ChannelContract
from disco_core.testing.procfs import freeze, wait_gone

pytestmark = pytest.mark.timeout(60)


@disco.register_func("chan.fill_rank", override=True)
def _fill_rank(x):
    from disco_core.worker import current

    x[...] = current().worker_id + 1
    return None


@pytest.fixture(scope="module")
def servers():
    made = [rpc.Server(port=9400, port_end=9500, token="disco-secret") for _ in range(2)]
    yield made
    for s in made:
        s.terminate()


def test_allreduce_over_two_rpc_servers(servers):
    t0 = time.perf_counter()
    sess = disco.Session.create("rpc", servers=[s.addr for s in servers], token="disco-secret")
    try:
        assert time.perf_counter() - t0 < 10
        assert sess.num_workers == 3
        ch = sess.channel
        assert ch.kind == "rpc" and ch.num_nodes == 1 and ch.shares_memory  # loopback servers
        sess.import_python_module("disco_core.testing.funcs")
        pids = [sess.get_global_func("testing.pid")().debug_get_from_remote(w) for w in range(3)]
        assert len(set(pids)) == 3
        sess.init_ccl("shm")
        x = sess.empty((1000,), "float32")
        sess.get_global_func("chan.fill_rank")(x)
        y = sess.empty((1000,), "float32")
        sess.allreduce(x, y, "sum")
        out = np.zeros(1000, "float32")
        sess.copy_from_worker_0(out, y)
        assert (out == 1 + 2 + 3).all()
        for w in (1, 2):
            assert (y.debug_get_from_remote(w) == 6).all()
    finally:
        sess.shutdown()


def test_a_busy_shutdown_leaves_no_reader_thread_nor_descriptor(servers, monkeypatch):
    """``shutdown()`` while a worker runs a long call closed the links before their ends
    were read: the reply thread and its epoll descriptor stayed for good (an outside
    check: 22 of 26 busy shutdowns), and each shutdown took 1 s longer."""
    import threading

    def eventpolls() -> int:
        fds = os.listdir("/proc/self/fd")
        return sum("eventpoll" in _readlink(f"/proc/self/fd/{fd}") for fd in fds)

    monkeypatch.setenv("DISCO_SHUTDOWN_TIMEOUT", "1")
    before = eventpolls()
    for _ in range(3):
        sess = disco.Session.create("rpc", servers=[s.addr for s in servers], token="disco-secret")
        sess.import_python_module("disco_core.testing.funcs")
        sess.get_global_func("testing.sleep")(20.0, 1)  # worker 1 busy
        sess._sync_worker(0)
        time.sleep(0.2)
        t0 = time.monotonic()
        sess.shutdown()
        assert time.monotonic() - t0 < 4
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(
        t.name == "disco-rpc-replies" for t in threading.enumerate()
    ):
        time.sleep(0.05)
    assert not [t for t in threading.enumerate() if t.name == "disco-rpc-replies"]
    assert eventpolls() <= before


def _readlink(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


def test_wrong_token_refused(servers):
    with pytest.raises(rpc.RPCAuthError):
        disco.Session.create("rpc", servers=[servers[0].addr], token="wrong")


def test_bad_arguments():
    with pytest.raises(disco.DiscoError, match="servers"):
        disco.Session.create("rpc")
    # (a new user's "host:port" string was iterated: "not enough values to unpack")
    bad = [
        (dict(servers="127.0.0.1:9585"), disco.DiscoTypeError, "servers must be a list of"),
        (dict(servers=["127.0.0.1"]), disco.DiscoTypeError, "each server must be a"),
        (dict(servers=[("h", "x")]), disco.DiscoTypeError, "each server must be a"),
        (dict(servers=[("h", 0)]), disco.DiscoValueError, "a port 1-65535"),
        (dict(tracker="nohost", num_workers=2), disco.DiscoTypeError, "tracker must be a"),
        # an attacker check: these were read as ('h', 9), (':', 1), port 9091 and port 1
        (dict(servers=["h9"]), disco.DiscoTypeError, "each server must be a"),
        (dict(servers=["::1"]), disco.DiscoValueError, "IPv6 address in brackets"),
        (dict(servers=[("h", 9091.9)]), disco.DiscoTypeError, "the port must be an int"),
        (dict(servers=[("h", True)]), disco.DiscoTypeError, "the port must be an int"),
        (dict(servers=["h: 9091"]), disco.DiscoTypeError, "each server must be a"),
    ]
    for kw, exc, says in bad:
        with pytest.raises(exc, match=says):
            disco.Session.create("rpc", token="x", **kw)


def test_a_server_may_be_named_host_colon_port(servers):
    addr = f"127.0.0.1:{servers[0].port}"
    with disco.Session.create("rpc", servers=[addr], token="disco-secret") as sess:
        assert sess.num_workers == 2
        sess._sync_all()


def test_session_over_tracker_returns_servers_to_pool():
    tr = rpc.Tracker(port=9600, port_end=9700)
    made = [rpc.Server(port=9400, port_end=9500, tracker_addr=tr.addr, key="pool") for _ in range(2)]  # fmt: skip
    ts = rpc.connect_tracker(*tr.addr)
    try:
        sess = disco.Session.create("rpc", tracker=tr.addr, key="pool", num_workers=3)
        assert ts.summary()["queue_info"]["pool"]["free"] == 0
        sess.import_python_module("disco_core.testing.funcs")
        r = sess.get_global_func("testing.echo")(7)
        assert [r.debug_get_from_remote(w) for w in range(3)] == [7, 7, 7]
        sess.shutdown()
        deadline = time.monotonic() + 10
        while ts.summary()["queue_info"]["pool"]["free"] != 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert ts.summary()["queue_info"]["pool"]["free"] == 2
        # the same pool serves plain RPC sessions
        s = ts.request("pool")
        assert s.get_function("chan.fill_rank") is not None
        s.close()
    finally:
        ts.close()
        for s in made:
            s.terminate()
        tr.terminate()


class TestRPCChannelContract(ChannelContract):
    """Worker i of the kit's sessions runs on server (i - 1) % 2, in a session process."""

    workers_are_processes = True
    death_timeout = 3.0

    @pytest.fixture
    def make_session(self, servers):
        def make(num_workers, num_groups=1):
            return disco.Session.create(
                "rpc",
                servers=[s.addr for s in servers],
                num_workers=num_workers,
                num_groups=num_groups,
                token="disco-secret",
            )

        return make


@pytest.mark.parametrize("how", ["option", "env"])
def test_tracker_pool_too_small(monkeypatch, how):
    """Too few free servers: a clear error in time, and the servers go back (issue 8, a)."""
    tr = rpc.Tracker(port=9600, port_end=9700)
    srv = rpc.Server(port=9400, port_end=9500, tracker_addr=tr.addr, key="small")
    ts = rpc.connect_tracker(*tr.addr)
    try:
        options = {"start_timeout": 1.5} if how == "option" else {}
        if how == "env":
            monkeypatch.setenv("DISCO_START_TIMEOUT", "1.5")
        t0 = time.monotonic()
        with pytest.raises(disco.DiscoError, match=r"got 1 of the 2 servers of key 'small'.*1 server\(s\) for key 'small'"):  # fmt: skip
            disco.Session.create("rpc", tracker=tr.addr, key="small", num_workers=3, **options)
        assert time.monotonic() - t0 < 10
        deadline = time.monotonic() + 10
        while ts.summary()["queue_info"]["small"] != {"free": 1, "pending": 0, "total": 1}:
            assert time.monotonic() < deadline, ts.summary()
            time.sleep(0.02)
    finally:
        ts.close()
        srv.terminate()
        tr.terminate()


@pytest.mark.timeout(60)
def test_stopped_worker_with_a_full_socket_is_unresponsive(servers, monkeypatch):
    """Commands with MiBs by value to a stopped worker fill its socket; the send ends.

    The write blocked for ever before (issue 14): the liveness watch now judges the
    workers of a link whose write does not end, and cuts that link.
    """
    monkeypatch.setenv("DISCO_LIVENESS_TIMEOUT", "3")  # the servers' workers beat once a second
    sess = disco.Session.create("rpc", servers=[servers[0].addr], token="disco-secret")
    try:
        sess.import_python_module("disco_core.testing.funcs")
        pid = sess.call_packed("testing.pid").debug_get_from_remote(1)
        with open(f"/proc/{pid}/comm") as f:
            assert f.read().strip() == "disco-worker"  # (ps shows it)
        freeze(pid)
        t0 = time.monotonic()
        with pytest.raises(disco.WorkerUnresponsiveError) as info:
            for _ in range(50):  # 4 MiB each
                sess.call_packed("testing.checksum", np.ones(1 << 20, "float32"))
            sess.sync_worker_0()
        assert time.monotonic() - t0 < 3 + 4
        assert info.value.worker_ids == [1]
    finally:
        t0 = time.monotonic()
        sess.shutdown()
        assert time.monotonic() - t0 < 6
    # killed from here (its process holds the link and named itself a worker), not
    # left stopped for its server's own watch (which waits twice its liveness timeout)
    assert wait_gone([pid], 3.0) == []


class _NotAllowed:
    """A user's class: nothing a network peer may rebuild."""


def test_a_value_the_servers_would_refuse_is_refused_at_the_call(servers):
    """An RPC server's workers rebuild commands with an allow-list: a command they
    cannot read ended the worker, so the controller refuses it at the call."""
    sess = disco.Session.create("rpc", servers=[s.addr for s in servers], token="disco-secret")
    try:
        f = sess.get_global_func("disco.worker_id")
        with pytest.raises(disco.DiscoTypeError, match=r"cannot send .*_NotAllowed.* network link"):
            sess.call_packed(f, _NotAllowed())
        assert [f().debug_get_from_remote(w) for w in range(sess.num_workers)] == [0, 1, 2]
    finally:
        sess.shutdown()


def test_a_reply_the_controller_refuses_fails_the_call_not_the_session(servers):
    """A remote value the network format cannot carry (a function, here) fetched back:
    the server's worker refuses to encode it, so the call fails with a WorkerError and
    the session goes on (a refused reply once ended the link, and the session with it)."""
    sess = disco.Session.create("rpc", servers=[s.addr for s in servers], token="disco-secret")
    try:
        f = sess.get_global_func("disco.worker_id")
        with pytest.raises(disco.WorkerError, match="cannot send builtins.function over a network") as info:  # fmt: skip
            f.debug_get_from_remote(2)
        assert info.value.worker_id == 2
        assert [f().debug_get_from_remote(w) for w in range(sess.num_workers)] == [0, 1, 2]
    finally:
        sess.shutdown()


class _Name(str):
    """A user's str subclass."""


def test_a_str_subclass_for_a_function_name_goes_as_a_plain_str(servers):
    """get_global_func sends the name as an immutable value (unchecked): a str subclass
    would reach the servers' workers, which refuse it and end."""
    sess = disco.Session.create("rpc", servers=[s.addr for s in servers], token="disco-secret")
    try:
        f = sess.get_global_func(_Name("disco.worker_id"))
        assert [f().debug_get_from_remote(w) for w in range(sess.num_workers)] == [0, 1, 2]
        assert sess.call_packed(_Name("disco.world_size")).debug_get_from_remote(2) == 3
    finally:
        sess.shutdown()


@disco.register_func("chan.size", override=True)
def _chan_size(x):
    return x.size


@disco.register_func("chan.sleep", override=True)
def _chan_sleep(t):
    time.sleep(t)
    return None


def test_a_long_command_is_not_taken_for_a_silent_server(monkeypatch):
    """A client watches its RPC server by the server's heartbeats while a request runs
    (1.5 x liveness_timeout with nothing moving ends a wait): once the session carries a
    Disco worker's frames there are no such heartbeats, and a command may run for long
    with nothing on the wire. The watch is lifted for it (the core's own liveness
    applies)."""
    monkeypatch.setenv("DISCO_RPC_WATCH_SERVER", "1")
    srv = rpc.Server(port=9400, port_end=9500, token="disco-secret", liveness_timeout=0.5)
    try:
        sess = disco.Session.create("rpc", servers=[srv.addr], token="disco-secret")
        try:
            link = sess.channel.rpc_links[0]
            assert link.sess._quiet == 0 and not link.t.limited
            sess.get_global_func("chan.sleep")(2.0)
            # a command that carries 64 MiB while the worker sleeps: the write waits
            sess.get_global_func("chan.size")(np.ones(16 << 20, "float32"))
            sess._sync_all()  # every worker finished them, the RPC one included
            x = sess.empty((4,), "float32")
            sess.get_global_func("chan.fill_rank")(x)
            assert (x.debug_get_from_remote(1) == 2).all()
        finally:
            sess.shutdown()
    finally:
        srv.terminate()


@pytest.mark.timeout(30)
def test_a_worker_pid_is_believed_only_when_that_process_holds_the_link():
    """The ``ready`` message's pid came from the peer, and the link killed it when the
    worker stopped answering: a forged one killed another process of this user (an
    outside check; ``-1`` would have been all of them). A process that holds the link
    but is not named a worker (a relay: an ssh tunnel, a shared proxy) is not believed
    either (a second check: the server could name the relay that carries its link)."""
    import socket
    import subprocess
    import sys
    import threading

    from disco_rpc.channel import RPCWorkerLink

    lst = socket.create_server(("127.0.0.1", 0))
    here = socket.create_connection(lst.getsockname())
    there, _ = lst.accept()
    decoy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])

    def fresh_link(host="127.0.0.1"):
        link = RPCWorkerLink.__new__(RPCWorkerLink)  # (its session is not needed here)
        link.worker_ids, link.host, link.sock = (1,), host, here
        link.pid = link._peer_inode = None
        link._pid_named = False
        return link

    # the other end of ``here``, held by a child (as a server's session process holds
    # it) that names itself a worker, as a worker host does before its "ready"
    from disco_rpc.worker_host import WORKER_PROCESS_NAME

    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from disco_rpc.worker_host import mark_worker_process as m; import time; "
            "print(m(), flush=True); time.sleep(60)",
        ],
        pass_fds=(there.fileno(),),
        stdout=subprocess.PIPE,
        text=True,
    )
    # and by a relay (no name of a worker)
    relay = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], pass_fds=(there.fileno(),)
    )
    try:
        assert holder.stdout.readline().strip() == "True"
        with open(f"/proc/{holder.pid}/comm") as f:
            assert f.read().strip() == WORKER_PROCESS_NAME
        # a process cannot name another (so a peer cannot have a relay named a worker)
        fd = os.open(f"/proc/{relay.pid}/comm", os.O_WRONLY)
        try:
            with pytest.raises(OSError):  # EINVAL: not a thread of this process
                os.write(fd, WORKER_PROCESS_NAME.encode())
        finally:
            os.close(fd)
        with open(f"/proc/{relay.pid}/comm") as f:
            assert f.read().strip() != WORKER_PROCESS_NAME
        for forged in (
            decoy.pid,
            -1,
            0,
            1,
            "123",
            2.5,
            None,
            os.getpid(),
            threading.get_native_id(),
            relay.pid,
        ):
            link = fresh_link()
            link.set_pid(forged)
            assert link.pid is None, forged
            link._kill_process()
        assert decoy.poll() is None and relay.poll() is None  # untouched
        link = fresh_link()
        link.set_pid(holder.pid)
        assert link.pid == holder.pid and link._peer_inode == os.fstat(there.fileno()).st_ino
        link = fresh_link()
        link.set_pid(decoy.pid)  # the first ready counts, and only it
        link.set_pid(holder.pid)
        assert link.pid is None
        link = fresh_link("10.0.0.1")  # a worker on another machine is never killed from here
        link.set_pid(holder.pid)
        assert link.pid is None
    finally:
        for p in (decoy, holder, relay):
            p.kill()
            p.wait()
        for s in (here, there, lst):
            s.close()


@pytest.mark.timeout(60)
def test_processes_forked_by_disco_rpc_do_not_inherit_the_worker_name():
    """A process inherits its parent's name across fork: a server started from inside a
    Disco worker was named a worker too, so a client whose worker in it (a ``no_fork``
    server) stopped answering killed the whole shared server (an outside check)."""
    from disco_rpc.worker_host import WORKER_PROCESS_NAME, name_process

    with open("/proc/self/comm") as f:
        mine = f.read().strip()
    assert name_process(WORKER_PROCESS_NAME)  # as inside a worker host
    try:
        srv = rpc.Server(port=9700, port_end=9800, token="disco-secret", no_fork=True)
    finally:
        name_process(mine)
    try:
        with open(f"/proc/{srv.pid}/comm") as f:
            assert f.read().strip() == "disco-server"
    finally:
        srv.terminate()
