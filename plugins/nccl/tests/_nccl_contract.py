"""What the conformance kit needs to know about NCCL (shared by the stand-in and GPU runs)."""

from __future__ import annotations

import disco_core as disco
from disco_core.testing import CCLContract, session_maker

#: ThreadedSessions with ``init_ccl("nccl")``: the kit's ``make_session``.
threaded_nccl = session_maker(disco.ThreadedSession, "nccl")


class NCCLContract(CCLContract):
    """The kit's settings for NCCL (subclass it and set ``num_workers``)."""

    # NCCL's types that CuPy can hold (no bool, int16 or bfloat16); NCCL has no timeout.
    dtypes = ("int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "float32", "float64")  # fmt: skip
    timeout_options = None
    avg_exact = False  # ncclAvg multiplies by 1/n before it sums
