"""Activation by environment: the wrapped `TopKRouter.forward` and the process-wide tracer.

`mcore_proxy.trace.activate` (stdlib only, run from `patches/sitecustomize.py` through
`mcore_proxy.activation`) calls the `patch_*` functions below right after megatron or mindspeed
modules are imported; nothing here imports megatron at module import. Imports go one way:
runtime -> megatron glue -> tracer (the glue asks `activate`, not this module, whether the
environment traces).

Environment:
- `MCORE_PROXY_TRACE_DIR`           folder for `rank{R:05d}.safetensors` + `.json` (required)
- `MCORE_PROXY_TRACE_FLUSH_STEPS`   rewrite the file every N forward passes (default 100, 0: only
                                    at exit); a step is defined in `mcore_proxy.trace.tracer`
- `MCORE_PROXY_TRACE_SALIENCY`      `1`: also hook the experts of every MoE layer (saliency_sum)

Plain megatron: `TopKRouter.forward` is replaced by a wrapper when its module is imported.
MindSpeed: its patch manager later *replaces* `TopKRouter.forward` (MindSpeed-LLM does), which
would drop a plain wrapper, so a `*_wrapper` is also registered with `MindSpeedPatchesManager`;
the manager applies wrappers on top of whatever replacement it installs. A wrapped function is
marked, wrapping is idempotent, and a nested traced call (a replacement that calls the original
forward) records once, in the outermost wrapper.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import threading

from mcore_proxy.activation import register_with_mindspeed
from mcore_proxy.trace import megatron
from mcore_proxy.trace.activate import ENV_DIR, env_tracing_active
from mcore_proxy.trace.tracer import Tracer

log = logging.getLogger(__name__)

ENV_FLUSH = "MCORE_PROXY_TRACE_FLUSH_STEPS"
ENV_SALIENCY = "MCORE_PROXY_TRACE_SALIENCY"
DEFAULT_FLUSH_STEPS = 100
ROUTER_FORWARD = "megatron.core.transformer.moe.router.TopKRouter.forward"
MOE_LAYER_INIT = "megatron.core.transformer.moe.moe_layer.MoELayer.__init__"
_MARK = "__mcore_proxy_traced__"

_TRACER = None
_LOCK = threading.Lock()
_NESTING = threading.local()


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name, "")
    try:
        return int(text) if text else default
    except ValueError:
        raise ValueError(f"{name}={text!r} is not an integer") from None


def env_tracer():
    """The process-wide tracer configured by the environment, created on first use; its final
    flush runs at interpreter exit."""
    global _TRACER
    if _TRACER is None:
        with _LOCK:
            if _TRACER is None:
                tracer = Tracer(os.environ[ENV_DIR], flush_every=_env_int(ENV_FLUSH, DEFAULT_FLUSH_STEPS))
                atexit.register(tracer.close)
                _TRACER = tracer
    return _TRACER


def saliency_requested() -> bool:
    return os.environ.get(ENV_SALIENCY, "0") not in ("", "0", "false", "False")


def traced_router_forward(forward):
    """Wrap a `TopKRouter.forward(self, input, padding_mask=None)` implementation."""
    if getattr(forward, _MARK, False):
        return forward

    @functools.wraps(forward)
    def traced_forward(self, *args, **kwargs):
        if getattr(_NESTING, "depth", 0) or not env_tracing_active():
            return forward(self, *args, **kwargs)
        _NESTING.depth = 1
        try:
            output = forward(self, *args, **kwargs)
        finally:
            _NESTING.depth = 0
        megatron.record_router_call(env_tracer(), self, args, kwargs, output)
        return output

    setattr(traced_forward, _MARK, True)
    return traced_forward


def traced_moe_layer_init(init):
    """Wrap `MoELayer.__init__` so each new MoE layer hooks its experts for saliency."""
    if getattr(init, _MARK, False):
        return init

    @functools.wraps(init)
    def traced_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if getattr(self, "_mcore_proxy_saliency_hooked", False) or not env_tracing_active():
            return
        self._mcore_proxy_saliency_hooked = True
        layer = self

        def hook(module, args, output):
            if megatron.saliency_supported(layer):
                megatron.record_experts_call(env_tracer(), layer, args, output)

        self.experts.register_forward_hook(hook)

    setattr(traced_init, _MARK, True)
    return traced_init


# MindSpeed's patch manager treats a registered function whose name ends in "wrapper" as a
# decorator applied on top of the (possibly replaced) original: keep these names.
def trace_router_forward_wrapper(forward):
    return traced_router_forward(forward)


def trace_moe_layer_init_wrapper(init):
    return traced_moe_layer_init(init)


def patch_router_module(module) -> None:
    """Called once `megatron.core.transformer.moe.router` is imported."""
    cls = module.TopKRouter
    cls.forward = traced_router_forward(cls.forward)
    log.info("trace: TopKRouter.forward wrapped; statistics go to %s", os.environ.get(ENV_DIR))


def patch_moe_layer_module(module) -> None:
    """Called once `megatron.core.transformer.moe.moe_layer` is imported (saliency only)."""
    if saliency_requested():
        cls = module.MoELayer
        cls.__init__ = traced_moe_layer_init(cls.__init__)


def mindspeed_patches() -> dict:
    patches = {ROUTER_FORWARD: trace_router_forward_wrapper}
    if saliency_requested():
        patches[MOE_LAYER_INIT] = trace_moe_layer_init_wrapper
    return patches


def patch_mindspeed_module(module) -> None:
    """Called once `mindspeed.patch_utils` is imported."""
    register_with_mindspeed(module, mindspeed_patches(), "trace")


def _trace_vllm_model(model) -> None:
    from mcore_proxy.trace.vllm import attach

    attach(env_tracer(), model)


def patch_vllm_loader_module(module) -> None:
    """Called once vLLM's `model_loader.base_loader` is imported: the routers of every model the
    rollout engine loads feed the process-wide tracer."""
    from mcore_proxy.engines import vllm as vllm_engine

    vllm_engine.on_model_loaded(_trace_vllm_model)
    vllm_engine.patch_loader_module(module)
