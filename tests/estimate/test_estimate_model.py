"""Parameter counts of `estimate` against real megatron-core models and checkpoints.

The checkpoint fixtures were saved by megatron-core at TP/PP/EP/ETP layouts: the unique totals
must equal the sum of their canonical tensor sizes, and the per-device count at the saved layout
the sum of each rank file's tensor sizes. A model megatron-core builds in a spawned gloo rank
(GQA, q/k norms, biases, shared-expert gate, MTP) checks the terms the fixtures do not have.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from mcore_proxy.checkpoint import open_checkpoint
from mcore_proxy.checkpoint.torchfile import TorchFile
from mcore_proxy.estimate.memory import Layout, device_params, stage_layers, stage_params
from mcore_proxy.estimate.model import (
    activated_parameters,
    all_mtp_params,
    attention_params,
    compress_ratio,
    count_parameters,
    expert_flops_per_token,
    mtp_params,
    with_experts,
)
from mcore_proxy.mcore.spec import ModelSpec
from mcore_proxy.checkpoint.hf import spec_fields_from_config
from mcore_proxy.estimate.sources import from_preset, from_spec, merge
from mcore_proxy.testing.fixtures import FIXTURES


def arch_of(view, source="fixture"):
    return merge(from_spec(view.spec, view.names(), source))


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_counts_equal_the_checkpoint_tensor_sizes(megatron_ckpt, name):
    ckpt, _ = megatron_ckpt(name)
    view = open_checkpoint(ckpt)
    sizes = {n: math.prod(view.shape(n)) for n in view.names()}
    counted = count_parameters(arch_of(view))
    assert counted.total == sum(sizes.values())
    assert counted.experts == sum(v for n, v in sizes.items() if re.search(r"\.mlp\.experts\.\d+\.", n))
    assert counted.non_expert == counted.total - counted.experts
    assert counted.buffers == sum(v for n, v in sizes.items() if n.endswith("router.expert_bias"))


def _rank_coords(folder: str, args) -> tuple[int, int, int]:
    """mp_rank_TT[_PPP][_EEE] -> (tp, pp, ep)."""
    parts = [int(x) for x in folder.split("_")[2:]]
    tp = parts.pop(0)
    pp = parts.pop(0) if args.pipeline_model_parallel_size > 1 else 0
    ep = parts.pop(0) if args.expert_model_parallel_size > 1 else 0
    return tp, pp, ep


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_per_device_counts_equal_each_rank_file(megatron_ckpt, name):
    """Every rank file holds what one device of that (TP, PP, EP) coordinate holds."""
    ckpt, _ = megatron_ckpt(name)
    view = open_checkpoint(ckpt)
    arch, args = arch_of(view), view.args
    src = view.layout
    layout = Layout(
        tp=src.tp,
        pp=src.pp,
        ep=src.ep,
        etp=src.etp,
        dp=max(1, src.ep * src.etp // src.tp),
        stages=tuple(src.stage_layers or stage_layers(arch.num_layers, src.pp)),
    )
    stages = stage_params(arch, layout.stages)
    folders = sorted(p for p in (ckpt / "iter_0000010").iterdir() if p.name.startswith("mp_rank_"))
    assert folders
    for folder in folders:
        tensors = TorchFile(folder / "model_optim_rng.pt").obj["model"]
        held = sum(t.shape.numel() for t in tensors.values() if hasattr(t, "shape"))
        _, pp, _ = _rank_coords(folder.name, args)
        assert sum(device_params(stages[pp], layout)) == held, folder.name


def _build_and_count(rank, world, port, models, out):
    """In a spawned gloo rank: megatron-core builds each model; write their state-dict sizes."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from mcore_proxy.functional.cpu import destroy_distributed, init_distributed

    init_distributed(rank, world, port)
    try:
        sizes = []
        for kwargs, vocab in models:
            config = TransformerConfig(**kwargs)
            spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
            mtp = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False) if config.mtp_num_layers else None
            gpt = GPTModel(
                config,
                spec,
                vocab_size=vocab,
                max_sequence_length=16,
                mtp_block_spec=mtp,
                position_embedding_type="rope",
                share_embeddings_and_output_weights=False,
            )
            sizes.append({k: v.numel() for k, v in gpt.state_dict().items() if isinstance(v, torch.Tensor)})
        torch.save(sizes, out)
    finally:
        destroy_distributed()


