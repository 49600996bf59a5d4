"""TVM's RPC client surface, as ``tvm.rpc`` documents it (issue 15, items 8, 10, 11, 12).

Parts are ported from TVM's ``tests/python/runtime/test_runtime_rpc.py``
(``test_rpc_file_exchange``, ``test_local_func``, ``test_rpc_echo``,
``test_rpc_array``, ``test_rpc_remote_module``), with ``disco_rpc`` for ``tvm.rpc``.
"""

from __future__ import annotations

import gc
import inspect
import os
import socket
import textwrap
import time

import numpy as np
import pytest

import disco_core as disco
import disco_rpc as rpc
from disco_rpc import handler, minrpc_server
from disco_rpc.client import _SESSIONS
from disco_rpc.server import HANDSHAKE_TIMEOUT, split_load_library

pytestmark = pytest.mark.timeout(60)

_PREPROC_CALLS: list = []


# Registered before any server forks, so every server process knows them.
@disco.register_func("compat.preproc", override=True)
def _preproc(*args):
    _PREPROC_CALLS.append(tuple(type(a).__name__ for a in args))


@disco.register_func("compat.preproc_calls", override=True)
def _preproc_calls():
    return list(_PREPROC_CALLS)


@disco.register_func("compat.addone", override=True)
def _addone(a, b):
    b[:] = a + 1


@disco.register_func("compat.sleep", override=True)
def _sleep(t):
    time.sleep(t)
    return t


@pytest.fixture(scope="module")
def server():
    srv = rpc.Server(port=9600, port_end=9700, key="x1")
    yield srv
    srv.terminate()


@pytest.fixture(params=["local", "server"])
def remote(request, server):
    """TVM's tests run each check on a LocalSession and on a server's session."""
    if request.param == "local":
        s = rpc.LocalSession()
    else:
        s = rpc.connect("127.0.0.1", server.port, key="x1")
    yield s
    s.close()


# --------------------------------------------------------------------------- item 8: files
def test_rpc_file_exchange(remote):
    """TVM's test_rpc_file_exchange / test_local_func: download gives back a bytearray."""
    blob = bytearray(np.random.randint(0, 10, size=(10)))
    remote.upload(blob, "dat.bin")
    rev = remote.download("dat.bin")
    assert type(rev) is bytearray
    assert rev == blob


def test_listdir_is_names_joined_by_comma(remote):
    assert remote.listdir(".") == ""
    remote.upload(b"1", "b.bin")
    remote.upload(b"2", "a.bin")
    remote.upload(b"3", "sub/c.bin")
    # TVM's form: one string, the names joined by ','; split(",") gives them back
    assert remote.listdir(".") == "a.bin,b.bin,sub"
    assert remote.listdir("sub") == "c.bin"
    assert remote.listdir(".").split(",") == remote.listdir_names(".")
    assert remote.listdir_names("sub") == ["c.bin"]


def test_download_to_a_file_returns_the_path(remote, tmp_path):
    remote.upload(b"abc", "x.bin")
    target = str(tmp_path / "x.bin")
    assert remote.download("x.bin", target=target) == target
    assert open(target, "rb").read() == b"abc"


# --------------------------------------------------------------------------- item 10
def test_missing_function_of_a_remote_module_is_attribute_error(remote):
    """TVM's test_rpc_echo: ``remote.system_lib()["notexist"]`` raises AttributeError."""
    with pytest.raises(AttributeError, match="Module has no function 'notexist'"):
        remote.system_lib()["notexist"]
    with pytest.raises(AttributeError, match="Module has no function 'nope'"):
        remote.system_lib().get_function("nope")
    # a module loaded from a file too
    remote.upload(b"def present():\n    return 1\n", "mod.py")
    mod = remote.load_module("mod.py")
    assert mod["present"]() == 1
    with pytest.raises(AttributeError, match="Module has no function 'absent'") as info:
        mod["absent"]
    assert isinstance(info.value, rpc.RPCError)  # still an RPC error, with the remote reason


