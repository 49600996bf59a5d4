"""disco-socket end to end: node layout, module shipping, handshake, failures, TLS, CLI."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from _socket_helpers import HOST, agent_cmd, children_of, wait_gone

import disco_core as disco
from disco_core import plugins
from disco_core.protocol import encode, frame_head
from disco_core.testing.procfs import freeze
from disco_socket import SocketChannel, controller, start_local_agents, wire
from disco_socket.controller import reachable_host

FUNCS = "disco_core.testing.funcs"


def _values(ref, n):
    return [ref.debug_get_from_remote(w) for w in range(n)]


# --------------------------------------------------------------------------- basics
def test_plugin_registers_socket_channel():
    assert plugins.lookup("channel", "socket") is SocketChannel
    names = {i.distribution: i for i in plugins.list_plugins()}
    assert "socket" in names["disco-socket"].provides["channel"]


def test_frame_layout_matches_core():
    header, buffers = encode(("x", np.zeros(5000, "uint8")))
    assert wire.frame_head(header, buffers, 1) == frame_head((header, buffers), 1)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("nodes", [2, 3])
def test_node_major_layout(cluster, nodes):
    sess = cluster.session(nodes, 2, num_groups=nodes)
    n = 2 * nodes
    assert sess.num_workers == n and sess.channel.num_nodes == nodes
    assert not sess.channel.shares_memory
    get = sess.get_global_func
    assert _values(get("disco.worker_id")(), n) == list(range(n))
    assert _values(get("disco.group_id")(), n) == [w // 2 for w in range(n)]
    sess.import_python_module(FUNCS)
    pids = _values(get("testing.pid")(), n)
    assert pids[0] == os.getpid() and len(set(pids)) == n
    # Node k's workers are children of node k's agent, whatever order the nodes joined.
    for link in sess.channel.nodes:
        kids = set(children_of(link.info["pid"]))
        assert {pids[w] for w in link.worker_ids} <= kids
        assert link.worker_ids == (2 * link.node_id, 2 * link.node_id + 1)
    # Data to and from every worker, large arrays included; per-worker values.
    a = np.random.default_rng(0).standard_normal(1 << 20)
    r = get("testing.echo")(a)
    for w in range(n):
        np.testing.assert_array_equal(r.debug_get_from_remote(w), a)
    wid = get("disco.worker_id")()
    x = get("testing.add")(wid, 10)
    assert _values(x, n) == [w + 10 for w in range(n)]
    # An error on a remote worker carries its traceback.
    get("testing.raise_on")(n - 1, "KeyError", "remote failure")
    with pytest.raises(disco.WorkerError) as info:
        x.debug_get_from_remote(n - 1)
    assert info.value.worker_id == n - 1 and "funcs.py" in info.value.remote_traceback
    assert _values(get("testing.echo")(3), n) == [3] * n
    agents = sess.agents
    worker_pids = pids[2:]
    sess.shutdown()
    assert [p.wait(10) for p in agents] == [0] * (nodes - 1)
    assert wait_gone(worker_pids, 5) == []


@pytest.mark.timeout(60)
def test_shm_ccl_refused_with_install_hint(cluster):
    sess = cluster.session(2, 1)
    with pytest.raises(disco.CCLError, match=r"pip install \./plugins/mpi"):
        sess.init_ccl("shm")
    assert sess.get_global_func("disco.world_size")().debug_get_from_remote(1) == 2


@pytest.mark.timeout(60)
def test_session_create_by_name(cluster):
    agents = []
    sess = disco.Session.create(
        "socket",
        num_nodes=2,
        num_workers_per_node=1,
        num_groups=1,
        host=HOST,
        port=0,
        on_listen=lambda h, p: agents.extend(start_local_agents(h, p, 1, 1)),
    )
    cluster.agents.extend(agents)
    cluster.sessions.append(sess)
    assert sess.get_global_func("disco.worker_id")().debug_get_from_remote(1) == 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("extra", [(), ("-v",)])
def test_local_agents_log_warnings_only_unless_asked(cluster, extra):
    """A program that starts its agents itself keeps its output: the agents (and their
    workers) printed INFO lines into it (outside check of the README's one-box example)."""
    agents = []
    env = {k: v for k, v in os.environ.items() if k != "DISCO_LOG_LEVEL"}

    def start(h, p):
        agents.extend(start_local_agents(h, p, 1, 1, token="t0k", extra_args=extra, env=env, stderr=subprocess.PIPE))  # fmt: skip

    sess = disco.SocketSession(2, 1, host=HOST, port=0, token="t0k", timeout=30, on_listen=start)
    cluster.sessions.append(sess)
    assert sess.get_global_func("disco.worker_id")().debug_get_from_remote(1) == 1
    sess.shutdown()
    [agent] = agents
    err = agent.communicate(timeout=30)[1].decode()
    assert agent.returncode == 0, err
    if extra:
        assert " INFO disco-socket: joined" in err and "worker 1 of 2 started" in err, err
    else:
        assert "INFO" not in err, err


# --------------------------------------------------------------------------- module files
_MODULE = """
from disco_core.worker import current

def where():
    return __file__

def scale(x, k):
    return x * k
"""


def _can_unshare_mount() -> bool:
    if not shutil.which("unshare"):
        return False
    r = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "true"], capture_output=True
    )
    return r.returncode == 0


@pytest.mark.timeout(60)
def test_load_vm_module_uses_the_nodes_own_copy(cluster, tmp_path):
    path = tmp_path / "shared_mod.py"
    path.write_text(_MODULE)
    sess = cluster.session(2, 2)
    mod = sess.load_vm_module(path)
    assert _values(mod["where"](), 4) == [str(path)] * 4  # same file here: not shipped


@pytest.mark.timeout(60)
@pytest.mark.parametrize("token", [None, "ship"])  # with a token: sealed records of the file
def test_load_vm_module_ships_a_file_the_nodes_lack(cluster, tmp_path, token):
    if not _can_unshare_mount():
        pytest.skip("needs `unshare --mount` (root or user namespaces) to hide a folder from nodes")
    hidden = tmp_path / "only_on_controller"
    hidden.mkdir()
    path = hidden / "model_mod.py"
    path.write_text(_MODULE)
    agents = []
    env = {k: v for k, v in os.environ.items() if k != "DISCO_TOKEN"}
    if token:
        env["DISCO_TOKEN"] = token

    def on_listen(host, port):
        # Each agent runs in its own mount namespace where `hidden` is an empty tmpfs.
        for _ in range(2):
            cmd = [
                "unshare", "--mount", "--propagation", "private", "sh", "-c",
                'mount -t tmpfs tmpfs "$0" && exec "$@"', str(hidden),
                *agent_cmd(host, port, 2, "-q"),
            ]  # fmt: skip
            agents.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL, env=env))

    try:
        sess = disco.SocketSession(3, 2, 1, HOST, 0, on_listen=on_listen, timeout=30, token=token)
    finally:
        cluster.agents.extend(agents)
    cluster.sessions.append(sess)
    mod = sess.load_vm_module(path)
    where = _values(mod["where"](), 6)
    assert where[:2] == [str(path)] * 2
    for w in range(2, 6):
        assert where[w] != str(path) and where[w].endswith("/model_mod.py")
        assert "disco-socket-node" in where[w]
    for got in _values(mod["scale"](np.arange(3.0), 2), 6):
        np.testing.assert_array_equal(got, [0.0, 2.0, 4.0])
    # Loading again ships nothing new and gives the same copies.
    assert _values(sess.load_vm_module(path)["where"](), 6) == where
    # A changed file is shipped again.
    path.write_text(_MODULE + "\nVERSION = 2\n")
    assert _values(sess.load_vm_module(path)["where"](), 6)[2] != where[2]
    sess.shutdown()
    assert [p.wait(10) for p in agents] == [0, 0]
    assert not os.path.exists(os.path.dirname(os.path.dirname(where[2])))  # cache removed


