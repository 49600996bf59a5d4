"""The channel conformance kit: :class:`ChannelContract`.

Any channel (the core's ``threaded`` and ``process``, disco-socket's ``socket``,
disco-rpc's ``rpc``, a third party's) subclasses :class:`ChannelContract` and
provides one fixture, ``make_session``, returning a factory
``make_session(num_workers, num_groups=1) -> disco_core.Session``. The kit then
checks every command of the session contract (``disco_core.Session``), the argument types,
register freeing, errors, worker death and shutdown.

Class attributes a subclass may set:

``workers_are_processes`` (bool, default False)
    Workers 1..N-1 run in processes of their own, which the death tests may end
    (``os._exit``, SIGKILL, a segfault). Worker 0 always lives in the controller's
    process and is never killed. Override :meth:`ChannelContract.killable_workers`
    for a finer answer.
``death_timeout`` (float, default 3.0)
    Seconds within which a dead worker must be reported as ``WorkerDiedError``.
``has_store`` (bool or None, default None)
    Whether every worker reaches the session's rendezvous store
    (``current().store``). None: as the channel's own ``has_store`` says. A
    channel without one (False) is checked for a clear error at use instead.
"""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

import disco_core as disco
from disco_core import plugins
from disco_core.testing.funcs import DLPackOnly, machine_identity
from disco_core.testing.procfs import freeze, gone, wait_gone
from disco_core.testing.trace_checks import check_streams, load_trace, worker_events

__all__ = ["ChannelContract", "FUNCS_MODULE"]

#: The module of worker-side helpers (``testing.*``) the kit imports on every worker.
FUNCS_MODULE = "disco_core.testing.funcs"

_PY_MODULE = """
import numpy as np
from disco_core.worker import current

CONSTANT = 5

def scale(x, k):
    return x * k

def whoami():
    return current().worker_id

def first_arg(*args):
    return args[0]
"""


def _values(ref: disco.DRef, num_workers: int) -> list:
    return [ref.debug_get_from_remote(w) for w in range(num_workers)]


def _sync_all(sess: disco.Session) -> None:
    """Wait for every worker (debug_get of a fresh register on each)."""
    ref = sess.call_packed(sess.get_global_func("testing.echo"), None)
    for w in range(sess.num_workers):
        assert ref.debug_get_from_remote(w) is None


SCALARS = [
    0,
    -7,
    2**70,
    1.5,
    float("inf"),
    True,
    False,
    "text",
    "ünïcødé",
    "",
    b"bytes\x00\xff",
    b"",
    None,
    np.dtype("float16"),
    np.dtype("int64"),
    disco.Device("cpu", 0),
    disco.Device("cuda", 1),
    (),
    [],
]


