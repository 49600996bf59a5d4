"""A minimal disco-rpc server over stdin/stdout, using the Python standard library only.

This file is the ``__main__`` of the zipapps that :func:`disco_rpc.with_minrpc`
writes: a device with nothing but Python runs it and a client drives it through
:class:`disco_rpc.PopenSession`. It must import nothing outside the standard
library (no NumPy, no disco_core, no disco_rpc) but :mod:`disco_rpc.protocol`, the
protocol's numbers (standard library only too), which the zipapp holds beside it.

Supported: the handshake (token-free, as over pipes), ``get_function`` and calls
of global functions registered by the packaged ``.py`` files (through a stand-in
``disco_core.register_func`` when the real package is missing), ``system_lib()``
(those functions and the symbols of packaged ``.so`` files), ``load_module`` of
packaged or uploaded ``.py`` and ``.so`` files, ``upload``/``download``/
``listdir``/``remove`` confined to a work folder, ``time_evaluator``, ``ping``,
and values ``None``, ``bool``, ``int``, ``float``, ``complex``, ``str``,
``bytes``, tuples, lists, dicts and remote handles. Not supported: arrays and
remote tensors (they need NumPy: use the full server), devices other than the
CPU, TLS, session constructors (``rpc.Connect``) and linking ``.tar`` files.
"""

import ctypes
import importlib.util
import os
import re
import secrets
import shutil
import struct
import sys
import tempfile
import time
import traceback
import types

# The protocol's numbers are disco_rpc/protocol.py's (standard library only too): imported
# from the package, or from the copy that with_minrpc ships beside this file in a zipapp.
if __package__:  # imported as disco_rpc.minrpc_server
    from . import protocol as proto
else:  # the zipapp's __main__
    import disco_rpc_protocol as proto  # type: ignore[no-redef]

#: Over pipes there is no token and no sealing: the pipes join this process and the
#: client that spawned it, and no other party can reach them (the handshake answers
#: "no authentication required").
MAX_MESSAGE_BYTES = 1 << 30
# Local names only: assigning to proto's would change disco_rpc.protocol for every
# module of the package when this file is imported from it.
CHUNK_KIND = proto.CHUNK_FRAME  # a chunk frame's kind
STREAM_CHUNK = proto.CHUNK  # a file chunk's size
FUNC, MODULE = proto.HANDLE_FUNC, proto.HANDLE_MODULE
HEAD = proto.FRAME_HEAD
PART_RE = re.compile(re.escape(proto.PART_PREFIX) + r"[0-9a-f]{16}\Z")
RESTYPES = {
    "int": ctypes.c_int, "int32": ctypes.c_int32, "int64": ctypes.c_int64,
    "uint64": ctypes.c_uint64, "float": ctypes.c_float, "float32": ctypes.c_float,
    "double": ctypes.c_double, "float64": ctypes.c_double, "void": None,
}  # fmt: skip

REGISTRY: dict = {}


class Ref:
    def __init__(self, kind, hid, info=None):
        self.kind, self.hid, self.info = kind, hid, info


class Device:
    def __init__(self, code, dev_id):
        self.code, self.dev_id = code, dev_id


def _install_registry_stub():
    """Give packaged files ``import disco_core; disco_core.register_func`` without the package."""
    try:
        import disco_core  # noqa: F401

        return
    except ImportError:
        pass
    mod = types.ModuleType("disco_core")

    def register_func(name, func=None, override=False):
        if func is None:
            return lambda f: register_func(name, f, override)
        if name in REGISTRY and not override:
            raise KeyError(f"global function {name!r} is already registered")
        REGISTRY[name] = func
        return func

    mod.register_func = register_func
    mod.get_global_func = lambda name, allow_missing=False: (
        REGISTRY.get(name) if allow_missing else REGISTRY[name]
    )
    mod.MINRPC = True
    sys.modules["disco_core"] = mod


