"""The event recorder of one worker (or of the controller): a ring buffer of fixed records.

Each event is eight 64-bit integers (six for a worker's commands, in a
:class:`CommandRing` of their own; three for the controller's sends, in a
:class:`SendRing`) written with one ``struct.pack_into`` into a preallocated buffer
(about 0.1 us), so recording costs no allocation per event and the memory a trace
takes is bounded by its capacity: when a ring is full the oldest events are
overwritten and counted as dropped. The buffer is an
anonymous mapping, zero-filled lazily by the kernel, so only the part a trace uses
is ever touched (a ``bytearray`` would be memset whole: 4 to 7 MiB of every traced
process's memory at the default capacity, gigabytes at a large one).

Strings (function names, call sites, a collective's attributes) are interned in
a table and referred to by index.
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
import time
from typing import Any

import numpy as np

from ..errors import DiscoValueError

__all__ = [
    "Recorder",
    "DEFAULT_CAPACITY",
    "FIELDS",
    "K_COMMAND",
    "K_COPY",
    "K_MODULE",
    "K_COLLECTIVE",
    "K_SEND",
    "K_SYNC",
    "OK",
    "FAILED",
    "SHORT_RECORD",
    "SEND_RECORD",
    "CommandRing",
    "SendRing",
    "capacity_from_env",
    "check_capacity",
    "MIN_CAPACITY",
    "MAX_CAPACITY",
    "clock_identity",
    "now",
]

#: Events a worker keeps (the newest ones), unless ``DISCO_TRACE_EVENTS`` says otherwise:
#: 4 MiB of records for the controller, 7 MiB for a worker's two rings (commands and
#: collectives; what it exports is the newest of them all). Reading a trace back (``disco trace summary``,
#: ``plot``) takes about 1.2 KB of memory per event, so a full default trace of 4
#: workers reads in ~550 MB.
DEFAULT_CAPACITY = 1 << 16
#: The fewest and the most events a ring may hold (the most: 1 GiB of records).
MIN_CAPACITY, MAX_CAPACITY = 1 << 10, 1 << 24
#: int64 fields of a record: kind, name, start, end, and four per kind (see below).
FIELDS = 8

# Worker events: (kind, name, t0, t1, seq, reg or bytes, index, action)
K_COMMAND = 1
K_COPY = 2
K_MODULE = 3
# A worker writes its commands apart, in a CommandRing, six fields each (the hot path:
# fewer steps per command): (kind | name << 8, t0, t1, reg or bytes, the other commands
# before it or -1 if it is no call_packed, action); export() rebuilds the record above.
# (kind, op, t0, t1, seq on its communicator, bytes, OK or FAILED, attributes); the
# command it ran in is the next command record (a command is recorded when it ends)
K_COLLECTIVE = 4
#: How a collective ended: it returned, or it raised (a peer died, the CCL was aborted,
#: a wrong call): a failed one's members need not have met, and a reader leaves it out
#: of lateness and bandwidth (outside check: 47 aborted calls made a straggler 856 ms
#: late in a 605 ms trace).
OK, FAILED = -1, -2
# Controller events: (kind, name, t0, t1, seq, site, worker, bytes)
K_SEND = 10
K_SYNC = 11

_RECORD = struct.Struct(f"<{FIELDS}q")
#: Six fields: a worker's command record (:class:`CommandRing`).
SHORT_RECORD = struct.Struct("<6q")
#: Three fields: a controller's send (:class:`SendRing`).
SEND_RECORD = struct.Struct("<3q")

# The positional parameters of each CCL operation (``disco_core.ccl.base.CCL``).
_PARAMS = {
    "allreduce": ("src", "dst", "op", "in_group"),
    "allgather": ("src", "dst", "in_group"),
    "broadcast": ("src", "dst", "in_group"),
    "scatter": ("src", "dst", "in_group"),
    "gather": ("src", "dst", "in_group"),
    "send": ("buf", "peer"),
    "recv": ("buf", "peer"),
    "barrier": ("in_group",),
}
# For a call with positional arguments only: the place of the buffer that sizes it
# (-1: none) and of the first argument after the buffers (the reduction, in_group,
# the peer). A call's attributes follow from the buffer's dtype and those arguments,
# so they key a cache of its names: reading each argument apart cost ~0.5 us a
# collective.
_CUTS = {
    "allreduce": (0, 2),
    "allgather": (0, 2),
    "gather": (0, 2),
    "broadcast": (1, 2),
    "scatter": (1, 2),
    "send": (0, 1),
    "recv": (0, 1),
    "barrier": (-1, 0),
}

#: The clock of every event, in integer nanoseconds (CLOCK_MONOTONIC on Linux, so the
#: processes of one machine share it; offsets are still measured, see ``session_trace``).
now = time.perf_counter_ns


@functools.cache
def clock_identity() -> str:
    """What makes two processes' :data:`now` the same clock: the kernel's boot id and
    the process's time-namespace offsets (empty where they cannot be read).

    Processes of one running kernel, outside time namespaces that shift it, read one
    CLOCK_MONOTONIC: their offset is exactly 0, nothing needs measuring.
    """
    parts = []
    for path in ("/proc/sys/kernel/random/boot_id", "/proc/self/timens_offsets"):
        try:
            with open(path) as f:
                parts.append(" ".join(f.read().split()))
        except OSError:
            parts.append("")
    return "|".join(parts) if parts[0] else ""


def check_capacity(value: object, what: str) -> int:
    """``value`` as a ring size, or a :class:`DiscoValueError` naming ``what``."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or not MIN_CAPACITY <= value <= MAX_CAPACITY
    ):
        raise DiscoValueError(
            f"{what} must be a whole number of events from {MIN_CAPACITY:,} to {MAX_CAPACITY:,}, "
            f"got {value!r}"
        )
    return value


