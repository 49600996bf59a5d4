"""A collective's buffers are checked at the call, before anything is sent (and a closed session cannot be entered).

An outside check (a new user following the README) found two silent or late
failures: a NumPy array as ``allreduce``'s ``dst`` was sent to every worker by value,
written there and dropped, the caller's array left unchanged with no error; and a
list as ``src`` failed only on the workers, at the next sync. A register of another
session was reported as "no CCL is initialised" when the session had none yet.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

import disco_core as disco

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=["threaded", "process"])
def sess(request):
    make = disco.ThreadedSession if request.param == "threaded" else disco.ProcessSession
    with make(2) as s:
        s.init_ccl("shm")
        yield s


def _calls(s, **kw):
    """Every DRef collective of the session, as (name, call(src, dst)); ``kw`` go to each."""
    return [
        ("allreduce", lambda src, dst: s.allreduce(src, dst, "sum", **kw)),
        ("allgather", lambda src, dst: s.allgather(src, dst, **kw)),
        ("broadcast_from_worker0", lambda src, dst: s.broadcast_from_worker0(src, dst, **kw)),
        ("scatter_from_worker0", lambda src, dst: s.scatter_from_worker0(src, dst, **kw)),
        ("gather_to_worker0", lambda src, dst: s.gather_to_worker0(src, dst, **kw)),
    ]


@pytest.mark.parametrize("target", [np.zeros(4, "float32"), None, [0.0] * 4])
def test_a_target_that_is_no_register_is_refused_at_the_call(sess, target):
    src = sess.empty((4,), "float32")
    for name, call in _calls(sess):
        dst_name = "to_array" if name in ("scatter_from_worker0", "gather_to_worker0") else "dst"
        with pytest.raises(disco.DiscoTypeError, match=rf"{name}: {dst_name} must be a DRef") as err:  # fmt: skip
            call(src, target)
        if isinstance(target, np.ndarray):
            assert "copy_from_worker_0" in str(err.value)  # says what to do instead
    sess.sync_worker_0()  # nothing went out: no error waits at the next sync


@pytest.mark.parametrize("source", [[1.0, 2.0, 3.0, 4.0], 3.0, None, "x"])
def test_a_source_that_is_neither_a_register_nor_an_array_is_refused_at_the_call(sess, source):
    dst = sess.empty((4,), "float32")
    for name, call in _calls(sess):
        src_name = "from_array" if name in ("scatter_from_worker0", "gather_to_worker0") else "src"
        with pytest.raises(disco.DiscoTypeError, match=rf"{name}: {src_name} must be a DRef or an array.*got {type(source).__name__}"):  # fmt: skip
            call(source, dst)
    sess.sync_worker_0()


def test_a_host_array_source_is_still_sent_by_value(sess):
    dst = sess.empty((4,), "float32")
    sess.allreduce(np.arange(4, dtype="float32"), dst, "sum")
    out = np.empty(4, "float32")
    sess.copy_from_worker_0(out, dst)
    np.testing.assert_array_equal(out, 2 * np.arange(4, dtype="float32"))


def test_broadcast_and_scatter_refuse_a_host_array_as_dst(sess):
    with pytest.raises(disco.DiscoTypeError, match="broadcast: dst must be a DRef"):
        sess.broadcast(np.ones(4, "float32"), np.zeros(4, "float32"))
    with pytest.raises(disco.DiscoTypeError, match="scatter: dst must be a DRef"):
        sess.scatter(np.ones((2, 4), "float32"), np.zeros(4, "float32"))
    got = sess.broadcast(np.ones(4, "float32"))  # and dst=None still allocates one
    np.testing.assert_array_equal(got.debug_get_from_remote(1), np.ones(4, "float32"))


def test_a_register_of_another_session_is_named_before_the_missing_ccl():
    with disco.ThreadedSession(2) as a, disco.ThreadedSession(2) as b:
        x = a.empty((4,), "float32")
        mine = b.empty((4,), "float32")
        for src, dst, param in ((x, mine, "src"), (mine, x, "dst")):
            with pytest.raises(disco.DiscoValueError, match=rf"allreduce: {param} .* belongs to another session"):  # fmt: skip
                b.allreduce(src, dst)
        with pytest.raises(disco.CCLError, match="no CCL is initialised"):
            b.allreduce(mine, mine)  # its own registers: the missing CCL is the error


def test_entering_a_closed_session_is_refused():
    """Found by the same check: ``with sess:`` after ``shutdown()`` went in, and only the
    calls inside it failed."""
    s = disco.ThreadedSession(1)
    s.shutdown()
    with pytest.raises(disco.SessionClosedError):
        with s:
            pass
    s.shutdown()  # a second shutdown still does nothing


def test_a_host_argument_that_is_no_array_names_the_call_and_the_parameter(sess):
    """They said only "expected an array ..., got DRef" (e.g. copy_to_worker_0's
    arguments swapped), not which call or which argument."""
    ref = sess.empty((4,), "float32")
    cases = [
        (lambda: sess.copy_to_worker_0(ref, np.zeros(4, "float32")), "copy_to_worker_0: host_array"),
        (lambda: sess.copy_from_worker_0([0.0] * 4, ref), "copy_from_worker_0: host_array"),
        (lambda: sess.broadcast([1.0, 2.0]), "broadcast: src"),
        (lambda: sess.scatter([[1.0], [2.0]]), "scatter: src"),
    ]  # fmt: skip
    for call, named in cases:
        with pytest.raises(disco.DiscoTypeError, match=rf"^{named}: expected an array"):
            call()
    sess.sync_worker_0()


@pytest.mark.parametrize("flag", ["no", "False", 2, None, 0.0])
def test_a_flag_that_is_not_true_or_false_is_refused_at_the_call(sess, flag):
    # bool("no") is True: every group-wide flag took it for yes, silently
    src, dst = sess.empty((2,), "float32"), sess.empty((2,), "float32")
    host = np.zeros(2, "float32")
    calls = {name: functools.partial(call, src, dst) for name, call in _calls(sess, in_group=flag)}
    calls["broadcast"] = lambda: sess.broadcast(host, in_group=flag)
    calls["scatter"] = lambda: sess.scatter(host, in_group=flag)
    calls["empty"] = lambda: sess.empty((2,), "float32", in_group=flag)
    for name, call in calls.items():
        with pytest.raises(disco.DiscoTypeError, match=rf"{name}: in_group must be True or False, got {flag!r}"):  # fmt: skip
            call()
    with pytest.raises(disco.DiscoTypeError, match="empty: worker0_only must be True or False"):
        sess.empty((2,), "float32", worker0_only=flag)
    sess.sync_worker_0()  # nothing went out


def test_true_false_numpy_bools_and_one_and_zero_are_flags(sess):
    sess.broadcast(np.arange(2, dtype="float32"))  # (every worker holds the same)
    for flag in (True, False, np.bool_(True), np.bool_(False), 1, 0):
        src, dst = sess.broadcast(np.ones(2, "float32")), sess.empty((2,), "float32")
        sess.allreduce(src, dst, "sum", in_group=flag)
        np.testing.assert_array_equal(dst.debug_get_from_remote(1), [2.0, 2.0])
