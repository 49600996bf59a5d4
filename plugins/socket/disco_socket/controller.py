"""The controller side of the ``socket`` channel: :class:`SocketChannel` and :class:`NodeLink`.

Worker 0 is a thread of the controller's process, the controller's node's other
workers are child processes (the core's own :class:`ProcessWorkerLink`), and each
remote node is one :class:`NodeLink`: a TCP (optionally TLS) connection to a node
agent that relays every command to that node's workers and every reply back.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import heapq
import ipaddress
import json
import logging
import os
import queue
import select
import socket
import ssl
import struct
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from disco_core import (
    DiscoError,
    DiscoTimeoutError,
    DiscoTypeError,
    DiscoValueError,
    NetworkError,
    WorkerDiedError,
    WorkerError,
)
from disco_core.spi import (
    AcceptLoop,
    BatchingLink,
    Drain,
    Handshake,
    LinkChannel,
    Outgoing,
    ProcessWorkerLink,
    ReaderGate,
    ReplyHub,
    ReplyReader,
    SessionKeys,
    SocketHandshake,
    StderrTee,
    ThreadWorkerLink,
    WorkerLink,
    check_bind,
    check_untrusted,
    decode_untrusted,
    frame_head,
    listen_family,
    liveness_timeout,
    new_nonce,
    resolve_token,
    start_timeout,
    start_worker_processes,
    stretch_token,
    worker_env,
)
from disco_core.spi import accept as _accept
from disco_core.spi import protocol as P

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

__all__ = ["SocketChannel", "NodeLink", "DEFAULT_TIMEOUT"]

log = logging.getLogger("disco_socket")

#: Seconds the controller waits for every node to join (the ``timeout`` option).
DEFAULT_TIMEOUT = 60.0
#: Seconds one connection may take to complete its handshake.
HANDSHAKE_TIMEOUT = 10.0
#: Seconds of waiting for nodes after which a WARNING says what to run on them.
WAIT_NOTICE_DELAY = 3.0
#: Seconds a connection that arrives after every node joined may take to be told so.
_LATE_TIMEOUT = 2.0
#: The core's built-in function that loads module files (intercepted to ship the file).
_LOAD_MODULE = "disco.load_module"


def _loads(data: bytes) -> Any:
    """A JSON message from the agent (``ValueError`` if malformed, however deeply nested)."""
    try:
        return json.loads(data.decode(errors="replace"))
    except RecursionError:
        raise DiscoValueError("protocol error: a JSON message nested too deeply") from None


def _span(ids: Sequence[int]) -> str:
    return f"{ids[0]}-{ids[-1]}" if len(ids) > 1 else str(ids[0])


def reachable_host(host: str) -> str:
    """An address other machines can use for a controller listening on ``host``.

    ``host`` itself, unless it is a wildcard (``0.0.0.0``, ``::``): then this
    machine's primary address (the source address of its default route), else its
    hostname.
    """
    try:
        if not ipaddress.ip_address(host).is_unspecified:
            return host
    except ValueError:
        return host
    v6 = ":" in host
    # A documentation address: connecting a UDP socket only looks the route up; nothing is sent.
    probe = ("2001:db8::1", 9) if v6 else ("192.0.2.1", 9)
    try:
        with socket.socket(socket.AF_INET6 if v6 else socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(probe)
            ip = ipaddress.ip_address(s.getsockname()[0])
        if not (ip.is_loopback or ip.is_unspecified):
            return str(ip)
    except (OSError, ValueError):
        pass
    return socket.gethostname()


def _held(reader: StreamReader | None, tx: Any, sock: socket.socket) -> bool:
    """True when bytes from ``sock`` wait above the kernel (in ``reader``, the seal, TLS)."""
    if reader is not None and reader.has_buffered():
        return True
    if getattr(tx, "pending", 0):
        return True
    return isinstance(sock, ssl.SSLSocket) and sock.pending() > 0


def _wait_readable(sock: socket.socket, reader: StreamReader, tx: Any) -> None:
    """Block until a message can be read: bytes in the kernel, or already held above it."""
    if not _held(reader, tx, sock):
        select.select([sock], [], [])


class NodeLink(BatchingLink):
    """The controller's connection to one remote node and, through it, to its workers.

    One reader thread per node receives what the agent sends (relayed replies
    tagged with their global worker id, death reports, module-file answers) and
    hands replies to the :class:`ReplyHub`; a closed connection marks every worker
    of the node dead at once. With reply connections (``data``: global worker id
    -> socket), each worker's replies arrive on its own connection, written there
    by the worker itself, and one more thread per worker receives them straight
    into their arrays' memory.
    """

    hub: ReplyHub  # set before the reader thread starts
    untrusted = True  # the agent's workers rebuild commands with decode_untrusted

    def __init__(
        self,
        node_id: int,
        sock: socket.socket,
        peer: str,
        worker_ids: Sequence[int],
        hub: ReplyHub,
        info: dict,
        data: dict[int, socket.socket] | None = None,
        heartbeat_timeout: float = wire.DEFAULT_HEARTBEAT_TIMEOUT,
        tx: Any = None,
        data_keys: dict[int, SessionKeys] | None = None,
    ) -> None:
        super().__init__()
        self.node_id = node_id
        self.sock = sock
        #: every byte to and from the node goes through this (sealed with a token)
        self.tx = tx if tx is not None else wire.transport(sock)
        self.data_keys = dict(data_keys or {})
        self.peer = peer
        self.worker_ids = tuple(worker_ids)
        self.first = self.worker_ids[0]
        self.hub = hub
        self.info = info
        self.dead_reason: str | None = None
        #: True once the heartbeat gave up on the silent node; its workers then
        #: stopped answering, whichever reader marks them first
        self.silent = False
        self._requests: dict[int, queue.SimpleQueue] = {}
        self._next_request = 1
        self._staged: dict[tuple[str, str], str] = {}
        self.reader = threading.Thread(
            target=self._read_loop, name=f"disco-socket-node{node_id}", daemon=True
        )
        self.data = dict(data or {})
        self.data_readers = [
            threading.Thread(
                target=self._data_loop, args=(gid, conn), name=f"disco-socket-w{gid}", daemon=True
            )
            for gid, conn in self.data.items()
        ]
        #: one per reader thread ("node", and each reply connection's worker id)
        self.gates: dict[Any, ReaderGate] = {}
        self.heartbeat_timeout = heartbeat_timeout
        self.heartbeat: wire.Heartbeat | None = None
        if heartbeat_timeout > 0:
            self.heartbeat = wire.Heartbeat(
                sock,
                self.lock,
                heartbeat_timeout,
                self._silent,
                f"disco-socket-beat{node_id}",
                send=self.tx.send_parts,
            )
        tx = self.tx
        self.gates["node"] = ReaderGate()
        self.gates["node"].add(sock.fileno(), lambda: _held(self._node_reader, tx, sock))
        self._node_reader: StreamReader | None = None
        self._streams: dict[int, tuple[StreamReader, Any]] = {}
        for gid, conn in self.data.items():
            self.gates[gid] = ReaderGate()
            self.gates[gid].add(conn.fileno(), functools.partial(self._data_held, gid, conn))
        self.reader.start()
        for t in self.data_readers:
            t.start()
        if self.heartbeat is not None:
            self.heartbeat.start()

    def _data_held(self, gid: int, conn: socket.socket) -> bool:
        stream = self._streams.get(gid)
        return stream is not None and _held(stream[0], stream[1], conn)

    heartbeats = True  # each worker's own, relayed by the agent or on its reply connection

    def input_fd(self, worker_id: int) -> int | None:
        conn = self.data.get(worker_id, self.sock)
        try:
            return conn.fileno()
        except OSError:
            return None

    def describe(self) -> str:
        return f"node {self.node_id} ({self.peer}, workers {_span(self.worker_ids)})"

    def __repr__(self) -> str:
        return f"<NodeLink {self.describe()}>"

    # ------------------------------------------------------------------ sending
    def _route(self, targets: Sequence[int] | None) -> bytes:
        if targets is None or len(targets) == len(self.worker_ids):
            return MSG.pack(K_FRAME, ALL)
        first = self.first
        return MSG.pack(K_FRAME, len(targets)) + struct.pack(
            f"<{len(targets)}I", *[w - first for w in targets]
        )

    def send(self, out: Outgoing) -> None:
        self.send_to(out, None)

    def send_to(self, out: Outgoing, targets: Sequence[int] | None) -> None:
        """Send ``out`` to the node's workers ``targets`` (global ids; None: all of them)."""
        frame = out.wire_frame  # the network format: the workers unpickle nothing
        self.send_head(self._route(targets) + frame_head(frame, out.flags), frame[1])

    def _write(self, data: bytes) -> None:
        self.tx.send_parts([data])  # one record: a batch of whole messages

    def _write_views(self, head: bytes, buffers: Sequence[Any]) -> None:
        self.tx.send_parts([head, *buffers])  # one record: one whole message

    def _died(self, exc: BaseException) -> WorkerDiedError:
        if self.dead_reason is None:
            self.reader.join(0.5)  # the reader usually knows better why
        reason = self.dead_reason or f"{self.describe()} connection broke: {exc}"
        return WorkerDiedError(self.worker_ids, reason)

    # ------------------------------------------------------------------ module files
    def _request(self, kind: int, meta: dict, payload: Callable[[], None] | None = None) -> int:
        with self.lock:
            rid = self._next_request
            self._next_request += 1
            self._requests[rid] = queue.SimpleQueue()
            self._flush_locked()
            self.tx.send_parts([MSG.pack(kind, rid) + wire.blob(json.dumps(meta).encode())])
            if payload is not None:
                payload()
        return rid

    def _answer(self, rid: int, timeout: float) -> dict:
        q = self._requests[rid]
        deadline = time.monotonic() + timeout
        try:
            while True:
                if self.dead_reason:
                    raise WorkerDiedError(self.worker_ids, self.dead_reason)
                try:
                    return q.get(timeout=0.2)
                except queue.Empty:
                    if time.monotonic() > deadline:
                        raise DiscoTimeoutError(
                            f"{self.describe()} did not answer a module-file request "
                            f"within {timeout:.0f} s"
                        ) from None
        finally:
            self._requests.pop(rid, None)

    def stage_file(self, path: str, sha256: str, size: int, timeout: float = 60.0) -> str:
        """Make the module file ``path`` available on the node; return its path there.

        The node keeps its own copy when it has the same file (same path, same
        SHA-256); otherwise the controller ships the bytes once, into the agent's
        cache folder.
        """
        key = (path, sha256)
        staged = self._staged.get(key)
        if staged is not None:
            return staged
        meta = {"path": path, "sha256": sha256, "size": size, "name": os.path.basename(path)}
        try:
            answer = self._answer(self._request(K_STAT, meta), timeout)
            if answer.get("need"):

                def payload() -> None:
                    self._send_file(path, size)

                answer = self._answer(self._request(K_FILE, meta, payload), timeout)
        except OSError as exc:
            raise self._died(exc) from None
        if answer.get("error"):
            raise DiscoError(f"{self.describe()} could not store {path}: {answer['error']}")
        staged = str(answer["path"])
        self._staged[key] = staged
        return staged

    def _send_file(self, path: str, size: int) -> None:
        """The bytes of a module file, after its ``FILE`` message (sealed with a token).

        Unsealed, the kernel sends the file (``sendfile``); sealed, it goes in
        records of at most 1 MiB, each checked by the agent as it arrives (and
        the whole file against its SHA-256, which travelled sealed).
        """
        with open(path, "rb") as f:
            sent = self.tx.sendfile(f, size)
            if sent:
                return
            left = size
            chunk = bytearray(min(size, 1 << 20) or 1)
            with memoryview(chunk) as view:
                while left:
                    n = f.readinto(view[: min(left, len(chunk))])
                    if not n:
                        raise NetworkError(  # out of step with the node: it dies
                            f"{path} shrank while it was being sent"
                        )
                    self.tx.send_parts([view[:n]])
                    left -= n

    # ------------------------------------------------------------------ receiving
    def _deliver(self, gid: int, header: bytes, buffers: list) -> None:
        # Bytes from a socket are never unpickled: the workers reply in the core's
        # tagged network format, which makes plain values, arrays, dtypes, devices
        # and worker errors only.
        try:
            msg = decode_untrusted(header, buffers)
        except Exception as exc:  # noqa: BLE001 - a reply this process does not accept
            msg = (
                "fail",
                WorkerError(
                    gid,
                    type(exc).__name__,
                    f"the worker's reply was refused by the controller: {exc}",
                ),
            )
        self.hub.deliver(gid, msg)

    def _data_loop(self, gid: int, conn: socket.socket) -> None:
        """Replies of worker ``gid`` from its own (authenticated) reply connection."""
        tx: Any = wire.transport(conn)
        keys = self.data_keys.get(gid)
        if keys is not None:
            tx = wire.seal(tx, keys)  # the worker seals every reply frame itself
        reader = StreamReader(tx)
        self._streams[gid] = (reader, tx)
        hub = self.hub
        gate = self.gates[gid]
        try:
            while True:
                _wait_readable(conn, reader, tx)
                with gate.lock:  # the channel's settle() waits for the delivery
                    header, buffers, _ = reader.read_frame()
                    reader.settle()
                    self._deliver(gid, header, buffers)
        except Exception as exc:  # noqa: BLE001 - whatever stops this reader ends the link
            # (a MemoryError for a declared size, a malformed message...): a reader thread
            # that died silently left its callers waiting for good (outside check)
            exc = reader.blame(exc)
            gate.remove(conn.fileno())
            if hub.closing:
                return
            # The worker exited (its agent reports why) or the node went away (the
            # node's connection says so): give those better reasons a moment.
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline and not hub.closing:
                if gid in hub.dead or self.dead_reason is not None:
                    break
                time.sleep(0.02)
            if self.dead_reason is not None:
                # The node is gone, and all its workers with it. Name them all here too:
                # the node's reader may set the reason a moment before it marks them, and
                # a waiter woken by this worker alone would name only this one.
                self._mark_node_dead()
                return
            hub.mark_dead(
                [gid], f"worker {gid}'s reply connection closed ({exc}) (on {self.describe()})"
            )

    def _read_loop(self) -> None:
        reader = self._node_reader = StreamReader(self.tx)
        settle = reader.settle  # act on a message only once its record verified
        hub = self.hub
        ids = set(self.worker_ids)
        gate = self.gates["node"]
        try:
            while True:
                _wait_readable(self.sock, reader, self.tx)
                with gate.lock:  # the channel's settle() waits for the delivery
                    self._read_one(reader, settle, hub, ids)
        except Exception as exc:  # noqa: BLE001 - whatever stops this reader ends the link
            exc = reader.blame(exc)
            gate.remove(self.sock.fileno())
            if isinstance(exc, EOFError) and str(exc) == "connection closed":
                what = "disconnected (the node agent exited or its machine went away)"
            else:
                what = f"disconnected: {exc}"
            if self.dead_reason is None:  # else the heartbeat gave up on it first
                self.dead_reason = f"{self.describe()} {what}"
                if not hub.closing:
                    log.error("disco-socket: %s", self.dead_reason)
            if not hub.closing:
                self._mark_node_dead()

    def _mark_node_dead(self) -> None:
        """Mark every worker of the node dead for :attr:`dead_reason` (unresponsive when
        the node fell silent, whichever reader gets here first)."""
        reason = self.dead_reason or f"{self.describe()} is gone"  # (set by every caller)
        self.hub.mark_dead(self.worker_ids, reason, unresponsive=self.silent)

    def _read_one(self, reader: StreamReader, settle: Any, hub: ReplyHub, ids: set) -> None:
        """Read one message from the node and act on it."""
        kind, arg = reader.read_msg()
        if kind == K_FRAME:
            if arg not in ids or arg in self.data:
                raise EOFError(f"protocol error: a reply tagged worker {arg}")
            header, buffers, _ = reader.read_frame()
            settle()
            self._deliver(arg, header, buffers)
        elif kind == K_PING:
            settle()  # the kernel's receive time is the heartbeat (wire.idle_seconds)
        elif kind == K_DIED:
            report = _loads(reader.read_blob())
            settle()
            if arg in ids and not hub.closing:
                hub.mark_dead([arg], self._death_reason(report))
        elif kind in (K_STAT, K_FILE):
            answer = _loads(reader.read_blob())
            settle()
            if not isinstance(answer, dict):
                raise DiscoValueError("protocol error: a module-file answer is not an object")
            q = self._requests.get(arg)
            if q is not None:
                q.put(answer)
        else:
            raise EOFError(f"protocol error: unknown message kind {kind}")

    def _death_reason(self, report: Any) -> str:
        """The text of a worker death report: why, where, and the end of its stderr."""
        if not isinstance(report, dict):
            report = {}
        text = f"{report.get('reason') or 'a worker died'} (on {self.describe()})"
        tail = report.get("stderr")
        if isinstance(tail, str) and tail.strip():
            text += "; the end of its stderr:\n" + tail.rstrip()
        return text

    def _silent(self, idle: float) -> None:
        """The heartbeat heard nothing for too long: the node is dead to this session."""
        if self.hub.closing or self.dead_reason is not None:
            return
        self.silent = True  # (before the reason: a reader that sees the reason sees this)
        self.dead_reason = (
            f"{self.describe()} stopped responding: nothing arrived from it for {idle:.1f} s "
            f"(heartbeat timeout {self.heartbeat_timeout:g} s; the node is frozen or "
            "overloaded, its machine went away, or the network between them is cut)"
        )
        paused = self.heartbeat.paused_for if self.heartbeat is not None else 0.0
        if paused > self.heartbeat_timeout / 2:
            self.dead_reason += (
                f"; but this controller itself did not run for {paused:.1f} s (stopped or "
                "suspended), and a node agent gives up on a controller that is silent for "
                "the heartbeat timeout"
            )
        log.error("disco-socket: %s", self.dead_reason)
        # silent, not known dead: WorkerUnresponsiveError ("stopped answering"), as a
        # silent worker is (outside chaos check: a frozen node read "died")
        self._mark_node_dead()
        self.kill()  # unblocks any send stuck on the dead connection

    def report_silence(self, worker_ids: Sequence[int], timeout: float) -> bool:
        """Workers of this node are silent: when the node's own connection has been as
        silent, the node is what froze (their heartbeats come through it when replies
        are relayed), and it is reported as the node, as the heartbeat would (a chaos
        check: with equal timeouts the workers were named 7 times in 12)."""
        if self.dead_reason is not None:
            return True  # reported already: its workers are being marked
        if self.heartbeat is None:
            return False  # no pings: a quiet connection is no sign of a frozen node
        try:
            idle = wire.idle_seconds(self.sock)
        except OSError:
            return False
        if idle is None or idle <= timeout:
            return False
        self._silent(idle)
        return True

    def poll(self) -> str | None:
        return self.dead_reason

    def close(self, deadline: float) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()  # no ping after BYE; a slow shutdown is no death
        try:
            with self.lock:
                self._flush_locked()
                self.tx.send_parts([MSG.pack(K_BYE, 0)])
        except OSError:
            pass
        # The agent stops its workers, then closes the connection.
        self.reader.join(max(0.0, deadline - time.monotonic()))
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.reader.join(1.0)
        self.sock.close()
        self._close_data(max(0.1, deadline - time.monotonic()))

    def _close_data(self, wait: float) -> None:
        # The workers close their reply connections when they exit.
        end = time.monotonic() + wait
        for t in self.data_readers:
            t.join(max(0.0, end - time.monotonic()))
        for conn in self.data.values():
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in self.data_readers:
            t.join(1.0)
        for conn in self.data.values():
            conn.close()

    def kill(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
        for conn in [self.sock, *self.data.values()]:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class _PendingNode:
    """A node between its welcome and the arrival of all its reply connections.

    ``secret`` is :func:`~disco_socket.wire.reply_secret` of the node's handshake
    (None without a token); ``keys`` the record keys of each reply connection;
    ``conn``, ``tx`` and ``info`` the node's own connection, waiting for its
    :class:`NodeLink`; ``deadline`` when the node is dropped if they have not all
    arrived. Only the accept loop's thread touches it.
    """

    def __init__(self, secret: bytes | None, ids: set[int], peer: str, conn: socket.socket, tx: Any, info: dict, deadline: float) -> None:  # fmt: skip
        self.secret = secret
        self.ids = ids
        self.peer = peer
        self.conn = conn
        self.tx = tx
        self.info = info
        self.deadline = deadline
        self.socks: dict[int, socket.socket] = {}
        self.keys: dict[int, SessionKeys] = {}

    def close_replies(self) -> None:
        """Close the reply connections that arrived."""
        for sock in self.socks.values():
            sock.close()
        self.socks.clear()

    def close(self) -> None:
        """Close the node's connection and its reply connections."""
        self.close_replies()
        try:
            self.conn.close()
        except OSError:
            pass


class _Hello:
    """The controller's side of one handshake, as a step machine that never blocks.

    :class:`~disco_core.spi.SocketHandshake` feeds it exactly :attr:`want` bytes
    at a time from a non-blocking socket (after a non-blocking TLS handshake) and
    sends what :meth:`step` returns (a few hundred bytes at most). It reads the
    fixed hello, then the JSON hello (at most :data:`~disco_socket.wire.MAX_HANDSHAKE_BYTES`),
    answers with the challenge and, with a token, checks the peer's proof and
    sends its own; see :mod:`disco_socket.wire` for the messages.

    When it is over (``want == 0``), ``ok`` is True and either ``failure`` is
    None (the peer authenticated: ``kind`` is ``"node"`` or ``"data"``,
    ``hello`` its JSON hello, ``keys`` the record keys with a token) or
    ``failure`` says why the peer was refused after a JSON error was sent (the
    connection is then closed politely). A peer refused without an answer makes
    :meth:`step` raise :class:`~disco_socket.wire.HandshakeError` (kept in
    ``failure``).
    """

    def __init__(self, channel: SocketChannel, peer: str) -> None:
        self.ch = channel
        self.peer = peer
        self.want = HELLO.size
        self.ok = False
        self.failure: str | None = None
        self.kind = "node"
        self.late = False
        self.hello: dict = {}
        self.hs: Handshake | None = None
        self.keys: SessionKeys | None = None
        self.pending: _PendingNode | None = None
        self._head = b""
        self._raw = b""
        self._len = b""
        self._then: Callable[[bytes], bytes] = self._on_magic
        self._next: Callable[[bytes], bytes] = self._on_magic

    # -- the machine -------------------------------------------------------------
    def step(self, data: bytes) -> bytes:
        """Consume exactly :attr:`want` bytes; return what to send back."""
        try:
            return self._then(data)
        except HandshakeError as exc:
            self.failure = str(exc)
            self.want = 0
            raise
        except Exception as exc:  # noqa: BLE001 - whatever it sent, it is dropped
            self.failure = f"malformed handshake ({type(exc).__name__}: {exc})"
            self.want = 0
            raise HandshakeError(self.failure) from None

    def _message(self, then: Callable[[bytes], bytes]) -> None:
        """Read one ``u32 length | JSON`` message next, then call ``then(body)``."""
        self.want = 4
        self._then = self._on_length
        self._next = then

    def _on_length(self, data: bytes) -> bytes:
        (n,) = wire.U32.unpack(data)
        if n > wire.MAX_HANDSHAKE_BYTES:
            raise HandshakeError(
                f"handshake message too large ({n} bytes, at most {wire.MAX_HANDSHAKE_BYTES})"
            )
        self._len = data
        if n == 0:  # not JSON: refused below, as any malformed message
            return self._next(b"")
        self.want = n
        self._then = self._next
        return b""

    def _done(self, out: bytes = b"") -> bytes:
        self.want = 0
        self.ok = True
        return out

    def _refuse(self, reason: str, error: str | None = None) -> bytes:
        """Refuse the peer: ``error`` is sent (as ``{"error": ...}``), ``reason`` kept."""
        self.failure = reason
        return self._done(wire.json_message({"error": error if error is not None else reason}))

    # -- the node's hello ----------------------------------------------------------
    def _on_magic(self, data: bytes) -> bytes:
        self._head = data
        magic, version = HELLO.unpack(data)
        ch = self.ch
        # A session with a token says it is full only to a node that proved the token
        # (in _admit): a peer without it learns nothing (an attacker check found the
        # number of nodes told to anyone).
        if ch._full and ch._token is None:
            if magic != MAGIC:
                raise HandshakeError("a late connection that is not a node agent")
            self.late = True
            self._message(self._on_late_hello)  # read it, so the answer is not reset away
            return b""
        if magic == DATA_MAGIC and ch._direct_replies and version == PROTOCOL_VERSION:
            self.kind = "data"
            self._message(self._on_data_hello)
            return b""
        if magic not in (MAGIC, DATA_MAGIC):
            raise HandshakeError("not a disco-socket node agent (bad magic bytes)")
        if magic == DATA_MAGIC and version == PROTOCOL_VERSION:
            return self._refuse(
                "a reply connection, but this session relays replies",
                "this session takes no reply connections",
            )
        if version != PROTOCOL_VERSION:
            return self._refuse(
                f"protocol version mismatch: the controller speaks disco-socket protocol "
                f"{PROTOCOL_VERSION}, the node speaks {version}; install the same "
                "disco-socket version on every node"
            )
        self._message(self._on_node_hello)
        return b""

    def _on_late_hello(self, data: bytes) -> bytes:
        wire.parse_json(data)
        return self._refuse(self.ch._late_reason())

    def _on_node_hello(self, data: bytes) -> bytes:
        hello = self.hello = wire.parse_json(data)
        raw = self._len + data
        wire.nonce_hex(hello.get("nonce"), "hello")
        token = self.ch._token
        node_auth = hello.get("auth")
        if token is not None and node_auth is not True:
            return self._refuse(
                "authentication failed: this session requires a token and the node has "
                "none (give it the session's token in DISCO_TOKEN)"
            )
        if token is None and node_auth is not False:
            return self._refuse(
                "the node has a token but this session has none (start the session "
                "with the same token=, or DISCO_TOKEN)"
            )
        sent = wire.json_message(
            {"version": PROTOCOL_VERSION, "nonce": new_nonce().hex(), "auth": token is not None}
        )
        if token is None:
            return self._done(sent)
        self.hs = Handshake(token, "server", wire.LABEL)
        self.hs.bind(self._head + raw, sent)
        self._message(self._on_node_proof)
        return sent

    def _on_node_proof(self, data: bytes) -> bytes:
        hs = self.hs
        assert hs is not None
        got = wire.parse_proof(wire.parse_json(data))
        if got is None or not hs.verify(got):
            return self._refuse(
                "authentication failed (wrong token)",
                "authentication failed: the node's token differs from the controller's "
                "(use the same --token or DISCO_TOKEN everywhere)",
            )
        self.keys = hs.keys()
        return self._done(wire.json_message({"proof": hs.proof().hex()}))

    # -- a reply connection --------------------------------------------------------
    def _on_data_hello(self, data: bytes) -> bytes:
        """Only JSON is read: the peer must name a node whose handshake is under way
        and one of its workers not yet connected, and, with a token, prove it holds
        that node's :func:`~disco_socket.wire.reply_secret`."""
        hello = self.hello = wire.parse_json(data)
        raw = self._len + data
        node_id, gid = hello.get("node_id"), hello.get("worker")
        wire.nonce_hex(hello.get("nonce"), "reply-connection hello")
        ch = self.ch
        with ch._ids_lock:
            pending = ch._pending.get(node_id) if type(node_id) is int else None
        if pending is None or type(gid) is not int or gid not in pending.ids or gid in pending.socks:  # fmt: skip
            return self._refuse(
                f"an unexpected reply connection (node {node_id!r}, worker {gid!r})",
                "unexpected reply connection",
            )
        if hello.get("auth") is not (pending.secret is not None):
            return self._refuse(
                "a reply connection that does not match its node's auth", "authentication failed"
            )
        self.pending = pending
        sent = wire.json_message({"nonce": new_nonce().hex(), "auth": pending.secret is not None})
        if pending.secret is None:
            return self._done(sent)
        self.hs = Handshake(pending.secret, "server", wire.LABEL + b" reply", stretch=False)
        self.hs.bind(self._head + raw, sent)
        self._message(self._on_data_proof)
        return sent

    def _on_data_proof(self, data: bytes) -> bytes:
        hs = self.hs
        assert hs is not None
        got = wire.parse_proof(wire.parse_json(data))
        if got is None or not hs.verify(got):
            return self._refuse(
                "authentication failed on a reply connection (wrong proof)",
                "authentication failed",
            )
        self.keys = hs.keys()
        return self._done(wire.json_message({"proof": hs.proof().hex()}))


class _Pending(SocketHandshake):
    """A connection in its handshake: a :class:`_Hello` over a non-blocking socket.

    Closed before it was handed on (refused without an answer, closed by the
    peer, past its deadline, or dropped to make room for newer ones), it leaves
    its reason in the channel's :attr:`SocketChannel.rejected`.
    """

    def __init__(self, sock: socket.socket, addr: Any, machine: _Hello, ssl_context: ssl.SSLContext | None, channel: SocketChannel) -> None:  # fmt: skip
        super().__init__(sock, addr, machine, ssl_context)
        self.channel = channel
        self.handed = False
        self.deadline = time.monotonic() + channel._handshake_timeout

    def close(self) -> None:
        if not self.handed:
            self.handed = True
            m: _Hello = self.machine  # type: ignore[assignment]
            if m.failure is not None:
                if m.late:
                    log.warning("disco-socket: dropped a late connection from %s: %s", m.peer, m.failure)  # fmt: skip
                else:
                    self.channel._reject(m.peer, m.failure)
            elif not self.channel._full:
                why = (
                    f"no complete handshake within {self.channel._handshake_timeout:g} s"
                    if time.monotonic() >= self.deadline
                    else "the connection closed (or was dropped) during the handshake"
                )
                self.channel._reject(m.peer, why, quiet=True)
        super().close()


class SocketChannel(LinkChannel):
    """Workers on several machines; node 0 is the controller's own.

    Parameters
    ----------
    num_nodes : int
        Machines, the controller's included.
    num_workers_per_node : int
        Workers on every machine. Global worker ids are node-major: node ``k`` holds
        workers ``k * per_node`` .. ``k * per_node + per_node - 1``.
    num_groups : int
        Worker groups.
    host, port
        Where to listen for node agents (``port=0``: any free port; see ``address``).
    token : str or bytes, optional
        The shared secret (default ``$DISCO_TOKEN``; empty means none). With a
        token, every node proves it holds it, the controller proves it back, and
        every byte after the handshake is a sealed record (see the README's threat
        model). Without one, a loopback session warns once and a session beyond
        loopback is refused (:class:`~disco_core.errors.InsecureBindError`) unless
        it has TLS or ``allow_insecure_bind``.
    ssl_context : ssl.SSLContext, optional
        A server-side TLS context; the agents then need ``--tls-ca`` (and, for mutual
        TLS, ``--tls-cert/--tls-key``).
    allow_insecure_bind : bool
        Listen beyond loopback with neither a token nor TLS that requires client certificates (a warning): anyone who
        reaches the port can run code on every node. For trusted networks only.
    timeout : float
        Seconds to wait for every node to join (default 60); then ``TimeoutError``.
    on_listen : callable, optional
        ``on_listen(host, port)`` is called once the controller listens (to start
        the agents, e.g. with :func:`disco_socket.start_local_agents`). It runs on
        this thread before any node is admitted: it must return at once (start the
        agents, do not wait for them), or their handshakes time out.
    entrypoint : str
        The worker module every node starts (``python -m <entrypoint>``).
    ship_modules : bool
        Ship ``load_vm_module`` files to nodes that do not have them (default True).
    handshake_timeout : float
        Seconds one connection may take to authenticate.
    direct_replies : bool
        Without TLS (default True): every remote worker writes its replies to its
        own authenticated connection to the controller, instead of through its
        agent. With TLS, replies are always relayed over the node's TLS connection
        (a worker writes plain bytes to its file descriptor; it cannot speak TLS).
    heartbeat_timeout : float, optional
        Seconds without a byte from a node after which it is declared dead
        (``WorkerDiedError`` naming it); its agent likewise exits when the
        controller is silent this long. Default ``$DISCO_HEARTBEAT_TIMEOUT``, else 5;
        0 turns heartbeats off. Pings go every ``min(1, timeout / 5)`` seconds.
    """

    kind = "socket"

    def __init__(
        self,
        num_nodes: int,
        num_workers_per_node: int,
        num_groups: int = 1,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | bytes | None = None,
        ssl_context: ssl.SSLContext | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        on_listen: Callable[[str, int], Any] | None = None,
        entrypoint: str = "disco_core.worker",
        ship_modules: bool = True,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        direct_replies: bool = True,
        heartbeat_timeout: float | None = None,
        allow_insecure_bind: bool = False,
    ) -> None:
        for name, value in (
            ("num_nodes", num_nodes),
            ("num_workers_per_node", num_workers_per_node),
        ):
            if isinstance(value, bool) or not isinstance(value, int):
                raise DiscoTypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < 1:
                raise DiscoValueError(f"{name} must be >= 1, got {value}")
        if ssl_context is not None and not isinstance(ssl_context, ssl.SSLContext):
            raise DiscoTypeError("ssl_context must be an ssl.SSLContext")
        # (a port of 70000 or "9091", a timeout of -1 were taken: new-user check)
        if not isinstance(host, str) or not host:
            raise DiscoTypeError(f"host must be a host name or address, got {host!r}")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise DiscoValueError(f"port must be an int 0-65535 (0: any free port), got {port!r}")
        for name, seconds in (("timeout", timeout), ("handshake_timeout", handshake_timeout)):
            if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < float("inf"):  # fmt: skip
                raise DiscoValueError(f"{name} must be a number of seconds > 0, got {seconds!r}")
        if on_listen is not None and not callable(on_listen):  # (it failed as it was called)
            raise DiscoTypeError(f"on_listen must be a callable on_listen(host, port), got {on_listen!r}")  # fmt: skip
        num_workers = num_nodes * num_workers_per_node
        super().__init__(num_workers, num_groups)
        self.num_nodes = num_nodes
        self.shares_memory = num_nodes == 1
        self.per_node = num_workers_per_node
        self.timeout = float(timeout)
        self.entrypoint = entrypoint
        self.ship_modules = ship_modules
        self._token = resolve_token(token)
        self._allow_insecure_bind = bool(allow_insecure_bind)
        self._ssl = ssl_context
        self._handshake_timeout = float(handshake_timeout)
        self.heartbeat_timeout = wire.heartbeat_timeout(heartbeat_timeout)
        self._direct_replies = bool(direct_replies) and ssl_context is None
        #: node id -> its reply connections while it completes its handshake
        self._pending: dict[int, _PendingNode] = {}
        #: every node joined: a later agent is told the session is full
        self._full = False
        self._loop: AcceptLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._free_ids = list(range(1, num_nodes))
        self._ids_lock = threading.Lock()
        self._joined: queue.SimpleQueue = queue.SimpleQueue()
        #: why connections were turned away during the handshake (the last 1,000)
        self.rejected: collections.deque[str] = collections.deque(maxlen=1000)
        self.nodes: list[NodeLink] = []
        self.procs: list[ProcessWorkerLink] = []
        self.reader: ReplyReader | None = None
        self.stderr: StderrTee | None = None  # the local workers'
        self._loader_regs: set[int] = set()
        self._hashes: dict[tuple, str] = {}
        self._listener: socket.socket | None = None
        try:
            self._start(host, port, on_listen)
        except BaseException:
            self._abort()
            raise

    # ------------------------------------------------------------------ start-up
    def _start(self, host: str, port: int, on_listen: Callable | None) -> None:
        if self.num_nodes > 1:
            # The core's one bind policy: beyond loopback, a token or mutual TLS (or the
            # explicit, warned-about opt-out); on loopback without a token, one warning.
            check_bind(
                host,
                token=self._token,
                tls=self._ssl,
                allow_insecure_bind=self._allow_insecure_bind,
                what="disco-socket controller",
            )
            if self._token:  # scrypt, once: before the agents' handshakes, not in the first
                stretch_token(self._token)
            family = listen_family(host, "disco-socket controller")
            try:
                self._listener = socket.create_server((host, port), family=family, backlog=64)
            except OSError as exc:  # in use, not an address of this machine, a low port
                raise DiscoError(
                    f"SocketSession: cannot listen on {host}:{port}: {exc.strerror or exc}"
                    + (" (port=0 picks a free port)" if port else "")
                ) from exc
            self.address: tuple[str, int] = self._listener.getsockname()[:2]
        else:
            self.address = (host, port)
        env = worker_env()
        nw, ng = self.num_workers, self.num_groups
        # each local link is in self.procs as its process starts: _abort finds them all
        self.stderr, self.reader = start_worker_processes(
            self.hub, range(1, self.per_node), nw, ng, self.entrypoint, env, self.procs
        )
        self.gates.append(self.reader.gate)
        if self._listener is not None:
            log.info(
                "disco-socket: waiting for %d node(s) on %s:%d (run %s on each)",
                self.num_nodes - 1, *self.address, self._join_hint(),
            )  # fmt: skip
            if on_listen is not None:
                on_listen(*self.address)
            self._accept_nodes()
        thread0 = ThreadWorkerLink(0, nw, ng, self.hub)
        # Worker 0 imports the nodes' entrypoint for a global function it lacks.
        thread0.worker.ctx.extra["entrypoint"] = self.entrypoint
        self._set_links([thread0, *self.procs, *sorted(self.nodes, key=lambda n: n.node_id)])
        for node in self.nodes:
            self.gates.extend(node.gates.values())
        self.wait_ready(range(1, self.num_workers), time.monotonic() + max(start_timeout(), 1.0))

    def join_command(self) -> str:
        """What to run on each other node (with an address other machines can reach)."""
        host, port = self.address
        cmd = f"disco-socket join {reachable_host(host)} {port} --workers {self.per_node}"
        if self._ssl is not None:
            cmd += " --tls-ca CA_FILE"
        return cmd

    def _join_hint(self) -> str:
        note = " (with this session's token in DISCO_TOKEN)" if self._token else ""
        return f"`{self.join_command()}`{note}"

    def _accept_nodes(self) -> None:
        """Wait for every node to join while the accept loop authenticates them.

        One thread (``disco-socket-accept``) runs the core's
        :class:`~disco_core.spi.AcceptLoop` for the channel's whole life: every
        handshake is a non-blocking :class:`_Hello` step machine advanced by
        that thread, with at most ``max_pending`` of them at once (the oldest is
        dropped to make room) and a deadline each (``handshake_timeout``); no
        thread is started for a connection before it has authenticated. After
        every node joined, the same loop tells late agents that the session is
        full.
        """
        listener = self._listener
        assert listener is not None
        per_node_conns = 1 + (self.per_node if self._direct_replies else 0)
        self._loop = AcceptLoop(
            listener,
            self._make_hello,
            self._on_hello_done,
            max_pending=max(_accept.DEFAULT_MAX_PENDING, 2 * (self.num_nodes - 1) * per_node_conns),
            handshake_timeout=self._handshake_timeout,
            on_tick=self._expire_pending,
            tick_interval=0.25,
            name="disco-socket controller",
        )
        self._loop_thread = threading.Thread(
            target=self._run_loop, name="disco-socket-accept", daemon=True
        )
        self._loop_thread.start()
        start = time.monotonic()
        deadline = start + self.timeout
        noticed = False
        want = self.num_nodes - 1
        while len(self.nodes) < want:
            try:
                self.nodes.append(self._joined.get(timeout=0.1))
                continue
            except queue.Empty:
                pass
            if self.hub.dead:
                raise self.hub.died_error()
            if not self._loop_thread.is_alive():
                raise DiscoError("SocketSession: the controller's accept loop ended early")
            now = time.monotonic()
            if now > deadline:
                raise self._join_timeout(want)
            if not noticed and now - start >= WAIT_NOTICE_DELAY:
                noticed = True  # without logging configured, this is all the user sees
                log.warning(
                    "disco-socket: waiting for %d more node(s) to join %s:%d (for up to %g s); "
                    "on each other machine run: %s",
                    want - len(self.nodes), *self.address, self.timeout, self._join_hint(),
                )  # fmt: skip
        self._full = True

    def _run_loop(self) -> None:
        try:
            self._loop.run()  # type: ignore[union-attr]  # set before this thread starts
        finally:
            with self._ids_lock:
                left = list(self._pending.values())
                self._pending.clear()
            for pending in left:
                pending.close()

    def _join_timeout(self, want: int) -> DiscoTimeoutError:
        host, port = self.address
        rejected = ""
        if self.rejected:
            n = len(self.rejected)
            last = f"the last 3 of {n}" if n > 3 else "they"
            rejected = (
                f"; {n} connection(s) were rejected ({last}: "
                + "; ".join(list(self.rejected)[-3:])
                + ")"
            )
        return DiscoTimeoutError(
            f"SocketSession: only {len(self.nodes)} of {want} node(s) joined {host}:{port} "
            f"within the {self.timeout:g} s timeout (the timeout= option); start each missing "
            f"node with {self._join_hint()}{rejected}"
        )

    def _late_reason(self) -> str:
        return (
            f"the session already has all its {self.num_nodes} nodes; this agent is one too "
            "many (check --workers and the number of agents started for this session)"
        )

    def _claim_id(self) -> int | None:
        with self._ids_lock:
            return heapq.heappop(self._free_ids) if self._free_ids else None

    def _release_id(self, node_id: int) -> None:
        with self._ids_lock:
            heapq.heappush(self._free_ids, node_id)

    def _reject(self, peer: str, reason: str, quiet: bool = False) -> None:
        """Keep why ``peer`` was turned away (:attr:`rejected`, the last 1,000) and log it."""
        self.rejected.append(f"{peer}: {reason}")
        (log.debug if quiet else log.warning)(
            "disco-socket: rejected the connection from %s: %s", peer, reason
        )

    # ------------------------------------------------------------------ the accept loop's side
    def _make_hello(self, sock: socket.socket, addr: Any) -> _Pending:
        """A new connection (accept loop thread): its handshake, not yet advanced."""
        wire.tune_socket(sock, self.heartbeat_timeout)
        peer = f"{addr[0]}:{addr[1]}"
        return _Pending(sock, addr, _Hello(self, peer), self._ssl, self)

    def _on_hello_done(self, hs: _Pending) -> None:
        """A handshake ended without error (accept loop thread): admit or refuse the peer."""
        hs.handed = True
        m: _Hello = hs.machine  # type: ignore[assignment]
        if m.failure is not None:  # refused, with a JSON error already sent
            if m.late:
                log.warning("disco-socket: turned away %s: %s", m.peer, m.failure)
            else:
                self._reject(m.peer, m.failure)
            self._loop.adopt(Drain(hs.sock, hs.addr), _LATE_TIMEOUT)  # type: ignore[union-attr]
            return
        if m.kind == "data":  # blocking, no timeout: its reader waits for replies for ever
            self._add_reply_connection(m, hs.detach(None))
        else:  # a bound on sending the welcome; none once the node joined (_join)
            self._admit(m, hs.detach(self._handshake_timeout))

    def _admit(self, m: _Hello, conn: socket.socket) -> None:
        """A node that authenticated: its id and welcome, then (without TLS) its reply connections.

        Runs in the accept loop's thread and never waits on the peer: the welcome
        is a few hundred bytes into an empty socket buffer, and the node's reply
        connections arrive through the same loop (:meth:`_add_reply_connection`).
        """
        peer, hello = m.peer, m.hello
        tx: Any = wire.transport(conn)
        if m.keys is not None:
            tx = wire.seal(tx, m.keys)  # from here on every byte is a sealed record
        node_id = None
        try:
            workers = hello.get("workers")
            if type(workers) is not int or workers != self.per_node:
                msg = (
                    f"the node offers {workers!r} workers but this session has "
                    f"{self.per_node} workers per node (--workers {self.per_node})"
                )
                wire.send_json(tx, {"error": msg})
                raise HandshakeError(msg)
            node_id = self._claim_id()
            if node_id is None:
                late = self._late_reason()
                wire.send_json(tx, {"error": late})
                raise HandshakeError(late)
            first = node_id * self.per_node
            ids = list(range(first, first + self.per_node))
            info = {
                "node_id": node_id,
                "peer": peer,
                "hostname": str(hello.get("host", "?"))[:256],
                "pid": hello.get("pid") if type(hello.get("pid")) is int else None,
                "worker_ids": ids,
                "sealed": m.keys is not None,
            }
            pending = None
            if self._direct_replies:
                # Registered before the welcome: the node's reply connections follow it.
                secret = (
                    wire.reply_secret(self._token, m.hs.transcript)
                    if m.hs is not None and self._token is not None
                    else None
                )
                pending = _PendingNode(
                    secret, set(ids), peer, conn, tx, info,
                    time.monotonic() + self._handshake_timeout,
                )  # fmt: skip
                with self._ids_lock:
                    self._pending[node_id] = pending
            wire.send_json(
                tx,
                {
                    "node_id": node_id,
                    "num_nodes": self.num_nodes,
                    "num_workers": self.num_workers,
                    "num_groups": self.num_groups,
                    "worker_ids": ids,
                    "entrypoint": self.entrypoint,
                    "sys_path": [p if p else os.getcwd() for p in sys.path],
                    "direct": self._direct_replies,
                    "heartbeat_timeout": self.heartbeat_timeout,
                    # the workers' heartbeats are paced by the controller's bound
                    "liveness_timeout": liveness_timeout(),
                },
            )
            if pending is None:
                self._join(node_id, conn, tx, info, None, None)
        except Exception as exc:  # noqa: BLE001 - any failure is this peer's rejection
            if node_id is not None:
                with self._ids_lock:
                    left = self._pending.pop(node_id, None)
                if left is not None:
                    left.close_replies()
                self._release_id(node_id)
            if not isinstance(exc, (HandshakeError, OSError)):
                exc = HandshakeError(f"malformed handshake ({type(exc).__name__}: {exc})")
            self._reject(peer, str(exc))
            try:
                conn.close()
            except OSError:
                pass

    def _join(
        self,
        node_id: int,
        conn: socket.socket,
        tx: Any,
        info: dict,
        data: dict[int, socket.socket] | None,
        data_keys: dict[int, SessionKeys] | None,
    ) -> None:
        """Make the :class:`NodeLink` of a node whose handshake is complete."""
        conn.settimeout(None)
        link = NodeLink(
            node_id, conn, info["peer"], info["worker_ids"], self.hub, info, data,
            self.heartbeat_timeout, tx=tx, data_keys=data_keys,
        )  # fmt: skip
        log.info("disco-socket: %s joined (agent pid %s)", link.describe(), info["pid"])
        self._joined.put(link)

    def _add_reply_connection(self, m: _Hello, conn: socket.socket) -> None:
        """A worker's reply connection authenticated: keep it; the last one completes its node."""
        node_id, gid = m.hello["node_id"], m.hello["worker"]
        with self._ids_lock:
            pending = self._pending.get(node_id)
            if pending is None or pending is not m.pending or gid in pending.socks:
                pending = None
            else:
                pending.socks[gid] = conn
                if m.keys is not None:
                    pending.keys[gid] = m.keys
                if len(pending.socks) == len(pending.ids):
                    del self._pending[node_id]
                else:
                    return
        if pending is None:
            self._reject(m.peer, f"a second reply connection for worker {gid}")
            conn.close()
            return
        try:
            self._join(
                node_id, pending.conn, pending.tx, pending.info,
                dict(pending.socks), dict(pending.keys),
            )  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - e.g. no thread could be started
            pending.close()
            self._release_id(node_id)
            self._reject(pending.peer, f"could not start serving the node: {exc}")

    def _expire_pending(self) -> None:
        """Drop nodes whose reply connections did not all arrive in time (accept loop's tick)."""
        now = time.monotonic()
        with self._ids_lock:
            late = [(k, p) for k, p in self._pending.items() if p.deadline <= now]
            for k, _p in late:
                del self._pending[k]
        for node_id, pending in late:
            pending.close()
            self._release_id(node_id)
            self._reject(
                pending.peer,
                f"only {len(pending.socks)} of {len(pending.ids)} reply connections arrived "
                f"within {self._handshake_timeout:g} s",
            )

    def _close_listener(self) -> None:
        loop, thread = self._loop, self._loop_thread
        if loop is not None:
            loop.stop()
        if thread is not None:
            thread.join(2.0)
        if self._listener is not None:
            self._listener.close()

    def _abort(self) -> None:
        self.hub.closing = True
        self._close_listener()
        while True:
            try:
                self.nodes.append(self._joined.get_nowait())
            except queue.Empty:
                break
        links: list[NodeLink | ProcessWorkerLink] = [*self.nodes, *self.procs]
        for link in links:  # each one, whatever the others do
            try:
                link.kill()
                link.close(time.monotonic() + 1)
            except Exception:  # noqa: BLE001 - the error being raised is the one to see
                log.debug("clean-up of %r failed", link, exc_info=True)

    # ------------------------------------------------------------------ commands
    def send(self, out: Outgoing, workers: Sequence[int] | None = None) -> None:
        loads = self._scan(out) if self.nodes else None
        link_of = self._link_of
        if workers is None:
            targets: list[tuple[WorkerLink, list[int] | None]] = [
                (link, None) for link in self.links
            ]
        else:
            groups: dict[int, tuple[WorkerLink, list[int]]] = {}
            for w in workers:
                link = link_of[w]
                entry = groups.get(id(link))
                if entry is None:
                    groups[id(link)] = (link, [w])
                else:
                    entry[1].append(w)
            targets = list(groups.values())
        if not out.shared and self.nodes:  # before any link gets it
            check_untrusted(out, [link for link, _ in targets])
        staged: dict[int, Outgoing] = {}
        if loads:  # every node has the module file before any worker gets the command
            for link, _ in targets:
                if type(link) is NodeLink:
                    staged[id(link)] = self._stage(out, loads, link)
        dirty = False
        for link, ws in targets:
            if type(link) is NodeLink:
                link.send_to(staged.get(id(link), out), ws)
            else:
                link.send(out)
            dirty = dirty or link.buffered
        if dirty and not self._flush_due:
            self._mark_dirty()

    def _scan(self, out: Outgoing) -> list[int] | None:
        """Track the registers holding ``disco.load_module``; stage files it is called on."""
        regs = self._loader_regs
        loads = []
        for i, cmd in enumerate(out.cmds):
            action = cmd[0]
            if action == P.CALL_PACKED:
                if regs and cmd[2] in regs and cmd[3] and isinstance(cmd[3][0], str):
                    loads.append(i)
                regs.discard(cmd[1])
            elif action == P.GET_GLOBAL_FUNC:
                if cmd[2] == _LOAD_MODULE:
                    regs.add(cmd[1])
                else:
                    regs.discard(cmd[1])
            elif action == P.KILL_REG:
                regs.difference_update(cmd[1])
            elif action == P.DEBUG_SET_REGISTER:
                regs.discard(cmd[1])
        if not loads or not self.ship_modules:
            return None
        return loads

    def _file_hash(self, path: str) -> tuple[str, int]:
        st = os.stat(path)
        key = (path, st.st_size, st.st_mtime_ns)
        digest = self._hashes.get(key)
        if digest is None:
            h = hashlib.sha256()
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
            digest = self._hashes[key] = h.hexdigest()
        return digest, st.st_size

    def _stage(self, out: Outgoing, loads: list[int], link: NodeLink) -> Outgoing:
        cmds = list(out.cmds)
        for i in loads:
            action, reg, func, args = cmds[i]
            path = args[0]
            if not os.path.isfile(path):
                continue  # the node may have it; its loader reports otherwise
            digest, size = self._file_hash(path)
            remote = link.stage_file(path, digest, size)
            cmds[i] = (action, reg, func, (remote, *args[1:]))
        return Outgoing(*cmds)

    def close(self, timeout: float = 5.0) -> None:
        self._close_listener()
        super().close(timeout)
        if self.reader is not None:
            self.reader.stop()
            self.reader.join(timeout=1.0)
        if self.stderr is not None:
            self.stderr.join(timeout=1.0)  # the local workers' last words


def create(**options: Any) -> SocketChannel:
    """The ``socket`` channel factory (``Session.create("socket", ...)``)."""
    return SocketChannel(**options)
