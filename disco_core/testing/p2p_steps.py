"""Point-to-point scenarios after failed calls, run the same way for every CCL.

A scenario is a list of steps, each one command of the session: ``("pair", v, f)`` a
send of ``v`` from worker 1 and its receive on worker 0 in one call; ``("send", v, f)``
and ``("recv", v, f)`` the halves of a pair split across two commands, ``v`` being what
that receive's own send sends; ``("pipe", v, f)`` a step of a pipeline, both in one
command: a send of ``v`` and a receive of what the command before sent (``v - 1``);
``f`` a worker that raises in that call before its part
(-1: none); ``("fail", w)`` a call of its own that raises on ``w``; ``("nap",)``
worker 0 starts its next receive 0.5 s late. A step with ``"large"`` sends 8 KiB.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["run_p2p_steps"]


def run_p2p_steps(sess: Any, steps: Sequence[tuple]) -> list[tuple[tuple, float, Any]]:
    """Run ``steps`` on ``sess`` (``disco_core.testing.funcs`` imported on its workers);
    return ``(step, value, ref)`` for each receive: ``ref`` holds on worker 0 what the
    receive took, which must be ``value`` or an error."""
    pair = sess.get_global_func("testing.p2p_pair")
    receives = []
    for step in steps:
        if step[0] == "nap":
            sess.get_global_func("testing.sleep")(0.5, 0)
        elif step[0] == "fail":
            sess.get_global_func("testing.raise_on")(step[1])
        else:
            part, value, fail = step[0], float(step[1]), step[2]
            part = "both" if part == "pair" else part
            size = 2048 if "large" in step else 4  # float32: 8 KiB, or 16 bytes
            ref = pair(1, 0, value if part != "recv" else 0.0, fail, 0.0, part, size)
            if part != "send":
                receives.append((step, value - (part == "pipe"), ref))
    return receives
