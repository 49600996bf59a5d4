"""The server side of one session: its objects, its work folder, its operations.

A :class:`SessionHandler` is driven either by :func:`serve_conn` (frames over a
socket or pipes) or directly, in process, by :class:`~disco_rpc.client.LocalSession`.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import secrets
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

from disco_core import (
    DiscoFileNotFoundError,
    DiscoKeyError,
    DiscoPermissionError,
    DiscoTimeoutError,
    DiscoTypeError,
    DiscoValueError,
    IntegrityError,
)
from disco_core.spi import Device, as_device, as_dtype, as_shape, dtype_name, registry, to_host
from disco_core.spi import empty as dev_empty

from . import wire
from .errors import (
    DesyncError,
    ProtocolError,
    RPCError,
    RPCIsADirectoryError,
    RPCNotADirectoryError,
)
from .protocol import (  # noqa: F401 (every operation code: handler.OP_CALL is still a name)
    BEATS_ALWAYS,
    BEATS_IDLE,
    BEATS_NONE,
    ERROR,
    OP_CALL,
    OP_DEV_EXIST,
    OP_DEV_SYNC,
    OP_DISCO_WORKER,
    OP_DOWNLOAD,
    OP_EMPTY,
    OP_FREE,
    OP_GET_FUNC,
    OP_INIT,
    OP_LINK,
    OP_LISTDIR,
    OP_LOAD_MODULE,
    OP_MOD_FUNC,
    OP_NAMES,
    OP_PING,
    OP_REMOVE,
    OP_SYSTEM_LIB,
    OP_TENSOR,
    OP_TENSOR_GET,
    OP_TENSOR_SET,
    OP_TIME_EVAL,
    OP_UPLOAD,
    OP_UPLOAD_CHECK,
    PART_PREFIX,
    POPEN_WORK_DIR_ENV,
    REPLY,
)
from .wire import FileSource, HandleRef
from .worker_host import run_worker

__all__ = [
    "CACHE_FLUSH_NAMES",
    "SessionHandler",
    "SystemLib",
    "UploadTarget",
    "cache_flush_cpu_non_first_arg",
    "confine",
    "open_confined",
    "open_dir_in",
    "receive_in_place",
    "serve_conn",
    "error_value",
    "OP_NAMES",
    "PART_PREFIX",
    "WORK_DIR_ENV",
]

logger = logging.getLogger("disco_rpc")

#: The environment variable through which PopenSession hands its child the session's
#: work folder (made and removed by the client, so a crashed child leaves nothing).
WORK_DIR_ENV = POPEN_WORK_DIR_ENV
_PART_RE = re.compile(re.escape(PART_PREFIX) + r"[0-9a-f]{16}\Z")
#: The clock of ``time_evaluator`` (a module attribute so a test can stop it).
_clock = time.perf_counter


def rmtree_at(name: str, dir_fd: int, *, fallback: bool = sys.version_info < (3, 11)) -> None:
    """Remove the folder ``name`` of ``dir_fd`` and all it holds, following no link.

    ``shutil.rmtree(dir_fd=)`` is Python 3.11+; on 3.10 (or with ``fallback``) the
    same is done with ``os.fwalk``, every step relative to an open folder.
    """
    if not fallback:
        shutil.rmtree(name, dir_fd=dir_fd)  # type: ignore[call-arg,unused-ignore]
        return
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
    try:
        for _, dirs, files, root_fd in os.fwalk(".", topdown=False, dir_fd=fd):
            for entry in files:
                os.unlink(entry, dir_fd=root_fd)
            for entry in dirs:
                try:
                    os.rmdir(entry, dir_fd=root_fd)
                except NotADirectoryError:  # a link to a folder: the link goes
                    os.unlink(entry, dir_fd=root_fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dir_fd)


class SystemLib:
    """The server's "system library": global functions, then symbols of loaded libraries."""

    def __init__(self, libs: list) -> None:
        self.libs = libs

    def __getitem__(self, name: str) -> Any:
        fn = registry.get_global_func(name, allow_missing=True)
        if fn is not None:
            return fn
        return self._symbol(name, "int")

    def get_function(self, name: str, restype: Any = None) -> Any:
        """A global function, or a C symbol of a loaded library returning ``restype``.

        With ``restype`` the name must be a C symbol (``"int64"``, ``"double"``, ...
        as for :meth:`~disco_rpc.ctypes_loader.CtypesModule.get_function`).
        """
        if restype is None:
            return self[name]
        try:
            return self._symbol(name, restype)
        except KeyError:
            if registry.get_global_func(name, allow_missing=True) is not None:
                raise DiscoTypeError(
                    f"{name!r} is a Python global function: restype= applies to C functions "
                    "of the server's loaded libraries"
                ) from None
            raise

    def _symbol(self, name: str, restype: Any) -> Any:
        from .ctypes_loader import CFunction

        for lib in self.libs:
            try:
                return CFunction(getattr(lib, name), name, restype)
            except AttributeError:
                continue
        raise DiscoKeyError(registry.missing_message(name))


