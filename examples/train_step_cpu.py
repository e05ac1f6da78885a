"""A user's launch script in miniature: train (or evaluate) a tiny megatron-core MoE GPT on CPU.

It knows nothing about mcore-proxy's tracing. Routing statistics are collected only because the
launch environment says so (see examples/trace_cpu.sh):

    PYTHONPATH=<repo>/patches MCORE_PROXY_TRACE_DIR=/tmp/stats \
        torchrun --standalone --nproc_per_node 2 examples/train_step_cpu.py --tokens tokens.npy --ep 2

Data: a .npy of int token ids, cut into sequences of --seq-length + 1 (inputs and shifted
labels); data-parallel replica d takes micro-batches d, d + DP, d + 2 DP, ... of the file, and
wraps around. Training: forward, backward, gradients averaged over the data-parallel group
(expert parameters over the expert-data-parallel group), AdamW step. `--eval`: forward only,
which also allows --tp > 1 without sequence parallelism.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", required=True, help=".npy file of token ids")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--seq-length", type=int, default=32)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--eval", action="store_true", help="forward passes only")
    return p.parse_args()


def setup(args):
    # CPU stand-in for a GPU: megatron-core calls a few CUDA functions even on CPU; the shim
    # neutralises them. It is a test fixture of mcore-proxy, not part of the tracing.
    from mcore_proxy.functional.cpu import patch_megatron_for_cpu

    patch_megatron_for_cpu()
    from megatron.core import parallel_state, tensor_parallel

    torch.distributed.init_process_group("gloo")  # rank, world, master from torchrun's env
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tp, expert_model_parallel_size=args.ep, expert_tensor_parallel_size=1
    )
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(1234)


def build_model(args):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=4,
        ffn_hidden_size=2 * args.hidden,
        num_moe_experts=args.experts,
        moe_ffn_hidden_size=args.hidden // 2,
        moe_router_topk=args.topk,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-2,
        moe_token_dispatcher_type="allgather",
        gated_linear_unit=True,
        add_bias_linear=False,
        normalization="RMSNorm",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        bf16=False,
        tensor_model_parallel_size=args.tp,
        expert_model_parallel_size=args.ep,
        expert_tensor_parallel_size=1,
        init_method_std=0.2,
    )
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    return GPTModel(
        config, spec, vocab_size=args.vocab, max_sequence_length=args.seq_length, position_embedding_type="rope"
    )


def micro_batches(args):
    from megatron.core import parallel_state

    data = np.load(args.tokens).astype(np.int64) % args.vocab
    per = args.seq_length + 1
    sequences = torch.from_numpy(data[: len(data) // per * per].reshape(-1, per))
    dp, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    batches = len(sequences) // args.micro_batch
    for step in range(args.steps):
        i = (step * dp_size + dp) % batches
        chunk = sequences[i * args.micro_batch : (i + 1) * args.micro_batch]
        yield chunk[:, :-1], chunk[:, 1:]


def average_gradients(model):
    from megatron.core import parallel_state

    for param in model.parameters():
        if param.grad is None:
            continue
        expert = not getattr(param, "allreduce", True)  # megatron marks expert parameters
        group = parallel_state.get_expert_data_parallel_group() if expert else parallel_state.get_data_parallel_group()
        if torch.distributed.get_world_size(group) > 1:
            torch.distributed.all_reduce(param.grad, group=group)
            param.grad /= torch.distributed.get_world_size(group)


def main():
    args = parse_args()
    setup(args)
    model = build_model(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mask = torch.triu(torch.ones(args.seq_length, args.seq_length, dtype=torch.bool), 1)[None, None]
    positions = torch.arange(args.seq_length).expand(args.micro_batch, -1)
    model.train(not args.eval)
    for step, (tokens, labels) in enumerate(micro_batches(args)):
        if args.eval:
            with torch.no_grad():
                loss = model(tokens, positions, mask, labels=labels).mean()
        else:
            loss = model(tokens, positions, mask, labels=labels).mean()
            optimizer.zero_grad()
            loss.backward()
            average_gradients(model)
            optimizer.step()
        if torch.distributed.get_rank() == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
