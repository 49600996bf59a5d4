"""The disco-rpc protocol's numbers, on the Python standard library alone.

One definition shared by every part that speaks the protocol: the full server
and its client (:mod:`disco_rpc.wire`, :mod:`disco_rpc.handler`), the tracker,
the proxy, the ``"rpc"`` Disco channel and the minimal server
(:mod:`disco_rpc.minrpc_server`, which imports this file and nothing outside the
standard library, and is shipped with it beside it in the zipapps of
:func:`disco_rpc.with_minrpc`). As TVM's ``rpc_reference.h`` and ``base.py``.

A frame is a head ``<BBHII``: kind, operation, flags, length of its meta (the
encoded value) and number of out-of-band buffers, then one ``<Q`` length per
buffer, the meta and the buffers. Values are tagged (``T_NONE`` ... ``T_DTYPE``):
plain values inline, byte strings of :data:`INLINE_BYTES` or more out of band,
containers nested at most :data:`MAX_DEPTH` deep.

Tracker links (:mod:`disco_rpc.tracker`) carry frames of the same format with the
``T_PUT`` ... ``T_PING`` operations; links between a proxy and the servers
behind it (:mod:`disco_rpc.proxy`) the ``P_*`` ones.
"""

from __future__ import annotations

import struct

__all__ = [
    "MAGIC",
    "VERSION",
    "LABEL",
    "MAX_KEY_BYTES",
    "OK",
    "KEY_MISMATCH",
    "BAD_VERSION",
    "AUTH_FAILED",
    "NO_SERVER",
    "SERVERS_BUSY",
    "TICKET_REQUIRED",
    "SERVER_TAKEN",
    "REQUEST",
    "REPLY",
    "ERROR",
    "CHUNK_FRAME",
    "HEARTBEAT",
    "FLAG_ABORT",
    "FLAG_END",
    "FRAME_HEAD",
    "HEARTBEAT_FRAME",
    "INLINE_BYTES",
    "MAX_DEPTH",
    "MAX_BUFFERS",
    "CHUNK",
    "HANDLE_FUNC",
    "HANDLE_MODULE",
    "HANDLE_TENSOR",
    "HANDLE_OBJECT",
    "OP_NAMES",
    "BEATS_NONE",
    "BEATS_IDLE",
    "BEATS_ALWAYS",
    "PART_PREFIX",
    "POPEN_WORK_DIR_ENV",
    "POPEN_PARENT_ENV",
    "TRACKER_MAX_MESSAGE_BYTES",
    "REGISTRANT_KEY",
    "CLIENT_KEY",
    "TICKET_SEP",
    "ticket_key",
    "PROXY_SERVER_KEY",
    "LINK_KEYS",
    "PROXY_MAX_MESSAGE_BYTES",
    "P_REGISTER",
    "P_PAIRED",
    "P_ACK",
]

# --------------------------------------------------------------------------- handshake
#: The first bytes of every hello.
MAGIC = b"DISCORPC"
#: Version 2: proofs over the whole transcript, and sealed records after a handshake with a
#: token. Version 3: a Disco session's workers on a server answer the core's fence command
#: (``SYNC_WORKER`` with a token), which a server of version 2 would answer without it.
#: Version 4: proofs and keys from scrypt of the token (``disco-net/2``): a peer of
#: version 3 is told "version" at the hello, not "wrong token" at the proof.
VERSION = 4
#: The protocol's label in the proofs and keys (those of another protocol are worthless here).
LABEL = b"disco-rpc/2"
#: The longest key a hello may carry, in bytes.
MAX_KEY_BYTES = 4096
# statuses of a handshake
OK, KEY_MISMATCH, BAD_VERSION, AUTH_FAILED = 0, 1, 2, 3
# statuses a proxy answers with when it cannot pair a client with a server
NO_SERVER, SERVERS_BUSY, TICKET_REQUIRED = 4, 5, 6
#: Not a refusal: a proxy holds this client until a server of its key is free, and
#: says so at once and every :data:`HELD_NOTICE_EVERY` seconds; the real reply follows.
HELD = 7
#: Not a refusal either: the server behind a proxy started another client's session while
#: this client's handshake ran (it serves one at a time); the client connects again, and
#: the proxy holds it until the server is free. Sent instead of the reply, or instead of
#: the status after the client's proof checked out.
SERVER_TAKEN = 8
#: Seconds between two "held" notices of a proxy.
HELD_NOTICE_EVERY = 2.0
#: Seconds a client stays held, at most, whatever a proxy says (TVM's ``timeout_client``
#: is 600 by default; this bounds what a misbehaving proxy can make a client wait).
MAX_HELD_WAIT = 3600.0

