"""disco-mpi: MPI for Disco for Python.

* the CCL ``"mpi"``: ``session.init_ccl("mpi")`` on any session whose workers are
  processes (ProcessSession, SocketSession, the ``mpi`` channel);
* the channel ``"mpi"``: ``mpiexec -n N python script.py`` where the script calls
  ``disco.Session.create("mpi")`` (or :func:`MPISession`) gives an N-worker session;
* the command ``disco-mpi run -n N script.py``.
"""

from __future__ import annotations

from ._runtime import launcher
from .ccl import MPICCL, MPIRendezvous
from .channel import MPIChannel, MPISession, rank, world_size

__version__ = "0.1.0"

__all__ = [
    "MPICCL",
    "MPIRendezvous",
    "MPIChannel",
    "MPISession",
    "rank",
    "world_size",
    "launcher",
    "__version__",
]
