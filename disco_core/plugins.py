"""The plugin manager: entry points, lookup by name, install hints, conflicts.

Plugins are found through the ``disco_core`` entry-point group, in the controller
and again, lazily, in every worker process, so a worker sees the same plugins.
Setting ``DISCO_DISABLE_PLUGIN_AUTOLOAD=1`` loads only the core's own entry
points (like ``PYTEST_DISABLE_PLUGIN_AUTOLOAD``); ``DISCO_PLUGINS=mod1,mod2`` then
names extra plugin modules to load.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import os
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any

import pluggy

from . import hookspecs
from .errors import PluginConflictError, PluginLoadError, PluginNotFoundError

__all__ = [
    "KINDS",
    "PluginInfo",
    "get_plugin_manager",
    "install_command",
    "register_plugin",
    "unregister_plugin",
    "lookup",
    "registered",
    "list_plugins",
    "DiscoPluginWarning",
]

ENTRY_POINT_GROUP = "disco_core"
AUTOLOAD_ENV = "DISCO_DISABLE_PLUGIN_AUTOLOAD"
PLUGINS_ENV = "DISCO_PLUGINS"
CORE_DISTRIBUTION = "disco-core"

#: kind -> (hook name, human noun)
KINDS = {
    "channel": ("disco_register_channels", "channel"),
    "ccl": ("disco_register_ccls", "CCL"),
    "loader": ("disco_register_module_loaders", "module loader"),
}

#: Names we know a distribution for, so a missing one comes with an install hint.
KNOWN_PROVIDERS: dict[str, dict[str, str]] = {
    "channel": {"socket": "disco-socket", "rpc": "disco-rpc", "mpi": "disco-mpi"},
    "ccl": {"mpi": "disco-mpi", "nccl": "disco-nccl", "rccl": "disco-rccl", "shm": "disco-core"},
    "loader": {".pt2": "torch (pip install torch) for the core's .pt2 loader"},
}


def install_command(distribution: str) -> str:
    """How to install one of this repository's distributions (``disco-socket``, ...).

    None of them is on PyPI yet: a hint naming the bare distribution would send users
    to whoever registers that name first, so it names the folder in a clone instead.
    """
    folder = "." if distribution == CORE_DISTRIBUTION else f"./plugins/{distribution[6:]}"
    return f"pip install {folder} from a clone of the Disco repository (not yet on PyPI)"


class DiscoPluginWarning(UserWarning):
    """A plugin failed to load; the rest of Disco keeps working."""


@dataclass
class PluginInfo:
    """What ``disco plugins`` shows for one plugin."""

    name: str
    distribution: str
    version: str
    provides: dict[str, list[str]] = field(default_factory=dict)
    error: str | None = None


class _Manager:
    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self.infos: dict[str, PluginInfo] = {}
        self.broken: dict[str, PluginInfo] = {}
        self._tables: dict[str, dict[str, tuple[Any, str]]] = {}
        self.lock = threading.RLock()

    # -- loading ------------------------------------------------------------
    def load_entry_points(self) -> None:
        autoload = os.environ.get(AUTOLOAD_ENV, "").strip() in ("", "0")
        for ep in _entry_points():
            dist = ep.dist.name if ep.dist is not None else "?"
            version = ep.dist.version if ep.dist is not None else "?"
            if not autoload and _canon(dist) != CORE_DISTRIBUTION:
                continue
            key = f"{dist}:{ep.name}"
            if key in self.infos or self.pm.has_plugin(key):
                continue
            try:
                obj = ep.load()
            except Exception as exc:  # a broken plugin must not break the rest
                self._broken(
                    key, dist, version, f"entry point {ep.value!r}: {type(exc).__name__}: {exc}"
                )
                continue
            self._add(obj, key, dist, version)
        for modname in filter(
            None, (m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(","))
        ):
            if self.pm.has_plugin(modname):
                continue
            try:
                obj = importlib.import_module(modname)
            except Exception as exc:
                self._broken(modname, modname, "?", f"{type(exc).__name__}: {exc}")
                continue
            self._add(obj, modname, modname, "?")

    def _broken(self, key: str, dist: str, version: str, error: str) -> None:
        self.broken[key] = PluginInfo(key, dist, version, error=error)
        if os.environ.get("DISCO_WORKER_PROCESS"):
            return  # the controller already warned; workers report it only when used
        warnings.warn(
            f"Disco plugin {key!r} (distribution {dist} {version}) failed to load and is "
            f"ignored: {error}",
            DiscoPluginWarning,
            stacklevel=4,
        )

    def _add(self, obj: Any, key: str, dist: str, version: str) -> None:
        with self.lock:
            self.pm.register(obj, name=key)
            self.infos[key] = PluginInfo(key, dist, version)
            self._tables.clear()

    def remove(self, key: str) -> None:
        with self.lock:
            if self.pm.has_plugin(key):
                self.pm.unregister(name=key)
            self.infos.pop(key, None)
            self._tables.clear()

    # -- lookup ---------------------------------------------------------------
    def table(self, kind: str) -> dict[str, tuple[Any, str]]:
        """name -> (implementation, plugin key), built once per kind."""
        with self.lock:
            cached = self._tables.get(kind)
            if cached is not None:
                return cached
            hook_name, noun = KINDS[kind]
            table: dict[str, tuple[Any, str]] = {}
            for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
                key = impl.plugin_name
                try:
                    provided = impl.function() or {}
                except Exception as exc:
                    raise PluginLoadError(
                        f"plugin {key!r} ({self._dist(key)}) failed in {hook_name}(): "
                        f"{type(exc).__name__}: {exc}"
                    ) from exc
                provided = dict(provided)
                info = self.infos.get(key)
                if info is not None:
                    info.provides[kind] = sorted(provided)
                for name, value in provided.items():
                    if name in table and table[name][1] != key:
                        other = table[name][1]
                        raise PluginConflictError(
                            f"{noun} {name!r} is registered by two plugins: {other!r} "
                            f"(distribution {self._dist(other)}) and {key!r} (distribution "
                            f"{self._dist(key)}); uninstall one of them"
                        )
                    table[name] = (value, key)
            self._tables[kind] = table
            return table

    def _dist(self, key: str) -> str:
        info = self.infos.get(key)
        return f"{info.distribution} {info.version}" if info else key


_MANAGER: _Manager | None = None
_MANAGER_LOCK = threading.Lock()


def _canon(dist: str) -> str:
    return dist.lower().replace("_", "-")


def _entry_points():
    eps = md.entry_points()
    if hasattr(eps, "select"):
        return list(eps.select(group=ENTRY_POINT_GROUP))
    return list(eps.get(ENTRY_POINT_GROUP, []))  # pragma: no cover - Python < 3.10


def _manager() -> _Manager:
    global _MANAGER
    if _MANAGER is None:
        with _MANAGER_LOCK:
            if _MANAGER is None:
                mgr = _Manager()
                mgr.load_entry_points()
                if not any(_canon(i.distribution) == CORE_DISTRIBUTION for i in mgr.infos.values()):
                    # Running from a source tree that was never installed: the entry
                    # points are missing, so register the built-ins the same way.
                    from . import _builtin_plugin

                    mgr._add(_builtin_plugin, "disco-core:builtins", CORE_DISTRIBUTION, "source")
                _MANAGER = mgr
    return _MANAGER


def get_plugin_manager() -> pluggy.PluginManager:
    """The pluggy plugin manager, with every entry-point plugin loaded."""
    return _manager().pm


def register_plugin(plugin: Any, name: str | None = None) -> str:
    """Register a plugin object by hand (tests, notebooks); returns its name.

    A plugin registered this way in the controller is not seen by worker processes;
    publish an entry point (or list the module in ``DISCO_PLUGINS``) for that.
    """
    mgr = _manager()
    key = name or getattr(plugin, "__name__", None) or repr(plugin)
    mgr._add(plugin, key, key, "local")
    return key


def unregister_plugin(name: str) -> None:
    """Undo :func:`register_plugin`."""
    _manager().remove(name)


def registered(kind: str) -> dict[str, Any]:
    """Every name registered for ``kind`` ("channel", "ccl" or "loader")."""
    return {name: impl for name, (impl, _) in _manager().table(kind).items()}


def lookup(kind: str, name: str) -> Any:
    """Return the implementation registered for ``name``.

    Raises
    ------
    PluginNotFoundError
        Nobody registered ``name``; the message says which distribution provides it
        (when known) and lists what is installed.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown plugin kind {kind!r}; expected one of {sorted(KINDS)}")
    mgr = _manager()
    table = mgr.table(kind)
    if name in table:
        return table[name][0]
    noun = KINDS[kind][1]
    have = ", ".join(sorted(table)) or "none"
    provider = KNOWN_PROVIDERS.get(kind, {}).get(name)
    if provider and provider.startswith("disco-"):
        hint = f"it is provided by the distribution {provider}: {install_command(provider)}"
    elif provider:
        hint = f"it needs {provider}"
    else:
        hint = "no known distribution provides it; a plugin registers it through the 'disco_core' entry-point group"
    broken = "".join(f"\n  (plugin {k} failed to load: {i.error})" for k, i in mgr.broken.items())
    if os.environ.get(AUTOLOAD_ENV, "").strip() not in ("", "0"):
        broken += f"\n  ({AUTOLOAD_ENV} is set: only the core's plugins were loaded)"
    raise PluginNotFoundError(
        f"no {noun} named {name!r} is installed; {hint}. Installed {noun}s: {have}{broken}"
    )


def list_plugins() -> list[PluginInfo]:
    """Every plugin (loaded or broken) with what it registers, for ``disco plugins``."""
    mgr = _manager()
    for kind in KINDS:
        try:
            mgr.table(kind)
        except Exception:  # a conflict still lists the plugins
            pass
    return sorted(
        [*mgr.infos.values(), *mgr.broken.values()], key=lambda i: (i.distribution, i.name)
    )
