"""disco-nccl: GPU collectives for Disco through NCCL (CuPy's ``cupy.cuda.nccl``).

``session.init_ccl("nccl", *device_ids)`` binds worker ``w`` to GPU
``device_ids[w % len(device_ids)]`` (all GPUs in order when none are given), makes
that GPU the worker's default device (``empty`` allocates there, as CuPy arrays)
and runs every collective and point-to-point operation through NCCL.
"""

from .ccl import NCCLCCL, NCCLRendezvous, nccl_dtype, reduce_op

__all__ = ["NCCLCCL", "NCCLRendezvous", "nccl_dtype", "reduce_op"]
