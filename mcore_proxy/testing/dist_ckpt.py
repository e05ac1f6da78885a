"""torch_dist checkpoints of tiny real megatron-core models on CPU: save, load, run.

Like build.py, everything runs in ranks spawned with `torch.multiprocessing.spawn` over gloo, so
the files are written and read by megatron-core's own `sharded_state_dict` and
`dist_checkpointing` at a real TP/PP/EP layout. The model building, weights and reference logits
are build.py's.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from mcore_proxy.checkpoint.iteration import TRACKER, folder_name, tracked_folder
from mcore_proxy.functional.model import build_gpt, Layout, ToyMoE
from mcore_proxy.functional.run import fixed_tokens, forward_logits, rank_coords, restrict_routers, writes_folder
from mcore_proxy.testing.build import diversify_weights, legacy_rank_dir
from mcore_proxy.functional.cpu import destroy_distributed, free_port, init_distributed

# What Megatron training passes to `sharded_state_dict` and stores in common.pt (its
# `_build_sharded_state_dict_metadata` without the optimizer flags).
CONTENT_METADATA = {"singleton_local_shards": False}


def dist_args(model: ToyMoE, layout: Layout):
    """`args` as Megatron training stores them in a torch_dist common.pt."""
    args = model.megatron_args(layout)
    args.ckpt_format = "torch_dist"
    return args


def iteration_dir(ckpt_dir) -> Path:
    """The iteration folder the tracker of a checkpoint root names."""
    folder = tracked_folder(Path(ckpt_dir))
    if folder is None:
        raise FileNotFoundError(f"{ckpt_dir}: no readable {TRACKER}")
    return folder


def _save_legacy(gpt, model: ToyMoE, layout: Layout, legacy_dir: Path, iteration: int, world: int) -> None:
    """build.py's legacy save, from ranks that already hold the model (a collective)."""
    coords = rank_coords(layout)
    if writes_folder(coords, world):
        folder = legacy_dir / folder_name(iteration) / legacy_rank_dir(*coords, layout)
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(
            {
                "args": model.megatron_args(layout),
                "checkpoint_version": 3.0,
                "iteration": iteration,
                "model": gpt.state_dict_for_save_checkpoint(),
            },
            folder / "model_optim_rng.pt",
        )


def _write_on_last_stage(logits, layout: Layout, world: int, path) -> None:
    coords = rank_coords(layout)
    first = writes_folder(coords, world)  # a collective: every rank calls it once
    if logits is not None and first and coords == (0, layout.pp - 1, 0):
        torch.save(logits, path)


def _save_worker(rank, world, port, model, layout, ckpt_dir, iteration, ref_path, legacy_dir, kept, kept_ref):
    from megatron.core import dist_checkpointing

    init_distributed(rank, world, port, tp=layout.tp, pp=layout.pp, ep=layout.ep, etp=layout.etp)
    try:
        gpt = build_gpt(model, layout)
        diversify_weights(gpt, model)
        tokens = fixed_tokens(model)
        _write_on_last_stage(forward_logits(gpt, tokens), layout, world, ref_path)
        if kept is not None:
            with restrict_routers(gpt, {str(k): v for k, v in kept.items()}):
                _write_on_last_stage(forward_logits(gpt, tokens), layout, world, kept_ref)
        it_dir = Path(ckpt_dir) / folder_name(iteration)
        it_dir.mkdir(parents=True, exist_ok=True)
        state = {
            "model": gpt.sharded_state_dict(metadata=dict(CONTENT_METADATA)),
            "args": dist_args(model, layout),
            "checkpoint_version": 3.0,
            "iteration": iteration,
        }
        dist_checkpointing.save(state, str(it_dir), content_metadata=dict(CONTENT_METADATA))
        if legacy_dir is not None:
            _save_legacy(gpt, model, layout, Path(legacy_dir), iteration, world)
        torch.distributed.barrier()
        if rank == 0:
            for root in (ckpt_dir, legacy_dir):
                if root is not None:
                    (Path(root) / TRACKER).write_text(str(iteration))
    finally:
        destroy_distributed()


def save_torch_dist(
    model: ToyMoE,
    layout: Layout,
    ckpt_dir,
    *,
    iteration: int = 10,
    ref_path=None,
    legacy_dir=None,
    kept: dict[int, list[int]] | None = None,
    kept_ref_path=None,
) -> Path:
    """Build the model at `layout` in spawned gloo ranks and save it as Megatron training does with
    `--ckpt-format torch_dist` (sharded state dict, args in common.pt, tracker).

    Returns the path of the logits [b, s, vocab] on `fixed_tokens` (default: beside the checkpoint).
    `legacy_dir`: the same ranks also save a legacy checkpoint of the same weights.
    `kept` (MoE layer -> kept expert ids): also write the logits with routers restricted to them
    (`restrict_routers`) to `kept_ref_path`.
    """
    ckpt_dir = Path(ckpt_dir)
    ref_path = Path(ref_path or ckpt_dir.with_name(ckpt_dir.name + ".logits.pt"))
    if kept is not None and kept_ref_path is None:
        raise ValueError("kept_ref_path is needed with kept")
    torch.multiprocessing.spawn(
        _save_worker,
        args=(
            layout.world_size,
            free_port(),
            model,
            layout,
            str(ckpt_dir),
            iteration,
            str(ref_path),
            None if legacy_dir is None else str(legacy_dir),
            kept,
            None if kept_ref_path is None else str(kept_ref_path),
        ),
        nprocs=layout.world_size,
        join=True,
    )
    return ref_path


def _load_worker(rank, world, port, model, layout, ckpt_dir, out_path):
    from megatron.core import dist_checkpointing

    init_distributed(rank, world, port, tp=layout.tp, pp=layout.pp, ep=layout.ep, etp=layout.etp)
    try:
        gpt = build_gpt(model, layout)
        it_dir = str(iteration_dir(ckpt_dir))
        # as Megatron training does: the content metadata stored with the checkpoint decides how
        # the model describes its shards
        metadata = dist_checkpointing.load_content_metadata(it_dir) or {}
        loaded = dist_checkpointing.load({"model": gpt.sharded_state_dict(metadata=metadata)}, it_dir)
        gpt.load_state_dict(loaded["model"], strict=True)
        _write_on_last_stage(forward_logits(gpt, fixed_tokens(model)), layout, world, out_path)
        torch.distributed.barrier()
    finally:
        destroy_distributed()


def load_torch_dist_and_run(model: ToyMoE, layout: Layout, ckpt_dir: str | os.PathLike, out_path) -> torch.Tensor:
    """Load a torch_dist checkpoint with megatron-core's `dist_checkpointing.load` into models
    built at `layout` (strict), run the fixed tokens, and return the logits [b, s, vocab]."""
    torch.multiprocessing.spawn(
        _load_worker,
        args=(layout.world_size, free_port(), model, layout, str(ckpt_dir), str(out_path)),
        nprocs=layout.world_size,
        join=True,
    )
    return torch.load(out_path)
