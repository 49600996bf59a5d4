"""Helpers of disco-socket's tests (a uniquely named module: the core has its own conftest)."""

from __future__ import annotations

import subprocess
import sys

import disco_core as disco
from disco_core.testing import procfs
from disco_socket import start_local_agents

HOST = "127.0.0.1"


pid_gone = procfs.gone
wait_gone = procfs.wait_gone


def children_of(pid: int) -> list[int]:
    return sorted(procfs.children_of(pid))


def agent_cmd(host: str, port: int, workers: int, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "disco_socket",
        "join",
        host,
        str(port),
        "--workers",
        str(workers),
        *extra,
    ]


class Cluster:
    """Sessions plus the agent processes started for them; everything is reaped at the end."""

    def __init__(self) -> None:
        self.agents: list[subprocess.Popen] = []
        self.sessions: list[disco.Session] = []

    def session(
        self,
        num_nodes: int,
        per_node: int,
        num_groups: int = 1,
        token: str | None = None,
        timeout: float = 30.0,
        agent_args: tuple = (),
        **options,
    ) -> disco.Session:
        started: list[subprocess.Popen] = []

        def on_listen(host: str, port: int) -> None:
            started.extend(
                start_local_agents(
                    host, port, num_nodes - 1, per_node, token=token, extra_args=("-q", *agent_args)
                )
            )

        try:
            sess = disco.SocketSession(
                num_nodes, per_node, num_groups, HOST, 0,
                on_listen=on_listen, timeout=timeout, token=token, **options,
            )  # fmt: skip
        finally:
            self.agents.extend(started)
        sess.agents = started  # type: ignore[attr-defined]
        self.sessions.append(sess)
        return sess

    def close(self) -> None:
        for sess in self.sessions:
            sess.shutdown()
        for p in self.agents:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def layout(num_workers: int, per_node: int) -> tuple[int, int]:
    """Nodes and workers per node for a kit session of ``num_workers``."""
    if num_workers % per_node == 0 and num_workers // per_node > 1:
        return num_workers // per_node, per_node
    return num_workers, 1
