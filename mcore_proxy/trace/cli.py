"""`mcore-proxy stats merge DIR [-o OUT]` and `mcore-proxy stats show STATS [--png DIR]`."""
from __future__ import annotations

import argparse
from pathlib import Path

from mcore_proxy.errors import OutputError, StatsError
from mcore_proxy.plotting import require_matplotlib

MERGED_NAME = "routing_stats.safetensors"
RANK_GLOB = "rank*.safetensors"


def register(subparsers) -> None:
    p = subparsers.add_parser("stats", help="merge and inspect routing statistics",
                              description="Routing statistics written by the trace patch.")
    sub = p.add_subparsers(dest="stats_command", required=True)
    m = sub.add_parser("merge", help="sum the per-rank files of a traced run",
                       description="Element-wise sum of DIR/rank*.safetensors into one file.")
    m.add_argument("dir", help="folder the run wrote (MCORE_PROXY_TRACE_DIR)")
    m.add_argument("-o", "--output", help=f"merged file (default DIR/{MERGED_NAME})")
    m.add_argument("--force", action="store_true", help="replace an existing output file")
    m.add_argument("--allow-missing-layers", action="store_true",
                   help="merge even if some declared MoE layers have no statistics")
    m.set_defaults(func=run_merge)
    s = sub.add_parser("show", help="per-layer load, dead experts, entropy, co-activation",
                       description="Summarise a statistics file (or a folder of rank files).")
    s.add_argument("stats", help="a .safetensors statistics file, or a folder of rank files")
    s.add_argument("--top", type=int, default=3, metavar="N", help="experts listed per end (3)")
    s.add_argument("--png", metavar="DIR", help="also write load.png and coact.png into DIR")
    s.set_defaults(func=run_show)


def rank_files(folder: Path) -> list[Path]:
    if not folder.is_dir():
        raise StatsError(f"{folder}: not a folder; pass the MCORE_PROXY_TRACE_DIR of a traced run")
    files = sorted(folder.glob(RANK_GLOB))
    if not files:
        raise StatsError(f"{folder}: holds no {RANK_GLOB} routing-statistics files; pass the "
                         "MCORE_PROXY_TRACE_DIR of a run that finished (files are written at "
                         "exit and every MCORE_PROXY_TRACE_FLUSH_STEPS steps)")
    return files


def merge_folder(folder: Path, *, allow_missing_layers: bool = False):
    from mcore_proxy.stats import load_stats, merge_stats

    parts = [(path, load_stats(path)) for path in rank_files(folder)]
    return merge_stats(parts, allow_missing_layers=allow_missing_layers)


def run_merge(args: argparse.Namespace) -> int:
    from mcore_proxy.stats import save_stats

    folder = Path(args.dir)
    out = Path(args.output) if args.output else folder / MERGED_NAME
    if out.suffix != ".safetensors":
        raise OutputError(f"{out}: the merged file must end in .safetensors (its sidecar is the .json)")
    if out.exists() and not args.force:
        raise OutputError(f"{out}: exists; pass --force to replace it or choose another -o")
    merged = merge_folder(folder, allow_missing_layers=args.allow_missing_layers)
    save_stats(merged, out)
    print(f"merged {merged.meta['ranks_merged']} rank file(s): {len(merged.layers)} MoE layers, "
          f"{merged.total_tokens} routed tokens over all layers -> {out}")
    return 0


def run_show(args: argparse.Namespace) -> int:
    from mcore_proxy.stats import load_stats
    from mcore_proxy.trace.summary import summary_table, write_heatmaps

    if args.png:
        require_matplotlib("--png")  # before anything is printed or written
    path = Path(args.stats)
    stats = merge_folder(path) if path.is_dir() else load_stats(path)
    print(summary_table(stats, args.top))
    if args.png:
        for written in write_heatmaps(stats, args.png):
            print(f"wrote {written}")
    return 0