class FunctionKeyError(KeyError):
    """No function of that name: a ``KeyError`` as the full server's, which the client
    raises as ``RPCAttributeError`` (an ``AttributeError``, as TVM's); its text unquoted."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def _lookup(name):
    if name in REGISTRY:
        return REGISTRY[name]
    try:
        import disco_core

        fn = disco_core.get_global_func(name, allow_missing=True)
    except ImportError:
        fn = None
    if fn is None:
        if name in CACHE_FLUSH_NAMES:  # TVM's f_preproc: no arrays here, nothing to flush
            return _no_flush
        raise FunctionKeyError(f"global function {name!r} is not registered")
    return fn


#: TVM's cache-flushing ``f_preproc`` (disco_rpc.handler.CACHE_FLUSH_NAMES).
CACHE_FLUSH_NAMES = ("cache_flush_cpu_non_first_arg", "cache_flush_cpu_preproc")


def _no_flush(*_args):
    return None


# --------------------------------------------------------------------------- values
def encode(v, out, bufs, export, depth=0):
    t = type(v)
    if v is None:
        out.append(proto.T_NONE)
    elif t is bool:
        out.append(proto.T_TRUE if v else proto.T_FALSE)
    elif t is int:
        if -(1 << 63) <= v < (1 << 63):
            out += struct.pack("<Bq", proto.T_INT, v)
        else:
            b = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
            out += struct.pack("<BI", proto.T_BIGINT, len(b)) + b
    elif t is float:
        out += struct.pack("<Bd", proto.T_FLOAT, v)
    elif t is complex:
        out += struct.pack("<Bdd", proto.T_COMPLEX, v.real, v.imag)
    elif t is str:
        b = v.encode("utf-8", "surrogatepass")
        out += struct.pack("<BI", proto.T_STR, len(b)) + b
    elif t in (bytes, bytearray, memoryview):
        b = bytes(v)
        if len(b) < proto.INLINE_BYTES:
            out += struct.pack("<BI", proto.T_BYTES, len(b)) + b
        else:
            out += struct.pack("<BI", proto.T_BUF, len(bufs))
            bufs.append(b)
    elif t in (tuple, list):
        if depth >= proto.MAX_DEPTH:
            raise ValueError("value nested too deeply")
        out += struct.pack("<BI", proto.T_TUPLE if t is tuple else proto.T_LIST, len(v))
        for x in v:
            encode(x, out, bufs, export, depth + 1)
    elif t is dict:
        out += struct.pack("<BI", proto.T_DICT, len(v))
        for k, x in v.items():
            encode(k, out, bufs, export, depth + 1)
            encode(x, out, bufs, export, depth + 1)
    elif t is Device:
        out += struct.pack("<BII", proto.T_DEVICE, v.code, v.dev_id)
    else:
        ref = export(v)
        out += struct.pack("<BBQ", proto.T_HANDLE, ref.kind, ref.hid)
        encode(ref.info, out, bufs, export, depth + 1)


class Decoder:
    def __init__(self, meta, bufs, resolve):
        self.meta, self.pos, self.bufs, self.resolve = meta, 0, bufs, resolve

    def take(self, n):
        if n < 0 or self.pos + n > len(self.meta):
            raise ValueError("truncated value in frame")
        p = self.pos
        self.pos += n
        return self.meta[p : p + n]

    def u32(self):
        return struct.unpack("<I", self.take(4))[0]

    def value(self, depth=0):
        if depth > proto.MAX_DEPTH:
            raise ValueError("value nested too deeply")
        tag = self.take(1)[0]
        if tag == proto.T_NONE:
            return None
        if tag in (proto.T_FALSE, proto.T_TRUE):
            return tag == proto.T_TRUE
        if tag == proto.T_INT:
            return struct.unpack("<q", self.take(8))[0]
        if tag == proto.T_BIGINT:
            return int.from_bytes(self.take(self.u32()), "little", signed=True)
        if tag == proto.T_FLOAT:
            return struct.unpack("<d", self.take(8))[0]
        if tag == proto.T_COMPLEX:
            return complex(*struct.unpack("<dd", self.take(16)))
        if tag == proto.T_STR:
            return bytes(self.take(self.u32())).decode("utf-8", "surrogatepass")
        if tag == proto.T_BYTES:
            return bytes(self.take(self.u32()))
        if tag == proto.T_BUF:
            idx = self.u32()
            if idx >= len(self.bufs):
                raise ValueError(f"bad buffer index {idx}")
            return bytes(self.bufs[idx])  # byte strings are bytes, whatever their size
        if tag in (proto.T_TUPLE, proto.T_LIST):
            n = self.u32()
            if n > len(self.meta):
                raise ValueError("container longer than its frame")
            items = [self.value(depth + 1) for _ in range(n)]
            return tuple(items) if tag == proto.T_TUPLE else items
        if tag == proto.T_DICT:
            n = self.u32()
            if n > len(self.meta):
                raise ValueError("container longer than its frame")
            return {self.value(depth + 1): self.value(depth + 1) for _ in range(n)}
        if tag == proto.T_HANDLE:
            _kind, hid = struct.unpack("<BQ", self.take(9))
            self.value(depth + 1)
            return self.resolve(hid)
        if tag == proto.T_DEVICE:
            return Device(*struct.unpack("<II", self.take(8)))
        if tag == proto.T_ARRAY:
            raise TypeError("arrays are not supported by the minimal server (it has no NumPy)")
        if tag == proto.T_DTYPE:
            return bytes(self.take(self.u32())).decode("ascii")
        raise ValueError(f"unknown value tag {tag}")


# --------------------------------------------------------------------------- io
class Pipe:
    def __init__(self, rfd, wfd):
        self.rfd, self.wfd = rfd, wfd

    def read(self, n):
        out = bytearray(n)
        view = memoryview(out)
        got = 0
        while got < n:
            k = os.readv(self.rfd, [view[got:]])
            if not k:
                raise EOFError("the client closed the pipe")
            got += k
        return out

    def write(self, *parts):
        for p in parts:
            view = memoryview(p)
            while len(view):
                view = view[os.write(self.wfd, view) :]

    def recv(self, resolve):
        while True:
            head = self.read(HEAD.size)
            # a client's "still here" (relayed by a server's rpc.PopenSession): nothing to do
            if head != proto.HEARTBEAT_FRAME:
                break
        kind, op, _flags, meta_len, nbuf = HEAD.unpack(head)
        if nbuf > 1 << 16 or meta_len + 8 * nbuf > MAX_MESSAGE_BYTES:
            raise EOFError("frame over the size limit")
        lens = struct.unpack(f"<{nbuf}Q", self.read(8 * nbuf)) if nbuf else ()
        if meta_len + sum(lens) > MAX_MESSAGE_BYTES:
            raise EOFError("frame over the size limit")
        meta = self.read(meta_len)
        bufs = [self.read(n) for n in lens]
        return op, Decoder(memoryview(meta), bufs, resolve)

    def send(self, kind, op, value, export, flags=0):
        out, bufs = bytearray(), []
        encode(value, out, bufs, export)
        head = HEAD.pack(kind, op, flags, len(out), len(bufs))
        head += b"".join(struct.pack("<Q", len(b)) for b in bufs)
        self.write(head + out, *bufs)

    # A file travels as CHUNK frames (no meta, one buffer each) after the request
    # (upload) or the reply (download) that declared its size, then an END frame.
    def chunk_head(self, op, left):
        """A chunk's size; 0 for the end (expected when ``left`` is 0)."""
        kind, cop, flags, meta_len, nbuf = HEAD.unpack(self.read(HEAD.size))
        if kind != CHUNK_KIND or cop != op:
            raise EOFError("expected a file chunk: the connection is out of sync")
        if flags & proto.FLAG_ABORT and nbuf == 0 and meta_len <= 1 << 16:
            reason = Decoder(self.read(meta_len), [], None).value()
            raise ValueError(f"the client gave up: {reason}")
        if left == 0 and (flags, nbuf, meta_len) == (proto.FLAG_END, 0, 0):
            return 0
        if flags or nbuf != 1 or meta_len or not left:
            raise EOFError("malformed file chunk")
        (n,) = struct.unpack("<Q", self.read(8))
        if not 0 < n <= min(left, MAX_MESSAGE_BYTES):
            raise EOFError(f"file chunk of {n} bytes")
        return n

    def recv_stream(self, op, size, f):
        """Read a stream of ``size`` bytes into ``f`` (or drop it); raise the write error last."""
        done, failed = 0, None
        while done < size:
            n = self.chunk_head(op, size - done)
            data = self.read(n)
            if f is not None and failed is None:
                try:
                    f.write(data)
                except OSError as exc:
                    failed = exc
            done += n
        self.chunk_head(op, 0)
        if failed is not None:
            raise failed

    def send_stream(self, op, f, size, chunk):
        done = 0
        while done < size:
            n = min(chunk, size - done)
            data = f.read(n)
            self.write(
                struct.pack("<BBHIIQ", CHUNK_KIND, op, 0, 0, 1, n), data + bytes(n - len(data))
            )
            if len(data) < n:  # the file shrank: the padding is followed by an abort
                self.send(CHUNK_KIND, op, "the file ended early", None, proto.FLAG_ABORT)
                return
            done += n
        self.write(HEAD.pack(CHUNK_KIND, op, proto.FLAG_END, 0, 0))


