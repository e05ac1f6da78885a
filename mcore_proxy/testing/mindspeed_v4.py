"""A DeepSeek-V4 checkpoint as MindSpeed-LLM saves it (tests only), derived from the public source.

`mindspeed_v4_checkpoint` turns a tiny Hugging Face DeepSeek-V4 folder (`hf_fixtures.build_cached(
"deepseek_v4", ...)`: transformers 5 `save_pretrained` plus an `mtp.0.*` block) into the legacy
`--ckpt-format torch` rank files MindSpeed-LLM's own converter writes for `--transformer-impl local`,
and `mindspeed_v4_args` gives the training args `pretrain_deepseek4.py` would save with them. It is
written from MindSpeed-LLM at commit c77308a1 (paths below are in that tree) and imports nothing
of this project's checkpoint or convert code, so that the project's reader and writer of these
names can be tested against an independent derivation:

- `mindspeed_llm/tasks/checkpoint/convert_ckpt_deepseek4.py`, class `DeepSeek4Hf2MgConvert` (the
  HF -> Megatron direction): names, TP chunking, EP placement, grouped GEMM, MTP, rank folders, the
  saved dict (`set_model_preprocess` 534, `set_model_postprocess` 541, `set_mtp_preprocess` 558,
  `set_mtp_postprocess` 583, `set_model_layer_norm_ex` 598, `set_model_layer_attn_ex` 616,
  `set_model_layer_mlp_ex` 708, `run` 875, `generate_mg_weights_dir` 126);
- the model, to check that its state dict holds the same keys: `mindspeed_llm/tasks/models/spec/
  deepseek4_spec.py`, `mindspeed_llm/tasks/models/transformer/deepseek4/{csa,compressor,mhc}.py`,
  `mindspeed_llm/tasks/models/transformer/dsa_indexer.py`, `mindspeed_llm/core/models/deepseek4/
  deepseek4_model.py`, `mindspeed_llm/core/transformer/{transformer_layer,transformer_block,
  multi_token_prediction}.py`, `mindspeed_llm/core/transformer/moe/router.py` (tid2eid),
  `mindspeed_llm/core/tensor_parallel/layers.py` (LinearNoTP);
- the args: `examples/mcore/deepseek4_flash/pretrain_deepseek4_flash_4k_A3_ptd.sh` and the
  argument definitions under `mindspeed_llm/features_manager/` (`transformer/mhc_feature.py`,
  `transformer/multi_latent_attention/{csa_feature,dsa_indexer_feature,mla_feature}.py`,
  `moe/moe_router.py`, `fusions/swiglu_limit_feature.py`, `transformer/transformer_block.py`,
  `transformer/mtp.py`, `common/rotary.py`).

The layout (TP size t, EP size e, expert tensor parallel size 1; E experts, H hidden):

- rank folders `iter_{it:07d}/mp_rank_{tp:02}[_{pp:03}][_{ep:03}]` (the PP part when PP > 1, the EP
  part when EP > 1), one `model_optim_rng.pt` each holding `{"args", "checkpoint_version": 3.0,
  "iteration", "model"}`; a folder for EVERY (tp, ep) pair, as the converter writes them
  (`run` 935-949); `latest_checkpointed_iteration.txt` beside them;
- `embedding.word_embeddings.weight` on the first stage and, when PP > 1, again on the last (the MTP
  block embeds there: `set_mtp_preprocess` 580); it, `output_layer.weight` and `mtp.layers.{k}.
  eh_proj.weight` (= cat([e_proj, h_proj], dim=1)) are chunked by TP on dim 0;
- `final_layernorm.weight` (the model's, not the decoder's: with MTP or mHC the block's final norm
  is an IdentityOp, transformer_block.py 201-211), `hc_head.{hc_base, hc_fn.weight, hc_scale}` on the
  last stage, replicated;
- per layer (`decoder.layers.{local}` or `mtp.layers.{k}.transformer_layer`): `input_layernorm` and
  `pre_mlp_layernorm` (attn_norm, ffn_norm), `self_attention.` + `attn_sink` (TP dim 0),
  `kv_layernorm.weight`, `q_layernorm.weight`, `linear_q.weight` (wq_a) and `linear_kv.weight` (wkv)
  replicated (LinearNoTP), `linear_q_up_proj.weight` (wq_b, TP dim 0), `linear_o_down_proj.weight`
  (wo_a, TP dim 0: whole output groups), `linear_o_up_proj.weight` (wo_b, TP dim 1); for a decoder
  layer of compress ratio != 0 `compressor.{ape, norm.weight, wgate.weight, wkv.weight}` and for ratio
  4 also `indexer.kv_compressor.*`, `indexer.wq_b.weight`, `indexer.weights_proj.weight`, all
  replicated; `attn_mhc.*` / `mlp_mhc.*` (hc_attn_* / hc_ffn_*; `hc_scale` one [3] tensor);
  `mlp.router.weight` (the gate's first E rows) and either `mlp.router.tid2eid` (decoder layers
  below n_hash_layers) or `mlp.router.expert_bias` (every other layer, the MTP layers included);
  `mlp.shared_experts.linear_fc1.weight` = [gate_r; up_r] of TP rank r and `linear_fc2.weight` TP
  dim 1; the routed experts of EP rank e (global e * E/e + j) whole on every TP rank, either
  `mlp.experts.local_experts.{j}.linear_fc1.weight` = cat([w1, w3]) [2F, H] and `linear_fc2.weight`
  = w2 [H, F], or (grouped GEMM) `mlp.experts.weight1` [H, E_local * 2F] whose memory is
  [E_local, H, 2F] with block j = cat([w1, w3]).T, and `weight2` [E_local * F, H] = the w2.T stacked;
- for MTP layer k: `mtp.layers.{k}.{enorm, hnorm}.weight`, `eh_proj.weight`, `hc_head.*`
  (mtp.k.hc_head_*), `mtp.final_layernorms.{k}.weight` (mtp.k.norm), and no compressor or indexer.

Tensors keep the Hugging Face dtype, except tid2eid, stored as the model declares it (int64:
`torch.arange`, router.py 368-373).

Discrepancies and open questions found while deriving this (line numbers at c77308a1):

1. The converter reads `layers.{i}.attn.kv_norm.weight` (convert_ckpt_deepseek4.py 220, 277, 627;
   configs/checkpoint/model_cfg.json "layers_self_attention_kv_layernorm"), but transformers 5
   writes the KV norm as `attn.norm.weight` (its deepseek_v4 conversion mapping reads both), so on
   this fixture the converter would stop with a missing key. Derived here from `attn.kv_norm.weight`,
   else `attn.norm.weight`.
2. The converter takes the per-layer ratios from config.json `compress_ratios` (one more entry per
   MTP layer: 57-65) and the hash layers from `num_hash_layers` (model_cfg.json "n_hash_layers");
   transformers 5 writes `layer_types` + `compress_rates` and `mlp_layer_types` instead. Derived
   here from either (sliding_attention -> 0, leading hash_moe layers -> n_hash_layers).
3. The MTP layer's compressor and indexer are dropped: the converter treats every MTP layer as
   uncompressed (643-646, and the model agrees: DeepSeek4MTPSelfAttention sets compressor and
   indexer to None, csa.py 919-922), but the fixture's `mtp.0` is a copy of layer 3 (a CSA layer)
   and has 10 such tensors (`mtp.0.attn.compressor.*`, `mtp.0.attn.indexer.*`); neither the
   converter nor this derivation complains. `dropped_release_keys` lists them. (V4-Flash's
   compress_ratios, as this project's estimate/presets.py copies them, give the MTP layer 0.)
4. The training args' `--compress-ratios` has one entry per decoder layer and none for the MTP
   layers (the recipe passes 43 values for 43 real layers + 1 noop layer, line 72), while the
   converter requires num_layers + MTP entries from config.json. The model never reads an MTP
   entry: the MTP transformer layer is built with the default layer_number 1
   (multi_token_prediction.py 69), so its attention reads `compress_ratios[offset]` of its
   pipeline stage and then discards the result (csa.py 274, 919-922).
5. The converter writes the compressor for every ratio != 0 (646, 694); the model builds it only for
   ratio > 1 (csa.py 275-281). A ratio of 1 (none in the releases) would give keys the model lacks.
6. With expert tensor parallel size 1 and TP > 1, EP > 1 the converter writes every (tp, ep) folder
   (935-936), while training saves only the pairs (tp, tp % ep) or (ep % tp, ep)
   (mindspeed_llm/training/utils.py 1029-1060; the converter's own mg2hf side reads only those,
   1496-1510 and convert_mg2hf.py 1557-1575). At tp=2, ep=2: training writes mp_rank_00_000 and
   mp_rank_01_001, the converter also mp_rank_00_001 and mp_rank_01_000 (same contents per TP rank).
7. The model's state dict also holds `_extra_state` entries (None) for every megatron-core
   ColumnParallelLinear / RowParallelLinear, which the converter does not write and this derivation
   does not add: `output_layer`, `mtp.layers.{k}.eh_proj`, and per layer `self_attention.
   {linear_q_up_proj, linear_o_down_proj, linear_o_up_proj}`, `mlp.shared_experts.{linear_fc1,
   linear_fc2}` and, without grouped GEMM, `mlp.experts.local_experts.{j}.{linear_fc1, linear_fc2}`.
   LinearNoTP (linear_q, linear_kv, compressor, indexer, hc_fn) has none (layers.py 284-310), nor
   GroupedMLP. Loading relies on megatron's non-strict fallback for missing extra state (MindSpeed
   only filters unexpected `_extra_state` keys: tasks/megatron_basic/requirements_basic.py 38-39).
8. The saved `args` differ: the converter saves a Namespace of its own and the HF model's plain
   attributes (`__parameter_packaging` 113-124) and `"iteration": 1` always (946); here `args` are
   the training args and `iteration` is a parameter.
9. The converter refuses a non-bf16 `wkv` (636-641); the fixture is float32, kept as it is (args
   say params_dtype float32, bf16 and fp16 False).
10. Dtypes in a bf16 run: attn_sink, compressor ape/wkv/wgate are declared float32 (csa.py 192,
    compressor.py 53-61; the compressor's `linear_config.param_dtype = torch.float32` sets an
    attribute LinearNoTP never reads: it uses `config.params_dtype`, layers.py 296), yet
    Float16Module casts all of them to bf16 and only the mHC parameters are cast back to float32
    (mhc.py 67-80); the converter copies the release dtypes. Not visible in this float32 fixture.
11. Hash layers: the router's `expert_bias` buffer is set to None (router.py 374), so hash layers
    save no expert_bias, matching the converter; `tid2eid` is a frozen int64 Parameter
    [padded_vocab_size, topk]. MTP layers never build the hash table (transformer_layer.py 98-99),
    matching the converter's expert_bias there. `local_tokens_per_expert` is not persistent.
12. `kv_lora_rank` and `v_head_dim` are not read by the V4 attention (csa.py reads qk_head_dim as
    the full head dim, 173); here kv_lora_rank = head_dim (the recipe's 512 is V4-Flash's head_dim)
    and v_head_dim = 128 (the recipe's value, not a V4 dimension).
    `--norm-topk-prob` is not passed by the recipe, but the sqrtsoftplus routing always renormalises
    (moe_utils.py 147-175); here it follows config.json.

Rope (csa.py 282, 570; deepseek4_model.py 272-293; rotary_pos_embedding.py 321-361): a table of
`rope_scaling_original_max_position_embeddings` positions over the `qk_pos_emb_head_dim` rotary
dims; compressed layers (ratio > 1) use base `compress_rope_theta` and YaRN (`rope_factor`,
`beta_fast`, `beta_slow`) when `original_seq_len` > 0; the other layers use base `rope_theta`
without YaRN. From config.json: rope_theta = rope_parameters.main.rope_theta (else rope_theta),
compress_rope_theta = rope_parameters.compress.rope_theta (else compress_rope_theta); when the
compress rope is YaRN (rope_parameters.compress.rope_type or a release's rope_scaling.type),
rope_factor = its factor, original_seq_len = its original_max_position_embeddings, beta_fast /
beta_slow = its beta_fast / beta_slow and rope_scaling_type = "yarn"; otherwise original_seq_len 0
(no YaRN), rope_factor 1.0, beta_fast 32 / beta_slow 1 (MindSpeed's defaults, unread) and
rope_scaling_type None. rope_scaling_original_max_position_embeddings = seq_length (both recipes set
it to SEQ_LEN); rotary_base = int(rope_theta). The recipe's `--rope-scaling-factor`,
`--rope-scaling-mscale*` are never read by the V4 path and are not given.

The rank files are read with `torch.load(weights_only=False)`: they are this package's fixtures.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from mcore_proxy.testing.hf_fixtures import hf_tensors
from mcore_proxy.testing.quantized import V4_RELEASE_NAMES

SOURCE = "MindSpeed-LLM c77308a1"
SPEC = ["mindspeed_llm.tasks.models.spec.deepseek4_spec", "layer_spec"]
MTP_SPEC = ["mindspeed_llm.tasks.models.spec.deepseek4_spec", "mtp_spec"]
RANK_FILE = "model_optim_rng.pt"


# ---------------------------------------------------------------- config.json -> model facts
def _head_dim(config: dict) -> int:
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def _rope_head_dim(config: dict) -> int:
    for key in ("qk_rope_head_dim", "rope_head_dim"):
        if config.get(key):
            return int(config[key])
    return int(_head_dim(config) * config.get("partial_rotary_factor", 1.0))


def decoder_compress_ratios(config: dict) -> list[int]:
    """One KV compress ratio per decoder layer (0: sliding window only), from a release's
    `compress_ratios` or transformers' `layer_types` + `compress_rates`."""
    n = int(config["num_hidden_layers"])
    if config.get("compress_ratios") is not None:
        ratios = [int(r) for r in config["compress_ratios"]]
        if len(ratios) < n:
            raise ValueError(f"compress_ratios has {len(ratios)} entries for {n} layers")
        return ratios[:n]
    rates, out = config.get("compress_rates") or {}, []
    for kind in config["layer_types"]:
        if kind == "sliding_attention":
            out.append(0)
        elif kind in rates:
            out.append(int(rates[kind]))
        else:
            raise ValueError(f"layer type {kind!r} has no compress rate in config.json")
    if len(out) != n:
        raise ValueError(f"layer_types has {len(out)} entries for {n} layers")
    return out


