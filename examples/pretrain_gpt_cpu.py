"""A CPU stand-in for MindSpeed-LLM's / Megatron-LM's `pretrain_gpt.py`: megatron-core on gloo ranks.

    torchrun --nproc_per_node 2 examples/pretrain_gpt_cpu.py <Megatron arguments> --load CKPT --mock-data

It takes the argument names of a Megatron/MindSpeed-LLM launch script (the subset a small
SwiGLU/RMSNorm/RoPE MoE GPT needs; anything else is refused, as Megatron refuses unknown
flags), builds the model with megatron-core at the given TP/PP/EP/ETP layout, loads the
legacy checkpoint in `--load` strictly, and trains `--train-iters` iterations on `--mock-data`
(a fixed pool of random sequences, so the loss falls as it memorises them) with Adam. Like
Megatron, it needs `--no-load-optim --no-load-rng` when the checkpoint holds no optimizer or RNG
state, and it fails when the model the arguments describe does not match the checkpoint.

Pipeline stages pass activations forward and gradients back by p2p, one micro-batch at a time
(no 1F1B overlap: a schedule on CPU needs no overlap, and megatron-core's own schedules allocate
on CUDA); gradients are averaged over the data-parallel group (expert parameters over the
expert-data-parallel group), as Megatron's DDP does.
"""

from __future__ import annotations

import argparse
import ast
import sys
import time
from pathlib import Path

import torch

# the data-parallel gradient averaging of the plain training example (this folder is on sys.path)
from train_step_cpu import average_gradients


def moe_layer_freq(text: str):
    """Megatron's --moe-layer-freq: an int, or a list literal such as [0,1,1,1] (no expressions)."""
    value = ast.literal_eval(text)
    if isinstance(value, int) or (isinstance(value, list) and all(v in (0, 1) for v in value)):
        return value
    raise argparse.ArgumentTypeError(f"{text!r}: expected an int or a list of 0/1 such as [0,1,1,1]")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    model = p.add_argument_group("model (GPT_ARGS)")
    for name in (
        "num-layers",
        "hidden-size",
        "ffn-hidden-size",
        "num-attention-heads",
        "seq-length",
        "max-position-embeddings",
        "padded-vocab-size",
        "make-vocab-size-divisible-by",
    ):
        model.add_argument(f"--{name}", type=int)
    model.add_argument("--normalization", choices=("RMSNorm",), default="RMSNorm")
    model.add_argument("--position-embedding-type", choices=("rope",), default="rope")
    for flag in ("--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights"):
        model.add_argument(flag, action="store_true")
    moe = p.add_argument_group("MoE (MOE_ARGS)")
    for name in (
        "num-experts",
        "moe-router-topk",
        "moe-ffn-hidden-size",
        "moe-shared-expert-intermediate-size",
        "moe-router-num-groups",
        "moe-router-group-topk",
    ):
        moe.add_argument(f"--{name}", type=int)
    moe.add_argument("--moe-layer-freq", type=moe_layer_freq, default=1)
    moe.add_argument("--moe-router-score-function", choices=("softmax", "sigmoid"), default="softmax")
    moe.add_argument("--moe-token-dispatcher-type", choices=("allgather",), default="allgather")
    for flag in ("--moe-shared-expert-gate", "--moe-router-enable-expert-bias", "--moe-grouped-gemm"):
        moe.add_argument(flag, action="store_true")
    par = p.add_argument_group("parallelism (MODEL_PARALLEL_ARGS)")
    for name in ("tensor-model-parallel-size", "pipeline-model-parallel-size", "expert-model-parallel-size"):
        par.add_argument(f"--{name}", type=int, default=1)
    par.add_argument("--expert-tensor-parallel-size", type=int)
    par.add_argument("--decoder-first-pipeline-num-layers", type=int)
    train = p.add_argument_group("training (TRAIN_ARGS, OUTPUT_ARGS)")
    for name, default in (
        ("micro-batch-size", 1),
        ("global-batch-size", None),
        ("train-iters", 4),
        ("seed", 1234),
        ("log-interval", 1),
    ):
        train.add_argument(f"--{name}", type=int, default=default)
    train.add_argument("--lr", type=float, default=1e-3)
    train.add_argument("--load", type=Path, required=True, help="legacy checkpoint (the proxy)")
    train.add_argument("--mock-data", action="store_true", help="random sequences instead of --data-path")
    for flag in ("--no-load-optim", "--no-load-rng"):
        train.add_argument(flag, action="store_true")
    train.add_argument("--distributed-backend", choices=("gloo",), default="gloo")
    args = p.parse_args(argv)
    if not args.mock_data:
        p.error("only --mock-data is supported on CPU (MindSpeed-LLM reads --data-path)")
    if args.moe_grouped_gemm:
        p.error("--moe-grouped-gemm: this CPU stand-in builds SequentialMLP experts")
    return args


