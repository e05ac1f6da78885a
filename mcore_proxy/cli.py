"""`mcore-proxy` console entry point: a thin argparse layer; every command lives in its package.

Each command module exposes `register(subparsers)`, which adds its parser and sets `func`.
Heavy imports (kmedoids, matplotlib, megatron) happen inside the command functions only.

Exit codes: 0 success, 1 a check found a difference, 2 bad input or usage (including a failed
write: full disk, file-size limit, read-only target), 3 an internal error (one line; the
traceback with --debug or MCORE_PROXY_DEBUG=1), 128 + N when stopped by signal N (SIGINT,
SIGTERM, SIGHUP), after removing any partial output.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
import traceback

from mcore_proxy.errors import CheckFailed, Interrupted, ProxyError

COMMAND_MODULES = (
    "mcore_proxy.checkpoint.cli",
    "mcore_proxy.select.cli",
    "mcore_proxy.trace.cli",
    "mcore_proxy.trace.collect_cli",
    "mcore_proxy.convert.cli",
    "mcore_proxy.estimate.cli",
    "mcore_proxy.diagnose.cli",
    "mcore_proxy.fidelity.cli",
)
DEBUG_ENV = "MCORE_PROXY_DEBUG"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mcore-proxy", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log diagnostics")
    parser.add_argument("--debug", action="store_true",
                        help=f"print the traceback of an internal error (or set {DEBUG_ENV}=1)")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def main(argv: list[str] | None = None) -> int:
    from mcore_proxy.interrupts import signal_name, stop_on_signals

    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    debug = args.debug or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    name = f"mcore-proxy {args.command}"
    if hasattr(signal, "SIGXFSZ"):
        # past a file-size limit (ulimit -f) a write then fails with EFBIG, which is reported as
        # one sentence, instead of the default action: killing the process with a core dump
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        with stop_on_signals():
            return int(args.func(args) or 0)
    except Interrupted as stop:
        print(f"{name}: stopped by {signal_name(stop.signum)}; partial output removed", file=sys.stderr)
        return 128 + stop.signum
    except ProxyError as err:
        print(f"{name}: error: {err}", file=sys.stderr)
        return 2
    except CheckFailed as err:
        print(f"{name}: check failed: {err}", file=sys.stderr)
        return 1
    except OSError as err:  # an unreadable input or an unwritable place outside the staged output
        where = f"{err.filename}: " if err.filename else ""
        print(f"{name}: error: {where}{err.strerror or err}; check the path and its permissions", file=sys.stderr)
        return 2
    except Exception as err:  # noqa: BLE001 - the one place internal errors become exit code 3
        if debug:
            traceback.print_exc()
        print(f"{name}: internal error: {_one_line(err)} (run with --debug or {DEBUG_ENV}=1 for the "
              "traceback, and report it)", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
