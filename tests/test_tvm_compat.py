"""TVM's documented Disco behaviours, for code ported from ``tvm.runtime.disco``.

Each test names the behaviour of TVM's ``python/tvm/runtime/disco/session.py`` (or
its C++ worker) it checks. The ``test_tvm_*`` tests are ported from TVM's
``tests/python/disco/test_ccl.py`` and ``test_session.py`` (the shm CCL in place of
NCCL, ``debug_get_from_remote`` returning NumPy in place of ``.numpy()``).
"""

from __future__ import annotations

import gc
import os
import sys
import textwrap
import uuid

import numpy as np
import pytest

import disco_core as disco
from disco_core import registry
from disco_core.ccl.base import average_in_place

pytestmark = pytest.mark.timeout(60)

FUNCS = "disco_core.testing.funcs"
KINDS = {"threaded": disco.ThreadedSession, "process": disco.ProcessSession}


@pytest.fixture(params=sorted(KINDS))
def kind(request):
    return request.param


def _open(kind: str, num_workers: int, num_groups: int = 1) -> disco.Session:
    sess = KINDS[kind](num_workers, num_groups)
    sess.import_python_module(FUNCS)
    return sess


def _count(sess: disco.Session, worker: int) -> int:
    """Registers holding a value on ``worker`` (the count's own register excluded)."""
    return sess.call_packed("disco.register_count").debug_get_from_remote(worker) - 1


# ---------------------------------------------------------------- 1. DPackedFunc / DModule
def test_dpackedfunc_and_dmodule_take_tvms_constructor_order(tmp_path, kind):
    mod = tmp_path / "compat_mod.py"
    mod.write_text("def twice(x):\n    return 2 * x\n")
    with _open(kind, 2) as sess:
        f = disco.DPackedFunc(sess.get_global_func("testing.add"), sess)
        assert [f(2, 3).debug_get_from_remote(w) for w in range(2)] == [5, 5]
        # TVM's load_vm_module: DModule(func(path, device), self)
        m = disco.DModule(sess.call_packed("disco.load_module", str(mod), None), sess)
        assert m["twice"](21).debug_get_from_remote(1) == 42
        # TVM's DModule.__getitem__: DPackedFunc(func(self, name, False), self.session)
        g = disco.DPackedFunc(sess.call_packed("disco.module_get_function", m, "twice"), sess)
        assert g(4).debug_get_from_remote(0) == 8


def test_wrapper_and_dref_share_the_register_freed_once(kind):
    with _open(kind, 2) as sess:
        echo = sess.get_global_func("testing.echo")
        sess.sync_worker_0()
        before = [_count(sess, w) for w in range(2)]
        dref = sess.get_global_func("testing.add")
        reg = dref.reg_id
        wrapped = disco.DPackedFunc(dref, sess)
        again = disco.DPackedFunc(wrapped, sess)  # a wrapper of a wrapper shares it too
        assert wrapped.reg_id == again.reg_id == reg
        del dref
        gc.collect()
        echo(None)  # would carry the kill of the register, had the DRef freed it
        assert wrapped(1, 2).debug_get_from_remote(1) == 3
        del wrapped
        gc.collect()
        echo(None)
        assert again(3, 4).debug_get_from_remote(1) == 7  # the last handle keeps it
        del again
        gc.collect()
        echo(None)  # the kill rides along: freed now
        assert [_count(sess, w) for w in range(2)] == before
        # Freed once: the id is handed out once, so two new registers are distinct.
        a, b = echo("a"), echo("b")
        assert a.reg_id != b.reg_id and reg in (a.reg_id, b.reg_id)
        assert [a.debug_get_from_remote(1), b.debug_get_from_remote(1)] == ["a", "b"]


def test_wrapping_the_wrong_arguments_is_a_clear_error():
    with disco.ThreadedSession(1) as sess, disco.ThreadedSession(1) as other:
        f = sess.get_global_func("disco.worker_id")
        with pytest.raises(disco.DiscoTypeError, match=r"dref must be a DRef.*TVM's order"):
            disco.DPackedFunc(sess, f.reg_id)  # the old (session, reg_id) order
        with pytest.raises(TypeError, match="session must be"):
            disco.DModule(f, "not a session")
        with pytest.raises(TypeError, match="dref must be a DRef"):
            disco.DModule(3, sess)
        with pytest.raises(ValueError, match="another session"):
            disco.DPackedFunc(f, other)
        assert f().debug_get_from_remote(0) == 0  # nothing was broken


