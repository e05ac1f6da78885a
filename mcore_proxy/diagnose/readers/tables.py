"""JSONL and CSV metric files.

- JSONL (`*.jsonl`, or a `*.json` that is not a TRL trainer state): one JSON object per line,
  verl's FileLogger `{"step": N, "data": {"actor/kl_loss": ..}}` or flat `{"step": N, "key": value}`
  (`global_step`, `iteration`, `iter`, `_step` also name the step). A last line that does not parse
  is a line still being written, and is skipped.
- CSV (`*.csv`): a header with a step column (the same names); a last row without its newline is
  skipped for the same reason.
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

from mcore_proxy.diagnose.readers.common import (
    STEP_KEYS,
    complete_lines,
    finish,
    log,
    new_points,
    number,
)
from mcore_proxy.diagnose.series import RunLog
from mcore_proxy.core.errors import LogError


def read_jsonl(path: Path) -> RunLog:
    points = new_points()
    lines = path.read_text(errors="replace").splitlines()
    for index, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if index == len(lines):  # the last line of a log still being written
                log.warning("%s: line %d is incomplete; skipped", path, index)
                continue
            raise LogError(
                f"{path}: line {index} is not JSON ({err.msg}); each line must be one "
                'object such as {"step": 3, "data": {"actor/kl_loss": 0.01}}'
            ) from None
        if not isinstance(record, dict):
            continue
        step = next((record[k] for k in STEP_KEYS if k in record), None)
        data = record.get("data") if isinstance(record.get("data"), dict) else record
        if not isinstance(step, (int, float)) or isinstance(step, bool):
            step = next((data[k] for k in STEP_KEYS if isinstance(data.get(k), (int, float))), None)
        if step is None:
            raise LogError(
                f"{path}: line {index} has no step ({', '.join(STEP_KEYS)}); write "
                '{"step": N, "data": {...}} or {"step": N, "metric": value}'
            )
        for key, value in data.items():
            value = number(value)
            if key not in STEP_KEYS and value is not None:
                points[key].append((int(step), value))
    return finish(path, "jsonl", points, "no numeric field besides the step")


def read_csv(path: Path) -> RunLog:
    rows = list(csv.reader(io.StringIO("\n".join(complete_lines(path)))))
    if not rows:
        raise LogError(f"{path}: empty CSV file; pass a log with a header row and a step column")
    header = [h.strip() for h in rows[0]]
    lowered = [h.lower() for h in header]
    step_col = next((lowered.index(k) for k in STEP_KEYS if k in lowered), None)
    if step_col is None:
        raise LogError(f"{path}: no step column in the header {header[:6]}; name one of {', '.join(STEP_KEYS)}")
    points = new_points()
    for row in rows[1:]:
        if len(row) <= step_col:
            continue
        step = number(row[step_col])
        if step is None or not math.isfinite(step):
            continue
        for col, cell in enumerate(row[: len(header)]):
            value = number(cell) if col != step_col else None
            if value is not None:
                points[header[col]].append((int(step), value))
    return finish(path, "csv", points, "no numeric column besides the step")
