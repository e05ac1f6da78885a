"""An Estimate as a plain-text table and as JSON (the same numbers; bytes in JSON, GiB in text)."""

from __future__ import annotations

from mcore_proxy.estimate import FORMAT, GIB, Estimate, VariantPlan
from mcore_proxy.estimate.model import attention_kind


def _variant_dict(v: VariantPlan) -> dict:
    layout, mem = v.best
    return {
        "num_experts": v.arch.num_experts,
        "parameters": {
            "total": v.params.total,
            "experts": v.params.experts,
            "non_expert": v.params.non_expert,
            "buffers": v.params.buffers,
        },
        "devices": v.devices,
        "layout": layout.to_dict(),
        "memory_bytes": mem.to_dict(),
        "alternatives": [{"layout": lo.to_dict(), "memory_bytes": m.to_dict()} for lo, m in v.layouts[1:]],
    }


def to_dict(e: Estimate) -> dict:
    r, a = e.request, e.original.arch
    flops = e.expert_flops
    t = r.training
    return {
        "format": FORMAT,
        "model": {
            "name": a.name,
            "source": a.source,
            "num_layers": a.num_layers,
            "moe_layers": len(a.moe_layers),
            "mtp_layers": a.mtp_layers,
            "hidden_size": a.hidden_size,
            "num_experts": a.num_experts,
            "topk": a.topk,
            "moe_ffn_hidden_size": a.moe_ffn_hidden_size,
            "attention": attention_kind(a),
        },
        "training": {
            "micro_batch": t.micro_batch,
            "seq_len": t.seq_len,
            "precision": t.precision,
            "optimizer": t.optimizer,
            "recompute": t.recompute,
            "distributed_optimizer": True,
        },
        "device_memory_bytes": r.device_memory,
        "memory_fraction": r.memory_fraction,
        "budget_bytes": r.budget,
        "devices_per_node": r.constraints.devices_per_node,
        "original": _variant_dict(e.original),
        "proxy": _variant_dict(e.proxy),
        "ratios": {
            "devices": e.device_ratio,
            "expert_flops_per_token": flops[0] / flops[1],
            "expert_flops_per_token_per_device": (flops[1] / e.proxy.devices) / (flops[0] / e.original.devices),
        },
        "expert_flops_per_token": {"original": flops[0], "proxy": flops[1]},
    }


def _b(n: int) -> str:
    """Parameter counts: 30.53 B, 1.54 B, 123.4 M, 75,040."""
    if n >= 10**9:
        return f"{n / 1e9:.2f} B"
    if n >= 10**6:
        return f"{n / 1e6:.1f} M"
    return f"{n:,}"


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def format_text(e: Estimate) -> str:
    d = to_dict(e)
    r, a, t = e.request, e.original.arch, e.request.training
    o, p = e.original, e.proxy
    rows = [
        ("", "original", f"proxy (K={p.arch.num_experts})"),
        ("experts per MoE layer", str(a.num_experts), str(p.arch.num_experts)),
        ("parameters", _b(o.params.total), _b(p.params.total)),
        ("  routed experts", _b(o.params.experts), _b(p.params.experts)),
        ("  non-expert", _b(o.params.non_expert), _b(p.params.non_expert)),
        ("smallest layout", o.best[0].describe(), p.best[0].describe()),
        ("devices", str(o.devices), str(p.devices)),
    ]
    for key, label in (
        ("weights", "weights / device"),
        ("gradients", "gradients / device"),
        ("optimizer", "optimizer state / device"),
        ("activations", "activations / device"),
        ("total", "total / device"),
    ):
        rows.append((label, _gib(d["original"]["memory_bytes"][key]), _gib(d["proxy"]["memory_bytes"][key])))
    w0 = max(len(x[0]) for x in rows)
    w1 = max(len(x[1]) for x in rows)
    head = [
        f"model     {a.name} ({a.source}): {a.num_layers} layers ({len(a.moe_layers)} MoE"
        + (f", {a.mtp_layers} MTP" if a.mtp_layers else "")
        + f"), H={a.hidden_size}, {d['model']['attention']}, "
        f"{a.num_experts} experts x F={a.moe_ffn_hidden_size}, top-{a.topk}",
        f"training {t.precision}, {t.optimizer} with the distributed optimizer, micro-batch {t.micro_batch} x "
        f"{t.seq_len} tokens, recompute {t.recompute}, 1F1B pipeline",
        f"budget   {_gib(r.budget)} per device ({r.memory_fraction:.0%} of {_gib(r.device_memory)}), "
        f"{r.constraints.devices_per_node} devices per node",
        "",
    ]
    table = [f"{x[0]:<{w0}}  {x[1]:<{w1}}  {x[2]}" for x in rows]
    ratios = d["ratios"]
    tail = [
        "",
        f"devices: {o.devices} -> {p.devices} ({ratios['devices']:.2f}x fewer)",
        f"expert FLOPs per token: {e.expert_flops[0] / 1e9:.2f} -> {e.expert_flops[1] / 1e9:.2f} GFLOP "
        f"(x{1 / ratios['expert_flops_per_token']:.2f}: every token still runs top-{a.topk} experts), so for the "
        f"same global batch each proxy device computes x{ratios['expert_flops_per_token_per_device']:.2f} the "
        "expert FLOPs of an original device",
    ]
    for name, v in (("original", o), ("proxy", p)):
        if len(v.layouts) > 1:
            tail.append(
                f"also on {v.devices} devices ({name}): "
                + "; ".join(f"{lo.describe()} {_gib(m.total)}" for lo, m in v.layouts[1:])
            )
    return "\n".join(head + table + tail)
