"""transformers sites: sparse MoE blocks whose router module returns `(logits [T, E], top-k scores
[T, k], top-k indices [T, k])` with softmax routing (transformers >= 5: Qwen3-MoE, Qwen2-MoE,
Mixtral, OLMoE, ...), and the output embeddings (`lm_head`). transformers is never imported here:
a model that is not a transformers model has no such sites.

Routers are changed by a forward hook on the router module: logit faults re-derive the top-k
from the corrupted logits with the router's own rule (`core.routing.softmax_topk`); top-k
faults alter the indices. Expert noise acts on the block's combined routed-experts output.
"""

from __future__ import annotations

from mcore_proxy.engines import transformers as hf_models
from mcore_proxy.faults.site import Site


def find_sites(model) -> list[Site]:
    """The routers, fused routed experts and output embeddings of a transformers model (none of
    anything else), found by `engines/transformers.py` without a family record."""
    if not hf_models.is_transformers_model(model):
        return []
    sites = [Site("gate", module, lambda lid=lid: lid) for lid, module in hf_models.routers(model).items()]
    sites += [Site("hf_expert", module, lambda lid=lid: lid) for lid, module in hf_models.fused_experts(model).items()]
    output = model.get_output_embeddings()
    return sites + ([Site("output", output)] if output is not None else [])
