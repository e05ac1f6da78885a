"""`mcore-proxy inspect CKPT [--json]`."""
from __future__ import annotations

import json


def register(sub) -> None:
    p = sub.add_parser("inspect", help="show a checkpoint's format, layout, layers and bytes")
    p.add_argument("ckpt", help="checkpoint folder (root with the tracker file, or an iter_* folder)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=run_inspect)


def run_inspect(args) -> int:
    from mcore_proxy.checkpoint import open_checkpoint
    from mcore_proxy.checkpoint.inspect import describe, format_description

    info = describe(open_checkpoint(args.ckpt))
    print(json.dumps(info, indent=2) if args.json else format_description(info))
    return 0
