"""A plugin's mistake stays its own: each kind of mistake disables (or refuses a name of)
only the plugin that made it, with one warning naming it, and the core keeps working.

Every plugin here is installed as a distribution with a ``disco_core`` entry point and
used from a fresh interpreter, as a user would meet it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(180)

README = Path(__file__).resolve().parents[1] / "README.md"

# Run in a fresh interpreter with the plugin installed: the core must keep working
# (threads, the shm CCL, the .py loader), the plugin's names must fail with a
# DiscoError naming it, and `disco plugins` must report it.
_CHECK = r"""
import contextlib, io, json, sys, warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import numpy as np
    import disco_core as disco
    from disco_core import cli, plugins

    with disco.ThreadedSession(2) as sess:
        sess.init_ccl("shm")
        x = sess.allreduce(sess.broadcast(np.ones(3, "float32")), sess.empty((3,), "float32"))
        print("ALLREDUCE", x.debug_get_from_remote(1).tolist())
        mod = sess.load_vm_module(sys.argv[1])
        print("PY-LOADER", mod["answer"]().debug_get_from_remote(1))
    print("SHM-IS-CORE", plugins.lookup("ccl", "shm").__module__)
    for kind, name in json.loads(sys.argv[2]):
        try:
            found = plugins.lookup(kind, name)
        except disco.DiscoError as exc:
            print("LOOKUP", kind, name, type(exc).__name__, str(exc).replace("\n", " "))
        else:
            print("FOUND", kind, name, getattr(found, "__name__", found))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli.main(["plugins", "--json"])
    print("CLI-RC", rc)
    print("CLI-JSON", json.dumps(json.loads(out.getvalue())))
for w in caught:
    print("WARN", w.category.__name__, str(w.message).replace("\n", " "))
"""

_MODULE = "def answer():\n    return 42\n"


def _pythonpath(*roots: Path) -> str:
    """``roots`` first, then this interpreter's own path (a worktree under test stays first)."""
    return os.pathsep.join([*map(str, roots), *filter(None, [os.environ.get("PYTHONPATH")])])


def _env(*roots: Path) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=_pythonpath(*roots))
    env.pop("DISCO_PLUGINS", None)
    env.pop("DISCO_DISABLE_PLUGIN_AUTOLOAD", None)
    env.pop("DISCO_WORKER_PROCESS", None)
    return env


def _install_by_hand(site: Path, dist: str, entry_points: str, files: dict[str, str]) -> None:
    """A distribution as an installer leaves it: the files and a ``*.dist-info``."""
    info = site / f"{dist.replace('-', '_')}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(entry_points)
    for rel, text in files.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(textwrap.dedent(text))