_COMMON = dict(
    num_layers=3,
    hidden_size=64,
    num_attention_heads=8,
    num_query_groups=2,
    kv_channels=16,
    ffn_hidden_size=96,
    moe_ffn_hidden_size=24,
    moe_router_topk=2,
    moe_layer_freq=[0, 1, 1],
    moe_router_load_balancing_type="none",
    moe_token_dispatcher_type="allgather",
    gated_linear_unit=True,
    normalization="RMSNorm",
    use_cpu_initialization=True,
    params_dtype=torch.float32,
)
# megatron-core refuses biases with shared experts: one model has the shared experts, one the biases
MODELS = {
    "gqa-qknorm-shared-gate-mtp": dict(
        num_moe_experts=8,
        moe_shared_expert_intermediate_size=40,
        moe_shared_expert_gate=True,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        qk_layernorm=True,
        add_bias_linear=False,
        mtp_num_layers=1,
    ),
    "gqa-biases": dict(num_moe_experts=4, add_bias_linear=True, mtp_num_layers=None),
}


def _as_args(kw: dict):
    """The same model as Megatron training's argparse names would give it."""
    names = dict(
        num_experts=kw["num_moe_experts"],
        swiglu=True,
        group_query_attention=True,
        padded_vocab_size=96,
        untie_embeddings_and_output_weights=True,
    )
    rename = {
        "num_moe_experts": None,
        "gated_linear_unit": None,
        "use_cpu_initialization": None,
        "params_dtype": None,
        "moe_shared_expert_intermediate_size": "moe_shared_expert_intermediate_size",
    }
    for k, v in kw.items():
        if rename.get(k, k):
            names[rename.get(k, k)] = v
    return type("Args", (), names)()


@pytest.fixture(scope="module")
def built_sizes(tmp_path_factory):
    from mcore_proxy.functional.cpu import free_port

    out = tmp_path_factory.mktemp("built") / "sizes.pt"
    models = [({**_COMMON, **kw}, 96) for kw in MODELS.values()]
    torch.multiprocessing.spawn(_build_and_count, args=(1, free_port(), models, str(out)), nprocs=1, join=True)
    return dict(zip(MODELS, torch.load(out)))


@pytest.mark.parametrize("model", sorted(MODELS))
def test_counts_equal_a_model_megatron_core_builds(built_sizes, model):
    sizes = built_sizes[model]
    arch = merge(from_spec(ModelSpec.from_args(_as_args({**_COMMON, **MODELS[model]})), [], "args"))
    counted = count_parameters(arch)
    assert counted.total == sum(sizes.values())
    assert counted.experts == sum(v for k, v in sizes.items() if ".experts." in k and "shared" not in k)
    assert mtp_params(arch).total * arch.mtp_layers == sum(v for k, v in sizes.items() if k.startswith("mtp."))


def test_presets_reproduce_the_published_sizes():
    """Qwen3-30B-A3B: 30.5 B (its model card); DeepSeek-V3: 671 B main model and one MTP module
    of 11.5 B unique parameters (DeepSeek's README_WEIGHTS), ~37 B activated per token."""
    qwen = merge(from_preset("qwen3-30b-a3b"))
    assert round(count_parameters(qwen).total / 1e9, 1) == 30.5
    ds = merge(from_preset("deepseek-v3"))
    mtp = mtp_params(ds).total
    assert round((count_parameters(ds).total - mtp) / 1e9) == 671
    assert abs(mtp - 11.5e9) / 11.5e9 < 0.015
    count, mtp_layer = count_parameters(ds), mtp_params(ds)
    per_expert = count.experts // (ds.num_experts * (len(ds.moe_layers) + 1))
    active = count.non_expert - (mtp_layer.total - mtp_layer.expert) + ds.topk * per_expert * len(ds.moe_layers)
    assert round(active / 1e9, 1) == 37.6


