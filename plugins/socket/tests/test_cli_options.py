"""``disco-socket``: --version, -v/--log-level and help with defaults (issue 17)."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import version

import pytest

from disco_core.testing.commands import assert_documented
from disco_socket import cli
from disco_socket.wire import PROTOCOL_VERSION


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "disco_socket", *args],
        capture_output=True,
        text=True,
        timeout=30,
        env={k: v for k, v in os.environ.items() if k != "DISCO_LOG_LEVEL"},
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args", [("--version",), ("join", "--version"), ("version",)])
def test_version(args):
    r = _run(*args)
    assert r.returncode == 0, r.stderr
    assert (
        r.stdout.strip() == f"disco-socket {version('disco-socket')} (protocol {PROTOCOL_VERSION})"
    )


def test_every_option_has_help_and_the_common_ones():
    assert_documented(cli._parser())


@pytest.mark.timeout(60)
def test_join_help_shows_defaults():
    r = _run("join", "--help")
    text = " ".join(r.stdout.split())
    assert r.returncode == 0
    assert "seconds between attempts (default: 0.2)" in text
    assert "(default: $DISCO_LOG_LEVEL, else info)" in text
    assert "(default: None)" not in text and "(default: False)" not in text


@pytest.mark.timeout(60)
def test_log_level_before_the_short_form():
    # DEBUG lines of the agent, then exit 3: no controller answers on a closed port
    r = _run("--log-level", "debug", "127.0.0.1", "1", "1", "--connect-timeout", "0.3")
    assert r.returncode == 3, r.stderr
    assert " INFO " in r.stderr and "disco_socket" in r.stderr
    r = _run("-v", "127.0.0.1", "1", "1", "--connect-timeout", "0.3", "-q")
    assert r.returncode == 3 and " INFO " not in r.stderr  # -q: errors only
    r = _run("127.0.0.1", "1", "1", "--log-level", "nope")
    assert r.returncode == 2 and "unknown log level 'nope'" in r.stderr


@pytest.mark.timeout(60)
def test_a_port_out_of_range_is_refused_as_such():
    """It tried to connect and said "connection refused" (outside check)."""
    for form in (["127.0.0.1", "99999", "1"], ["join", "127.0.0.1", "0", "--workers", "1"]):
        r = _run(*form)
        assert r.returncode == 2 and "a port is 1-65535, got" in r.stderr, r.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("options", "says"),
    [
        (["--tls-ca", "/nonexistent/ca.pem"], "cannot use the TLS files (/nonexistent/ca.pem)"),
        (["--tls-cert", "/etc/hostname", "--tls-key", "/etc/hostname"], "cannot use the TLS files"),
        (["--tls-key", "/etc/hostname"], "--tls-key needs --tls-cert"),
        (["--retry-interval", "-1"], "seconds must be > 0 and finite, got -1"),
        (["--connect-timeout", "nan"], "seconds must be > 0 and finite, got nan"),
    ],
)
def test_bad_tls_files_and_seconds_are_refused_without_a_traceback(options, says):
    """Each gave a traceback and exit code 1, or was accepted (-1 s, nan s, a key with
    no certificate): outside check."""
    r = _run("join", "127.0.0.1", "9", "--workers", "1", *options)
    assert r.returncode == 2, r.stderr
    assert says in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"port": 70000}, "port must be an int 0-65535"),
        ({"port": "9091"}, "port must be an int 0-65535"),
        ({"port": -1}, "port must be an int 0-65535"),
        ({"host": ""}, "host must be a host name"),
        ({"timeout": -1}, "timeout must be a number of seconds > 0"),
        ({"handshake_timeout": float("nan")}, "handshake_timeout must be a number of seconds"),
    ],
)
def test_socket_session_options_are_checked_before_it_listens(options, says):
    """A port of 70000 or "9091" and a timeout of -1 were taken (with one node: no
    error at all), an empty host retried for the whole timeout (new-user check)."""
    import disco_core as disco

    kwargs = {"host": "127.0.0.1", "port": 0, "token": "t0k", **options}
    with pytest.raises((disco.DiscoValueError, disco.DiscoTypeError), match=says):
        disco.SocketSession(1, 1, **kwargs)
