"""A server program run as a child process and joined by two pipes (TVM's popen convention).

Used by :class:`disco_rpc.PopenSession` and by a server's ``rpc.PopenSession``
session constructor. As TVM's ``rpc.CreatePipeClient``, the program gets the
numbers of its two pipe ends as its last two arguments (``<read fd> <write fd>``,
the convention of the servers :func:`disco_rpc.with_minrpc` writes); the same
pipes are also its stdin and stdout, so a program that serves on those
(:func:`disco_rpc.serve_stdio`) works too. A full argument list is run as given,
on stdin/stdout only.

The child's session folder and temporary files (``TMPDIR``) lie in one folder
that this side makes and removes, so a child that is killed leaves nothing.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from . import auth, wire
from .errors import RPCError
from .protocol import POPEN_PARENT_ENV, POPEN_WORK_DIR_ENV

__all__ = ["PipeChild", "child_argv"]

#: Seconds a child whose pipes were closed has to exit before it is killed.
EXIT_GRACE = 5.0


def child_argv(binary: Any, temp: str) -> tuple[list[str], bool]:
    """The command for ``binary`` and whether it takes TVM's two pipe-fd arguments.

    A path or the bytes of an executable (written under ``temp``) is TVM's form;
    a ``.py`` path runs with this interpreter; a list is a full command, as given.
    """
    if isinstance(binary, (list, tuple)):
        if not binary:
            raise RPCError("PopenSession: the command is empty")
        return [os.fspath(a) for a in binary], False
    if isinstance(binary, (bytes, bytearray, memoryview)):
        if not len(binary):
            raise RPCError("PopenSession: the binary is empty (0 bytes)")
        path = os.path.join(temp, "server.minrpc")
        with open(path, "wb") as f:
            f.write(binary)
        os.chmod(path, stat.S_IRUSR | stat.S_IXUSR)
        return [path], True
    if not isinstance(binary, (str, os.PathLike)):
        raise RPCError(
            f"PopenSession takes a path, the bytes of an executable or a command list, "
            f"not {type(binary).__name__}"
        )
    path = os.path.abspath(os.fspath(binary))
    if not os.path.isfile(path):
        raise RPCError(f"{path} does not exist")
    if path.endswith(".py"):
        return [sys.executable, path], True
    if not os.access(path, os.X_OK):
        raise RPCError(f"{path} is not executable")
    return [path], True


class PipeChild:
    """A server program started as a child process, spoken to over two pipes.

    Parameters
    ----------
    binary : str, bytes or list of str
        See :func:`child_argv`.
    max_message_bytes : int
        The largest frame accepted from the child.
    temp_root : str, optional
        Where the child's folder is made (the system's temporary folder by default).
    die_with_parent : bool
        Ask the child (``$DISCO_RPC_POPEN_PARENT``; minimal servers honour it on
        Linux) to have the kernel kill it when the thread that started it ends: for a
        server's session, whose process may be killed outright.

    Attributes
    ----------
    conn : disco_rpc.wire.Conn
        The connection to the child; closing it ends the child (:meth:`close`).
    proc : subprocess.Popen
        The child.
    work_dir : str
        The session folder handed to the child (``DISCO_RPC_POPEN_WORK_DIR``).
    """

    def __init__(self, binary: Any, *, max_message_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES, temp_root: str | None = None, die_with_parent: bool = False) -> None:  # fmt: skip
        self.closed = False
        self._close_lock = threading.Lock()
        self._closed_event = threading.Event()
        self.proc: subprocess.Popen | None = None
        self._root = tempfile.mkdtemp(prefix="disco-rpc-popen-", dir=temp_root)
        try:
            argv, fd_args = child_argv(binary, self._root)
            self.label = os.path.basename(argv[0]) if not fd_args else os.path.basename(argv[-1])
            self.argv = argv
            self.work_dir = os.path.join(self._root, "work")
            tmp = os.path.join(self._root, "tmp")
            os.mkdir(self.work_dir, 0o700)
            os.mkdir(tmp, 0o700)
            env = {**os.environ, POPEN_WORK_DIR_ENV: self.work_dir, "TMPDIR": tmp}
            env.pop(POPEN_PARENT_ENV, None)
            if die_with_parent:
                env[POPEN_PARENT_ENV] = str(os.getpid())
            self._spawn(argv, fd_args, env)
        except BaseException:
            shutil.rmtree(self._root, ignore_errors=True)
            raise
        self.conn = _ChildConn(wire.PipeTransport(self._fds[0], self._fds[1]), max_message_bytes)
        self.conn.child = self

    def _spawn(self, argv: list[str], fd_args: bool, env: dict) -> None:
        c_read, p_write = os.pipe()  # parent -> child
        p_read, c_write = os.pipe()  # child -> parent
        cmd = argv + [str(c_read), str(c_write)] if fd_args else argv
        try:
            for attempt in range(20):
                try:
                    self.proc = subprocess.Popen(
                        cmd, stdin=c_read, stdout=c_write, pass_fds=(c_read, c_write), env=env
                    )
                    break
                except OSError as exc:
                    # a binary just written can be busy while another thread's fork
                    # still holds it open for writing: try again shortly
                    if exc.errno != errno.ETXTBSY or attempt == 19:
                        raise RPCError(f"PopenSession: cannot start {cmd[0]}: {exc}") from None
                    time.sleep(0.01)
        except BaseException:
            for fd in (p_read, p_write):
                os.close(fd)
            raise
        finally:
            # only the child holds its ends: its exit is then an end of file here
            os.close(c_read)
            os.close(c_write)
        self._fds = (p_read, p_write)
        wire.CLOSE_IN_CHILD.update(self._fds)  # a server forked later does not keep them

    def handshake(self, timeout: float) -> None:
        """Run the (token-free) handshake; raise :class:`RPCError` naming why it failed."""
        t = self.conn.t
        t.settimeout(timeout)
        try:
            auth.client_handshake(self.conn, "", None, peer="popen server")
        except TimeoutError:
            raise RPCError(
                f"{self.argv!r} did not answer the disco-rpc handshake within {timeout:g} s: "
                "it is not a disco-rpc server (it must call disco_rpc.serve_stdio() or be "
                "`python -m disco_rpc stdio` or a with_minrpc output), or it hangs before serving"
            ) from None
        except OSError as exc:  # RPCAuthError included: a closed pipe, an echo, ...
            code = self.exit_code(1.0)  # a closed pipe: the child is exiting
            if code is not None:
                raise RPCError(
                    f"the server {self.argv!r} exited with code {code} before it served"
                ) from None
            if isinstance(exc, RPCError):
                raise
            raise RPCError(f"the server {self.argv!r} did not start: {exc}") from exc
        finally:
            t.settimeout(None)

    def exit_code(self, wait: float = 0.0) -> int | None:
        """The child's exit status, waiting up to ``wait`` seconds; None while it runs."""
        try:
            return self.proc.wait(timeout=wait)  # type: ignore[union-attr]  # started
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()

    def close(self, grace: float = EXIT_GRACE) -> None:
        """Close the pipes, let the child exit (killed after ``grace`` s), remove its files.

        Safe from several threads: ``grace`` 0 kills the child at once even while
        another thread is giving it its grace period, and every call returns only
        once the child is gone (a session process may ``os._exit`` right after).
        """
        if grace <= 0:
            self.kill()
        with self._close_lock:
            first = not self.closed
            self.closed = True
        if not first:
            self._closed_event.wait()
            return
        try:
            wire.CLOSE_IN_CHILD.difference_update(self._fds)
            wire.Conn.close(self.conn)
            if self.exit_code(grace) is None:
                self.proc.kill()  # type: ignore[union-attr]  # it ran: it has an exit code
                self.proc.wait()  # type: ignore[union-attr]
            shutil.rmtree(self._root, ignore_errors=True)
        finally:
            self._closed_event.set()


class _ChildConn(wire.Conn):
    """The connection to a :class:`PipeChild`; closing it ends the child."""

    child: PipeChild

    def close(self) -> None:
        self.child.close()
