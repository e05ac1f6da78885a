"""The injectors on a transformers MoE (a tiny Qwen3-MoE built by transformers' own classes):
effects where expected, switched off bit-identical; and activation by environment through
`PreTrainedModel.post_init`."""

import json
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mcore_proxy import faults  # noqa: E402
from mcore_proxy.faults.clock import CLOCK  # noqa: E402


def tiny_qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=32,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(config).eval()


@pytest.fixture(scope="module")
def model():
    return tiny_qwen3_moe()


TOKENS = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))


def routed(model):
    """Per layer: (logits, top-k scores, indices) of its router, and the logits of the model."""
    seen, handles = {}, []
    for i, layer in enumerate(model.model.layers):
        handles.append(
            layer.mlp.gate.register_forward_hook(
                lambda mod, args, out, i=i: seen.__setitem__(i, tuple(t.detach().clone() for t in out))
            )
        )
    with torch.no_grad():
        logits = model(TOKENS).logits
    for h in handles:
        h.remove()
    return seen, logits


def test_router_faults_change_the_routing_and_switch_off_exactly(model):
    base, base_logits = routed(model)
    with faults.inject("router_noise:std=2.0,layers=1", model=model):
        noisy, noisy_logits = routed(model)
    assert torch.equal(noisy[0][2], base[0][2])  # layer 0 untouched
    assert not torch.equal(noisy[1][2], base[1][2]) and not torch.equal(noisy_logits, base_logits)
    torch.testing.assert_close(noisy[1][1].sum(-1), torch.ones(24))  # re-derived, renormalised top-k
    with faults.inject("topk:mode=swap,rate=0.5", model=model):
        swapped, _ = routed(model)
    changed = (swapped[0][2].sort(-1).values != base[0][2].sort(-1).values).any(-1).float().mean()
    assert 0.4 < changed < 1.0
    with faults.inject("router_weight:std=0.5;topk:rate=0.5,start=5", model=model):
        pass
    again, again_logits = routed(model)
    assert torch.equal(again_logits, base_logits) and all(torch.equal(again[i][2], base[i][2]) for i in base)
    with faults.inject("router_noise:std=2.0,engine=rollout;logprob_precision:engine=rollout", model=model):
        elsewhere, elsewhere_logits = routed(model)  # a transformers model is the trainer's
    assert torch.equal(elsewhere_logits, base_logits)
    with faults.inject("router_tie_flip:margin=100,engine=trainer", model=model):
        flipped, _ = routed(model)
    assert all(not torch.equal(flipped[i][2], base[i][2]) for i in base)  # every token's 2nd choice
    with faults.inject("router_precision:dtype=fp8", model=model):
        fp8, _ = routed(model)  # an FP8 rollout's router: logits on E4M3's grid, top-k from those
    assert all(torch.equal(fp8[i][0], base[i][0].to(torch.float8_e4m3fn).float()) for i in base)


def test_expert_noise_and_logprob_precision(model):
    _, base_logits = routed(model)
    with faults.inject("logprob_precision:dtype=bf16", model=model):
        _, rounded = routed(model)
    assert torch.equal(rounded, base_logits.bfloat16().float())
    with faults.inject("logprob_precision:dtype=fp8", model=model):
        _, fp8 = routed(model)
    # E4M3 keeps 3 mantissa bits: a relative error up to 1/16 on normal numbers (|x| >= 2^-6), far
    # coarser than bf16's 1/256
    assert torch.equal(fp8, base_logits.to(torch.float8_e4m3fn).float())
    normal = base_logits.abs() >= 2**-6
    relative = ((fp8 - base_logits).abs() / base_logits.abs())[normal].max()
    assert 1 / 256 < relative <= 1 / 16
    with faults.inject("expert_noise:std=0.05", model=model) as session:
        _, noisy = routed(model)
    assert not torch.equal(noisy, base_logits) and session.report()[0]["active_calls"] == 2


def test_update_omission_on_a_transformers_model():
    model = tiny_qwen3_moe().train()
    CLOCK.reset()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    with faults.inject("update_omission:group=experts", model=model, optimizer=opt):
        loss = model(TOKENS, labels=TOKENS).loss
        loss.backward()
        opt.step()
    moved = {k for k, v in model.state_dict().items() if not torch.equal(v, initial[k])}
    experts = {k for k in initial if ".mlp.experts." in k}
    assert experts and moved and not moved & experts


def test_environment_activation_through_post_init(helpers):
    script = (
        "import json, torch, sys; sys.path.insert(0, %r); from test_hf import tiny_qwen3_moe, TOKENS;"
        "m = tiny_qwen3_moe();"
        "from mcore_proxy.faults import runtime;"
        "import torch; a = m(TOKENS).logits; print(json.dumps([bool(torch.equal(a, a.bfloat16().float())),"
        " runtime.env_session().report()[0]['active_calls']]))"
    ) % str(helpers.REPO / "tests" / "faults")
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=helpers.user_env(helpers.PATCHES, MCORE_PROXY_FAULTS="logprob_precision:when=always"),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [True, 1]


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_router_faults_keep_a_renormalising_routers_rule(hf_model, family):
    """Mixtral's and gpt-oss's routers have no norm_topk_prob but renormalise their top-k weights:
    a logit fault re-derives the choice by the same rule, so the weights still sum to 1."""
    from mcore_proxy.hf.models import load_model, mark_routers

    model = load_model(hf_model(family))
    seen = []
    router = next(iter(mark_routers(model).values()))
    with faults.inject("router_noise:std=0.5", model=model):
        handle = router.register_forward_hook(lambda mod, args, out: seen.append(out[1].detach()))
        with torch.no_grad():
            model(TOKENS)
        handle.remove()
    torch.testing.assert_close(seen[0].float().sum(-1), torch.ones(seen[0].shape[0]))