def _check(site: Path, tmp_path: Path, lookups=()) -> tuple[dict, subprocess.CompletedProcess]:
    module = tmp_path / "model.py"
    module.write_text(_MODULE)
    proc = subprocess.run(
        [sys.executable, "-c", _CHECK, str(module), json.dumps(list(lookups))],
        env=_env(site),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    out = {
        "warnings": [x[5:] for x in lines if x.startswith("WARN ")],
        "lookups": {
            tuple(x.split()[1:3]): x.split(" ", 3)[3]
            for x in lines
            if x.startswith(("LOOKUP ", "FOUND "))
        },
        "cli_rc": int(next(x for x in lines if x.startswith("CLI-RC")).split()[1]),
        "cli": json.loads(next(x for x in lines if x.startswith("CLI-JSON")).split(" ", 1)[1]),
    }
    # The core keeps working.
    assert "ALLREDUCE [2.0, 2.0, 2.0]" in lines, proc.stdout
    assert "PY-LOADER 42" in lines, proc.stdout
    assert "SHM-IS-CORE disco_core.ccl.shm" in lines, proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    return out, proc


def _entry(data: dict, name: str) -> dict:
    (entry,) = [p for p in data["cli"]["plugins"] if p["name"] == name]
    return entry


def _one_warning_about(data: dict, key: str, dist: str, *words: str) -> str:
    """Exactly one warning names the plugin ``key``; it is a DiscoPluginWarning naming all of it."""
    mine = [w for w in data["warnings"] if w.split(" (", 1)[0].endswith(f"Disco plugin {key!r}")]
    assert len(mine) == 1, data["warnings"]
    assert mine[0].startswith("DiscoPluginWarning "), mine
    for word in (dist, *words):
        assert word in mine[0], (word, mine[0])
    return mine[0]


# ---------------------------------------------------------------------------- the README
def _readme_template() -> tuple[str, str]:
    """The toml and python blocks of README.md's "Writing a plugin", as printed."""
    text = README.read_text()
    section = text.split("\n## Writing a plugin", 1)[1].split("\n## ", 1)[0]
    (toml,) = re.findall(r"```toml\n(.*?)```", section, re.S)
    (python,) = re.findall(r"```python\n(.*?)```", section, re.S)
    return toml, python


def _install_readme_template(src: Path, site: Path) -> tuple[str, str]:
    """Install the README's template into ``site``; return (entry-point name, module)."""
    toml, python = _readme_template()
    ep_name, module = re.search(
        r'^\[project\.entry-points\.disco_core\]\s*\n(\S+)\s*=\s*"([\w.]+)"', toml, re.M
    ).groups()
    parts = module.split(".")
    for i in range(1, len(parts)):
        pkg = src.joinpath(*parts[:i])
        pkg.mkdir(parents=True, exist_ok=True)
        (pkg / "__init__.py").touch()
    src.joinpath(*parts[:-1], parts[-1] + ".py").write_text(python)
    (src / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=61"]\nbuild-backend = "setuptools.build_meta"\n\n'
        '[project]\nname = "my-package"\nversion = "0.1.0"\n\n'
        "[tool.setuptools.packages.find]\n"
        f'include = ["{parts[0]}*"]\n\n' + toml
    )
    if importlib.util.find_spec("pip") and importlib.util.find_spec("setuptools"):
        subprocess.run(
            [
                sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                "--no-build-isolation", "--no-index", "--target", str(site), str(src),
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )  # fmt: skip
    else:  # no installer here: lay the distribution out as pip would
        files = {str(p.relative_to(src)): p.read_text() for p in src.rglob("*.py")}
        _install_by_hand(site, "my-package", f"[disco_core]\n{ep_name} = {module}\n", files)
    return ep_name, module


@pytest.mark.timeout(240)
def test_readme_template_installed_as_printed_breaks_only_itself(tmp_path):
    site = tmp_path / "site"
    ep_name, module = _install_readme_template(tmp_path / "src", site)
    key = f"my-package:{ep_name}"
    data, _ = _check(site, tmp_path, [("ccl", "myccl"), ("loader", ".onnx")])
    # Its hooks import modules the template leaves for the author to write.
    warning = _one_warning_about(data, key, "my-package", "ModuleNotFoundError", "disabled")
    assert "disco_register_ccls" in warning
    for kind in ("ccl", "loader"):
        (text,) = [v for (k, _), v in data["lookups"].items() if k == kind]
        assert text.startswith("PluginNotFoundError"), text
        assert key in text and "ModuleNotFoundError" in text, text
    assert data["cli_rc"] == 1
    entry = _entry(data, key)
    assert entry["disabled"] and "ModuleNotFoundError" in entry["error"], entry

    # The `disco` command says so too, and exits 1.
    proc = subprocess.run(
        [sys.executable, "-m", "disco_core", "plugins"],
        env=_env(site),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert key in proc.stdout and "ModuleNotFoundError" in proc.stdout
    assert "Traceback" not in proc.stderr


_IN_WORKER_PROCESSES = r"""
import sys, numpy as np, disco_core as disco
with disco.ProcessSession(3) as sess:
    sess.init_ccl("shm")
    x = sess.allreduce(sess.broadcast(np.ones(2, "float32")), sess.empty((2,), "float32"))
    print("ALLREDUCE", x.debug_get_from_remote(2).tolist())
    mod = sess.load_vm_module(sys.argv[1])
    print("PY-LOADER", [mod["answer"]().debug_get_from_remote(w) for w in (1, 2)])
    try:
        sess.load_vm_module(sys.argv[2])
    except disco.DiscoError as exc:
        print("ONNX", type(exc).__name__)
    print("STILL", sess.get_global_func("disco.worker_id")().debug_get_from_remote(2))
"""


@pytest.mark.timeout(240)
def test_readme_template_does_not_break_worker_processes(tmp_path):
    site = tmp_path / "site"
    _install_readme_template(tmp_path / "src", site)
    (tmp_path / "model.py").write_text(_MODULE)
    (tmp_path / "model.onnx").write_text("")
    proc = subprocess.run(
        [
            sys.executable, "-c", _IN_WORKER_PROCESSES,
            str(tmp_path / "model.py"), str(tmp_path / "model.onnx"),
        ],
        env=_env(site),
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ALLREDUCE [3.0, 3.0]" in proc.stdout
    assert "PY-LOADER [42, 42]" in proc.stdout
    assert "ONNX PluginNotFoundError" in proc.stdout
    assert "STILL 2" in proc.stdout  # no worker died
    # The controller warns once; worker processes stay quiet about it.
    assert proc.stderr.count("DiscoPluginWarning") == 1, proc.stderr


# ---------------------------------------------------------------------------- each mistake
_CCL_CLASS = """
import disco_core
from disco_core.spi import CCL

class MyCCL(CCL):
    pass
"""

# name -> (plugin module body, lookups, words its warning and error must hold,
#          the error type of the plugin's own name, disabled?)
MISTAKES = {
    "import-error": (
        "raise ImportError('this plugin needs libfoo')\n",
        "PluginNotFoundError",
        ["libfoo", "ImportError"],
        True,
    ),
    "raising-hook": (
        _CCL_CLASS
        + """
@disco_core.hookimpl
def disco_register_ccls():
    raise RuntimeError("hook exploded")
""",
        "PluginNotFoundError",
        ["disco_register_ccls() raised RuntimeError: hook exploded"],
        True,
    ),
    "list-return": (
        _CCL_CLASS
        + """
@disco_core.hookimpl
def disco_register_ccls():
    return [("myccl", MyCCL)]
""",
        "PluginNotFoundError",
        ["disco_register_ccls() returned a list, not a mapping"],
        True,
    ),
    "string-as-ccl": (
        _CCL_CLASS
        + """
@disco_core.hookimpl
def disco_register_ccls():
    return {"myccl": "MyCCL"}
""",
        "PluginLoadError",
        ["'myccl': 'MyCCL', which is not a subclass of disco_core.spi.CCL"],
        True,
    ),
    "misspelled-hook": (
        _CCL_CLASS
        + """
@disco_core.hookimpl
def disco_register_ccl():
    return {"myccl": MyCCL}
""",
        "PluginNotFoundError",
        ["unknown hook 'disco_register_ccl'", "did you mean 'disco_register_ccls'"],
        True,
    ),
    "conflict-with-shm": (
        _CCL_CLASS
        + """
@disco_core.hookimpl
def disco_register_ccls():
    return {"shm": MyCCL, "myccl": MyCCL}
""",
        "FOUND",  # only "shm" is refused; its other name stays
        ["CCL 'shm' is the core's own", "refused"],
        False,
    ),
}


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_each_mistake_breaks_only_its_plugin(mistake, tmp_path):
    body, outcome, words, disabled = MISTAKES[mistake]
    site = tmp_path / "site"
    _install_by_hand(
        site, "disco-mistaken", "[disco_core]\nmistaken = disco_mistaken\n",
        {"disco_mistaken.py": body},
    )  # fmt: skip
    key = "disco-mistaken:mistaken"
    data, _ = _check(site, tmp_path, [("ccl", "myccl")])
    _one_warning_about(data, key, "disco-mistaken", *words)
    text = data["lookups"][("ccl", "myccl")]
    if outcome == "FOUND":
        assert text == "MyCCL", text
    else:
        assert text.startswith(outcome + " "), text
        assert key in text and "disco-mistaken" in text, text
        for word in words:
            assert word in text, (word, text)
    assert data["cli_rc"] == 1
    entry = _entry(data, key)
    assert entry["disabled"] is disabled
    for word in words:
        assert word in entry["error"], (word, entry)
    assert data["cli"]["problems"] and all(key in p for p in data["cli"]["problems"])


def test_wrong_channel_and_loader_objects(tmp_path):
    site = tmp_path / "site"
    body = """
        import disco_core

        @disco_core.hookimpl
        def disco_register_channels():
            return {"mychannel": 42}

        @disco_core.hookimpl
        def disco_register_module_loaders():
            return {"onnx": print}
    """
    _install_by_hand(site, "disco-objects", "[disco_core]\nobj = disco_objects\n", {
        "disco_objects.py": body
    })  # fmt: skip
    key = "disco-objects:obj"
    data, _ = _check(site, tmp_path, [("channel", "mychannel"), ("loader", "onnx")])
    warning = _one_warning_about(data, key, "disco-objects", "'mychannel': 42", "not callable")
    assert "the suffix 'onnx'" in warning
    for lookup in (("channel", "mychannel"), ("loader", "onnx")):
        text = data["lookups"][lookup]
        assert text.startswith("PluginLoadError ") and key in text, text


def test_two_third_parties_claiming_a_name_lose_it_both(tmp_path):
    site = tmp_path / "site"
    for dist, mod in (("disco-first", "disco_first"), ("disco-second", "disco_second")):
        body = (
            _CCL_CLASS
            + f"""
@disco_core.hookimpl
def disco_register_ccls():
    return {{"twice": MyCCL, "only-{mod}": MyCCL}}
"""
        )
        _install_by_hand(site, dist, f"[disco_core]\nplug = {mod}\n", {f"{mod}.py": body})
    lookups = [("ccl", "twice"), ("ccl", "only-disco_first"), ("ccl", "only-disco_second")]
    data, _ = _check(site, tmp_path, lookups)
    for dist in ("disco-first", "disco-second"):
        _one_warning_about(data, f"{dist}:plug", dist, "'twice'", "refused")
        assert not _entry(data, f"{dist}:plug")["disabled"]
    text = data["lookups"][("ccl", "twice")]
    assert text.startswith("PluginConflictError ")
    assert "disco-first" in text and "disco-second" in text
    assert data["lookups"][("ccl", "only-disco_first")] == "MyCCL"
    assert data["lookups"][("ccl", "only-disco_second")] == "MyCCL"
    assert data["cli_rc"] == 1


def test_in_process_registration_warns_at_the_call():
    """``register_plugin`` checks at once; unregistering restores everything."""
    import disco_core as disco
    from disco_core import plugins

    class Misspelled:
        @disco.hookimpl
        def disco_register_channel(self):
            return {}

    with pytest.warns(plugins.DiscoPluginWarning, match="disco_register_channels"):
        plugins.register_plugin(Misspelled(), "fake-misspelled")
    try:
        (info,) = [i for i in plugins.list_plugins() if i.name == "fake-misspelled"]
        assert info.disabled and "unknown hook 'disco_register_channel'" in info.error
        assert "threaded" in plugins.registered("channel")
    finally:
        plugins.unregister_plugin("fake-misspelled")
    assert not [i for i in plugins.list_plugins() if i.name == "fake-misspelled"]


def test_unmarked_hook_functions_count_like_pytest():
    """A ``disco_*`` function without the marker is a hook (so a typo in one is caught)."""
    import types

    from disco_core import plugins
    from disco_core.channels.threaded import ThreadedChannel

    mod = types.ModuleType("fake_unmarked")
    exec("def disco_register_channels():\n    return {'unmarked-threads': T}\n", vars(mod))
    mod.T = ThreadedChannel
    plugins.register_plugin(mod, "fake-unmarked")
    try:
        assert plugins.lookup("channel", "unmarked-threads") is ThreadedChannel
    finally:
        plugins.unregister_plugin("fake-unmarked")


def test_registering_a_name_twice_is_the_callers_error():
    import disco_core as disco
    from disco_core import plugins

    class Nothing:
        pass

    plugins.register_plugin(Nothing(), "fake-twice")
    try:
        with pytest.raises(disco.DiscoValueError, match="fake-twice"):
            plugins.register_plugin(Nothing(), "fake-twice")
    finally:
        plugins.unregister_plugin("fake-twice")
    assert "shm" in plugins.registered("ccl")


def test_a_module_with_unknown_hooks_warns_at_register_plugin():
    """The warning comes from register_plugin itself (not at some later lookup)."""
    import types

    from disco_core import plugins

    mod = types.ModuleType("fake_typo")
    exec("def disco_register_loaders():\n    return {}\n", vars(mod))
    with pytest.warns(plugins.DiscoPluginWarning, match="disco_register_module_loaders"):
        plugins.register_plugin(mod, "fake-typo")
    plugins.unregister_plugin("fake-typo")


def test_a_hook_calling_sys_exit_only_disables_its_plugin():
    import disco_core as disco
    from disco_core import plugins

    class Exits:
        @disco.hookimpl
        def disco_register_channels(self):
            raise SystemExit(3)

    with pytest.warns(plugins.DiscoPluginWarning, match="fake-exits.*SystemExit"):
        plugins.register_plugin(Exits(), "fake-exits")
    try:
        assert "threaded" in plugins.registered("channel")
    finally:
        plugins.unregister_plugin("fake-exits")


def test_warnings_as_errors_leave_the_manager_whole():
    """Under ``-W error`` the warning raises once, at the call; later calls just work."""
    import warnings

    import disco_core as disco
    from disco_core import plugins

    class Raises:
        @disco.hookimpl
        def disco_register_ccls(self):
            raise RuntimeError("boom")

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", plugins.DiscoPluginWarning)
            with pytest.raises(plugins.DiscoPluginWarning, match="fake-raises"):
                plugins.register_plugin(Raises(), "fake-raises")
            assert "shm" in plugins.registered("ccl")  # said once: no second warning
            assert plugins.lookup("channel", "threaded") is not None
    finally:
        plugins.unregister_plugin("fake-raises")


def test_a_hook_with_arguments_no_spec_has_only_disables_its_plugin():
    """pluggy refuses the hook when it registers it: the plugin is disabled, in one line."""
    import disco_core as disco
    from disco_core import plugins

    class WantsSession:
        @disco.hookimpl
        def disco_register_ccls(self, session):
            return {}

    with pytest.warns(plugins.DiscoPluginWarning, match="fake-args.*'session'"):
        plugins.register_plugin(WantsSession(), "fake-args")
    try:
        (info,) = [i for i in plugins.list_plugins() if i.name == "fake-args"]
        assert info.disabled and "PluginValidationError" in info.error
        assert "\n" not in info.error
        assert "shm" in plugins.registered("ccl")
    finally:
        plugins.unregister_plugin("fake-args")


@pytest.mark.timeout(60)
def test_naming_an_installed_plugin_in_disco_plugins_is_no_mistake():
    env = dict(_env(), DISCO_PLUGINS="disco_core._builtin_plugin")
    proc = subprocess.run(
        [sys.executable, "-W", "always", "-m", "disco_core", "plugins"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Problems" not in proc.stdout and "Warning" not in proc.stderr


def test_registering_one_object_under_two_names_is_the_callers_error():
    import disco_core as disco
    from disco_core import plugins

    class Nothing:
        pass

    obj = Nothing()
    plugins.register_plugin(obj, "fake-once")
    try:
        with pytest.raises(disco.DiscoValueError, match="fake-once"):
            plugins.register_plugin(obj, "fake-again")
    finally:
        plugins.unregister_plugin("fake-once")
