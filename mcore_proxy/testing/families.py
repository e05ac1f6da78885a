"""Tiny DeepSeek-V3- and Qwen3-MoE-shaped megatron-core models, saved and loaded as Megatron does.

`Family` extends build.py's ToyMoE with what these families add: multi-latent attention
(`q_lora_rank`, `kv_lora_rank`, head dims), GQA with qk norms and an explicit head dim, learned
absolute positions, MTP layers, the top-k scaling factor. `StagedLayout` adds Megatron's
`--pipeline-model-parallel-layout` string (which may imply virtual stages) to a Layout.

Models are built with megatron-core's local spec (Transformer Engine is not installable here;
`mcore_cpu.local_mla_spec` is the one spec edit MLA needs without it), filled with
layout-independent global weights (`global_weights.fill_global_weights`, plus expert biases by
global layer), so a model computes the same function at every TP/PP/EP/VPP layout.

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
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from mcore_proxy.pipeline_layout import split_stages
from mcore_proxy.testing.build import (Layout, ToyMoE, _rank_coords, _training_extras, _writes_folder, fixed_tokens,
                                       legacy_rank_dir, restrict_routers)
from mcore_proxy.testing.dist_ckpt import CONTENT_METADATA, TRACKER, iteration_dir
from mcore_proxy.testing.global_weights import fill_global_weights
from mcore_proxy.testing.mcore_cpu import destroy_distributed, free_port, init_distributed, local_mla_spec


@dataclass(frozen=True)
class Family(ToyMoE):
    """A ToyMoE with the attention, position and MTP options of DeepSeek-V3 and Qwen3-MoE.

    attention: "gqa" (`linear_qkv`, `num_query_groups`, head dim `kv_channels`) or "mla"
    (`linear_q_down_proj` [q_lora, H], `linear_q_up_proj` [heads*(qk+rope), q_lora],
    `linear_kv_down_proj` [kv_lora+rope, H], `linear_kv_up_proj` [heads*(qk+v), kv_lora]; with
    q_lora_rank None a single `linear_q_proj`). qk_layernorm: q/k norms for GQA, q/kv latent norms
    for MLA (the local MLA spec has none without it).
    """

    attention: str = "gqa"
    num_query_groups: int | None = None
    kv_channels: int | None = None
    qk_layernorm: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int = 16
    qk_head_dim: int = 8
    qk_pos_emb_head_dim: int = 4
    v_head_dim: int = 8
    position_embedding_type: str = "rope"
    mtp_layers: int = 0
    topk_scaling_factor: float | None = None
    norm_epsilon: float = 1e-5           # megatron's default layernorm_epsilon
    rotary_base: float = 10000.0

    def __post_init__(self):
        if self.attention not in ("gqa", "mla"):
            raise ValueError(f"attention must be 'gqa' or 'mla', got {self.attention!r}")

    def transformer_config(self, layout: Layout):
        """megatron-core's TransformerConfig (MLATransformerConfig for MLA) of this model at `layout`."""
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        # built at PP 1 first: the base class knows no layout string, and 5 layers over PP 2 need one
        # (or a first-stage size, set below with the real PP)
        base = super().transformer_config(dataclasses.replace(layout, pp=1, first_stage_layers=None))
        values = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init}
        # SwiGLU as the args say (`swiglu`) and both families compute: TransformerConfig's default
        # activation is gelu, which with gated_linear_unit would be GeGLU
        values.update(pipeline_model_parallel_size=layout.pp, qk_layernorm=self.qk_layernorm, mtp_num_layers=self.mtp_layers or None,
                      layernorm_epsilon=self.norm_epsilon, activation_func=torch.nn.functional.silu,
                      moe_router_topk_scaling_factor=self.topk_scaling_factor,
                      pipeline_model_parallel_layout=getattr(layout, "pipeline_layout", None),
                      num_layers_in_first_pipeline_stage=layout.first_stage_layers)
        if self.attention == "gqa":
            values.update(num_query_groups=self.num_query_groups, kv_channels=self.kv_channels)
            return type(base)(**values)
        values.update(multi_latent_attention=True, q_lora_rank=self.q_lora_rank, kv_lora_rank=self.kv_lora_rank,
                      qk_head_dim=self.qk_head_dim, qk_pos_emb_head_dim=self.qk_pos_emb_head_dim,
                      v_head_dim=self.v_head_dim, rope_type="rope", num_query_groups=None, kv_channels=None)
        return MLATransformerConfig(**values)

    def megatron_args(self, layout: Layout):
        """`args` as Megatron-LM's argparse and validate_args leave them for this model."""
        args = super().megatron_args(layout)
        mla = self.attention == "mla"
        text = getattr(layout, "pipeline_layout", None)
        vpp = getattr(layout, "vpp", None)
        heads = self.num_attention_heads
        vars(args).update(
            multi_latent_attention=mla, qk_layernorm=self.qk_layernorm,
            group_query_attention=not mla and self.num_query_groups not in (None, heads),
            num_query_groups=(self.num_query_groups or heads) if not mla else heads,
            kv_channels=self.kv_channels or self.hidden_size // heads,
            q_lora_rank=self.q_lora_rank if mla else None, kv_lora_rank=self.kv_lora_rank,
            qk_head_dim=self.qk_head_dim, qk_pos_emb_head_dim=self.qk_pos_emb_head_dim, v_head_dim=self.v_head_dim,
            rope_type="rope" if mla else None, rotary_scaling_factor=1.0, rotary_base=self.rotary_base,
            norm_epsilon=self.norm_epsilon,
            position_embedding_type=self.position_embedding_type, max_position_embeddings=self.seq_length,
            untie_embeddings_and_output_weights=True,
            mtp_num_layers=self.mtp_layers or None, mtp_loss_scaling_factor=0.1,
            moe_router_topk_scaling_factor=self.topk_scaling_factor,
            pipeline_model_parallel_layout=text, virtual_pipeline_model_parallel_size=vpp,
            num_layers_per_virtual_pipeline_stage=None, num_virtual_stages_per_pipeline_rank=None,
            overlap_p2p_comm=vpp is not None)
        return args