def test_remote_device_prints_as_tvm(remote):
    """TVM's test_rpc_array: ``str(tensor.device)`` starts with "remote"."""
    idx = remote._tbl_index
    dev = remote.cpu(0)
    assert str(dev) == repr(dev) == f"remote[{idx}]:cpu(0)"
    assert str(remote.cuda(1)) == f"remote[{idx}]:cuda(1)"
    x = rpc.tensor(np.ones((3, 4)), remote.cpu(0))
    assert str(x.device).startswith("remote")
    np.testing.assert_equal(x.numpy(), np.ones((3, 4)))


def test_session_indices_are_per_live_session():
    a, b = rpc.LocalSession(), rpc.LocalSession()
    assert a._tbl_index != b._tbl_index
    freed = b._tbl_index
    b.close()
    assert str(b.cpu(0)) == f"remote[{freed}]:cpu(0)"  # closed, not gone: its index stays
    del b
    gc.collect()
    free = [i for i, ref in enumerate(_SESSIONS.slots) if ref() is None]
    assert freed in free
    c = rpc.LocalSession()  # TVM's table: the lowest free slot
    assert c._tbl_index == min(free)
    a.close()
    c.close()


# --------------------------------------------------------------------------- item 11
TVM_TIME_EVALUATOR_PARAMS = [
    "func_name", "dev", "number", "repeat", "min_repeat_ms", "limit_zero_time_iterations",
    "cooldown_interval_ms", "repeats_to_cooldown", "cache_flush_bytes", "f_preproc",
]  # fmt: skip


def test_time_evaluator_has_tvm_positional_order():
    params = list(inspect.signature(rpc.RemoteModule.time_evaluator).parameters)
    assert params[1 : 1 + len(TVM_TIME_EVALUATOR_PARAMS)] == TVM_TIME_EVALUATOR_PARAMS


def test_time_evaluator_f_preproc_runs_before_each_repeat(remote):
    """TVM's positional order, with ``f_preproc`` called with the same arguments per repeat."""
    _PREPROC_CALLS.clear()
    dev = remote.cpu(0)
    a = rpc.tensor(np.random.uniform(size=102).astype("float32"), dev)
    b = rpc.tensor(np.zeros(102, dtype="float32"), dev)
    lib = remote.system_lib()
    time_f = lib.time_evaluator("compat.addone", dev, 2, 3, 0, 100, 0, 1, 0, "compat.preproc")
    res = time_f(a, b)
    assert len(res.results) == 3 and res.mean > 0
    np.testing.assert_allclose(b.numpy(), a.numpy() + 1)
    calls = remote.get_function("compat.preproc_calls")()
    assert calls == [("ndarray", "ndarray")] * 3


def test_time_evaluator_cache_flush_cpu_preproc(remote):
    """TVM's cache-flushing ``f_preproc`` exists on the server, under TVM's name."""
    dev = remote.cpu(0)
    a = rpc.tensor(np.ones(1000, "float32"), dev)
    b = rpc.empty((1000,), "float32", dev)
    lib = remote.system_lib()
    for name in ("cache_flush_cpu_non_first_arg", "cache_flush_cpu_preproc"):
        remote.get_function(name)  # reachable as a global function
        res = lib.time_evaluator("compat.addone", dev, number=1, repeat=2, f_preproc=name)(a, b)
        assert len(res.results) == 2
    np.testing.assert_array_equal(b.numpy(), np.full(1000, 2, "float32"))


def test_cache_flush_evicts_through_a_buffer_larger_than_the_caches(monkeypatch):
    monkeypatch.setattr(handler, "_EVICT", [])
    handler.cache_flush_cpu_non_first_arg(np.zeros(4), 3)  # no array after the first
    assert handler._EVICT == []
    handler.cache_flush_cpu_non_first_arg(np.zeros(4), np.zeros(4))
    assert handler._EVICT[0].nbytes == 2 * handler._llc_bytes() > 0


