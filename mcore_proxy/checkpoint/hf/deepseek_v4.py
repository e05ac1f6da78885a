"""DeepSeek-V4 (`DeepseekV4ForCausalLM`, transformers 5) <-> Megatron-LM's DeepSeek-V4: mapping table
and config translations.

Megatron-LM has DeepSeek-V4 on its `dev` branch only (no megatron-core release has it; checked at
dev d48bd6be, `transformer/experimental_attention_variant/{deepseek_v4_hybrid_attention,csa}.py`,
`transformer/hyper_connection.py`, `transformer/moe/router.py`, `transformer/multi_token_prediction.py`,
and by building a tiny GPTModel from that tree on CPU: bench/deepseek_v4_megatron_dev.py). The
canonical names are that tree's GPTModel state-dict names (`--experimental-attention-variant
dsv4_hybrid`, `--enable-hyper-connections`, `--moe-n-hash-layers`):

  transformers (save_pretrained)       Megatron-LM dev
  attn.wq_a / q_norm / wq_b            self_attention.linear_q_down_proj / q_layernorm / linear_q_up_proj
  attn.wkv / attn.norm                 self_attention.linear_kv_proj / kv_layernorm (one shared KV head)
  attn.wo_a / wo_b                     self_attention.linear_o_group_proj (a bare Parameter) / linear_proj
  attn.attn_sink                       self_attention.core_attention.attn_sink
  attn.compressor.{wkv,wgate,ape,norm} self_attention.core_attention.compressor.{linear_wkv,linear_wgate,ape,norm}
  attn.indexer.{wq_b,weights_proj}     self_attention.core_attention.indexer.{linear_wq_b,linear_weights_proj}
  attn.indexer.compressor.*            self_attention.core_attention.indexer.compressor.* (as above)
  hc_attn_fn / _base / _scale [3]      self_attention_hyper_connection.mapping_proj.weight / bias /
                                       alpha_pre, alpha_post, alpha_res ([1] each: scale[0], [1], [2])
  hc_ffn_*                             mlp_hyper_connection.* (the same)
  ffn.gate.weight / bias / tid2eid     mlp.router.weight / expert_bias / tid2eid (int64 <-> int32 buffer)
  ffn.experts.{e}.w1, w3 / w2          mlp.experts.{e}.linear_fc1 (gate rows, then up) / linear_fc2
  ffn.shared_experts.w1, w3 / w2       mlp.shared_experts.linear_fc1 / linear_fc2
  model.hc_head.hc_{fn,base,scale}     decoder.hc_head_{fn,base,scale}
  head.weight                          output_layer.weight
  mtp.{k}.{e_proj,h_proj,enorm,hnorm}  mtp.layers.{k}.{e_proj,h_proj,enorm,hnorm}.weight
  mtp.{k}.norm / hc_head_*             mtp.layers.{k}.final_layernorm / hc_head_*
  mtp.{k}.<layer tensors>              mtp.layers.{k}.transformer_layer.* (legacy files: `mtp_model_layer`,
                                       names.py; torch_dist: `transformer_layer`, as the dev tree maps it)

The HF side is transformers' `save_pretrained` spelling (written and read) and the release's
(`layers.{i}.`, `embed`, `norm`, `hc_head_*`; read only, once dequantized: its FP4/FP8 `.scale`
tensors are refused by `HFNativeView.megatron`). Megatron-LM dev runs DeepSeek-V4's attention at
tensor-parallel size 1 only (an assert in `deepseek_v4_hybrid_attention.py`): the writers refuse
TP > 1; experts split over EP / ETP as for any model. Its torch_dist files key layers one by one
(`hetereogenous_dist_checkpoint`), its compressed layers use YaRN RoPE at
`csa_compress_rotary_base` (a factor of 1 is plain RoPE), and its indexer is built exactly for
compress ratio 4, as transformers builds it for `compressed_sparse_attention`. Proven by
tests/checkpoint/hf/test_hf_deepseek_v4_megatron.py (round trips) and, off CI, by
bench/deepseek_v4_megatron_dev.py (the dev tree loads the files strictly and computes transformers'
logits); what is not is in docs/families.md. MindSpeed-LLM saves DeepSeek-V4 under other names and
shardings (tensor-parallel attention): `checkpoint/mindspeed_llm_v4.py` maps them to these.
"""

