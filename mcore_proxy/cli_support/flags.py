"""What every `mcore-proxy` command shares on the command line: the one spelling table, the help
layout with exit codes, and the rules of `--json` and `--force`.

Spellings. Megatron-LM's and MindSpeed-LLM's checkpoint converters name their options otherwise
than we do (`--load-dir`, `--target-expert-parallel-size`, `--num-layer-list`, ...). Every one of
their spellings of an option we have is accepted beside ours, from `SPELLINGS` only: a command
adds an option with `add_option(parser, "--target-ep", ...)` and gets all its spellings. The ones
we know but cannot honour yet (`NOT_YET`) are accepted by the commands they apply to and refused
with one sentence saying why, instead of argparse's "unrecognized arguments".

`--json`: stdout then carries exactly one JSON object, `{"format": "mcore-proxy-<command>/1",
...}`, with the same numbers as the text: sizes as byte counts in keys ending in `_bytes`
(the text shows them in binary units, `mcore_proxy.core.units`), shares as fractions in [0, 1],
paths as given. Progress bars and warnings go to stderr. On bad input (exit 2) or an internal
error (exit 3) stdout stays empty and stderr holds the sentence; a check that found a difference
(exit 1) still prints its document, with `"ok": false`.

`--force`: every command that writes refuses an existing output unless given `--force`; with it
the new output is written completely beside the old one and then swapped in
(`mcore_proxy.core.output`), so a failed forced run leaves the old output as it was.
"""

from __future__ import annotations

import argparse
import json
import math
import textwrap
from dataclasses import dataclass

MEGATRON = "Megatron-LM tools/checkpoint (convert.py, saver_core.py)"
MINDSPEED = "MindSpeed-LLM convert_ckpt.py (mindspeed_llm/tasks/checkpoint)"
CONVERTERS = f"{MEGATRON}; {MINDSPEED}"
TRAINING = "Megatron training arguments"
# the `-model-` spellings of the target sizes: Pai-Megatron-Patch's hf2mcore_*.py converters and
# transformers' Megatron checkpoint_reshaping_and_interoperability.py
HF2MCORE = "hf2mcore converters (Pai-Megatron-Patch, transformers' Megatron conversion)"


@dataclass(frozen=True)
class Spelling:
    """Other names of one of our options.

    ours: our spelling (`CKPT` is the positional checkpoint of `inspect` and `convert`);
    names: the other spellings, accepted wherever `ours` is; origin: whose spellings they are;
    value: for a switch that stands for `ours value` (`--moe-grouped-gemm` = `--expert-layout grouped`).
    """

    ours: str
    names: tuple[str, ...]
    origin: str
    value: str | None = None


@dataclass(frozen=True)
class NotYet:
    """Spellings of converter options that map onto nothing we can do yet: accepted, then refused
    with `why` by the commands in `commands`."""

    names: tuple[str, ...]
    origin: str
    why: str
    commands: tuple[str, ...]


SPELLINGS: tuple[Spelling, ...] = (
    Spelling("CKPT", ("--load-dir",), CONVERTERS),
    Spelling("--ckpt", ("--load-dir",), CONVERTERS),
    Spelling("--orig", ("--load-dir",), CONVERTERS),
    Spelling("--out", ("--save-dir",), CONVERTERS),
    Spelling("--proxy", ("--save-dir",), CONVERTERS),
    Spelling("--target-tp", ("--target-tensor-parallel-size",), CONVERTERS),
    Spelling("--target-tp", ("--target-tensor-model-parallel-size",), HF2MCORE),
    Spelling("--target-pp", ("--target-pipeline-parallel-size",), CONVERTERS),
    Spelling("--target-pp", ("--target-pipeline-model-parallel-size",), HF2MCORE),
    Spelling("--target-ep", ("--target-expert-parallel-size",), CONVERTERS),
    Spelling("--target-ep", ("--target-expert-model-parallel-size",), HF2MCORE),
    Spelling("--target-etp", ("--target-expert-tensor-parallel-size",), CONVERTERS),
    # ModelLink / MindSpeed-LLM saver (`--target-num-layer-list 2,5,5,4` in their conversion scripts)
    Spelling("--target-stage-layers", ("--num-layer-list", "--target-num-layer-list"), MINDSPEED),
    Spelling("--expert-layout", ("--moe-grouped-gemm",), f"{MINDSPEED}; {TRAINING}", value="grouped"),
    Spelling("--tp", ("--tensor-model-parallel-size",), TRAINING),
    Spelling("--pp", ("--pipeline-model-parallel-size",), TRAINING),
    Spelling("--ep", ("--expert-model-parallel-size",), TRAINING),
    Spelling("--etp", ("--expert-tensor-parallel-size",), TRAINING),
    Spelling("--micro-batch", ("--micro-batch-size",), TRAINING),
    Spelling("--seq-len", ("--seq-length",), TRAINING),
)