def hash_layers(config: dict) -> int:
    """The number of leading hash-routed layers (a release's num_hash_layers, or transformers'
    leading `hash_moe` mlp_layer_types)."""
    if config.get("num_hash_layers") is not None:
        return int(config["num_hash_layers"])
    kinds = list(config.get("mlp_layer_types") or [])
    unknown = sorted(set(kinds) - {"moe", "hash_moe"})
    if unknown:
        raise ValueError(f"mlp_layer_types {unknown} are not MoE layers (every V4 layer is)")
    n = 0
    while n < len(kinds) and kinds[n] == "hash_moe":
        n += 1
    if "hash_moe" in kinds[n:]:
        raise ValueError("hash-routed layers must come first (MindSpeed hashes layers 1..n_hash_layers)")
    return n


def _rope(config: dict) -> dict:
    params = config.get("rope_parameters") or {}
    main = params.get("main") if isinstance(params.get("main"), dict) else params
    compress = params.get("compress") if isinstance(params.get("compress"), dict) else {}
    rope_theta = float(main.get("rope_theta", config.get("rope_theta", 10000.0)))
    compress_theta = float(compress.get("rope_theta", config.get("compress_rope_theta", 40000.0)))
    scaling = config.get("rope_scaling") or {}
    if compress.get("rope_type") == "yarn":
        yarn = compress
    elif (scaling.get("rope_type") or scaling.get("type")) == "yarn":
        yarn = scaling
    else:
        yarn = None
    out = dict(rope_theta=rope_theta, rotary_base=int(rope_theta), compress_rope_theta=compress_theta)
    if yarn is None:
        out.update(rope_factor=1.0, original_seq_len=0, beta_fast=32, beta_slow=1, rope_scaling_type=None)
    else:
        out.update(
            rope_factor=float(yarn["factor"]),
            original_seq_len=int(yarn["original_max_position_embeddings"]),
            beta_fast=int(yarn.get("beta_fast", 32)),
            beta_slow=int(yarn.get("beta_slow", 1)),
            rope_scaling_type="yarn",
        )
    return out


