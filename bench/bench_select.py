"""Benchmark `select_experts` on a DeepSeek-V3-sized problem.

61 decoder layers, the first 3 dense, 58 MoE layers of E=256 routed experts, H=7168, top-8 with
8 groups / 4 selected, sigmoid scores. Router weights are bf16 tensors in an in-memory
ModelView (as a reader yields them); statistics are synthetic with planted clusters. Times
the whole selection (checks, three views, fusion, K-Medoids with restarts per group,
representatives, coverage, router fingerprint), not the data generation.

    python bench/bench_select.py                 # K=16 and K=64, median of 3 runs
    python bench/bench_select.py --k 64 --runs 5 --group-policy flatten

On a shared machine, multi-threaded OpenBLAS slows down sharply when other processes hold the
cores; OPENBLAS_NUM_THREADS=1 keeps the time stable there (see bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import numpy as np
import torch

from mcore_proxy.checkpoint.view import DictModelView
from mcore_proxy.select import select_experts
from mcore_proxy.select.synthetic import planted_layer
from mcore_proxy.mcore.spec import ModelSpec, expert_bias_name, router_weight_name
from mcore_proxy.core.stats import RoutingStats


def build(num_layers: int, dense: int, experts: int, hidden: int, tokens: int, seed: int):
    """(view, stats) of a DeepSeek-V3-shaped model with synthetic routing statistics."""
    spec = ModelSpec(
        num_layers=num_layers,
        hidden_size=hidden,
        num_experts=experts,
        topk=8,
        moe_layers=tuple(range(dense, num_layers)),
        score_function="sigmoid",
        num_groups=8,
        group_topk=4,
        expert_bias=True,
    )
    tensors, layers = {}, {}
    for i, lid in enumerate(spec.moe_layer_ids):
        p = planted_layer(num_experts=experts, clusters=32, hidden=hidden, topk=8, tokens=tokens, seed=seed + i)
        tensors[router_weight_name(lid)] = torch.from_numpy(p.router).to(torch.bfloat16)
        tensors[expert_bias_name(lid)] = torch.zeros(experts, dtype=torch.float32)
        layers[lid] = p.stats
    return DictModelView(tensors, spec, iteration=0), RoutingStats(layers, 8)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--dense", type=int, default=3)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--tokens", type=int, default=16384, help="simulated tokens per layer")
    ap.add_argument("--method", default="multiview")
    ap.add_argument("--group-policy", default=None)
    ap.add_argument("--restarts", type=int, default=8)
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    view, stats = build(args.layers, args.dense, args.experts, args.hidden, args.tokens, seed=0)
    print(
        f"generated {len(stats.layers)} MoE layers, E={args.experts}, H={args.hidden} in "
        f"{time.perf_counter() - t0:.1f} s"
    )
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"python {platform.python_version()}, numpy {np.__version__}, torch {torch.__version__}, "
        f"torch threads {torch.get_num_threads()}"
    )
    print(f"command: python {' '.join(sys.argv)}")
    print("load average (1, 5, 15 min) before: %.2f %.2f %.2f" % os.getloadavg())
    print("| K | method | group policy | runs | median s | min s | max s | mean token coverage |")
    print("|---|---|---|---|---|---|---|---|")
    for k in args.k:
        times, plan = [], None
        for _ in range(args.runs):
            t = time.perf_counter()
            plan = select_experts(
                view, stats, k, method=args.method, restarts=args.restarts, group_policy=args.group_policy
            )
            times.append(time.perf_counter() - t)
        print(
            f"| {k} | {args.method} | {plan.params['group_policy']} | {args.runs} | "
            f"{statistics.median(times):.2f} | {min(times):.2f} | {max(times):.2f} | "
            f"{plan.mean_coverage()[0]:.3f} |"
        )
    print("load average (1, 5, 15 min) after: %.2f %.2f %.2f" % os.getloadavg())
    return 0


if __name__ == "__main__":
    sys.exit(main())
