"""`mcore-proxy campaign CONFIG [--jobs N] [--dry-run] [--png] [--json]`: run a fault-injection campaign into a
signature library and print which metric warns earliest for each fault."""

from __future__ import annotations

from mcore_proxy.core.errors import CheckFailed
from mcore_proxy.cli_support.flags import add_command, emit, positive_int


def register(subparsers) -> None:
    p = add_command(
        subparsers,
        "campaign",
        run_campaign_command,
        help="run a training command under each fault of a list, into a signature library",
        checks="a run failed; start the campaign again to rerun it",
        description="Run the config's training command once as a baseline and once per fault, "
        "strength and schedule (MCORE_PROXY_FAULTS set per run), a few at a time; a "
        "restarted campaign runs only what has not finished (on a signal the running "
        "runs are stopped and their folders removed). Writes WORK/runs/NAME/ per run "
        "and WORK/library.json (mcore-proxy-library/1), and prints the "
        "earliest-warning metric of each fault.",
    )
    p.add_argument("config", metavar="CONFIG", help="campaign file (JSON, mcore-proxy-campaign-config/1)")
    p.add_argument("--jobs", type=positive_int, metavar="N", help="runs at once (overrides the config's \"jobs\")")
    p.add_argument("--dry-run", action="store_true", help="list the runs and their state, run nothing")
    p.add_argument(
        "--png",
        action="store_true",
        help="also draw the library (entries x metrics: shift and onset) as WORK/library.png",
    )


def _fmt(value, spec=".3g") -> str:
    return "-" if value is None else format(value, spec)


def warning_table(library) -> str:
    """Per library entry: the metric that departs from the baseline first, its onset and strength."""
    from mcore_proxy.diagnose.library import earliest_warning

    lines = [
        f"{'run':<24} {'earliest warning':<16} {'onset':>5} {'shift':>10} {'relative':>8} "
        f"{'effect':>7} {'p':>7}  also shifted"
    ]
    for entry in library.entries:
        first = earliest_warning(entry.signature)
        if first is None:
            lines.append(f"{entry.name:<24} {'none: no metric departs from the baseline'}")
            continue
        others = [
            f"{m.metric}@{m.onset}" for m in entry.signature.metrics.values() if m.shifted and m.metric != first.metric
        ]
        lines.append(
            f"{entry.name:<24} {first.metric:<16} {first.onset:>5} {first.shift:>+10.3g} "
            f"{_fmt(first.relative_shift, '+.2f'):>8} {_fmt(first.effect, '+.1f'):>7} "
            f"{first.p_shift:>7.2g}  {', '.join(others) or '-'}"
        )
    return "\n".join(lines)


def draw_library(library, path):
    import os

    import matplotlib.pyplot as plt

    from mcore_proxy.diagnose.report import library_figure

    fig = library_figure(library)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}.png")
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    os.replace(tmp, path)
    return path


def require_library_packages(config) -> None:
    """The signature library is built from the runs' logs once the baseline has finished: without
    the `diagnose` extra that would fail after hours of runs, so it is checked before any starts.
    (A TensorBoard log is known for sure only once it exists; a `tfevents` name is checked here.)"""
    from pathlib import Path

    from mcore_proxy.core.optional import check

    tensorboard = any("tfevents" in Path(entry.log).name for entry in config.entries)
    modules = ["scipy", "ruptures"] + (["tensorboard"] if tensorboard else [])
    check(*modules, why="campaign (its signature library of the runs' metrics)")


def run_campaign_command(args) -> int:
    import dataclasses

    from mcore_proxy.campaign.config import ConfigError, load_config
    from mcore_proxy.campaign.runner import check_work_folder, finished, run_campaign

    config = load_config(args.config)
    if args.jobs is not None:
        if args.jobs < 1:
            raise ConfigError(f"--jobs {args.jobs}: must be >= 1")
        config = dataclasses.replace(config, jobs=args.jobs)
    if args.dry_run:
        check_work_folder(config)
        runs = [
            {
                "name": e.name,
                "state": "finished" if finished(e) else "to run",
                "spec": e.spec,
                "command": list(e.command),
            }
            for e in config.entries
        ]
        text = "\n".join(
            f"{r['name']:<24} {r['state']:<9} {r['spec'] or 'no fault'}\n    {' '.join(r['command'])}" for r in runs
        )
        emit(args, "campaign", {"config": str(config.path), "dry_run": True, "runs": runs}, text)
        return 0
    if args.png:
        from mcore_proxy.cli_support.plotting import require_matplotlib

        require_matplotlib("--png")
    require_library_packages(config)
    result = run_campaign(config)
    lines = [
        f"{o.entry.name:<24} {o.status:<16} {o.seconds / 60:6.1f} min  {o.entry.spec or 'no fault'}"
        for o in result.outcomes
    ]
    picture = None
    if result.library is not None:
        if args.png and result.library.entries:
            picture = str(draw_library(result.library, config.library.with_suffix(".png")))
        lines += [
            "",
            warning_table(result.library),
            f"library: {config.library} ({len(result.library.entries)} entries)",
        ]
        lines += [f"picture: {picture}"] if picture else []
    emit(args, "campaign", campaign_document(result, picture), "\n".join(lines))
    if result.failed:
        raise CheckFailed(
            f"{len(result.failed)} run(s) failed: "
            + "; ".join(
                f"{o.entry.name} (exit {o.returncode}, {o.entry.run_dir / 'console.log'})" for o in result.failed
            )
            + "; start the campaign again to rerun them"
        )
    return 0


def campaign_document(result, picture) -> dict:
    """The `--json` document: every run's outcome, the library and each entry's earliest warning."""
    from mcore_proxy.diagnose.library import earliest_warning

    earliest = {}
    for entry in result.library.entries if result.library else ():
        first = earliest_warning(entry.signature)
        earliest[entry.name] = (
            None
            if first is None
            else {
                "metric": first.metric,
                "onset": first.onset,
                "shift": first.shift,
                "relative_shift": first.relative_shift,
                "effect": first.effect,
                "p_shift": first.p_shift,
                "also_shifted": {
                    m.metric: m.onset
                    for m in entry.signature.metrics.values()
                    if m.shifted and m.metric != first.metric
                },
            }
        )
    return {
        "config": str(result.config.path),
        "work": str(result.config.work),
        "ok": not result.failed,
        "runs": [
            {
                "name": o.entry.name,
                "fault": o.entry.fault,
                "strength": o.entry.strength,
                "spec": o.entry.spec,
                "status": o.status,
                "seconds": o.seconds,
                "returncode": o.returncode,
                "log": o.entry.log,
            }
            for o in result.outcomes
        ],
        "library": str(result.config.library) if result.library is not None else None,
        "picture": picture,
        "earliest_warning": earliest,
    }
