"""The plugin module: the entry point ``disco_tutorial = "disco_tutorial.plugin"``.

Imports are inside the hooks, so that ``disco plugins`` lists the plugin without
loading the implementations.
"""

from __future__ import annotations

import disco_core


@disco_core.hookimpl
def disco_register_ccls() -> dict:
    from .ccl import ThreadCCL

    return {"threads": ThreadCCL}


@disco_core.hookimpl
def disco_register_channels() -> dict:
    from .channel import trace_channel

    return {"trace": trace_channel}
