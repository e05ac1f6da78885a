"""Readers of training-metric logs: TensorBoard event files, JSONL, CSV and console logs.

`read_log(path) -> RunLog` picks the reader from the path:

- a folder, or a file whose name contains `tfevents`: TensorBoard event files (every
  `events.out.tfevents.*` under the folder, in name order, so a restarted run's later file wins on
  a step logged twice), read with the `tensorboard` package's event-file loader (scalars written as
  `simple_value` or as scalar tensors);
- `*.jsonl` / `*.json`: one JSON object per line, verl's `{"step": N, "data": {"actor/kl_loss": ..}}`
  or flat `{"step": N, "key": value, ...}` (`global_step`, `iteration`, `_step` also name the step);
- `*.csv`: a header with a step column (`step`, `global_step`, `iteration`, `iter`, `_step`);
- anything else: a console log, whose metric lines are Megatron's (`training.py`:
  ` [date] iteration        5/     100 | consumed samples: ... | lm loss: 2.3E+00 | grad norm: 0.81 |`)
  or MindSpeed-RL's (`[date] iteration: 5 / 100 | grpo/score/mean : 0.5000 | actor/kl_loss : 0.0012`);
  other lines are ignored.

Values that are not numbers (elapsed time `0:01:02`, memory strings) are skipped; a line that is
cut off at the end of a file still being written is skipped too. Re-reading a growing log gives its
new points (these readers hold no state between calls).
"""
from __future__ import annotations

import csv
import json
import logging
import math
import re
from collections import defaultdict
from pathlib import Path

from mcore_proxy.diagnose.series import RunLog, Series
from mcore_proxy.errors import LogError

log = logging.getLogger(__name__)

STEP_KEYS = ("step", "global_step", "iteration", "iter", "_step")
CONSOLE_LINE = re.compile(r"iteration\s*:?\s*(\d+)\s*/\s*(\d+)\s*\|(.*)$")
TB_PATTERN = "events.out.tfevents.*"


def _number(value) -> float | None:
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


def _finish(path: Path, fmt: str, points: dict, what: str) -> RunLog:
    metrics = {name: Series.from_points(p) for name, p in points.items()}
    metrics = {name: s for name, s in metrics.items() if len(s)}
    if not metrics:
        raise LogError(f"{path}: no numeric metric found ({what}); pass a TensorBoard folder, a "
                       "JSONL/CSV file or a Megatron/MindSpeed-RL console log")
    return RunLog(str(path), fmt, metrics)


def read_tensorboard(path: Path) -> RunLog:
    files = sorted(path.rglob(TB_PATTERN)) if path.is_dir() else [path]
    if not files:
        raise LogError(f"{path}: folder holds no TensorBoard event file ({TB_PATTERN}); pass the "
                       "folder the run's SummaryWriter wrote, or a JSONL/CSV/console log")
    logging.getLogger("tensorboard").setLevel(logging.ERROR)
    try:
        from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
        from tensorboard.util import tensor_util
    except ImportError:
        raise LogError(f"{path}: reading TensorBoard logs needs the tensorboard package: "
                       "pip install 'mcore-proxy[diagnose]'") from None
    points: dict[str, list] = defaultdict(list)
    for file in files:
        try:
            for event in EventFileLoader(str(file)).Load():
                for value in event.summary.value:
                    array = tensor_util.make_ndarray(value.tensor) if value.HasField("tensor") else None
                    if array is not None and array.size == 1 and array.dtype.kind in "fiub":
                        points[value.tag].append((event.step, float(array.reshape(-1)[0])))
        except Exception as err:  # the loader raises protobuf/IO errors of many kinds on bad files
            raise LogError(f"{file}: not a readable TensorBoard event file ({type(err).__name__}: "
                           f"{err}); pass the folder a SummaryWriter wrote") from None
    return _finish(path, "tensorboard", points, f"{len(files)} event file(s) without scalars")


