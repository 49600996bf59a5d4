"""disco-socket's plugin: registers the ``socket`` channel through the ``disco_core`` entry points."""

from __future__ import annotations

from disco_core import hookimpl


@hookimpl
def disco_register_channels():
    from .controller import SocketChannel

    return {"socket": SocketChannel}
