"""The node agent: ``disco-socket join HOST PORT --workers N``.

It connects to the controller (retrying while the controller is not up yet),
authenticates both ways (with a token: the core's handshake, then every byte
sealed), starts its N workers as child processes (the core's
``python -m disco_core.worker --untrusted``: commands and replies are in the
core's tagged network format, never pickles) and then only relays command frames from the socket to the workers'
pipes, as bytes, never unpickled, each only once the record it came in verified.

Replies: without TLS, the agent opens one authenticated reply connection per
worker and hands it to the worker as its ``--reply-fd`` (with a token, plus the
key that worker seals its replies with, in a pipe: ``--reply-key-fd``), so the
worker writes its replies straight to the controller (no pipe, no relay). With
TLS (a worker cannot speak TLS on a raw file descriptor), replies go through a
pipe and the agent relays them over its TLS connection. It exits, and its
workers with it, when the session shuts down, the controller disappears or falls
silent (heartbeat), a record from it fails its check, or the agent gets SIGINT,
SIGTERM or SIGHUP.

The workers' stderr goes through the agent (to its own stderr), which keeps the
last bytes of each: a worker's death report carries them to the controller.
Module files shipped here live in a cache folder locked by the agent; a folder
whose lock is free belongs to an agent that died, and the next agent removes it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import queue
import re
import selectors
import shutil
import signal
import socket
import ssl
import stat
import struct
import tempfile
import threading
import time
from typing import Any

from disco_core import DiscoError, DiscoValueError
from disco_core.spi import (
    CAN_SPLICE,
    TOKEN_ENV,
    Handshake,
    SessionKeys,
    StderrTee,
    exit_reason,
    is_loopback,
    new_nonce,
    new_pipe,
    read_frame_head,
    resolve_token,
    send_all,
    spawn_worker,
    start_failure,
    stop_worker,
    worker_argv,
    worker_env,
)

from . import wire
from .wire import (
    ALL,
    DATA_MAGIC,
    HELLO,
    K_BYE,
    K_DIED,
    K_FILE,
    K_FRAME,
    K_PING,
    K_STAT,
    MAGIC,
    MSG,
    PROTOCOL_VERSION,
    HandshakeError,
    StreamReader,
)

__all__ = [
    "run_agent",
    "AgentError",
    "EXIT_OK",
    "EXIT_LOST",
    "EXIT_REFUSED",
    "EXIT_NO_CONTROLLER",
    "EXIT_SIGNAL",
    "remove_stale_caches",
]

log = logging.getLogger("disco_socket.agent")

#: Exit codes of the agent.
EXIT_OK = 0  # the session shut down
EXIT_LOST = 1  # the controller went away without shutting the session down
EXIT_REFUSED = 2  # the handshake failed (version, token, worker count)
EXIT_NO_CONTROLLER = 3  # no controller answered within --connect-timeout
EXIT_SIGNAL = 128  # + the signal number: stopped by SIGINT (130), SIGTERM (143), SIGHUP (129)

_CACHE_PREFIX = "disco-socket-node"
_CACHE_LOCK = ".owner.lock"


class AgentError(DiscoError):
    """The agent cannot join or stay in its session; ``code`` is its exit code."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class _Interrupted(BaseException):
    """Raised in the main thread by SIGINT/SIGTERM/SIGHUP (not an ``Exception``: nothing swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


def _writev_all(fd: int, parts: list) -> None:
    send_all(lambda views: os.writev(fd, views), parts)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def connect(
    host: str,
    port: int,
    connect_timeout: float,
    retry_interval: float,
    ssl_context: ssl.SSLContext | None,
    server_hostname: str | None,
) -> socket.socket:
    """Connect to the controller, retrying until ``connect_timeout`` seconds have passed."""
    deadline = time.monotonic() + connect_timeout
    said = False
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=max(1.0, retry_interval * 4))
            break
        except OSError as exc:
            why = _connect_failure(host, port, exc)
            if time.monotonic() + retry_interval > deadline:
                raise AgentError(
                    f"gave up reaching a controller at {host}:{port} after {connect_timeout:g} s "
                    f"(--connect-timeout): {why}",
                    EXIT_NO_CONTROLLER,
                ) from None
            if not said:
                log.info(
                    "disco-socket: waiting for the controller at %s:%d: %s; retrying for up to "
                    "%g s (--connect-timeout)", host, port, why, connect_timeout,
                )  # fmt: skip
                said = True
            time.sleep(retry_interval)
    wire.tune_socket(sock)
    sock.settimeout(30.0)  # the handshake; relaying is blocking
    if ssl_context is not None:
        try:
            sock = ssl_context.wrap_socket(sock, server_hostname=server_hostname or host)
        except (ssl.SSLError, OSError) as exc:
            sock.close()
            raise AgentError(
                f"TLS handshake with {host}:{port} failed: {exc}", EXIT_REFUSED
            ) from None
    return sock


def _connect_failure(host: str, port: int, exc: OSError) -> str:
    """What a failed connection attempt says about the controller, in words."""
    if isinstance(exc, ConnectionRefusedError):
        return (
            f"connection refused: nothing is listening at {host}:{port} (the controller "
            "is not up yet, or its session is over)"
        )
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve the host name {host!r} ({exc})"
    if isinstance(exc, TimeoutError):
        return f"no answer from {host}:{port} (the host is down, unreachable or firewalled)"
    return f"{host}:{port}: {exc}"


def handshake(sock: socket.socket, token: bytes | None, workers: int) -> tuple[dict, Any]:
    """Authenticate both ways; return the controller's welcome and the link's transport.

    With a token the node proves it first, then checks the controller's proof,
    and the returned transport seals every record; a controller that does not
    ask for a token (it cannot prove anything) is refused. Without a token, a
    controller that asks for one is refused.

    Raises
    ------
    HandshakeError
        The controller refused this node, failed to prove the token, or sent
        something malformed.
    """
    tx: Any = wire.transport(sock)
    hello = {
        "workers": workers,
        "nonce": new_nonce().hex(),
        "auth": token is not None,
        "host": socket.gethostname(),
        "pid": os.getpid(),
    }
    data = json.dumps(hello, separators=(",", ":")).encode()
    sent = HELLO.pack(MAGIC, PROTOCOL_VERSION) + wire.U32.pack(len(data)) + data
    tx.send_parts([sent])
    challenge, raw = wire.recv_json_raw(tx)
    if "error" in challenge:
        raise HandshakeError(str(challenge["error"])[:2000])
    if challenge.get("version") != PROTOCOL_VERSION:
        raise HandshakeError(
            f"protocol version mismatch: the node speaks {PROTOCOL_VERSION}, "
            f"the controller {challenge.get('version')!r}"
        )
    wire.nonce_hex(challenge.get("nonce"), "challenge")
    ctrl_auth = challenge.get("auth")
    if token is not None and ctrl_auth is not True:
        raise HandshakeError(
            "the controller does not ask for a token, but this node has one: refusing a "
            "controller that cannot prove it holds the session's token (it may be an impostor; "
            "if not, start the session with the same token)"
        )
    if token is None and ctrl_auth is not False:
        raise HandshakeError(
            "the controller requires a token and this node has none (set DISCO_TOKEN to the "
            "session's token)"
        )
    hs = None
    if token is not None:
        hs = Handshake(token, "client", wire.LABEL)
        hs.bind(sent, raw)
        wire.send_json(tx, {"proof": hs.proof().hex()})
        answer = wire.recv_json(tx)
        if "error" in answer:
            raise HandshakeError(str(answer["error"])[:2000])
        got = wire.parse_proof(answer)
        if got is None or not hs.verify(got):
            raise HandshakeError("the controller failed to authenticate (its token differs)")
        tx = wire.seal(tx, hs.keys())  # from here on every byte is a sealed record
    welcome = wire.recv_json(tx)
    if "error" in welcome:
        raise HandshakeError(str(welcome["error"])[:2000])
    ids = welcome.get("worker_ids")
    if (
        not isinstance(ids, list)
        or len(ids) != workers
        or not all(type(i) is int and i >= 0 for i in ids)
        or type(welcome.get("node_id")) is not int
        or not all(type(welcome.get(k)) is int for k in ("num_workers", "num_groups"))
    ):
        raise HandshakeError("malformed welcome")
    try:
        welcome["heartbeat_timeout"] = wire.heartbeat_timeout(welcome.get("heartbeat_timeout"))
    except (TypeError, ValueError):
        raise HandshakeError("malformed welcome (heartbeat_timeout)") from None
    # a handshake (hs) takes place only with a token
    welcome["reply_secret"] = wire.reply_secret(token, hs.transcript) if hs is not None else None  # type: ignore[arg-type]
    return welcome, tx


def open_reply_connection(
    host: str,
    port: int,
    secret: bytes | None,
    node_id: int,
    gid: int,
    timeout: float = 30.0,
    heartbeat_timeout: float = wire.DEFAULT_HEARTBEAT_TIMEOUT,
) -> tuple[socket.socket, SessionKeys | None]:
    """Open and authenticate worker ``gid``'s reply connection (see :mod:`disco_socket.wire`).

    Returns the socket and, with a token (``secret``: the node's
    :func:`~disco_socket.wire.reply_secret`), the keys the worker seals its
    replies with.
    """
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        wire.tune_socket(sock, heartbeat_timeout)
        tx = wire.transport(sock)
        hello = {"node_id": node_id, "worker": gid, "nonce": new_nonce().hex()}
        hello["auth"] = secret is not None
        data = json.dumps(hello, separators=(",", ":")).encode()
        sent = HELLO.pack(DATA_MAGIC, PROTOCOL_VERSION) + wire.U32.pack(len(data)) + data
        tx.send_parts([sent])
        challenge, raw = wire.recv_json_raw(tx)
        if "error" in challenge:
            raise HandshakeError(str(challenge["error"])[:2000])
        wire.nonce_hex(challenge.get("nonce"), "reply-connection challenge")
        if challenge.get("auth") is not (secret is not None):
            raise HandshakeError("the controller's reply-connection challenge does not match")
        keys = None
        if secret is not None:
            hs = Handshake(secret, "client", wire.LABEL + b" reply", stretch=False)
            hs.bind(sent, raw)
            wire.send_json(tx, {"proof": hs.proof().hex()})
            answer = wire.recv_json(tx)
            if "error" in answer:
                raise HandshakeError(str(answer["error"])[:2000])
            got = wire.parse_proof(answer)
            if got is None or not hs.verify(got):
                raise HandshakeError("the controller failed to authenticate a reply connection")
            keys = hs.keys()
        sock.settimeout(None)  # blocking: the worker writes to it with os.write
        return sock, keys
    except BaseException:
        sock.close()
        raise


def _key_pipe(key: bytes) -> int:
    """A pipe holding ``key`` (its read end): how a worker gets its reply key, off its argv."""
    r, w = os.pipe()
    try:
        os.write(w, key)  # 64 bytes: far below the pipe's capacity
    except BaseException:
        os.close(r)
        raise
    finally:
        os.close(w)
    return r


class WorkerProc:
    """One local worker process: a command pipe, and replies to ``reply_sock`` or a pipe.

    With ``reply_sock`` (a reply connection) the worker writes its replies to the
    controller itself, sealed under ``reply_key`` when the session has a token; the
    agent keeps no copy of the socket and watches the worker through a pipe whose
    write end only the worker holds (end of file: it exited). Without, replies
    come up the pipe ``reply_r`` for the agent to relay. The worker's stderr is the
    pipe ``err_r`` (see :class:`disco_core.channels.stderr_tee.StderrTee`).

    Workers run with ``--untrusted``: their commands crossed a socket, so they
    are in the core's tagged network format (never pickles), as their replies are.
    """

    def __init__(
        self,
        gid: int,
        num_workers: int,
        num_groups: int,
        entrypoint: str,
        env: dict,
        reply_sock: socket.socket | None = None,
        reply_key: bytes | None = None,
    ) -> None:
        self.gid = gid
        self.err_r, err_w = os.pipe()
        cmd_r, self.cmd_w = new_pipe()
        self.reply_r: int | None = None
        if reply_sock is None:
            self.reply_r, reply_w = new_pipe()
            self.watch_r = self.reply_r
            keep: tuple[int, ...] = ()
        else:
            reply_w = reply_sock.fileno()
            self.watch_r, life_w = os.pipe()
            keep = (life_w,)
        key_r = None
        if reply_sock is not None and reply_key is not None:
            key_r = _key_pipe(reply_key)
            keep = (*keep, key_r)
        argv = worker_argv(
            entrypoint, gid, num_workers, num_groups, cmd_r, reply_w,
            untrusted=True, reply_key_fd=key_r,
        )  # fmt: skip
        try:
            self.proc = spawn_worker(argv, (cmd_r, reply_w, *keep), env, err_w)
        except BaseException:
            os.close(self.err_r)
            raise
        finally:
            os.close(err_w)
            os.close(cmd_r)
            if reply_sock is None:
                os.close(reply_w)
            else:
                reply_sock.close()  # the worker's now: its exit closes the connection
            for fd in keep:
                os.close(fd)

    def exit_reason(self, wait: float = 0.0) -> str | None:
        return exit_reason(self.proc, self.gid, wait)

    def close(self, deadline: float) -> None:
        stop_worker(self.proc, self.cmd_w, deadline)


# --------------------------------------------------------------------------- module-file cache
def _make_cache(node_id: int) -> tuple[str, int]:
    """A fresh cache folder and the descriptor of its lock, held while this process lives.

    The lock file is locked under a temporary name and renamed into place, so
    :func:`remove_stale_caches` never sees it unlocked while its agent lives.
    """
    path = tempfile.mkdtemp(prefix=f"{_CACHE_PREFIX}{node_id}-")
    tmp = os.path.join(path, ".owner.tmp")
    fd = os.open(tmp, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.rename(tmp, os.path.join(path, _CACHE_LOCK))
    except BaseException:
        os.close(fd)
        shutil.rmtree(path, ignore_errors=True)
        raise
    return path, fd


def remove_stale_caches(root: str | None = None) -> list[str]:
    """Remove module-file cache folders left by agents that died (SIGKILL, crash).

    A folder is stale when its lock file is not locked: the kernel releases an
    ``flock`` when its process ends, however it ends. Only folders of this user
    are considered. Returns the removed paths.

    Parameters
    ----------
    root : str, optional
        Where the caches are (default :func:`tempfile.gettempdir`).
    """
    root = root or tempfile.gettempdir()
    try:
        names = [n for n in os.listdir(root) if n.startswith(_CACHE_PREFIX)]
    except OSError:
        return []
    removed = []
    for name in names:
        path = os.path.join(root, name)
        try:
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                continue
            fd = os.open(os.path.join(path, _CACHE_LOCK), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue  # no lock (yet): not ours to judge
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # its agent is alive
        try:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        finally:
            os.close(fd)
    return removed


_SPLICE_FLAGS = getattr(os, "SPLICE_F_MOVE", 1) | getattr(os, "SPLICE_F_MORE", 4)


class _ReplyRelay:
    """Moves reply frames from one worker's pipe to the controller's socket.

    The frame's head (prefix, lengths, header) is parsed here; its
    out-of-band buffers go from the pipe to the socket with ``splice`` (kernel to
    kernel, no copy in this process, and streaming: the worker is still writing the
    end of an array while its start is on the wire). Over TLS, or when the link is
    sealed (a token: nothing may bypass the seal), they are read into memory and
    the whole message is sent as one record.
    """

    _CHUNK = 1 << 16

    def __init__(self, fd: int, gid: int, agent: Agent, splice: bool) -> None:
        self.fd = fd
        self.tag = MSG.pack(K_FRAME, gid)
        self.agent = agent
        self.splice = splice
        self.buf = bytearray()
        self.sending = False

    def pump(self) -> None:
        """Relay every frame whose first bytes are waiting (blocks until each is whole)."""
        chunk = os.read(self.fd, self._CHUNK)  # small replies: several frames in one read
        if not chunk:
            raise EOFError("worker closed its reply pipe")
        self.buf += chunk
        while self.buf:
            self._relay_one()

    def _relay_one(self) -> None:
        # Read only the head: with splice, what follows must stay in the pipe.
        pos = 0

        def take(n: int) -> bytes:
            nonlocal pos
            self._need_exact(pos + n)
            pos += n
            return bytes(self.buf[pos - n : pos])

        hlen, lens, _ = read_frame_head(take, max_frame=wire.MAX_FRAME_BYTES)
        head_len = pos + hlen
        self._need_exact(head_len)
        total = sum(lens)
        have = min(total, len(self.buf) - head_len)
        first = bytes(self.buf[: head_len + have])
        del self.buf[: head_len + have]
        left = total - have
        agent = self.agent
        with agent.send_lock:
            self.sending = True
            tx = agent.tx
            if not left:
                tx.send_parts([self.tag + first])
            elif self.splice:
                tx.send_parts([self.tag + first])
                sfd = agent.sock.fileno()
                while left:
                    n = os.splice(self.fd, sfd, min(left, 1 << 30), flags=_SPLICE_FLAGS)
                    if not n:
                        raise EOFError("worker closed its reply pipe in the middle of a frame")
                    left -= n
            else:
                rest = bytearray(left)
                view = memoryview(rest)
                got = 0
                while got < left:
                    n = os.readv(self.fd, [view[got:]])
                    if not n:
                        raise EOFError("worker closed its reply pipe in the middle of a frame")
                    got += n
                tx.send_parts([self.tag + first, rest])
            self.sending = False

    def _need_exact(self, n: int) -> None:
        # Never read past the frame's head (the buffers may be spliced).
        while len(self.buf) < n:
            chunk = os.read(self.fd, n - len(self.buf))
            if not chunk:
                raise EOFError("worker closed its reply pipe")
            self.buf += chunk


def _meta(data: bytes) -> dict:
    """A module-file request's JSON object (``ValueError`` if malformed)."""
    try:
        meta = json.loads(data)
    except RecursionError:
        raise DiscoValueError("protocol error: a JSON message nested too deeply") from None
    if not isinstance(meta, dict):
        raise DiscoValueError("protocol error: a module-file request is not an object")
    return meta


