"""Where injectors attach: the router, routed-experts and output-layer modules of a model.

A `Site` is one module of one of these kinds, with a function that tells its global 0-based layer
id (resolved at call time: megatron sets `layer_number` after the MoE layer is built):

    router    megatron `TopKRouter` (logits through `gating`, choices through its forward output)
    experts   megatron `MoELayer.experts` (output `(out [routed tokens, H], bias)`)
    gate      transformers: a sparse MoE block's router `nn.Linear` (output logits)
    hf_expert transformers: one expert module of a sparse MoE block (output [tokens, H])
    output    megatron `GPTModel.output_layer` (output `(logits, bias)`), transformers `lm_head`,
              vLLM's `LogitsProcessor` (output logits [T, V])
    vllm_router  vLLM: the router object of a fused-MoE layer (`engines/vllm.py`: logits
              transformed before its `select_experts`)
"""

from __future__ import annotations

from mcore_proxy.engines import megatron
from mcore_proxy.faults import hf
from mcore_proxy.faults.site import Site


def moe_layer_sites(layer) -> list[Site]:
    """The router and experts of one megatron `MoELayer`."""
    router = layer.router
    lid = lambda: megatron.router_layer_id(router)  # noqa: E731
    return [Site("router", router, lid), Site("experts", layer.experts, lid)]


def gpt_model_sites(gpt) -> list[Site]:
    """The output layer of a megatron `GPTModel` stage that has one (post_process)."""
    output = getattr(gpt, "output_layer", None)
    return [Site("output", output)] if output is not None else []


def vllm_sites(model) -> list[Site]:
    """The routers and the logits of a model vLLM built (`mcore_proxy.engines.vllm`)."""
    from mcore_proxy.engines import vllm as vllm_engine

    routers = vllm_engine.moe_routers(model).items()
    sites = [Site("vllm_router", router, lambda lid=lid: lid, "rollout") for lid, router in routers]
    logits = vllm_engine.logits_module(model)
    return sites + ([Site("output", logits, engine="rollout")] if logits is not None else [])


def find_sites(model) -> list[Site]:
    """Every site of `model` (a module, or a list of virtual-pipeline chunks): megatron-core's
    (`engines/megatron.py`) and transformers' (`faults/hf.py`)."""
    sites = [site for layer in megatron.moe_layers(model) for site in moe_layer_sites(layer)]
    sites += [Site("output", output) for output in megatron.output_layers(model)]
    for chunk in model if isinstance(model, (list, tuple)) else [model]:
        sites += hf.find_sites(chunk)
    return sites
