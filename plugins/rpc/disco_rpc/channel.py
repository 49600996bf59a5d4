"""The ``"rpc"`` Disco channel: a Disco session whose workers run on RPC servers.

``disco_core.Session.create("rpc", servers=[(host, port), ...])`` (or
``tracker=(host, port), key=...``) opens one RPC session per remote worker,
authenticated as any RPC session (``token=``), and turns each into a Disco
worker: the server's session process runs the core's worker loop on the
session's socket, speaking the core's frame format. Worker 0 stays in the
controller's process, as in every Disco session. The pool of machines behind a
tracker serves RPC users and Disco sessions alike; a worker's server goes back
to the pool when the Disco session ends.

The core's frames cross the session's connection as they are: sealed records
when the session has a token (every frame one record, checked before it is
acted on), and nothing from the socket is ever unpickled: each side rebuilds
the other's frames with :func:`disco_core.spi.decode_untrusted`, a parser of
the core's tagged network format that makes plain values, arrays, dtypes,
devices and worker errors only. TLS is not supported
on this channel (its reader waits on the raw socket).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

import numpy as np

from disco_core import (
    DiscoError,
    DiscoTypeError,
    DiscoValueError,
    UntrustedValueError,
    WorkerDiedError,
    WorkerError,
)
from disco_core.spi import (
    BatchingLink,
    LinkChannel,
    ReplyHub,
    ReplyReader,
    ThreadWorkerLink,
    decode_untrusted,
    env_seconds,
    is_loopback,
)

from . import wire
from .client import connect
from .protocol import OP_DISCO_WORKER
from .worker_host import WORKER_PROCESS_NAME, LinkFrames, run_worker

__all__ = ["RPCChannel", "RPCWorkerLink", "run_worker", "LinkFrames"]

logger = logging.getLogger("disco_rpc.channel")


def _start_timeout() -> float:
    return env_seconds("DISCO_START_TIMEOUT", 60.0)


# --------------------------------------------------------------------------- controller side
class RPCWorkerLink(BatchingLink):
    """One worker in an RPC server's session process, behind the session's socket."""

    heartbeats = True  # the server's worker host sends them (disco_core.spi.HeartbeatSender)
    untrusted = True  # the server's worker host rebuilds commands with decode_untrusted

    def __init__(self, worker_id: int, sess: Any, host: str) -> None:
        super().__init__()
        self.worker_ids = (worker_id,)
        self.sess = sess
        self.host = host
        conn = sess._conn
        self.t = conn.t  # sealed when the session has a token
        self.sock: socket.socket = conn.t.sock
        self.sock.settimeout(None)  # blocking: the reader waits in recv
        self.fd = self.sock.fileno()
        # the worker's first frames may have come in with the RPC reply
        self.reader = LinkFrames(conn)
        self.out_fd = self.fd
        self.dead_reason: str | None = None
        self.pid: int | None = None  # the worker's process, once checked (set_pid)
        self._peer_inode: int | None = None
        self._pid_named = False
        self.eof = threading.Event()

    def _died(self, exc: OSError) -> WorkerDiedError:
        reason = (
            self.dead_reason
            or f"worker {self.worker_ids[0]} on {self.host}: connection broke ({exc})"
        )
        return WorkerDiedError(self.worker_ids, reason)

    def input_fd(self, worker_id: int) -> int | None:
        return self.fd

    def poll(self) -> str | None:
        return self.dead_reason

    def _write(self, data: bytes) -> None:
        self.t.send_parts([data])  # a batch of small frames: one record

    def _write_views(self, head: bytes, buffers: Any) -> None:
        self.t.send_parts([head, *buffers])  # a frame with its buffers: one record

    def set_pid(self, pid: Any) -> None:
        """The worker's process, as its ``ready`` message names it: kept only when that
        process holds the other end of this link (on this machine) and is named as a
        worker (``WORKER_PROCESS_NAME``, which a worker host takes before ``ready``).

        The pid comes from a peer: a forged one (another process of this user, ``-1``:
        all of them) would be what :meth:`kill` kills (an outside check). So only the
        first ``ready`` counts, and never for this process or a thread's id. A worker
        behind a local relay (a proxy, a tunnel) does not hold this link: it is not
        killed from here, its server ends it. The relay holds it, and a peer that
        speaks for the worker (the server, which holds the token) could name the
        relay (a second check): it is not named as a worker, and a process can name
        only itself. A ``no_fork`` server's workers are threads of the server's
        process, which is not named either: a client never kills a server.
        """
        if self._pid_named:
            return  # only the first: later ones may only try their luck (an outside check)
        self._pid_named = True
        if type(pid) is not int or pid <= 1 or not _loopback(self.host):
            return
        if pid == os.getpid() or not _is_process(pid):
            # this process (an in-process relay holds the other end), or a thread's id
            logger.info("worker %d named process %d: not believed", self.worker_ids[0], pid)
            return
        inode = _peer_socket_inode(self.sock)
        if inode is not None and _holds_socket(pid, inode) and _named_worker(pid):
            self.pid, self._peer_inode = pid, inode
        else:
            logger.info(  # (behind a relay too: not a warning)
                "worker %d on %s named process %d, which is not a worker process holding "
                "its connection: it will not be killed from here if it stops answering",
                self.worker_ids[0], self.host, pid,
            )  # fmt: skip

    def _kill_process(self) -> None:
        # still that process (not another that took its pid since), still holding the link
        pid = self.pid
        if pid and self._peer_inode and _holds_socket(pid, self._peer_inode) and _named_worker(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def kill(self) -> None:
        """Cut the link to a worker that stopped answering (a write stuck on it ends)."""
        self._kill_process()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self, deadline: float) -> None:
        try:
            self.sock.shutdown(socket.SHUT_WR)  # end of file: an idle worker exits
        except OSError:
            pass
        if not self.eof.wait(max(0.0, deadline - time.monotonic())):
            self._kill_process()  # a laggard on this machine: end it
        self.sess.close()


class _ReplyReader(ReplyReader):
    """The core's reply reader over every worker's socket; end of file means the worker is gone."""

    decode = staticmethod(decode_untrusted)  # these frames crossed a socket

    def __init__(self, links: list[RPCWorkerLink], hub: ReplyHub) -> None:
        super().__init__(links, hub, name="disco-rpc-replies")

    def link_fd(self, link: RPCWorkerLink) -> int:
        return link.fd

    def on_message(self, link: RPCWorkerLink, msg: tuple) -> None:
        if type(msg) is tuple and len(msg) > 1 and type(msg[0]) is str and msg[0] == "ready":
            link.set_pid(msg[1])

    def refused(self, worker_id: int, exc: UntrustedValueError) -> tuple:
        # A whole frame this process does not rebuild (a remote function's result that
        # is not plain data): the waiting call fails, the session goes on (as the
        # socket channel's replies do)
        return (
            "fail",
            WorkerError(
                worker_id,
                type(exc).__name__,
                f"the worker's reply was refused by the controller: {exc}",
            ),
        )

    def link_ended(self, link: RPCWorkerLink, fd: int, exc: BaseException) -> None:
        link.eof.set()
        if not self.hub.closing:
            reason = (
                f"worker {link.worker_ids[0]} (pid {link.pid} on {link.host}) "
                f"closed its connection: {exc}"
            )
            link.dead_reason = reason
            self.hub.mark_dead(link.worker_ids, reason)


def _loopback(host: str) -> bool:
    return is_loopback(host)


def _proc_net_address(addr: tuple) -> str:
    """``(host, port, ...)`` as ``/proc/net/tcp[6]`` writes it (each 32-bit word in host order)."""
    host, port = addr[0], addr[1]
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    raw = socket.inet_pton(family, host)
    words = "".join(
        f"{int.from_bytes(raw[i : i + 4], sys.byteorder):08X}" for i in range(0, len(raw), 4)
    )
    return f"{words}:{port:04X}"


def _peer_socket_inode(sock: socket.socket) -> int | None:
    """The inode of the other end of ``sock``, a loopback TCP connection (None: not found).

    ``/proc/net/tcp`` lists both ends of a loopback connection: the peer's is the one
    whose local address is this end's peer address, and the other way round.
    """
    try:
        here, there = _proc_net_address(sock.getsockname()), _proc_net_address(sock.getpeername())
    except (OSError, ValueError):
        return None
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    fields = line.split()
                    if fields[1] == there and fields[2] == here:
                        return int(fields[9])
        except (OSError, IndexError, ValueError, StopIteration):
            continue
    return None


def _is_process(pid: int) -> bool:
    """Whether ``pid`` is a process, not one of its threads (whose ids ``/proc`` lists too)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Tgid:"):
                    return int(line.split()[1]) == pid
    except (OSError, ValueError):
        pass
    return False


