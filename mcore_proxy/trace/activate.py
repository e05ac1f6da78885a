"""The trace as a feature of `mcore_proxy.activation`: switched on by `MCORE_PROXY_TRACE_DIR`.
Standard library only.

`patches/sitecustomize.py` activates it at interpreter start (through
`mcore_proxy.activation.activate_from_env`); when the watched modules are imported,
`mcore_proxy.trace.runtime` patches them:

    megatron.core.transformer.moe.router      -> wrap TopKRouter.forward
    megatron.core.transformer.moe.moe_layer   -> wrap MoELayer.__init__ (saliency only)
    mindspeed.patch_utils                     -> register *_wrapper functions with
                                                 MindSpeedPatchesManager
    vllm.model_executor.model_loader.base_loader -> observe the routers of every model vLLM loads
"""

from __future__ import annotations

from mcore_proxy.activation import Feature, PostImportFinder, activate  # noqa: F401 (re-exported)

ENV_DIR = "MCORE_PROXY_TRACE_DIR"

WATCHED = {
    "megatron.core.transformer.moe.router": "patch_router_module",
    "megatron.core.transformer.moe.moe_layer": "patch_moe_layer_module",
    "mindspeed.patch_utils": "patch_mindspeed_module",
    "vllm.model_executor.model_loader.base_loader": "patch_vllm_loader_module",
}

FEATURE = Feature("trace", ENV_DIR, "mcore_proxy.trace.runtime", WATCHED)


def env_tracing_active() -> bool:
    return FEATURE.active()


def activate_from_env() -> bool:
    """Switch the trace on if `MCORE_PROXY_TRACE_DIR` is set (idempotent). Returns whether active.
    (`mcore_proxy.activation.activate_from_env()` switches on every feature the environment names.)"""
    return activate(FEATURE)
