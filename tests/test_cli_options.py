"""The ``disco`` command's common options and :mod:`disco_core.commandline` (issue 17)."""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys

import pytest

import disco_core
from disco_core import cli, commandline
from disco_core.testing.commands import assert_documented


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k != commandline.LOG_LEVEL_ENV}
    return subprocess.run(
        [sys.executable, "-m", "disco_core", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**base, **(env or {})},
    )


def test_every_option_has_help_and_the_common_ones():
    assert_documented(cli.build_parser())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args", [("--version",), ("plugins", "--version"), ("demo", "--version")])
def test_version(args):
    r = _run(*args)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"disco {disco_core.__version__} (disco-core;")


@pytest.mark.timeout(120)
def test_verbose_plugins_logs_what_it_loads():
    quiet = _run("plugins")
    assert quiet.returncode == 0 and "disco_core.plugins" not in quiet.stderr
    for args in (("-v", "plugins"), ("plugins", "-v"), ("plugins", "--log-level", "INFO")):
        r = _run(*args)
        assert r.returncode == 0, r.stderr
        assert (
            "disco_core.plugins" in r.stderr
            and "INFO loaded plugin disco-core:builtins" in r.stderr
        )
        assert "DEBUG" not in r.stderr
    r = _run("-vv", "plugins")
    assert "DEBUG plugin disco-core:builtins registers channels" in r.stderr
    r = _run("plugins", env={commandline.LOG_LEVEL_ENV: "info"})  # the variable sets the default
    assert "INFO loaded plugin" in r.stderr


@pytest.mark.timeout(60)
def test_bad_log_level_is_a_usage_error():
    r = _run("plugins", "--log-level", "chatty")
    assert r.returncode == 2 and "unknown log level 'chatty'" in r.stderr


@pytest.mark.timeout(60)
def test_help_shows_defaults():
    r = _run("demo", "--help")
    text = " ".join(r.stdout.split())
    assert r.returncode == 0 and "(default: 1024)" in text and "--log-level LEVEL" in text
    assert "(default: None)" not in text and "(default: False)" not in text


# ------------------------------------------------------------------ commandline helpers
@pytest.mark.parametrize(
    ("text", "level"),
    [("debug", 10), ("INFO", 20), ("Warning", 30), ("error", 40), ("critical", 50), ("15", 15)],
)
def test_parse_level(text, level):
    assert commandline.parse_level(text) == level


@pytest.mark.parametrize("text", ["", "loud", "WARN ", "fatalish"])
def test_parse_level_refuses(text):
    with pytest.raises(ValueError, match="unknown log level"):
        commandline.parse_level(text)


def test_level_from_args(monkeypatch, capsys):
    monkeypatch.delenv(commandline.LOG_LEVEL_ENV, raising=False)
    ns = argparse.Namespace
    assert commandline.level_from_args(ns()) == logging.WARNING
    assert commandline.level_from_args(ns(verbose=1)) == logging.INFO
    assert commandline.level_from_args(ns(verbose=5)) == logging.DEBUG
    assert commandline.level_from_args(ns(verbose=2, log_level="error")) == logging.ERROR
    assert commandline.level_from_args(ns(), logging.INFO) == logging.INFO
    monkeypatch.setenv(commandline.LOG_LEVEL_ENV, "error")
    assert commandline.level_from_args(ns()) == logging.ERROR
    assert commandline.level_from_args(ns(verbose=1)) == logging.WARNING
    capsys.readouterr()
    monkeypatch.setenv(commandline.LOG_LEVEL_ENV, "bogus")  # not fatal, but said
    assert commandline.level_from_args(ns()) == logging.WARNING
    err = capsys.readouterr().err
    assert "DISCO_LOG_LEVEL: unknown log level 'bogus'" in err and "(using WARNING)" in err


def test_subcommand_does_not_reset_options_given_before_it():
    p = cli.build_parser()
    args = p.parse_args(["--log-level", "debug", "plugins"])
    assert args.log_level == "debug"
    args = p.parse_args(["-vv", "plugins", "--json"])
    assert args.verbose == 2 and args.json


def test_level_for_workers(monkeypatch):
    monkeypatch.setenv(commandline.LOG_LEVEL_ENV, "debug")
    assert commandline.level_for_workers() == "debug"
    monkeypatch.delenv(commandline.LOG_LEVEL_ENV)
    core = logging.getLogger("disco_core")
    monkeypatch.setattr(core, "level", logging.INFO)
    handler = logging.NullHandler()
    core.addHandler(handler)
    try:
        assert commandline.level_for_workers() == "INFO"
        monkeypatch.setattr(core, "level", logging.WARNING)
        assert commandline.level_for_workers() is None  # nothing below WARNING asked for
    finally:
        core.removeHandler(handler)


def test_configure_logging_passes_the_level_to_workers_only_when_asked(monkeypatch):
    monkeypatch.delenv(commandline.LOG_LEVEL_ENV, raising=False)
    commandline.configure_logging(logging.WARNING)
    assert commandline.LOG_LEVEL_ENV not in os.environ  # workers stay silent
    commandline.configure_logging(logging.DEBUG)
    assert os.environ[commandline.LOG_LEVEL_ENV] == "DEBUG"
    commandline.configure_logging(logging.ERROR)  # an explicit level overrides the variable
    assert os.environ[commandline.LOG_LEVEL_ENV] == "ERROR"


@pytest.mark.parametrize(
    "argv, usage",
    [
        (["trace", "summary", "x.json", "--bogus"], "usage: disco trace summary"),
        (["demo", "--bogus"], "usage: disco demo"),
        (["--bogus", "plugins"], "usage: disco "),
    ],
)
def test_an_unknown_option_gets_the_usage_of_its_command(argv, usage, capsys):
    """argparse reports an unknown option with the top-level usage (an outside check)."""
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(usage) and "unrecognized arguments: --bogus" in err, err


def test_plain_warnings_are_one_line(monkeypatch):
    import warnings

    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)
    commandline.plain_warnings("prog")
    text = warnings.formatwarning("be careful", RuntimeWarning, "/a/file.py", 12, "code()")
    assert text == "prog: warning: be careful\n"
