"""``disco trace summary``: where each worker's time went, per call site, and who arrived last.

:func:`load` reads a trace file (:mod:`disco_core.tracing.format`), :func:`summarize`
computes a :class:`Summary` and :func:`format_summary` prints it. Every time is on
the controller's clock, as in the file.

Per worker
    *span*: ``otherData.duration_us``, the traced window; for a worker whose ring
    dropped its oldest events, from its oldest kept one to the window's end.
    *busy*: the union of the worker's top-level events (commands, copies, module
    loads; collectives are nested inside commands), cut to the window.
    *functions*: command time not inside a collective (nor inside a copy or a module
    load, counted there). *collectives waiting / moving*: for each collective call
    (the events with the same ``key`` on its members), ``last_arrival`` is the
    latest start of its members; a member's waiting is
    ``clamp(last_arrival - start, 0, dur)`` (it waited for the others), its moving
    ``dur - waiting``; a ``send`` and its ``recv`` (the k-th send from a to b and the k-th
    recv on b from a share a key) are split the same way; an operation that failed
    (``args.failed``) counts as waiting. *copies*: ``copy``
    events; *modules*: ``module`` events; *idle*: span - busy.

Per collective call site
    The site is the controller's ``send`` event's ``args.site`` of the command the
    collective ran in (the collective's ``cmd_seq`` is the send's ``seq``), else
    that command's name. One row per (op, site): *count* of calls; *mean*, *p50*,
    *p99* of a call's time (latest end - earliest start over its members;
    percentiles linear between ranks); *bytes* per member (mean over the calls);
    *busbw* in GB/s as nccl-tests reports it: algbw = size / (latest end -
    last_arrival), summed over the row's calls, where size is the bytes per member
    (n times that for allgather, gather and scatter, whose bytes is one member's
    piece), times allreduce 2(n-1)/n; allgather, gather and scatter (n-1)/n;
    broadcast and send/recv 1; barrier none.

Stragglers
    For each collective call with two or more members, the last to arrive and its
    lateness = last_arrival - the second-latest start (a tie names nobody). Per
    worker: the times it was last, the total lateness, and its worst call. A
    lateness no larger than the two workers' clock precisions added
    (``otherData.clock.precision_us``) may be clock error: those are counted apart.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

from ._intervals import clip, measure, overlap, percentile, union
from ._report import render
from ._trace import Instance, SiteFinder, Trace, instances, load, printable

__all__ = [
    "Trace",
    "load",
    "WorkerTime",
    "CallSite",
    "LateCall",
    "Straggler",
    "Summary",
    "summarize",
    "format_summary",
    "bus_factor",
]

#: Point-to-point operations: no ``key``, never joined into a call.
_P2P = ("send", "recv", "send/recv")
#: Operations whose ``bytes`` is one member's piece of the array nccl-tests sizes them by.
_WHOLE_IS_N_PIECES = ("allgather", "gather", "scatter")


@dataclass
class WorkerTime:
    """Where one worker's time went, in milliseconds (see the module's definitions)."""

    worker: int
    span_ms: float
    busy_ms: float
    functions_ms: float
    waiting_ms: float
    moving_ms: float
    copies_ms: float
    modules_ms: float
    idle_ms: float
    #: The oldest events lost to the worker's ring buffer (the numbers cover the rest).
    dropped: int = 0


@dataclass
class CallSite:
    """The collective calls of one operation at one call site."""

    op: str
    site: str
    count: int
    mean_ms: float
    p50_ms: float
    p99_ms: float
    #: Bytes per member, the mean over the calls.
    bytes: int
    #: Bus bandwidth in GB/s (None for a barrier, or no time spent moving).
    busbw_gbps: float | None


@dataclass
class LateCall:
    """One collective call a worker arrived last at."""

    key: str
    op: str
    site: str
    lateness_ms: float
    #: True when the lateness is no larger than the clock precision (it may be clock error).
    within_precision: bool


@dataclass
class Straggler:
    """How often one worker arrived last at a collective call, and how late."""

    worker: int
    times_last: int
    lateness_ms: float
    #: Of ``times_last``, those by no more than the clock precision.
    within_precision: int
    worst: LateCall | None = None


@dataclass
class Summary:
    """Everything ``disco trace summary`` prints.

    Attributes
    ----------
    path : str
        The trace file.
    channel : str
        The session's channel (``"?"`` when the file does not say).
    num_workers : int
    span_ms : float
        The traced window.
    clock_method : str
        How the workers' clock offsets were measured.
    precision_us : list of float
        The +- of each worker's clock offset (empty: not in the file).
    dropped : list of int
        Per worker, the oldest events lost (the numbers cover the rest).
    controller_dropped : int
    notes : list of str
        The file's notes: what the trace could not record (a worker's track left empty).
    workers : list of WorkerTime
        By worker.
    call_sites : list of CallSite
        By op, then by total time, the longest first.
    calls : int
        Collective calls with two or more members (the stragglers' denominator).
    stragglers : list of Straggler
        By worker.
    headline : str
        One line naming the worst straggler.
    failed : list of int
        Per worker, the collective operations that raised (``args.failed``): their time
        counts as waiting; they are left out of the call sites and the stragglers.
    """

    path: str
    channel: str
    num_workers: int
    span_ms: float
    clock_method: str
    precision_us: list[float]
    dropped: list[int]
    controller_dropped: int
    notes: list[str] = field(default_factory=list)
    workers: list[WorkerTime] = field(default_factory=list)
    call_sites: list[CallSite] = field(default_factory=list)
    calls: int = 0
    stragglers: list[Straggler] = field(default_factory=list)
    headline: str = ""
    failed: list[int] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON (NaN becomes None)."""
        return _no_nan(asdict(self))


def _no_nan(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _no_nan(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_no_nan(v) for v in value]
    return value


def bus_factor(op: str, n: int) -> float | None:
    """nccl-tests' bus bandwidth factor of ``op`` among ``n`` members (None: no bandwidth)."""
    if op == "allreduce":
        return 2.0 * (n - 1) / n
    if op in ("allgather", "gather", "scatter"):
        return (n - 1) / n
    if op in ("broadcast", *_P2P):
        return 1.0
    return None  # barrier, and operations this reader does not know


def _nbytes(args: Any) -> int:
    value = args.get("bytes", 0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return 0
    return int(value)


def _worker_times(trace: Trace, calls: list[Instance]) -> list[WorkerTime]:
    n, span = trace.num_workers, trace.duration_us
    waiting, moving = [0.0] * n, [0.0] * n
    for inst in calls:
        last = inst.last_arrival
        for w, s in inst.members:
            wait = min(max(last - s.start, 0.0), s.dur)
            waiting[w] += wait
            moving[w] += s.dur - wait
    out = []
    for w, track in enumerate(trace.workers):
        moving[w] += sum(s.dur for s in track.collective if s.args.get("key") is None and not s.args.get("failed"))  # fmt: skip
        # a failed operation's time, mostly spent waiting for a peer that never came,
        # is waiting (it was counted nowhere: the columns did not add up to busy)
        waiting[w] += sum(s.dur for s in track.collective if s.args.get("failed"))
        commands = union((s.start, s.end) for s in track.command)
        inner = union((s.start, s.end) for s in (*track.collective, *track.copy, *track.module))
        # A ring that dropped its oldest events covers the window from its oldest kept
        # one: over the whole window, the lost part would count as idle
        begin = 0.0
        if trace.dropped[w] and (commands or inner):
            begin = min(max(min(a for a, _ in [*commands, *inner]), 0.0), span)
        busy = clip(union([*commands, *inner]), begin, span)
        copies = measure(union((s.start, s.end) for s in track.copy))
        modules = measure(union((s.start, s.end) for s in track.module))
        out.append(
            WorkerTime(
                worker=w,
                span_ms=(span - begin) / 1e3,
                busy_ms=measure(busy) / 1e3,
                functions_ms=(measure(commands) - overlap(commands, inner)) / 1e3,
                waiting_ms=waiting[w] / 1e3,
                moving_ms=moving[w] / 1e3,
                copies_ms=copies / 1e3,
                modules_ms=modules / 1e3,
                idle_ms=max(span - begin - measure(busy), 0.0) / 1e3,
                dropped=trace.dropped[w],
            )
        )
    return out


def _call_sites(trace: Trace, calls: list[Instance], site_of: SiteFinder) -> list[CallSite]:
    # (op, site) -> [(call time us, bytes per member, bus bytes, moving us)]
    rows: dict[tuple[str, str], list[tuple[float, int, float | None, float]]] = defaultdict(list)
    for inst in calls:
        w, first = inst.members[0]
        nbytes = max(_nbytes(s.args) for _, s in inst.members)
        n = len(inst.members)
        factor = bus_factor(inst.op, n)
        # nccl-tests' size: the whole gathered or scattered array (n pieces of a member's)
        size = nbytes * n if inst.op in _WHOLE_IS_N_PIECES else nbytes
        rows[(inst.op, site_of(w, first))].append(
            (
                inst.last_end - inst.first_start,
                nbytes,
                None if factor is None else size * factor,
                inst.last_end - inst.last_arrival,
            )
        )
    for w, track in enumerate(trace.workers):
        for s in track.collective:
            if s.args.get("key") is None and not s.args.get("failed"):
                op, nbytes = str(s.args.get("op", s.name)), _nbytes(s.args)
                rows[(op, site_of(w, s))].append((s.dur, nbytes, float(nbytes), s.dur))
    out = []
    for (op, site), items in rows.items():
        times = [t for t, _, _, _ in items]
        bus = [b for _, _, b, _ in items]
        moving = sum(m for _, _, _, m in items)
        busbw = None
        if all(b is not None for b in bus) and moving > 0:
            busbw = sum(b for b in bus if b is not None) / moving / 1e3  # bytes/us = MB/s
        out.append(
            CallSite(
                op=op,
                site=site,
                count=len(items),
                mean_ms=sum(times) / len(times) / 1e3,
                p50_ms=percentile(times, 50) / 1e3,
                p99_ms=percentile(times, 99) / 1e3,
                bytes=round(sum(b for _, b, _, _ in items) / len(items)),
                busbw_gbps=busbw,
            )
        )
    out.sort(key=lambda r: (r.op, -r.mean_ms * r.count, r.site))
    return out


def _stragglers(
    trace: Trace, calls: list[Instance], site_of: SiteFinder
) -> tuple[int, list[Straggler]]:
    found = [Straggler(w, 0, 0.0, 0) for w in range(trace.num_workers)]
    prec = trace.precision_us or [0.0] * trace.num_workers
    counted = 0
    for inst in calls:
        if len(inst.members) < 2:
            continue
        counted += 1
        order = sorted(inst.members, key=lambda m: m[1].start)
        (second_w, second), (last_w, last) = order[-2], order[-1]
        lateness = last.start - second.start
        if lateness <= 0:
            continue  # a tie: nobody was last
        within = lateness <= prec[last_w] + prec[second_w]
        entry = found[last_w]
        entry.times_last += 1
        entry.lateness_ms += lateness / 1e3
        entry.within_precision += within
        if entry.worst is None or lateness / 1e3 > entry.worst.lateness_ms:
            site = site_of(last_w, last)
            entry.worst = LateCall(inst.key, inst.op, site, lateness / 1e3, within)
    return counted, found


def _duration(ms: float) -> str:
    return f"{ms:.1f} ms" if ms >= 1 else f"{ms * 1e3:.1f} us"


def _headline(calls: int, stragglers: list[Straggler]) -> str:
    late = [s for s in stragglers if s.times_last]
    if not calls:
        return "no collective call with two or more members: no stragglers"
    if not late:
        return f"no stragglers: the members of all {calls} collective calls arrived together"
    worst = max(late, key=lambda s: (s.lateness_ms, s.times_last))
    line = (
        f"worker {worst.worker} arrived last at {worst.times_last} of {calls} collective"
        f"{'s' if calls != 1 else ''}, {_duration(worst.lateness_ms)} in all"
    )
    if worst.within_precision == worst.times_last:
        line += " (every time within the clock precision: it may be clock error)"
    return line


def summarize(trace: Trace) -> Summary:
    """The numbers of ``trace``: per worker, per collective call site, and stragglers.

    Parameters
    ----------
    trace : Trace
        A trace read by :func:`load`.

    Returns
    -------
    Summary
        See the module's docstring for the definitions.
    """
    calls = instances(trace)
    site_of = SiteFinder(trace)
    counted, stragglers = _stragglers(trace, calls, site_of)
    return Summary(
        path=trace.path,
        channel=printable(str(trace.session.get("channel", "?"))),
        num_workers=trace.num_workers,
        span_ms=trace.duration_us / 1e3,
        clock_method=trace.clock_method,
        precision_us=list(trace.precision_us),
        dropped=list(trace.dropped),
        controller_dropped=trace.controller_dropped,
        notes=list(trace.notes),
        workers=_worker_times(trace, calls),
        call_sites=_call_sites(trace, calls, site_of),
        calls=counted,
        stragglers=stragglers,
        headline=_headline(counted, stragglers),
        failed=[sum(1 for s in t.collective if s.args.get("failed")) for t in trace.workers],
    )


def format_summary(summary: Summary) -> str:
    """``summary`` as the text ``disco trace summary`` prints."""
    return render(summary)
