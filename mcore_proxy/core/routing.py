"""The top-k rule of transformers' softmax MoE routers (Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral,
gpt-oss): softmax over all E logits in fp32, the k largest, renormalised over the chosen unless the
router says `norm_topk_prob=False`. Mixtral's and gpt-oss's routers have no such attribute and
renormalise (gpt-oss takes the softmax of the top-k logits, which is the same). One rule for the
fault injectors that re-derive a router's choice from changed logits (faults/hf.py) and for routing
replay, which gives a router's weights to experts another engine chose (hf/models.py).
"""

from __future__ import annotations


def topk_of(router) -> int:
    """How many experts a router chooses per token: its `top_k`, else what `hf.models.mark_routers`
    read from the model's config for a router that does not carry one."""
    return int(getattr(router, "_mcore_proxy_topk", None) or router.top_k)


def renormalises(router) -> bool:
    """Whether the router rescales its top-k weights to sum to 1."""
    return bool(getattr(router, "norm_topk_prob", True))


def softmax_weights(router, logits, experts):
    """The weights [T, k] the router gives the experts `experts` [T, k] for `logits` [T, E]."""
    import torch

    weights = torch.softmax(logits.float(), dim=-1).gather(-1, experts)
    if renormalises(router):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype)


def softmax_topk(router, logits):
    """(weights [T, k], expert ids [T, k]): the router's own choice for `logits` [T, E]."""
    import torch

    experts = torch.topk(logits.float(), topk_of(router), dim=-1).indices
    return softmax_weights(router, logits, experts), experts