NOT_YET: tuple[NotYet, ...] = (
    NotYet(
        ("--noop-layers",),
        MINDSPEED,
        "mcore-proxy does not write noop layers yet other than the source's: a legacy source "
        "saved with --noop-layers keeps them (same ids, same args), so leave the flag out and "
        "launch the proxy with the source's --noop-layers",
        ("convert",),
    ),
    NotYet(
        ("--num-layers-per-virtual-pipeline-stage", "--vpp-stage"),
        MINDSPEED,
        "mcore-proxy does not write virtual stages from a layer count per virtual stage; give "
        "--target-vpp N (N = layers per pipeline rank / layers per virtual stage) or a "
        "--target-pipeline-layout",
        ("convert",),
    ),
)

EXIT_CODES = {
    0: "success",
    1: "a check found a difference",
    2: "bad input or usage, including a failed write (one sentence naming the file and the fix)",
    3: "internal error (one line; the traceback with --debug or MCORE_PROXY_DEBUG=1)",
    "128+N": "stopped by signal N (SIGINT, SIGTERM, SIGHUP); any partial output removed",
}


def exit_codes_text(checks: str | None = None) -> str:
    """The exit-code table of a help text; `checks`: what exit 1 means for this command, or None
    for a command that checks nothing (it never exits 1)."""
    rows = [
        (str(code), what if code != 1 else f"{what} ({checks})")
        for code, what in EXIT_CODES.items()
        if code != 1 or checks
    ]
    width = max(len(code) for code, _ in rows)
    return "exit codes:\n" + "\n".join(f"  {code:<{width}}  {what}" for code, what in rows)


def spellings_of(ours: str) -> tuple[str, ...]:
    """Every other spelling of our option `ours` that takes a value (switches are `switches_of`)."""
    return tuple(n for s in SPELLINGS if s.ours == ours and s.value is None for n in s.names)


def switches_of(ours: str) -> tuple[Spelling, ...]:
    return tuple(s for s in SPELLINGS if s.ours == ours and s.value is not None)


class HelpFormatter(argparse.HelpFormatter):
    """Help texts wrapped to the terminal, except paragraphs written on several lines (examples,
    tables), which stay as written; an option's spellings on one line with one metavar
    (`--target-ep, --target-expert-parallel-size N`)."""

    def __init__(self, prog, **kwargs):
        super().__init__(prog, max_help_position=34, **kwargs)

    def _fill_text(self, text, width, indent):
        paragraphs = text.strip("\n").split("\n\n")
        return "\n\n".join(
            p
            if "\n" in p
            else textwrap.fill(" ".join(p.split()), width, initial_indent=indent, subsequent_indent=indent)
            for p in paragraphs
        )

    def _format_action_invocation(self, action):
        if not action.option_strings or action.nargs == 0:
            return super()._format_action_invocation(action)
        metavar = self._format_args(action, self._get_default_metavar_for_optional(action))
        return f"{', '.join(action.option_strings)} {metavar}"


