"""The DeepSeek-V3- and Qwen3-MoE-shaped fixtures: saved by megatron-core as Megatron training
saves them, in both formats, and loaded back by megatron-core at the saved and at other layouts.

Both fixtures are filled with layout-independent global weights (testing/global_weights.py), so
every rank-local shard must equal its slice of the global tensor, and a model loaded at any
layout must compute the reference logits. The fixtures are built once per session (cached with
MCORE_PROXY_FIXTURE_CACHE); one more set of ranks runs every load.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from mcore_proxy.mcore.pipeline_layout import parse_pipeline_layout
from mcore_proxy.testing import global_weights
from mcore_proxy.testing.families import DEEPSEEK_V3, QWEN3_MOE, StagedLayout, iteration_dir, load_and_run

pytestmark = [pytest.mark.megatron, pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")]

CLOSE = dict(rtol=1e-4, atol=1e-4)  # fp32 logits of size ~1; another TP/EP/expert module reorders sums


def _rank_file(ckpt, folder: str) -> dict:
    return torch.load(
        iteration_dir(ckpt.legacy) / folder / "model_optim_rng.pt", map_location="cpu", weights_only=False
    )


def _folders(ckpt) -> list[str]:
    return sorted(p.name for p in iteration_dir(ckpt.legacy).iterdir())


# -- legacy files ------------------------------------------------------------------------------


def test_deepseek_legacy_is_shaped_like_megatron_training(family_ckpt):
    ckpt = family_ckpt["deepseek_v3_mla"]
    # TP=2 x EP=2 with ETP=1 on 4 ranks: (tp, ep) = (0, 0) and (1, 1) only, per PP rank
    assert _folders(ckpt) == ["mp_rank_00_000_000", "mp_rank_00_001_000", "mp_rank_01_000_001", "mp_rank_01_001_001"]
    state = _rank_file(ckpt, "mp_rank_00_000_000")
    assert {
        "args",
        "checkpoint_version",
        "iteration",
        "model0",
        "model1",
        "optimizer",
        "opt_param_scheduler",
        "rng_state",
    } <= set(state) and "model" not in state
    args = state["args"]
    assert (args.pipeline_model_parallel_layout, args.virtual_pipeline_model_parallel_size) == ("Ettt|tt|m|L", 2)
    assert (args.multi_latent_attention, args.q_lora_rank, args.kv_lora_rank, args.mtp_num_layers) == (True, 20, 12, 1)
    assert args.num_layers_per_virtual_pipeline_stage is None and args.transformer_impl == "local"
    # pp 0: vp 0 = embedding + layers 0-2 (dense), vp 1 = the MTP layer with its own embedding copy
    m0, m1 = state["model0"], state["model1"]
    assert _layers(m0) == [0, 1, 2] and "embedding.word_embeddings.weight" in m0
    assert _layers(m1) == [] and "embedding.word_embeddings.weight" in m1 and "output_layer.weight" not in m1
    assert any(k.startswith("mtp.layers.0.transformer_layer.mlp.router") for k in m1)
    # pp 1: vp 0 = layers 3-4 (MoE) and the final norm (MTP: beside the last decoder layer), vp 1 = loss only
    last = _rank_file(ckpt, "mp_rank_00_001_000")
    assert _layers(last["model0"]) == [0, 1] and "decoder.final_layernorm.weight" in last["model0"]
    assert sorted(k for k in last["model1"] if not k.endswith("_extra_state")) == ["output_layer.weight"]
    layout = parse_pipeline_layout(args.pipeline_model_parallel_layout, 2, 5, 1)
    assert layout.final_norm_stage == layout.stage(1, 0) and layout.mtp_standalone


def _layers(model_state) -> list[int]:
    return sorted({int(m.group(1)) for k in model_state if (m := re.match(r"decoder\.layers\.(\d+)\.", k))})


# rank-local shapes at TP=2, ETP=1 (H=32, 4 heads, q_lora 20, kv_lora 12, qk 8, rope 4, v 6, F=8)
DEEPSEEK_LOCAL = {
    "self_attention.linear_q_down_proj.weight": (10, 32),  # column-parallel in the local spec
    "self_attention.linear_q_up_proj.weight": (24, 20),  # 2 heads x (8 + 4)
    "self_attention.linear_kv_down_proj.weight": (8, 32),  # (12 + 4) / 2
    "self_attention.linear_kv_up_proj.weight": (28, 12),  # 2 heads x (8 + 6)
    "self_attention.linear_proj.weight": (32, 12),  # row-parallel: 2 heads x 6
    "self_attention.q_layernorm.weight": (20,),
    "self_attention.kv_layernorm.weight": (12,),
    "input_layernorm.weight": (32,),
    "pre_mlp_layernorm.weight": (32,),
}


def test_deepseek_mla_shards(family_ckpt):
    state = _rank_file(family_ckpt["deepseek_v3_mla"], "mp_rank_01_001_001")["model0"]
    for suffix, shape in DEEPSEEK_LOCAL.items():
        assert tuple(state[f"decoder.layers.0.{suffix}"].shape) == shape, suffix
    assert tuple(state["decoder.layers.0.mlp.router.weight"].shape) == (32, 32)
    assert state["decoder.layers.0.mlp.router.expert_bias"].dtype == torch.float32
    experts = {
        int(m.group(1))
        for k in state
        if (m := re.match(r"decoder\.layers\.0\.mlp\.experts\.local_experts\.(\d+)\.", k))
    }
    assert experts == set(range(16))  # 32 experts over EP=2
    assert tuple(state["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"].shape) == (16, 32)  # ETP=1


def _canonical(key: str, layer_ids: tuple[int, ...], ep_rank: int, local_experts: int) -> str:
    """Canonical name of a rank-local key (global layer, global expert)."""
    m = re.match(r"decoder\.layers\.(\d+)\.(.*)$", key)
    if m:
        key = f"decoder.layers.{layer_ids[int(m.group(1))]}.{m.group(2)}"
    m = re.match(r"(.*\.mlp\.experts\.)local_experts\.(\d+)\.(.*)$", key)
    if m:
        key = f"{m.group(1)}{ep_rank * local_experts + int(m.group(2))}.{m.group(3)}"
    return key


def _expected_shard(name, local_shape, tp_rank, tp, seed, router_std, expert_tp=1):
    kind = global_weights.kind_of(name)
    rank, size = (0, expert_tp) if ".experts." in name else (tp_rank, tp)
    full = global_weights.global_tensor(
        name, global_weights._sharded_shape(local_shape, kind, size), kind, seed, router_std
    )
    return global_weights._split(full, kind, rank, size)


@pytest.mark.parametrize("name", ["deepseek_v3_mla", "qwen3_moe"])
def test_legacy_shards_are_slices_of_the_global_weights(family_ckpt, name):
    """Every parameter of every rank file is its TP slice of the global tensor at its global layer
    and expert: the shard table of docs/families.md, proven on the files."""
    ckpt = family_ckpt[name]
    lay, model = ckpt.layout, ckpt.model
    layout = parse_pipeline_layout(
        lay.pipeline_layout or "E" + "|".join(["t" * (model.num_layers // lay.pp)] * lay.pp) + "L",
        lay.pp,
        model.num_layers,
        model.mtp_layers,
    )
    checked = 0
    for folder in _folders(ckpt):
        tp_rank, pp_rank, ep_rank = (int(x) for x in re.match(r"mp_rank_(\d+)_(\d+)_(\d+)", folder).groups())
        state = _rank_file(ckpt, folder)
        chunks = [k for k in state if re.fullmatch(r"model\d*", k)]
        for vp, key in enumerate(chunks):
            stage = layout.stage(pp_rank, vp)
            for local, value in state[key].items():
                if local.endswith("_extra_state") or local.endswith("expert_bias"):
                    continue
                if ".experts.weight" in local:
                    checked += _check_grouped(local, value, stage.decoder, ep_rank, ckpt)
                    continue
                canon = _canonical(local, stage.decoder, ep_rank, model.num_experts // lay.ep)
                want = _expected_shard(canon, value.shape, tp_rank, lay.tp, ckpt.seed, model.router_std)
                assert torch.equal(value, want), (folder, key, local)
                checked += 1
    assert checked > 100


def _check_grouped(local: str, value, layer_ids, ep_rank: int, ckpt) -> int:
    """GroupedMLP weight1 [H, E_local*2F] is [E_local][H][2F] in memory, weight2 [E_local*F, H] is
    [E_local][F][H] (DESIGN.md 7): expert j's block, transposed, is its fc1 [2F, H] / fc2 [H, F]."""
    model, lay = ckpt.model, ckpt.layout
    n_local, hidden = model.num_experts // lay.ep, model.hidden_size
    m = re.match(r"decoder\.layers\.(\d+)\.mlp\.experts\.weight([12])$", local)
    layer, which = layer_ids[int(m.group(1))], m.group(2)
    view = value.view(n_local, hidden, -1) if which == "1" else value.view(n_local, -1, hidden)
    for j in range(n_local):
        fc = "linear_fc1" if which == "1" else "linear_fc2"
        canon = f"decoder.layers.{layer}.mlp.experts.{ep_rank * n_local + j}.{fc}.weight"
        kind = global_weights.kind_of(canon)
        want = global_weights.global_tensor(canon, view[j].t().shape, kind, ckpt.seed, model.router_std)
        assert torch.equal(view[j].t(), want), (local, j)
    return n_local