@dataclass(frozen=True)
class StagedLayout(Layout):
    """A Layout with Megatron's `pipeline_model_parallel_layout` string (None: even stages)."""

    pipeline_layout: str | None = None

    @property
    def vpp(self) -> int | None:
        """Virtual stages per rank as Megatron-LM's validate_args derives them (None for 1)."""
        if self.pipeline_layout is None:
            return None
        n = len(split_stages(self.pipeline_layout)) // self.pp
        return n if n > 1 else None


@dataclass(frozen=True)
class Job:
    """One model in the shared world: build `model` at `layout`, then save and/or load, then run.

    save_legacy / save_dist: checkpoint roots to write (weights: the global weights of `seed`).
    load_legacy / load_dist: a checkpoint root to load strictly instead of filling weights.
    logits: where the last stage writes [1 + mtp_layers, b, s, V].
    trace_dir: if set, routing statistics of the forward pass go there (`mcore_proxy.trace.install`).
    keep: if set, layer id -> kept expert ids: every router may choose only those
    (`build.restrict_routers`, the reference a proxy must reproduce).
    """

    model: Family
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


def _vpp(layout: Layout) -> int | None:
    return getattr(layout, "vpp", None)


def build_chunks(model: Family, layout: Layout) -> list:
    """This rank's model chunks (one per virtual stage) as Megatron-LM's gpt_builder builds them
    (call inside the layout's parallel state). MTP layers use the spec of the model's last
    decoder layer, also on a stage without decoder layers (`gpt_builders.py`)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_decoder_block_spec, get_gpt_decoder_layer_specs,
                                                          get_gpt_mtp_block_spec)

    config = model.transformer_config(layout)
    vpp = _vpp(layout)
    chunks = []
    for vp in (range(vpp) if vpp else [None]):
        spec = local_mla_spec(get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                                         normalization="RMSNorm", vp_stage=vp))
        mtp = None
        if model.mtp_layers:
            last = local_mla_spec(get_gpt_decoder_layer_specs(config, False, "RMSNorm", vp_stage=vp)[-1])
            mtp = get_gpt_mtp_block_spec(config, last, use_transformer_engine=False, vp_stage=vp)
        chunks.append(GPTModel(
            config, spec, vocab_size=model.vocab_size, max_sequence_length=model.seq_length,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            parallel_output=False, share_embeddings_and_output_weights=False,
            position_embedding_type=model.position_embedding_type, rotary_base=model.rotary_base,
            mtp_block_spec=mtp, vp_stage=vp).eval())
    return chunks


def fill_weights(chunks: list, model: Family, seed: int) -> None:
    """Global weights for every parameter, and for every router's expert-bias buffer a vector
    keyed by its global layer (MTP depths after the decoder), the same on every rank."""
    fill_global_weights(chunks, seed=seed, router_std=model.router_std)
    for chunk in chunks:
        for module in chunk.modules():
            if getattr(module, "expert_bias", None) is not None and hasattr(module, "gating"):
                g = torch.Generator().manual_seed(50_000 + module.layer_number + 7919 * seed)
                module.expert_bias.copy_(torch.randn(module.expert_bias.shape, generator=g) * 0.1)


def _send(t: torch.Tensor, dst: int) -> None:
    """Tensor with its shape first: an MTP stage sends [(1 + mtp) * s, b, h], the others [s, b, h]."""
    torch.distributed.send(torch.tensor(t.shape, dtype=torch.int64), dst=dst)
    torch.distributed.send(t.contiguous(), dst=dst)


def _recv(src: int) -> torch.Tensor:
    shape = torch.empty(3, dtype=torch.int64)
    torch.distributed.recv(shape, src=src)
    out = torch.empty(tuple(shape.tolist()))
    torch.distributed.recv(out, src=src)
    return out


def run_chunks(chunks: list, model: Family, tokens: torch.Tensor) -> torch.Tensor | None:
    """One forward pass of the fixed tokens through the pipeline (chunks in Megatron's
    interleaved order, activations passed by p2p around the PP ring); on the last stage the
    logits of every output-layer call as [1 + mtp_layers, b, s, V] (main head first), else None."""
    from megatron.core import parallel_state as ps

    b, s = tokens.shape
    positions = torch.arange(s).expand(b, s)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]
    labels = {"labels": tokens} if model.mtp_layers else {}
    vpp = len(chunks) > 1
    seen: list[torch.Tensor] = []
    hooks = [c.output_layer.register_forward_hook(lambda m, i, o: seen.append(o[0].detach().clone()))
             for c in chunks if c.post_process]
    try:
        with torch.no_grad():
            for vp, chunk in enumerate(chunks):
                vp_stage = vp if vpp else None
                if not ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage):
                    chunk.set_input_tensor(_recv(ps.get_pipeline_model_parallel_prev_rank()))
                out = chunk(tokens, positions, mask, **labels)
                if not ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage):
                    _send(out, ps.get_pipeline_model_parallel_next_rank())
    finally:
        for h in hooks:
            h.remove()
    if not seen:
        return None
    if len(seen) != 1 + model.mtp_layers:
        raise RuntimeError(f"expected {1 + model.mtp_layers} output-layer calls, saw {len(seen)}")
    # megatron's post-processing applies the output layer to the MTP depths first, the main head last
    return torch.stack([x.transpose(0, 1) for x in [seen[-1], *seen[:-1]]])


def _state_keys(chunks: list) -> list[str]:
    """Megatron-LM's generate_state_dict: `model`, or `model0`, `model1`, ... with virtual stages."""
    return ["model"] if len(chunks) == 1 else [f"model{v}" for v in range(len(chunks))]