# ---------------------------------------------------------------- 2. get_global_func
_ENTRY = """
import disco_core as disco
from disco_core.worker import current, main

disco.register_func("{tag}.everywhere", lambda x: (current().worker_id, x + 1), override=True)
if __name__ == "__main__":  # the children only: worker 0 imports this module, not as __main__
    disco.register_func("{tag}.children_only", lambda: current().worker_id, override=True)
    main()
"""


def _importable(folder, monkeypatch) -> None:
    """Modules in ``folder`` importable here and by ``python -m`` in the children."""
    monkeypatch.syspath_prepend(str(folder))
    paths = [str(folder), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in paths if p))


@pytest.fixture
def entry_module(tmp_path, monkeypatch):
    """A custom entrypoint module (a unique name) on sys.path; removed afterwards."""
    tag = f"compat_entry_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{tag}.py").write_text(textwrap.dedent(_ENTRY.format(tag=tag)))
    _importable(tmp_path, monkeypatch)
    yield tag
    sys.modules.pop(tag, None)
    for name in (f"{tag}.everywhere", f"{tag}.children_only", f"{tag}.late"):
        registry.remove_global_func(name)


def test_function_registered_by_a_custom_entrypoint_is_reachable(entry_module):
    tag = entry_module
    assert registry.get_global_func(f"{tag}.everywhere", allow_missing=True) is None
    # ProcessSession(num_workers, entrypoint): the positional form of TVM's older docs.
    with disco.ProcessSession(3, tag) as sess:
        f = sess.get_global_func(f"{tag}.everywhere")  # the controller lacks it: no refusal
        r = f(41)
        # worker 0 (the controller's process) imported the entrypoint for it
        assert [r.debug_get_from_remote(w) for w in range(3)] == [(0, 42), (1, 42), (2, 42)]


def test_function_only_in_the_children(entry_module):
    tag = entry_module
    with disco.ProcessSession(3, num_groups=1, entrypoint=tag) as sess:
        f = sess.get_global_func(f"{tag}.children_only")
        sess.sync_worker_0()  # no error: the children have it
        r = f()
        # ... but worker 0 cannot run what its process lacks: a clear error at the sync
        # with worker 0 (a sync with worker 2 alone may come before worker 0 ran it)
        with pytest.raises(disco.WorkerError, match=rf"{tag}.children_only.*worker 0") as info:
            sess.sync_worker_0()
        assert info.value.worker_id == 0 and info.value.exc_type == "ValueError"
        assert info.value.others == []  # only worker 0 failed
        assert [r.debug_get_from_remote(w) for w in (1, 2)] == [1, 2]  # they ran it
        # registered later in the controller: worker 0 finds it when called
        disco.register_func(f"{tag}.children_only", lambda: "controller", override=True)
        r = f()
        assert [r.debug_get_from_remote(w) for w in range(3)] == ["controller", 1, 2]


@pytest.mark.parametrize(("cls", "n"), [(disco.ThreadedSession, 1), (disco.ThreadedSession, 3), (disco.ProcessSession, 1), (disco.ProcessSession, 2)])  # fmt: skip
def test_name_missing_everywhere_is_an_error_at_the_first_sync(cls, n):
    with cls(n) as sess:
        f = sess.get_global_func("compat.nowhere_to_be_found")
        wid = sess.get_global_func("disco.worker_id")()
        with pytest.raises(disco.WorkerError, match="compat.nowhere_to_be_found") as info:
            for w in range(n):
                wid.debug_get_from_remote(w)
        assert info.value.exc_type == "ValueError"
        with pytest.raises(disco.WorkerError, match="compat.nowhere_to_be_found"):
            f()  # calling it is an error too, naming it
            sess.sync_worker_0()
            wid.debug_get_from_remote(n - 1)
        assert sess.get_global_func("disco.worker_id")().debug_get_from_remote(n - 1) == n - 1


def test_a_bad_entrypoint_import_is_reported_when_the_function_is_called(tmp_path, monkeypatch):
    tag = f"compat_bad_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{tag}.py").write_text(
        "import disco_core as disco\n"
        "from disco_core.worker import main\n"
        "if __name__ == '__main__':\n"
        f"    disco.register_func('{tag}.f', lambda: 1, override=True)\n"
        "    main()\n"
        "else:\n"
        "    raise RuntimeError('not importable here')\n"
    )
    _importable(tmp_path, monkeypatch)
    try:
        with disco.ProcessSession(2, entrypoint=tag) as sess:
            r = sess.get_global_func(f"{tag}.f")()
            with pytest.raises(disco.WorkerError, match="not importable here") as info:
                sess.sync_worker_0()
            assert info.value.worker_id == 0
            assert r.debug_get_from_remote(1) == 1
    finally:
        sys.modules.pop(tag, None)
        registry.remove_global_func(f"{tag}.f")


