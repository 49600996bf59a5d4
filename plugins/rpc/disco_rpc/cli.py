"""The ``disco-rpc`` command: ``server``, ``tracker``, ``proxy``, ``query``, ``stdio``,
``upload``, ``download``, ``ls``."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from . import wire


def _tls_server(cert: str | None, keyfile: str | None):
    if not cert:
        return None
    import ssl

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, keyfile)
    return ctx


def _tls_client(cafile: str | None, insecure: bool):
    if not cafile and not insecure:
        return None
    import ssl

    ctx = ssl.create_default_context(cafile=cafile)
    if insecure:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


class _Bar:
    """A progress bar on stderr."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.t0 = time.perf_counter()

    def __call__(self, done: int, total: int) -> None:
        frac = done / total if total else 1.0
        width = 30
        fill = int(frac * width)
        rate = done / max(time.perf_counter() - self.t0, 1e-9) / 1e6
        sys.stderr.write(
            f"\r{self.label} [{'#' * fill}{'.' * (width - fill)}] {frac:6.1%} "
            f"{done / 1e6:.1f}/{total / 1e6:.1f} MB {rate:.0f} MB/s"
        )
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="disco-rpc", description="Disco RPC server and tools")
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("server", help="run an RPC server in the foreground")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=9091)
    s.add_argument("--port-end", type=int, default=9199)
    s.add_argument("--key", default="")
    s.add_argument(
        "--load-library", default=None, help=".py/.so files separated by ':' (TVM's) or ','"
    )
    s.add_argument("--no-fork", action="store_true")
    s.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds a connecting client has for its handshake (TVM's socket timeout; at most "
        "10, the default); not a limit on sessions",
    )
    s.add_argument("--session-timeout", type=float, default=None, help="longest session, seconds")
    s.add_argument(
        "--liveness-timeout",
        type=float,
        default=None,
        help="seconds of silence after which a client is taken for frozen or gone and its "
        "session ends (default $DISCO_RPC_LIVENESS_TIMEOUT, else 8; 0: never)",
    )
    s.add_argument(
        "--work-dir",
        default=None,
        help="a folder every session uses and that is kept (default: one temporary folder "
        "per session, deleted when it ends)",
    )
    s.add_argument("--max-message-bytes", type=int, default=wire.DEFAULT_MAX_MESSAGE_BYTES)
    s.add_argument("--tls-cert", default=None)
    s.add_argument("--tls-key", default=None)
    s.add_argument("--allow-insecure-bind", action="store_true")
    s.add_argument("--silent", action="store_true")
    s.epilog = "The token is read from $DISCO_TOKEN."

    t = sub.add_parser("tracker", help="run an RPC tracker in the foreground")
    t.add_argument("--host", default="127.0.0.1")
    t.add_argument("--port", type=int, default=9190)
    t.add_argument("--port-end", type=int, default=9199)
    t.add_argument("--tls-cert", default=None)
    t.add_argument("--tls-key", default=None)
    t.add_argument("--match-timeout", type=float, default=10.0)
    t.add_argument(
        "--tvm-protocol",
        action="store_true",
        help="also speak TVM's tracker protocol (TVM's rpc_server, connect_tracker, "
        "query_rpc_tracker), which has no authentication: beyond loopback it needs "
        "--allow-insecure-bind",
    )
    t.add_argument("--allow-insecure-bind", action="store_true")
    t.add_argument("--silent", action="store_true")
    t.epilog = "The token is read from $DISCO_TOKEN."

    q = sub.add_parser("query", help="print a tracker's servers and queues")
    q.add_argument("--host", default="127.0.0.1")
    q.add_argument("--port", type=int, default=9190)
    q.add_argument("--tls-ca", default=None)
    q.add_argument("--tls-insecure", action="store_true")

    px = sub.add_parser("proxy", help="run an RPC proxy in the foreground")
    px.add_argument("--host", default="127.0.0.1")
    px.add_argument("--port", type=int, default=9090)
    px.add_argument("--port-end", type=int, default=9199)
    px.add_argument("--tracker", default=None, help="host:port of a tracker to register with")
    px.add_argument("--allow-insecure-bind", action="store_true")
    px.add_argument("--silent", action="store_true")

    st = sub.add_parser("stdio", help="serve one session on stdin/stdout (for PopenSession)")
    st.add_argument("--load-library", default=None)

    for name in ("upload", "download", "ls"):
        c = sub.add_parser(
            name,
            help=f"{name} through a session of a server (files persist between invocations "
            "only on a server with --work-dir)",
        )
        c.add_argument("--host", default="127.0.0.1")
        c.add_argument("--port", type=int, default=9091)
        c.add_argument("--key", default="")
        c.add_argument("--tls-ca", default=None)
        c.add_argument("--tls-insecure", action="store_true")
        if name == "upload":
            c.add_argument("file")
            c.add_argument("target", nargs="?")
        elif name == "download":
            c.add_argument("path")
            c.add_argument("out")
        else:
            c.add_argument("path", nargs="?", default=".")

    s.add_argument("--tracker", default=None, help="host:port of a tracker to register with")
    s.add_argument("--custom-addr", default=None, help="the host the tracker tells clients")
    s.add_argument("--through-proxy", action="store_true", help="--host/--port name a proxy")

    args = p.parse_args(argv)
    from .errors import RPCError

    try:
        return _run(args)
    except (RPCError, OSError) as exc:
        print(f"disco-rpc: {_short(exc)}", file=sys.stderr)
        return 1


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

        ctx = _tls_client(args.tls_ca, args.tls_insecure)
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

    ctx = _tls_client(args.tls_ca, args.tls_insecure)
    with connect(args.host, args.port, args.key, ssl_context=ctx) as sess:
        if args.cmd == "upload":
            sess.upload(args.file, args.target, progress=_Bar(f"upload {args.file}"))
        elif args.cmd == "download":
            sess.download(args.path, target=args.out, progress=_Bar(f"download {args.path}"))
        else:
            names = sess.listdir_names(args.path)
            if names:
                print("\n".join(names))
    return 0