def _save_legacy(job: Job, chunks: list, writer: bool, coords) -> None:
    if not writer:
        return
    folder = Path(job.save_legacy) / f"iter_{job.iteration:07d}" / legacy_rank_dir(*coords, job.layout)
    folder.mkdir(parents=True, exist_ok=True)
    state = {"args": job.model.megatron_args(job.layout), "checkpoint_version": 3.0, "iteration": job.iteration}
    for chunk, key in zip(chunks, _state_keys(chunks)):
        state[key] = chunk.state_dict_for_save_checkpoint()
    state.update(_training_extras(torch.nn.ModuleList(chunks)))
    torch.save(state, folder / "model_optim_rng.pt")


def _save_dist(job: Job, chunks: list) -> None:
    from megatron.core import dist_checkpointing

    it_dir = Path(job.save_dist) / f"iter_{job.iteration:07d}"
    it_dir.mkdir(parents=True, exist_ok=True)
    args = job.model.megatron_args(job.layout)
    args.ckpt_format = "torch_dist"
    state = {"args": args, "checkpoint_version": 3.0, "iteration": job.iteration}
    for chunk, key in zip(chunks, _state_keys(chunks)):
        state[key] = chunk.sharded_state_dict(metadata=dict(CONTENT_METADATA))
    dist_checkpointing.save(state, str(it_dir), content_metadata=dict(CONTENT_METADATA))


