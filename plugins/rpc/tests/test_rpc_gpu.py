"""disco-rpc with a real GPU on the server. Skipped (with the reason) without CuPy or a GPU.

The server runs in a process of its own that has not touched CUDA, as
``disco-rpc server`` does: each session is a process forked from it, and CUDA
cannot be used in a child forked after its parent initialised it. This module
therefore counts the GPUs with ``nvidia-smi`` (or a child Python), so that the
test process forks its own servers with CUDA still uninitialised too.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import disco_rpc as rpc


def _gpu_count() -> int:
    """GPUs seen by CuPy, asked in a child process (this one must not initialise CUDA)."""
    if importlib.util.find_spec("cupy") is None:
        return 0
    code = "import cupy; print(cupy.cuda.runtime.getDeviceCount())"
    try:
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
        )
        return int(out.stdout.strip() or 0)
    except (subprocess.SubprocessError, ValueError):
        return 0


NUM_GPUS = _gpu_count()
pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("cupy") is None,
        reason="CuPy is not installed (pip install cupy-cuda12x)",
    ),
    pytest.mark.skipif(NUM_GPUS < 1, reason="no GPU on this machine"),
    pytest.mark.timeout(120),
]

PY_MODULE = textwrap.dedent(
    """
    def scale(x, k):
        x *= k            # runs on the array's own device: a CuPy kernel for cuda
        return float(x.sum())

    def kind(x):
        return type(x).__module__.split(".")[0]
    """
)

SERVE = textwrap.dedent(
    """
    import sys
    import disco_rpc as rpc

    srv = rpc.Server(port=9700, port_end=9800)
    print(srv.port, flush=True)
    sys.stdin.read()  # until the test closes our stdin
    srv.terminate()
    """
)


@pytest.fixture(scope="module")
def server_port():
    """A ``disco_rpc.Server`` in a fresh process (no CUDA in it), as users start one."""
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        port = int(proc.stdout.readline())
        yield port
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(params=["server", "local"])
def sess(request, server_port):
    s = rpc.connect("127.0.0.1", server_port) if request.param == "server" else rpc.LocalSession()
    yield s
    s.close()


def test_the_server_has_its_gpus_and_no_more(sess):
    assert sess.cuda(0).exist
    assert not sess.cuda(NUM_GPUS).exist
    sess.cuda(0).sync()


@pytest.mark.parametrize("nbytes", [16, 64 << 20])
def test_arrays_on_the_gpu_round_trip(sess, nbytes):
    host = np.random.default_rng(0).standard_normal(nbytes // 4).astype(np.float32)
    x = rpc.tensor(host, sess.cuda(0))
    assert x.device.device_type == "cuda" and x.shape == host.shape
    np.testing.assert_array_equal(x.numpy(), host)
    x.copyfrom(host[::-1].copy())
    np.testing.assert_array_equal(x.numpy(), host[::-1])
    y = rpc.empty(host.shape, "float32", sess.cuda(0))
    y.copyfrom(host)
    np.testing.assert_array_equal(np.asarray(y), host)


def test_a_remote_python_function_runs_on_the_gpu_array(sess):
    sess.upload(PY_MODULE.encode(), "gpumod.py")
    mod = sess.load_module("gpumod.py")
    x = rpc.tensor(np.ones(1000, np.float32), sess.cuda(0))
    assert mod["kind"](x) == "cupy"
    assert mod["scale"](x, 3.0) == 3000.0
    np.testing.assert_array_equal(x.numpy(), np.full(1000, 3.0, np.float32))


def test_a_gpu_the_server_lacks_is_a_clear_error(sess):
    with pytest.raises(rpc.RPCError):
        rpc.empty((4,), "float32", sess.cuda(NUM_GPUS + 7))
    np.testing.assert_array_equal(rpc.tensor(np.ones(2), sess.cuda(0)).numpy(), np.ones(2))


AFTER_CUDA = textwrap.dedent(
    """
    import numpy as np, cupy, disco_rpc as rpc
    cupy.zeros(1)  # CUDA initialised here, before the server forks its sessions
    srv = rpc.Server(port=9800, port_end=9900)
    s = rpc.connect("127.0.0.1", srv.port)
    for what, call in (("exist", lambda: s.cuda(0).exist),
                       ("tensor", lambda: rpc.tensor(np.ones(2, np.float32), s.cuda(0)))):
        try:
            print(what, "returned", call())
        except rpc.RPCError as exc:
            print(what, "raised", str(exc).splitlines()[0])
    s.close()
    srv.terminate()
    """
)


def test_a_server_made_after_a_cuda_call_says_why_its_sessions_cannot_use_the_gpu():
    out = subprocess.run(
        [sys.executable, "-c", AFTER_CUDA], capture_output=True, text=True, timeout=100
    )
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert set(lines) == {"exist", "tensor"}, out.stdout + out.stderr
    # Counting the GPUs works in such a process (seen on an H200): the GPU exists.
    # Using it fails, and the reply says why rather than a bare "initialization error".
    assert lines["exist"] in ("returned True",) or "forked after" in lines["exist"], lines
    tensor = lines["tensor"]
    assert tensor.startswith("raised ") and "forked after its parent initialised CUDA" in tensor
    assert "disco-rpc server" in tensor, tensor