# Total and activated parameters as each publisher states them (billions), and where. Totals are
# of the main model, MTP layers left out (DeepSeek-V3's 671 B is counted so, and DeepSeek-V4-Flash's
# 284 B matches only so); activated as `activated_parameters` counts them, without the embedding
# table (gpt-oss's 5.1 B and DeepSeek-V3's 37 B leave it out too).
PUBLISHED = {
    # DeepSeek-V4 model card (huggingface.co/deepseek-ai/DeepSeek-V4-Flash, -Pro): "DeepSeek-V4-Pro
    # with 1.6T parameters (49B activated) and DeepSeek-V4-Flash with 284B parameters (13B activated)"
    "deepseek-v4-flash": (284, 13),
    "deepseek-v4-pro": (1600, 49),
    # Qwen3.5-397B-A17B model card (huggingface.co/Qwen/Qwen3.5-397B-A17B): 397B total, 17B
    # activated; Qwen3.5-35B-A3B by its name (35 B total, 3 B activated)
    "qwen3.5-397b-a17b": (397, 17),
    "qwen3.5-35b-a3b": (35, 3),
    # zai-org/GLM-4.5 README.md: "355 billion total parameters with 32 billion active parameters"
    "glm-4.5": (355, 32),
    # MoonshotAI/Kimi-K2 README.md, Model Summary: Total Parameters 1T, Activated Parameters 32B
    "kimi-k2": (1000, 32),
    # openai/gpt-oss README.md: "117B parameters with 5.1B active parameters"
    "gpt-oss-120b": (117, 5.1),
}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_presets_match_the_published_total_and_activated_parameters(preset):
    """Within 3 % of the published total and 5 % of the published activated count (both rounded
    by their publishers: "1.6T", "17B")."""
    a = merge(from_preset(preset))
    total = count_parameters(a).total - all_mtp_params(a).total
    activated = activated_parameters(a)
    published_total, published_activated = PUBLISHED[preset]
    assert abs(total / 1e9 / published_total - 1) < 0.03, f"{total / 1e9:.2f} B"
    assert abs(activated / 1e9 / published_activated - 1) < 0.05, f"{activated / 1e9:.2f} B"


# A tiny config.json of each new family and the size of the model transformers 5.24 builds from it
# (its state dict summed, persistent buffers included: DeepSeek-V4's tid2eid and expert bias);
# transformers builds no MTP layer, so MTP layers are left out. Measured with
# getattr(transformers, Config)(**cfg) and the family's ...ForCausalLM (kimi_k2 as DeepseekV3).
_TINY = dict(
    vocab_size=128, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False
)
_GDN = dict(
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=24,
)
TRANSFORMERS_SIZES = {
    # hash-routed layer 0, sliding / compressed sparse (indexer) / heavily compressed attention, mHC
    "deepseek_v4": (
        dict(
            _TINY,
            model_type="deepseek_v4",
            hidden_size=64,
            moe_intermediate_size=32,
            num_hidden_layers=4,
            num_key_value_heads=1,
            head_dim=32,
            q_lora_rank=16,
            o_groups=2,
            o_lora_rank=16,
            index_n_heads=2,
            index_head_dim=16,
            layer_types=[
                "sliding_attention",
                "compressed_sparse_attention",
                "heavily_compressed_attention",
                "compressed_sparse_attention",
            ],
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
            mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
            hc_mult=4,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            num_nextn_predict_layers=1,
        ),
        359045,
    ),
    # Gated DeltaNet beside gated attention, a gated shared expert, every layer MoE
    "qwen3_5_moe_text": (
        dict(
            _TINY,
            **_GDN,
            model_type="qwen3_5_moe_text",
            num_hidden_layers=4,
            layer_types=["linear_attention", "full_attention"] * 2,
        ),
        85472,
    ),
    # the same through full_attention_interval, with a dense first layer
    "qwen3_next": (
        dict(
            _TINY,
            **_GDN,
            model_type="qwen3_next",
            intermediate_size=64,
            num_hidden_layers=4,
            mlp_only_layers=[0],
            full_attention_interval=2,
        ),
        76736,
    ),
    # q/k/v biases, q/k norms, a dense first layer, shared expert, MTP
    "glm4_moe": (
        dict(
            _TINY,
            model_type="glm4_moe",
            intermediate_size=64,
            num_hidden_layers=3,
            attention_bias=True,
            use_qk_norm=True,
            first_k_dense_replace=1,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            n_group=2,
            topk_group=1,
            num_nextn_predict_layers=1,
        ),
        52192,
    ),
    # MLA, one dense layer, sigmoid routing in one group
    "kimi_k2": (
        dict(
            _TINY,
            model_type="kimi_k2",
            intermediate_size=64,
            num_key_value_heads=4,
            num_hidden_layers=3,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=8,
            first_k_dense_replace=1,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            n_group=1,
            topk_group=1,
        ),
        54736,
    ),
    # biased q/k/v/o, router and experts, sinks
    "gpt_oss": (
        dict(
            _TINY,
            model_type="gpt_oss",
            intermediate_size=32,
            num_hidden_layers=2,
            num_local_experts=8,
            num_experts_per_tok=2,
        ),
        65912,
    ),
}


