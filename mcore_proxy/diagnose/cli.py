"""`mcore-proxy compare` (original vs proxy, or triage of a run against a signature library) and
`mcore-proxy watch LOG` (early warnings while a run grows)."""

from __future__ import annotations

import re
from pathlib import Path

from mcore_proxy.core.errors import CheckFailed, ProxyError
from mcore_proxy.cli_support.flags import add_command, emit

ROLE_ARGS = (
    ("orig-base", "original, baseline"),
    ("orig-fault", "original, with the fault"),
    ("proxy-base", "proxy, baseline"),
    ("proxy-fault", "proxy, with the fault"),
)


def register(subparsers) -> None:
    register_watch(subparsers)  # watch a run, then compare it (pipeline order in the help)
    p = add_command(
        subparsers,
        "compare",
        run_compare,
        help="does the proxy reproduce the original's fault signature? / triage a run",
        checks="the proxy's fault signature differs from the original's, or is inconclusive",
        writes="report folder (an earlier compare report)",
        description="Two modes. (1) --orig-base/--orig-fault/--proxy-base/--proxy-fault: compare "
        "the fault signatures (faulted run against its baseline) of the original and "
        "the proxy, metric by metric: direction and size of the shift, trend, onset, "
        "correlation of the shift curves. (2) Triage, --run/--baseline/--library: rank "
        "the faults of a signature library (written by `mcore-proxy campaign`) by how "
        "well their signatures match the run's departure from its baseline, with the "
        "evidence per metric (it checks nothing: exit 0).",
    )
    for role, what in ROLE_ARGS:
        p.add_argument(
            f"--{role}",
            metavar="LOG",
            nargs="+",
            help=f"metric log of the {what} run: TensorBoard folder, .jsonl, .csv, console log (Megatron, "
            "MindSpeed-RL, verl, TRL), trainer_state.json, MLflow run, W&B/SwanLab offline run; several "
            "(one per seed, the same number and order for the four roles): compare seed by seed",
        )
    p.add_argument("--run", metavar="LOG", help="triage: the metric log of the run to diagnose")
    p.add_argument("--baseline", metavar="LOG", help="triage: the log of a healthy run of the same setting")
    p.add_argument("--library", metavar="LIB", help="triage: library.json written by `mcore-proxy campaign`")
    p.add_argument(
        "--metrics",
        nargs="+",
        metavar="NAME",
        help="canonical (reward, kl_loss, ppo_kl, entropy, grad_norm, logprob_diff, rollout_kl, "
        "response_length, clipfrac, pg_loss, routing_disagreement, routing_token_disagreement) or raw names "
        "(default: every known metric the logs have)",
    )
    p.add_argument(
        "--onset-window",
        type=int,
        metavar="STEPS",
        help="onsets this close agree (default: 10%% of the compared steps, at least 3)",
    )
    p.add_argument(
        "--min-share",
        type=float,
        default=0.8,  # seeds.DEFAULT_MIN_SHARE (not imported here: registering a command stays light)
        metavar="F",
        help="over several seeds: the share of seeds that must reproduce the fault (default 0.8: 4 of 5)",
    )
    p.add_argument("-o", "--output", metavar="DIR", help="write report.json, report.md and PNG curves here")


