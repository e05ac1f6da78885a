"""An evaluation launch in miniature: load a Megatron legacy checkpoint and run forward passes
over a token file, on CPU ranks under torchrun. It knows nothing about tracing; routing
statistics are collected only when the launch environment says so (see quickstart.sh):

    PYTHONPATH=<repo>/patches MCORE_PROXY_TRACE_DIR=/tmp/stats \
        torchrun --standalone --nproc_per_node 4 examples/eval_checkpoint_cpu.py --ckpt CKPT --tokens t.npy

The model is built from the checkpoint's own args (Megatron's --use-checkpoint-args) at the
checkpoint's parallel layout; the world size must equal that layout's. Data-parallel replica d
takes micro-batches d, d + DP, ... of the token file.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--tokens", required=True, help=".npy file of token ids")
    ap.add_argument("--micro-batch", type=int, default=4)
    args = ap.parse_args()

    root = Path(args.ckpt)
    it = (root / "latest_checkpointed_iteration.txt").read_text().strip()
    it_dir = root / ("release" if it == "release" else f"iter_{int(it):07d}")
    first = sorted(it_dir.glob("mp_rank_*"))[0] / "model_optim_rng.pt"
    margs = torch.load(first, map_location="cpu", weights_only=False)["args"]

    # CPU stand-in for GPUs and the tiny-model builder of mcore-proxy's tests: megatron-core
    # needs a few CUDA calls neutralised on CPU. Neither has anything to do with tracing.
    from mcore_proxy.functional.family import family_from_args
    from mcore_proxy.functional.model import build_gpt, Layout
    from mcore_proxy.functional.run import forward_logits
    from mcore_proxy.checkpoint.layout import rank_dir_name
    from mcore_proxy.functional.cpu import patch_megatron_for_cpu

    patch_megatron_for_cpu()
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    layout = Layout(
        tp=margs.tensor_model_parallel_size,
        pp=margs.pipeline_model_parallel_size,
        ep=margs.expert_model_parallel_size,
        etp=margs.expert_tensor_parallel_size,
        grouped=bool(margs.moe_grouped_gemm),
        first_stage_layers=getattr(margs, "decoder_first_pipeline_num_layers", None),
    )
    torch.distributed.init_process_group("gloo")
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    model = family_from_args(margs, seq_length=margs.seq_length)
    gpt = build_gpt(model, layout)
    coords = (
        ps.get_tensor_model_parallel_rank(),
        ps.get_pipeline_model_parallel_rank(),
        ps.get_expert_model_parallel_rank(),
    )
    state = torch.load(
        it_dir / rank_dir_name(*coords, layout) / "model_optim_rng.pt", map_location="cpu", weights_only=False
    )
    gpt.load_state_dict(state["model"], strict=True)

    ids = np.load(args.tokens)
    seq, mb = model.seq_length, args.micro_batch
    batches = len(ids) // (seq * mb)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    for b in range(dp_rank, batches - batches % dp, dp):
        chunk = torch.from_numpy(ids[b * seq * mb : (b + 1) * seq * mb].astype(np.int64)).view(mb, seq)
        forward_logits(gpt, chunk)
    if torch.distributed.get_rank() == 0:
        print(
            f"evaluated {batches - batches % dp} micro-batches of {mb}x{seq} tokens on "
            f"{torch.distributed.get_world_size()} ranks"
        )
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
