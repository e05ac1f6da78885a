"""examples/rl_vllm's GRPO update in the project's interpreter (no vLLM): TIS weighs each token by
min(p_train / p_rollout, cap), and `--no-tis` trains as if the two engines agreed."""

from __future__ import annotations

import argparse
import copy
import importlib.util
from pathlib import Path

import torch

from mcore_proxy.hf.models import load_model

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "rl_vllm" / "run.py"


def example():
    spec = importlib.util.spec_from_file_location("rl_vllm_run", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def one_update(run, model, tokens, old_lp, rollout_lp, no_tis: bool) -> dict:
    model = copy.deepcopy(model).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    args = argparse.Namespace(minibatches=1, clip=0.2, tis_cap=2.0, no_tis=no_tis)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    run.update(model, optimizer, tokens, old_lp, rollout_lp, advantages, 4, args)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_no_tis_trains_as_if_the_engines_agreed(hf_model):
    run = example()
    model = load_model(hf_model("qwen3_moe")).float()
    tokens = torch.randint(3, 120, (4, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        old_lp = run.token_logprobs(model(tokens).logits, tokens)[:, 3:]
    skewed = old_lp + torch.linspace(-1.0, 1.0, old_lp.numel()).view_as(old_lp)  # weights 0.37 .. 2.7 (capped at 2)
    agreed = one_update(run, model, tokens, old_lp, old_lp, no_tis=False)
    without = one_update(run, model, tokens, old_lp, skewed, no_tis=True)
    weighted = one_update(run, model, tokens, old_lp, skewed, no_tis=False)
    assert all(torch.equal(agreed[k], without[k]) for k in agreed)
    assert any(not torch.allclose(agreed[k], weighted[k]) for k in agreed)