def run_compare(args) -> int:
    roles = [r for r, _ in ROLE_ARGS if getattr(args, r.replace("-", "_"))]
    triage = [n for n in ("run", "baseline", "library") if getattr(args, n)]
    if triage and roles:
        raise ProxyError(
            f"compare: --{', --'.join(triage)} (triage) and --{', --'.join(roles)} "
            "(original vs proxy) are two modes; pass one set"
        )
    if triage:
        if len(triage) < 3:
            raise ProxyError("compare: triage needs --run, --baseline and --library together")
        return run_triage(args)
    if len(roles) < 4:
        raise ProxyError(
            "compare: pass --orig-base, --orig-fault, --proxy-base and --proxy-fault "
            "(or --run, --baseline and --library to triage a run)"
        )
    from mcore_proxy.diagnose.compare import ROLES, compare_runs, role_name
    from mcore_proxy.diagnose.readers import read_log
    from mcore_proxy.diagnose.report import as_dict, summary_table, write_report

    paths = {role: getattr(args, role) for role in ROLES}
    counts = {len(logs) for logs in paths.values()}
    if len(counts) > 1:
        given = ", ".join(f"--{role_name(r)} {len(p)}" for r, p in paths.items())
        raise ProxyError(f"compare: give the same number of logs (one per seed) to each role; got {given}")
    if counts != {1}:
        return run_seeds(args, paths)
    paths = {role: logs[0] for role, logs in paths.items()}
    comparison = compare_runs({role: read_log(path) for role, path in paths.items()}, args.metrics, args.onset_window)
    report = None
    if args.output:
        report = str(write_report(args.output, comparison, inputs=tuple(paths.values()), replace=args.force))
    text = summary_table(comparison) + (f"\nreport: {report}" if report else "")
    emit(args, "compare", {**as_dict(comparison), "report": report}, text)
    if not comparison.consistent:
        raise CheckFailed(comparison.verdict())
    return 0


def run_seeds(args, paths: dict) -> int:
    """compare over seeds: the i-th log of each role is seed i (diagnose/seeds.py)."""
    from mcore_proxy.diagnose.compare import ROLES, compare_runs
    from mcore_proxy.diagnose.readers import read_log
    from mcore_proxy.diagnose.seeds import SeedsComparison, seeds_dict, seeds_table, write_seeds_report

    if not 0 < args.min_share <= 1:
        raise ProxyError(f"compare: --min-share {args.min_share} must lie in (0, 1], e.g. 0.8 for 4 of 5 seeds")
    seeds = len(paths["orig_base"])
    comparisons = tuple(
        compare_runs({role: read_log(paths[role][i]) for role in ROLES}, args.metrics, args.onset_window)
        for i in range(seeds)
    )
    result = SeedsComparison(comparisons, args.min_share)
    report = None
    if args.output:
        inputs = tuple(p for logs in paths.values() for p in logs)
        report = str(write_seeds_report(args.output, result, inputs=inputs, replace=args.force))
    text = seeds_table(result) + (f"\nreport: {report}" if report else "")
    emit(args, "compare", {**seeds_dict(result), "report": report}, text)
    if not result.consistent:
        raise CheckFailed(result.verdict())
    return 0


def run_triage(args) -> int:
    from mcore_proxy.diagnose.compare import pair_signature, require_finite
    from mcore_proxy.diagnose.library import load_library
    from mcore_proxy.diagnose.readers import read_log
    from mcore_proxy.diagnose.triage import rank_faults, triage_dict, triage_table

    if args.output:
        raise ProxyError(
            "compare: -o/--output is for the original-vs-proxy comparison; with triage use --json and redirect it"
        )
    library = load_library(args.library)
    baseline, run = (require_finite(read_log(path)) for path in (args.baseline, args.run))
    signature, left_out = pair_signature(baseline, run, args.metrics)
    ranks = rank_faults(signature, library, args.onset_window)
    if not ranks:
        raise ProxyError(
            f"{args.library}: no library entry departs from its baseline in any metric; "
            "rerun the campaign with stronger faults or more steps"
        )
    text = "\n".join([triage_table(signature, ranks, library), *(f"left out: {n}" for n in left_out)])
    emit(args, "compare", {**triage_dict(signature, ranks), "library": args.library, "left_out": left_out}, text)
    return 0


# -- watch ----------------------------------------------------------------------------------------


