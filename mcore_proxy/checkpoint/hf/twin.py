"""The tiny twin of a Hugging Face MoE config: the same architecture and structure (which layers
are MoE, shared experts, routing groups, attention kinds, per-layer patterns), with every size
small (hidden 64, a few layers, a 128-token vocabulary, at most 12 experts). Pure dict work on
config values; the configs come from transformers' own config classes, so defaults are filled in.

What a twin keeps, and why: discovery (`discovery.py`) and the proof (`convert/twin.py`) read the
model's structure, which these settings decide, never its size. The rules are generic over key
names (`*_size`, `*_dim`, `*heads`, per-layer lists); no family is named here.
"""

from __future__ import annotations

import copy
import re

HIDDEN = 64
VOCAB = 128
MAX_EXPERTS = 12  # a twin's expert count: enough for a plan to keep half per layer and per group
MAX_LAYERS = 16

# a key that counts experts: holds "expert" and none of these (top-k, shared, sizes, periods, ...)
_NOT_COUNT = re.compile(
    r"per_tok|per_token|shared|group|period|offset|ffn|hidden|size|dim|zero|top|_k$|freq|interval|step|capacity"
    r"|layer|bias|scale|rank|coef|factor|noise|jitter|loss|ratio|dropout|start|end|prob|type"
)
TOPK = re.compile(
    r"(experts_per_tok|experts_per_token|^moe_k$|^top_?k$|^moe_topk$|^num_selected_experts$|^router_topk$"
    r"|^moe_top_k$|^top_k_experts$|^expert_top_k$|^num_activated_experts$)"
)
GROUPS = re.compile(r"^(n_group|num_expert_group|n_expert_groups|moe_n_group|num_groups_experts|n_groups)$")
TOPK_GROUP = re.compile(r"^(topk_group|topk_groups|moe_topk_group|n_topk_group)$")
SCORE_FUNCTION = ("scoring_func", "score_function", "router_score_function", "moe_router_score_function")
_DENSE_FIRST = re.compile(
    r"^(first_k_dense_replace|first_k_dense|num_dense_layers|n_dense_layers|moe_layer_start_index|dense_layers"
    r"|first_dense_layers|num_first_dense_layers)$"
)
_SIZES = {
    "hidden_size": HIDDEN,
    "d_model": HIDDEN,
    "n_embd": HIDDEN,
    "num_attention_heads": 4,
    "n_head": 4,
    "n_heads": 4,
    "head_dim": 16,
    "attention_head_dim": 16,
    "intermediate_size": 64,
    "vocab_size": VOCAB,
    "q_lora_rank": 16,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "o_lora_rank": 16,
    "index_n_heads": 2,
    "index_head_dim": 16,
    "index_topk": 4,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "mamba_n_heads": 8,
    "mamba_d_head": 16,
    "mamba_expand": 2,
    "mamba_d_state": 16,
    "ssm_state_size": 16,
    "mamba_n_groups": 1,
    "n_groups": 1,
    "mamba_headdim": 16,
    "mamba_head_dim": 16,
    "mamba_num_heads": 8,
    "time_step_rank": 8,
    "mamba_dt_rank": 8,
    "index_num_heads": 2,
    "indexer_n_heads": 2,
    "indexer_head_dim": 16,
    "sliding_window": 8,
    "attention_chunk_size": 8,
    "sliding_window_size": 8,
}
_DIMLIKE = re.compile(r"(size|dim|rank|width|channels)$|_dim_|heads$")
_KEEP = re.compile(
    r"vocab|position|window|chunk|layer|expert|token|group|kernel|seed|interval|step|freq|rope|theta|topk|top_k"
    r"|bucket|max_|length|ctx|conv|batch|sinkhorn|iters|compress"
)
_LAYER_COUNTS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers")
_PERIODS = ("decoder_sparse_step", "interleave_moe_layer_step", "moe_layer_freq", "moe_every_n_layers")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def expert_count_keys(text: dict) -> dict[str, int | list]:
    """Keys of a text config that count routed experts: an int > 1, or a per-layer list of them
    (one level of nested dicts too, as `ffn_config.moe_num_experts`)."""
    out: dict[str, int | list] = {}
    for key, value in text.items():
        if "expert" not in key or _NOT_COUNT.search(key) or TOPK.search(key):
            continue
        if _is_int(value) and value > 1:
            out[key] = value
        elif isinstance(value, list) and value and all(_is_int(x) for x in value) and max(value) > 1:
            out[key] = value
    for key, value in text.items():
        if isinstance(value, dict) and not key.startswith(("id2label", "label2id", "rope")) and not _numbered(value):
            out.update({f"{key}.{k}": v for k, v in expert_count_keys(value).items()})
    return out


