"""Routing statistics from Megatron/MindSpeed runs (DESIGN.md 4.1).

    from mcore_proxy.trace import install
    with install(model, "stats_dir") as tracer:      # model: a module or the list of VP chunks
        ...your forward passes...                    # -> stats_dir/rank{R:05d}.safetensors + .json

Launch pipelines need no code change: put `patches/` on PYTHONPATH and set
`MCORE_PROXY_TRACE_DIR` (see `mcore_proxy.trace.runtime`). Then `mcore-proxy stats merge DIR`.

Importing this package imports nothing heavy; torch and megatron load on first use.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "install": "mcore_proxy.trace.megatron",
    "Tracer": "mcore_proxy.trace.tracer",
    "RouterInfo": "mcore_proxy.trace.tracer",
    "LayerAccumulator": "mcore_proxy.trace.accumulator",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'mcore_proxy.trace' has no attribute {name!r}")
