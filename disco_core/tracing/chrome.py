"""Turn recorded events into the trace file (:mod:`disco_core.tracing.format`)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import stat
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from .format import CONTROLLER_TID, FORMAT_VERSION, PID, worker_tid
from .recorder import FAILED, K_COLLECTIVE, K_COMMAND, K_COPY, K_MODULE, K_SEND, K_SYNC
from .worker_side import ACTION_NAMES

__all__ = ["ClockFit", "TraceData", "build", "iter_events", "parse_attrs", "write"]

_CATEGORY = {K_COMMAND: "command", K_COPY: "copy", K_MODULE: "module"}


@dataclass
class ClockFit:
    """A worker's clock against the controller's: ``worker - controller``, measured twice.

    The offset is interpolated linearly between the measurement at the start
    (``t_start``, on the controller's clock, in ns) and the one at the end, so a
    slow drift of the two clocks is followed.
    """

    t_start: int
    offset_start: int
    precision_start: int
    t_end: int | None = None
    offset_end: int | None = None
    precision_end: int | None = None

    def to_controller(self, t: int) -> int:
        """A worker time (ns) on the controller's clock."""
        if self.t_end is None or self.offset_end is None or self.t_end <= self.t_start:
            return t - self.offset_start
        guess = t - self.offset_start
        frac = min(1.0, max(0.0, (guess - self.t_start) / (self.t_end - self.t_start)))
        return t - round(self.offset_start + frac * (self.offset_end - self.offset_start))

    @property
    def precision(self) -> int:
        """The worse of the two measurements' precision (ns)."""
        return max(self.precision_start, self.precision_end or 0)

    @property
    def offset(self) -> float:
        """The mean offset (ns)."""
        if self.offset_end is None:
            return float(self.offset_start)
        return (self.offset_start + self.offset_end) / 2


@dataclass
class TraceData:
    """Everything a trace file is made of."""

    session: dict[str, Any]
    t_start: int
    t_end: int
    controller: dict[str, Any]
    workers: list[dict[str, Any] | None]
    clocks: list[ClockFit | None]
    method: str
    notes: list[str] = field(default_factory=list)


def parse_attrs(text: str) -> dict[str, Any]:
    """A collective's attributes (``dtype|reduce|comm|group_id|peer``) as event args.

    Raises
    ------
    ValueError
        ``text`` is not five fields, or its group id or peer is not an integer.
    """
    dtype, reduce, comm, group_id, peer = text.split("|")
    out: dict[str, Any] = {"dtype": dtype, "group": comm if comm != "p2p" else "world"}
    if reduce:
        out["reduce"] = reduce
    out["group_id"] = int(group_id) if comm == "group" else 0
    if comm == "p2p":
        out["peer"] = int(peer)
    out["_comm"] = comm
    return out


def _worker_events(w: int, data: dict[str, Any], fit: ClockFit, t0: int, out: list, flows: dict, t_end: int | None = None) -> dict[int, str]:  # fmt: skip
    """Append worker ``w``'s events to ``out``; return its command names by call_packed seq."""
    names: Sequence[str] = data["names"]
    tid = worker_tid(w)
    convert = fit.to_controller
    by_seq: dict[int, str] = {}
    inside: list[dict] = []  # collectives whose command has not ended yet (it is recorded next)
    skipped = 0  # the trace's own start, not shown: the first index shown is 0
    for kind, name_id, a, b, seq, f5, f6, f7 in data["events"].tolist():
        start = convert(a)
        # The window opens when every worker has answered the trace's start sync and
        # closes when every worker has answered its stop sync: a sync still running
        # at either edge (its reply already sent) is the trace's own, not the program's.
        own_sync = kind != K_COLLECTIVE and seq < 0
        if convert(b) < t0 or (own_sync and start < t0):
            skipped += kind != K_COLLECTIVE
            continue
        if t_end is not None and own_sync and convert(b) > t_end:
            continue
        ts = (start - t0) / 1e3
        dur = max(0.0, (b - a) / 1e3)
        name = names[name_id]
        if kind == K_COLLECTIVE:
            args = parse_attrs(names[f7])
            comm = args.pop("_comm")
            args.update(worker=w, op=name, bytes=f5, seq=seq, cmd_seq=-1)
            if f6 == FAILED:
                args["failed"] = True
            inside.append(args)
            if comm == "p2p":
                peer = args["peer"]
                src, dst = (w, peer) if name == "send" else (peer, w)
                key = f"p2p:{src}>{dst}:{seq}"
            else:
                where = "world" if comm == "world" else f"group{args['group_id']}"
                key = f"{where}:{seq}"
            args["key"] = key
            flows.setdefault(key, []).append((ts, tid, name))
            out.append({"name": name, "cat": "collective", "ph": "X", "ts": ts, "dur": dur,
                        "pid": PID, "tid": tid, "args": args})  # fmt: skip
            continue
        cat = _CATEGORY.get(kind)
        if cat is None:
            continue
        action = "call_packed" if seq >= 0 else ACTION_NAMES.get(f7, f"action {f7}")
        args = {"worker": w, "action": action, "index": f6 - skipped, "seq": seq}
        if kind == K_COPY:
            args["bytes"] = f5
        else:
            args["reg"] = f5
        if seq >= 0:
            by_seq[seq] = name
            for coll in inside:
                coll["cmd_seq"] = seq
        inside.clear()
        out.append({"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": dur,
                    "pid": PID, "tid": tid, "args": args})  # fmt: skip
    return by_seq


def iter_events(data: TraceData, other: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The trace file's events, one at a time (one worker's at most are held at once);
    ``other`` receives the file's ``otherData`` once they are all out."""
    t0 = data.t_start
    n = len(data.workers)
    yield from [
        {"name": "process_name", "ph": "M", "pid": PID, "tid": 0,
         "args": {"name": f"disco session ({data.session.get('channel', '?')}, {n} workers)"}},
        {"name": "thread_name", "ph": "M", "pid": PID, "tid": CONTROLLER_TID,
         "args": {"name": "controller"}},
        {"name": "thread_sort_index", "ph": "M", "pid": PID, "tid": CONTROLLER_TID,
         "args": {"sort_index": -1}},
    ]  # fmt: skip
    for w in range(n):
        tid = worker_tid(w)
        yield {"name": "thread_name", "ph": "M", "pid": PID, "tid": tid,
               "args": {"name": f"worker {w}"}}  # fmt: skip
        yield {"name": "thread_sort_index", "ph": "M", "pid": PID, "tid": tid,
               "args": {"sort_index": w}}  # fmt: skip
    flows: dict[str, list] = {}
    names_by_seq: dict[int, str] = {}
    dropped = []
    notes = list(data.notes)
    for w, (wdata, fit) in enumerate(zip(data.workers, data.clocks)):
        if wdata is None or fit is None:
            dropped.append(0)
            continue
        mine: list[dict[str, Any]] = []
        its_flows: dict[str, list] = {}
        try:
            found = _worker_events(w, wdata, fit, t0, mine, its_flows, data.t_end)
            lost = int(wdata["dropped"])
        except (LookupError, ValueError, TypeError, ArithmeticError) as exc:
            # the caller checks a worker's answer; one it missed costs that track, not the file
            notes.append(f"worker {w}: events left out ({type(exc).__name__}: {exc})")
            dropped.append(0)
            continue
        dropped.append(lost)
        yield from mine
        del mine
        for key, members in its_flows.items():
            flows.setdefault(key, []).extend(members)
        if not names_by_seq:
            names_by_seq = found
    ctl = data.controller
    names = ctl["names"]
    for kind, name_id, a, b, seq, f5, f6, f7 in ctl["events"].tolist():
        if b < t0:  # the trace's own start (as on the workers' tracks)
            continue
        ts, dur = (a - t0) / 1e3, max(0.0, (b - a) / 1e3)
        if kind == K_SEND:
            name = names[name_id] or names_by_seq.get(seq, "call_packed")
            args = {"seq": seq, "site": names[f5]}
            yield {"name": name, "cat": "send", "ph": "X", "ts": ts, "dur": dur,
                   "pid": PID, "tid": CONTROLLER_TID, "args": args}  # fmt: skip
        elif kind == K_SYNC:
            name = names[name_id]
            args = {"worker": f6}
            cat = "sync"
            if name.startswith("copy_"):
                cat, args["bytes"] = "copy", f7
            yield {"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": dur,
                   "pid": PID, "tid": CONTROLLER_TID, "args": args}  # fmt: skip
    for flow_id, (_key, members) in enumerate(sorted(flows.items()), start=1):
        if len(members) < 2:
            continue
        # by arrival: the viewers take flow steps in time order (a step before the start is lost)
        members.sort(key=lambda m: (m[0], m[1]))
        last = len(members) - 1
        for i, (ts, tid, name) in enumerate(members):
            ph = "s" if i == 0 else ("f" if i == last else "t")
            ev = {"name": name, "cat": "collective", "ph": ph, "id": flow_id, "ts": ts,
                  "pid": PID, "tid": tid}  # fmt: skip
            if ph != "s":
                ev["bp"] = "e"
            yield ev
    clocks = data.clocks
    other.update(
        {
            "disco_trace": FORMAT_VERSION,
            "session": data.session,
            "duration_us": (data.t_end - t0) / 1e3,
            "clock": {
                "offset_us": [None if c is None else c.offset / 1e3 for c in clocks],
                "precision_us": [None if c is None else c.precision / 1e3 for c in clocks],
                "method": data.method,
            },
            "dropped": dropped,
            "controller_dropped": int(ctl["dropped"]),
            "notes": notes,
        }
    )


def build(data: TraceData) -> dict[str, Any]:
    """The trace file's JSON object (all of it in memory: :func:`write` streams instead)."""
    other: dict[str, Any] = {}
    events = list(iter_events(data, other))
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def probe_folder(folder: str) -> None:
    """Make and drop a file in ``folder`` (``OSError`` if none can be made there)."""
    os.close(_new_file(folder)[0])


def _new_file(folder: str) -> tuple[int, str | None]:
    """An open, writable new file in ``folder``: unnamed where the file system allows it
    (``O_TMPFILE``: a process killed while writing leaves nothing), else a hidden
    temporary name (returned, to be renamed or removed)."""
    flag = getattr(os, "O_TMPFILE", 0)
    if flag:
        try:
            return os.open(folder, flag | os.O_WRONLY | os.O_CLOEXEC, 0o600), None
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise  # else: this file system has no unnamed files
    fd, tmp = tempfile.mkstemp(prefix=".disco-trace-", suffix=".json", dir=folder)
    return fd, tmp


def _link(fd: int, name: str) -> None:
    """Give the unnamed file ``fd`` the path ``name`` (``FileExistsError`` if taken)."""
    # linkat(AT_SYMLINK_FOLLOW) of /proc/self/fd/N (os.link calls plain link(), which
    # does not follow the magic link, unless a directory fd is given)
    proc = os.open("/proc", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.link(f"self/fd/{fd}", name, src_dir_fd=proc, follow_symlinks=True)
    finally:
        os.close(proc)


def _link_hidden(fd: int, folder: str) -> str:
    """Give the unnamed file ``fd`` a free hidden name in ``folder``; return it."""
    for _ in range(100):
        tmp = os.path.join(folder, f".disco-trace-{secrets.token_hex(6)}.json")
        try:
            _link(fd, tmp)
            return tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary name", folder)


def write(obj: TraceData | dict[str, Any], path: str | os.PathLike) -> str:
    """Write the trace file atomically (a reader never sees half of it); return its path.

    ``obj`` is the recorded :class:`TraceData`, streamed one event at a time (a file
    of a million events is never a million dicts in memory), or a built JSON object.
    The file is written unnamed (``O_TMPFILE``) and named once whole, so a process
    killed while writing leaves no file behind. A path that is not a regular file
    (a device, a pipe, a symbolic link) is refused rather than replaced.
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = _new_file(folder)
    try:
        # 1 MiB buffers: each write to the file lets other threads take the GIL (a thread
        # that sends commands meanwhile held every one of ~1,000 small writes ~5 ms)
        with os.fdopen(fd, "w", buffering=1 << 20, closefd=False) as f:
            if isinstance(obj, dict):
                json.dump(obj, f, separators=(",", ":"))
            else:
                other: dict[str, Any] = {}
                dumps, sep = json.JSONEncoder(separators=(",", ":")).encode, ""
                f.write('{"traceEvents":[')
                for ev in iter_events(obj, other):
                    f.write(sep)
                    f.write(dumps(ev))
                    sep = ","
                f.write('],"displayTimeUnit":"ms","otherData":')
                f.write(dumps(other))
                f.write("}")
        try:
            kind = os.lstat(path).st_mode
        except FileNotFoundError:
            kind = stat.S_IFREG
        if not stat.S_ISREG(kind):  # made since the trace started (checked then too)
            raise FileExistsError(errno.EEXIST, "is not a regular file: not replaced", path)
        if tmp is None:
            try:  # a new name: the file goes straight there (a kill leaves nothing)
                _link(fd, path)
                return path
            except FileExistsError:  # replacing a file: through a hidden name
                tmp = _link_hidden(fd, folder)
        os.replace(tmp, path)
        tmp = None
    finally:
        os.close(fd)
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    return path
