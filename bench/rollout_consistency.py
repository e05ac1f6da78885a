"""Routing consistency between vLLM (rollout) and transformers (trainer), original vs proxy.

    MCORE_PROXY_VLLM_PYTHON=$(bash tools/vllm_env.sh) python bench/rollout_consistency.py [--out DIR]

Builds (once, in DIR) a tiny Qwen3-MoE at vLLM's head size (16 experts, top-4, 3 MoE layers; the
tests' `qwen3_moe@vllm`) and a K = 8 proxy by the user's pipeline (collect on calibration text,
select, convert), then runs `mcore_proxy.rollout.consistency.measure` on both models in fp32 and
bf16, with no fault and under each rollout router fault at two strengths (the faults act in vLLM
only). Writes DIR/consistency.json (every report) and prints the table bench/RESULTS.md records.
Several minutes: one vLLM start per row.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from mcore_proxy.cli import main as cli
from mcore_proxy.rollout.consistency import measure
from mcore_proxy.testing.hf_fixtures import build_cached, calibration_jsonl

FAULTS = (
    "",
    "router_precision:dtype=fp16",
    "router_precision:dtype=bf16",
    "router_noise:std=0.1",
    "router_noise:std=0.5",
    "router_tie_flip:margin=0.05",
    "router_tie_flip:margin=0.3",
)


def models(out: Path, name: str = "qwen3_moe@vllm", pinned_plan: Path | None = None) -> tuple[Path, Path, Path, Path]:
    """(original, K = 8 proxy, plan, calibration data) in `out`, built once. With `pinned_plan` the
    proxy is converted from that plan instead of collect + select: the routing statistics come
    from a transformers forward pass whose numerics may move with the installed release, while
    the conversion from a stored plan is exact, so the proxy is rebuilt the same anywhere."""
    orig = build_cached(name, out / "fixtures")
    data = out / "data.jsonl"
    if not data.exists():
        calibration_jsonl(data, records=48, seed=1)
    proxy, plan = out / "proxy", out / "plan.json"
    if not proxy.exists():
        if pinned_plan is not None:
            shutil.copyfile(pinned_plan, plan)
        else:
            assert cli(["collect", "--hf", str(orig), "--data", str(data), "-o", str(out / "stats")]) == 0
            stats = out / "stats" / "routing_stats.safetensors"
            argv = ["select", "--ckpt", str(orig), "--stats", str(stats), "--num-experts", "8", "-o", str(plan)]
            assert cli(argv) == 0
        assert cli(["convert", str(orig), "--plan", str(plan), "-o", str(proxy)]) == 0
    return orig, proxy, plan, data


def row(report: dict) -> str:
    o, p = report["models"]["original"], report["models"]["proxy"]
    pat = report["pattern"]
    rho = "n/a" if pat["spearman"] is None else f"{pat['spearman']:.2f}"
    ratio = "n/a" if pat["rate_ratio"] is None else f"{pat['rate_ratio']:.2f}"
    kept = [r["kept_share"] for r in o["layers"] if r.get("kept_share") is not None]
    kept_text = f"{sum(kept) / len(kept):.2f}" if kept else "n/a"
    return (
        f"| {report['dtype']} | {report['rollout_faults'] or 'none'} | {o['decision_disagreement']:.4f} | "
        f"{p['decision_disagreement']:.4f} | {o['tokens_any_layer']:.3f} | {p['tokens_any_layer']:.3f} | "
        f"{o['logprob_gap_abs_mean']:.2e} | {p['logprob_gap_abs_mean']:.2e} | {rho} | {ratio} | {kept_text} |"
    )


def run() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("bench/out/rollout"))
    parser.add_argument("--model", default="qwen3_moe@vllm", help="fixture: qwen3_moe@vllm-deep has 8 MoE layers")
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--faults", nargs="+", default=list(FAULTS), help="rollout faults ('' for none)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    orig, proxy, plan, data = models(args.out, args.model)
    reports = []
    print(
        "| dtype | rollout fault | decisions differ, orig | proxy | tokens differing (any layer), orig | proxy "
        "| mean abs log-prob gap, orig | proxy | Spearman over layers | rate ratio proxy/orig | kept share |"
    )
    print("|---" * 11 + "|")
    for dtype in args.dtypes:
        for fault in args.faults:
            start = time.perf_counter()
            report = measure(orig, data, proxy=proxy, plan=plan, dtype=dtype, faults=fault or None)
            report["seconds"] = round(time.perf_counter() - start, 1)
            reports.append(report)
            print(row(report), flush=True)
    (args.out / "consistency.json").write_text(json.dumps(reports, indent=1) + "\n")


if __name__ == "__main__":
    run()