def _load(job: Job, chunks: list, coords) -> None:
    if job.load_legacy:
        path = iteration_dir(job.load_legacy) / legacy_rank_dir(*coords, job.layout) / "model_optim_rng.pt"
        state = torch.load(path, map_location="cpu", weights_only=False)
        for chunk, key in zip(chunks, _state_keys(chunks)):
            chunk.load_state_dict(state[key], strict=True)
    elif job.load_dist:
        from megatron.core import dist_checkpointing

        it_dir = str(iteration_dir(job.load_dist))
        metadata = dist_checkpointing.load_content_metadata(it_dir) or {}
        keys = _state_keys(chunks)
        loaded = dist_checkpointing.load({k: c.sharded_state_dict(metadata=metadata) for k, c in zip(keys, chunks)},
                                         it_dir)
        for chunk, key in zip(chunks, keys):
            chunk.load_state_dict(loaded[key], strict=True)


def embedding_ranks(model: Family, layout: Layout):
    """Megatron-LM's `get_embedding_ranks` (pretrain_gpt.py) for this model: the ranks whose word
    embeddings are kept equal are the first stage, the last one if embeddings are tied (never
    here), and every stage with MTP layers. megatron-core's default (first and last stage) would
    all-reduce an untied output layer into the MTP stage's embedding copy."""
    text = getattr(layout, "pipeline_layout", None)
    if text is not None:
        from mcore_proxy.pipeline_layout import parse_pipeline_layout

        mtp_pp = {s.pp for s in parse_pipeline_layout(text, layout.pp).stages if s.mtp}
    else:
        mtp_pp = {layout.pp - 1} if model.mtp_layers else set()

    def ranks(pp_ranks: list[int]) -> list[int]:
        if len(pp_ranks) == 1:
            return list(pp_ranks)
        return sorted({pp_ranks[0]} | {pp_ranks[p] for p in mtp_pp})

    return ranks


