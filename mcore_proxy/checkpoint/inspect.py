"""What a checkpoint holds: format, layout, layers, routing settings, bytes. Reads no tensor data."""

from __future__ import annotations

import os
import re
from collections import Counter

from mcore_proxy.checkpoint.hf.quant import FP8_BLOCK, INT4_PACKED, MXFP4, V4_SCALE, find_quantized
from mcore_proxy.checkpoint.layer_spec import attention_kind
from mcore_proxy.checkpoint.names import split_expert_name
from mcore_proxy.checkpoint.view import ModelView, tensor_nbytes
from mcore_proxy.core.units import format_bytes


_ATTENTION = {"mla": "multi-latent attention", "gqa": "grouped-query attention"}
QUANT_NAMES = {
    FP8_BLOCK: "FP8 with block scales",
    V4_SCALE: "FP8/FP4 with E8M0 scales (DeepSeek-V4)",
    MXFP4: "MXFP4 blocks and scales",
    INT4_PACKED: "compressed-tensors int4",
}


def _compact(ids: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    out, start = [], None
    for i, x in enumerate(ids):
        if start is None:
            start = x
        if i + 1 == len(ids) or ids[i + 1] != x + 1:
            out.append(f"{start}" if start == x else f"{start}-{x}")
            start = None
    return ",".join(out) or "-"


def describe(view: ModelView) -> dict:
    """A JSON-ready description of a checkpoint (pure: shapes and args only)."""
    spec = view.spec
    names = view.names()
    moe = sorted(
        {int(m.group(1)) for n in names if (m := re.match(r"^decoder\.layers\.(\d+)\.mlp\.router\.weight$", n))}
    )
    layers = sorted({int(m.group(1)) for n in names if (m := re.match(r"^decoder\.layers\.(\d+)\.", n))})
    mtp = sorted({int(m.group(1)) for n in names if (m := re.match(r"^mtp\.layers\.(\d+)\.", n))})
    dtype_bytes: Counter = Counter()
    expert_bytes = 0
    for n in names:
        b = tensor_nbytes(view, n)
        if b:
            dtype_bytes[view.dtype_name(n)] += b
            expert_bytes += b if split_expert_name(n) is not None else 0
    info = view.info
    layout = info.layout
    descriptor = getattr(info.format_info, "descriptor", None)  # an HF folder read by its family's descriptor
    files, file_bytes = files_and_bytes(info.path) if info.path else (0, 0)
    return {
        "path": str(info.path or ""),
        "checkpoint_format": info.format,
        "family": view.spec.extra.get("hf_family"),
        "iteration": view.iteration,
        "parallel": None
        if layout is None
        else {
            "tp": layout.tp,
            "pp": layout.pp,
            "ep": layout.ep,
            "etp": layout.etp,
            "vpp": layout.vpp,
            "stage_layers": list(layout.stage_layers) if layout.stage_layers else None,
            "pipeline_layout": layout.pipeline_layout,
        },
        "moe_tp_extend_ep": layout is not None and layout.tp_extend_ep,
        "attention": attention_kind(view.args) if view.args is not None else None,
        "layer_spec": view.layer_spec,
        # names of multi-latent attention as saved: megatron-core's or MindSpeed-LLM's (with its options)
        "naming": info.naming.describe() if info.naming is not None else "megatron-core",
        "indexer": any(".core_attention.indexer." in n for n in names),
        "expert_layout": None if layout is None else layout.expert_layout,
        "num_layers": spec.num_layers,
        "dense_layers": [L for L in layers if L not in moe],
        "noop_layers": list(spec.noop_layers),
        "moe_layers": moe,
        "mtp_layers": mtp,
        "hidden_size": spec.hidden_size,
        "num_experts": spec.num_experts,
        "moe_ffn_hidden_size": spec.moe_ffn_hidden_size,
        "shared_expert_size": spec.shared_expert_size,
        "topk": spec.topk,
        "score_function": spec.score_function,
        "num_groups": spec.num_groups,
        "group_topk": spec.group_topk,
        "expert_bias": any(n.endswith("mlp.router.expert_bias") for n in names),
        "dtype": dtype_bytes.most_common(1)[0][0] if dtype_bytes else None,
        "bytes_by_dtype": dict(dtype_bytes),
        "total_bytes": sum(dtype_bytes.values()),
        "expert_bytes": expert_bytes,
        "files": files,
        "file_bytes": file_bytes,
        "tensors": len(names),
        "hash_layers": spec.hash_layer_ids,
        "quantization": sorted({q.scheme for q in find_quantized(names)}),
        "support": None if descriptor is None else family_support(descriptor, info.format_info.config),
    }


def files_and_bytes(path) -> tuple[int, int]:
    """(files, bytes) under `path`, a file or a folder, with one stat per file: scandir tells files
    from folders without one, where `rglob` + `is_file` + `stat` cost 0.1 s on 2,048 rank folders.
    Symlinked files count, symlinked folders are not entered (as `rglob`)."""
    if not os.path.isdir(path):
        return (1, os.stat(path).st_size) if os.path.isfile(path) else (0, 0)
    files = size = 0
    stack = [os.fspath(path)]
    while stack:
        with os.scandir(stack.pop()) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                elif entry.is_file():
                    files, size = files + 1, size + entry.stat().st_size
    return files, size


def family_support(family, config: dict) -> dict:
    """What mcore-proxy does with an HF family's folder (docs/families.md says what proves each);
    the Megatron mapping may cover only some of the family's architectures."""
    archs = config.get("architectures") or [None]
    mapped = family.megatron is not None and archs[0] in family.megatron.architectures
    return {
        "origin": family.origin,
        "hf_to_hf": "collect, select, convert, verify, fidelity",
        "megatron": f"HF <-> Megatron as {family.name}" if mapped else "no Megatron mapping (HF -> HF only)",
        "notes": family.notes or None,
    }


def format_description(d: dict) -> str:
    """The plain-text report of `describe`."""
    p = d["parallel"] or {}
    rows = [
        ("checkpoint", d["path"]),
        (
            "format",
            f"{d['checkpoint_format']}, iteration {d['iteration']}" + (f", {d['family']}" if d.get("family") else ""),
        ),
        (
            "parallel",
            " ".join(f"{k.upper()}={p[k]}" for k in ("tp", "pp", "ep", "etp", "vpp") if k in p)
            + (f" layout {p['pipeline_layout']!r}" if p.get("pipeline_layout") else "")
            + (f" stages={p['stage_layers']}" if p.get("stage_layers") and len(set(p["stage_layers"])) > 1 else "")
            + (" tp-extend-ep (experts over EP x TP)" if d.get("moe_tp_extend_ep") else "")
            if p
            else "none: safetensors shards by file, not by parallel rank",
        ),
        (
            "layers",
            f"{d['num_layers']} decoder: dense {_compact(d['dense_layers'])}, MoE {_compact(d['moe_layers'])}"
            + (f", noop {_compact(d['noop_layers'])} (no tensors)" if d.get("noop_layers") else "")
            + (f"; MTP {_compact(d['mtp_layers'])}" if d["mtp_layers"] else ""),
        ),
        (
            "experts",
            f"{d['num_experts']} routed x F={d['moe_ffn_hidden_size']}"
            + (f", layout {d['expert_layout']}" if d["expert_layout"] else "")
            + (f", shared F={d['shared_expert_size']}" if d["shared_expert_size"] else ""),
        ),
        (
            "router",
            f"top-{d['topk']} {d['score_function']}"
            + (f", groups {d['num_groups']} top-{d['group_topk']}" if d["num_groups"] else "")
            + (", expert bias" if d["expert_bias"] else "")
            + (f"; hash-routed layers {', '.join(d['hash_layers'])} (token-id table)" if d.get("hash_layers") else ""),
        ),
        (
            "hidden",
            str(d["hidden_size"])
            + (f", {_ATTENTION[d['attention']]}" if d.get("attention") else "")
            + (f", {d['layer_spec']} layer spec" if d.get("attention") else "")
            + (f", {d['naming']} names" if d.get("attention") else "")
            + (", DSA indexer" if d.get("indexer") else ""),
        ),
        (
            "dtype",
            ", ".join(f"{k} {format_bytes(v)}" for k, v in d["bytes_by_dtype"].items())
            + (
                f"; quantized: {', '.join(QUANT_NAMES[q] for q in d['quantization'])}, pruned as stored "
                "(--dequantize to expand)"
                if d.get("quantization")
                else ""
            ),
        ),
        (
            "bytes",
            f"{format_bytes(d['total_bytes'])} model ({d['tensors']} tensors), "
            f"{format_bytes(d['expert_bytes'])} routed experts; {format_bytes(d['file_bytes'])} in {d['files']} files",
        ),
    ]
    if d.get("support"):
        support = d["support"]
        rows.append(
            (
                "support",
                f"{support['origin']} family; HF -> HF: {support['hf_to_hf']}; {support['megatron']}"
                + (f"; {support['notes']}" if support["notes"] else ""),
            )
        )
    if d.get("twin_proof"):
        rows.append(("twin proof", d["twin_proof"]["summary"]))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