def test_qwen3_legacy_keys(family_ckpt):
    ckpt = family_ckpt["qwen3_moe"]
    assert _folders(ckpt) == ["mp_rank_00_000_000", "mp_rank_00_001_000", "mp_rank_01_000_001", "mp_rank_01_001_001"]
    first = _rank_file(ckpt, "mp_rank_01_000_001")
    m = first["model"]
    assert tuple(m["embedding.position_embeddings.weight"].shape) == (16, 32)  # replicated over TP
    assert tuple(m["decoder.layers.0.self_attention.linear_qkv.weight"].shape) == (48, 32)  # (4 q + 2x2 kv) x 12 / 2
    assert tuple(m["decoder.layers.0.self_attention.q_layernorm.weight"].shape) == (12,)
    assert tuple(m["decoder.layers.0.self_attention.k_layernorm.weight"].shape) == (12,)
    assert tuple(m["decoder.layers.0.self_attention.linear_proj.weight"].shape) == (32, 24)
    assert tuple(m["decoder.layers.0.mlp.experts.weight1"].shape) == (32, 16 * 16)  # [H, E_local * 2F], ETP=1
    assert tuple(m["decoder.layers.0.mlp.experts.weight2"].shape) == (16 * 8, 32)  # [E_local * F, H]
    assert "decoder.layers.0.pre_mlp_layernorm.weight" in m
    args = first["args"]
    assert (args.position_embedding_type, args.qk_layernorm, args.num_query_groups, args.kv_channels) == (
        "learned_absolute",
        True,
        2,
        12,
    )
    assert args.pipeline_model_parallel_layout is None and args.moe_grouped_gemm
    last = _rank_file(ckpt, "mp_rank_00_001_000")["model"]
    assert "embedding.position_embeddings.weight" not in last  # first stage only (no MTP)


