"""MindSpeed-LLM-named checkpoints DERIVED from a megatron-core-saved legacy checkpoint (tests only).

Derived, not saved by MindSpeed-LLM: neither MindSpeed-LLM nor mindspeed can be installed here. The
derivation applies the documented mapping (`mcore_proxy.checkpoint.mindspeed_llm`, docs/families.md 3)
to the rank files of a megatron-core multi-latent attention checkpoint (the `deepseek_v3_mla` fixture):

- per pipeline stage the TP shards of `linear_q_down_proj` / `linear_kv_down_proj` are joined and
  stored fused as `self_attention.linear_qkv.weight` on every TP rank (`linear_qkv._extra_state: None`
  replaces the two down projections' entries);
- with `mla_mm_split` each rank's whole-head shard of `linear_q_up_proj` / `linear_kv_up_proj` is
  stored as its `linear_qk_nope` + `linear_qk_rope` / `linear_kv_nope` + `linear_v` parts;
- `mtp.layers.{k}.final_layernorm.weight` -> `mtp.final_layernorms.{k}.weight` and (with MTP)
  `decoder.final_layernorm.weight` -> `final_layernorm.weight`;
- with `tp_extend_ep` every (tp, ep) rank folder is written and holds expert chunk ep * TP + tp of
  E / (EP x TP) whole experts (MindSpeed-LLM `convert_ckpt_deepseek3.py`: `torch.chunk(experts,
  ep_size * tp_size)[ep_rank * tp_size + tp_rank]`), numbered 0.. locally;
- with `indexer` every attention layer gets DeepSeek-V3.2 indexer tensors with random values of the
  documented shapes (the same on every rank: they are replicated) under MindSpeed-LLM's
  `self_attention.dsa_indexer.*` names or megatron's `self_attention.core_attention.indexer.*`;
- args say `mla_mm_split`, `moe_tp_extend_ep`, `transformer_impl = "local"` (and the indexer sizes).

The rank files are read with `torch.load(weights_only=False)`: they are this package's own fixtures.
"""

from __future__ import annotations

import re
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from mcore_proxy.checkpoint.mindspeed_llm import MLADims, split_up
from mcore_proxy.testing.dist_ckpt import iteration_dir

_FOLDER = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
_DOWN = re.compile(r"^(.*\.self_attention\.)linear_(q|kv)_down_proj\.(weight|_extra_state)$")
_UP = re.compile(r"^(.*\.self_attention\.)linear_(q|kv)_up_proj\.(weight|_extra_state)$")
_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)\.(.*)$")
_ATTN_PROJ = re.compile(r"^(.*\.self_attention\.)linear_proj\.weight$")
INDEX_HEADS, INDEX_HEAD_DIM = 2, 8
# megatron name -> MindSpeed-LLM name of each indexer tensor, and its shape from (H, q_lora)
INDEXER = {
    "core_attention.indexer.linear_wq_b.weight": "dsa_indexer.wq_b.weight",
    "core_attention.indexer.linear_wk.weight": "dsa_indexer.wk.weight",
    "core_attention.indexer.k_norm.weight": "dsa_indexer.k_norm.weight",
    "core_attention.indexer.k_norm.bias": "dsa_indexer.k_norm.bias",
    "core_attention.indexer.linear_weights_proj.weight": "dsa_indexer.weights_proj.weight",
}


def indexer_shape(name: str, hidden: int, q_lora: int) -> tuple[int, ...]:
    """Shape of a megatron indexer tensor (Megatron-LM dsa.py; MindSpeed-LLM dsa_indexer.py)."""
    return {
        "linear_wq_b.weight": (INDEX_HEADS * INDEX_HEAD_DIM, q_lora),
        "linear_wk.weight": (INDEX_HEAD_DIM, hidden),
        "k_norm.weight": (INDEX_HEAD_DIM,),
        "k_norm.bias": (INDEX_HEAD_DIM,),
        "linear_weights_proj.weight": (INDEX_HEADS, hidden),
    }[name.split("indexer.")[1]]


@dataclass(frozen=True)
class Derivation:
    """What to derive: --mla-mm-split, --moe-tp-extend-ep, indexer tensors (None, "megatron" or
    "mindspeed-llm" names), MindSpeed-LLM's MLA names at all (False: megatron names, e.g. for a
    megatron-named indexer checkpoint)."""

    mla_mm_split: bool = False
    tp_extend_ep: bool = False
    indexer: str | None = None
    mindspeed_names: bool = True


def _coords(name: str, pp: int, ep: int) -> tuple[int, int, int]:
    m = _FOLDER.match(name)
    rest = [int(g) for g in m.groups()[1:] if g is not None]
    return int(m.group(1)), rest.pop(0) if pp > 1 else 0, rest.pop(0) if ep > 1 else 0


def _folder(tp: int, pp: int, ep: int, pps: int, eps: int) -> str:
    return f"mp_rank_{tp:02d}" + (f"_{pp:03d}" if pps > 1 else "") + (f"_{ep:03d}" if eps > 1 else "")


