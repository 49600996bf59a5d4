"""disco-socket against impostors and relays: real agents, real sockets on 127.0.0.1.

Each attack is scripted as an outsider would run it: a node without the token, a
fake controller where the node connects, a relay between node and controller that
alters or injects a command, hostile handshake bytes, a worker that returns an
object whose unpickling would run code. With a token, none of them gets anything
run, and nothing hangs.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import numpy as np
import pytest
from _socket_helpers import HOST, agent_cmd, children_of, wait_gone
from hypothesis import given, settings
from hypothesis import strategies as st

import disco_core as disco
from disco_core import protocol as P
from disco_core.errors import (
    DiscoError,
    FrameLimitError,
    InsecureBindError,
    IntegrityError,
    WorkerDiedError,
    WorkerError,
)
from disco_core.net.security import Handshake
from disco_core.spi import decode_untrusted, encode_for_network
from disco_socket import start_local_agents, wire
from disco_socket.agent import EXIT_REFUSED, AgentError

FUNCS = "disco_core.testing.funcs"


# --------------------------------------------------------------------------- helpers
@pytest.fixture
def sec_module(tmp_path, monkeypatch):
    """A module of test functions that the controller and every worker import."""
    name = f"sock_sec_{os.getpid()}_{abs(hash(str(tmp_path))) % 10**8}"
    (tmp_path / f"{name}.py").write_text(
        textwrap.dedent(
            """
            import numpy as np

            from disco_core.registry import register_func
            from disco_core.worker import current


            class Evil:
                # Unpickling this opens (creates) a file: code run by whoever loads it.
                def __init__(self, path):
                    self.path = path

                def __reduce__(self):
                    return (open, (self.path, "w"))


            class Opaque:
                pass


            def touch(path):
                # One file per worker: worker 0 runs in the controller's process.
                open(f"{path}.{current().worker_id}", "w").close()
                return path


            register_func("sec.touch", touch, override=True)
            register_func("sec.evil", lambda path: Evil(path), override=True)
            register_func("sec.opaque", lambda: Opaque(), override=True)
            register_func(
                "sec.values",
                lambda: (np.arange(5.0), np.float32(2.5), 7, "s", {"k": [1, 2]}, None),
                override=True,
            )
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    __import__(name)
    return name


