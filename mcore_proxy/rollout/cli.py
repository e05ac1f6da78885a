"""`mcore-proxy consistency --orig MODEL [--proxy MODEL --plan plan.json] --data FILE [-o DIR]`."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from mcore_proxy.cli_support.flags import add_command, emit, positive_int

REPORT, PICTURE = "consistency.json", "consistency.png"


def register(sub) -> None:
    p = add_command(
        sub,
        "consistency",
        run_consistency,
        help="routing and log-prob agreement between the rollout engine (vLLM) and the trainer",
        writes=f"{REPORT} and {PICTURE} in DIR",
        description="Run the same token sequences through vLLM (the rollout engine, in its own "
        "Python: --vllm-python) and transformers (the trainer) and report per MoE layer the share of "
        "router decisions that differ, the share of tokens with a differing top-k set in any layer, "
        "and the rollout-training log-prob gap; for a proxy beside its original, how the proxy's "
        "per-layer pattern follows the original's. --rollout-faults act in vLLM only. docs/rollout.md.",
    )
    p.add_argument("--orig", type=Path, required=True, metavar="MODEL", help="original: Hugging Face folder")
    p.add_argument("--proxy", type=Path, metavar="MODEL", help="its proxy: Hugging Face folder (needs --plan)")
    p.add_argument("--plan", type=Path, help="the plan.json the proxy was made with (kept experts' share)")
    p.add_argument("--data", type=Path, required=True, metavar="FILE", help="JSONL data, as for collect")
    p.add_argument("-o", "--out", type=Path, metavar="DIR", help=f"write {REPORT} and {PICTURE} here")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="both engines' precision (default fp32)")
    p.add_argument(
        "--rollout-faults", metavar="SPEC", help="MCORE_PROXY_FAULTS for the rollout engine only (docs/faults.md)"
    )
    p.add_argument(
        "--vllm-python", metavar="PY", help="python of the vLLM environment (default $MCORE_PROXY_VLLM_PYTHON)"
    )
    p.add_argument("--max-sequences", type=positive_int, default=32, help="sequences of FILE used (default 32)")
    p.add_argument("--max-length", type=positive_int, default=128, help="tokens per sequence at most (default 128)")


def table(report: dict) -> str:
    lines = []
    for name, model in report["models"].items():
        lines.append(
            f"{name}: {model['tokens']} tokens; {model['tokens_any_layer']:.3f} of tokens differ in some layer; "
            f"log-prob gap |mean| {model['logprob_gap_abs_mean']:.3g}, max {model['logprob_gap_abs_max']:.3g}"
        )
        with_kept = any("kept_share" in row for row in model["layers"])
        lines.append("  layer  decisions differ  tokens differ" + ("  kept share" if with_kept else ""))
        for row in model["layers"]:
            kept = row.get("kept_share")
            lines.append(
                f"  {row['layer']:>5}  {row['decision_disagreement']:>16.4f}  {row['token_disagreement']:>13.4f}"
                + (f"  {kept:>10.3f}" if kept is not None else "")
            )
    if "pattern" in report:
        pat = report["pattern"]
        rho = "n/a (a constant side)" if pat["spearman"] is None else f"{pat['spearman']:.3f}"
        ratio = "n/a" if pat["rate_ratio"] is None else f"{pat['rate_ratio']:.3f}"
        lines.append(f"proxy vs original: rank correlation over layers {rho}, mean rate ratio {ratio}")
    return "\n".join(lines)


def draw(report: dict, path: Path) -> None:
    """Per MoE layer, the share of router decisions that differ between the engines, per model."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for (name, model), marker in zip(report["models"].items(), "os"):
        layers = [int(r["layer"]) for r in model["layers"]]
        ax.plot(layers, [r["decision_disagreement"] for r in model["layers"]], marker + "-", label=name)
    ax.set(xlabel="MoE layer", ylabel="router decisions differing, vLLM vs transformers")
    ax.set_ylim(bottom=0)
    ax.legend()
    faults = report["rollout_faults"] or "no fault"
    ax.set_title(f"routing consistency, {report['dtype']}, {faults}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_consistency(args) -> int:
    from mcore_proxy.core.errors import ProxyError
    from mcore_proxy.core.optional import check

    check("transformers", *(["matplotlib"] if args.out is not None else []), why="consistency")
    if args.proxy is not None and args.plan is None:
        raise ProxyError("--proxy needs --plan (the plan.json the proxy was made with)")
    if args.rollout_faults:
        from mcore_proxy.faults.spec import parse

        parse(args.rollout_faults)  # a typo fails here, not after the engine started
    from mcore_proxy.core.output import staged_files
    from mcore_proxy.rollout.consistency import measure

    inputs = tuple(p for p in (args.orig, args.proxy, args.plan, args.data) if p is not None)
    with contextlib.ExitStack() as outputs:
        report_dir = None
        if args.out is not None:
            report_dir = outputs.enter_context(
                staged_files(args.out, "consistency", (REPORT, PICTURE), replace=args.force, inputs=inputs)
            )
        report = measure(
            args.orig,
            args.data,
            proxy=args.proxy,
            plan=args.plan,
            dtype=args.dtype,
            faults=args.rollout_faults,
            python=args.vllm_python,
            max_sequences=args.max_sequences,
            max_length=args.max_length,
        )
        if report_dir is not None:
            (report_dir / REPORT).write_text(json.dumps(report, indent=2) + "\n")
            draw(report, report_dir / PICTURE)
    text = table(report) + (f"\nwrote {args.out / REPORT} and {args.out / PICTURE}" if args.out else "")
    emit(args, "consistency", report, text)
    return 0
