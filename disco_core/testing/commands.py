"""Checks of a command-line parser that every Disco command meets (for plugins' tests)."""

from __future__ import annotations

import argparse

__all__ = ["assert_documented"]


def assert_documented(parser: argparse.ArgumentParser) -> None:
    """Every parser and sub-parser of ``parser`` has ``--version``, ``-v/--verbose`` and
    ``--log-level``, and every one of its options has help text."""
    parsers = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            parsers.extend(action.choices.values())
    for p in parsers:
        opts = {o for a in p._actions for o in a.option_strings}
        assert {"--version", "-v", "--verbose", "--log-level"} <= opts, (
            f"{p.prog}: missing common options"
        )
        for action in p._actions:
            assert action.help, f"{p.prog} {action.option_strings or action.dest}: no help"