class Relay:
    """A TCP relay between agents and a controller: what anyone on the path can do.

    Every connection accepted is relayed to ``upstream``. On connection number
    ``conn`` (0: the node's link; 1: its first reply connection), the bytes in
    direction ``way`` ("down": controller to node, "up": node to controller) pass
    through :meth:`_tamper`: when armed, it flips one byte of ``pattern``
    (``mode="flip"``), inserts ``forged`` before the next chunk
    (``mode="inject"``), keeps a copy of the chunk holding ``pattern``
    (``mode="record"``) and sends it again before the next one (``mode="replay"``).
    """

    def __init__(self, upstream: tuple[str, int], conn: int = 0, way: str = "down") -> None:
        self.upstream = upstream
        self.tamper_at = (conn, way)
        self.listener = socket.create_server((HOST, 0))
        self.port = self.listener.getsockname()[1]
        self.mode: str | None = None
        self.pattern = b""
        self.forged = b""
        self.recorded = b""
        self.done = threading.Event()
        self.socks: list[socket.socket] = []
        self.count = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self, mode: str, pattern: bytes = b"", forged: bytes = b"") -> None:
        self.pattern, self.forged = pattern, forged
        self.mode = mode

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return
            up = socket.create_connection(self.upstream)
            self.socks += [down, up]
            tamper_up = self.tamper_at == (self.count, "up")
            tamper_down = self.tamper_at == (self.count, "down")
            self.count += 1
            threading.Thread(target=self._pump, args=(down, up, tamper_up), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, down, tamper_down), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, tamper: bool) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if tamper:
                    data = self._tamper(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _tamper(self, data: bytes) -> bytes:
        if self.mode == "flip" and self.pattern in data:
            i = data.index(self.pattern) + len(self.pattern) - 1
            data = data[:i] + bytes([data[i] ^ 0x03]) + data[i + 1 :]  # "A" -> "B"
            self.mode = None
            self.done.set()
        elif self.mode == "inject":
            data = self.forged + data
            self.mode = None
            self.done.set()
        elif self.mode == "record" and self.pattern in data:
            self.recorded = data  # forwarded as is, kept for later
            self.mode = None
        elif self.mode == "replay":
            data = self.recorded + data  # old records again, before the new ones
            self.mode = None
            self.done.set()
        return data

    def close(self) -> None:
        self.listener.close()
        for s in self.socks:
            s.close()


def _relayed_session(cluster, token, relays, conn=0, way="down", **options):
    """A 2-node session (1 worker each) whose agent reaches the controller through a Relay."""

    started = []

    def on_listen(host, port):
        relay = Relay((host, port), conn, way)
        relays.append(relay)
        started.extend(start_local_agents(host, relay.port, 1, 1, token=token))
        cluster.agents.extend(started)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # loopback without a token
        sess = disco.SocketSession(
            2, 1, 1, HOST, 0, token=token, on_listen=on_listen, timeout=30, **options
        )
    cluster.sessions.append(sess)
    sess.agents = started
    return sess


def _forged_call(func_reg: int, path: str) -> bytes:
    """A whole relay message: run ``func(path)`` on every worker of the node."""
    frame = encode_for_network((P.CALL_PACKED, 0, func_reg, (path,)))
    return wire.MSG.pack(wire.K_FRAME, wire.ALL) + P.frame_head(frame) + b"".join(frame[1])


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


def _wait_exit(proc: subprocess.Popen, timeout: float = 20) -> int:
    return proc.wait(timeout)


# --------------------------------------------------------------------------- the relay
@pytest.mark.timeout(90)
@pytest.mark.parametrize("token", [None, "s3cret"])
def test_relay_flipping_a_command_byte(cluster, sec_module, tmp_path, token):
    relays: list[Relay] = []
    sess = _relayed_session(cluster, token, relays)
    relay = relays[0]
    sess.import_python_module(sec_module)
    touch = sess.get_global_func("sec.touch")
    touch(str(tmp_path / "warmup")).debug_get_from_remote(1)
    target = str(tmp_path / "marker-A")
    relay.arm("flip", pattern=target.encode())
    if token is None:
        # Unsealed, the on-path relay rewrites the command: the node runs marker-B.
        assert touch(target).debug_get_from_remote(1).endswith("marker-B")
        assert relay.done.is_set() and (tmp_path / "marker-B.1").exists()
    else:
        t0 = time.monotonic()
        with pytest.raises(WorkerDiedError, match=r"node 1 .*(integrity|disconnected)"):
            touch(target).debug_get_from_remote(1)
        assert time.monotonic() - t0 < 15
        assert relay.done.is_set()
        assert not (tmp_path / "marker-B.1").exists()
        assert not (tmp_path / "marker-A.1").exists()
        assert [a.wait(20) for a in sess.agents] == [1]  # the agent dropped the link
    relay.close()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("token", [None, "s3cret"])
def test_relay_injecting_a_command(cluster, sec_module, tmp_path, token):
    relays: list[Relay] = []
    sess = _relayed_session(cluster, token, relays)
    relay = relays[0]
    sess.import_python_module(sec_module)
    touch = sess.get_global_func("sec.touch")
    assert touch(str(tmp_path / "warmup")).debug_get_from_remote(1)
    forged = _forged_call(touch.reg_id, str(tmp_path / "injected"))
    injected = tmp_path / "injected.1"  # the file of worker 1, on the node
    if token is not None:
        # As a sealed record would look, with a made-up tag (the relay has no key).
        forged = struct.pack("<Q", len(forged)) + forged + os.urandom(16)
    relay.arm("inject", forged=forged)
    ok = sess.get_global_func("disco.worker_id")
    if token is None:
        assert ok().debug_get_from_remote(1) == 1
        deadline = time.monotonic() + 5
        while not injected.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert injected.exists()  # unsealed, the injected command ran
    else:
        with pytest.raises(WorkerDiedError, match="node 1"):
            ok().debug_get_from_remote(1)
        assert relay.done.is_set()
        assert [a.wait(20) for a in sess.agents] == [1]
        assert not injected.exists()
    relay.close()


@pytest.mark.timeout(90)
def test_relay_replaying_a_command(cluster, sec_module, tmp_path):
    relays: list[Relay] = []
    sess = _relayed_session(cluster, "s3cret", relays)
    relay = relays[0]
    sess.import_python_module(sec_module)
    touch = sess.get_global_func("sec.touch")
    first, second = tmp_path / "first", tmp_path / "second"
    relay.arm("record", pattern=str(first).encode())
    assert touch(str(first)).debug_get_from_remote(1) == str(first)
    assert relay.recorded
    (tmp_path / "first.1").unlink()
    relay.arm("replay")
    with pytest.raises(WorkerDiedError, match="node 1"):
        touch(str(second)).debug_get_from_remote(1)
    assert relay.done.is_set()
    assert [a.wait(20) for a in sess.agents] == [1]
    # On the node, neither the replayed command nor the new one ran.
    assert not (tmp_path / "first.1").exists() and not (tmp_path / "second.1").exists()
    relay.close()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("token", [None, "s3cret"])
def test_relay_flipping_a_reply_byte(cluster, token):
    """A direct reply connection (worker -> controller) is sealed by the worker itself."""
    relays: list[Relay] = []
    sess = _relayed_session(cluster, token, relays, conn=1, way="up")
    relay = relays[0]
    assert relay.count == 2  # the node's link and worker 1's reply connection
    sess.import_python_module(FUNCS)
    echo = sess.get_global_func("testing.echo")
    payload = "reply-" + "x" * 40 + "A"
    assert echo(payload).debug_get_from_remote(1) == payload  # untampered, it arrives
    relay.arm("flip", pattern=payload.encode())
    if token is None:
        assert echo(payload).debug_get_from_remote(1) == payload[:-1] + "B"  # forged
    else:
        with pytest.raises(WorkerDiedError, match="worker 1.*reply connection.*integrity"):
            echo(payload).debug_get_from_remote(1)
    assert relay.done.is_set()
    relay.close()


@pytest.mark.timeout(90)
def test_a_pickled_reply_injected_on_the_path_is_refused_not_unpickled(cluster, tmp_path):
    """What a hostile node or an on-path attacker of an unsealed link could send: a
    reply frame whose header is a pickle that opens a file when loaded. The controller
    refuses it as not a frame of the network format; nothing is unpickled."""

    class Evil:
        def __init__(self, path):
            self.path = path

        def __reduce__(self):
            return (open, (self.path, "w"))

    relays: list[Relay] = []
    sess = _relayed_session(cluster, None, relays, conn=1, way="up")
    relay = relays[0]
    sess.import_python_module(FUNCS)
    echo = sess.get_global_func("testing.echo")
    assert echo("warm").debug_get_from_remote(1) == "warm"
    marker = tmp_path / "pwned"
    frame = P.encode(("reply", Evil(str(marker))))  # a pickle, as an older release sent
    relay.arm("inject", forged=P.frame_head(frame) + b"".join(frame[1]))
    with pytest.raises(WorkerError, match="refused by the controller.*not a Disco network frame"):
        echo("x").debug_get_from_remote(1)
    assert relay.done.is_set() and not marker.exists()
    relay.close()


# --------------------------------------------------------------------------- impostors
@pytest.mark.timeout(60)
def test_node_without_the_token_is_refused(cluster):
    out = {}

    def action(host, port):
        r = subprocess.run(
            agent_cmd(host, port, 1, "-q"),
            capture_output=True,
            text=True,
            timeout=30,
            env={k: v for k, v in os.environ.items() if k != "DISCO_TOKEN"},
        )
        out["rc"], out["err"] = r.returncode, r.stderr
        cluster.agents.extend(start_local_agents(host, port, 1, 1, token="s3cret"))

    on_listen, done = _on_listen_then(action)
    sess = disco.SocketSession(2, 1, 1, HOST, 0, token="s3cret", on_listen=on_listen, timeout=30)
    cluster.sessions.append(sess)
    assert done.wait(10)
    assert out["rc"] == EXIT_REFUSED
    assert "requires a token" in out["err"]
    assert any("requires a token" in r for r in sess.channel.rejected)
    assert sess.get_global_func("disco.worker_id")().debug_get_from_remote(1) == 1


@pytest.mark.timeout(60)
def test_node_with_a_token_refuses_a_controller_without_one(cluster):
    out = {}

    def action(host, port):
        r = subprocess.run(
            agent_cmd(host, port, 1, "-q"),
            capture_output=True,
            text=True,
            timeout=30,
            env=dict(os.environ, DISCO_TOKEN="mine"),
        )
        out["rc"], out["err"] = r.returncode, r.stderr
        cluster.agents.extend(start_local_agents(host, port, 1, 1))

    on_listen, done = _on_listen_then(action)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        sess = disco.SocketSession(2, 1, 1, HOST, 0, on_listen=on_listen, timeout=30)
    cluster.sessions.append(sess)
    assert done.wait(10)
    assert out["rc"] == EXIT_REFUSED
    assert "has a token but this session has none" in out["err"]


class FakeController:
    """Listens where a node connects, without the token, and records what it gets."""

    def __init__(self, behaviour: str) -> None:
        self.behaviour = behaviour
        self.listener = socket.create_server((HOST, 0))
        self.port = self.listener.getsockname()[1]
        self.got: list[bytes] = []
        self.after = b""
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            conn.settimeout(10)
            head = wire.recv_exact(conn, wire.HELLO.size)
            hello = wire.recv_json(conn)
            self.got.append(head + json.dumps(hello).encode())
            auth = self.behaviour != "no-auth"
            nonce = os.urandom(32).hex()
            wire.send_json(conn, {"version": wire.PROTOCOL_VERSION, "nonce": nonce, "auth": auth})
            if auth:
                self.got.append(json.dumps(wire.recv_json(conn)).encode())  # the node's proof
                if self.behaviour == "bad-proof":
                    wire.send_json(conn, {"proof": os.urandom(32).hex()})
                else:  # "welcome": skip the proof, send a welcome as if all was well
                    wire.send_json(
                        conn,
                        {"node_id": 1, "worker_ids": [1], "num_workers": 2, "num_groups": 1},
                    )
            # Then a command, as the controller would send it: the node must be gone.
            try:
                conn.sendall(_forged_call(1, "/nonexistent/never-run"))
                self.after = conn.recv(100)
            except OSError:
                self.after = b""

    def close(self) -> None:
        self.listener.close()
        self.thread.join(5)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("behaviour", ["no-auth", "bad-proof", "welcome"])
def test_fake_controller_gets_nothing(behaviour):
    fake = FakeController(behaviour)
    before = set(children_of(os.getpid()))
    r = subprocess.run(
        agent_cmd(HOST, fake.port, 1),
        capture_output=True,
        text=True,
        timeout=30,
        env=dict(os.environ, DISCO_TOKEN="the-real-token"),
    )
    fake.close()
    assert r.returncode == EXIT_REFUSED, r.stderr
    assert "joined" not in r.stderr  # no worker was started
    if behaviour == "no-auth":
        assert "refusing a controller that cannot prove" in r.stderr
        assert len(fake.got) == 1  # the hello: a nonce, no proof
    else:
        assert "failed to authenticate" in r.stderr
        assert len(fake.got) == 2  # a proof bound to the fake's own nonce: useless elsewhere
    assert fake.after == b""
    assert wait_gone(list(set(children_of(os.getpid())) - before), 5) == []


@pytest.mark.timeout(60)
def test_a_proof_is_worthless_in_another_handshake():
    node = Handshake(b"k", "client", wire.LABEL)
    node.bind(b"hello", b"challenge-1")
    other = Handshake(b"k", "server", wire.LABEL)
    other.bind(b"hello", b"challenge-2")
    assert not other.verify(node.proof())
    a = wire.reply_secret(b"k", node.transcript)
    assert a != wire.reply_secret(b"k", other.transcript)
    assert a != wire.reply_secret(b"other", node.transcript)
    assert wire.parse_proof({"proof": "zz" * 32}) is None
    assert wire.parse_proof({"proof": 5}) is None


# --------------------------------------------------------------------------- hostile bytes
@pytest.mark.timeout(60)
@pytest.mark.parametrize("token", [None, "s3cret"])
def test_deeply_nested_hello_is_refused_cleanly(cluster, caplog, token):
    caplog.set_level(logging.WARNING, logger="disco_socket")
    seen = {}

    def action(host, port):
        for magic in (wire.MAGIC, wire.DATA_MAGIC):
            with socket.create_connection((host, port), timeout=10) as s:
                payload = b"[" * 60_000
                s.sendall(wire.HELLO.pack(magic, wire.PROTOCOL_VERSION))
                s.sendall(wire.U32.pack(len(payload)) + payload)
                try:
                    seen[magic] = s.recv(100)  # closed without an answer
                except ConnectionResetError:
                    seen[magic] = b""
        cluster.agents.extend(start_local_agents(host, port, 1, 1, token=token))

    on_listen, done = _on_listen_then(action)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        sess = disco.SocketSession(2, 1, 1, HOST, 0, token=token, on_listen=on_listen, timeout=30)
    cluster.sessions.append(sess)
    assert done.wait(10)
    assert seen == {wire.MAGIC: b"", wire.DATA_MAGIC: b""}
    assert sum("nested too deeply" in r for r in sess.channel.rejected) == 2
    assert sess.get_global_func("disco.worker_id")().debug_get_from_remote(1) == 1


def test_recv_json_refuses_deep_nesting_and_read_frame_checks_counts():
    a, b = socket.socketpair()
    with a, b:
        payload = b"[" * 60_000
        a.sendall(wire.U32.pack(len(payload)) + payload)
        with pytest.raises(wire.HandshakeError, match="nested too deeply"):
            wire.recv_json(b)
        # A frame declaring 2**32-1 buffers is refused before 32 GiB are asked for.
        a.sendall(wire.FRAME_PREFIX.pack(10, 0xFFFFFFFF, 0))
        with pytest.raises(DiscoError, match="buffers"):
            wire.StreamReader(b).read_frame()


def test_errors_are_disco_errors():
    assert issubclass(wire.HandshakeError, DiscoError)
    assert issubclass(wire.HandshakeError, ConnectionError)
    assert issubclass(AgentError, DiscoError)
    assert AgentError("x", 2).code == 2


# --------------------------------------------------------------------------- no unpickling
@pytest.mark.timeout(90)
@pytest.mark.parametrize("token", [None, "s3cret"])
def test_replies_are_never_unpickled(cluster, sec_module, tmp_path, token):
    """A remote worker replies in the network format, which holds no object: one it
    cannot encode (a pickle of this one would open a file) fails the call, at the worker."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        sess = cluster.session(2, 2, token=token)
    sess.import_python_module(sec_module)
    marker = tmp_path / "pwned"
    evil = sess.get_global_func("sec.evil")(str(marker))
    with pytest.raises(WorkerError, match=r"cannot send \S*\.Evil over a network link"):
        evil.debug_get_from_remote(2)
    assert not marker.exists()
    opaque = sess.get_global_func("sec.opaque")()
    with pytest.raises(WorkerError, match=r"cannot send \S*\.Opaque over a network link"):
        opaque.debug_get_from_remote(3)
    # Plain values still arrive, from both remote workers.
    for w in (2, 3):
        arr, f32, i, s, d, none = sess.get_global_func("sec.values")().debug_get_from_remote(w)
        assert np.array_equal(arr, np.arange(5.0)) and f32 == np.float32(2.5)
        assert (i, s, d, none) == (7, "s", {"k": [1, 2]}, None)
    sess.import_python_module(FUNCS)
    big = np.arange(1 << 18, dtype=np.float64)
    assert np.array_equal(sess.get_global_func("testing.echo")(big).debug_get_from_remote(3), big)
    with pytest.raises(WorkerError, match="raised on purpose"):
        sess.get_global_func("testing.raise")().debug_get_from_remote(2)
    assert sess.get_global_func("disco.worker_id")().debug_get_from_remote(3) == 3


@pytest.mark.timeout(90)
def test_a_command_a_remote_worker_would_refuse_is_refused_at_the_call(cluster):
    """A list of 100,000 empty sets takes 43 times its encoded size in memory, past what a
    receiver allows: the remote worker refused the command and exited (code 3), and the
    session was over. Now the call raises, nothing is sent, and the session goes on."""
    sess = cluster.session(2, 1, token="t")
    sess.import_python_module(FUNCS)
    echo = sess.get_global_func("testing.echo")
    with pytest.raises(disco.DiscoValueError, match="more than 24 bytes of memory per byte"):
        echo([set() for _ in range(100_000)])
    # small ones too (not rebuilt by the sender: its encoder checks them; check 58)
    step = (1 << 61) - 1  # ints that differ by this share a hash
    with pytest.raises(disco.DiscoValueError, match="keys of one hash value"):
        echo({i * step: None for i in range(-4, 5)} | {i: None for i in range(30)})
    with pytest.raises(disco.DiscoValueError, match="time without a unit"):
        echo(np.timedelta64(5))
    assert echo([np.str_(""), np.str_]).debug_get_from_remote(1) == ["", np.str_]
    sets = [{i} for i in range(100_000)]  # 19 times its size: it crosses
    assert echo(sets).debug_get_from_remote(1) == sets
    assert sess.get_global_func("disco.worker_id")().debug_get_from_remote(1) == 1


@pytest.mark.timeout(60)
def test_agent_starts_workers_untrusted(cluster):
    sess = cluster.session(2, 1, token="t")
    (agent,) = sess.agents
    deadline = time.monotonic() + 5
    workers = []
    while not workers and time.monotonic() < deadline:
        workers = children_of(agent.pid)
        time.sleep(0.05)
    with open(f"/proc/{workers[0]}/cmdline", "rb") as f:
        argv = f.read().split(b"\0")
    assert b"--untrusted" in argv and b"--reply-key-fd" in argv
    with open(f"/proc/{workers[0]}/environ", "rb") as f:
        assert not any(e.startswith(b"DISCO_TOKEN=") for e in f.read().split(b"\0"))


# --------------------------------------------------------------------------- bind policy
@pytest.mark.timeout(60)
def test_bind_beyond_loopback_needs_a_token_or_tls():
    before = set(children_of(os.getpid()))
    t0 = time.monotonic()
    with pytest.raises(InsecureBindError, match="refusing to listen on 0.0.0.0"):
        disco.SocketSession(2, 1, 1, "0.0.0.0", 0, timeout=1)
    assert time.monotonic() - t0 < 5
    assert wait_gone(list(set(children_of(os.getpid())) - before), 5) == []
    # The explicit opt-out listens, with a warning.
    with pytest.warns(
        RuntimeWarning, match="neither a token nor TLS that requires client certificates"
    ):
        with pytest.raises(TimeoutError):
            disco.SocketSession(2, 1, 1, "0.0.0.0", 0, timeout=0.5, allow_insecure_bind=True)
    # A token is enough.
    with pytest.raises(TimeoutError):
        disco.SocketSession(2, 1, 1, "0.0.0.0", 0, timeout=0.5, token="t")
    # TLS is not, unless it requires the nodes' certificates: alone, it let any node in
    import ssl

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with pytest.raises(InsecureBindError, match="does not require client certificates"):
        disco.SocketSession(2, 1, 1, "0.0.0.0", 0, timeout=1, ssl_context=ctx)


def test_no_unpickling_in_the_plugin_source():
    """No module of the plugin unpickles anything (the core's allow-list does it)."""
    root = os.path.join(os.path.dirname(__file__), "..", "disco_socket")
    for name in os.listdir(root):
        if name.endswith(".py"):
            with open(os.path.join(root, name)) as f:
                text = f.read()
            for bad in ("pickle.loads", "pickle.load(", "Unpickler", "protocol import decode\n"):
                assert bad not in text, (name, bad)


# --------------------------------------------------------------------------- fuzz
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)
_hello_fields = st.fixed_dictionaries(
    {"nonce": st.just("ab" * 32) | _json, "auth": st.booleans() | _json},
    optional={
        "workers": _json | st.just(1),
        "host": _json,
        "pid": _json,
        "node_id": _json | st.just(1),
        "worker": _json | st.just(1),
        "proof": _json | st.just("cd" * 32),
    },
)


def _message(obj_or_bytes) -> bytes:
    data = obj_or_bytes if isinstance(obj_or_bytes, bytes) else json.dumps(obj_or_bytes).encode()
    return wire.U32.pack(len(data)) + data


_peer_bytes = st.one_of(
    st.binary(max_size=200),  # anything at all
    st.builds(  # a hello with fields of any type, then anything
        lambda magic, version, hello, rest: (
            wire.HELLO.pack(magic, version) + _message(hello) + rest
        ),
        st.sampled_from([wire.MAGIC, wire.DATA_MAGIC]),
        st.sampled_from([wire.PROTOCOL_VERSION] * 4 + [3, 0xFFFFFFFF]),
        _hello_fields,
        st.binary(max_size=40) | _hello_fields.map(_message),
    ),
    st.builds(  # a well-formed hello, then a malformed or deep second message
        lambda rest: (
            wire.HELLO.pack(wire.MAGIC, wire.PROTOCOL_VERSION)
            + _message({"workers": 1, "nonce": "ab" * 32, "auth": True})
            + rest
        ),
        st.binary(max_size=100)
        | st.integers(1, 40_000).map(lambda n: _message(b"[" * n))
        | _hello_fields.map(_message),
    ),
)


@pytest.mark.timeout(120)
def test_fuzz_the_controller_handshake(cluster):
    """Seeded: whatever a peer sends before authenticating, the controller answers
    at most with a JSON error, closes the connection, keeps no thread, and still
    takes a real node afterwards."""
    box: dict = {}
    ready = threading.Event()

    def on_listen(host, port):
        box["addr"] = (host, port)
        ready.set()

    def start():
        try:
            box["sess"] = disco.SocketSession(
                2, 1, 1, HOST, 0, token="fuzz", on_listen=on_listen, timeout=100,
                handshake_timeout=5,
            )  # fmt: skip
        except BaseException as exc:  # noqa: BLE001 - reported below
            box["error"] = exc

    starter = threading.Thread(target=start, daemon=True)
    starter.start()
    assert ready.wait(30)
    sent = []

    @settings(max_examples=300, deadline=None, derandomize=True, database=None)
    @given(_peer_bytes)
    def attack(data):
        with socket.create_connection(box["addr"], timeout=10) as s:
            try:
                s.sendall(data)
                s.shutdown(socket.SHUT_WR)
                while s.recv(1 << 16):  # a JSON error at most, then the end
                    pass
            except OSError:  # reset, or closed before this side's shutdown
                pass
        sent.append(data)

    attack()
    cluster.agents.extend(start_local_agents(*box["addr"], 1, 1, token="fuzz"))
    starter.join(60)
    assert "error" not in box, box.get("error")
    sess = box["sess"]
    cluster.sessions.append(sess)
    deadline = time.monotonic() + 10
    while len(sess.channel.rejected) < len(sent) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(sess.channel.rejected) == len(sent)
    alive = [t for t in threading.enumerate() if t.name == "disco-socket-handshake"]
    assert alive == []
    assert sess.get_global_func("disco.worker_id")().debug_get_from_remote(1) == 1


_controller_bytes = st.one_of(
    st.binary(max_size=200),
    st.builds(  # a challenge with fields of any type, then anything
        lambda challenge, rest: _message(challenge) + rest,
        st.fixed_dictionaries(
            {
                "version": st.just(wire.PROTOCOL_VERSION) | _json,
                "nonce": st.just("ab" * 32) | _json,
                "auth": st.booleans() | _json,
            },
            optional={"error": _json},
        ),
        st.binary(max_size=60)
        | _hello_fields.map(_message)
        | st.integers(1, 40_000).map(lambda n: _message(b"{" * n)),
    ),
)


@pytest.mark.timeout(120)
@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(data=_controller_bytes, token=st.sampled_from([None, b"fuzz"]))
def test_fuzz_the_node_handshake(data, token):
    """Seeded: whatever a controller without the token sends, the node's handshake
    ends in a HandshakeError or the connection's end, never another exception, and
    never proceeds (a malformed welcome is refused even without a token)."""
    from disco_socket.agent import handshake

    a, b = socket.socketpair()
    with a, b:
        a.settimeout(5)
        b.sendall(data)
        b.shutdown(socket.SHUT_WR)
        with pytest.raises((wire.HandshakeError, OSError)):
            handshake(a, token, 1)


@pytest.mark.timeout(60)
def test_worker_seals_its_replies_with_the_key_from_its_pipe():
    """``python -m disco_core.worker --reply-key-fd``: every reply frame is one sealed record."""
    from disco_core.net.security import SessionKeys

    a, b = socket.socketpair()
    cmd_r, cmd_w = os.pipe()
    key = os.urandom(64)
    key_r, key_w = os.pipe()
    os.write(key_w, key)
    os.close(key_w)
    argv = [
        sys.executable, "-m", "disco_core.worker", "--worker-id", "1", "--num-workers", "2",
        "--cmd-fd", str(cmd_r), "--reply-fd", str(b.fileno()), "--untrusted",
        "--reply-key-fd", str(key_r),
    ]  # fmt: skip
    proc = subprocess.Popen(argv, pass_fds=(cmd_r, b.fileno(), key_r))
    for fd in (cmd_r, key_r):
        os.close(fd)
    b.close()
    try:
        a.settimeout(30)
        with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
            cmdline = f.read()
        assert key.hex().encode() not in cmdline and key not in cmdline
        # With the wrong key the very first record fails its check...
        raw = bytearray()
        while len(raw) < 8:
            raw += a.recv(8 - len(raw))
        (length,) = struct.unpack("<Q", raw)
        body = wire.recv_exact(a, length + 16)
        good = wire.seal(_Replay(raw + body), SessionKeys(send=os.urandom(64), recv=key))
        header, bufs, _ = wire.StreamReader(good).read_frame()
        # the worker's first message: its first heartbeat, before "ready"
        assert decode_untrusted(header, bufs) == ("alive", None)
        bad = wire.seal(_Replay(raw + body), SessionKeys(send=key, recv=os.urandom(64)))
        with pytest.raises(DiscoError, match="integrity"):
            wire.StreamReader(bad).read_frame()
    finally:
        os.close(cmd_w)  # end of commands: the worker exits
        assert proc.wait(20) == 0
        a.close()


class _Replay:
    """A transport that serves recorded bytes."""

    def __init__(self, data: bytes) -> None:
        self.data = memoryview(bytes(data))

    def recv_into(self, view) -> int:
        n = min(len(view), len(self.data))
        view[:n] = self.data[:n]
        self.data = self.data[n:]
        return n

    def send_parts(self, parts) -> None:
        raise AssertionError("nothing is sent")


def _forged_record(payload: bytes) -> bytes:
    """A large sealed record as an attacker without the keys writes it (a wrong tag)."""
    return struct.pack("<Q", len(payload)) + payload + os.urandom(16)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("declares", ["a 512 GiB buffer", "a 512 MiB header"])
def test_a_forged_record_sizes_no_memory(monkeypatch, declares):
    """An attacker on the path, without the token, injects a large record whose frame
    head declares a huge buffer or header: the reader sizes nothing from those bytes
    before their record's tag is checked, and fails on the tag (outside check: the
    reader allocated the declared 1 TiB first)."""
    from disco_core.net.security import SessionKeys

    sizes: list[int] = []
    real_alloc = wire.alloc
    monkeypatch.setattr(wire, "alloc", lambda n: sizes.append(n) or real_alloc(min(n, 1)))
    if declares == "a 512 GiB buffer":
        head = wire.FRAME_PREFIX.pack(2, 1, 0) + struct.pack("<Q", 512 << 30) + b"hh"
    else:
        head = wire.FRAME_PREFIX.pack(512 << 20, 0, 0)
    payload = wire.MSG.pack(wire.K_FRAME, wire.ALL) + head
    payload += bytes(200_000 - len(payload))  # a large record: read before its tag
    tx = wire.seal(_Replay(_forged_record(payload)), SessionKeys(os.urandom(64), os.urandom(64)))
    reader = wire.StreamReader(tx)
    assert reader.read_msg() == (wire.K_FRAME, wire.ALL)
    with pytest.raises(IntegrityError):
        reader.read_frame()
    assert sizes == []
    assert len(reader.buf) < 4 << 20  # grew with what came (200 kB), not as declared


def test_garbage_in_a_forged_record_is_reported_as_forged():
    """Bytes of a large record are parsed before its tag: a message of unknown kind
    injected there is reported as the forgery it is (IntegrityError), not as the
    peer's protocol error (an outside check)."""
    from disco_core.net.security import SessionKeys

    payload = wire.MSG.pack(99, 0) + os.urandom(100_000)
    tx = wire.seal(_Replay(_forged_record(payload)), SessionKeys(os.urandom(64), os.urandom(64)))
    reader = wire.StreamReader(tx)
    assert reader.read_msg() == (99, 0)  # (acted on only once settled: see settle())
    error = reader.blame(EOFError("protocol error: unknown message kind 99"))
    assert isinstance(error, IntegrityError)
    tx = wire.seal(_Replay(_forged_record(payload)), SessionKeys(os.urandom(64), os.urandom(64)))
    reader = wire.StreamReader(tx)
    reader.read_msg()
    assert isinstance(reader.blame(FrameLimitError("frame declares 1 TiB")), IntegrityError)
    plain = wire.StreamReader(_Replay(payload))
    plain.read_msg()
    unknown = EOFError("protocol error: unknown message kind 99")
    assert plain.blame(unknown) is unknown  # nothing to verify on a plain link


@pytest.mark.timeout(30)
def test_blame_waits_a_bounded_time_for_a_record_that_stops():
    """A forged record whose sender stops in the middle (frozen, or never sending the
    rest) holds the reader's report for ``BLAME_WAIT`` seconds, not for good."""
    from disco_core.net.security import SessionKeys

    a, b = socket.socketpair()
    try:
        payload = wire.MSG.pack(99, 0) + os.urandom(100_000)
        a.sendall(struct.pack("<Q", len(payload) + 50_000) + payload)  # the rest never comes
        tx = wire.seal(wire.transport(b), SessionKeys(os.urandom(64), os.urandom(64)))
        reader = wire.StreamReader(tx)
        assert reader.read_msg() == (99, 0)
        unknown = EOFError("protocol error: unknown message kind 99")
        t0 = time.monotonic()
        assert reader.blame(unknown) is unknown
        assert wire.BLAME_WAIT - 0.1 < time.monotonic() - t0 < wire.BLAME_WAIT + 3
    finally:
        a.close()
        b.close()


def test_a_record_over_the_bound_is_refused_before_it_is_read():
    from disco_core.net.security import SessionKeys

    forged = struct.pack("<Q", wire.MAX_RECORD_BYTES + 1)
    tx = wire.seal(_Replay(forged), SessionKeys(os.urandom(64), os.urandom(64)))
    with pytest.raises(FrameLimitError, match="declared a record of"):
        wire.StreamReader(tx).read_msg()


@pytest.mark.timeout(60)
def test_insecure_opt_out_warns_on_both_sides(cluster):
    from disco_socket.controller import reachable_host

    addr = reachable_host("0.0.0.0")
    if addr == socket.gethostname():
        pytest.skip("this machine has no non-loopback address")
    agents = []

    def on_listen(host, port):
        agents.append(
            subprocess.Popen(
                agent_cmd(addr, port, 1),
                stdin=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                env={k: v for k, v in os.environ.items() if k != "DISCO_TOKEN"},
            )
        )

    with pytest.warns(
        RuntimeWarning, match="neither a token nor TLS that requires client certificates"
    ):
        sess = disco.SocketSession(
            2, 1, 1, "0.0.0.0", 0, on_listen=on_listen, timeout=30, allow_insecure_bind=True
        )
    cluster.agents.extend(agents)
    assert sess.get_global_func("disco.worker_id")().debug_get_from_remote(1) == 1
    sess.shutdown()
    (agent,) = agents
    assert agent.wait(10) == 0
    assert "with neither a token nor TLS" in agent.stderr.read()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "relay_bytes, says",
    [
        (wire.MSG.pack(wire.K_FRAME, 0xFFFFFFF0), "a command for 4294967280 of 1 workers"),
        (
            wire.MSG.pack(wire.K_FRAME, wire.ALL) + wire.FRAME_PREFIX.pack(10, 0xFFFFFFFF, 0),
            "frame declares 4294967295 buffers",
        ),
        (
            wire.MSG.pack(wire.K_FRAME, wire.ALL) + wire.FRAME_PREFIX.pack(1 << 50, 1, 0),
            "frame declares a header of",
        ),
    ],
)
def test_node_checks_declared_counts_before_allocating(relay_bytes, says):
    """A controller (here one without a token, joined by a node without one) that
    declares absurd counts is dropped at once, nothing allocated for them."""
    listener = socket.create_server((HOST, 0))
    port = listener.getsockname()[1]

    def serve():
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(20)
            wire.recv_exact(conn, wire.HELLO.size)
            wire.recv_json(conn)
            nonce = os.urandom(32).hex()
            wire.send_json(conn, {"version": wire.PROTOCOL_VERSION, "nonce": nonce, "auth": False})
            welcome = {"node_id": 1, "worker_ids": [1], "num_workers": 2, "num_groups": 1}
            wire.send_json(conn, {**welcome, "direct": False, "heartbeat_timeout": 0})
            time.sleep(1.0)  # the workers start
            conn.sendall(relay_bytes)
            try:
                while conn.recv(1 << 16):
                    pass
            except OSError:
                pass

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    r = subprocess.run(
        agent_cmd(HOST, port, 1),
        capture_output=True,
        text=True,
        timeout=30,
        env={k: v for k, v in os.environ.items() if k != "DISCO_TOKEN"},
    )
    listener.close()
    t.join(5)
    assert r.returncode == 1, r.stderr
    assert says in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.timeout(90)
def test_ctrl_c_as_a_sealed_record_is_sent_leaves_the_session_working(cluster):
    """With a token every frame is a sealed record whose number is taken before it is
    written: Ctrl-C landing in that send ended the session (the node saw a record out of
    order: outside check, finding 4, 6 of 10 runs). Ctrl-C now waits for the record."""
    from disco_core.net import protect
    from disco_core.testing.interrupts import interrupt_on_entry

    sess = cluster.session(2, 1, token="s3cret")
    sess.import_python_module("disco_core.testing.funcs")
    echo = sess.get_global_func("testing.echo")
    assert echo(1).debug_get_from_remote(1) == 1
    ref = echo(5)
    # the record's tag is made after its number was taken, before it is written
    with interrupt_on_entry(protect._tag.__code__) as fired:
        with pytest.raises(KeyboardInterrupt):
            ref.debug_get_from_remote(1)
    assert fired == [1]
    assert [echo(v).debug_get_from_remote(1) for v in (6, 7)] == [6, 7]