def test_process_session_entrypoint_given_twice():
    with pytest.raises(TypeError, match="entrypoint was given twice"):
        disco.ProcessSession(2, "disco_core.worker", entrypoint="disco_core.worker")
    with pytest.raises(TypeError, match="entrypoint"):
        disco.ProcessSession(2, entrypoint="")


# ---------------------------------------------------------------- 3. debug_copy_from
def test_debug_copy_from_copies_into_the_existing_array(kind):
    with _open(kind, 2) as sess:
        x = sess.empty((3,), "float32")
        alias = sess.get_global_func("testing.echo")(x)  # the same array on each worker
        x.debug_copy_from(1, np.array([1, 2, 3], "float32"))
        np.testing.assert_array_equal(alias.debug_get_from_remote(1), [1, 2, 3])
        for bad, what in ((np.zeros(4, "float32"), "shape"), (np.zeros(3, "int32"), "dtype")):
            with pytest.raises(disco.WorkerError, match="debug_copy_from") as info:
                x.debug_copy_from(1, bad)
            assert info.value.exc_type == "ValueError" and info.value.worker_id == 1, what
        np.testing.assert_array_equal(x.debug_get_from_remote(1), [1, 2, 3])  # untouched
        # A register without an array (worker0_only elsewhere) takes the value, as TVM's.
        y = sess.empty((2,), "int64", worker0_only=True)
        y.debug_copy_from(1, np.array([7, 8]))
        np.testing.assert_array_equal(y.debug_get_from_remote(1), [7, 8])
        # A freed register is an error, not a silent new value.
        stale = disco.DRef(sess, 10_000)
        try:
            with pytest.raises(disco.WorkerError, match="holds no value"):
                stale.debug_copy_from(0, np.zeros(1))
        finally:
            stale.reg_id = 0
        assert sess.get_global_func("disco.worker_id")().debug_get_from_remote(1) == 1


# ---------------------------------------------------------------- 4. broadcast / scatter in_group
@pytest.mark.parametrize("kind_", ["threaded", "process"])
def test_broadcast_and_scatter_honour_in_group(kind_):
    nw, groups, size = 4, 2, 2
    with _open(kind_, nw, groups) as sess:
        sess.init_ccl("shm")
        host = np.arange(6, dtype="float32").reshape(2, 3)
        for in_group in (True, False):
            b = sess.broadcast(host, in_group=in_group)
            for w in range(nw):  # every group receives the same data
                np.testing.assert_array_equal(b.debug_get_from_remote(w), host)
        shards = np.arange(size * 3, dtype="int32").reshape(size, 3)
        s = sess.scatter(shards)  # in_group=True: one row per group member
        for w in range(nw):
            np.testing.assert_array_equal(s.debug_get_from_remote(w), shards[w % size])
        rows = np.arange(nw * 3, dtype="int32").reshape(nw, 3)
        s = sess.scatter(rows, in_group=False)
        for w in range(nw):
            np.testing.assert_array_equal(s.debug_get_from_remote(w), rows[w])
        with pytest.raises(ValueError, match="group size"):
            sess.scatter(rows)
        with pytest.raises(ValueError, match="number of workers"):
            sess.scatter(shards, in_group=False)
        # in_group=False: the host data is staged on worker 0 only
        stage = sess.empty((2,), "float32", worker0_only=True, in_group=False)
        assert stage.debug_get_from_remote(2) is None


def test_broadcast_without_a_ccl_allocates_nothing():
    with disco.ThreadedSession(2) as sess:
        sess.sync_worker_0()
        before = _count(sess, 0)
        with pytest.raises(disco.CCLError, match="init_ccl"):
            sess.broadcast(np.zeros(3))
        with pytest.raises(disco.CCLError, match="init_ccl"):
            sess.scatter(np.zeros((2, 3)))
        assert _count(sess, 0) == before


def _tvm_ccl_session(kind: str, num_workers: int, num_groups: int = 1) -> disco.Session:
    sess = KINDS[kind](num_workers=num_workers, num_groups=num_groups)
    sess.init_ccl("shm")
    return sess


