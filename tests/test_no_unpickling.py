"""No bytes from a socket are ever unpickled (issue 13, 4.4): a walk of the source tree.

Two rules, checked on the syntax tree of every module of ``disco_core/`` and of the
plugins' packages (``plugins/*/disco_*/``):

1. ``pickle.load``, ``pickle.loads`` and ``pickle.Unpickler`` (however imported)
   appear only in ``disco_core/protocol.py``, whose :func:`decode` unpickles the
   frames of pipes from processes this one started.
2. The core's plain :func:`disco_core.protocol.decode` is called only where the
   frames come over pipes from a process this one spawned itself: the process
   channel, the worker (whose ``command_stream`` picks ``decode_untrusted`` for
   frames that crossed a socket) and ``protocol.py``. Everything else that
   rebuilds the core's frames uses ``decode_untrusted``.
3. ``disco_core/wire_values.py`` (:func:`decode_untrusted`, the parser of the
   network format) imports no pickle module at all (a test below).
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: Where plain unpickling may be written.
PICKLE_ALLOWED = {"disco_core/protocol.py"}
#: Where the core's plain ``decode`` may be called (pipes from processes spawned here).
DECODE_ALLOWED = {
    "disco_core/protocol.py",
    "disco_core/channels/process.py",
}
DECODE_ALLOWED_DIRS = ("disco_core/worker/",)
#: Modules known to call plain ``decode`` on socket frames, each being switched to
#: ``decode_untrusted`` on another branch of issue 13; listed so that this test
#: passes meanwhile. An entry whose module is clean is simply not needed any more.
PENDING = {
    "plugins/socket/disco_socket/controller.py": "issue 13: the socket channel's branch",
}

_PICKLE_NAMES = {"load", "loads", "Unpickler", "_Unpickler"}
_PICKLE_MODULES = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill"}


def _sources() -> list[pathlib.Path]:
    files = sorted((ROOT / "disco_core").rglob("*.py"))
    for pkg in sorted((ROOT / "plugins").glob("*/disco_*")):
        if pkg.is_dir():
            files += sorted(pkg.rglob("*.py"))
    return files


def _is_core_protocol(module: str | None, level: int, rel: str) -> bool:
    """Whether ``from <module> import ...`` in ``rel`` names ``disco_core.protocol``."""
    if level == 0:
        return module == "disco_core.protocol"
    if not rel.startswith("disco_core/"):
        return False
    pkg = pathlib.PurePosixPath(rel).parent.parts  # e.g. ("disco_core", "channels")
    base = pkg[: len(pkg) - (level - 1)] if level > 1 else pkg
    full = ".".join(base) + ("." + module if module else "")
    return full == "disco_core.protocol"


def _violations(path: pathlib.Path) -> tuple[list[str], list[str]]:
    """``(pickle uses, plain decode calls)`` in one file, as ``"line: what"``."""
    rel = path.relative_to(ROOT).as_posix()
    tree = ast.parse(path.read_text(), filename=rel)
    pickle_aliases: set[str] = set()  # names bound to a pickle module
    pickle_funcs: set[str] = set()  # names bound to pickle.load/loads/Unpickler
    protocol_aliases: set[str] = set()  # names bound to disco_core.protocol
    decode_names: set[str] = set()  # names bound to disco_core.protocol.decode
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in _PICKLE_MODULES:
                    pickle_aliases.add(a.asname or a.name)
                if a.name == "disco_core.protocol":
                    protocol_aliases.add(a.asname or "disco_core.protocol")
        elif isinstance(node, ast.ImportFrom):
            if node.module in _PICKLE_MODULES and node.level == 0:
                pickle_funcs |= {a.asname or a.name for a in node.names if a.name in _PICKLE_NAMES}
            if _is_core_protocol(node.module, node.level, rel):
                decode_names |= {a.asname or a.name for a in node.names if a.name == "decode"}
            for a in node.names:  # from disco_core import protocol / from .. import protocol
                if a.name == "protocol" and _is_core_protocol(
                    (node.module + ".protocol") if node.module else "protocol", node.level, rel
                ):
                    protocol_aliases.add(a.asname or a.name)
    pickles, decodes = [], []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id in pickle_aliases and node.attr in _PICKLE_NAMES:
                pickles.append(f"{node.lineno}: {node.value.id}.{node.attr}")
            if node.value.id in protocol_aliases and node.attr == "decode":
                decodes.append(f"{node.lineno}: {node.value.id}.decode")
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            if node.id in pickle_funcs:
                pickles.append(f"{node.lineno}: {node.id}")
            if node.id in decode_names:
                decodes.append(f"{node.lineno}: decode")
        elif isinstance(node, ast.ClassDef):  # a subclass of an imported Unpickler
            for b in node.bases:
                if isinstance(b, ast.Name) and b.id in pickle_funcs:
                    pickles.append(f"{node.lineno}: class {node.name}({b.id})")
    return pickles, decodes


def test_walk_finds_the_sources():
    files = {p.relative_to(ROOT).as_posix() for p in _sources()}
    assert "disco_core/protocol.py" in files
    assert "plugins/rpc/disco_rpc/channel.py" in files
    assert "plugins/mpi/disco_mpi/channel.py" in files


def test_the_checker_sees_what_it_must(tmp_path, monkeypatch):
    """The walk flags each way of writing an unpickle and a plain decode."""
    pkg = tmp_path / "disco_core" / "channels"
    pkg.mkdir(parents=True)
    bad = pkg / "bad.py"
    bad.write_text(
        "import pickle as p\n"
        "from pickle import loads as ld, Unpickler\n"
        "from ..protocol import decode as dec\n"
        "from disco_core import protocol\n"
        "p.loads(b'')\n"
        "ld(b'')\n"
        "class U(Unpickler): pass\n"
        "dec(b'')\n"
        "protocol.decode(b'')\n"
    )
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    pickles, decodes = _violations(bad)
    assert len(pickles) == 4, pickles  # p.loads, ld, and the Unpickler base (name and class)
    assert len(decodes) == 2, decodes


def test_no_unpickling_of_network_bytes():
    problems = []
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        pickles, decodes = _violations(path)
        if pickles and rel not in PICKLE_ALLOWED:
            problems += [f"{rel}:{p} (unpickling outside disco_core/protocol.py)" for p in pickles]
        decode_ok = rel in DECODE_ALLOWED or rel.startswith(DECODE_ALLOWED_DIRS) or rel in PENDING
        if decodes and not decode_ok:
            problems += [
                f"{rel}:{d} (plain decode of frames that may have crossed a socket: "
                "use disco_core.spi.decode_untrusted)"
                for d in decodes
            ]
    assert not problems, "\n".join(problems)


def test_the_network_format_parser_imports_no_pickle():
    """``decode_untrusted`` is a parser of its own format, not a restricted unpickler."""
    tree = ast.parse((ROOT / "disco_core" / "wire_values.py").read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            imported.add(node.module.split(".")[0])
    assert "pickle" in _PICKLE_MODULES and not imported & (_PICKLE_MODULES | {"copyreg", "marshal", "shelve"}), imported  # fmt: skip
    from disco_core import spi, wire_values

    assert spi.decode_untrusted is wire_values.decode_untrusted
