"""The ``threaded`` channel: every worker is a thread of the controller's process."""

from __future__ import annotations

from .base import LinkChannel, ThreadWorkerLink

__all__ = ["ThreadedChannel"]


class ThreadedChannel(LinkChannel):
    """Workers 0..N-1 as threads; commands travel on in-process queues."""

    kind = "threaded"

    def __init__(self, num_workers: int, num_groups: int = 1) -> None:
        super().__init__(num_workers, num_groups)
        self._set_links(
            [ThreadWorkerLink(w, num_workers, num_groups, self.hub) for w in range(num_workers)]
        )
