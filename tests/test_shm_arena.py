"""The shm CCL's arenas: large arrays from ``empty`` live in shared memory the peers
map, and allreduce then reduces straight between the workers' arrays."""

from __future__ import annotations

import functools

import numpy as np
import pytest

import disco_core as disco

pytestmark = pytest.mark.timeout(90)

N = 300_000  # float32: 1.2 MB, above the arena threshold and several staging rounds


def _inputs(n_workers: int, dtype: str) -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [(rng.standard_normal(N) * 10 ** (w % 3)).astype(dtype) for w in range(n_workers)]


@pytest.fixture(params=[("process", 2, 1), ("process", 4, 2), ("threaded", 3, 1)], ids=str)
def sess(request):
    kind, n, groups = request.param
    cls = disco.ProcessSession if kind == "process" else disco.ThreadedSession
    with cls(n, groups) as s:
        s.init_ccl("shm")
        s.import_python_module("disco_core.testing.funcs")
        yield s


def _scatter_inputs(sess, xs):
    # scatter allocates its dst with empty: the arrays land in the workers' arenas
    return sess.scatter(np.stack(xs), in_group=False)


def test_empty_arrays_come_from_the_arena(sess):
    inside = sess.get_global_func("testing.in_ccl_memory")
    big = sess.empty((N,), "float32")
    small = sess.empty((16,), "float32")
    on_worker_0_only = sess.empty((N,), "float32", worker0_only=True)
    for w in range(sess.num_workers):
        assert inside(big).debug_get_from_remote(w) is True
        assert inside(small).debug_get_from_remote(w) is False  # small arrays stay private
    assert inside(on_worker_0_only).debug_get_from_remote(0) is True


@pytest.mark.parametrize("dtype", ["float32", "float16", "int64"])
@pytest.mark.parametrize("in_place", [False, True])
def test_allreduce_between_arenas_is_bit_identical(sess, dtype, in_place):
    n = sess.num_workers
    xs = _inputs(n, dtype)
    src = _scatter_inputs(sess, xs)
    dst = src if in_place else sess.empty((N,), dtype)
    sess.allreduce(src, dst, "sum", in_group=False)
    want = functools.reduce(np.add, xs)
    for w in range(n):
        got = dst.debug_get_from_remote(w)
        assert got.tobytes() == want.tobytes(), f"worker {w}"


def test_allreduce_in_groups_between_arenas(sess):
    n, g = sess.num_workers, sess.num_groups
    xs = _inputs(n, "float32")
    src = _scatter_inputs(sess, xs)
    dst = sess.empty((N,), "float32")
    sess.allreduce(src, dst, "max", in_group=True)
    size = n // g
    for w in range(n):
        start = w // size * size
        want = functools.reduce(np.maximum, xs[start : start + size])
        assert dst.debug_get_from_remote(w).tobytes() == want.tobytes()


def test_mixed_arena_and_private_arrays_fall_back_to_staging(sess):
    n = sess.num_workers
    xs = _inputs(n, "float32")
    src = _scatter_inputs(sess, xs)
    # worker n-1 gets a private (non-arena) array for its src (an argument's copy)
    sess.import_python_module("disco_core.testing.ccl_funcs")
    src = sess.call_packed("ccl_kit.replace_on", src, n - 1, xs[n - 1])
    inside = sess.get_global_func("testing.in_ccl_memory")
    assert inside(src).debug_get_from_remote(n - 1) is False
    dst = sess.empty((N,), "float32")
    sess.allreduce(src, dst, "sum", in_group=False)
    want = functools.reduce(np.add, xs)
    for w in range(n):
        assert dst.debug_get_from_remote(w).tobytes() == want.tobytes()


def test_arena_blocks_are_reused(sess):
    for _ in range(20):  # 20 x 1.2 MB allocated and dropped: the free list takes them back
        x = sess.empty((N,), "float32")
        sess.allreduce(x, x, "sum")
        del x
    sess.sync_worker_0()
