"""What a TVM-protocol peer without the token learns and changes through SUMMARY.

1. It reads the address, key and session state of every token-protected server
   (this project's protocol needs the tracker token for the same summary).
2. It inflates the counts this project's clients see for their own key (queue_info
   merges both worlds), e.g. the pool_text in RPCRequestTimeoutError, and lists a fake
   "server:<our key>" at an address of its choice.
It is never matched to our server (the REQUEST waits), nor sees a ticket.
"""

import json
import socket
import struct

import disco_rpc as rpc
from disco_rpc import base
from disco_rpc.base import TrackerCode as C
from disco_rpc.errors import RPCRequestTimeoutError

TOKEN = "s3cret"


def conn(port):
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(struct.pack("<i", base.RPC_TRACKER_MAGIC))
    base.recvall(s, 4)
    return s


tr = rpc.Tracker(port=9400, port_end=9500, tvm_protocol=True, token=TOKEN, silent=True)
try:
    srv = rpc.Server(
        port=9600, port_end=9700, tracker_addr=("127.0.0.1", tr.port), key="secret-gpu", token=TOKEN
    )
    ts = rpc.connect_tracker("127.0.0.1", tr.port, token=TOKEN)
    sess = ts.request("secret-gpu", session_timeout=30)
    s = conn(tr.port)
    base.sendjson(s, [C.SUMMARY])
    print("1. TVM peer, no token, SUMMARY:", json.dumps(base.recvjson(s)))
    base.sendjson(s, [C.UPDATE_INFO, {"key": "server:secret-gpu", "addr": ["203.0.113.7", 9090]}])
    base.recvjson(s)
    for i in range(64):
        base.sendjson(s, [C.PUT, "secret-gpu", [9090, f"x{i}"], "203.0.113.7"])
        base.recvjson(s)
    try:
        ts.request("secret-gpu", wait_timeout=1)
    except RPCRequestTimeoutError as e:
        print("2. our client's timeout message:", e)
    print("   our summary for our key:", ts.summary()["queue_info"]["secret-gpu"])
    s.close()
    sess.close()
    srv.terminate()
finally:
    tr.terminate()
