"""Peer: torch.distributed with the gloo backend, one process per rank.

Started by ``bench_ccl.py`` as ``python bench/peer_gloo.py --rank R --world N --port P``
(one process per rank); rank 0 prints the results as JSON.
"""

from __future__ import annotations

import argparse
import datetime
import warnings

import torch
import torch.distributed as dist
from _peer_loop import parse_plan, run_plan


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--plan", required=True, help="op:bytes,op:bytes,...")
    ap.add_argument("--budget", type=float, default=0.25)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{args.port}",
        rank=args.rank,
        world_size=args.world,
        timeout=datetime.timedelta(seconds=120),
    )
    n = args.world

    def make_op(op: str, nbytes: int):
        nelem = nbytes // 4
        if op == "allreduce":
            t = torch.ones(nelem, dtype=torch.float32)
            # In place, as gloo does it; ours writes a separate dst (no extra copy here).
            return lambda: dist.all_reduce(t, op=dist.ReduceOp.SUM)
        if op == "allgather":
            src = torch.ones(nelem // n, dtype=torch.float32)
            dst = torch.empty(nelem, dtype=torch.float32)
            return lambda: dist.all_gather_into_tensor(dst, src)
        if op == "broadcast":
            t = torch.ones(nelem, dtype=torch.float32)
            return lambda: dist.broadcast(t, src=0)
        if op == "pingpong":  # ranks 0 and 1; the others wait at the barriers
            src = torch.ones(nelem, dtype=torch.float32)
            dst = torch.empty(nelem, dtype=torch.float32)
            rank = dist.get_rank()
            if rank == 0:
                return lambda: (dist.send(src, 1), dist.recv(dst, 1))
            if rank == 1:
                return lambda: (dist.recv(dst, 0), dist.send(src, 0))
            return lambda: None
        raise ValueError(op)

    def max_all(x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    meta = {"peer": "gloo", "ranks": n, "torch": torch.__version__}
    run_plan(
        parse_plan(args.plan),
        make_op,
        dist.barrier,
        max_all,
        args.rank,
        args.budget,
        args.repeats,
        meta,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
