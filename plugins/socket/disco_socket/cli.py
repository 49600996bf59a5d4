"""The ``disco-socket`` command: ``disco-socket join HOST PORT --workers N``.

Also ``disco-socket HOST PORT N [options]`` and ``python -m disco_socket HOST PORT N
[options]``, short for ``join HOST PORT --workers N [options]``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from .wire import PROTOCOL_VERSION

_COMMANDS = ("join", "version")


def _usage(prog: str) -> str:
    return (
        f"{prog} join HOST PORT --workers N [options]\n"
        f"       {prog} HOST PORT N [options]   (short for join; options as for join)\n"
        f"       {prog} version"
    )


def _parser(prog: str = "disco-socket") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        usage=_usage(prog),
        description="Disco for Python over sockets: run a node agent that joins a SocketSession.",
        epilog=f"Example: {prog} 10.0.0.1 9091 2 joins the session whose controller listens "
        f"at 10.0.0.1:9091 with 2 workers. `{prog} join --help` lists the options. "
        "Exit codes: 0 the session shut down, 1 the controller vanished or fell silent, "
        "2 refused (version, token, worker count, TLS, session full), 3 no controller "
        "reachable in time, 128+N stopped by signal N (130: Ctrl-C).",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="{join,version}")
    j = sub.add_parser(
        "join",
        prog=f"{prog} join",
        help="join the session whose controller listens at HOST PORT",
        description="Connect to a SocketSession's controller, start this node's workers and "
        "relay their commands until the session shuts down (or the controller disappears). "
        f"Short form: {prog} HOST PORT N [options].",
    )
    j.add_argument("host", help="the controller's address")
    j.add_argument("port", type=int, help="the controller's port")
    j.add_argument(
        "--workers",
        "-n",
        type=int,
        required=True,
        help="workers on this node (num_workers_per_node)",
    )
    j.add_argument(
        "--token",
        default=None,
        help="the shared secret (default: $DISCO_TOKEN); prefer the variable, "
        "command lines are visible to other users",
    )
    j.add_argument(
        "--connect-timeout",
        type=float,
        default=float(os.environ.get("DISCO_CONNECT_TIMEOUT", "60")),
        help="seconds to keep retrying while nothing answers at HOST PORT (default 60, "
        "or $DISCO_CONNECT_TIMEOUT)",
    )
    j.add_argument(
        "--retry-interval", type=float, default=0.2, help="seconds between attempts (default 0.2)"
    )
    j.add_argument("--tls", action="store_true", help="use TLS, verifying with the system CAs")
    j.add_argument(
        "--tls-ca", help="CA bundle that signed the controller's certificate (implies --tls)"
    )
    j.add_argument("--tls-cert", help="this node's certificate, for mutual TLS (implies --tls)")
    j.add_argument("--tls-key", help="the key of --tls-cert")
    j.add_argument(
        "--tls-server-name", help="the name to check the controller's certificate against"
    )
    j.add_argument("-q", "--quiet", action="store_true", help="log errors only")
    sub.add_parser(
        "version", prog=f"{prog} version", help="print the package and protocol versions"
    )
    return p


def _expand_short_form(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``HOST PORT N [options]`` -> ``join HOST PORT --workers N [options]``.

    ``HOST PORT --workers N [options]`` is taken as well; anything shorter is a usage
    error that says what is missing (not argparse's "invalid choice").
    """
    host, rest = argv[0], argv[1:]
    if not rest or rest[0].startswith("-"):
        parser.error(f"missing PORT after {host!r}: run {parser.prog} HOST PORT N")
    port, rest = rest[0], rest[1:]
    if rest and not rest[0].startswith("-"):
        return ["join", host, port, "--workers", rest[0], *rest[1:]]
    if not any(a in ("--workers", "-n") or a.startswith("--workers=") for a in rest):
        parser.error(
            f"missing N, the number of workers on this node (the session's "
            f"num_workers_per_node): run {parser.prog} {host} {port} N"
        )
    return ["join", host, port, *rest]


def main(argv: list[str] | None = None, prog: str = "disco-socket") -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    parser = _parser(prog)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] not in _COMMANDS and not argv[0].startswith("-"):
        argv = _expand_short_form(parser, argv)
    args = parser.parse_args(argv)
    if args.command == "version":
        from importlib.metadata import PackageNotFoundError, version

        try:
            v = version("disco-socket")
        except PackageNotFoundError:  # pragma: no cover - source tree
            v = "source"
        print(f"disco-socket {v} (protocol {PROTOCOL_VERSION})")
        return 0
    logging.basicConfig(
        level=logging.ERROR if args.quiet else logging.INFO,
        format="%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    from .agent import client_ssl_context, run_agent

    ctx = None
    if args.tls or args.tls_ca or args.tls_cert:
        ctx = client_ssl_context(args.tls_ca, args.tls_cert, args.tls_key)
    if args.workers < 1:
        print("disco-socket: --workers must be >= 1", file=sys.stderr)
        return 2
    return run_agent(
        args.host,
        args.port,
        args.workers,
        token=args.token,
        connect_timeout=args.connect_timeout,
        retry_interval=args.retry_interval,
        ssl_context=ctx,
        server_hostname=args.tls_server_name,
    )


def module_main(argv: list[str] | None = None) -> int:
    """``python -m disco_socket HOST PORT N [options]`` (or the ``disco-socket`` arguments)."""
    return main(argv, prog="python -m disco_socket")
