"""Test fixtures: tiny real megatron-core MoE GPT models saved on CPU as Megatron training does.

Everything here runs inside ranks spawned with `torch.multiprocessing.spawn` over gloo, so the
checkpoints are written by megatron-core's own modules at a real TP/PP/EP/ETP layout. Building
and running models is `mcore_proxy.functional`'s; this module adds what only tests need:
weights made diverse per expert, the training entries of a save, the save itself.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import torch

from mcore_proxy.checkpoint.iteration import TRACKER, folder_name
from mcore_proxy.checkpoint.layout import rank_dir_name
from mcore_proxy.functional.cpu import destroy_distributed, free_port, init_distributed
from mcore_proxy.functional.model import Layout, ToyMoE, build_gpt
from mcore_proxy.functional.run import fixed_tokens, forward_logits, rank_coords, writes_folder


def diversify_weights(gpt, model: ToyMoE) -> None:
    """Make experts differ and routing decisive, deterministically.

    CPU initialisation draws the same numbers on every EP rank, so experts on different EP ranks
    would be copies; noise keyed by (layer, global expert, TP rank) breaks that, and router rows
    and expert biases keyed by layer stay identical on all replicas.
    """
    from megatron.core import parallel_state as ps

    ep_rank, tp_rank = ps.get_expert_model_parallel_rank(), ps.get_expert_tensor_parallel_rank()
    for layer in gpt.decoder.layers:
        mlp = layer.mlp
        if not hasattr(mlp, "router"):
            continue
        g = torch.Generator().manual_seed(1000 + layer.layer_number + 7919 * model.weight_seed)
        mlp.router.weight.data.copy_(torch.randn(mlp.router.weight.shape, generator=g) * model.router_std)
        if getattr(mlp.router, "expert_bias", None) is not None:
            mlp.router.expert_bias.copy_(torch.randn(mlp.router.expert_bias.shape, generator=g) * 0.1)
        local = mlp.experts.num_local_experts
        for name, p in mlp.experts.named_parameters():
            for j in range(local):
                expert = ep_rank * local + j
                gen = torch.Generator().manual_seed(
                    layer.layer_number * 100_003 + expert * 101 + tp_rank + 7919 * model.weight_seed
                )
                _add_expert_noise(p, name, j, local, gen)


def _add_expert_noise(p, name: str, j: int, local: int, gen) -> None:
    if "local_experts" in name:  # SequentialMLP: one module per expert
        if name.split(".")[1] == str(j):
            p.data.add_(torch.randn(p.shape, generator=gen) * 0.05)
    else:  # GroupedMLP: [H, E*2F] / [E*F, H], expert-major memory
        view = p.data.view(local, -1)
        view[j].add_(torch.randn(view[j].shape, generator=gen) * 0.05)


# the rank folder name of Megatron's legacy format (`mp_rank_TT[_PPP][_EEE]`)
legacy_rank_dir = rank_dir_name


def training_extras(gpt) -> dict:
    """Optimizer, scheduler and RNG entries as a training save has them (the reader ignores them)."""
    opt = torch.optim.Adam(gpt.parameters(), lr=1e-4)
    return {
        "optimizer": {"optimizer": opt.state_dict(), "param_groups_sizes": [len(list(gpt.parameters()))]},
        "opt_param_scheduler": {"max_lr": 1e-4, "num_steps": 10},
        "rng_state": [
            {
                "random_rng_state": random.getstate(),
                "np_rng_state": np.random.get_state(),
                "torch_rng_state": torch.get_rng_state(),
                "rng_tracker_states": {},
            }
        ],
        "num_floating_point_operations_so_far": 0,
    }


def _save_worker(rank, world, port, model, layout, ckpt_dir, iteration, ref_path):
    init_distributed(rank, world, port, tp=layout.tp, pp=layout.pp, ep=layout.ep, etp=layout.etp)
    try:
        gpt = build_gpt(model, layout)
        diversify_weights(gpt, model)
        logits = forward_logits(gpt, fixed_tokens(model))
        coords = rank_coords(layout)
        writer = writes_folder(coords, world)  # a collective: every rank calls it once
        if writer:
            folder = Path(ckpt_dir) / folder_name(iteration) / legacy_rank_dir(*coords, layout)
            folder.mkdir(parents=True, exist_ok=True)
            state = {
                "args": model.megatron_args(layout),
                "checkpoint_version": 3.0,
                "iteration": iteration,
                "model": gpt.state_dict_for_save_checkpoint(),
            }
            state.update(training_extras(gpt))
            torch.save(state, folder / "model_optim_rng.pt")
        if logits is not None and writer and coords == (0, layout.pp - 1, 0):
            torch.save(logits, ref_path)
        torch.distributed.barrier()
        if rank == 0:
            (Path(ckpt_dir) / TRACKER).write_text(str(iteration))
    finally:
        destroy_distributed()


def save_checkpoint(
    model: ToyMoE,
    layout: Layout,
    ckpt_dir: str | os.PathLike,
    iteration: int = 10,
    ref_path: str | os.PathLike | None = None,
) -> Path:
    """Build the model at `layout` in spawned gloo ranks, save a legacy checkpoint, and write the
    logits [b, s, vocab] on `fixed_tokens` to `ref_path` (default: beside the checkpoint)."""
    ckpt_dir = Path(ckpt_dir)
    ref_path = Path(ref_path or ckpt_dir.with_name(ckpt_dir.name + ".logits.pt"))
    torch.multiprocessing.spawn(
        _save_worker,
        args=(layout.world_size, free_port(), model, layout, str(ckpt_dir), iteration, str(ref_path)),
        nprocs=layout.world_size,
        join=True,
    )
    return ref_path
