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