from __future__ import annotations

import logging
import re

from mcore_proxy.checkpoint.hf.descriptor import E_ROUTED
from mcore_proxy.checkpoint.hf.mapping import GLU, MODEL, MTP, PICK, Row
from mcore_proxy.checkpoint.hf.megatron_mapping import (
    MegatronMapping,
    dtype_fields,
    dtype_name,
    local_spec_args,
    require,
)
from mcore_proxy.checkpoint.names import MTP_MODEL_LAYER
from mcore_proxy.core.errors import CheckpointError
from mcore_proxy.mcore import megatron_args as ma

log = logging.getLogger(__name__)

NAME = "DeepSeek-V4"
ARCHITECTURE = "DeepseekV4ForCausalLM"
VARIANT = "dsv4_hybrid"
SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
CSA_RATIO = 4  # Megatron-LM builds the indexer exactly for this ratio (csa.py)
MEGATRON_RATIOS = (0, 4, 128)  # what Megatron-LM dev's TransformerConfig accepts
HC_EPS = 1e-6  # Megatron-LM's mHC epsilons are constants (hyper_connection.py)
_LAYER_OF = re.compile(r"^(?:model\.)?(layers\.\d+|mtp\.\d+)$")
_ATTN, _CORE = "self_attention.", "self_attention.core_attention."


def _compressor(canonical: str, hf: str) -> tuple[Row, ...]:
    return (
        Row(f"{canonical}.linear_wkv.weight", f"{hf}.wkv.weight"),
        Row(f"{canonical}.linear_wgate.weight", f"{hf}.wgate.weight"),
        Row(f"{canonical}.ape", f"{hf}.ape"),
        Row(f"{canonical}.norm.weight", f"{hf}.norm.weight"),
    )


def _hyper_connection(canonical: str, hf: str) -> tuple[Row, ...]:
    return (
        Row(f"{canonical}.mapping_proj.weight", f"{hf}_fn"),
        Row(f"{canonical}.bias", f"{hf}_base"),
        *(
            Row(f"{canonical}.alpha_{part}", f"{hf}_scale", PICK, index=i)
            for i, part in enumerate(("pre", "post", "res"))
        ),
    )


ROWS = (
    Row("embedding.word_embeddings.weight", "model.embed_tokens.weight", scope=MODEL),
    Row("embedding.word_embeddings.weight", "embed.weight", scope=MODEL, read_only=True),  # the release's
    Row("decoder.final_layernorm.weight", "model.norm.weight", scope=MODEL),
    Row("decoder.final_layernorm.weight", "norm.weight", scope=MODEL, read_only=True),
    Row("output_layer.weight", "head.weight", scope=MODEL),
    *(Row(f"decoder.hc_head_{p}", f"model.hc_head.hc_{p}", scope=MODEL) for p in ("fn", "base", "scale")),
    *(Row(f"decoder.hc_head_{p}", f"hc_head_{p}", scope=MODEL, read_only=True) for p in ("fn", "base", "scale")),
    Row("input_layernorm.weight", "attn_norm.weight"),
    Row("pre_mlp_layernorm.weight", "ffn_norm.weight"),
    Row(_ATTN + "linear_q_down_proj.weight", "attn.wq_a.weight"),
    Row(_ATTN + "q_layernorm.weight", "attn.q_norm.weight"),
    Row(_ATTN + "linear_q_up_proj.weight", "attn.wq_b.weight"),
    Row(_ATTN + "linear_kv_proj.weight", "attn.wkv.weight"),
    Row(_ATTN + "kv_layernorm.weight", "attn.norm.weight"),
    Row(_ATTN + "linear_o_group_proj", "attn.wo_a.weight"),
    Row(_ATTN + "linear_proj.weight", "attn.wo_b.weight"),
    Row(_CORE + "attn_sink", "attn.attn_sink"),
    *_compressor(_CORE + "compressor", "attn.compressor"),
    Row(_CORE + "indexer.linear_wq_b.weight", "attn.indexer.wq_b.weight"),
    Row(_CORE + "indexer.linear_weights_proj.weight", "attn.indexer.weights_proj.weight"),
    *_compressor(_CORE + "indexer.compressor", "attn.indexer.compressor"),
    *_hyper_connection("self_attention_hyper_connection", "hc_attn"),
    *_hyper_connection("mlp_hyper_connection", "hc_ffn"),
    Row("mlp.shared_experts.linear_fc1.weight", ("ffn.shared_experts.w1.weight", "ffn.shared_experts.w3.weight"), GLU),
    Row("mlp.shared_experts.linear_fc2.weight", "ffn.shared_experts.w2.weight"),
    # the MTP block `mtp.{k}.` beside its decoder layer (Megatron-LM: e_proj and h_proj apart with mHC)
    *(Row(f"{p}.weight", f"{p}.weight", scope=MTP) for p in ("enorm", "hnorm", "e_proj", "h_proj")),
    Row("final_layernorm.weight", "norm.weight", scope=MTP),
    *(Row(f"hc_head_{p}", f"hc_head_{p}", scope=MTP) for p in ("fn", "base", "scale")),
)


