"""Console logs (stdout/stderr captured to a file), as they come: mixed with progress bars (tqdm's
`\\r` updates), Ray's `(Actor pid=N)` prefixes, ANSI colours, warnings and other output. Every line
is split at `\\r` and each piece is tried by three parsers; the log's kind is the one that finds the
most records (ties: Megatron/MindSpeed-RL, then verl, then TRL).

- Megatron (`training.py`):
  ` [date] iteration        5/     100 | consumed samples: ... | lm loss: 2.3E+00 | grad norm: 0.81 |`
  and MindSpeed-RL (`[date] iteration: 5 / 100 | grpo/score/mean : 0.5000 | actor/kl_loss : 0.0012`):
  the step is the iteration; values that are not numbers (`elapsed time: 0:01:02`) are skipped.
- verl (`verl.utils.tracking.Tracking` with the `console` backend: `LocalLogger` prints
  `concat_dict_to_str(data, step)`, i.e. `step:N - key:pformat(value) - ...` for every value that
  is a `numbers.Number`): `step:3 - actor/kl_loss:0.001 - critic/score/mean:np.float64(0.25)`.
  numpy 2 scalars print as `np.float64(x)`, `np.int64(n)`, which are read too. The record may start
  anywhere in a line (after a Ray prefix, a timestamp, or a progress bar it was glued to). A record
  broken over several lines (a terminal, or a log collector that cuts long lines) is joined: the
  lines after it that hold nothing but `key:value` pieces separated by ` - ` (or the rest of a cut
  key or number) continue it; a Ray prefix before such a piece is ignored.
- TRL / transformers (`ProgressCallback.on_log` writes `str(logs)` through tqdm):
  `{'loss': 0.01, 'grad_norm': 0.5, 'learning_rate': 1e-06, 'reward': 0.25, 'kl': 0.001, 'epoch': 0.5}`
  (transformers >= 5 formats floats as strings: `{'loss': '0.01', ...}`; both are read). These
  lines carry no step: the n-th training line is step n (the global step when `logging_steps=1`,
  else n x logging_steps), unless the dict has `step` or `global_step`, which wins. A line of
  evaluation metrics only (`eval_*`) belongs to the last training line's step; the closing summary
  (`train_runtime`, `train_loss`, ...) is skipped.

The last line of a file still being written (no newline yet) is skipped. Values may be `nan` or
`inf` (kept as such by `Series`); a step that is not a whole number from 0 to 10^15 is refused,
naming the line.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from mcore_proxy.diagnose.readers.common import (
    complete_lines,
    finish,
    new_points,
    number,
    step_error,
    step_problem,
    strip_ansi,
)
from mcore_proxy.diagnose.series import RunLog

# -- Megatron and MindSpeed-RL ----------------------------------------------------------------------

CONSOLE_LINE = re.compile(r"iteration\s*:?\s*(\d+)\s*/\s*(\d+)\s*\|(.*)$")

# The first record of a parse whose step is not a step: (line number, why), or None. A console log
# that holds one is refused by `read_console` naming the line, if its kind is the log's kind.
BadStep = tuple[int, str] | None


def _console_fields(line: str) -> tuple[str, dict[str, float]] | None:
    """One Megatron or MindSpeed-RL metric line -> (iteration as its digits, {key: value})."""
    match = CONSOLE_LINE.search(line)
    if match is None:
        return None
    values = {}
    for field in match.group(3).split("|"):
        key, sep, text = field.partition(":")
        value = number(text) if sep else None
        if value is not None and key.strip():
            values[key.strip()] = value
    return match.group(1), values


def parse_console_line(line: str) -> tuple[int, dict[str, float]] | None:
    """One Megatron or MindSpeed-RL metric line -> (iteration, {key: value}); None otherwise, or
    when the iteration is not a step (`step_problem`)."""
    fields = _console_fields(line)
    if fields is None or step_problem(fields[0]) is not None:
        return None
    return int(fields[0]), fields[1]


def parse_megatron(lines: list[str]) -> tuple[dict, int, BadStep]:
    points, records, bad = new_points(), 0, None
    for index, line in enumerate(lines, 1):
        for piece in line.split("\r"):
            fields = _console_fields(piece)
            if fields is None or not fields[1]:
                continue
            records += 1
            problem = step_problem(fields[0])
            if problem is not None:
                bad = bad or (index, problem)
                continue
            for key, value in fields[1].items():
                points[key].append((int(fields[0]), value))
    return points, records, bad


# -- verl -----------------------------------------------------------------------------------------

VERL_START = re.compile(r"(?<![\w/.\-])step:(\d+)(?=\s+-\s|\s*$)")
VERL_SEP = re.compile(r"\s+-\s+")
RAY_PREFIX = re.compile(r"^\s*\([\w.\-]+(?: [\w.\-]+)? pid=\d+(?:, ip=[\w.:\-]+)?\)\s?")
RAY_REPEATED = re.compile(r"\s*\[repeated \d+x across cluster\]")
NUMPY_SCALAR = re.compile(
    r"(?:np|numpy)\.(?:float|int|uint|longdouble|double|single|half|longlong)\w*"
    r"\(\s*([^()]*?)\s*\)"
)
CONTINUATION = re.compile(r"(?:-\s+)?[^\s]+(?:\s+-\s+[^\s]+)*(?:\s+-)?")


def verl_value(text: str) -> float | None:
    """A value as `pprint.pformat` prints a number: 0.25, 1e-06, nan, True, np.float64(0.25)."""
    text = text.strip()
    match = NUMPY_SCALAR.fullmatch(text)
    if match is not None:
        text = match.group(1)
    elif text in ("np.True_", "numpy.True_"):
        return 1.0
    elif text in ("np.False_", "numpy.False_"):
        return 0.0
    if text in ("True", "False"):
        return float(text == "True")
    try:
        return float(text)
    except ValueError:
        return None


def verl_pair(piece: str) -> tuple[str, float] | None:
    key, sep, text = piece.strip().rpartition(":")
    if not sep or not key.strip():
        return None
    value = verl_value(text)
    return None if value is None else (key.strip(), value)


def _join(record: str, cont: str) -> str:
    """A verl record and the next piece of it on the following line."""
    head, cont = record.rstrip(), cont.strip()
    if cont.startswith("- "):  # cut just before a separator
        return head + " " + cont
    if head.endswith(" -"):  # cut just after one
        return head + " " + cont
    pieces, first = VERL_SEP.split(head), VERL_SEP.split(cont)[0]
    if verl_pair(pieces[-1]) is not None and verl_pair(first) is not None:
        return head + " - " + cont  # cut at a separator whose spaces were dropped
    return head + cont  # cut inside a key or a number


def _continues(record: str, line: str) -> str | None:
    """The part of `line` that continues the verl record `record`, or None."""
    text = RAY_REPEATED.sub("", RAY_PREFIX.sub("", line)).strip()
    if not text or VERL_START.search(text) or CONTINUATION.fullmatch(text) is None:
        return None
    if ":" not in text and " - " not in text:  # a lone fragment: only the rest of a cut value
        if verl_pair(VERL_SEP.split(_join(record, text))[-1]) is None:
            return None
    return text


def parse_verl(lines: list[str]) -> tuple[dict, int, BadStep]:
    points, records, bad = new_points(), 0, None
    record, step, start = None, "", 0  # the open record, its step's digits, its first line

    def flush():
        nonlocal records, bad
        if record is None:
            return
        pairs = [verl_pair(p) for p in VERL_SEP.split(RAY_REPEATED.sub("", record)) if p.strip()]
        pairs = [p for p in pairs if p is not None]
        if not pairs:
            return
        records += 1
        problem = step_problem(step)
        if problem is not None:
            bad = bad or (start, problem)
            return
        for key, value in pairs:
            points[key].append((int(step), value))

    for index, raw in enumerate(lines, 1):
        line = strip_ansi(raw)
        if record is not None:
            cont = _continues(record, line.split("\r")[-1])
            if cont is not None:
                record = _join(record, cont)
                continue
            flush()
            record = None
        for piece in line.split("\r"):
            match = VERL_START.search(piece)
            if match is not None:
                flush()
                record, step, start = piece[match.end() :], match.group(1), index
        # a record ends at the end of its line unless the next line continues it
    flush()
    return points, records, bad


# -- TRL / transformers ---------------------------------------------------------------------------

TRL_DICT = re.compile(r"\{'[^']+': .*\}")
BARE_FLOAT = re.compile(r"(?<=: )(-?inf|nan)(?=[,}])")
SUMMARY_KEYS = ("train_runtime", "train_samples_per_second", "train_steps_per_second")


def _trl_dict(piece: str) -> dict | None:
    match = TRL_DICT.search(piece)
    if match is None:
        return None
    try:
        logs = ast.literal_eval(BARE_FLOAT.sub(r"'\1'", match.group(0)))
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None
    return logs if isinstance(logs, dict) else None


def parse_trl(lines: list[str]) -> tuple[dict, int, BadStep]:
    points, records, step, bad = new_points(), 0, 0, None
    for index, raw in enumerate(lines, 1):
        for piece in strip_ansi(raw).split("\r"):
            logs = _trl_dict(piece)
            if logs is None or any(k in logs for k in SUMMARY_KEYS):
                continue
            values = {str(k): number(v) for k, v in logs.items()}
            values = {k: v for k, v in values.items() if v is not None}
            if not values:
                continue
            records += 1
            explicit = next((values[k] for k in ("step", "global_step") if k in values), None)
            problem = None if explicit is None else step_problem(explicit)
            if problem is not None:
                bad = bad or (index, problem)
                continue
            evaluation = all(k.startswith(("eval_", "test_")) or k == "epoch" for k in values)
            if explicit is not None:
                step = int(explicit)
            elif not evaluation:
                step += 1
            for key, value in values.items():
                if key not in ("step", "global_step"):
                    points[key].append((step, value))
    return points, records, bad


# -- the log --------------------------------------------------------------------------------------

KINDS = (("console", parse_megatron), ("verl-console", parse_verl), ("trl-console", parse_trl))


def read_console(path: Path) -> RunLog:
    lines = complete_lines(path)
    best = ("console", new_points(), 0, None)
    for kind, parse in KINDS:
        points, records, bad = parse(lines)
        if records > best[2]:
            best = (kind, points, records, bad)
    kind, points, _, bad = best
    if bad is not None:
        raise step_error(f"{path}: line {bad[0]}", bad[1])
    return finish(
        path,
        kind,
        points,
        "no metric line of Megatron or MindSpeed-RL ('iteration i / N | key: value |'), "
        "verl ('step:N - key:value - ...') or TRL ({'loss': ..., 'reward': ...})",
    )
