"""Deliberately broken CCLs and channels, one planted bug each.

``tests/test_kits_catch_planted_bugs.py`` runs the conformance kits against each
and asserts that the kit fails it, within seconds. The bugs are the mistakes a
plugin author makes (issue 18): each class is the core's working ``shm`` CCL (or
``process`` channel) with one thing done wrong. Loaded as a plugin through
``DISCO_PLUGINS=planted_plugin`` (worker processes inherit it).
"""

from __future__ import annotations

import os
import socket
import tempfile
import threading
import time
import uuid
from typing import Any

import numpy as np

import disco_core
from disco_core.ccl.shm import ShmCCL
from disco_core.channels.process import ProcessChannel
from disco_core.errors import CCLError, CCLTimeoutError


class AvgByReciprocal(ShmCCL):
    """``avg`` as ``sum * (1/n)``: exact for 2 and 4 members, not for 3."""

    def allreduce(self, src: Any, dst: Any, op: str, in_group: bool) -> None:
        if op != "avg" or not isinstance(dst, np.ndarray) or dst.dtype.kind != "f":
            return super().allreduce(src, dst, op, in_group)
        super().allreduce(src, dst, "sum", in_group)
        np.multiply(dst, dst.dtype.type(1.0 / len(self.members(in_group))), out=dst)


class IgnoresAbort(ShmCCL):
    """Never told that a peer died: its members wait on for their own timeout."""

    @classmethod
    def rendezvous(cls, channel: Any, device_ids: Any, **options: Any) -> Any:
        rendezvous = super().rendezvous(channel, device_ids, **options)
        rendezvous.abort = lambda reason: None
        return rendezvous


class LeaksConnections(ShmCCL):
    """Opens connections (as a TCP CCL does), each with a reader thread; ``close``
    forgets them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.conns = conns = socket.socketpair()
        threading.Thread(target=lambda: conns[0].recv(1) and conns, daemon=True).start()


class GatherWritesEverywhere(ShmCCL):
    """``gather`` also overwrites the non-roots' ``dst``."""

    def gather(self, src: Any, dst: Any, in_group: bool) -> None:
        super().gather(src, dst, in_group)
        if isinstance(dst, np.ndarray) and self.ctx.worker_id != self.members(in_group)[0]:
            dst[...] = 0


class WaitsInsteadOfRefusing(ShmCCL):
    """No argument checks: a wrong call waits for a matching peer until it times out."""

    def allreduce(self, src: Any, dst: Any, op: str, in_group: bool) -> None:
        try:
            return super().allreduce(src, dst, op, in_group)
        except CCLTimeoutError:
            raise
        except CCLError:
            time.sleep(self.timeout)
            raise CCLTimeoutError(f"allreduce: waited {self.timeout:g} s for the others") from None


class JoinIgnoresAbort(ShmCCL):
    """Its constructor waits until every member constructed (a join through files),
    and nothing but its own 60 s limit ends that wait."""

    @classmethod
    def rendezvous(cls, channel: Any, device_ids: Any, **options: Any) -> Any:
        rendezvous = super().rendezvous(channel, device_ids, **options)
        rendezvous.payload = {**rendezvous.payload, "join": uuid.uuid4().hex}
        return rendezvous

    def __init__(self, ctx: Any, payload: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(ctx, payload, *args, **kwargs)
        base = os.path.join(tempfile.gettempdir(), f"planted-join-{payload['join']}")
        open(f"{base}.{ctx.worker_id}", "w").close()
        deadline = time.monotonic() + 60
        while not all(os.path.exists(f"{base}.{w}") for w in range(ctx.num_workers)):
            if time.monotonic() > deadline:
                raise CCLTimeoutError("the join took more than 60 s")
            time.sleep(0.01)


class NamelessChannel(ProcessChannel):
    """A channel that does not say what it is (``kind`` left at the base default)."""

    kind = "?"


@disco_core.hookimpl
def disco_register_ccls() -> dict:
    return {
        "planted.avg_by_reciprocal": AvgByReciprocal,
        "planted.ignores_abort": IgnoresAbort,
        "planted.leaks_connections": LeaksConnections,
        "planted.gather_writes_everywhere": GatherWritesEverywhere,
        "planted.waits_instead_of_refusing": WaitsInsteadOfRefusing,
        "planted.join_ignores_abort": JoinIgnoresAbort,
    }


@disco_core.hookimpl
def disco_register_channels() -> dict:
    return {"planted.nameless": NamelessChannel}
