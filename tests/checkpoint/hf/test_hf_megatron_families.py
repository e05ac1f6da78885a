"""Mixtral, Qwen2-MoE and GLM-4.5-MoE between Hugging Face and Megatron, proven by both frameworks
running the result. Each family's tiny transformers model (testing/hf_fixtures.py, several
shards) converts to legacy at TP 2 / EP 2 and to torch_dist; megatron-core loads both strictly
(torch_dist re-sharded to TP 1 / EP 1) and computes the HF model's logits. Each Megatron
checkpoint converts back to HF: the family is recognised from the Megatron args alone, every
tensor comes back bit for bit, and transformers computes megatron's logits. The tensors that
make these families differ (q/k/v biases, the shared-expert gate, the score-correction bias,
partial RoPE's q/k norms) are nonzero, so a wrong mapping of any would change the logits.

All families' Megatron runs share one set of ranks: spawning costs seconds per rank.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from mcore_proxy.checkpoint import open_checkpoint
from mcore_proxy.cli import main
from mcore_proxy.functional.run import fixed_tokens
from mcore_proxy.hf.models import load_model, run
from mcore_proxy.mcore.launch_flags import model_flags
from mcore_proxy.testing.families import StagedLayout, family_from_args, load_and_run
from mcore_proxy.testing.hf_fixtures import hf_tensors

pytestmark = [pytest.mark.megatron, pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")]

LAYOUT = ["--target-tp", "2", "--target-pp", "1", "--target-ep", "2", "--target-etp", "1"]
LOADED = {"legacy": StagedLayout(tp=2, pp=1, ep=2, etp=1), "torch_dist": StagedLayout(tp=1, pp=1, ep=1)}
CLOSE = dict(rtol=1e-4, atol=1e-4)  # fp32 logits of size ~1 from two frameworks' op orders


@dataclass(frozen=True)
class Case:
    """One family's tiny model (`fixture`, with `config` edits of config.json in a copy), its HF
    architecture, what megatron-core must be told (`args`, from config.json), and the tensors
    that must not be zero for the logits to test their mapping (`nonzero`)."""

    fixture: str
    architecture: str
    args: dict
    nonzero: tuple[str, ...]
    config: dict = field(default_factory=dict)


CASES = {
    "mixtral": Case(
        "mixtral",
        "MixtralForCausalLM",
        dict(
            moe_layer_freq=[1, 1],
            rotary_base=1e6,
            norm_epsilon=1e-5,
            add_qkv_bias=False,
            qk_layernorm=False,
            moe_shared_expert_intermediate_size=None,
            moe_router_pre_softmax=False,
        ),
        ("decoder.layers.1.mlp.router.weight",),
    ),
    "qwen2_moe": Case(
        "qwen2_moe",
        "Qwen2MoeForCausalLM",
        dict(
            moe_layer_freq=[0, 1, 1],
            add_qkv_bias=True,
            qk_layernorm=False,
            norm_epsilon=1e-6,
            moe_shared_expert_intermediate_size=24,
            moe_shared_expert_gate=True,
            moe_router_pre_softmax=False,
        ),
        (
            "decoder.layers.1.mlp.router.weight",
            "decoder.layers.0.self_attention.linear_qkv.bias",
            "decoder.layers.1.mlp.shared_experts.gate_weight",
        ),
    ),
    # Qwen1.5-MoE's router: top-k of the softmax over all experts, not renormalised (same weights)
    "qwen2_moe_unnormalised": Case(
        "qwen2_moe",
        "Qwen2MoeForCausalLM",
        dict(moe_router_pre_softmax=True),
        ("decoder.layers.1.mlp.router.weight",),
        config=dict(norm_topk_prob=False),
    ),
    "glm4_moe": Case(
        "glm4_moe",
        "Glm4MoeForCausalLM",
        dict(
            moe_layer_freq=[0, 1, 1],
            add_qkv_bias=True,
            qk_layernorm=True,
            rotary_percent=0.5,
            kv_channels=8,
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_num_groups=2,
            moe_router_group_topk=1,
            moe_router_topk_scaling_factor=2.5,
            moe_shared_expert_intermediate_size=16,
            mtp_num_layers=1,
        ),
        (
            "decoder.layers.2.mlp.router.weight",
            "decoder.layers.2.mlp.router.expert_bias",
            "decoder.layers.2.self_attention.linear_qkv.bias",
            "mtp.layers.0.transformer_layer.mlp.router.expert_bias",
        ),
    ),
}


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, want, **CLOSE, msg=lambda m: f"{what}: {m}")


def _source(hf_model, case: Case, tmp: Path) -> Path:
    """The case's HF folder: the session's fixture, or a copy of it with config.json edited."""
    src = hf_model(case.fixture)
    if not case.config:
        return src
    copy = shutil.copytree(src, tmp / "source")
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, **case.config}, indent=2))
    return copy


@pytest.fixture(scope="module")
def in_megatron(hf_model, tmp_path_factory):
    """{case: (HF source, megatron model, {format: checkpoint}, {format: logits [1 + mtp, b, s, V]})}:
    every case converted HF -> legacy and torch_dist, all loaded and run in one set of ranks."""
    made, jobs = {}, []
    for name, case in CASES.items():
        tmp = tmp_path_factory.mktemp(name)
        src, ckpts = _source(hf_model, case, tmp), {fmt: tmp / fmt for fmt in LOADED}
        for fmt, out in ckpts.items():
            assert main(["convert", str(src), "-o", str(out), "--format", fmt, *LAYOUT]) == 0
        model = family_from_args(open_checkpoint(ckpts["legacy"]).args)
        jobs += [(model, LOADED[fmt], fmt, out, tmp / f"{fmt}.pt") for fmt, out in ckpts.items()]
        made[name] = (src, model, ckpts)
    logits = iter(load_and_run(jobs))
    return {
        name: (src, model, ckpts, {fmt: next(logits) for fmt in ckpts}) for name, (src, model, ckpts) in made.items()
    }


@pytest.mark.parametrize("name", CASES)
def test_hf_to_megatron_computes_the_hf_logits(in_megatron, name):
    src, model, ckpts, logits = in_megatron[name]
    case = CASES[name]
    view = open_checkpoint(ckpts["legacy"])
    assert {k: getattr(view.args, k) for k in case.args} == case.args
    for tensor in case.nonzero:  # a mapping that dropped or misplaced them would change the logits
        assert view.get(tensor).abs().min() > 0, tensor
    flags = model_flags(view.args)  # what convert prints for the Megatron launch
    for arg, flag in (("add_qkv_bias", "--add-qkv-bias"), ("moe_shared_expert_gate", "--moe-shared-expert-gate")):
        assert (flag in flags) == bool(getattr(view.args, arg, False)), flag
    assert ("--rotary-percent 0.5" in flags) == (view.args.rotary_percent == 0.5)
    hf = run(load_model(src), fixed_tokens(model))
    for fmt, got in logits.items():
        assert_close(got[0], hf, f"{name} from {fmt}")


def test_the_router_weights_matter(in_megatron):
    """Renormalised or not, the same weights route alike but weigh differently: the two Qwen2-MoE
    cases' logits differ, so `moe_router_pre_softmax` is tested by them."""
    renormalised, plain = (in_megatron[name][3]["legacy"][0] for name in ("qwen2_moe", "qwen2_moe_unnormalised"))
    assert (renormalised - plain).abs().max() > 100 * CLOSE["atol"]