# -- torch_dist files --------------------------------------------------------------------------


def _dist_metadata(ckpt):
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(iteration_dir(ckpt.torch_dist))).read_metadata().state_dict_metadata


def _dist_tensor(ckpt, key, shape):
    from torch.distributed.checkpoint import FileSystemReader, load

    out = {key: torch.empty(shape)}
    load(out, storage_reader=FileSystemReader(str(iteration_dir(ckpt.torch_dist))), no_dist=True)
    return out[key]


def test_deepseek_torch_dist_keys(family_ckpt):
    """Per-layer keys (dense and MoE layers differ), MLA norms under their own names (the local
    MLA spec maps no keys), down projections at full size, experts with an expert axis."""
    ckpt = family_ckpt["deepseek_v3_mla"]
    md = _dist_metadata(ckpt)
    shapes = {
        k: tuple(v.size) for k, v in md.items() if hasattr(v, "size") and not k.split("/")[0].endswith("_extra_state")
    }
    want = {
        "decoder.layers.0.input_layernorm.weight": (32,),
        "decoder.layers.0.self_attention.linear_q_down_proj.weight": (20, 32),
        "decoder.layers.0.self_attention.linear_q_up_proj.weight": (48, 20),
        "decoder.layers.0.self_attention.linear_kv_down_proj.weight": (16, 32),
        "decoder.layers.0.self_attention.linear_kv_up_proj.weight": (56, 12),
        "decoder.layers.0.self_attention.linear_proj.weight": (32, 24),
        "decoder.layers.0.mlp.linear_fc1.weight": (128, 32),
        "decoder.layers.3.mlp.experts.experts.linear_fc1.weight": (32, 16, 32),
        "decoder.layers.3.mlp.experts.experts.linear_fc2.weight": (32, 32, 8),
        "decoder.layers.3.mlp.shared_experts.linear_fc1.weight": (32, 32),
        "decoder.layers.4.mlp.router.expert_bias": (32,),
        "mtp.layers.0.eh_proj.weight": (32, 64),
        "mtp.layers.0.transformer_layer.self_attention.linear_q_down_proj.weight": (20, 32),
        "decoder.final_layernorm.weight": (32,),
        "embedding.word_embeddings.weight": (128, 32),
        "output_layer.weight": (128, 32),
    }
    for key, shape in want.items():
        assert shapes[key] == shape, key
    assert not any(k.startswith("decoder.layers.self_attention") for k in shapes)  # no stacked keys
    assert not any("layer_norm_weight" in k for k in shapes)
    key = "decoder.layers.3.self_attention.linear_kv_down_proj.weight"
    assert torch.equal(
        _dist_tensor(ckpt, key, (16, 32)),
        global_weights.global_tensor(key, (16, 32), "column", ckpt.seed, DEEPSEEK_V3.router_std),
    )