def duration(text: str) -> float:
    """'30s', '5m', '1h' or plain seconds -> seconds."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", str(text))
    if match is None:
        raise ProxyError(f"duration {text!r}: write seconds as 30, 30s, 5m or 1h")
    return float(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[match.group(2)]


def register_watch(subparsers) -> None:
    from mcore_proxy.diagnose.detect import DETECTORS, Settings

    d = Settings()
    p = add_command(
        subparsers,
        "watch",
        run_watch,
        help="follow a run's metric log and warn early, with the step each trouble began",
        checks="an alert of a --fail-on detector; the watch stops at the first",
        description="Follow a growing metric log (TensorBoard folder, JSONL, CSV, console log of "
        "Megatron/MindSpeed-RL/verl/TRL, TRL trainer state, MLflow run, W&B/SwanLab offline run) "
        "and report early signs of trouble with the step where each began: a NaN or inf in any "
        "metric (fails the watch by default), reward plateau, log-prob difference, "
        "rollout-vs-training KL or PPO KL rising, entropy collapse, grad-norm spikes, and with "
        "--baseline a significant divergence from it in any metric. "
        "One JSON line per alert on stdout (mcore-proxy-alert/1) as it comes, or with "
        "--json one document at the end; a live one-screen view on stderr when it is "
        "a terminal. It stops with --once, --idle, at a --fail-on alert, or on a "
        "signal.",
    )
    p.add_argument(
        "log", metavar="LOGDIR", help="the run's log (any format compare reads, docs/logs.md); it may not exist yet"
    )
    p.add_argument("--baseline", metavar="LOG", help="a healthy run's log to diverge from")
    p.add_argument("--every", default="30s", metavar="DURATION", help="check interval (default 30s)")
    p.add_argument("--once", action="store_true", help="check once and stop")
    p.add_argument(
        "--idle",
        metavar="DURATION",
        help="stop when the log has not grown (or not appeared) for this long (default: follow until stopped)",
    )
    p.add_argument(
        "--fail-on",
        default="nonfinite",
        metavar="DETECTORS",
        help=f"comma-separated detectors ({', '.join(DETECTORS)}, 'any', or 'none') whose first alert "
        "stops the watch with exit 1 (default nonfinite: a NaN or inf in a metric)",
    )
    p.add_argument("--detectors", default=",".join(DETECTORS), metavar="LIST", help="detectors to run (default: all)")
    p.add_argument("--alerts", metavar="FILE", help="append the JSON alert lines to FILE instead of stdout")
    p.add_argument("--no-view", action="store_true", help="no live view even on a terminal")
    p.add_argument("--window", type=int, default=d.window, help=f"rolling-mean window, steps (default {d.window})")
    p.add_argument(
        "--warmup", type=int, default=d.warmup, help=f"first points taken as the healthy level (default {d.warmup})"
    )
    p.add_argument(
        "--patience",
        type=int,
        default=d.patience,
        help=f"plateau: steps without a new best mean reward (default {d.patience})",
    )
    p.add_argument(
        "--collapse",
        type=float,
        default=d.collapse,
        help=f"entropy: alert below this fraction of its early level (default {d.collapse})",
    )
    p.add_argument(
        "--spike",
        type=float,
        default=d.spike,
        help=f"grad norm: alert above this multiple of its recent median (default {d.spike:g})",
    )
    p.add_argument(
        "--rise",
        type=float,
        default=d.rise,
        help=f"rising: the shift must exceed this many warm-up standard deviations (default {d.rise:g})",
    )
    p.add_argument(
        "--persist",
        type=int,
        default=d.persist,
        help=f"rising, diverge: a shift must cover this many logged steps (default {d.persist})",
    )
    p.add_argument(
        "--effect",
        type=float,
        default=d.effect,
        help=f"diverge: a shift must be this many baseline noise units (default {d.effect:g})",
    )
    p.add_argument(
        "--rising",
        nargs="+",
        default=list(d.rising_metrics),
        metavar="METRIC",
        help=f"metrics watched for rising from their early level (default {' '.join(d.rising_metrics)})",
    )
    p.add_argument(
        "--nonfinite",
        nargs="+",
        default=[],
        metavar="METRIC",
        help="metrics (canonical or raw names) watched for NaN and inf (default: every metric of the log)",
    )
    p.set_defaults(func=run_watch)


def _detectors(text: str, flag: str, allow_any: bool) -> tuple:
    from mcore_proxy.diagnose.detect import DETECTORS

    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if allow_any and names == ("any",):
        return DETECTORS
    if allow_any and names == ("none",):
        return ()
    unknown = [n for n in names if n not in DETECTORS]
    if unknown:
        raise ProxyError(
            f"{flag} {text!r}: unknown detector(s) {unknown}; known: {', '.join(DETECTORS)}"
            + (", any, none" if allow_any else "")
        )
    return names


def check_alerts_file(alerts: Path, logs: list[Path]) -> None:
    """--alerts appends to a file: never to a log the watch reads (or a file inside a log folder),
    never inside a checkpoint, and in a folder that exists."""
    from mcore_proxy.core.output import check_folder, check_not_in_checkpoint

    target = alerts.absolute()
    for log_path in logs:
        src = log_path.resolve()
        if target.resolve() == src or src in target.resolve().parents:
            raise ProxyError(
                f"{alerts}: is (or lies in) the log {log_path} that the watch reads; choose another --alerts file"
            )
    check_folder(target.parent)
    check_not_in_checkpoint(target.parent)


def run_watch(args) -> int:
    import sys
    import time

    from mcore_proxy.diagnose.detect import Settings
    from mcore_proxy.diagnose.watch import Watcher, alert_line, view
    from mcore_proxy.core.errors import LogError

    every, idle = duration(args.every), duration(args.idle) if args.idle else None
    try:
        settings = Settings(
            window=args.window,
            warmup=args.warmup,
            patience=args.patience,
            collapse=args.collapse,
            spike=args.spike,
            rise=args.rise,
            persist=args.persist,
            effect=args.effect,
            rising_metrics=tuple(args.rising),
            nonfinite_metrics=tuple(args.nonfinite),
        )
    except ValueError as err:
        raise ProxyError(f"watch: {err}") from None
    enabled = _detectors(args.detectors, "--detectors", False)
    fail_on = _detectors(args.fail_on, "--fail-on", True)
    watcher = Watcher(Path(args.log), Path(args.baseline) if args.baseline else None, settings, enabled)
    live = sys.stderr.isatty() and not args.no_view
    # alert lines go to --alerts FILE, else to stdout, which --json keeps for its one document
    if args.alerts:
        check_alerts_file(Path(args.alerts), [Path(p) for p in (args.log, args.baseline) if p])
    out = open(args.alerts, "a") if args.alerts else None if args.json else sys.stdout
    failed = None
    try:
        while failed is None:
            new = watcher.check()
            for alert in new:
                if out is not None:
                    print(alert_line(alert), file=out, flush=True)
            if live:
                sys.stderr.write("\x1b[H\x1b[2J" + view(watcher, every))
                sys.stderr.flush()
            failed = next((a for a in new if a.finding.detector in fail_on), None)
            if failed is not None or args.once or (idle is not None and time.time() - watcher.last_growth > idle):
                break
            if out is sys.stdout and hasattr(sys.stdout, "reader_gone") and sys.stdout.reader_gone():
                break  # the reader of the alert lines has gone (`watch LOG | head -1`): so has the watch
            time.sleep(every)
    finally:
        if args.alerts:
            out.close()
    if watcher.run is None:
        when = "" if args.once else " before the watch stopped"
        raise LogError(f"{args.log}: nothing readable{when} ({watcher.waiting})")
    if not live:
        sys.stderr.write(view(watcher, every))
    if args.json:
        emit(
            args,
            "watch",
            {
                "log": args.log,
                "baseline": args.baseline,
                "last_step": watcher.last_step,
                "ok": failed is None,
                "alerts": [a.to_dict() for a in watcher.alerts],
            },
            "",
        )
    if failed is not None:
        f = failed.finding
        raise CheckFailed(
            f"{f.detector} alert on {f.metric} (since step {f.onset}, noticed at step {failed.step}): {f.message}"
        )
    return 0
