"""The ``disco-rpc`` command: ``server``, ``tracker``, ``proxy``, ``query``, ``stdio``,
``upload``, ``download``, ``ls``.

Every command takes ``--version``, ``-v``/``--verbose`` and ``--log-level LEVEL``;
``--help`` shows each option's default.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from typing import Any, TextIO

from disco_core import DiscoError
from disco_core.spi import (
    HelpFormatter,
    add_common_options,
    chosen_parser,
    configure_logging,
    level_from_args,
    parse_command_line,
    plain_warnings,
)

from . import wire

__all__ = ["main", "build_parser"]

log = logging.getLogger("disco_rpc.cli")


class _TLSFilesError(ValueError):
    """A TLS option's file cannot be used: a usage error (exit 2) naming the options."""


def _load_tls(load, *options: tuple[str, str | None]):
    """``load(*files)`` (the files of ``options``), with an error that names the options
    and their files (ssl says only "[SSL] PEM lib" or "[Errno 2]": an outside check)."""
    import ssl

    given = [(o, f) for o, f in options if f]
    for option, path in given:
        if not os.path.isfile(path):
            raise _TLSFilesError(f"{option} {path}: no such file")
    try:
        return load(*(f for _o, f in options))
    except (OSError, ssl.SSLError) as exc:
        named = " and ".join(f"{o} {f}" for o, f in given)
        raise _TLSFilesError(
            f"cannot use {named}: {exc} (PEM files: a certificate, its unencrypted key, "
            "a CA bundle)"
        ) from None


def _tls_server(cert: str | None, keyfile: str | None, client_ca: str | None = None):
    if not cert:
        return None
    import ssl

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    _load_tls(ctx.load_cert_chain, ("--tls-cert", cert), ("--tls-key", keyfile))
    if client_ca:  # mutual TLS: TLS then stands in for a token beyond loopback
        _load_tls(ctx.load_verify_locations, ("--tls-client-ca", client_ca))
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def _tls_client(cafile: str | None, insecure: bool, cert: str | None = None, keyfile: str | None = None, prefix: str = "--tls"):  # fmt: skip
    """A client context of the options ``{prefix}-ca``, ``-cert``, ``-key`` (None without)."""
    if not cafile and not insecure and not cert:
        return None
    import ssl

    ctx = _load_tls(lambda ca: ssl.create_default_context(cafile=ca), (f"{prefix}-ca", cafile))
    if insecure:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    if cert:  # for a service that requires client certificates (--tls-client-ca there)
        _load_tls(ctx.load_cert_chain, (f"{prefix}-cert", cert), (f"{prefix}-key", keyfile))
    return ctx


class _Bar:
    """A progress bar on stderr, redrawn in place: only where stderr is a terminal.

    Anywhere else (a log file, a pipe, CI) a ``\\r`` redraw is noise: one line is
    written by :meth:`done`, once the transfer succeeded (the last byte sent is not
    yet an upload the server accepted).
    """

    def __init__(self, label: str, stream: TextIO | None = None) -> None:
        self.label = label
        self.stream = stream or sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.live = bool(isatty and isatty())
        self.t0 = time.perf_counter()
        self.total: int | None = None  # (not live: set when the last byte went)
        self.elapsed = 0.0

    def done(self) -> None:
        """The transfer succeeded: write its one line (where no bar was drawn)."""
        if not self.live and self.total is not None:
            rate = self.total / self.elapsed / 1e6
            self.stream.write(
                f"{self.label}: {self.total / 1e6:.1f} MB in {self.elapsed:.2f} s ({rate:.0f} MB/s)\n"
            )
            self.stream.flush()

    def __call__(self, done: int, total: int) -> None:
        if not self.live:
            if done >= total:
                self.total, self.elapsed = total, max(time.perf_counter() - self.t0, 1e-9)
            return
        elapsed = max(time.perf_counter() - self.t0, 1e-9)
        rate = done / elapsed / 1e6
        frac = done / total if total else 1.0
        width = 30
        fill = int(frac * width)
        self.stream.write(
            f"\r{self.label} [{'#' * fill}{'.' * (width - fill)}] {frac:6.1%} "
            f"{done / 1e6:.1f}/{total / 1e6:.1f} MB {rate:.0f} MB/s"
        )
        if done >= total:
            self.stream.write("\n")
        self.stream.flush()


