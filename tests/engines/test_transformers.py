"""engines/transformers.py on tiny transformers models: routers found by the family's path (what
`hf.models` asks) and by shape (what a fault inside a training process asks) are the same modules,
and the fused routed experts are the MoE blocks' `experts`."""

from __future__ import annotations

import pytest

from mcore_proxy.engines import transformers as hf_models
from mcore_proxy.hf.models import family_of_model, load_model


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_routers_by_family_path_and_by_shape_agree(hf_model, name):
    model = load_model(hf_model(name))
    runtime = family_of_model(model).runtime
    by_path = hf_models.routers(model, runtime.router_module, runtime.router_weight)
    by_shape = hf_models.routers(model)
    assert by_path and by_path == by_shape
    assert set(by_path) == set(hf_models.decoder_layers(model)) - set(_dense_layers(model))
    experts = hf_models.fused_experts(model)
    assert set(experts) == set(by_path) and all(hasattr(m, "gate_up_proj") for m in experts.values())
    assert hf_models.is_transformers_model(model) and not hf_models.is_transformers_model(by_path["1"])


def _dense_layers(model) -> list[str]:
    """Layers whose MLP has no router (Qwen's `mlp_only_layers`, `decoder_sparse_step`)."""
    return [lid for lid, layer in hf_models.decoder_layers(model).items() if not hasattr(layer.mlp, "gate")]
