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
from mcore_proxy.estimate.model import count_parameters, expert_flops_per_token, mtp_params
from mcore_proxy.estimate.sources import from_megatron_args, from_preset, merge
from mcore_proxy.testing.fixtures import FIXTURES


def arch_of(view, source="fixture"):
    return merge(from_megatron_args(view.args, view.names(), source))


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
    layout = Layout(tp=src.tp, pp=src.pp, ep=src.ep, etp=src.etp, dp=max(1, src.ep * src.etp // src.tp),
                    stages=tuple(src.stage_layers or stage_layers(arch.num_layers, src.pp)))
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
            gpt = GPTModel(config, spec, vocab_size=vocab, max_sequence_length=16, mtp_block_spec=mtp,
                           position_embedding_type="rope", share_embeddings_and_output_weights=False)
            sizes.append({k: v.numel() for k, v in gpt.state_dict().items() if isinstance(v, torch.Tensor)})
        torch.save(sizes, out)
    finally:
        destroy_distributed()


_COMMON = dict(num_layers=3, hidden_size=64, num_attention_heads=8, num_query_groups=2, kv_channels=16,
               ffn_hidden_size=96, moe_ffn_hidden_size=24, moe_router_topk=2, moe_layer_freq=[0, 1, 1],
               moe_router_load_balancing_type="none", moe_token_dispatcher_type="allgather",
               gated_linear_unit=True, normalization="RMSNorm", use_cpu_initialization=True,
               params_dtype=torch.float32)
# megatron-core refuses biases with shared experts: one model has the shared experts, one the biases
MODELS = {
    "gqa-qknorm-shared-gate-mtp": dict(num_moe_experts=8, moe_shared_expert_intermediate_size=40,
                                       moe_shared_expert_gate=True, moe_router_score_function="sigmoid",
                                       moe_router_enable_expert_bias=True, qk_layernorm=True,
                                       add_bias_linear=False, mtp_num_layers=1),
    "gqa-biases": dict(num_moe_experts=4, add_bias_linear=True, mtp_num_layers=None),
}


def _as_args(kw: dict):
    """The same model as Megatron training's argparse names would give it."""
    names = dict(num_experts=kw["num_moe_experts"], swiglu=True, group_query_attention=True,
                 padded_vocab_size=96, untie_embeddings_and_output_weights=True)
    rename = {"num_moe_experts": None, "gated_linear_unit": None, "use_cpu_initialization": None,
              "params_dtype": None, "moe_shared_expert_intermediate_size": "moe_shared_expert_intermediate_size"}
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
    arch = merge(from_megatron_args(_as_args({**_COMMON, **MODELS[model]}), [], "args"))
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


def _megatron_theoretical(a) -> int:
    """megatron/training/theoretical_memory_usage.py's parameter formula (Megatron-LM), which
    leaves out the router, the expert bias, q/k norms of GQA and the MTP projections."""
    h, norm = a.hidden_size, 1
    m = a.mla
    q = m.q_lora_rank * (h + a.num_attention_heads * (m.qk_head_dim + m.qk_pos_emb_head_dim) + norm)
    attn = (q + m.kv_lora_rank * (h + a.num_attention_heads * (m.qk_head_dim + m.v_head_dim) + norm)
            + h * m.qk_pos_emb_head_dim + a.num_attention_heads * m.v_head_dim * h)
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
        left_out += (a.num_layers + a.mtp_layers) * (i.n_heads * i.head_dim * r + i.head_dim * a.hidden_size
                                                     + 2 * i.head_dim + i.n_heads * a.hidden_size)
    assert ours == _megatron_theoretical(a) + left_out


def test_expert_flops_per_token_do_not_depend_on_the_number_of_experts():
    a = merge(from_preset("qwen3-30b-a3b"))
    assert expert_flops_per_token(a) == expert_flops_per_token(a.with_experts(48))
    assert expert_flops_per_token(a) == 8 * 2 * 3 * 2048 * 768 * 48
