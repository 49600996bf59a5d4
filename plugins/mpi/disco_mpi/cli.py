"""``disco-mpi``: run a Disco script as an MPI job, and show the MPI in use.

``disco-mpi run -n N [--launcher MPIEXEC] [-- extra launcher args] script.py [args...]``
runs ``mpiexec -n N python script.py args...``: rank 0 hosts the controller and
worker 0, ranks 1..N-1 are the other workers (the script creates its session with
``disco.Session.create("mpi")``). ``disco-mpi info`` prints the MPI library, the
launcher and the thread support.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from . import _runtime


def _run(args: argparse.Namespace) -> int:
    exe = args.launcher or _runtime.launcher()
    if exe is None:
        print(
            "disco-mpi: no MPI launcher found (pip install mpich, or pass --launcher / set "
            "DISCO_MPIEXEC)",
            file=sys.stderr,
        )
        return 2
    extra = shlex.split(args.launcher_args or "")
    argv = [exe, "-n", str(args.n), *extra, sys.executable, args.script, *args.args]
    if args.dry_run:
        print(shlex.join(argv))
        return 0
    sys.stdout.flush()
    os.execv(exe, argv)
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="disco-mpi", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run a script as an N-worker MPI session")
    r.add_argument("-n", "--np", dest="n", type=int, required=True, help="number of workers")
    r.add_argument("--launcher", help="the mpiexec to use (default: beside Python, or PATH)")
    r.add_argument("--launcher-args", help="extra launcher arguments, one quoted string")
    r.add_argument("--dry-run", action="store_true", help="print the command, run nothing")
    r.add_argument("script")
    r.add_argument("args", nargs=argparse.REMAINDER)
    r.set_defaults(func=_run)
    i = sub.add_parser("info", help="show the MPI library and launcher in use")
    i.set_defaults(func=_info)
    args = p.parse_args(argv)
    if getattr(args, "n", 1) < 1:
        p.error("-n must be >= 1")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
