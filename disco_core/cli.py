"""The ``disco`` command (also ``python -m disco_core``).

Subcommands:

``disco plugins [--json]``
    Every installed plugin: its distribution and version, the channels, CCLs and
    module loaders it registers, and each broken plugin with its own error; exit
    status 1 when any plugin is broken.
``disco demo [options]``
    The tensor-parallel transformer MLP block across a session with the ``shm`` CCL,
    checked against NumPy, with a table of time per step (see :mod:`disco_core.demo`).
``disco trace summary FILE [--json]``
    A trace file's numbers: per worker, where the time went (functions, collectives
    waiting and moving, copies, module loads, idle); per collective call site, count,
    time and bus bandwidth; and the stragglers, who arrived last at each collective
    (see :mod:`disco_core.tracing.summary`).
``disco trace plot FILE -o OUT.png``
    The trace's timeline and straggler chart as an image (needs matplotlib:
    ``pip install 'disco-core[plot]'``).

A ``disco trace`` command exits with status 2 when the file is not a readable Disco
trace, 1 on any other error, with one line on stderr.

Every command takes ``--version``, ``-v``/``--verbose`` (INFO, then DEBUG) and
``--log-level LEVEL`` (:mod:`disco_core.commandline`), before or after the subcommand.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import warnings
from typing import Any

from .commandline import (
    HelpFormatter,
    add_common_options,
    chosen_parser,
    configure_logging,
    level_from_args,
    parse_command_line,
    plain_warnings,
)

__all__ = ["main", "build_parser"]

#: Plugin kinds in the order ``disco plugins`` shows them: (kind, heading, JSON key).
_KINDS = (
    ("channel", "channels", "channels"),
    ("ccl", "CCLs", "ccls"),
    ("loader", "module loaders", "module_loaders"),
)

_EPILOG = """\
examples:
  disco plugins                 what is installed: channels, CCLs, module loaders
  disco plugins --json          the same, machine-readable
  disco demo                    tensor-parallel MLP on 1, 2 and 4 process workers (shm CCL)
  disco demo --workers 2 --steps 5 --d-model 256 --d-ff 1024
  disco demo --session threaded
  disco -v demo --workers 2     the same, logging the sessions' lifecycle (INFO; -vv: DEBUG)
  disco trace summary run.json  per worker and per collective, where a traced run's time went
  disco trace plot run.json -o timeline.png   its timeline and stragglers (needs matplotlib)

environment:
  DISCO_LOG_LEVEL=INFO              log level of the commands and of worker processes
  DISCO_DISABLE_PLUGIN_AUTOLOAD=1   load only the core's own plugins
  DISCO_PLUGINS=mod1,mod2           also load these modules as plugins
  DISCO_START_TIMEOUT=60            seconds to wait for process workers to start
  DISCO_SHUTDOWN_TIMEOUT=5          seconds to wait for workers to stop before killing them
  DISCO_CCL_TIMEOUT=300             seconds a shm collective waits for its peers
  DISCO_TRACE=run.json              trace every session of a program (disco trace summary run.json)

docs: README.md of the disco-core distribution.
"""


def _version_text() -> str:
    from . import __version__

    return f"disco {__version__} (disco-core; Python {platform.python_version()}, {sys.executable})"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``disco`` command."""
    from . import demo

    parser = argparse.ArgumentParser(
        prog="disco",
        description="Disco for Python: an SPMD distributed runtime with a pluggable core (after "
        "Apache TVM's Disco). A controller drives N workers that all run the same commands; "
        "channels (threaded, process, socket, ...), collective libraries (CCLs: shm, mpi, "
        "nccl, ...) and module loaders are plugins.",
        epilog=_EPILOG,
        formatter_class=HelpFormatter,
    )
    add_common_options(parser, "disco-core", version_text=_version_text())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", help="one of:")

    p = sub.add_parser(
        "plugins",
        help="list installed plugins and what they register",
        description="List every installed Disco plugin (entry-point group 'disco_core'): its "
        "distribution and version, the channels, CCLs and module loaders it registers, and "
        "each broken plugin with its own error. Exit status 1 when any plugin is broken.",
        formatter_class=HelpFormatter,
    )
    add_common_options(p, "disco-core", version_text=_version_text())
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(handler=_cmd_plugins)

    d = sub.add_parser(
        "demo",
        help="run the tensor-parallel transformer MLP demo and check it against NumPy",
        description=(demo.__doc__ or "").replace("``", ""),
        formatter_class=HelpFormatter,
    )
    add_common_options(d, "disco-core", version_text=_version_text())
    demo.add_arguments(d)
    d.set_defaults(handler=_cmd_demo)
    _add_trace_parser(sub)
    return parser


