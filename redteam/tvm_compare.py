"""Real TVM servers/clients against our tracker (tvm_protocol=True) or TVM's own tracker.

usage: tvm_compare.py ours|tvm
Scenarios: priorities, session end -> server re-registers, summary while a session runs,
a client killed while waiting, a SIGSTOPped server while a client requests.
"""

import os
import signal
import subprocess
import sys
import threading
import time

from tvm import rpc as trpc

KIND = sys.argv[1]
PY = sys.executable
procs = []


def spawn(*args):
    p = subprocess.Popen(
        [PY, *args], start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    procs.append(p)
    return p


def killall():
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGCONT)
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


tracker = None
try:
    if KIND == "ours":
        import disco_rpc as rpc

        tracker = rpc.Tracker(port=9400, port_end=9500, tvm_protocol=True, silent=True)
        port = tracker.port
    else:
        port = 9510
        spawn("-m", "tvm.exec.rpc_tracker", "--host=127.0.0.1", f"--port={port}", "--port-end=9520")
        time.sleep(2.5)
    srv = spawn(
        "-m",
        "tvm.exec.rpc_server",
        "--host=127.0.0.1",
        "--port=9530",
        "--port-end=9560",
        f"--tracker=127.0.0.1:{port}",
        "--key=k",
    )
    ts = trpc.connect_tracker("127.0.0.1", port)
    for _ in range(100):
        if ts.summary()["queue_info"].get("k", {}).get("free"):
            break
        time.sleep(0.1)
    print("summary idle:", ts.summary())
    a = ts.request("k", priority=1, session_timeout=60)
    print("A got a session; echo:", a.get_function("testing.echo")(7))
    print("summary with A in session:", ts.summary())
    order = []

    def waiter(name, prio):
        t = trpc.connect_tracker("127.0.0.1", port)
        s = t.request("k", priority=prio, session_timeout=30)
        order.append(name)
        s.get_function("testing.echo")(1)
        time.sleep(1.0)
        del s

    tb = threading.Thread(target=waiter, args=("B(prio 1)", 1))
    tb.start()
    time.sleep(0.5)
    tc = threading.Thread(target=waiter, args=("C(prio 5)", 5))
    tc.start()
    time.sleep(0.5)
    print("queue while B, C wait:", ts.summary()["queue_info"])
    t0 = time.monotonic()
    del a
    tb.join(60)
    tc.join(60)
    print(f"served order after A ended: {order} ({time.monotonic() - t0:.1f} s)")
    # a waiting client killed: its request must not take the next slot
    w = spawn(
        "-c",
        f"import tvm.rpc as r; s=r.connect_tracker('127.0.0.1',{port}).request('k',priority=9,session_timeout=30); import time; time.sleep(60)",
    )
    time.sleep(3)  # it got the server (free) and holds a session
    print("summary with a client process in session:", ts.summary()["queue_info"])
    w2 = spawn(
        "-c",
        f"import tvm.rpc as r; s=r.connect_tracker('127.0.0.1',{port}).request('k',priority=9); import time; time.sleep(60)",
    )
    time.sleep(3)
    print("queue with a second waiter:", ts.summary()["queue_info"])
    os.killpg(w2.pid, signal.SIGKILL)
    w2.wait()
    time.sleep(0.5)
    print("after killing the waiter:", ts.summary()["queue_info"])
    os.killpg(w.pid, signal.SIGKILL)
    w.wait()
    t0 = time.monotonic()
    for _ in range(200):
        if ts.summary()["queue_info"].get("k", {}).get("free"):
            break
        time.sleep(0.1)
    print(
        f"server free again {time.monotonic() - t0:.1f} s after its client was killed:",
        ts.summary()["queue_info"],
    )
    s = ts.request("k", session_timeout=5)
    print("next request OK:", s.get_function("testing.echo")(3))
    del s
    time.sleep(1.5)
    # SIGSTOP the server, then request
    os.killpg(srv.pid, signal.SIGSTOP)
    time.sleep(0.5)
    res = {}

    def req():
        try:
            t0 = time.monotonic()
            trpc.connect_tracker("127.0.0.1", port).request("k", session_timeout=5)
            res["r"] = f"got a session after {time.monotonic() - t0:.1f} s"
        except Exception as e:
            res["r"] = f"{type(e).__name__}: {str(e)[:100]} after {time.monotonic() - t0:.1f} s"

    th = threading.Thread(target=req, daemon=True)
    th.start()
    th.join(20)
    print("request to a SIGSTOPped server:", res.get("r", "still waiting after 20 s"))
    print("summary while stopped:", ts.summary()["queue_info"])
    os.killpg(srv.pid, signal.SIGCONT)
    th.join(20)
    print("after SIGCONT:", res.get("r", "still waiting"))
    time.sleep(1)
    os.killpg(srv.pid, signal.SIGKILL)
    srv.wait()
    time.sleep(1)
    print("after killing the server:", ts.summary())
finally:
    killall()
    if tracker is not None:
        tracker.terminate()
