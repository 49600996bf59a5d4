"""Benchmark disco-rpc beside raw loopback TCP and, when installed, TVM's RPC.

    python plugins/rpc/bench_rpc.py [--mib 64] [--calls 5000] [--token T] [--json out.json]

``--token`` runs disco-rpc with a token: a mutual proof at connect, then every
frame sealed (a 16-byte tag per record); compare with a run without it.

TVM is run from ``/work/main/.venv-bench`` (or ``$TVM_PYTHON``) in a child process,
in the same run, with the same sizes. Targets (issue 7): call round trip < 100 us
and <= TVM's; 64 MiB upload/download/tensor copies >= 1 GB/s and >= half the raw
loopback bandwidth; connect < 10 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import textwrap
import time

import numpy as np


def raw_loopback(nbytes: int, reps: int) -> float:
    """GB/s of one ``sendall`` of ``nbytes`` to another process over 127.0.0.1 (best of reps)."""
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(1)
    port = lst.getsockname()[1]
    pid = os.fork()
    if pid == 0:
        try:
            lst.close()
            c = socket.create_connection(("127.0.0.1", port))
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            buf = bytearray(nbytes)
            view = memoryview(buf)
            for _ in range(reps):
                got = 0
                while got < nbytes:
                    got += c.recv_into(view[got:])
                c.sendall(b"k")
        finally:
            os._exit(0)
    conn, _ = lst.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    data = np.random.bytes(nbytes)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        conn.sendall(data)
        conn.recv(1)
        best = min(best, time.perf_counter() - t)
    conn.close()
    lst.close()
    os.waitpid(pid, 0)
    return nbytes / best / 1e9


def _best(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def bench_disco(nbytes: int, calls: int, reps: int, token: str | None = None) -> dict:
    import disco_core as disco
    import disco_rpc as rpc

    disco.register_func("bench.addone", lambda a: a + 1, override=True)
    srv = rpc.Server(port=9091, port_end=9199, token=token)
    try:
        times = []
        for _ in range(20):
            t = time.perf_counter()
            s = rpc.connect("127.0.0.1", srv.port, token=token)
            times.append(time.perf_counter() - t)
            s.close()
        out = {"connect_ms": statistics.median(times) * 1e3}
        s = rpc.connect("127.0.0.1", srv.port, token=token)
        f = s.get_function("bench.addone")
        for _ in range(200):
            f(1)
        lat = []
        for _ in range(calls):
            t = time.perf_counter()
            f(1)
            lat.append(time.perf_counter() - t)
        out["call_us"] = statistics.median(lat) * 1e6
        blob = np.random.bytes(nbytes)
        out["upload_GBps"] = nbytes / _best(lambda: s.upload(blob, "blob.bin"), reps) / 1e9
        out["download_GBps"] = nbytes / _best(lambda: s.download("blob.bin"), reps) / 1e9
        arr = np.frombuffer(blob, dtype="float32").copy()
        dev = s.cpu(0)
        out["tensor_to_GBps"] = nbytes / _best(lambda: rpc.tensor(arr, device=dev), reps) / 1e9
        x = rpc.tensor(arr, device=dev)
        out["tensor_from_GBps"] = nbytes / _best(x.numpy, reps) / 1e9
        out["copyfrom_GBps"] = nbytes / _best(lambda: x.copyfrom(arr), reps) / 1e9
        s.close()
    finally:
        srv.terminate()
    return out


TVM_SCRIPT = textwrap.dedent(
    """
    import json, statistics, sys, time
    import numpy as np
    import tvm
    from tvm import rpc
    nbytes, calls, reps = map(int, sys.argv[1:4])

    def best(fn):
        b = float("inf")
        for _ in range(reps):
            t = time.perf_counter(); fn(); b = min(b, time.perf_counter() - t)
        return b

    srv = rpc.Server(host="127.0.0.1", port=9300, port_end=9399)
    time.sleep(0.5)
    out = {}
    ts = []
    for _ in range(20):
        t = time.perf_counter(); s = rpc.connect("127.0.0.1", srv.port); ts.append(time.perf_counter() - t)
        del s
    out["connect_ms"] = statistics.median(ts) * 1e3
    s = rpc.connect("127.0.0.1", srv.port)
    f = s.get_function("rpc.test.addone")  # built into TVM's server
    for _ in range(200):
        f(1)
    lat = []
    for _ in range(calls):
        t = time.perf_counter(); f(1); lat.append(time.perf_counter() - t)
    out["call_us"] = statistics.median(lat) * 1e6
    blob = bytearray(np.random.bytes(nbytes))
    out["upload_GBps"] = nbytes / best(lambda: s.upload(blob, "blob.bin")) / 1e9
    out["download_GBps"] = nbytes / best(lambda: s.download("blob.bin")) / 1e9
    arr = np.frombuffer(bytes(blob), dtype="float32").copy()
    dev = s.cpu(0)
    out["tensor_to_GBps"] = nbytes / best(lambda: tvm.runtime.tensor(arr, dev)) / 1e9
    x = tvm.runtime.tensor(arr, dev)
    out["tensor_from_GBps"] = nbytes / best(x.numpy) / 1e9
    out["copyfrom_GBps"] = nbytes / best(lambda: x.copyfrom(arr)) / 1e9
    print("JSON" + json.dumps(out))
    srv.terminate()
    """
)


def bench_tvm(nbytes: int, calls: int, reps: int) -> dict | None:
    py = os.environ.get("TVM_PYTHON") or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "..", ".venv-bench", "bin", "python"
    )
    if not os.path.exists(py):
        return None
    try:
        r = subprocess.run(
            [py, "-c", TVM_SCRIPT, str(nbytes), str(calls), str(reps)],
            capture_output=True,
            text=True,
            timeout=480,
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
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--calls", type=int, default=5000)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--no-tvm", action="store_true")
    p.add_argument("--json", default=None)
    p.add_argument("--token", default=None, help="run disco-rpc with this token (sealed frames)")
    a = p.parse_args()
    nbytes = a.mib << 20
    raw = raw_loopback(nbytes, a.reps)
    ours = bench_disco(nbytes, a.calls, a.reps, a.token)
    tvm = None if a.no_tvm else bench_tvm(nbytes, a.calls, a.reps)
    rows = [
        ("connect", "connect_ms", "ms"),
        ("call round trip (median)", "call_us", "us"),
        (f"upload {a.mib} MiB", "upload_GBps", "GB/s"),
        (f"download {a.mib} MiB", "download_GBps", "GB/s"),
        (f"tensor to remote {a.mib} MiB", "tensor_to_GBps", "GB/s"),
        (f"tensor.numpy() {a.mib} MiB", "tensor_from_GBps", "GB/s"),
        (f"tensor.copyfrom {a.mib} MiB", "copyfrom_GBps", "GB/s"),
    ]
    print(f"raw loopback TCP ({a.mib} MiB, best of {a.reps}): {raw:.2f} GB/s")
    print("disco-rpc " + ("with a token: sealed frames" if a.token else "without a token"))
    print(f"{'':32s} {'disco-rpc':>12s} {'tvm.rpc':>12s}")
    for label, k, unit in rows:
        t = f"{tvm[k]:.3g}" if tvm else "-"
        print(f"{label:32s} {ours[k]:>12.3g} {t:>12s}  {unit}")
    bw_keys = [k for _l, k, u in rows if u == "GB/s"]
    ok = (
        ours["call_us"] < 100
        and ours["connect_ms"] < 10
        and all(ours[k] >= 1.0 and ours[k] >= raw / 2 for k in bw_keys)
        and (tvm is None or ours["call_us"] <= tvm["call_us"])
    )
    print("targets met" if ok else "targets NOT all met")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"raw_loopback_GBps": raw, "token": bool(a.token), "disco_rpc": ours, "tvm": tvm}, f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