# -- config.json -> Megatron-LM dev args ---------------------------------------------------------------


def compress_ratios(config, layers: int) -> list[int]:
    """Per decoder layer: 0 (sliding window only), the CSA rate, or the HCA rate (`layer_types` and
    `compress_rates`, or the release's `compress_ratios`)."""
    if not config.has("layer_types") and config.has("compress_ratios"):
        ratios = [int(r) for r in config.list("compress_ratios")][:layers]
    else:
        types = config.list("layer_types")
        rates = {CSA: CSA_RATIO, HCA: 128, **config.dict("compress_rates", {})}
        if len(types) != layers or set(types) - {SLIDING, CSA, HCA}:
            raise CheckpointError(
                f"{config.path}: layer_types must name {SLIDING}, {CSA} or {HCA} for each of the "
                f"{layers} layers; fix config.json"
            )
        if int(rates[CSA]) != CSA_RATIO or int(rates[HCA]) in (0, CSA_RATIO):
            raise CheckpointError(
                f"{config.path}: compress_rates {rates} give a compressed sparse attention rate other "
                f"than {CSA_RATIO} or a heavily compressed one of 0 or {CSA_RATIO}; Megatron-LM builds "
                f"the indexer exactly for rate {CSA_RATIO}, so its layers would differ"
            )
        ratios = [0 if t == SLIDING else int(rates[t]) for t in types]
    if len(ratios) != layers:
        raise CheckpointError(
            f"{config.path}: compress_ratios has {len(ratios)} entries for {layers} layers; fix config.json"
        )
    return ratios


def hash_layers(config, layers: int) -> int:
    """How many leading layers route by the token-id table (`mlp_layer_types`, else `num_hash_layers`,
    transformers' default 3); Megatron-LM hashes exactly the first `moe_n_hash_layers`."""
    if not config.has("mlp_layer_types"):
        return min(layers, config.int("num_hash_layers", 3))
    types = config.list("mlp_layer_types")
    n = next((i for i, t in enumerate(types) if t != "hash_moe"), len(types))
    if len(types) != layers or any(t != "moe" for t in types[n:]):
        raise CheckpointError(
            f"{config.path}: mlp_layer_types must be 'hash_moe' for the first layers and 'moe' for "
            f"the rest, one entry for each of the {layers} layers, as Megatron-LM's "
            "moe_n_hash_layers says; fix config.json"
        )
    return n


