"""Devices, dtypes, shapes and the host-array helpers."""

from __future__ import annotations

import importlib.util
import pickle

import numpy as np
import pytest

import disco_core as disco
from disco_core import device as dev
from disco_core.testing.funcs import DLPackOnly


@pytest.mark.parametrize(
    "args, expected",
    [
        (("cpu", 0), ("cpu", 0)),
        (("cpu",), ("cpu", 0)),
        (("cuda:1",), ("cuda", 1)),
        (("CUDA", 2), ("cuda", 2)),
        ((2, 0), ("cuda", 0)),
        ((10, 3), ("rocm", 3)),
        (("gpu", 1), ("cuda", 1)),
        (("llvm",), ("cpu", 0)),
        ((disco.Device("rocm", 4),), ("rocm", 4)),
    ],
)
def test_device_forms(args, expected):
    d = disco.Device(*args)
    assert (d.device_type, d.device_id) == expected


@pytest.mark.parametrize(
    "args, exc",
    [
        (("nope",), ValueError),
        (("cuda:x",), ValueError),
        (("cuda:1", 2), ValueError),
        (("cpu", -1), ValueError),
        (("cpu", 1.5), ValueError),
        ((999,), ValueError),
        ((None,), TypeError),
    ],
)
def test_device_errors(args, exc):
    with pytest.raises(exc):
        disco.Device(*args)


def test_device_equality_hash_str_pickle():
    d = disco.Device("cuda", 1)
    assert d == disco.Device("cuda:1") and d == "cuda:1" and d != "cuda:0" and d != "garbage"
    assert hash(d) == hash(disco.Device("cuda", 1))
    assert len({d, disco.Device("cuda:1"), disco.Device("cpu")}) == 2
    assert str(d) == "cuda:1" and "cuda" in repr(d)
    assert pickle.loads(pickle.dumps(d)) == d
    assert d.device_type_code == 2 and d.is_gpu
    assert disco.Device("cpu").device_type_code == 1 and not disco.Device("cpu").is_gpu


def test_as_device():
    assert dev.as_device(None) is None
    d = disco.Device("cpu", 0)
    assert dev.as_device(d) is d
    assert dev.as_device("cuda:2") == disco.Device("cuda", 2)
    assert dev.as_device(("rocm", 1)) == disco.Device("rocm", 1)

    class TorchLike:
        type = "cuda"
        index = 3

    assert dev.as_device(TorchLike()) == disco.Device("cuda", 3)
    with pytest.raises(TypeError):
        dev.as_device(object())


def test_as_dtype():
    assert dev.as_dtype("float32") == np.float32
    assert dev.as_dtype(np.float16) == np.float16
    assert dev.as_dtype(np.dtype("int8")) == np.int8
    assert dev.as_dtype("bool") == np.bool_
    # NumPy parses a name with a comma as Python: a SyntaxError escaped (an attacker check)
    long_shape = "(" + "9" * 5000 + ",)i4"
    for bad in ("not_a_dtype", None, object, "U5", "S3", "O", "datetime64[s]", long_shape):
        with pytest.raises(TypeError):
            dev.as_dtype(bad)


def test_dtype_name_is_numpy_s_name_cached_per_dtype():
    dtypes = [np.dtype(t) for t in ("float32", ">f4", "int8", "bool", "complex128", "V8")]
    dtypes.append(np.dtype([("a", "<i4"), ("b", ">f8")]))
    if importlib.util.find_spec("ml_dtypes") is not None:
        dtypes.append(dev.as_dtype("bfloat16"))
    for _ in range(2):  # the second round comes from the cache
        assert [dev.dtype_name(d) for d in dtypes] == [d.name for d in dtypes]
    assert dev.dtype_name(np.dtype(">f4")) == "float32"
    # the cache is bounded: structured dtypes can be made without end
    for k in range(dev._MAX_DTYPE_NAMES + 10):
        assert dev.dtype_name(np.dtype([(f"f{k}", "u1")])).startswith("void")
    assert len(dev._DTYPE_NAMES) <= dev._MAX_DTYPE_NAMES