@pytest.mark.timeout(60)
class ChannelContract:
    """The session contract every channel honours. Subclass it and provide ``make_session``."""

    workers_are_processes: bool = False
    death_timeout: float = 3.0
    has_store: bool | None = None

    # ------------------------------------------------------------------ fixtures
    @pytest.fixture
    def make_session(self) -> Callable[..., disco.Session]:
        """Provided by the subclass: ``make_session(num_workers, num_groups=1) -> Session``."""
        raise NotImplementedError(
            "a ChannelContract subclass must define the make_session fixture"
        )  # pragma: no cover

    @pytest.fixture
    def new_session(self, make_session):
        """Like ``make_session``, plus the testing functions imported; shut down afterwards."""
        made: list[disco.Session] = []

        def factory(num_workers: int = 3, num_groups: int = 1) -> disco.Session:
            sess = make_session(num_workers, num_groups)
            made.append(sess)
            assert isinstance(sess, disco.Session)
            sess.import_python_module(FUNCS_MODULE)
            return sess

        yield factory
        for sess in made:
            sess.shutdown()

    @pytest.fixture
    def sess(self, new_session) -> disco.Session:
        return new_session(3)

    def killable_workers(self, sess: disco.Session) -> list[int]:
        """The workers the death tests may end (never worker 0)."""
        return list(range(1, sess.num_workers)) if self.workers_are_processes else []

    # ------------------------------------------------------------------ shape and facts
    def test_shape(self, new_session):
        sess = new_session(4, 2)
        assert (sess.num_workers, sess.num_groups) == (4, 2)

    def test_builtin_worker_facts(self, new_session):
        sess = new_session(4, 2)
        get = sess.get_global_func
        assert _values(get("disco.worker_id")(), 4) == [0, 1, 2, 3]
        assert _values(get("disco.worker_rank")(), 4) == [0, 1, 2, 3]
        assert _values(get("disco.world_size")(), 4) == [4, 4, 4, 4]
        assert _values(get("disco.group_id")(), 4) == [0, 0, 1, 1]
        devices = _values(get("disco.device")(), 4)
        assert all(isinstance(d, disco.Device) for d in devices)
        assert all(d == disco.Device("cpu", 0) for d in devices)

    def test_channel_facts(self, new_session):
        """``kind``, ``num_nodes`` and ``shares_memory`` tell the truth, as far as it can be
        seen from here: CCLs branch on them (``shm`` refuses a session that spans
        machines). ``kind`` is not another registered channel's name; one node means
        every worker runs on the controller's machine; shared memory means every worker
        can map the controller's memory files (the ``shm`` CCL's way). Overstating
        ``num_nodes`` or understating ``shares_memory`` is the cautious direction and is
        not checked (disco-socket's local agents are nodes of one machine)."""
        sess = new_session(4, 2)
        channel = sess._channel
        kind, nodes, shares = channel.kind, channel.num_nodes, channel.shares_memory
        assert isinstance(kind, str) and kind and kind != "?", (
            f"the channel's kind is {kind!r}: set Channel.kind to the registered name"
        )
        claimed = plugins.registered("channel").get(kind)
        if isinstance(claimed, type):  # the kind of another registered channel class
            assert isinstance(channel, claimed), (
                f"the channel says kind={kind!r}, the name of {claimed.__qualname__}, but it "
                f"is a {type(channel).__qualname__}: set Channel.kind to its own registered name"
            )
        assert type(nodes) is int and 1 <= nodes <= sess.num_workers, f"num_nodes is {nodes!r}"
        assert type(shares) is bool, f"shares_memory is {shares!r}"
        token = os.urandom(16)
        fd = os.memfd_create("disco-channel-kit")
        try:
            os.write(fd, token)
            facts = _values(sess.get_global_func("testing.machine")(os.getpid(), fd, token), 4)
        finally:
            os.close(fd)
        here = machine_identity()
        machines = {f["machine"] for f in facts}
        assert len(machines) <= nodes, (
            f"the workers run on {len(machines)} machines but the channel says num_nodes={nodes}"
        )
        if nodes == 1:
            away = [w for w, f in enumerate(facts) if f["machine"] != here]
            assert not away, f"num_nodes=1 but workers {away} run on another machine"
        if shares:
            blind = [w for w, f in enumerate(facts) if not f["shares_memory"]]
            assert not blind, (
                f"shares_memory=True but workers {blind} cannot map the controller's memory"
            )

    def test_user_function_current(self, new_session):
        sess = new_session(4, 2)
        facts = _values(sess.get_global_func("testing.context")(), 4)
        for w, f in enumerate(facts):
            assert f["worker_id"] == w
            assert (f["num_workers"], f["num_groups"], f["world_size"]) == (4, 2, 4)
            assert f["group_id"] == w // 2
            assert f["device"] == "cpu:0"
        assert facts[0]["pid"] == os.getpid()  # worker 0 lives in the controller's process

    def test_current_outside_worker(self):
        with pytest.raises(disco.DiscoError, match="outside"):
            disco.worker.current()

    # ------------------------------------------------------------------ rendezvous store
    def test_rendezvous_store(self, new_session):
        """Every worker sets a key and reads all; ``add`` counts every worker; a wait
        times out naming its key. A channel that declares no store (``has_store``
        False) must say so at use, not hang."""
        sess = new_session(3)
        get = sess.get_global_func
        declared = getattr(sess.channel, "has_store", False)
        if self.has_store is not None:
            assert declared == self.has_store, (
                f"the kit says has_store={self.has_store}, the channel says {declared}"
            )
        if not declared:
            get("testing.store_add")("kit/none")
            with pytest.raises(disco.DiscoError, match="no rendezvous store"):
                _sync_all(sess)
            return
        prefix = f"kit-{os.getpid()}-{time.monotonic_ns()}"
        ref = get("testing.store_exchange")(prefix, 20.0)
        want = [b"value of %d" % w for w in range(3)]
        assert _values(ref, 3) == [want] * 3
        assert sorted(_values(get("testing.store_add")(f"{prefix}/n"), 3)) == [1, 2, 3]
        t0 = time.monotonic()
        get("testing.store_get")(f"{prefix}/never", 0.3)
        with pytest.raises(disco.DiscoTimeoutError, match=f"{prefix}/never"):
            _sync_all(sess)
        assert time.monotonic() - t0 < 10, "a store wait outlived its timeout"
        _sync_all(sess)  # the session goes on

    # ------------------------------------------------------------------ functions
    def test_get_global_func(self, sess):
        f = sess.get_global_func("testing.add")
        assert isinstance(f, disco.DPackedFunc)
        r = f(2, 3)
        assert isinstance(r, disco.DRef) and not isinstance(r, disco.DPackedFunc)
        assert _values(r, 3) == [5, 5, 5]
        assert _values(sess.call_packed(f, "a", "b"), 3) == ["ab"] * 3

    def test_unknown_function_is_an_error_at_the_first_sync(self, sess):
        """As in TVM, the workers look the name up: missing everywhere, it is a
        WorkerError (a ValueError there) naming the function at the next sync."""
        f = sess.get_global_func("testing.no_such_function")
        with pytest.raises(disco.WorkerError, match="testing.no_such_function") as info:
            _sync_all(sess)
        assert info.value.exc_type == "ValueError"
        with pytest.raises(TypeError):
            sess.get_global_func(42)
        f(1)  # calling it fails too, clearly
        with pytest.raises(disco.WorkerError, match="testing.no_such_function"):
            _sync_all(sess)
        _sync_all(sess)

    def test_call_packed_rejects_non_function(self, sess):
        with pytest.raises(TypeError):
            sess.call_packed(42, 1)
        with pytest.raises(TypeError):
            sess.call_packed(None)
        _sync_all(sess)

    def test_call_packed_value_types(self, sess):
        echo = sess.get_global_func("testing.echo")
        refs = [echo(value) for value in SCALARS]
        for value, r in zip(SCALARS, refs):
            for got in _values(r, 3):
                assert type(got) is type(value), (value, got)
                assert got == value
        everything = echo(tuple(SCALARS))
        assert _values(everything, 3) == [tuple(SCALARS)] * 3

    def test_call_packed_types_seen_by_worker(self, sess):
        args = (1, 2.0, True, "s", b"b", None, np.dtype("int8"), disco.Device("cpu", 0))
        args += ((1, [2.0, ("x", None)]), [b"y", ()], np.zeros((2, 3), "float32"))
        expected = (
            (
                "int",
                "float",
                "bool",
                "str",
                "bytes",
                "NoneType",
                np.dtype("int8").__class__.__name__,
            )
            + ("Device", ("int", ["float", ("str", "NoneType")]), ["bytes", ()])
            + ("ndarray[float32][2, 3]",)
        )
        r = sess.get_global_func("testing.describe")(*args)
        assert _values(r, 3) == [expected] * 3

    def test_dref_arguments_replaced_per_worker(self, sess):
        wid = sess.get_global_func("disco.worker_id")()
        r = sess.get_global_func("testing.echo_args")(
            1, (wid, [wid, "x", (None, wid)]), [b"b"], wid
        )
        for w, got in enumerate(_values(r, 3)):
            assert got == (1, (w, [w, "x", (None, w)]), [b"b"], w)

    def test_dref_argument_is_the_register_value(self, sess):
        arr = sess.empty((4,), "int64")
        sess.get_global_func("testing.fill")(arr, 5)
        for got in _values(arr, 3):
            np.testing.assert_array_equal(got, [5, 5, 5, 5])
        # Commands run in order, each on the register's own object.
        lst = sess.get_global_func("testing.new_list")()
        append = sess.get_global_func("testing.append")
        for i in range(50):
            append(lst, i)
        assert _values(lst, 3) == [list(range(50))] * 3

    def test_a_traced_session_gives_the_same_results(self, sess, tmp_path):
        """Under ``disco.trace`` commands give what they give untraced; every worker's
        track holds every command, in order, with the controller's call numbers."""
        path = tmp_path / "channel.json"
        with disco.trace(sess, path):
            lst = sess.get_global_func("testing.new_list")()
            append = sess.get_global_func("testing.append")
            for i in range(20):
                append(lst, i)
            wid = sess.get_global_func("disco.worker_id")()
            arr = sess.copy_to_worker_0(np.arange(6.0))
            back = np.empty(6)
            sess.copy_from_worker_0(back, arr)
            values = _values(lst, 3), _values(wid, 3)
        assert values == ([list(range(20))] * 3, [0, 1, 2])
        np.testing.assert_array_equal(back, np.arange(6.0))
        data = load_trace(path)
        assert data["otherData"]["dropped"] == [0, 0, 0] and not data["otherData"]["notes"]
        for cmds in check_streams(data, 3).values():
            assert sum(e["name"] == "testing.append" for e in cmds) == 20
        copies = [e["name"] for e in worker_events(data, 0, "copy")]
        assert copies == ["copy_to_worker_0", "copy_from_worker_0"]

    def test_numpy_arguments_by_value(self, sess):
        base = np.arange(6, dtype="float64")
        keep = base.copy()
        r = sess.get_global_func("testing.mutate")(base)
        got = _values(r, 3)
        np.testing.assert_array_equal(base, keep)  # the controller's array is untouched
        for w, arr in enumerate(got):
            assert isinstance(arr, np.ndarray) and arr.dtype == base.dtype
            np.testing.assert_array_equal(arr, keep + w + 1)  # no worker saw another's change
        # Changing the host array after the call changes nothing on the workers.
        r2 = sess.get_global_func("testing.echo")(base)
        base[:] = -1
        for arr in _values(r2, 3):
            np.testing.assert_array_equal(arr, keep)

    def test_array_variants(self, sess):
        echo = sess.get_global_func("testing.echo")
        arrays = {
            "strided": np.arange(24, dtype="float32").reshape(4, 6)[:, ::2],
            "fortran": np.asfortranarray(np.arange(12, dtype="int32").reshape(3, 4)),
            "0d": np.array(3.5),
            "empty": np.zeros((0, 5), "float64"),
            "bool": np.array([True, False, True]),
            "f16-out-of-band": np.arange(5000, dtype="float16"),
            "strided-out-of-band": np.arange(20000, dtype="float64")[::3],
            "int8": np.arange(-100, 100, dtype="int8"),
            "complex": np.arange(8, dtype="complex128"),
        }
        refs = {name: echo(a) for name, a in arrays.items()}
        for name, a in arrays.items():
            for got in _values(refs[name], 3):
                assert isinstance(got, np.ndarray), name
                assert got.shape == a.shape and got.dtype == a.dtype, name
                np.testing.assert_array_equal(got, a, err_msg=name)

    def test_large_array_8mib(self, sess):
        a = np.random.default_rng(0).integers(0, 255, size=8 << 20, dtype=np.uint8)
        expected = sess.get_global_func("testing.checksum")
        local = disco.get_global_func("testing.checksum")(a)
        assert _values(expected(a), 3) == [local] * 3
        r = sess.get_global_func("testing.echo")(a.view("float64"))
        back = r.debug_get_from_remote(2)
        np.testing.assert_array_equal(back, a.view("float64"))

    def test_return_values(self, sess):
        r = sess.get_global_func("testing.make_dict")()
        for w, got in enumerate(_values(r, 3)):
            assert got == {"worker": w, "nested": [1, (2, 3)], "text": "é"}
        arr = sess.get_global_func("testing.arange")(10, "int32")
        for w, got in enumerate(_values(arr, 3)):
            np.testing.assert_array_equal(got, np.arange(10, dtype="int32") * (w + 1))

    def test_unpicklable_argument_is_type_error(self, sess):
        echo = sess.get_global_func("testing.echo")
        with pytest.raises(TypeError):
            echo(threading.Lock())
        with pytest.raises(TypeError):
            echo((1, [lambda: 0]))
        assert _values(echo(7), 3) == [7, 7, 7]

    def test_dref_of_another_session(self, sess, new_session):
        other = new_session(2)
        foreign = other.get_global_func("testing.echo")(1)
        with pytest.raises(ValueError):
            sess.get_global_func("testing.echo")(foreign)
        with pytest.raises(TypeError):
            sess.call_packed(other.get_global_func("testing.echo"), 1)
        assert foreign.debug_get_from_remote(1) == 1
        _sync_all(sess)

    def test_commands_are_asynchronous(self, sess):
        sleep = sess.get_global_func("testing.sleep")
        t0 = time.monotonic()
        sleep(1.0)
        returned = time.monotonic() - t0
        sess.sync_worker_0()
        synced = time.monotonic() - t0
        assert returned < 0.5, f"call_packed waited {returned:.2f} s for the command to run"
        assert synced >= 0.9, "sync_worker_0 returned before worker 0 ran the command"

    # ------------------------------------------------------------------ modules
    def test_import_python_module_error_at_call_site(self, sess):
        with pytest.raises(ImportError):
            sess.import_python_module("disco_core.testing.no_such_module_here")
        _sync_all(sess)
        assert _values(sess.get_global_func("testing.echo")(1), 3) == [1, 1, 1]

    def test_import_python_module_on_every_worker(self, sess):
        pids = _values(sess.get_global_func("testing.pid")(), 3)
        assert pids[0] == os.getpid()
        for w in self.killable_workers(sess):
            assert pids[w] != os.getpid()

    def test_load_vm_module(self, sess, tmp_path):
        path = tmp_path / "disco_kit_module.py"
        path.write_text(_PY_MODULE)
        mod = sess.load_vm_module(str(path))
        assert isinstance(mod, disco.DModule)
        scale = mod["scale"]
        assert isinstance(scale, disco.DPackedFunc)
        for got in _values(scale(np.arange(3.0), 2), 3):
            np.testing.assert_array_equal(got, [0.0, 2.0, 4.0])
        assert _values(mod["whoami"](), 3) == [0, 1, 2]
        wid = sess.get_global_func("disco.worker_id")()
        assert _values(mod["first_arg"](wid), 3) == [0, 1, 2]
        # A pathlib.Path is accepted too.
        assert _values(sess.load_vm_module(path)["whoami"](), 3) == [0, 1, 2]

    def test_load_vm_module_errors(self, sess, tmp_path):
        with pytest.raises(FileNotFoundError):
            sess.load_vm_module(str(tmp_path / "missing.py"))
        odd = tmp_path / "model.unknownsuffix"
        odd.write_text("")
        with pytest.raises(disco.PluginNotFoundError):
            sess.load_vm_module(str(odd))
        bare = tmp_path / "model"
        bare.write_text("")
        with pytest.raises(ValueError, match="no file suffix"):
            sess.load_vm_module(str(bare))
        path = tmp_path / "disco_kit_module2.py"
        path.write_text(_PY_MODULE)
        mod = sess.load_vm_module(str(path))
        mod["no_such_function"]
        with pytest.raises(disco.WorkerError):
            _sync_all(sess)
        mod["CONSTANT"]  # not callable
        with pytest.raises(disco.WorkerError):
            _sync_all(sess)
        broken = tmp_path / "disco_kit_broken.py"
        broken.write_text("raise RuntimeError('module top level failed')\n")
        sess.load_vm_module(str(broken))
        with pytest.raises(disco.WorkerError, match="module top level failed"):
            _sync_all(sess)
        assert _values(mod["whoami"](), 3) == [0, 1, 2]

    # ------------------------------------------------------------------ copies
    def test_copy_to_worker0_allocates(self, sess):
        host = np.arange(12, dtype="float32").reshape(3, 4)
        r = sess.copy_to_worker_0(host)
        assert isinstance(r, disco.DRef)
        host_copy = host.copy()
        host[:] = -1  # copy_to_worker_0 returned: worker 0 holds its own data
        out = np.empty((3, 4), "float32")
        sess.copy_from_worker_0(out, r)
        np.testing.assert_array_equal(out, host_copy)
        np.testing.assert_array_equal(r.debug_get_from_remote(0), host_copy)
        assert r.debug_get_from_remote(1) is None  # only worker 0 allocated

    def test_copy_into_existing(self, sess):
        dst = sess.empty((5,), "int64")
        host = np.arange(5, dtype="int64") * 3
        assert sess.copy_to_worker_0(host, dst) is dst
        out = np.zeros(5, "int64")
        sess.copy_from_worker_0(out, dst)
        np.testing.assert_array_equal(out, host)
        # A strided destination view and a strided source.
        strided_src = np.arange(10, dtype="int64")[::2]
        sess.copy_to_worker_0(strided_src, dst)
        out2 = np.zeros(10, "int64")
        sess.copy_from_worker_0(out2[::2], dst)
        np.testing.assert_array_equal(out2[::2], strided_src)
        np.testing.assert_array_equal(out2[1::2], 0)

    def test_copy_8mib(self, sess):
        host = np.random.default_rng(1).standard_normal(1 << 20)  # 8 MiB of float64
        r = sess.copy_to_worker_0(host)
        out = np.empty_like(host)
        sess.copy_from_worker_0(out, r)
        np.testing.assert_array_equal(out, host)

    def test_copy_dlpack_source(self, sess):
        host = np.arange(6, dtype="float32")
        r = sess.copy_to_worker_0(DLPackOnly(host))
        np.testing.assert_array_equal(r.debug_get_from_remote(0), host)

    def test_copy_shape_mismatch(self, sess):
        dst = sess.empty((4,), "float32")
        with pytest.raises((ValueError, disco.WorkerError), match="shape"):
            sess.copy_to_worker_0(np.zeros(5, "float32"), dst)
        with pytest.raises((ValueError, disco.WorkerError), match="shape|dtype"):
            sess.copy_to_worker_0(np.zeros(4, "int32"), dst)
        with pytest.raises((ValueError, disco.WorkerError), match="shape"):
            sess.copy_from_worker_0(np.zeros((2, 3), "float32"), dst)
        # The session is fine and no stale error surfaces later.
        sess.sync_worker_0()
        _sync_all(sess)
        sess.copy_to_worker_0(np.ones(4, "float32"), dst)
        out = np.zeros(4, "float32")
        sess.copy_from_worker_0(out, dst)
        np.testing.assert_array_equal(out, 1)
        # As TVM's Tensor::CopyFrom: the same number of elements fits whatever the shape.
        sess.copy_to_worker_0(np.arange(4, dtype="float32").reshape(2, 2), dst)
        out = np.zeros((2, 2), "float32")
        sess.copy_from_worker_0(out, dst)
        np.testing.assert_array_equal(out, [[0, 1], [2, 3]])

    def test_copy_bad_arguments(self, sess):
        dst = sess.empty((4,), "float32")
        with pytest.raises(TypeError):
            sess.copy_from_worker_0(np.zeros(4, "float32"), "not a dref")
        with pytest.raises(TypeError):
            sess.copy_to_worker_0(np.zeros(4, "float32"), "not a dref")
        ro = np.zeros(4, "float32")
        ro.flags.writeable = False
        with pytest.raises(ValueError):
            sess.copy_from_worker_0(ro, dst)
        _sync_all(sess)

    # ------------------------------------------------------------------ debug get / set
    def test_debug_get_and_copy_from_every_worker(self, sess):
        r = sess.empty((3,), "float64")
        sources = [np.full(3, w * 1.5) for w in range(3)]
        for w in range(3):
            r.debug_copy_from(w, sources[w])
        for s in sources:
            s[:] = 99  # debug_copy_from copied: later changes stay here
        for w, got in enumerate(_values(r, 3)):
            np.testing.assert_array_equal(got, np.full(3, w * 1.5))
        r.debug_copy_from(1, DLPackOnly(np.arange(3.0)))
        np.testing.assert_array_equal(r.debug_get_from_remote(1), np.arange(3.0))
        # An array is copied into, as in TVM: another size, dtype or kind is an error.
        for bad in (np.zeros(4), np.zeros(3, "float32"), {"any": 1}):
            with pytest.raises(disco.WorkerError, match="debug_copy_from"):
                r.debug_copy_from(2, bad)
        np.testing.assert_array_equal(r.debug_get_from_remote(2), np.full(3, 3.0))
        # The same number of elements in another shape fits (TVM copies whenever the
        # sizes match; its own allgather test copies a flat array into a (3, 3, 2) one).
        r.debug_copy_from(0, np.arange(3.0).reshape(3, 1))
        np.testing.assert_array_equal(r.debug_get_from_remote(0), np.arange(3.0))
        r.debug_copy_from(0, sources[0] * 0)
        # A register holding no array takes the value (TVM's SetRegister).
        n = sess.get_global_func("testing.echo")(None)
        n.debug_copy_from(2, {"any": ("picklable", 1)})
        assert n.debug_get_from_remote(2) == {"any": ("picklable", 1)}

    def test_debug_bad_worker_id(self, sess):
        r = sess.get_global_func("testing.echo")(1)
        with pytest.raises(ValueError):
            r.debug_get_from_remote(3)
        with pytest.raises(ValueError):
            r.debug_get_from_remote(-1)
        with pytest.raises(TypeError):
            r.debug_get_from_remote("0")
        with pytest.raises(ValueError):
            r.debug_copy_from(5, 1)
        assert _values(r, 3) == [1, 1, 1]

    def test_debug_get_returns_a_copy(self, sess):
        r = sess.get_global_func("testing.arange")(4, "float32")
        got = r.debug_get_from_remote(0)
        got[:] = 42
        np.testing.assert_array_equal(r.debug_get_from_remote(0), np.arange(4, dtype="float32"))

    # ------------------------------------------------------------------ empty and groups
    def test_empty(self, new_session):
        sess = new_session(4, 2)
        r = sess.empty((2, 3), "float32")
        for got in _values(r, 4):
            assert isinstance(got, np.ndarray) and got.shape == (2, 3) and got.dtype == "float32"
        r = sess.empty(5, np.dtype("int16"), device="cpu:0")
        assert all(g.shape == (5,) and g.dtype == "int16" for g in _values(r, 4))
        r = sess.empty((2,), "float64", device=disco.Device("cpu", 0), worker0_only=True)
        got = _values(r, 4)  # group roots are workers 0 and 2
        assert [g is None for g in got] == [False, True, False, True]
        r = sess.empty((2,), "float64", worker0_only=True, in_group=False)
        assert [g is None for g in _values(r, 4)] == [False, True, True, True]
        f = sess.get_global_func("disco.empty")
        r = f((3,), "int8", None, True, True)
        assert [g is None for g in _values(r, 4)] == [False, True, False, True]

    def test_empty_bad_arguments_at_call_site(self, sess):
        with pytest.raises(TypeError):
            sess.empty((2,), "not_a_dtype")
        with pytest.raises(TypeError):
            sess.empty((2,), object)
        with pytest.raises(TypeError):
            sess.empty((2,), None)
        with pytest.raises(ValueError):
            sess.empty((-1, 2), "float32")
        with pytest.raises(TypeError):
            sess.empty((2.5,), "float32")
        with pytest.raises(TypeError):
            sess.empty("ab", "float32")
        with pytest.raises((ValueError, TypeError)):
            sess.empty((2,), "float32", device="no_such_device")
        _sync_all(sess)

    # ------------------------------------------------------------------ registers
    def test_dref_freeing_keeps_registers_bounded(self, sess):
        count = sess.get_global_func("disco.register_count")
        before = max(_values(count(), 3))
        echo = sess.get_global_func("testing.echo")
        highest = 0
        for i in range(20_000):
            r = echo(i)
            highest = max(highest, r.reg_id)
        x = sess.get_global_func("disco.worker_id")()
        add = sess.get_global_func("testing.add")
        for _ in range(2_000):  # chains: each step frees the previous step
            x = add(x, 1)
        assert _values(x, 3) == [2000, 2001, 2002]
        del r, x
        gc.collect()
        _sync_all(sess)
        after = _values(count(), 3)
        assert max(after) <= before + 10, f"registers leak: {before} before, {after} after"
        assert highest < 100, f"register ids are not reused (highest {highest})"

    def test_register_ids_reused_with_fresh_values(self, sess):
        echo = sess.get_global_func("testing.echo")
        a = echo("old")
        rid = a.reg_id
        del a
        flush = echo(None)  # the kill may ride along with the next command to all workers
        b = echo("new")
        c = echo("newer")
        assert rid in (b.reg_id, c.reg_id)
        assert flush.reg_id != rid
        assert _values(b, 3) == ["new"] * 3
        assert _values(c, 3) == ["newer"] * 3

    def test_call_on_freed_register(self, sess):
        echo = sess.get_global_func("testing.echo")
        stale = disco.DRef(sess, 1_000_000)  # a register that holds nothing
        try:
            echo(stale)
            with pytest.raises(disco.WorkerError, match="register"):
                sess.sync_worker_0()
            with pytest.raises(disco.WorkerError):
                stale.debug_get_from_remote(1)
        finally:
            stale.reg_id = 0  # never allocated: do not free it
        a = echo(1)
        rid = a.reg_id
        del a
        echo(None)  # carries the kill of the register (the id is free, not yet reused)
        freed = disco.DRef(sess, rid)
        try:
            with pytest.raises(disco.WorkerError):
                freed.debug_get_from_remote(2)
        finally:
            freed.reg_id = 0
        _sync_all(sess)
        assert _values(echo(2), 3) == [2, 2, 2]

    # ------------------------------------------------------------------ errors
    def test_worker_error_on_every_worker(self, sess):
        sess.get_global_func("testing.raise")("ValueError", "bad thing 123")
        with pytest.raises(disco.WorkerError) as info:
            sess.sync_worker_0()
        e = info.value
        assert isinstance(e, disco.DiscoError)
        assert e.worker_id == 0 and e.exc_type == "ValueError"
        assert "bad thing 123" in str(e) and "ValueError" in str(e) and "worker 0" in str(e)
        assert "funcs.py" in e.remote_traceback and "raise_" in e.remote_traceback
        assert e.remote_traceback.rstrip().splitlines()[-1] in str(e)
        assert sorted(o.worker_id for o in e.others) == [1, 2]
        assert all(o.exc_type == "ValueError" and o.remote_traceback for o in e.others)
        # Usable afterwards, and nothing stale surfaces later.
        sess.sync_worker_0()
        _sync_all(sess)
        assert _values(sess.get_global_func("testing.echo")(5), 3) == [5, 5, 5]

    def test_worker_error_on_one_worker(self, sess):
        sess.get_global_func("testing.raise_on")(2, "KeyError", "only here")
        ok = sess.get_global_func("testing.echo")(1)
        with pytest.raises(disco.WorkerError) as info:
            ok.debug_get_from_remote(2)
        assert info.value.worker_id == 2 and info.value.exc_type == "KeyError"
        assert "only here" in str(info.value) and info.value.remote_traceback
        assert _values(ok, 3) == [1, 1, 1]
        sess.sync_worker_0()

    def test_worker_error_type_names(self, sess):
        sess.get_global_func("testing.raise")("ZeroDivisionError", "x")
        with pytest.raises(disco.WorkerError) as info:
            sess.sync_worker_0()
        assert info.value.exc_type == "ZeroDivisionError"

    def test_failed_result_register(self, sess):
        bad = sess.get_global_func("testing.raise_on")(1, "ValueError", "failed result")
        with pytest.raises(disco.WorkerError, match="failed result") as info:
            bad.debug_get_from_remote(1)
        assert info.value.worker_id == 1

    def test_no_stale_error_after_failed_debug_get(self, sess):
        """One failure is reported once: the next synchronising call is clean."""
        bad = sess.get_global_func("testing.raise_on")(1, "ValueError", "reported once")
        with pytest.raises(disco.WorkerError):
            bad.debug_get_from_remote(1)
        sess.sync_worker_0()
        _sync_all(sess)

    def test_unpicklable_result_is_an_error_not_a_death(self, sess):
        r = sess.get_global_func("testing.unpicklable")()
        for w in range(3):
            try:
                r.debug_get_from_remote(w)  # in-process workers may hand the object over
            except disco.WorkerError:
                pass
        _sync_all(sess)
        assert _values(sess.get_global_func("testing.echo")(3), 3) == [3, 3, 3]

    def test_error_in_dpackedfunc_register_argument(self, sess):
        bad = sess.get_global_func("testing.raise")("RuntimeError", "first")
        sess.get_global_func("testing.echo")(bad)  # uses a register that holds no value
        with pytest.raises(disco.WorkerError, match="first"):
            sess.sync_worker_0()
        _sync_all(sess)

    # ------------------------------------------------------------------ worker death
    def _need_killable(self, sess) -> int:
        ids = self.killable_workers(sess)
        if not ids:
            pytest.skip("this channel's workers are not separate processes")
        return ids[-1]

    @pytest.mark.timeout(30)
    @pytest.mark.parametrize("mode", ["exit", "sigkill", "segfault"])
    def test_worker_death_is_reported(self, sess, mode):
        target = self._need_killable(sess)
        pids = _values(sess.get_global_func("testing.pid")(), 3)
        ok = sess.get_global_func("testing.echo")(1)
        t0 = time.monotonic()
        sess.get_global_func("testing.die")(mode, target, os.getpid())
        with pytest.raises(disco.WorkerDiedError) as info:
            ok.debug_get_from_remote(target)
        took = time.monotonic() - t0
        assert took < self.death_timeout, f"death reported after {took:.2f} s"
        assert target in info.value.worker_ids
        assert isinstance(info.value, disco.DiscoError)
        # Every later synchronising call says so at once; none hangs.
        for call in (sess.sync_worker_0, lambda: ok.debug_get_from_remote(0)):
            t1 = time.monotonic()
            with pytest.raises(disco.WorkerDiedError):
                call()
            assert time.monotonic() - t1 < self.death_timeout
        try:
            sess.get_global_func("testing.echo")(2)
        except disco.WorkerDiedError:
            pass
        t2 = time.monotonic()
        sess.shutdown()
        assert time.monotonic() - t2 < 10
        sess.shutdown()
        assert wait_gone([pids[target]], 5) == []

    @pytest.mark.timeout(30)
    def test_worker_death_while_waiting_on_another(self, sess):
        target = self._need_killable(sess)
        other = next(w for w in range(3) if w != target)
        ok = sess.get_global_func("testing.echo")(1)
        sess.get_global_func("testing.sleep")(3.0, other)
        t0 = time.monotonic()
        sess.get_global_func("testing.die")("exit", target, os.getpid(), 0.2)
        with pytest.raises(disco.WorkerDiedError) as info:
            ok.debug_get_from_remote(other)  # other is busy; target dies meanwhile
        took = time.monotonic() - t0
        assert took < self.death_timeout + 0.2, f"death reported after {took:.2f} s"
        assert info.value.worker_ids == [target]
        sess.shutdown()

    @pytest.mark.timeout(30)
    def test_frozen_worker_is_unresponsive(self, new_session, monkeypatch):
        """A stopped worker process ends a wait as WorkerUnresponsiveError, never a hang."""
        # read as the session starts; remote workers beat once a second
        monkeypatch.setenv("DISCO_LIVENESS_TIMEOUT", "3")
        sess = new_session(3)
        target = self._need_killable(sess)
        pids = _values(sess.get_global_func("testing.pid")(), 3)
        ok = sess.get_global_func("testing.echo")(1)
        freeze(pids[target])
        try:
            t0 = time.monotonic()
            with pytest.raises(disco.WorkerUnresponsiveError) as info:
                ok.debug_get_from_remote(target)
            took = time.monotonic() - t0
        finally:
            try:
                os.kill(pids[target], signal.SIGCONT)
            except ProcessLookupError:
                pass
        assert info.value.worker_ids == [target], info.value
        assert took < 3 + self.death_timeout, f"reported after {took:.2f} s"
        with pytest.raises(disco.WorkerDiedError):
            sess.sync_worker_0()
        sess.shutdown()
        assert wait_gone([pids[target]], 10) == []

    def test_recv_with_timeout_ends(self, sess):
        """``Channel.recv(worker, timeout)`` (the gathering after a failure) has an end."""
        t0 = time.monotonic()
        with pytest.raises(disco.DiscoTimeoutError):
            sess.channel.recv(sess.num_workers - 1, timeout=0.3)  # no reply is owed
        assert time.monotonic() - t0 < 2.0
        _sync_all(sess)  # and the session is in step

    @pytest.mark.timeout(30)
    def test_worker_processes_gone_after_shutdown(self, sess):
        ids = self.killable_workers(sess)
        if not ids:
            pytest.skip("this channel's workers are not separate processes")
        pids = _values(sess.get_global_func("testing.pid")(), 3)
        assert all(not gone(pids[w]) for w in ids)
        sess.get_global_func("testing.sleep")(0.5)  # shutdown while commands are pending
        sess.shutdown()
        assert wait_gone([pids[w] for w in ids], 5) == []

    # ------------------------------------------------------------------ shutdown
    @pytest.mark.timeout(30)
    def test_shutdown_idempotent_and_closed_errors(self, sess, tmp_path):
        f = sess.get_global_func("testing.echo")
        r = f(1)
        arr = sess.empty((2,), "float32")
        t0 = time.monotonic()
        sess.shutdown()
        sess.shutdown()
        assert time.monotonic() - t0 < 6
        calls = [
            lambda: sess.get_global_func("testing.echo"),
            lambda: f(1),
            lambda: sess.call_packed(f, 1),
            sess.sync_worker_0,
            lambda: sess.copy_to_worker_0(np.zeros(2, "float32")),
            lambda: sess.copy_to_worker_0(np.zeros(2, "float32"), arr),
            lambda: sess.copy_from_worker_0(np.zeros(2, "float32"), arr),
            lambda: sess.empty((2,), "float32"),
            lambda: r.debug_get_from_remote(0),
            lambda: r.debug_copy_from(0, 1),
            lambda: sess.import_python_module(FUNCS_MODULE),
            lambda: sess.load_vm_module(str(tmp_path / "m.py")),
            lambda: sess.init_ccl("shm"),
        ]
        for i, call in enumerate(calls):
            with pytest.raises(disco.SessionClosedError):
                call()
                pytest.fail(f"call {i} did not raise")
        r = arr = f = None  # dropping DRefs after shutdown is silent
        gc.collect()

    @pytest.mark.timeout(30)
    def test_context_manager(self, make_session):
        with make_session(2) as sess:
            assert isinstance(sess, disco.Session)
            sess.import_python_module(FUNCS_MODULE)
            r = sess.get_global_func("testing.echo")(4)
            assert r.debug_get_from_remote(1) == 4
        with pytest.raises(disco.SessionClosedError):
            sess.sync_worker_0()
        with pytest.raises(KeyError):
            with make_session(2) as sess2:
                raise KeyError("inside")
        with pytest.raises(disco.SessionClosedError):
            sess2.sync_worker_0()

    @pytest.mark.timeout(30)
    def test_shutdown_with_pending_commands(self, sess):
        echo = sess.get_global_func("testing.echo")
        keep = [echo(i) for i in range(500)]
        t0 = time.monotonic()
        sess.shutdown()
        assert time.monotonic() - t0 < 6
        del keep

    @pytest.mark.timeout(30)
    def test_shutdown_after_worker_error(self, sess):
        sess.get_global_func("testing.raise")()
        sess.shutdown()  # pending errors do not block shutdown
        with pytest.raises(disco.SessionClosedError):
            sess.sync_worker_0()
