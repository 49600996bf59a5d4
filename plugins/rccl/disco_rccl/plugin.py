"""Entry point of disco-rccl: registers the CCL ``"rccl"``."""

from __future__ import annotations

from disco_core import hookimpl


@hookimpl
def disco_register_ccls():
    from . import RCCLCCL

    return {"rccl": RCCLCCL}