class _ExitWatch:
    """Watches a worker that writes its replies itself: end of file when it exits."""

    sending = False

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def pump(self) -> None:
        if not os.read(self.fd, 4096):
            raise EOFError("worker exited")


class Agent:
    """Relays one node's traffic (see the module docstring)."""

    def __init__(
        self,
        sock: socket.socket,
        welcome: dict,
        peer: str,
        reply_socks: dict[int, socket.socket] | None = None,
        tx: Any = None,
        reply_keys: dict[int, SessionKeys] | None = None,
    ) -> None:
        self.sock = sock
        #: every byte to and from the controller goes through this (sealed with a token)
        self.tx = tx if tx is not None else wire.transport(sock)
        self.sealed = hasattr(self.tx, "at_boundary")
        self.peer = peer
        self.node_id = int(welcome["node_id"])
        self.ids: list[int] = welcome["worker_ids"]
        self.send_lock = threading.Lock()
        self.stopping = False
        self.bye = threading.Event()
        self._stopped = False
        self.lost: str | None = None  # why the controller is considered gone
        self._cache: str | None = None  # made on the first shipped file
        self._cache_lock = -1
        env = worker_env()
        env.pop(TOKEN_ENV, None)  # the workers never need the token
        # The controller's import path first where it exists here (same layout on
        # every node is common); then the agent's own.
        extra = [p for p in welcome.get("sys_path", []) if isinstance(p, str) and os.path.isdir(p)]
        own = env.get("DISCO_SYS_PATH", "").split(os.pathsep)
        env["DISCO_SYS_PATH"] = os.pathsep.join(dict.fromkeys([*own, *extra]))
        liveness: Any = welcome.get("liveness_timeout")
        if type(liveness) in (int, float) and 0 < liveness < 1e9:
            # the workers beat often enough for the controller's DISCO_LIVENESS_TIMEOUT
            env["DISCO_LIVENESS_TIMEOUT"] = repr(float(liveness))
        entrypoint = str(welcome.get("entrypoint") or "disco_core.worker")
        if not re.fullmatch(r"[A-Za-z_][\w.]*", entrypoint):
            raise HandshakeError(f"bad worker entry point {entrypoint!r}")
        nw, ng = int(welcome["num_workers"]), int(welcome["num_groups"])
        socks = dict(reply_socks or {})
        keys = dict(reply_keys or {})
        self.links: list[WorkerProc] = []
        try:
            for gid in self.ids:
                key = keys[gid].send if gid in keys else None
                self.links.append(
                    WorkerProc(gid, nw, ng, entrypoint, env, socks.pop(gid, None), key)
                )
        except BaseException as exc:
            for s in socks.values():
                s.close()
            for link in self.links:
                link.proc.kill()
                link.close(time.monotonic() + 1)
                os.close(link.err_r)
            error = start_failure(None, len(self.ids), exc) if isinstance(exc, OSError) else None
            if error is None:
                raise
            # out of descriptors or processes: the controller is told why, as for a
            # worker that died (its user may not see this machine's log)
            for gid in self.ids:
                report = {"reason": str(error), "stderr": ""}
                try:
                    self._send([MSG.pack(K_DIED, gid), wire.blob(json.dumps(report).encode())])
                except OSError:
                    break
            sock.close()
            raise AgentError(str(error), EXIT_LOST) from None
        self.stderr = StderrTee([link.err_r for link in self.links])
        self.queues: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in self.links]
        self.writers = [
            threading.Thread(target=self._write_loop, args=(i,), daemon=True, name=f"to-{gid}")
            for i, gid in enumerate(self.ids)
        ]
        for t in self.writers:
            t.start()
        self.replier = threading.Thread(target=self._reply_loop, daemon=True, name="replies")
        self.replier.start()
        self.heartbeat_timeout = float(welcome.get("heartbeat_timeout", 0))
        self.heartbeat: wire.Heartbeat | None = None
        if self.heartbeat_timeout > 0:
            self.heartbeat = wire.Heartbeat(
                sock,
                self.send_lock,
                self.heartbeat_timeout,
                self._silent,
                "heartbeat",
                send=self.tx.send_parts,
            ).start()

    def _silent(self, idle: float) -> None:
        """Nothing from the controller for the heartbeat timeout: give up on it."""
        if self.stopping:
            return
        self.lost = (
            f"nothing arrived from it for {idle:.1f} s (heartbeat timeout "
            f"{self.heartbeat_timeout:g} s: it is frozen, or the network is cut)"
        )
        try:  # wakes the main loop, blocked reading the connection
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    # ------------------------------------------------------------------ to the workers
    def _write_loop(self, i: int) -> None:
        q, fd = self.queues[i], self.links[i].cmd_w
        broken = False
        while True:
            item = q.get()
            if item is None:
                break
            parts = list(item)
            while len(parts) < 64:  # coalesce what is already waiting: one write
                try:
                    nxt = q.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    q.put(None)
                    break
                parts.extend(nxt)
            if broken:
                continue
            try:
                _writev_all(fd, parts)
            except OSError:
                broken = True  # the worker is gone; the reply loop reports it

    # ------------------------------------------------------------------ to the controller
    def _send(self, parts: list) -> None:
        with self.send_lock:
            self.tx.send_parts(parts)  # one record: one whole message

    def _reply_loop(self) -> None:
        sel = selectors.DefaultSelector()
        relays: dict[int, _ExitWatch | _ReplyRelay] = {}
        # splice would put bytes on the wire around the seal: only on a plain link
        splice = CAN_SPLICE and not isinstance(self.sock, ssl.SSLSocket) and not self.sealed
        for i, link in enumerate(self.links):
            if link.reply_r is None:
                relays[link.watch_r] = _ExitWatch(link.watch_r)
            else:
                relays[link.watch_r] = _ReplyRelay(link.reply_r, self.ids[i], self, splice)
            sel.register(link.watch_r, selectors.EVENT_READ, i)
        while relays:
            for key, _ in sel.select():
                relay = relays[key.fd]
                try:
                    relay.pump()
                except (EOFError, OSError) as exc:
                    if isinstance(exc, OSError) and relay.sending:
                        pass  # the connection broke; the main loop sees it
                    sel.unregister(key.fd)
                    os.close(key.fd)
                    del relays[key.fd]
                    if not self.stopping:
                        self._report_death(key.data)
        sel.close()

    def _report_death(self, i: int) -> None:
        link, gid = self.links[i], self.ids[i]
        reason = link.exit_reason(wait=1.0) or f"worker {gid} closed its reply pipe"
        if link.proc.poll() == 0:
            # A clean exit: the session's shutdown command, whose BYE follows.
            self.bye.wait(1.0)
        if not self.stopping:
            log.error("disco-socket: %s", reason)
            report = {"reason": reason, "stderr": self.stderr.tail(i, wait=0.5)}
            try:
                self._send([MSG.pack(K_DIED, gid), wire.blob(json.dumps(report).encode())])
            except OSError:
                pass

    def _answer(self, kind: int, rid: int, answer: dict) -> None:
        self._send([MSG.pack(kind, rid), wire.blob(json.dumps(answer).encode())])

    # ------------------------------------------------------------------ module files
    @property
    def cache(self) -> str:
        if self._cache is None:
            self._cache, self._cache_lock = _make_cache(self.node_id)
        return self._cache

    def _cache_path(self, meta: dict) -> str:
        name = os.path.basename(str(meta.get("name", ""))) or "module"
        if name in (".", ".."):
            name = "module"
        digest = str(meta.get("sha256", ""))
        if not re.fullmatch(r"[0-9a-f]{64}", digest):
            raise DiscoValueError("bad sha256")
        return os.path.join(self.cache, digest[:32], name)

    def _stat(self, meta: dict) -> dict:
        try:
            path, digest = str(meta["path"]), str(meta["sha256"])
            if os.path.isfile(path) and _sha256(path) == digest:
                return {"path": path, "need": False}
            target = self._cache_path(meta)
            return {"path": target, "need": not os.path.isfile(target)}
        except (OSError, KeyError, ValueError) as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}

    def _receive_file(self, reader: StreamReader, meta: dict) -> dict:
        size = int(meta.get("size", -1))
        if size < 0:
            raise EOFError("protocol error: file without a size")
        chunk = bytearray(min(size, 1 << 20) or 1)
        h = hashlib.sha256()
        error = None
        try:
            target = self._cache_path(meta)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target))
        except (OSError, ValueError) as exc:
            error, fd, tmp, target = f"{type(exc).__name__}: {exc}", -1, "", ""
        left = size
        try:
            with memoryview(chunk) as view:
                while left:  # always consume the bytes, so the stream stays in step
                    n = min(left, len(chunk))
                    reader.read_into(view[:n])
                    h.update(view[:n])
                    if fd >= 0:
                        try:
                            _writev_all(fd, [view[:n]])
                        except OSError as exc:  # a full disk: keep reading, answer the error
                            error = f"{type(exc).__name__}: {exc}"
                            os.close(fd)
                            os.unlink(tmp)
                            fd = -1
                    left -= n
            reader.settle()  # the file's last record verified
        except BaseException:  # the link broke or a record was forged: keep nothing
            if fd >= 0:
                os.close(fd)
                os.unlink(tmp)
            raise
        if fd >= 0:
            os.close(fd)
            if h.hexdigest() != meta.get("sha256"):
                os.unlink(tmp)
                error = "the file arrived corrupted (SHA-256 mismatch)"
            else:
                os.replace(tmp, target)
        if error:
            log.error("disco-socket: could not store %s: %s", meta.get("name"), error)
            return {"error": error}
        return {"path": target}

    # ------------------------------------------------------------------ main loop
    def run(self) -> int:
        reader = StreamReader(self.tx)
        settle = reader.settle  # act on a message only once its record verified
        queues = self.queues
        n = len(queues)
        code = EXIT_LOST
        try:
            while True:
                kind, arg = reader.read_msg()
                if kind == K_FRAME:
                    if arg == ALL:
                        targets: Any = range(n)
                    elif arg > n:
                        raise EOFError(f"protocol error: a command for {arg} of {n} workers")
                    else:
                        targets = struct.unpack(f"<{arg}I", reader.take(4 * arg))
                        if any(t >= n for t in targets):
                            raise EOFError("protocol error: a command for a worker not here")
                    header, buffers, flags = reader.read_frame()
                    settle()
                    item = (wire.frame_head(header, buffers, flags), *buffers)
                    for t in targets:
                        queues[t].put(item)
                elif kind == K_PING:
                    settle()  # the kernel's receive time is the heartbeat (wire.idle_seconds)
                elif kind == K_STAT:
                    meta = _meta(reader.read_blob())
                    settle()
                    self._answer(K_STAT, arg, self._stat(meta))
                elif kind == K_FILE:
                    meta = _meta(reader.read_blob())
                    settle()
                    self._answer(K_FILE, arg, self._receive_file(reader, meta))
                elif kind == K_BYE:
                    settle()
                    self.stopping = True
                    self.bye.set()
                    code = EXIT_OK
                    break
                else:
                    raise EOFError(f"protocol error: unknown message kind {kind}")
        except (EOFError, OSError, ValueError, struct.error) as exc:
            log.error(
                "disco-socket: node %d lost the controller at %s (%s); stopping its workers",
                self.node_id, self.peer, self.lost or reader.blame(exc),
            )  # fmt: skip
        except _Interrupted as exc:
            log.warning(
                "disco-socket: node %d got %s; stopping its workers", self.node_id, exc.name
            )
            code = EXIT_SIGNAL + exc.signum
        finally:
            self.stop(grace=4.0 if code == EXIT_OK else 1.0)
        return code

    def stop(self, grace: float) -> None:
        """Let the workers finish their commands (a shutdown is among them), then end them."""
        if self._stopped:
            return
        self._stopped = True
        self.stopping = True
        self.bye.set()
        if self.heartbeat is not None:
            self.heartbeat.stop()
        for q in self.queues:
            q.put(None)
        deadline = time.monotonic() + grace
        for t in self.writers:
            t.join(max(0.0, deadline - time.monotonic()))
        for link in self.links:
            link.close(deadline)  # EOF on the command pipe, wait, kill laggards
        self.replier.join(max(0.1, deadline - time.monotonic()))
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self.stderr.thread.join(max(0.1, deadline - time.monotonic()))  # the last words
        if self._cache is not None:
            shutil.rmtree(self._cache, ignore_errors=True)
            os.close(self._cache_lock)


