"""Peer: mpi4py (with MPICH), run as ``mpiexec -n N python bench/peer_mpi.py --plan ...``.

Rank 0 prints the results as JSON.
"""

from __future__ import annotations

import argparse

import numpy as np
from _peer_loop import parse_plan, run_plan
from mpi4py import MPI


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan", required=True, help="op:bytes,op:bytes,...")
    ap.add_argument("--budget", type=float, default=0.25)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    n = comm.Get_size()

    def make_op(op: str, nbytes: int):
        nelem = nbytes // 4
        if op == "allreduce":
            src = np.ones(nelem, dtype=np.float32)
            dst = np.empty_like(src)
            return lambda: comm.Allreduce(src, dst, op=MPI.SUM)
        if op == "allgather":
            src = np.ones(nelem // n, dtype=np.float32)
            dst = np.empty(nelem, dtype=np.float32)
            return lambda: comm.Allgather(src, dst)
        if op == "broadcast":
            buf = np.ones(nelem, dtype=np.float32)
            return lambda: comm.Bcast(buf, root=0)
        if op == "pingpong":  # ranks 0 and 1; the others wait at the barriers
            src = np.ones(nelem, dtype=np.float32)
            dst = np.empty_like(src)
            rank = comm.Get_rank()
            if rank == 0:
                return lambda: (comm.Send(src, 1), comm.Recv(dst, 1))
            if rank == 1:
                return lambda: (comm.Recv(dst, 0), comm.Send(src, 0))
            return lambda: None
        raise ValueError(op)

    def max_all(x: float) -> float:
        return comm.allreduce(x, op=MPI.MAX)

    meta = {
        "peer": "MPICH",
        "ranks": n,
        "mpi": MPI.Get_library_version().splitlines()[0].strip(),
    }
    run_plan(
        parse_plan(args.plan),
        make_op,
        comm.Barrier,
        max_all,
        comm.Get_rank(),
        args.budget,
        args.repeats,
        meta,
    )


if __name__ == "__main__":
    main()