def positive_int(text: str) -> int:
    """argparse type of a size or count: an integer >= 1. A parallel size of 0 is not "the default"
    (leave the option out for that), and a count of 0 has nothing to do."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"{value} is not a size: give an integer >= 1 (leave the option out for its default)"
        )
    return value


def add_option(parser, *ours: str, **kwargs) -> argparse.Action:
    """`parser.add_argument(*ours, **kwargs)` plus every spelling of `ours` in the table; a switch
    spelling (`--moe-grouped-gemm`) becomes its own flag storing its value into the same dest."""
    action = parser.add_argument(*ours, *(n for o in ours for n in spellings_of(o)), **kwargs)
    for o in ours:
        for s in switches_of(o):
            parser.add_argument(
                *s.names,
                dest=action.dest,
                action="store_const",
                const=s.value,
                help=f"same as {o} {s.value} ({s.origin.split(' (')[0]})",
            )
    return action


class _Once(argparse.Action):
    """Store a value given once, by either of two spellings (a positional and an option), through
    `cast`. A positional that was not given arrives as its default, SUPPRESS (before Python 3.12
    even through `type`, hence no `type` here): it sets nothing."""

    def __init__(self, option_strings, dest, cast=str, **kwargs):
        self.cast = cast
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        if values == argparse.SUPPRESS:
            return
        if getattr(namespace, self.dest, None) is not None:
            parser.error(
                f"the {self.metavar} is given twice; give it once, as {self.metavar} or with "
                f"{', '.join(spellings_of('CKPT'))}"
            )
        setattr(namespace, self.dest, self.cast(values))


def add_checkpoint_argument(parser, help: str, type=str) -> None:
    """The positional checkpoint CKPT, also accepted as `--load-dir CKPT` (one of the two is required)."""
    parser.add_argument(
        "ckpt",
        nargs="?",
        metavar="CKPT",
        action=_Once,
        cast=type,
        default=argparse.SUPPRESS,
        help=f"{help} (or {' / '.join(spellings_of('CKPT'))} CKPT)",
    )
    parser.add_argument(
        *spellings_of("CKPT"),
        dest="ckpt",
        metavar="CKPT",
        action=_Once,
        cast=type,
        default=None,
        help=argparse.SUPPRESS,
    )
    parser.set_defaults(_post_checks=(*(parser.get_default("_post_checks") or ()), _need_checkpoint))


def _need_checkpoint(args) -> None:
    if getattr(args, "ckpt", None) is None:
        args._parser.error(f"the checkpoint is required: give CKPT (or {', '.join(spellings_of('CKPT'))} CKPT)")


class _Refuse(argparse.Action):
    """A spelling we accept but cannot honour yet: one sentence, exit 2."""

    def __init__(self, option_strings, dest, why: str = "", **kwargs):
        self.why = why
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is accepted but not supported yet: {self.why}")


def add_not_yet(parser, command: str) -> None:
    """The NOT_YET spellings that apply to `command`, in their own help section."""
    rows = [n for n in NOT_YET if command in n.commands]
    if not rows:
        return
    group = parser.add_argument_group("accepted from Megatron / MindSpeed-LLM converters, not supported yet")
    for n in rows:
        group.add_argument(
            *n.names,
            action=_Refuse,
            why=n.why,
            dest=argparse.SUPPRESS,
            metavar="VALUE",
            help=f"{n.origin.split(' (')[0]}: refused ({n.why.split(';')[0]})",
        )


def add_command(
    subparsers,
    name: str,
    func,
    *,
    help: str,
    description: str,
    checks: str | None = None,
    writes: str | None = None,
    json_output: bool = True,
) -> argparse.ArgumentParser:
    """A subcommand parser with the shared layout: our help formatter, no abbreviated options
    (`--target-e` must not silently mean one of several spellings), the exit codes in its help,
    and the shared options: `--json`, and `--force` for a command that `writes` an output."""
    p = subparsers.add_parser(
        name,
        help=help,
        description=description,
        epilog=exit_codes_text(checks),
        formatter_class=HelpFormatter,
        allow_abbrev=False,
    )
    shared = p.add_argument_group("output")
    if json_output:
        shared.add_argument(
            "--json", action="store_true", help="print one JSON object (bytes, fractions) instead of text; same numbers"
        )
    if writes:
        shared.add_argument(
            "--force",
            action="store_true",
            help=f"replace an existing {writes}: the new one is written completely first, "
            "then swapped in (a failed run leaves the old one as it was)",
        )
    p.set_defaults(func=func, _parser=p, _post_checks=())
    return p


def add_group(subparsers, name: str, *, help: str, description: str):
    """A command with subcommands of its own (`stats merge|show`); returns their subparsers."""
    p = subparsers.add_parser(
        name, help=help, description=description, formatter_class=HelpFormatter, allow_abbrev=False
    )
    p.set_defaults(_parser=p)
    return p.add_subparsers(dest=f"{name}_command", required=True, metavar="COMMAND")


def empty_argument(argv: list[str]) -> str | None:
    """The refusal of the first empty argument in `argv`, or None.

    An empty argument is never meant: it is an unset shell variable (`-o "$OUT"`), and as a path it
    would mean the current folder (`Path("")` is `.`), so `convert -o "" --force` would replace the
    folder the user stands in. No option of any command takes an empty value."""
    for i, value in enumerate(argv):
        if value == "":
            before = argv[i - 1] if i > 0 else ""
            name = before if before.startswith("-") and "=" not in before else "a positional argument"
        elif value.startswith("--") and value.endswith("=") and value.count("=") == 1:
            name = value[:-1]
        else:
            continue
        return (
            f"{name} is given an empty value (an unset shell variable?); an empty path would mean the "
            "current folder, so it is refused: give the value"
        )
    return None


def finish(args) -> None:
    """Checks that span several options (run by the entry point after parsing)."""
    for check in getattr(args, "_post_checks", ()):
        check(args)


def _finite(value):
    """JSON has no NaN or infinity: they become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def json_document(command: str, doc: dict) -> str:
    """The `--json` output of `command`: `{"format": "mcore-proxy-<command>/1", ...doc}`."""
    fmt = f"mcore-proxy-{command}/1"
    if doc.get("format", fmt) != fmt:  # a document's own "format" key would hide what the document is
        raise ValueError(f"the {command} document's 'format' is {doc['format']!r}, not {fmt!r}")
    return json.dumps(_finite({"format": fmt, **doc}), indent=2, allow_nan=False)


def emit(args, command: str, doc: dict, text: str) -> None:
    """Print the JSON document with `--json`, else the text."""
    print(json_document(command, doc) if getattr(args, "json", False) else text)
