"""Worker functions for the disco-mpi tests (imported on every worker)."""

from __future__ import annotations

import os
import time

import numpy as np

import disco_core as disco
from disco_core.worker import current


def make(shape, dtype: str, seed: int, worker_id: int) -> np.ndarray:
    """The array worker ``worker_id`` contributes (the controller recomputes it)."""
    rng = np.random.default_rng(seed * 1000 + worker_id)
    dt = dtype
    if dtype == "bfloat16":
        import ml_dtypes

        dt = ml_dtypes.bfloat16
    if dtype == "bool":
        return rng.integers(0, 2, size=shape).astype(bool)
    if np.dtype(dt).kind in "iu":
        return rng.integers(-50 if np.dtype(dt).kind == "i" else 0, 50, size=shape).astype(dt)
    if np.dtype(dt).kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dt)
    return rng.standard_normal(shape).astype(dt)


@disco.register_func("mpi_test.make", override=True)
def _make(shape, dtype, seed):
    return make(tuple(shape), dtype, seed, current().worker_id)


@disco.register_func("mpi_test.die_on", override=True)
def _die_on(worker_id: int, delay: float = 0.2) -> None:
    if current().worker_id == worker_id:
        time.sleep(delay)
        os._exit(7)


@disco.register_func("mpi_test.ccl_name", override=True)
def _ccl_name():
    return current().ccl.name


@disco.register_func("mpi_test.p2p", override=True)
def _p2p(buf, out):
    """Workers 2k and 2k+1 swap ``buf`` into ``out``."""
    ccl = current().ccl
    me = current().worker_id
    peer = me ^ 1
    if me % 2 == 0:
        ccl.send(buf, peer)
        ccl.recv(out, peer)
    else:
        ccl.recv(out, peer)
        ccl.send(buf, peer)


@disco.register_func("mpi_test.pipeline", override=True)
def _pipeline(buf, out):
    """Group 0 sends ``buf`` to the next group, which receives it into ``out``."""
    ctx = current()
    if ctx.group_id + 1 < ctx.num_groups:
        disco.get_global_func("disco.send_to_next_group")(buf)
    if ctx.group_id > 0:
        disco.get_global_func("disco.recv_from_prev_group")(out)


@disco.register_func("mpi_test.barrier_then_p2p", override=True)
def _barrier_then_p2p(nbytes: int) -> None:
    """Worker 0 runs a group barrier (the others get this call then, and end it), and
    0.5 s later another one, then a receive of 4 floats from worker 1 (``nbytes`` 0)
    or a send of ``nbytes`` to it; the others do nothing."""
    from disco_core.builtins import barrier, recv_from_worker, send_to_worker

    if current().worker_id == 0:
        barrier(True)
        time.sleep(0.5)  # (worker 1's notices are in by now: the next barrier takes them)
        barrier(True)
        if nbytes:
            send_to_worker(np.ones(nbytes // 4, "float32"), 1)
        else:
            recv_from_worker(np.zeros(4, "float32"), 1)


@disco.register_func("mpi_test.shape_by_worker", override=True)
def _shape_by_worker(dtype):
    return np.zeros((2 + (current().worker_id == 1),), dtype)


@disco.register_func("mpi_test.bad_recv", override=True)
def _bad_recv():
    """Worker 0 sends 4 floats to worker 1, which expects 3: both drain, worker 1 raises."""
    ctx = current()
    if ctx.worker_id == 0:
        ctx.ccl.send(np.ones(4, "float32"), 1)
    elif ctx.worker_id == 1:
        ctx.ccl.recv(np.empty(3, "float32"), 0)


def aliased_input(worker_id: int, n: int = 8) -> np.ndarray:
    return np.arange(n, dtype="float64") * 10 + worker_id


@disco.register_func("mpi_test.aliased", override=True)
def _aliased(in_group: bool) -> dict:
    """In-place and overlapping src/dst through the CCL (MPI forbids aliased buffers)."""
    ctx = current()
    ccl = ctx.ccl
    comm = ccl.group if in_group else ccl.world
    n, r, me = comm.Get_size(), comm.Get_rank(), ctx.worker_id
    out = {}
    x = aliased_input(me, 6)
    ccl.allreduce(x, x, "sum", in_group)  # src is dst
    out["allreduce_same"] = x
    b = aliased_input(me)
    ccl.allreduce(b[0:6], b[2:8], "max", in_group)  # partly overlapping
    out["allreduce_overlap"] = b[2:8].copy()
    g = np.zeros(n * 3)
    g[r * 3 : r * 3 + 3] = aliased_input(me, 3)
    ccl.allgather(g[r * 3 : r * 3 + 3], g, in_group)  # src is this member's slot
    out["allgather_slot"] = g
    h = np.zeros(n * 3)
    h[0:3] = aliased_input(me, 3)
    ccl.allgather(h[0:3], h, in_group)  # src is slot 0: in place only on rank 0
    out["allgather_first"] = h
    c = aliased_input(me)
    ccl.broadcast(c[0:6], c[2:8], in_group)  # the root's src and dst overlap
    out["broadcast_overlap"] = c[2:8].copy()
    d = np.zeros(n * 3)
    d[0:3] = aliased_input(me, 3)
    if r == 0:
        ccl.gather(d[0:3], d, in_group)  # the root's src is its own slot
        out["gather_root_slot"] = d
    else:
        ccl.gather(d[0:3], None, in_group)
    s = np.repeat(np.arange(n, dtype="float64"), 3) + 100 * me
    if r == 0:
        ccl.scatter(s, s[0:3], in_group)  # the root's dst is its own slot
        out["scatter_root_slot"] = s[0:3].copy()
    else:
        t = np.zeros(3)
        ccl.scatter(None, t, in_group)
        out["scatter_root_slot"] = t
    return out


def shm_mappings() -> list[str]:
    """This process's mappings of /dev/shm files ("PATH (deleted)" once unlinked)."""
    out: set[str] = set()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(None, 5)
            if len(fields) == 6 and fields[5].startswith("/dev/shm/"):
                out.add(fields[5].rstrip("\n"))
    return sorted(out)


@disco.register_func("mpi_test.shm_mappings", override=True)
def _shm_mappings() -> str:
    import json

    return json.dumps({"pid": os.getpid(), "maps": shm_mappings()})
