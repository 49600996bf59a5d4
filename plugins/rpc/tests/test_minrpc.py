"""rpc.with_minrpc: TVM's compile-function decorator writing a stdlib-only server (issues 8, 15)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import textwrap
import threading
import time

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
    path = str(tmp_path_factory.mktemp("out") / "server.pyz")
    assert rpc.with_minrpc(None, interpreter=_bare_python())(path, [d]) is None  # TVM's: None
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
        # a missing function is an AttributeError, as on the full server and in TVM's
        # test_rpc_echo (it was a plain RPCError: an outside check)
        with pytest.raises(AttributeError, match="Module has no function 'notexist'"):
            sess.system_lib()["notexist"]
        with pytest.raises(AttributeError):
            mod["notexist"]
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
    out = str(tmp_path / "bare.pyz")
    rpc.with_minrpc(interpreter=f"{sys.executable} -SI")(out, [])
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


# --------------------------------------------------------------------------- TVM's with_minrpc (issue 15, 9)
MYADD_C = "#include <stdint.h>\nint64_t myadd(int64_t a, int64_t b) { return a + b; }\n"


def _cc():
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def create_executable(output, objects, options=None, cc=None):
    """TVM's ``tvm.support.cc.create_executable`` on Linux: the same arguments and command."""
    cmd = [cc or _cc()]
    if output.endswith((".so", ".dylib")):
        cmd += ["-shared", "-fPIC"]
    cmd += ["-o", output, *(options or []), *objects]
    subprocess.run(cmd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def myadd_obj(tmp_path_factory):
    """An object file with ``int64_t myadd(int64_t, int64_t)``, as TVM's test builds one."""
    cc = _cc()
    if cc is None:
        pytest.skip("no C compiler (cc or gcc) to build the native object")
    d = tmp_path_factory.mktemp("obj")
    (d / "myadd.c").write_text(MYADD_C)
    subprocess.run([cc, "-c", "-fPIC", "-o", str(d / "myadd.o"), str(d / "myadd.c")], check=True)
    return str(d / "myadd.o")


def _children():
    """The pids of this process's live (or unreaped) children."""
    out = set()
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as f:
            out |= {int(p) for p in f.read().split()}
    return out


def test_with_minrpc_has_tvms_signature():
    import inspect

    params = inspect.signature(rpc.with_minrpc).parameters
    assert list(params)[:3] == ["compile_func", "server", "runtime"]
    assert params["server"].default == "posix_popen_server" and params["runtime"].default == "libtvm"  # fmt: skip
    fcompile = rpc.with_minrpc(create_executable)
    assert list(inspect.signature(fcompile).parameters) == ["output", "objects", "options"]
    assert fcompile.need_system_lib is True and fcompile.__name__ == "with_minrpc"


def test_rpc_remote_module_minrpc(myadd_obj, tmp_path):
    """TVM's ``test_rpc_remote_module``, its minrpc part (``check_minrpc``), ported."""
    calls = []

    def compile_func(output, objects, options=None):
        calls.append((output, list(objects), list(options or [])))
        create_executable(output, objects, options)

    path_minrpc = str(tmp_path / "dev_lib.minrpc")
    rpc.with_minrpc(compile_func)(path_minrpc, [myadd_obj], options=["-O2"])
    # compile_func links the objects into the shared library the server loads
    (lib, objs, opts), = calls  # fmt: skip
    assert lib.endswith(".so") and objs == [myadd_obj] and opts == ["-shared", "-fPIC", "-O2"]

    with pytest.raises(RuntimeError):
        rpc.PopenSession("filenotexist")

    # start the minrpc session
    remote = rpc.PopenSession(path_minrpc)
    try:
        f1 = remote.system_lib()
        time_f = f1.time_evaluator("myadd", remote.cpu(0), number=1)
        cost = time_f(20, 22).mean
        assert cost > 0
        assert f1["myadd"](20, 22) == 42
        assert f1.get_function("myadd", restype="int64")(1 << 40, 1) == (1 << 40) + 1
    finally:
        remote.close()

    # through a server: the binary's bytes as the session constructor's argument
    server = rpc.Server(key="x0")
    try:
        with open(path_minrpc, "rb") as f:
            binary = f.read()
        client = rpc.connect(
            "127.0.0.1", server.port, key="x0",
            session_constructor_args=["rpc.PopenSession", binary],
        )  # fmt: skip
        try:
            assert client.info["minrpc"] is True and client.info["via"] == "popen"
            assert client.info["pid"] != os.getpid()
            assert client.system_lib()["myadd"](2, 3) == 5
            client.upload(b"abc", "f.bin")
            assert bytes(client.download("f.bin")) == b"abc"
        finally:
            client.close()
        with pytest.raises(rpc.RPCError, match="takes the bytes of the server binary"):
            rpc.connect("127.0.0.1", server.port, key="x0", session_constructor_args=["rpc.PopenSession", path_minrpc])  # fmt: skip
        with pytest.raises(rpc.RPCError, match="exited with code 3"):
            rpc.connect("127.0.0.1", server.port, key="x0", session_constructor_args=["rpc.PopenSession", b"#!/bin/sh\nexit 3\n"])  # fmt: skip
        with rpc.connect("127.0.0.1", server.port, key="x0") as plain:  # the server still serves
            assert plain.listdir(".") is not None
    finally:
        server.terminate()

    # change to not executable
    os.chmod(path_minrpc, stat.S_IRUSR)
    with pytest.raises(RuntimeError, match="not executable"):
        rpc.PopenSession(path_minrpc)


def test_minrpc_output_speaks_on_its_fd_arguments(tmp_path):
    """TVM's popen convention: the two pipe descriptors come as arguments; stdout stays quiet."""
    from disco_rpc import auth, wire

    path = str(tmp_path / "s.minrpc")
    rpc.with_minrpc(None)(path, [])
    c_read, p_write = os.pipe()
    p_read, c_write = os.pipe()
    proc = subprocess.Popen(
        [path, str(c_read), str(c_write)], pass_fds=(c_read, c_write),
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
    )  # fmt: skip
    os.close(c_read)
    os.close(c_write)
    conn = wire.Conn(wire.PipeTransport(p_read, p_write))
    conn.t.settimeout(30)
    auth.client_handshake(conn, "", None)
    sess = rpc.RPCSession(conn, label="fds")
    try:
        sess._init(0, None)
        assert sess.info["minrpc"] is True and sess.info["pid"] == proc.pid
        sess.upload(b"x", "a.bin")
        assert sess.listdir(".") == "a.bin"
    finally:
        sess.close()
    assert proc.wait(timeout=10) == 0  # the end of its pipe ends it
    assert proc.stdout.read() == b""
    proc.stdout.close()
    # anything but two descriptors is refused with the usage, as TVM's server exits
    bad = subprocess.run([path, "x"], capture_output=True, timeout=30)
    assert bad.returncode == 2 and b"usage" in bad.stderr


def test_popen_bad_binaries_fail_fast_and_leave_no_child(tmp_path):
    """Missing, not executable, exiting at once, not a program, silent: clear errors, no child left."""
    before = _children()
    with pytest.raises(rpc.RPCError, match="does not exist"):
        rpc.PopenSession(str(tmp_path / "missing"))
    t0 = time.monotonic()
    with pytest.raises(rpc.RPCError, match="exited with code 3 before it served"):
        rpc.PopenSession(b"#!/bin/sh\nexit 3\n")
    with pytest.raises(rpc.RPCError, match="cannot start"):
        rpc.PopenSession(b"\x7fELF but not really")
    assert time.monotonic() - t0 < 10
    t0 = time.monotonic()
    with pytest.raises(rpc.RPCError, match="did not answer the disco-rpc handshake within 1 s"):
        rpc.PopenSession(b"#!/bin/sh\nexec sleep 30\n", startup_timeout=1)
    assert time.monotonic() - t0 < 10
    assert _children() <= before  # every child was reaped (killed when it hung)


def test_popen_session_cleans_up_and_skips_heartbeats(tmp_path):
    """The child's folders go with the session; a relayed heartbeat is skipped, not a request."""
    path = str(tmp_path / "s.minrpc")
    rpc.with_minrpc()(path, [])
    sess = rpc.PopenSession(path)
    root = os.path.dirname(sess._child.work_dir)
    sess.upload(b"x", "a.bin")
    assert os.path.isfile(os.path.join(sess._child.work_dir, "a.bin"))
    for _ in range(3):
        sess._conn.send_heartbeat()
    assert sess.listdir(".") == "a.bin"
    pid = sess.info["pid"]
    sess.close()
    assert not os.path.exists(root)
    assert pid not in _children()


def test_with_minrpc_wrong_use(tmp_path, myadd_obj):
    from disco_core import DiscoFileNotFoundError, DiscoTypeError, DiscoValueError

    out = str(tmp_path / "s.minrpc")
    with pytest.raises(DiscoValueError, match="unknown server 'tcp_server'"):
        rpc.with_minrpc(None, "tcp_server")
    with pytest.raises(DiscoValueError, match="unknown runtime 'crt'"):
        rpc.with_minrpc(None, runtime="crt")
    with pytest.raises(DiscoTypeError, match="compile_func"):
        rpc.with_minrpc(42)
    with pytest.raises(DiscoValueError, match=r"myadd.o.*compile_func is None"):
        rpc.with_minrpc(None)(out, [myadd_obj])
    with pytest.raises(DiscoFileNotFoundError, match="without writing"):
        rpc.with_minrpc(lambda output, objects, options=None: None)(out, [myadd_obj])
    with pytest.raises(DiscoFileNotFoundError, match="nope.o does not exist"):
        rpc.with_minrpc(create_executable)(out, [str(tmp_path / "nope.o")])
    with pytest.raises(DiscoValueError, match="linking failed"):
        rpc.with_minrpc(_cc())(out, [myadd_obj], options=["-no-such-option-x"])
    assert not os.path.exists(out)  # nothing half-written
    # a compiler command (str) as TVM's cross_compiler takes it
    rpc.with_minrpc(_cc())(out, [myadd_obj])
    with rpc.PopenSession(out) as s:
        assert s.system_lib()["myadd"](1, 2) == 3


def test_minrpc_server_import_leaves_the_protocol_alone():
    """Importing the minimal server from the package changes none of the protocol's numbers."""
    import importlib

    from disco_rpc import minrpc_server, protocol

    before = {k: v for k, v in vars(protocol).items() if k.isupper()}
    importlib.reload(minrpc_server)
    after = {k: v for k, v in vars(protocol).items() if k.isupper()}
    assert after == before and protocol.CHUNK == 8 << 20


def test_popen_constructor_behind_a_token(tmp_path):
    """A sealed session relays to the popen child: files of several records arrive whole."""
    path = str(tmp_path / "s.minrpc")
    rpc.with_minrpc()(path, [])
    with open(path, "rb") as f:
        binary = f.read()
    token = "minrpc-test-token-0123456789"
    server = rpc.Server(key="x1", token=token)
    try:
        with rpc.connect("127.0.0.1", server.port, key="x1", token=token, session_constructor_args=["rpc.PopenSession", binary]) as s:  # fmt: skip
            data = os.urandom(3 << 20)
            s.upload(data, "big.bin")
            assert bytes(s.download("big.bin")) == data
            assert s.info["minrpc"] is True
    finally:
        server.terminate()


def test_popen_constructor_child_ends_with_a_timed_out_session(tmp_path):
    """The server's session time limit ends the popen child too, even inside a long call."""
    (tmp_path / "slow.py").write_text(
        "import time, disco_core\n"
        "disco_core.register_func('slow.sleep', lambda t: time.sleep(t) or t)\n"
    )
    path = str(tmp_path / "slow.minrpc")
    rpc.with_minrpc()(path, [str(tmp_path / "slow.py")])
    with open(path, "rb") as f:
        binary = f.read()
    server = rpc.Server(key="x2", session_timeout=1)
    try:
        sess = rpc.connect("127.0.0.1", server.port, key="x2", session_constructor_args=["rpc.PopenSession", binary])  # fmt: skip
        pid = sess.info["pid"]
        with pytest.raises(rpc.RPCSessionTimeoutError):
            sess.get_function("slow.sleep")(30)
        assert _gone(pid), "the popen child outlived its session"
    finally:
        server.terminate()


def _gone(pid, within=5.0):
    """Whether ``pid`` ends (or is a zombie, killed and waiting to be reaped) within ``within`` s."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except (
            FileNotFoundError,
            ProcessLookupError,
        ):  # reaped before the open, or between open and read
            return True
        time.sleep(0.05)
    return False


def _call_into(fn, arg, errors):
    try:
        fn(arg)
    except Exception as exc:  # noqa: BLE001 - the test looks at it
        errors.append(exc)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_popen_constructor_child_dies_with_a_killed_session_process(tmp_path):
    """A session process killed outright (no cleanup runs) takes the popen child with it."""
    import signal

    (tmp_path / "slow.py").write_text(
        "import time, disco_core\n"
        "disco_core.register_func('slow.sleep', lambda t: time.sleep(t) or t)\n"
    )
    path = str(tmp_path / "slow.minrpc")
    rpc.with_minrpc()(path, [str(tmp_path / "slow.py")])
    with open(path, "rb") as f:
        binary = f.read()
    server = rpc.Server(key="x3")
    try:
        sess = rpc.connect("127.0.0.1", server.port, key="x3", session_constructor_args=["rpc.PopenSession", binary])  # fmt: skip
        pid = sess.info["pid"]
        with open(f"/proc/{pid}/stat") as f:
            session_pid = int(f.read().rsplit(")", 1)[1].split()[1])  # the child's parent
        assert session_pid not in (os.getpid(), 1)
        errors = []
        call = threading.Thread(target=_call_into, args=(sess.get_function("slow.sleep"), 30, errors))  # fmt: skip
        call.start()
        time.sleep(0.3)  # the child is inside the call: it reads no end of file
        os.kill(session_pid, signal.SIGKILL)
        assert _gone(pid), "the popen child outlived its killed session process"
        call.join(10)
        assert not call.is_alive() and isinstance(errors[0], rpc.RPCError)
    finally:
        server.terminate()
