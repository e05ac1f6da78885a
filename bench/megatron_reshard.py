"""The peer of `mcore-proxy convert`: megatron-core's own load-then-save re-sharding, on CPU.

    python bench/megatron_reshard.py SRC -o OUT [--target-tp 1 --target-pp P --target-ep 2] [--timings T.json]

SRC is a legacy checkpoint of a local-spec MoE GPT (what `SyntheticMoEView` + `write_checkpoint`
produce). Megatron has no offline re-sharder in megatron-core, so this does what a user of it
does, in ranks spawned with gloo (one per rank of each layout, as megatron requires):

  A. at the source layout: build the GPT model (bf16, no weight initialisation), `torch.load`
     each rank's `model_optim_rng.pt`, `load_state_dict(strict=True)`, then
     `dist_checkpointing.save` of `sharded_state_dict()` into OUT.torch_dist (torch_dist is
     megatron's layout-free format: it loads at any TP/PP/EP);
  B. at the target layout: build the model, `dist_checkpointing.load`, `load_state_dict`, and
     save legacy `model_optim_rng.pt` rank files at the target layout into OUT, as Megatron's
     `--ckpt-format torch` save does.

Megatron does not prune: OUT holds all E experts per layer. Per-phase wall times (parent side:
process start, imports, build, load, save) go to `--timings`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import time
from pathlib import Path

import torch

from mcore_proxy.functional.model import build_gpt, Layout, ToyMoE
from mcore_proxy.checkpoint.iteration import TRACKER, folder_name
from mcore_proxy.checkpoint.layout import rank_dir_name
from mcore_proxy.functional.run import rank_coords, writes_folder
from mcore_proxy.functional.cpu import destroy_distributed, free_port, init_distributed


@dataclasses.dataclass(frozen=True)
class Bf16MoE(ToyMoE):
    """ToyMoE in bf16 with weight initialisation off (every weight is loaded right after)."""

    def transformer_config(self, layout):
        config = super().transformer_config(layout)
        return dataclasses.replace(
            config, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16, bf16=True, perform_initialization=False
        )


def model_from_args(args) -> Bf16MoE:
    return Bf16MoE(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size,
        num_experts=args.num_experts,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        topk=args.moe_router_topk,
        vocab_size=args.padded_vocab_size,
        seq_length=getattr(args, "seq_length", 16) or 16,
    )


def _mark(stamps: dict, key: str, t0: float) -> None:
    torch.distributed.barrier()
    stamps[key] = round(time.perf_counter() - t0, 2)


def _phase_a(rank, world, port, model, layout, src_iter_dir, dist_dir, stamps_path):
    from megatron.core import dist_checkpointing

    t0 = time.perf_counter()
    init_distributed(rank, world, port, tp=layout.tp, pp=layout.pp, ep=layout.ep, etp=layout.etp)
    stamps = {}
    try:
        _mark(stamps, "init", t0)
        gpt = build_gpt(model, layout).bfloat16()  # as Float16Module does in bf16 training
        _mark(stamps, "build", t0)
        path = Path(src_iter_dir) / rank_dir_name(*rank_coords(layout), layout) / "model_optim_rng.pt"
        state = torch.load(path, map_location="cpu", weights_only=False)
        _mark(stamps, "torch.load", t0)
        gpt.load_state_dict(state["model"], strict=True)
        args, iteration = state["args"], state["iteration"]
        del state
        _mark(stamps, "load_state_dict", t0)
        Path(dist_dir).mkdir(parents=True, exist_ok=True)
        args.ckpt_format = "torch_dist"
        dist_checkpointing.save(
            {"model": gpt.sharded_state_dict(), "args": args, "checkpoint_version": 3.0, "iteration": iteration},
            str(dist_dir),
        )
        _mark(stamps, "dist_checkpointing.save", t0)
        if rank == 0:
            Path(stamps_path).write_text(json.dumps(stamps))
    finally:
        destroy_distributed()


def _phase_b(rank, world, port, model, layout, dist_dir, out_dir, args, iteration, stamps_path):
    from megatron.core import dist_checkpointing

    t0 = time.perf_counter()
    init_distributed(rank, world, port, tp=layout.tp, pp=layout.pp, ep=layout.ep, etp=layout.etp)
    stamps = {}
    try:
        _mark(stamps, "init", t0)
        gpt = build_gpt(model, layout).bfloat16()  # as Float16Module does in bf16 training
        _mark(stamps, "build", t0)
        loaded = dist_checkpointing.load({"model": gpt.sharded_state_dict()}, str(dist_dir))
        _mark(stamps, "dist_checkpointing.load", t0)
        gpt.load_state_dict(loaded["model"], strict=True)
        del loaded
        _mark(stamps, "load_state_dict", t0)
        coords = rank_coords(layout)
        if writes_folder(coords, world):
            folder = Path(out_dir) / folder_name(iteration) / rank_dir_name(*coords, layout)
            folder.mkdir(parents=True, exist_ok=True)
            torch.save(
                {
                    "args": args,
                    "checkpoint_version": 3.0,
                    "iteration": iteration,
                    "model": gpt.state_dict_for_save_checkpoint(),
                },
                folder / "model_optim_rng.pt",
            )
        _mark(stamps, "torch.save legacy", t0)
        if rank == 0:
            (Path(out_dir) / TRACKER).write_text(str(iteration))
            Path(stamps_path).write_text(json.dumps(stamps))
    finally:
        destroy_distributed()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--target-tp", type=int, default=None)
    ap.add_argument("--target-pp", type=int, default=None)
    ap.add_argument("--target-ep", type=int, default=None)
    ap.add_argument("--timings", default=None)
    ap.add_argument("--keep-torch-dist", action="store_true")
    a = ap.parse_args()

    from mcore_proxy.checkpoint.legacy import LegacyCheckpoint

    src = LegacyCheckpoint(a.src)  # metadata only: args and the source layout
    s = src.layout
    if len(set(s.stage_layers)) != 1 or s.vpp != 1 or s.etp != s.tp:
        raise SystemExit("this peer handles even pipeline stages, no VPP, ETP=TP only")
    model = model_from_args(src.args)
    source = Layout(tp=s.tp, pp=s.pp, ep=s.ep)
    target = Layout(tp=a.target_tp or s.tp, pp=a.target_pp or s.pp, ep=a.target_ep or s.ep)
    out = Path(a.out)
    dist_dir = out.with_name(out.name + ".torch_dist")
    for p in (out, dist_dir):
        if p.exists():
            raise SystemExit(f"{p} exists")
    stamps_a, stamps_b = out.with_name(out.name + ".a.json"), out.with_name(out.name + ".b.json")
    iteration = src.iteration if isinstance(src.iteration, int) else 0

    t0 = time.perf_counter()
    torch.multiprocessing.spawn(
        _phase_a,
        args=(source.world_size, free_port(), model, source, str(src.path), str(dist_dir), str(stamps_a)),
        nprocs=source.world_size,
        join=True,
    )
    t1 = time.perf_counter()
    tgt_args = argparse.Namespace(**vars(src.args))  # megatron saves its own args, layout updated
    tgt_args.tensor_model_parallel_size, tgt_args.pipeline_model_parallel_size = target.tp, target.pp
    tgt_args.expert_model_parallel_size, tgt_args.expert_tensor_parallel_size = target.ep, target.etp
    torch.multiprocessing.spawn(
        _phase_b,
        args=(
            target.world_size,
            free_port(),
            model,
            target,
            str(dist_dir),
            str(out),
            tgt_args,
            iteration,
            str(stamps_b),
        ),
        nprocs=target.world_size,
        join=True,
    )
    t2 = time.perf_counter()
    timings = {
        "source_ranks": source.world_size,
        "target_ranks": target.world_size,
        "phase_a_s": round(t1 - t0, 2),
        "phase_b_s": round(t2 - t1, 2),
        "torch_dist_bytes": sum(p.stat().st_size for p in dist_dir.rglob("*") if p.is_file()),
        "out_bytes": sum(p.stat().st_size for p in out.rglob("*") if p.is_file()),
        "phase_a_steps": json.loads(stamps_a.read_text()),
        "phase_b_steps": json.loads(stamps_b.read_text()),
    }
    stamps_a.unlink()
    stamps_b.unlink()
    if not a.keep_torch_dist:
        shutil.rmtree(dist_dir)
    print(json.dumps(timings))
    if a.timings:
        Path(a.timings).write_text(json.dumps(timings, indent=1))


if __name__ == "__main__":
    main()
