"""The core's built-in plugin, registered through the ``disco_core`` entry point like any other."""

from __future__ import annotations

from .hookspecs import hookimpl


@hookimpl
def disco_register_channels():
    from .channels.process import ProcessChannel
    from .channels.threaded import ThreadedChannel

    return {"threaded": ThreadedChannel, "process": ProcessChannel}


@hookimpl
def disco_register_ccls():
    from .ccl.shm import ShmCCL

    return {"shm": ShmCCL}


@hookimpl
def disco_register_module_loaders():
    from . import loaders

    found = {".py": loaders.load_py}
    if loaders.torch_available():
        found[".pt2"] = loaders.load_pt2
    return found