def test_time_evaluator_cache_flush_bytes(monkeypatch):
    """``cache_flush_bytes`` copies a buffer of that size before each timed run."""
    flushes = []
    real = handler._CacheFlush

    class Counting(real):
        def __init__(self, nbytes, device):
            super().__init__(nbytes, device)
            flushes.append(self.a.nbytes)

        def __call__(self):
            super().__call__()
            flushes.append("flush")

    monkeypatch.setattr(handler, "_CacheFlush", Counting)
    with rpc.LocalSession() as s:
        dev = s.cpu(0)
        a, b = rpc.tensor(np.ones(8), dev), rpc.empty((8,), "float64", dev)
        ev = s.system_lib().time_evaluator("compat.addone", dev, number=1, repeat=3, cache_flush_bytes=1 << 16)  # fmt: skip
        assert len(ev(a, b).results) == 3
    assert flushes == [1 << 16, "flush", "flush", "flush"]


def test_time_evaluator_refuses_bad_arguments_at_the_call_site(remote):
    lib = remote.system_lib()
    dev = remote.cpu(0)
    with pytest.raises(rpc.RPCError, match="'no.such.preproc' is not registered"):
        lib.time_evaluator("compat.addone", dev, f_preproc="no.such.preproc")
    with pytest.raises(ValueError, match="cache_flush_bytes must be >= 0"):
        lib.time_evaluator("compat.addone", dev, cache_flush_bytes=-1)
    with pytest.raises(TypeError, match="cache_flush_bytes must be an int"):
        lib.time_evaluator("compat.addone", dev, cache_flush_bytes="1")
    with pytest.raises(TypeError, match="f_preproc must be the name"):
        lib.time_evaluator("compat.addone", dev, f_preproc=print)


def test_minimal_server_time_evaluator_takes_the_new_arguments(monkeypatch):
    """The stdlib-only server's evaluator accepts ``cache_flush_bytes`` and ``f_preproc`` too."""
    _PREPROC_CALLS.clear()
    disco.register_func("compat.plain", lambda x: x + 1, override=True)
    sess = minrpc_server.Session(None)
    try:
        res = sess.time_eval(None, "compat.plain", None, 2, 3, 0, 100, 0, 1, None, (5,), 4096, "compat.preproc")  # fmt: skip
        assert len(res) == 3
        assert _PREPROC_CALLS == [("int",)] * 3
    finally:
        sess.close()
    # TVM's flushing preproc is known there without disco-rpc's handler (no arrays: a no-op)
    assert set(minrpc_server.CACHE_FLUSH_NAMES) == set(handler.CACHE_FLUSH_NAMES)
    monkeypatch.setattr(disco, "get_global_func", lambda name, allow_missing=False: None)
    for name in handler.CACHE_FLUSH_NAMES:
        assert minrpc_server._lookup(name)(1, 2) is None
    with pytest.raises(KeyError, match="'compat.plain' is not registered"):
        minrpc_server._lookup("compat.plain")


# --------------------------------------------------------------------------- item 12
def test_server_timeout_is_a_socket_timeout_not_a_session_limit():
    """TVM's ``Server(timeout=...)`` times the socket's operations; sessions may last longer."""
    srv = rpc.Server(port=9600, port_end=9700, timeout=0.5)
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as raw:
            t0 = time.monotonic()
            assert raw.recv(1) == b""  # a client that sends no handshake is let go ...
            assert time.monotonic() - t0 < min(3.0, HANDSHAKE_TIMEOUT)  # ... after `timeout`
        with rpc.connect("127.0.0.1", srv.port) as s:
            assert s.info["server_timeout"] == 0  # no limit on sessions
            assert s.get_function("compat.sleep")(1.0) == 1.0  # twice `timeout`
    finally:
        srv.terminate()


def test_server_timeout_and_session_timeout_are_checked():
    with pytest.raises(ValueError, match="timeout must be > 0"):
        rpc.Server(port=9600, port_end=9700, timeout=-1)
    with pytest.raises(TypeError, match="session_timeout must be a number"):
        rpc.Server(port=9600, port_end=9700, session_timeout="long")


