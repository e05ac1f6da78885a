"""Megatron -> HF of checkpoints whose args leave fields to Megatron's defaults (issue 40 item 4).

The quickstart's checkpoint (`deepseek_like_pp2_uneven`, args from `ToyMoE.megatron_args`) has no
`kv_channels`, `num_query_groups`, `rotary_base`, `norm_epsilon` or
`untie_embeddings_and_output_weights`: Megatron derives or defaults them, and so must the HF
writer (it raised AttributeError on `args.kv_channels`). The quickstart's model itself has no
transformers family (a sigmoid group-limited router with a sigmoid-gated shared expert: GLM-4.5-MoE
routes so but has no shared-expert gate, Qwen2-MoE has the gate but routes by softmax), so it is
refused in one sentence; `seq_tp2_pp2_ep2`, whose args lack the same fields, is a Mixtral on HF,
and transformers computes megatron-core's logits from it and from its proxy.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from mcore_proxy.checkpoint import open_checkpoint
from mcore_proxy.cli import main
from mcore_proxy.functional.model import Layout
from mcore_proxy.functional.run import fixed_tokens, load_and_run
from mcore_proxy.hf.models import load_model, run
from mcore_proxy.select.synthetic import planted_plan
from mcore_proxy.testing.fixtures import FIXTURES

pytestmark = [pytest.mark.megatron, pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")]

CLOSE = dict(rtol=1e-5, atol=1e-5)
QUICKSTART, MIXTRAL_LIKE = "deepseek_like_pp2_uneven", "seq_tp2_pp2_ep2"
UNSAID = ("kv_channels", "num_query_groups", "norm_epsilon", "rotary_base", "untie_embeddings_and_output_weights")


def _plan(ckpt, keep: int, path):
    """K = `keep` experts per layer chosen by the real selection from statistics planted in the
    checkpoint's shape (as tests/convert/conftest.py makes its plans)."""
    return planted_plan(open_checkpoint(ckpt), keep, path)


@pytest.mark.parametrize("how", ["plan", "dry-run", "no plan"])
def test_the_quickstart_checkpoint_is_refused_in_one_sentence(megatron_ckpt, digest, tmp_path, capsys, how):
    ckpt, _ = megatron_ckpt(QUICKSTART)
    args = open_checkpoint(ckpt).args
    assert not any(hasattr(args, field) for field in UNSAID)
    before = digest(ckpt)
    out = tmp_path / "tohf"
    argv = ["convert", str(ckpt), "-o", str(out), "--format", "hf"]
    if how != "no plan":
        argv += ["--plan", str(tmp_path / "plan.json")]
        _plan(ckpt, 8, tmp_path / "plan.json")
    argv += ["--dry-run"] if how == "dry-run" else []
    capsys.readouterr()
    assert main(argv) == 2  # bad input, not an internal error (3)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "mlp.shared_experts.gate_weight has no GLM-4.5-MoE" in err, err
    assert not out.exists() and digest(ckpt) == before


@pytest.fixture(scope="module")
def mixtral_like(megatron_ckpt, digest, tmp_path_factory):
    """The fixture converted to HF, and its proxy (K = 4 of 8) to HF and to a one-rank legacy
    checkpoint run by megatron-core: {name: folder}, the plan, the proxy's megatron-core logits,
    and the input's digest before and after."""
    ckpt, _ = megatron_ckpt(MIXTRAL_LIKE)
    tmp = tmp_path_factory.mktemp("mixtral-like")
    before = digest(ckpt)
    plan = _plan(ckpt, 4, tmp / "plan.json")
    out = {name: tmp / name for name in ("hf", "dry", "proxy_hf", "proxy_legacy")}
    one_rank = ["--target-tp", "1", "--target-pp", "1", "--target-ep", "1"]
    assert main(["convert", str(ckpt), "-o", str(out["hf"]), "--format", "hf"]) == 0
    assert main(["convert", str(ckpt), "-o", str(out["dry"]), "--format", "hf", "--dry-run"]) == 0
    assert (
        main(["convert", str(ckpt), "--plan", str(tmp / "plan.json"), "-o", str(out["proxy_hf"]), "--format", "hf"])
        == 0
    )
    legacy = ["convert", str(ckpt), "--plan", str(tmp / "plan.json"), "-o", str(out["proxy_legacy"]), *one_rank]
    assert main(legacy) == 0
    model, _ = FIXTURES[MIXTRAL_LIKE]
    small = dataclasses.replace(model, num_experts=plan.num_experts)
    proxy_logits = load_and_run(small, Layout(), out["proxy_legacy"], tmp / "proxy.pt")
    return out, plan, proxy_logits, (before, digest(ckpt))


def test_the_args_leave_megatron_to_derive_them(megatron_ckpt):
    args = open_checkpoint(megatron_ckpt(MIXTRAL_LIKE)[0]).args
    assert not any(hasattr(args, field) for field in UNSAID)


def test_it_converts_to_hf_and_transformers_computes_megatrons_logits(megatron_ckpt, mixtral_like):
    out, _, _, (before, after) = mixtral_like
    assert before == after, "the input checkpoint was modified"
    assert not out["dry"].exists()  # --dry-run writes nothing
    config = json.loads((out["hf"] / "config.json").read_text())
    # Megatron's values: kv_channels = 32 / 4 heads, a group per head, norm epsilon 1e-5, RoPE base
    # 10000, and an output layer of its own (the args say nothing; the tensors do)
    assert (config["architectures"], config["head_dim"], config["num_key_value_heads"]) == (
        ["MixtralForCausalLM"],
        8,
        4,
    )
    assert (config["rms_norm_eps"], config["rope_parameters"]["rope_theta"], config["tie_word_embeddings"]) == (
        1e-5,
        10000.0,
        False,
    )
    model, _ = FIXTURES[MIXTRAL_LIKE]
    want = torch.load(megatron_ckpt(MIXTRAL_LIKE)[1])  # megatron-core's logits at TP 2 / PP 2 / EP 2
    torch.testing.assert_close(run(load_model(out["hf"]), fixed_tokens(model)), want, **CLOSE)


def test_its_proxy_on_hf_computes_the_megatron_proxys_logits(megatron_ckpt, mixtral_like):
    """The rollout proxy (HF, transformers) and the trainer proxy (Megatron, megatron-core) of one
    plan agree; the Megatron proxy equals the restricted original (tests/convert/test_functional.py)."""
    out, plan, proxy_logits, _ = mixtral_like
    rollout = load_model(out["proxy_hf"])
    assert rollout.config.num_local_experts == plan.num_experts == 4
    model, _ = FIXTURES[MIXTRAL_LIKE]
    got = run(rollout, fixed_tokens(model))
    torch.testing.assert_close(got, proxy_logits, **CLOSE)
    full = torch.load(megatron_ckpt(MIXTRAL_LIKE)[1])
    assert (got - full).abs().max() > 1e-3  # the pruning is not a no-op
