"""`mcore-proxy` console entry point: a thin argparse layer; every command lives in its package.

Each command module exposes `register(subparsers)`, which adds its parser and sets `func`.
Heavy imports (kmedoids, matplotlib, megatron) happen inside the command functions only.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

from mcore_proxy.errors import CheckFailed, ProxyError

COMMAND_MODULES = (
    "mcore_proxy.checkpoint.cli",
    "mcore_proxy.select.cli",
    "mcore_proxy.trace.cli",
    "mcore_proxy.convert.cli",
    "mcore_proxy.diagnose.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mcore-proxy", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log diagnostics")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except ProxyError as err:
        print(f"mcore-proxy {args.command}: error: {err}", file=sys.stderr)
        return 2
    except CheckFailed as err:
        print(f"mcore-proxy {args.command}: check failed: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
