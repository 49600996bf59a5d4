"""Malformed TVM-protocol messages against Tracker(tvm_protocol=True): each should close
only its own connection, without a traceback in the tracker, and the tracker keeps serving
both protocols. Also shows what an unauthenticated TVM peer learns from SUMMARY."""

import json
import socket
import struct
import time

import disco_rpc as rpc
from disco_rpc import base
from disco_rpc.base import TrackerCode as C

TOKEN = "s3cret"


def conn(port):
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(struct.pack("<i", base.RPC_TRACKER_MAGIC))
    assert len(base.recvall(s, 4)) == 4
    return s


def raw(port, body: bytes):
    s = conn(port)
    s.sendall(struct.pack("<i", len(body)) + body)
    s.settimeout(3)
    try:
        d = s.recv(100)
        return "closed" if d == b"" else f"answered {d[:40]!r}"
    except TimeoutError:
        return "STILL OPEN (no answer)"
    except ConnectionResetError:
        return "reset"
    finally:
        s.close()


tr = rpc.Tracker(port=9400, port_end=9500, tvm_protocol=True, token=TOKEN)
try:
    port = tr.port
    srv = rpc.Server(
        port=9600, port_end=9700, tracker_addr=("127.0.0.1", port), key="secret-gpu", token=TOKEN
    )
    cases = {
        "deep nesting": b"[" * 900000 + b"]" * 10,
        "non-utf8": b'[6, "\xff\xfe"]',
        "huge int priority": json.dumps([C.REQUEST, "k", "u", 10**400]).encode(),
        "huge int code": b"[" + b"9" * 5000 + b"]",
        "int key PUT": json.dumps([C.PUT, 5, [9000, "m"], None]).encode(),
        "dict key numbers": b'[5, {"1": 2, "key": 3}]',
        "NaN priority": b'[4, "k", "u", NaN]',
        "bool port": json.dumps([C.PUT, "k", [True, "m"], None]).encode(),
        "neg code": b"[-5]",
        "float code": b"[1.0]",
        "empty list": b"[]",
        "string": b'"x"',
        "addr wrong": json.dumps([C.UPDATE_INFO, {"addr": "nope"}]).encode(),
        "put short": json.dumps([C.PUT, "k"]).encode(),
        "request short": json.dumps([C.REQUEST, "k"]).encode(),
        "big string number": b'[4, "k", "u", 1' + b"0" * 4500 + b"]",
    }
    for name, body in cases.items():
        print(f"{name:20s} -> {raw(port, body)}")
    for size in (0, -1, 1 << 21, 2**31 - 1):
        s = conn(port)
        s.sendall(struct.pack("<i", size))
        s.settimeout(3)
        try:
            r = "closed" if s.recv(10) == b"" else "answered"
        except TimeoutError:
            r = "STILL OPEN"
        except ConnectionResetError:
            r = "reset"
        print(f"size {size:<12d} -> {r}")
        s.close()
    # negative priority is a valid number: it should queue
    s = conn(port)
    base.sendjson(s, [C.REQUEST, "k", "u", -1e308])
    s.settimeout(0.5)
    try:
        s.recv(1)
        print("neg priority: answered?!")
    except TimeoutError:
        print("neg priority: queued (ok)")
    s.close()
    # what does an unauthenticated TVM peer learn?
    s = conn(port)
    print("TVM SUMMARY (no token):", json.dumps(base.sendjson(s, [C.SUMMARY]) or base.recvjson(s)))
    base.sendjson(s, [C.REQUEST, "secret-gpu", "u", 1])
    s.settimeout(1.5)
    try:
        print("REQUEST secret-gpu answered:", s.recv(100))
    except TimeoutError:
        print("REQUEST secret-gpu: waits (not matched to our server)")
    s.close()
    ts = rpc.connect_tracker("127.0.0.1", port, token=TOKEN)
    t0 = time.monotonic()
    ts.summary()
    print(f"authenticated summary still works: {time.monotonic() - t0:.3f} s")
    srv.terminate()
finally:
    tr.terminate()
