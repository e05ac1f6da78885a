"""Quantized releases, in the three layouts they ship: DeepSeek-V3's FP8 with fp32 block scales,
gpt-oss's MXFP4 fused experts, DeepSeek-V4's FP4 experts and FP8 linears with E8M0 scales (under
the release's own key names). Each is pruned with the plan of its unquantized original without
dequantizing: every kept weight and its scales bit for bit. Dequantizing (`--dequantize`) gives
what transformers computes: both proxies, loaded in transformers, equal the quantized original
(which transformers dequantizes on CPU) with every router restricted to the kept experts."""

from __future__ import annotations

import functools
import json

import pytest
import torch

from mcore_proxy.checkpoint import open_checkpoint
from mcore_proxy.checkpoint.hf.quant import (
    config_dtype,
    dequantize_blocks,
    find_quantized,
)
from mcore_proxy.cli import main
from mcore_proxy.core.errors import CheckpointError
from mcore_proxy.hf.models import load_model, restrict_gates, run
from mcore_proxy.testing.hf_fixtures import hf_tensors
from mcore_proxy.testing.quantized import (
    fp8_blocks,
    fp8_copy,
    mxfp4_copy,
    v4_release_copy,
)

# 4x4 blocks for DeepSeek-V3: transformers' FP8 dequantization refuses partial blocks, which
# mcore-proxy's handles (test_fp8_blocks_dequantize_by_definition_including_partial_blocks)
COPIES = {
    "deepseek_v3": functools.partial(fp8_copy, block=(4, 4)),
    "gpt_oss": mxfp4_copy,
    "deepseek_v4": v4_release_copy,
}
# the stored dtypes of each layout's experts, so that a copy which quantized nothing fails
STORED = {
    "deepseek_v3": {torch.float8_e4m3fn, torch.float32},
    "gpt_oss": {torch.uint8},
    "deepseek_v4": {torch.int8, torch.float8_e8m0fnu},
}
TOKENS = torch.randint(3, 128, (3, 20), generator=torch.Generator().manual_seed(11))


def same_bytes(x: torch.Tensor, y: torch.Tensor) -> bool:
    return (
        x.dtype == y.dtype
        and x.shape == y.shape
        and torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))
    )


@pytest.fixture(scope="module")
def quantized(hf_proxy, tmp_path_factory):
    """`quantized(name)` -> (quantized original, plan path, plan, pruned proxy, dequantized proxy)."""
    made: dict[str, tuple] = {}

    def get(name: str):
        if name not in made:
            orig, _, plan_path, plan, _ = hf_proxy(name)
            base = tmp_path_factory.mktemp(f"quant-{name}")
            src, pruned, deq = COPIES[name](orig, base / "src"), base / "pruned", base / "dequantized"
            assert main(["convert", str(src), "--plan", str(plan_path), "-o", str(pruned)]) == 0
            flag = "--dequantize-fp8" if name == "deepseek_v3" else "--dequantize"  # the older spelling too
            assert main(["convert", str(src), "--plan", str(plan_path), "-o", str(deq), flag]) == 0
            made[name] = (src, plan_path, plan, pruned, deq)
        return made[name]

    return get


@pytest.mark.parametrize("name", sorted(COPIES))
def test_kept_experts_and_their_scales_are_copied_bit_for_bit(quantized, name):
    src, _, plan, pruned, _ = quantized(name)
    source, got = hf_tensors(src), hf_tensors(pruned)
    spelling = open_checkpoint(src).info.format_info.spelling
    companions = {q.scale for q in find_quantized(list(source))}
    checked = set()
    for lid in plan.layer_ids:
        kept = plan.kept(lid)
        prefix = f"decoder.layers.{lid}" if not lid.startswith("mtp.") else f"mtp.layers.{lid[4:]}.transformer_layer"
        for template, (hf, _) in spelling.items():
            if not template.startswith(prefix + ".mlp.experts."):
                continue
            for j, e in enumerate(kept):
                key, new = (hf.replace("{e}", str(e)), hf.replace("{e}", str(j))) if "{e}" in hf else (hf, hf)
                want = source[key] if "{e}" in hf else source[key][e]
                assert same_bytes(got[new] if "{e}" in hf else got[new][j], want), new
                checked.add(key)
    assert checked & companions, "no expert scale was checked"
    assert {source[k].dtype for k in checked} >= STORED[name]
    experts = {k for k in source if ".experts." in k and ".shared_experts." not in k}
    others = [
        k
        for k in source
        if k not in experts
        and not k.endswith(
            ("gate.weight", "router.weight", "gate.bias", "router.bias", "e_score_correction_bias", "tid2eid")
        )
    ]
    assert any(k in companions for k in others) or name == "gpt_oss"  # attention's scales are copied too
    assert all(same_bytes(got[k], source[k]) for k in others)
    assert (
        json.loads((pruned / "config.json").read_text())["quantization_config"]
        == json.loads((src / "config.json").read_text())["quantization_config"]
    )


@pytest.mark.parametrize("name", sorted(COPIES))
def test_dequantized_proxy_is_what_transformers_computes(quantized, name):
    src, _, plan, pruned, deq = quantized(name)
    original = load_model(src)  # transformers dequantizes the release itself (CPU)
    with restrict_gates(original, plan):
        reference = run(original, TOKENS)
    assert (run(original, TOKENS) - reference).abs().max() > 0.1
    for proxy in (deq, pruned):
        torch.testing.assert_close(run(load_model(proxy), TOKENS), reference, rtol=1e-5, atol=1e-5)
    tensors, config = hf_tensors(deq), json.loads((deq / "config.json").read_text())
    assert "quantization_config" not in config and not find_quantized(list(tensors))
    dtype = config_dtype(config)
    assert {t.dtype for k, t in tensors.items() if ".experts." in k} == {dtype}


def test_fp8_blocks_dequantize_by_definition_including_partial_blocks():
    w = torch.randn(20, 13)
    q, scale = fp8_blocks(w, (8, 8))
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (3, 2)
    back = dequantize_blocks(q, scale, (8, 8), "w", torch.float32)
    # block (2, 1) is rows 16..19, columns 8..12: a partial block scaled by its own factor
    torch.testing.assert_close(back[16:, 8:], q[16:, 8:].float() * scale[2, 1], rtol=0, atol=0)
    assert (back - w).abs().max() <= w.abs().max() * 0.07  # e4m3: 3 mantissa bits
    with pytest.raises(CheckpointError, match="do not fit"):
        dequantize_blocks(q, scale[:2], (8, 8), "w")
