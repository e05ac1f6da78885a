"""One table of Megatron defaults for args fields older or other Megatron versions did not save."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from mcore_proxy.core.errors import CheckpointError
from mcore_proxy.mcore import megatron_args as ma
from mcore_proxy.mcore.megatron_args import DEFAULTS, REQUIRED, TRANSFORMER_CONFIG_NAMES, arg
from mcore_proxy.mcore.spec import ModelSpec

OLDER_MEGATRON_LACKS = (
    "moe_layer_freq",
    "moe_shared_expert_intermediate_size",
    "moe_router_enable_expert_bias",
    "moe_router_num_groups",
    "moe_router_group_topk",
)


def test_defaults_are_megatron_cores_own():
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = {f.name: f for f in dataclasses.fields(TransformerConfig)}
    for ours, theirs in TRANSFORMER_CONFIG_NAMES.items():
        f = fields[theirs]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        assert DEFAULTS[ours] == default, (ours, theirs, default)
    assert set(OLDER_MEGATRON_LACKS) <= set(TRANSFORMER_CONFIG_NAMES)


def changed(args, changes: dict):
    """`args` with `changes` set; a value of dataclasses.MISSING deletes the field."""
    for k, v in changes.items():
        if v is dataclasses.MISSING:
            delattr(args, k)
        else:
            setattr(args, k, v)
    return args


def full_args(**changes):
    args = argparse.Namespace(
        num_layers=4,
        hidden_size=32,
        num_experts=8,
        moe_router_topk=2,
        moe_layer_freq=1,
        moe_shared_expert_intermediate_size=None,
        moe_router_enable_expert_bias=False,
        moe_router_num_groups=None,
        moe_router_group_topk=None,
        ffn_hidden_size=64,
        moe_ffn_hidden_size=16,
        swiglu=True,
    )
    return changed(args, changes)


def test_absent_fields_read_as_megatron_defaults():
    older = full_args(**{k: dataclasses.MISSING for k in OLDER_MEGATRON_LACKS})
    assert ModelSpec.from_args(older) == ModelSpec.from_args(full_args())
    assert ModelSpec.from_args(older).moe_layers == (0, 1, 2, 3)


def test_a_field_without_a_safe_default_is_named():
    assert DEFAULTS["num_layers"] is REQUIRED
    with pytest.raises(
        CheckpointError,
        match=r"^the Megatron args in ckpt/x.pt lack num_layers, which has no "
        "safe default",
    ):
        ModelSpec.from_args(full_args(num_layers=dataclasses.MISSING), where="ckpt/x.pt")


@pytest.mark.parametrize(
    "field,value",
    [
        ("num_layers", "4"),
        ("num_layers", 10**12),
        ("hidden_size", None),
        ("num_experts", 2.5),
        ("moe_router_topk", True),
        ("moe_router_score_function", 3),
        ("moe_router_enable_expert_bias", "yes"),
    ],
)
def test_wrong_types_are_refused_by_name(field, value):
    with pytest.raises(CheckpointError, match=f"args {field} in f.pt"):
        ModelSpec.from_args(full_args(**{field: value}), where="f.pt")


def test_ffn_hidden_size_follows_megatrons_rule_when_absent():
    def dense(**changes):
        return ModelSpec.from_args(full_args(hidden_size=96, ffn_hidden_size=dataclasses.MISSING, **changes))

    assert dense().dense_ffn_hidden_size == 256  # int(8*96/3/64)*64
    assert dense(swiglu=dataclasses.MISSING).dense_ffn_hidden_size == 384
    assert arg(argparse.Namespace(), "expert_tensor_parallel_size") is None


# -- fields Megatron derives from others, and every field the readers route through the table ----


def quickstart_args(**changes):
    """Args as the quickstart's checkpoint holds them (`functional.model.ToyMoE.megatron_args`):
    no kv_channels, num_query_groups, group_query_attention, rotary_base, rotary_percent,
    norm_epsilon, qk_layernorm, add_qkv_bias, untie_embeddings_and_output_weights."""
    from mcore_proxy.testing.fixtures import FIXTURES

    model, layout = FIXTURES["deepseek_like_pp2_uneven"]
    args = model.megatron_args(layout)
    return changed(args, changes)


def test_the_quickstart_args_lack_what_megatron_derives():
    args = quickstart_args()
    for field in ("kv_channels", "num_query_groups", "group_query_attention", "rotary_base", "norm_epsilon"):
        assert not hasattr(args, field), field


def test_kv_channels_is_hidden_over_heads_when_absent():
    assert ma.kv_channels(quickstart_args()) == 32 // 4
    assert ma.kv_channels(quickstart_args(kv_channels=16)) == 16  # a saved value wins (Qwen3: head_dim)
    with pytest.raises(
        CheckpointError, match=r"lack kv_channels and hidden_size 30 is not a multiple of num_attention_heads 4"
    ):
        ma.kv_channels(quickstart_args(hidden_size=30))
    with pytest.raises(CheckpointError, match=r"^args kv_channels in f.pt is '8', expected an integer"):
        ma.kv_channels(quickstart_args(kv_channels="8"), "f.pt")


@pytest.mark.parametrize(
    "changes,groups",
    [
        ({}, 4),  # absent: one group per head
        # Megatron-LM saves argparse's num_query_groups=1 without --group-query-attention: ignored
        (dict(group_query_attention=False, num_query_groups=1), 4),
        (dict(group_query_attention=True, num_query_groups=2), 2),
        (dict(group_query_attention=True), 1),  # the flag without a count: argparse's 1
        (dict(group_query_attention=True, num_query_groups=None), 4),  # TransformerConfig: None -> heads
    ],
)
def test_query_groups_as_megatron_core_counts_them(changes, groups):
    assert ma.num_query_groups(quickstart_args(**changes)) == groups


def test_norm_epsilon_of_every_megatron_version():
    assert ma.norm_epsilon(quickstart_args()) == 1e-5  # absent: Megatron's default
    assert ma.norm_epsilon(quickstart_args(norm_epsilon=1e-6)) == 1e-6  # Megatron-LM before 0.16
    assert ma.norm_epsilon(quickstart_args(layernorm_epsilon=1e-6)) == 1e-6  # 0.16: TransformerConfig's name


def test_positions_and_rope_type_as_megatron_leaves_them():
    assert ma.max_position_embeddings(quickstart_args()) == 16
    assert ma.max_position_embeddings(quickstart_args(max_position_embeddings=dataclasses.MISSING)) == 16
    assert ma.rope_type(quickstart_args()) == "rope"
    assert ma.rope_type(quickstart_args(multi_latent_attention=True)) == "yarn"  # MLATransformerConfig's default
    assert ma.rope_type(quickstart_args(multi_latent_attention=True, rope_type="rope")) == "rope"


def test_routed_fields_read_as_megatron_defaults():
    args = quickstart_args()
    expect = {
        "rotary_base": 10000,
        "rotary_percent": 1.0,
        "rotary_scaling_factor": 1.0,
        "kv_lora_rank": 32,
        "qk_head_dim": 128,
        "qk_pos_emb_head_dim": 64,
        "v_head_dim": 128,
        "csa_window_size": 128,
        "o_groups": 8,
        "num_residual_streams": 4,
        "mhc_sinkhorn_iterations": 20,
    }
    assert {k: ma.arg_float(args, k) for k in expect} == expect
    for field, value in (("qk_layernorm", False), ("add_qkv_bias", False), ("rotary_interleaved", False)):
        assert ma.arg_bool(args, field) is value, field
    assert ma.arg_bool(argparse.Namespace(), "add_bias_linear") is True  # --disable-bias-linear turns it off
    assert ma.arg_str(argparse.Namespace(), "position_embedding_type") == "learned_absolute"
    assert ma.arg_str(argparse.Namespace(), "normalization") == "LayerNorm"
    assert ma.topk_scaling_factor(args) == 1.0  # None: no scaling
    assert ma.arg_float(quickstart_args(rotary_base=None), "rotary_base") == 10000  # None: not set


@pytest.mark.parametrize(
    "read,field,value,says",
    [
        (ma.arg_float, "rotary_base", "1e4", "expected a number"),
        (ma.arg_float, "norm_epsilon", True, "expected a number"),
        (ma.arg_list, "csa_compress_ratios", "[0, 4]", "expected a list of whole numbers"),
        (ma.arg_bool, "qk_layernorm", "yes", "expected true or false"),
        (ma.arg_str, "position_embedding_type", 1, "expected a string"),
    ],
)
def test_routed_fields_of_the_wrong_type_are_refused_by_name(read, field, value, says):
    with pytest.raises(CheckpointError, match=rf"^args {field} in f.pt is .*{says}"):
        read(quickstart_args(**{field: value}), field, "f.pt")


def test_a_field_a_model_needs_is_named_when_absent():
    with pytest.raises(CheckpointError, match=r"^the Megatron args in f.pt lack dsa_indexer_topk, which DeepSeek-V3.2"):
        ma.arg_int(quickstart_args(), "dsa_indexer_topk", "f.pt", needed="DeepSeek-V3.2's indexer")


def test_hf_readers_of_the_quickstart_args_get_megatrons_values():
    """What Megatron -> HF reads of args without the derived fields (issue 40 item 4: the traceback
    was `args.kv_channels`); the quickstart's model has no HF family (test_hf_megatron_defaults.py)."""
    from mcore_proxy.checkpoint.hf import gqa

    args = quickstart_args()
    assert gqa.qkv_groups(args) == (4, 4, 8)
    config = gqa.decoder_config(args, ModelSpec.from_args(args), rotary_key=True)
    assert (config["num_key_value_heads"], config["head_dim"], config["rms_norm_eps"]) == (4, 8, 1e-5)
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}
    assert config["max_position_embeddings"] == 16