def toy_model(args):
    """The model (as mcore_proxy reads a checkpoint's args: `functional.family.family_from_args`)
    and the Layout the arguments describe."""
    from mcore_proxy.functional.family import family_from_args
    from mcore_proxy.functional.model import Layout

    model = family_from_args(args, seq_length=args.seq_length)
    layout = Layout(
        tp=args.tensor_model_parallel_size,
        pp=args.pipeline_model_parallel_size,
        ep=args.expert_model_parallel_size,
        etp=args.expert_tensor_parallel_size,
        first_stage_layers=args.decoder_first_pipeline_num_layers,
    )
    return model, layout


def fail(message: str) -> None:
    print(f"pretrain_gpt_cpu: error: {message}", file=sys.stderr, flush=True)
    sys.exit(1)


def load_checkpoint(gpt, args, layout) -> int:
    """Megatron's load: the rank's mp_rank_* file, strictly; returns the iteration."""
    from megatron.core import parallel_state as ps

    from mcore_proxy.checkpoint.iteration import folder_name
    from mcore_proxy.checkpoint.layout import rank_dir_name

    tracker = args.load / "latest_checkpointed_iteration.txt"
    if not tracker.is_file():
        fail(f"{tracker}: missing; --load must be a Megatron checkpoint folder")
    it = tracker.read_text().strip()
    coords = (
        ps.get_tensor_model_parallel_rank(),
        ps.get_pipeline_model_parallel_rank(),
        ps.get_expert_model_parallel_rank(),
    )
    path = (
        args.load
        / folder_name(it if it == "release" else int(it))
        / rank_dir_name(*coords, layout)
        / "model_optim_rng.pt"
    )
    if not path.is_file():
        fail(
            f"{path}: no rank file for TP/PP/EP rank {coords}; the launch's parallel sizes do not match "
            "the checkpoint (use the flags mcore-proxy convert printed)"
        )
    state = torch.load(path, map_location="cpu", weights_only=False)  # as Megatron loads its own files
    if "optimizer" not in state and not args.no_load_optim:
        fail(f"{path}: holds no optimizer state; pass --no-load-optim")
    if "rng_state" not in state and not args.no_load_rng:
        fail(f"{path}: holds no RNG state; pass --no-load-rng")
    problems = state_dict_mismatch(state["model"], gpt.state_dict())
    if problems:
        fail(f"{path}: does not match the model the arguments describe: {problems}")
    gpt.load_state_dict(state["model"], strict=True)
    return int(state.get("iteration", 0) or 0)


def state_dict_mismatch(saved: dict, built: dict) -> str:
    """What a strict load would refuse, in one line ('' when it would load)."""
    out = [
        f"{k}: checkpoint {list(v.shape)}, model {list(built[k].shape)}"
        for k, v in saved.items()
        if k in built and isinstance(v, torch.Tensor) and v.shape != built[k].shape
    ][:1]
    for what, keys in (
        ("missing from the checkpoint", [k for k in built if k not in saved]),
        ("not in the model", [k for k in saved if k not in built]),
    ):
        if keys:
            out.append(f"{len(keys)} tensors {what} (first {keys[0]})")
    return "; ".join(out)


def mock_batches(args, dp: int, dp_size: int, micro_batches: int):
    """Every iteration the same global batch of random sequences; replica dp takes its micro-batches."""
    g = torch.Generator().manual_seed(args.seed)
    pool = torch.randint(0, args.padded_vocab_size, (args.global_batch_size, args.seq_length + 1), generator=g)
    mine = pool.view(dp_size, micro_batches, args.micro_batch_size, -1)[dp]
    return [(mb[:, :-1], mb[:, 1:]) for mb in mine]


