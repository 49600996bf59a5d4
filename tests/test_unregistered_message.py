"""A function the controller's script registers is unknown to process workers: the error says why.

What a new user hit (issue 17, item 1): ``worker 1 raised ValueError: global function
'my.double' is not registered``, buried under "register N holds no value" errors
that only followed from it, and chained to another traceback.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import disco_core as disco
from disco_core import registry
from disco_core.errors import WorkerError, is_follow_on

NAME = "test.unreg.double"


@pytest.fixture
def in_script_only():
    """A function registered here, in the controller's process only (as a script's would be)."""
    disco.register_func(NAME, lambda x: x * 2, override=True)
    yield NAME
    registry.remove_global_func(NAME)


@pytest.mark.timeout(60)
def test_process_workers_say_why_and_how(in_script_only):
    with disco.ProcessSession(3) as sess:
        f = sess.get_global_func(NAME)
        a = sess.empty((4,), "float32")
        c = f(f(a))  # two follow-on failures on each process worker
        with pytest.raises(disco.WorkerError) as info:
            c.debug_get_from_remote(1)
        err = info.value
        # the type callers rely on is kept: a WorkerError for a remote ValueError
        assert isinstance(err, WorkerError) and err.exc_type == "ValueError"
        assert err.worker_id == 1
        text = str(err)
        headline = text.splitlines()[0]
        assert f"{NAME!r} is not registered on worker 1" in headline
        assert "process of its own" in headline
        assert "sess.import_python_module(" in headline
        # worker 2's identical error is one short mention, not the whole text again
        assert "(and 1 more: the same on worker 2)" in text
        # the follow-on errors are counted, not quoted, and none is the headline
        assert "holds no value" not in text
        follow = [e for e in err.others if is_follow_on(e)]
        assert follow and all("holds no value" in e.remote_message for e in follow)
        assert f"({len(follow)} follow-on errors not shown" in text
        # no chained traceback ("During handling of the above exception ...")
        assert err.__context__ is None or err.__suppress_context__
        # the session is still usable, and worker 0 (the controller's process) ran it
        assert c.debug_get_from_remote(0).shape == (4,)


@pytest.mark.timeout(60)
def test_import_python_module_is_the_cure(tmp_path, monkeypatch):
    mod = "disco_test_unreg_cure"
    (tmp_path / f"{mod}.py").write_text(
        textwrap.dedent(
            f"""
            import disco_core as disco

            @disco.register_func("{mod}.double", override=True)
            def double(x):
                return x * 2
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("DISCO_SYS_PATH", str(tmp_path))
    try:
        with disco.ProcessSession(2) as sess:
            sess.import_python_module(mod)
            r = sess.get_global_func(f"{mod}.double")(21)
            assert [r.debug_get_from_remote(w) for w in range(2)] == [42, 42]
    finally:
        registry.remove_global_func(f"{mod}.double")
        sys.modules.pop(mod, None)


@pytest.mark.timeout(60)
def test_threaded_workers_keep_the_short_message():
    # Threads share the controller's registry: the process hint would mislead there.
    with disco.ThreadedSession(2) as sess:
        sess.get_global_func("test.unreg.nowhere")
        with pytest.raises(disco.WorkerError) as info:
            sess.sync_worker_0()
            sess.get_global_func("disco.worker_id")().debug_get_from_remote(1)
        assert info.value.exc_type == "ValueError"
        assert "'test.unreg.nowhere' is not registered" in str(info.value)
        assert "process of its own" not in str(info.value)


@pytest.mark.timeout(60)
def test_a_module_beside_the_cwd_but_not_the_script_says_where_python_looked(tmp_path):
    """A script run from elsewhere imports a module of the current directory: the error
    says that Python looked in the script's folder, and what to do."""
    script = tmp_path / "job.py"
    script.write_text(
        "import disco_core as disco\n"
        "with disco.ThreadedSession(1) as s:\n"
        "    s.import_python_module('examples.mymod')\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run(
        [sys.executable, str(script)], cwd=root, env=env, capture_output=True, text=True,
        timeout=50,
    )  # fmt: skip
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "disco_core.errors.DiscoModuleNotFoundError: import_python_module('examples.mymod')"
    )
    assert "running script's folder" in last and "PYTHONPATH" in last and str(tmp_path) in last


@pytest.mark.timeout(60)
def test_import_python_module_keeps_its_place_in_the_command_order(tmp_path, monkeypatch):
    """Worker 0 imports in the controller's process, after the commands sent before."""
    log = tmp_path / "order.txt"
    (tmp_path / "first_loaded.py").write_text(f"open({str(log)!r}, 'a').write('load ')\n")
    (tmp_path / "then_imported.py").write_text(f"open({str(log)!r}, 'a').write('import ')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with disco.ThreadedSession(1) as sess:
        sess.load_vm_module(str(tmp_path / "first_loaded.py"))
        sess.import_python_module("then_imported")
        sess.sync_worker_0()
    assert log.read_text() == "load import "