_DIST = "disco-rpc"
_TOKEN_NOTE = (
    "The token is read from $DISCO_TOKEN (never from the command line); links to a tracker, "
    "and the tracker itself, use $DISCO_TRACKER_TOKEN when it is set."
)
#: Commands that run a service in the foreground: they log at INFO unless told otherwise.
_SERVICES = ("server", "tracker", "proxy")


def _sub(sub: Any, name: str, help: str, description: str, **kw: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        name, help=help, description=description, formatter_class=HelpFormatter, **kw
    )
    add_common_options(p, _DIST, default_level="info" if name in _SERVICES else "warning")
    return p


def _port_number(text: str) -> int:
    """A port 0-65535, for argparse (refused before anything starts or warns)."""
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"expected a port 0-65535, got {text!r}")
    return int(text)


def _add_listen(p: argparse.ArgumentParser, port: int, what: str) -> None:
    p.add_argument("--host", default="127.0.0.1", help=f"the address the {what} listens on")
    p.add_argument("--port", type=_port_number, default=port, help="the first port to try")
    p.add_argument(
        "--port-end",
        type=_port_number,
        default=9199,
        help="the end of the range of ports to try, not included: the first free port in "
        "[port, port-end) is used (the port alone when port-end <= port)",
    )


def _add_insecure(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--allow-insecure-bind",
        action="store_true",
        help="listen beyond loopback without a token (anyone who reaches the port gets in)",
    )
    p.add_argument("--silent", action="store_true", help="log errors only (default: INFO)")


