"""What the readers share: numbers from log text, complete lines of a growing file, the RunLog."""

from __future__ import annotations

import logging
import math
import re
from collections import defaultdict
from pathlib import Path

from mcore_proxy.diagnose.series import RunLog, Series
from mcore_proxy.core.errors import LogError

log = logging.getLogger("mcore_proxy.diagnose.readers")

STEP_KEYS = ("step", "global_step", "iteration", "iter", "_step")
FORMATS_HINT = (
    "pass a TensorBoard folder, a JSONL/CSV file, a console log of Megatron, MindSpeed-RL, "
    "verl or TRL, a TRL trainer_state.json, an MLflow run folder, or a W&B/SwanLab offline run"
)
ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")

Points = dict  # raw metric name -> [(step, value), ...]


class BadRecord(LogError):
    """A complete record of a log is wrong (its step is not a step, it is nested too deep, it is not
    JSON): reading the log again will not mend it, so `watch` stops on it instead of waiting."""


def new_points() -> dict:
    return defaultdict(list)


def number(value) -> float | None:
    """A number from a JSON/CSV/log value: int, float, bool or numeric text; None otherwise. NaN
    and infinities are numbers here (the series keeps them apart from its curve); an integer too
    large for a float (a JSON literal beyond 1.8e308) is an infinity of its sign."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int):
        try:
            return float(value)
        except OverflowError:
            return math.inf if value > 0 else -math.inf
    if isinstance(value, float):
        return value
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            return None
    return None


MAX_STEP = 10**15  # beyond any run's steps (even counted in tokens); exact in float64 and int64


def step_problem(value) -> str | None:
    """Why `value` is not a step, or None when it is one. `value` is a number read as a step, or
    the digits a console line gives as one. A step is a whole number from 0 to MAX_STEP: 3.0
    counts; NaN, 2.5, -1 and 1e30 do not."""
    if isinstance(value, str) and value.isdecimal():  # a console's digits: no int() of a 5000-digit run
        digits = value.lstrip("0") or "0"
        if len(digits) > len(str(MAX_STEP)):
            return f"step {digits[0]}.{digits[1:3]}e+{len(digits) - 1} is outside 0..10^15"
        value = int(digits)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"step {value!r} is not a number"
    if isinstance(value, float) and not math.isfinite(value):
        return f"step {value} is not finite"
    if isinstance(value, float) and not value.is_integer():
        return f"step {value!r} is not a whole number"
    if not 0 <= value <= MAX_STEP:
        return f"step {_shown(value)} is outside 0..10^15"
    return None


def _shown(value: int | float) -> str:
    """A step out of range, short: -3, 1.00e+30 (ints of any size, without float overflow)."""
    if isinstance(value, float):
        return f"{value:.3g}"
    digits = str(abs(value))
    sign = "-" if value < 0 else ""
    return sign + (digits if len(digits) <= 16 else f"{digits[0]}.{digits[1:3]}e+{len(digits) - 1}")


def as_step(value, where: str) -> int:
    """`value` as a step (see `step_problem`); LogError naming `where` (the file and the line) otherwise."""
    problem = step_problem(value)
    if problem is not None:
        raise step_error(where, problem)
    return int(value)


def step_error(where: str, problem: str) -> BadRecord:
    return BadRecord(f"{where}: {problem}; a step must be a whole number from 0 to 10^15 (the training step)")


def finish(path: Path, fmt: str, points: dict, what: str) -> RunLog:
    """The RunLog of `points` (raw name -> [(step, value)]); LogError when no metric has a value.
    A metric whose values are all NaN or infinite is kept: watch alerts on it, compare refuses a
    log of nothing else (`compare.require_finite`)."""
    metrics = {name: Series.from_points(p) for name, p in points.items()}
    metrics = {name: s for name, s in metrics.items() if s.logged}
    if not metrics:
        raise LogError(f"{path}: no numeric metric found ({what}); {FORMATS_HINT}")
    return RunLog(str(path), fmt, metrics)


def complete_lines(path: Path) -> list[str]:
    """The lines of a text log, without the last one when it has no newline yet: a log that is
    still being written may end in half a line, whose last number would be cut short."""
    text = path.read_text(errors="replace")
    lines = text.split("\n")
    tail = lines.pop()  # "" when the file ends with a newline
    if tail.strip():
        log.info("%s: the last line has no newline yet (still being written?); skipped", path)
    return lines


def head_bytes(path: Path, size: int = 4096) -> bytes:
    with path.open("rb") as f:
        return f.read(size)


def strip_ansi(text: str) -> str:
    return ANSI.sub("", text) if "\x1b" in text else text


LISTED = 8


def listed(names: list[str]) -> str:
    """The first `LISTED` names, and how many more: for a refusal of a folder that holds several runs."""
    more = f" and {len(names) - LISTED} more" if len(names) > LISTED else ""
    return ", ".join(names[:LISTED]) + more