def _mtp_ratios(config, depths: int, decoder: list[int]) -> list[int]:
    """Compress ratio of each MTP layer, from its tensors (config.json does not say; DeepSeek's release
    has none, a copied decoder layer may): the compressor's `ape` rows. The decoder layers' compressors
    are checked against `decoder` on the way."""
    from mcore_proxy.checkpoint.hf.folder import weight_map
    from mcore_proxy.checkpoint.hf.safetensors_io import read_header

    folder = config.path.parent
    wmap = weight_map(folder)
    layer = lambda key: _LAYER_OF.sub(r"\1", key.split(".attn.")[0])  # noqa: E731  (`layers.3`, `mtp.0`)
    apes = {}
    for file in sorted({f for k, f in wmap.items() if k.endswith(".attn.compressor.ape")}):
        apes.update(
            {
                layer(k): tuple(info.shape)
                for k, info in read_header(folder / file).items()
                if k.endswith(".attn.compressor.ape")
            }
        )
    indexed = {layer(k) for k in wmap if ".attn.indexer." in k}
    prefixes = [(f"layers.{i}", r) for i, r in enumerate(decoder)]
    out = []
    for k in range(depths):
        ape = apes.get(f"mtp.{k}")
        out.append(ape[0] if ape else 0)
        prefixes.append((f"mtp.{k}", out[-1]))
    for prefix, ratio in prefixes:
        ape = apes.get(prefix)
        if (ape[0] if ape else 0) != ratio or (prefix in indexed) != (ratio == CSA_RATIO):
            said = " (config.json)" if prefix.startswith("layers.") else ""
            raise CheckpointError(
                f"{config.path}: {prefix} has compress ratio {ratio}{said}, but its compressor "
                f"holds {ape[0] if ape else 'no'} rows and it has {'an' if prefix in indexed else 'no'} "
                "indexer; fix config.json or use the config.json that came with these weights"
            )
    return out


def _rope_args(config) -> dict:
    """Megatron-LM dev: plain RoPE at `rotary_base` in sliding-window layers, YaRN at
    `csa_compress_rotary_base` in compressed ones (factor 1: plain RoPE; the concentration factor is
    not applied, as transformers' V4 sets attention_factor 1)."""
    params = config.dict("rope_parameters", {})
    main, compress = params.get("main", {}), params.get("compress", {})
    if main.get("rope_type", "default") != "default":
        raise CheckpointError(
            f"{config.path}: rope_parameters.main is {main.get('rope_type')!r}; Megatron-LM's "
            "DeepSeek-V4 uses plain RoPE in sliding-window layers"
        )
    fields = dict(
        rope_type="yarn",
        rotary_base=float(main.get("rope_theta", config.float("rope_theta", 10000.0))),
        csa_compress_rotary_base=float(compress.get("rope_theta", config.float("compress_rope_theta", 160000.0))),
        rotary_scaling_factor=1.0,
        mscale=1.0,
        mscale_all_dim=0.0,
    )
    kind = compress.get("rope_type", "default")
    if kind == "yarn":
        fields.update(
            rotary_scaling_factor=float(compress.get("factor", 1.0)),
            original_max_position_embeddings=int(compress.get("original_max_position_embeddings", 4096)),
            beta_fast=float(compress.get("beta_fast", 32)),
            beta_slow=float(compress.get("beta_slow", 1)),
        )
    elif kind != "default":
        raise CheckpointError(
            f"{config.path}: rope_parameters.compress is {kind!r}; Megatron-LM's DeepSeek-V4 "
            "uses YaRN (or plain) RoPE in compressed layers"
        )
    return fields


