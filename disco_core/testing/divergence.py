"""Code that differs between workers, checked the same way for every CCL."""

from __future__ import annotations

import time
from typing import Any

__all__ = ["check_skip_onto_the_other_communicator"]


def _value_or_error(ref: Any, worker: int) -> Any:
    from ..errors import WorkerError

    try:
        return ref.debug_get_from_remote(worker).tolist()
    except WorkerError as exc:
        return str(exc)


def check_skip_onto_the_other_communicator(sess: Any, first_in_group: bool) -> None:
    """On ``sess`` (4 workers, 2 groups, a CCL; ``disco_core.testing.funcs`` imported
    on its workers), worker 1 skips a world allreduce (a group one, with
    ``first_in_group``) and its next call runs a group (world) one: every member must
    fail within 10 s, one of them naming worker 1 ("went on to a collective of call"),
    rather than wait for the CCL's timeout."""
    unless = sess.get_global_func("testing.allreduce_unless")
    t0 = time.monotonic()
    skipped = unless(1, first_in_group)
    after = unless(-1, not first_in_group)
    got = [_value_or_error(skipped, w) for w in (0, 2, 3)]
    got += [_value_or_error(after, w) for w in range(4)]
    assert time.monotonic() - t0 < 10, got
    assert all(isinstance(g, str) for g in got[3:]), got
    assert any("worker 1 went on to a collective of call" in g for g in got if isinstance(g, str)), got  # fmt: skip
