"""The named tiny Megatron checkpoints the tests, examples and benchmarks build.

Each entry pairs a ToyMoE architecture with the layout it is saved at; `build_fixture` saves it
with megatron-core in spawned gloo ranks (legacy format) plus the reference logits.
"""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from mcore_proxy.testing.build import Layout, ToyMoE, save_checkpoint

FIXTURES: dict[str, tuple[ToyMoE, Layout]] = {
    # SequentialMLP, softmax top-2 of 8, TP=2 PP=2 EP=2 (8 ranks)
    "seq_tp2_pp2_ep2": (ToyMoE(), Layout(tp=2, pp=2, ep=2)),
    # GroupedMLP (weight1/weight2, as MindSpeed-LLM writes with --moe-grouped-gemm), EP=4
    "grouped_ep4": (ToyMoE(weight_seed=1), Layout(tp=1, pp=1, ep=4, grouped=True)),
    # expert TP differs from attention TP: some mp_rank folders legitimately do not exist
    "seq_tp2_etp1_ep2": (ToyMoE(weight_seed=2), Layout(tp=2, pp=1, ep=2, etp=1)),
    # DeepSeek-like: dense first layer, shared experts with gate, sigmoid scores with expert
    # bias, group-limited routing (16 experts in 4 groups, top-2 groups, top-4), uneven stages (1 + 3)
    "deepseek_like_pp2_uneven": (
        ToyMoE(num_layers=4, num_experts=16, moe_layer_freq=(0, 1, 1, 1), shared_expert_size=24,
               shared_expert_gate=True, score_function="sigmoid", expert_bias=True, num_groups=4,
               group_topk=2, topk=4),
        Layout(tp=1, pp=2, ep=2, first_stage_layers=1)),
}


def fixture_key(name: str) -> str:
    model, layout = FIXTURES[name]
    source = Path(__file__).with_name("build.py").read_bytes()
    digest = hashlib.sha256(repr((model, layout)).encode() + source).hexdigest()[:12]
    return f"{name}-{digest}"


def build_fixture(name: str, root: str | os.PathLike) -> tuple[Path, Path]:
    """Build (or reuse, when `root` already holds this exact fixture) -> (checkpoint, logits)."""
    model, layout = FIXTURES[name]
    base = Path(root) / fixture_key(name)
    ckpt, ref = base / "ckpt", base / "ckpt.logits.pt"
    if not (ref.is_file() and (ckpt / "latest_checkpointed_iteration.txt").is_file()):
        shutil.rmtree(base, ignore_errors=True)
        base.mkdir(parents=True)
        save_checkpoint(model, layout, ckpt, ref_path=ref)
    return ckpt, ref
