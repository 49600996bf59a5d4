"""The ``disco`` command: ``disco plugins``, ``--version``, ``--help``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import disco_core
from disco_core import cli

pytestmark = pytest.mark.timeout(120)

BUILTINS = {
    "channels": {"threaded", "process"},
    "ccls": {"shm"},
    "module_loaders": {".py"},
}


def run_disco(*args: str, env: dict | None = None, timeout: float = 60):
    """Run ``python -m disco_core ARGS`` with a clean plugin environment."""
    full_env = dict(os.environ)
    full_env.pop("DISCO_PLUGINS", None)
    full_env.pop("DISCO_DISABLE_PLUGIN_AUTOLOAD", None)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "disco_core", *args],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def core_entry(data: dict) -> dict:
    entries = [p for p in data["plugins"] if p["distribution"] == "disco-core" and not p["error"]]
    assert entries, f"no disco-core plugin listed: {data}"
    return entries[0]


def test_plugins_json_lists_builtins_with_distribution():
    proc = run_disco("plugins", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["entry_point_group"] == "disco_core"
    assert data["autoload"] is True
    assert data["problems"] == []
    core = core_entry(data)
    assert core["version"] == disco_core.__version__ or core["version"] == "source"
    for key, names in BUILTINS.items():
        assert names <= set(core["provides"][key]), (key, core)


def test_plugins_text_lists_builtins():
    proc = run_disco("plugins")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "disco-core" in out
    for name in ("threaded", "process", "shm", ".py"):
        assert name in out
    for heading in ("channels:", "CCLs:", "module loaders:"):
        assert heading in out


def test_console_script_is_installed():
    exe = shutil.which("disco", path=str(Path(sys.executable).parent)) or shutil.which("disco")
    if exe is None:
        pytest.skip("the 'disco' console script is not on PATH (package not installed)")
    proc = subprocess.run([exe, "plugins"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "shm" in proc.stdout and "disco-core" in proc.stdout


def test_broken_plugin_is_listed_with_its_error():
    proc = run_disco("plugins", "--json", env={"DISCO_PLUGINS": "disco_no_such_plugin_xyz"})
    assert proc.returncode == 1, proc.stderr
    data = json.loads(proc.stdout)
    # (other installed plugins may be broken too; only ours is known here)
    (mine,) = [p for p in data["plugins"] if p["name"] == "disco_no_such_plugin_xyz"]
    assert mine["error"] and "ModuleNotFoundError" in mine["error"]
    core_entry(data)  # the rest still works

    text = run_disco("plugins", env={"DISCO_PLUGINS": "disco_no_such_plugin_xyz"})
    assert text.returncode == 1, text.stderr  # a broken plugin is a failure
    assert "failed to load" in text.stdout
    assert "disco_no_such_plugin_xyz" in text.stdout
    assert "ModuleNotFoundError" in text.stdout
    assert "Traceback" not in text.stderr


def _write_plugin(tmp_path: Path, name: str, body: str) -> dict:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    pythonpath = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    return {"DISCO_PLUGINS": name, "PYTHONPATH": pythonpath}


def test_third_party_plugin_shows_what_it_registers(tmp_path):
    env = _write_plugin(
        tmp_path,
        "disco_test_thirdparty",
        """
        import disco_core
        import disco_core.spi

        @disco_core.hookimpl
        def disco_register_channels():
            return {"carrier-pigeon": object}

        class SmokeSignals(disco_core.spi.CCL):
            pass

        @disco_core.hookimpl
        def disco_register_ccls():
            return {"smoke-signals": SmokeSignals}

        @disco_core.hookimpl
        def disco_register_module_loaders():
            return {".scroll": lambda path, device: None}
        """,
    )
    proc = run_disco("plugins", "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["extra_modules"] == ["disco_test_thirdparty"]
    (mine,) = [p for p in data["plugins"] if p["name"] == "disco_test_thirdparty"]
    assert mine["error"] is None
    assert mine["provides"] == {
        "channels": ["carrier-pigeon"],
        "ccls": ["smoke-signals"],
        "module_loaders": [".scroll"],
    }
    text = run_disco("plugins", env=env).stdout
    assert "carrier-pigeon" in text and "smoke-signals" in text and ".scroll" in text


def test_conflicting_plugin_is_reported(tmp_path):
    env = _write_plugin(
        tmp_path,
        "disco_test_conflict",
        """
        import disco_core
        import disco_core.spi

        class OtherShm(disco_core.spi.CCL):
            pass

        @disco_core.hookimpl
        def disco_register_ccls():
            return {"shm": OtherShm}
        """,
    )
    proc = run_disco("plugins", "--json", env=env)
    assert proc.returncode == 1, proc.stderr
    data = json.loads(proc.stdout)
    assert any("shm" in p and "disco_test_conflict" in p for p in data["problems"]), data
    assert "refused" in next(p for p in data["problems"] if "disco_test_conflict" in p)
    text = run_disco("plugins", env=env).stdout
    assert "Problems:" in text and "disco_test_conflict" in text


def test_autoload_disabled_is_said():
    proc = run_disco("plugins", env={"DISCO_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "DISCO_DISABLE_PLUGIN_AUTOLOAD" in proc.stdout
    assert "shm" in proc.stdout  # the core's own plugins are still loaded


def test_version():
    proc = run_disco("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"disco {disco_core.__version__}")


def test_help_names_the_subcommands():
    proc = run_disco("--help")
    assert proc.returncode == 0, proc.stderr
    for word in ("plugins", "demo", "DISCO_DISABLE_PLUGIN_AUTOLOAD", "DISCO_PLUGINS"):
        assert word in proc.stdout
    demo_help = run_disco("demo", "--help")
    assert demo_help.returncode == 0
    for option in ("--d-model", "--d-ff", "--batch", "--workers", "--steps", "--session"):
        assert option in demo_help.stdout


def test_no_command_prints_usage_and_fails():
    proc = run_disco()
    assert proc.returncode == 2
    assert "usage: disco" in proc.stderr


def test_unknown_command_is_a_usage_error():
    proc = run_disco("frobnicate")
    assert proc.returncode == 2
    assert "invalid choice" in proc.stderr


def test_main_in_process(capsys):
    assert cli.main(["plugins", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert BUILTINS["ccls"] <= set(core_entry(data)["provides"]["ccls"])
