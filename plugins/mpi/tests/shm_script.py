"""One scenario of test_mpi_shm.py: ``python shm_script.py MODE``.

Prints ``MAPPED <json>``: every /dev/shm file that the controller and the workers had
mapped while the session ran (``PATH (deleted)`` once its name is gone), so that the
test can check that none of them is left behind.
"""

import json
import os
import signal
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
os.environ["PYTHONPATH"] = os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])

import mpi_test_funcs  # noqa: E402

import disco_core as disco  # noqa: E402

MAPPED: set[str] = set()


def observe(sess) -> dict:
    """Record every member's /dev/shm mappings; return {worker id: pid}."""
    MAPPED.update(mpi_test_funcs.shm_mappings())
    f = sess.call_packed("mpi_test.shm_mappings")
    pids = {}
    for w in range(1, sess.num_workers):
        info = json.loads(f.debug_get_from_remote(w))
        MAPPED.update(info["maps"])
        pids[w] = info["pid"]
    return pids


def work(sess) -> None:
    n = sess.num_workers
    x = sess.broadcast(np.arange(1 << 16, dtype="float32"))
    y = sess.empty((1 << 16,), "float32")
    sess.allreduce(x, y, op="sum", in_group=False)
    got = y.debug_get_from_remote(n - 1)
    assert got[3] == 3 * n, got[:4]


def start(sess: disco.Session) -> dict:
    """The mpi CCL on ``sess``, one allreduce, the segments observed; {worker id: pid}."""
    sess.import_python_module("mpi_test_funcs")
    sess.init_ccl("mpi")
    work(sess)
    return observe(sess)


def process_session(n: int = 2) -> None:
    sess = disco.ProcessSession(n)
    try:
        start(sess)
    finally:
        sess.shutdown()


def killed() -> None:
    sess = disco.ProcessSession(3)
    try:
        pids = start(sess)
        os.kill(pids[2], signal.SIGKILL)
        try:
            for _ in range(50):
                work(sess)
                time.sleep(0.1)
        except disco.DiscoError as exc:
            print("after the kill:", type(exc).__name__)
        else:
            raise SystemExit("no error after a worker was killed")
    finally:
        sess.shutdown()


def socket_session() -> None:
    from disco_socket import start_local_agents

    agents = []
    sess = disco.SocketSession(
        3, 1, 1, "127.0.0.1", 0, timeout=60,
        on_listen=lambda h, p: agents.extend(start_local_agents(h, p, 2, 1, extra_args=("-q",))),
    )  # fmt: skip
    try:
        start(sess)
    finally:
        sess.shutdown()
        for a in agents:
            a.wait(30)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "process":
        process_session()
    elif mode == "loop":
        for _ in range(4):
            process_session(2)
    elif mode == "killed":
        killed()
    elif mode == "socket":
        socket_session()
    else:
        raise SystemExit(f"unknown mode {mode}")
    print("MAPPED " + json.dumps(sorted(MAPPED)), flush=True)