@pytest.mark.parametrize("use_explicit_output", [True, False])
def test_tvm_broadcast(kind, use_explicit_output):
    array = np.arange(12, dtype="float32").reshape(3, 4)
    with _tvm_ccl_session(kind, 2) as sess:
        if use_explicit_output:
            src_array = sess.empty((3, 4), "float32", worker0_only=True)
            src_array.debug_copy_from(0, array)
            dst_array = sess.empty((3, 4), "float32")
            sess.broadcast_from_worker0(src_array, dst_array)
        else:
            dst_array = sess.broadcast(array)
        np.testing.assert_equal(dst_array.debug_get_from_remote(1), array)


def test_tvm_group_broadcast(kind):
    array_1 = np.arange(12, dtype="float32").reshape(3, 4)
    array_2 = np.multiply(array_1, -1)
    with _tvm_ccl_session(kind, 4, 2) as sess:
        src_array = sess.empty((3, 4), "float32", worker0_only=True, in_group=True)
        src_array.debug_copy_from(0, array_1)
        src_array.debug_copy_from(2, array_2)
        dst_array = sess.empty((3, 4), "float32")
        sess.broadcast_from_worker0(src_array, dst_array)
        np.testing.assert_equal(dst_array.debug_get_from_remote(1), array_1)
        np.testing.assert_equal(dst_array.debug_get_from_remote(3), array_2)


@pytest.mark.parametrize("use_explicit_output", [True, False])
def test_tvm_scatter(kind, use_explicit_output):
    array = np.arange(36, dtype="float32").reshape(2, 6, 3)
    with _tvm_ccl_session(kind, 2) as sess:
        if use_explicit_output:
            d_src = sess.empty((2, 6, 3), "float32", worker0_only=True)
            d_dst = sess.empty((6, 3), "float32")
            d_src.debug_copy_from(0, array)
            sess.scatter_from_worker0(d_src, d_dst)
        else:
            d_dst = sess.scatter(array)
        np.testing.assert_equal(d_dst.debug_get_from_remote(0), array[0, :, :])
        np.testing.assert_equal(d_dst.debug_get_from_remote(1), array[1, :, :])


def test_tvm_group_scatter(kind):
    array_1 = np.arange(36, dtype="float32").reshape(2, 6, 3)
    array_2 = np.multiply(array_1, -1)
    with _tvm_ccl_session(kind, 4, 2) as sess:
        d_src = sess.empty((2, 6, 3), "float32", worker0_only=True, in_group=True)
        d_src.debug_copy_from(0, array_1)
        d_src.debug_copy_from(2, array_2)
        d_dst = sess.empty((6, 3), "float32")
        sess.scatter_from_worker0(d_src, d_dst)
        np.testing.assert_equal(d_dst.debug_get_from_remote(0), array_1[0, :, :])
        np.testing.assert_equal(d_dst.debug_get_from_remote(1), array_1[1, :, :])
        np.testing.assert_equal(d_dst.debug_get_from_remote(2), array_2[0, :, :])
        np.testing.assert_equal(d_dst.debug_get_from_remote(3), array_2[1, :, :])


def test_tvm_allgather(kind):
    # TVM's test copies a flat (18,) array into a (3, 3, 2) one: debug_copy_from (as
    # TVM's Tensor::CopyFrom) needs the same size, not the same shape.
    array = np.arange(36, dtype="float32")
    with _tvm_ccl_session(kind, 2) as sess:
        d_src = sess.empty((3, 3, 2), "float32")
        d_dst = sess.empty((3, 4, 3), "float32")
        d_src.debug_copy_from(0, array[:18])
        d_src.debug_copy_from(1, array[18:])
        sess.allgather(d_src, d_dst)
        np.testing.assert_equal(d_dst.debug_get_from_remote(0), array.reshape(3, 4, 3))
        np.testing.assert_equal(d_dst.debug_get_from_remote(1), array.reshape(3, 4, 3))


