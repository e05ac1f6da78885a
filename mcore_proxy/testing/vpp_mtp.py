"""Legacy checkpoints with virtual pipeline stages and MTP layers, saved as Megatron training does.

A `Job` builds one tiny ToyMoE with megatron-core at a layout (`TraceRun`: TP/PP/EP/ETP, `vpp`
model chunks, `mtp_layers`) with layout-independent global weights (`trace_runs.build_stage`),
then either saves it (`model` or, with virtual stages, `model0`, `model1`, ... per rank file;
`args` as Megatron's argparse leaves them) or loads a legacy checkpoint into it strictly, and
runs the fixed tokens. Logits are written as [1 + mtp_layers, b, s, V]: the main head, then
each MTP depth (the MTP heads are the output layer applied to each depth's hidden states).

`run_jobs` runs several jobs one after the other in *one* set of spawned gloo ranks,
re-initialising megatron's parallel state per job: each spawned rank costs seconds of imports.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mcore_proxy.checkpoint.iteration import TRACKER, folder_name, tracked_folder
from mcore_proxy.functional.run import fixed_tokens, rank_coords, restrict_routers, writes_folder
from mcore_proxy.testing.build import legacy_rank_dir, training_extras
from mcore_proxy.functional.cpu import destroy_distributed, free_port, init_distributed
from mcore_proxy.testing.trace_runs import TraceRun, build_stage, forward


@dataclass(frozen=True)
class Job:
    """One model in the shared world: build `run`, then save to `save` or load `load`, then run.

    keep: restrict the routers to these experts while running (`build.restrict_routers`).
    logits: where the last pipeline stage writes [1 + mtp_layers, b, s, V].
    """

    run: TraceRun = field(default_factory=TraceRun)
    save: str | None = None
    load: str | None = None
    logits: str | None = None
    keep: dict[str, list[int]] | None = None
    iteration: int = 10


def training_args(run: TraceRun):
    """`args` as Megatron-LM training pickles them for `run`.

    Virtual stages: the user gives `--num-layers-per-virtual-pipeline-stage` (or, for uneven
    stages, `--num-virtual-stages-per-pipeline-rank`); `validate_args` derives
    `virtual_pipeline_model_parallel_size` and keeps both. `--overlap-p2p-comm` defaults on and
    is switched off without interleaving. MTP: `--mtp-num-layers` (None when off).
    """
    args = run.model.megatron_args(run.layout)
    vpp = run.vpp if run.vpp and run.vpp > 1 else None
    per_stage = run.model.num_layers // run.layout.pp
    if vpp and (run.layout.first_stage_layers or per_stage % vpp):
        raise ValueError(f"{run}: virtual stages need even stages of a multiple of {vpp} layers")
    args.num_layers_per_virtual_pipeline_stage = per_stage // vpp if vpp else None
    args.num_virtual_stages_per_pipeline_rank = None
    args.virtual_pipeline_model_parallel_size = vpp
    args.overlap_p2p_comm = vpp is not None
    args.mtp_num_layers = run.mtp_layers or None
    args.mtp_loss_scaling_factor = 0.1
    return args


def _enter_layout(rank: int, world: int, port: int, run: TraceRun) -> None:
    """gloo group on first use; megatron's parallel state for `run`'s layout every time."""
    lay = run.layout
    if not torch.distributed.is_initialized():
        init_distributed(rank, world, port, tp=lay.tp, pp=lay.pp, ep=lay.ep, etp=lay.etp, vpp=run.vpp)
        return
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=lay.tp,
        pipeline_model_parallel_size=lay.pp,
        virtual_pipeline_model_parallel_size=run.vpp,
        expert_model_parallel_size=lay.ep,
        expert_tensor_parallel_size=lay.etp,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(1234)


def _chunks(gpt) -> list:
    return gpt if isinstance(gpt, list) else [gpt]


def _model_state_keys(run: TraceRun) -> list[str]:
    """`model` or `model0`, `model1`, ...: Megatron's keys for this rank's model chunks."""
    return [f"model{v}" for v in range(run.vpp)] if run.vpp else ["model"]


def _heads(gpt, run: TraceRun, tokens: torch.Tensor) -> torch.Tensor | None:
    """[1 + mtp_layers, b, s, V] on the last stage (None elsewhere): every output-layer call of
    the forward, MTP depths first in megatron's post-processing, the main head last. Cloned:
    the loss megatron computes from them (labels are needed with MTP) works in place."""
    seen: list[torch.Tensor] = []
    hooks = [
        c.output_layer.register_forward_hook(lambda m, i, o: seen.append(o[0].detach().clone()))
        for c in _chunks(gpt)
        if getattr(c, "post_process", False)
    ]
    try:
        out = forward(gpt, run, tokens, None)
    finally:
        for h in hooks:
            h.remove()
    if out is None:
        return None
    if len(seen) != 1 + run.mtp_layers:
        raise RuntimeError(f"expected {1 + run.mtp_layers} output-layer calls, saw {len(seen)}")
    return torch.stack([x.transpose(0, 1) for x in [seen[-1], *seen[:-1]]])


def _job(job: Job, world: int) -> None:
    run = job.run
    gpt = build_stage(run)
    coords = rank_coords(run.layout)
    writer = writes_folder(coords, world)  # a collective: every rank calls it once per job
    if job.load:
        state = torch.load(
            tracked_folder(Path(job.load)) / legacy_rank_dir(*coords, run.layout) / "model_optim_rng.pt",
            map_location="cpu",
            weights_only=False,
        )
        for chunk, key in zip(_chunks(gpt), _model_state_keys(run)):
            chunk.load_state_dict(state[key], strict=True)
    with contextlib.ExitStack() as stack:
        for chunk in _chunks(gpt) if job.keep else []:
            stack.enter_context(restrict_routers(chunk, job.keep))
        heads = _heads(gpt, run, fixed_tokens(run.model))
    if job.save and writer:
        folder = Path(job.save) / folder_name(job.iteration) / legacy_rank_dir(*coords, run.layout)
        folder.mkdir(parents=True, exist_ok=True)
        state = {"args": training_args(run), "checkpoint_version": 3.0, "iteration": job.iteration}
        for chunk, key in zip(_chunks(gpt), _model_state_keys(run)):
            state[key] = chunk.state_dict_for_save_checkpoint()
        state.update(training_extras(torch.nn.ModuleList(_chunks(gpt))))
        torch.save(state, folder / "model_optim_rng.pt")
    if heads is not None and job.logits and writer and coords == (0, run.layout.pp - 1, 0):
        torch.save(heads, job.logits)
    torch.distributed.barrier()
    if job.save and torch.distributed.get_rank() == 0:
        (Path(job.save) / TRACKER).write_text(str(job.iteration))


def _worker(rank: int, world: int, port: int, jobs: list[Job]) -> None:
    torch.set_num_threads(1)  # several ranks share few cores
    try:
        for job in jobs:
            _enter_layout(rank, world, port, job.run)
            _job(job, world)
    finally:
        if torch.distributed.is_initialized():
            destroy_distributed()


def run_jobs(jobs: list[Job], world: int | None = None) -> None:
    """Run `jobs` in order in one set of spawned gloo ranks (`world`: the largest job's world
    size by default; every job's layout must fit it, the rest of the ranks are data parallel)."""
    world = world or max(job.run.layout.world_size for job in jobs)
    for job in jobs:
        if world % job.run.layout.world_size:
            raise ValueError(f"{job.run.layout} does not fit a world of {world} ranks")
    torch.multiprocessing.spawn(_worker, args=(world, free_port(), list(jobs)), nprocs=world, join=True)


def save_checkpoint(
    run: TraceRun, ckpt_dir: str | os.PathLike, logits: str | os.PathLike | None = None, iteration: int = 10
) -> Path:
    """Save `run`'s model (global weights) as a legacy checkpoint, as Megatron training does."""
    run_jobs([Job(run, save=str(ckpt_dir), logits=str(logits) if logits else None, iteration=iteration)])
    return Path(ckpt_dir)


def load_and_run(
    run: TraceRun, ckpt_dir: str | os.PathLike, logits: str | os.PathLike, keep: dict[str, list[int]] | None = None
) -> torch.Tensor:
    """Load a legacy checkpoint strictly into `run`'s model; -> [1 + mtp_layers, b, s, V]."""
    run_jobs([Job(run, load=str(ckpt_dir), logits=str(logits), keep=keep)])
    return torch.load(logits)