def client_ssl_context(
    ca: str | None = None, cert: str | None = None, key: str | None = None
) -> ssl.SSLContext:
    """A TLS client context: verify the controller against ``ca`` (system CAs when None)."""
    ctx = ssl.create_default_context(cafile=ca)
    if cert:
        ctx.load_cert_chain(cert, key)
    return ctx


def run_agent(
    host: str,
    port: int,
    workers: int,
    token: str | bytes | None = None,
    connect_timeout: float = 60.0,
    retry_interval: float = 0.2,
    ssl_context: ssl.SSLContext | None = None,
    server_hostname: str | None = None,
) -> int:
    """Join the session at ``host:port`` with ``workers`` workers; return the exit code.

    In the main thread, SIGINT (Ctrl-C), SIGTERM and SIGHUP stop the workers and
    return ``EXIT_SIGNAL + signum`` after one log line (no traceback).
    """
    if workers < 1:
        raise DiscoValueError("workers must be >= 1")
    key = resolve_token(token)
    for path in remove_stale_caches():
        log.info("disco-socket: removed %s, left behind by an agent that died", path)
    state: dict[str, Any] = {"agent": None, "fired": False}

    def on_signal(signum: int, frame: Any) -> None:
        agent = state["agent"]
        if state["fired"] or (agent is not None and agent.stopping):
            return  # already stopping, within a bounded time
        state["fired"] = True
        raise _Interrupted(signum)

    previous = _install_handlers(on_signal)
    try:
        try:
            state["agent"] = _join(
                host, port, workers, key, connect_timeout, retry_interval, ssl_context,
                server_hostname,
            )  # fmt: skip
        except AgentError as exc:
            log.error("disco-socket: %s", exc)
            return exc.code
        except _Interrupted as exc:
            log.warning("disco-socket: got %s before joining %s:%d; exiting", exc.name, host, port)
            return EXIT_SIGNAL + exc.signum
        agent = state["agent"]
        try:
            return agent.run()
        except BaseException:
            agent.stop(grace=0.5)
            raise
    finally:
        _restore_handlers(previous)