def test_tvm_group_allgather(kind):
    array_1 = np.arange(36, dtype="float32")
    array_2 = np.arange(48, dtype="float32")
    with _tvm_ccl_session(kind, 4, 2) as sess:
        d_src_1 = sess.empty((3, 3, 2), "float32")
        d_dst_1 = sess.empty((3, 4, 3), "float32")
        d_src_2 = sess.empty((2, 4, 3), "float32")
        d_dst_2 = sess.empty((2, 6, 4), "float32")
        d_src_1.debug_copy_from(0, array_1[:18])
        d_src_1.debug_copy_from(1, array_1[18:])
        d_src_2.debug_copy_from(2, array_2[:24])
        d_src_2.debug_copy_from(3, array_2[24:])
        sess.allgather(d_src_1, d_dst_1, in_group=True)
        sess.allgather(d_src_2, d_dst_2, in_group=True)
        np.testing.assert_equal(d_dst_1.debug_get_from_remote(0), array_1.reshape(3, 4, 3))
        np.testing.assert_equal(d_dst_1.debug_get_from_remote(1), array_1.reshape(3, 4, 3))
        np.testing.assert_equal(d_dst_2.debug_get_from_remote(2), array_2.reshape(2, 6, 4))
        np.testing.assert_equal(d_dst_2.debug_get_from_remote(3), array_2.reshape(2, 6, 4))


def test_tvm_gather(kind):
    array = np.arange(36, dtype="float32")
    with _tvm_ccl_session(kind, 2) as sess:
        d_src = sess.empty((3, 3, 2), "float32")
        d_dst = sess.empty((3, 4, 3), "float32", worker0_only=True)
        d_src.debug_copy_from(0, array[:18])
        d_src.debug_copy_from(1, array[18:])
        sess.gather_to_worker0(d_src, d_dst)
        np.testing.assert_equal(d_dst.debug_get_from_remote(0), array.reshape(3, 4, 3))


def test_tvm_sync_worker(kind):
    # TVM's test_session.py syncs every worker with the private sess._sync_worker(i).
    with _open(kind, 3) as sess:
        r = sess.get_global_func("disco.worker_id")()
        for i in range(sess.num_workers):
            sess._sync_worker(i)
        assert r.debug_get_from_remote(2) == 2


def test_copies_need_the_same_size_and_dtype_not_the_same_shape(kind):
    with _open(kind, 2) as sess:
        x = sess.empty((2, 3), "int32")
        x.debug_copy_from(1, np.arange(6, dtype="int32"))
        np.testing.assert_array_equal(x.debug_get_from_remote(1), np.arange(6).reshape(2, 3))
        sess.copy_to_worker_0(np.arange(6, dtype="int32").reshape(3, 2), x)
        out = np.zeros(6, "int32")
        sess.copy_from_worker_0(out, x)
        np.testing.assert_array_equal(out, np.arange(6))
        for bad in (np.zeros(5, "int32"), np.zeros(6, "float32")):
            with pytest.raises(disco.WorkerError, match="the dtype and the number of elements"):
                x.debug_copy_from(1, bad)


