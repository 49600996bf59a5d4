"""Starting MPI in a process, finding the launcher, and borrowing a launcher's PMI.

MPI is initialised lazily, the first time the plugin needs it, with
``MPI_THREAD_MULTIPLE``: worker 0 lives in the controller's process and its
commands run on the worker thread or on the controller's thread (whichever gets
there first), so MPI calls come from more than one thread, never at the same time.

Joining processes that were not started by ``mpiexec``
-----------------------------------------------------
Two processes that each called ``MPI_Init`` as *singletons* cannot
``MPI_Comm_connect``/``MPI_Comm_accept`` with MPICH 5.0 (both singletons get the
same world id: "Local and remote groups in MPI_Intercomm_create must not overlap",
MPICH issue 7805), while one singleton and processes started under
``mpiexec -n 1`` can. So a worker process that is not an MPI process yet borrows a
launcher: it starts ``mpiexec -n 1 python -m disco_mpi._donor SOCKET``; the donor,
started by the launcher, hands its PMI connection (the ``PMI_FD`` socket and the
``PMI_*`` variables) back to the worker over a Unix socket and waits. The worker
then initialises MPI as if the launcher had started it (a world of its own, with a
unique id) and connects to worker 0. The donor exits when the worker does.

MPICH's shared-memory segment
-----------------------------
``MPI_Init`` in MPICH 5 (ch4, POSIX shared memory) creates, or attaches to, a
segment ``/dev/shm/mpich_shm_<world id>_<node id>`` that the local processes of one
MPI world share, and unlinks it only in ``MPI_Finalize`` (``MPL_initshm_freeall``).
A process that ends without finalizing (a Disco controller never does: it may open
another session later and MPI cannot be initialised twice; a worker ends with
``os._exit`` or is killed) leaves its segment behind, about 1 MiB each. Here every
process is alone in its world (a singleton controller, a worker whose world is the
one of its donor's ``mpiexec -n 1``), so no other process will ever open that name:
:func:`release_shm` unlinks it right after ``MPI_Init`` (the mapping stays valid,
like an unlinked file that is still open). Nothing is left in ``/dev/shm`` then,
whatever way the process ends.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from disco_core import CCLError

__all__ = [
    "mpi",
    "is_initialized",
    "launcher",
    "borrow_pmi",
    "library_version",
    "release_shm",
]

_LOCK = threading.RLock()
_MPI: Any = None
_DONOR: subprocess.Popen | None = None


def launcher() -> str | None:
    """The ``mpiexec`` to use: ``$DISCO_MPIEXEC``, the one beside Python, or on ``PATH``."""
    env = os.environ.get("DISCO_MPIEXEC")
    if env:
        return env
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.access(here, os.X_OK):
        return here
    return shutil.which("mpiexec") or shutil.which("mpirun")


def is_initialized() -> bool:
    """True when MPI is initialised in this process (without initialising it)."""
    if _MPI is not None:
        return True
    if "mpi4py.MPI" not in sys.modules:
        return False
    return bool(sys.modules["mpi4py.MPI"].Is_initialized())


def _launched() -> bool:
    """True when a launcher started this process (it can talk to a process manager)."""
    keys = ("PMI_FD", "PMI_PORT", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "SLURM_STEP_ID")
    return any(k in os.environ for k in keys)


def mpi(borrow: bool = False, timeout: float = 60.0, finalize: bool = False) -> Any:
    """Return ``mpi4py.MPI``, initialising MPI (``THREAD_MULTIPLE``) when needed.

    With ``borrow``, a process that was not started by a launcher first borrows one
    (see the module's docstring) so that it can connect to other MPI processes.
    """
    global _MPI
    with _LOCK:
        if _MPI is not None:
            return _MPI
        try:
            import mpi4py
        except ImportError as exc:  # pragma: no cover - a dependency of the plugin
            raise CCLError(
                f"the 'mpi' CCL needs mpi4py ({exc}); install the plugin with pip install "
                "./plugins/mpi from a clone of the Disco repository (not yet on PyPI)"
            ) from exc
        if "mpi4py.MPI" not in sys.modules:
            mpi4py.rc.thread_level = "multiple"
            # A finalize at exit would wait for peers that are already gone, except in
            # an MPI job (the ``mpi`` channel), where every rank finalizes together.
            mpi4py.rc.finalize = bool(finalize)
            if borrow and not _launched():
                borrow_pmi(timeout)
        try:
            from mpi4py import MPI
        except Exception as exc:
            raise CCLError(f"MPI failed to initialise: {type(exc).__name__}: {exc}") from exc
        if not MPI.Is_initialized():
            MPI.Init_thread(MPI.THREAD_MULTIPLE)
        _MPI = MPI
        release_shm()
        return MPI


#: MPICH's POSIX segments (``mpich_shm_%x_%d``; ``mpich_vci_%x_%d`` with several VCIs)
#: as ``/proc/self/maps`` shows them while their name still exists.
_SEGMENT = re.compile(r"/dev/shm/mpich_(?:shm|vci)_[0-9a-f]+_[0-9]+")


def release_shm(all_attached: bool = False) -> list[str]:
    """Unlink the MPICH shared-memory segments this process has mapped; return their paths.

    MPICH needs a segment's name only until every local process of the same MPI
    world has attached (which each does inside ``MPI_Init``), and removes it only in
    ``MPI_Finalize``. So the name is removed here, which is safe when this process is
    its world's only member (the default check), or when the caller knows that every
    process of its world is past ``MPI_Init`` (``all_attached``, after a collective
    on ``MPI_COMM_WORLD``). Only files this process has mapped are touched, and only
    when the name still refers to the very file mapped (same device and inode).
    Linux only (``/proc/self/maps``); elsewhere, and when MPI is not initialised
    through this module, it does nothing.
    """
    MPI = _MPI
    if MPI is None:
        return []
    try:
        if not all_attached and MPI.COMM_WORLD.Get_size() != 1:
            return []
        with open("/proc/self/maps") as f:
            lines = f.readlines()
    except Exception:  # noqa: BLE001 - no /proc, or MPI refuses: nothing to do
        return []
    removed: list[str] = []
    seen: set[str] = set()
    for line in lines:
        fields = line.split(None, 5)
        if len(fields) < 6:
            continue
        path = fields[5].rstrip("\n")
        if path in seen or not _SEGMENT.fullmatch(path):
            continue  # an unlinked one shows as "PATH (deleted)"
        seen.add(path)
        try:
            major, minor = (int(x, 16) for x in fields[3].split(":"))
            inode = int(fields[4])
            st = os.stat(path)
            if (st.st_ino, os.major(st.st_dev), os.minor(st.st_dev)) != (inode, major, minor):
                continue
            os.unlink(path)
            removed.append(path)
        except (OSError, ValueError):
            continue
    return removed


_ABORT_REASON: list[str] = []


def abort_at_exit(reason: str) -> None:
    """End the MPI job with ``MPI_Abort`` (code 1) when this process exits, saying why.

    For rank 0 of a job with a rank that stopped answering: ``MPI_Finalize`` waits for
    it, and so does the launcher, for good. Registered after MPI's own finalizer, so
    it runs first (``atexit`` runs the last registered first); the program's code after
    the session still runs.
    """
    if not _ABORT_REASON:
        atexit.register(_abort_now)
    _ABORT_REASON[:] = [reason]


def _abort_now() -> None:
    MPI = _MPI
    if MPI is None or not _ABORT_REASON:
        return
    print(f"disco-mpi: aborting the MPI job: {_ABORT_REASON[0]}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    # the launcher forwards what a rank wrote through a pipe: the abort's teardown
    # raced it, and the job ended without its reason (1 of 4 runs, an outside check)
    time.sleep(0.3)
    MPI.COMM_WORLD.Abort(1)


def thread_level_ok(MPI: Any) -> bool:
    return MPI.Query_thread() >= MPI.THREAD_SERIALIZED


def library_version() -> str:
    return mpi().Get_library_version().strip().splitlines()[0]


def borrow_pmi(timeout: float = 60.0) -> None:
    """Start ``mpiexec -n 1 python -m disco_mpi._donor`` and adopt its PMI connection."""
    global _DONOR
    exe = launcher()
    if exe is None:
        raise CCLError(
            "the 'mpi' CCL needs an MPI launcher (mpiexec) to let worker processes join: "
            "none found beside Python or on PATH (pip install mpich, or set DISCO_MPIEXEC)"
        )
    listener, address, cleanup = _donor_listener()
    try:
        listener.settimeout(0.2)
        env = {k: v for k, v in os.environ.items() if not k.startswith("PMI_")}
        _DONOR = subprocess.Popen(
            [exe, "-n", "1", sys.executable, "-m", "disco_mpi._donor", address],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
            start_new_session=False,
        )
        deadline = time.monotonic() + timeout
        while True:
            try:
                conn, _ = listener.accept()
                if _same_user(conn):
                    break
                conn.close()  # (an abstract socket has no permissions: another user's process)
            except TimeoutError:
                pass
            code = _DONOR.poll()
            if code is not None:
                raise CCLError(
                    f"the MPI launcher {exe} exited with code {code} before handing over "
                    "its PMI connection"
                )
            if time.monotonic() > deadline:
                _DONOR.kill()
                raise CCLError(f"the MPI launcher {exe} did not start within {timeout:.0f} s")
        conn.settimeout(timeout)
        msg, fds, _, _ = socket.recv_fds(conn, 1 << 16, 4)
        if not fds:
            raise CCLError(f"the MPI launcher {exe} handed over no PMI connection")
        env_in = json.loads(msg.decode())
        env_in["PMI_FD"] = str(fds[0])
        os.environ.update(env_in)
        # Keep ``conn`` open for the life of this process: its EOF ends the donor.
        _KEEP.append(conn)
    finally:
        listener.close()
        cleanup()


def _donor_listener() -> tuple[socket.socket, str, Any]:
    """A Unix socket for the donor to call: ``(listener, address, cleanup)``.

    On Linux it is an abstract socket (``address`` starts with ``@``): no file, so a
    worker killed while it waits leaves nothing behind; :func:`_same_user` stands in
    for the permissions an abstract socket lacks. Elsewhere it lives in a private
    temporary folder that ``cleanup()`` removes.
    """
    if sys.platform.startswith("linux"):
        name = f"disco-mpi-{os.getpid()}-{os.urandom(8).hex()}"
        bind_to, address, cleanup = "\0" + name, "@" + name, lambda: None
    else:
        folder = tempfile.mkdtemp(prefix="disco-mpi-")
        bind_to = address = os.path.join(folder, "pmi")

        def cleanup() -> None:
            shutil.rmtree(folder, ignore_errors=True)

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(bind_to)
        listener.listen(4)
    except BaseException:
        listener.close()
        cleanup()
        raise
    return listener, address, cleanup


def _same_user(conn: socket.socket) -> bool:
    """Whether the process at the other end of ``conn`` runs as this process's user."""
    so_peercred = getattr(socket, "SO_PEERCRED", None)
    if so_peercred is None:
        return True  # (the private folder's permissions hold instead)
    creds = conn.getsockopt(socket.SOL_SOCKET, so_peercred, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1] == os.getuid()


_KEEP: list[socket.socket] = []
