"""``Session.create("trace", num_workers=4)``: a channel that logs the control plane.

:class:`TraceChannel` is a decorator: it wraps another registered channel (by
default ``threaded``), hands every call on to it, and logs each command on the
``disco_tutorial.trace`` logger at DEBUG level (nothing is formatted otherwise).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from disco_core import Channel, WorkerError
from disco_core.spi import Outgoing, lookup, protocol

__all__ = ["TraceChannel", "trace_channel"]

log = logging.getLogger("disco_tutorial.trace")


def _name(cmd: tuple) -> str:
    return protocol.Action(cmd[0]).name.lower()


class TraceChannel(Channel):
    """Every call goes to ``inner``; commands and replies are logged on the way.

    Parameters
    ----------
    inner : Channel
        The channel that does the work.
    """

    kind = "trace"

    def __init__(self, inner: Channel) -> None:
        self.inner = inner
        # The session and CCLs read the shape from the channel itself.
        self.num_workers, self.num_groups = inner.num_workers, inner.num_groups
        self.num_nodes, self.shares_memory = inner.num_nodes, inner.shares_memory

    def send(self, out: Outgoing, workers: Sequence[int] | None = None) -> None:
        if log.isEnabledFor(logging.DEBUG):
            to = "all" if workers is None else list(workers)
            log.debug("send %s to %s", [_name(c) for c in out.cmds], to)
        self.inner.send(out, workers)

    def send_shared(self, cmds: tuple[tuple, ...]) -> None:
        if log.isEnabledFor(logging.DEBUG):
            log.debug("send %s to all", [_name(c) for c in cmds])
        self.inner.send_shared(cmds)  # keep the inner channel's fast path

    def sync(self, worker_id: int) -> None:
        log.debug("sync worker %d", worker_id)
        self.inner.sync(worker_id)

    def recv(self, worker_id: int, timeout: float | None = None) -> Any:
        reply = self.inner.recv(worker_id, timeout)
        log.debug("reply from worker %d", worker_id)
        return reply

    def settle(self, timeout: float = 1.0) -> None:
        self.inner.settle(timeout)

    # The session's rendezvous store reaches the workers through the inner channel.
    @property
    def has_store(self) -> bool:  # type: ignore[override]
        return self.inner.has_store

    def attach_store(self, store: Any) -> None:
        self.inner.attach_store(store)

    def mark_unresponsive(self, worker_ids: Sequence[int], reason: str) -> None:
        self.inner.mark_unresponsive(worker_ids, reason)

    def take_errors(self) -> list[WorkerError]:
        errors = self.inner.take_errors()
        for e in errors:
            log.debug("error from worker %d: %s", e.worker_id, e.exc_type)
        return errors

    def check_alive(self) -> None:
        self.inner.check_alive()

    def on_worker_death(self, callback: Callable[[list[int], str], None]) -> None:
        self.inner.on_worker_death(callback)

    def close(self, timeout: float = 5.0) -> None:
        log.debug("close")
        self.inner.close(timeout)


def trace_channel(
    num_workers: int, num_groups: int = 1, inner: str = "threaded", **options: Any
) -> TraceChannel:
    """The factory the plugin registers: ``inner`` (any registered channel), traced."""
    factory = lookup("channel", inner)
    return TraceChannel(factory(num_workers=num_workers, num_groups=num_groups, **options))
