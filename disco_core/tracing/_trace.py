"""Reading a trace file (:mod:`disco_core.tracing.format`) into tracks and collective calls.

:func:`load` checks the file and sorts its complete (``ph: "X"``) events by track and
category; :func:`instances` joins the members of each collective call. The summary
and the plot both start from here.
"""

from __future__ import annotations

import bisect
import json
import math
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import DiscoError, DiscoFileNotFoundError, DiscoValueError
from .format import CONTROLLER_TID, FORMAT_VERSION, tid_worker

__all__ = ["Span", "Track", "Trace", "Instance", "SiteFinder", "load", "instances", "send_sites", "printable"]  # fmt: skip

#: The categories of complete events a reader uses; the others are ignored.
_CATEGORIES = ("command", "collective", "copy", "module", "send", "sync")


@dataclass(frozen=True)
class Span:
    """One complete event: ``start`` and ``end`` in microseconds from the trace's start."""

    start: float
    end: float
    cat: str
    name: str
    args: Mapping[str, Any]

    @property
    def dur(self) -> float:
        return self.end - self.start


@dataclass
class Track:
    """The events of one track (a worker's or the controller's), by category, by start."""

    command: list[Span] = field(default_factory=list)
    collective: list[Span] = field(default_factory=list)
    copy: list[Span] = field(default_factory=list)
    module: list[Span] = field(default_factory=list)
    send: list[Span] = field(default_factory=list)
    sync: list[Span] = field(default_factory=list)


@dataclass
class Trace:
    """A trace file, read and checked by :func:`load`.

    Attributes
    ----------
    path : str
        The file it was read from.
    num_workers : int
        ``otherData.session.num_workers`` (else one past the highest worker track).
    duration_us : float
        The traced window, ``otherData.duration_us``.
    session : dict
        ``otherData.session`` as written (channel, num_workers, num_groups).
    clock_method : str
        How the clock offsets were measured (``otherData.clock.method``).
    precision_us : list of float
        The +- of each worker's clock offset; empty when the file gives none.
    dropped : list of int
        Per worker, the oldest events lost to its ring buffer.
    controller_dropped : int
        The same for the controller.
    workers : list of Track
        Each worker's events (index: worker id).
    controller : Track
        The controller's events (``send``, ``sync``, ``copy``).
    notes : list of str
        What the writer could not record (``otherData.notes``): a worker that died,
        did not answer in time, or sent events that were left out.
    """

    path: str
    num_workers: int
    duration_us: float
    session: dict[str, Any]
    clock_method: str
    precision_us: list[float]
    dropped: list[int]
    controller_dropped: int
    workers: list[Track]
    controller: Track
    notes: list[str] = field(default_factory=list)


def _notes(value: Any) -> list[str]:
    """The file's notes, printable and bounded (a forged file's go to a terminal)."""
    items = value[:100] if isinstance(value, list) else []
    return [printable(n[:500]) for n in items if isinstance(n, str)]


@dataclass
class Instance:
    """One collective call: its members' events (those with the same ``key``).

    ``members`` holds ``(worker, span)`` by worker; ``last_arrival`` is the latest
    start among them.
    """

    key: str
    op: str
    members: list[tuple[int, Span]]

    @property
    def first_start(self) -> float:
        return min(s.start for _, s in self.members)

    @property
    def last_arrival(self) -> float:
        return max(s.start for _, s in self.members)

    @property
    def last_end(self) -> float:
        return max(s.end for _, s in self.members)


#: The most workers a trace file may claim (its header or its tracks).
_MAX_WORKERS = 1 << 16


def _bad(path: str, what: str) -> DiscoValueError:
    return DiscoValueError(f"{path}: {what}")


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return float(value) if math.isfinite(value) else None
    except OverflowError:  # an int past float's range: no usable number either
        return None


