"""Every example of every README.md runs as printed and prints what it shows.

Each fenced ``python`` or ``bash`` block of each README.md in the repository is one
test case (``README.md:43``), run in a subprocess from the repository root with this
interpreter's folder first on ``PATH`` (so ``python``, ``disco``, ``mpiexec`` are the
venv's), under a timeout, and must exit with 0. A block shows what it prints in
two ways, and both are checked (each expected line must appear in the output, in
order, spaces collapsed):

* a comment on a ``print(...)`` line: ``print(y)  # [ 4.  6.  8. 10.]``;
* a plain fence right after the block, marked ``<!-- example: output -->``.

A block whose first line is a comment naming a file (``# examples/kernels.py``) shows
a file: if it exists in the repository the block must match it (the README cannot
drift from what it shows), otherwise it is written to a temporary folder put on
``PYTHONPATH`` for the later blocks of the same README. A block that writes files
must leave the repository as it found it (no new untracked file).

Directives go in an HTML comment on the line before the fence, separated by ``;``:

* ``skip (REASON)``: not run, reported as skipped. REASON starts with one of
  ``ALLOWED_SKIPS``.
* ``requires MODULE``: skipped when MODULE cannot be imported (an optional peer or
  plugin that is not installed), run otherwise.
* ``timeout SECONDS``: a longer limit than the default.

The blocks of the root README's "Writing a plugin" section are installed and tested by
``tests/test_plugin_isolation.py`` and skipped here.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import site
import subprocess
import sys
import tempfile
import tokenize
from dataclasses import dataclass, field
from io import StringIO
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TIMEOUT = 60
ALLOWED_SKIPS = (
    "needs a GPU",
    "needs a remote machine",
    "is the test command itself",
    "installs from the network",
)
# (README, section heading) whose blocks another test owns
OWNED_ELSEWHERE = {
    ("README.md", "Writing a plugin"): "installed and tested by tests/test_plugin_isolation.py",
}
SKIP_DIRS = {".git", ".venv", ".venv-bench", "node_modules", "build", "dist"}

FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
DIRECTIVE = re.compile(r"^\s*<!--\s*example:\s*(.*?)\s*-->\s*$")
FILE_HEADER = re.compile(r"^#\s*([\w./-]+\.py)\s*(?:$|\s--)")


@dataclass
class Block:
    """One fenced block of a README."""

    readme: Path
    line: int  # line of the opening fence, 1-based
    lang: str
    code: str
    section: str  # the heading of level 1 or 2 it is under
    directives: list[str] = field(default_factory=list)
    output: str | None = None  # the following fence marked as output

    @property
    def name(self) -> str:
        path = self.readme.relative_to(ROOT) if self.readme.is_relative_to(ROOT) else self.readme
        return f"{path}:{self.line}"

    @property
    def file_shown(self) -> str | None:
        """The file this block shows (its first line names it), if any."""
        first = self.code.split("\n", 1)[0]
        m = FILE_HEADER.match(first) if self.lang == "python" else None
        return m.group(1) if m else None


def parse_readme(path: Path) -> list[Block]:
    """Every fenced block of ``path`` with its directives and expected output."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    section = ""
    pending: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if re.match(r"##?\s", line):  # the section: the last heading of level 1 or 2
            section = line.lstrip("#").strip()
        m = DIRECTIVE.match(line)
        if m:
            # split on ";" outside parentheses (a skip's reason may hold one)
            parts = re.split(r";(?![^()]*\))", m.group(1))
            pending = [d.strip() for d in parts if d.strip()]
            i += 1
            continue
        fence = FENCE.match(line)
        if not fence:
            if line.strip():
                pending = []
            i += 1
            continue
        indent, lang = fence.groups()
        end = i + 1
        while end < len(lines) and not FENCE.match(lines[end]):
            end += 1
        body = "\n".join(ln[len(indent) :] for ln in lines[i + 1 : end])
        if "output" in pending and blocks:
            blocks[-1].output = body
        else:
            blocks.append(Block(path, i + 1, lang, body + "\n", section, pending))
        pending = []
        i = end + 1
    return blocks