def test_bfloat16():
    if importlib.util.find_spec("ml_dtypes") is None:
        with pytest.raises(TypeError, match="ml_dtypes"):
            dev.as_dtype("bfloat16")
    else:
        assert dev.as_dtype("bfloat16").name == "bfloat16"


def test_ml_dtypes_names_are_known_before_ml_dtypes_is_imported(python_run):
    """NumPy knows "float8_e4m3fn" only once ml_dtypes is imported: a worker process
    refused ``sess.empty((3,), float8_e4m3fn)`` that the controller took, until a
    ``bfloat16`` array had been made there (an outside check). A name that is no
    scalar type of ml_dtypes ("finfo") is still unknown."""
    if importlib.util.find_spec("ml_dtypes") is None:
        pytest.skip("ml_dtypes is not installed")
    r = python_run(
        "import sys\n"
        "from disco_core.device import as_dtype\n"
        "assert 'ml_dtypes' not in sys.modules\n"
        "print(as_dtype('float8_e4m3fn'), as_dtype('float8_e5m2'), as_dtype('int4'))\n"
        "try:\n"
        "    as_dtype('finfo')\n"
        "except TypeError as exc:\n"
        "    print('refused:', exc)\n"
    )
    assert r.returncode == 0, r.stderr
    assert "float8_e4m3fn float8_e5m2 int4" in r.stdout
    assert "refused: unknown dtype 'finfo'" in r.stdout


def test_as_shape():
    assert dev.as_shape(3) == (3,)
    assert dev.as_shape((2, np.int64(3))) == (2, 3)
    assert dev.as_shape([]) == ()
    with pytest.raises(ValueError):
        dev.as_shape((2, -1))
    for bad in ((2.0,), (True,), "ab", None):
        with pytest.raises(TypeError):
            dev.as_shape(bad)


def test_empty_on_host():
    a = dev.empty((2, 3), "float32")
    assert isinstance(a, np.ndarray) and a.shape == (2, 3) and a.dtype == np.float32
    assert dev.empty(4, "int8", disco.Device("cpu", 0)).shape == (4,)
    with pytest.raises(ValueError):
        dev.empty((2,), "float32", disco.Device("opencl", 0))


def test_empty_on_gpu_without_cupy():
    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed")
    with pytest.raises(RuntimeError, match="CuPy"):
        dev.empty((2,), "float32", "cuda:0")


def test_dlpack_arrays_are_viewed_without_copy():
    host = np.arange(6, dtype="float32")
    view = dev.as_array(DLPackOnly(host))
    assert isinstance(view, np.ndarray) and np.shares_memory(view, host)
    assert dev.to_host(host) is host
    np.testing.assert_array_equal(dev.to_host(DLPackOnly(host)), host)
    assert dev.is_array(host) and dev.is_array(DLPackOnly(host)) and not dev.is_array([1])
    assert dev.to_host(5) == 5
    with pytest.raises(TypeError):
        dev.as_array(object())


def test_a_dtype_object_is_checked_as_a_name_is_and_given_in_native_order():
    """``np.dtype`` objects skipped the check (the error came from every worker, later),
    and a big-endian one made a native array that its own data could not be copied to."""
    for bad in (np.dtype(object), np.dtype([("a", "f4")]), np.dtype("U3"), np.dtype("S2")):
        with pytest.raises(disco.DiscoTypeError, match="cannot live in a worker array"):
            dev.as_dtype(bad)
    assert dev.as_dtype(np.dtype(">f4")) == np.dtype("float32")
    assert dev.as_dtype(">i8").isnative
    assert dev.as_dtype(np.dtype("float16")) is np.dtype("float16")