def test_a_toy_models_args_read_back_as_the_same_model():
    """ToyMoE is a ModelSpec: the args it writes describe it field for field (MLA, dense layers
    first, MTP, tying, stacked layers), so a checkpoint's spec builds the model that saved it."""
    from mcore_proxy.functional.family import family_from_args
    from mcore_proxy.functional.model import Layout
    from mcore_proxy.testing.families import DEEPSEEK_V3, QWEN3_MOE_HF, QWEN3_MOE_TIED

    for model in (DEEPSEEK_V3, QWEN3_MOE_HF, QWEN3_MOE_TIED):
        back = family_from_args(model.megatron_args(Layout()), seq_length=model.seq_length)
        assert dataclasses.replace(back, weight_seed=model.weight_seed) == model
        assert back.stacked_layers == model.stacked_layers  # torch_dist keys the layers alike


def test_mtp_layers_are_moe_when_the_last_decoder_layer_holding_tensors_is():
    """Megatron builds MTP with the last decoder layer's spec: a dense last layer makes a dense MTP
    layer (no router to read), while MindSpeed's trailing noop layers (DeepSeek-V3's 61 of 64) do not."""
    base = dict(num_layers=6, hidden_size=64, num_experts=8, moe_router_topk=2, mtp_num_layers=1)
    dense_last = ModelSpec.from_args(argparse.Namespace(**base, moe_layer_freq=[1, 1, 1, 1, 1, 0]))
    noop_last = ModelSpec.from_args(argparse.Namespace(**base, moe_layer_freq=1, noop_layers="4,5"))
    assert dense_last.moe_layer_ids == ["0", "1", "2", "3", "4"] and not dense_last.mtp_is_moe
    assert noop_last.moe_layer_ids == ["0", "1", "2", "3", "mtp.0"] and noop_last.mtp_is_moe
