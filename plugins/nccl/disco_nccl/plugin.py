"""Entry point of disco-nccl: registers the CCL ``"nccl"``."""

from __future__ import annotations

from disco_core import hookimpl


@hookimpl
def disco_register_ccls():
    from .ccl import NCCLCCL

    return {"nccl": NCCLCCL}
