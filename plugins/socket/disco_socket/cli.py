"""The ``disco-socket`` command: ``disco-socket join HOST PORT --workers N``."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from .wire import PROTOCOL_VERSION


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="disco-socket",
        description="Disco for Python over sockets: run a node agent that joins a SocketSession.",
    )
    sub = p.add_subparsers(dest="command", required=True)
    j = sub.add_parser(
        "join",
        help="join the session whose controller listens at HOST PORT",
        description="Connect to a SocketSession's controller, start this node's workers and "
        "relay their commands until the session shuts down (or the controller disappears).",
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
        help="seconds to keep retrying while the controller is not up (default 60)",
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
    sub.add_parser("version", help="print the package and protocol versions")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
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
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) >= 3 and argv[0] not in ("join", "version") and not argv[0].startswith("-"):
        argv = ["join", argv[0], argv[1], "--workers", argv[2], *argv[3:]]
    return main(argv)