def args_from_config(config, mtp_layers: int = 0):
    """Megatron-LM dev args of the model `config` (an HFConfig) describes (argparse names, which
    are its TransformerConfig fields); refuses what Megatron-LM would build differently."""
    layers = config.int("num_hidden_layers", minimum=1)
    heads, head_dim = config.int("num_attention_heads", minimum=1), config.int("head_dim", minimum=1)
    rope_dim = int(head_dim * config.float("partial_rotary_factor", 64 / 512))
    if config.int("num_key_value_heads", 1) != 1 or config.int("n_shared_experts", 1) != 1:
        raise CheckpointError(
            f"{config.path}: DeepSeek-V4 has one shared key/value head and one shared expert; "
            "num_key_value_heads and n_shared_experts must be 1"
        )
    if config.float("hc_eps", HC_EPS) != HC_EPS:
        raise CheckpointError(
            f"{config.path}: hc_eps is {config.float('hc_eps')}, but Megatron-LM's hyper-connections use {HC_EPS}"
        )
    ratios = compress_ratios(config, layers)
    mtp_ratios = _mtp_ratios(config, mtp_layers, ratios)
    if set(ratios + mtp_ratios) - set(MEGATRON_RATIOS):
        log.warning(
            "%s: compress ratios %s: Megatron-LM dev's TransformerConfig accepts only %s; its code builds "
            "other ratios alike, but a launch refuses them",
            config.path,
            ratios + mtp_ratios,
            MEGATRON_RATIOS,
        )
    experts, ffn = (
        config.first_int(*E_ROUTED),
        config.int("moe_intermediate_size", minimum=1),
    )
    vocab = config.int("vocab_size", minimum=1)
    positions = config.int("max_position_embeddings", 4096, minimum=1)
    return local_spec_args(
        num_layers=layers,
        hidden_size=config.int("hidden_size", minimum=1),
        num_attention_heads=heads,
        num_query_groups=heads,
        kv_channels=head_dim,
        group_query_attention=False,
        multi_latent_attention=True,
        q_lora_rank=config.int("q_lora_rank", minimum=1),
        qk_pos_emb_head_dim=rope_dim,
        v_head_dim=head_dim,
        qk_head_dim=head_dim - rope_dim,
        kv_lora_rank=head_dim - rope_dim,  # as Megatron derives
        qk_layernorm=True,
        o_groups=config.int("o_groups", minimum=1),
        o_lora_rank=config.int("o_lora_rank", minimum=1),
        experimental_attention_variant=VARIANT,
        csa_window_size=config.int("sliding_window", minimum=1),
        csa_compress_ratios=ratios + mtp_ratios,
        **_rope_args(config),
        dsa_indexer_n_heads=config.int("index_n_heads", minimum=1),
        dsa_indexer_head_dim=config.int("index_head_dim", minimum=1),
        dsa_indexer_topk=config.int("index_topk", minimum=1),
        num_experts=experts,
        moe_ffn_hidden_size=ffn,
        moe_layer_freq=[1] * layers,
        moe_shared_expert_intermediate_size=ffn,
        moe_router_topk=config.int("num_experts_per_tok", minimum=1),
        moe_router_score_function=config.str("scoring_func", "sqrtsoftplus"),
        moe_router_enable_expert_bias=True,
        moe_router_pre_softmax=False,
        moe_router_num_groups=None,
        moe_router_group_topk=None,
        moe_router_topk_scaling_factor=config.float("routed_scaling_factor", 1.0),
        moe_router_load_balancing_type="seq_aux_loss",
        moe_router_dtype="fp32",
        moe_n_hash_layers=hash_layers(config, layers),
        activation_func_clamp_value=config.float("swiglu_limit", 10.0),
        enable_hyper_connections=True,
        num_residual_streams=config.int("hc_mult", minimum=1),
        mhc_sinkhorn_iterations=config.int("hc_sinkhorn_iters", 20, minimum=1),
        norm_epsilon=config.float("rms_norm_eps", 1e-6),
        untie_embeddings_and_output_weights=not config.bool("tie_word_embeddings", False),
        padded_vocab_size=vocab,
        vocab_size=vocab,
        seq_length=positions,
        max_position_embeddings=positions,
        mtp_num_layers=mtp_layers or None,
        transformer_impl="transformer_engine",
        **dtype_fields(config),
    )


# -- Megatron-LM dev args -> config.json ----------------------------------------------------------------


def claims(view) -> bool:
    return ma.arg_str(view.args, "experimental_attention_variant") == VARIANT


def _layer_types(args, layers: int) -> tuple[list[str], dict]:
    ratios = ma.arg_list(args, "csa_compress_ratios", needed=NAME)[:layers]
    heavy = sorted({r for r in ratios if r not in (0, CSA_RATIO)})
    if len(heavy) > 1:
        raise CheckpointError(
            f"Megatron args csa_compress_ratios {ratios} hold several heavy rates {heavy}; a "
            "DeepSeek-V4 config.json has one heavily compressed rate"
        )
    types = [SLIDING if r == 0 else CSA if r == CSA_RATIO else HCA for r in ratios]
    return types, {CSA: CSA_RATIO, HCA: heavy[0] if heavy else 128}