def derive(src: Path, dst: Path, how: Derivation, seed: int = 0) -> Path:
    """Write the derived checkpoint at `dst` (a checkpoint root) from the legacy root `src`."""
    src_it = iteration_dir(src)
    files = {
        p.parent.name: torch.load(p, map_location="cpu", weights_only=False)
        for p in sorted(src_it.glob("mp_rank_*/model_optim_rng.pt"))
    }
    args = next(iter(files.values()))["args"]
    tp, pps, eps = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.expert_model_parallel_size
    dims = MLADims.from_args(args)
    by_coords = {_coords(n, pps, eps): s for n, s in files.items()}
    chunks = [k for k in next(iter(files.values())) if re.fullmatch(r"model\d*", k)]
    # per (pp, chunk key, local name): TP shards of the down projections; global experts by id
    down, experts = {}, {}
    per_src = args.num_experts // eps
    for (t, p, e), state in by_coords.items():
        for ck in chunks:
            for name, value in state[ck].items():
                if _DOWN.match(name) and name.endswith(".weight"):
                    down.setdefault((p, ck, name), {})[t] = value
                elif m := _EXPERT.match(name):
                    experts[(p, ck, m.group(1), e * per_src + int(m.group(2)), m.group(3))] = value
    folders = (
        {(t, p, e) for t in range(tp) for p in range(pps) for e in range(eps)} if how.tp_extend_ep else set(by_coords)
    )
    per = args.num_experts // (eps * tp) if how.tp_extend_ep else per_src
    out_it = Path(dst) / src_it.relative_to(src)
    out_it.mkdir(parents=True)
    shutil.copy(Path(src) / "latest_checkpointed_iteration.txt", Path(dst) / "latest_checkpointed_iteration.txt")
    for t, p, e in sorted(folders):
        base = next(s for (t2, p2, _), s in sorted(by_coords.items()) if (t2, p2) == (t, p))
        state = {k: v for k, v in base.items() if k not in chunks}
        chunk_id = e * tp + t if how.tp_extend_ep else e
        for ck in chunks:
            state[ck] = _chunk(base[ck], p, ck, t, chunk_id, per, down, experts, dims, how, args, seed)
        state["args"] = _args(args, how)
        folder = out_it / _folder(t, p, e, pps, eps)
        folder.mkdir()
        torch.save(state, folder / "model_optim_rng.pt")
    return Path(dst)


def _chunk(model: dict, p, ck, t, chunk_id, per, down, experts, dims, how, args, seed) -> dict:
    out: dict = {}
    for name, value in model.items():
        if _EXPERT.match(name):
            continue  # re-placed below
        if how.mindspeed_names and (m := _DOWN.match(name)):
            if m.group(2) == "q":
                fused = m.group(1) + "linear_qkv."
                if m.group(3) == "weight":
                    q = down[(p, ck, name)]
                    kv = down[(p, ck, m.group(1) + "linear_kv_down_proj.weight")]
                    out[fused + "weight"] = torch.cat(
                        [torch.cat([q[r] for r in sorted(q)]), torch.cat([kv[r] for r in sorted(kv)])]
                    )
                else:
                    out[fused + "_extra_state"] = value
            continue
        if how.mindspeed_names and how.mla_mm_split and (m := _UP.match(name)):
            parts = ("qk_nope", "qk_rope") if m.group(2) == "q" else ("kv_nope", "v")
            values = split_up(value, m.group(2), dims) if m.group(3) == "weight" else (value, value)
            for part, v in zip(parts, values):
                out[f"{m.group(1)}linear_{part}.{m.group(3)}"] = v.clone() if torch.is_tensor(v) else v
            continue
        out[_renamed(name, args) if how.mindspeed_names else name] = value
        if how.indexer and (m := _ATTN_PROJ.match(name)):
            for mname, msname in INDEXER.items():
                shape = indexer_shape(mname, args.hidden_size, dims.q_lora)
                g = torch.Generator().manual_seed(seed + zlib.crc32(f"{p}/{ck}/{name}/{mname}".encode()))
                key = m.group(1) + (msname if how.indexer == "mindspeed-llm" else mname)
                out[key] = torch.randn(shape, generator=g)
    for (p2, ck2, prefix, g, rest), value in experts.items():
        if (p2, ck2) == (p, ck) and g // per == chunk_id:
            out[f"{prefix}{g % per}.{rest}"] = value
    return out


def _renamed(name: str, args) -> str:
    if m := re.match(r"^mtp\.layers\.(\d+)\.final_layernorm\.weight$", name):
        return f"mtp.final_layernorms.{m.group(1)}.weight"
    if name == "decoder.final_layernorm.weight" and getattr(args, "mtp_num_layers", None):
        return "final_layernorm.weight"
    return name


def _args(args, how: Derivation):
    import copy

    out = copy.copy(args)
    out.transformer_impl = "local"
    if how.mindspeed_names:
        out.mla_mm_split = how.mla_mm_split
    out.moe_tp_extend_ep = how.tp_extend_ep
    if how.tp_extend_ep:
        out.expert_tensor_parallel_size = 1
    if how.indexer:
        out.enable_dsa_indexer, out.index_n_heads, out.index_head_dim = True, INDEX_HEADS, INDEX_HEAD_DIM
    return out
