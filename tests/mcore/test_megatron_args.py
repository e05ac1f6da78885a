"""One table of Megatron defaults for args fields older or other Megatron versions did not save."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from mcore_proxy.core.errors import CheckpointError
from mcore_proxy.mcore.megatron_args import DEFAULTS, REQUIRED, TRANSFORMER_CONFIG_NAMES, arg, ffn_hidden_size
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
    for k, v in changes.items():
        if v is dataclasses.MISSING:
            delattr(args, k)
        else:
            setattr(args, k, v)
    return args


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
    assert ffn_hidden_size(argparse.Namespace(hidden_size=96, swiglu=True)) == 256  # int(8*96/3/64)*64
    assert ffn_hidden_size(argparse.Namespace(hidden_size=96)) == 384
    assert arg(argparse.Namespace(), "expert_tensor_parallel_size") is None