@pytest.mark.parametrize("family", sorted(TRANSFORMERS_SIZES))
def test_counts_equal_what_transformers_builds(family):
    cfg, size = TRANSFORMERS_SIZES[family]
    a = merge(spec_fields_from_config(cfg, family))
    assert count_parameters(a).total - all_mtp_params(a).total == size


def test_deepseek_v4_mtp_layer_is_the_release_s():
    """DeepSeek-V4-Pro's MTP layer as DeepSeek's inference/model.py builds it (MTPBlock: a Block of
    layer id 61, whose compress ratio, the release's 62nd, is 0: sliding window only, no compressor;
    e_proj, h_proj, enorm, hnorm, norm, its own hc_head) with the release's shapes."""
    pro = merge(from_preset("deepseek-v4-pro"))
    h, heads, hd, q, og, ol, e, f, hc = 7168, 128, 512, 1536, 16, 1024, 384, 3072, 4
    # attn_sink, kv_norm, q_norm, wkv, wo_a, wo_b, wq_a, wq_b
    attention = heads + hd + q + hd * h + og * ol * (heads * hd // og) + h * og * ol + q * h + heads * hd * q
    moe = e * 3 * f * h + e + e * h + 3 * f * h  # routed experts, gate.bias, gate.weight, shared expert
    mhc = 2 * ((2 + hc) * hc * hc * h + (2 + hc) * hc + 3) + (hc * hc * h + hc + 1)  # hc_attn, hc_ffn, hc_head
    expected = attention + moe + mhc + 2 * h * h + 5 * h  # e_proj, h_proj; attn/ffn norms, enorm, hnorm, norm
    assert compress_ratio(pro, pro.num_layers) == 0 and pro.hash_layers == (0, 1, 2)
    assert mtp_params(pro).total == expected
    flash = merge(from_preset("deepseek-v4-flash"))
    assert attention_params(flash, flash.num_layers) == attention_params(flash, 0)  # both sliding only


def _megatron_theoretical(a) -> int:
    """megatron/training/theoretical_memory_usage.py's parameter formula (Megatron-LM), which
    leaves out the router, the expert bias, q/k norms of GQA and the MTP projections."""
    h, norm = a.hidden_size, 1
    m = a.mla
    q = m.q_lora_rank * (h + a.num_attention_heads * (m.qk_head_dim + m.qk_pos_emb_head_dim) + norm)
    attn = (
        q
        + m.kv_lora_rank * (h + a.num_attention_heads * (m.qk_head_dim + m.v_head_dim) + norm)
        + h * m.qk_pos_emb_head_dim
        + a.num_attention_heads * m.v_head_dim * h
    )
    dense = 2 * h * (a.ffn_hidden_size * 3 / 2 + norm) + attn
    moe = 2 * h * (a.moe_ffn_hidden_size * a.num_experts * 3 / 2 + a.shared_expert_size * 3 / 2 + norm) + attn
    n_moe = len(a.moe_layers)
    block = dense * (a.num_layers - n_moe) + moe * n_moe + h
    return int(block + moe * a.mtp_layers + 2 * h * a.vocab_size)


@pytest.mark.parametrize("preset", ["deepseek-v3", "deepseek-v3.2"])
def test_mla_counts_agree_with_megatrons_theoretical_formula(preset):
    a = merge(from_preset(preset))
    ours = count_parameters(a).total
    left_out = (len(a.moe_layers) + a.mtp_layers) * (a.num_experts * a.hidden_size + a.num_experts)
    left_out += a.mtp_layers * (2 * a.hidden_size * a.hidden_size + 3 * a.hidden_size)
    if a.indexer:
        i, r = a.indexer, a.mla.q_lora_rank
        left_out += (a.num_layers + a.mtp_layers) * (
            i.n_heads * i.head_dim * r + i.head_dim * a.hidden_size + 2 * i.head_dim + i.n_heads * a.hidden_size
        )
    assert ours == _megatron_theoretical(a) + left_out


def test_expert_flops_per_token_do_not_depend_on_the_number_of_experts():
    a = merge(from_preset("qwen3-30b-a3b"))
    assert expert_flops_per_token(a) == expert_flops_per_token(with_experts(a, 48))
    assert expert_flops_per_token(a) == 8 * 2 * 3 * 2048 * 768 * 48
