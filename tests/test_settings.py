"""Durations from the environment: one parser, a clear error naming the variable."""

from __future__ import annotations

import os

import pytest

import disco_core as disco
from disco_core.settings import env_seconds, env_seconds_or_default


@pytest.mark.parametrize("raw", ["abc", "-1", "nan", "1e"])
def test_bad_values_name_the_variable(monkeypatch, raw):
    monkeypatch.setenv("DISCO_TEST_SECONDS", raw)
    with pytest.raises(disco.DiscoValueError, match="DISCO_TEST_SECONDS"):
        env_seconds("DISCO_TEST_SECONDS", 3.0)
    with pytest.warns(RuntimeWarning, match="DISCO_TEST_SECONDS"):
        assert env_seconds_or_default("DISCO_TEST_SECONDS", 3.0) == 3.0


def test_good_values(monkeypatch):
    monkeypatch.delenv("DISCO_TEST_SECONDS", raising=False)
    assert env_seconds("DISCO_TEST_SECONDS", 3) == 3.0
    for raw, value in (("", 3.0), (" 2.5 ", 2.5), ("0", 0.0), ("inf", float("inf"))):
        monkeypatch.setenv("DISCO_TEST_SECONDS", raw)
        assert env_seconds("DISCO_TEST_SECONDS", 3) == value


@pytest.mark.timeout(60)
def test_bad_start_timeout_is_an_error_at_the_call_site(monkeypatch, no_leftover_children):
    monkeypatch.setenv("DISCO_START_TIMEOUT", "soon")
    with pytest.raises(disco.DiscoValueError, match="DISCO_START_TIMEOUT"):
        disco.ProcessSession(2)


@pytest.mark.timeout(60)
def test_bad_shutdown_timeout_still_stops_the_workers(monkeypatch, procs):
    sess = disco.ProcessSession(2)
    pid = sess.channel.procs[0].proc.pid
    monkeypatch.setenv("DISCO_SHUTDOWN_TIMEOUT", "abc")
    with pytest.warns(RuntimeWarning, match="DISCO_SHUTDOWN_TIMEOUT"):
        sess.shutdown()
    assert procs.wait_gone([pid], 5) == []


