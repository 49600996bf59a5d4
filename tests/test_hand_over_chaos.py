"""Outsider checks of the held-back control plane (issue 16): ways to make it hang.

Both were found by an outside chaos check; both hung (or missed the hand-over)
before ``LinkChannel.hand_over`` stopped blocking and ``CCL.__init_subclass__``
looked at inherited operations.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from disco_core.ccl.base import CCL, WAITING_OPS

pytestmark = pytest.mark.timeout(60)


def test_a_waiting_op_from_a_mixin_hands_over_first():
    """A plugin whose operations live on a mixin (not a CCL subclass) must be wrapped too."""
    calls = []

    class Ops:
        def allreduce(self, src, dst, op, in_group):
            calls.append("allreduce")

    for name in WAITING_OPS[1:]:
        setattr(Ops, name, lambda self, *a, _n=name: calls.append(_n))

    class Ctx:
        def hand_over(self):
            calls.append("hand_over")

    class MixedCCL(Ops, CCL):
        name = "mixed"

    MixedCCL(Ctx(), None).allreduce(None, None, "sum", True)
    assert calls == ["hand_over", "allreduce"]
    calls.clear()
    MixedCCL(Ctx(), None).barrier(False)
    assert calls == ["hand_over", "barrier"]


_FULL_PIPE = """
import numpy as np
import disco_core as disco
from disco_core.channels import base
base.FLUSH_DELAY = 30.0  # only a sync, a wait or a full batch hands commands over
big = "x" * 65536
with disco.ProcessSession(2) as sess:
    sess.import_python_module("disco_core.testing.funcs")
    echo = sess.get_global_func("testing.echo")
    sess.init_ccl("shm")
    x = sess.empty((4,), "float32")
    for w in range(2):
        x.debug_copy_from(w, np.ones(4, "float32"))
    sess._sync_all()
    sess.allreduce(x, x)  # worker 1 enters it and waits for worker 0
    for i in range(300):  # the 256th seals a batch larger than worker 1's pipe
        echo(big + str(i))
    sess.sync_worker_0()
    assert (x.debug_get_from_remote(1) == 2).all()
print("done")
"""


def test_worker0_collective_does_not_deadlock_on_a_full_pipe():
    """Worker 1 waits in an allreduce for worker 0; meanwhile 256 large commands fill its pipe.

    Worker 0 runs the allreduce only when woken (or at the sync). Whoever seals the
    batch (the controller at the 256th command, or worker 0's ``hand_over``) also
    writes the commands sent *after* the allreduce, under ``_seal_lock``, and blocks
    on the full pipe of worker 1, which waits for worker 0: the controller hangs for
    good (worker 1 sends heartbeats, so no liveness check fires, and shutdown hangs
    too). TVM's worker 0 never writes to the other workers' pipes, so there the
    controller only blocks until worker 0 catches up. Run in a child process: the
    hang must not take the test run with it.
    """
    proc = subprocess.Popen(
        [sys.executable, "-c", _FULL_PIPE],
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("the controller hung (deadlock on worker 1's full pipe)")
    assert proc.returncode == 0 and b"done" in out, out.decode(errors="replace")[-2000:]


def test_a_direct_command_does_not_overtake_a_batch_being_written():
    """The flusher cut the batch and blocks writing it to worker 1 (busy, its pipe full);
    a command for worker 2 alone must still reach worker 2 after that batch, not before.

    It used to: ``send`` saw the batch empty (already cut) and wrote straight to
    worker 2, whose ``debug_get`` then found the register not yet set.
    """
    import time

    import disco_core as disco

    with disco.ProcessSession(3) as sess:
        sess.import_python_module("disco_core.testing.funcs")
        echo = sess.get_global_func("testing.echo")
        sleep = sess.get_global_func("testing.sleep")
        big = "x" * 8_000_000  # larger than any pipe: the write waits for worker 1
        for i in range(3):
            sess._sync_all()
            sleep(0.3, 1)  # worker 1 reads nothing for 0.3 s
            time.sleep(0.02)  # the flusher hands that over
            x = echo(big + str(i))
            time.sleep(0.02)  # the flusher has cut the batch and is writing it to worker 1
            assert x.debug_get_from_remote(2) == big + str(i)
