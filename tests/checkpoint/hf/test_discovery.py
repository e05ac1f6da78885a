"""A family discovered from transformers itself (checkpoint/hf/discovery.py): what it finds agrees
with the declarations written by hand, and what it cannot read is refused in one sentence."""

from __future__ import annotations

from pathlib import Path

import pytest

from mcore_proxy.checkpoint.hf.config import HFConfig
from mcore_proxy.checkpoint.hf.discovery import NotDiscovered, discover
from mcore_proxy.checkpoint.hf.families import declared


def config_of(folder: Path, **changes) -> HFConfig:
    config = HFConfig.load(folder)
    return HFConfig({**config.data, **changes}, config.path)


def default_config(model_type: str, arch: str, **changes) -> HFConfig:
    import transformers

    data = transformers.CONFIG_MAPPING[model_type]().to_dict()
    data.update(changes, model_type=model_type, architectures=[arch])
    return HFConfig(data, Path(f"<{model_type}>") / "config.json")


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3", "minimax_m2", "ernie4_5_moe"])
def test_discovery_finds_what_the_declaration_says(hf_model, name):
    """Router, its biases, fused experts and the Hub's per-expert spelling: each discovered
    pattern is one the declaration holds, the router module is the one it hooks, and the score
    function (softmax for Qwen3-MoE, Mixtral, gpt-oss, ERNIE; sigmoid for DeepSeek-V3, MiniMax-M2)
    the one it declares."""
    config = config_of(hf_model(name))
    found, written = discover(config).family, declared(config.architecture())
    assert found.origin == "discovered" and written.origin == "declared"
    assert set(found.router.weight) <= set(written.router.weight)
    assert set(found.router.bias) <= set(written.router.bias)
    assert set(found.router.score_bias) <= set(written.router.score_bias) and (
        bool(found.router.score_bias) == bool(written.router.score_bias)
    )
    assert set(found.experts.fused) <= set(written.experts.fused) and found.experts.fused
    assert set(found.experts.per_expert) & set(written.experts.per_expert) or not written.experts.per_expert
    assert found.runtime.router_module == written.runtime.router_module
    assert set(found.config.experts) & set(written.config.experts)
    # the score function: config.json's where it names one, else the one the router's weights follow
    assert scoring(found.config, config) == scoring(written.config, config)


def scoring(keys, config: HFConfig) -> str:
    """A family's score function for `config`: a constant, or a config key with its default."""
    if isinstance(keys.score_function, str):
        return keys.score_function
    key, default = keys.score_function
    return config.data.get(key) or default


@pytest.mark.parametrize("name, scoring", [("nemotron_h", "sigmoid"), ("hunyuan_v1_moe", "softmax")])
def test_a_router_without_a_config_key_has_the_score_function_its_weights_follow(hf_model, name, scoring):
    """NemotronH's config names no score function; its router's top-k weights are sigmoid scores."""
    assert discover(config_of(hf_model(name))).family.config.score_function == scoring


def test_a_named_score_function_defaults_to_the_config_classs_value():
    """DeepSeek-V4's config class names its score function (scoring_func, sqrtsoftplus, which
    neither softmax nor sigmoid ratios fit): a config.json that leaves the key out scores as
    transformers would build it, not as softmax."""
    found = discover(default_config("deepseek_v4", "DeepseekV4ForCausalLM")).family
    assert found.config.score_function == ("scoring_func", "sqrtsoftplus")


@pytest.mark.parametrize(
    "config,words",
    [
        # a dense model: nothing counts experts
        (default_config("llama", "LlamaForCausalLM"), ["LlamaForCausalLM", "no config key that counts routed experts"]),
        # a model type transformers does not ship (remote code): never run
        (
            default_config("qwen3_moe", "MyMoeForCausalLM", auto_map={"AutoModelForCausalLM": "m.MyMoe"}),
            ["MyMoeForCausalLM", "remote code is never run"],
        ),
        (default_config("jetmoe", "JetMoeForCausalLM"), ["2 routers per layer"]),
        (default_config("zaya", "ZayaForCausalLM"), ["E + 1 slots", "always-on extra experts"]),
        # a vision tower whose layer sizes no twin rule shrinks: refused on the meta device, never allocated
        (
            default_config("inkling_mm_model", "InklingForConditionalGeneration"),
            ["InklingForConditionalGeneration has a twin of", "not small"],
        ),
    ],
    ids=["dense", "remote-code", "two-routers", "extra-slots", "twin-not-small"],
)
def test_what_discovery_cannot_read_is_refused_in_one_sentence(config, words):
    with pytest.raises(NotDiscovered) as err:
        discover(config)
    message = str(err.value)
    assert "\n" not in message and message.endswith("every family and its status: docs/families.md")
    assert all(w in message for w in words), message
