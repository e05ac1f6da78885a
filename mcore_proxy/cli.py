"""`mcore-proxy` console entry point: a thin argparse layer; every command lives in its package.

Each command module exposes `register(subparsers)`, which adds its parser through
`mcore_proxy.cli_support.flags` (the spelling table, help layout, `--json` and `--force`) and sets `func`.
Heavy imports (kmedoids, matplotlib, megatron) happen inside the command functions only.
Exit codes: `mcore_proxy.cli_support.flags.EXIT_CODES`. An optional package a command needs and the install
lacks is exit 2 with one sentence naming the extra (`mcore_proxy.core.optional`), also when the command
did not check for it first.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import select
import signal
import stat
import sys
import traceback

from mcore_proxy.core.errors import CheckFailed, Interrupted, ProxyError
from mcore_proxy.core.optional import from_import_error

# in pipeline order: the order of the top-level help
COMMAND_MODULES = (
    "mcore_proxy.checkpoint.cli",
    "mcore_proxy.estimate.cli",
    "mcore_proxy.activation.cli",
    "mcore_proxy.trace.cli",
    "mcore_proxy.trace.collect_cli",
    "mcore_proxy.select.cli",
    "mcore_proxy.convert.cli",
    "mcore_proxy.fidelity.cli",
    "mcore_proxy.rollout.cli",
    "mcore_proxy.campaign.cli",
    "mcore_proxy.diagnose.cli",
)
DEBUG_ENV = "MCORE_PROXY_DEBUG"

DESCRIPTION = """\
Build a small proxy of a Mixture-of-Experts checkpoint to reproduce training faults on
fewer devices: keep K of the E routed experts in every MoE layer, chosen from routing
statistics of a real run (or of a Hugging Face model under `collect`), and write a Megatron
checkpoint (legacy or torch_dist) at a smaller expert-parallel layout, or Hugging Face safetensors
for the rollout engine. Everything else is copied bit for bit; `verify` proves it.
"""

EPILOG = """\
a typical run:
  mcore-proxy inspect CKPT                               what the checkpoint holds
  mcore-proxy estimate --ckpt CKPT --num-experts 8       devices for the original and the proxy
  PYTHONPATH=$(mcore-proxy patches) MCORE_PROXY_TRACE_DIR=trace <your Megatron or MindSpeed launch>
  mcore-proxy stats merge trace                          -> trace/routing_stats.safetensors
  mcore-proxy select --ckpt CKPT --stats trace/routing_stats.safetensors --num-experts 8 -o plan.json
  mcore-proxy convert CKPT --plan plan.json -o PROXY --target-ep 1
  mcore-proxy verify --orig CKPT --proxy PROXY --plan plan.json
  mcore-proxy consistency --orig HF --data FILE --vllm-python PY   rollout vs trainer routing
  mcore-proxy compare --orig-base A --orig-fault B --proxy-base C --proxy-fault D   (metric logs)
  mcore-proxy campaign faults.json                       faulted runs of the proxy -> library.json
  mcore-proxy watch RUN_LOG --baseline BASE_LOG          early warnings while a run grows
  mcore-proxy compare --run LOG --baseline BASE_LOG --library library.json   which fault is it?
Megatron and MindSpeed-LLM converter spellings are accepted beside ours (--load-dir, --save-dir,
--target-tensor-parallel-size, --target-expert-parallel-size, --num-layer-list, ...); every
command takes --json (one JSON object on stdout), and every command that writes takes --force.
`mcore-proxy COMMAND --help` shows a command's options.