# --------------------------------------------------------------------------- modules
class PyModule:
    def __init__(self, mod):
        self.mod = mod

    def __getitem__(self, name):
        fn = getattr(self.mod, name, None)
        if fn is None or not callable(fn):
            raise KeyError(f"module has no function {name!r}")
        return fn


class CFunction:
    def __init__(self, cfunc, name, restype="int"):
        if restype not in RESTYPES:
            raise ValueError(f"unknown restype {restype!r}")
        self.cfunc, self.__name__, self.restype = cfunc, name, RESTYPES[restype]

    def __call__(self, *args):
        self.cfunc.restype = self.restype
        conv = []
        for a in args:
            if isinstance(a, bool):
                conv.append(ctypes.c_int(int(a)))
            elif isinstance(a, int):
                conv.append(ctypes.c_int64(a))
            elif isinstance(a, float):
                conv.append(ctypes.c_double(a))
            elif isinstance(a, str):
                conv.append(ctypes.c_char_p(a.encode()))
            elif isinstance(a, bytes):
                conv.append(ctypes.c_char_p(a))
            elif a is None:
                conv.append(ctypes.c_void_p(None))
            else:
                raise TypeError(f"cannot pass a {type(a).__name__} to a C function")
        return self.cfunc(*conv)


class CModule:
    def __init__(self, lib, path):
        self.lib, self.path = lib, path

    def get_function(self, name, restype="int"):
        try:
            return CFunction(getattr(self.lib, name), name, restype or "int")
        except AttributeError:
            raise KeyError(f"{os.path.basename(self.path)} has no symbol {name!r}") from None

    def __getitem__(self, name):
        return self.get_function(name)


