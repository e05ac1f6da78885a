"""`mcore-proxy fidelity --orig MODEL --proxy MODEL --plan plan.json --data FILE [-o DIR]`."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from mcore_proxy.cli_support.flags import add_command, emit, positive_int

REPORT, PICTURE = "fidelity.json", "fidelity.png"


def register(sub) -> None:
    p = add_command(
        sub,
        "fidelity",
        run_fidelity,
        help="how closely a proxy follows its original on calibration data",
        writes=f"{REPORT} and {PICTURE} in DIR",
        description="Run original and proxy in transformers over JSONL records (as for collect) and "
        "measure per MoE layer the share of the original top-k gate mass on kept experts and "
        "top-1 routing agreement, per layer the hidden-state cosine, and the next-token KL "
        "and top-1 agreement. Megatron checkpoints are measured through their HF conversion.",
    )
    p.add_argument(
        "--orig", type=Path, required=True, metavar="MODEL", help="original: HF folder or Megatron checkpoint"
    )
    p.add_argument("--proxy", type=Path, required=True, metavar="MODEL", help="proxy: HF folder or Megatron checkpoint")
    p.add_argument("--plan", type=Path, required=True, help="the plan.json the proxy was made with")
    p.add_argument("--data", type=Path, required=True, metavar="FILE", help="JSONL data")
    p.add_argument("-o", "--out", type=Path, metavar="DIR", help=f"write {REPORT} and {PICTURE} here")
    p.add_argument("--max-tokens", type=positive_int, help="stop after this many tokens (default: all of FILE)")
    p.add_argument("--batch-size", type=positive_int, default=8, help="sequences per forward pass (default 8)")
    p.add_argument("--max-length", type=positive_int, help="longest sequence (default: max_position_embeddings)")
    p.add_argument("--device", choices=("cpu", "cuda", "npu"), default="cpu")


def table(report: dict) -> str:
    lines = [
        f"{report['tokens']} tokens; next-token KL {report['next_token_kl']:.4g} nats, "
        f"top-1 agreement {report['next_token_top1_agreement']:.3f}",
        "layer  kept   gate-mass share  top-1 routing  hidden cosine",
    ]
    moe = {m["layer"]: m for m in report["moe_layers"]}
    for i, cos in enumerate(report["hidden_cosine"]):
        m = moe.get(str(i))
        route = (
            f"{m['kept']:>3}/{m['experts']:<3} {m['gate_mass_share']:>15.3f}  {m['top1_routing_agreement']:>13.3f}"
            if m
            else f"{'dense':<7} {'':>15}  {'':>13}"
        )
        lines.append(f"{i:>5}  {route}  {cos:>13.4f}")
    return "\n".join(lines)


def _short(path: str) -> str:
    return "/".join(Path(path).parts[-2:])


def draw(report: dict, path: Path) -> None:
    """Left: per MoE layer gate-mass share and top-1 routing agreement; right: hidden cosine per layer."""
    import matplotlib.pyplot as plt

    moe = report["moe_layers"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    ids = [int(m["layer"]) for m in moe]
    left.plot(ids, [m["gate_mass_share"] for m in moe], "o-", label="gate-mass share on kept experts")
    left.plot(ids, [m["top1_routing_agreement"] for m in moe], "s-", label="top-1 routing agreement")
    left.set(xlabel="MoE layer", ylabel="share of tokens / gate mass", ylim=(0, 1.05), xticks=ids)
    left.legend(loc="lower left")
    cos = report["hidden_cosine"]
    right.plot(range(len(cos)), cos, "o-", color="tab:green")
    right.set(
        xlabel="decoder layer",
        ylabel="hidden-state cosine (proxy vs original)",
        xticks=list(range(len(cos))),
        ylim=(min(0.0, min(cos)), 1.02),
    )
    fig.suptitle(
        f"proxy {_short(report['proxy'])} vs original {_short(report['orig'])}: next-token KL "
        f"{report['next_token_kl']:.3g} nats, top-1 agreement {report['next_token_top1_agreement']:.2f} "
        f"({report['tokens']} tokens)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_fidelity(args) -> int:
    from mcore_proxy.core.optional import check

    # both models run in transformers; -o draws with matplotlib: one sentence for all that is missing
    check(
        "transformers",
        *(["matplotlib"] if args.out is not None else []),
        why="fidelity" + (" -o" if args.out is not None else ""),
    )
    from mcore_proxy.core.output import staged_files
    from mcore_proxy.fidelity.measure import measure

    with contextlib.ExitStack() as outputs:  # refused before the models run if the report exists
        report_dir = None
        if args.out is not None:
            from mcore_proxy.cli_support.plotting import require_matplotlib

            require_matplotlib("fidelity -o")
            report_dir = outputs.enter_context(
                staged_files(
                    args.out,
                    "fidelity",
                    (REPORT, PICTURE),
                    replace=args.force,
                    inputs=(args.orig, args.proxy, args.plan, args.data),
                )
            )
        report = measure(
            args.orig,
            args.proxy,
            args.plan,
            args.data,
            max_tokens=args.max_tokens,
            batch_size=args.batch_size,
            max_length=args.max_length,
            device=args.device,
        )
        if report_dir is not None:
            (report_dir / REPORT).write_text(json.dumps(report, indent=2) + "\n")
            draw(report, report_dir / PICTURE)
    text = table(report) + (f"\nwrote {args.out / REPORT} and {args.out / PICTURE}" if args.out else "")
    emit(args, "fidelity", report, text)
    return 0