@pytest.mark.parametrize("fmt", list(LOADED))
@pytest.mark.parametrize("name", CASES)
def test_megatron_to_hf_computes_megatrons_logits(in_megatron, name, fmt, tmp_path):
    """The family comes from the Megatron args alone (the checkpoint does not say it came from HF);
    the HF checkpoint written holds the source's tensors bit for bit, MTP layer included."""
    src, model, ckpts, logits = in_megatron[name]
    out = tmp_path / "hf"
    assert main(["convert", str(ckpts[fmt]), "-o", str(out), "--format", "hf"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [CASES[name].architecture]
    assert {k: config[k] for k in CASES[name].config} == CASES[name].config
    want, got = hf_tensors(src), hf_tensors(out)
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert torch.equal(got[key], value), key
    assert_close(run(load_model(out), fixed_tokens(model)), logits[fmt][0], f"{name} from {fmt} as HF")


def test_config_json_that_disagrees_with_the_shards_is_refused(hf_model, tmp_path, capsys):
    """config.json without q/k/v biases beside shards that hold them: one sentence naming both, nothing
    written (a Megatron checkpoint without the biases would not load, or load a different model)."""
    src = _source(hf_model, Case("qwen2_moe", "", {}, (), config=dict(qkv_bias=False)), tmp_path)
    capsys.readouterr()  # transformers' save progress bar, when a test run left it on, is not convert's output
    out = tmp_path / "legacy"
    assert main(["convert", str(src), "-o", str(out), "--format", "legacy"]) == 2
    err = capsys.readouterr().err.strip()
    assert "add_qkv_bias=False" in err and "q_proj.bias" in err and len(err.splitlines()) == 1 and not out.exists()