class SystemLib:
    def __init__(self, libs):
        self.libs = libs

    def __getitem__(self, name):
        if name in REGISTRY:
            return REGISTRY[name]
        for lib in self.libs:
            try:
                return CFunction(getattr(lib, name), name)
            except AttributeError:
                continue
        return _lookup(name)

    def get_function(self, name, restype=None):
        """A global function, or (with ``restype``) a C symbol of a packaged library."""
        if restype is None:
            return self[name]
        for lib in self.libs:
            try:
                return CFunction(getattr(lib, name), name, restype)
            except AttributeError:
                continue
        raise KeyError(f"no loaded library has a symbol {name!r}")


LOADED: dict = {}


def load_file(path):
    """Load a ``.py`` or ``.so`` file once; a second load returns the same module."""
    key = os.path.realpath(path)
    if key not in LOADED:
        LOADED[key] = _load_file(path)
    return LOADED[key]


def _load_file(path):
    if path.endswith(".py"):
        name = "minrpc_mod_" + os.path.splitext(os.path.basename(path))[0]
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return PyModule(mod)
    if path.endswith((".so", ".dylib", ".dll")):
        return CModule(ctypes.CDLL(os.path.abspath(path)), path)
    raise ValueError(f"the minimal server loads .py and .so files, not {os.path.basename(path)}")


