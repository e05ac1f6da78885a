"""Post-import hooks that switch tracing on from the environment. Standard library only.

`patches/sitecustomize.py` calls `activate_from_env()` at interpreter start. When
`MCORE_PROXY_TRACE_DIR` is set it puts a finder first on `sys.meta_path` that lets the watched
modules import normally and then hands them to `mcore_proxy.trace.runtime`:

    megatron.core.transformer.moe.router      -> wrap TopKRouter.forward
    megatron.core.transformer.moe.moe_layer   -> wrap MoELayer.__init__ (saliency only)
    mindspeed.patch_utils                     -> register *_wrapper functions with
                                                 MindSpeedPatchesManager

Nothing (not even torch) is imported until one of those modules is; a process that never
imports megatron is untouched. Modules already imported when activation runs are patched at once.
"""
from __future__ import annotations

import importlib
import importlib.abc
import os
import sys
import threading

ENV_DIR = "MCORE_PROXY_TRACE_DIR"

WATCHED = {
    "megatron.core.transformer.moe.router": "patch_router_module",
    "megatron.core.transformer.moe.moe_layer": "patch_moe_layer_module",
    "mindspeed.patch_utils": "patch_mindspeed_module",
}


def runtime_callback(function_name: str):
    """A callback that imports `mcore_proxy.trace.runtime` only when it fires."""

    def callback(module) -> None:
        runtime = importlib.import_module("mcore_proxy.trace.runtime")
        getattr(runtime, function_name)(module)

    return callback


class _NotifyingLoader(importlib.abc.Loader):
    """Delegates to the real loader, then runs the callback on the executed module."""

    def __init__(self, loader, callback):
        self._loader, self._callback = loader, callback

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._callback(module)

    def __getattr__(self, attr):  # get_source, get_filename, is_package, ... of the real loader
        return getattr(self._loader, attr)


class PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: asks the other finders, then wraps the loader of a watched module
    so that `callbacks[name](module)` runs once the module has executed (once per name)."""

    def __init__(self, callbacks: dict):
        self.callbacks = dict(callbacks)
        self.pending = set(self.callbacks)
        self._busy = threading.local()

    def run_now(self, name: str, module) -> None:
        self.pending.discard(name)
        self.callbacks[name](module)

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


def activate_from_env() -> bool:
    """Install the finder if `MCORE_PROXY_TRACE_DIR` is set (idempotent). Returns whether active."""
    global _FINDER
    if not os.environ.get(ENV_DIR):
        return False
    if _FINDER is None:
        _FINDER = PostImportFinder({name: runtime_callback(fn) for name, fn in WATCHED.items()})
        sys.meta_path.insert(0, _FINDER)
        for name in WATCHED:
            if name in sys.modules:  # imported before activation (e.g. by a chained sitecustomize)
                _FINDER.run_now(name, sys.modules[name])
    return True