@pytest.mark.timeout(60)
def test_bad_flush_delay_does_not_break_the_import(python_run):
    r = python_run(
        "import disco_core as d; print(d.channels.base.FLUSH_DELAY)",
        env={"DISCO_FLUSH_DELAY": "abc", "PYTHONWARNINGS": "default"},
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "0.0005" and "DISCO_FLUSH_DELAY" in r.stderr


def test_no_bare_float_of_an_environment_variable():
    """Every duration read from the environment goes through disco_core.settings."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    offenders = []
    for base in ("disco_core", "plugins"):
        for dirpath, _, files in os.walk(os.path.join(root, base)):
            if "/tests" in dirpath or ".egg-info" in dirpath:
                continue
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(dirpath, name)
                    with open(path) as f:
                        for no, line in enumerate(f, 1):
                            if "float(os.environ" in line:
                                offenders.append(f"{path}:{no}: {line.strip()}")
    # not durations of a wait: spin budgets, and a command-line default (argparse says why)
    allowed = ("DISCO_SHM_SPIN_US", "DISCO_RPC_SPIN_US", "DISCO_CONNECT_TIMEOUT", "DISCO_LIVENESS")
    assert [o for o in offenders if not any(a in o for a in allowed)] == [], offenders


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["process", "threaded"])
def test_a_bad_gather_timeout_is_refused_when_the_session_starts(monkeypatch, kind, no_leftover_children):  # fmt: skip
    """It was read only after a worker failed, and the error about the setting took the
    worker's own error's place: the failure was never reported (an outside check)."""
    import threading

    monkeypatch.setenv("DISCO_GATHER_TIMEOUT", "x")
    before = threading.active_count()
    with pytest.raises(disco.DiscoValueError, match="DISCO_GATHER_TIMEOUT"):
        disco.Session.create(kind, num_workers=2)
    assert threading.active_count() == before  # refused before a worker thread started


def test_a_gather_timeout_changed_later_still_reports_the_worker_error(monkeypatch):
    sess = disco.ThreadedSession(2)
    try:
        sess.import_python_module("disco_core.testing.funcs")
        monkeypatch.setenv("DISCO_GATHER_TIMEOUT", "x")
        with pytest.warns(RuntimeWarning, match="DISCO_GATHER_TIMEOUT"):
            with pytest.raises(disco.WorkerError, match="ValueError"):
                sess.get_global_func("testing.raise_")().debug_get_from_remote(0)
    finally:
        sess.shutdown()


@pytest.mark.timeout(60)
def test_a_start_timeout_of_zero_is_refused(monkeypatch, no_leftover_children):
    monkeypatch.setenv("DISCO_START_TIMEOUT", "0")
    with pytest.raises(disco.DiscoValueError, match="DISCO_START_TIMEOUT"):
        disco.ProcessSession(2)


def test_a_session_of_too_many_workers_is_refused_before_anything_is_made():
    """ThreadedSession(10**9) took memory until the process was killed."""
    from disco_core.session import MAX_WORKERS

    with pytest.raises(disco.DiscoValueError, match=f"at most {MAX_WORKERS}"):
        disco.ThreadedSession(10**9)


@pytest.mark.timeout(60)
def test_threads_that_cannot_start_leave_none_behind():
    """Past what the process may start, the threads started so far stayed (an outside
    check); now they are stopped and the error says what failed."""
    import subprocess
    import sys

    code = (
        "import resource, threading, time, disco_core as disco\n"
        "resource.setrlimit(resource.RLIMIT_AS, (2_000_000_000, 2_000_000_000))\n"
        "n = threading.active_count()\n"
        "try:\n"
        "    disco.ThreadedSession(60000)\n"
        "except disco.DiscoError as exc:\n"
        "    print('REFUSED', 'could not be started' in str(exc))\n"
        "time.sleep(1.5)\n"
        "print('THREADS', threading.active_count() - n)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert "REFUSED True" in r.stdout and "THREADS 0" in r.stdout, r.stdout + r.stderr[-2000:]


@pytest.mark.parametrize("var, raw", [("DISCO_CCL_TIMEOUT", "abc")])
def test_a_bad_ccl_variable_is_named(monkeypatch, var, raw):
    monkeypatch.setenv(var, raw)
    sess = disco.ThreadedSession(2)
    try:
        with pytest.raises(disco.DiscoValueError, match=var):
            sess.init_ccl("shm")
    finally:
        sess.shutdown()


def test_a_bad_shm_spin_warns_naming_it(monkeypatch):
    monkeypatch.setenv("DISCO_SHM_SPIN_US", "x")
    from disco_core.ccl.shm import _spin_us

    with pytest.warns(RuntimeWarning, match="DISCO_SHM_SPIN_US"):
        assert _spin_us() == 200.0


def test_a_listen_host_that_does_not_resolve_is_named_not_called_insecure():
    from disco_core.net.security import check_bind

    with pytest.raises(disco.DiscoValueError, match="does not resolve"):
        check_bind("no.such.host.invalid", token=None, tls=False, what="test")


def test_the_listen_family_follows_what_the_host_resolves_to(monkeypatch):
    import socket

    from disco_core.net import security

    assert security.listen_family("") == socket.AF_INET
    assert security.listen_family("127.0.0.1") == socket.AF_INET
    assert security.listen_family("::1") == socket.AF_INET6
    with pytest.raises(disco.DiscoValueError, match="without brackets"):
        security.listen_family("[::1]")  # bind() does not take it (outside check 58)
    with pytest.raises(disco.DiscoValueError, match="does not resolve"):
        security.listen_family("a" * 64 + ".com")  # a label over 63: UnicodeError
    assert security.listen_family("localhost") == socket.AF_INET  # keeps meaning 127.0.0.1

    # a name with only an IPv6 address (ip6-localhost where /etc/hosts has it)
    v6 = [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", 0, 0, 0))]
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: v6)
    assert security.listen_family("ip6-localhost") == socket.AF_INET6


def test_a_special_loopback_name_that_does_not_resolve_is_named(monkeypatch):
    import socket

    from disco_core.net import security

    def fail(*a, **k):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", fail)
    # before: taken as loopback by its name, then a raw socket.gaierror from bind
    with pytest.raises(
        disco.DiscoValueError, match="'ip6-localhost' for the test: the name does not resolve"
    ):
        security.check_bind("ip6-localhost", token=None, tls=False, what="test")
