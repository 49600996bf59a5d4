"""Cost of SUMMARY floods from unauthenticated TVM links once they filled the tracker with keys.

Prints the latency an authenticated client sees (its own summary) while N TVM links
pipeline SUMMARY requests and read the replies."""

import socket
import struct
import sys
import threading
import time

import disco_rpc as rpc
from disco_rpc import base
from disco_rpc.base import TrackerCode as C

TOKEN = "s3cret"
NLINKS = int(sys.argv[1]) if len(sys.argv) > 1 else 50


def conn(port):
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(struct.pack("<i", base.RPC_TRACKER_MAGIC))
    base.recvall(s, 4)
    return s


tr = rpc.Tracker(port=9400, port_end=9500, tvm_protocol=True, token=TOKEN, silent=True)
try:
    port = tr.port
    ts = rpc.connect_tracker("127.0.0.1", port, token=TOKEN)

    def lat(n=20):
        xs = []
        for _ in range(n):
            t0 = time.monotonic()
            ts.summary()
            xs.append(time.monotonic() - t0)
        xs.sort()
        return f"median {xs[len(xs) // 2] * 1e3:.1f} ms, max {xs[-1] * 1e3:.1f} ms"

    print("idle:", lat())
    holders = []
    t0 = time.monotonic()
    for i in range(NLINKS):
        s = conn(port)
        for j in range(64):
            base.sendjson(s, [C.PUT, f"{i:03d}{j:02d}" + "k" * 251, [9000, "m"], "h" * 255])
        for _ in range(64):
            base.recvjson(s)
        holders.append(s)
    print(f"{NLINKS * 64} slots put in {time.monotonic() - t0:.1f} s; with them:", lat())
    s = conn(port)
    t0 = time.monotonic()
    base.sendjson(s, [C.SUMMARY])
    r = base.recvjson(s)
    print(f"one TVM SUMMARY: {time.monotonic() - t0:.3f} s, truncated={r[1].get('truncated')}")
    stop = threading.Event()

    def flood():
        f = conn(port)
        while not stop.is_set():
            base.sendjson(f, [C.SUMMARY])
            base.recvjson(f)
        f.close()

    ths = [threading.Thread(target=flood, daemon=True) for _ in range(4)]
    for t in ths:
        t.start()
    time.sleep(0.5)
    print("during a 4-link SUMMARY flood:", lat(10))
    stop.set()
    for t in ths:
        t.join(10)
    t0 = time.monotonic()
    for h in holders:
        h.close()
    time.sleep(0.2)
    print("after closing them:", lat())
finally:
    tr.terminate()
