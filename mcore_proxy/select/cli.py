"""`mcore-proxy select`: a thin layer over `mcore_proxy.select.run_selection`."""

from __future__ import annotations

import argparse
import functools
import glob
from pathlib import Path

from mcore_proxy.core.errors import OutputError, PlanError
from mcore_proxy.cli_support.flags import add_command, add_option, emit, positive_int
from mcore_proxy.cli_support.plotting import require_matplotlib
from mcore_proxy.select.constraints import GROUP_POLICIES
from mcore_proxy.select.fuse import NORMALISATIONS
from mcore_proxy.select.selector import DEFAULT_REFINEMENTS, DEFAULT_WEIGHTS, METHODS, REPRESENTATIVES
from mcore_proxy.select.views import COACT_MODES, ROUTER_METRICS


def parse_weights(text: str) -> tuple[float, float, float]:
    """`"1,2,0.5"` -> (1.0, 2.0, 0.5): weights of the router, co-activation, prototype views."""
    try:
        w = tuple(float(x) for x in text.split(","))
    except ValueError:
        w = ()
    if len(w) != 3:
        raise PlanError(f"--weights {text!r} must be three comma-separated numbers R,C,P, e.g. --weights 1,1,1")
    return w


def register(subparsers) -> None:
    p = add_command(
        subparsers,
        "select",
        run,
        help="choose K experts per MoE layer -> plan.json",
        writes="plan (and report files)",
        description="Multi-view, frequency-aware expert selection: router-weight, co-activation "
        "and routed-context views, fused, clustered with K-Medoids; the most "
        "frequently activated expert of each cluster is kept.",
    )
    add_option(p, "--ckpt", required=True, metavar="CKPT", help="source checkpoint (router weights, spec)")
    p.add_argument("--stats", required=True, help="routing statistics (.safetensors + .json)")
    p.add_argument(
        "--num-experts", "-k", type=positive_int, required=True, metavar="K", help="experts to keep in every MoE layer"
    )
    add_option(
        p,
        "--target-ep",
        type=positive_int,
        default=1,
        metavar="N",
        help="expert-parallel degree K must divide (default 1)",
    )
    p.add_argument("--method", choices=METHODS, default="multiview")
    p.add_argument(
        "--weights",
        default=",".join(f"{w:g}" for w in DEFAULT_WEIGHTS),
        metavar="R,C,P",
        help="fusion weights of the router, co-activation, prototype views "
        "(default %(default)s, the paper's; bench/RESULTS.md measures others)",
    )
    p.add_argument(
        "--coact-mode",
        choices=COACT_MODES,
        default="partners",
        help="co-selected experts are partners (far apart) or substitutes (close)",
    )
    p.add_argument("--norm", choices=NORMALISATIONS, default="minmax")
    p.add_argument("--router-metric", choices=ROUTER_METRICS, default="cosine")
    p.add_argument(
        "--group-policy",
        choices=GROUP_POLICIES,
        default=None,
        help="group-limited routing: keep K/G per group (default) or flatten to G=1",
    )
    p.add_argument(
        "--representative",
        choices=REPRESENTATIVES,
        default=None,
        help="kept expert of a cluster: the most frequent member, or the member that "
        "best reconstructs the layer's output (reads expert weights); default "
        f"for multiview: {DEFAULT_REFINEMENTS['representative']}",
    )
    p.add_argument(
        "--weight-search",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="choose the view weights per layer by reconstruction (reads expert "
        f"weights); default for multiview: {'on' if DEFAULT_REFINEMENTS['weight_search'] else 'off'}",
    )
    p.add_argument(
        "--proxy-topk",
        default=None,
        metavar="N|auto",
        help="experts per token in the proxy: N, or auto = round(top-k x K / E), at least 1 (2 for softmax after "
        "top-k): a token uses the same share of the kept experts as of all; default: the source's top-k. Weights "
        "are unchanged",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--restarts", type=positive_int, default=8, help="K-Medoids restarts (lowest loss wins)")
    p.add_argument("--report", metavar="DIR", help="write PNGs and summary.txt into DIR")
    p.add_argument("-o", "--output", required=True, help="plan.json to write (must not exist unless --force)")


def run(args: argparse.Namespace) -> int:
    from contextlib import ExitStack

    from tqdm import tqdm

    from mcore_proxy.checkpoint import open_checkpoint
    from mcore_proxy.runtime.memory import expect_torch
    from mcore_proxy.core.output import staged_files
    from mcore_proxy.select.constraints import check_stats_match
    from mcore_proxy.select.report import REPORT_FILES, summary_dict, summary_table, write_report
    from mcore_proxy.select.selector import run_selection
    from mcore_proxy.core.stats import load_stats, sidecar_path

    weights = parse_weights(args.weights)
    out = Path(args.output)
    if out.is_dir():
        raise OutputError(f"-o {args.output} is a folder; pass the plan file to write, e.g. -o {out / 'plan.json'}")
    if args.report:
        require_matplotlib("--report")  # before anything is written
    inputs = (args.ckpt, args.stats, sidecar_path(args.stats))
    with ExitStack() as outputs:  # refused before any work if they exist; moved into place at the end
        plan_dir = outputs.enter_context(
            staged_files(out.parent, out.name, (glob.escape(out.name),), replace=args.force, inputs=inputs)
        )
        report_dir = args.report and outputs.enter_context(
            staged_files(args.report, "report", REPORT_FILES, replace=args.force, inputs=inputs)
        )
        stats = load_stats(args.stats, stream=True)  # one layer's statistics in memory at a time
        expect_torch()  # router and expert weights are read as tensors
        view = open_checkpoint(args.ckpt)
        check_stats_match(stats, view.spec, str(args.stats))
        common = dict(target_ep=args.target_ep, group_policy=args.group_policy, seed=args.seed)
        plan, details = run_selection(
            view,
            stats,
            args.num_experts,
            method=args.method,
            weights=weights,
            coact_mode=args.coact_mode,
            norm=args.norm,
            router_metric=args.router_metric,
            restarts=args.restarts,
            representative=args.representative,
            weight_search=args.weight_search,
            topk=args.proxy_topk,
            progress=functools.partial(tqdm, desc="select", unit="layer"),
            keep_matrices=bool(args.report),
            **common,
        )
        report = []
        if args.report:  # the report first: a plan is written only by a command that succeeds
            baselines = {
                m: run_selection(view, stats, args.num_experts, method=m, **common)[0] for m in ("frequency", "random")
            }
            report = [Path(args.report) / f.name for f in write_report(report_dir, plan, details, baselines)]
        plan.save(plan_dir / out.name)
    notes = []
    if plan.params.get("group_policy") == "flatten":
        notes.append(
            "group-limited routing flattened: the proxy runs with --moe-router-num-groups 1 --moe-router-group-topk 1"
        )
    doc = {"plan": str(out), **summary_dict(plan), "report": [str(f) for f in report], "notes": notes}
    text = [summary_table(plan)] + [f"note: {n}" for n in notes]
    text += [f"wrote report: {len(report)} files in {args.report}"] if report else []
    emit(args, "select", doc, "\n".join(text + [f"wrote {out}"]))
    return 0