def find_readmes() -> list[Path]:
    found = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
        if "README.md" in filenames:
            found.append(Path(dirpath) / "README.md")
    return sorted(found)


def expected_from_comments(code: str) -> list[str]:
    """The trailing comments of ``print(...)`` lines: what those lines print."""
    expected = []
    try:
        tokens = list(tokenize.generate_tokens(StringIO(code).readline))
    except (tokenize.TokenError, SyntaxError):
        return expected
    first_on_line: dict[int, tokenize.TokenInfo] = {}
    for tok in tokens:
        if tok.type in (tokenize.INDENT, tokenize.DEDENT, tokenize.NL, tokenize.NEWLINE):
            continue
        first_on_line.setdefault(tok.start[0], tok)
        if tok.type == tokenize.COMMENT:
            head = first_on_line[tok.start[0]]
            if head is not tok and head.string == "print":
                expected.append(tok.string[1:].strip())
    return expected


def normalise(text: str) -> str:
    return " ".join(text.split())


def assert_shows(expected: list[str], out: str, name: str) -> None:
    """Each expected line appears as an output line, in order."""
    got = [normalise(x) for x in out.splitlines()]
    pos = 0
    for want in expected:
        want_n = normalise(want)
        if not want_n or want_n == "...":
            continue
        for k in range(pos, len(got)):
            if got[k] == want_n:
                pos = k + 1
                break
        else:
            pytest.fail(f"{name}: expected the line {want!r} in the output (in order):\n{out}")


def untracked() -> set[str] | None:
    """Untracked, not ignored files of the checkout (None outside a git checkout)."""
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        return None
    res = subprocess.run(
        ["git", "ls-files", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    return set(res.stdout.splitlines()) if res.returncode == 0 else None


def collect() -> list:
    params = []
    for readme in find_readmes():
        blocks = parse_readme(readme)
        modules: list[Block] = []
        for b in blocks:
            if b.lang not in ("python", "bash"):
                continue
            if b.file_shown is not None and owner(b) is None:
                # a file: checked against the repository, or made for the later blocks
                if (ROOT / b.file_shown).exists():
                    params.append(pytest.param(b, [], id=b.name))
                else:
                    modules.append(b)
                continue
            params.append(pytest.param(b, list(modules), id=b.name))
    return params


def owner(block: Block) -> str | None:
    """Which other test covers ``block``, if one does (OWNED_ELSEWHERE)."""
    rel = str(block.readme.relative_to(ROOT)) if block.readme.is_relative_to(ROOT) else ""
    return OWNED_ELSEWHERE.get((rel, block.section))


KNOWN_DIRECTIVES = re.compile(r"skip\s*\(.+\)|requires\s+[\w.]+|timeout\s+\d+")


def skip_reason(block: Block) -> str | None:
    """Why ``block`` is not run, or None; a directive this file does not know fails."""
    for d in block.directives:
        assert KNOWN_DIRECTIVES.fullmatch(d), f"{block.name}: unknown example directive {d!r}"
    if owner(block):
        return owner(block)
    for d in block.directives:
        m = re.fullmatch(r"skip\s*\((.+)\)", d)
        if m:
            reason = m.group(1).strip()
            assert reason.startswith(ALLOWED_SKIPS), (
                f"{block.name}: skip reason {reason!r} must start with one of {ALLOWED_SKIPS}"
            )
            return reason
        m = re.fullmatch(r"requires\s+([\w.]+)", d)
        if m and importlib.util.find_spec(m.group(1)) is None:
            return f"needs {m.group(1)}, which is not installed"
    return None


def block_timeout(block: Block) -> float:
    for d in block.directives:
        m = re.fullmatch(r"timeout\s+(\d+)", d)
        if m:
            return float(m.group(1))
    return DEFAULT_TIMEOUT


#: A block that installs a package (a ``pip install`` outside a comment): it runs in a
#: throwaway venv (:func:`layered_venv`).
INSTALLS = re.compile(r"^[^#\n]*\bpip3? install\b", re.M)


def layered_venv(tmp: Path) -> Path:
    """A throwaway venv over this interpreter's: it sees every package installed here
    (a ``.pth`` that adds this venv's site-packages, with their own ``.pth`` files), and
    what its ``pip`` installs lands in its own folder. A block's ``pip install`` used to
    land in the venv under test, for good, while the plugins' suites ran beside the
    core's in that same venv (``scripts/test.sh``): every later session, in both, then
    loaded the installed plugin too. Its ``bin`` holds ``python`` and shims for ``pip``
    and ``pytest`` that run them with its own interpreter."""
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)  # fmt: skip
    py = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True, capture_output=True, text=True, timeout=60,
    ).stdout.strip()  # fmt: skip
    lines = "".join(f"import site; site.addsitedir({d!r})\n" for d in site_dirs())
    Path(purelib, "_disco_outer_venv.pth").write_text(lines)
    for name in ("pip", "pytest"):
        shim = venv / "bin" / name
        shim.write_text(f'#!/bin/sh\nexec "{py}" -m {name} "$@"\n')
        shim.chmod(0o755)
    return venv


