"""Fault injectors for megatron-core (and transformers) models and optimizers.

    from mcore_proxy import faults
    with faults.inject("logprob_precision:dtype=bf16;update_omission:every=2", model=gpt,
                       optimizer=opt) as session:
        ...                                  # faults.set_step(i) if the loop knows its step

Launch pipelines need no code change: put `patches/` on PYTHONPATH and set `MCORE_PROXY_FAULTS`
(see `mcore_proxy.faults.spec` for the syntax and the kinds, `mcore_proxy.faults.runtime`).

Importing this package imports nothing heavy; torch loads on first use.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "inject": "mcore_proxy.faults.session",
    "FaultSession": "mcore_proxy.faults.session",
    "INJECTORS": "mcore_proxy.faults.session",
    "parse": "mcore_proxy.faults.spec",
    "FaultSpec": "mcore_proxy.faults.spec",
    "Schedule": "mcore_proxy.faults.spec",
    "FaultSpecError": "mcore_proxy.faults.spec",
    "KINDS": "mcore_proxy.faults.spec",
    "set_step": "mcore_proxy.faults.clock",
    "current_step": "mcore_proxy.faults.clock",
    "rollout": "mcore_proxy.faults.clock",
    "CLOCK": "mcore_proxy.faults.clock",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'mcore_proxy.faults' has no attribute {name!r}")
