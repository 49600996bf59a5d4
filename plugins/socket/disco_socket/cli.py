"""The ``disco-socket`` command: ``disco-socket join HOST PORT --workers N``.

Also ``disco-socket HOST PORT N [options]`` and ``python -m disco_socket HOST PORT N
[options]``, short for ``join HOST PORT --workers N [options]``. Every form takes
``--version``, ``-v``/``--verbose`` and ``--log-level LEVEL``.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import ssl
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

from .wire import PROTOCOL_VERSION

__all__ = ["main", "module_main"]

_COMMANDS = ("join", "version")
#: Options every form takes before HOST (the short form is found after them).
_GLOBAL_FLAGS = ("-v", "--verbose", "-vv", "-vvv")


def _port(text: str) -> int:
    """A TCP port, 1-65535 (99999 said "connection refused": outside check)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 < port < 65536:
        raise argparse.ArgumentTypeError(f"a port is 1-65535, got {port}")
    return port


def _seconds(text: str) -> float:
    """A positive, finite number of seconds (-1 and nan were accepted: outside check)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"seconds must be > 0 and finite, got {text}")
    return value


def _usage(prog: str) -> str:
    return (
        f"{prog} join HOST PORT --workers N [options]\n"
        f"       {prog} HOST PORT N [options]   (short for join; options as for join)\n"
        f"       {prog} version"
    )


def _version_text() -> str:
    from disco_core.spi import commandline

    version = commandline.distribution_version("disco-socket")
    return f"disco-socket {version} (protocol {PROTOCOL_VERSION})"


def _parser(prog: str = "disco-socket") -> argparse.ArgumentParser:
    version = _version_text()
    p = argparse.ArgumentParser(
        formatter_class=HelpFormatter,
        prog=prog,
        usage=_usage(prog),
        description="Disco for Python over sockets: run a node agent that joins a SocketSession.",
        epilog=f"Example: {prog} 10.0.0.1 9091 2 joins the session whose controller listens "
        f"at 10.0.0.1:9091 with 2 workers. `{prog} join --help` lists the options. "
        "Exit codes: 0 the session shut down, 1 the controller vanished or fell silent, "
        "2 refused (version, token, worker count, TLS, session full), 3 no controller "
        "reachable in time, 128+N stopped by signal N (130: Ctrl-C).",
    )
    add_common_options(p, "disco-socket", version_text=version)
    sub = p.add_subparsers(dest="command", required=True, metavar="{join,version}", help="one of:")
    j = sub.add_parser(
        "join",
        prog=f"{prog} join",
        help="join the session whose controller listens at HOST PORT",
        description="Connect to a SocketSession's controller, start this node's workers and "
        "relay their commands until the session shuts down (or the controller disappears). "
        f"Short form: {prog} HOST PORT N [options].",
        formatter_class=HelpFormatter,
    )
    add_common_options(j, "disco-socket", version_text=version, default_level="info")
    j.add_argument("host", help="the controller's address")
    j.add_argument("port", type=_port, help="the controller's port (1-65535)")
    j.add_argument(
        "--workers",
        "-n",
        type=int,
        metavar="N",
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
        metavar="SECONDS",
        type=_seconds,
        default=None,  # $DISCO_CONNECT_TIMEOUT, else 60: read in main(), naming the variable
        help="seconds to keep retrying while nothing answers at HOST PORT (default: "
        "$DISCO_CONNECT_TIMEOUT, else 60)",
    )
    j.add_argument(
        "--retry-interval",
        metavar="SECONDS",
        type=_seconds,
        default=0.2,
        help="seconds between attempts",
    )
    j.add_argument("--tls", action="store_true", help="use TLS, verifying with the system CAs")
    j.add_argument(
        "--tls-ca",
        metavar="FILE",
        help="CA bundle that signed the controller's certificate (implies --tls)",
    )
    j.add_argument(
        "--tls-cert", metavar="FILE", help="this node's certificate, for mutual TLS (implies --tls)"
    )
    j.add_argument("--tls-key", metavar="FILE", help="the key of --tls-cert")
    j.add_argument(
        "--tls-server-name",
        metavar="NAME",
        help="the name to check the controller's certificate against",
    )
    j.add_argument("-q", "--quiet", action="store_true", help="log errors only (default: INFO)")
    v = sub.add_parser(
        "version",
        prog=f"{prog} version",
        help="print the package and protocol versions (as --version)",
        description="Print the disco-socket and protocol versions.",
        formatter_class=HelpFormatter,
    )
    add_common_options(v, "disco-socket", version_text=version)
    return p


def _first_word(argv: list[str]) -> int:
    """The index of the first argument that is not one of the common options."""
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in _GLOBAL_FLAGS or a.startswith("--log-level="):
            i += 1
        elif a == "--log-level":
            i += 2
        else:
            break
    return i


def _expand_short_form(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``HOST PORT N [options]`` -> ``join HOST PORT --workers N [options]``.

    ``HOST PORT --workers N [options]`` is taken as well; anything shorter is a usage
    error that says what is missing (not argparse's "invalid choice").
    """
    host, rest = argv[0], argv[1:]
    close = difflib.get_close_matches(host.lower(), _COMMANDS, n=1)
    if not rest or rest[0].startswith("-"):
        maybe = f" (or did you mean the command {close[0]!r}?)" if close else ""
        parser.error(f"missing PORT after {host!r}{maybe}: run {parser.prog} HOST PORT N")
    port, rest = rest[0], rest[1:]
    if not port.isdigit():  # a mistyped command ("jion 10.0.0.1 9192") is not a host
        if close:
            parser.error(f"unknown command {host!r}: did you mean {close[0]!r}?")
        parser.error(
            f"{host!r} is not a command ({', '.join(_COMMANDS)}), and as the short form's "
            f"HOST it needs a PORT number after it, not {port!r}: run {parser.prog} HOST PORT N"
        )
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
    first = _first_word(argv)
    if first < len(argv) and argv[first] not in _COMMANDS and not argv[first].startswith("-"):
        argv = argv[:first] + _expand_short_form(parser, argv[first:])
    args = parse_command_line(parser, argv)
    if getattr(args, "connect_timeout", 0) is None:
        text = os.environ.get("DISCO_CONNECT_TIMEOUT", "").strip() or "60"  # empty: unset
        try:
            args.connect_timeout = _seconds(text)
        except argparse.ArgumentTypeError as exc:  # was a raw ValueError traceback
            chosen_parser(parser, args).error(f"$DISCO_CONNECT_TIMEOUT: {exc}")
    if args.command == "version":
        print(_version_text())
        return 0
    try:
        level = level_from_args(args, logging.ERROR if args.quiet else logging.INFO)
    except ValueError as exc:
        parser.error(str(exc))
    if args.quiet and getattr(args, "log_level", None) is None:
        level = max(level, logging.ERROR)  # -q wins over $DISCO_LOG_LEVEL, not --log-level
    # The agent's own INFO lines are its default; its workers' lifecycle lines only
    # when the user asked for records (-v, --log-level or $DISCO_LOG_LEVEL).
    asked = bool(getattr(args, "verbose", 0)) or getattr(args, "log_level", None) is not None
    plain_warnings("disco-socket")
    configure_logging(level, pass_to_workers=asked or bool(os.environ.get("DISCO_LOG_LEVEL")))
    from .agent import client_ssl_context, run_agent

    if args.workers < 1:
        print("disco-socket: --workers must be >= 1", file=sys.stderr)
        return 2
    if args.tls_key and not args.tls_cert:
        print("disco-socket: --tls-key needs --tls-cert (the certificate it is the key of)", file=sys.stderr)  # fmt: skip
        return 2
    ctx = None
    if args.tls or args.tls_ca or args.tls_cert:
        try:
            ctx = client_ssl_context(args.tls_ca, args.tls_cert, args.tls_key)
        except (OSError, ssl.SSLError) as exc:  # a missing file, a file that is no PEM
            files = ", ".join(f for f in (args.tls_ca, args.tls_cert, args.tls_key) if f)
            print(f"disco-socket: cannot use the TLS files ({files}): {exc}", file=sys.stderr)
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
