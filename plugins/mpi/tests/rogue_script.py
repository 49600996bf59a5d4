"""Rank 1 sends rank 0 replies no worker sends (an outside check of the reply reader).

Run with ``mpiexec -n 3``. ``MODE`` (argv[1]); argv[2], in the modes that end the
session, is the file where rank 0 writes what the call raised:

``garbage``
    an empty message, two goodbyes and a ready, then workers 2 and 1 are asked
    something: rank 0 drops the garbage, counts one goodbye per rank, and hears
    both (worker 1's answer is its own, not the ready's 99).
``bad-head``
    a head that declares 2**32-1 buffers: rank 0 ends the session's links with
    the reason, and the waiting call raises WorkerDiedError.
``missing-buffer``
    a head that declares a buffer which never comes: the same, once the buffer's
    wait (``_BUFFER_WAIT``, 1 s here) is over.
"""

import struct
import sys

import disco_core as disco
from disco_core.spi import encode_for_network, frame_head
from disco_core.worker import current
from disco_mpi import channel

MODE = sys.argv[1]
channel._BUFFER_WAIT = 1.0
_comm = []
_serve = channel._serve


def serve(comm, me, size, num_groups):
    _comm.append(comm)  # the channel's private communicator, for the function below
    _serve(comm, me, size, num_groups)


channel._serve = serve


@disco.register_func("rogue.send")
def rogue_send() -> None:
    if current().worker_id != 1:
        return
    comm = _comm[0]
    if MODE == "garbage":  # (and a ready, which a rank never sends: not an answer)
        msgs = [(), ("bye", None), ("bye", None), ("ready", 99)]
        frames = [frame_head(encode_for_network(m)) for m in msgs]
    elif MODE == "bad-head":
        frames = [struct.pack("<QII", 0, 0xFFFFFFFF, 0)]
    else:  # a head announcing one 16-byte buffer, and no buffer
        header, _ = encode_for_network(("reply", None))
        frames = [struct.pack("<QIIQ", len(header), 1, 0, 16) + header]
    for head in frames:
        comm.Send([head, channel._runtime.mpi().BYTE], 0, channel._REPLY_TAG)


sess = disco.Session.create("mpi")
sess.get_global_func("rogue.send")()
ask = sess.get_global_func("disco.worker_id")
if MODE == "garbage":
    sess.sync_worker_0()
    assert ask().debug_get_from_remote(2) == 2
    assert ask().debug_get_from_remote(1) == 1
    print("ROGUE GARBAGE DROPPED")
    sess.shutdown()
else:
    try:  # rank 1 answers after its forged frames: the reader meets them first
        ask().debug_get_from_remote(1)
        ask().debug_get_from_remote(2)
    except disco.WorkerDiedError as exc:
        # to a file: what a rank prints may not pass mpiexec before the abort below
        with open(sys.argv[2], "w") as f:
            f.write(f"ROGUE HEAD REFUSED {exc}")
    channel._runtime.mpi().COMM_WORLD.Abort(0)  # the other ranks wait for commands
