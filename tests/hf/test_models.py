"""hf.models: routing replay (R3) on transformers-built tiny models."""

import pytest
import torch

pytest.importorskip("transformers")

from mcore_proxy.core.errors import ProxyError  # noqa: E402
from mcore_proxy.hf.models import Replay, load_model, mark_routers, routed_run  # noqa: E402

TOKENS = torch.randint(3, 100, (2, 10), generator=torch.Generator().manual_seed(0))


def routed(model) -> tuple[torch.Tensor, dict]:
    """(logits, layer -> top-k ids) of one pass."""
    return routed_run(model, TOKENS)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_replaying_a_models_own_routing_changes_nothing_and_other_ids_are_taken(hf_model, family):
    model = load_model(hf_model(family))
    logits, own = routed(model)
    replay = Replay(mark_routers(model))
    try:
        replay.ids = own
        same, _ = routed(model)
        torch.testing.assert_close(same, logits, rtol=1e-5, atol=1e-5)
        shifted = {layer: (ids + 1) % model.config.get_text_config().num_local_experts for layer, ids in own.items()}
        replay.ids = shifted
        other, seen = routed(model)
    finally:
        replay.close()
    assert not torch.allclose(other, logits)
    assert all(torch.equal(seen[layer].sort(-1).values, shifted[layer].sort(-1).values) for layer in own)


def test_a_sigmoid_router_is_refused(hf_model):
    model = load_model(hf_model("glm4_moe"))
    _, own = routed(model)
    replay = Replay(mark_routers(model))
    replay.ids = own
    try:
        with pytest.raises(ProxyError, match="not a softmax over its chosen experts"):
            routed(model)
    finally:
        replay.close()
