"""disco-socket end to end: node layout, module shipping, handshake, failures, TLS, CLI."""

from __future__ import annotations

import json
import logging
import os
import pickle
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
from disco_socket import SocketChannel, start_local_agents, wire

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
    with pytest.raises(disco.CCLError, match="pip install disco-mpi"):
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
def test_load_vm_module_ships_a_file_the_nodes_lack(cluster, tmp_path):
    if not _can_unshare_mount():
        pytest.skip("needs `unshare --mount` (root or user namespaces) to hide a folder from nodes")
    hidden = tmp_path / "only_on_controller"
    hidden.mkdir()
    path = hidden / "model_mod.py"
    path.write_text(_MODULE)
    agents = []

    def on_listen(host, port):
        # Each agent runs in its own mount namespace where `hidden` is an empty tmpfs.
        for _ in range(2):
            cmd = [
                "unshare", "--mount", "--propagation", "private", "sh", "-c",
                'mount -t tmpfs tmpfs "$0" && exec "$@"', str(hidden),
                *agent_cmd(host, port, 2, "-q"),
            ]  # fmt: skip
            agents.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL))

    try:
        sess = disco.SocketSession(3, 2, 1, HOST, 0, on_listen=on_listen, timeout=30)
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
    assert "no controller answered" in r.stderr


@pytest.mark.timeout(60)
def test_timeout_when_nodes_never_come():
    before = set(children_of(os.getpid()))
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"0 of 2 node\(s\) joined .*disco-socket join"):
        disco.SocketSession(3, 2, 1, HOST, 0, timeout=1.5)
    assert time.monotonic() - t0 < 5
    # The controller's own local worker processes were stopped.
    assert wait_gone(list(set(children_of(os.getpid())) - before), 5) == []


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
    if not shutil.which("openssl"):
        pytest.skip("needs the openssl command to make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    r = subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=disco-test", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        capture_output=True,
    )  # fmt: skip
    if r.returncode:
        pytest.skip(f"openssl could not make a certificate: {r.stderr[-200:]!r}")
    return cert, key


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


@pytest.mark.timeout(90)
def test_nodes_in_network_namespaces(tmp_path):
    """Three nodes: the controller in the test's namespace, two agents each in a netns of its own.

    The test creates the namespaces and veth pairs with addresses it assigns
    (10.250.k.1 on the controller's side, 10.250.k.2 in namespace k) and deletes
    them afterwards; no other address is ever contacted.
    """
    if not shutil.which("ip"):
        pytest.skip("needs the `ip` command (iproute2)")
    tag = f"{os.getpid() % 100000}"
    names = [f"disco-t{tag}-{k}" for k in (1, 2)]
    r = _ip("netns", "add", names[0])
    if r.returncode:
        pytest.skip(f"no permission to create network namespaces: {r.stderr.strip()}")
    created = [names[0]]
    agents = []
    sess = None
    try:
        for k, ns in enumerate(names, start=1):
            if ns not in created:
                assert _ip("netns", "add", ns).returncode == 0
                created.append(ns)
            host_if, ns_if = f"dsv{tag}h{k}", f"dsv{tag}n{k}"
            for args in (
                ("link", "add", host_if, "type", "veth", "peer", "name", ns_if),
                ("link", "set", ns_if, "netns", ns),
                ("addr", "add", f"10.250.{k}.1/24", "dev", host_if),
                ("link", "set", host_if, "up"),
            ):
                r = _ip(*args)
                if r.returncode:
                    pytest.skip(
                        f"cannot set up veth pairs: ip {' '.join(args)}: {r.stderr.strip()}"
                    )
            for args in (
                ("addr", "add", f"10.250.{k}.2/24", "dev", ns_if),
                ("link", "set", ns_if, "up"),
                ("link", "set", "lo", "up"),
            ):
                assert _ip(*args, ns=ns).returncode == 0
            if k != 1:  # the controller listens on 10.250.1.1
                assert (
                    _ip("route", "add", "10.250.1.0/24", "via", f"10.250.{k}.1", ns=ns).returncode
                    == 0
                )
        controller = "10.250.1.1"

        def on_listen(host, port):
            for ns in names:
                cmd = ["ip", "netns", "exec", ns, *agent_cmd(host, port, 2, "-q")]
                agents.append(
                    subprocess.Popen(
                        cmd, stdin=subprocess.DEVNULL, env=dict(os.environ, DISCO_TOKEN="ns")
                    )
                )

        sess = disco.SocketSession(
            3, 2, 1, controller, 0, on_listen=on_listen, token="ns", timeout=30
        )
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
        for p in agents:
            if p.poll() is None:
                p.kill()
                p.wait()
        for ns in created:
            _ip("netns", "del", ns)  # removes the veth pairs with it


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


def test_handshake_proofs_bind_roles_and_nonces():
    a, b = wire.new_nonce(), wire.new_nonce()
    node = wire.proof(b"k", "node", a, b)
    assert node != wire.proof(b"k", "controller", a, b)
    assert node != wire.proof(b"k", "node", b, a)
    assert node != wire.proof(b"other", "node", a, b)
    assert wire.check_proof(node, node) and not wire.check_proof(node, None)
