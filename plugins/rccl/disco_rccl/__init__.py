"""disco-rccl: ``init_ccl("rccl")`` on AMD GPUs, disco-nccl's implementation on CuPy-ROCm."""

from disco_nccl.ccl import NCCLCCL


class RCCLCCL(NCCLCCL):
    """RCCL collectives (CuPy's ROCm build exposes RCCL as ``cupy.cuda.nccl``)."""

    name = "rccl"


__all__ = ["RCCLCCL"]
