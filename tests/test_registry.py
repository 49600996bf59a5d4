"""The global function registry."""

from __future__ import annotations

import pytest

import disco_core as disco
from disco_core import registry


@pytest.fixture
def names():
    """Names registered by a test, removed afterwards."""
    used: list[str] = []
    yield used
    for name in used:
        registry.remove_global_func(name)
    assert not set(used) & set(disco.list_global_func_names())


def test_register_by_call_and_decorator(names):
    names += ["test.reg.call", "test.reg.deco"]

    def f(x):
        return x + 1

    assert disco.register_func("test.reg.call", f) is f

    @disco.register_func("test.reg.deco")
    def g(x):
        return x * 2

    assert disco.get_global_func("test.reg.call") is f
    assert disco.get_global_func("test.reg.deco")(4) == 8
    listed = disco.list_global_func_names()
    assert listed == sorted(listed)
    assert {"test.reg.call", "test.reg.deco"} <= set(listed)


def test_bare_decorator_uses_qualname(names):
    @disco.register_func
    def test_registry_bare_function():
        return 1

    names.append(test_registry_bare_function.__qualname__)
    assert disco.get_global_func(test_registry_bare_function.__qualname__)() == 1


def test_duplicate_and_override(names):
    names.append("test.reg.dup")
    disco.register_func("test.reg.dup", lambda: 1)
    with pytest.raises(ValueError, match="already registered"):
        disco.register_func("test.reg.dup", lambda: 2)
    assert disco.get_global_func("test.reg.dup")() == 1
    disco.register_func("test.reg.dup", lambda: 3, override=True)
    assert disco.get_global_func("test.reg.dup")() == 3
    same = disco.get_global_func("test.reg.dup")
    disco.register_func("test.reg.dup", same)  # the same function again is fine


def test_missing():
    with pytest.raises(ValueError, match="test.reg.never"):
        disco.get_global_func("test.reg.never")
    assert disco.get_global_func("test.reg.never", allow_missing=True) is None


def test_missing_suggests_close_names():
    with pytest.raises(ValueError, match="disco.worker_id"):
        disco.get_global_func("disco.worker_idd")


def test_bad_registrations():
    with pytest.raises(TypeError):
        disco.register_func("test.reg.bad", 42)
    with pytest.raises(TypeError):
        disco.register_func("", lambda: 0)
    with pytest.raises(TypeError):
        disco.register_func(None, lambda: 0)
    assert disco.get_global_func("test.reg.bad", allow_missing=True) is None


def test_builtins_registered():
    names = set(disco.list_global_func_names())
    expected = {
        "worker_id", "worker_rank", "world_size", "group_id", "device", "empty",
        "allreduce", "allgather", "broadcast_from_worker0", "scatter_from_worker0",
        "gather_to_worker0", "recv_from_worker0", "send_to_worker", "recv_from_worker",
        "send_to_next_group", "recv_from_prev_group",
    }  # fmt: skip
    assert {f"disco.{n}" for n in expected} <= names


def test_sessions_use_the_registry(names):
    names.append("test.reg.session")
    disco.register_func("test.reg.session", lambda a, b: (a, b, disco.worker.current().worker_id))
    with disco.ThreadedSession(2) as sess:
        r = sess.get_global_func("test.reg.session")("x", 2)
        assert r.debug_get_from_remote(1) == ("x", 2, 1)
    with disco.ThreadedSession(1) as sess:
        # looked up by the workers (it may exist only there): missing, it fails at the sync
        missing = sess.get_global_func("test.reg.not.there")
        with pytest.raises(disco.WorkerError, match="test.reg.not.there") as err:
            sess.sync_worker_0()
        assert isinstance(err.value, ValueError) or err.value.exc_type == "ValueError"
        del missing


def test_bad_registrations_are_disco_errors():
    import disco_core as disco

    with pytest.raises(disco.DiscoTypeError, match="name must be a non-empty str"):
        disco.register_func(123)
    with pytest.raises(disco.DiscoTypeError, match="is not callable"):
        disco.register_func("testing.not_callable", 5)


_MODULE = """
import disco_core as disco

@disco.register_func("test.reg.module_add")
def add(a, b):
    return a + b
"""


def test_a_module_run_again_replaces_its_own_registrations(tmp_path, names, monkeypatch):
    """A ``.py`` file that registers a function could be loaded once per process: each
    worker thread of a ThreadedSession runs it (worker 1 failed with "already
    registered"), as do a second session, ``importlib.reload`` and an import by name
    of a file loaded by path. The same ``def`` run again replaces its registration."""
    import importlib
    import sys

    names.append("test.reg.module_add")
    path = tmp_path / "reg_again_mod.py"
    path.write_text(_MODULE)
    for _ in range(2):  # a second session in the same process too
        with disco.ThreadedSession(2) as sess:
            sess.load_vm_module(str(path))
            add = sess.get_global_func("test.reg.module_add")
            assert [add(2, 3).debug_get_from_remote(w) for w in (0, 1)] == [5, 5]
    deco = tmp_path / "reg_again_deco.py"  # a decorated function, reloaded
    deco.write_text(
        "import functools\nimport disco_core as disco\n"
        "def deco(f):\n    @functools.wraps(f)\n    def w(*a):\n        return f(*a)\n    return w\n"
        "@disco.register_func('test.reg.module_deco')\n@deco\ndef f(x):\n    return x + 1\n"
    )
    names.append("test.reg.module_deco")
    monkeypatch.syspath_prepend(str(tmp_path))
    deco_module = importlib.import_module("reg_again_deco")
    try:
        importlib.reload(deco_module)
        assert disco.get_global_func("test.reg.module_deco") is deco_module.f
    finally:
        sys.modules.pop("reg_again_deco", None)
    module = importlib.import_module("reg_again_mod")  # loaded by path above
    try:
        importlib.reload(module)
        assert disco.get_global_func("test.reg.module_add") is module.add
    finally:
        sys.modules.pop("reg_again_mod", None)
    other = tmp_path / "other_mod.py"  # another file's function under that name still fails
    other.write_text(_MODULE)
    with disco.ThreadedSession(1) as sess:
        with pytest.raises(disco.WorkerError, match="already registered"):
            sess.load_vm_module(str(other))
            sess._sync_all()


def _plain_deco(f):
    def wrapper():
        return f()

    return wrapper


def _factory(k):
    def g():
        return k

    return g


class _Holder:
    def __init__(self, v):
        self.v = v

    def m(self):
        return self.v


def _exec_def(body: str):
    ns: dict = {}
    exec(f"def h():\n    return {body!r}", ns)
    return ns["h"]


_PAIRS = {
    "a decorator without wraps": (_plain_deco(lambda: 1), _plain_deco(lambda: 2)),
    "closures of one factory": (_factory(1), _factory(2)),
    "two lambdas on one line": tuple([lambda: 1, lambda: 2]),
    "bound methods of two instances": (_Holder(1).m, _Holder(2).m),
    "code run from strings": (_exec_def("one"), _exec_def("two")),
}


@pytest.mark.parametrize("case", sorted(_PAIRS))
def test_different_functions_from_one_place_still_conflict(names, case):
    """The same-def rule first compared file, line and name only: these pairs, made
    many times by one run, then replaced each other silently (outside check)."""
    first, second = _PAIRS[case]
    names.append("test.reg.pair")
    disco.register_func("test.reg.pair", first)
    with pytest.raises(ValueError, match="already registered"):
        disco.register_func("test.reg.pair", second)
    assert disco.get_global_func("test.reg.pair")() == first()