def _hostport(text: str | None):
    if not text:
        return None
    host, _, port = text.rpartition(":")
    return (host or "127.0.0.1", int(port))


def _interrupt(*_args) -> None:
    raise KeyboardInterrupt


def _wait_forever(obj) -> int:
    import signal
    import time

    signal.signal(signal.SIGTERM, _interrupt)
    try:
        while obj.pid is not None:
            pid, _ = os.waitpid(obj.pid, os.WNOHANG)
            if pid:
                obj.pid = None
                break
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    finally:
        obj.terminate()
    return 0


def _tracker_or_proxy(args) -> int:
    logging.basicConfig(
        level=logging.ERROR if args.silent else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    from .errors import RPCError

    try:
        if args.cmd == "tracker":
            from .tracker import Tracker

            obj = Tracker(
                args.host, args.port, args.port_end, args.silent,
                ssl_context=_tls_server(args.tls_cert, args.tls_key),
                match_timeout=args.match_timeout, allow_insecure_bind=args.allow_insecure_bind,
                tvm_protocol=args.tvm_protocol,
            )  # fmt: skip
        else:
            from .proxy import Proxy

            obj = Proxy(  # type: ignore[assignment]
                args.host, args.port, args.port_end, tracker_addr=_hostport(args.tracker),
                allow_insecure_bind=args.allow_insecure_bind,
            )  # fmt: skip
    except RPCError as exc:
        print(f"disco-rpc: {exc}", file=sys.stderr)
        return 1
    print(f"disco-rpc {args.cmd} listening on {obj.host}:{obj.port}", flush=True)
    return _wait_forever(obj)


def _managed_server(args) -> int:
    from .errors import RPCError
    from .server import Server

    logging.basicConfig(
        level=logging.ERROR if args.silent else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    try:
        srv = Server(
            args.host, args.port, args.port_end, is_proxy=args.through_proxy,
            tracker_addr=_hostport(args.tracker), key=args.key,
            load_library=args.load_library, custom_addr=args.custom_addr, no_fork=args.no_fork,
            timeout=args.timeout, session_timeout=args.session_timeout, work_dir=args.work_dir,
            max_message_bytes=args.max_message_bytes,
            ssl_context=_tls_server(args.tls_cert, args.tls_key),
            allow_insecure_bind=args.allow_insecure_bind,
            liveness_timeout=args.liveness_timeout,
        )  # fmt: skip
    except (RPCError, ValueError) as exc:
        print(f"disco-rpc: {exc}", file=sys.stderr)
        return 1
    print(f"disco-rpc server on {srv.host}:{srv.port}", flush=True)
    return _wait_forever(srv)


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
        resolve_liveness_timeout,
        serve_forever,
    )
    from .server import (
        handshake_timeout as resolve_handshake_timeout,
    )

    logging.basicConfig(
        level=logging.ERROR if args.silent else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    token = auth.resolve_token(None)
    ctx = _tls_server(args.tls_cert, args.tls_key)
    try:
        check_bind(args.host, token, ctx, args.allow_insecure_bind)
    except InsecureBindError as exc:
        print(f"disco-rpc: {exc} (--tls-cert for TLS, --allow-insecure-bind)", file=sys.stderr)
        return 2
    try:
        liveness = resolve_liveness_timeout(args.liveness_timeout)
        session_timeout = _positive_or_none(args.session_timeout, "--session-timeout")
        handshake_timeout = resolve_handshake_timeout(args.timeout)
        sock = bind_listener(args.host, args.port, args.port_end)
    except (RPCError, ValueError, TypeError) as exc:
        print(f"disco-rpc: {exc}", file=sys.stderr)
        return 1
    cfg = ServerConfig(
        key=args.key,
        token=token,
        ssl_context=ctx,
        work_dir=os.path.abspath(args.work_dir) if args.work_dir else "",
        max_message_bytes=args.max_message_bytes,
        session_timeout=session_timeout,
        handshake_timeout=handshake_timeout,
        no_fork=args.no_fork,
        libs=load_libraries(args.load_library),
        liveness_timeout=liveness,
    )
    host, port = sock.getsockname()[:2]
    print(f"disco-rpc server listening on {host}:{port}", flush=True)
    try:
        serve_forever(sock, cfg)
    except (KeyboardInterrupt, SystemExit):
        pass
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