def experts_of(counts: dict) -> int:
    """E: the largest count."""
    return max(v if _is_int(v) else max(v) for v in counts.values())


def _numbered(d: dict) -> bool:
    return bool(d) and all(str(k).isdigit() for k in d)


def layer_count(text: dict) -> int:
    return next((text[k] for k in _LAYER_COUNTS if _is_int(text.get(k))), 1)


def layers_needed(text: dict, layers: int) -> int:
    """A prefix of the layers that shows every kind a per-layer setting holds (at least 4, at most
    MAX_LAYERS), and two MoE periods."""
    n = min(layers, 4)
    for value in text.values():
        if isinstance(value, list) and len(value) == layers and layers > 4:
            kinds = [str(x) for x in value]
            n = max(n, next((m for m in range(n, min(layers, MAX_LAYERS) + 1) if set(kinds[:m]) == set(kinds)), n))
    for key in _PERIODS:
        if _is_int(text.get(key)) and text[key] > 1:
            n = max(n, min(layers, 2 * text[key]))
    return n


def _shrink_sizes(d: dict, layers: int) -> None:
    heads, kv_heads = d.get("num_attention_heads"), d.get("num_key_value_heads")
    for key, value in list(d.items()):
        if key in _SIZES and _is_int(value):
            d[key] = _SIZES[key]
        elif key in _SIZES and isinstance(value, list) and len(value) == layers and all(_is_int(x) for x in value):
            d[key] = [_SIZES[key]] * len(value)
        elif "vocab" in key and _is_int(value) and value > VOCAB:
            d[key] = VOCAB
    if "head_dim" in d and d["head_dim"] is None and "kv_lora_rank" not in d:
        d["head_dim"] = _SIZES["head_dim"]  # a model that reads config.head_dim as it is
    if _is_int(kv_heads):
        d["num_key_value_heads"] = 4 if kv_heads == heads else (1 if kv_heads == 1 else 2)
    for key, value in list(d.items()):
        if key in _SIZES or not _is_int(value) or "expert" in key:
            continue
        if ("intermediate" in key or "ffn" in key) and value > 64:
            d[key] = 32
        elif _DIMLIKE.search(key) and not _KEEP.search(key) and value > 64:
            d[key] = 16
        elif key.endswith("heads") and not _KEEP.search(key) and value > 4:
            d[key] = 4
    if _is_int(d.get("qk_nope_head_dim")) and "qk_head_dim" in d:
        d["qk_head_dim"] = d["qk_nope_head_dim"] + d["qk_rope_head_dim"]
    if _is_int(d.get("qk_rope_head_dim")) and _is_int(d.get("head_dim")) and _is_int(d.get("kv_lora_rank")):
        d["head_dim"] = d["qk_rope_head_dim"]  # MLA: rotary on the rope part
    n = 0
    for key, value in list(d.items()):  # token ids inside the small vocabulary
        if key.endswith(("token_id", "token_index")) and _is_int(value) and value >= VOCAB:
            d[key] = 1 if key.startswith("pad") else VOCAB - 8 + n % 8
            n += 1
        elif key.endswith("token_ids") and isinstance(value, list):
            d[key] = [x if (not _is_int(x) or x < VOCAB) else VOCAB - 8 + i % 8 for i, x in enumerate(value)]


def _shrink_layers(d: dict, layers: int, keep: int) -> None:
    for key, value in list(d.items()):
        if key in _LAYER_COUNTS and _is_int(value):
            d[key] = keep
        elif _DENSE_FIRST.search(key) and _is_int(value) and 1 < value < layers:
            d[key] = 1
        elif "layer" in key and _is_int(value) and layers > 1 and value == layers - 1 and "num" not in key:
            d[key] = keep - 1
        elif isinstance(value, list) and len(value) == layers:  # one entry per layer
            d[key] = value[:keep]
            base = key.replace("_per_layer", "")
            if base in _SIZES and all(_is_int(x) for x in value):
                d[key] = [_SIZES[base]] * keep  # a per-layer size: small, like its scalar form
            elif all(_is_int(x) for x in value) and "layer" in key and all(x <= i for i, x in enumerate(value)):
                d[key] = [x if x < keep else i for i, x in enumerate(d[key])]  # references to earlier layers
        elif isinstance(value, dict) and _numbered(value):
            d[key] = {k: v for k, v in value.items() if int(k) < keep}
        elif isinstance(value, list) and value and all(_is_int(x) for x in value) and "layer" in key:
            d[key] = [x for x in value if x < keep]  # layer indices
        elif isinstance(value, dict) and "layer" in key:  # e.g. {"full_attn_layers": [...]} (1-based)
            d[key] = {
                k: ([x for x in v if x <= keep] if isinstance(v, list) and all(_is_int(x) for x in v) else v)
                for k, v in value.items()
            }


