"""Overhead of the routing-statistics hooks on one megatron-core MoE layer (router + experts).

Shape of a Qwen3-30B-A3B MoE layer: hidden 2048, 128 experts of FFN 768, top-8, bf16 weights
and activations, fp32 router (moe_router_dtype=fp32), micro-batch of 4096 tokens, allgather
dispatcher, one CPU rank (the megatron CPU shim stands in for the GPU). The same layer runs
with and without the hooks in `--rounds` back-to-back pairs within one process (the order
alternates); each pair gives a ratio with/without, of process CPU time (robust when other jobs
share the machine) and of wall time; the medians over pairs are reported. The cost of the hook
alone (`Tracer.record` on the captured router outputs) is timed too, as a share of the forward.

    python bench/bench_trace.py                      # SequentialMLP, 1 thread, 7 pairs
    python bench/bench_trace.py --grouped --saliency --rounds 9
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time

import torch


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--ffn", type=int, default=768)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--rounds", type=int, default=7, help="pairs of forwards with/without hooks")
    p.add_argument("--grouped", action="store_true", help="GroupedMLP instead of SequentialMLP")
    p.add_argument("--saliency", action="store_true", help="also hook the experts (saliency_sum)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    return p.parse_args()


def build_layer(args):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1,
        hidden_size=args.hidden,
        num_attention_heads=16,
        num_moe_experts=args.experts,
        moe_ffn_hidden_size=args.ffn,
        moe_router_topk=args.topk,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=args.grouped,
        gated_linear_unit=True,
        add_bias_linear=False,
        normalization="RMSNorm",
        use_cpu_initialization=True,
        params_dtype=torch.bfloat16,
        bf16=True,
    )
    spec = get_gpt_layer_local_spec(num_experts=args.experts, moe_grouped_gemm=args.grouped)
    layer = build_module(spec.submodules.mlp, config=config)
    layer.set_layer_number(1)
    with torch.no_grad():
        layer.router.weight.normal_(0, 1.0)  # decisive, diverse routing
    return layer.eval()


def timed(fn) -> tuple[float, float]:
    """(wall, process CPU) seconds of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    from mcore_proxy.functional.cpu import destroy_distributed, free_port, init_distributed

    init_distributed(0, 1, free_port())
    from mcore_proxy.trace.megatron import attach_hooks, install, router_info

    layer = build_layer(args)
    hidden = torch.randn(args.tokens, 1, args.hidden, dtype=torch.bfloat16)

    def forward():
        with torch.no_grad():
            layer(hidden)

    with tempfile.TemporaryDirectory() as out:
        tracer = install(layer, out, saliency=args.saliency)
        forward()  # warm-up, allocates the accumulators
        tracer.detach()
        forward()
        pairs = []
        for i in range(args.rounds):  # alternate the order: no drift bias
            pair = {}
            for hooked in (False, True) if i % 2 == 0 else (True, False):
                if hooked:
                    attach_hooks(tracer, layer, saliency=args.saliency)
                    pair["with"] = timed(forward)
                    tracer.detach()
                else:
                    pair["without"] = timed(forward)
            pairs.append(pair)
        with torch.no_grad():
            probs, routing_map = layer.router(hidden)
        info = router_info(layer.router)
        hook = statistics.median(
            timed(lambda: tracer.record(info, hidden, probs, routing_map))[1] for _ in range(max(3, args.rounds))
        )
        saliency_hook = None
        if args.saliency:  # the experts hook alone, on a real output
            captured = {}
            handle = layer.experts.register_forward_hook(lambda mod, a, out: captured.update(args=a, out=out[0]))
            forward()
            handle.remove()
            experts = torch.tensor(layer.local_expert_indices)
            saliency_hook = statistics.median(
                timed(lambda: tracer.record_saliency(info.layer_id, experts, captured["out"], captured["args"][1]))[1]
                for _ in range(max(3, args.rounds))
            )
        steps = tracer.steps
    destroy_distributed()

    experts = "GroupedMLP" if args.grouped else "SequentialMLP"
    print(
        f"MoE layer forward, {args.tokens} tokens, H={args.hidden}, E={args.experts}, "
        f"F={args.ffn}, top-{args.topk}, bf16, {experts}, saliency={args.saliency}"
    )
    print(
        f"cpu: {platform.processor() or platform.machine()}, torch threads "
        f"{torch.get_num_threads()}, {os.cpu_count()} cores, {args.rounds} pairs, "
        f"recorded steps {steps}"
    )
    for k, what in ((1, "process CPU"), (0, "wall")):
        plain = statistics.median(p["without"][k] for p in pairs)
        ratios = sorted(p["with"][k] / p["without"][k] for p in pairs)
        r = statistics.median(ratios)
        print(
            f"{what:>11}: without hooks median {plain * 1e3:.0f} ms; ratio with/without, median "
            f"of pairs {r:.4f} (overhead {100 * (r - 1):+.2f} %), range {ratios[0]:.3f}..{ratios[-1]:.3f}"
        )
    plain_cpu = statistics.median(p["without"][1] for p in pairs)
    print(
        f"router hook alone (Tracer.record, CPU time): {hook * 1e3:.1f} ms = "
        f"{100 * hook / plain_cpu:.2f} % of the forward"
    )
    if saliency_hook is not None:
        print(
            f"experts hook alone (Tracer.record_saliency, CPU time): {saliency_hook * 1e3:.1f} ms "
            f"= {100 * saliency_hook / plain_cpu:.2f} % of the forward"
        )


if __name__ == "__main__":
    main()