# --------------------------------------------------------------------------- the session
class Session:
    def __init__(self, build_dir):
        # PopenSession makes the session's folder and removes it, even after a crash here
        given = os.environ.get(proto.POPEN_WORK_DIR_ENV)
        self.own_work = not given
        self.work = given or tempfile.mkdtemp(prefix="disco-minrpc-")
        self.build_dir = build_dir
        self.objects = {}
        self.next_id = 1
        self.libs = []
        self.chunk = STREAM_CHUNK  # lowered to the client's max_message_bytes at INIT

    def export(self, obj):
        hid = self.next_id
        self.next_id += 1
        self.objects[hid] = obj
        if callable(obj) and not hasattr(obj, "__getitem__"):
            return Ref(FUNC, hid, getattr(obj, "__name__", "function"))
        return Ref(MODULE, hid, type(obj).__name__)

    def resolve(self, hid):
        try:
            return self.objects[hid]
        except KeyError:
            raise ValueError(f"unknown remote object {hid}") from None

    def path(self, p):
        if not isinstance(p, str) or os.path.isabs(p) or p.startswith("~") or "\0" in p:
            raise PermissionError(f"remote path {p!r} must be relative to the work folder")
        if ".." in p.replace("\\", "/").split("/"):
            raise PermissionError(f"remote path {p!r} leaves the work folder")
        full = os.path.realpath(os.path.join(self.work, p))
        root = os.path.realpath(self.work)
        if full != root and not full.startswith(root + os.sep):
            raise PermissionError(f"remote path {p!r} leaves the work folder")
        return full

    def find(self, p):
        full = self.path(p)
        if not os.path.exists(full) and self.build_dir:
            cand = os.path.join(self.build_dir, os.path.basename(p))
            if os.path.exists(cand):
                return cand
        return full

    def handle(self, op, args):
        if op == proto.OP_GET_FUNC:
            return _lookup(args[0])
        if op == proto.OP_CALL:
            fn = args[0] if not isinstance(args[0], int) else self.resolve(args[0])
            return fn(*args[1])
        if op == proto.OP_SYSTEM_LIB:
            return SystemLib(self.libs)
        if op == proto.OP_MOD_FUNC:
            module, name, restype = args
            if restype is not None:
                return module.get_function(name, restype)
            return module[name]
        if op == proto.OP_LOAD_MODULE:
            full = self.find(args[0])
            if not os.path.exists(full):
                raise FileNotFoundError(f"no file {args[0]!r} in the build or the work folder")
            return load_file(full)
        if op == proto.OP_LISTDIR:
            names = os.listdir(self.path(args[0] if args else "."))
            return sorted(n for n in names if not PART_RE.match(n))
        if op == proto.OP_REMOVE:
            full = self.path(args[0])
            if os.path.isdir(full):
                shutil.rmtree(full)
            else:
                os.remove(full)
            return None
        if op == proto.OP_PING:  # its argument back: a client's token (see the client's _resync)
            return args[0] if args else None
        if op in (proto.OP_FREE, proto.OP_DEV_SYNC):
            return None
        if op == proto.OP_DEV_EXIST:
            return args[0].code == 1
        if op == proto.OP_TIME_EVAL:
            return self.time_eval(*args)
        if op == proto.OP_UPLOAD_CHECK:
            return self.upload_check(*args)
        if op in (proto.OP_TENSOR, proto.OP_EMPTY, proto.OP_TENSOR_GET, proto.OP_TENSOR_SET):
            raise TypeError("remote tensors are not supported by the minimal server (no NumPy)")
        raise ValueError(f"operation {op} is not supported by the minimal server")

    def upload_check(self, target):
        """What :meth:`upload` would refuse, before the body is sent (``OP_UPLOAD_CHECK``)."""
        full = self.path(target)
        if PART_RE.match(os.path.basename(full)):
            raise PermissionError(f"remote name {target!r} is reserved for partial uploads")
        if os.path.isdir(full):
            raise IsADirectoryError(f"remote path {target!r} is a folder")

    def upload(self, pipe, payload):
        """An upload request ``(target, size)``; ``size`` bytes of chunks follow it."""
        try:
            frees, (target, size) = payload
            size = int(size)
        except (TypeError, ValueError):
            raise EOFError("malformed upload request: the connection is out of sync") from None
        try:
            full = self.path(target)
            if PART_RE.match(os.path.basename(full)):
                raise PermissionError(f"remote name {target!r} is reserved for partial uploads")
            os.makedirs(os.path.dirname(full), exist_ok=True)
        except Exception:
            pipe.recv_stream(proto.OP_UPLOAD, size, None)
            raise
        tmp = os.path.join(os.path.dirname(full), proto.PART_PREFIX + secrets.token_hex(8))
        try:
            with open(tmp, "wb") as f:
                pipe.recv_stream(proto.OP_UPLOAD, size, f)
            os.replace(tmp, full)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)

    def download(self, pipe, path):
        with open(self.find(path), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            pipe.send(proto.REPLY, proto.OP_DOWNLOAD, size, self.export)
            pipe.send_stream(proto.OP_DOWNLOAD, f, size, self.chunk)

    def time_eval(
        self, module, name, _dev, number, repeat, min_ms, zero_limit, cool_ms, cool_every, restype, args,
        flush_bytes=0, preproc="",
    ):  # fmt: skip
        if module is None:
            fn = _lookup(name)
        elif restype is not None:
            fn = module.get_function(name, restype)
        else:
            fn = module[name]
        pre = _lookup(preproc) if preproc else None
        # TVM's cache_flush_bytes: one buffer copied into another before each timed run
        flush = (bytearray(flush_bytes), bytes(flush_bytes)) if flush_bytes else None
        fn(*args)
        number, results = max(1, number), []
        for i in range(max(1, repeat)):
            if pre is not None:
                pre(*args)
            elapsed, zeros = 0.0, 0
            while True:  # as TVM's: grow `number` until a repeat lasts min_ms
                if elapsed > 0:
                    number = int(max(min_ms / 1e3 / (elapsed / number) + 1, number * 1.618))
                if flush is not None:
                    flush[0][:] = flush[1]
                t0 = time.perf_counter()
                for _ in range(number):
                    fn(*args)
                elapsed = time.perf_counter() - t0
                zeros += elapsed == 0  # a clock too coarse: do not loop forever
                if elapsed * 1e3 >= (min_ms or 0) or zeros >= max(1, zero_limit):
                    break
            results.append(elapsed / number)
            if cool_ms and cool_every and (i + 1) % cool_every == 0:
                time.sleep(cool_ms / 1e3)
        return results

    def init(self, args):
        if args[1]:
            raise ValueError("session constructors are not supported by the minimal server")
        if len(args) > 2 and args[2]:
            self.chunk = max(1, min(STREAM_CHUNK, int(args[2])))
        return {
            "pid": os.getpid(),
            "version": proto.VERSION,
            "minrpc": True,
            "max_message_bytes": MAX_MESSAGE_BYTES,
        }

    def close(self):
        if self.own_work:
            shutil.rmtree(self.work, ignore_errors=True)


def error_value(exc):
    t = type(exc)
    name = t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"
    return (name, str(exc), "".join(traceback.format_exception(t, exc, exc.__traceback__)))


def serve(build_dir=None, fds=(0, 1)):
    """Serve one session on the pipe descriptors ``fds`` (read, write)."""
    rfd, wfd = os.dup(fds[0]), os.dup(fds[1])
    for fd in set(fds) - {0, 1, 2}:
        os.close(fd)
    sys.stdout.flush()
    os.dup2(2, 1)  # what the functions print goes to stderr
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # only the protocol reads the client's pipe
    os.close(null)
    pipe = Pipe(rfd, wfd)
    _install_registry_stub()
    sess = Session(build_dir)
    if build_dir and os.path.isdir(build_dir):
        sys.path.insert(0, build_dir)
        for name in sorted(os.listdir(build_dir)):
            full = os.path.join(build_dir, name)
            if name.endswith(".py"):
                load_file(full)
            elif name.endswith((".so", ".dylib")):
                sess.libs.append(
                    ctypes.CDLL(os.path.abspath(full), mode=getattr(ctypes, "RTLD_GLOBAL", 0))
                )
    try:
        magic, version, keylen = struct.unpack("<8sII", pipe.read(16))
        if magic != proto.MAGIC or keylen > 4096:
            return
        pipe.read(keylen + 32)
        status = 0 if version == proto.VERSION else 2
        pipe.write(struct.pack("<8sIBB32s", proto.MAGIC, proto.VERSION, status, 0, os.urandom(32)))
        if status:
            return
        while True:
            try:
                op, dec = pipe.recv(sess.resolve)
                if op == proto.OP_UPLOAD:  # the stream must be read whatever happens
                    try:
                        sess.upload(pipe, dec.value())
                        pipe.send(proto.REPLY, op, None, sess.export)
                    except EOFError:
                        raise
                    except Exception as exc:  # noqa: BLE001 - the failure goes back
                        pipe.send(proto.ERROR, op, error_value(exc), sess.export)
                    continue
            except EOFError:
                return
            try:
                frees, args = dec.value()
                for hid in frees or ():
                    sess.objects.pop(hid, None)
                if op == proto.OP_INIT:
                    result = sess.init(args)
                elif op == proto.OP_DOWNLOAD:
                    sess.download(pipe, args[0])
                    continue
                else:
                    result = sess.handle(op, args)
                pipe.send(proto.REPLY, op, result, sess.export)
            except Exception as exc:  # noqa: BLE001 - every failure goes back to the client
                pipe.send(proto.ERROR, op, error_value(exc), sess.export)
    finally:
        sess.close()


USAGE = """usage: minrpc-server [READ_FD WRITE_FD]

Serve one disco-rpc session on the pipe descriptors READ_FD and WRITE_FD, as TVM's
posix_popen_server (rpc.PopenSession passes them), or on stdin/stdout without them.
"""


def parse_fds(argv):
    """The pipe descriptors of the command line ``argv`` (without the program): ``(read, write)``."""
    if not argv:
        return 0, 1
    if len(argv) == 2 and all(a.isdigit() for a in argv):
        fds = int(argv[0]), int(argv[1])
        for fd in fds:
            os.fstat(fd)  # OSError (EBADF) for a descriptor this process lacks
        return fds
    raise ValueError(f"expected two pipe descriptors, got {argv}")


def die_with_parent():
    """End with the process that started this one, when it asked to (a server's session).

    A session process killed outright (SIGKILL) runs no cleanup: the kernel then
    kills this server too, instead of leaving it running a long call (Linux only).
    """
    parent = os.environ.get(proto.POPEN_PARENT_ENV)
    if not parent or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        return
    if str(os.getppid()) != parent:  # the parent died before the prctl: it never fires
        sys.exit(1)


def main():
    try:
        fds = parse_fds(sys.argv[1:])
    except (ValueError, OSError) as exc:
        sys.stderr.write(f"minrpc-server: {exc}\n{USAGE}")
        sys.exit(2)
    die_with_parent()
    here = os.path.dirname(os.path.abspath(__file__))
    build_dir = None
    if os.path.isfile(here):  # running from a zipapp: unpack its build folder
        import zipfile

        build_dir = tempfile.mkdtemp(prefix="disco-minrpc-build-")
        with zipfile.ZipFile(here) as z:
            for info in z.infolist():
                if info.filename.startswith("build/") and not info.is_dir():
                    name = os.path.basename(info.filename)
                    if name:
                        with z.open(info) as src, open(os.path.join(build_dir, name), "wb") as dst:
                            shutil.copyfileobj(src, dst)
    elif os.path.isdir(os.path.join(here, "build")):
        build_dir = os.path.join(here, "build")
    try:
        serve(build_dir, fds)
    finally:
        if build_dir and build_dir.startswith(tempfile.gettempdir()):
            shutil.rmtree(build_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
