"""What the readers share: numbers from log text, complete lines of a growing file, the RunLog."""

from __future__ import annotations

import logging
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


def new_points() -> dict:
    return defaultdict(list)


def number(value) -> float | None:
    """A number from a JSON/CSV/log value: int, float, bool or numeric text; None otherwise."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            return None
    return None


def finish(path: Path, fmt: str, points: dict, what: str) -> RunLog:
    metrics = {name: Series.from_points(p) for name, p in points.items()}
    metrics = {name: s for name, s in metrics.items() if len(s)}
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
