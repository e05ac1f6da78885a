"""`mcore-proxy campaign CONFIG [--jobs N] [--dry-run]`: run a fault-injection campaign into a
signature library and print which metric warns earliest for each fault."""
from __future__ import annotations

from mcore_proxy.errors import CheckFailed


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "campaign", help="run a training command under each fault of a list, into a signature library",
        description="Run the config's training command once as a baseline and once per fault and "
                    "strength (MCORE_PROXY_FAULTS set per run), a few at a time; a restarted campaign "
                    "runs only what has not finished. Writes WORK/runs/NAME/ per run and "
                    "WORK/library.json (mcore-proxy-library/1), and prints the earliest-warning "
                    "metric of each fault. Exit 0 all runs finished, 1 some failed, 2 bad config, "
                    "128+N stopped by signal N (running runs are stopped and their folders removed).")
    p.add_argument("config", metavar="CONFIG", help="campaign file (JSON, mcore-proxy-campaign/1)")
    p.add_argument("--jobs", type=int, metavar="N", help="runs at once (overrides the config's \"jobs\")")
    p.add_argument("--dry-run", action="store_true", help="list the runs and their state, run nothing")
    p.add_argument("--png", action="store_true",
                   help="also draw the library (entries x metrics: shift and onset) as WORK/library.png")
    p.set_defaults(func=run_campaign_command)


def _fmt(value, spec=".3g") -> str:
    return "-" if value is None else format(value, spec)


def warning_table(library) -> str:
    """Per library entry: the metric that departs from the baseline first, its onset and strength."""
    from mcore_proxy.diagnose.library import earliest_warning

    lines = [f"{'run':<24} {'earliest warning':<16} {'onset':>5} {'shift':>10} {'relative':>8} "
             f"{'effect':>7} {'p':>7}  also shifted"]
    for entry in library.entries:
        first = earliest_warning(entry.signature)
        if first is None:
            lines.append(f"{entry.name:<24} {'none: no metric departs from the baseline'}")
            continue
        others = [f"{m.metric}@{m.onset}" for m in entry.signature.metrics.values()
                  if m.shifted and m.metric != first.metric]
        lines.append(f"{entry.name:<24} {first.metric:<16} {first.onset:>5} {first.shift:>+10.3g} "
                     f"{_fmt(first.relative_shift, '+.2f'):>8} {_fmt(first.effect, '+.1f'):>7} "
                     f"{first.p_shift:>7.2g}  {', '.join(others) or '-'}")
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


def run_campaign_command(args) -> int:
    import dataclasses

    from mcore_proxy.campaign.config import ConfigError, load_config
    from mcore_proxy.campaign.runner import finished, run_campaign

    config = load_config(args.config)
    if args.jobs is not None:
        if args.jobs < 1:
            raise ConfigError(f"--jobs {args.jobs}: must be >= 1")
        config = dataclasses.replace(config, jobs=args.jobs)
    if args.dry_run:
        for entry in config.entries:
            state = "finished" if finished(entry) else "to run"
            print(f"{entry.name:<24} {state:<9} {entry.spec or 'no fault'}\n    {' '.join(entry.command)}")
        return 0
    if args.png:
        from mcore_proxy.plotting import require_matplotlib

        require_matplotlib("--png")
    result = run_campaign(config)
    for outcome in result.outcomes:
        print(f"{outcome.entry.name:<24} {outcome.status:<16} {outcome.seconds / 60:6.1f} min  "
              f"{outcome.entry.spec or 'no fault'}")
    if result.library is not None:
        print()
        print(warning_table(result.library))
        print(f"library: {config.library} ({len(result.library.entries)} entries)")
        if args.png and result.library.entries:
            print(f"picture: {draw_library(result.library, config.library.with_suffix('.png'))}")
    if result.failed:
        raise CheckFailed(f"{len(result.failed)} run(s) failed: " + "; ".join(
            f"{o.entry.name} (exit {o.returncode}, {o.entry.run_dir / 'console.log'})" for o in result.failed)
            + "; start the campaign again to rerun them")
    return 0
