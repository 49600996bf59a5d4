"""Issue 13, finding 5, for the socket controller: before a peer is known, it costs almost nothing.

The controller used to start a thread per incoming connection before its
handshake. Now one thread runs every handshake as a non-blocking step machine
(the core's ``AcceptLoop``), with a cap on pending ones and a deadline for each.
The controller runs in a child process with the 1,024 descriptors a default
shell gives, so its threads and CPU time can be counted in ``/proc``.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from _socket_helpers import HOST, wait_gone

from disco_socket import start_local_agents

pytestmark = pytest.mark.timeout(120)

#: Idle connections of the flood (over the 1,024 descriptors the controller has).
N_IDLE = 1100

_CONTROLLER = textwrap.dedent(
    """
    import json, os, resource, sys, time
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))
    import disco_core as disco

    def on_listen(host, port):
        spare = int(os.environ.get("FLOOD_SPARE_FDS", "0"))
        if spare:  # descriptors run out long before the cap on pending handshakes
            top = max(int(fd) for fd in os.listdir("/proc/self/fd"))
            resource.setrlimit(resource.RLIMIT_NOFILE, (top + 1 + spare, hard))
        print(json.dumps({"port": port}), flush=True)

    sess = disco.SocketSession(
        2, 1, 1, "127.0.0.1", 0, token="flood", on_listen=on_listen, timeout=60,
        handshake_timeout=5,
    )
    print(json.dumps({"joined": time.time()}), flush=True)
    value = sess.get_global_func("disco.worker_id")().debug_get_from_remote(1)
    print(json.dumps({"worker": value, "rejected": len(sess.channel.rejected)}), flush=True)
    sess.shutdown()
    """
)


@contextlib.contextmanager
def _soft_nofile_at_least(n: int):
    """This process's soft RLIMIT_NOFILE raised to ``n`` (if lower), then restored."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= n:
        yield
        return
    if hard != resource.RLIM_INFINITY and hard < n:
        pytest.skip(f"RLIMIT_NOFILE allows {hard} descriptors; the flood needs {n}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (n, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def _flood(port: int, n: int) -> list[socket.socket]:
    """``n`` connections that never send a byte (connected without waiting)."""
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex((HOST, port))
        socks.append(s)
    return socks


def _line(proc: subprocess.Popen) -> dict:
    line = proc.stdout.readline()
    assert line, f"the controller exited: {proc.wait(5)}"
    return json.loads(line)


@pytest.mark.parametrize("spare_fds", [0, 16], ids=["pending-cap", "emfile"])
def test_controller_flood_of_idle_sockets(spare_fds):
    """1,100 idle sockets: no thread each, no spinning, and a real node still joins at once.

    With 1,024 descriptors the cap on pending handshakes (64) holds them back;
    with only 16 spare descriptors ``accept`` fails with ``EMFILE`` first, and
    the loop drops the oldest pending connection (or pauses) instead of spinning.
    """
    env = dict(os.environ, DISCO_HEARTBEAT_TIMEOUT="5", FLOOD_SPARE_FDS=str(spare_fds))
    proc = subprocess.Popen(
        [sys.executable, "-c", _CONTROLLER],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    agents: list[subprocess.Popen] = []
    try:
        port = _line(proc)["port"]
        time.sleep(0.5)  # the accept loop's thread is up
        base = _threads(proc.pid)
        with _soft_nofile_at_least(N_IDLE + 256):
            idle = _flood(port, N_IDLE)
            try:
                time.sleep(1.0)  # the controller takes them all in
                threads = _threads(proc.pid)
                assert threads <= base + 1, (
                    f"{threads} threads for {N_IDLE} idle sockets (was {base})"
                )
                cpu0 = _cpu_seconds(proc.pid)
                time.sleep(2.0)
                cpu = _cpu_seconds(proc.pid) - cpu0
                assert cpu < 0.2, (
                    f"the controller used {cpu:.2f} s of CPU in 2 s holding idle sockets"
                )
                t0 = time.time()
                agents = start_local_agents(HOST, port, 1, 1, token="flood")
                joined = _line(proc)["joined"]
                took = joined - t0
                print(f"a node joined {took * 1000:.0f} ms after its agent started")
                # the agent's own start (interpreter, imports, one worker process) included
                assert took < 4.0, f"a node took {took:.2f} s to join during the flood"
            finally:
                for s in idle:
                    s.close()
        done = _line(proc)
        assert done["worker"] == 1
        assert done["rejected"] >= 1  # the idle ones, dropped for room or at their deadline
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        for a in agents:
            if a.poll() is None:
                a.kill()
        wait_gone([a.pid for a in agents], 10)
        for a in agents:
            a.wait(5)
        proc.stdout.close()


def test_idle_handshakes_time_out_and_pending_is_capped(cluster):
    """Idle connections are closed at their deadline or dropped for room; a node joins after."""
    import disco_core as disco

    box: dict = {}

    def flood(host, port):
        idle = [socket.create_connection((host, port), timeout=5) for _ in range(80)]
        t0 = time.monotonic()
        for s in idle:
            s.settimeout(4)
            assert s.recv(1) == b""  # closed: dropped for room, or at its deadline
            s.close()
        box["closed_in"] = time.monotonic() - t0
        cluster.agents.extend(start_local_agents(host, port, 1, 1, token="cap"))

    def on_listen(host, port):  # the accept loop starts once this returns
        threading.Thread(target=flood, args=(host, port), daemon=True).start()

    sess = disco.SocketSession(
        2, 1, 1, HOST, 0, token="cap", on_listen=on_listen, timeout=30, handshake_timeout=1.0
    )
    cluster.sessions.append(sess)
    assert box["closed_in"] < 3.0
    assert sum("no complete handshake" in r for r in sess.channel.rejected) >= 1
    assert sess.get_global_func("disco.worker_id")().debug_get_from_remote(1) == 1


def test_connections_block_without_timeout_once_joined(cluster):
    """The handshake's non-blocking sockets are blocking, without a timeout, once a node joined
    (a timeout left on a reply connection would end an idle worker after it)."""
    sess = cluster.session(2, 2, token="blocking")
    link = sess.channel.nodes[0]
    assert link.data, "this session should have reply connections"
    for conn in [link.sock, *link.data.values()]:
        assert conn.gettimeout() is None
    assert sess.get_global_func("disco.worker_id")().debug_get_from_remote(3) == 3