_CACHE_OWNER = """
import sys, time
from disco_socket.agent import _make_cache
print(_make_cache(int(sys.argv[1]))[0], flush=True)
time.sleep(60)
"""


@pytest.mark.timeout(60)
def test_stale_module_caches_are_removed_by_the_next_agent(cluster, tmp_path):
    """The cache folder of a SIGKILLed agent is removed by the next agent on that machine."""
    env = dict(os.environ, TMPDIR=str(tmp_path))
    owners = [
        subprocess.Popen(
            [sys.executable, "-c", _CACHE_OWNER, str(k)], stdout=subprocess.PIPE, text=True, env=env
        )
        for k in (1, 2)
    ]
    try:
        dead, alive = [p.stdout.readline().strip() for p in owners]
        owners[0].kill()  # like a SIGKILLed agent: no clean-up of its own
        owners[0].wait()
        assert os.path.isdir(dead) and os.path.isdir(alive)
        agents = []
        sess = disco.SocketSession(
            2, 1, 1, HOST, 0, timeout=30,
            on_listen=lambda h, p: agents.extend(start_local_agents(h, p, 1, 1, env=env)),
        )  # fmt: skip
        cluster.agents.extend(agents)
        cluster.sessions.append(sess)
        assert not os.path.exists(dead)
        assert os.path.isdir(alive)  # its owner still runs
    finally:
        for p in owners:
            p.kill()
            p.wait()


# --------------------------------------------------------------------------- joining
@pytest.mark.timeout(60)
def test_slow_node_start(cluster):
    started = []

    def on_listen(host, port):
        def later():
            time.sleep(2.0)
            started.extend(start_local_agents(host, port, 1, 2, extra_args=("-q",)))

        threading.Thread(target=later, daemon=True).start()

    t0 = time.monotonic()
    sess = disco.SocketSession(2, 2, 1, HOST, 0, on_listen=on_listen, timeout=30)
    took = time.monotonic() - t0
    cluster.sessions.append(sess)
    time.sleep(0.1)
    cluster.agents.extend(started)
    assert took >= 2.0
    assert _values(sess.get_global_func("disco.worker_id")(), 4) == [0, 1, 2, 3]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@pytest.mark.timeout(60)
def test_agent_started_before_the_controller_retries(cluster):
    port = _free_port()
    agent = subprocess.Popen(agent_cmd(HOST, port, 1, "-q"), stdin=subprocess.DEVNULL)
    cluster.agents.append(agent)
    time.sleep(1.5)
    assert agent.poll() is None  # still retrying
    sess = disco.SocketSession(2, 1, 1, HOST, port, timeout=30)
    cluster.sessions.append(sess)
    assert sess.get_global_func("disco.worker_id")().debug_get_from_remote(1) == 1


@pytest.mark.timeout(60)
def test_agent_gives_up_without_controller():
    port = _free_port()
    r = subprocess.run(
        agent_cmd(HOST, port, 1, "--connect-timeout", "1"),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 3
    assert "connection refused: nothing is listening at" in r.stderr
    assert "gave up reaching a controller" in r.stderr


@pytest.mark.timeout(60)
def test_timeout_when_nodes_never_come():
    before = set(children_of(os.getpid()))
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"0 of 2 node\(s\) joined .*disco-socket join"):
        disco.SocketSession(3, 2, 1, HOST, 0, timeout=1.5)
    assert time.monotonic() - t0 < 5
    # The controller's own local worker processes were stopped.
    assert wait_gone(list(set(children_of(os.getpid())) - before), 5) == []


@pytest.mark.timeout(60)
def test_wildcard_host_suggests_a_reachable_address():
    with pytest.raises(TimeoutError) as info:
        disco.SocketSession(2, 1, 1, "0.0.0.0", 0, timeout=1, token="t")  # beyond loopback
    msg = str(info.value)
    hint = reachable_host("0.0.0.0")
    assert hint != "0.0.0.0" and "join 0.0.0.0" not in msg
    assert f"disco-socket join {hint} " in msg and "--workers 1" in msg
    assert "(timeout=)" not in msg and "within the 1 s timeout" in msg
    with socket.socket() as s:  # the suggested address is one of this machine's
        s.bind((hint, 0))
    assert reachable_host("10.1.2.3") == "10.1.2.3"  # a specific address is kept


@pytest.mark.timeout(60)
def test_waiting_for_nodes_says_what_to_run(cluster, caplog, monkeypatch):
    caplog.set_level(logging.WARNING, logger="disco_socket")
    monkeypatch.setattr(controller, "WAIT_NOTICE_DELAY", 0.5)

    def action(host, port):
        time.sleep(1.5)
        cluster.agents.extend(start_local_agents(host, port, 1, 2, extra_args=("-q",)))

    on_listen, _ = _on_listen_then(action)
    sess = disco.SocketSession(2, 2, 1, HOST, 0, on_listen=on_listen, timeout=30)
    cluster.sessions.append(sess)
    port = sess.channel.address[1]
    notes = [r for r in caplog.records if "waiting for" in r.getMessage()]
    assert len(notes) == 1 and notes[0].levelno == logging.WARNING
    assert f"disco-socket join {HOST} {port} --workers 2" in notes[0].getMessage()


@pytest.mark.timeout(60)
def test_nodes_that_join_fast_are_not_announced(cluster, caplog):
    caplog.set_level(logging.WARNING, logger="disco_socket")
    t0 = time.monotonic()
    cluster.session(2, 2)
    took = time.monotonic() - t0
    notes = [r for r in caplog.records if "waiting for" in r.getMessage()]
    # Quiet when the nodes came within the delay (a very slow machine may see the note).
    assert len(notes) == (0 if took < controller.WAIT_NOTICE_DELAY else 1)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("token", [None, "surplus"])