def test_load_library_accepts_tvm_separator(tmp_path, monkeypatch):
    for name in ("liba", "libb", "libc"):
        (tmp_path / f"{name}.py").write_text(
            textwrap.dedent(
                f"""
                import disco_core
                disco_core.register_func("compat.{name}", lambda: "{name}", override=True)
                """
            )
        )
    monkeypatch.chdir(tmp_path)  # relative paths are taken from the current folder, as TVM's
    srv = rpc.Server(port=9600, port_end=9700, load_library="liba.py:libb.py,libc.py")
    try:
        with rpc.connect("127.0.0.1", srv.port) as s:
            assert [s.get_function(f"compat.{n}")() for n in ("liba", "libb", "libc")] == ["liba", "libb", "libc"]  # fmt: skip
    finally:
        srv.terminate()


def test_split_load_library(tmp_path):
    assert split_load_library(None) == [] and split_load_library("") == []
    assert split_load_library("a.so:b.py") == ["a.so", "b.py"]  # TVM 0.27
    assert split_load_library("a.so,b.py") == ["a.so", "b.py"]  # this project's earlier form
    assert split_load_library(["x:y.so"]) == ["x:y.so"]  # a list is taken as is
    odd = tmp_path / "odd:name,1.so"
    odd.write_bytes(b"")
    assert split_load_library(str(odd)) == [str(odd)]  # an existing file is never split
    assert split_load_library(os.fspath(odd) + ":b.so") == [str(tmp_path / "odd"), "name", "1.so", "b.so"]  # fmt: skip


def test_tracker_and_proxy_take_tvms_arguments():
    """TVM: ``Tracker(host, port=9190, port_end=9199, silent=False, reuse_addr=True,
    timeout=None)`` and ``Proxy(host, port=9091, ...)`` (the porter's findings 4 and 5)."""
    import inspect

    params = list(inspect.signature(rpc.Tracker).parameters.values())
    assert [p.name for p in params[:6]] == ["host", "port", "port_end", "silent", "reuse_addr", "timeout"]  # fmt: skip
    assert all(p.kind is p.POSITIONAL_OR_KEYWORD for p in params[:6])
    assert inspect.signature(rpc.Proxy).parameters["port"].default == 9091
    tr = rpc.Tracker("127.0.0.1", 9190, 9300, False, True, 0.5)
    try:
        t0 = time.monotonic()  # a peer that says nothing is dropped after `timeout`
        s = socket.create_connection(("127.0.0.1", tr.port), timeout=5)
        assert s.recv(1) == b""
        assert time.monotonic() - t0 < 3
        s.close()
    finally:
        tr.terminate()
    with pytest.raises(ValueError, match="timeout"):
        rpc.Tracker(port=9190, port_end=9300, timeout=-1)


def test_tracker_summary_keeps_a_key_whose_servers_left():
    """TVM's test_rpc_tracker_register: after the server stops, ``queue_info[key]`` is still
    there, with nothing free."""
    tr = rpc.Tracker(port=9190, port_end=9300)
    srv = rpc.Server(port=9400, port_end=9500, tracker_addr=tr.addr, key="gone")
    ts = rpc.connect_tracker("127.0.0.1", tr.port)
    try:
        deadline = time.monotonic() + 10
        while ts.summary()["queue_info"].get("gone", {}).get("free") != 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        srv.terminate()
        while ts.summary()["queue_info"]["gone"]["free"] != 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert ts.summary()["queue_info"]["gone"] == {"free": 0, "pending": 0, "total": 0}
        assert "no server registered" in ts.pool_text("gone")
    finally:
        ts.close()
        srv.terminate()
        tr.terminate()


def test_a_remote_tensor_keeps_the_cpu_number_it_was_made_on():
    """``rpc.tensor(x, remote.cpu(3)).device`` said ``cpu(0)``; TVM's keeps ``cpu(3)``."""
    sess = rpc.LocalSession()
    try:
        dev = sess.cpu(3)
        for made in (rpc.tensor(np.ones(3), dev), rpc.empty((3,), "float32", dev)):
            assert (made.device.device_type, made.device.device_id) == ("cpu", 3)
            assert str(made.device).endswith("cpu(3)")
    finally:
        sess.close()
