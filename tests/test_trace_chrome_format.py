"""A trace file is well-formed Chrome trace-event JSON (what Perfetto and chrome://tracing need).

No trace viewer is installed here, so this checks the structure the viewers rely on:
the fields each phase needs, finite numeric times, complete (``X``) events that
nest on each track (Perfetto drops partly overlapping ones), and flow arrows whose
every step sits inside a slice of a named track, one start and one end per arrow,
the steps in time order (the first member to arrive starts the arrow, the last ends it).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict

import pytest

import disco_core as disco
from disco_core.testing import trace_checks

pytestmark = pytest.mark.timeout(120)


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON (a browser's JSON.parse rejects it)")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@pytest.fixture(scope="module")
def traced(tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("trace") / "run.json"
    with disco.ThreadedSession(4) as sess:  # 4 divides the demo's 256 hidden columns
        sess.init_ccl("shm")
        trace_checks.traced_demo(sess, path, steps=4, late_worker=2)
    with open(path) as f:
        return json.loads(f.read(), parse_constant=_reject_constant)


def test_every_event_has_the_fields_its_phase_needs(traced: dict):
    events = traced["traceEvents"]
    assert traced["displayTimeUnit"] in ("ms", "ns")
    phases = defaultdict(int)
    for e in events:
        phases[e["ph"]] += 1
        assert isinstance(e["name"], str) and e["name"], e
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int), e
        if e["ph"] == "M":
            assert e["name"] in ("process_name", "thread_name", "thread_sort_index"), e
            assert isinstance(e["args"], dict), e
        elif e["ph"] == "X":
            assert _is_number(e["ts"]) and _is_number(e["dur"]) and e["dur"] >= 0, e
            assert isinstance(e["cat"], str) and isinstance(e.get("args", {}), dict), e
        else:
            assert e["ph"] in ("s", "t", "f"), e
            assert _is_number(e["ts"]) and "id" in e and e["cat"], e
            if e["ph"] != "s":
                assert e["bp"] == "e", e  # bound to the enclosing slice, not the next one
    assert phases["M"] and phases["X"] and phases["s"] and phases["f"]


def test_complete_events_nest_on_each_track(traced: dict):
    tracks: dict[tuple[int, int], list[tuple[float, float, str]]] = defaultdict(list)
    for e in traced["traceEvents"]:
        if e["ph"] == "X":
            tracks[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"], e["name"]))
    for key, slices in tracks.items():
        slices.sort(key=lambda s: (s[0], -(s[1] - s[0])))
        stack: list[tuple[float, float, str]] = []
        for s in slices:
            while stack and stack[-1][1] <= s[0]:
                stack.pop()
            assert not stack or s[1] <= stack[-1][1] + 1e-3, f"{key}: {s} overlaps {stack[-1]}"
            stack.append(s)


def test_flow_steps_join_slices_of_named_tracks(traced: dict):
    events = traced["traceEvents"]
    named = {(e["pid"], e["tid"]) for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    slices = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            slices[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    flows = defaultdict(list)
    for e in events:
        if e["ph"] in ("s", "t", "f"):
            flows[(e["cat"], e["name"], e["id"])].append(e)
    assert flows
    for key, steps in flows.items():
        phases = sorted(e["ph"] for e in steps)
        assert phases.count("s") == 1 and phases.count("f") == 1, (key, phases)
        tracks = [(e["pid"], e["tid"]) for e in steps]
        assert len(set(tracks)) == len(tracks), (key, tracks)  # one step per worker
        for e, where in zip(steps, tracks):
            assert where in named, (key, where)
            assert any(a <= e["ts"] <= b for a, b in slices[where]), (key, e)
        # Perfetto and catapult take flow steps in time order: a step before its
        # arrow's start is dropped (Perfetto counts it as flow_step_without_start)
        order = {"s": 0, "t": 1, "f": 2}
        times = [e["ts"] for e in sorted(steps, key=lambda e: order[e["ph"]])]
        assert times == sorted(times), (key, [(e["ph"], e["tid"], e["ts"]) for e in steps])