def _dtype_name(config: dict) -> str:
    name = str(config.get("dtype") or config.get("torch_dtype") or "bfloat16").replace("torch.", "")
    if name not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"unsupported dtype {name!r}")
    return name


def mindspeed_v4_args(config: dict, *, tp: int, pp: int, ep: int, grouped_gemm: bool) -> argparse.Namespace:
    """The training args MindSpeed-LLM's pretrain_deepseek4.py would save for this config (argparse
    dest names, plain values only: params_dtype is the string "torch.<dtype>").

    Every value comes from config.json where it has a counterpart; the recipe's model-shaping flags
    without one keep the recipe's value (transformer_impl, spec, mtp_spec, moe_layer_freq 1,
    first_k_dense_replace -1, moe_router_num_groups 1, moe_router_group_topk 1, load balancing none,
    seq_aux, expert_tensor_parallel_size 1, make_vocab_size_divisible_by 1, qk_layernorm,
    kv_compress, multi_latent_attention, enable_dsa_indexer, enable_mhc, v_head_dim 128,
    kv_lora_rank = head_dim); the rest keep MindSpeed-LLM's defaults (max_batch_size 4, scale_fmt
    None). seq_length has no counterpart: min(4096, max_position_embeddings) (4096 is the recipe's
    and model_cfg.json's). ffn_hidden_size = intermediate_size, else hidden_size as the recipe
    passes it (unused: every layer is MoE). See the module docstring for the rope fields."""
    n_layers, hidden = int(config["num_hidden_layers"]), int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    head_dim = _head_dim(config)
    moe_ffn = int(config["moe_intermediate_size"])
    dtype = _dtype_name(config)
    max_pos = int(config["max_position_embeddings"])
    seq_length = min(4096, max_pos)
    vocab = int(config["vocab_size"])
    values = dict(
        # model size
        num_layers=n_layers,
        hidden_size=hidden,
        ffn_hidden_size=int(config.get("intermediate_size") or hidden),
        num_attention_heads=heads,
        kv_channels=hidden // heads,
        group_query_attention=False,
        vocab_size=vocab,
        padded_vocab_size=vocab,
        make_vocab_size_divisible_by=1,
        max_position_embeddings=max_pos,
        seq_length=seq_length,
        normalization="RMSNorm",
        norm_epsilon=float(config.get("rms_norm_eps", 1e-6)),
        swiglu=True,
        add_bias_linear=False,
        add_qkv_bias=False,
        untie_embeddings_and_output_weights=not config.get("tie_word_embeddings", False),
        position_embedding_type="deepseek4",
        # attention: MLA flags, CSA / HCA
        multi_latent_attention=True,
        q_lora_rank=int(config["q_lora_rank"]),
        qk_head_dim=head_dim,
        qk_pos_emb_head_dim=_rope_head_dim(config),
        kv_lora_rank=head_dim,
        v_head_dim=128,
        qk_layernorm=True,
        kv_compress=True,
        o_groups=int(config["o_groups"]),
        o_lora_rank=int(config["o_lora_rank"]),
        sliding_window_size=int(config["sliding_window"]),
        compress_ratios=decoder_compress_ratios(config),
        max_batch_size=4,
        use_flash_attn=True,
        mla_mm_split=False,
        rope_scaling_original_max_position_embeddings=seq_length,
        **_rope(config),
        # the indexer of the ratio-4 layers
        enable_dsa_indexer=True,
        index_n_heads=int(config["index_n_heads"]),
        index_head_dim=int(config["index_head_dim"]),
        index_topk=int(config["index_topk"]),
        scale_fmt=None,
        # hyper-connections
        enable_mhc=True,
        hc_mult=int(config["hc_mult"]),
        hc_sinkhorn_iters=int(config.get("hc_sinkhorn_iters", 20)),
        hc_eps=float(config.get("hc_eps", 1e-6)),
        # MoE
        num_experts=int(config["n_routed_experts"]),
        moe_router_topk=int(config["num_experts_per_tok"]),
        moe_ffn_hidden_size=moe_ffn,
        moe_shared_expert_intermediate_size=int(config.get("n_shared_experts", 1)) * moe_ffn,
        moe_router_score_function=str(config.get("scoring_func", "sqrtsoftplus")),
        moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=float(config.get("router_aux_loss_coef", 0.0)),
        seq_aux=True,
        norm_topk_prob=bool(config.get("norm_topk_prob", False)),
        moe_router_dtype="fp32",
        moe_router_num_groups=1,
        moe_router_group_topk=1,
        n_hash_layers=hash_layers(config),
        swiglu_limit=float(config.get("swiglu_limit", 0.0)),
        moe_grouped_gemm=bool(grouped_gemm),
        moe_layer_freq=1,
        first_k_dense_replace=-1,
        moe_token_dispatcher_type="alltoall",
        num_zero_experts=None,
        moe_tp_extend_ep=False,
        # MTP
        mtp_num_layers=int(config.get("num_nextn_predict_layers", 0)) or None,
        # implementation, parallelism, format
        transformer_impl="local",
        spec=list(SPEC),
        mtp_spec=list(MTP_SPEC),
        use_mcore_models=True,
        use_legacy_models=False,
        ckpt_format="torch",
        params_dtype=f"torch.{dtype}",
        bf16=dtype == "bfloat16",
        fp16=dtype == "float16",
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1,
        context_parallel_size=1,
        sequence_parallel=tp > 1,
        num_layers_per_virtual_pipeline_stage=None,
        virtual_pipeline_model_parallel_size=None,
        noop_layers=None,
        num_layer_list=None,
        schedules_method=None,
    )
    return argparse.Namespace(**dict(sorted(values.items())))


