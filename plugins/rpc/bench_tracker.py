"""Benchmark the disco-rpc tracker beside TVM's (when installed), in the same run.

    python plugins/rpc/bench_tracker.py [--requests 20] [--json out.json]

Measures: tracker start (constructor until a client's summary() answers), and
request() -> usable session (request, then one remote call), median of N. TVM is
run from ``/work/main/.venv-bench`` (or ``$TVM_PYTHON``) in a child process.
Targets: request() under 10 ms; tracker start under 0.5 s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap
import time


def bench_disco(n: int) -> dict:
    import disco_core as disco
    import disco_rpc as rpc

    disco.register_func("bench.pid", os.getpid, override=True)
    starts = []
    for _ in range(5):
        t = time.perf_counter()
        tr = rpc.Tracker(port=9190, port_end=9290, silent=True)
        ts = rpc.connect_tracker("127.0.0.1", tr.port)
        ts.summary()
        starts.append(time.perf_counter() - t)
        ts.close()
        tr.terminate()
    tr = rpc.Tracker(port=9190, port_end=9290, silent=True)
    srvs = [
        rpc.Server(port=9091, port_end=9190, tracker_addr=tr.addr, key="bench") for _ in range(2)
    ]
    ts = rpc.connect_tracker("127.0.0.1", tr.port)
    lat = []
    try:
        for _ in range(n):
            t = time.perf_counter()
            s = ts.request("bench")
            s.get_function("bench.pid")()
            lat.append(time.perf_counter() - t)
            s.close()
    finally:
        ts.close()
        for s in srvs:
            s.terminate()
        tr.terminate()
    return {
        "tracker_start_ms": statistics.median(starts) * 1e3,
        "request_ms": statistics.median(lat) * 1e3,
    }


TVM_SCRIPT = textwrap.dedent(
    """
    import json, statistics, sys, time
    from tvm import rpc
    from tvm.rpc.tracker import Tracker
    n = int(sys.argv[1])
    starts = []
    for _ in range(3):
        t = time.perf_counter()
        tr = Tracker(port=9390, port_end=9490, silent=True)
        while True:
            try:
                ts = rpc.connect_tracker("127.0.0.1", tr.port); ts.summary(); break
            except Exception:
                time.sleep(0.005)
        starts.append(time.perf_counter() - t)
        del ts
        tr.terminate()
    tr = Tracker(port=9390, port_end=9490, silent=True)
    srvs = [rpc.Server(port=9491, port_end=9590, tracker_addr=("127.0.0.1", tr.port), key="bench", silent=True) for _ in range(2)]
    ts = rpc.connect_tracker("127.0.0.1", tr.port)
    deadline = time.time() + 20
    while ts.summary()["queue_info"].get("bench", {}).get("free", 0) < 2 and time.time() < deadline:
        time.sleep(0.05)
    lat = []
    for _ in range(n):
        t = time.perf_counter()
        s = ts.request("bench")
        s.get_function("rpc.test.addone")(1)
        lat.append(time.perf_counter() - t)
        del s
        time.sleep(0.05)
    print("JSON" + json.dumps({"tracker_start_ms": statistics.median(starts) * 1e3, "request_ms": statistics.median(lat) * 1e3}))
    for s in srvs:
        s.terminate()
    tr.terminate()
    """
)


def bench_tvm(n: int) -> dict | None:
    py = os.environ.get("TVM_PYTHON") or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "..", ".venv-bench", "bin", "python"
    )
    if not os.path.exists(py):
        return None
    try:
        r = subprocess.run(
            [py, "-c", TVM_SCRIPT, str(n)], capture_output=True, text=True, timeout=300
        )
    except subprocess.TimeoutExpired:
        print("(TVM run timed out)", file=sys.stderr)
        return None
    for line in r.stdout.splitlines():
        if line.startswith("JSON"):
            return json.loads(line[4:])
    print(f"(TVM run failed: {r.stderr.strip()[-400:]})", file=sys.stderr)
    return None


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--no-tvm", action="store_true")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    ours = bench_disco(a.requests)
    tvm = None if a.no_tvm else bench_tvm(a.requests)
    print(f"{'':34s} {'disco-rpc':>10s} {'tvm.rpc':>10s}")
    for label, k in [
        ("tracker start (ms)", "tracker_start_ms"),
        ("request() -> usable session (ms)", "request_ms"),
    ]:
        t = f"{tvm[k]:.3g}" if tvm else "-"
        print(f"{label:34s} {ours[k]:>10.3g} {t:>10s}")
    ok = ours["request_ms"] < 10 and ours["tracker_start_ms"] < 500
    verdict = "met" if ok else "NOT all met"
    print(f"targets (request() -> usable session < 10 ms, tracker start < 500 ms): {verdict}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"disco_rpc": ours, "tvm": tvm}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
