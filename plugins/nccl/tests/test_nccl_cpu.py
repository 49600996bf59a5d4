"""disco-nccl without a GPU: registration, the clear error, and the GPU-free logic.

Some tests below hand the CCL a stand-in for CuPy's NCCL module (``FakeNccl``): they
check the rendezvous, group arithmetic and communicator life cycle, not NCCL. The
real thing runs in test_nccl_gpu.py when a GPU is present.
"""

from __future__ import annotations

import numpy as np
import pytest

import disco_core as disco
from disco_core import plugins
from disco_core.errors import CCLError
from disco_nccl import backend, ccl
from disco_nccl.ccl import NCCLCCL, check_device_ids, nccl_dtype, reduce_op


def _usable_gpu() -> bool:
    try:
        backend.load("nccl")
    except CCLError:
        return False
    return True


# What is missing on this machine, as init_ccl("nccl") must say it.
_MISSING = r"needs CuPy.*pip install|needs a GPU|cannot load the NCCL library|built without NCCL"


def test_registered_by_disco_nccl():
    assert plugins.lookup("ccl", "nccl") is NCCLCCL
    assert any(
        i.distribution == "disco-nccl" and "nccl" in i.provides.get("ccl", [])
        for i in plugins.list_plugins()
    )


@pytest.mark.timeout(60)
@pytest.mark.skipif(_usable_gpu(), reason="a GPU is usable: this test covers machines without")
@pytest.mark.parametrize("kind", ["threaded", "process"])
def test_init_ccl_without_cupy_or_gpu_is_a_clear_error_and_the_session_survives(kind):
    cls = disco.ThreadedSession if kind == "threaded" else disco.ProcessSession
    with cls(2) as sess:
        with pytest.raises(CCLError, match=_MISSING):
            sess.init_ccl("nccl")
        with pytest.raises(CCLError, match="no CCL is initialised"):
            sess.allreduce(sess.empty((2,), "float32"), sess.empty((2,), "float32"))
        sess.init_ccl("shm")  # the failed init left nothing behind
        x = sess.broadcast(np.ones(3, np.float32))
        assert x.debug_get_from_remote(1).sum() == 3


def test_device_ids_are_checked():
    assert check_device_ids((), 2, 4) == (0, 1)
    assert check_device_ids((3, 1), 2, 4) == (3, 1)
    with pytest.raises(CCLError, match="2 device ids given for 3 workers"):
        check_device_ids((0, 1), 3, 4)
    with pytest.raises(CCLError, match="repeat a GPU"):
        check_device_ids((1, 1), 2, 4)
    with pytest.raises(CCLError, match=r"no GPU \[5\]"):
        check_device_ids((0, 5), 2, 4)


def test_dtype_and_op_codes_follow_nccl_h():
    assert nccl_dtype(np.float32) == 7 and nccl_dtype("float16") == 6 and nccl_dtype(np.int64) == 4
    assert (
        reduce_op("sum") == 0
        and reduce_op("max") == 2
        and reduce_op("min") == 3
        and reduce_op("avg") == 4
    )
    with pytest.raises(CCLError, match="no datatype for bool"):
        nccl_dtype(np.bool_)
    with pytest.raises(CCLError, match="no datatype for int16"):
        nccl_dtype(np.int16)
    with pytest.raises(CCLError, match="unsupported op"):
        reduce_op("xor")


def test_abort_from_the_controller_reaches_in_process_workers():
    rv = ccl.NCCLRendezvous({"token": 12345})
    assert ccl._ABORTED.get(rv.token) is None
    rv.abort("worker 1 died")
    assert ccl._ABORTED[rv.token] == "worker 1 died"
    rv.close()
    assert rv.token not in ccl._ABORTED


# The NCCL calls disco-nccl makes, with the number of arguments it passes.
_CALLS = {
    "allReduce": 6, "allGather": 5, "broadcast": 6, "send": 5, "recv": 5,
    "commSplit": 2, "abort": 0, "destroy": 0, "check_async_error": 0,
}  # fmt: skip


def test_the_calls_match_the_installed_cupy_binding():
    """Where CuPy and its NCCL library import (no GPU needed): every call exists with that arity."""
    try:
        from cupy.cuda import nccl
    except ImportError as exc:
        pytest.skip(f"CuPy with NCCL is not installed here ({exc})")
    comm = nccl.NcclCommunicator
    for name, nargs in _CALLS.items():
        if name == "commSplit" and not hasattr(comm, name):
            continue  # older CuPy: disco-nccl initialises groups from their own ids
        doc = getattr(comm, name).__doc__.splitlines()[0]  # "NcclCommunicator.f(self, ...)"
        params = [p for p in doc[doc.index("(") + 1 : doc.rindex(")")].split(",") if p.strip()]
        required = [p for p in params[1:] if "=" not in p]
        assert len(required) <= nargs <= len(params) - 1, f"{name}: {doc}"
    for name in ("get_unique_id", "groupStart", "groupEnd", "get_version"):
        assert callable(getattr(nccl, name)), name
    assert (nccl.NCCL_FLOAT32, nccl.NCCL_AVG, nccl.NCCL_UINT8) == (7, 4, 1)


@pytest.mark.parametrize("ids, says", [((0, 0), "repeat a GPU"), ((0,), "1 device ids given for 2 workers")])  # fmt: skip
def test_a_wrong_device_id_list_is_said_before_anything_is_loaded(ids, says):
    """Where CuPy is missing, ``init_ccl("nccl", 0, 0)`` said only "needs CuPy": the
    call's own mistake came second (outside check). It is checked first now; the
    session stays usable."""
    with disco.ThreadedSession(2) as sess:
        with pytest.raises(disco.CCLError, match=says):
            sess.init_ccl("nccl", *ids)
        sess.init_ccl("shm")
        assert sess.call_packed("disco.worker_id").debug_get_from_remote(1) == 1