def config_from_args(args, spec) -> dict:
    """A DeepSeek-V4 config.json for a Megatron-LM DeepSeek-V4 (Megatron -> HF)."""
    require(
        args,
        [
            ("enable_hyper_connections", ma.arg_bool(args, "enable_hyper_connections"), True),
            ("multi_latent_attention", ma.arg_bool(args, "multi_latent_attention"), True),
            ("swiglu", ma.arg_bool(args, "swiglu"), True),
            ("add_bias_linear", ma.arg_bool(args, "add_bias_linear"), False),
            ("normalization", ma.arg_str(args, "normalization"), "RMSNorm"),
            ("moe_router_score_function", spec.score_function, "sqrtsoftplus"),
            ("moe_shared_expert_intermediate_size", spec.shared_expert_size, spec.moe_ffn_hidden_size),
            ("moe_layer_freq", list(spec.moe_layers), list(range(spec.num_layers))),
        ],
        NAME,
    )
    layers = spec.num_layers
    head_dim, rope_dim = (ma.arg_int(args, f, minimum=1) for f in ("v_head_dim", "qk_pos_emb_head_dim"))
    types, rates = _layer_types(args, layers)
    factor = ma.arg_float(args, "rotary_scaling_factor")
    compress = {
        "rope_type": "default",
        "rope_theta": ma.arg_float(args, "csa_compress_rotary_base"),
        "partial_rotary_factor": rope_dim / head_dim,
    }
    if factor != 1.0:
        compress.update(
            rope_type="yarn",
            factor=factor,
            attention_factor=1.0,
            original_max_position_embeddings=ma.arg_int(args, "original_max_position_embeddings", minimum=1),
            beta_fast=ma.arg_float(args, "beta_fast"),
            beta_slow=ma.arg_float(args, "beta_slow"),
        )
    main = {
        "rope_type": "default",
        "rope_theta": ma.arg_float(args, "rotary_base"),
        "partial_rotary_factor": rope_dim / head_dim,
    }
    hashed = ma.arg_int(args, "moe_n_hash_layers", maximum=layers)
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "deepseek_v4",
        "vocab_size": ma.arg_int(args, "padded_vocab_size", minimum=1),
        "hidden_size": spec.hidden_size,
        "moe_intermediate_size": int(spec.moe_ffn_hidden_size),
        "num_hidden_layers": layers,
        "num_attention_heads": ma.arg_int(args, "num_attention_heads", minimum=1),
        "num_key_value_heads": 1,
        "head_dim": head_dim,
        "q_lora_rank": ma.arg_int(args, "q_lora_rank", minimum=1, needed=NAME),
        "partial_rotary_factor": rope_dim / head_dim,
        "o_groups": ma.arg_int(args, "o_groups", minimum=1),
        "o_lora_rank": ma.arg_int(args, "o_lora_rank", minimum=1),
        "layer_types": types,
        "compress_rates": rates,
        "sliding_window": ma.arg_int(args, "csa_window_size", minimum=1),
        "index_n_heads": ma.arg_int(args, "dsa_indexer_n_heads", minimum=1, needed=NAME),
        "index_head_dim": ma.arg_int(args, "dsa_indexer_head_dim", minimum=1, needed=NAME),
        "index_topk": ma.arg_int(args, "dsa_indexer_topk", minimum=1, needed=NAME),
        "mlp_layer_types": ["hash_moe"] * hashed + ["moe"] * (layers - hashed),
        "n_shared_experts": 1,
        "scoring_func": "sqrtsoftplus",
        "norm_topk_prob": True,
        "routed_scaling_factor": ma.topk_scaling_factor(args),
        "swiglu_limit": ma.arg_float(args, "activation_func_clamp_value") or 10.0,
        "hc_mult": ma.arg_int(args, "num_residual_streams", minimum=1),
        "hc_sinkhorn_iters": ma.arg_int(args, "mhc_sinkhorn_iterations", minimum=1),
        "hc_eps": HC_EPS,
        "rope_theta": main["rope_theta"],
        "compress_rope_theta": compress["rope_theta"],
        "rope_parameters": {"main": main, "compress": compress},
        "max_position_embeddings": ma.max_position_embeddings(args),
        "rms_norm_eps": ma.norm_epsilon(args),
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": not ma.arg_bool(args, "untie_embeddings_and_output_weights"),
        "num_nextn_predict_layers": spec.mtp_layers,
        "dtype": dtype_name(args),
    }


MAPPING = MegatronMapping(
    (ARCHITECTURE,),
    ROWS,
    args_from_config,
    config_from_args,
    mtp_prefix="mtp.{k}.",
    claims=claims,
    variants=frozenset({MTP_MODEL_LAYER}),
    hash_table=("mlp.router.tid2eid", ("int64", "int32")),
)