def _mapping(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _read(path: str) -> Any:
    try:
        # O_NONBLOCK: a FIFO's open would wait for a writer (for ever); it is refused below
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise DiscoFileNotFoundError(f"{path}: no such file") from None
    except OSError as exc:
        raise DiscoError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # /dev/zero never ends, a FIFO may not
        os.close(fd)
        raise _bad(path, "not a regular file")
    try:  # (MemoryError: a sparse file of gigabytes takes no disk)
        with open(fd, "rb") as f:
            raw = f.read()
        return json.loads(raw)
    except OSError as exc:
        raise DiscoError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    except MemoryError:
        raise DiscoError(f"{path}: too large to read in this process's memory") from None
    except (UnicodeDecodeError, ValueError) as exc:  # (ValueError: JSON's, and int digits)
        raise _bad(path, f"not JSON ({exc})") from None
    except RecursionError:
        raise _bad(path, "not a trace: nested too deeply") from None


def printable(text: str) -> str:
    """``text`` with what a terminal would act on (escape sequences, controls) as ``?``:
    a trace file's names are printed, and a shared file may be forged."""
    return text if text.isprintable() else "".join(c if c.isprintable() else "?" for c in text)


#: Event args a reader prints: made printable as they are read.
_PRINTED_ARGS = ("op", "site", "key")
#: The largest ``ts`` or ``dur`` a reader takes, in microseconds (about 30 years): a
#: forged 1e300 made a straggler 1e300 ms late in a 352 ms trace (outside check).
_MAX_US = 1e15


def load(path: str | os.PathLike[str]) -> Trace:
    """Read and check the trace file at ``path``.

    Raises
    ------
    DiscoValueError
        Naming the file and what is wrong: not JSON, not a Disco trace (no
        ``otherData.disco_trace``), a newer format version than this reader's, or an
        event without its times.
    DiscoFileNotFoundError
        No file at ``path``.
    """
    name = os.fspath(path)
    doc = _read(name)
    other = doc.get("otherData") if isinstance(doc, dict) else None
    if not isinstance(other, dict) or "disco_trace" not in other:
        raise _bad(name, "not a Disco trace (no otherData.disco_trace)")
    version = other["disco_trace"]
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise _bad(name, f"not a Disco trace (otherData.disco_trace is {version!r})")
    if version > FORMAT_VERSION:
        raise _bad(
            name,
            f"trace format version {version} is newer than this reader's ({FORMAT_VERSION}): "
            "read it with a newer disco-core",
        )
    events = doc.get("traceEvents")
    if not isinstance(events, list):
        raise _bad(name, "traceEvents is missing or not a list")

    by_tid: dict[int, Track] = {}
    for i, ev in enumerate(events):
        if not isinstance(ev, dict):
            raise _bad(name, f"event {i} is not an object")
        if ev.get("ph") != "X" or ev.get("cat") not in _CATEGORIES:
            continue  # metadata, flow arrows, and whatever a later writer adds
        ts, dur, tid = _number(ev.get("ts")), _number(ev.get("dur")), ev.get("tid")
        if ts is None or dur is None or not (0 <= dur <= _MAX_US and -_MAX_US <= ts <= _MAX_US) or not isinstance(tid, int) or tid < 0:  # fmt: skip
            raise _bad(name, f"event {i} ({ev.get('cat')} {ev.get('name')!r}) has bad ts/dur/tid")
        args = ev.get("args")
        if not isinstance(args, dict):
            args = {}
        if any(isinstance(args.get(k), str) and not args[k].isprintable() for k in _PRINTED_ARGS):
            args = {**args, **{k: printable(args[k]) for k in _PRINTED_ARGS if isinstance(args.get(k), str)}}  # fmt: skip
        nbytes = args.get("bytes")
        if nbytes is not None and ((value := _number(nbytes)) is None or value < 0):
            raise _bad(name, f"event {i} ({ev.get('cat')} {ev.get('name')!r}) has bad bytes")
        span = Span(ts, ts + dur, ev["cat"], printable(str(ev.get("name", ""))), args)
        getattr(by_tid.setdefault(tid, Track()), span.cat).append(span)
    for track in by_tid.values():
        for cat in _CATEGORIES:
            getattr(track, cat).sort(key=lambda s: (s.start, -s.end))

    session = _mapping(other.get("session"))
    clock = _mapping(other.get("clock"))
    highest = max((tid_worker(t) for t in by_tid if t != CONTROLLER_TID), default=-1)
    num_workers = session.get("num_workers")
    if num_workers is not None and (isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1):  # fmt: skip
        raise _bad(
            name, f"otherData.session.num_workers is {num_workers!r}, not a count of workers"
        )
    if num_workers is None or num_workers < highest + 1:
        num_workers = highest + 1
    if num_workers > _MAX_WORKERS:  # a forged header: per-worker tables would exhaust memory
        raise _bad(name, f"it claims {num_workers} workers (at most {_MAX_WORKERS} are read)")
    duration = _number(other.get("duration_us"))
    if duration is not None and duration < 0:
        raise _bad(name, f"otherData.duration_us is negative ({duration})")
    if not duration:  # a reader can still say something: the last event's end
        ends = [s.end for t in by_tid.values() for c in _CATEGORIES for s in getattr(t, c)]
        duration = max(ends, default=0.0)

    def per_worker(value: Any, cast: type) -> list:
        items = list(value) if isinstance(value, list) else []
        out = [cast(v) if _number(v) is not None else cast(0) for v in items[:num_workers]]
        return out + [cast(0)] * (num_workers - len(out))

    return Trace(
        path=name,
        num_workers=num_workers,
        duration_us=duration,
        session=session,
        clock_method=printable(str(clock.get("method", "unknown"))),
        # Empty when the file does not say: "unknown", not "exact".
        precision_us=(
            per_worker(clock["precision_us"], float)
            if isinstance(clock.get("precision_us"), list)
            else []
        ),
        dropped=per_worker(other.get("dropped"), int),
        controller_dropped=int(_number(other.get("controller_dropped")) or 0),
        workers=[by_tid.get(w + 1, Track()) for w in range(num_workers)],
        controller=by_tid.get(CONTROLLER_TID, Track()),
        notes=_notes(other.get("notes")),
    )


def instances(trace: Trace) -> list[Instance]:
    """The collective calls of ``trace`` (events with a ``key``, but those that
    ``failed``: their members need not have met), by first start."""
    groups: dict[str, Instance] = {}
    for w, track in enumerate(trace.workers):
        for span in track.collective:
            key = span.args.get("key")
            if key is None or span.args.get("failed"):
                continue  # nothing to join it with; an operation that raised
            # a send and its recv are one exchange (keys "p2p:<from>><to>:<k>")
            op = "send/recv" if str(key).startswith("p2p:") else str(span.args.get("op", span.name))
            groups.setdefault(str(key), Instance(str(key), op, [])).members.append((w, span))
    return sorted(groups.values(), key=lambda inst: (inst.first_start, inst.key))


class SiteFinder:
    """The call site of each collective of a trace.

    The controller's ``send`` site of the command the collective ran in (its
    ``cmd_seq`` is the send's ``seq``), else that command's name, else ``"?"``.
    """

    def __init__(self, trace: Trace) -> None:
        self._sites = send_sites(trace)
        self._commands = [t.command for t in trace.workers]
        self._starts = [[c.start for c in t.command] for t in trace.workers]
        self._by_seq = [
            {c.args["seq"]: c.name for c in t.command if isinstance(c.args.get("seq"), int)}
            for t in trace.workers
        ]

    def __call__(self, worker: int, span: Span) -> str:
        cmd_seq = span.args.get("cmd_seq", -1)
        if isinstance(cmd_seq, int) and cmd_seq in self._sites:
            return self._sites[cmd_seq]
        if isinstance(cmd_seq, int) and cmd_seq >= 0 and cmd_seq in self._by_seq[worker]:
            return self._by_seq[worker][cmd_seq]
        # A command that started no later than the collective and encloses it; a few
        # steps back in case commands nest (a module load inside a call).
        commands = self._commands[worker]
        k = bisect.bisect_right(self._starts[worker], span.start) - 1
        for j in range(k, max(k - 4, -1), -1):
            if commands[j].end >= span.end:
                return commands[j].name
        return "?"


def send_sites(trace: Trace) -> dict[int, str]:
    """The controller's ``send`` events: ``seq`` to ``site`` (those that have both)."""
    out = {}
    for span in trace.controller.send:
        seq, site = span.args.get("seq"), span.args.get("site")
        if isinstance(seq, int) and isinstance(site, str) and site:
            out[seq] = site
    return out