class _CacheFlush:
    """TVM's ``cache_flush_bytes``: two arrays of that size on the device, one copied
    into the other before each timed run, so the caches hold none of the function's data."""

    def __init__(self, nbytes: int, device: Any) -> None:
        n = max(1, nbytes // 4)
        self.a = dev_empty((n,), "int32", device)
        self.b = dev_empty((n,), "int32", device)
        self.b[...] = 0

    def __call__(self) -> None:
        self.a[...] = self.b


#: The caches' largest size, measured once (``_llc_bytes``).
_LLC: list[int] = []


def _llc_bytes() -> int:
    """The size of the CPU's largest cache as the kernel reports it, else 32 MiB."""
    if not _LLC:
        best = 0
        root = "/sys/devices/system/cpu/cpu0/cache"
        try:
            for entry in os.listdir(root):
                try:
                    with open(os.path.join(root, entry, "size")) as f:
                        text = f.read().strip().upper()
                except OSError:
                    continue
                unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
                digits = text.rstrip("KMG")
                if digits.isdigit():
                    best = max(best, int(digits) * unit)
        except OSError:
            pass
        _LLC.append(best or 32 << 20)
    return _LLC[0]


def cache_flush_cpu_non_first_arg(*args: Any) -> None:
    """Evict the arrays among ``args[1:]`` from the CPU caches (TVM's ``f_preproc`` of this name).

    TVM issues ``clflush`` on each array's lines; Python cannot, so this writes a
    buffer twice the size of the largest cache, which leaves none of the arrays'
    lines in any cache. Nothing is done when no argument after the first is a
    host array (as TVM's, the first argument is kept: it is usually the output).
    """
    if not any(isinstance(a, np.ndarray) for a in args[1:]):
        return
    n = 2 * _llc_bytes() // 8
    buf = _EVICT[0] if _EVICT and _EVICT[0].size == n else None
    if buf is None:
        buf = np.zeros(n, np.int64)
        _EVICT[:] = [buf]
    buf += 1  # a read and a write of every line


_EVICT: list[np.ndarray] = []
#: TVM's name, and the name issue 15 gave it; a user's own registration is kept.
CACHE_FLUSH_NAMES = ("cache_flush_cpu_non_first_arg", "cache_flush_cpu_preproc")
for _name in CACHE_FLUSH_NAMES:
    if registry.get_global_func(_name, allow_missing=True) is None:
        registry.register_func(_name, cache_flush_cpu_non_first_arg)
del _name


def _components(path: Any) -> tuple[str, list[str]]:
    """``(path, its components)``: a relative path without ``..``, or raise."""
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str):
        raise DiscoTypeError(f"a remote path must be a str, got {type(path).__name__}")
    if "\0" in path:
        raise DiscoPermissionError("a remote path must not contain NUL characters")
    if os.path.isabs(path) or path.startswith("~"):
        raise DiscoPermissionError(
            f"remote path {path!r} is absolute: paths are relative to the session's work folder"
        )
    parts = path.replace("\\", "/").split("/")
    if ".." in parts:
        raise DiscoPermissionError(f"remote path {path!r} leaves the session's work folder ('..')")
    return path, [p for p in parts if p not in ("", ".")]


def confine(root: str, path: Any) -> str:
    """``path`` inside ``root``; absolute paths, ``..`` and escaping links are refused.

    A check of a name only: what is at that name may change before it is used.
    File operations use :func:`open_confined`, which checks and opens in one step;
    this remains for ``load_module`` (whose loaders take a path, and which runs
    the client's code anyway).
    """
    path, _parts = _components(path)
    full = os.path.join(root, path)
    real_root = os.path.realpath(root)
    real = os.path.realpath(full)
    if real != real_root and not real.startswith(real_root + os.sep):
        raise DiscoPermissionError(f"remote path {path!r} leaves the session's work folder")
    return full


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _NOFOLLOW | os.O_CLOEXEC


def _refuse_link(path: str, exc: OSError) -> OSError:
    if exc.errno == errno.ELOOP:
        return PermissionError(
            f"remote path {path!r} goes through a link: links are not followed in the "
            "session's work folder"
        )
    return exc