def _shrink_routing(d: dict, count_keys: list[str], experts: int, twin_experts: int, topk: int) -> None:
    for key in count_keys:
        if "." in key:
            outer, inner = key.split(".", 1)
            d[outer] = dict(d[outer], **{inner: twin_experts})
        else:
            value = d[key]
            d[key] = twin_experts if _is_int(value) else [twin_experts if x == experts else x for x in value]
    for key, value in list(d.items()):
        if TOPK.search(key) and (_is_int(value) or value is None):
            d[key] = topk if value is None else min(value, topk)
        elif GROUPS.search(key) and _is_int(value) and value > 1:
            d[key] = 2
        elif TOPK_GROUP.search(key) and _is_int(value) and value > 1:
            d[key] = 1
        elif (key.startswith("num_shared_experts") or key in ("n_shared_experts", "moe_num_shared_experts")) and (
            _is_int(value) and value > 2
        ):
            d[key] = 1


def _shrink_tower(d: dict, text_hidden) -> dict:
    """A vision or audio sub-config and the sub-configs it nests: one layer, hidden 64 (the towers
    are copied, never pruned)."""
    d = copy.deepcopy(d)
    own = d.get("hidden_size") or d.get("embed_dim")
    for key, value in list(d.items()):
        if not _is_int(value):
            continue
        if value in (text_hidden, own) and value > HIDDEN:
            d[key] = HIDDEN
        if key in ("depth", "num_hidden_layers", "num_layers"):
            d[key] = 1
        elif key in ("hidden_size", "embed_dim", "d_model", "out_hidden_size", "projection_dim", "text_hidden_size"):
            d[key] = HIDDEN
        elif key in ("num_heads", "num_attention_heads", "num_key_value_heads"):
            d[key] = 4
        elif "intermediate" in key:
            d[key] = 64
    for key, value in list(d.items()):  # a tower built of towers (an image encoder beside a ViT)
        if isinstance(value, dict) and "model_type" in value:
            d[key] = _shrink_tower(value, text_hidden)
    return d


def twin_text(text: dict, count_keys: list[str], experts: int, twin_experts: int) -> dict:
    """The twin of a text config (a dict with transformers' defaults filled in)."""
    d = copy.deepcopy(text)
    layers = layer_count(d)
    keep = layers_needed(d, layers)
    _shrink_sizes(d, layers)
    _shrink_routing(d, count_keys, experts, twin_experts, max(1, min(2, twin_experts // 4)))
    _shrink_layers(d, layers, keep)
    return d


def twin_config(full: dict, text_key: str | None, count_keys: list[str], experts: int, twin_experts: int) -> dict:
    """The twin of a whole config dict: its text part (top level, or `full[text_key]`) shrunk by
    `twin_text`, its other sub-configs (vision, audio) to one small layer."""
    if text_key is None:
        return twin_text(full, count_keys, experts, twin_experts)
    out = copy.deepcopy(full)
    text_hidden = full[text_key].get("hidden_size")
    for key, value in full.items():
        if isinstance(value, dict) and key.endswith("_config") and key != text_key and "model_type" in value:
            out[key] = _shrink_tower(value, text_hidden)
        elif key in _SIZES and _is_int(value):
            out[key] = _SIZES[key]
        elif key.endswith("token_id") and _is_int(value) and value >= VOCAB:
            out[key] = VOCAB - 8
    out[text_key] = twin_text(full[text_key], count_keys, experts, twin_experts)
    return out


def with_source_head_dim(config: dict, text_key: str | None, text: dict) -> dict:
    """`config` (a twin) with its text part's `head_dim` back at the source's, where the source
    gives one: for models whose code sizes a rotary split for the real heads."""
    out = copy.deepcopy(config)
    part = out[text_key] if text_key else out
    if _is_int(text.get("head_dim")):
        part["head_dim"] = text["head_dim"]
    return out


def with_experts(config: dict, text_key: str | None, count_keys: list[str], old: int, new: int) -> dict:
    """`config` with its expert count `old` set to `new` in every counting key."""
    out = copy.deepcopy(config)
    text = out[text_key] if text_key else out
    for key in count_keys:
        if "." in key:
            outer, inner = key.split(".", 1)
            text[outer][inner] = new
        else:
            value = text[key]
            text[key] = new if _is_int(value) else [new if x == old else x for x in value]
    return out


def with_topk(config: dict, text_key: str | None, k: int) -> dict:
    """`config` with every top-k key of its text part at `k` (a top-1 twin's weights cannot show
    its score function)."""
    out = copy.deepcopy(config)
    text = out[text_key] if text_key else out
    for key, value in list(text.items()):
        if TOPK.search(key) and _is_int(value):
            text[key] = k
    return out