def _enter(rank: int, world: int, port: int, model: Family, layout: Layout) -> None:
    """gloo group on first use, then megatron's parallel state for `layout` (and this model's
    embedding group)."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if not torch.distributed.is_initialized():
        init_distributed(rank, world, port)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
                                 virtual_pipeline_model_parallel_size=_vpp(layout),
                                 expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.etp,
                                 get_embedding_ranks=embedding_ranks(model, layout))
    tensor_parallel.model_parallel_cuda_manual_seed(1234)


def _job(job: Job, world: int) -> None:
    chunks = build_chunks(job.model, job.layout)
    coords = _rank_coords(job.layout)
    writer = _writes_folder(coords, world)  # a collective: every rank calls it once per job
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
            _enter(rank, world, port, job.model, job.layout)
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
DEEPSEEK_V3 = Family(
    attention="mla", num_layers=5, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
    q_lora_rank=20, kv_lora_rank=12, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6, qk_layernorm=True,
    num_experts=32, moe_ffn_hidden_size=8, topk=8, moe_layer_freq=(0, 0, 0, 1, 1), shared_expert_size=16,
    score_function="sigmoid", expert_bias=True, num_groups=8, group_topk=4, topk_scaling_factor=2.5,
    mtp_layers=1, position_embedding_type="rope", weight_seed=3)
# Megatron's DeepSeek-V3 layout "Et*3|(tt|)*29,m|L" at PP 16 in miniature: VPP 2, the MTP layer
# on its own stage (pp 0, vp 1), the loss stage (pp 1, vp 1) without decoder layers.
DEEPSEEK_V3_LAYOUT = StagedLayout(tp=2, pp=2, ep=2, etp=1, pipeline_layout="Ettt|tt|m|L")

# Qwen3-MoE in miniature: GQA (4 query heads, 2 groups) with an explicit head dim (q width 48 !=
# hidden 32) and q/k norms, 32 experts softmax top-8, no shared expert, GroupedMLP
# (MindSpeed-LLM's Qwen3 recipes use --moe-grouped-gemm). Positions: Megatron's default
# `learned_absolute` (`embedding.position_embeddings.weight`) instead of Qwen3's rope, so that one
# fixture has it; with MTP beside a second chunk megatron-core 0.16.1 cannot save it in torch_dist
# (two main replicas of the key: docs/families.md).
QWEN3_MOE = Family(
    attention="gqa", num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=12,
    qk_layernorm=True, ffn_hidden_size=64, num_experts=32, moe_ffn_hidden_size=8, topk=8,
    score_function="softmax", position_embedding_type="learned_absolute", weight_seed=4)
QWEN3_MOE_LAYOUT = StagedLayout(tp=2, pp=2, ep=2, etp=1, grouped=True)

# Qwen3-MoE as Hugging Face has it (a Megatron -> HF source): rope, one dense layer first, eps and
# RoPE base of the real model (1e-6, 1e6) rather than megatron's defaults
QWEN3_MOE_HF = dataclasses.replace(QWEN3_MOE, position_embedding_type="rope", moe_layer_freq=(0, 1, 1, 1),
                                   norm_epsilon=1e-6, rotary_base=1e6, weight_seed=5)


@dataclass(frozen=True)
class FamilyCheckpoint:
    """One saved family fixture: the same weights in both formats, and their reference logits."""

    name: str
    model: Family
    layout: Layout
    legacy: Path
    torch_dist: Path
    logits: Path
    seed: int = 0


def save_jobs(name: str, model: Family, layout: Layout, base: Path, seed: int | None = None) -> tuple[Job, FamilyCheckpoint]:
    """The job saving fixture `name` under `base` (legacy/, torch_dist/, logits.pt) and its record
    (global weights of `seed`, by default the model's weight_seed)."""
    seed = model.weight_seed if seed is None else seed
    ckpt = FamilyCheckpoint(name, model, layout, base / "legacy", base / "torch_dist", base / "logits.pt", seed)
    job = Job(model, layout, seed=seed, save_legacy=str(ckpt.legacy), save_dist=str(ckpt.torch_dist),
              logits=str(ckpt.logits))
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


def family_from_args(args, seq_length: int = 16) -> Family:
    """The Family a checkpoint's Megatron args describe (GQA or MLA, local spec), e.g. the args
    `convert` writes for a Hugging Face model; `seq_length` sizes the fixed tokens."""
    from mcore_proxy.layer_pattern import parse_layer_pattern
    from mcore_proxy.megatron_args import arg, ffn_hidden_size
    from mcore_proxy.spec import ModelSpec

    spec = ModelSpec.from_args(args)
    # absent in older Megatron's args: its default (megatron_args.DEFAULTS), as ModelSpec reads it
    freq = parse_layer_pattern(arg(args, "moe_layer_freq"), "args moe_layer_freq")
    mla = bool(getattr(args, "multi_latent_attention", False))
    fields = dict(
        attention="mla" if mla else "gqa", num_layers=spec.num_layers, hidden_size=spec.hidden_size,
        num_attention_heads=int(args.num_attention_heads), ffn_hidden_size=ffn_hidden_size(args),
        num_experts=spec.num_experts, moe_ffn_hidden_size=spec.moe_ffn_hidden_size, topk=spec.topk,
        moe_layer_freq=tuple(freq) if isinstance(freq, list) else freq, shared_expert_size=spec.shared_expert_size,
        score_function=spec.score_function, expert_bias=spec.expert_bias, num_groups=spec.num_groups,
        group_topk=spec.group_topk, vocab_size=int(args.padded_vocab_size), seq_length=seq_length,
        qk_layernorm=bool(getattr(args, "qk_layernorm", False)), mtp_layers=spec.mtp_layers,
        shared_expert_gate=bool(getattr(args, "moe_shared_expert_gate", False)),
        topk_scaling_factor=getattr(args, "moe_router_topk_scaling_factor", None),
        position_embedding_type=getattr(args, "position_embedding_type", "rope"),
        norm_epsilon=float(getattr(args, "norm_epsilon", 1e-5)), rotary_base=float(getattr(args, "rotary_base", 10000)))
    if mla:
        fields.update(q_lora_rank=args.q_lora_rank, kv_lora_rank=args.kv_lora_rank, qk_head_dim=args.qk_head_dim,
                      qk_pos_emb_head_dim=args.qk_pos_emb_head_dim, v_head_dim=args.v_head_dim)
    else:
        fields.update(num_query_groups=getattr(args, "num_query_groups", None), kv_channels=getattr(args, "kv_channels", None))
    return Family(**fields)