_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _install_handlers(handler: Any) -> dict:
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, handler) for sig in _SIGNALS}


def _restore_handlers(previous: dict) -> None:
    for sig, old in previous.items():
        signal.signal(sig, old)


def _join(
    host: str,
    port: int,
    workers: int,
    key: bytes | None,
    connect_timeout: float,
    retry_interval: float,
    ssl_context: ssl.SSLContext | None,
    server_hostname: str | None,
) -> Agent:
    """Connect, authenticate, open the reply connections and start the workers."""
    if key is None and ssl_context is None and not is_loopback(host):
        log.warning(
            "disco-socket: joining %s:%d with neither a token nor TLS: anyone on the path "
            "can run code on this node (set DISCO_TOKEN to the session's token)", host, port,
        )  # fmt: skip
    sock = connect(host, port, connect_timeout, retry_interval, ssl_context, server_hostname)
    try:
        welcome, tx = handshake(sock, key, workers)
    except (HandshakeError, OSError, ValueError) as exc:
        sock.close()
        raise AgentError(
            f"the handshake with the controller at {host}:{port} failed: {exc}", EXIT_REFUSED
        ) from None
    except BaseException:
        sock.close()
        raise
    beat = welcome["heartbeat_timeout"]
    wire.tune_socket(sock, beat)
    reply_socks: dict[int, socket.socket] = {}
    reply_keys: dict[int, SessionKeys] = {}
    try:
        if welcome.get("direct") and ssl_context is None:
            for gid in welcome["worker_ids"]:
                reply_socks[gid], keys = open_reply_connection(
                    host, port, welcome["reply_secret"], int(welcome["node_id"]), gid,
                    heartbeat_timeout=beat,
                )  # fmt: skip
                if keys is not None:
                    reply_keys[gid] = keys
    except BaseException as exc:
        for s in [sock, *reply_socks.values()]:
            s.close()
        if isinstance(exc, (HandshakeError, OSError, ValueError)):
            raise AgentError(
                f"the controller at {host}:{port} refused a reply connection: {exc}",
                EXIT_REFUSED,
            ) from None
        raise
    sock.settimeout(None)
    log.info(
        "disco-socket: joined %s:%d as node %s (workers %s%s)",
        host, port, welcome["node_id"], welcome["worker_ids"],
        ", direct replies" if reply_socks else "",
    )  # fmt: skip
    return Agent(sock, welcome, f"{host}:{port}", reply_socks, tx, reply_keys)
