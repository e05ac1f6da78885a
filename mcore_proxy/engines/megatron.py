"""megatron-core models seen from outside: their MoE layers, routers and output layers, and the
layer id a router stands for. megatron-core is imported only when a model is asked about, and a
process without it has no megatron-core modules (`classes()` is None).

Layer ids come from the router's own `layer_number` (1-based, global: megatron adds the pipeline
and virtual-pipeline offsets when it builds the layer), so every stage names its layers the way
the canonical checkpoint does: L = layer_number - 1, and MTP layers, which megatron numbers after
the decoder (num_layers + k + 1), become `mtp.{k}`.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple


class Classes(NamedTuple):
    moe_layer: type
    router: type
    gpt_model: type


def classes() -> Classes | None:
    """megatron-core's MoELayer, TopKRouter and GPTModel, or None where it is not installed."""
    try:
        from megatron.core.models.gpt import GPTModel
        from megatron.core.transformer.moe.moe_layer import MoELayer
        from megatron.core.transformer.moe.router import TopKRouter
    except ImportError:
        return None
    return Classes(MoELayer, TopKRouter, GPTModel)


def modules(model) -> Iterable:
    """Every module of `model` (a module, or the list of its virtual-pipeline chunks)."""
    for chunk in model if isinstance(model, (list, tuple)) else [model]:
        yield from chunk.modules()


def _of_class(model, pick) -> list:
    found = classes()
    return [] if found is None else [m for m in modules(model) if isinstance(m, pick(found))]


def moe_layers(model) -> list:
    """Every megatron-core `MoELayer` of `model` (its `.router` and `.experts`)."""
    return _of_class(model, lambda c: c.moe_layer)


def routers(model) -> list:
    """Every megatron-core `TopKRouter` of `model`."""
    return _of_class(model, lambda c: c.router)


def output_layers(model) -> list:
    """The output layer of every `GPTModel` stage of `model` that has one (post_process)."""
    outputs = (getattr(gpt, "output_layer", None) for gpt in _of_class(model, lambda c: c.gpt_model))
    return [o for o in outputs if o is not None]


def layer_id(layer_number: int | None, num_layers: int) -> str:
    """megatron's 1-based global `layer_number` -> stats layer id (`"12"` or `"mtp.0"`)."""
    if layer_number is None:
        raise RuntimeError(
            "MoE router has no layer_number: megatron sets it when the MoE layer is "
            "built inside a TransformerLayer; trace whole models, not bare routers"
        )
    index = int(layer_number) - 1
    return str(index) if index < num_layers else f"mtp.{index - num_layers}"


def router_layer_id(router) -> str | None:
    """The layer id of a router, None before megatron has numbered its layer."""
    if getattr(router, "layer_number", None) is None:
        return None
    return layer_id(router.layer_number, router.config.num_layers)
