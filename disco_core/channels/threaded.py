"""The ``threaded`` channel: every worker is a thread of the controller's process."""

from __future__ import annotations

import time

from ..errors import DiscoError
from .base import LinkChannel, ThreadWorkerLink, WorkerLink

__all__ = ["ThreadedChannel"]


class ThreadedChannel(LinkChannel):
    """Workers 0..N-1 as threads; commands travel on in-process queues."""

    kind = "threaded"

    def __init__(self, num_workers: int, num_groups: int = 1) -> None:
        super().__init__(num_workers, num_groups)
        links: list[ThreadWorkerLink] = []
        try:
            for w in range(num_workers):
                links.append(ThreadWorkerLink(w, num_workers, num_groups, self.hub))
        except (RuntimeError, MemoryError) as exc:
            # the threads already started are stopped (they stayed, an outside check)
            for link in links:
                link.stopped = True
                link.close(time.monotonic() + 1.0)
            raise DiscoError(
                f"ThreadedSession({num_workers}): worker thread {len(links)} could not be "
                f"started ({type(exc).__name__}: {exc}); this process cannot run that many "
                "worker threads (use fewer, or a ProcessSession)"
            ) from None
        self._set_links(list[WorkerLink](links))
