"""core.routing: the softmax top-k rule reproduces what each transformers router returns itself."""

import pytest
import torch

pytest.importorskip("transformers")

from mcore_proxy.core.routing import softmax_topk  # noqa: E402
from mcore_proxy.hf.models import load_model, mark_routers  # noqa: E402


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "gpt_oss"])
def test_the_rule_is_each_routers_own(hf_model, family):
    """Mixtral's and gpt-oss's routers have no norm_topk_prob and renormalise; the rule says so."""
    model = load_model(hf_model(family))
    router = next(iter(mark_routers(model).values()))
    hidden = torch.randn(12, router.weight.shape[1], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, weights, experts = router(hidden)
        ours, chosen = softmax_topk(router, logits)
    assert torch.equal(chosen.sort(-1).values, experts.sort(-1).values)
    torch.testing.assert_close(ours.gather(-1, chosen.argsort(-1)), weights.gather(-1, experts.argsort(-1)))
