"""The plugin manager: entry points, lookup by name, install hints, conflicts.

Plugins are found through the ``disco_core`` entry-point group, in the controller
and again, lazily, in every worker process, so a worker sees the same plugins.
Setting ``DISCO_DISABLE_PLUGIN_AUTOLOAD=1`` loads only the core's own entry
points (like ``PYTEST_DISABLE_PLUGIN_AUTOLOAD``); ``DISCO_PLUGINS=mod1,mod2`` then
names extra plugin modules to load.

A plugin's mistake stays its own. A plugin that fails to import, defines a
``disco_*`` function that is no hook, has a hook that raises or returns anything
but a mapping of valid names to objects of the right kind is *disabled*: none of
its names are registered, one :class:`DiscoPluginWarning` names it, and everything
else keeps working. A name two plugins claim is kept by the core when the core is
one of them (the other plugin loses that name only); between two other plugins the
name is refused for both. Asking for a name only a broken plugin provided raises
:class:`~disco_core.errors.PluginLoadError` (or ``PluginConflictError``) naming the
plugin and its error.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata as md
import inspect
import logging
import os
import reprlib
import sys
import threading
import types
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pluggy

from . import hookspecs
from .errors import (
    DiscoError,
    DiscoTypeError,
    DiscoValueError,
    PluginConflictError,
    PluginLoadError,
    PluginNotFoundError,
)

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
logger = logging.getLogger("disco_core.plugins")
_LOAD_LEVEL = (
    logging.DEBUG if os.environ.get("DISCO_WORKER_PROCESS") else logging.INFO
)  # the controller's lines say it once

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

_HOOK_PREFIX = "disco_"


def install_command(distribution: str) -> str:
    """How to install one of this repository's distributions (``disco-socket``, ...).

    None of them is on PyPI yet: a hint naming the bare distribution would send users
    to whoever registers that name first, so it names the folder in a clone instead.
    """
    folder = "." if distribution == CORE_DISTRIBUTION else f"./plugins/{distribution[6:]}"
    extra = _EXTRAS.get(distribution, "")
    target = f"'{folder}{extra}'" if extra else folder
    # a distribution of this repository it depends on: pip cannot fetch it by itself
    target = " ".join([*_INSTALLED_WITH.get(distribution, ()), target])
    return f"pip install {target} from a clone of the Disco repository (not yet on PyPI)"


#: The extra a GPU plugin needs for its library (CuPy for the CUDA or ROCm version).
_EXTRAS = {"disco-nccl": "[cuda12]", "disco-rccl": "[rocm7]"}
#: The folders installed beside a distribution that depends on them (disco-rccl runs
#: on disco-nccl's code; alone, pip looks for disco-nccl on PyPI and fails).
_INSTALLED_WITH = {"disco-rccl": ("./plugins/nccl",)}


class DiscoPluginWarning(UserWarning):
    """A plugin is broken (disabled, or refused a name); the rest of Disco keeps working."""


@dataclass
class PluginInfo:
    """What ``disco plugins`` shows for one plugin.

    ``error`` is the plugin's own problem, or None. ``disabled`` is True when none
    of its names are registered (it failed to import, or one of its hooks is
    wrong); a plugin that only lost a name to a conflict keeps the others.
    """

    name: str
    distribution: str
    version: str
    provides: dict[str, list[str]] = field(default_factory=dict)
    error: str | None = None
    disabled: bool = False


class _PluginManager(pluggy.PluginManager):
    """pluggy's manager that, like pytest's, also takes unmarked ``disco_*`` functions.

    Any function whose name starts with ``disco_`` is a hook implementation, so a
    misspelled one (marked or not) reaches the unknown-hook check instead of being
    silently skipped.
    """

    def parse_hookimpl_opts(self, plugin: Any, name: str) -> Any:
        opts = super().parse_hookimpl_opts(plugin, name)
        if opts is None and name.startswith(_HOOK_PREFIX):
            static = inspect.getattr_static(plugin, name, None)
            if isinstance(
                static, (types.FunctionType, types.MethodType, staticmethod, classmethod)
            ):
                return {
                    "wrapper": False,
                    "hookwrapper": False,
                    "optionalhook": False,
                    "tryfirst": False,
                    "trylast": False,
                    "specname": None,
                }
        return opts


@dataclass
class _Resolved:
    """The merged tables of every enabled plugin, and the names nobody can have."""

    #: kind -> name -> (implementation, plugin key)
    tables: dict[str, dict[str, tuple[Any, str]]]
    #: kind -> name -> the error a lookup of that name raises
    unavailable: dict[str, dict[str, DiscoError]]


class _Manager:
    def __init__(self) -> None:
        self.pm = _PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self.infos: dict[str, PluginInfo] = {}  # registered with pluggy
        self.broken: dict[str, PluginInfo] = {}  # never registered (import, bad hook names)
        self._resolved: _Resolved | None = None
        self._resolving = False
        self._warned: set[tuple[str, str]] = set()
        self._pending: list[PluginInfo] = []  # to warn about once no lock is held
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
            if key in self.infos or key in self.broken:
                continue
            try:
                obj = ep.load()
            except (Exception, SystemExit) as exc:  # a broken plugin must not break the rest
                self._broken(
                    key, dist, version, f"entry point {ep.value!r}: {type(exc).__name__}: {exc}"
                )
                continue
            if not self.pm.is_registered(obj):  # two entry points naming one module
                self._add(obj, key, dist, version)
        for modname in filter(
            None, (m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(","))
        ):
            if modname in self.infos or modname in self.broken:
                continue
            try:
                obj = importlib.import_module(modname)
            except (Exception, SystemExit) as exc:
                self._broken(modname, modname, "?", f"{type(exc).__name__}: {exc}")
                continue
            if not self.pm.is_registered(obj):  # DISCO_PLUGINS naming an installed one
                self._add(obj, modname, modname, "?")

    def _broken(self, key: str, dist: str, version: str, error: str) -> None:
        info = PluginInfo(key, dist, version, error=_one_line(error), disabled=True)
        self.broken[key] = info
        logger.debug("plugin %s (%s %s) failed to load: %s", key, dist, version, error)
        self._warn(info)

    def _add(self, obj: Any, key: str, dist: str, version: str) -> None:
        """Register ``obj``; a plugin pluggy refuses, or with unknown hooks, is broken."""
        with self.lock:
            try:
                self.pm.register(obj, name=key)
            except Exception as exc:  # pluggy's PluginValidationError, a name taken twice
                self._broken(key, dist, version, f"{type(exc).__name__}: {exc}")
                return
            unknown = self._unknown_hooks(obj)
            if unknown:
                self.pm.unregister(obj)
                self._broken(key, dist, version, unknown)
                return
            self.broken.pop(key, None)
            self.infos[key] = PluginInfo(key, dist, version)
            logger.log(_LOAD_LEVEL, "loaded plugin %s (%s %s)", key, dist, version)
            self._resolved = None

    def _unknown_hooks(self, plugin: Any) -> str | None:
        """pluggy's ``check_pending()`` for one plugin: its hooks that have no spec."""
        known = sorted(hook for hook, _ in KINDS.values())
        bad = sorted(
            caller.name
            for caller in self.pm.get_hookcallers(plugin) or []
            if not caller.has_spec()
            and any(i.plugin is plugin and not i.optionalhook for i in caller.get_hookimpls())
        )
        if not bad:
            return None
        parts = []
        for name in bad:
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            parts.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        return (
            f"unknown hook{'s' if len(bad) > 1 else ''} {', '.join(parts)}; Disco's hooks "
            f"are {', '.join(known)} (a function named {_HOOK_PREFIX}* in a plugin is a hook)"
        )

    def remove(self, key: str) -> None:
        with self.lock:
            if self.pm.has_plugin(key):
                self.pm.unregister(name=key)
            self.infos.pop(key, None)
            self.broken.pop(key, None)
            self._resolved = None

    # -- resolution ------------------------------------------------------------
    def resolved(self) -> _Resolved:
        """Every hook of every plugin called once, checked and merged (cached)."""
        resolved = self._resolved
        if resolved is not None:  # the common case, without the lock
            return resolved
        with self.lock:
            if self._resolved is not None:
                return self._resolved
            if self._resolving:  # a hook that looks a plugin up while registering
                raise PluginLoadError(
                    "a plugin hook asked for a plugin while the plugins were being registered"
                )
            self._resolving = True
            try:
                resolved, to_warn = self._resolve()
            finally:
                self._resolving = False
            self._resolved = resolved
            for info in to_warn:
                self._warn(info)
        self.emit_warnings()
        return resolved

    def _resolve(self) -> tuple[_Resolved, list[PluginInfo]]:
        claims = self._call_hooks()
        tables: dict[str, dict[str, tuple[Any, str]]] = {kind: {} for kind in KINDS}
        unavailable: dict[str, dict[str, DiscoError]] = {kind: {} for kind in KINDS}
        problems: dict[str, list[str]] = {key: [] for key in self.infos}
        for key, info in self.infos.items():
            if info.error is not None:  # disabled: its names lead to its error
                for kind, names in claims[key].items():
                    for name in names:
                        unavailable[kind].setdefault(name, self._disabled_error(kind, name, info))
        for kind, (_, noun) in KINDS.items():
            by_name: dict[str, list[str]] = {}
            for key, info in self.infos.items():
                if info.error is None:
                    for name in claims[key].get(kind, {}):
                        by_name.setdefault(name, []).append(key)
            for name, keys in by_name.items():
                if len(keys) == 1:
                    tables[kind][name] = (claims[keys[0]][kind][name], keys[0])
                    continue
                core = [k for k in keys if _is_core(self.infos[k])]
                if core:  # the core's own name wins; every other claimant loses it
                    tables[kind][name] = (claims[core[0]][kind][name], core[0])
                    for k in keys:
                        if k not in core:
                            problems[k].append(
                                f"{noun} {name!r} is the core's own ({self._dist(core[0])}), "
                                f"which wins; this plugin's {name!r} is refused, its other "
                                "names stay"
                            )
                    continue
                who = " and ".join(f"{k!r} ({self._dist(k)})" for k in keys)
                unavailable[kind][name] = PluginConflictError(
                    f"{noun} {name!r} is registered by {len(keys)} plugins: {who}; the name is "
                    f"refused for all of them: uninstall all but one"
                )
                for k in keys:
                    others = ", ".join(repr(o) for o in keys if o != k)
                    problems[k].append(
                        f"{noun} {name!r} is also registered by {others}; the name is refused "
                        f"for {'both' if len(keys) == 2 else 'all of them'}, this plugin's "
                        "other names stay"
                    )
        to_warn = []
        for key, info in self.infos.items():
            if info.error is None:
                info.provides = {
                    kind: sorted(n for n, (_, k) in tables[kind].items() if k == key)
                    for kind in KINDS
                }
                for kind, provided in info.provides.items():
                    logger.debug("plugin %s registers %ss %s", key, KINDS[kind][1], provided)
                if problems[key]:
                    info.error = "; ".join(problems[key])
            if info.error is not None:
                to_warn.append(info)
        return _Resolved(tables, unavailable), to_warn

    def _call_hooks(self) -> dict[str, dict[str, dict[str, Any]]]:
        """key -> kind -> {name: object}; sets ``error`` on each plugin with a wrong hook.

        Every hook of a plugin is called, even after one failed, so that the names
        it would have provided lead to its error rather than to "not installed".
        """
        claims: dict[str, dict[str, dict[str, Any]]] = {key: {} for key in self.infos}
        errors: dict[str, list[str]] = {key: [] for key in self.infos}
        for info in self.infos.values():
            info.error, info.disabled, info.provides = None, False, {}
        for kind, (hook_name, _) in KINDS.items():
            for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
                key = impl.plugin_name
                if key not in claims:  # registered on the pluggy manager directly
                    continue
                try:
                    result = impl.function()
                except (Exception, SystemExit) as exc:  # SystemExit: a plugin's sys.exit()
                    errors[key].append(f"{hook_name}() raised {type(exc).__name__}: {exc}")
                    continue
                try:
                    found, problem = _check_result(kind, result)
                except Exception as exc:  # a mapping whose items() or a repr() raises
                    found = {}
                    problem = (
                        f"{hook_name}() returned an unreadable {type(result).__name__}: {exc!r}"
                    )
                claims[key][kind] = found
                if problem:
                    errors[key].append(problem)
        for key, problems in errors.items():
            if problems:
                info = self.infos[key]
                info.error = _one_line("; ".join(problems))
                info.disabled = True
        return claims

    def _disabled_error(self, kind: str, name: str, info: PluginInfo) -> DiscoError:
        return PluginLoadError(
            f"{KINDS[kind][1]} {name!r} comes from the plugin {info.name!r} "
            f"({self._dist(info.name)}), which is disabled: {info.error}"
        )

    def _warn(self, info: PluginInfo) -> None:
        """Queue the one warning about ``info``'s current error."""
        if os.environ.get("DISCO_WORKER_PROCESS"):
            return  # the controller already warned; a worker reports it only when used
        if (info.name, info.error or "") not in self._warned:
            self._warned.add((info.name, info.error or ""))
            self._pending.append(info)

    def emit_warnings(self) -> None:
        """Warn about what was queued, with no lock held and the state complete.

        Under ``-W error`` the warning raises here, after the manager has been set
        up, so the next call finds it in the same state and does not warn again.
        """
        if not self._pending:  # the common case, without the lock
            return
        with self.lock:
            pending, self._pending = self._pending, []
        for info in pending:
            what = "is disabled" if info.disabled else "lost a name"
            warnings.warn(
                f"Disco plugin {info.name!r} ({_origin(info)}) "
                f"{what}: {info.error}. The rest of Disco keeps working; `disco plugins` lists "
                "every problem.",
                DiscoPluginWarning,
                stacklevel=_caller_level(),
            )

    def _dist(self, key: str) -> str:
        info = self.infos.get(key) or self.broken.get(key)
        return _origin(info) if info else key