# ---------------------------------------------------------------------------- plugins
def _collect_plugins() -> dict[str, Any]:
    """Everything ``disco plugins`` shows, as plain data."""
    from . import plugins

    with warnings.catch_warnings():
        # Broken plugins are listed below; the loader's warning would say it twice.
        warnings.simplefilter("ignore", plugins.DiscoPluginWarning)
        infos = plugins.list_plugins()
    entries = []
    for info in infos:
        entries.append(
            {
                "name": info.name,
                "distribution": info.distribution,
                "version": info.version,
                "provides": {key: list(info.provides.get(kind, [])) for kind, _, key in _KINDS},
                "error": info.error,
                "disabled": info.disabled,
            }
        )
    autoload_off = os.environ.get(plugins.AUTOLOAD_ENV, "").strip() not in ("", "0")
    return {
        "entry_point_group": plugins.ENTRY_POINT_GROUP,
        "autoload": not autoload_off,
        "extra_modules": [
            m.strip() for m in os.environ.get(plugins.PLUGINS_ENV, "").split(",") if m.strip()
        ],
        "plugins": entries,
        # One line per broken plugin, for readers that want only what is wrong.
        "problems": [f"{p['name']} ({_dist_text(p)}): {p['error']}" for p in entries if p["error"]],
    }


def _dist_text(p: dict[str, Any]) -> str:
    if p["version"] in ("?", "", None):
        return (
            f"module {p['distribution']}" if p["distribution"] == p["name"] else p["distribution"]
        )
    return f"{p['distribution']} {p['version']}"


def _print_plugins(data: dict[str, Any]) -> None:
    working = [p for p in data["plugins"] if not p["disabled"]]
    broken = [p for p in data["plugins"] if p["error"]]
    print(f"Disco plugins (entry-point group {data['entry_point_group']!r}):")
    if not data["autoload"]:
        print("  (DISCO_DISABLE_PLUGIN_AUTOLOAD is set: only the core's own plugins are loaded)")
    if data["extra_modules"]:
        print(f"  (DISCO_PLUGINS adds: {', '.join(data['extra_modules'])})")
    if not working:
        print("  none loaded")
    width = max(len(heading) for _, heading, _ in _KINDS) + 1
    for p in working:
        print()
        print(f"{p['name']}  ({_dist_text(p)})")
        any_kind = False
        for _, heading, key in _KINDS:
            names = p["provides"][key]
            if names:
                any_kind = True
                print(f"    {(heading + ':').ljust(width)} {', '.join(names)}")
        if not any_kind:
            print("    (registers nothing)")
    if broken:
        print()
        print(
            f"Problems: {len(broken)} broken plugin{'s' if len(broken) > 1 else ''} "
            "(everything else keeps working):"
        )
        for p in broken:
            state = (
                "failed to load, disabled: none of its names are registered"
                if p["disabled"]
                else "lost a name, its other names stay"
            )
            print(f"  {p['name']}  ({_dist_text(p)}): {state}")
            print(f"    error: {p['error']}")


def _cmd_plugins(args: argparse.Namespace) -> int:
    """Print the plugins; exit status 1 when any plugin is broken."""
    data = _collect_plugins()
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        _print_plugins(data)
    return 1 if data["problems"] else 0


# ---------------------------------------------------------------------------- demo
def _cmd_demo(args: argparse.Namespace) -> int:
    from . import demo

    return demo.run(args)


# ---------------------------------------------------------------------------- trace
_TRACE_EPILOG = """\
examples:
  disco trace summary run.json          the tables: per worker, per call site, stragglers
  disco trace summary run.json --json   the same numbers, machine-readable
  disco trace plot run.json -o timeline.png

exit status: 0, 2 when FILE is not a readable Disco trace, 1 on any other error.
"""


