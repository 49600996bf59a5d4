"""What a new user of ``disco-rpc`` meets: help, versions, logging, file transfer errors (issue 17)."""

from __future__ import annotations

import io
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from importlib.metadata import version

import pytest

import disco_core as disco
import disco_rpc as rpc
from disco_core.testing.commands import assert_documented
from disco_rpc import cli, client

PY = sys.executable
TOKEN = "ux-secret"
SUBCOMMANDS = ("server", "tracker", "query", "proxy", "stdio", "upload", "download", "ls")


def _run(*args: str, timeout: float = 30, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "DISCO_TOKEN": TOKEN, **kw.pop("env", {})}
    return subprocess.run(
        [PY, "-m", "disco_rpc", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = tmp_path_factory.mktemp("ux-work")
    srv = rpc.Server(port=10400, port_end=10450, token=TOKEN, work_dir=str(work))
    yield srv
    srv.terminate()


# --------------------------------------------------------------------------- options
def _parsers():
    p = cli.build_parser()
    sub = next(a for a in p._actions if a.__class__.__name__ == "_SubParsersAction")
    return p, sub.choices


def test_every_option_has_help_and_the_common_ones():
    p, subs = _parsers()
    assert set(SUBCOMMANDS) <= set(subs)
    assert_documented(p)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cmd", ["server", "upload", "tracker"])
def test_help_shows_defaults(cmd):
    r = _run(cmd, "--help")
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())  # as wrapped for any terminal width
    assert "(default: 127.0.0.1)" in text and "--log-level LEVEL" in text
    assert "(default: None)" not in text and "(default: False)" not in text


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args", [("--version",), ("server", "--version"), ("ls", "--version")])
def test_version(args):
    r = _run(*args)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"disco-rpc {version('disco-rpc')}"


@pytest.mark.timeout(60)
def test_bad_log_level_is_a_usage_error():
    r = _run("ls", "--log-level", "loud")
    assert r.returncode == 2 and "unknown log level 'loud'" in r.stderr


def test_a_tracker_address_without_a_port_is_a_usage_error_naming_the_option():
    p = cli.build_parser()
    for cmd in ("server", "proxy"):
        assert p.parse_args([cmd, "--tracker", "[::1]:9190"]).tracker == ("::1", 9190)
        assert p.parse_args([cmd, "--tracker", ":9190"]).tracker == ("127.0.0.1", 9190)
    # before: "disco-rpc: invalid literal for int() with base 10: 'nohostport'", rc 1
    for bad in ("nohostport", "host:0", "host:x", "host:70000"):
        with pytest.raises(SystemExit) as exc:
            p.parse_args(["server", "--tracker", bad])
        assert exc.value.code == 2


@pytest.mark.timeout(90)
def test_the_file_commands_reach_a_server_through_its_tracker(tmp_path):
    """``ls``/``upload``/``download --tracker``: a tracker's servers take only clients
    with a ticket, and the file commands had no way to get one (an outside check)."""
    tracker = rpc.Tracker(port=10460, port_end=10480, token=TOKEN)
    srv = rpc.Server(
        port=10480, port_end=10500, token=TOKEN, key="board", work_dir=str(tmp_path),
        tracker_addr=tracker.addr,
    )  # fmt: skip
    try:
        where = ("--tracker", f"127.0.0.1:{tracker.port}", "--key", "board")
        src = tmp_path / "local.txt"
        src.write_text("through the tracker")
        r = _run("upload", *where, str(src), "up.txt")
        assert r.returncode == 0, r.stderr
        r = _run("ls", *where)
        assert r.returncode == 0 and "up.txt" in r.stdout.split(), r
        out = tmp_path / "back.txt"
        r = _run("download", *where, "up.txt", str(out))
        assert r.returncode == 0 and out.read_text() == "through the tracker", r
        r = _run("ls", "--port", str(srv.port), "--key", "board")  # straight to the server
        assert r.returncode == 1 and "a ticket from the tracker is required" in r.stderr, r
        assert "--tracker HOST:PORT" in r.stderr
    finally:
        srv.terminate()
        tracker.terminate()


@pytest.mark.timeout(90)
def test_a_file_command_waiting_on_a_tracker_says_why_and_can_be_bounded():
    """``ls --tracker ... --key`` with a key no server has waited for ever without a word:
    a mistyped key looked like a hang (outside check). After a few seconds it says
    what the tracker has, and ``--wait-timeout`` bounds the wait."""
    tracker = rpc.Tracker(port=10460, port_end=10480, token=TOKEN)
    try:
        r = _run("ls", "--tracker", f"127.0.0.1:{tracker.port}", "--key", "nokey", "--wait-timeout", "6")  # fmt: skip
        assert r.returncode == 1, r
        lines = r.stderr.splitlines()
        assert lines[0] == (
            "disco-rpc ls: waiting for a server of key 'nokey': the tracker has no server "
            "registered for key 'nokey'; waiting up to 6 s"
        ), r.stderr
        assert lines[-1].startswith("disco-rpc: no server for key 'nokey' became free within 6 s")
        r = _run("ls", "--key", "nokey", "--wait-timeout", "6")
        assert r.returncode == 2 and "--wait-timeout is for a request to a tracker" in r.stderr
        r = _run("ls", "--tracker", f"127.0.0.1:{tracker.port}", "--wait-timeout", "0")
        assert r.returncode == 2 and "expected a number of seconds > 0" in r.stderr
    finally:
        tracker.terminate()


@pytest.mark.timeout(60)
def test_wait_timeout_bounds_the_connect_to_a_frozen_tracker_too():
    """A stopped tracker (SIGSTOP: the kernel still accepts into its backlog) held
    ``--wait-timeout 3`` for the link's full 10 s handshake: the bound covers it now."""
    frozen = socket.create_server(("127.0.0.1", 0))  # listens, never answers
    try:
        port = frozen.getsockname()[1]
        t0 = time.monotonic()
        r = _run("ls", "--tracker", f"127.0.0.1:{port}", "--key", "k", "--wait-timeout", "2")
        took = time.monotonic() - t0
        assert r.returncode == 1, r
        assert "no answer from the tracker at" in r.stderr and "2 s" in r.stderr, r.stderr
        assert took < 8, took  # 2 s and the interpreter's start, not 10 s and more
    finally:
        frozen.close()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("cmd", [["server", "--port", "10510", "--port-end", "10530"],
                                 ["tracker", "--port", "10550", "--port-end", "10570"]])  # fmt: skip
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 0)])
def test_a_service_stopped_by_ctrl_c_exits_130_and_by_sigterm_0(cmd, sig, code):
    """As ``disco demo`` and ``disco-socket join``: an interrupted run is told from a
    requested stop by its status (both were 0: an outside check)."""
    p = subprocess.Popen(
        [PY, "-m", "disco_rpc", *cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env={**os.environ, "DISCO_TOKEN": TOKEN},
    )  # fmt: skip
    try:
        line = p.stdout.readline()
        assert "listening on" in line or "server on" in line, p.stderr.read()
        p.send_signal(sig)
        assert p.wait(30) == code, p.stderr.read()
    finally:
        p.kill()
        p.wait()


@pytest.mark.timeout(60)
def test_the_no_token_warning_is_one_plain_line():
    """Not Python's ``.../cli.py:487: RuntimeWarning: ...`` and the source line."""
    env = {k: v for k, v in os.environ.items() if k != "DISCO_TOKEN"}
    p = subprocess.Popen(
        [PY, "-m", "disco_rpc", "server", "--port", "10570", "--port-end", "10590"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        assert "listening on" in p.stdout.readline()
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0
        err = p.stderr.read()
        assert err.startswith(
            "disco-rpc: warning: the RPC server listens on 127.0.0.1 without a token"
        )
        assert err.count("\n") == 1 and ".py:" not in err, err
    finally:
        p.kill()
        p.wait()


@pytest.mark.parametrize("cmd", ["server", "tracker", "proxy", "ls", "query"])
@pytest.mark.parametrize("port", ["99999", "-3", "x"])
def test_a_bad_port_is_a_usage_error_before_anything_warns(cmd, port, capsys):
    """It warned that the service had no token, then refused the port."""
    with pytest.raises(SystemExit) as exc:
        cli.main([cmd, "--port", port])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --port: expected a port 0-65535" in err and "warning" not in err, err


@pytest.mark.timeout(60)
def test_a_bad_tracker_address_names_the_option():
    r = _run("server", "--tracker", "nohostport")
    assert r.returncode == 2 and "argument --tracker: expected HOST:PORT" in r.stderr, r.stderr


@pytest.mark.timeout(60)
def test_verbose_logs_the_client_side(server):
    # -vv: DEBUG; the session's work goes through the core's logging configuration
    r = _run("ls", "--port", str(server.port), "-vv")
    assert r.returncode == 0, r.stderr
    assert "disco_rpc.cli" in r.stderr and "INFO ls: connecting to 127.0.0.1" in r.stderr
    assert "DEBUG session open: work folder" in r.stderr
    quiet = _run("ls", "--port", str(server.port))
    assert quiet.returncode == 0 and quiet.stderr == ""
    assert TOKEN not in r.stderr  # never the secret


# --------------------------------------------------------------------------- downloads
@pytest.mark.timeout(60)
def test_download_into_a_missing_local_folder(server, tmp_path):
    with rpc.connect("127.0.0.1", server.port, token=TOKEN) as s:
        s.upload(b"abc", "d.txt")
        missing = tmp_path / "nope" / "d.txt"
        with pytest.raises(FileNotFoundError, match="local folder .*nope.* does not exist"):
            s.download("d.txt", target=str(missing))
        assert s.download("d.txt") == bytearray(b"abc")  # the session is still usable
        with pytest.raises(ValueError, match="is a folder"):
            s.download("d.txt", target=str(tmp_path))
    r = _run("download", "--port", str(server.port), "d.txt", str(missing))
    assert r.returncode == 1
    assert r.stderr.count("\n") == 1 and "does not exist" in r.stderr, r.stderr
    assert "lost the connection" not in r.stderr


@pytest.mark.timeout(60)
def test_download_defaults_to_the_remote_name_and_takes_a_folder(server, tmp_path):
    """As ``cp`` and ``scp``: no local name writes the remote file's name here, a
    folder gets it inside (both were refused: an outside check)."""
    with rpc.connect("127.0.0.1", server.port, token=TOKEN) as s:
        s.upload(b"named", "named.txt")
    here = tmp_path / "here"
    here.mkdir()
    r = subprocess.run(
        [PY, "-m", "disco_rpc", "download", "--port", str(server.port), "named.txt"],
        capture_output=True, text=True, timeout=30, cwd=here,
        env={**os.environ, "DISCO_TOKEN": TOKEN},
    )  # fmt: skip
    assert r.returncode == 0 and (here / "named.txt").read_bytes() == b"named", r
    into = tmp_path / "into"
    into.mkdir()
    r = _run("download", "--port", str(server.port), "named.txt", str(into))
    assert r.returncode == 0 and (into / "named.txt").read_bytes() == b"named", r
    assert cli._local_target("a/b.bin", None) == "b.bin"
    # a folder that is not there: said at once, no server blamed, nothing left
    # (it said "lost the connection ... the server process died", and left a .part file)
    missing = tmp_path / "missing"
    r = _run("download", "--port", str(server.port), "named.txt", f"{missing}/")
    assert r.returncode == 1 and "does not exist" in r.stderr and "lost" not in r.stderr, r
    assert not missing.exists() and not list(tmp_path.glob(".missing*"))


@pytest.mark.timeout(60)
def test_local_session_download_checks_the_folder_too(tmp_path):
    s = rpc.LocalSession()
    s.upload(b"x", "f.bin")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        s.download("f.bin", target=str(tmp_path / "nope" / "f.bin"))


# --------------------------------------------------------------------------- uploads
class _CountingRelay:
    """A TCP relay in front of the server that counts the bytes the client sends."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.sent = 0
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.port = self.lsock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        c, _ = self.lsock.accept()
        s = socket.create_connection(("127.0.0.1", self.target))
        threading.Thread(target=self._pump, args=(c, s, True), daemon=True).start()
        threading.Thread(target=self._pump, args=(s, c, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, count: bool) -> None:
        try:
            while data := src.recv(1 << 20):
                if count:
                    self.sent += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.lsock.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("checked", [True, False])
def test_refused_upload_sends_no_body(server, monkeypatch, checked):
    body = bytes(64 << 20)
    if not checked:  # the old way, to show that the count below can tell
        monkeypatch.setattr(client, "CHECK_UPLOADS_ABOVE", len(body))
    relay = _CountingRelay(server.port)
    try:
        with rpc.connect("127.0.0.1", relay.port, token=TOKEN) as s:
            before = relay.sent
            with pytest.raises(
                rpc.RPCError, match="PermissionError.*leaves the session's work folder"
            ):
                s.upload(body, "../outside.bin")
            sent = relay.sent - before
            s.upload(b"small", "fine.bin")  # still in sync
            assert "fine.bin" in s.listdir_names(".")
    finally:
        relay.close()
    if checked:
        assert sent < 64 << 10, f"{sent} bytes sent for a refused upload"
    else:
        assert sent >= len(body)


@pytest.mark.timeout(120)
def test_accepted_large_upload_arrives(server):
    body = os.urandom(client.CHECK_UPLOADS_ABOVE + 1)
    with rpc.connect("127.0.0.1", server.port, token=TOKEN) as s:
        s.upload(body, "sub/big.bin")
        assert bytes(s.download("sub/big.bin")) == body
        with pytest.raises(rpc.RPCError, match="reserved for partial uploads"):
            s.upload(body, rpc.protocol.PART_PREFIX + "0123456789abcdef")


# --------------------------------------------------------------------------- progress
def test_progress_bar_only_on_a_terminal():
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    log, tty = io.StringIO(), Tty()
    bars = [cli._Bar("upload f", stream=stream) for stream in (log, tty)]
    for bar in bars:
        for done in (0, 10 << 20, 20 << 20):
            bar(done, 20 << 20)
    assert log.getvalue() == ""  # the last byte sent is not yet an upload that succeeded
    cli._Bar("upload f", stream=log).done()  # (nothing sent: no line either)
    assert log.getvalue() == ""
    for bar in bars:
        bar.done()
    assert "\r" not in log.getvalue() and log.getvalue().count("\n") == 1
    assert "upload f: 21.0 MB in" in log.getvalue()
    assert tty.getvalue().count("\r") == 3 and "100.0%" in tty.getvalue()


@pytest.mark.timeout(60)
def test_a_refused_upload_prints_no_success_line(server, tmp_path):
    # (an outside check: "upload hello.txt: 0.0 MB in 0.00 s", then the server's refusal)
    f = tmp_path / "hello.txt"
    f.write_text("hello")
    r = _run("upload", str(f), "../escape.txt", "--port", str(server.port))
    assert r.returncode == 1 and "leaves the session's work folder" in r.stderr
    assert "MB in" not in r.stderr, r.stderr
    r = _run("upload", str(f), "ok.txt", "--port", str(server.port))
    assert r.returncode == 0 and f"upload {f}: 0.0 MB in" in r.stderr, r.stderr


@pytest.mark.timeout(120)
def test_minimal_server_checks_uploads_too(tmp_path):
    path = str(tmp_path / "s.minrpc")
    rpc.with_minrpc(None)(path, [])
    sess = rpc.PopenSession(path)
    try:
        body = bytes(client.CHECK_UPLOADS_ABOVE + 1)
        for bad, why in (("../x.bin", "PermissionError"), (".", "IsADirectoryError")):
            with pytest.raises(rpc.RPCError, match=why):
                sess.upload(body, bad)
        sess.upload(body, "ok.bin")
        assert sess.listdir_names(".") == ["ok.bin"]
    finally:
        sess.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("fallback", [False, True], ids=["rmtree", "python-3.10-path"])
def test_removing_a_remote_folder_follows_no_link(tmp_path, fallback):
    """``rmtree_at`` (the server's folder removal): everything inside goes, what a link
    points at stays, on Python 3.11's ``rmtree(dir_fd=)`` and on the 3.10 fallback."""
    from disco_rpc.handler import rmtree_at

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    work = tmp_path / "work"
    (work / "d" / "e").mkdir(parents=True)
    (work / "d" / "f.txt").write_text("x")
    (work / "d" / "e" / "g.txt").write_text("y")
    (work / "d" / "link_dir").symlink_to(outside)
    (work / "d" / "link_file").symlink_to(outside / "keep.txt")
    dfd = os.open(work, os.O_RDONLY | os.O_DIRECTORY)
    try:
        rmtree_at("d", dfd, fallback=fallback)
    finally:
        os.close(dfd)
    assert not (work / "d").exists()
    assert (outside / "keep.txt").read_text() == "keep"


@pytest.mark.timeout(60)
def test_a_port_that_is_no_port_is_named(server):
    for kw, exc in (({"port": "abc"}, disco.DiscoTypeError), ({"port_end": 1.5}, disco.DiscoTypeError), ({"port": 70000}, disco.DiscoValueError)):  # fmt: skip
        name = next(iter(kw))
        with pytest.raises(exc, match=f"{name} must be an int 0-65535"):
            rpc.Server(token=TOKEN, **kw)
    # a range of one port, taken: the error names that port, not an empty range
    with pytest.raises(rpc.RPCError, match=rf"cannot bind to port {server.port} on 127.0.0.1"):
        rpc.Server(port=server.port, port_end=server.port + 1, token=TOKEN)
    r = _run("server", "--help")
    assert "not included" in r.stdout and "[port, port-end)" in r.stdout


def test_a_download_that_cannot_be_renamed_into_place_leaves_no_part_file(tmp_path):
    target = tmp_path / "t.bin"
    with pytest.raises(OSError):
        with client._replacing(str(target)) as f:
            f.write(b"data")
            target.mkdir()  # the target became a folder meanwhile: the rename fails
            (target / "x").write_text("not empty")
    assert [p.name for p in tmp_path.iterdir()] == ["t.bin"]


@pytest.mark.timeout(90)
def test_the_readmes_first_example_stops_when_its_server_cannot_start(tmp_path):
    """The README's shell example, as printed, with its port taken: it waited for ever
    (an outside check); it ends once the server has exited."""
    import pathlib
    import re
    import time

    readme = pathlib.Path(__file__).resolve().parents[1] / "README.md"
    blocks = re.findall(r"```bash\n(.*?)```", readme.read_text(), re.S)
    block = next(b for b in blocks if "until disco-rpc ls" in b)
    script = tmp_path / "example.sh"
    script.write_text(block)
    env = {**os.environ, "PATH": os.path.dirname(PY) + os.pathsep + os.environ["PATH"]}
    with socket.socket() as taken:  # bound, not listening: the server cannot bind, ls is refused
        taken.bind(("127.0.0.1", 9098))
        t0 = time.monotonic()
        r = subprocess.run(
            ["bash", str(script)], capture_output=True, text=True, timeout=60, env=env
        )
    assert time.monotonic() - t0 < 30, r
    assert "cannot bind to port 9098" in r.stderr, r.stderr


@pytest.mark.timeout(90)
def test_mutual_tls_from_the_command_line_serves_beyond_loopback_without_a_token(tls_files, tmp_path):  # fmt: skip
    """TLS stands in for a token beyond loopback only when it requires client certificates;
    the commands had no way to ask for them (a re-check), so a CLI service beyond
    loopback needed DISCO_TOKEN. ``--tls-client-ca`` asks; clients present theirs with
    ``--tls-cert``/``--tls-key``."""
    cert, key = tls_files
    env = {k: v for k, v in os.environ.items() if k not in ("DISCO_TOKEN", "DISCO_TRACKER_TOKEN")}
    tls = ["--tls-cert", cert, "--tls-key", key]
    refused = subprocess.run(
        [PY, "-m", "disco_rpc", "server", "--host", "0.0.0.0", "--port", "10810", *tls],
        capture_output=True, text=True, timeout=30, env=env,
    )  # fmt: skip
    assert refused.returncode == 2 and "--tls-client-ca" in refused.stderr, refused
    server = subprocess.Popen(
        [PY, "-m", "disco_rpc", "server", "--host", "0.0.0.0", "--port", "10810",
         "--port-end", "10840", *tls, "--tls-client-ca", cert, "--work-dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
    )  # fmt: skip
    try:
        line = server.stdout.readline()  # type: ignore[union-attr]
        assert "listening on" in line, (line, server.stderr.read() if server.poll() is not None else "")  # type: ignore[union-attr]  # fmt: skip
        port = line.rsplit(":", 1)[1].strip()
        (tmp_path / "f.txt").write_text("x")
        base = [PY, "-m", "disco_rpc", "ls", "--port", port, "--tls-ca", cert]
        ok = subprocess.run([*base, "--tls-cert", cert, "--tls-key", key], capture_output=True, text=True, timeout=30, env=env)  # fmt: skip
        assert ok.returncode == 0 and "f.txt" in ok.stdout, ok
        no_cert = subprocess.run(base, capture_output=True, text=True, timeout=30, env=env)
        assert no_cert.returncode == 1, no_cert
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(10)
    r = _run("ls", "--tls-key", key)
    assert r.returncode == 2 and "--tls-key needs --tls-cert" in r.stderr


@pytest.mark.timeout(90)
def test_a_cli_server_registers_with_a_tls_tracker(tls_files, tmp_path):
    """``disco-rpc server --tracker`` had no TLS options for its link to the tracker, so
    it could not register with a TLS tracker, and its error suggested ``--tls-ca``, an
    option it lacks (an outside check). ``--tracker-tls-ca`` (and ``-cert``/``-key``)
    give that link TLS; the proxy command has them too, and TLS of its own."""
    import ssl

    cert, key = tls_files
    sctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    sctx.load_cert_chain(cert, key)
    tracker = rpc.Tracker(port=10860, port_end=10880, token=TOKEN, ssl_context=sctx)
    env = {**os.environ, "DISCO_TOKEN": TOKEN}
    server = subprocess.Popen(
        [PY, "-m", "disco_rpc", "server", "--port", "10880", "--port-end", "10900",
         "--key", "tls-board", "--tracker", f"127.0.0.1:{tracker.port}",
         "--tracker-tls-ca", cert, "--work-dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        listed = ""
        while "tls-board" not in listed and time.monotonic() < deadline:
            assert server.poll() is None, server.communicate()
            r = _run("query", "--port", str(tracker.port), "--tls-ca", cert)
            assert r.returncode == 0, r
            listed = r.stdout
            time.sleep(0.2)
        assert "tls-board" in listed, listed
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(10)
        tracker.terminate()
    for args, says in (
        (
            ["server", "--tracker", "127.0.0.1:1", "--tracker-tls-key", key],
            "--tracker-tls-key needs --tracker-tls-cert",
        ),  # fmt: skip
        (
            ["proxy", "--tracker", "127.0.0.1:1", "--tracker-tls-ca", str(tmp_path / "none.pem")],
            "--tracker-tls-ca",
        ),  # fmt: skip
        (
            ["proxy", "--tls-cert", key, "--tls-key", key],
            f"cannot use --tls-cert {key} and --tls-key {key}",
        ),  # fmt: skip
        (["ls", "--tls-ca", key], f"cannot use --tls-ca {key}"),
    ):
        r = _run(*args)
        assert r.returncode == 2 and says in r.stderr, (args, r)


@pytest.mark.timeout(90)
def test_file_commands_through_a_tracker_use_tls_with_the_server_too(tls_files, tmp_path):
    """``ls/upload/download --tracker`` gave ``--tls-*`` to the tracker link alone: the
    session with the server went out in plaintext while the log said TLS, and a TLS
    server could not be reached (an outside check). ``--tls-*`` are the server's, and
    the tracker's too unless ``--tracker-tls-*`` are given."""
    import ssl

    cert, key = tls_files
    sctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    sctx.load_cert_chain(cert, key)
    cctx = ssl.create_default_context(cafile=cert)
    tracker = rpc.Tracker(port=10900, port_end=10920, token=TOKEN, ssl_context=sctx)
    tls_srv = rpc.Server(
        port=10920, port_end=10940, token=TOKEN, key="tls-files", work_dir=str(tmp_path),
        ssl_context=sctx, tracker_addr=tracker.addr, tracker_ssl_context=cctx,
    )  # fmt: skip
    plain_dir = tmp_path / "plain"
    plain_dir.mkdir()
    plain_srv = rpc.Server(
        port=10940, port_end=10960, token=TOKEN, key="plain-files", work_dir=str(plain_dir),
        tracker_addr=tracker.addr, tracker_ssl_context=cctx,
    )  # fmt: skip
    try:
        (tmp_path / "secret.txt").write_text("x")
        (plain_dir / "open.txt").write_text("y")
        where = ("--tracker", f"127.0.0.1:{tracker.port}")
        r = _run("ls", *where, "--key", "tls-files", "--tls-ca", cert, "-v")
        assert r.returncode == 0 and "secret.txt" in r.stdout.split(), r
        r = _run("ls", *where, "--key", "plain-files", "--tracker-tls-ca", cert)
        assert r.returncode == 0 and "open.txt" in r.stdout.split(), r
    finally:
        plain_srv.terminate()
        tls_srv.terminate()
        tracker.terminate()
    for args, says in (
        (
            ["ls", "--tracker-tls-ca", cert],
            "--tracker-tls-ca is for the link to the tracker: add --tracker",
        ),  # fmt: skip
        (
            ["server", "--proxy-tls-ca", cert],
            "--proxy-tls-ca is for the link to the proxy: add --through-proxy",
        ),  # fmt: skip
    ):
        r = _run(*args)
        assert r.returncode == 2 and says in r.stderr, (args, r)


def test_a_tracker_speaking_tvms_protocol_on_loopback_warns_even_with_mutual_tls(tls_files):
    """TVM's peers prove nothing, so a tracker with --tvm-protocol serves any local user
    whatever its TLS; mutual TLS silenced the loopback warning (an outside check)."""
    import ssl
    import warnings

    from disco_core.net import security

    cert, key = tls_files
    mutual = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    mutual.load_cert_chain(cert, key)
    mutual.load_verify_locations(cert)
    mutual.verify_mode = ssl.CERT_REQUIRED
    security._warned_loopback.discard("RPC tracker's TVM protocol")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        rpc.Tracker(port=10960, port_end=10980, ssl_context=mutual, tvm_protocol=True).terminate()
    assert any("TVM protocol" in str(w.message) for w in seen), [str(w.message) for w in seen]
    with pytest.raises(disco.InsecureBindError, match="neither a token nor TLS can guard it"):
        rpc.Tracker(host="0.0.0.0", port=10960, port_end=10980, ssl_context=mutual, tvm_protocol=True)  # fmt: skip