def capacity_from_env() -> int:
    """The ring's size in events: ``DISCO_TRACE_EVENTS``, or the default."""
    text = os.environ.get("DISCO_TRACE_EVENTS", "").strip()
    if not text:
        return DEFAULT_CAPACITY
    try:
        value: object = int(text)
    except ValueError:
        value = text
    return check_capacity(value, "DISCO_TRACE_EVENTS")


class _ClosureRing:
    """A ring of fixed records whose writer keeps the write offset in its own closure
    (no attribute read or written per record: the hot paths), the newest kept.

    The writer calls :meth:`track` once with a function giving its offset, and
    :meth:`lap` (which returns the new offset, 0) when it goes round.
    """

    __slots__ = ("capacity", "ring", "position", "laps")
    record: struct.Struct  # the subclass's

    def __init__(self, capacity: int) -> None:
        self.capacity = int(capacity)
        self.ring = mmap.mmap(-1, max(1, self.capacity) * self.record.size)
        self.laps = 0
        #: records written in all
        self.position: Any = lambda: 0

    def writer(self) -> tuple[mmap.mmap, int, int, Any]:
        """What a writer's closure holds: the ring, a record's size and the ring's (bytes),
        and the record's ``pack_into``."""
        step = self.record.size
        return self.ring, step, self.capacity * step, self.record.pack_into

    def track(self, offset: Any) -> None:
        """Count the records from the writer's ``offset()`` (bytes) and the laps."""
        cap, size = self.capacity, self.record.size
        self.position = lambda: self.laps * cap + offset() // size

    def lap(self) -> int:
        self.laps += 1
        return 0

    @property
    def dropped(self) -> int:
        """Records overwritten because the ring was full."""
        return max(0, self.position() - self.capacity)

    def _kept(self) -> tuple[np.ndarray, np.ndarray]:
        """The kept records, oldest first (raw fields), and their places in the stream."""
        total, cap = self.position(), self.capacity
        raw = np.frombuffer(self.ring, dtype="<i8").reshape(cap, self.record.size // 8)
        rows = raw[:total] if total <= cap else np.roll(raw, -(total % cap), axis=0)
        return rows, np.arange(total - len(rows), total, dtype=np.int64)


class CommandRing(_ClosureRing):
    """A worker's commands, apart from its other events: six fields each.

    ``(kind | name << 8, t0, t1, reg or bytes, other commands before it or -1, action)``,
    written by ``worker_side``'s recorders (``Worker.execute`` calls them); a command's index is its place
    in the stream and a call's seq that minus the other commands before it.
    """

    __slots__ = ()
    record = SHORT_RECORD

    def events(self) -> np.ndarray:
        """The kept commands, oldest first, as full records: int64, ``(k, FIELDS)``."""
        rows, index = self._kept()
        others = rows[:, 4]
        return np.stack(
            [rows[:, 0] & 0xFF, rows[:, 0] >> 8, rows[:, 1], rows[:, 2],
             np.where(others >= 0, index - others, -1), rows[:, 3], index, rows[:, 5]],
            axis=1,
        ).astype(np.int64)  # fmt: skip


class SendRing(_ClosureRing):
    """The controller's sends (its ``call_packed`` commands), apart: three fields each.

    ``(name, t0, site)``, written by ``session_trace``'s send recorder (``Session._call`` calls it); a send's
    seq is its place among them.
    """

    __slots__ = ()
    record = SEND_RECORD

    def events(self) -> np.ndarray:
        """The kept sends, oldest first, as full records: int64, ``(k, FIELDS)``."""
        rows, seq = self._kept()
        zero = np.zeros(len(rows), np.int64)
        return np.stack(
            [np.full(len(rows), K_SEND, np.int64), rows[:, 0], rows[:, 1], rows[:, 1], seq,
             rows[:, 2], zero, zero],
            axis=1,
        ).astype(np.int64)  # fmt: skip


class Recorder:
    """A bounded ring of event records.

    Parameters
    ----------
    capacity : int
        Events kept; older ones are overwritten (and counted in :attr:`dropped`).
    """

    __slots__ = ("capacity", "count", "names", "_ids", "_ring", "_pack", "seqs", "commands", "sends", "_calls", "hooked")  # fmt: skip

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = int(capacity)
        self.count = 0  # events recorded in all
        self.names: list[str] = []
        self._ids: dict[str, int] = {}
        self._ring = mmap.mmap(-1, max(1, self.capacity) * _RECORD.size)
        self._pack = _RECORD.pack_into
        #: worker side: operations so far per communicator key ("world", "group")
        self.seqs: dict[str, list[int]] = {}
        #: worker side: (op, dtype, the arguments after the buffers) -> ((op's name id,
        #: attrs id), the communicator's seq counter), for calls with positional arguments
        self._calls: dict[tuple, tuple[tuple[int, int], list[int]]] = {}
        #: worker side: the commands, written apart (``worker_side``); None elsewhere
        self.commands: CommandRing | None = None
        #: controller side: the sends, written apart (``session_trace``); None elsewhere
        self.sends: SendRing | None = None
        #: worker side: the CCL instance whose operations record here, and their names
        #: (``ccl_hooks``); None when none
        self.hooked: tuple[Any, list[str]] | None = None

    def intern(self, text: str) -> int:
        """The table index of ``text`` (added on first use)."""
        i = self._ids.get(text)
        if i is None:
            i = self._ids[text] = len(self.names)
            self.names.append(text)
        return i

    def add(self, kind: int, name: int, t0: int, t1: int, a: int = 0, b: int = 0, c: int = 0, d: int = 0) -> None:  # fmt: skip
        """Record one event (``name`` is an :meth:`intern` index)."""
        n = self.count
        self._pack(self._ring, (n % self.capacity) * 64, kind, name, t0, t1, a, b, c, d)
        self.count = n + 1

    @property
    def dropped(self) -> int:
        """Events overwritten because the ring was full."""
        return max(0, self.count - self.capacity)

    def events(self) -> np.ndarray:
        """The kept events, oldest first: an int64 array of shape ``(k, FIELDS)``."""
        ring = np.frombuffer(self._ring, dtype="<i8").reshape(self.capacity, FIELDS)
        n = self.count
        if n <= self.capacity:
            return ring[:n].copy()
        start = n % self.capacity
        return np.concatenate([ring[start:], ring[:start]])

    def export(self) -> dict[str, Any]:
        """Plain values for the controller (they may cross a socket: no objects).

        A worker's commands and its collectives come in one stream, ordered by their
        end: a collective ends before the command it ran in, which comes next. The
        controller's sends and syncs, likewise. A worker's stream holds ``capacity``
        events at most (the newest), as one ring would.
        """
        events = self.events()
        dropped = self.dropped
        if self.sends is not None:
            sends = self.sends.events()
            dropped += self.sends.dropped
            both = np.concatenate([events, sends])
            events = both[np.lexsort((np.arange(len(both)), both[:, 3]))]
        if self.commands is not None:
            commands = self.commands.events()
            recorded = self.count + self.commands.position()
            if self.commands.dropped and len(commands):
                # a collective of a command the ring no longer holds would be joined
                # to the wrong one: keep only those that began after the first kept
                events = events[events[:, 2] >= commands[0, 2]]
            both = np.concatenate([events, commands])
            rank = np.r_[np.zeros(len(events), np.int8), np.ones(len(commands), np.int8)]
            events = both[np.lexsort((np.arange(len(both)), rank, both[:, 3]))]
            # The newest ``capacity`` of the stream, as one ring of them kept before the
            # commands had their own: the controller takes no more from a worker (its
            # whole track was refused), and every event left out is counted
            events = events[-self.capacity :]
            dropped = recorded - len(events)
        return {"names": list(self.names), "events": events, "dropped": dropped}

    def collective(self, ccl: Any, op: Any, hand_over: Any, args: tuple, kwargs: dict) -> Any:
        """Run the CCL operation ``op`` of ``ccl`` (after ``hand_over()``) and record it.

        Called by the CCL's operation wrapper (``disco_core.ccl.base``) while
        ``ctx.tracer`` is this recorder; the hand-over is part of the operation's time.
        """
        # The hot path of a traced collective, every step counted: a call with
        # positional arguments finds its names and its seq counter in one lookup.
        name = op.__name__
        cut = _CUTS.get(name)
        call = None
        if cut is not None and not kwargs and len(args) > cut[0]:
            buf = args[cut[0]] if cut[0] >= 0 else None
            try:
                key = (name, getattr(buf, "dtype", ""), args[cut[1] :])
                call = self._calls.get(key)
                if call is None:
                    call = self._new_call(ccl, name, args, kwargs, key)[0]
                nbytes = int(getattr(buf, "nbytes", 0) or 0)
            except TypeError:  # an unhashable argument: the slow way
                call = None
        if call is None:
            call, nbytes = self._new_call(ccl, name, args, kwargs, None)
        ids, counter = call
        seq = counter[0]
        counter[0] = seq + 1
        ended = OK
        t0 = now()
        try:
            if hand_over is not None:
                hand_over()
            return op(ccl, *args, **kwargs)
        except BaseException:
            ended = FAILED
            raise
        finally:
            t1 = now()
            n = self.count
            self._pack(self._ring, (n % self.capacity) * 64, K_COLLECTIVE, ids[0], t0, t1, seq, nbytes, ended, ids[1])  # fmt: skip
            self.count = n + 1

    def _new_call(self, ccl: Any, name: str, args: tuple, kwargs: dict, key: tuple | None) -> tuple:
        """``((name id, attributes id), seq counter), bytes`` of a call, its first part
        cached under ``key`` (None: not cached).

        The seq counter is a one-item list shared by every call of one communicator.
        """
        bound = dict(zip(_PARAMS.get(name, ()), args))
        bound.update(kwargs)
        # what every member holds alike: broadcast's and scatter's src is the root's only
        buf = bound.get("dst") if name in ("broadcast", "scatter") else bound.get("src", bound.get("buf"))  # fmt: skip
        in_group = bound.get("in_group", False)
        reduce = bound.get("op", "") if name == "allreduce" else ""
        peer = bound.get("peer", -1)
        if name in ("send", "recv"):
            comm = "p2p"
        else:
            comm, peer = ("group" if in_group else "world"), -1
        # a send and a recv are counted per peer: the k-th send from a to b meets the
        # k-th recv on b from a (the file joins them)
        counter = self.seqs.setdefault(comm if comm != "p2p" else f"{name}>{peer}", [0])
        # str() of a NumPy dtype alone costs ~3 us, more than a small collective
        dtype = getattr(buf, "dtype", "")
        attrs = f"{dtype}|{reduce}|{comm}|{ccl.ctx.group_id}|{peer}"
        call = ((self.intern(name), self.intern(attrs)), counter)
        if key is not None and len(self._calls) < 4096:
            self._calls[key] = call
        return call, int(getattr(buf, "nbytes", 0) or 0)