def train_micro_batch(gpt, tokens, labels, scale: float, hidden: int) -> torch.Tensor | None:
    """Forward and backward of one micro-batch through the pipeline; its loss on the last stage."""
    from megatron.core import parallel_state as ps

    b, s = tokens.shape
    positions = torch.arange(s).expand(b, s)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    received = None
    if not first:
        received = torch.empty(s, b, hidden)
        torch.distributed.recv(received, src=ps.get_pipeline_model_parallel_prev_rank())
        received.requires_grad_()
        gpt.set_input_tensor(received)
    out = gpt(tokens, positions, mask)
    loss = None
    if last:  # logits [b, s, V], gathered over TP (the helper builds parallel_output=False)
        loss = torch.nn.functional.cross_entropy(out.float().flatten(0, 1), labels.flatten())
        (loss * scale).backward()
    else:
        torch.distributed.send(out.detach().contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
        grad = torch.empty_like(out)
        torch.distributed.recv(grad, src=ps.get_pipeline_model_parallel_next_rank())
        out.backward(grad)
    if received is not None:
        torch.distributed.send(received.grad.contiguous(), dst=ps.get_pipeline_model_parallel_prev_rank())
    return loss


def initialize(args):
    """gloo ranks from torchrun's environment, megatron's parallel state, the model: (toy, layout, gpt)."""
    # CPU stand-in for NPUs/GPUs: megatron-core calls a few CUDA functions even on CPU, which
    # mcore-proxy's test helper neutralises (mcore_proxy/functional/cpu.py)
    from mcore_proxy.functional.model import build_gpt
    from mcore_proxy.functional.cpu import patch_megatron_for_cpu

    patch_megatron_for_cpu()
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    torch.distributed.init_process_group(args.distributed_backend)
    model, layout = toy_model(args)
    world = torch.distributed.get_world_size()
    if world % (layout.tp * layout.pp):
        fail(f"{world} ranks do not divide into TP x PP = {layout.tp * layout.pp}")
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    return model, layout, build_gpt(model, layout).train()


def log_iteration(args, step: int, seconds: float, loss: float) -> None:
    """Megatron's training log line."""
    print(
        f" iteration {step:8d}/{args.train_iters:8d} | consumed samples: {step * args.global_batch_size:12d}"
        f" | elapsed time per iteration (ms): {1000 * seconds:.1f} | learning rate: {args.lr:.6E}"
        f" | global batch size: {args.global_batch_size:5d} | lm loss: {loss:.6E} |",
        flush=True,
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    model, layout, gpt = initialize(args)
    from megatron.core import parallel_state as ps

    iteration = load_checkpoint(gpt, args, layout)
    dp, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    args.global_batch_size = args.global_batch_size or args.micro_batch_size * dp_size
    micro_batches = args.global_batch_size // (args.micro_batch_size * dp_size)
    if micro_batches < 1 or args.global_batch_size % (args.micro_batch_size * dp_size):
        fail(
            f"--global-batch-size {args.global_batch_size} is not a multiple of micro-batch x DP "
            f"= {args.micro_batch_size * dp_size}"
        )
    if torch.distributed.get_rank() == 0:
        print(
            f"loaded {args.load} iteration {iteration}: {model.num_experts} experts per MoE layer, "
            f"{torch.distributed.get_world_size()} ranks at TP={layout.tp} PP={layout.pp} EP={layout.ep} "
            f"ETP={layout.etp} DP={dp_size}, {micro_batches} micro-batches of {args.micro_batch_size}",
            flush=True,
        )
    reporter = ps.is_pipeline_last_stage() and dp == 0 and ps.get_tensor_model_parallel_rank() == 0
    optimizer = torch.optim.Adam(gpt.parameters(), lr=args.lr)
    batches = mock_batches(args, dp, dp_size, micro_batches)
    for step in range(1, args.train_iters + 1):
        start = time.perf_counter()
        optimizer.zero_grad()
        losses = [train_micro_batch(gpt, t, lab, 1 / micro_batches, model.hidden_size) for t, lab in batches]
        average_gradients(gpt)
        optimizer.step()
        if ps.is_pipeline_last_stage():  # the loss averaged over micro-batches and replicas
            loss = torch.stack(losses).mean().detach()
            torch.distributed.all_reduce(loss, group=ps.get_data_parallel_group())
            if reporter and step % args.log_interval == 0:
                log_iteration(args, step, time.perf_counter() - start, loss.item() / dp_size)
    torch.distributed.barrier()
    ps.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