# ---------------------------------------------------------------- HF release tensors
def release_tensors(hf_folder: Path) -> dict[str, torch.Tensor]:
    """The folder's tensors under DeepSeek-V4 release keys (what MindSpeed-LLM's converter reads)."""
    out = {}
    for key, value in hf_tensors(Path(hf_folder)).items():
        for old, new in V4_RELEASE_NAMES:
            if key.startswith(old):
                key = new + key[len(old) :]
                break
        out[key] = value
    return out


class _Release:
    """Release tensors by key, remembering which were read."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors, self.used = tensors, set()

    def __call__(self, *keys: str) -> torch.Tensor:
        for key in keys:
            if key in self.tensors:
                self.used.add(key)
                return self.tensors[key]
        raise KeyError(f"none of {list(keys)} in the Hugging Face tensors")

    def has(self, key: str) -> bool:
        return key in self.tensors


def _own(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy with storage of its own (torch.save of a view saves the whole base)."""
    return t.clone(memory_format=torch.contiguous_format)


def _part(t: torch.Tensor, parts: int, rank: int, dim: int) -> torch.Tensor:
    if t.shape[dim] % parts:
        raise ValueError(f"dim {dim} of {tuple(t.shape)} does not split in {parts}")
    return _own(t.chunk(parts, dim)[rank])


