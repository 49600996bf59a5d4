"""rpc.with_minrpc (issue 8): a build plus a stdlib-only server in one zipapp, via PopenSession."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import disco_rpc as rpc

pytestmark = pytest.mark.timeout(60)

KERNELS = textwrap.dedent(
    """
    import disco_core

    @disco_core.register_func("mini.add")
    def add(a, b):
        return a + b

    @disco_core.register_func("mini.echo")
    def echo(*args):
        return args

    def greet(name):
        print("printing goes to stderr")
        return "hi " + name

    def fail():
        raise KeyError("nope")
    """
)


def _bare_python():
    """A Python without NumPy when there is one (a device with only the stdlib)."""
    for cand in ("/usr/bin/python3", shutil.which("python3")):
        if cand and os.path.exists(cand):
            r = subprocess.run([cand, "-c", "import numpy"], capture_output=True)
            if r.returncode != 0:
                return cand
    return sys.executable


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    d = tmp_path_factory.mktemp("build")
    (d / "kernels.py").write_text(KERNELS)
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc:
        (d / "c.c").write_text(
            "#include <stdint.h>\nint64_t twice(int64_t x) { return 2 * x; }\n"
            "double half(double x) { return x / 2; }\n"
        )
        subprocess.run([cc, "-shared", "-fPIC", "-o", str(d / "libk.so"), str(d / "c.c")], check=True)  # fmt: skip
        (d / "c.c").unlink()
    out = tmp_path_factory.mktemp("out") / "server.pyz"
    path = rpc.with_minrpc(d, out, interpreter=_bare_python())
    return path, bool(cc)


def test_minrpc_package(package):
    path, have_cc = package
    assert os.access(path, os.X_OK)
    with open(path, "rb") as f:
        assert f.read(2) == b"#!"
    sess = rpc.PopenSession(path)
    try:
        assert sess.info.get("minrpc") is True
        assert sess.get_function("mini.add")(2, 3) == 5
        assert sess.get_function("mini.echo")(None, True, 1.5, "s", b"b", [1, (2,)], {"k": 1j}, 1 << 70) == (None, True, 1.5, "s", b"b", [1, (2,)], {"k": 1j}, 1 << 70)  # fmt: skip
        mod = sess.load_module("kernels.py")
        assert mod["greet"]("you") == "hi you"
        with pytest.raises(rpc.RPCError, match="KeyError"):
            mod["fail"]()
        res = mod.time_evaluator("greet", sess.cpu(0), number=5, repeat=3)("t")
        assert len(res.results) == 3 and res.mean > 0
        data = os.urandom(100_000)
        sess.upload(data, "blob.bin")
        assert bytes(sess.download("blob.bin")) == data
        assert sess.listdir(".") == "blob.bin"
        with pytest.raises(rpc.RPCError, match="PermissionError"):
            sess.download("../etc/passwd")
        sess.remove("blob.bin")
        with pytest.raises(rpc.RPCError, match="not supported"):
            rpc.tensor(np.zeros(3), device=sess.cpu(0))
        if have_cc:
            assert sess.system_lib()["twice"](21) == 42
            lib = sess.load_module("libk.so")
            assert lib.get_function("half", restype="double")(3.0) == 1.5
            # system_lib has get_function(name, restype) too (issue 7, 3)
            syslib = sess.system_lib()
            assert syslib.get_function("half", restype="double")(5.0) == 2.5
            assert syslib.get_function("mini.add")(1, 2) == 3
    finally:
        sess.close()


def test_minrpc_streams_and_bytes(package):
    """Files stream in chunks the client's limit allows; byte strings are bytes (issue 7, 6/11/13)."""
    path, _have_cc = package
    sess = rpc.PopenSession(path, max_message_bytes=1 << 16)
    try:
        data = os.urandom(300_000)
        seen: list = []
        sess.upload(data, "big.bin", progress=lambda d, t: seen.append(d))
        assert seen[-1] == len(data)
        seen.clear()
        assert bytes(sess.download("big.bin", progress=lambda d, t: seen.append(d))) == data
        assert len(seen) >= 4  # several chunks: each fits 64 KiB
        echo = sess.get_function("mini.echo")
        for n in (10, 1 << 15):
            (back,) = echo(os.urandom(n))
            assert type(back) is bytes and len(back) == n
        sess.upload(b"mine", "notes.part")
        assert sess.listdir_names(".") == ["big.bin", "notes.part"]
        with pytest.raises(rpc.RPCError, match="FileNotFoundError"):
            sess.download("nope")
        assert sess.get_function("mini.add")(1, 1) == 2
    finally:
        sess.close()


def _imports(path):
    """Every module ``path`` imports: ``(name, level)`` (level > 0: a relative import)."""
    import ast

    out = []
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            out += [(a.name, 0) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.module is None:  # from . import protocol
                out += [(a.name, node.level) for a in node.names]
            else:
                out.append((node.module, node.level))
    return out


def test_minrpc_server_is_stdlib_only():
    """The minimal server and the protocol file it imports need the standard library only."""
    from disco_rpc.minrpc import MINRPC_SERVER, PROTOCOL, PROTOCOL_NAME

    src = open(MINRPC_SERVER).read()
    for banned in ("import numpy", "from disco_rpc ", "from disco_rpc.", "import disco_rpc\n"):
        assert banned not in src
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    for name, level in _imports(PROTOCOL):
        assert level == 0 and name.split(".")[0] in stdlib, f"protocol.py imports {name}"
    for name, level in _imports(MINRPC_SERVER):
        if level:  # inside the package: the protocol, nothing else
            assert (name, level) == ("protocol", 1), f"minrpc_server.py imports .{name}"
        elif name == "disco_core":  # optional: the real registry when installed, else a stand-in
            continue
        else:
            assert name.split(".")[0] in stdlib | {PROTOCOL_NAME}, f"minrpc_server imports {name}"


def test_minrpc_zipapp_ships_the_protocol(tmp_path):
    """The zipapp holds protocol.py beside its __main__ and runs without disco_rpc on the path."""
    import zipfile

    from disco_rpc.minrpc import PROTOCOL_NAME

    # -SI: no site-packages, no PYTHONPATH: only the standard library and the zip itself
    out = rpc.with_minrpc(None, tmp_path / "bare.pyz", interpreter=f"{sys.executable} -SI")
    with zipfile.ZipFile(out) as z:
        assert {"__main__.py", PROTOCOL_NAME + ".py"} <= set(z.namelist())
    sess = rpc.PopenSession(out)
    try:
        assert sess.info.get("minrpc") is True
        sess.upload(b"x", "f.bin")
        assert sess.listdir(".") == "f.bin"
    finally:
        sess.close()


def test_minrpc_server_speaks_this_version_without_crypto():
    """The minimal server's handshake version is the full server's; it never needs cryptography."""
    from disco_rpc import auth, minrpc_server
    from disco_rpc.minrpc import MINRPC_SERVER

    assert minrpc_server.proto.VERSION == auth.VERSION
    src = open(MINRPC_SERVER).read()
    assert "cryptography" not in src and "disco_core" not in src.split('"""', 2)[2].split("def ")[0]
