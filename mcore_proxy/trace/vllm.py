"""Routing statistics of a model served by vLLM: the routers `engines.vllm` finds feed the
same `Tracer` the Megatron and transformers traces use (DESIGN.md 4.1).

Each router call gives the router input (hidden [T, H], the MoE block's input after its norm) and
vLLM's own choice (`topk_weights [T, k]`, `topk_ids [T, k]`, the weights as vLLM's fused experts
apply them). vLLM packs the prompts of a step into one token batch without padding, so every token
counts once. With tensor parallelism every rank routes the same tokens: only rank 0 records.
"""

from __future__ import annotations

from mcore_proxy.engines import vllm as vllm_engine
from mcore_proxy.trace.tracer import RouterInfo, Tracer


def source_info() -> dict:
    import torch
    import vllm

    return {"framework": "vllm", "vllm": vllm.__version__, "torch": torch.__version__}


def attach(tracer: Tracer, model) -> int:
    """Observe every router of `model` into `tracer`; returns the number of routers."""
    counts = vllm_engine.tensor_parallel_rank() == 0
    routers = vllm_engine.moe_routers(model)
    tracer.meta.setdefault("source", source_info())
    for layer, router in routers.items():
        experts, topk = vllm_engine.router_shape(router)
        info = RouterInfo(layer, experts, topk, counts=counts)

        def observe(hidden, logits, weights, ids, info=info):
            tracer.record(info, hidden, weights, ids)

        tracer.hooks.add(vllm_engine.add_observer(router, observe))
    return len(routers)