def rank_folder(tp_rank: int, pp_rank: int, ep_rank: int, *, pp: int, ep: int) -> str:
    """`mp_rank_{tp:02}[_{pp:03}][_{ep:03}]` (convert_ckpt_deepseek4.py generate_mg_weights_dir)."""
    name = f"mp_rank_{tp_rank:02}"
    if pp > 1:
        name += f"_{pp_rank:03}"
    if ep > 1:
        name += f"_{ep_rank:03}"
    return name


class _Derivation:
    def __init__(self, hf_folder: Path, tp: int, pp: int, ep: int, grouped_gemm: bool):
        self.config = json.loads((Path(hf_folder) / "config.json").read_text())
        self.w = _Release(release_tensors(hf_folder))
        self.tp, self.pp, self.ep, self.grouped = tp, pp, ep, grouped_gemm
        c = self.config
        self.layers = int(c["num_hidden_layers"])
        self.experts = int(c["n_routed_experts"])
        self.hidden = int(c["hidden_size"])
        self.mtp = int(c.get("num_nextn_predict_layers", 0))
        self.ratios = decoder_compress_ratios(c)
        self.n_hash = hash_layers(c)
        for what, n, parts in (
            ("layers", self.layers, pp),
            ("experts", self.experts, ep),
            ("attention heads", int(c["num_attention_heads"]), tp),
            ("o_groups", int(c["o_groups"]), tp),
            ("vocab", int(c["vocab_size"]), tp),
        ):
            if n % parts:
                raise ValueError(f"{n} {what} do not split in {parts}")

    # -- pieces of one (tp, ep) rank, in the converter's order
    def embedding(self, sd: dict, tp_rank: int, key: str = "embed.weight") -> None:
        sd["embedding.word_embeddings.weight"] = _part(self.w(key), self.tp, tp_rank, 0)

    def postprocess(self, sd: dict, tp_rank: int) -> None:
        w = self.w
        sd["final_layernorm.weight"] = _own(w("norm.weight"))
        sd["output_layer.weight"] = _part(w("head.weight"), self.tp, tp_rank, 0)
        sd["hc_head.hc_base"] = _own(w("hc_head_base"))
        sd["hc_head.hc_fn.weight"] = _own(w("hc_head_fn"))
        sd["hc_head.hc_scale"] = _own(w("hc_head_scale"))

    def mtp_preprocess(self, sd: dict, k: int, tp_rank: int) -> None:
        w, hf, mg = self.w, f"mtp.{k}", f"mtp.layers.{k}"
        sd[f"{mg}.enorm.weight"] = _own(w(f"{hf}.enorm.weight"))
        sd[f"{mg}.hnorm.weight"] = _own(w(f"{hf}.hnorm.weight"))
        eh_proj = torch.cat([w(f"{hf}.e_proj.weight"), w(f"{hf}.h_proj.weight")], dim=1)
        sd[f"{mg}.eh_proj.weight"] = _part(eh_proj, self.tp, tp_rank, 0)
        if self.pp > 1:
            own = f"{hf}.emb.tok_emb.weight"
            self.embedding(sd, tp_rank, own if w.has(own) else "embed.weight")

    def mtp_postprocess(self, sd: dict, k: int) -> None:
        w, hf, mg = self.w, f"mtp.{k}", f"mtp.layers.{k}"
        sd[f"mtp.final_layernorms.{k}.weight"] = _own(w(f"{hf}.norm.weight"))
        sd[f"{mg}.hc_head.hc_base"] = _own(w(f"{hf}.hc_head_base"))
        sd[f"{mg}.hc_head.hc_fn.weight"] = _own(w(f"{hf}.hc_head_fn"))
        sd[f"{mg}.hc_head.hc_scale"] = _own(w(f"{hf}.hc_head_scale"))

    def layer(self, sd: dict, hf: str, mg: str, *, index: int | None, tp_rank: int, ep_rank: int) -> None:
        """Decoder layer `index` (None: an MTP layer) from release prefix `hf` to Megatron prefix `mg`."""
        w, tp, mtp = self.w, self.tp, index is None
        sd[f"{mg}.input_layernorm.weight"] = _own(w(f"{hf}.attn_norm.weight"))
        sd[f"{mg}.pre_mlp_layernorm.weight"] = _own(w(f"{hf}.ffn_norm.weight"))

        a, h = f"{mg}.self_attention", f"{hf}.attn"
        sd[f"{a}.attn_sink"] = _part(w(f"{h}.attn_sink"), tp, tp_rank, 0)
        sd[f"{a}.kv_layernorm.weight"] = _own(w(f"{h}.kv_norm.weight", f"{h}.norm.weight"))
        sd[f"{a}.q_layernorm.weight"] = _own(w(f"{h}.q_norm.weight"))
        sd[f"{a}.linear_o_down_proj.weight"] = _part(w(f"{h}.wo_a.weight", f"{h}.wo_a"), tp, tp_rank, 0)
        sd[f"{a}.linear_kv.weight"] = _own(w(f"{h}.wkv.weight"))
        sd[f"{a}.linear_o_up_proj.weight"] = _part(w(f"{h}.wo_b.weight"), tp, tp_rank, 1)
        sd[f"{a}.linear_q.weight"] = _own(w(f"{h}.wq_a.weight"))
        sd[f"{a}.linear_q_up_proj.weight"] = _part(w(f"{h}.wq_b.weight"), tp, tp_rank, 0)
        ratio = 0 if mtp else self.ratios[index]
        if ratio != 0:
            for name in ("ape", "norm.weight", "wgate.weight", "wkv.weight"):
                sd[f"{a}.compressor.{name}"] = _own(w(f"{h}.compressor.{name}"))
            if ratio == 4:
                for name in ("ape", "norm.weight", "wgate.weight", "wkv.weight"):
                    sd[f"{a}.indexer.kv_compressor.{name}"] = _own(w(f"{h}.indexer.compressor.{name}"))
                sd[f"{a}.indexer.wq_b.weight"] = _own(w(f"{h}.indexer.wq_b.weight"))
                sd[f"{a}.indexer.weights_proj.weight"] = _own(w(f"{h}.indexer.weights_proj.weight"))

        f = f"{hf}.ffn"
        sd[f"{mg}.mlp.router.weight"] = _own(w(f"{f}.gate.weight")[: self.experts])
        if not mtp and index < self.n_hash:
            sd[f"{mg}.mlp.router.tid2eid"] = w(f"{f}.gate.tid2eid").to(torch.int64, copy=True)
        else:
            sd[f"{mg}.mlp.router.expert_bias"] = _own(w(f"{f}.gate.bias"))
        gate = w(f"{f}.shared_experts.w1.weight", f"{f}.shared_experts.w1")
        up = w(f"{f}.shared_experts.w3.weight", f"{f}.shared_experts.w3")
        down = w(f"{f}.shared_experts.w2.weight", f"{f}.shared_experts.w2")
        sd[f"{mg}.mlp.shared_experts.linear_fc1.weight"] = torch.cat(
            [_part(gate, tp, tp_rank, 0), _part(up, tp, tp_rank, 0)], dim=0
        )
        sd[f"{mg}.mlp.shared_experts.linear_fc2.weight"] = _part(down, tp, tp_rank, 1)
        for mhc, kind in (("attn_mhc", "attn"), ("mlp_mhc", "ffn")):
            sd[f"{mg}.{mhc}.hc_base"] = _own(w(f"{hf}.hc_{kind}_base"))
            sd[f"{mg}.{mhc}.hc_fn.weight"] = _own(w(f"{hf}.hc_{kind}_fn"))
            sd[f"{mg}.{mhc}.hc_scale"] = _own(w(f"{hf}.hc_{kind}_scale"))

        local = self.experts // self.ep
        fc1, fc2 = [], []
        for j in range(local):
            e = f"{f}.experts.{ep_rank * local + j}"
            fc1.append(torch.cat([w(f"{e}.w1.weight", f"{e}.w1"), w(f"{e}.w3.weight", f"{e}.w3")], dim=0))
            fc2.append(w(f"{e}.w2.weight", f"{e}.w2"))
        if self.grouped:
            sd[f"{mg}.mlp.experts.weight1"] = torch.stack([x.t() for x in fc1]).reshape(self.hidden, -1).contiguous()
            sd[f"{mg}.mlp.experts.weight2"] = torch.stack([x.t() for x in fc2]).reshape(-1, self.hidden).contiguous()
        else:
            for j in range(local):
                sd[f"{mg}.mlp.experts.local_experts.{j}.linear_fc1.weight"] = _own(fc1[j])
                sd[f"{mg}.mlp.experts.local_experts.{j}.linear_fc2.weight"] = _own(fc2[j])

    def stage(self, pp_rank: int, tp_rank: int, ep_rank: int) -> dict[str, torch.Tensor]:
        sd: dict[str, torch.Tensor] = {}
        per_stage = self.layers // self.pp
        last = pp_rank == self.pp - 1
        if pp_rank == 0:
            self.embedding(sd, tp_rank)
        if last:
            for k in range(self.mtp):
                self.mtp_preprocess(sd, k, tp_rank)
                self.layer(
                    sd, f"mtp.{k}", f"mtp.layers.{k}.transformer_layer", index=None, tp_rank=tp_rank, ep_rank=ep_rank
                )
                self.mtp_postprocess(sd, k)
        for local in range(per_stage):
            index = pp_rank * per_stage + local
            self.layer(sd, f"layers.{index}", f"decoder.layers.{local}", index=index, tp_rank=tp_rank, ep_rank=ep_rank)
        if last:
            self.postprocess(sd, tp_rank)
        return sd


