"""The controller side of the ``socket`` channel: :class:`SocketChannel` and :class:`NodeLink`.

Worker 0 is a thread of the controller's process, the controller's node's other
workers are child processes (the core's own :class:`ProcessWorkerLink`), and each
remote node is one :class:`NodeLink`: a TCP (optionally TLS) connection to a node
agent that relays every command to that node's workers and every reply back.
"""

from __future__ import annotations

import hashlib
import heapq
import ipaddress
import json
import logging
import os
import queue
import socket
import ssl
import struct
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from disco_core import protocol as P
from disco_core.channels.base import (
    BatchingLink,
    LinkChannel,
    Outgoing,
    ReplyHub,
    ThreadWorkerLink,
    WorkerLink,
)
from disco_core.channels.process import (
    ProcessWorkerLink,
    ReplyReader,
    start_timeout,
    tee_stderr,
    worker_env,
)
from disco_core.errors import DiscoError, WorkerDiedError, WorkerError
from disco_core.net.security import Handshake, SessionKeys, check_bind, new_nonce, resolve_token
from disco_core.protocol import decode_untrusted, frame_head

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
        raise ValueError("protocol error: a JSON message nested too deeply") from None


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
        self.reader.start()
        for t in self.data_readers:
            t.start()
        if self.heartbeat is not None:
            self.heartbeat.start()

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
        frame = out.frame
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
                        raise TimeoutError(
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
                        raise OSError(f"{path} shrank while it was being sent")
                    self.tx.send_parts([view[:n]])
                    left -= n

    # ------------------------------------------------------------------ receiving
    def _deliver(self, gid: int, header: bytes, buffers: list) -> None:
        # Bytes from a socket are never unpickled: only plain values, arrays,
        # dtypes, devices and worker errors are rebuilt (the core's allow-list).
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
        hub = self.hub
        try:
            while True:
                header, buffers, _ = reader.read_frame()
                reader.settle()
                self._deliver(gid, header, buffers)
        except (EOFError, OSError, ValueError, struct.error) as exc:
            if hub.closing:
                return
            # The worker exited (its agent reports why) or the node went away (the
            # node's connection says so): give those better reasons a moment.
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline and not hub.closing:
                if gid in hub.dead or self.dead_reason is not None:
                    break
                time.sleep(0.02)
            reason = self.dead_reason or (
                f"worker {gid}'s reply connection closed ({exc}) (on {self.describe()})"
            )
            hub.mark_dead([gid], reason)

    def _read_loop(self) -> None:
        reader = StreamReader(self.tx)
        settle = reader.settle  # act on a message only once its record verified
        hub = self.hub
        ids = set(self.worker_ids)
        try:
            while True:
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
                        raise ValueError("protocol error: a module-file answer is not an object")
                    q = self._requests.get(arg)
                    if q is not None:
                        q.put(answer)
                else:
                    raise EOFError(f"protocol error: unknown message kind {kind}")
        except (EOFError, OSError, ValueError, RecursionError, struct.error) as exc:
            if isinstance(exc, EOFError) and str(exc) == "connection closed":
                what = "disconnected (the node agent exited or its machine went away)"
            else:
                what = f"disconnected: {exc}"
            if self.dead_reason is None:  # else the heartbeat gave up on it first
                self.dead_reason = f"{self.describe()} {what}"
                if not hub.closing:
                    log.error("disco-socket: %s", self.dead_reason)
            if not hub.closing:
                hub.mark_dead(self.worker_ids, self.dead_reason)

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
        self.dead_reason = (
            f"{self.describe()} stopped responding: nothing arrived from it for {idle:.1f} s "
            f"(heartbeat timeout {self.heartbeat_timeout:g} s; the node is frozen or "
            "overloaded, its machine went away, or the network between them is cut)"
        )
        log.error("disco-socket: %s", self.dead_reason)
        self.hub.mark_dead(self.worker_ids, self.dead_reason)
        self.kill()  # unblocks any send stuck on the dead connection

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
    (None without a token); ``keys`` the record keys of each reply connection.
    """

    def __init__(self, secret: bytes | None, ids: set[int], peer: str) -> None:
        self.secret = secret
        self.ids = ids
        self.peer = peer
        self.socks: dict[int, socket.socket] = {}
        self.keys: dict[int, SessionKeys] = {}
        self.done = threading.Event()


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
        Listen beyond loopback with neither a token nor TLS (a warning): anyone who
        reaches the port can run code on every node. For trusted networks only.
    timeout : float
        Seconds to wait for every node to join (default 60); then ``TimeoutError``.
    on_listen : callable, optional
        ``on_listen(host, port)`` is called once the controller listens (to start
        the agents, e.g. with :func:`disco_socket.start_local_agents`).
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
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if ssl_context is not None and not isinstance(ssl_context, ssl.SSLContext):
            raise TypeError("ssl_context must be an ssl.SSLContext")
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
        self._direct = bool(direct_replies) and ssl_context is None
        #: node id -> its reply connections while it completes its handshake
        self._pending: dict[int, _PendingNode] = {}
        self._free_ids = list(range(1, num_nodes))
        self._ids_lock = threading.Lock()
        self._joined: queue.SimpleQueue = queue.SimpleQueue()
        self.rejected: list[str] = []
        self.nodes: list[NodeLink] = []
        self.procs: list[ProcessWorkerLink] = []
        self.reader: ReplyReader | None = None
        self.stderr = None  # the local workers' StderrTee
        self._loader_regs: set[int] = set()
        self._hashes: dict[tuple, str] = {}
        self._listener: socket.socket | None = None
        self._turn_away: threading.Thread | None = None
        try:
            self._start(host, port, on_listen)
        except BaseException:
            self._abort()
            raise

    # ------------------------------------------------------------------ start-up
    def _start(self, host: str, port: int, on_listen: Callable | None) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        if self.num_nodes > 1:
            # The core's one bind policy: beyond loopback, a token or TLS (or the
            # explicit, warned-about opt-out); on loopback without a token, one warning.
            check_bind(
                host,
                token=self._token,
                tls=self._ssl is not None,
                allow_insecure_bind=self._allow_insecure_bind,
                what="disco-socket controller",
            )
            self._listener = socket.create_server((host, port), family=family, backlog=64)
            self.address: tuple[str, int] = self._listener.getsockname()[:2]
        else:
            self.address = (host, port)
        env = worker_env()
        nw, ng = self.num_workers, self.num_groups
        for w in range(1, self.per_node):
            self.procs.append(ProcessWorkerLink(w, nw, ng, self.entrypoint, env))
        self.stderr = tee_stderr(self.procs)
        self.reader = ReplyReader(self.procs, self.hub)
        self.reader.start()
        if self._listener is not None:
            log.info(
                "disco-socket: waiting for %d node(s) on %s:%d (run %s on each)",
                self.num_nodes - 1, *self.address, self._join_hint(),
            )  # fmt: skip
            if on_listen is not None:
                on_listen(*self.address)
            self._accept_nodes()
        thread0 = ThreadWorkerLink(0, nw, ng, self.hub)
        self._set_links([thread0, *self.procs, *sorted(self.nodes, key=lambda n: n.node_id)])
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
        listener = self._listener
        assert listener is not None
        listener.settimeout(0.1)
        start = time.monotonic()
        deadline = start + self.timeout
        noticed = False
        want = self.num_nodes - 1
        while len(self.nodes) < want:
            while True:
                try:
                    self.nodes.append(self._joined.get_nowait())
                except queue.Empty:
                    break
            if len(self.nodes) >= want:
                break
            if self.hub.dead:
                raise self.hub.died_error()
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
            try:
                conn, addr = listener.accept()
            except TimeoutError:
                continue
            threading.Thread(
                target=self._handshake,
                args=(conn, addr),
                name="disco-socket-handshake",
                daemon=True,
            ).start()
        listener.settimeout(None)
        self._turn_away = threading.Thread(
            target=self._turn_away_loop, name="disco-socket-full", daemon=True
        )
        self._turn_away.start()

    def _join_timeout(self, want: int) -> TimeoutError:
        host, port = self.address
        rejected = ""
        if self.rejected:
            rejected = f"; {len(self.rejected)} connection(s) were rejected: " + "; ".join(
                self.rejected[-3:]
            )
        return TimeoutError(
            f"SocketSession: only {len(self.nodes)} of {want} node(s) joined {host}:{port} "
            f"within the {self.timeout:g} s timeout (the timeout= option); start each missing "
            f"node with {self._join_hint()}{rejected}"
        )

    def _turn_away_loop(self) -> None:
        """Tell agents that come after every node joined that the session is full.

        Without this they would find the port closed and retry until their
        ``--connect-timeout``; now they exit at once with a clear refusal. Ends when
        :meth:`close` shuts the listener down.
        """
        listener = self._listener
        assert listener is not None
        while True:
            try:
                conn, addr = listener.accept()
            except OSError:
                return
            self._turn_away_one(conn, f"{addr[0]}:{addr[1]}")

    def _turn_away_one(self, conn: socket.socket, peer: str) -> None:
        reason = (
            f"the session already has all its {self.num_nodes} nodes; this agent is one too "
            "many (check --workers and the number of agents started for this session)"
        )
        try:
            conn.settimeout(_LATE_TIMEOUT)
            if self._ssl is not None:
                conn = self._ssl.wrap_socket(conn, server_side=True)
            magic, _ = HELLO.unpack(wire.recv_exact(conn, HELLO.size))
            if magic == MAGIC:  # read the hello (JSON only) so the answer is not reset away
                wire.recv_json(conn)
                wire.send_json(conn, {"error": reason})
                conn.shutdown(socket.SHUT_WR)
            log.warning("disco-socket: turned away %s: %s", peer, reason)
        except Exception as exc:  # noqa: BLE001 - whatever it sent, it is dropped
            log.warning("disco-socket: dropped a late connection from %s: %s", peer, exc)
        finally:
            conn.close()

    def _claim_id(self) -> int | None:
        with self._ids_lock:
            return heapq.heappop(self._free_ids) if self._free_ids else None

    def _release_id(self, node_id: int) -> None:
        with self._ids_lock:
            heapq.heappush(self._free_ids, node_id)

    def _handshake(self, conn: socket.socket, addr: Any) -> None:
        """Authenticate one connection (a node, or one of its reply connections).

        Whatever goes wrong, the connection is closed and the reason kept in
        :attr:`rejected` (and logged): a peer that sends garbage, however
        malformed or deeply nested, never leaves a thread or a socket behind.
        """
        peer = f"{addr[0]}:{addr[1]}"
        node_id = None
        try:
            conn.settimeout(self._handshake_timeout)
            wire.tune_socket(conn, self.heartbeat_timeout)
            if self._ssl is not None:
                conn = self._ssl.wrap_socket(conn, server_side=True)
            tx: Any = wire.transport(conn)
            head = wire.recv_exact(tx, HELLO.size)
            magic, version = HELLO.unpack(head)
            if magic == DATA_MAGIC and self._direct and version == PROTOCOL_VERSION:
                self._data_handshake(conn, tx, head)
                return
            if magic not in (MAGIC, DATA_MAGIC):
                raise HandshakeError("not a disco-socket node agent (bad magic bytes)")
            if magic == DATA_MAGIC and version == PROTOCOL_VERSION:
                wire.send_json(tx, {"error": "this session takes no reply connections"})
                raise HandshakeError("a reply connection, but this session relays replies")
            if version != PROTOCOL_VERSION:
                msg = (
                    f"protocol version mismatch: the controller speaks disco-socket protocol "
                    f"{PROTOCOL_VERSION}, the node speaks {version}; install the same "
                    "disco-socket version on every node"
                )
                wire.send_json(tx, {"error": msg})
                raise HandshakeError(msg)
            hello, raw = wire.recv_json_raw(tx)
            wire.nonce_hex(hello.get("nonce"), "hello")
            token = self._token
            node_auth = hello.get("auth")
            if token is not None and node_auth is not True:
                msg = (
                    "authentication failed: this session requires a token and the node has "
                    "none (give it the session's token in DISCO_TOKEN)"
                )
                wire.send_json(tx, {"error": msg})
                raise HandshakeError(msg)
            if token is None and node_auth is not False:
                msg = (
                    "the node has a token but this session has none (start the session "
                    "with the same token=, or DISCO_TOKEN)"
                )
                wire.send_json(tx, {"error": msg})
                raise HandshakeError(msg)
            challenge = {
                "version": PROTOCOL_VERSION,
                "nonce": new_nonce().hex(),
                "auth": token is not None,
            }
            sent = wire.send_json(tx, challenge)
            hs = None
            if token is not None:
                hs = Handshake(token, "server", wire.LABEL)
                hs.bind(head + raw, sent)
                got = wire.parse_proof(wire.recv_json(tx))
                if got is None or not hs.verify(got):
                    wire.send_json(
                        tx,
                        {
                            "error": "authentication failed: the node's token differs from "
                            "the controller's (use the same --token or DISCO_TOKEN everywhere)"
                        },
                    )
                    raise HandshakeError("authentication failed (wrong token)")
                wire.send_json(tx, {"proof": hs.proof().hex()})
                tx = wire.seal(tx, hs.keys())  # from here on every byte is a sealed record
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
                wire.send_json(tx, {"error": "the session already has all its nodes"})
                raise HandshakeError("the session already has all its nodes")
            first = node_id * self.per_node
            ids = list(range(first, first + self.per_node))
            pending = None
            if self._direct:
                # Registered before the welcome: the node's reply connections follow it.
                secret = wire.reply_secret(token, hs.transcript) if hs is not None else None
                pending = _PendingNode(secret, set(ids), peer)
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
                    "direct": self._direct,
                    "heartbeat_timeout": self.heartbeat_timeout,
                },
            )
            data = data_keys = None
            if pending is not None:
                if not pending.done.wait(self._handshake_timeout):
                    raise HandshakeError(
                        f"only {len(pending.socks)} of {len(ids)} reply connections arrived "
                        f"within {self._handshake_timeout:g} s"
                    )
                with self._ids_lock:
                    del self._pending[node_id]
                    data, data_keys = dict(pending.socks), dict(pending.keys)
            conn.settimeout(None)
            info = {
                "node_id": node_id,
                "peer": peer,
                "hostname": str(hello.get("host", "?"))[:256],
                "pid": hello.get("pid") if type(hello.get("pid")) is int else None,
                "worker_ids": ids,
                "sealed": hs is not None,
            }
            link = NodeLink(
                node_id, conn, peer, ids, self.hub, info, data, self.heartbeat_timeout,
                tx=tx, data_keys=data_keys,
            )  # fmt: skip
            node_id = None
            log.info("disco-socket: %s joined (agent pid %s)", link.describe(), info["pid"])
            self._joined.put(link)
        except Exception as exc:  # noqa: BLE001 - any failure is this peer's rejection
            if node_id is not None:
                with self._ids_lock:
                    left = self._pending.pop(node_id, None)
                for sock in left.socks.values() if left is not None else ():
                    sock.close()
                self._release_id(node_id)
            if not isinstance(exc, (HandshakeError, OSError)):
                exc = HandshakeError(f"malformed handshake ({type(exc).__name__}: {exc})")
            self.rejected.append(f"{peer}: {exc}")
            log.warning("disco-socket: rejected the connection from %s: %s", peer, exc)
            try:
                conn.close()
            except OSError:
                pass

    def _data_handshake(self, conn: socket.socket, tx: Any, head: bytes) -> None:
        """Authenticate a worker's reply connection (raises :class:`HandshakeError`).

        Only JSON is read: the peer must name a node whose handshake is under way
        and one of its workers not yet connected, and, with a token, prove it
        holds that node's :func:`~disco_socket.wire.reply_secret`; otherwise it
        is dropped. With a token the worker then seals every reply frame under
        this handshake's keys.
        """
        hello, raw = wire.recv_json_raw(tx)
        node_id, gid = hello.get("node_id"), hello.get("worker")
        wire.nonce_hex(hello.get("nonce"), "reply-connection hello")
        with self._ids_lock:
            pending = self._pending.get(node_id) if type(node_id) is int else None
        if (
            pending is None
            or type(gid) is not int
            or gid not in pending.ids
            or gid in pending.socks
        ):
            wire.send_json(tx, {"error": "unexpected reply connection"})
            raise HandshakeError(
                f"an unexpected reply connection (node {node_id!r}, worker {gid!r})"
            )
        if hello.get("auth") is not (pending.secret is not None):
            wire.send_json(tx, {"error": "authentication failed"})
            raise HandshakeError("a reply connection that does not match its node's auth")
        sent = wire.send_json(tx, {"nonce": new_nonce().hex(), "auth": pending.secret is not None})
        keys = None
        if pending.secret is not None:
            hs = Handshake(pending.secret, "server", wire.LABEL + b" reply")
            hs.bind(head + raw, sent)
            got = wire.parse_proof(wire.recv_json(tx))
            if got is None or not hs.verify(got):
                wire.send_json(tx, {"error": "authentication failed"})
                raise HandshakeError("authentication failed on a reply connection (wrong proof)")
            wire.send_json(tx, {"proof": hs.proof().hex()})
            keys = hs.keys()
        conn.settimeout(None)
        with self._ids_lock:
            if gid in pending.socks or self._pending.get(node_id) is not pending:
                raise HandshakeError(f"a second reply connection for worker {gid}")
            pending.socks[gid] = conn
            if keys is not None:
                pending.keys[gid] = keys
            if len(pending.socks) == len(pending.ids):
                pending.done.set()

    def _close_listener(self) -> None:
        if self._listener is not None:
            try:  # wakes the thread blocked in accept()
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
        if self._turn_away is not None:
            self._turn_away.join(1.0)

    def _abort(self) -> None:
        self.hub.closing = True
        self._close_listener()
        while True:
            try:
                self.nodes.append(self._joined.get_nowait())
            except queue.Empty:
                break
        for link in self.nodes:
            link.kill()
            link.close(time.monotonic() + 1)
        for link in self.procs:
            link.kill()
            link.close(time.monotonic() + 1)

    # ------------------------------------------------------------------ commands
    def send(self, out: Outgoing, workers: Sequence[int] | None = None) -> None:
        loads = self._scan(out) if self.nodes else None
        link_of = self._link_of
        if workers is None:
            targets = [(link, None) for link in self.links]
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
            self.reader.join(timeout=1.0)
        if self.stderr is not None:
            self.stderr.join(timeout=1.0)  # the local workers' last words


def create(**options: Any) -> SocketChannel:
    """The ``socket`` channel factory (``Session.create("socket", ...)``)."""
    return SocketChannel(**options)
