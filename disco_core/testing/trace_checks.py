"""Checks of a traced session, shared by the core's, the channels' and the CCLs' tests.

:func:`traced_demo` runs the demo's tensor-parallel step on a session under
:func:`disco_core.trace`, optionally with one worker made late; :func:`check_trace`
asserts what every trace must show: each worker's commands all there and in
order, the same ``call_packed`` numbers as the controller's, and the members of
each collective overlapping within the clocks' stated precision.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from .. import demo_funcs
from ..tracing import format as fmt
from ..tracing import summary
from ..tracing.session_trace import trace

__all__ = [
    "traced_demo",
    "check_trace",
    "check_straggler",
    "check_streams",
    "load_trace",
    "worker_events",
    "LATE_STEP",
]

#: The step before whose allreduce :func:`traced_demo` makes one worker late.
LATE_STEP = 3


def load_trace(path: str | os.PathLike) -> dict[str, Any]:
    """The trace file's JSON object."""
    with open(path) as f:
        return json.load(f)


def worker_events(data: dict[str, Any], worker: int, cat: str | None = None) -> list[dict]:
    """Worker ``worker``'s complete (``X``) events, of category ``cat``, in time order."""
    tid = fmt.worker_tid(worker)
    out = [
        e
        for e in data["traceEvents"]
        if e["ph"] == "X" and e["tid"] == tid and (cat is None or e.get("cat") == cat)
    ]
    return sorted(out, key=lambda e: e["ts"])


def traced_demo(
    sess: Any,
    path: str | os.PathLike,
    steps: int = 6,
    late_worker: int | None = None,
    late_s: float = 0.05,
) -> np.ndarray:
    """Run ``steps`` demo steps on ``sess`` (its CCL initialised) under a trace into ``path``.

    With ``late_worker``, that worker sleeps ``late_s`` seconds before the allreduce
    of step :data:`LATE_STEP` (``testing.sleep``), so it arrives last at it. Returns
    the last step's output, checked against NumPy.
    """
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 64)).astype(np.float32)
    w1 = (rng.standard_normal((64, 256)) / 8).astype(np.float32)
    w2 = (rng.standard_normal((256, 64)) / 16).astype(np.float32)
    n = sess.num_workers
    with trace(sess, path):
        sess.import_python_module("disco_core.demo_funcs")
        sess.import_python_module("disco_core.testing.funcs")
        mlp = sess.get_global_func(demo_funcs.MLP_SHARD)
        f = 256 // n  # worker k: columns of W1 and rows of W2 k*f .. (k+1)*f (the demo's split)
        a = np.ascontiguousarray(w1.reshape(64, n, f).transpose(1, 0, 2))
        b = np.ascontiguousarray(w2.reshape(n, f, 64))
        w1r, w2r = sess.scatter(a), sess.scatter(b)
        xr = sess.empty(x.shape, x.dtype)
        part = sess.empty((8, 64), x.dtype)
        out = sess.empty((8, 64), x.dtype)
        y = np.empty((8, 64), np.float32)
        for step in range(steps):
            sess.broadcast(x, xr)
            mlp(xr, w1r, w2r, part)
            if late_worker is not None and step == LATE_STEP:
                sess.call_packed("testing.sleep", late_s, late_worker)
            sess.allreduce(part, out, "sum")
            sess.copy_from_worker_0(y, out)
    np.testing.assert_allclose(y, demo_funcs.mlp_reference(x, w1, w2), rtol=1e-4, atol=1e-4)
    return y


