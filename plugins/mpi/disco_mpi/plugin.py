"""The disco-mpi plugin: registers the CCL ``"mpi"`` and the channel ``"mpi"``."""

from __future__ import annotations

from disco_core import hookimpl


@hookimpl
def disco_register_ccls():
    from .ccl import MPICCL

    return {"mpi": MPICCL}


@hookimpl
def disco_register_channels():
    from .channel import MPIChannel

    return {"mpi": MPIChannel}
