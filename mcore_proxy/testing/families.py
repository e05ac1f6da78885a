"""Tiny DeepSeek-V3- and Qwen3-MoE-shaped megatron-core models, saved and loaded as Megatron does.

The models (`functional.model.ToyMoE`, `StagedLayout`, `family_from_args`, `build_chunks`, `run_chunks`) are
library code in `mcore_proxy.functional.family` (what `verify --functional` runs); this module adds
the fixtures: the two families, their layouts, and jobs that fill layout-independent global
weights (`global_weights.fill_global_weights`, plus expert biases by global layer), so a model
computes the same function at every TP/PP/EP/VPP layout.

`run_jobs` runs a list of `Job`s in one set of spawned gloo ranks (re-initialising megatron's
parallel state per job; each spawned rank costs seconds of imports): save a checkpoint in legacy
format (`model` or `model0`, `model1`, ... per rank file, with args, iteration,
checkpoint_version, optimizer, scheduler and RNG entries as Megatron-LM's `generate_state_dict`
writes them) and in torch_dist format (megatron-core's `dist_checkpointing.save` of the
chunks' sharded state dicts, args in common.pt), or load one of either format strictly into a
model built at any layout, and write the logits on the fixed tokens as [1 + mtp_layers, b, s, V]
(main head, then each MTP depth).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from mcore_proxy.checkpoint.iteration import TRACKER, folder_name
from mcore_proxy.checkpoint.safe_globals import torch_load_allowing
from mcore_proxy.functional.cpu import destroy_distributed, free_port
from mcore_proxy.functional.family import (
    StagedLayout,
    build_chunks,
    enter_layout,
    family_from_args,
    run_chunks,
    state_keys,
)
from mcore_proxy.functional.model import Layout, ToyMoE
from mcore_proxy.functional.run import fixed_tokens, rank_coords, restrict_routers, writes_folder
from mcore_proxy.mcore.spec import MLA
from mcore_proxy.testing.build import legacy_rank_dir, training_extras
from mcore_proxy.testing.dist_ckpt import CONTENT_METADATA, iteration_dir
from mcore_proxy.testing.global_weights import fill_global_weights

__all__ = [
    "DEEPSEEK_V3",
    "DEEPSEEK_V3_LAYOUT",
    "QWEN3_MOE",
    "QWEN3_MOE_LAYOUT",
    "QWEN3_MOE_HF",
    "QWEN3_MOE_TIED",
    "QWEN3_MOE_TIED_LAYOUT",
    "FamilyCheckpoint",
    "Job",
    "StagedLayout",
    "build_chunks",
    "family_from_args",
    "fill_weights",
    "iteration_dir",
    "load_and_run",
    "run_chunks",
    "run_jobs",
    "save_jobs",
]


@dataclass(frozen=True)
class Job:
    """One model in the shared world: build `model` at `layout`, then save and/or load, then run.

    save_legacy / save_dist: checkpoint roots to write (weights: the global weights of `seed`).
    load_legacy / load_dist: a checkpoint root to load strictly instead of filling weights.
    logits: where the last stage writes [1 + mtp_layers, b, s, V].
    trace_dir: if set, routing statistics of the forward pass go there (`mcore_proxy.trace.install`).
    keep: if set, layer id -> kept expert ids: every router may choose only those
    (`functional.run.restrict_routers`, the reference a proxy must reproduce).
    """

    model: ToyMoE
    layout: Layout
    seed: int = 0
    save_legacy: str | None = None
    save_dist: str | None = None
    load_legacy: str | None = None
    load_dist: str | None = None
    logits: str | None = None
    iteration: int = 10
    trace_dir: str | None = None
    keep: dict | None = None

    def __post_init__(self):
        if self.load_legacy and self.load_dist:
            raise ValueError("a job loads one checkpoint")
        if (self.save_legacy or self.save_dist) and (self.load_legacy or self.load_dist):
            raise ValueError("a job either saves freshly filled weights or loads them")


def fill_weights(chunks: list, model: ToyMoE, seed: int) -> None:
    """Global weights for every parameter, and for every router's expert-bias buffer a vector
    keyed by its global layer (MTP depths after the decoder), the same on every rank."""
    fill_global_weights(chunks, seed=seed, router_std=model.router_std)
    for chunk in chunks:
        for module in chunk.modules():
            if getattr(module, "expert_bias", None) is not None and hasattr(module, "gating"):
                g = torch.Generator().manual_seed(50_000 + module.layer_number + 7919 * seed)
                module.expert_bias.copy_(torch.randn(module.expert_bias.shape, generator=g) * 0.1)


def _save_legacy(job: Job, chunks: list, writer: bool, coords) -> None:
    if not writer:
        return
    folder = Path(job.save_legacy) / folder_name(job.iteration) / legacy_rank_dir(*coords, job.layout)
    folder.mkdir(parents=True, exist_ok=True)
    state = {"args": job.model.megatron_args(job.layout), "checkpoint_version": 3.0, "iteration": job.iteration}
    for chunk, key in zip(chunks, state_keys(chunks)):
        state[key] = chunk.state_dict_for_save_checkpoint()
    state.update(training_extras(torch.nn.ModuleList(chunks)))
    torch.save(state, folder / "model_optim_rng.pt")


def _save_dist(job: Job, chunks: list) -> None:
    from megatron.core import dist_checkpointing

    it_dir = Path(job.save_dist) / folder_name(job.iteration)
    it_dir.mkdir(parents=True, exist_ok=True)
    args = job.model.megatron_args(job.layout)
    args.ckpt_format = "torch_dist"
    state = {"args": args, "checkpoint_version": 3.0, "iteration": job.iteration}
    for chunk, key in zip(chunks, state_keys(chunks)):
        state[key] = chunk.sharded_state_dict(metadata=dict(CONTENT_METADATA))
    dist_checkpointing.save(state, str(it_dir), content_metadata=dict(CONTENT_METADATA))


def _load(job: Job, chunks: list, coords) -> None:
    if job.load_legacy:
        path = iteration_dir(job.load_legacy) / legacy_rank_dir(*coords, job.layout) / "model_optim_rng.pt"
        state = torch.load(path, map_location="cpu", weights_only=False)
        for chunk, key in zip(chunks, state_keys(chunks)):
            chunk.load_state_dict(state[key], strict=True)
    elif job.load_dist:
        from megatron.core import dist_checkpointing

        it_dir = str(iteration_dir(job.load_dist))
        keys = state_keys(chunks)
        # megatron-core loads common.pt with torch.load(weights_only=True), which refuses the enums
        # that Python 3.11.2 pickles by name: the fixtures saved under it hold them (docs/safe-loading.md)
        with torch_load_allowing():
            metadata = dist_checkpointing.load_content_metadata(it_dir) or {}
            loaded = dist_checkpointing.load(
                {k: c.sharded_state_dict(metadata=metadata) for k, c in zip(keys, chunks)}, it_dir
            )
        for chunk, key in zip(chunks, keys):
            chunk.load_state_dict(loaded[key], strict=True)


def _job(job: Job, world: int) -> None:
    chunks = build_chunks(job.model, job.layout)
    coords = rank_coords(job.layout)
    writer = writes_folder(coords, world)  # a collective: every rank calls it once per job
    if job.load_legacy or job.load_dist:
        _load(job, chunks, coords)
    else:
        fill_weights(chunks, job.model, job.seed)
    with contextlib.ExitStack() as stack:
        if job.trace_dir:
            from mcore_proxy.trace import install

            stack.enter_context(install(chunks, job.trace_dir))
        if job.keep is not None:
            for chunk in chunks:
                stack.enter_context(restrict_routers(chunk, job.keep))
        heads = run_chunks(chunks, job.model, fixed_tokens(job.model))
    if job.save_legacy:
        _save_legacy(job, chunks, writer, coords)
    if job.save_dist:
        _save_dist(job, chunks)
    if heads is not None and job.logits and writer and coords == (0, job.layout.pp - 1, 0):
        torch.save(heads, job.logits)
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        for root in (job.save_legacy, job.save_dist):
            if root:
                (Path(root) / TRACKER).write_text(str(job.iteration))


def _worker(rank: int, world: int, port: int, jobs: list[Job]) -> None:
    torch.set_num_threads(1)  # several ranks share few cores
    try:
        for job in jobs:
            enter_layout(rank, world, port, job.model, job.layout)
            _job(job, world)
    finally:
        if torch.distributed.is_initialized():
            destroy_distributed()


def run_jobs(jobs: list[Job], world: int | None = None) -> None:
    """Run `jobs` in order in one set of spawned gloo ranks (`world`: the largest job's world
    size by default; every job's layout must divide it, the other ranks are data parallel)."""
    world = world or max(job.layout.world_size for job in jobs)
    for job in jobs:
        if world % job.layout.world_size:
            raise ValueError(f"{job.layout} does not fit a world of {world} ranks")
    torch.multiprocessing.spawn(_worker, args=(world, free_port(), list(jobs)), nprocs=world, join=True)


# -- the two families ---------------------------------------------------------------------------

# DeepSeek-V3 in miniature: MLA with q_lora (q/kv latent norms), v head dim != qk head dim,
# 3 dense layers first, 32 routed experts in 8 groups (top-4 groups, top-8, sigmoid scores with
# expert bias, scaling factor 2.5), one shared expert, one MTP layer, rope (inside MLA).
DEEPSEEK_V3 = ToyMoE(
    num_layers=5,
    hidden_size=32,
    num_attention_heads=4,
    ffn_hidden_size=64,
    mla=MLA(q_lora_rank=20, kv_lora_rank=12, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6),
    qk_layernorm=True,
    num_experts=32,
    moe_ffn_hidden_size=8,
    topk=8,
    moe_layers=(3, 4),
    shared_expert_size=16,
    score_function="sigmoid",
    expert_bias=True,
    num_groups=8,
    group_topk=4,
    topk_scaling_factor=2.5,
    mtp_layers=1,
    position_embedding_type="rope",
    weight_seed=3,
)
# Megatron's DeepSeek-V3 layout "Et*3|(tt|)*29,m|L" at PP 16 in miniature: VPP 2, the MTP layer
# on its own stage (pp 0, vp 1), the loss stage (pp 1, vp 1) without decoder layers.
DEEPSEEK_V3_LAYOUT = StagedLayout(tp=2, pp=2, ep=2, etp=1, pipeline_layout="Ettt|tt|m|L")

# Qwen3-MoE in miniature: GQA (4 query heads, 2 groups) with an explicit head dim (q width 48 !=
# hidden 32) and q/k norms, 32 experts softmax top-8, no shared expert, GroupedMLP
# (MindSpeed-LLM's Qwen3 recipes use --moe-grouped-gemm). Positions: Megatron's default
# `learned_absolute` (`embedding.position_embeddings.weight`) instead of Qwen3's rope, so that one
# fixture has it; with MTP beside a second chunk megatron-core 0.16.1 cannot save it in torch_dist
# (two main replicas of the key: docs/families.md).
QWEN3_MOE = ToyMoE(
    num_layers=4,
    hidden_size=32,
    num_attention_heads=4,
    num_query_groups=2,
    kv_channels=12,
    qk_layernorm=True,
    ffn_hidden_size=64,
    num_experts=32,
    moe_ffn_hidden_size=8,
    topk=8,
    score_function="softmax",
    position_embedding_type="learned_absolute",
    weight_seed=4,
)
QWEN3_MOE_LAYOUT = StagedLayout(tp=2, pp=2, ep=2, etp=1, grouped=True)

# Qwen3-MoE as Hugging Face has it (a Megatron -> HF source): rope, one dense layer first, eps and
# RoPE base of the real model (1e-6, 1e6) rather than megatron's defaults
QWEN3_MOE_HF = dataclasses.replace(
    QWEN3_MOE,
    position_embedding_type="rope",
    moe_layers=(1, 2, 3),
    norm_epsilon=1e-6,
    rotary_base=1e6,
    weight_seed=5,
)

# Megatron's default of tied embeddings (no --untie-embeddings-and-output-weights) at PP 2: the last
# stage's `output_layer.weight` is its copy of the word embeddings (legacy), a replica of
# `embedding.word_embeddings.weight` (torch_dist); SequentialMLP
QWEN3_MOE_TIED = dataclasses.replace(QWEN3_MOE_HF, untie_embeddings=False, weight_seed=6)
QWEN3_MOE_TIED_LAYOUT = StagedLayout(tp=2, pp=2, ep=2, etp=1)


@dataclass(frozen=True)
class FamilyCheckpoint:
    """One saved family fixture: the same weights in both formats, and their reference logits."""

    name: str
    model: ToyMoE
    layout: Layout
    legacy: Path
    torch_dist: Path
    logits: Path
    seed: int = 0


def save_jobs(
    name: str, model: ToyMoE, layout: Layout, base: Path, seed: int | None = None
) -> tuple[Job, FamilyCheckpoint]:
    """The job saving fixture `name` under `base` (legacy/, torch_dist/, logits.pt) and its record
    (global weights of `seed`, by default the model's weight_seed)."""
    seed = model.weight_seed if seed is None else seed
    ckpt = FamilyCheckpoint(name, model, layout, base / "legacy", base / "torch_dist", base / "logits.pt", seed)
    job = Job(
        model, layout, seed=seed, save_legacy=str(ckpt.legacy), save_dist=str(ckpt.torch_dist), logits=str(ckpt.logits)
    )
    return job, ckpt


def load_and_run(jobs: list[tuple], trace_dirs: list | None = None, keeps: list | None = None) -> list[torch.Tensor]:
    """Load each (model, layout, "legacy" | "torch_dist", checkpoint, logits path) strictly into
    megatron-core models at that layout and run the fixed tokens, all in one set of ranks;
    returns each job's logits [1 + mtp_layers, b, s, V]. `trace_dirs[i]`: trace job i there;
    `keeps[i]`: restrict job i's routers to those experts (layer id -> kept ids)."""
    built = []
    for i, (model, layout, fmt, ckpt, out) in enumerate(jobs):
        key = {"legacy": "load_legacy", "torch_dist": "load_dist"}[fmt]
        trace = str(trace_dirs[i]) if trace_dirs and trace_dirs[i] else None
        keep = keeps[i] if keeps else None
        built.append(Job(model, layout, logits=str(out), trace_dir=trace, keep=keep, **{key: str(ckpt)}))
    run_jobs(built)
    return [torch.load(j.logits) for j in built]