def check_streams(data: dict[str, Any], num_workers: int) -> dict[int, list[dict]]:
    """Assert that every worker's track holds every command it ran, in order, and the
    controller's ``call_packed`` numbers and names; return each worker's commands."""
    sends = sorted(
        (e for e in data["traceEvents"] if e.get("cat") == "send"), key=lambda e: e["args"]["seq"]
    )
    assert [e["args"]["seq"] for e in sends] == list(range(len(sends)))
    out = {}
    for w in range(num_workers):
        cmds = [e for e in worker_events(data, w) if e["cat"] in ("command", "copy", "module")]
        # every command the worker ran, in order: no gap in its stream
        assert [e["args"]["index"] for e in cmds] == list(range(len(cmds))), f"worker {w}"
        calls = [e for e in cmds if e["args"]["action"] == "call_packed"]
        assert [(e["args"]["seq"], e["name"]) for e in calls] == [
            (e["args"]["seq"], e["name"]) for e in sends
        ], f"worker {w}"
        out[w] = cmds
    return out


def check_trace(path: str | os.PathLike, num_workers: int, steps: int = 6) -> dict[str, Any]:
    """Assert what a trace of :func:`traced_demo` must show; return its JSON object."""
    data = load_trace(path)
    other = data["otherData"]
    assert other["disco_trace"] == fmt.FORMAT_VERSION
    assert other["session"]["num_workers"] == num_workers
    assert other["dropped"] == [0] * num_workers, other["dropped"]
    assert not other.get("notes"), other.get("notes")
    precision = other["clock"]["precision_us"]
    assert all(p is not None and p >= 0 for p in precision), precision
    span = other["duration_us"]
    for e in data["traceEvents"]:
        # every event inside the traced window (the trace's own start and stop left out)
        if e["ph"] == "X" and e["tid"] != fmt.CONTROLLER_TID:
            slack = precision[fmt.tid_worker(e["tid"])] + 1.0
            assert -slack <= e["ts"] and e["ts"] + e["dur"] <= span + slack, (e, span)
    for w, cmds in check_streams(data, num_workers).items():
        calls = [e for e in cmds if e["args"]["action"] == "call_packed"]
        assert sum(e["name"] == demo_funcs.MLP_SHARD for e in calls) == steps, w
        assert sum(e["cat"] == "module" for e in cmds) == 2, w
    by_key: dict[str, list[dict]] = {}
    for w in range(num_workers):
        for e in worker_events(data, w, "collective"):
            if e["args"]["key"] is not None:
                by_key.setdefault(e["args"]["key"], []).append(e)
    allreduces = [m for m in by_key.values() if m[0]["name"] == "allreduce"]
    assert len(allreduces) == steps
    for members in by_key.values():
        assert sorted(e["args"]["worker"] for e in members) == list(range(num_workers))
        assert len({(e["name"], e["args"]["bytes"], e["args"]["dtype"]) for e in members}) == 1
    for members in allreduces:
        # no member can finish an allreduce before the last one arrived: on the
        # controller's clock that holds within the workers' stated precision
        last = max(members, key=lambda e: e["ts"])
        for e in members:
            slack = precision[e["args"]["worker"]] + precision[last["args"]["worker"]] + 1.0
            assert last["ts"] <= e["ts"] + e["dur"] + slack, (last, e, slack)
    return data


def check_straggler(path: str | os.PathLike, worker: int, late_s: float) -> summary.Summary:
    """Assert that ``disco trace summary`` names ``worker`` as the straggler of the
    allreduce it was made late for (:func:`traced_demo` with ``late_worker``)."""
    result = summary.summarize(summary.load(path))
    assert result.headline.startswith(f"worker {worker} "), result.headline
    late = {s.worker: s for s in result.stragglers}[worker]
    assert late.worst is not None and late.worst.op == "allreduce", late
    # the sleep, less what the others spent meanwhile on their own way to the allreduce
    assert late.worst.lateness_ms >= 0.8 * late_s * 1e3, late.worst
    assert not late.worst.within_precision
    data = load_trace(path)
    allreduces = sorted(
        {
            e["args"]["key"]
            for e in worker_events(data, worker, "collective")
            if e["name"] == "allreduce"
        },
        key=lambda k: int(k.split(":")[1]),
    )
    assert late.worst.key == allreduces[LATE_STEP], (late.worst.key, allreduces)
    return result