def _is_core(info: PluginInfo) -> bool:
    """The core's own plugin (its entry point, or the built-ins of a source tree)."""
    return _canon(info.distribution) == CORE_DISTRIBUTION and info.version != "local"


def _origin(info: PluginInfo) -> str:
    """Where a plugin comes from, for messages: its distribution, or how it got here."""
    if info.version == "local":
        return "registered by hand with register_plugin"
    if info.version == "?" and info.distribution == info.name:
        return f"module {info.name}, from {PLUGINS_ENV}"
    return f"distribution {info.distribution} {info.version}"


def _check_result(kind: str, result: Any) -> tuple[dict[str, Any], str | None]:
    """The valid names of one hook's result, and what is wrong with it (None: nothing)."""
    hook_name, noun = KINDS[kind]
    if result is None:  # pluggy's "no result": registers nothing
        return {}, None
    if not isinstance(result, Mapping):
        return {}, (
            f"{hook_name}() returned a {type(result).__name__}, not a mapping "
            f"(dict) of name to {noun}"
        )
    found: dict[str, Any] = {}
    wrong = []
    for name, value in result.items():
        problem = _check_entry(kind, name, value)
        if problem:
            wrong.append(problem)
        if isinstance(name, str):  # even a wrong entry's name leads to the plugin's error
            found[name] = value
    if wrong:
        return found, f"{hook_name}() returned {'; '.join(wrong)}"
    return found, None


