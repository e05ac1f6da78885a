"""Traced runs of tiny real megatron-core MoE GPT models on CPU, at any parallel layout.

`run_traced({"name": TraceRun(...)}, out_dir)` spawns the gloo ranks of the layout, builds the model with
identical global weights (`fill_global_weights`), attaches `mcore_proxy.trace.install`, runs
the same token batch (each data-parallel replica takes its rows; pipeline stages exchange
activations by p2p), and leaves `out_dir/name/rank{R:05d}.safetensors` + `.json` plus the logits
of each replica (`logits_dp{d}.pt`). Statistics of different layouts are then comparable.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mcore_proxy.functional.model import Layout, ToyMoE
from mcore_proxy.functional.run import causal_inputs, fixed_tokens
from mcore_proxy.testing.global_weights import fill_global_weights
from mcore_proxy.functional.cpu import destroy_distributed, free_port, init_distributed


@dataclass(frozen=True)
class TraceRun:
    """One traced run: model, layout and what the forward passes do."""

    model: ToyMoE = field(default_factory=ToyMoE)
    layout: Layout = field(default_factory=Layout)
    vpp: int | None = None  # virtual pipeline stages per rank (model chunks)
    sequence_parallel: bool = False
    mtp_layers: int = 0
    recompute: bool = False  # full recompute, training-mode forward + backward (PP=1)
    saliency: bool = False
    batch: int = 4  # sequences in the global batch, split over DP replicas
    seq: int | None = None  # use the first `seq` positions (default: model.seq_length)
    pad_from: int | None = None  # positions >= pad_from are padding (padding_mask True)
    steps: int = 1  # forward passes over the batch
    flush_every: int = 0
    seed: int = 0


def allow_recompute_on_cpu() -> None:
    """CPU stand-in for the CUDA RNG state that megatron's activation recomputation saves and
    restores around the re-run forward (there is no CUDA generator on a CPU-only torch)."""
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.empty(0, dtype=torch.uint8)
    mrandom._set_cuda_rng_state = lambda *a, **k: None


class SequenceParallelRMSNorm:
    """CPU stand-in for the apex/TE norms megatron requires with sequence parallelism.

    megatron's `WrappedTorchNorm` refuses sequence parallelism only because torch's norm does
    not mark its weight for the sequence-parallel gradient all-reduce; the forward of a norm is
    per token, so on a sequence slice it computes exactly what apex/TE compute."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_):
        norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        norm.weight.sequence_parallel = True
        return norm


def _swap_torch_norm(spec):
    """Copy of a layer/block spec with every WrappedTorchNorm replaced by SequenceParallelRMSNorm."""
    import copy

    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    def walk(obj):
        if isinstance(obj, (list, tuple)):
            for item in obj:
                walk(item)
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            for f in dataclasses.fields(obj):
                value = getattr(obj, f.name)
                if value is WrappedTorchNorm:
                    setattr(obj, f.name, SequenceParallelRMSNorm)
                else:
                    walk(value)

    spec = copy.deepcopy(spec)
    walk(spec)
    return spec


def run_config(run: TraceRun):
    config = run.model.transformer_config(run.layout)
    extra = {"sequence_parallel": run.sequence_parallel}
    if run.vpp:
        extra["virtual_pipeline_model_parallel_size"] = run.vpp
    if run.mtp_layers:
        extra["mtp_num_layers"] = run.mtp_layers
    if run.recompute:
        extra.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return dataclasses.replace(config, **extra)


def build_stage(run: TraceRun):
    """This rank's GPT stage of `run` (call after init_distributed); with `run.vpp`, the list
    of its model chunks, as Megatron builds them for the interleaved schedule."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec

    config = run_config(run)
    chunks = []
    for vp in range(run.vpp) if run.vpp else [None]:
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm", vp_stage=vp)
        if run.sequence_parallel:
            spec = _swap_torch_norm(spec)
        mtp = (
            get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False, vp_stage=vp) if run.mtp_layers else None
        )
        chunks.append(
            GPTModel(
                config,
                spec,
                vocab_size=run.model.vocab_size,
                max_sequence_length=run.model.seq_length,
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
                parallel_output=False,
                position_embedding_type="rope",
                mtp_block_spec=mtp,
                vp_stage=vp,
            )
        )
    fill_global_weights(chunks, seed=run.seed, router_std=run.model.router_std)
    return chunks if run.vpp else chunks[0]


def replica_tokens(run: TraceRun) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """(tokens [b, s], padding_mask [b, s] or None, dp rank) of this rank's data-parallel replica."""
    from megatron.core import parallel_state as ps

    tokens = fixed_tokens(run.model, batch=run.batch)[:, : run.seq or run.model.seq_length]
    dp, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    tokens = tokens.chunk(dp_size, dim=0)[dp]
    pad = None
    if run.pad_from is not None:
        pad = torch.zeros(tokens.shape, dtype=torch.bool)
        pad[:, run.pad_from :] = True
    return tokens, pad, dp


