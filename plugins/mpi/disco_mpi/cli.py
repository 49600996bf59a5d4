"""``disco-mpi``: run a Disco script as an MPI job, and show the MPI in use.

``disco-mpi run -n N [--launcher MPIEXEC] [-- extra launcher args] script.py [args...]``
runs ``mpiexec -n N python script.py args...``: rank 0 hosts the controller and
worker 0, ranks 1..N-1 are the other workers (the script creates its session with
``disco.Session.create("mpi")``). ``disco-mpi info`` prints the MPI library, the
launcher and the thread support.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import shutil
import sys

from disco_core.spi import (
    HelpFormatter,
    add_common_options,
    chosen_parser,
    configure_logging,
    level_from_args,
    parse_command_line,
    plain_warnings,
)

from . import _runtime

__all__ = ["main", "build_parser"]

log = logging.getLogger("disco_mpi.cli")


def _resolve_launcher(exe: str) -> tuple[str | None, str]:
    """The launcher's path, or None with the reason it cannot be run."""
    if os.sep not in exe:  # a bare name: looked up on PATH, as a shell would
        found = shutil.which(exe)
        return (found, "") if found else (None, "not found on PATH")
    if not os.path.exists(exe):
        return None, "no such file"
    if os.path.isdir(exe) or not os.access(exe, os.X_OK):
        return None, "not an executable file"
    return exe, ""


def _run(args: argparse.Namespace) -> int:
    given = args.launcher or _runtime.launcher()
    if given is None:
        print(
            "disco-mpi: no MPI launcher found (pip install mpich, or pass --launcher / set "
            "DISCO_MPIEXEC)",
            file=sys.stderr,
        )
        return 2
    exe, why = _resolve_launcher(given)
    if exe is None:
        source = "--launcher" if args.launcher else "the MPI launcher ($DISCO_MPIEXEC or found)"
        print(f"disco-mpi: {source} {given!r}: {why}", file=sys.stderr)
        return 2
    extra = shlex.split(args.launcher_args or "")
    argv = [exe, "-n", str(args.n), *extra, sys.executable, args.script, *args.args]
    if args.dry_run:
        print(shlex.join(argv))
        return 0
    if not args.script.startswith("-") and not os.path.isfile(args.script):
        # (else every rank's Python says it, N times over)
        print(f"disco-mpi: no such script: {args.script!r}", file=sys.stderr)
        return 2
    log.info("running %s", shlex.join(argv))
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execv(exe, argv)
    except OSError as exc:  # e.g. a script with a missing interpreter
        print(f"disco-mpi: cannot run the launcher {exe!r}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    return 1  # pragma: no cover


def _info(_: argparse.Namespace) -> int:
    import mpi4py

    MPI = _runtime.mpi()
    levels = {
        MPI.THREAD_SINGLE: "single",
        MPI.THREAD_FUNNELED: "funneled",
        MPI.THREAD_SERIALIZED: "serialized",
        MPI.THREAD_MULTIPLE: "multiple",
    }
    print(f"mpi4py     {mpi4py.__version__}")
    print(f"library    {_runtime.library_version()}")
    print(f"standard   MPI {'.'.join(map(str, MPI.Get_version()))}")
    print(f"threads    {levels.get(MPI.Query_thread(), MPI.Query_thread())}")
    print(f"launcher   {_runtime.launcher() or '(none found)'}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``disco-mpi``."""
    p = argparse.ArgumentParser(
        prog="disco-mpi",
        description=__doc__.split("\n\n")[0].replace("``", ""),
        formatter_class=HelpFormatter,
    )
    add_common_options(p, "disco-mpi")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", help="one of:")
    r = sub.add_parser(
        "run",
        help="run a script as an N-worker MPI session",
        description="Run SCRIPT with the MPI launcher as N ranks: rank 0 hosts the controller "
        "and worker 0, the others are workers.",
        formatter_class=HelpFormatter,
    )
    add_common_options(r, "disco-mpi")
    r.add_argument("-n", "--np", dest="n", type=int, required=True, help="number of workers")
    r.add_argument(
        "--launcher",
        help="the mpiexec to use, a path or a name on PATH (default: $DISCO_MPIEXEC, else "
        "the one beside Python, else mpiexec or mpirun on PATH)",
    )
    r.add_argument("--launcher-args", help="extra launcher arguments, one quoted string")
    r.add_argument("--dry-run", action="store_true", help="print the command, run nothing")
    # optional to argparse (with REMAINDER after it, argparse would say "script, args"
    # are required), required by main()
    r.add_argument("script", nargs="?", help="the Python script to run on every rank")
    r.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    r.set_defaults(func=_run)
    i = sub.add_parser(
        "info",
        help="show the MPI library and launcher in use",
        description="Show mpi4py, the MPI library, its thread support and the launcher.",
        formatter_class=HelpFormatter,
    )
    add_common_options(i, "disco-mpi")
    i.set_defaults(func=_info)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run ``disco-mpi`` with ``argv`` (``sys.argv[1:]`` when None); return its exit code."""
    p = build_parser()
    args = parse_command_line(p, argv)
    if getattr(args, "n", 1) < 1:
        chosen_parser(p, args).error("-n must be >= 1")
    if args.command == "run" and args.script is None:
        chosen_parser(p, args).error("the following arguments are required: script")
    try:
        plain_warnings("disco-mpi")
        configure_logging(level_from_args(args))
    except ValueError as exc:
        chosen_parser(p, args).error(str(exc))
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
