"""Output-logit faults where RL frameworks built on transformers compute log-probs: TRL's fused LM
head (reads `lm_head.weight`, never calls `lm_head`) and transformers' `generate` as the rollout
phase (environment activation)."""

import json
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mcore_proxy import faults  # noqa: E402
from mcore_proxy.faults import fused_head  # noqa: E402

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
from test_hf import TOKENS, tiny_qwen3_moe  # noqa: E402


def test_logprob_outputs_equal_trl_kernel_on_cpu():
    kernels = pytest.importorskip("trl.kernels")
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(10, 16, generator=g), torch.randn(40, 16, generator=g)
    bias, targets = torch.randn(40, generator=g), torch.randint(0, 40, (10,), generator=g)
    names = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
    for softcap, scale in ((None, 1.0), (5.0, 0.5)):
        ours = fused_head.logprob_outputs(hidden, weight, bias, targets, 0.7, softcap, scale, names)
        trl = kernels.ChunkedLogProbFunction.apply(hidden, weight, bias, targets, 0.7, 16, softcap, scale, names)
        for a, b in zip(ours, trl):
            if a.dtype == torch.bool:
                assert torch.equal(a, b)
            else:
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def fused_logps(model):
    """TRL's GRPO log-prob pass: the fused head's per-token log-probs of TOKENS."""
    return model(TOKENS, labels=TOKENS, fused_lm_head=True).log_probs


def test_precision_reaches_trls_fused_head_only_in_no_grad_passes():
    pytest.importorskip("trl")
    import trl.trainer.utils as trl_utils
    from trl.trainer.utils import add_fused_lm_head

    saved = trl_utils._ChunkedLogProbFunction
    try:
        assert fused_head.patch_trl_module(trl_utils) and fused_head.patch_trl_module(trl_utils)  # idempotent
        wrapper = trl_utils._ChunkedLogProbFunction
        assert isinstance(wrapper, fused_head.FusedLogProb) and wrapper.original is saved
        model = tiny_qwen3_moe()
        add_fused_lm_head(model, temperature=0.7)
        with torch.no_grad():
            clean = fused_logps(model)
            logits = model(TOKENS).logits
        expected = (
            torch.log_softmax(logits.bfloat16().float()[:, :-1] / 0.7, -1).gather(-1, TOKENS[:, 1:, None]).squeeze(-1)
        )
        with faults.inject("logprob_precision:dtype=bf16,when=no_grad", model=model) as session:
            with torch.no_grad():
                rounded = fused_logps(model)
            training = fused_logps(model)  # autograd on: a training pass
            assert training.requires_grad
        torch.testing.assert_close(rounded, expected, rtol=0, atol=1e-5)
        assert not torch.equal(rounded, clean)
        assert torch.equal(training.detach(), clean)  # fp32 training pass: TRL's own kernel
        assert session.report()[0]["active_calls"] == 1
        with torch.no_grad():
            assert torch.equal(fused_logps(model), clean)  # closed: no trace left
        # the head is found by its weight at call time, also after the parameter was replaced
        with faults.inject("logprob_precision:dtype=fp16,when=always", model=model) as session:
            model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
            with torch.no_grad():
                assert not torch.equal(fused_logps(model), clean)
        assert session.report()[0]["active_calls"] == 1
    finally:
        trl_utils._ChunkedLogProbFunction = saved


def test_environment_activation_generate_is_a_rollout_and_trl_is_patched(helpers):
    script = (
        "import json, sys, torch; sys.path.insert(0, %r); from test_hf import tiny_qwen3_moe, TOKENS;"
        "m = tiny_qwen3_moe();"
        "from mcore_proxy.faults import runtime;"
        "torch.no_grad()(m)(TOKENS);"  # a no-grad pass outside generate
        "before = runtime.env_session().report()[0]['active_calls'];"
        "m.generate(TOKENS[:, :4], max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0);"
        "after = runtime.env_session().report()[0]['active_calls'];"
        "trl = None\n"
        "try:\n import trl.trainer.utils as u; trl = type(u._ChunkedLogProbFunction).__name__\n"
        "except ImportError: pass\n"
        "print(json.dumps([before, after, trl]))"
    ) % str(helpers.REPO / "tests" / "faults")
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=helpers.user_env(helpers.PATCHES, MCORE_PROXY_FAULTS="logprob_precision:when=rollout"),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    before, after, trl = json.loads(proc.stdout.strip().splitlines()[-1])
    assert before == 0 and after == 3  # one forward per generated token
    try:
        import trl as _  # noqa: F401
    except ImportError:
        assert trl is None
    else:
        assert trl == "FusedLogProb"
