"""``rpc.with_minrpc``: TVM's compile-function decorator, writing a self-contained minimal server.

``with_minrpc(compile_func)`` returns ``fcompile(output, objects, options=None)``,
which writes at ``output`` one executable file: a zipapp holding the minimal server
(:mod:`disco_rpc.minrpc_server`, Python standard library only) and the objects.
The file speaks on the two pipe descriptors given as its arguments, TVM's popen
convention: ``rpc.PopenSession(output)`` runs it, and so does a server for
``session_constructor_args=["rpc.PopenSession", open(output, "rb").read()]``.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import zipfile
from collections.abc import Callable
from typing import Any

from disco_core import DiscoFileNotFoundError, DiscoTypeError, DiscoValueError

__all__ = [
    "with_minrpc",
    "write_minrpc",
    "MINRPC_SERVER",
    "PROTOCOL",
    "PROTOCOL_NAME",
    "SERVERS",
    "RUNTIMES",
    "NATIVE_SUFFIXES",
    "LINKED_LIBRARY",
]

_HERE = os.path.dirname(os.path.abspath(__file__))
#: The source of the minimal server (the zipapp's ``__main__``).
MINRPC_SERVER = os.path.join(_HERE, "minrpc_server.py")
#: The protocol's numbers (:mod:`disco_rpc.protocol`), which the minimal server imports.
PROTOCOL = os.path.join(_HERE, "protocol.py")
#: The name of :data:`PROTOCOL`'s module in a zipapp, beside its ``__main__``.
PROTOCOL_NAME = "disco_rpc_protocol"
#: The minimal servers there are (TVM's names): only the one over a pair of pipes.
SERVERS = ("posix_popen_server",)
#: The runtimes a minimal server can carry: TVM's default name for the only one here.
RUNTIMES = ("libtvm",)
#: Objects that ``compile_func`` links into one shared library (the others are shipped as they are).
NATIVE_SUFFIXES = (".o", ".obj", ".a", ".c", ".cc", ".cpp", ".cxx", ".s", ".S")
#: The name of that library in the minimal server's build.
LINKED_LIBRARY = "libminrpc_linked.so"


def _files(objects: Any) -> list[str]:
    """The files of ``objects`` (paths or folders, whose files are taken), checked."""
    if objects is None:
        return []
    if isinstance(objects, (str, os.PathLike)):
        objects = [objects]
    out = []
    for item in objects:
        if not isinstance(item, (str, os.PathLike)):
            raise DiscoTypeError(f"objects must be paths, not {type(item).__name__}")
        path = os.fspath(item)
        if os.path.isdir(path):
            for name in sorted(os.listdir(path)):
                full = os.path.join(path, name)
                if os.path.isfile(full):
                    out.append(full)
        elif os.path.isfile(path):
            out.append(path)
        else:
            raise DiscoFileNotFoundError(f"{path} does not exist")
    return out


def write_minrpc(output: str | os.PathLike, files: Any = (), *, interpreter: str = "/usr/bin/env python3") -> str:  # fmt: skip
    """Write the minimal server and ``files`` as one executable zipapp at ``output``.

    Parameters
    ----------
    output : path
        The file to write (replaced if it exists).
    files : path or list of paths
        Files (or folders of files) to ship, under their base names: ``.py`` files
        are imported at start (their ``disco_core.register_func`` calls register
        global functions, through a stand-in when disco_core is not installed on
        the device), shared libraries are loaded and their symbols reach
        ``system_lib()``; every file can be loaded by name with ``load_module``.
    interpreter : str
        The ``#!`` line's interpreter: any Python 3.8+, nothing else installed.

    Returns
    -------
    str
        ``output``.
    """
    paths = _files(files)
    names = [os.path.basename(p) for p in paths]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise DiscoValueError(f"two files to ship share the name(s) {sorted(dup)}")
    output = os.fspath(output)
    tmp = f"{output}.part-{os.getpid()}"
    try:
        with open(tmp, "wb") as raw:
            raw.write(b"#!" + interpreter.encode("utf-8") + b"\n")
            with zipfile.ZipFile(raw, "w", compression=zipfile.ZIP_DEFLATED) as z:
                z.write(MINRPC_SERVER, "__main__.py")
                z.write(PROTOCOL, PROTOCOL_NAME + ".py")  # the server imports it
                for path in paths:
                    z.write(path, "build/" + os.path.basename(path))
        os.chmod(tmp, 0o755)
        os.replace(tmp, output)  # never a half-written executable at output
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return output


def _link(compile_func: Any, objects: list[str], options: list[str], out_dir: str) -> str:
    """Link native ``objects`` into one shared library with ``compile_func``; its path."""
    lib = os.path.join(out_dir, LINKED_LIBRARY)
    opts = ["-shared", "-fPIC", *options]
    if isinstance(compile_func, str):  # a compiler command, as TVM's cross_compiler takes
        cmd = [compile_func, *opts, "-o", lib, *objects]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise DiscoValueError(f"with_minrpc: cannot run the compiler {cmd}: {exc}") from None
        if proc.returncode != 0:
            raise DiscoValueError(
                f"with_minrpc: linking failed ({' '.join(cmd)}):\n{proc.stdout}{proc.stderr}"
            )
    else:
        compile_func(lib, objects, options=opts)
    if not os.path.isfile(lib):
        raise DiscoFileNotFoundError(
            f"with_minrpc: compile_func {compile_func!r} returned without writing the shared "
            f"library {lib} (it is called as compile_func(output, objects, options=[...]))"
        )
    return lib


def with_minrpc(compile_func: Callable[..., Any] | str | None = None, server: str = "posix_popen_server", runtime: str = "libtvm", *, interpreter: str = "/usr/bin/env python3") -> Callable[..., None]:  # fmt: skip
    """Attach the minimal server to a compile function, as TVM's ``rpc.with_minrpc``.

    Parameters
    ----------
    compile_func : callable or str, optional
        Links the native objects (``.o``, ``.a``, C sources: ``NATIVE_SUFFIXES``)
        into a shared library that the server loads into ``system_lib()``. Called as
        TVM's compile functions are, ``compile_func(lib, objects, options=opts)``,
        with ``lib`` a path ending in ``.so`` and ``opts`` ``["-shared", "-fPIC"]``
        plus the caller's options (``tvm.support.cc.create_executable`` and
        ``create_shared`` work as they are); a str is a compiler command (``"gcc"``).
        None when no native object is linked.
    server : str
        The kind of minimal server: ``"posix_popen_server"`` (the only one).
    runtime : str
        The runtime linked into it: ``"libtvm"`` (the only one; here, the minimal
        server's Python runtime).
    interpreter : str
        The ``#!`` line's interpreter of the output (this project's addition).

    Returns
    -------
    fcompile : callable
        ``fcompile(output, objects, options=None)`` writes at ``output`` an
        executable minimal server holding ``objects`` (paths: native objects are
        linked by ``compile_func``; ``.so`` and ``.py`` files and any other file are
        shipped as they are, see ``write_minrpc``). The output serves on the
        pipe descriptors given as its two arguments (TVM's popen convention), or on
        stdin/stdout without arguments. ``fcompile.need_system_lib`` is True, as TVM's.

    Examples
    --------
    >>> fcompile = rpc.with_minrpc("gcc")  # doctest: +SKIP
    >>> fcompile("server.minrpc", ["kernels.o", "funcs.py"])  # doctest: +SKIP
    >>> remote = rpc.PopenSession("server.minrpc")  # doctest: +SKIP
    >>> remote.system_lib()["myadd"](1, 2)  # doctest: +SKIP
    3
    """
    if server not in SERVERS:
        raise DiscoValueError(
            f"with_minrpc: unknown server {server!r}; known: {', '.join(SERVERS)} "
            "(with_minrpc(compile_func, server, runtime) returns fcompile; call "
            "fcompile(output, objects) to write the server)"
        )
    if runtime not in RUNTIMES:
        raise DiscoValueError(f"with_minrpc: unknown runtime {runtime!r}; known: {', '.join(RUNTIMES)}")  # fmt: skip
    if compile_func is not None and not (callable(compile_func) or isinstance(compile_func, str)):
        raise DiscoTypeError(
            "with_minrpc: compile_func must be a compile function, a compiler command (str) "
            f"or None, not {type(compile_func).__name__}"
        )

    def fcompile(output: str | os.PathLike, objects: Any, options: list[str] | None = None) -> None:  # fmt: skip
        files = _files(objects)
        native = [p for p in files if p.endswith(NATIVE_SUFFIXES)]
        shipped = [p for p in files if not p.endswith(NATIVE_SUFFIXES)]
        if options is not None and not isinstance(options, (list, tuple)):
            raise DiscoTypeError(f"options must be a list of str, not {type(options).__name__}")
        with tempfile.TemporaryDirectory(prefix="disco-minrpc-link-") as tmp:
            if native:
                if compile_func is None:
                    raise DiscoValueError(
                        f"with_minrpc: {[os.path.basename(p) for p in native]} must be linked, "
                        "but compile_func is None: give one, e.g. with_minrpc('gcc') or "
                        "with_minrpc(tvm.support.cc.create_executable)"
                    )
                shipped.append(_link(compile_func, native, list(options or []), tmp))
            write_minrpc(output, shipped, interpreter=interpreter)

    fcompile.__name__ = "with_minrpc"
    fcompile.need_system_lib = True  # type: ignore[attr-defined]
    return fcompile
