"""JSONL and CSV metric files.

- JSONL (`*.jsonl`, or a `*.json` that is not a TRL trainer state): one JSON object per line,
  verl's FileLogger `{"step": N, "data": {"actor/kl_loss": ..}}` or flat `{"step": N, "key": value}`
  (`global_step`, `iteration`, `iter`, `_step` also name the step). A last line that does not parse
  is a line still being written, and is skipped.
- CSV (`*.csv`): a header with a step column (the same names); a last row without its newline is
  skipped for the same reason, and so is a row whose step cell is empty or text (a missing value,
  a header repeated by concatenated files).

Values may be NaN or infinite (`NaN`, `Infinity`, `-Infinity` in JSON; `nan`, `inf` in CSV): they
are kept as such (`Series`). A step must be a whole number from 0 to 10^15, else the file and line
are named; so is a line nested too deep to parse.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from mcore_proxy.diagnose.readers.common import (
    STEP_KEYS,
    BadRecord,
    as_step,
    complete_lines,
    finish,
    log,
    new_points,
    number,
)
from mcore_proxy.diagnose.series import RunLog
from mcore_proxy.core.errors import LogError


JSONL_SHAPE = 'each line must be one object such as {"step": 3, "data": {"actor/kl_loss": 0.01}}'


def read_jsonl(path: Path) -> RunLog:
    points = new_points()
    lines = path.read_text(errors="replace").splitlines()
    for index, line in enumerate(lines, 1):
        if not line.strip():
            continue
        record = _json_line(path, line, index, last=index == len(lines))
        if not isinstance(record, dict):
            continue
        step, data = _step_and_data(record, f"{path}: line {index}")
        for key, value in data.items():
            value = number(value)
            if key not in STEP_KEYS and value is not None:
                points[key].append((step, value))
    return finish(path, "jsonl", points, "no numeric field besides the step")


def _json_line(path: Path, line: str, index: int, last: bool):
    """The JSON value of one line; None for an incomplete last line (a log still being written);
    BadRecord for a line that is not JSON, nested past what the parser can follow, or holding an
    integer of thousands of digits (Python refuses to convert it)."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as err:
        if last:
            log.warning("%s: line %d is incomplete; skipped", path, index)
            return None
        raise BadRecord(f"{path}: line {index} is not JSON ({err.msg}); {JSONL_SHAPE}") from None
    except RecursionError:
        raise BadRecord(
            f"{path}: line {index} is JSON nested too deep to read (a metric record nests two levels); {JSONL_SHAPE}"
        ) from None
    except ValueError:  # json's limit on integer literals (4300 digits): JSONDecodeError is caught above
        raise BadRecord(
            f"{path}: line {index} holds a number of thousands of digits, which no metric log has; {JSONL_SHAPE}"
        ) from None


def _step_and_data(record: dict, where: str) -> tuple[int, dict]:
    """The step of one JSONL record (a STEP_KEYS key of the record, else of its `data`) and the dict
    holding its metrics (`data` in verl's shape, else the record); BadRecord naming `where`."""
    step = next((record[k] for k in STEP_KEYS if k in record), None)
    data = record.get("data") if isinstance(record.get("data"), dict) else record
    if not isinstance(step, (int, float)) or isinstance(step, bool):
        step = next((data[k] for k in STEP_KEYS if isinstance(data.get(k), (int, float))), None)
    if step is None:
        raise BadRecord(
            f"{where} has no step ({', '.join(STEP_KEYS)}); write "
            '{"step": N, "data": {...}} or {"step": N, "metric": value}'
        )
    return as_step(step, where), data


def read_csv(path: Path) -> RunLog:
    reader = csv.reader(io.StringIO("\n".join(complete_lines(path))))
    header = [h.strip() for h in next(reader, [])]
    if not header:
        raise LogError(f"{path}: empty CSV file; pass a log with a header row and a step column")
    lowered = [h.lower() for h in header]
    step_col = next((lowered.index(k) for k in STEP_KEYS if k in lowered), None)
    if step_col is None:
        raise LogError(f"{path}: no step column in the header {header[:6]}; name one of {', '.join(STEP_KEYS)}")
    points = new_points()
    for row in reader:
        step = number(row[step_col]) if len(row) > step_col else None
        if step is None:  # an empty step cell (pandas' missing value), a header repeated by `cat`
            continue
        step = as_step(step, f"{path}: line {reader.line_num}")
        for col, cell in enumerate(row[: len(header)]):
            value = number(cell) if col != step_col else None
            if value is not None:
                points[header[col]].append((step, value))
    return finish(path, "csv", points, "no numeric column besides the step")