def dropped_release_keys(hf_folder: Path) -> list[str]:
    """Release keys of `hf_folder` the conversion never reads (for the fixture: the MTP layer's
    compressor and indexer)."""
    d = _Derivation(Path(hf_folder), 1, 1, 1, False)
    d.stage(0, 0, 0)
    return sorted(set(d.w.tensors) - d.w.used)


def mindspeed_v4_checkpoint(
    hf_folder: Path, out: Path, *, tp: int = 1, pp: int = 1, ep: int = 1, grouped_gemm: bool = False, iteration: int = 1
) -> Path:
    """Writes out/latest_checkpointed_iteration.txt and out/iter_{iteration:07d}/mp_rank_*/model_optim_rng.pt
    as MindSpeed-LLM saves the model of `hf_folder` at these parallel sizes; returns `out`."""
    hf_folder, out = Path(hf_folder), Path(out)
    d = _Derivation(hf_folder, tp, pp, ep, grouped_gemm)
    config = dict(d.config)
    if not (config.get("dtype") or config.get("torch_dtype")):
        config["dtype"] = str(d.w("embed.weight").dtype).replace("torch.", "")
    args = mindspeed_v4_args(config, tp=tp, pp=pp, ep=ep, grouped_gemm=grouped_gemm)
    base = out / f"iter_{iteration:07d}"
    for p in range(pp):
        for e in range(ep):
            for t in range(tp):
                folder = base / rank_folder(t, p, e, pp=pp, ep=ep)
                folder.mkdir(parents=True, exist_ok=True)
                torch.save(
                    {"args": args, "checkpoint_version": 3.0, "iteration": iteration, "model": d.stage(p, t, e)},
                    folder / RANK_FILE,
                )
    (out / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return out