# ---------------------------------------------------------------- 6. avg on integers
@pytest.mark.parametrize("dtype", ["int8", "int16", "int32", "int64", "uint8", "uint64"])
def test_average_in_place_is_ncclavg_on_integers(dtype):
    info = np.iinfo(dtype)
    vals = [0, 1, 5, 7, 8, int(info.max), int(info.max) - 3]
    if info.min < 0:
        vals += [-1, -5, -7, -8, int(info.min), int(info.min) + 3]
    for n in (1, 2, 3, 4, 7):
        a = np.array(vals, dtype)
        average_in_place(a, n)
        want = [abs(v) // n * (1 if v >= 0 else -1) for v in vals]  # truncated toward zero
        assert a.tolist() == want, (dtype, n)
    big = np.array([2**60 + 13, -(2**60 + 13)] if dtype == "int64" else [0], dtype)
    average_in_place(big, 4)
    if dtype == "int64":  # exact where a float64 detour would round
        assert big.tolist() == [2**58 + 3, -(2**58 + 3)]
    small = np.array([int(info.max)], dtype)
    average_in_place(small, int(info.max) + 1 if info.max < 2**20 else 2**20)
    assert small.tolist() == [0 if info.max < 2**20 else int(info.max) // 2**20]


def test_average_in_place_on_floats():
    a = np.array([1.0, -3.0, 2.5], "float32")
    average_in_place(a, 2)
    assert a.dtype == np.float32 and a.tolist() == [0.5, -1.5, 1.25]


def test_allreduce_avg_of_integers_on_a_session(kind):
    with _tvm_ccl_session(kind, 3) as sess:
        rows = np.zeros((3, 4), "int32")
        rows[0] = [-1, 1, -7, 7]  # sums -1, 1, -7, 7 over 3 members
        src = sess.scatter(rows, in_group=False)
        dst = sess.empty((4,), "int32")
        sess.allreduce(src, dst, op="avg")
        for w in range(3):
            assert dst.debug_get_from_remote(w).tolist() == [0, 0, -2, 2]


# ---------------------------------------------------------------- 7. TVM's global names
def test_tvm_import_python_module_name_is_registered(kind):
    assert disco.get_global_func("runtime.disco._import_python_module") is not None
    with KINDS[kind](2) as sess:
        # TVM's Session.import_python_module, verbatim
        imp = sess.get_global_func("runtime.disco._import_python_module")
        imp(FUNCS)
        r = sess.get_global_func("testing.add")(1, 2)
        assert [r.debug_get_from_remote(w) for w in range(2)] == [3, 3]


def test_debug_get_from_remote_arrays_have_tvms_numpy_method():
    """TVM's tests read results with ``ref.debug_get_from_remote(w).numpy()``."""
    with disco.ThreadedSession(2) as sess:
        host = np.arange(6, dtype="float32").reshape(2, 3)
        ref = sess.copy_to_worker_0(host)
        got = ref.debug_get_from_remote(0)
        assert isinstance(got, np.ndarray) and isinstance(got, disco.HostArray)
        plain = got.numpy()
        assert type(plain) is np.ndarray and np.array_equal(plain, host)
        disco.register_func("compat.pair", lambda a, b: (a, b), override=True)
        a, b = sess.get_global_func("compat.pair")(ref, 3).debug_get_from_remote(0)
        assert np.array_equal(a.numpy(), host) and b == 3  # inside a tuple too
        assert sess.get_global_func("disco.worker_id")().debug_get_from_remote(1) == 1


def test_process_session_signature_is_the_designs():
    """DESIGN.md: ``ProcessSession(num_workers, num_groups=1, entrypoint="disco_core.worker")``."""
    import inspect

    params = inspect.signature(disco.ProcessSession).parameters
    assert [(p.name, p.default) for p in params.values()] == [
        ("num_workers", inspect.Parameter.empty),
        ("num_groups", 1),
        ("entrypoint", "disco_core.worker"),
    ]


@pytest.mark.parametrize("make", [disco.ThreadedSession, disco.ProcessSession])
def test_the_copies_refuse_a_register_of_another_session(make):
    """``copy_to_worker_0`` and ``copy_from_worker_0`` took a handle of another session
    and used the register of that number in this one: an unrelated array overwritten,
    or read back, silently (outside check)."""
    import numpy as np

    with make(1) as sess, make(1) as other:
        x = sess.copy_to_worker_0(np.ones(4, np.float32))
        z = other.copy_to_worker_0(np.full(4, 7, np.float32))
        assert x.reg_id == z.reg_id  # the same number names x here
        with pytest.raises(disco.DiscoValueError, match="copy_to_worker_0: remote_array .* belongs to another session"):  # fmt: skip
            sess.copy_to_worker_0(np.full(4, 9, np.float32), z)
        out = np.zeros(4, np.float32)
        with pytest.raises(disco.DiscoValueError, match="copy_from_worker_0: remote_array .* belongs to another session"):  # fmt: skip
            sess.copy_from_worker_0(out, z)
        assert (out == 0).all()
        assert (x.debug_get_from_remote(0) == 1).all() and (z.debug_get_from_remote(0) == 7).all()


@pytest.mark.parametrize("make", [disco.ThreadedSession, disco.ProcessSession])
def test_a_handle_of_another_session_inside_an_argument_is_refused(make):
    """Top-level handles of another session were refused already; one inside a list, a
    tuple or a dict went as its register number and read whatever this session held
    under it (outside check). Handles of the session itself still resolve there."""
    with disco.ThreadedSession(1) as other, make(2) as sess:
        sess.import_python_module("disco_core.testing.funcs")
        theirs = other.call_packed("disco.worker_id")
        mine = sess.call_packed("disco.worker_id")
        for bad in ([theirs], {"k": (1, theirs)}, (2, [theirs])):
            with pytest.raises(disco.DiscoValueError, match="inside an argument, belongs to another session"):  # fmt: skip
                sess.call_packed("testing.echo", bad)
        x = sess.empty((1,), "float32")
        with pytest.raises(disco.DiscoValueError, match="belongs to another session"):
            x.debug_copy_from(1, [theirs])
        out = sess.call_packed("testing.echo", [mine, (mine, 7)])
        assert out.debug_get_from_remote(1) == [1, (1, 7)]
        assert out.debug_get_from_remote(0) == [0, (0, 7)]