def _add_tls_server(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls-cert", metavar="FILE", help="serve TLS with this certificate (PEM)")
    p.add_argument("--tls-key", metavar="FILE", help="the key of --tls-cert (when not in it)")
    p.add_argument(
        "--tls-client-ca",
        metavar="FILE",
        help="with --tls-cert: require each client's certificate, signed by this CA bundle "
        "(mutual TLS; it then stands in for a token beyond loopback)",
    )


def _add_link_tls(p: argparse.ArgumentParser, link: str, what: str, default: str = "") -> None:
    """``--{link}-tls-ca``/``-cert``/``-key``: TLS for the link this service opens to ``what``
    (the service's own ``--tls-*`` options are for those that connect to it)."""
    p.add_argument(
        f"--{link}-tls-ca", metavar="FILE",
        help=f"reach the {what} over TLS, checking it with this CA bundle{default}",
    )  # fmt: skip
    p.add_argument(
        f"--{link}-tls-cert", metavar="FILE",
        help=f"reach the {what} over TLS, presenting this certificate (PEM) to a {what} that requires one",
    )  # fmt: skip
    p.add_argument(f"--{link}-tls-key", metavar="FILE", help=f"the key of --{link}-tls-cert")


def _link_tls(args, link: str):
    """The client context of ``--{link}-tls-*`` (None without them)."""
    ca, cert, key = (getattr(args, f"{link}_tls_{k}", None) for k in ("ca", "cert", "key"))
    if key and not cert:
        raise _TLSFilesError(f"--{link}-tls-key needs --{link}-tls-cert (the certificate it is the key of)")  # fmt: skip
    return _tls_client(ca, False, cert, key, prefix=f"--{link}-tls")


def _add_connect(p: argparse.ArgumentParser, port: int, what: str) -> None:
    p.add_argument("--host", default="127.0.0.1", help=f"the {what}'s address")
    p.add_argument("--port", type=_port_number, default=port, help=f"the {what}'s port")
    p.add_argument(
        "--tls-ca",
        metavar="FILE",
        help=f"connect with TLS, checking the {what} with this CA bundle",
    )
    p.add_argument(
        "--tls-insecure",
        action="store_true",
        help="connect with TLS without checking the certificate (testing only)",
    )
    p.add_argument(
        "--tls-cert",
        metavar="FILE",
        help=f"connect with TLS, presenting this certificate (PEM) to a {what} that requires one",
    )
    p.add_argument("--tls-key", metavar="FILE", help="the key of --tls-cert (when not in it)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``disco-rpc``."""
    p = argparse.ArgumentParser(
        prog="disco-rpc",
        description="Disco RPC: servers, tracker and proxy after tvm.rpc, and file tools.",
        epilog="`disco-rpc COMMAND --help` lists a command's options. " + _TOKEN_NOTE,
        formatter_class=HelpFormatter,
    )
    add_common_options(p, _DIST)
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND", help="one of:")

    s = _sub(
        sub, "server", "run an RPC server in the foreground",
        "Serve RPC sessions (tvm.rpc's server): each client gets a session in its own "
        "process, with its own work folder.",
        epilog=_TOKEN_NOTE,
    )  # fmt: skip
    _add_listen(s, 9091, "server")
    s.add_argument(
        "--key", default="", help="the key clients and the tracker match on (default: none)"
    )
    s.add_argument(
        "--load-library",
        metavar="FILES",
        help=".py/.so files to load, separated by ':' (TVM's) or ','",
    )
    s.add_argument(
        "--no-fork",
        action="store_true",
        help="serve sessions in threads of this process, not forked ones",
    )
    s.add_argument(
        "--timeout",
        type=float,
        metavar="SECONDS",
        help="seconds a connecting client has for its handshake (TVM's socket timeout; at most "
        "10, the default); not a limit on sessions",
    )
    s.add_argument(
        "--session-timeout",
        type=float,
        metavar="SECONDS",
        help="longest session, in seconds (default: no limit)",
    )
    s.add_argument(
        "--liveness-timeout",
        type=float,
        metavar="SECONDS",
        help="seconds of silence after which a client is taken for frozen or gone and its "
        "session ends (default: $DISCO_RPC_LIVENESS_TIMEOUT, else 8; 0: never)",
    )
    s.add_argument(
        "--work-dir",
        metavar="DIR",
        help="a folder every session uses and that is kept (default: one temporary folder "
        "per session, deleted when it ends)",
    )
    s.add_argument(
        "--max-message-bytes",
        type=int,
        default=wire.DEFAULT_MAX_MESSAGE_BYTES,
        metavar="N",
        help="the largest message a session accepts, in bytes",
    )
    _add_tls_server(s)
    _add_insecure(s)
    s.add_argument(
        "--tracker", metavar="HOST:PORT", type=_hostport, help="a tracker to register with"
    )
    s.add_argument(
        "--custom-addr", metavar="HOST", help="the host the tracker tells clients (default: --host)"
    )
    s.add_argument(
        "--through-proxy", action="store_true", help="--host/--port name a proxy to serve through"
    )
    _add_link_tls(s, "tracker", "tracker")
    _add_link_tls(s, "proxy", "proxy (with --through-proxy)")

    t = _sub(
        sub, "tracker", "run an RPC tracker in the foreground",
        "Match clients with servers by key, with priorities and queues (tvm.rpc's tracker).",
        epilog=_TOKEN_NOTE,
    )  # fmt: skip
    _add_listen(t, 9190, "tracker")
    _add_tls_server(t)
    t.add_argument(
        "--match-timeout", type=float, default=10.0, metavar="SECONDS",
        help="seconds a matched server waits for its client",
    )  # fmt: skip
    t.add_argument(
        "--tvm-protocol",
        action="store_true",
        help="also speak TVM's tracker protocol (TVM's rpc_server, connect_tracker, "
        "query_rpc_tracker), which has no authentication: beyond loopback it needs "
        "--allow-insecure-bind",
    )
    _add_insecure(t)

    q = _sub(
        sub, "query", "print a tracker's servers and queues",
        "Print a tracker's servers and queues, as TVM's query_rpc_tracker does.",
    )  # fmt: skip
    _add_connect(q, 9190, "tracker")

    px = _sub(
        sub, "proxy", "run an RPC proxy in the foreground",
        "Relay clients to servers that cannot be reached directly (tvm.rpc's proxy).",
        epilog=_TOKEN_NOTE,
    )  # fmt: skip
    _add_listen(px, 9090, "proxy")
    px.add_argument(
        "--tracker", metavar="HOST:PORT", type=_hostport, help="a tracker to register with"
    )
    _add_tls_server(px)
    _add_link_tls(px, "tracker", "tracker")
    _add_insecure(px)

    st = _sub(
        sub, "stdio", "serve one session on stdin/stdout (for PopenSession)",
        "Serve one session on this process's stdin and stdout (what PopenSession starts).",
    )  # fmt: skip
    st.add_argument(
        "--load-library", metavar="FILES", help=".py/.so files to load, separated by ':' or ','"
    )

    for name, short, what in (
        (
            "upload",
            "copy a local file to a server",
            "Copy a local file into a server session's work folder.",
        ),
        (
            "download",
            "copy a server's file here",
            "Copy a file of a server session's work folder to a local file.",
        ),
        ("ls", "list a server's folder", "List a folder of a server session's work folder."),
    ):
        c = _sub(
            sub, name, f"{short} (one session each: use a server with --work-dir)",
            f"{what} Each invocation is a session of its own: files persist between "
            "invocations only on a server started with --work-dir.",
            epilog=_TOKEN_NOTE,
        )  # fmt: skip
        _add_connect(c, 9091, "server")
        c.add_argument("--key", default="", help="the server's key (default: none)")
        c.add_argument(
            "--tracker",
            metavar="HOST:PORT",
            type=_hostport,
            help="ask this tracker for a server of --key (then --host and --port are not used)",
        )
        c.add_argument(
            "--wait-timeout",
            metavar="SECONDS",
            type=_positive_seconds,
            help="with --tracker: give up when no server of --key is free within this "
            "time (default: wait, as TVM's tracker requests do; what the tracker has is "
            f"said after {_WAIT_NOTICE_S:g} s)",
        )
        # (--tls-* are the server's: with --tracker they went to the tracker alone, and
        # the session with the server was plain while the log said TLS: an outside check)
        _add_link_tls(c, "tracker", "tracker", " (default: as --tls-ca, --tls-cert, --tls-key)")
        if name == "upload":
            c.add_argument("file", help="the local file")
            c.add_argument("target", nargs="?", help="the remote name (default: the file's name)")
        elif name == "download":
            c.add_argument("path", help="the remote file")
            c.add_argument(
                "out",
                nargs="?",
                help="the local file to write, or a folder to write it into (default: the "
                "remote file's name, in the current folder)",
            )
        else:
            c.add_argument("path", nargs="?", default=".", help="the remote folder")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run ``disco-rpc`` with ``argv`` (``sys.argv[1:]`` when None); return its exit code."""
    p = build_parser()
    args = parse_command_line(p, argv)
    if args.cmd in _SERVICES:
        default = logging.ERROR if args.silent else logging.INFO
    else:
        default = logging.WARNING
    try:
        level = level_from_args(args, default)
    except ValueError as exc:
        chosen_parser(p, args).error(str(exc))
    if getattr(args, "wait_timeout", None) is not None and args.tracker is None:
        chosen_parser(p, args).error("--wait-timeout is for a request to a tracker: add --tracker")
    for link, needs, flag in (("tracker", "tracker", "--tracker"), ("proxy", "through_proxy", "--through-proxy")):  # fmt: skip
        given = [f"--{link}-tls-{k}" for k in ("ca", "cert", "key") if getattr(args, f"{link}_tls_{k}", None)]  # fmt: skip
        if given and not getattr(args, needs, None):
            chosen_parser(p, args).error(f"{given[0]} is for the link to the {link}: add {flag}")
    if getattr(args, "tls_client_ca", None) and not args.tls_cert:
        chosen_parser(p, args).error("--tls-client-ca needs --tls-cert (TLS of this service's own)")
    if getattr(args, "tls_key", None) and not getattr(args, "tls_cert", None):
        chosen_parser(p, args).error(
            "--tls-key needs --tls-cert (the certificate it is the key of)"
        )
    if getattr(args, "silent", False) and getattr(args, "log_level", None) is None:
        level = max(level, logging.ERROR)  # --silent wins over $DISCO_LOG_LEVEL, not --log-level
    plain_warnings("disco-rpc")
    configure_logging(level)
    from .errors import RPCError

    try:
        return _run(args)
    except _TLSFilesError as exc:
        print(f"disco-rpc: {exc}", file=sys.stderr)
        return 2
    except (RPCError, OSError, DiscoError) as exc:
        print(f"disco-rpc: {_short(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # outside a service's wait (which stops what it started)
        print("disco-rpc: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _short(exc: BaseException) -> str:
    """One line for an error (a remote error without its remote traceback)."""
    exc_type = getattr(exc, "exc_type", "")
    if exc_type:
        return f"remote {exc_type}: {exc.remote_message}"  # type: ignore[attr-defined]
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"{exc.strerror or exc}: {exc.filename}"
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def _run(args) -> int:
    if args.cmd == "server":
        if args.tracker or args.through_proxy:
            return _managed_server(args)
        return _server(args)
    if args.cmd in ("tracker", "proxy"):
        return _tracker_or_proxy(args)
    if args.cmd == "query":
        from .tracker import connect_tracker

        ctx = _tls_client(args.tls_ca, args.tls_insecure, args.tls_cert, args.tls_key)
        with connect_tracker(args.host, args.port, ssl_context=ctx) as ts:
            # as TVM's python -m tvm.exec.query_rpc_tracker prints it
            print(f"Tracker address {args.host}:{args.port}\n")
            print(ts.text_summary())
        return 0
    if args.cmd == "stdio":
        from .server import serve_stdio

        serve_stdio(args.load_library)
        return 0
    return _files(args)


def _files(args) -> int:
    """``upload``, ``download``, ``ls``: one session each (use a server with --work-dir)."""
    from .client import connect

    ctx = _tls_client(args.tls_ca, args.tls_insecure, args.tls_cert, args.tls_key)
    tls = "TLS" if ctx is not None else "no TLS"
    if args.tracker is not None:
        from .tracker import HANDSHAKE_TIMEOUT, TrackerSession

        link = _link_tls(args, "tracker")
        tracker_ctx = ctx if link is None else link
        tracker_tls = "TLS" if tracker_ctx is not None else "no TLS"
        log.info("%s: asking the tracker at %s:%d (%s) for a server of key %r (%s)", args.cmd, *args.tracker, tracker_tls, args.key, tls)  # fmt: skip
        # A request waits for a free server without a bound (TVM's rule): a mistyped key
        # looked like a hang, without a word (outside check). Say what the tracker has.
        notice = threading.Timer(_WAIT_NOTICE_S, _say_still_waiting, (args, tracker_ctx))
        notice.daemon = True
        notice.start()
        try:
            # (a frozen tracker took its full 10 s handshake past a shorter --wait-timeout)
            bound = {} if args.wait_timeout is None else {"connect_timeout": min(HANDSHAKE_TIMEOUT, max(args.wait_timeout, 0.1))}  # fmt: skip
            with TrackerSession(args.tracker, ssl_context=tracker_ctx, server_ssl_context=ctx, **bound) as tracker:  # fmt: skip
                sess = tracker.request(args.key, wait_timeout=args.wait_timeout)
        finally:
            notice.cancel()
    else:
        log.info("%s: connecting to %s:%d (key %r, %s)", args.cmd, args.host, args.port, args.key, tls)  # fmt: skip
        sess = connect(args.host, args.port, args.key, ssl_context=ctx)
    with sess:
        log.debug("session open: work folder %s", sess.info.get("work_dir", "?"))
        if args.cmd == "upload":
            bar = _Bar(f"upload {args.file}")
            sess.upload(args.file, args.target, progress=bar)
            bar.done()
        elif args.cmd == "download":
            bar = _Bar(f"download {args.path}")
            sess.download(args.path, target=_local_target(args.path, args.out), progress=bar)
            bar.done()
        else:
            names = sess.listdir_names(args.path)
            if names:
                print("\n".join(names))
    return 0


def _local_target(remote: str, out: str | None) -> str:
    """Where ``download`` writes ``remote``: ``out``, or the remote name in ``out`` when
    it is a folder (``.`` when not given), as ``cp`` and ``scp`` do."""
    name = os.path.basename(remote.rstrip("/")) or remote
    if out is None:
        return name
    return os.path.join(out, name) if os.path.isdir(out) else out


def _hostport(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (or ``:PORT``, or ``[::1]:PORT``) as an address, for argparse."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT with a port 1-65535, got {text!r}")
    return (host.strip("[]") or "127.0.0.1", int(port))


#: The exit status after Ctrl-C, as ``disco demo`` and ``disco-socket join`` (128 + SIGINT);
#: a SIGTERM is a requested stop: 0.
EXIT_INTERRUPTED = 130


def _wait_forever(obj, banner: str) -> int:
    """Print ``banner``, then wait until ``obj``'s process ends or a signal stops us."""
    import signal
    import time

    from .service import exit_on_term

    signal.signal(signal.SIGTERM, exit_on_term)
    try:
        print(banner, flush=True)  # (a Ctrl-C here still stops obj's process)
        while obj.pid is not None:
            pid, _ = os.waitpid(obj.pid, os.WNOHANG)
            if pid:
                obj.pid = None
                break
            time.sleep(0.2)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 0
    finally:
        obj.terminate()
    return 0


#: Seconds a file command waits for the tracker's server before it says why it waits.
_WAIT_NOTICE_S = 5.0


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


def _say_still_waiting(args, ctx) -> None:
    """On a timer thread, with a tracker link of its own: what the request waits for."""
    from .tracker import connect_tracker

    try:
        with connect_tracker(*args.tracker, ssl_context=ctx) as tracker:
            # (the tracker counts this command's own request among those waiting)
            pool = tracker.pool_text(args.key).replace("request(s) waiting", "request(s) waiting, this one included")  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - a notice only; the request says what failed
        pool = f"the tracker could not be asked: {_short(exc)}"
    bound = f"up to {args.wait_timeout:g} s" if args.wait_timeout else "until one is free (--wait-timeout bounds it)"  # fmt: skip
    print(f"disco-rpc {args.cmd}: waiting for a server of key {args.key!r}: {pool}; waiting {bound}", file=sys.stderr)  # fmt: skip


def _tracker_or_proxy(args) -> int:
    from .errors import RPCError

    try:
        if args.cmd == "tracker":
            from .tracker import Tracker

            obj = Tracker(
                args.host, args.port, args.port_end, args.silent,
                ssl_context=_tls_server(args.tls_cert, args.tls_key, args.tls_client_ca),
                match_timeout=args.match_timeout, allow_insecure_bind=args.allow_insecure_bind,
                tvm_protocol=args.tvm_protocol,
            )  # fmt: skip
        else:
            from .proxy import Proxy

            obj = Proxy(  # type: ignore[assignment]
                args.host, args.port, args.port_end, tracker_addr=args.tracker,
                allow_insecure_bind=args.allow_insecure_bind,
                ssl_context=_tls_server(args.tls_cert, args.tls_key, args.tls_client_ca),
                tracker_ssl_context=_link_tls(args, "tracker"),
            )  # fmt: skip
    except RPCError as exc:
        print(f"disco-rpc: {exc}", file=sys.stderr)
        return 1
    return _wait_forever(obj, f"disco-rpc {args.cmd} listening on {obj.host}:{obj.port}")


def _managed_server(args) -> int:
    from .errors import RPCError
    from .server import Server

    tls = _tls_server(args.tls_cert, args.tls_key, args.tls_client_ca)  # (usage errors: exit 2)
    tracker_tls, proxy_tls = _link_tls(args, "tracker"), _link_tls(args, "proxy")
    try:
        srv = Server(
            args.host, args.port, args.port_end, is_proxy=args.through_proxy,
            tracker_addr=args.tracker, key=args.key,
            load_library=args.load_library, custom_addr=args.custom_addr, no_fork=args.no_fork,
            timeout=args.timeout, session_timeout=args.session_timeout, work_dir=args.work_dir,
            max_message_bytes=args.max_message_bytes,
            ssl_context=tls, allow_insecure_bind=args.allow_insecure_bind,
            liveness_timeout=args.liveness_timeout,
            tracker_ssl_context=tracker_tls, proxy_ssl_context=proxy_tls,
        )  # fmt: skip
    except (RPCError, ValueError) as exc:
        print(f"disco-rpc: {exc}", file=sys.stderr)
        return 1
    return _wait_forever(srv, f"disco-rpc server on {srv.host}:{srv.port}")


def _server(args) -> int:
    from disco_core import InsecureBindError

    from . import auth
    from .errors import RPCError
    from .server import (
        ServerConfig,
        _positive_or_none,
        bind_listener,
        check_bind,
        load_libraries,
        prepare_work_dir,
        resolve_liveness_timeout,
        serve_forever,
    )
    from .server import (
        handshake_timeout as resolve_handshake_timeout,
    )
    from .wire import check_message_limit

    token = auth.resolve_token(None)
    ctx = _tls_server(args.tls_cert, args.tls_key, args.tls_client_ca)
    try:
        check_bind(args.host, token, ctx, args.allow_insecure_bind)
    except InsecureBindError as exc:
        print(
            f"disco-rpc: {exc} (set DISCO_TOKEN, or --tls-cert with --tls-client-ca, or --allow-insecure-bind)",
            file=sys.stderr,
        )
        return 2
    try:
        liveness = resolve_liveness_timeout(args.liveness_timeout)
        session_timeout = _positive_or_none(args.session_timeout, "--session-timeout")
        handshake_timeout = resolve_handshake_timeout(args.timeout)
        work_dir = prepare_work_dir(args.work_dir, "--work-dir") if args.work_dir else ""
        max_bytes = check_message_limit(args.max_message_bytes, "--max-message-bytes")
        sock = bind_listener(args.host, args.port, args.port_end)
    except (RPCError, ValueError, TypeError) as exc:
        print(f"disco-rpc: {exc}", file=sys.stderr)
        return 1
    cfg = ServerConfig(
        key=args.key,
        token=token,
        ssl_context=ctx,
        work_dir=work_dir,
        max_message_bytes=max_bytes,
        session_timeout=session_timeout,
        handshake_timeout=handshake_timeout,
        no_fork=args.no_fork,
        libs=load_libraries(args.load_library),
        liveness_timeout=liveness,
    )
    host, port = sock.getsockname()[:2]
    import signal

    from .service import exit_on_term

    signal.signal(signal.SIGTERM, exit_on_term)  # before the line a supervisor waits for
    try:
        print(f"disco-rpc server listening on {host}:{port}", flush=True)
        serve_forever(sock, cfg)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except SystemExit as exc:  # SIGTERM
        return exc.code if isinstance(exc.code, int) else 0
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