"""


def build_parser() -> argparse.ArgumentParser:
    from mcore_proxy import __version__
    from mcore_proxy.cli_support.flags import HelpFormatter, exit_codes_text

    parser = argparse.ArgumentParser(
        prog="mcore-proxy",
        description=DESCRIPTION,
        epilog=EPILOG + exit_codes_text("verify, compare; a failed campaign run; a watch --fail-on alert"),
        formatter_class=HelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"mcore-proxy {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log diagnostics")
    parser.add_argument(
        "--debug", action="store_true", help=f"print the traceback of an internal error (or set {DEBUG_ENV}=1)"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", title="commands, in pipeline order")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse; a usage error shows the usage of the (sub)command it belongs to, not the top level's."""
    from mcore_proxy.cli_support.flags import empty_argument, finish

    # a caller's paths and numbers are taken as the words they print as (main(["select", "-k", 4]))
    argv = sys.argv[1:] if argv is None else [str(word) for word in argv]
    args, extra = parser.parse_known_args(argv)
    command_parser = getattr(args, "_parser", parser)
    if extra:
        command_parser.error(f"unrecognized arguments: {' '.join(extra)}")
    empty = empty_argument(argv)
    if empty is not None:
        command_parser.error(empty)
    finish(args)
    return args


class _PipeGuard:
    """stdout that goes quiet once its reader has gone (`mcore-proxy inspect CKPT | head -1`): the
    Unix convention, as `cat` does, instead of an error; the command runs on and keeps its exit code
    (verify's 0 or 1 is not lost because its report was cut). Everything else passes through."""

    def __init__(self, stream):
        self._stream, self.closed_pipe = stream, False

    def write(self, text: str) -> int:
        if not self.closed_pipe:
            try:
                self._stream.write(text)
                self._stream.flush()  # find a closed pipe now, not at the interpreter's exit
            except BrokenPipeError:
                self._go_quiet()
        return len(text)

    def flush(self) -> None:
        if not self.closed_pipe:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._go_quiet()

    def reader_gone(self) -> bool:
        """Whether stdout's reader has gone, also before anything was written to it: a pipe's write
        end reports POLLERR once no reader is left (a follower such as `watch` asks between polls)."""
        if not self.closed_pipe:
            try:
                fd = self._stream.fileno()
                if stat.S_ISFIFO(os.fstat(fd).st_mode):
                    poller = select.poll()
                    poller.register(fd, select.POLLOUT)
                    if any(event & select.POLLERR for _, event in poller.poll(0)):
                        self._go_quiet()
            except (OSError, ValueError, AttributeError):  # no descriptor (tests' capture) or no poll
                pass
        return self.closed_pipe

    def _go_quiet(self) -> None:
        self.closed_pipe = True
        try:  # the interpreter flushes fd 1 at exit: let that find /dev/null, not the closed pipe
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
        except (OSError, ValueError, AttributeError):  # a stream without a descriptor (tests' capture)
            pass

    def __getattr__(self, name):
        return getattr(self._stream, name)


@contextlib.contextmanager
def quiet_on_closed_pipe():
    """sys.stdout guarded by _PipeGuard for the block."""
    guard = _PipeGuard(sys.stdout)
    sys.stdout = guard
    try:
        yield guard
    finally:
        sys.stdout = guard._stream


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def main(argv: list | None = None) -> int:
    """Run one command line (`argv`: its words, default sys.argv[1:]; a Path or a number is taken as
    its text) and return its exit code."""
    from mcore_proxy.runtime.interrupts import signal_name, stop_on_signals

    args = parse(build_parser(), argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    debug = args.debug or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    name = " ".join(
        ["mcore-proxy", args.command] + ([args.stats_command] if getattr(args, "stats_command", None) else [])
    )
    if hasattr(signal, "SIGXFSZ"):
        # past a file-size limit (ulimit -f) a write then fails with EFBIG, which is reported as
        # one sentence, instead of the default action: killing the process with a core dump
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        with stop_on_signals(), quiet_on_closed_pipe():
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
        missing = from_import_error(err) if isinstance(err, ImportError) else None
        if missing is not None:  # an optional package no check of the command asked for first
            print(f"{name}: error: {missing}", file=sys.stderr)
            return 2
        if debug:
            traceback.print_exc()
        print(
            f"{name}: internal error: {_one_line(err)} (run with --debug or {DEBUG_ENV}=1 for the "
            "traceback, and report it)",
            file=sys.stderr,
        )
        return 3


if __name__ == "__main__":
    sys.exit(main())
