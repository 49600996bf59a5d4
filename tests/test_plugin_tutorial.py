"""The plugin of the "Writing a plugin" tutorial (examples/plugin_tutorial) passes the kits.

The tutorial's own test file is run here, with the plugin registered by hand in
this process (its entry point is covered by the packaging tests); worker processes
find it through ``DISCO_PLUGINS``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from disco_core import plugins

TUTORIAL = Path(__file__).resolve().parents[1] / "examples" / "plugin_tutorial"
sys.path.insert(0, str(TUTORIAL))

import disco_tutorial.plugin  # noqa: E402


def _load(path: Path):
    spec = importlib.util.spec_from_file_location("disco_tutorial_kits", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_kits = _load(TUTORIAL / "tests" / "test_kits.py")
TestThreadCCL = _kits.TestThreadCCL
TestTraceChannel = _kits.TestTraceChannel
test_trace_logs_commands = _kits.test_trace_logs_commands
test_threads_ccl_refuses_worker_processes = _kits.test_threads_ccl_refuses_worker_processes


@pytest.fixture(autouse=True, scope="module")
def _tutorial_plugin():
    """Register the plugin here, and for worker processes through DISCO_PLUGINS."""
    name = None
    if "threads" not in plugins.registered("ccl"):  # not installed through its entry point
        name = plugins.register_plugin(disco_tutorial.plugin, "disco-tutorial")
    # Set after this process's plugin manager exists, so that it is read by workers only.
    mp = pytest.MonkeyPatch()
    path = [str(TUTORIAL), os.environ.get("PYTHONPATH", "")]
    mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, path)))
    mp.setenv("DISCO_PLUGINS", "disco_tutorial.plugin")
    yield
    mp.undo()
    if name is not None:
        plugins.unregister_plugin(name)
