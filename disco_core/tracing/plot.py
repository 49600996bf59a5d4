"""``disco trace plot``: a trace's timeline and its stragglers, as one image.

Needs matplotlib (``pip install 'disco-core[plot]'``), imported only when
:func:`plot` runs. The figure is drawn without pyplot (no GUI backend, no global
state): the canvas is Agg's.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from typing import Any

from ..errors import DiscoError
from ._trace import Span, Trace, instances
from .summary import Summary, summarize

__all__ = ["plot", "COLORS"]

#: The colour of each category of bar.
COLORS = {
    "function": "#4c72b0",
    "collective waiting": "#f2c14e",
    "collective moving": "#c44e52",
    "copy": "#55a868",
    "module": "#8172b2",
    "send": "#64717e",
    "sync": "#b8c4cf",
}


def _matplotlib() -> Any:
    try:
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as exc:
        raise DiscoError(
            f"matplotlib is needed to plot a trace ({exc}): pip install 'disco-core[plot]' "
            "(in a clone of the repository: pip install 'matplotlib>=3.7', which is all the extra adds)"
        ) from None
    return Figure, Patch


def _ranges(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """``(start, width)`` in ms, as ``broken_barh`` takes them."""
    return [(start / 1e3, (end - start) / 1e3) for start, end in spans if end > start]


def _rows(trace: Trace) -> list[tuple[str, dict[str, list[tuple[float, float]]]]]:
    """Each track's bars by category: the controller first, then the workers."""
    ctl = trace.controller
    rows = [
        (
            "controller",
            {
                "send": [(s.start, s.end) for s in ctl.send],
                "sync": [(s.start, s.end) for s in ctl.sync],
                "copy": [(s.start, s.end) for s in ctl.copy],
            },
        )
    ]
    # A collective bar is split at its call's last arrival: waiting, then moving.
    split: dict[int, float] = {}
    for inst in instances(trace):
        last = inst.last_arrival
        for _, span in inst.members:
            split[id(span)] = min(max(last, span.start), span.end)
    for w, track in enumerate(trace.workers):
        colls: list[Span] = track.collective
        rows.append(
            (
                f"worker {w}",
                {
                    # Commands first: the nested bars drawn after them cover their part.
                    "function": [(s.start, s.end) for s in track.command],
                    "collective waiting": [(s.start, split.get(id(s), s.start)) for s in colls],
                    "collective moving": [(split.get(id(s), s.start), s.end) for s in colls],
                    "copy": [(s.start, s.end) for s in track.copy],
                    "module": [(s.start, s.end) for s in track.module],
                },
            )
        )
    return rows


def _check_regular(target: str) -> None:
    """Refuse a name that exists and is not a regular file (a device, a pipe, a symbolic
    link): an image would be written through it, or beside it, as for a trace."""
    try:
        mode = os.lstat(target).st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise DiscoError(f"{target!r}: cannot look at it: {exc.strerror or exc}") from None
    if not stat.S_ISREG(mode):
        raise DiscoError(
            f"{target!r} exists and is not a regular file: give the image's file name "
            "(timeline.png)"
        )


def plot(trace: Trace, path: str | os.PathLike[str], summary: Summary | None = None) -> str:
    """Draw ``trace``'s timeline and straggler chart into the image file ``path``.

    Top: one row per track (the controller, then each worker), bars coloured by
    category; a collective's bar is split into its waiting and moving parts. Bottom:
    each worker's total lateness as the last to arrive at a collective call (see
    :mod:`disco_core.tracing.summary`). The format follows ``path``'s suffix (PNG,
    SVG, PDF...).

    Parameters
    ----------
    trace : disco_core.tracing._trace.Trace
        A trace read by :func:`disco_core.tracing.summary.load`.
    path : str or path-like
        The image file to write; without a suffix, ``.png`` is added.
    summary : disco_core.tracing.summary.Summary, optional
        ``summarize(trace)``, when the caller has it already.

    Returns
    -------
    str
        The file written.

    Raises
    ------
    DiscoError
        matplotlib is not installed, ``path`` is a folder or has a suffix matplotlib
        cannot write, or the file could not be written.
    """
    Figure, Patch = _matplotlib()
    target = os.fspath(path)
    if not target or target.endswith(os.sep) or os.path.isdir(target):
        raise DiscoError(f"{target!r} is a folder: give the image's file name (timeline.png)")
    suffix = os.path.splitext(target)[1].lower().lstrip(".")
    if not suffix:
        _check_regular(target)  # -o /dev/null wrote /dev/null.png
        target, suffix = target + ".png", "png"
    _check_regular(target)
    summary = summary if summary is not None else summarize(trace)
    rows = _rows(trace)
    fig = Figure(figsize=(12, 2.5 + 0.4 * len(rows)), layout="constrained")
    formats = fig.canvas.get_supported_filetypes()
    if suffix not in formats:
        raise DiscoError(
            f"{target}: matplotlib cannot write .{suffix} images; use one of "
            + ", ".join(f".{f}" for f in sorted(formats))
        )
    top, bottom = fig.subplots(2, 1, height_ratios=[max(len(rows), 2), 2])

    used = set()
    for y, (_, bars) in enumerate(rows):
        for cat, spans in bars.items():
            ranges = _ranges(spans)
            if ranges:
                used.add(cat)
                # One call per row and category: a single collection, fast for 100k bars.
                # An edge of the face's colour: a bar shorter than a pixel still shows.
                top.broken_barh(
                    ranges,
                    (y - 0.4, 0.8),
                    facecolors=COLORS[cat],
                    edgecolors=COLORS[cat],
                    linewidth=0.5,
                )
    top.set_yticks(range(len(rows)), [label for label, _ in rows])
    top.set_ylim(len(rows) - 0.5, -0.5)
    top.set_xlim(0, max(trace.duration_us / 1e3, 1e-3))
    top.set_xlabel("ms since the start of the trace (controller's clock)")
    top.set_title(f"{os.path.basename(trace.path)}: timeline")
    top.legend(
        handles=[Patch(color=COLORS[c], label=c) for c in COLORS if c in used],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize="small",
    )

    workers = [s.worker for s in summary.stragglers]
    late = [s.lateness_ms for s in summary.stragglers]
    bottom.bar(workers, late, color=COLORS["collective waiting"], edgecolor="#555555")
    for s in summary.stragglers:
        if s.times_last:
            bottom.annotate(
                f"last {s.times_last}x",
                (s.worker, s.lateness_ms),
                ha="center",
                va="bottom",
                fontsize="small",
            )
    bottom.set_xticks(workers, [f"worker {w}" for w in workers])
    bottom.set_ylabel("lateness, ms")
    bottom.margins(y=0.25)  # room for the labels above the bars
    bottom.set_title(f"stragglers: {summary.headline}", fontsize="medium")
    try:
        fig.savefig(target, dpi=100)
    except OSError as exc:
        raise DiscoError(f"{target}: cannot write the plot: {exc}") from None
    return target
