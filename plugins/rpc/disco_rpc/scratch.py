"""Scratch folders that a later run removes when the process that made them was killed.

A server removes its scratch folder (uploads, session work folders) when it stops;
a server killed with ``SIGKILL`` cannot, and its folder stayed in the temporary
directory for good (outside check). Each folder made here holds an ``flock`` on a
lock file inside it for as long as its maker, or a process forked from it, lives;
the kernel drops the lock when the last of them dies, however it dies. The next
folder of the same kind that is made first removes every folder of that kind whose
lock is free. A lock, not a process id: a process id may be reused, or belong to
another PID namespace that shares the temporary directory.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import stat
import tempfile
import time

from .stops import stops_held

__all__ = ["LOCK_NAME", "owned_scratch_dir", "release", "remove", "sweep_abandoned", "stops_held"]

logger = logging.getLogger("disco_rpc")

#: The lock file inside each folder; a folder without one (made by an older version,
#: or still being made) is never removed by :func:`sweep_abandoned`.
LOCK_NAME = ".disco-owner.lock"


def owned_scratch_dir(prefix: str, dir: str | None = None) -> tuple[str, int]:
    """Make a private folder (``tempfile.mkdtemp``) that holds its owner's lock.

    Folders of the same ``prefix`` in ``dir`` (the temporary directory by default)
    whose owners are gone are removed first.

    Parameters
    ----------
    prefix : str
        The start of the folder's name, as for ``tempfile.mkdtemp``.
    dir : str, optional
        Where to make it.

    Returns
    -------
    path, lock_fd : tuple of str and int
        The folder, and the descriptor that holds its lock: keep it open for as long
        as the folder is in use (processes forked meanwhile share it), then
        :func:`release` it.
    """
    path = ""
    fd = -1
    # (a SIGTERM between the folder and its lock left a lockless folder; one in Python's
    # first look at the temporary folder, an empty file of a random name there)
    with stops_held():
        sweep_abandoned(prefix, dir)
        try:
            path = tempfile.mkdtemp(prefix=prefix, dir=dir)
            # locked under a temporary name, then renamed: a sweep never sees the lock
            # file of a folder still being made unlocked
            fd, tmp = tempfile.mkstemp(prefix=".lock-", dir=path)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(tmp, os.path.join(path, LOCK_NAME))
        except BaseException:
            if fd >= 0:
                os.close(fd)
            if path:
                shutil.rmtree(path, ignore_errors=True)
            raise
    return path, fd


def remove(path: str, within: float = 2.0) -> bool:
    """Remove a folder of :func:`owned_scratch_dir`: its contents first, its lock file
    last, retried for ``within`` seconds; True once it is gone.

    A session process forked from the owner may still write there as the owner removes
    it (it ends when its server does, a moment later): a bare ``rmtree`` then failed on
    the new entry, having deleted the lock file first, and left a folder that no sweep
    removes (one without a lock file is never taken for an abandoned one). A fresh-clone
    run of the suites left one, 1 run in 3. Whatever is left now keeps its lock file,
    which the next sweep finds free once those processes are gone.
    """
    deadline = time.monotonic() + within
    while True:
        try:
            names = os.listdir(path)
        except FileNotFoundError:
            return True
        except OSError:
            names = []
        for name in names:
            if name == LOCK_NAME:
                continue
            entry = os.path.join(path, name)
            if os.path.isdir(entry) and not os.path.islink(entry):
                shutil.rmtree(entry, ignore_errors=True)
            else:
                try:
                    os.unlink(entry)
                except OSError:
                    pass
        lock = os.path.join(path, LOCK_NAME)
        try:
            if set(os.listdir(path)) <= {LOCK_NAME}:
                try:
                    os.unlink(lock)
                except FileNotFoundError:
                    pass
                os.rmdir(path)
                return True
        except FileNotFoundError:
            return True
        except OSError:
            # An entry came between the look and the rmdir: the lock file goes back (free:
            # its owner is done), so that a folder left now is still swept (its own test
            # found that window under load)
            try:
                with open(lock, "a"):
                    pass
            except OSError:
                pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def release(lock_fd: int | None) -> None:
    """Close a lock descriptor of :func:`owned_scratch_dir` (None: nothing)."""
    if lock_fd is not None:
        try:
            os.close(lock_fd)
        except OSError:
            pass


def sweep_abandoned(prefix: str, dir: str | None = None) -> list[str]:
    """Remove the folders of ``prefix`` in ``dir`` whose owners are gone; return them.

    Only folders of this user, that are not symbolic links and hold an unlocked
    :data:`LOCK_NAME`, are removed (``shutil.rmtree`` does not follow links). Errors
    are logged, never raised: a sweep must not keep a server from starting.
    """
    root = dir if dir is not None else tempfile.gettempdir()
    removed: list[str] = []
    try:
        names = [n for n in os.listdir(root) if n.startswith(prefix)]
    except OSError:
        return removed
    uid = os.getuid()
    for name in names:
        path = os.path.join(root, name)
        try:
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
                continue
            # O_NONBLOCK: a FIFO by that name would block the open (and every server start)
            fd = os.open(os.path.join(path, LOCK_NAME), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                continue
        except OSError:
            continue  # gone, not ours, or no lock file (an older version's, or being made)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # its owner lives
            remove(path, within=0.0)
            removed.append(path)
            logger.info("removed %s: the process that made it is gone", path)
        finally:
            os.close(fd)
    return removed
