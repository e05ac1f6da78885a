"""megatron-core models of the families mcore-proxy supports, built from a checkpoint's args, on CPU.

A `functional.model.ToyMoE` describes what DeepSeek-V3- and Qwen3-MoE-shaped models hold:
multi-latent attention (`q_lora_rank`, `kv_lora_rank`, head dims), GQA with qk norms, q/k/v biases
and an explicit head dim, learned absolute positions, partial RoPE, MTP layers, the top-k scaling
factor.
`StagedLayout` adds Megatron's `--pipeline-model-parallel-layout` string (which may imply virtual
stages) to a Layout. `family_from_spec` builds a ToyMoE from a checkpoint's ModelSpec (the one
reader of its args, `mcore.spec`; `family_from_args` from bare args); `build_chunks` builds a
rank's model chunks with megatron-core's local spec (`functional.cpu.local_mla_spec` for MLA),
`run_chunks` runs the fixed tokens through the pipeline, and `load_legacy_and_run` loads legacy
checkpoints strictly (weights only, nothing in them may run) and returns their logits
[1 + mtp_layers, b, s, V] (main head, then each MTP depth): what `verify --functional` runs.

Shipped on purpose (issue 9); `mcore_proxy.testing.families` builds its fixtures on it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch

from mcore_proxy.checkpoint.formats import get_format
from mcore_proxy.engines.hooks import Hooks
from mcore_proxy.functional.cpu import destroy_distributed, free_port, init_distributed, local_mla_spec
from mcore_proxy.functional.model import Layout, ToyMoE
from mcore_proxy.functional.run import causal_inputs, fixed_tokens, rank_coords, restrict_routers, writes_folder
from mcore_proxy.mcore.pipeline_layout import split_stages
from mcore_proxy.mcore.spec import ModelSpec


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


def vpp_of(layout: Layout) -> int | None:
    """Virtual stages per rank of `layout` (None for a plain Layout or 1)."""
    return getattr(layout, "vpp", None)


def build_chunks(model: ToyMoE, layout: Layout) -> list:
    """This rank's model chunks (one per virtual stage) as Megatron-LM's gpt_builder builds them
    (call inside the layout's parallel state). MTP layers use the spec of the model's last
    decoder layer, also on a stage without decoder layers (`gpt_builders.py`)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_decoder_layer_specs,
        get_gpt_mtp_block_spec,
    )

    config = model.transformer_config(layout)
    vpp = vpp_of(layout)
    chunks, dsa = [], model.indexer is not None
    for vp in range(vpp) if vpp else [None]:
        spec = local_mla_spec(
            get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm", vp_stage=vp),
            dsa,
        )
        mtp = None
        if model.mtp_layers:
            last = local_mla_spec(get_gpt_decoder_layer_specs(config, False, "RMSNorm", vp_stage=vp)[-1], dsa)
            mtp = get_gpt_mtp_block_spec(config, last, use_transformer_engine=False, vp_stage=vp)
        chunks.append(
            GPTModel(
                config,
                spec,
                vocab_size=model.vocab_size,
                max_sequence_length=model.seq_length,
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
                parallel_output=False,
                share_embeddings_and_output_weights=model.tied_embeddings,
                position_embedding_type=model.position_embedding_type,
                rotary_base=model.rotary_base,
                rotary_percent=model.rotary_percent,
                mtp_block_spec=mtp,
                vp_stage=vp,
            ).eval()
        )
    return chunks


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


def run_chunks(chunks: list, model: ToyMoE, tokens: torch.Tensor) -> torch.Tensor | None:
    """One forward pass of the fixed tokens through the pipeline (chunks in Megatron's
    interleaved order, activations passed by p2p around the PP ring); on the last stage the
    logits of every output-layer call as [1 + mtp_layers, b, s, V] (main head first), else None."""
    from megatron.core import parallel_state as ps

    b, s = tokens.shape
    positions, mask = causal_inputs(b, s)
    labels = {"labels": tokens} if model.mtp_layers else {}
    vpp = len(chunks) > 1
    seen: list[torch.Tensor] = []
    with Hooks() as hooks, torch.no_grad():
        for c in chunks:
            if c.post_process:
                hooks.forward(c.output_layer, lambda m, i, o: seen.append(o[0].detach().clone()))
        for vp, chunk in enumerate(chunks):
            vp_stage = vp if vpp else None
            if not ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage):
                chunk.set_input_tensor(_recv(ps.get_pipeline_model_parallel_prev_rank()))
            out = chunk(tokens, positions, mask, **labels)
            if not ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage):
                _send(out, ps.get_pipeline_model_parallel_next_rank())
    if not seen:
        return None
    if len(seen) != 1 + model.mtp_layers:
        raise RuntimeError(f"expected {1 + model.mtp_layers} output-layer calls, saw {len(seen)}")
    # megatron's post-processing applies the output layer to the MTP depths first, the main head last
    return torch.stack([x.transpose(0, 1) for x in [seen[-1], *seen[:-1]]])


