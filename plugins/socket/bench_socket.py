"""disco-socket benchmark: a 2-node loopback SocketSession beside a ProcessSession.

Measures, in one run:

* round trip ``call_packed`` + ``sync_worker_0`` (µs; best of 3 runs of 2000: one
  run's mean moved by 2x between runs on a 2-vCPU VM, with where the scheduler put
  the processes);
* remote round trip: ``call_packed`` on every worker, then ``debug_get_from_remote``
  of its small result from worker 2 (µs; best of 3 runs of 2000);
* copy bandwidth ``copy_to_worker_0`` + ``copy_from_worker_0`` (worker 0 is in the
  controller's process in both sessions);
* ``debug_get_from_remote`` of a 64 MiB array from worker 2: a worker on the remote
  node for the socket session (socket + agent relay), a child process for the
  process session (pipe);
* 64 MiB sent to every worker as a ``call_packed`` argument;
* raw loopback TCP bandwidth (one process ``sendall``, another ``recv_into``), the
  yardstick the remote ``debug_get_from_remote`` is compared against.

The socket session runs twice: without a token (plain records, ``splice``) and
with one (every record sealed, see the README's Security section).

Everything runs in each CPU placement of ``bench/_placement.py`` (unpinned;
everything on one CPU; the controller on one CPU and every worker and agent on
the others): a ratio measured in one placement only is not a result.

Usage: ``python bench_socket.py [--mib 64] [--repeat 5] [--placements unpinned,one-cpu,split] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import sys
import time
import warnings

import numpy as np

import disco_core as disco
from disco_socket import start_local_agents

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
from _placement import PLACEMENTS, Placement, load_average, placements  # noqa: E402


def _best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _sender(port: int, nbytes: int, rounds: int) -> None:
    data = np.ones(nbytes, np.uint8)
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(rounds):
            s.sendall(memoryview(data))
            s.recv(1)  # the receiver's go-ahead: one transfer at a time, like a reply


def raw_loopback_bandwidth(nbytes: int, rounds: int, place: Placement) -> float:
    """Best GB/s of one ``nbytes`` transfer between two processes over loopback TCP
    (the sender where ``place`` puts workers, the receiver where the controller is)."""
    with socket.create_server(("127.0.0.1", 0)) as srv:
        port = srv.getsockname()[1]
        proc = mp.get_context("spawn").Process(target=_sender, args=(port, nbytes, rounds))
        with place.spawning():
            proc.start()
        conn, _ = srv.accept()
        buf = bytearray(nbytes)
        view = memoryview(buf)
        best = float("inf")
        with conn:
            for _ in range(rounds):
                t0 = time.perf_counter()
                got = 0
                while got < nbytes:
                    got += conn.recv_into(view[got:])
                best = min(best, time.perf_counter() - t0)
                conn.sendall(b"k")
        proc.join()
    return nbytes / best / 1e9


def bench_session(name: str, sess: disco.Session, nbytes: int, repeat: int) -> dict:
    sess.import_python_module("disco_core.testing.funcs")
    out: dict = {"session": name}
    echo = sess.get_global_func("testing.echo")
    for _ in range(200):  # warm up
        echo(1)
        sess.sync_worker_0()
    n = 2000
    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        for i in range(n):
            echo(i)
            sess.sync_worker_0()
        runs.append((time.perf_counter() - t0) / n * 1e6)
    out["round_trip_us"] = min(runs)
    for i in range(200):
        echo(i).debug_get_from_remote(2)
    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        for i in range(n):
            echo(i).debug_get_from_remote(2)
        runs.append((time.perf_counter() - t0) / n * 1e6)
    out["remote_round_trip_us"] = min(runs)

    host = np.random.default_rng(0).standard_normal(nbytes // 8)
    back = np.empty_like(host)
    ref = sess.copy_to_worker_0(host)
    t_to = _best(lambda: sess.copy_to_worker_0(host, ref), repeat)
    t_from = _best(lambda: sess.copy_from_worker_0(back, ref), repeat)
    assert np.array_equal(back, host)
    out["copy_to_worker0_GBps"] = nbytes / t_to / 1e9
    out["copy_from_worker0_GBps"] = nbytes / t_from / 1e9

    remote = echo(host)  # every worker holds its own copy
    w = 2
    got = remote.debug_get_from_remote(w)
    assert np.array_equal(got, host)
    del got
    t_get = _best(lambda: remote.debug_get_from_remote(w), repeat)
    out[f"debug_get_worker{w}_GBps"] = nbytes / t_get / 1e9

    checksum = sess.get_global_func("testing.checksum")

    def send_all() -> None:
        done = checksum(echo(host))
        for k in range(sess.num_workers):
            done.debug_get_from_remote(k)

    t_bcast = _best(send_all, repeat)
    out["call_packed_64MiB_to_all_GBps_per_worker"] = nbytes / t_bcast / 1e9
    return out


def bench_placement(place: Placement, nbytes: int, repeat: int) -> dict:
    """Every session's figures and the raw loopback bandwidth, in one placement."""
    results = []
    with place:
        with place.spawning():
            sess = disco.ProcessSession(4)
        with sess:
            results.append(bench_session("process (4 workers)", sess, nbytes, repeat))
        for token, name in ((None, "socket (2x2, loopback)"), ("bench", "socket + token (sealed)")):
            agents: list = []
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # loopback without a token
                with place.spawning():  # the local workers and the agent's, where workers go
                    sess = disco.SocketSession(
                        2,
                        2,
                        1,
                        "127.0.0.1",
                        0,
                        token=token,
                        on_listen=lambda h, p, t=token, a=agents: a.extend(
                            start_local_agents(h, p, 1, 2, token=t, extra_args=("-q",))
                        ),
                    )
                with sess:
                    results.append(bench_session(name, sess, nbytes, repeat))
            for a in agents:
                a.wait(10)
        raw = raw_loopback_bandwidth(nbytes, repeat, place)
    return {"sessions": results, "raw_loopback_GBps": raw}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--placements", default=",".join(PLACEMENTS), help="comma-separated")
    p.add_argument("--json", help="write the results here too")
    args = p.parse_args()
    nbytes = args.mib << 20
    print(f"bench_socket: {os.cpu_count()} CPUs; {load_average()}; {args.mib} MiB")
    out = {}
    for place in placements(args.placements.split(",")):
        got = bench_placement(place, nbytes, args.repeat)
        out[place.name] = got
        results, raw = got["sessions"], got["raw_loopback_GBps"]
        keys = [k for k in results[0] if k != "session"]
        width = max(len(k) for k in keys) + 2
        print(f"\n== {place.describe()}; {load_average()}")
        print(f"{'':{width}}" + "".join(f"{r['session']:>26}" for r in results))
        for k in keys:
            print(f"{k:{width}}" + "".join(f"{r[k]:>26.3f}" for r in results))
        ratio = results[1]["debug_get_worker2_GBps"] / raw
        got["ratio"] = ratio
        print(f"raw loopback TCP bandwidth ({args.mib} MiB, best of {args.repeat}): {raw:.3f} GB/s")
        print(
            f"socket debug_get_from_remote(worker on the remote node), {args.mib} MiB: "
            f"{results[1]['debug_get_worker2_GBps']:.3f} GB/s = {ratio:.2f} x raw loopback "
            f"({'meets' if ratio >= 0.5 else 'BELOW'} the 0.5 x target)"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
