"""What every Disco command shares: ``--version``, ``-v``/``--verbose``, ``--log-level``.

The commands (``disco``, ``disco-rpc``, ``disco-socket``, ``disco-mpi``) add these
options to their parser and to each subcommand's with :func:`add_common_options`,
show every option's default in ``--help`` (:class:`HelpFormatter`) and set up
:mod:`logging` with :func:`configure_logging`. The level chosen is passed on to
worker processes in :data:`LOG_LEVEL_ENV` (``DISCO_LOG_LEVEL``), which they read
with :func:`configure_from_env`: a worker logs to its stderr only when a level is set.

Standard library only: the worker imports it.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import textwrap
import warnings
from typing import TextIO

__all__ = [
    "LOG_LEVEL_ENV",
    "LOG_FORMAT",
    "HelpFormatter",
    "add_common_options",
    "distribution_version",
    "parse_level",
    "level_from_args",
    "configure_logging",
    "plain_warnings",
    "parse_command_line",
    "chosen_parser",
    "configure_from_env",
    "level_for_workers",
]

#: The variable that carries the log level to worker processes (and sets a default).
LOG_LEVEL_ENV = "DISCO_LOG_LEVEL"
#: One line per record; the pid tells a controller's lines from its workers'.
LOG_FORMAT = "%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s"

_LEVELS = ("debug", "info", "warning", "error", "critical")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows each option's default, except where there is nothing to show.

    No "(default: None)", "(default: False)" or "(default: )" (an unset option, a flag), and
    nothing where the help text already speaks of its default. Descriptions and
    epilogs keep their line breaks; a paragraph of one long line is wrapped.
    """

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        # A paragraph of one line is prose: wrapped. A block of lines was laid out by
        # hand (a list, examples, a table): kept as written.
        lines = text.splitlines()
        out = []
        for k, line in enumerate(lines):
            alone = (k == 0 or not lines[k - 1].strip()) and (
                k == len(lines) - 1 or not lines[k + 1].strip()
            )
            if alone and len(line) > width and not line[:1].isspace():
                out.append(
                    textwrap.fill(line, width, initial_indent=indent, subsequent_indent=indent)
                )
            else:
                out.append(indent + line)
        return "\n".join(out)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default in (None, False, "", argparse.SUPPRESS) or "default" in text.lower():
            return text
        return super()._get_help_string(action)


