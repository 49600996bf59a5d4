"""disco-rpc's Disco plugin: the ``.so`` module loader (ctypes) and the ``"rpc"`` channel."""

from __future__ import annotations

from disco_core import hookimpl


@hookimpl
def disco_register_module_loaders():
    from .ctypes_loader import load_so

    return {".so": load_so}


@hookimpl
def disco_register_channels():
    from .channel import RPCChannel

    return {"rpc": RPCChannel}