def forward(gpt, run: TraceRun, tokens: torch.Tensor, pad: torch.Tensor | None):
    """One forward pass (and backward with `run.recompute`); logits [b, s, V] on the last stage.

    Stages (and, with virtual pipelining, the chunks in their interleaved order: rank 0 chunk 0,
    rank 1 chunk 0, ..., rank 0 chunk 1, ...) pass activations on by p2p around the PP ring."""
    from megatron.core import parallel_state as ps

    b, s = tokens.shape
    positions, mask = causal_inputs(b, s)
    kwargs = {"padding_mask": pad} if pad is not None else {}
    if run.mtp_layers:
        kwargs["labels"] = tokens
    if run.recompute:
        gpt.train()
        out = gpt(tokens, positions, mask, **kwargs)
        out.float().pow(2).mean().backward()
        return out.detach()
    out = None
    for vp, chunk in enumerate(gpt if isinstance(gpt, list) else [gpt]):
        chunk.eval()
        vp_stage = vp if run.vpp else None
        with torch.no_grad():
            if not ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage):
                s_local = s // ps.get_tensor_model_parallel_world_size() if run.sequence_parallel else s
                recv = torch.empty(s_local, b, chunk.config.hidden_size)
                torch.distributed.recv(recv, src=ps.get_pipeline_model_parallel_prev_rank())
                chunk.set_input_tensor(recv)
            out = chunk(tokens, positions, mask, **kwargs)
            if not ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage):
                torch.distributed.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
                out = None
    return out


def _traced_forward_passes(run: TraceRun, out_dir: Path) -> None:
    from megatron.core import parallel_state as ps

    from mcore_proxy.trace import install

    gpt = build_stage(run)
    tokens, pad, dp = replica_tokens(run)
    with install(gpt, out_dir, flush_every=run.flush_every, saliency=run.saliency):
        for _ in range(run.steps):
            out = forward(gpt, run, tokens, pad)
    if out is not None and ps.get_tensor_model_parallel_rank() == 0:
        torch.save(out, out_dir / f"logits_dp{dp}.pt")
    torch.distributed.barrier()


def _worker(rank, world, port, runs: dict, out_dir: str):
    first = next(iter(runs.values()))
    lay = first.layout
    torch.set_num_threads(1)  # several ranks share few cores: no intra-op oversubscription
    init_distributed(rank, world, port, tp=lay.tp, pp=lay.pp, ep=lay.ep, etp=lay.etp, vpp=first.vpp)
    try:
        allow_recompute_on_cpu()
        for name, run in runs.items():
            _traced_forward_passes(run, Path(out_dir) / name)
    finally:
        destroy_distributed()


def run_traced(runs: dict[str, TraceRun], out_dir: str | os.PathLike) -> dict[str, Path]:
    """Run each of `runs` (one layout for all: they share the spawned gloo ranks, which saves
    the per-rank start-up) one after the other; returns {name: out_dir/name} holding the rank
    files and logits of that run."""
    layouts = {(run.layout, run.vpp) for run in runs.values()}
    if len(layouts) != 1:
        raise ValueError(f"run_traced: runs of one call must share a layout, got {layouts}")
    out_dir = Path(out_dir)
    folders = {name: out_dir / name for name in runs}
    for folder in folders.values():
        folder.mkdir(parents=True, exist_ok=True)
    world = layouts.pop()[0].world_size
    torch.multiprocessing.spawn(_worker, args=(world, free_port(), dict(runs), str(out_dir)), nprocs=world, join=True)
    return folders


def replica_logits(out_dir: str | os.PathLike) -> torch.Tensor:
    """Logits of all data-parallel replicas, concatenated in batch order."""
    files = sorted(Path(out_dir).glob("logits_dp*.pt"), key=lambda p: int(p.stem[len("logits_dp") :]))
    return torch.cat([torch.load(f) for f in files])
