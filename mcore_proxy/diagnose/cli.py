"""`mcore-proxy compare --orig-base A --orig-fault B --proxy-base C --proxy-fault D [--metrics ...] [-o DIR]`."""
from __future__ import annotations

from mcore_proxy.errors import CheckFailed
from mcore_proxy.flags import add_command, emit


def register(subparsers) -> None:
    p = add_command(subparsers, "compare", run_compare, help="does the proxy reproduce the original's fault signature?",
                    checks="the proxy's fault signature differs from the original's, or is inconclusive",
                    writes="report folder (an earlier compare report)",
                    description="Compare the fault signatures (faulted run against its baseline) of the original "
                                "and the proxy, metric by metric: direction and size of the shift, trend, onset, "
                                "correlation of the shift curves.")
    for role, what in (("orig-base", "original, baseline"), ("orig-fault", "original, with the fault"),
                       ("proxy-base", "proxy, baseline"), ("proxy-fault", "proxy, with the fault")):
        p.add_argument(f"--{role}", required=True, metavar="LOG",
                       help=f"metric log of the {what} run: TensorBoard folder, .jsonl, .csv or console log")
    p.add_argument("--metrics", nargs="+", metavar="NAME",
                   help="canonical (reward, kl_loss, ppo_kl, entropy, grad_norm, logprob_diff, "
                        "response_length, clipfrac, pg_loss) or raw names (default: every known "
                        "metric the logs have)")
    p.add_argument("--onset-window", type=int, metavar="STEPS",
                   help="onsets this close agree (default: 10%% of the compared steps, at least 3)")
    p.add_argument("-o", "--output", metavar="DIR", help="write report.json, report.md and PNG curves here")


def run_compare(args) -> int:
    from mcore_proxy.diagnose.compare import ROLES, compare_runs
    from mcore_proxy.diagnose.readers import read_log
    from mcore_proxy.diagnose.report import as_dict, summary_table, write_report

    paths = {role: getattr(args, role) for role in ROLES}
    comparison = compare_runs({role: read_log(path) for role, path in paths.items()}, args.metrics,
                              args.onset_window)
    report = None
    if args.output:
        report = str(write_report(args.output, comparison, inputs=tuple(paths.values()), replace=args.force))
    text = summary_table(comparison) + (f"\nreport: {report}" if report else "")
    emit(args, "compare", {**as_dict(comparison), "report": report}, text)
    if not comparison.consistent:
        raise CheckFailed(comparison.verdict())
    return 0
