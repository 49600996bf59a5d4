"""Wrong arguments at disco_rpc's public call sites: a Disco error at the call, naming
what was wrong (an outside check found built-in errors, a server that reported success
and then died, and limits that made every later call fail on the server)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import disco_core as disco
import disco_rpc as rpc

pytestmark = pytest.mark.filterwarnings("ignore:the RPC server listens")


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"port": "x"}, disco.DiscoTypeError, "port must be an int"),
        ({"port": -1}, disco.DiscoValueError, "port must be an int 0-65535"),
        ({"connect_timeout": -1}, disco.DiscoValueError, "connect_timeout"),
        ({"connect_timeout": "soon"}, disco.DiscoTypeError, "connect_timeout"),
        ({"session_timeout": -1}, disco.DiscoValueError, "session_timeout"),
        ({"ssl_context": "x"}, disco.DiscoTypeError, "ssl_context must be an ssl.SSLContext"),
        ({"token": 123}, disco.DiscoTypeError, "token must be str or bytes"),
        ({"max_message_bytes": -1}, disco.DiscoValueError, "max_message_bytes must be at least"),
        ({"key": 5}, disco.DiscoTypeError, "connect: key must be a str, got int 5"),
    ],
)
def test_connect_refuses_bad_arguments_before_it_connects(kwargs, error, words):
    args = {"port": 9}  # nothing listens there: a bad argument is named first
    args.update(kwargs)
    port = args.pop("port")
    with pytest.raises(error, match=words):
        rpc.connect("127.0.0.1", port, **args)


@pytest.mark.timeout(60)
def test_a_server_refuses_a_work_dir_or_limit_it_cannot_use(tmp_path):
    """A file as work_dir was accepted, and the server process died with a raw
    traceback after the constructor returned; a limit of -1 failed every call."""
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    with pytest.raises(disco.DiscoValueError, match="work_dir .*a-file.* cannot be made"):
        rpc.Server(port=9700, port_end=9800, work_dir=str(a_file))
    with pytest.raises(disco.DiscoValueError, match="max_message_bytes must be at least"):
        rpc.Server(port=9700, port_end=9800, max_message_bytes=-1)
    # the command line says so before it listens, and leaves no scratch folder
    r = subprocess.run(
        [sys.executable, "-m", "disco_rpc", "server", "--port", "9700", "--work-dir", str(a_file)],
        capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL,
        env={**os.environ, "DISCO_TOKEN": "t"},
    )  # fmt: skip
    assert r.returncode == 1 and "--work-dir" in r.stderr and "listening" not in r.stdout, r


@pytest.mark.timeout(60)
def test_upload_and_get_function_name_what_was_wrong(tmp_path):
    srv = rpc.Server(port=9700, port_end=9800)
    try:
        s = rpc.connect("127.0.0.1", srv.port)
        with pytest.raises(disco.DiscoFileNotFoundError, match="no local file"):
            s.upload(str(tmp_path / "missing.txt"))
        with pytest.raises(disco.DiscoValueError, match="is a folder"):
            s.upload(str(tmp_path))
        with pytest.raises(disco.DiscoTypeError, match="a local file's path or bytes"):
            s.upload(123, "x")
        with pytest.raises(disco.DiscoTypeError, match="name must be a str"):
            s.get_function(123)
        t = rpc.empty((4,), "float32", device=s.cpu())
        with pytest.raises(disco.DiscoTypeError, match="copyfrom: cannot convert a object array"):
            t.copyfrom(np.array([object()] * 4))
        t.copyfrom(np.arange(4))  # a number array is converted, as TVM's copyfrom does
        assert t.numpy().tolist() == [0.0, 1.0, 2.0, 3.0]
        assert s.cpu().exist  # the session goes on
        other = rpc.connect("127.0.0.1", srv.port)  # the same server: one label for both
        with pytest.raises(disco.DiscoValueError, match=r"belongs to the RPC session 127\.0\.0\.1:\d+ \(another session of that server\), not to this one"):  # fmt: skip
            other._export(t)
        other.close()
        s.close()
    finally:
        srv.terminate()


@pytest.mark.timeout(60)
def test_a_tracker_request_refused_for_its_options_holds_no_server():
    """Its options were checked only after the tracker had handed it a server, whose
    ticket was never given back: the next request waited ~10 s (re-check 55)."""
    import time

    tr = rpc.Tracker(port=9190, port_end=9299, token="t")
    srv = rpc.Server(port=9700, port_end=9800, tracker_addr=("127.0.0.1", tr.port), key="k", token="t")  # fmt: skip
    try:
        tc = rpc.connect_tracker("127.0.0.1", tr.port, token="t")
        deadline = time.monotonic() + 10
        while not tc.summary()["queue_info"].get("k", {}).get("free"):
            assert time.monotonic() < deadline, "the server never registered"
            time.sleep(0.05)
        with pytest.raises(disco.DiscoValueError, match="session_timeout"):
            tc.request("k", session_timeout=-1, wait_timeout=3)
        t0 = time.monotonic()
        s = tc.request("k", wait_timeout=3)
        assert time.monotonic() - t0 < 1.0
        s.close()
    finally:
        srv.terminate()
        tr.terminate()


@pytest.mark.timeout(60)
def test_connect_still_takes_what_it_took_before():
    """None for session_timeout (no limit, as TVM's) and connect_timeout, a port as digits."""
    srv = rpc.Server(port=9700, port_end=9800)
    try:
        s = rpc.connect("127.0.0.1", str(srv.port), session_timeout=None, connect_timeout=None)
        assert s.cpu().exist
        s.close()
    finally:
        srv.terminate()


def test_a_listen_address_that_is_not_usable_is_named():
    """Raw OSError / gaierror / UnicodeError before (outside check 58)."""
    with pytest.raises(rpc.RPCError, match=r"cannot listen on 10\.255\.255\.1:9100: Cannot assign"):
        rpc.Server(host="10.255.255.1", port=9100, token="t")  # not this machine's
    with pytest.raises(disco.DiscoValueError, match="without brackets"):
        rpc.Server(host="[::1]", port=9100, token="t")
    with pytest.raises(disco.DiscoValueError, match="does not resolve"):
        rpc.Server(host="a" * 64 + ".com", port=9100, token="t")


def test_the_rpc_channel_says_when_both_servers_and_tracker_are_given():
    """Both were refused with the message for neither ("needs servers=... or
    tracker=...": outside check)."""
    with pytest.raises(disco.DiscoError, match="not both"):
        disco.Session.create("rpc", num_workers=1, servers=[("127.0.0.1", 9)], tracker=("127.0.0.1", 9))  # fmt: skip
    with pytest.raises(disco.DiscoError, match="needs servers="):
        disco.Session.create("rpc", num_workers=1)
