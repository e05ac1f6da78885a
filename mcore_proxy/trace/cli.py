"""`mcore-proxy stats merge DIR [-o OUT]` and `mcore-proxy stats show STATS [--png DIR]`."""

from __future__ import annotations

import argparse
import glob
from pathlib import Path

from mcore_proxy.core.errors import OutputError, StatsError
from mcore_proxy.cli_support.flags import add_command, add_group, emit, positive_int
from mcore_proxy.cli_support.plotting import require_matplotlib

MERGED_NAME = "routing_stats.safetensors"
RANK_GLOB = "rank*.safetensors"


def register(subparsers) -> None:
    sub = add_group(
        subparsers,
        "stats",
        help="merge the per-rank routing statistics of a traced run; show them",
        description="Routing statistics written by the trace patch (one file per rank).",
    )
    m = add_command(
        sub,
        "merge",
        run_merge,
        help="sum the per-rank files of a traced run",
        writes="merged file",
        description="Element-wise sum of DIR/rank*.safetensors into one file (and its JSON sidecar).",
    )
    m.add_argument("dir", help="folder the run wrote (MCORE_PROXY_TRACE_DIR)")
    m.add_argument("-o", "--output", help=f"merged file (default DIR/{MERGED_NAME})")
    m.add_argument(
        "--allow-missing-layers", action="store_true", help="merge even if some declared MoE layers have no statistics"
    )
    s = add_command(
        sub,
        "show",
        run_show,
        help="per-layer load, dead experts, entropy, co-activation",
        writes="load.png and coact.png of --png",
        description="Summarise a statistics file (or a folder of rank files).",
    )
    s.add_argument("stats", help="a .safetensors statistics file, or a folder of rank files")
    s.add_argument("--top", type=positive_int, default=3, metavar="N", help="experts listed per end (3)")
    s.add_argument("--png", metavar="DIR", help="also write load.png and coact.png into DIR")


def rank_files(folder: Path) -> list[Path]:
    if not folder.is_dir():
        raise StatsError(f"{folder}: not a folder; pass the MCORE_PROXY_TRACE_DIR of a traced run")
    files = sorted(folder.glob(RANK_GLOB))
    if not files:
        raise StatsError(
            f"{folder}: holds no {RANK_GLOB} routing-statistics files; pass the "
            "MCORE_PROXY_TRACE_DIR of a run that finished (files are written at "
            "exit and every MCORE_PROXY_TRACE_FLUSH_STEPS steps)"
        )
    return files


def check_merge_output(out: Path, folder: Path) -> None:
    """The merged file may not be one of the rank files it sums, nor lie in the folder it reads
    (a later merge would sum it again), except under the default name, `DIR/routing_stats.safetensors`,
    which no merge reads (it does not match `rank*.safetensors`)."""
    if not folder.is_dir():
        return  # rank_files names the problem
    here = out.absolute().parent.resolve()
    inside = here == folder.resolve() or folder.resolve() in here.parents
    if inside and out.name != MERGED_NAME:
        raise OutputError(
            f"{out}: lies in the folder {folder} that the merge reads, so a later merge would sum it "
            f"again (or it replaces a rank file); write it outside, or as {folder / MERGED_NAME}"
        )


def merge_folder(folder: Path, *, allow_missing_layers: bool = False):
    from mcore_proxy.core.stats import load_stats, merge_stats

    parts = [(path, load_stats(path)) for path in rank_files(folder)]
    return merge_stats(parts, allow_missing_layers=allow_missing_layers)


def run_merge(args: argparse.Namespace) -> int:
    from mcore_proxy.core.output import staged_files
    from mcore_proxy.core.stats import save_stats, sidecar_path

    folder = Path(args.dir)
    out = Path(args.output) if args.output else folder / MERGED_NAME
    if out.suffix != ".safetensors":
        raise OutputError(f"{out}: the merged file must end in .safetensors (its sidecar is the .json)")
    check_merge_output(out, folder)
    names = (glob.escape(out.name), glob.escape(sidecar_path(out).name))  # the JSON last, as save_stats
    with staged_files(out.parent, out.name, names, replace=args.force) as tmp:
        merged = merge_folder(folder, allow_missing_layers=args.allow_missing_layers)
        save_stats(merged, tmp / out.name)
    doc = {
        "output": str(out),
        "ranks_merged": merged.meta["ranks_merged"],
        "moe_layers": len(merged.layers),
        "total_tokens": merged.total_tokens,
    }
    emit(
        args,
        "stats-merge",
        doc,
        f"merged {doc['ranks_merged']} rank file(s): {doc['moe_layers']} MoE layers, "
        f"{doc['total_tokens']} routed tokens over all layers -> {out}",
    )
    return 0


def run_show(args: argparse.Namespace) -> int:
    from contextlib import nullcontext

    from mcore_proxy.core.output import staged_files
    from mcore_proxy.core.stats import load_stats
    from mcore_proxy.trace.summary import HEATMAPS, summary_dict, summary_table, write_heatmaps

    if args.png:
        require_matplotlib("--png")  # before anything is printed or written
    path = Path(args.stats)
    pngs = (
        staged_files(args.png, "stats-png", HEATMAPS, replace=args.force, inputs=(path,)) if args.png else nullcontext()
    )
    with pngs as png_dir:
        stats = merge_folder(path) if path.is_dir() else load_stats(path)
        written = [Path(args.png) / p.name for p in write_heatmaps(stats, png_dir)] if args.png else []
    doc = {"stats": str(path), **summary_dict(stats, args.top), "png": [str(p) for p in written]}
    emit(args, "stats-show", doc, "\n".join([summary_table(stats, args.top)] + [f"wrote {p}" for p in written]))
    return 0