def distribution_version(distribution: str) -> str:
    """The installed version of ``distribution`` (``"unknown"`` from a bare source tree)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return "unknown"


def add_common_options(
    parser: argparse.ArgumentParser,
    distribution: str,
    *,
    version_text: str | None = None,
    default_level: str = "warning",
) -> argparse.ArgumentParser:
    """Add ``--version``, ``-v``/``--verbose`` and ``--log-level`` to ``parser``.

    Call it for the command's parser and for each subcommand's: the options are
    accepted before and after the subcommand. Their defaults are suppressed, so a
    subcommand never resets what was given before it; read them with
    :func:`level_from_args`.

    Parameters
    ----------
    parser : argparse.ArgumentParser
        The parser to extend.
    distribution : str
        The distribution whose version ``--version`` prints (``importlib.metadata``).
    version_text : str, optional
        What ``--version`` prints instead of ``"<prog> <version>"``.
    default_level : str
        The command's level when neither an option nor ``$DISCO_LOG_LEVEL`` sets one
        (for the help text; pass the same to :func:`level_from_args`).

    Returns
    -------
    argparse.ArgumentParser
        ``parser``.
    """
    prog = parser.prog.split()[0]
    parser.add_argument(
        "--version",
        action="version",
        version=version_text or f"{prog} {distribution_version(distribution)}",
        help=f"print the version of {distribution} and exit",
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=argparse.SUPPRESS,
        help="log more: each -v one level lower (warning, info, debug)",
    )
    parser.add_argument(
        "--log-level",
        metavar="LEVEL",
        default=argparse.SUPPRESS,
        help=f"log level: {', '.join(_LEVELS)} or a number (default: ${LOG_LEVEL_ENV}, "
        f"else {default_level}); overrides -v",
    )
    return parser


def parse_level(text: str | int) -> int:
    """A :mod:`logging` level from a name (any case) or a number.

    Raises
    ------
    ValueError
        For anything else, naming the levels there are.
    """
    if isinstance(text, int):
        return text
    word = str(text).strip()
    if word.lstrip("-").isdigit():
        return int(word)
    level = logging.getLevelName(word.upper())
    if word.lower() in _LEVELS and isinstance(level, int):
        return level
    raise ValueError(f"unknown log level {text!r}: use one of {', '.join(_LEVELS)} or a number")


def level_from_args(args: argparse.Namespace, default: int = logging.WARNING) -> int:
    """The level ``args`` ask for: ``--log-level``, else ``-v`` steps down from the default.

    The default is ``$DISCO_LOG_LEVEL`` when set (and valid), else ``default``; an
    invalid variable is named on stderr, and ``default`` used.

    Raises
    ------
    ValueError
        An unknown ``--log-level``.
    """
    given = getattr(args, "log_level", None)
    if given is not None:
        return parse_level(given)
    env = os.environ.get(LOG_LEVEL_ENV, "").strip()
    if env:
        try:
            default = parse_level(env)
        except ValueError as exc:  # a bad variable must not stop the command: it says so
            print(
                f"{os.path.basename(sys.argv[0]) or 'disco'}: {LOG_LEVEL_ENV}: {exc} "
                f"(using {logging.getLevelName(default)})",
                file=sys.stderr,
            )
    verbose = getattr(args, "verbose", 0) or 0
    return max(logging.DEBUG, default - 10 * verbose) if verbose else default


def configure_logging(
    level: int, stream: TextIO | None = None, *, pass_to_workers: bool = True
) -> None:
    """Log records of ``level`` and above to ``stream`` (stderr), one line each.

    Parameters
    ----------
    level : int
        A :mod:`logging` level.
    stream : typing.TextIO, optional
        Where the lines go; default ``sys.stderr``.
    pass_to_workers : bool
        Also set ``$DISCO_LOG_LEVEL`` (when ``level`` is below WARNING, or the
        variable was set), so worker processes started from here log at the same
        level (to their stderr, which the controller passes on).
    """
    # Not force=True: a program that set up logging itself (or a test runner) keeps its own.
    logging.basicConfig(level=level, format=LOG_FORMAT, stream=stream or sys.stderr)
    # Workers stay silent unless asked; an option given here overrides the variable.
    if pass_to_workers and (level < logging.WARNING or os.environ.get(LOG_LEVEL_ENV)):
        os.environ[LOG_LEVEL_ENV] = logging.getLevelName(level)


def chosen_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:  # fmt: skip
    """The (sub)parser of the command ``args`` chose (``disco trace summary``'s for
    ``disco trace summary ...``), so that its usage goes with an error about it."""
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        name = getattr(args, subs[0].dest, None) if subs else None
        if name is None or name not in subs[0].choices:
            return parser
        parser = subs[0].choices[name]


def parse_command_line(
    parser: argparse.ArgumentParser, argv: list[str] | None = None
) -> argparse.Namespace:
    """``parser.parse_args(argv)``, but an unknown option is reported with the usage of
    the command it was given to (argparse reports it with the top-level usage)."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        chosen_parser(parser, args).error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def plain_warnings(prog: str) -> None:
    """Print this command's warnings as ``PROG: warning: MESSAGE``, one line each.

    Python's default shows the file and source line that warned (``.../cli.py:487:
    RuntimeWarning: ...`` and the code), which a command's user has no use for (an
    outside check). Call it from a command's ``main`` only: it changes the process's
    ``warnings.formatwarning``.
    """

    def one_line(message, category, filename, lineno, line=None) -> str:  # noqa: ARG001
        return f"{prog}: warning: {message}\n"

    warnings.formatwarning = one_line  # type: ignore[assignment]


def configure_from_env() -> bool:
    """In a worker process: log to stderr at ``$DISCO_LOG_LEVEL``, if it is set.

    Returns whether logging was set up. Nothing is set up without the variable:
    a worker is silent unless its controller's user asked for records.
    """
    text = os.environ.get(LOG_LEVEL_ENV, "").strip()
    if not text:
        return False
    try:
        level = parse_level(text)
    except ValueError as exc:
        print(f"disco worker: {LOG_LEVEL_ENV}: {exc}", file=sys.stderr)
        return False
    logging.basicConfig(level=level, format=LOG_FORMAT, stream=sys.stderr)
    return True


def level_for_workers() -> str | None:
    """The log level worker processes should use, as ``$DISCO_LOG_LEVEL`` spells it.

    ``$DISCO_LOG_LEVEL`` when set; else the level of the ``disco_core`` loggers when
    the controller's user configured logging to show records below WARNING (e.g.
    ``logging.basicConfig(level=logging.INFO)``); else None: workers stay silent.
    """
    text = os.environ.get(LOG_LEVEL_ENV, "").strip()
    if text:
        return text
    core = logging.getLogger("disco_core")
    level = core.getEffectiveLevel()
    if level >= logging.WARNING or not (logging.getLogger().handlers or core.handlers):
        return None
    return logging.getLevelName(level)
