"""The named tiny Megatron checkpoints the tests, examples and benchmarks build.

Each entry pairs a ToyMoE architecture with the layout it is saved at; `build_fixture` saves it
with megatron-core in spawned gloo ranks (legacy format) plus the reference logits. Their args are
short (`ToyMoE.short_args`): attention, positions, norms and tying are left to Megatron's
defaults, as in hand-made args, so every reader is tested on args that leave them out.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from mcore_proxy.checkpoint.iteration import TRACKER
from mcore_proxy.functional.model import Layout, ToyMoE
from mcore_proxy.testing.build import save_checkpoint
from mcore_proxy.testing.cache import build_lock

FIXTURES: dict[str, tuple[ToyMoE, Layout]] = {
    # SequentialMLP, softmax top-2 of 8, TP=2 PP=2 EP=2 (8 ranks)
    "seq_tp2_pp2_ep2": (ToyMoE(short_args=True), Layout(tp=2, pp=2, ep=2)),
    # GroupedMLP (weight1/weight2, as MindSpeed-LLM writes with --moe-grouped-gemm), EP=4
    "grouped_ep4": (ToyMoE(weight_seed=1, short_args=True), Layout(tp=1, pp=1, ep=4, grouped=True)),
    # expert TP differs from attention TP: some mp_rank folders legitimately do not exist
    "seq_tp2_etp1_ep2": (ToyMoE(weight_seed=2, short_args=True), Layout(tp=2, pp=1, ep=2, etp=1)),
    # DeepSeek-like: dense first layer, shared experts with gate, sigmoid scores with expert
    # bias, group-limited routing (16 experts in 4 groups, top-2 groups, top-4), uneven stages (1 + 3)
    "deepseek_like_pp2_uneven": (
        ToyMoE(
            num_layers=4,
            num_experts=16,
            moe_layers=(1, 2, 3),
            shared_expert_size=24,
            shared_expert_gate=True,
            score_function="sigmoid",
            expert_bias=True,
            num_groups=4,
            group_topk=2,
            topk=4,
            short_args=True,
        ),
        Layout(tp=1, pp=2, ep=2, first_stage_layers=1),
    ),
}


def _sources(*modules) -> bytes:
    """The code a fixture is built by: a change to it makes a new key."""
    return b"".join(Path(m.__file__).read_bytes() for m in modules)


def fixture_key(name: str) -> str:
    from mcore_proxy.functional import cpu, model as model_module, run
    from mcore_proxy.testing import build

    model, layout = FIXTURES[name]
    source = _sources(build, model_module, run, cpu)
    digest = hashlib.sha256(repr((model, layout)).encode() + source).hexdigest()[:12]
    return f"{name}-{digest}"


def build_fixture(name: str, root: str | os.PathLike) -> tuple[Path, Path]:
    """Build (or reuse, when `root` already holds this exact fixture) -> (checkpoint, logits)."""
    model, layout = FIXTURES[name]
    key = fixture_key(name)
    base = Path(root) / key
    ckpt, ref = base / "ckpt", base / "ckpt.logits.pt"
    with build_lock(root, key):
        if not (ref.is_file() and (ckpt / TRACKER).is_file()):
            shutil.rmtree(base, ignore_errors=True)
            base.mkdir(parents=True)
            save_checkpoint(model, layout, ckpt, ref_path=ref)
    return ckpt, ref


# -- model families saved in both formats (testing/families.py) ---------------------------------


def _family_fixtures():
    from mcore_proxy.testing import families as fam

    return {
        # DeepSeek-V3 shape: MLA (q_lora), 3 dense layers, 32 experts in 8 groups, sigmoid + bias,
        # shared expert, MTP on its own stage; TP=2 PP=2 (layout "Ettt|tt|m|L", VPP 2) EP=2 ETP=1
        "deepseek_v3_mla": (fam.DEEPSEEK_V3, fam.DEEPSEEK_V3_LAYOUT),
        # Qwen3-MoE shape: GQA with q/k norms, softmax top-8 of 32, GroupedMLP, learned absolute
        # positions; TP=2 PP=2 EP=2 ETP=1
        "qwen3_moe": (fam.QWEN3_MOE, fam.QWEN3_MOE_LAYOUT),
        # the same as Hugging Face's Qwen3-MoE has it (rope, a dense first layer, eps 1e-6, RoPE base 1e6):
        # the Megatron -> HF source of tests/checkpoint/hf
        "qwen3_moe_hf": (fam.QWEN3_MOE_HF, fam.QWEN3_MOE_LAYOUT),
        # tied embeddings (Megatron's default) at PP 2: the last stage holds the embeddings' copy
        "qwen3_moe_tied": (fam.QWEN3_MOE_TIED, fam.QWEN3_MOE_TIED_LAYOUT),
    }


def family_fixture_key(name: str) -> str:
    from mcore_proxy.mcore import pipeline_layout
    from mcore_proxy.functional import cpu, model as model_module, run
    from mcore_proxy.testing import build, dist_ckpt, families, global_weights

    model, layout = _family_fixtures()[name]
    source = _sources(families, build, dist_ckpt, global_weights, cpu, model_module, run, pipeline_layout)
    return f"{name}-{hashlib.sha256(repr((model, layout)).encode() + source).hexdigest()[:12]}"


def build_family_fixtures(root: str | os.PathLike, names=None) -> dict:
    """Build (or reuse from `root`) the family fixtures -> {name: FamilyCheckpoint}: the same
    global weights saved in legacy and torch_dist format plus the logits [1 + mtp, b, s, V].
    Everything missing is built in one set of spawned gloo ranks."""
    from mcore_proxy.testing import families as fam

    table = _family_fixtures()
    out, jobs = {}, []
    with build_lock(root, "families"):
        for name in names or sorted(table):
            model, layout = table[name]
            base = Path(root) / family_fixture_key(name)
            job, ckpt = fam.save_jobs(name, model, layout, base)
            out[name] = ckpt
            if not (base / "done").is_file():
                shutil.rmtree(base, ignore_errors=True)
                base.mkdir(parents=True)
                jobs.append((job, base))
        if jobs:
            fam.run_jobs([job for job, _ in jobs])
            for _, base in jobs:
                (base / "done").write_text("ok")
    return out