def site_dirs() -> list[str]:
    """This interpreter's site-packages folders (those that exist)."""
    return [d for d in site.getsitepackages() if os.path.isdir(d)]


def installed_here() -> set[str]:
    """The names in this interpreter's site-packages folders (what is installed here)."""
    return {os.path.join(d, name) for d in site_dirs() for name in os.listdir(d)}


def run_block(block: Block, modules: list[Block], tmp: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("DISCO_PLUGINS", None)
    env.pop("DISCO_DISABLE_PLUGIN_AUTOLOAD", None)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    if block.lang != "python" and INSTALLS.search(block.code):
        env["PATH"] = str(layered_venv(tmp) / "bin") + os.pathsep + env["PATH"]
        env.pop("PYTHONHOME", None)
    if modules:
        for m in modules:
            dest = tmp / "modules" / str(m.file_shown)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(m.code)
        paths = [str(tmp / "modules"), env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    if block.lang == "python":
        argv = [sys.executable, "-"]  # as if pasted: the current folder is on sys.path
        stdin, text = subprocess.PIPE, block.code
    else:
        # from a file: a command of the block that reads stdin (mpiexec) must not eat the rest
        script = tmp / "block.sh"
        script.write_text(block.code)
        argv = ["bash", "-e", "-o", "pipefail", str(script)]
        stdin, text = subprocess.DEVNULL, None
    timeout = block_timeout(block)
    proc = subprocess.Popen(
        argv,
        cwd=ROOT,
        env=env,
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(text, timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{block.name} ran past {timeout:.0f} s; its output:\n{out}")
    finally:
        try:  # whatever the block left running in its process group
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return subprocess.CompletedProcess(argv, proc.returncode, out, "")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("block, modules", collect())
def test_readme_example(block: Block, modules: list[Block]) -> None:
    reason = skip_reason(block)
    if reason:
        pytest.skip(reason)
    shown = block.file_shown
    if shown is not None:
        text = (ROOT / shown).read_text()
        body = block.code.split("\n", 1)[1]
        assert body.strip() == text.strip(), f"{block.name} no longer matches {shown}"
        return
    before = untracked()
    installed = installed_here()
    with tempfile.TemporaryDirectory() as tmp:
        res = run_block(block, modules, Path(tmp))
    assert res.returncode == 0, f"{block.name} exited with {res.returncode}:\n{res.stdout}"
    changed = sorted(installed ^ installed_here())
    assert not changed, f"{block.name} changed the venv under test: {changed}"
    expected = expected_from_comments(block.code) if block.lang == "python" else []
    if block.output is not None:
        expected += block.output.splitlines()
    assert_shows(expected, res.stdout, block.name)
    after = untracked()
    if before is not None and after is not None:
        left = sorted(after - before)
        assert not left, f"{block.name} left files in the repository: {left}"


def test_collector_finds_the_examples() -> None:
    """The collector sees the README examples of the core and of the plugins."""
    names = {p.id for p in collect()}
    assert any(n.startswith("README.md:") for n in names)
    assert any(n.startswith("plugins/rpc/README.md:") for n in names)
    assert any(n.startswith("plugins/socket/README.md:") for n in names)


def test_expected_output_comes_from_print_comments_only() -> None:
    code = 'print(x)  # [1. 2.]\nprint("# not a comment")\ny = 1  # not output\n'
    assert expected_from_comments(code) == ["[1. 2.]"]
    assert_shows(["[1. 2.]", "b"], "a\n[1.  2.]\nb\n", "case")  # spaces collapse
    with pytest.raises(pytest.fail.Exception, match="expected the line"):
        assert_shows(["b", "a"], "a\nb\n", "case")  # order counts


SAMPLE = """# Sample

<!-- example: skip (needs a GPU: two; really) -->
```python
import cupy
```

```python
# sample_mod.py
VALUE = 41
```

<!-- example: timeout 5 -->
```python
import sample_mod
print(sample_mod.VALUE + 1)
```
<!-- example: output -->
```
42
```

```toml
[not] = "run"
```
"""


@pytest.mark.timeout(60)
def test_collector_reads_directives_modules_and_outputs(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(SAMPLE)
    gpu, mod, user, toml = parse_readme(readme)
    assert (gpu.lang, gpu.line, gpu.directives) == (
        "python",
        4,
        ["skip (needs a GPU: two; really)"],
    )
    assert skip_reason(gpu) == "needs a GPU: two; really"
    assert mod.file_shown == "sample_mod.py"
    assert (user.directives, user.output) == (["timeout 5"], "42")
    assert block_timeout(user) == 5
    assert toml.lang == "toml"
    res = run_block(user, [mod], tmp_path)  # the module block is importable by later blocks
    assert res.returncode == 0, res.stdout
    assert res.stdout.split() == ["42"]


def test_collector_refuses_unknown_directives_and_reasons(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("<!-- example: skp (typo) -->\n```bash\ntrue\n```\n")
    with pytest.raises(AssertionError, match="unknown example directive"):
        skip_reason(parse_readme(readme)[0])
    readme.write_text("<!-- example: skip (too slow) -->\n```bash\ntrue\n```\n")
    with pytest.raises(AssertionError, match="must start with one of"):
        skip_reason(parse_readme(readme)[0])


def test_a_block_that_installs_runs_in_a_venv_of_its_own(tmp_path: Path) -> None:
    """What a block's ``pip install`` installs lands in a throwaway venv that still sees
    every package of this one (the venv under test stays as it was: see layered_venv)."""
    tutorial = next(p.values[0] for p in collect() if "plugin_tutorial" in p.values[0].name)
    assert INSTALLS.search(tutorial.code)
    assert not INSTALLS.search("disco trace plot t.json  # needs pip install -e '.[plot]'")
    venv = layered_venv(tmp_path)
    probe = (
        "import sys, sysconfig, numpy, pluggy, disco_core, disco_mpi\n"
        "print(sys.prefix)\nprint(sysconfig.get_path('purelib'))"
    )
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c", probe],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr  # this venv's packages, the plugins' too
    prefix, purelib = out.stdout.split()
    assert Path(prefix) == venv and Path(purelib).is_relative_to(venv)  # installs go there
    pip = subprocess.run(
        [str(venv / "bin" / "pip"), "--version"], capture_output=True, text=True, timeout=60
    )
    assert pip.returncode == 0 and "pip" in pip.stdout, pip.stderr
