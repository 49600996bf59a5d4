"""Threads and descriptors of the tracker process before and after waves of TVM-protocol abuse:
600 idle links (beyond the 512 cap), half magics, half messages, links that die with slots and
requests, RST closes. Authenticated peers must be served throughout."""

import os
import socket
import struct
import time

import disco_rpc as rpc
from disco_rpc import base
from disco_rpc.base import TrackerCode as C

TOKEN = "s3cret"
MAGIC = struct.pack("<i", base.RPC_TRACKER_MAGIC)


def stats(pid):
    return (
        len(os.listdir(f"/proc/{pid}/task")),
        len(os.listdir(f"/proc/{pid}/fd")),
        int([ln for ln in open(f"/proc/{pid}/status") if ln.startswith("VmRSS")][0].split()[1]),
    )


def rst(s):
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


tr = rpc.Tracker(port=9400, port_end=9500, tvm_protocol=True, token=TOKEN, silent=True)
try:
    pid = tr.pid
    port = tr.port
    ts = rpc.connect_tracker("127.0.0.1", port, token=TOKEN)
    ts.summary()
    time.sleep(0.5)
    print("start (threads, fds, rss KiB):", stats(pid))
    for wave in range(3):
        socks = []
        for _ in range(600):  # idle links, beyond the cap
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(MAGIC)
            socks.append(s)
        time.sleep(1)
        t0 = time.monotonic()
        ts.summary()
        a = time.monotonic() - t0
        print(
            f" wave {wave}: 600 idle TVM links: {stats(pid)}; authenticated summary {a * 1e3:.1f} ms"
        )
        for s in socks[:300]:
            rst(s)
        for s in socks[300:]:
            s.close()
        socks = []
        for i in range(200):  # half magic, half message, slots+requests then RST
            s = socket.create_connection(("127.0.0.1", port))
            if i % 4 == 0:
                s.sendall(MAGIC[:2])
            elif i % 4 == 1:
                s.sendall(MAGIC + struct.pack("<i", 100) + b"[1,")
            elif i % 4 == 2:
                s.sendall(MAGIC)
                base.recvall(s, 4)
                base.sendjson(s, [C.PUT, f"k{i}", [9000, "m"], None])
                base.recvjson(s)
                for _ in range(16):
                    base.sendjson(s, [C.REQUEST, f"q{i % 7}", "", i])
            else:
                s.sendall(b"\x71")
            socks.append(s)
        time.sleep(0.5)
        for j, s in enumerate(socks):
            (rst if j % 2 else socket.socket.close)(s)
        time.sleep(1.5)
        print(
            f" wave {wave} closed: {stats(pid)}; queue_info keys left: {len(ts.summary()['queue_info'])}"
        )
    time.sleep(11)  # handshake / message timeouts
    print("end:", stats(pid))
finally:
    tr.terminate()
