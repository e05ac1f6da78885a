"""vLLM glue: the MoE routers and the logits of a model vLLM built, and the hooks on them.

Light on purpose: it runs inside vLLM's engine and worker processes, imports vLLM only when asked
about a vLLM model, and is what the trace, the fault injectors and `mcore-proxy consistency` use
to reach a vLLM model (vLLM >= 0.30, whose fused-MoE layers are `MoERunner`s holding a `router`).

- Routers: every `MoERunner` (vLLM's fused-MoE layer) holds a router object whose
  `select_experts(hidden_states [T, H], router_logits [T, E], ...)` returns
  `(topk_weights [T, k], topk_ids [T, k])` on the modular kernels (every CPU kernel and the
  Triton ones). Its layer id is the decoder layer in the runner's name (`model.layers.{L}.mlp...`),
  as in the routing statistics. `route_through(router)` gives a router an instance-level
  `select_experts` that runs logit transforms before its class's rule and observers after it;
  removing the last callback restores the class's method, so a router with nothing attached is
  untouched.
- Logits: `model.logits_processor` (vLLM's `LogitsProcessor`, whose output is the logits [T, V]
  that sampling and log-probs read) takes forward hooks like any module.

Hooks are Python: they run in eager execution (`enforce_eager=True`, `--enforce-eager`). Under
CUDA graphs a replay never calls them; `patch_loader_module` warns when the engine compiles.
"""

from __future__ import annotations

import functools
import logging
import re

from mcore_proxy.engines.hooks import CallbackHandle

log = logging.getLogger(__name__)

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")
_CHAIN = "_mcore_proxy_route"
_MARK = "__mcore_proxy_vllm__"


def layer_of(name: str) -> str | None:
    """`model.layers.12.mlp.experts` -> "12" (None when the name holds no decoder layer)."""
    match = _LAYER.search(name)
    return match.group(1) if match else None


def moe_routers(model) -> dict[str, object]:
    """layer id -> the router of every fused-MoE layer of a vLLM model, in layer order."""
    found = {}
    for name, module in model.named_modules():
        router = getattr(module, "router", None)
        if router is None or not callable(getattr(router, "select_experts", None)):
            continue
        layer = layer_of(getattr(module, "layer_name", "") or name)
        if layer is not None and layer not in found:
            found[layer] = router
    return dict(sorted(found.items(), key=lambda item: int(item[0])))


def router_shape(router) -> tuple[int, int]:
    """(experts E, top-k k) of a vLLM router."""
    return int(router.global_num_experts), int(router.top_k)


def logits_module(model):
    """The module whose output is the logits [T, V] (vLLM's `LogitsProcessor`), or None."""
    return getattr(model, "logits_processor", None)


class _Route:
    """The callbacks of one router: `transforms` (hidden, logits) -> logits, run before the
    router's rule; `observers` (hidden, logits, weights, ids), run after it."""

    def __init__(self):
        self.transforms: list = []
        self.observers: list = []

    def empty(self) -> bool:
        return not (self.transforms or self.observers)


def _route(router) -> _Route:
    route = router.__dict__.get(_CHAIN)
    if route is None:
        route = _Route()
        rule = type(router).select_experts

        def select_experts(hidden_states, router_logits, *args, **kwargs):
            for transform in list(route.transforms):
                router_logits = transform(hidden_states, router_logits)
            weights, ids = rule(router, hidden_states, router_logits, *args, **kwargs)
            for observe in list(route.observers):
                observe(hidden_states, router_logits, weights, ids)
            return weights, ids

        router.__dict__[_CHAIN] = route
        router.__dict__["select_experts"] = select_experts
    return route


def _add(router, kind: str, fn) -> CallbackHandle:
    route = _route(router)
    getattr(route, kind).append(fn)

    def remove():
        getattr(route, kind).remove(fn)
        if route.empty():  # nothing attached: the class's method again, bit for bit
            router.__dict__.pop("select_experts", None)
            router.__dict__.pop(_CHAIN, None)

    return CallbackHandle(remove)


def add_logit_transform(router, fn) -> CallbackHandle:
    """`fn(hidden [T, H], logits [T, E]) -> logits` runs before the router's own rule."""
    return _add(router, "transforms", fn)


def add_observer(router, fn) -> CallbackHandle:
    """`fn(hidden [T, H], logits [T, E], weights [T, k], ids [T, k])` runs after the router's rule."""
    return _add(router, "observers", fn)


def tensor_parallel_rank() -> int:
    """This worker's tensor-parallel rank (0 outside a vLLM engine)."""
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except (ImportError, AssertionError, RuntimeError):
        return 0


# -- after a model is loaded ----------------------------------------------------------------------

_ON_LOAD: list = []


def on_model_loaded(callback) -> None:
    """Call `callback(model)` for every model vLLM's loaders build from now on (see
    `patch_loader_module`, which the activation runs when vLLM's loader module is imported)."""
    if callback not in _ON_LOAD:
        _ON_LOAD.append(callback)


def stop_on_model_loaded(callback) -> None:
    """Undo `on_model_loaded(callback)` (a callback holding models would keep them alive)."""
    if callback in _ON_LOAD:
        _ON_LOAD.remove(callback)


def _wrap_load_model(load_model):
    if getattr(load_model, _MARK, False):
        return load_model

    @functools.wraps(load_model)
    def wrapped(self, *args, **kwargs):
        model = load_model(self, *args, **kwargs)
        model_config = kwargs.get("model_config", args[1] if len(args) > 1 else None)
        compiled = getattr(model_config, "enforce_eager", True) is False
        if _ON_LOAD and compiled:
            log.warning(
                "mcore-proxy: vLLM runs this model with CUDA graphs or compilation; the trace and the "
                "faults act only in eager passes: pass enforce_eager=True (--enforce-eager)"
            )
        for callback in list(_ON_LOAD):
            callback(model)
        return model

    setattr(wrapped, _MARK, True)
    return wrapped


def patch_loader_module(module) -> None:
    """Called once `vllm.model_executor.model_loader.base_loader` is imported: every loader's
    `load_model` (the base class's, which the others inherit) hands its model to the callbacks."""
    cls = module.BaseModelLoader
    cls.load_model = _wrap_load_model(cls.load_model)