def _is_link(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def open_dir_in(root: str, parts: list[str], path: str, make: bool = False) -> int:
    """A file descriptor of the folder ``root/parts...``, opened one component at a time.

    Each component is opened relative to the one before with ``O_NOFOLLOW``, so
    no link (one swapped in at any moment included) can lead out of ``root``.
    ``make`` creates missing folders. The caller closes the descriptor.
    """
    fd = os.open(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | os.O_CLOEXEC)
    try:
        for name in parts:
            try:
                nfd = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not make:
                    raise DiscoFileNotFoundError(f"no folder {path!r} in the session's work folder") from None  # fmt: skip
                try:
                    os.mkdir(name, 0o777, dir_fd=fd)
                except FileExistsError:
                    pass
                nfd = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ENOTDIR, errno.ELOOP):  # Linux says ENOTDIR for a link
                    if _is_link(name, fd):
                        raise _refuse_link(path, OSError(errno.ELOOP, "link")) from None
                    raise RPCNotADirectoryError(f"remote path {path!r}: {name!r} is not a folder") from None  # fmt: skip
                raise
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_confined(root: str, path: Any, flags: int = os.O_RDONLY) -> int:
    """Check ``path`` and open it inside ``root`` in one step; return the descriptor.

    No component, the last included, may be a link (``O_NOFOLLOW`` on each), so
    what is opened is inside ``root`` whatever is renamed or linked meanwhile.
    The path ``"."`` (or ``""``) opens ``root`` itself.
    """
    path, parts = _components(path)
    if not parts:
        return os.open(root, os.O_RDONLY | os.O_CLOEXEC)
    dfd = open_dir_in(root, parts[:-1], path)
    try:
        return os.open(parts[-1], flags | _NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    except FileNotFoundError:
        raise DiscoFileNotFoundError(f"no file {path!r} in the session's work folder") from None
    except OSError as exc:
        raise _refuse_link(path, exc) from None
    finally:
        os.close(dfd)


class UploadTarget:
    """Where an upload goes: a folder opened inside the work folder, and a name in it."""

    __slots__ = ("dir_fd", "name", "path")

    def __init__(self, dir_fd: int, name: str, path: str) -> None:
        self.dir_fd, self.name, self.path = dir_fd, name, path


def session_prefix(pid: int) -> str:
    """The name's start of a work folder made by the session process ``pid``: the server
    removes what a session process that died left (an outside check: 10 killed
    sessions kept 10 folders and their 50 MB of uploads until the server stopped)."""
    return f"disco-rpc-session-{pid}-"


def link_prefix(pid: int) -> str:
    """The name's start of a folder of ``tar`` links made by the session process ``pid``."""
    return f"disco-rpc-link-{pid}-"


class SessionHandler:
    """One session's objects and work folder; every ``op_*`` method is one operation.

    Parameters
    ----------
    work_dir : str, optional
        A folder used as is and kept (shared by the sessions of a server with
        ``work_dir=``); by default a new folder, deleted when the session ends.
    libs : list
        Shared libraries whose symbols ``system_lib()`` finds.
    temp_root : str, optional
        Where the session's own temporary folders are made.
    """

    def __init__(self, work_dir: str | None = None, libs: list | None = None, temp_root: str | None = None) -> None:  # fmt: skip
        self.temp_root = temp_root
        self.owns_work = not work_dir
        if work_dir:
            os.makedirs(work_dir, exist_ok=True)
            self.work = os.path.abspath(work_dir)
        else:
            self.work = tempfile.mkdtemp(prefix=session_prefix(os.getpid()), dir=temp_root)
        self.scratch: list[str] = []  # link folders, deleted at close
        # run at close, first: e.g. killing an rpc.PopenSession child, which would
        # otherwise outlive a session process that ends with os._exit
        self.on_close: list[Callable[[], Any]] = []
        self._close_lock = threading.RLock()
        self.objects: dict[int, Any] = {}
        self.next_id = 1
        self.libs = libs if libs is not None else []
        self.closed = False
        self.ops: dict[int, Callable[..., Any]] = {
            OP_GET_FUNC: self.op_get_func,
            OP_CALL: self.op_call,
            OP_REMOVE: self.op_remove,
            OP_LISTDIR: self.op_listdir,
            OP_LOAD_MODULE: self.op_load_module,
            OP_MOD_FUNC: self.op_mod_func,
            OP_TENSOR: self.op_tensor,
            OP_EMPTY: self.op_empty,
            OP_TENSOR_GET: self.op_tensor_get,
            OP_TENSOR_SET: self.op_tensor_set,
            OP_DEV_SYNC: self.op_dev_sync,
            OP_DEV_EXIST: self.op_dev_exist,
            OP_LINK: self.op_link,
            OP_SYSTEM_LIB: self.op_system_lib,
            OP_PING: _pong,
            OP_FREE: lambda *ids: None,
            OP_TIME_EVAL: self.op_time_eval,
            OP_UPLOAD_CHECK: self.op_upload_check,
        }

    # -- objects ----------------------------------------------------------------
    def export(self, obj: Any) -> HandleRef | None:
        """Keep ``obj`` on the server; return the handle that names it."""
        if type(obj) is Device or isinstance(obj, (np.dtype, np.generic)):
            return None
        mod = type(obj).__module__.split(".")[0]
        info: Any  # the tensor's description, or a name
        if isinstance(obj, np.ndarray) or mod == "cupy":
            kind = HandleRef.TENSOR
            info = self._tensor_info(obj)
        elif callable(obj) and not hasattr(obj, "__getitem__"):
            kind, info = HandleRef.FUNC, getattr(obj, "__name__", type(obj).__name__)
        elif hasattr(obj, "__getitem__") and not isinstance(obj, (dict, list, tuple)):
            kind, info = HandleRef.MODULE, type(obj).__name__
        elif isinstance(obj, (dict, list, tuple, str, bytes, bytearray, int, float, bool)):
            return None
        else:
            kind, info = HandleRef.OBJECT, f"{type(obj).__module__}.{type(obj).__qualname__}"
        hid = self.next_id
        self.next_id += 1
        self.objects[hid] = obj
        return HandleRef(kind, hid, info)

    @staticmethod
    def _tensor_info(arr: Any) -> tuple:
        dev = Device("cpu", 0)
        if not isinstance(arr, np.ndarray):  # CuPy
            dev = Device("cuda", int(arr.device.id))
        return (tuple(int(d) for d in arr.shape), dtype_name(arr.dtype), dev)

    def resolve(self, ref: HandleRef) -> Any:
        try:
            return self.objects[ref.hid]
        except KeyError:
            raise ProtocolError(
                f"unknown remote object {ref.hid} (freed, or from another session)"
            ) from None

    def free(self, ids) -> None:
        for hid in ids:
            self.objects.pop(hid, None)

    def get(self, hid: int, kind: str) -> Any:
        try:
            return self.objects[hid]
        except KeyError:
            raise DiscoValueError(
                f"unknown remote {kind} {hid} (freed, or from another session)"
            ) from None

    # -- operations ---------------------------------------------------------------
    def op_get_func(self, name: str) -> Any:
        fn = registry.get_global_func(name, allow_missing=True)
        if fn is None:
            raise DiscoValueError(registry.missing_message(name))
        return fn

    def op_call(self, func: Any, args: tuple) -> Any:
        if isinstance(func, int):
            func = self.get(func, "function")
        return func(*args)

    def op_system_lib(self) -> Any:
        return SystemLib(self.libs)

    def path(self, path: Any) -> str:
        return confine(self.work, path)

    def upload_target(self, target: Any) -> UploadTarget:
        """Where an upload to ``target`` goes (its folders made, opened inside the work folder)."""
        path, parts = _components(target)
        if not parts:
            raise RPCIsADirectoryError(f"remote path {path!r} is a folder")
        if _PART_RE.match(parts[-1]):
            raise DiscoPermissionError(f"remote name {target!r} is reserved for partial uploads")
        dfd = open_dir_in(self.work, parts[:-1], path, make=True)
        try:
            st = os.stat(parts[-1], dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        except BaseException:
            os.close(dfd)
            raise
        if st is not None and stat.S_ISDIR(st.st_mode):
            os.close(dfd)
            raise RPCIsADirectoryError(f"remote path {target!r} is a folder")
        return UploadTarget(dfd, parts[-1], path)

    def op_upload_check(self, target: Any) -> None:
        """Raise what an upload to ``target`` would raise before its body (nothing sent yet)."""
        os.close(self.upload_target(target).dir_fd)

    @staticmethod
    def write_upload(target: UploadTarget, fill: Any) -> None:
        """Call ``fill(file)`` on a hidden temporary file beside the target, then rename it.

        The rename happens only once ``fill`` returned (a sealed stream verified to
        its last record): a stream that fails leaves no file, not even a part.
        Both names are relative to the folder opened by :meth:`upload_target`.
        """
        dfd = target.dir_fd
        tmp = PART_PREFIX + secrets.token_hex(8)
        try:
            # read-write: a sealed stream spliced in is checked from the file's pages
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | _NOFOLLOW, 0o666, dir_fd=dfd)  # fmt: skip
            try:
                with os.fdopen(fd, "wb") as f:
                    fill(f)
                os.replace(tmp, target.name, src_dir_fd=dfd, dst_dir_fd=dfd)
            except BaseException:
                try:
                    os.unlink(tmp, dir_fd=dfd)
                except OSError:
                    pass
                raise
        finally:
            os.close(dfd)

    def op_download(self, path: str) -> Any:
        fd = open_confined(self.work, path)
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise RPCIsADirectoryError(f"remote path {path!r} is a folder")
            f = os.fdopen(fd, "rb")  # closed by the caller once sent
        except BaseException:
            os.close(fd)
            raise
        return FileSource(f, st.st_size)

    def op_remove(self, path: str) -> None:
        path, parts = _components(path)
        if not parts:
            raise DiscoPermissionError("cannot remove the session's work folder itself")
        dfd = open_dir_in(self.work, parts[:-1], path)
        try:
            try:
                st = os.stat(parts[-1], dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                raise DiscoFileNotFoundError(f"no file {path!r} in the session's work folder") from None  # fmt: skip
            if stat.S_ISDIR(st.st_mode):
                rmtree_at(parts[-1], dfd)  # never follows links
            else:
                os.unlink(parts[-1], dir_fd=dfd)  # a link itself, not what it names
        finally:
            os.close(dfd)

    def op_listdir(self, path: str = ".") -> list:
        path, parts = _components(path or ".")
        fd = open_dir_in(self.work, parts, path)
        try:
            return sorted(n for n in os.listdir(fd) if not _PART_RE.match(n))
        finally:
            os.close(fd)

    def op_load_module(self, path: str, device: Any = None) -> Any:
        full = self.path(path)
        if not os.path.exists(full):
            raise DiscoFileNotFoundError(
                f"no file {path!r} in the session's work folder; upload it first"
            )
        suffix = os.path.splitext(full)[1]
        if suffix == ".tar":
            full = self._link(full)
            suffix = ".so"
        from .ctypes_loader import load_so

        try:
            from disco_core.spi import lookup

            loader = lookup("loader", suffix)
        except Exception:
            if suffix in (".so", ".dylib", ".dll"):
                loader = load_so
            else:
                raise
        return loader(full, as_device(device))

    def op_mod_func(self, module: Any, name: str, restype: Any = None) -> Any:
        if restype is not None:
            from .ctypes_loader import CtypesModule

            if not isinstance(module, (CtypesModule, SystemLib)):
                raise DiscoTypeError(
                    "restype= applies to functions of shared libraries and system_lib() only"
                )
            return module.get_function(name, restype)
        try:
            return module[name]
        except (KeyError, TypeError):
            fn = getattr(module, name, None)
            if fn is None or not callable(fn):
                raise
            return fn

    def op_time_eval(self, module: Any, name: str, device: Any, number: int, repeat: int, min_repeat_ms: float, limit_zero_time_iterations: int, cooldown_interval_ms: float, repeats_to_cooldown: int, restype: Any, args: tuple, cache_flush_bytes: int = 0, f_preproc: str = "") -> list:  # fmt: skip
        """Run ``module[name](*args)`` ``number`` times per repeat; return each repeat's mean (s).

        As TVM's evaluator: while a repeat lasts under ``min_repeat_ms``, ``number``
        grows and the repeat runs again, but a repeat whose measured time is exactly
        zero (a clock too coarse for it) does not grow ``number`` and counts towards
        ``limit_zero_time_iterations``, after which the repeat stops as it is.
        ``f_preproc`` (a global function's name) is called with ``args`` before each
        repeat; with ``cache_flush_bytes``, two arrays of that size on ``device`` are
        copied one into the other before each timed run (TVM's L2 flush).
        """
        fn = self.op_mod_func(module, name, restype) if module is not None else self.op_get_func(name)  # fmt: skip
        preproc = self.op_get_func(f_preproc) if f_preproc else None
        dev = as_device(device)
        sync = (lambda: self.op_dev_sync(dev)) if dev is not None and dev.is_gpu else None
        number, repeat = max(1, int(number)), max(1, int(repeat))
        min_s = float(min_repeat_ms or 0) / 1e3
        zero_limit = max(1, int(limit_zero_time_iterations))
        flush = _CacheFlush(int(cache_flush_bytes or 0), dev) if cache_flush_bytes else None
        fn(*args)  # warm-up, as TVM's evaluator does
        if sync is not None:
            sync()
        results = []
        for i in range(repeat):
            if preproc is not None:
                preproc(*args)
            elapsed, zeros = 0.0, 0
            while True:
                if elapsed > 0:  # too short to measure well: run more times
                    number = int(max(min_s / (elapsed / number) + 1, number * 1.618))
                if flush is not None:
                    flush()
                    if sync is not None:
                        sync()
                elapsed = self._time_once(fn, args, number, sync)
                zeros += elapsed == 0
                if elapsed >= min_s or zeros >= zero_limit:
                    break
            results.append(elapsed / number)
            if cooldown_interval_ms and repeats_to_cooldown and (i + 1) % int(repeats_to_cooldown) == 0:  # fmt: skip
                time.sleep(float(cooldown_interval_ms) / 1e3)
        return results

    @staticmethod
    def _time_once(fn: Any, args: tuple, number: int, sync: Any) -> float:
        t0 = _clock()
        for _ in range(number):
            fn(*args)
        if sync is not None:
            sync()
        return _clock() - t0

    def op_tensor(self, arr: np.ndarray, device: Any = None) -> Any:
        dev = as_device(device) or Device("cpu", 0)
        if dev.device_type == "cpu":
            return np.array(arr, copy=True) if not arr.flags.writeable else arr
        out = dev_empty(arr.shape, arr.dtype, dev)
        out.set(arr)
        return out

    def op_empty(self, shape: Any, dtype: Any, device: Any = None) -> Any:
        return dev_empty(as_shape(shape), as_dtype(dtype), as_device(device))

    def op_tensor_get(self, tensor: Any) -> np.ndarray:
        return to_host(tensor)

    def op_tensor_set(self, tensor: Any, arr: np.ndarray) -> None:
        if arr is tensor:  # received in place (:func:`receive_in_place`)
            return
        if tuple(arr.shape) != tuple(tensor.shape) or arr.dtype != tensor.dtype:
            if arr.size != tensor.size or arr.dtype != tensor.dtype:
                raise DiscoValueError(
                    f"copyfrom: source {arr.dtype}{list(arr.shape)} does not match the remote "
                    f"tensor {tensor.dtype}{list(tensor.shape)}"
                )
            arr = arr.reshape(tensor.shape)
        if isinstance(tensor, np.ndarray):
            np.copyto(tensor, arr)
        else:
            tensor.set(arr)

    def op_dev_sync(self, device: Any) -> None:
        dev = as_device(device)
        if dev is not None and dev.is_gpu:
            import cupy

            with cupy.cuda.Device(dev.device_id):
                cupy.cuda.Device(dev.device_id).synchronize()

    def op_dev_exist(self, device: Any) -> bool:
        dev = as_device(device)
        if dev is None or dev.device_type == "cpu":
            return True
        if dev.is_gpu:
            try:
                import cupy

                return dev.device_id < cupy.cuda.runtime.getDeviceCount()
            except Exception as exc:
                if any(e in str(exc) for e in _GPU_INIT_ERRORS):
                    raise  # the GPUs exist but this process cannot use them: say why
                return False
        return False

    def op_link(self, path: str) -> Any:
        so = self._link(self.path(path))
        f = open(so, "rb")
        return FileSource(f, os.fstat(f.fileno()).st_size)

    def _link(self, tar_path: str) -> str:
        # not in the work folder: it may be shared by sessions and kept
        out_dir = tempfile.mkdtemp(prefix=link_prefix(os.getpid()), dir=self.temp_root)
        self.scratch.append(out_dir)
        with tarfile.open(tar_path) as tar:
            members = []
            for m in tar.getmembers():
                if not m.isfile():
                    continue
                name = os.path.basename(m.name)
                if not name or name.startswith("."):
                    continue
                m.name = name
                members.append(m)
            objs = [m.name for m in members if m.name.endswith((".o", ".obj", ".a"))]
            if not objs:
                raise DiscoValueError(f"{os.path.basename(tar_path)} holds no object files (.o)")
            for m in members:
                src = tar.extractfile(m)
                with open(os.path.join(out_dir, m.name), "wb") as dst:
                    shutil.copyfileobj(src, dst)  # type: ignore[arg-type]  # a regular member
        cc = os.environ.get("CC", "cc")
        so = os.path.join(out_dir, os.path.splitext(os.path.basename(tar_path))[0] + ".so")
        cmd = [cc, "-shared", "-fPIC", "-o", so, *(os.path.join(out_dir, o) for o in objs)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RPCError(f"linking with {cc} failed:\n{proc.stdout}{proc.stderr}")
        return so

    def close(self) -> None:
        """Drop the session's objects and delete its folders (a shared work folder stays).

        Two watchdogs (session time, liveness) may call it at once and ``os._exit``
        right after: a second call returns only once the first is done.
        """
        with self._close_lock:
            if self.closed:
                return
            self.closed = True
            for hook in self.on_close:
                try:
                    hook()
                except Exception:  # noqa: BLE001 - the session's folders go all the same
                    logger.exception("a session's cleanup failed")
            self.objects.clear()
            for d in self.scratch:
                shutil.rmtree(d, ignore_errors=True)
            if self.owns_work:
                shutil.rmtree(self.work, ignore_errors=True)


# --------------------------------------------------------------------------- serving
#: Disco's errors that mix in a built-in exception go to the client under the
#: built-in's name, as the server's own checks reported them before they became
#: Disco errors (``remote FileNotFoundError: ...``).
_REPORTED_AS = {
    DiscoValueError: "ValueError",
    DiscoTypeError: "TypeError",
    DiscoKeyError: "KeyError",
    DiscoFileNotFoundError: "FileNotFoundError",
    DiscoPermissionError: "PermissionError",
    DiscoTimeoutError: "TimeoutError",
    RPCIsADirectoryError: "IsADirectoryError",
    RPCNotADirectoryError: "NotADirectoryError",
}


# What CUDA (CuPy) and ROCm say in a process forked after its parent initialised them.
_GPU_INIT_ERRORS = ("cudaErrorInitializationError", "hipErrorInitializationError")
GPU_AFTER_FORK_HINT = (
    "; a session process of rpc.Server is forked from the server's process, and CUDA "
    "cannot be used in a process forked after its parent initialised CUDA (any CuPy call, "
    "or torch.cuda.is_available(), before rpc.Server(...) was made): create the server "
    "before the first CUDA call, or run it as a process of its own (disco-rpc server)"
)


def _pong(*args: Any) -> Any:
    """``OP_PING``'s answer: its argument, if any (a client putting the connection back
    in step after an interrupted call waits for its own token's answer)."""
    return args[0] if args else None


def error_value(exc: BaseException) -> tuple:
    """``(type name, message, traceback)`` of ``exc``, as an ERROR frame carries it."""
    t = type(exc)
    name = _REPORTED_AS.get(t)
    if name is None:
        name = t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"
    tb = "".join(traceback.format_exception(t, exc, exc.__traceback__))
    text = str(exc)
    if any(e in text for e in _GPU_INIT_ERRORS):
        text += GPU_AFTER_FORK_HINT
    return (name, text, tb)


_SENT = object()  # the reply was sent already (a file stream)
_STREAM_OPS = (OP_UPLOAD, OP_DOWNLOAD, OP_LINK)


def serve_conn(conn: wire.Conn, handler: SessionHandler, live: Any = None) -> None:
    """Answer requests on ``conn`` until the peer leaves. Errors go back as ERROR frames.

    ``live`` (the server's liveness watchdog, optional) has a ``gate``, a lock held
    by this thread (from before the call) whenever it reads ``conn``: from the
    start of each request to the start of its work, and through an upload. While
    the gate is free (a request runs or its reply is being sent) the watchdog may
    take it and read ``conn`` itself. ``live.worker()`` is called when the session
    becomes a Disco worker. With ``live.call_beats``, ``live.calling`` is true from
    the moment a request's head came (on TLS, where OpenSSL forbids a write beside
    a read: once it was read whole, and never during an upload's stream) to the
    moment its reply is encoded, or a download's stream begins; never for the
    request that makes this session a Disco worker. Meanwhile the watchdog sends the
    client heartbeats; ``live.end_call()`` sets it false under ``live.send_lock`` (so
    no heartbeat falls inside the reply). A relay that holds back a large request
    (an ssh tunnel on a slow link) thus keeps its client hearing from the server
    while the request trickles in.
    """
    resolve = handler.resolve
    # a sealed link's bytes are checked when the frame ends: none may reach a tensor first
    direct = None if isinstance(conn.t, wire.SealedTransport) else receive_in_place
    gate = live.gate if live is not None else None
    beats = live is not None and live.call_beats
    # beats while a request is read: a send beside this thread's read (not on TLS)
    early = beats and not isinstance(getattr(conn.t, "inner", conn.t), wire.SSLTransport)
    on_begin = live.begin_call if early else None
    held = True
    while True:
        if not held:
            gate.acquire()  # type: ignore[union-attr]  # released only where there is a gate
            held = True
        try:
            _kind, op, payload = conn.recv(on_handle=resolve, direct=direct, on_begin=on_begin)
        except BaseException as exc:
            _end_call(live, early)
            if isinstance(exc, IntegrityError):
                logger.warning("dropped the session: %s", exc)
            elif isinstance(exc, DesyncError):
                _try_send_error(conn, 0, exc)
            elif isinstance(exc, ProtocolError):
                if _try_send_error(conn, 0, exc):
                    continue
            elif not isinstance(exc, (EOFError, OSError)):
                raise
            return
        if gate is not None and op != OP_UPLOAD:
            gate.release()  # not reading conn until the next request
            held = False
        calling = beats
        if beats:  # (nothing more on the call path of a session without them)
            if op == OP_DISCO_WORKER or (op == OP_UPLOAD and not early):
                _end_call(live, early)  # a worker's frames (or a TLS upload's stream) follow
                calling = False
            elif not early:
                live.calling = True  # on TLS, only now (a download's stream ends it)
        try:
            result = _dispatch(conn, handler, op, payload, live if calling else None)
        except DesyncError as exc:
            _end_call(live, calling)
            _try_send_error(conn, op, exc)
            return
        except IntegrityError as exc:
            _end_call(live, calling)
            logger.warning("dropped the session during %s: %s", OP_NAMES.get(op, op), exc)
            return
        except Exception as exc:
            _end_call(live, calling)
            # a file stream that broke is this connection's end; anything else
            # (user code raising ConnectionError too) is the client's error to see
            if op in _STREAM_OPS and isinstance(exc, (EOFError, ConnectionError)):
                return
            if not _try_send_error(conn, op, exc):
                return
            continue
        except BaseException:
            _end_call(live, calling)
            raise
        if result is _SENT:
            continue
        if op == OP_DISCO_WORKER:
            if live is not None:
                gate.acquire()  # type: ignore[union-attr]  # the core's worker loop reads the socket from now on
                live.worker()
            _start_worker(conn, result)
            return
        # the beats go on while the reply is encoded (a large one takes a while), and
        # end before its first byte: none may fall inside it
        if not _send_result(conn, handler, op, result, live if calling else None):
            return


def _end_call(live: Any, calling: bool) -> None:
    """No more heartbeats to the client, if a call's were going."""
    if calling:
        live.end_call()  # (one being sent is finished first)


def receive_in_place(op: int, value: Any, fills: list) -> tuple[Any, list]:
    """Where a request's buffers go (``Conn.recv``'s ``direct``): a ``copyfrom``'s array
    straight into the tensor it overwrites, when that tensor is a writable contiguous
    NumPy array of the same dtype and size; no array of its own, and no copy after.

    Only on a link without a seal: a sealed frame's bytes are verified when it ends,
    and a relay's changed bytes must never reach an object. A request whose bytes do
    not all come (the client died or cut it) leaves the tensor written in part and
    ends the session; an object that outlives the session (one that a registered
    function returns to the sessions of a ``no_fork`` server) keeps what came.
    """
    if op != OP_TENSOR_SET or len(fills) != 1:
        return value, fills
    try:
        frees, (tensor, arr) = value
    except (TypeError, ValueError):
        return value, fills
    if (
        type(tensor) is np.ndarray
        and type(arr) is np.ndarray
        and tensor.dtype == arr.dtype
        and tensor.size == arr.size
        and tensor.flags.c_contiguous
        and tensor.flags.writeable
    ):
        return (frees, (tensor, tensor)), [(fills[0][0], tensor.reshape(-1).view(np.uint8).data)]
    return value, fills


def _dispatch(conn: wire.Conn, handler: SessionHandler, op: int, payload: Any, live: Any = None) -> Any:  # fmt: skip
    """Run one request; return its result, or ``_SENT`` when it answered by itself.

    ``live``: the watchdog sending the client heartbeats meanwhile (None: none are
    going); a download ends them before its stream starts (the linker of
    ``download_linked_module`` may run long: beats go on while it does).
    """
    if op == OP_UPLOAD:
        return _receive_upload(conn, handler, payload)
    frees, args = payload
    if frees:
        handler.free(frees)
    if op == OP_CALL:
        return args[0](*args[1])
    if op in (OP_DOWNLOAD, OP_LINK):
        try:
            src = handler.op_download(*args) if op == OP_DOWNLOAD else handler.op_link(*args)
        finally:
            _end_call(live, live is not None)
        with src.file:
            conn.send(REPLY, op, src.size)
            conn.send_stream(op, src, src.size)
        return _SENT
    if op == OP_DISCO_WORKER:
        if isinstance(conn.t, wire.SSLTransport) or not hasattr(conn.t, "sock"):
            raise DiscoValueError("a Disco worker needs a plain socket session (no TLS, no pipes)")
        return args
    fn = handler.ops.get(op)
    if fn is None:
        raise ProtocolError(f"unknown operation {op}")
    return fn(*args)


def _receive_upload(conn: wire.Conn, handler: SessionHandler, payload: Any) -> None:
    """An upload: its request says ``(target, size)``, ``size`` bytes of chunks follow."""
    try:
        frees, (target, size) = payload
        size = int(size)
        if size < 0:
            raise DiscoValueError("negative size")
    except (TypeError, ValueError) as exc:
        # the stream's length is unknown: it cannot be skipped
        raise DesyncError(f"malformed upload request: {exc}") from None
    if frees:
        handler.free(frees)
    try:
        full = handler.upload_target(target)
    except Exception:
        conn.skip_stream(OP_UPLOAD, size)
        raise
    handler.write_upload(full, lambda f: conn.recv_stream(OP_UPLOAD, size, sink=f))


def _send_result(conn: wire.Conn, handler: SessionHandler, op: int, result: Any, live: Any = None) -> bool:  # fmt: skip
    """Send a REPLY (an ERROR if it cannot be encoded or is too large); False if the peer left.

    ``live``: the liveness watchdog whose heartbeats to the client go on until the
    reply is encoded (None: none are going).
    """
    try:
        # a tensor's contents go back by value; everything else as handles where needed
        meta, bufs = wire.encode(result, None if op == OP_TENSOR_GET else handler.export)
        conn.check_size(meta, bufs)
    except Exception as exc:
        _end_call(live, live is not None)
        return _try_send_error(conn, op, exc)
    except BaseException:
        _end_call(live, live is not None)
        raise
    _end_call(live, live is not None)
    try:
        conn.send_encoded(REPLY, op, meta, bufs)
        return True
    except OSError:
        return False


def _start_worker(conn: wire.Conn, args: Any) -> None:
    try:
        conn.send(REPLY, OP_DISCO_WORKER, None)
    except OSError:
        return
    run_worker(conn, *args)


def _try_send_error(conn: wire.Conn, op: int, exc: BaseException) -> bool:
    try:
        conn.send(ERROR, op, error_value(exc))
        return True
    except (OSError, EOFError):
        return False