def _add_trace_parser(sub: Any) -> None:
    t = sub.add_parser(
        "trace",
        help="read a trace file: a summary, or a timeline plot",
        description="Read a trace file written by disco_core.trace (Chrome trace-event JSON; "
        "Perfetto and chrome://tracing open it too).",
        epilog=_TRACE_EPILOG,
        formatter_class=HelpFormatter,
    )
    add_common_options(t, "disco-core", version_text=_version_text())
    tsub = t.add_subparsers(dest="trace_command", metavar="ACTION", help="one of:")
    t.set_defaults(handler=lambda args: _no_action(t))

    s = tsub.add_parser(
        "summary",
        help="per worker and per collective call site, where the time went; the stragglers",
        description="Per worker: busy, time in functions, in collectives waiting and moving, "
        "in copies and module loads, idle (ms and % of the traced span). Per collective call "
        "site: calls, mean/p50/p99 time, bytes, bus bandwidth. Stragglers: who arrived last "
        "at each collective and by how much, summed over the run. The notes at the end of "
        "the output define each number.",
        epilog=_TRACE_EPILOG,
        formatter_class=HelpFormatter,
    )
    add_common_options(s, "disco-core", version_text=_version_text())
    s.add_argument("file", metavar="FILE", help="the trace file (JSON)")
    s.add_argument("--json", action="store_true", help="print JSON instead of text")
    s.set_defaults(handler=_cmd_trace_summary)

    p = tsub.add_parser(
        "plot",
        help="draw the timeline and the straggler chart into an image (needs matplotlib)",
        description="One figure: the timeline (a row per worker and the controller, bars "
        "coloured by category, collectives split into waiting and moving) above a bar chart "
        "of each worker's total lateness at collectives. Needs matplotlib: "
        "pip install 'disco-core[plot]'.",
        epilog=_TRACE_EPILOG,
        formatter_class=HelpFormatter,
    )
    add_common_options(p, "disco-core", version_text=_version_text())
    p.add_argument("file", metavar="FILE", help="the trace file (JSON)")
    p.add_argument(
        "-o", "--output", metavar="OUT", required=True, help="the image to write (.png, .svg, .pdf)"
    )
    p.set_defaults(handler=_cmd_trace_plot)


def _no_action(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def _load_trace(args: argparse.Namespace, action: str) -> Any:
    """The trace of ``args.file``, or None after one line on stderr."""
    from .errors import DiscoError
    from .tracing.summary import load

    try:
        return load(args.file)
    except DiscoError as exc:
        print(f"disco trace {action}: {exc}{_traces_beside(args.file)}", file=sys.stderr)
        return None


def _traces_beside(name: str) -> str:
    """For a trace file that does not exist: the ones named after it that do (``disco demo
    --trace out.json`` writes ``out.1w.json``, ``out.2w.json``...; ``DISCO_TRACE`` a
    numbered file per later session)."""
    import glob
    from pathlib import Path

    path = Path(name)
    if path.exists():
        return ""
    near = sorted(glob.glob(glob.escape(str(path.with_suffix(""))) + ".*" + path.suffix))
    if not near:
        return ""
    more = f" and {len(near) - 4} more" if len(near) > 4 else ""
    return f"; traces named after it: {', '.join(near[:4])}{more}"


def _cmd_trace_summary(args: argparse.Namespace) -> int:
    from .tracing.summary import format_summary, summarize

    trace = _load_trace(args, "summary")
    if trace is None:
        return 2
    summary = summarize(trace)
    if args.json:
        print(json.dumps(summary.to_dict(), indent=2))
    else:
        print(format_summary(summary))
    return 0


def _cmd_trace_plot(args: argparse.Namespace) -> int:
    from .errors import DiscoError
    from .tracing.plot import plot

    trace = _load_trace(args, "plot")
    if trace is None:
        return 2
    try:
        written = plot(trace, args.output)
    except DiscoError as exc:
        print(f"disco trace plot: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {written}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the ``disco`` command with ``argv`` (``sys.argv[1:]`` when None); return its exit code."""
    parser = build_parser()
    args = parse_command_line(parser, argv)
    try:
        level = level_from_args(args, logging.WARNING)
    except ValueError as exc:
        chosen_parser(parser, args).error(str(exc))
    plain_warnings("disco")
    configure_logging(level)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return handler(args)
    except KeyboardInterrupt:
        print("disco: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # disco plugins | head
        try:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - silence the flush at exit
        except OSError:
            pass
        return 0


if __name__ == "__main__":
    sys.exit(main())
