"""The hook specifications that plugins implement.

A plugin is a module (or object) found through the ``disco_core`` entry-point
group. It implements any of the hooks below with the ``disco_core.hookimpl``
marker; each hook returns a mapping from a public name to an implementation, and
the plugin manager (:mod:`disco_core.plugins`) merges them.

The manager checks what each plugin gives it. Any function of a plugin whose name
starts with ``disco_`` is taken as a hook (marked or not, as pytest does with
``pytest_*``), so a misspelled hook is an error, not silence. A plugin is disabled,
with one :class:`~disco_core.plugins.DiscoPluginWarning` that names it, when it
fails to import, has an unknown ``disco_*`` function, or has a hook that raises or
returns anything but a mapping (or None) of the kinds documented below. A name
that the core and another plugin both claim stays the core's; one that two other
plugins claim is refused for both.

.. code-block:: toml

    # pyproject.toml of a third-party package
    [project.entry-points.disco_core]
    my_ccl = "my_package.disco_plugin"
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:  # pragma: no cover
    from .ccl.base import CCL
    from .channels.base import Channel

__all__ = ["hookspec", "hookimpl", "PROJECT_NAME"]

PROJECT_NAME = "disco_core"
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def disco_register_channels() -> Mapping[str, Callable[..., Channel]]:
    """Register control-plane channels.

    Returns
    -------
    Mapping[str, Callable[..., Channel]]
        Channel name (a non-empty str) to a factory (a callable).
        ``Session.create(name, **options)`` calls
        ``factory(**options)`` and wraps the :class:`~disco_core.channels.base.Channel`
        it returns in a :class:`~disco_core.Session`. The core registers
        ``"threaded"`` and ``"process"``; disco-socket registers ``"socket"``.
    """


@hookspec
def disco_register_ccls() -> Mapping[str, type[CCL]]:
    """Register collective communication libraries (the data plane).

    Returns
    -------
    Mapping[str, type[CCL]]
        CCL name (a non-empty str) to a subclass of :class:`~disco_core.ccl.base.CCL`
        (``disco_core.spi.CCL``).
        ``Session.init_ccl(name, *device_ids)`` instantiates it on every worker.
        The core registers ``"shm"``; disco-mpi, disco-nccl and disco-rccl
        register ``"mpi"``, ``"nccl"`` and ``"rccl"``.
    """


@hookspec
def disco_register_module_loaders() -> Mapping[str, Callable[[str, Any], Any]]:
    """Register module loaders, by file suffix.

    Returns
    -------
    Mapping[str, Callable[[str, Device | None], object]]
        File suffix (``".py"``, ``".pt2"``: a str starting with a dot, as
        :func:`os.path.splitext` returns it) to ``loader(path, device)``, which runs on
        every worker and returns a module: any object whose functions are reached by
        ``module[name]`` or ``getattr(module, name)``.
    """
