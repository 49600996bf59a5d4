"""The distributions look like real Python packages.

Every wheel ships ``py.typed`` and the LICENSE and carries its classifiers; code
type-checked against an installed disco_core gets its type hints; importing
disco_core elsewhere than Linux is one clear error.
"""

from __future__ import annotations

import email.parser
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

import disco_core
from disco_core._platform import check_platform
from disco_core.errors import DiscoError, UnsupportedPlatformError

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the TOML reader pip carries (every test venv has pip)
    from pip._vendor import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = sorted(p.parent for p in (ROOT / "plugins").glob("*/pyproject.toml"))

REQUIRED_CLASSIFIERS = {
    "Development Status :: 3 - Alpha",
    "License :: OSI Approved :: Apache Software License",
    "Operating System :: POSIX :: Linux",
    "Programming Language :: Python :: 3.10",
    "Programming Language :: Python :: 3.11",
    "Programming Language :: Python :: 3.12",
    "Programming Language :: Python :: 3.13",
    "Topic :: System :: Distributed Computing",
    "Typing :: Typed",
}


def _package_of(project: Path) -> str:
    """The import package a distribution folder ships (``disco_core``, ``disco_mpi``...)."""
    return "disco_core" if project == ROOT else f"disco_{project.name}"


def _copy_source(project: Path, dest: Path) -> Path:
    """Copy what a build of ``project`` reads, so that no build/ lands in the tree."""
    dest.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(project / name, dest / name)
    pkg = _package_of(project)
    shutil.copytree(project / pkg, dest / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The core's wheel and disco-socket's, built offline from copies of this tree."""
    tmp = tmp_path_factory.mktemp("wheels")
    sources = [_copy_source(p, tmp / "src" / p.name) for p in (ROOT, ROOT / "plugins/socket")]
    out = tmp / "dist"
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-index", "--no-deps"]
        + ["--no-build-isolation", "-q", "-w", str(out)]
        + [str(s) for s in sources],
        capture_output=True,
        text=True,
        env=env,
        timeout=100,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = {w.name.split("-")[0]: w for w in out.glob("*.whl")}
    assert set(found) == {"disco_core", "disco_socket"}, sorted(found)
    return found


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pkg", ["disco_core", "disco_socket"])
def test_wheel_ships_py_typed_license_and_classifiers(wheels: dict[str, Path], pkg: str) -> None:
    with zipfile.ZipFile(wheels[pkg]) as whl:
        names = whl.namelist()
        assert f"{pkg}/py.typed" in names
        # setuptools>=77 puts it under licenses/ (PEP 639), older ones beside METADATA
        licenses = [n for n in names if ".dist-info/" in n and n.endswith("/LICENSE")]
        assert len(licenses) == 1, names
        assert whl.read(licenses[0]) == (ROOT / "LICENSE").read_bytes()
        meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = email.parser.Parser().parsestr(whl.read(meta_name).decode())
    assert REQUIRED_CLASSIFIERS <= set(meta.get_all("Classifier") or [])
    assert meta["Author"] == "Disco for Python developers"
    assert meta["Keywords"] and "disco" in meta["Keywords"].split(",")
    assert "Apache-2.0" in (meta["License"] or meta["License-Expression"] or "")
    # no repository URL is invented while there is none
    assert not meta.get_all("Project-URL")


def test_license_is_the_apache_2_0_text() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License\n")
    assert "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    assert "APPENDIX: How to apply the Apache License to your work." in text


@pytest.mark.parametrize("project", [ROOT, *PLUGINS], ids=lambda p: _package_of(p))
def test_every_distribution_is_configured_alike(project: Path) -> None:
    """What the built wheels show, checked in every pyproject (plugins are separate dists)."""
    assert (project / "LICENSE").read_bytes() == (ROOT / "LICENSE").read_bytes()
    pkg = _package_of(project)
    assert (project / pkg / "py.typed").is_file()
    config = tomllib.loads((project / "pyproject.toml").read_text())
    meta = config["project"]
    assert REQUIRED_CLASSIFIERS <= set(meta["classifiers"])
    assert meta["authors"] == [{"name": "Disco for Python developers"}]
    assert meta["keywords"]
    assert "urls" not in meta
    assert "py.typed" in config["tool"]["setuptools"]["package-data"][pkg]


USER_CODE = """\
import numpy as np

import disco_core as disco


def run() -> None:
    with disco.ThreadedSession(num_workers=2) as sess:
        sess.broadcast(np.arange(4, dtype="float32"))


version: int = disco.__version__  # line 11: a str, which mypy only knows from the hints
"""


@pytest.mark.timeout(120)
def test_user_code_type_checks_against_installed_disco_core(
    wheels: dict[str, Path], tmp_path: Path
) -> None:
    site = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "-q"]
        + ["--disable-pip-version-check", "--target", str(site), str(wheels["disco_core"])],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    user = tmp_path / "user"
    user.mkdir()
    (user / "app.py").write_text(textwrap.dedent(USER_CODE))
    # Only the installed wheel is on the path: no source tree, no editable finder.
    env = dict(os.environ, PYTHONPATH=str(site))
    env.pop("MYPYPATH", None)
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-incremental", "--cache-dir", os.devnull, "app.py"],
        capture_output=True,
        text=True,
        cwd=user,
        env=env,
        timeout=100,
    )
    out = proc.stdout + proc.stderr
    assert "py.typed" not in out and "import-untyped" not in out, out
    errors = [line for line in out.splitlines() if ": error:" in line]
    assert len(errors) == 1 and errors[0].startswith("app.py:11:"), out
    assert "[assignment]" in errors[0], out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("platform", ["darwin", "win32"])
def test_import_elsewhere_than_linux_is_one_clear_error(platform: str) -> None:
    code = textwrap.dedent(
        f"""
        import sys
        sys.platform = {platform!r}
        try:
            import disco_core
        except BaseException as e:
            print(" ".join(c.__name__ for c in type(e).__mro__))
            print("session loaded:", "disco_core.session" in sys.modules)
            print(e)
        else:
            print("imported")
        """
    )
    env = dict(os.environ)
    src = str(Path(disco_core.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=50
    )
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0 and len(lines) == 3, proc.stdout + proc.stderr
    mro = lines[0].split()
    assert mro[:2] == ["UnsupportedPlatformError", "DiscoError"], lines[0]
    # the check runs before any module that needs Linux is loaded
    assert lines[1] == "session loaded: False"
    assert lines[2] == (
        f"Disco for Python needs Linux (memfd_create, futex, /proc); this is {platform}"
    )


def test_check_platform() -> None:
    check_platform("linux")
    check_platform()  # this machine runs the suite, so it is Linux
    with pytest.raises(UnsupportedPlatformError, match="needs Linux.*this is freebsd14"):
        check_platform("freebsd14")
    assert issubclass(UnsupportedPlatformError, DiscoError)
    assert disco_core.UnsupportedPlatformError is UnsupportedPlatformError
    assert "UnsupportedPlatformError" in disco_core.__all__