def test_surplus_agent_is_told_the_session_is_full(cluster, caplog, token):
    """With a token, only an agent that proved it is told (an attacker check: the number
    of nodes was told to any peer); one without the token learns nothing of it."""
    caplog.set_level(logging.WARNING, logger="disco_socket")
    sess = cluster.session(2, 1, token=token)
    host, port = sess.channel.address
    env = {**os.environ, "DISCO_TOKEN": token} if token else None
    t0 = time.monotonic()
    r = subprocess.run(
        agent_cmd(host, port, 1, "--connect-timeout", "20"),
        capture_output=True, text=True, timeout=40, env=env,
    )  # fmt: skip
    assert time.monotonic() - t0 < 10  # not after --connect-timeout
    assert r.returncode == 2, r.stderr
    assert "already has all its 2 nodes" in r.stderr
    said = "turned away" if token is None else "already has all its 2 nodes"
    assert any(said in rec.getMessage() for rec in caplog.records)
    if token is not None:
        env["DISCO_TOKEN"] = "not-the-token"
        r = subprocess.run(
            agent_cmd(host, port, 1, "--connect-timeout", "20"),
            capture_output=True, text=True, timeout=40, env=env,
        )  # fmt: skip
        assert r.returncode == 2 and "authentication failed" in r.stderr, r.stderr
        assert "nodes" not in r.stderr, r.stderr
    assert sess.get_global_func("disco.worker_id")().debug_get_from_remote(1) == 1
    # Once the session is over, nothing listens: the agent says so.
    sess.shutdown()
    r = subprocess.run(
        agent_cmd(host, port, 1, "--connect-timeout", "0.5"),
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert r.returncode == 3 and "nothing is listening" in r.stderr


def _on_listen_then(action):
    """An on_listen that runs ``action(host, port)`` in a thread (the accept loop runs meanwhile)."""
    done = threading.Event()

    def on_listen(host, port):
        def run():
            try:
                action(host, port)
            finally:
                done.set()

        threading.Thread(target=run, daemon=True).start()

    return on_listen, done


@pytest.mark.timeout(60)
def test_wrong_token_is_dropped_and_logged(cluster, caplog):
    caplog.set_level(logging.WARNING, logger="disco_socket")
    results = {}

    def action(host, port):
        env = dict(os.environ, DISCO_TOKEN="wrong-token")
        bad = subprocess.run(
            agent_cmd(host, port, 1), env=env, capture_output=True, text=True, timeout=30
        )
        results["bad"] = bad
        cluster.agents.extend(start_local_agents(host, port, 1, 1, token="s3cret"))

    on_listen, done = _on_listen_then(action)
    sess = disco.SocketSession(2, 1, 1, HOST, 0, token="s3cret", on_listen=on_listen, timeout=30)
    cluster.sessions.append(sess)
    done.wait(10)
    bad = results["bad"]
    assert bad.returncode == 2, bad.stderr
    assert "authentication failed" in bad.stderr
    assert "s3cret" not in bad.stderr
    assert any("authentication failed" in r.getMessage() for r in caplog.records)
    assert sess.channel.rejected and "wrong token" in sess.channel.rejected[0]
    assert sess.get_global_func("disco.worker_id")().debug_get_from_remote(1) == 1


@pytest.mark.timeout(60)
def test_a_port_in_use_is_a_disco_error_naming_it():
    """It was a bare ``OSError: [Errno 98]`` (not a DiscoError, as the README promises)."""
    with socket.create_server((HOST, 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(disco.DiscoError, match=f"cannot listen on {HOST}:{port}: .*port=0"):
            disco.SocketSession(2, 1, 1, HOST, port, token="t", timeout=5)


@pytest.mark.timeout(60)
def test_wrong_token_only_times_out_naming_the_rejection():
    def action(host, port):
        subprocess.run(
            agent_cmd(host, port, 1, "--token", "nope", "-q"), capture_output=True, timeout=30
        )

    on_listen, _ = _on_listen_then(action)
    with pytest.raises(TimeoutError, match="rejected.*wrong token"):
        disco.SocketSession(2, 1, 1, HOST, 0, token="yes", on_listen=on_listen, timeout=3)


def _raw(host, port):
    return socket.create_connection((host, port), timeout=5)


def _dropped(s) -> bool:
    """True when the peer closed the connection without sending anything (FIN or RST)."""
    try:
        return s.recv(100) == b""
    except ConnectionResetError:
        return True


@pytest.mark.timeout(60)
def test_wrong_protocol_version_and_hostile_peers(cluster, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="disco_socket")
    marker = tmp_path / "pwned"
    seen = {}

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    def action(host, port):
        # 1. A newer protocol: a clear JSON error, then the connection is closed.
        with _raw(host, port) as s:
            s.sendall(wire.HELLO.pack(wire.MAGIC, 999))
            seen["version"] = wire.recv_json(s)
            assert s.recv(1) == b""
        # 2. Not a disco-socket peer at all: dropped without an answer.
        with _raw(host, port) as s:
            s.sendall(b"GET / HTTP/1.0\r\n\r\n")
            seen["http"] = _dropped(s)
        # 3. A pickle where the handshake expects JSON: never unpickled, dropped.
        with _raw(host, port) as s:
            payload = pickle.dumps(Evil())
            s.sendall(wire.HELLO.pack(wire.MAGIC, wire.PROTOCOL_VERSION))
            s.sendall(wire.U32.pack(len(payload)) + payload)
            seen["pickle"] = _dropped(s)
        # 4. A huge declared handshake message: dropped.
        with _raw(host, port) as s:
            s.sendall(wire.HELLO.pack(wire.MAGIC, wire.PROTOCOL_VERSION) + wire.U32.pack(1 << 30))
            seen["huge"] = _dropped(s)
        cluster.agents.extend(start_local_agents(host, port, 1, 1))

    on_listen, done = _on_listen_then(action)
    sess = disco.SocketSession(2, 1, 1, HOST, 0, on_listen=on_listen, timeout=30)
    cluster.sessions.append(sess)
    assert done.wait(10)
    assert "protocol version mismatch" in seen["version"]["error"]
    assert "999" in seen["version"]["error"]
    assert seen["http"] and seen["pickle"] and seen["huge"]
    assert not marker.exists()
    assert len(sess.channel.rejected) == 4
    assert sum("rejected" in r.getMessage() for r in caplog.records) == 4
    assert sess.get_global_func("disco.worker_id")().debug_get_from_remote(1) == 1


@pytest.mark.timeout(60)
def test_an_agent_out_of_descriptors_says_so_in_one_line():
    """A node agent that cannot start its workers for its open-files limit printed a
    raw OSError traceback (outside check 58); the controller's start fails."""
    import resource

    results = {}

    def limited():
        resource.setrlimit(
            resource.RLIMIT_NOFILE, (16, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
        )

    def action(host, port):
        results["agent"] = subprocess.run(
            agent_cmd(host, port, 3), capture_output=True, text=True, timeout=30,
            preexec_fn=limited,
        )  # fmt: skip

    on_listen, done = _on_listen_then(action)
    # the controller is told why (it said only "the node agent exited"): as a failed
    # start, or, when the node's hello came first, as its workers' death (a fresh-clone
    # run: "workers 3, 4, 5 died: cannot start the worker processes ...")
    with pytest.raises(disco.WorkerDiedError, match="cannot start the worker processes"):
        disco.SocketSession(2, 3, 1, HOST, 0, on_listen=on_listen, timeout=30)
    assert done.wait(30)
    agent = results["agent"]
    assert agent.returncode == 1, agent.stderr
    assert (
        "cannot start the worker processes (3 to start here): Too many open files" in agent.stderr
    )
    assert "ulimit -n" in agent.stderr and "Traceback" not in agent.stderr, agent.stderr


@pytest.mark.timeout(60)
def test_wrong_worker_count_is_refused(cluster):
    results = {}

    def action(host, port):
        results["bad"] = subprocess.run(
            agent_cmd(host, port, 3), capture_output=True, text=True, timeout=30
        )
        cluster.agents.extend(start_local_agents(host, port, 1, 2))

    on_listen, done = _on_listen_then(action)
    sess = disco.SocketSession(2, 2, 1, HOST, 0, on_listen=on_listen, timeout=30)
    cluster.sessions.append(sess)
    done.wait(10)
    assert results["bad"].returncode == 2
    assert "offers 3 workers" in results["bad"].stderr


# --------------------------------------------------------------------------- failures
@pytest.mark.timeout(60)
def test_node_death_is_reported(cluster):
    sess = cluster.session(3, 2)
    sess.import_python_module(FUNCS)
    pids = _values(sess.get_global_func("testing.pid")(), 6)
    victim = next(link for link in sess.channel.nodes if link.node_id == 2)
    ok = sess.get_global_func("testing.echo")(1)
    t0 = time.monotonic()
    os.kill(victim.info["pid"], signal.SIGKILL)
    with pytest.raises(disco.WorkerDiedError) as info:
        ok.debug_get_from_remote(4)
    assert time.monotonic() - t0 < 3
    assert info.value.worker_ids == [4, 5]
    assert "node 2" in str(info.value) and "workers 4-5" in str(info.value)
    with pytest.raises(disco.WorkerDiedError):
        sess.sync_worker_0()
    assert wait_gone([pids[4], pids[5]], 5) == []  # the dead agent's workers follow it
    t1 = time.monotonic()
    sess.shutdown()
    assert time.monotonic() - t1 < 10
    others = [p for p in sess.agents if p.pid != victim.info["pid"]]
    assert [p.wait(10) for p in others] == [0]
    assert wait_gone(pids[1:], 5) == []


@pytest.mark.timeout(60)
def test_busy_node_death_while_waiting(cluster):
    sess = cluster.session(2, 2)
    sess.import_python_module(FUNCS)
    sess.get_global_func("testing.sleep")(3.0)  # every worker is busy
    ok = sess.get_global_func("testing.echo")(1)
    time.sleep(0.3)
    t0 = time.monotonic()
    sess.agents[0].kill()
    with pytest.raises(disco.WorkerDiedError, match="node 1"):
        ok.debug_get_from_remote(2)
    assert time.monotonic() - t0 < 2.5


@pytest.mark.timeout(60)
def test_frozen_node_is_declared_dead(cluster):
    """An agent and its workers stopped (SIGSTOP): the heartbeat declares the node dead."""
    sess = cluster.session(2, 2, heartbeat_timeout=2.0)
    sess.import_python_module(FUNCS)
    pids = _values(sess.get_global_func("testing.pid")(), 4)
    # Idle for longer than the timeout, then a large transfer: pings keep the node alive.
    time.sleep(3.0)
    big = np.arange(1 << 23, dtype="float64")
    np.testing.assert_array_equal(
        sess.get_global_func("testing.echo")(big).debug_get_from_remote(3), big
    )
    assert not sess.channel.hub.dead
    ok = sess.get_global_func("testing.echo")(1)
    frozen = [sess.channel.nodes[0].info["pid"], pids[2], pids[3]]
    for pid in frozen:
        freeze(pid)
    try:
        t0 = time.monotonic()
        with pytest.raises(disco.WorkerDiedError) as info:
            ok.debug_get_from_remote(2)
        took = time.monotonic() - t0
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
    assert took < 2.0 + 2.5
    assert info.value.worker_ids == [2, 3]
    msg = str(info.value)
    assert "node 1" in msg and "workers 2-3" in msg and "stopped responding" in msg
    assert isinstance(info.value, disco.WorkerUnresponsiveError) and "stopped answering" in msg
    # Thawed, the agent finds its connection closed; it exits and its workers with it.
    assert sess.agents[0].wait(10) == 1
    assert wait_gone(pids[2:], 5) == []


@pytest.mark.timeout(60)
def test_a_frozen_agent_relaying_replies_is_named_as_its_node(cluster, monkeypatch):
    """A chaos check (F7): with replies relayed by the agent and DISCO_LIVENESS_TIMEOUT
    equal to the heartbeat timeout, a frozen agent was reported as its workers having
    stopped answering (the workers' heartbeats come through it), 7 times in 12. The
    liveness watch now asks the link first, and a node whose own connection is as
    silent is named as the node."""
    monkeypatch.setenv("DISCO_LIVENESS_TIMEOUT", "3")
    sess = cluster.session(3, 1, heartbeat_timeout=3.0, direct_replies=False)
    sess.import_python_module(FUNCS)
    node = sess.channel.nodes[0]
    agent = node.info["pid"]
    freeze(agent)
    try:
        with pytest.raises(disco.WorkerUnresponsiveError) as info:
            sess.call_packed("testing.echo", 1)
            sess._sync_all()
    finally:
        os.kill(agent, signal.SIGCONT)
    msg = str(info.value)
    assert info.value.worker_ids == list(node.worker_ids), msg
    assert f"node {node.node_id}" in msg and "stopped responding" in msg, msg
    assert "DISCO_LIVENESS_TIMEOUT" not in msg, msg


@pytest.mark.timeout(60)
@pytest.mark.parametrize("token", [None, "frozen-worker"])
def test_frozen_remote_worker_is_unresponsive(cluster, monkeypatch, token):
    """A remote worker stopped (SIGSTOP) while its agent runs on: its own heartbeats stop.

    Issue 14, finding 1 on a SocketSession: the controller used to wait for it for
    ever. Its replies reach the controller through the agent (plain) or on its own
    sealed reply connection (token); either way the silence is noticed.
    """
    monkeypatch.setenv("DISCO_LIVENESS_TIMEOUT", "3")  # the agents' workers beat once a second
    sess = cluster.session(2, 2, token=token)
    sess.import_python_module(FUNCS)
    pids = _values(sess.get_global_func("testing.pid")(), 4)
    freeze(pids[3])
    t0 = time.monotonic()
    with pytest.raises(disco.WorkerUnresponsiveError) as info:
        sess._sync_all()
    assert time.monotonic() - t0 < 3.0 + 3.0
    assert info.value.worker_ids == [3]
    assert "DISCO_LIVENESS_TIMEOUT" in str(info.value)
    t0 = time.monotonic()
    sess.shutdown()
    assert time.monotonic() - t0 < 6.0
    assert wait_gone(pids[2:], 10) == []  # the agent kills the stopped worker too


@pytest.mark.timeout(60)
@pytest.mark.parametrize("token", [None, "frozen-agent"])
def test_workers_of_an_agent_frozen_for_good_end_after_shutdown(cluster, token):
    """An agent stopped (SIGSTOP) while its workers run on, and never thawed.

    Its workers' commands come through it, so they wait for good; but each holds its
    own reply connection, which the controller closes at shutdown. A worker's
    heartbeat that finds that connection gone ends the worker (they stayed, with
    the agent, until it was thawed: a chaos check's finding).
    """
    sess = cluster.session(2, 2, heartbeat_timeout=2.0, token=token)
    sess.import_python_module(FUNCS)
    pids = _values(sess.get_global_func("testing.pid")(), 4)
    agent = sess.channel.nodes[0].info["pid"]
    freeze(agent)
    try:
        with pytest.raises(disco.WorkerUnresponsiveError):
            sess._sync_all()
        sess.shutdown()
        assert wait_gone(pids[2:], 10) == []
    finally:
        os.kill(agent, signal.SIGCONT)


def _agent_stderr(args, signum, after):
    """Run an agent, send it ``signum`` after ``after`` s; its exit code and stderr."""
    proc = subprocess.Popen(
        args, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        time.sleep(after)
        os.killpg(proc.pid, signum)
        _, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err


@pytest.mark.timeout(60)
def test_ctrl_c_on_a_working_agent(cluster):
    """Ctrl-C (SIGINT to the agent's process group): one log line, workers stopped, exit 130."""
    got = {}

    def on_listen(host, port):
        def run():
            got["result"] = _agent_stderr(agent_cmd(host, port, 2), signal.SIGINT, 3.0)

        got["thread"] = threading.Thread(target=run, daemon=True)
        got["thread"].start()

    sess = disco.SocketSession(2, 2, 1, HOST, 0, on_listen=on_listen, timeout=30)
    cluster.sessions.append(sess)
    sess.import_python_module(FUNCS)
    pids = _values(sess.get_global_func("testing.pid")(), 4)
    got["thread"].join(30)
    code, err = got["result"]
    assert code == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert sum("SIGINT" in line for line in err.splitlines()) == 1
    assert wait_gone(pids[2:], 5) == []
    with pytest.raises(disco.WorkerDiedError, match="node 1"):
        sess.get_global_func("testing.echo")(1).debug_get_from_remote(2)


@pytest.mark.timeout(60)
def test_ctrl_c_while_waiting_for_the_controller():
    code, err = _agent_stderr(
        agent_cmd(HOST, _free_port(), 1, "--connect-timeout", "30"), signal.SIGINT, 1.5
    )
    assert code == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert sum("SIGINT" in line for line in err.splitlines()) == 1


@pytest.mark.timeout(60)
def test_worker_start_failure_carries_its_stderr(cluster):
    with pytest.raises(disco.WorkerDiedError) as info:
        cluster.session(2, 1, entrypoint="disco_socket_no_such_worker_module")
    msg = str(info.value)
    assert "node 1" in msg and "exited with code 1" in msg
    assert "No module named disco_socket_no_such_worker_module" in msg
    assert len(msg) < 4096  # only the end of the stderr


_CONTROLLER = """
import json, sys, disco_core as disco
def on_listen(host, port):
    print(json.dumps({"port": port}), flush=True)
sess = disco.SocketSession(2, 2, 1, "127.0.0.1", 0, on_listen=on_listen, timeout=30)
sess.import_python_module("disco_core.testing.funcs")
pids = [sess.get_global_func("testing.pid")().debug_get_from_remote(w) for w in range(4)]
print(json.dumps({"pids": pids}), flush=True)
sess.get_global_func("testing.sleep")(30.0)
import time; time.sleep(60)
"""


@pytest.mark.timeout(60)
def test_agent_exits_when_the_controller_freezes():
    """A frozen controller (SIGSTOP) sends no heartbeats: its agents stop their workers and exit."""
    env = dict(os.environ, DISCO_HEARTBEAT_TIMEOUT="2")
    ctrl = subprocess.Popen(
        [sys.executable, "-c", _CONTROLLER], stdout=subprocess.PIPE, text=True, env=env
    )
    agent = None
    try:
        port = json.loads(ctrl.stdout.readline())["port"]
        agent = subprocess.Popen(agent_cmd(HOST, port, 2, "-q"), stdin=subprocess.DEVNULL)
        pids = json.loads(ctrl.stdout.readline())["pids"]
        freeze(ctrl.pid)
        t0 = time.monotonic()
        assert agent.wait(15) == 1
        assert time.monotonic() - t0 < 2.0 + 3.0
        assert wait_gone(pids[2:], 5) == []
    finally:
        ctrl.kill()
        ctrl.wait()
        if agent is not None and agent.poll() is None:
            agent.kill()
            agent.wait()


@pytest.mark.timeout(60)
def test_controller_death_ends_agents_and_workers():
    ctrl = subprocess.Popen([sys.executable, "-c", _CONTROLLER], stdout=subprocess.PIPE, text=True)
    agent = None
    try:
        port = json.loads(ctrl.stdout.readline())["port"]
        agent = subprocess.Popen(agent_cmd(HOST, port, 2, "-q"), stdin=subprocess.DEVNULL)
        pids = json.loads(ctrl.stdout.readline())["pids"]
        time.sleep(0.3)  # the workers are now busy in testing.sleep
        ctrl.kill()
        ctrl.wait()
        assert agent.wait(10) == 1  # lost its controller
        assert wait_gone(pids[1:], 5) == []
    finally:
        ctrl.kill()
        if agent is not None and agent.poll() is None:
            agent.kill()


# --------------------------------------------------------------------------- TLS
def _make_cert(tmp_path):
    from disco_core.testing.tls import make_certificate

    return make_certificate(tmp_path)


@pytest.mark.timeout(60)
def test_tls(cluster, tmp_path):
    import ssl

    cert, key = _make_cert(tmp_path)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    results = {}

    def action(host, port):
        # A plain-TCP agent cannot talk to a TLS controller.
        results["plain"] = subprocess.run(
            agent_cmd(host, port, 1), capture_output=True, text=True, timeout=30
        )
        cluster.agents.extend(
            start_local_agents(
                host, port, 1, 1, token="t", extra_args=("--tls-ca", str(cert), "-q")
            )
        )

    on_listen, done = _on_listen_then(action)
    sess = disco.SocketSession(
        2, 1, 1, HOST, 0, ssl_context=ctx, token="t", on_listen=on_listen, timeout=30
    )
    cluster.sessions.append(sess)
    done.wait(10)
    assert results["plain"].returncode == 2
    assert isinstance(sess.channel.nodes[0].sock, ssl.SSLSocket)
    a = np.arange(1 << 18, dtype="float64")
    r = sess.get_global_func("disco.empty")((1 << 18,), "float64", None, False, False)
    r.debug_copy_from(1, a)
    np.testing.assert_array_equal(r.debug_get_from_remote(1), a)


# --------------------------------------------------------------------------- namespaces
def _ip(*args, ns=None):
    cmd = ["ip", *args] if ns is None else ["ip", "netns", "exec", ns, "ip", *args]
    return subprocess.run(cmd, capture_output=True, text=True)


@contextlib.contextmanager
def _namespaces(count: int, first_subnet: int):
    """``count`` network namespaces, each joined to this one by a veth pair.

    Namespace k (from 0) gets subnet ``10.250.(first_subnet + k).0/24``: ``.1`` on
    this side, ``.2`` inside, and a route to the first subnet (where the controller
    listens). Yields ``[(namespace, this side's interface, the namespace's), ...]``; all is
    deleted afterwards. Skips the test where namespaces or veth pairs cannot be made.
    """
    if not shutil.which("ip"):
        pytest.skip("needs the `ip` command (iproute2)")
    tag = f"{os.getpid() % 100000}"
    created, veths = [], []
    try:
        nets = []
        for k in range(count):
            net = first_subnet + k
            ns, host_if, ns_if = f"disco-t{tag}-{net}", f"dsv{tag}h{net}", f"dsv{tag}n{net}"
            r = _ip("netns", "add", ns)
            if r.returncode:
                pytest.skip(f"no permission to create network namespaces: {r.stderr.strip()}")
            created.append(ns)
            veths.append(host_if)
            for args in (
                ("link", "add", host_if, "type", "veth", "peer", "name", ns_if),
                ("link", "set", ns_if, "netns", ns),
                ("addr", "add", f"10.250.{net}.1/24", "dev", host_if),
                ("link", "set", host_if, "up"),
            ):
                r = _ip(*args)
                if r.returncode:
                    pytest.skip(
                        f"cannot set up veth pairs: ip {' '.join(args)}: {r.stderr.strip()}"
                    )
            for args in (
                ("addr", "add", f"10.250.{net}.2/24", "dev", ns_if),
                ("link", "set", ns_if, "up"),
                ("link", "set", "lo", "up"),
            ):
                assert _ip(*args, ns=ns).returncode == 0
            if k:
                route = ("route", "add", f"10.250.{first_subnet}.0/24", "via", f"10.250.{net}.1")
                assert _ip(*route, ns=ns).returncode == 0
            nets.append((ns, host_if, ns_if))
        yield nets
    finally:
        for host_if in veths:
            _ip("link", "del", host_if)  # both ends, now (the namespace's teardown is lazy)
        for ns in created:
            _ip("netns", "del", ns)


def _agents_in(namespaces, agents, token, workers=2, env=None):
    """An on_listen that starts one agent in each namespace."""

    def on_listen(host, port):
        for ns in namespaces:
            cmd = ["ip", "netns", "exec", ns, *agent_cmd(host, port, workers, "-q")]
            agents.append(
                subprocess.Popen(
                    cmd, stdin=subprocess.DEVNULL, env=dict(env or os.environ, DISCO_TOKEN=token)
                )
            )

    return on_listen


def _reap(agents):
    for p in agents:
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.timeout(90)
def test_nodes_in_network_namespaces():
    """Three nodes: the controller in the test's namespace, two agents each in a netns of its own.

    The test creates the namespaces and veth pairs with addresses it assigns
    (10.250.k.1 on the controller's side, 10.250.k.2 in namespace k) and deletes
    them afterwards; no other address is ever contacted.
    """
    agents = []
    sess = None
    with _namespaces(2, first_subnet=1) as nets:
        try:
            sess = disco.SocketSession(
                3, 2, 1, "10.250.1.1", 0, token="ns", timeout=30,
                on_listen=_agents_in([net[0] for net in nets], agents, "ns"),
            )  # fmt: skip
            peers = sorted(link.peer.split(":")[0] for link in sess.channel.nodes)
            assert peers == ["10.250.1.2", "10.250.2.2"]
            assert _values(sess.get_global_func("disco.worker_id")(), 6) == list(range(6))
            a = np.arange(1 << 20, dtype="float32")
            echo = sess.get_global_func("disco.empty")((1 << 20,), "float32", None, False, False)
            for w in range(6):
                echo.debug_copy_from(w, a + w)
            for w in range(6):
                np.testing.assert_array_equal(echo.debug_get_from_remote(w), a + w)
            sess.shutdown()
            assert [p.wait(10) for p in agents] == [0, 0]
        finally:
            if sess is not None:
                sess.shutdown()
            _reap(agents)


@pytest.mark.timeout(90)
def test_network_cut_is_noticed_by_both_sides(monkeypatch):
    """The link to a node's namespace goes down: neither side hears the other again.

    The controller raises ``WorkerDiedError`` naming the node within the heartbeat
    timeout (set here through ``DISCO_HEARTBEAT_TIMEOUT``), and the agent, cut off
    as well, gives up on the controller and stops its workers.
    """
    monkeypatch.setenv("DISCO_HEARTBEAT_TIMEOUT", "2")
    agents = []
    sess = None
    with _namespaces(1, first_subnet=3) as nets:
        ns, host_if, _ = nets[0]
        try:
            sess = disco.SocketSession(
                2, 2, 1, "10.250.3.1", 0, token="cut", timeout=30,
                on_listen=_agents_in([ns], agents, "cut"),
            )  # fmt: skip
            assert sess.channel.heartbeat_timeout == 2.0
            sess.import_python_module(FUNCS)
            pids = _values(sess.get_global_func("testing.pid")(), 4)
            ok = sess.get_global_func("testing.echo")(1)
            assert ok.debug_get_from_remote(3) == 1
            assert _ip("link", "set", host_if, "down").returncode == 0
            t0 = time.monotonic()
            with pytest.raises(disco.WorkerDiedError) as info:
                ok.debug_get_from_remote(2)
            assert time.monotonic() - t0 < 2.0 + 3.0
            assert info.value.worker_ids == [2, 3]
            assert "node 1" in str(info.value) and "stopped responding" in str(info.value)
            assert isinstance(info.value, disco.WorkerUnresponsiveError)
            assert agents[0].wait(10) == 1  # the agent noticed the silence too
            assert wait_gone(pids[2:], 5) == []
        finally:
            if sess is not None:
                sess.shutdown()
            _reap(agents)


@pytest.mark.timeout(90)
def test_heartbeat_survives_transfers_longer_than_its_timeout():
    """On a link limited to 20 Mbit/s one 6 MiB transfer takes ~2.5 s; the timeout is 1 s.

    While the controller sends, it cannot ping (its send lock is held), and while
    the agent relays a reply (``direct_replies=False``) neither can it: the bytes
    arriving keep each side alive all the same.
    """
    if not shutil.which("tc"):
        pytest.skip("needs the `tc` command (iproute2) to limit a link's rate")
    agents = []
    sess = None
    with _namespaces(1, first_subnet=4) as nets:
        ns, host_if, ns_if = nets[0]
        tbf = ["root", "tbf", "rate", "20mbit", "burst", "64kb", "latency", "2s"]
        for prefix, dev in (([], host_if), (["ip", "netns", "exec", ns], ns_if)):
            r = subprocess.run(
                [*prefix, "tc", "qdisc", "add", "dev", dev, *tbf], capture_output=True, text=True
            )
            if r.returncode:
                pytest.skip(f"cannot limit the link's rate (tc tbf): {r.stderr.strip()}")
        try:
            sess = disco.SocketSession(
                2, 1, 1, "10.250.4.1", 0, token="slow", timeout=30, heartbeat_timeout=1.0,
                direct_replies=False, on_listen=_agents_in([ns], agents, "slow", workers=1),
            )  # fmt: skip
            a = np.arange(6 << 17, dtype="float64")  # 6 MiB
            r = sess.get_global_func("disco.empty")(a.shape, "float64", None, False, False)
            t0 = time.monotonic()
            r.debug_copy_from(1, a)  # controller -> node
            np.testing.assert_array_equal(r.debug_get_from_remote(1), a)  # node -> controller
            assert time.monotonic() - t0 > 2 * 1.0  # the transfers did outlast the timeout
            assert not sess.channel.hub.dead
            sess.shutdown()
            assert agents[0].wait(10) == 0
        finally:
            if sess is not None:
                sess.shutdown()
            _reap(agents)


# --------------------------------------------------------------------------- CLI
def test_cli_version_and_help():
    script = os.path.join(os.path.dirname(sys.executable), "disco-socket")
    if not os.path.exists(script):
        pytest.skip("the disco-socket console script is not installed next to this Python")
    r = subprocess.run([script, "version"], capture_output=True, text=True)
    assert r.returncode == 0 and f"protocol {wire.PROTOCOL_VERSION}" in r.stdout
    r = subprocess.run(
        [sys.executable, "-m", "disco_socket", "join", "--help"], capture_output=True, text=True
    )
    assert r.returncode == 0
    for opt in ("--workers", "--token", "--connect-timeout", "--tls-ca", "--tls-cert"):
        assert opt in r.stdout


def test_cli_short_form_is_documented_and_checked():
    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", "disco_socket", *args],
            capture_output=True,
            text=True,
            timeout=30,
        )

    r = run("--help")
    assert r.returncode == 0 and "python -m disco_socket HOST PORT N" in r.stdout
    assert "Short form" in run("join", "--help").stdout
    port = str(_free_port())
    for args, missing in (((HOST, port), "missing N"), ((HOST,), "missing PORT")):
        r = run(*args)
        assert r.returncode == 2 and missing in r.stderr, r.stderr
        assert "invalid choice" not in r.stderr
    # A mistyped command is not taken for a host (it blamed the port: an outside check).
    r = run("jion", HOST, port, "--workers", "2")
    assert r.returncode == 2 and "unknown command 'jion': did you mean 'join'?" in r.stderr
    r = run(HOST, "x", "2")
    assert r.returncode == 2 and "needs a PORT number after it, not 'x'" in r.stderr
    for typo in (("jion",), ("JOIN", HOST, port)):  # alone, or in capitals
        r = run(*typo)
        assert r.returncode == 2 and "did you mean" in r.stderr and "'join'" in r.stderr, r.stderr
    # $DISCO_CONNECT_TIMEOUT: a bad one is a usage error naming it (was a traceback),
    # a good one is the default of --connect-timeout
    env = {**os.environ, "DISCO_CONNECT_TIMEOUT": "x"}
    r = subprocess.run([sys.executable, "-m", "disco_socket", HOST, port, "1"],
                       capture_output=True, text=True, timeout=30, env=env)  # fmt: skip
    assert r.returncode == 2 and "$DISCO_CONNECT_TIMEOUT: not a number of seconds: 'x'" in r.stderr
    env["DISCO_CONNECT_TIMEOUT"] = "0.3"
    r = subprocess.run([sys.executable, "-m", "disco_socket", HOST, port, "1", "-q"],
                       capture_output=True, text=True, timeout=30, env=env)  # fmt: skip
    assert r.returncode == 3 and "after 0.3 s" in r.stderr, r.stderr
    # Both spellings of the worker count parse (then find no controller: exit code 3).
    assert run(HOST, port, "1", "--connect-timeout", "0.3", "-q").returncode == 3
    assert run(HOST, port, "--workers", "1", "--connect-timeout", "0.3", "-q").returncode == 3


@pytest.mark.timeout(30)
def test_heartbeat_sees_its_own_pause(monkeypatch):
    """A controller that was itself stopped says so when it finds its nodes gone.

    The heartbeat thread measures how late its own ticks were: a pause of the whole
    process (SIGSTOP, a suspended machine) shows there, and the node's death reason
    then names it instead of only blaming the node.
    """
    import types

    lsock = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(lsock.getsockname())
    b, _ = lsock.accept()
    clock = [1000.0]
    monkeypatch.setattr(wire, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    hb = wire.Heartbeat(a, threading.Lock(), 5.0, lambda idle: None, "test-beat").start()
    try:
        time.sleep(0.3)
        clock[0] += 30.0  # the next tick comes 30 s late on the process's clock
        deadline = time.monotonic() + 5
        while hb.paused_for < 20 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert 20 < hb.paused_for < 40
    finally:
        hb.stop()
        for s in (a, b, lsock):
            s.close()


@pytest.mark.timeout(60)
def test_remote_workers_beat_at_the_controllers_pace(cluster, monkeypatch):
    """The welcome carries the controller's DISCO_LIVENESS_TIMEOUT to the agents' workers.

    Their heartbeat interval is a fifth of it: a short bound on the controller is not
    a false alarm on a node whose own environment says otherwise.
    """
    monkeypatch.setenv("DISCO_LIVENESS_TIMEOUT", "4")
    sess = cluster.session(2, 1)
    sess.import_python_module(FUNCS)
    r = sess.call_packed("testing.getenv", "DISCO_LIVENESS_TIMEOUT")
    assert r.debug_get_from_remote(1) == "4.0"  # set by the agent from the welcome ("4" inherited)


def test_the_plugin_package_names_the_session_it_brings():
    """DESIGN.md's layout: ``import disco_socket`` (SocketSession, multi-node)."""
    import disco_socket

    assert disco_socket.SocketSession is disco.SocketSession
    assert "SocketSession" in disco_socket.__all__


class _NotAllowed:
    """A user's class: nothing a network peer may rebuild."""


def test_a_value_the_nodes_would_refuse_is_refused_at_the_call(make_socket_session):
    """DESIGN.md: wrong use is an error at the call site, never a worker crash. A node's
    worker rebuilds commands with an allow-list; one it cannot read ended it (and the
    session with it: WorkerDiedError at the next sync), so the controller refuses first."""
    with make_socket_session(4) as sess:  # 2 nodes: workers 2 and 3 are remote
        f = sess.get_global_func("disco.worker_id")
        x = sess.empty((2,), "float32")
        for bad in (
            _NotAllowed(),
            [1, (2, _NotAllowed())],
            np.array([_NotAllowed()], dtype=object),
        ):
            with pytest.raises(
                disco.DiscoTypeError, match=r"cannot send .*_NotAllowed.* network link"
            ):
                sess.call_packed(f, bad)
        with pytest.raises(disco.DiscoTypeError, match="_NotAllowed"):
            x.debug_copy_from(3, _NotAllowed())
        # nothing went to any worker: every one is alive and in step
        assert [f().debug_get_from_remote(w) for w in range(4)] == [0, 1, 2, 3]
        sess.call_packed("disco.worker_id")  # plain values still go as before
        sess.sync_worker_0()


@pytest.mark.timeout(60)
def test_ctrl_c_as_the_local_workers_start_leaves_none_running():
    """A real SIGINT after a local worker process started but before its link was in
    the channel's list left that worker running while the controller lived (as in the
    core's ProcessChannel; outside check there). The start-up steps hold it now."""
    from disco_core.spi import FrameReader, ProcessWorkerLink

    main = threading.main_thread().ident
    fired = []

    def tracer(frame, event, arg):
        if (
            event == "call"
            and frame.f_code is FrameReader.__init__.__code__
            and frame.f_back.f_code is ProcessWorkerLink.__init__.__code__
            and not fired
        ):
            fired.append(1)
            signal.pthread_kill(main, signal.SIGINT)  # a real one, as Ctrl-C sends
        return None

    before = set(children_of(os.getpid()))
    sys.settrace(tracer)
    try:
        with pytest.raises(KeyboardInterrupt):
            disco.SocketSession(1, 3, host=HOST, port=0, timeout=30)
    finally:
        sys.settrace(None)
    assert fired == [1]
    deadline = time.monotonic() + 10
    while set(children_of(os.getpid())) - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not set(children_of(os.getpid())) - before


@pytest.mark.timeout(60)
def test_syncs_with_each_worker_of_a_socket_session():
    """``LinkChannel.sync`` is inherited by the socket channel, whose ``send`` is its own:
    a change of the sync's call to ``send`` (a keyword the override lacked) made every
    sync with a worker process raise TypeError (caught only by mypy)."""
    with disco.SocketSession(1, 3, host=HOST, port=0, timeout=30) as sess:
        f = sess.get_global_func("disco.worker_id")
        r = f()
        for w in range(3):
            sess._sync_worker(w)
        sess._sync_all()
        assert [int(r.debug_get_from_remote(w)) for w in range(3)] == [0, 1, 2]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("direct", [False, True])
def test_a_reply_the_controller_cannot_hold_ends_the_link_not_the_reader(cluster, monkeypatch, direct):  # fmt: skip
    """A reader thread stopped by anything (here a MemoryError for a reply's declared
    buffer: a peer can declare up to 1 TiB, or a relay can on a sealed record not yet
    verified) ends its link, and the waiting call gets a WorkerDiedError. Before, only
    EOFError, OSError, ValueError and struct.error did: the thread died silently and the
    call waited for good (outside check, F0/F1)."""
    real = wire.alloc

    def alloc(n):
        if n >= 1 << 20:
            raise MemoryError(f"cannot allocate {n} bytes")
        return real(n)

    monkeypatch.setattr(wire, "alloc", alloc)
    sess = cluster.session(2, 1, 1, direct_replies=direct)
    try:
        sess.import_python_module("disco_core.testing.funcs")
        ref = sess.get_global_func("testing.echo")(np.ones(1 << 18))  # 2 MiB on each worker
        t0 = time.monotonic()
        with pytest.raises(disco.WorkerDiedError, match="worker 1|node"):
            ref.debug_get_from_remote(1)
        assert time.monotonic() - t0 < 5  # at once, not by the heartbeat's silence (10 s)
    finally:
        sess.shutdown()


def test_an_empty_connect_timeout_variable_is_unset(monkeypatch):
    """As for the other DISCO_* variables (it was a usage error: outside check 58)."""
    from disco_socket import agent, cli

    seen = {}
    monkeypatch.setattr(agent, "run_agent", lambda *a, **kw: seen.update(kw) or 0)
    for value, want in (("", 60.0), (" ", 60.0), ("2.5", 2.5)):
        monkeypatch.setenv("DISCO_CONNECT_TIMEOUT", value)
        assert cli.main(["join", "127.0.0.1", "9", "--workers", "1"]) == 0
        assert seen["connect_timeout"] == want


@pytest.mark.parametrize(
    "args, kwargs, error, says",
    [
        ((0, 1), {}, disco.DiscoValueError, "SocketSession: num_nodes must be >= 1, got 0"),
        ((2, 0), {}, disco.DiscoValueError, "SocketSession: num_workers_per_node must be >= 1"),
        ((1.5, 1), {}, disco.DiscoTypeError, "SocketSession: num_nodes must be an int"),
        (
            (2, 1),
            {"bogus": 1},
            disco.DiscoTypeError,
            "SocketSession: got an unexpected keyword argument 'bogus'",
        ),  # fmt: skip
        ((1, 1), {"on_listen": 5}, disco.DiscoTypeError, "on_listen must be a callable"),
    ],
)
def test_bad_arguments_name_themselves(args, kwargs, error, says):
    """Both counts were reported as "num_workers must be >= 1", an unknown keyword as
    the channel's own TypeError, and a non-callable on_listen as "'int' object is not
    callable" once the session listened (outside check)."""
    with pytest.raises(error, match=re.escape(says)):
        disco.SocketSession(*args, **kwargs)