def _check_entry(kind: str, name: Any, value: Any) -> str | None:
    noun = KINDS[kind][1]
    if kind == "loader":
        if not isinstance(name, str) or len(name) < 2 or os.path.splitext("x" + name)[1] != name:
            return (
                f"the suffix {_short(name)}, which is not a file suffix like '.onnx' "
                "(as os.path.splitext gives it)"
            )
    elif not isinstance(name, str) or not name:
        return f"the name {_short(name)}: a {noun} name is a non-empty str"
    if kind == "ccl":
        from .ccl.base import CCL

        if not (isinstance(value, type) and issubclass(value, CCL)):
            return f"{name!r}: {_short(value)}, which is not a subclass of disco_core.spi.CCL"
    elif not callable(value):
        what = "factory(**options)" if kind == "channel" else "loader(path, device)"
        return f"{name!r}: {_short(value)}, which is not callable (a {noun} is a {what})"
    return None


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame outside disco_core: the warning points there."""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    level, frame = 1, sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def _one_line(text: str) -> str:
    """A multi-line error (pluggy's, a plugin's own) as one line for lists and warnings."""
    return "; ".join(filter(None, (line.strip() for line in text.splitlines())))


def _short(value: Any) -> str:
    """``repr(value)``, cut short: a message names the object, it does not dump it."""
    return reprlib.repr(value)


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
                if not any(_is_core(i) for i in mgr.infos.values()):
                    # Running from a source tree that was never installed: the entry
                    # points are missing, so register the built-ins the same way.
                    from . import _builtin_plugin

                    mgr._add(_builtin_plugin, "disco-core:builtins", CORE_DISTRIBUTION, "source")
                _MANAGER = mgr
    _MANAGER.emit_warnings()
    return _MANAGER


def get_plugin_manager() -> pluggy.PluginManager:
    """The pluggy plugin manager, with every entry-point plugin loaded."""
    return _manager().pm


def register_plugin(plugin: Any, name: str | None = None) -> str:
    """Register a plugin object by hand (tests, notebooks); returns its name.

    Its hooks are called at once: a plugin with a mistake is reported by a
    :class:`DiscoPluginWarning` here, and by :func:`list_plugins`, like one that
    was installed. A plugin registered this way in the controller is not seen by
    worker processes; publish an entry point (or list the module in
    ``DISCO_PLUGINS``) for that.
    """
    mgr = _manager()
    key = name or getattr(plugin, "__name__", None) or repr(plugin)
    # The caller's own mistakes: said here, not reported as a broken plugin.
    if key in mgr.infos:
        raise DiscoValueError(f"a plugin named {key!r} is already registered")
    if mgr.pm.is_registered(plugin):
        raise DiscoValueError(f"{plugin!r} is already registered as {mgr.pm.get_name(plugin)!r}")
    mgr._add(plugin, key, key, "local")
    mgr.resolved()
    mgr.emit_warnings()  # this plugin's mistakes are said here, at the call
    return key


def unregister_plugin(name: str) -> None:
    """Undo :func:`register_plugin`."""
    _manager().remove(name)


def registered(kind: str) -> dict[str, Any]:
    """Every name registered for ``kind`` ("channel", "ccl" or "loader")."""
    return {name: impl for name, (impl, _) in _manager().resolved().tables[kind].items()}


#: The kinds whose core built-ins :func:`lookup` returns before any plugin is loaded.
_CORE_FAST = ("channel", "ccl")
_CORE_TABLES: dict[str, dict[str, Any]] = {}


def _core_builtins(kind: str) -> dict[str, Any]:
    """The core's own registrations of ``kind`` (its built-in plugin's hook)."""
    table = _CORE_TABLES.get(kind)
    if table is None:
        from . import _builtin_plugin

        table = _CORE_TABLES[kind] = dict(getattr(_builtin_plugin, KINDS[kind][0])())
    return table


def lookup(kind: str, name: str) -> Any:
    """Return the implementation registered for ``name``.

    Raises
    ------
    DiscoTypeError
        ``name`` is not a str.
    PluginNotFoundError
        Nobody registered ``name``; the message says which distribution provides it
        (when known), lists what is installed, and names every broken plugin.
    PluginLoadError
        ``name`` comes only from a plugin that is disabled, or the distribution known
        to provide it is installed but failed to load; the message names the plugin
        and its error.
    PluginConflictError
        Two plugins other than the core registered ``name``; it is refused for both.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown plugin kind {kind!r}; expected one of {sorted(KINDS)}")
    if not isinstance(name, str):
        raise DiscoTypeError(f"a {kind} is named by a str, got {type(name).__name__} {name!r}")
    if _MANAGER is None and kind in _CORE_FAST:
        # The core wins every name conflict, so its own channels and CCLs need no
        # plugin loaded: a worker process's init_ccl("shm") skips importing every
        # installed plugin (0.2 s each).
        found = _core_builtins(kind).get(name)
        if found is not None:
            return found
    mgr = _manager()
    resolved = mgr.resolved()
    table = resolved.tables[kind]
    if name in table:
        return table[name][0]
    refused = resolved.unavailable[kind].get(name)
    if refused is not None:
        raise type(refused)(str(refused))  # a fresh exception per call: no shared traceback
    noun = KINDS[kind][1]
    have = ", ".join(sorted(table)) or "none"
    provider = KNOWN_PROVIDERS.get(kind, {}).get(name)
    failed = [
        i for i in mgr.broken.values() if provider and _canon(i.distribution) == _canon(provider)
    ]
    if failed:  # installed, but it did not load: "pip install" would send the user astray
        raise PluginLoadError(
            f"no {noun} named {name!r} is available: the distribution {provider} that provides "
            f"it is installed but failed to load ({failed[0].error})"
        )
    if provider and provider.startswith("disco-"):
        hint = f"it is provided by the distribution {provider}: {install_command(provider)}"
    elif provider:
        hint = f"it needs {provider}"
    else:
        hint = "no known distribution provides it; a plugin registers it through the 'disco_core' entry-point group"
    broken = "".join(
        f"\n  (plugin {i.name} ({mgr._dist(i.name)}) is disabled: {i.error})"
        for i in [*mgr.broken.values(), *mgr.infos.values()]
        if i.disabled
    )
    if os.environ.get(AUTOLOAD_ENV, "").strip() not in ("", "0"):
        broken += f"\n  ({AUTOLOAD_ENV} is set: only the core's plugins were loaded)"
    raise PluginNotFoundError(
        f"no {noun} named {name!r} is installed; {hint}. Installed {noun}s: {have}{broken}"
    )


def list_plugins() -> list[PluginInfo]:
    """Every plugin (working or broken) with what it registers, for ``disco plugins``."""
    mgr = _manager()
    mgr.resolved()
    return sorted(
        [*mgr.infos.values(), *mgr.broken.values()], key=lambda i: (i.distribution, i.name)
    )
