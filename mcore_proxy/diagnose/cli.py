"""`mcore-proxy compare --orig-base A --orig-fault B --proxy-base C --proxy-fault D [--metrics ...] [-o DIR]`."""
from __future__ import annotations

from mcore_proxy.errors import CheckFailed


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "compare", help="does the proxy reproduce the original's fault signature?",
        description="Compare the fault signatures (faulted run against its baseline) of the original "
                    "and the proxy, metric by metric: direction and size of the shift, trend, onset, "
                    "correlation of the shift curves. Exit 0 consistent, 1 not, 2 bad input.")
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
    p.set_defaults(func=run_compare)


def run_compare(args) -> int:
    from mcore_proxy.diagnose.compare import ROLES, compare_runs
    from mcore_proxy.diagnose.readers import read_log
    from mcore_proxy.diagnose.report import summary_table, write_report

    logs = {role: read_log(getattr(args, role)) for role in ROLES}
    comparison = compare_runs(logs, args.metrics, args.onset_window)
    print(summary_table(comparison))
    if args.output:
        print(f"report: {write_report(args.output, comparison)}")
    if not comparison.consistent:
        raise CheckFailed(comparison.verdict())
    return 0
