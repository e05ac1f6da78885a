"""megatron-core glue: router -> RouterInfo, forward hooks, and `install(model, out_dir)`.
Routers, MoE layers and layer ids come from `engines/megatron.py`; the hooks are the tracer's
(`Tracer.hooks`, an `engines.hooks.Hooks`).
"""

from __future__ import annotations

import logging
import os

import torch

from mcore_proxy.engines import megatron
from mcore_proxy.engines.megatron import layer_id
from mcore_proxy.trace import activate
from mcore_proxy.trace.tracer import RouterInfo, Tracer

log = logging.getLogger(__name__)

_INFO_ATTR = "_mcore_proxy_trace_info"


def _tp_size_rank(module) -> tuple[int, int]:
    group = getattr(module, "tp_group", None)
    if group is not None:
        return group.size(), group.rank()
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return 1, 0
    from megatron.core import parallel_state

    return (parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank())


def router_info(router) -> RouterInfo:
    """Resolve (once, cached on the router) its layer id and whether this rank records it."""
    info = getattr(router, _INFO_ATTR, None)
    if info is None:
        config = router.config
        tp_size, tp_rank = _tp_size_rank(router)
        counts = tp_size == 1 or bool(config.sequence_parallel) or tp_rank == 0
        info = RouterInfo(
            layer_id(router.layer_number, config.num_layers), int(config.num_moe_experts), int(router.topk), counts
        )
        setattr(router, _INFO_ATTR, info)
    return info


def saliency_supported(moe_layer) -> bool:
    """Saliency reads each (token, expert) output row once across the world only when experts are
    not tensor-parallel (ETP = 1: rows are whole, not partial sums) and attention TP ranks do not
    feed duplicate tokens (TP = 1 or sequence parallelism); probabilities must be applied inside
    the experts (megatron-core >= 0.11 without `moe_apply_probs_on_input`)."""
    config = moe_layer.config
    tp_size, _ = _tp_size_rank(moe_layer.router)
    etp = getattr(config, "expert_tensor_parallel_size", None) or tp_size
    return (
        etp == 1
        and (tp_size == 1 or bool(config.sequence_parallel))
        and not getattr(config, "moe_apply_probs_on_input", False)
    )


def model_layers(config) -> list[str] | None:
    """Every MoE layer id of the whole model, from its config (None if it cannot be told)."""
    from mcore_proxy.mcore.spec import moe_layer_pattern

    try:
        num_layers = int(config.num_layers)
        pattern = moe_layer_pattern(num_layers, getattr(config, "moe_layer_freq", 1) or 1)
        first_dense = int(getattr(config, "first_k_dense_replace", 0) or 0)  # MindSpeed-LLM
        noop = {int(i) for i in (getattr(config, "noop_layers", None) or ())}  # MindSpeed
        ids = [str(i) for i, moe in enumerate(pattern) if moe and i >= first_dense and i not in noop]
        if getattr(config, "mtp_num_layers", None) and pattern and pattern[-1]:
            ids += [f"mtp.{k}" for k in range(int(config.mtp_num_layers))]
        return ids
    except (AttributeError, TypeError, ValueError, SyntaxError) as err:
        log.warning(
            "trace: cannot list the model's MoE layers from its config (%s); the merge "
            "will not check that every layer has statistics",
            err,
        )
        return None


def run_meta(config) -> dict:
    """Sidecar facts about the run this rank belongs to."""
    meta = {
        "source": source_info(),
        "model_layers": model_layers(config),
        "sequence_parallel": bool(getattr(config, "sequence_parallel", False)),
    }
    for key in (
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "expert_model_parallel_size",
        "expert_tensor_parallel_size",
        "context_parallel_size",
    ):
        value = getattr(config, key, None)
        if value is not None:
            meta[key] = int(value)
    return meta


def source_info() -> dict:
    from importlib import metadata

    info = {"framework": "megatron-core", "torch": torch.__version__}
    try:
        from megatron.core import package_info

        info["megatron-core"] = package_info.__version__
    except ImportError:
        pass
    for dist in ("mindspeed", "mindspeed-llm"):
        try:
            info[dist] = metadata.version(dist)
            info["framework"] = "mindspeed"
        except metadata.PackageNotFoundError:
            pass
    return info


def record_router_call(tracer: Tracer, router, args: tuple, kwargs: dict, output) -> None:
    """Feed one `TopKRouter.forward(input, padding_mask=None) -> (probs, routing_map)` call."""
    info = router_info(router)
    if "source" not in tracer.meta:
        tracer.meta.update(run_meta(router.config))
    hidden = args[0] if args else kwargs["input"]
    padding_mask = args[1] if len(args) > 1 else kwargs.get("padding_mask")
    probs, routing_map = output[0], output[1]
    tracer.record(info, hidden, probs, routing_map, padding_mask)


def record_experts_call(tracer: Tracer, moe_layer, args: tuple, output) -> None:
    """Feed one `experts(permuted_hidden, tokens_per_expert, permuted_probs) -> (out, bias)`."""
    if len(args) < 3:  # an experts module that applies no probabilities itself
        return
    info = router_info(moe_layer.router)
    if not info.counts:
        return
    experts = getattr(moe_layer, "_mcore_proxy_local_experts", None)
    if experts is None:
        experts = torch.tensor(moe_layer.local_expert_indices, dtype=torch.long)
        moe_layer._mcore_proxy_local_experts = experts
    out = output[0] if isinstance(output, tuple) else output
    tracer.record_saliency(info.layer_id, experts, out, args[1])


def install(
    model, out_dir: str | os.PathLike, *, flush_every: int = 0, saliency: bool = False, rank: int | None = None
) -> Tracer:
    """Attach routing-statistics hooks to every `TopKRouter` of `model` (a module or the list
    of virtual-pipeline chunks). Returns the Tracer; use it as a context manager, or call
    `flush()` / `close()` yourself. `saliency=True` also hooks the experts modules where
    `saliency_supported` holds (elsewhere the field stays absent, with a warning)."""
    if activate.env_tracing_active():
        raise RuntimeError(
            f"routing statistics are already collected through {activate.ENV_DIR}; unset it or do not call install()"
        )
    tracer = Tracer(out_dir, flush_every=flush_every, rank=rank)
    attach_hooks(tracer, model, saliency=saliency)
    return tracer


def attach_hooks(tracer: Tracer, model, *, saliency: bool = False) -> int:
    """Register the forward hooks of `install` on `model`, owned by `tracer` (removed by
    `tracer.detach()`); returns the number of routers hooked."""
    routers, no_saliency = megatron.routers(model), []
    for router in routers:
        tracer.hooks.forward(
            router, lambda mod, args, kwargs, out: record_router_call(tracer, mod, args, kwargs, out), with_kwargs=True
        )
    for layer in megatron.moe_layers(model) if saliency else []:
        if saliency_supported(layer):
            tracer.hooks.forward(
                layer.experts, lambda mod, args, out, layer=layer: record_experts_call(tracer, layer, args, out)
            )
        else:
            no_saliency.append(layer.layer_number)
    if no_saliency:
        log.warning(
            "trace: saliency_sum is not recorded for MoE layers with layer_number %s: "
            "experts are tensor-parallel or TP runs without sequence parallelism",
            no_saliency,
        )
    if not routers:
        raise ValueError("install(): the model has no megatron-core TopKRouter; is it a MoE model?")
    return len(routers)