def test_qwen3_torch_dist_keys(family_ckpt):
    """Stacked keys with a layer axis (all layers alike), the local spec's norm key mapping, and
    GroupedMLP saved in the same expert-axis form as SequentialMLP."""
    ckpt = family_ckpt["qwen3_moe"]
    md = _dist_metadata(ckpt)
    shapes = {k: tuple(v.size) for k, v in md.items() if hasattr(v, "size") and "_extra_state" not in k}
    assert shapes == {
        "decoder.final_layernorm.weight": (32,),
        "decoder.layers.mlp.experts.experts.linear_fc1.weight": (4, 32, 16, 32),
        "decoder.layers.mlp.experts.experts.linear_fc2.weight": (4, 32, 32, 8),
        "decoder.layers.mlp.linear_fc1.layer_norm_weight": (4, 32),  # pre_mlp_layernorm
        "decoder.layers.mlp.router.weight": (4, 32, 32),
        "decoder.layers.self_attention.k_layernorm.weight": (4, 12),
        "decoder.layers.self_attention.linear_proj.weight": (4, 32, 48),
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": (4, 32),  # input_layernorm
        "decoder.layers.self_attention.linear_qkv.weight": (4, 96, 32),
        "decoder.layers.self_attention.q_layernorm.weight": (4, 12),
        "embedding.position_embeddings.weight": (16, 32),
        "embedding.word_embeddings.weight": (128, 32),
        "output_layer.weight": (128, 32),
    }
    # GroupedMLP also writes one byte-object `_extra_state` per (layer, expert)
    extra = [k for k in md if k.startswith("decoder.layers.mlp.experts.experts.linear_fc1._extra_state/")]
    assert len(extra) == 4 * 32
    key = "embedding.position_embeddings.weight"
    assert torch.equal(
        _dist_tensor(ckpt, key, (16, 32)),
        global_weights.global_tensor(key, (16, 32), "replicated", ckpt.seed, QWEN3_MOE.router_std),
    )


# -- loaded back by megatron-core ----------------------------------------------------------------

DEEPSEEK_OTHER = [
    StagedLayout(tp=1, pp=1, ep=4),  # no layout string, EP 4
    StagedLayout(tp=2, pp=2, ep=1, pipeline_layout="Etttt|tmL"),
]  # MTP beside the loss
QWEN3_OTHER = [StagedLayout(tp=1, pp=1, ep=4, grouped=False)]  # SequentialMLP


