"""transformers sites: sparse MoE blocks whose router module returns `(logits [T, E], top-k scores
[T, k], top-k indices [T, k])` with softmax routing (transformers >= 5: Qwen3-MoE, Qwen2-MoE,
Mixtral, OLMoE, ...), and the output embeddings (`lm_head`). transformers is never imported here:
a model that is not a transformers model has no such sites.

Routers are changed by a forward hook on the router module: logit faults re-derive the top-k
from the corrupted logits with the router's own rule (`core.routing.softmax_topk`); top-k
faults alter the indices. Expert noise acts on the block's combined routed-experts output.
"""

from __future__ import annotations

import re
import sys

import torch

from mcore_proxy.faults.site import Site

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def is_hf_router(module) -> bool:
    return (
        hasattr(module, "top_k")
        and isinstance(getattr(module, "weight", None), torch.Tensor)
        and getattr(module, "num_experts", None) is not None
    )


def find_sites(model) -> list[Site]:
    if "transformers" not in sys.modules:
        return []
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        return []
    sites = []
    for name, module in model.named_modules():
        match = _LAYER.search(name + ".")
        if is_hf_router(module) and match:
            lid = match.group(1)
            sites.append(Site("gate", module, lambda lid=lid: lid))
        elif name.endswith(".experts") and match and hasattr(module, "gate_up_proj"):
            lid = match.group(1)
            sites.append(Site("hf_expert", module, lambda lid=lid: lid))
    output = model.get_output_embeddings()
    if output is not None:
        sites.append(Site("output", output))
    return sites
