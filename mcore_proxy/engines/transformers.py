"""transformers models seen from outside: their decoder layers, MoE routers, fused routed experts
and output embeddings. transformers is never imported here: a model that is not a transformers
model has none of these.

A router is found in each decoder layer either at its family's path (`routers(model,
"mlp.gate")`: the family record says where, `hf/models.py`), or, where no family is at hand (a
fault injected inside a training process), as the module that looks like one: a `top_k`, a
`num_experts` and a `weight` tensor (transformers >= 5's sparse MoE routers).
"""

from __future__ import annotations

import re
import sys

_LAYER = re.compile(r"^(?:.*\.)?layers\.(\d+)$")
_NOT_TEXT = ("model.visual", "model.vision", "vision", "mtp")  # towers and MTP blocks have layers too


def is_transformers_model(model) -> bool:
    if "transformers" not in sys.modules:
        return False
    from transformers import PreTrainedModel

    return isinstance(model, PreTrainedModel)


def decoder_layers(model) -> dict:
    """Decoder layer index ("3") -> module, wherever the text model keeps them (`model.layers`,
    `model.language_model.layers`)."""
    out = {}
    for name, module in model.named_modules():
        m = _LAYER.match(name)
        if m and not name.startswith(_NOT_TEXT):
            out[m.group(1)] = module
    return out


def child(module, path: str):
    """`module.a.b` for path "a.b", or None where a part is missing."""
    for part in path.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module


def looks_like_router(module) -> bool:
    import torch

    return (
        hasattr(module, "top_k")
        and isinstance(getattr(module, "weight", None), torch.Tensor)
        and getattr(module, "num_experts", None) is not None
    )


def routers(model, router_module: str | None = None, router_weight: str = "weight") -> dict:
    """Layer id -> the MoE router of that decoder layer: the module at `router_module` holding a
    tensor at `router_weight`, or without a path the first module that `looks_like_router`."""
    import torch

    out = {}
    for lid, layer in decoder_layers(model).items():
        if router_module is not None:
            module = child(layer, router_module)
            if module is not None and isinstance(child(module, router_weight), torch.Tensor):
                out[lid] = module
        else:
            module = next((m for m in layer.modules() if looks_like_router(m)), None)
            if module is not None:
                out[lid] = module
    return out


def fused_experts(model) -> dict:
    """Layer id -> the routed-experts module of a sparse MoE block with fused tensors
    (`mlp.experts` holding `gate_up_proj`)."""
    out = {}
    for lid, layer in decoder_layers(model).items():
        module = next(
            (m for name, m in layer.named_modules() if name.split(".")[-1] == "experts" and hasattr(m, "gate_up_proj")),
            None,
        )
        if module is not None:
            out[lid] = module
    return out