def test_odd_host_values_are_clear_errors_at_the_call_or_work():
    """Outside check: each of these raised a raw error, or an error from the workers, or
    refused a legitimate big-endian array."""
    with disco.ProcessSession(2) as sess:
        with pytest.raises(disco.DiscoTypeError, match="device ids must be ints, got 'a'"):
            sess.init_ccl("shm", "a")
        with pytest.raises(
            disco.DiscoValueError, match=r"init_ccl\('shm'\): timeout must be a number .*'abc'"
        ):
            sess.init_ccl("shm", timeout="abc")
        with pytest.raises(disco.DiscoTypeError, match=r"init_ccl\('shm'"):
            sess.init_ccl("shm", timeout=lambda: 1)
        sess.init_ccl("shm")
        with pytest.raises(disco.DiscoTypeError, match="module_name must be"):
            sess.import_python_module(3)
        with pytest.raises(disco.DiscoTypeError, match="cannot live in a worker array"):
            sess.empty((2,), np.dtype(object))
        with pytest.raises(disco.DiscoTypeError, match="cannot live in a worker array"):
            sess.broadcast(np.array(["a", "b"]))
        with pytest.raises(disco.DiscoTypeError, match="debug_copy_from: the value cannot be sent"):
            sess.empty((2,), "float32").debug_copy_from(1, lambda: 0)
        big = np.arange(4, dtype=">f4")
        assert sess.broadcast(big).debug_get_from_remote(1).tolist() == [0, 1, 2, 3]
        assert sess.scatter(np.arange(4, dtype=">i8").reshape(2, 2)).debug_get_from_remote(1).tolist() == [2, 3]  # fmt: skip
        assert sess.copy_to_worker_0(big).debug_get_from_remote(0).tolist() == [0, 1, 2, 3]
        # and out again, into a host array of the other byte order (was "shape/dtype
        # mismatch: destination is >f4[4], source is float32[4]": an outside check)
        reg = sess.copy_to_worker_0(np.arange(4, dtype="float32"))
        out = np.zeros(4, ">f4")
        sess.copy_from_worker_0(out, reg)
        assert out.tolist() == [0, 1, 2, 3] and out.dtype.str == ">f4"
        reg.debug_copy_from(1, np.arange(4, dtype=">f4") * 2)
        assert reg.debug_get_from_remote(1).tolist() == [0, 2, 4, 6]
        with pytest.raises(disco.WorkerError, match="shape/dtype mismatch"):
            sess.copy_from_worker_0(np.zeros(4, ">f8"), reg)  # another dtype still is one
        f = sess.get_global_func("disco.worker_id")
        assert [f().debug_get_from_remote(w) for w in range(2)] == [0, 1]


def test_a_shape_no_array_can_have_is_refused_at_the_call():
    """A shape whose array cannot exist (too many bytes, too many dimensions) failed on
    every worker, at the next sync; a relative module name and a path of the wrong type
    raised raw errors."""
    with pytest.raises(disco.DiscoValueError, match="too large for any array"):
        dev.as_shape((2**70,), np.dtype("float32"))
    with pytest.raises(disco.DiscoValueError, match="too large for any array"):
        dev.as_shape((0, 2**62, 4), np.dtype("float32"))  # NumPy counts past a zero too
    with pytest.raises(disco.DiscoValueError, match="at most"):
        dev.as_shape((1,) * 65)
    assert dev.as_shape((0, 2**40), np.dtype("float32")) == (0, 2**40)
    assert dev.as_shape((3, 4), np.dtype("float64")) == (3, 4)
    with disco.ProcessSession(2) as sess:
        for shape in ((2**70,), (2**40, 2**40)):
            with pytest.raises(disco.DiscoValueError, match="too large for any array"):
                sess.empty(shape, "float32")
        with pytest.raises(disco.DiscoTypeError, match="relative name"):
            sess.import_python_module(".foo")
        with pytest.raises(disco.DiscoTypeError, match="path must be a file's path"):
            sess.load_vm_module(3)
        with pytest.raises(disco.DiscoFileNotFoundError, match="no such file"):
            sess.load_vm_module(b"/nonexistent/m.py")  # bytes are a path, as os.fspath says
        f = sess.get_global_func("disco.worker_id")  # the session goes on
        assert [f().debug_get_from_remote(w) for w in range(2)] == [0, 1]
