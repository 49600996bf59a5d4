"""Benchmark disco-rpc beside raw loopback TCP and, when installed, TVM's RPC.

    python plugins/rpc/bench_rpc.py [--mib 64] [--calls 5000] [--token T] [--json out.json]

``--token`` runs disco-rpc with a token: a mutual proof at connect, then every
frame sealed (a 16-byte tag per record); compare with a run without it.

TVM is run from ``/work/main/.venv-bench`` (or ``$TVM_PYTHON``) in a child process,
in the same run, with the same sizes.

Every comparison runs in three CPU placements (``bench/_placement.py``): unpinned;
client and server on one CPU; client on CPU 0 and the server process (and the
session processes it forks) on the others. The server is started while this
process sits on the server's CPUs, so it inherits them; TVM's child does the same
for its own server. Each placement prints the floor (one-byte ping-pong over
loopback TCP between two processes, a bare request/reply in plain Python over
it, and a prototype of a lean call lane with disco-rpc's own frames; memcpy; the raw stream into fresh memory,
where a download lands, and into a file, where an upload lands) and the load
average.

Targets, met only when met in every placement: call round trip <= TVM's
and < 100 us; 64 MiB upload and download >= 0.9x the raw loopback stream;
tensor copies >= 1 GB/s and >= half the stream; connect < 10 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import textwrap
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
from _placement import PLACEMENTS, Placement, floor, forked_peer, load_average, placements  # noqa: E402

from disco_core.net.io import unfilled_bytearray  # noqa: E402  (the fresh floor: as a download allocates)

BENCH_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench")


def bare_request_reply(calls: int, place: Placement) -> float:
    """Median seconds of a request/reply in plain Python over loopback TCP between two
    processes: a 16-byte ``struct`` head carrying a function number and an integer,
    a dict lookup and the call (``x + 1``) in the other process, the reply's head
    back (``sendall`` and ``recv_into`` on each side). What Python itself costs for
    an RPC, without anything a real one needs (a codec, handles, errors, locks,
    liveness, interrupts, limits): the floor a Python call path can approach.
    """
    head = struct.Struct("<BBHIQ")  # kind, op, flags, function, argument

    def serve(c: socket.socket) -> None:
        funcs = {7: lambda x: x + 1}
        buf = bytearray(1 << 16)
        view = memoryview(buf)
        while c.recv_into(view):
            _kind, op, _flags, func, arg = head.unpack_from(buf, 0)
            c.sendall(head.pack(2, op, 0, 0, funcs[func](arg)))

    def call(conn: socket.socket, view: memoryview, i: int) -> None:
        conn.sendall(head.pack(1, 3, 0, 7, i))
        conn.recv_into(view)
        if head.unpack_from(view, 0)[4] != i + 1:
            raise AssertionError("the bare request/reply loop lost step")

    return _median_round_trip(place, serve, call, calls)


def _median_round_trip(place: Placement, serve: Any, call: Any, calls: int) -> float:
    """Median seconds of ``call(conn, view, i)`` (one round trip, its answer checked)
    with a peer forked where ``place`` puts the workers, running ``serve(its socket)``;
    the first tenth of the calls warms up."""
    conn, pid = forked_peer(place, serve)
    view = memoryview(bytearray(1 << 16))
    times = []
    try:
        for i in range(calls):
            t0 = time.perf_counter()
            call(conn, view, i)
            times.append(time.perf_counter() - t0)
    finally:
        conn.close()
        os.waitpid(pid, 0)
    return statistics.median(times[calls // 10 :])


def lean_call_lane(calls: int, place: Placement) -> float:
    """Median seconds of a call over a prototype lean lane: disco-rpc's own frames (the
    request's bytes are what ``wire.encode_call`` makes, checked), built from a cached
    prefix; a client with a lock and the flags a real lane keeps (closed, in step);
    a server that checks the prefix, looks the handle up, calls, and answers an int.
    No codec beyond ints, no errors, no liveness: what a fast lane for plain calls
    could reach, above the bare request/reply (not part of disco-rpc).
    """
    import threading

    from disco_rpc import wire
    from disco_rpc.protocol import FRAME_HEAD, OP_CALL, REPLY, REQUEST

    ti, tq = struct.Struct("<BI"), struct.Struct("<Bq")
    fn = wire.HandleRef(wire.HandleRef.FUNC, 7)
    prefix = bytes(wire.encode_call(fn, ())[0])[:-5]  # the call's bytes up to its args
    hs = FRAME_HEAD.size

    def request(args: tuple) -> bytearray:
        meta = bytearray(prefix)
        meta += ti.pack(wire.T_TUPLE, len(args))
        for x in args:
            meta += tq.pack(wire.T_INT, x)
        return meta

    if bytes(request((5,))) != bytes(wire.encode_call(fn, (5,))[0]):
        raise AssertionError("the lean lane's request is not disco-rpc's")

    def serve(c: socket.socket) -> None:
        funcs = {7: lambda x: x + 1}
        buf = bytearray(1 << 16)
        view = memoryview(buf)
        hid_at = hs + len(prefix) - 9
        while c.recv_into(view):
            _kind, op, _flags, _mlen, nbuf = FRAME_HEAD.unpack_from(buf, 0)
            if nbuf or buf[hs : hs + len(prefix) - 9] != prefix[:-9]:
                raise AssertionError("not a plain call")
            hid = struct.unpack_from("<Q", buf, hid_at)[0]
            n = ti.unpack_from(buf, hs + len(prefix))[1]
            at = hs + len(prefix) + 5
            args = [tq.unpack_from(buf, at + 9 * i)[1] for i in range(n)]
            c.sendall(FRAME_HEAD.pack(REPLY, op, 0, 9, 0) + tq.pack(wire.T_INT, funcs[hid](*args)))

    lock = threading.Lock()
    state = {"closed": False, "in_step": True}

    def call(conn: socket.socket, view: memoryview, i: int) -> None:
        if state["closed"]:
            raise AssertionError("closed")
        with lock:
            meta = request((i,))
            state["in_step"] = False
            conn.sendall(FRAME_HEAD.pack(REQUEST, OP_CALL, 0, len(meta), 0) + meta)
            n = conn.recv_into(view)
            kind, op, _f, mlen, nbuf = FRAME_HEAD.unpack_from(view, 0)
            if n != hs + mlen or kind != REPLY or op != OP_CALL or nbuf or view[hs] != wire.T_INT:  # fmt: skip
                raise AssertionError("not a plain reply")
            state["in_step"] = True
            value = tq.unpack_from(view, hs)[1]
        if value != i + 1:
            raise AssertionError("the lean lane lost step")

    return _median_round_trip(place, serve, call, calls)


def raw_loopback(
    nbytes: int,
    reps: int,
    place: Placement,
    fresh: bool = False,
    to_file: bool = False,
    from_file: bool = False,
) -> float:
    """GB/s of one ``sendall`` of ``nbytes`` to another process over 127.0.0.1 (best of reps).

    ``fresh``: the receiver reads each time into a new buffer, as a download that
    returns new memory must (on some VMs the first touch of fresh pages costs more
    than the copy itself), made as a download makes its own (no zeros written,
    huge pages asked for: ``unfilled_bytearray``) and only once the sender's first
    bytes have come, so the time includes it (until 2026-11-27 it was made while the
    sender still read the last reply, outside the time: the floor then read a stream
    into memory made beforehand); otherwise into one buffer, reused. ``to_file``: the
    receiver writes what it reads (1 MiB at a time, one reused buffer) into a new
    file in the temporary folder, where an upload lands: the page cache's own cost,
    the floor of an upload. ``from_file``: the sender ``sendfile``s from a file in the
    page cache, as a server sending a download does (with ``fresh``: a download's own
    floor, from the server's file into the client's new memory).
    """

    def receive(c: socket.socket) -> None:
        view = memoryview(bytearray(min(nbytes, 1 << 20) if to_file else nbytes))
        probe = memoryview(bytearray(1 << 16))
        for _ in range(reps):
            got = 0
            if fresh:
                # made once the first bytes came (the sender's time has started)
                got = c.recv_into(probe)
                view = memoryview(unfilled_bytearray(nbytes))
                view[:got] = probe[:got]
            if to_file:
                with tempfile.TemporaryFile() as f:
                    while got < nbytes:
                        k = c.recv_into(view[: nbytes - got])
                        f.write(view[:k])
                        got += k
                    f.flush()
                    c.sendall(b"k")
                continue
            while got < nbytes:
                got += c.recv_into(view[got:])
            c.sendall(b"k")

    conn, pid = forked_peer(place, receive)
    data = np.random.bytes(nbytes)
    source = None
    if from_file:
        source = tempfile.TemporaryFile()
        source.write(data)
        source.flush()
        os.pread(source.fileno(), nbytes, 0)  # (in the page cache, as a file just uploaded)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        if source is None:
            conn.sendall(data)
        else:
            sent = 0
            while sent < nbytes:
                sent += os.sendfile(conn.fileno(), source.fileno(), sent, nbytes - sent)
        conn.recv(1)
        best = min(best, time.perf_counter() - t)
    if source is not None:
        source.close()
    conn.close()
    os.waitpid(pid, 0)
    return nbytes / best / 1e9


def _best(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def bench_disco(
    nbytes: int, calls: int, reps: int, place: Placement, token: str | None = None
) -> dict:
    import disco_core as disco
    import disco_rpc as rpc

    disco.register_func("bench.addone", lambda a: a + 1, override=True)
    with place.spawning():
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
    sys.path.insert(0, sys.argv[5])
    from _placement import Placement
    place = Placement(sys.argv[4])
    place.__enter__()

    def best(fn):
        b = float("inf")
        for _ in range(reps):
            t = time.perf_counter(); fn(); b = min(b, time.perf_counter() - t)
        return b

    with place.spawning():
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


def bench_tvm(nbytes: int, calls: int, reps: int, place: Placement) -> dict | None:
    py = os.environ.get("TVM_PYTHON") or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "..", ".venv-bench", "bin", "python"
    )
    if not os.path.exists(py):
        return None
    try:
        r = subprocess.run(
            [py, "-c", TVM_SCRIPT, str(nbytes), str(calls), str(reps), place.name, BENCH_DIR],
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


ROWS = [
    ("connect", "connect_ms", "ms"),
    ("call round trip (median)", "call_us", "us"),
    ("upload", "upload_GBps", "GB/s"),
    ("download", "download_GBps", "GB/s"),
    ("tensor to remote", "tensor_to_GBps", "GB/s"),
    ("tensor.numpy()", "tensor_from_GBps", "GB/s"),
    ("tensor.copyfrom", "copyfrom_GBps", "GB/s"),
]


def targets(raw: float, ours: dict, tvm: dict | None) -> list[tuple[str, float | None, bool]]:
    """The targets, checked in one placement: (label, value, met)."""
    out: list[tuple[str, float | None, bool]] = []
    if tvm is not None:
        r = ours["call_us"] / tvm["call_us"]
        out.append(("call round trip <= 1.0x TVM (ours/TVM)", r, r <= 1.0))
    out.append(("call round trip < 100 us", ours["call_us"], ours["call_us"] < 100))
    for key, label in (("upload_GBps", "upload"), ("download_GBps", "download")):
        r = ours[key] / raw
        out.append((f"{label} >= 0.9x the loopback stream", r, r >= 0.9))
    for key in ("tensor_to_GBps", "tensor_from_GBps", "copyfrom_GBps"):
        v = ours[key]
        out.append((f"{key[:-5]} >= 1 GB/s and >= 0.5x stream", v, v >= 1.0 and v >= raw / 2))
    out.append(("connect < 10 ms", ours["connect_ms"], ours["connect_ms"] < 10))
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--calls", type=int, default=5000)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--no-tvm", action="store_true")
    p.add_argument("--json", default=None)
    p.add_argument("--token", default=None, help="run disco-rpc with this token (sealed frames)")
    p.add_argument("--placements", default=",".join(PLACEMENTS), help="comma-separated")
    a = p.parse_args()
    nbytes = a.mib << 20
    print(f"bench_rpc: {os.cpu_count()} CPUs; {load_average()}; {a.mib} MiB; ", end="")
    print("disco-rpc " + ("with a token: sealed frames" if a.token else "without a token"))
    results = {}
    for place in placements(a.placements.split(",")):
        with place:
            fl = floor(place, 1000)
            fl["bare_rpc_s"] = bare_request_reply(max(a.calls, 2000), place)
            fl["lean_rpc_s"] = lean_call_lane(max(a.calls, 2000), place)
            load = os.getloadavg()[0]
            raw = raw_loopback(nbytes, a.reps, place)
            raw_fresh = raw_loopback(nbytes, a.reps, place, fresh=True)
            raw_file_fresh = raw_loopback(nbytes, a.reps, place, fresh=True, from_file=True)
            raw_file = raw_loopback(nbytes, a.reps, place, to_file=True)
            ours = bench_disco(nbytes, a.calls, a.reps, place, a.token)
        # TVM's child pins itself the same way (it starts from every CPU)
        tvm = None if a.no_tvm else bench_tvm(nbytes, a.calls, a.reps, place)
        results[place.name] = dict(
            raw=raw,
            raw_fresh=raw_fresh,
            raw_file_fresh=raw_file_fresh,
            raw_file=raw_file,
            ours=ours,
            tvm=tvm,
            floor=fl,
            load=load,
        )
        print(
            f"\n== {place.describe()}: load {load:.2f}; floor: socket ping-pong "
            f"{fl['socket_rt_s'] * 1e6:.1f} us, bare Python request/reply "
            f"{fl['bare_rpc_s'] * 1e6:.1f} us, a lean call lane's prototype with our frames "
            f"{fl['lean_rpc_s'] * 1e6:.1f} us, memcpy {fl['memcpy_GBps']:.1f} GB/s; "
            f"raw loopback TCP stream {raw:.2f} GB/s, into fresh memory {raw_fresh:.2f} GB/s "
            f"(download/fresh stream: {ours['download_GBps'] / raw_fresh:.2f}), sendfile from a "
            f"file into fresh memory {raw_file_fresh:.2f} GB/s (download/that stream: "
            f"{ours['download_GBps'] / raw_file_fresh:.2f}), into a file "
            f"{raw_file:.2f} GB/s (upload/file stream: {ours['upload_GBps'] / raw_file:.2f})"
        )
        print(f"{'':28s} {'disco-rpc':>10s} {'tvm.rpc':>10s} {'ours/TVM':>9s} {'ours/stream':>11s}")
        for label, k, unit in ROWS:
            t = tvm[k] if tvm else None
            vs_tvm = f"{ours[k] / t:.2f}" if t else "-"
            vs_raw = f"{ours[k] / raw:.2f}" if unit == "GB/s" else ""
            print(
                f"{label + (f' {a.mib} MiB' if unit == 'GB/s' else ''):28s} {ours[k]:>10.3g} "
                f"{'-' if t is None else f'{t:.3g}':>10s} {vs_tvm:>9s} {vs_raw:>11s}  {unit}"
            )
    checked = {name: targets(r["raw"], r["ours"], r["tvm"]) for name, r in results.items()}
    labels = [c[0] for c in next(iter(checked.values()))]
    print("\n== targets (met = met in every placement)")
    print(f"{'target':48s} " + " ".join(f"{n:>12s}" for n in checked) + "  met")
    all_met = True
    for i, label in enumerate(labels):
        cells, met = [], True
        for name in checked:
            if i >= len(checked[name]) or checked[name][i][0] != label:
                cells.append("-")
                met = False
                continue
            _, v, ok = checked[name][i]
            cells.append(f"{v:.3g}{'' if ok else ' (NO)'}")
            met = met and ok
        all_met = all_met and met
        print(
            f"{label:48s} " + " ".join(f"{c:>12s}" for c in cells) + f"  {'yes' if met else 'NO'}"
        )
    print("all targets met in every placement" if all_met else "targets NOT all met")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"token": bool(a.token), "placements": results}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