def state_keys(chunks: list) -> list[str]:
    """Megatron-LM's generate_state_dict: `model`, or `model0`, `model1`, ... with virtual stages."""
    return ["model"] if len(chunks) == 1 else [f"model{v}" for v in range(len(chunks))]


def embedding_ranks(model: ToyMoE, layout: Layout):
    """Megatron-LM's `get_embedding_ranks` (pretrain_gpt.py) for this model: the ranks whose word
    embeddings are kept equal are the first stage, the last one if embeddings are tied, and every
    stage with MTP layers. megatron-core's default (first and last stage) would
    all-reduce an untied output layer into the MTP stage's embedding copy."""
    text = getattr(layout, "pipeline_layout", None)
    if text is not None:
        from mcore_proxy.mcore.pipeline_layout import parse_pipeline_layout

        copies = {s.pp for s in parse_pipeline_layout(text, layout.pp).stages if s.mtp}
    else:
        copies = {layout.pp - 1} if model.mtp_layers else set()
    if model.tied_embeddings:
        copies.add(layout.pp - 1)  # the last stage's output layer is the embeddings' copy

    def ranks(pp_ranks: list[int]) -> list[int]:
        if len(pp_ranks) == 1:
            return list(pp_ranks)
        return sorted({pp_ranks[0]} | {pp_ranks[p] for p in copies})

    return ranks


def enter_layout(rank: int, world: int, port: int, model: ToyMoE, layout: Layout) -> None:
    """gloo group on first use, then megatron's parallel state for `layout` (and this model's
    embedding group)."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if not torch.distributed.is_initialized():
        init_distributed(rank, world, port)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=vpp_of(layout),
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        get_embedding_ranks=embedding_ranks(model, layout),
    )
    tensor_parallel.model_parallel_cuda_manual_seed(1234)


def _load_worker(rank: int, world: int, port: int, jobs: list[tuple]) -> None:
    torch.set_num_threads(1)  # several ranks share few cores
    try:
        for model, layout, ckpt, out, keep in jobs:
            enter_layout(rank, world, port, model, layout)
            chunks = build_chunks(model, layout)
            coords = rank_coords(layout)
            writer = writes_folder(coords, world)  # a collective: every rank calls it once per job
            state = get_format("legacy").load_rank(ckpt, coords, layout)
            for chunk, key in zip(chunks, state_keys(chunks)):
                chunk.load_state_dict(state[key], strict=True)
            with contextlib.ExitStack() as stack:
                if keep is not None:
                    for chunk in chunks:
                        stack.enter_context(restrict_routers(chunk, keep))
                heads = run_chunks(chunks, model, fixed_tokens(model))
            if heads is not None and writer and coords == (0, layout.pp - 1, 0):
                torch.save(heads, out)
            torch.distributed.barrier()
    finally:
        if torch.distributed.is_initialized():
            destroy_distributed()


def load_legacy_and_run(jobs: list[tuple], keeps: list | None = None) -> list[torch.Tensor]:
    """Load each (model, layout, legacy checkpoint, logits path) strictly into megatron-core models
    at that layout (`torch.load(weights_only=True)` with the allow-list of safe globals) and run the
    fixed tokens, all in one set of spawned gloo ranks; returns each job's logits
    [1 + mtp_layers, b, s, V]. `keeps[i]`: restrict job i's routers to those experts (layer id ->
    kept ids, `restrict_routers`)."""
    world = max(layout.world_size for _, layout, _, _ in jobs)
    for _, layout, _, _ in jobs:
        if world % layout.world_size:
            raise ValueError(f"{layout} does not fit a world of {world} ranks")
    built = [(m, lay, str(c), str(o), keeps[i] if keeps else None) for i, (m, lay, c, o) in enumerate(jobs)]
    torch.multiprocessing.spawn(_load_worker, args=(world, free_port(), built), nprocs=world, join=True)
    return [torch.load(o) for _, _, _, o in jobs]


def family_from_spec(spec: ModelSpec, seq_length: int = 16, tied: bool | None = None) -> ToyMoE:
    """The ToyMoE of a ModelSpec (its fields, Megatron's dense width where the args lack it), e.g.
    of the args `convert` writes for a Hugging Face model; `seq_length` sizes the fixed tokens.
    `tied`: whether the output layer is the word embeddings (`ModelView.embeddings_tied`); None:
    only when the args said so."""
    spec.require("num_attention_heads", "vocab_size", needed="building the model in megatron-core")
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(ModelSpec)}
    untie = spec.untie_embeddings is not False if tied is None else not tied
    return ToyMoE(
        **{**fields, "ffn_hidden_size": spec.dense_ffn_hidden_size, "seq_length": seq_length, "untie_embeddings": untie}
    )


def family_from_args(args, seq_length: int = 16, tied: bool | None = None) -> ToyMoE:
    """`family_from_spec` of the ModelSpec the args describe."""
    return family_from_spec(ModelSpec.from_args(args), seq_length, tied)