@pytest.fixture(scope="module")
def reloaded(family_ckpt, tmp_path_factory):
    """Every load in one set of ranks: (name, format, layout) -> logits [1 + mtp, b, s, V]."""
    out = tmp_path_factory.mktemp("reloaded")
    plan = []
    for name, others in (("deepseek_v3_mla", DEEPSEEK_OTHER), ("qwen3_moe", QWEN3_OTHER)):
        ckpt = family_ckpt[name]
        plan += [(name, "legacy", ckpt.layout), (name, "torch_dist", ckpt.layout)]
        plan += [(name, "torch_dist", lay) for lay in others]
    jobs = []
    for i, (name, fmt, lay) in enumerate(plan):
        ckpt = family_ckpt[name]
        jobs.append((ckpt.model, lay, fmt, getattr(ckpt, fmt), Path(out) / f"{i}.pt"))
    return dict(zip(plan, load_and_run(jobs)))


@pytest.mark.parametrize("name", ["deepseek_v3_mla", "qwen3_moe"])
def test_loads_at_the_saved_layout_reproduce_the_reference_exactly(family_ckpt, reloaded, name):
    ckpt = family_ckpt[name]
    ref = torch.load(ckpt.logits)
    assert ref.shape == (1 + ckpt.model.mtp_layers, 2, ckpt.model.seq_length, ckpt.model.vocab_size)
    for fmt in ("legacy", "torch_dist"):
        torch.testing.assert_close(reloaded[(name, fmt, ckpt.layout)], ref, rtol=0, atol=0)


@pytest.mark.parametrize(
    "name,layout", [("deepseek_v3_mla", lay) for lay in DEEPSEEK_OTHER] + [("qwen3_moe", lay) for lay in QWEN3_OTHER]
)
def test_torch_dist_loads_at_another_layout(family_ckpt, reloaded, name, layout):
    ref = torch.load(family_ckpt[name].logits)
    torch.testing.assert_close(reloaded[(name, "torch_dist", layout)], ref, **CLOSE)


def test_the_mtp_head_is_a_real_prediction(family_ckpt):
    """The MTP depth's logits are not a copy of the main head (the MTP layer really ran)."""
    ref = torch.load(family_ckpt["deepseek_v3_mla"].logits)
    assert (ref[0] - ref[1]).abs().max() > 0.1


# -- the readers ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["deepseek_v3_mla", "qwen3_moe"])
@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
def test_readers_open_the_family_fixtures(family_ckpt, name, fmt):
    """Every canonical tensor either reader yields equals the full tensor megatron-core saved
    (its torch_dist key, read by torch's own DCP loader), and every saved parameter is yielded:
    MLA in the local spec, the layout string with VPP and a standalone MTP stage (its embedding
    copy), learned absolute positions, GroupedMLP."""
    from mcore_proxy.checkpoint import open_checkpoint
    from mcore_proxy.checkpoint.names import KeyStyle

    ckpt = family_ckpt[name]
    view = open_checkpoint(getattr(ckpt, fmt))
    assert view.layer_spec == "local"
    assert (view.layout.tp, view.layout.pp, view.layout.ep, view.layout.etp) == (2, 2, 2, 1)
    assert view.layout.pipeline_layout == ckpt.layout.pipeline_layout
    md = _dist_metadata(ckpt)
    style = KeyStyle.from_args(view.args, view.spec)
    tensors = [n for n in view.names() if view.shape(n) is not None]
    by_key: dict[str, list[str]] = {}
    for n in tensors:
        by_key.setdefault(style.locate(n)[0], []).append(n)
    saved = {k for k, v in md.items() if hasattr(v, "size")}
    assert set(by_key) == saved  # nothing dropped, nothing invented
    for key, names in by_key.items():
        full = _dist_tensor(ckpt, key, tuple(md[key].size))
        for n in names:
            _, index, _ = style.locate(n)
            assert torch.equal(view.get(n), full[index] if index else full), n
