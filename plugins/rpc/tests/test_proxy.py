"""The proxy (issue 8): servers behind it, clients through it, a tracker through it."""

from __future__ import annotations

import os
import signal
import time

import pytest

import disco_core as disco
import disco_rpc as rpc
from disco_rpc.proxy import Proxy

pytestmark = pytest.mark.timeout(60)


@disco.register_func("pxy.pid", override=True)
def _pid():
    return os.getpid()


@disco.register_func("pxy.add", override=True)
def _add(a, b):
    return a + b


def _wait(pred, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False


def test_server_behind_proxy():
    assert rpc.Proxy is Proxy
    px = rpc.Proxy(port=9800, port_end=9900, wait=3.0)
    srv = rpc.Server(host="127.0.0.1", port=px.port, is_proxy=True, key="nat", token="end2end")
    try:
        for _ in range(3):  # one session after another
            with rpc.connect("127.0.0.1", px.port, key="nat", token="end2end") as s:
                assert s.get_function("pxy.add")(2, 3) == 5
                x = rpc.tensor(__import__("numpy").arange(1000.0), device=s.cpu(0))
                assert x.numpy().sum() == 499500.0
        # the server's token is checked end to end, through the proxy
        with pytest.raises(rpc.RPCAuthError):
            rpc.connect("127.0.0.1", px.port, key="nat", token="wrong")
        # an unknown key waits, then the proxy gives up
        with pytest.raises(rpc.RPCError):
            rpc.connect("127.0.0.1", px.port, key="nobody", connect_timeout=10)
    finally:
        srv.terminate()
        px.terminate()


def test_proxy_token_guards_registration():
    px = rpc.Proxy(port=9800, port_end=9900, token="proxy-secret", wait=1.0)
    bad = rpc.Server(host="127.0.0.1", port=px.port, is_proxy=True, key="k", proxy_token="nope")
    good = rpc.Server(host="127.0.0.1", port=px.port, is_proxy=True, key="k2", proxy_token="proxy-secret", token="")  # fmt: skip
    try:
        with pytest.raises(rpc.RPCError):
            rpc.connect("127.0.0.1", px.port, key="k", token="")
        with rpc.connect("127.0.0.1", px.port, key="k2", token="") as s:
            assert s.get_function("pxy.add")(1, 1) == 2
    finally:
        bad.terminate()
        good.terminate()
        px.terminate()


def test_tracker_through_proxy():
    tr = rpc.Tracker(port=9600, port_end=9700)
    px = rpc.Proxy(port=9800, port_end=9900, tracker_addr=tr.addr, wait=2.0)
    servers = [rpc.Server(host="127.0.0.1", port=px.port, is_proxy=True, key="nat") for _ in range(2)]  # fmt: skip
    ts = rpc.connect_tracker(*tr.addr)
    try:
        assert _wait(lambda: ts.summary()["queue_info"].get("nat", {}).get("free") == 2)
        addrs = {tuple(s["addr"]) for s in ts.summary()["server_info"]}
        assert addrs == {("127.0.0.1", px.port)}  # registered under the proxy's address
        a, b = ts.request("nat"), ts.request("nat")
        assert a.get_function("pxy.pid")() != b.get_function("pxy.pid")()
        assert ts.summary()["queue_info"]["nat"]["free"] == 0
        a.close()
        assert _wait(lambda: ts.summary()["queue_info"]["nat"]["free"] == 1)
        c = ts.request("nat")
        assert c.get_function("pxy.add")(1, 2) == 3
        c.close()
        b.close()
        assert _wait(lambda: ts.summary()["queue_info"]["nat"]["free"] == 2)
        # a forged ticket does not get through the proxy
        with pytest.raises(rpc.RPCError):
            rpc.connect("127.0.0.1", px.port, key="nat@forged", connect_timeout=15)
        # a server behind the proxy dies: the tracker forgets it
        os.kill(servers[0].pid, signal.SIGKILL)
        assert _wait(lambda: ts.summary()["queue_info"]["nat"]["total"] == 1, timeout=15)
        s = ts.request("nat")
        assert s.get_function("pxy.add")(2, 2) == 4
        s.close()
    finally:
        ts.close()
        for s in servers:
            s.terminate()
        px.terminate()
        tr.terminate()
