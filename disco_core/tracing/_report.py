"""The text of ``disco trace summary``: the tables of a :class:`~.summary.Summary`."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .summary import Summary

__all__ = ["render", "table"]

_NOTES = """\
Notes:
  busy: the union of the worker's commands, copies and module loads (collectives run
    inside commands); idle = span - busy.
  functions: command time not inside a collective, a copy or a module load.
  coll. waiting / moving: per collective call, last_arrival = the latest start of its
    members; a member waits clamp(last_arrival - start, 0, dur) and moves the rest of
    its time. A send and its recv are one call of two members (send/recv).
  call site: the controller's send site of the command a collective ran in, else that
    command's name. time: latest end - earliest start over the call's members.
    bytes: per member. busbw = algbw x nccl-tests' factor (allreduce 2(n-1)/n,
    allgather/gather/scatter (n-1)/n, broadcast/send/recv 1, barrier -), algbw =
    size / (latest end - last_arrival), summed over the row's calls; size = bytes,
    n x bytes for allgather/gather/scatter (as nccl-tests counts them).
  lateness: last_arrival - the second-latest start of a call with 2+ members.
    ~ marks lateness no larger than the two workers' clock precisions added: it may
    be clock error rather than a late worker."""


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], left: int = 0) -> list[str]:
    """Lines of a table: the first ``left`` columns aligned left, the others right."""
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        parts = [
            c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
        ]
        return "  ".join(parts).rstrip()

    return [line(headers), *(line(r) for r in rows)]


def _ms_pct(ms: float, span_ms: float) -> str:
    pct = 100.0 * ms / span_ms if span_ms > 0 else 0.0
    return f"{ms:.3f} ({pct:.1f}%)"


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _header(s: Summary) -> list[str]:
    out = [
        f"Disco trace {s.path}: {s.num_workers} worker{'s' if s.num_workers != 1 else ''} "
        f"({s.channel} channel), {s.span_ms:.3f} ms traced"
    ]
    prec = s.precision_us
    if prec:
        worst = max(range(len(prec)), key=lambda w: prec[w])
        which = "" if min(prec) == prec[worst] else f" (worker {worst} the least precise)"
        out.append(f"clock: precision +-{min(prec):.1f} to +-{prec[worst]:.1f} us{which}")
    else:
        out.append("clock: the trace gives no precision: small lateness may be clock error")
    # The method is a sentence or two: wrapped under its own heading.
    out += textwrap.wrap(
        f"clock offsets: {s.clock_method}",
        width=100,
        subsequent_indent="  ",
        break_on_hyphens=False,
    )
    for w, n in enumerate(s.dropped):
        if n > 0:
            out.append(
                f"dropped: the oldest {n} events of worker {w} were lost (ring buffer full); "
                "the numbers cover the rest"
            )
    if s.controller_dropped > 0:
        out.append(
            f"dropped: the oldest {s.controller_dropped} events of the controller were lost "
            "(ring buffer full); call sites of the commands they sent are unknown"
        )
    failed = [f"worker {w} {n}" for w, n in enumerate(s.failed) if n]
    if failed:
        out += textwrap.wrap(
            "failed: collective operations that raised (a peer died, the CCL was aborted, "
            f"a wrong call) count as waiting, and are left out of the call sites and "
            f"the stragglers: {', '.join(failed)}",
            width=100,
            subsequent_indent="  ",
        )
    for note in s.notes:  # e.g. a worker that died: its idle time below is not idleness
        out += textwrap.wrap(f"note: {note}", width=100, subsequent_indent="  ")
    return out


def render(s: Summary) -> str:
    """The whole text of ``disco trace summary`` for ``s``."""
    # The top line is the answer most runs are read for: who held the others up.
    out = [s.headline, *_header(s), ""]

    if any(w.span_ms < s.span_ms for w in s.workers):
        out.append(
            f"Per worker: ms (% of the {s.span_ms:.3f} ms span; where events were dropped, "
            "of the part from the oldest kept one: worker " + ", ".join(
                f"{w.worker} {w.span_ms:.3f} ms" for w in s.workers if w.span_ms < s.span_ms
            ) + ")"
        )  # fmt: skip
    else:
        out.append(f"Per worker: ms (% of the {s.span_ms:.3f} ms span)")
    heads = ["worker", "busy", "functions", "coll. waiting", "coll. moving", "copies"]
    heads += ["modules", "idle"]
    rows = [
        [
            str(w.worker),
            *(
                _ms_pct(v, w.span_ms)
                for v in (w.busy_ms, w.functions_ms, w.waiting_ms, w.moving_ms, w.copies_ms)
            ),
            _ms_pct(w.modules_ms, w.span_ms),
            _ms_pct(w.idle_ms, w.span_ms),
        ]
        for w in s.workers
    ]
    out += table(heads, rows, left=1) if rows else ["  (no workers)"]

    out += ["", "Per collective call site"]
    if s.call_sites:
        rows = [
            [
                c.op,
                c.site,
                str(c.count),
                f"{c.mean_ms:.3f}",
                f"{c.p50_ms:.3f}",
                f"{c.p99_ms:.3f}",
                _bytes(c.bytes),
                "-" if c.busbw_gbps is None else f"{c.busbw_gbps:.2f}",
            ]
            for c in s.call_sites
        ]
        heads = ["op", "site", "calls", "mean ms", "p50 ms", "p99 ms", "bytes", "busbw GB/s"]
        out += table(heads, rows, left=2)
    else:
        out.append("  (no collectives)")

    out += ["", "Stragglers: who arrived last at a collective call, and by how much"]
    late = sorted((x for x in s.stragglers if x.times_last), key=lambda x: -x.lateness_ms)
    if late:
        rows = []
        for x in late:
            worst = x.worst
            where = "" if worst is None else f"{worst.key} ({worst.op} at {worst.site})"
            rows.append(
                [
                    str(x.worker),
                    f"{x.times_last} of {s.calls}",
                    f"{x.lateness_ms:.3f}" + (" ~" if x.within_precision == x.times_last else ""),
                    str(x.within_precision),
                    where,
                    ""
                    if worst is None
                    else f"{worst.lateness_ms:.3f}" + (" ~" if worst.within_precision else ""),
                ]
            )
        heads = ["worker", "last", "lateness ms", "~ clock", "worst call", "its ms"]
        out += table(heads, rows, left=1)
        fuzzy = sum(x.within_precision for x in late)
        if fuzzy:
            total = sum(x.times_last for x in late)
            out.append(
                f"warning: {fuzzy} of the {total} last arrivals (column ~ clock) were by no "
                "more than the clock precision: they may be clock error, not lateness"
            )
    else:
        out.append("  (none)")
    out += ["", _NOTES]
    return "\n".join(out)
