"""What a server, a tracker and a proxy have in common: a service in a forked process.

The service process leads a process group of its own (its session processes are
in it too, so :func:`stop_process` ends them all), ignores Ctrl-C (the user's
program handles it), and exits when the process that started it goes away (the
``watch`` pipe it is given reaches its end of file).
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from . import wire

__all__ = ["ServiceProcess", "stop_process", "fork_session"]


def stop_process(pid: int, grace: float = 3.0) -> None:
    """SIGTERM ``pid`` (a process group leader we forked), then SIGKILL its group."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return
        if done:
            break
        time.sleep(0.005)
    else:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
        return
    try:  # session processes left behind in the group
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class ServiceProcess:
    """Base of :class:`~disco_rpc.Server`, :class:`~disco_rpc.Tracker` and :class:`~disco_rpc.Proxy`.

    A subclass sets ``host`` and ``port`` and calls :meth:`_fork`; it is a context
    manager, and :meth:`terminate` (also run when it is dropped) stops the process.
    """

    #: The name in ``repr``.
    _kind = "service"
    host: str
    port: int
    pid: int | None = None
    _watch: int | None = None

    def _fork(self, serve: Callable[[int], None]) -> int:
        """Fork the service process, which runs ``serve(watch_fd)`` and exits.

        It exits with 0 when ``serve`` returns or raises ``SystemExit``, else with 1
        after printing the traceback.
        """
        watch_r, watch_w = os.pipe()  # closes when this process goes: the service then exits
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                os.close(watch_w)
                wire.close_inherited()
                os.setpgid(0, 0)
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                serve(watch_r)
            except SystemExit:
                pass
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                os._exit(code)
        os.close(watch_r)
        self._watch = watch_w
        self.pid = pid
        return pid

    @property
    def addr(self) -> tuple[str, int]:
        """``(host, port)``, as given to ``connect`` and ``tracker_addr``."""
        return (self.host, self.port)

    def terminate(self) -> None:
        """Stop the process and every process it started; a second call does nothing."""
        pid, self.pid = self.pid, None
        if pid is None:
            return
        stop_process(pid)
        try:
            os.close(self._watch)
        except (OSError, TypeError):
            pass
        self._cleanup()

    def _cleanup(self) -> None:
        """What a subclass removes after its process stopped."""

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.terminate()

    def __del__(self) -> None:
        try:
            self.terminate()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"<disco_rpc.{self._kind} {self.host}:{self.port} pid={self.pid}>"


def fork_session(run: Callable[[], None]) -> tuple[int, int | None]:
    """Fork a session process that runs ``run()`` and ends (code 1 when it raised).

    Returns ``(pid, pidfd)``; the pidfd (None where the kernel has none) becomes
    readable when the child ends, so a select loop sees it at once.
    """
    sys.stdout.flush()  # what is buffered is printed once, not once per process
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            run()
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pidfd = None
    return pid, pidfd
