"""disco-rccl on a machine without an AMD GPU: registration and the clear error."""

from __future__ import annotations

import pytest

import disco_core as disco
from disco_core import plugins


def test_rccl_is_registered_by_its_own_distribution():
    cls = plugins.lookup("ccl", "rccl")
    assert cls.name == "rccl"
    info = {i.name: i for i in plugins.list_plugins()}
    assert any(
        i.distribution == "disco-rccl" and "rccl" in i.provides.get("ccl", [])
        for i in info.values()
    )


@pytest.mark.timeout(60)
def test_init_ccl_rccl_without_rocm_is_a_clear_error():
    try:
        import cupy

        if getattr(cupy.cuda.runtime, "is_hip", False) and cupy.cuda.runtime.getDeviceCount():
            pytest.skip("an AMD GPU is usable: this test covers machines without one")
    except ImportError:
        pass
    except Exception:  # CuPy-ROCm without a usable device: the error below applies
        pass
    with disco.ThreadedSession(1) as sess:
        # no CuPy, CuPy's CUDA build, or CuPy-ROCm without a GPU: each is named
        with pytest.raises(disco.CCLError, match=r"needs CuPy|CUDA build|needs a GPU"):
            sess.init_ccl("rccl")
        # the session still works
        assert sess.get_global_func("disco.worker_id")().debug_get_from_remote(0) == 0