def _named_worker(pid: int) -> bool:
    """Whether process ``pid`` named itself a Disco worker (``/proc/<pid>/comm``)."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().rstrip("\n") == WORKER_PROCESS_NAME
    except OSError:
        return False


def _holds_socket(pid: int, inode: int) -> bool:
    """Whether process ``pid`` (of this user) has the socket ``inode`` open."""
    want = f"socket:[{inode}]"
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == want:
                return True
        except OSError:
            continue
    return False


def _from_tracker(tsess: Any, key: str, priority: int, session_timeout: float, deadline: float, limit: float, have: int, need: int) -> Any:  # fmt: skip
    """One more session from the tracker, waiting at most until ``deadline``."""
    from .errors import RPCRequestTimeoutError

    try:
        return tsess.request(
            key, priority, session_timeout, wait_timeout=max(deadline - time.monotonic(), 1e-3)
        )
    except RPCRequestTimeoutError:
        raise DiscoError(
            f'the "rpc" channel got {have} of the {need} servers of key {key!r} it needs '
            f"within {limit:g} s (DISCO_START_TIMEOUT or start_timeout=): "
            f"{tsess.pool_text(key)}; the servers it got went back to the pool"
        ) from None


def _listed(value: Any, name: str) -> list:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise DiscoTypeError(
            f'the "rpc" channel: {name} must be a list of (host, port) pairs, got '
            f"{type(value).__name__} {value!r}"
        )
    return list(value)


def _address(value: Any, name: str) -> tuple[str, int]:
    """``(host, port)`` from a pair or a ``"host:port"`` string; a clear error otherwise.

    Strict on purpose (an outside check): ``"h9"`` read as host ``h`` port 9, ``"::1"``
    as host ``:`` port 1, and a float or bool port was rounded or counted.
    """
    shape = f'the "rpc" channel: {name} must be a (host, port) pair or "host:port", got {value!r}'
    if isinstance(value, str):
        host, colon, text_port = value.rpartition(":")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]  # [v6 address]:port
        elif ":" in host:
            raise DiscoValueError(f"{shape} (write an IPv6 address in brackets: [::1]:9091)")
        if not colon or not (text_port.isascii() and text_port.isdigit()):
            raise DiscoTypeError(shape)
        port: Any = int(text_port)
    elif isinstance(value, (tuple, list)) and len(value) == 2:
        host, port = value
        if isinstance(port, str) and port.isascii() and port.isdigit():
            port = int(port)
        if isinstance(port, bool) or not isinstance(port, (int, np.integer)):
            raise DiscoTypeError(f"{shape}: the port must be an int")
    else:
        raise DiscoTypeError(shape)
    if not isinstance(host, str) or not host or not 0 < port < 65536:
        raise DiscoValueError(
            f'the "rpc" channel: {name} must name a host and a port 1-65535, got {value!r}'
        )
    return host, int(port)


class RPCChannel(LinkChannel):
    """Worker 0 in the controller; workers 1..N-1 in sessions of RPC servers.

    Parameters
    ----------
    servers : list of (host, port) or "host:port", optional
        The servers; worker ``i`` (1 <= i < N) runs on ``servers[(i - 1) % len(servers)]``,
        each in a session process of its own.
    tracker : (host, port) or "host:port", optional
        Instead of ``servers``: ask this tracker for ``num_workers - 1`` servers of ``key``.
    num_workers : int
        Default ``len(servers) + 1``.
    key, token : str
        The servers' key (a tracker's key) and the shared secret (default ``$DISCO_TOKEN``).
    priority, session_timeout :
        Passed to the tracker's ``request``.
    start_timeout : float, optional
        Seconds to obtain the servers from the tracker and start the workers
        (default ``$DISCO_START_TIMEOUT``, 60). When the tracker cannot give enough
        free servers in time, the sessions already obtained go back to the pool
        and a :class:`~disco_core.errors.DiscoError` says how many servers of
        ``key`` there are.
    """

    kind = "rpc"

    def __init__(self, num_workers: int | None = None, num_groups: int = 1, servers: Any = None, tracker: Any = None, key: str = "", token: Any = None, priority: int = 1, session_timeout: float = 0, tracker_token: Any = None, connect_timeout: float = 10.0, start_timeout: float | None = None) -> None:  # fmt: skip
        if servers is not None and tracker is not None:  # (said as "needs one" too)
            raise DiscoError(
                'the "rpc" channel takes servers=[(host, port), ...] or tracker=(host, port), '
                "not both"
            )
        if servers is None and tracker is None:
            raise DiscoError(
                'the "rpc" channel needs servers=[(host, port), ...] or tracker=(host, port)'
            )
        if servers is not None:
            servers = [_address(s, "each server") for s in _listed(servers, "servers")]
            if not servers:
                raise DiscoError('the "rpc" channel needs at least one server')
            if num_workers is None:
                num_workers = len(servers) + 1
        else:
            tracker = _address(tracker, "tracker")
            if num_workers is None:
                raise DiscoError('the "rpc" channel with a tracker needs num_workers')
        num_workers = int(num_workers)
        super().__init__(num_workers, num_groups)
        limit = _start_timeout() if start_timeout is None else float(start_timeout)
        deadline = time.monotonic() + limit
        links: list[RPCWorkerLink] = []
        sessions: list = []
        tsess = None
        try:
            if tracker is not None:
                from .tracker import connect_tracker

                tsess = connect_tracker(
                    tracker[0], tracker[1],
                    token=tracker_token if tracker_token is not None else token,
                    server_token=token,
                )  # fmt: skip
            sys_path = [p if p else os.getcwd() for p in sys.path]
            for w in range(1, num_workers):
                if tsess is not None:
                    sess = _from_tracker(tsess, key, priority, session_timeout, deadline, limit, w - 1, num_workers - 1)  # fmt: skip
                    host = sess._label.rsplit(":", 1)[0]
                else:
                    host, port = servers[(w - 1) % len(servers)]
                    sess = connect(
                        host,
                        port,
                        key,
                        session_timeout,
                        token=token,
                        connect_timeout=connect_timeout,
                    )
                sessions.append(sess)
                if sess._conn is None or isinstance(sess._conn.t, wire.SSLTransport):
                    raise DiscoError('the "rpc" channel does not support TLS sessions')
                sess._stop_heartbeats()  # the socket is about to carry the core's frames
                sess._stop_watching_server()
                sess._request(OP_DISCO_WORKER, w, num_workers, num_groups, sys_path)
                links.append(RPCWorkerLink(w, sess, host))
            hosts = {link.host for link in links}
            if all(_loopback(h) for h in hosts):
                self.num_nodes, self.shares_memory = 1, True
            else:
                self.num_nodes, self.shares_memory = len(hosts) + 1, False
            self.reader = _ReplyReader(links, self.hub)
            self.gates.append(self.reader.gate)
            self.reader.start()
            self.rpc_links = links
            self._set_links([ThreadWorkerLink(0, num_workers, num_groups, self.hub), *links])
            self.wait_ready([link.worker_ids[0] for link in links], deadline, "RPC workers")
        except BaseException:
            self.hub.closing = True
            for s in sessions:
                s.close()
            raise
        finally:
            if tsess is not None:
                tsess.close()

    def close(self, timeout: float = 5.0) -> None:
        super().close(timeout)
        self.reader.stop()  # a link closed before its end was read leaves the reader waiting
        self.reader.join(timeout=1.0)
