"""Activation by environment, shared by the trace and the fault injectors. Standard library only.

The package's `_patches/sitecustomize.py` (the folder `mcore-proxy patches` prints, put on
`PYTHONPATH` by a launch; a checkout's `patches/sitecustomize.py` links to it) calls
`activate_from_env()` at interpreter start. Each *feature*
(`mcore_proxy.trace.activate.FEATURE`, `mcore_proxy.faults.activate.FEATURE`) names the
environment variable that switches it on, the runtime module that does the work, and the modules
it watches. For every active feature one finder, first on `sys.meta_path`, lets the watched
modules import normally and then hands each to `runtime.function(module)`:

    FEATURE_MODULES  ->  Feature(env_var, runtime, watched={module: function})  ->  PostImportFinder

Nothing (not even torch) is imported until a watched module is; a process that never imports
one is untouched. Modules already imported when activation runs are handed over at once.
"""

from __future__ import annotations

import importlib
import importlib.abc
import logging
import os
import sys
import threading
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

PATCHES_DIR = "_patches"
SITECUSTOMIZE = "sitecustomize.py"

# The features, in activation order. A new feature is one module with a `FEATURE` and one row.
FEATURE_MODULES = ("mcore_proxy.trace.activate", "mcore_proxy.faults.activate")


@dataclass(frozen=True)
class Feature:
    """One thing the environment can switch on in a launch pipeline.

    watched: imported module name -> name of the function in `runtime` called with the module.
    check: optional `module:function` (standard library only) called at activation, so that a
    bad setting fails at interpreter start instead of after minutes of model building.
    """

    name: str
    env_var: str
    runtime: str
    watched: dict = field(default_factory=dict)
    check: str | None = None

    def active(self) -> bool:
        return bool(os.environ.get(self.env_var))

    def callback(self, function_name: str):
        """A callback that imports the runtime module only when it fires."""
        runtime = self.runtime

        def callback(module) -> None:
            getattr(importlib.import_module(runtime), function_name)(module)

        return callback


class _NotifyingLoader(importlib.abc.Loader):
    """Delegates to the real loader, then runs the callbacks on the executed module."""

    def __init__(self, loader, callbacks):
        self._loader, self._callbacks = loader, callbacks

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        for callback in list(self._callbacks):
            callback(module)

    def __getattr__(self, attr):  # get_source, get_filename, is_package, ... of the real loader
        return getattr(self._loader, attr)


class PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: asks the other finders, then wraps the loader of a watched module
    so that its callbacks run once the module has executed (once per name).

    callbacks: module name -> a callable or a list of callables (more with `add`)."""

    def __init__(self, callbacks: dict | None = None):
        self.callbacks: dict[str, list] = {}
        self.pending: set[str] = set()
        self._busy = threading.local()
        for name, callback in (callbacks or {}).items():
            for one in callback if isinstance(callback, (list, tuple)) else [callback]:
                self.callbacks.setdefault(name, []).append(one)
                self.pending.add(name)

    def add(self, name: str, callback) -> None:
        """Watch `name`; if it is imported already, the callback runs now."""
        self.callbacks.setdefault(name, []).append(callback)
        if name in sys.modules:
            callback(sys.modules[name])
        else:
            self.pending.add(name)

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.pending or getattr(self._busy, "name", None) == fullname:
            return None
        self._busy.name = fullname
        try:
            spec = None
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        finally:
            self._busy.name = None
        if spec is None or spec.loader is None:
            return None
        self.pending.discard(fullname)
        spec.loader = _NotifyingLoader(spec.loader, self.callbacks[fullname])
        return spec


_FINDER: PostImportFinder | None = None
_ACTIVE: set[str] = set()
_LOCK = threading.Lock()


def finder() -> PostImportFinder:
    """The one finder of this process, first on `sys.meta_path` (created on first use)."""
    global _FINDER
    if _FINDER is None:
        _FINDER = PostImportFinder()
        sys.meta_path.insert(0, _FINDER)
    return _FINDER


def activate(feature: Feature) -> bool:
    """Switch `feature` on if its environment variable is set (idempotent). Returns whether active."""
    if not feature.active():
        return False
    with _LOCK:
        if feature.name in _ACTIVE:
            return True
        if feature.check:
            module_name, function_name = feature.check.split(":")
            getattr(importlib.import_module(module_name), function_name)()
        watcher = finder()
        for module_name, function_name in feature.watched.items():
            watcher.add(module_name, feature.callback(function_name))
        _ACTIVE.add(feature.name)
    return True


def patches_dir() -> str:
    """The folder to put on `PYTHONPATH` to activate by environment: the package's `_patches/`,
    shipped in the wheel as package data (it holds only `sitecustomize.py`)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), PATCHES_DIR)


def features() -> list[Feature]:
    return [importlib.import_module(name).FEATURE for name in FEATURE_MODULES]


def env_vars() -> tuple[str, ...]:
    """The variables that switch a feature on (`_patches/sitecustomize.py` mirrors them)."""
    return tuple(f.env_var for f in features())


def activate_from_env() -> tuple[str, ...]:
    """Switch on every feature whose environment variable is set; returns their names."""
    return tuple(f.name for f in features() if activate(f))


def register_with_mindspeed(patch_utils, patches: dict, feature: str) -> bool:
    """Register `{dotted target: wrapper}` with the `MindSpeedPatchesManager` of an imported
    `mindspeed.patch_utils`. MindSpeed applies a registered function whose name ends in "wrapper"
    on top of whatever replacement of the target it installs, so the wrappers survive MindSpeed's
    own patches. Returns False (with a warning) when the module has no such manager."""
    manager = getattr(patch_utils, "MindSpeedPatchesManager", None)
    if manager is None:
        log.warning(
            "%s: mindspeed.patch_utils has no MindSpeedPatchesManager; MindSpeed replacements "
            "of %s will not be covered",
            feature,
            ", ".join(patches),
        )
        return False
    for target, wrapper in patches.items():
        manager.register_patch(target, wrapper)
    log.info("%s: wrappers registered with %s", feature, getattr(manager, "__name__", manager))
    return True