def read_jsonl(path: Path) -> RunLog:
    points: dict[str, list] = defaultdict(list)
    lines = path.read_text(errors="replace").splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if number == len(lines):     # the last line of a log still being written
                log.warning("%s: line %d is incomplete; skipped", path, number)
                continue
            raise LogError(f"{path}: line {number} is not JSON ({err.msg}); each line must be one "
                           'object such as {"step": 3, "data": {"actor/kl_loss": 0.01}}') from None
        if not isinstance(record, dict):
            continue
        step = next((record[k] for k in STEP_KEYS if k in record), None)
        data = record.get("data") if isinstance(record.get("data"), dict) else record
        if not isinstance(step, (int, float)) or isinstance(step, bool):
            step = next((data[k] for k in STEP_KEYS if isinstance(data.get(k), (int, float))), None)
        if step is None:
            raise LogError(f"{path}: line {number} has no step ({', '.join(STEP_KEYS)}); write "
                           '{"step": N, "data": {...}} or {"step": N, "metric": value}')
        for key, value in data.items():
            number_value = _number(value)
            if key not in STEP_KEYS and number_value is not None:
                points[key].append((int(step), number_value))
    return _finish(path, "jsonl", points, "no numeric field besides the step")


def read_csv(path: Path) -> RunLog:
    with path.open(newline="", errors="replace") as f:
        rows = list(csv.reader(f))
    if not rows:
        raise LogError(f"{path}: empty CSV file; pass a log with a header row and a step column")
    header = [h.strip() for h in rows[0]]
    lowered = [h.lower() for h in header]
    step_col = next((lowered.index(k) for k in STEP_KEYS if k in lowered), None)
    if step_col is None:
        raise LogError(f"{path}: no step column in the header {header[:6]}; name one of "
                       f"{', '.join(STEP_KEYS)}")
    points: dict[str, list] = defaultdict(list)
    for row in rows[1:]:
        if len(row) <= step_col:
            continue
        step = _number(row[step_col])
        if step is None or not math.isfinite(step):
            continue
        for col, cell in enumerate(row[:len(header)]):
            value = _number(cell) if col != step_col else None
            if value is not None:
                points[header[col]].append((int(step), value))
    return _finish(path, "csv", points, "no numeric column besides the step")


def parse_console_line(line: str) -> tuple[int, dict[str, float]] | None:
    """One Megatron or MindSpeed-RL metric line -> (iteration, {key: value}); None otherwise."""
    match = CONSOLE_LINE.search(line)
    if match is None:
        return None
    values = {}
    for field in match.group(3).split("|"):
        key, sep, text = field.partition(":")
        value = _number(text) if sep else None
        if value is not None and key.strip():
            values[key.strip()] = value
    return int(match.group(1)), values


def read_console(path: Path) -> RunLog:
    points: dict[str, list] = defaultdict(list)
    with path.open(errors="replace") as f:
        for line in f:
            parsed = parse_console_line(line)
            if parsed is not None:
                step, values = parsed
                for key, value in values.items():
                    points[key].append((step, value))
    return _finish(path, "console", points, "no line 'iteration i / N | key : value |' of "
                   "Megatron or MindSpeed-RL")


def read_log(path) -> RunLog:
    """Read a run's metric log (see the module docstring for the formats)."""
    path = Path(path)
    if not path.exists():
        raise LogError(f"{path}: no such file or folder; pass the run's TensorBoard folder or its "
                       "JSONL, CSV or console log")
    if path.is_dir() or "tfevents" in path.name:
        return read_tensorboard(path)
    try:
        if path.suffix in (".jsonl", ".json"):
            return read_jsonl(path)
        if path.suffix == ".csv":
            return read_csv(path)
        return read_console(path)
    except (OSError, UnicodeError) as err:
        raise LogError(f"{path}: cannot be read ({err.strerror if isinstance(err, OSError) else err}); "
                       "check the path and its permissions") from None