# --------------------------------------------------------------------------- frames
# frame kinds
REQUEST, REPLY, ERROR, CHUNK_FRAME = 1, 2, 3, 4
#: A frame that only says "still here" (no op, no meta, no buffer): a client sends it
#: when it has sent nothing for a while, so that its server can tell a live client
#: from a dead or frozen one (README, "Liveness"). A connection skips it.
HEARTBEAT = 5
#: flags of a CHUNK frame without buffer: the sender gave up (its meta is the reason,
#: a str), or the stream is complete
FLAG_ABORT, FLAG_END = 1, 2
#: A frame's head: kind, operation, flags, meta length, number of buffers.
FRAME_HEAD = struct.Struct("<BBHII")
#: A heartbeat frame, whole.
HEARTBEAT_FRAME = FRAME_HEAD.pack(HEARTBEAT, 0, 0, 0, 0)
#: Byte strings at least this long travel out of band.
INLINE_BYTES = 1 << 14
#: Largest nesting depth of containers accepted from a peer.
MAX_DEPTH = 64
#: Largest number of out-of-band buffers in a frame.
MAX_BUFFERS = 1 << 16
#: Largest chunk of a file stream (smaller when the receiver's frames are bounded lower).
CHUNK = 8 << 20

# value tags
(
    T_NONE,
    T_FALSE,
    T_TRUE,
    T_INT,
    T_BIGINT,
    T_FLOAT,
    T_COMPLEX,
    T_STR,
    T_BYTES,
    T_BUF,
    T_TUPLE,
    T_LIST,
    T_DICT,
    T_ARRAY,
    T_HANDLE,
    T_DEVICE,
    T_DTYPE,
) = range(17)

# kinds of remote handles (``disco_rpc.wire.HandleRef``)
HANDLE_FUNC, HANDLE_MODULE, HANDLE_TENSOR, HANDLE_OBJECT = 1, 2, 3, 4

# --------------------------------------------------------------------------- session operations
(
    OP_INIT,
    OP_GET_FUNC,
    OP_CALL,
    OP_UPLOAD,
    OP_DOWNLOAD,
    OP_REMOVE,
    OP_LISTDIR,
    OP_LOAD_MODULE,
    OP_MOD_FUNC,
    OP_TENSOR,
    OP_EMPTY,
    OP_TENSOR_GET,
    OP_TENSOR_SET,
    OP_DEV_SYNC,
    OP_DEV_EXIST,
    OP_LINK,
    OP_SYSTEM_LIB,
    OP_PING,
    OP_FREE,
    OP_TIME_EVAL,
    OP_DISCO_WORKER,
) = range(1, 22)
#: ``(target,)``: would an upload to ``target`` be accepted? Sent before a large
#: upload, so a refused one costs a round trip, not its whole body. A server
#: without it answers "unknown operation" and the client uploads as before.
OP_UPLOAD_CHECK = 22

#: ``{code: "name"}`` of the session operations (for messages).
OP_NAMES = {v: k[3:].lower() for k, v in dict(globals()).items() if k.startswith("OP_")}

#: What a client says in its INIT (4th argument) about the heartbeats it sends: none
#: (an older or foreign client: its server notices only a closed connection), only
#: between calls (TLS: an OpenSSL connection must not be written while another thread
#: reads it), or always (README, "Liveness").
BEATS_NONE, BEATS_IDLE, BEATS_ALWAYS = 0, 1, 2

#: Uploads are written to a hidden temporary file of this name pattern, then renamed;
#: ``listdir`` hides exactly these names and uploads may not use them.
PART_PREFIX = ".disco-rpc-part-"
#: The environment variable through which a popen session hands its child the session's
#: work folder (made and removed by the parent, so a crashed child leaves nothing).
POPEN_WORK_DIR_ENV = "DISCO_RPC_POPEN_WORK_DIR"
#: Set (to the parent's pid) by a server for the child of an ``rpc.PopenSession``
#: constructor: a minimal server then asks the kernel to end it with its parent.
POPEN_PARENT_ENV = "DISCO_RPC_POPEN_PARENT"

# --------------------------------------------------------------------------- tracker
#: Frames on tracker links are small; this bounds them.
TRACKER_MAX_MESSAGE_BYTES = 1 << 20
#: The handshake key a registering server or proxy presents.
REGISTRANT_KEY = "disco-rpc/registrant"
#: The handshake key a client presents.
CLIENT_KEY = "disco-rpc/client"
#: The separator between a server key and a ticket in a client's handshake key.
TICKET_SEP = "@"

# tracker operations
T_PUT, T_REQUEST, T_SUMMARY, T_START, T_END, T_ASSIGN, T_REVOKE, T_FAIL, T_PING = range(1, 10)


def ticket_key(key: str, ticket: str) -> str:
    """The handshake key of a client sent to a server with ``ticket``."""
    return f"{key}{TICKET_SEP}{ticket}"


# --------------------------------------------------------------------------- proxy
#: The handshake key a server behind the proxy presents to it.
PROXY_SERVER_KEY = "disco-rpc/proxy-server"
#: The keys of service links (tracker and proxy). A server accepts none of them for a
#: session, whatever its own key ("" takes any other): a relay delivered a tracker
#: link to a server, and both sides completed the proof (an attacker check).
LINK_KEYS = frozenset({REGISTRANT_KEY, CLIENT_KEY, PROXY_SERVER_KEY})
#: Frames between proxy and server are tiny.
PROXY_MAX_MESSAGE_BYTES = 1 << 16
# operations between a proxy and a server behind it
P_REGISTER, P_PAIRED, P_ACK = 1, 2, 3

# the codes are public too (``from disco_rpc.protocol import OP_CALL``)
__all__ += [k for k in list(globals()) if k.startswith(("OP_", "T_", "P_")) and k not in __all__]
