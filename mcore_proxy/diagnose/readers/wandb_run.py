"""Weights & Biases offline (or not yet synced) runs: `wandb/offline-run-<date>-<id>/run-<id>.wandb`.

The `.wandb` file is W&B's transaction log (protobuf records in LevelDB-log framing), a private
format whose Python reader was removed from the wandb package (wandb-core, in Go, reads it now). It
is read through wandb's own command line, `python -m wandb leet inspect --json FILE`, which prints
every record as one JSON line with no network (tested with wandb 0.31); the `history` records hold
`{"item": {key: value, "_step": N, ...}, "step": {"num": N}}`. Keys starting with `_` (`_step`,
`_runtime`, `_timestamp`) are W&B's own and skipped; nested dicts are flattened with `.` as W&B
shows them. NaN and infinities, printed as the strings "NaN", "Infinity", "-Infinity", are kept; a
step out of 0..10^15 is refused naming the record.

Accepted paths: the `.wandb` file, its run folder, or a `wandb/` folder holding exactly one run
(with several, the reader refuses and lists them; `wandb/latest-run` names the newest).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from mcore_proxy.core.optional import MissingDependency, available, missing_message
from mcore_proxy.diagnose.readers.common import as_step, finish, listed, new_points, number
from mcore_proxy.diagnose.series import RunLog
from mcore_proxy.core.errors import LogError

EXPORT = "or sync it (wandb sync) and export its history to CSV"
# how `leet inspect` prints a NaN or an infinity (JSON has no such number); other strings are text
NONFINITE_TEXT = ("NaN", "Infinity", "-Infinity")
TIMEOUT = 120


def run_file(folder: Path) -> Path | None:
    files = sorted(folder.glob("run-*.wandb"))
    return files[-1] if files else None


def run_folders(folder: Path) -> list[Path]:
    return sorted(
        p
        for p in folder.iterdir()
        if p.is_dir() and not p.is_symlink() and p.name.startswith(("offline-run-", "run-")) and run_file(p) is not None
    )


def is_wandb(folder: Path) -> bool:
    return run_file(folder) is not None or bool(run_folders(folder))


def _flatten(item: dict):
    """(key, value) of a history item, nested dicts joined with `.`; a loop, not recursion, so that
    no nesting depth in the record can exhaust the stack."""
    stack = [("", item)]
    while stack:
        prefix, current = stack.pop()
        for key, value in current.items():
            if isinstance(value, dict):
                stack.append((f"{prefix}{key}.", value))
            else:
                yield f"{prefix}{key}", value


def read_wandb(path: Path) -> RunLog:
    if path.is_dir():
        file = run_file(path)
        if file is None:
            found = run_folders(path)
            if len(found) > 1:
                raise LogError(
                    f"{path}: a W&B folder with {len(found)} runs ({listed([p.name for p in found])}); pass one run's "
                    f"folder, e.g. {path / 'latest-run'}"
                )
            file = run_file(found[0])
    else:
        file = path
    if not available("wandb"):
        raise MissingDependency(f"{missing_message(['wandb'], f'{file}: reading a W&B run')} ({EXPORT})", ("wandb",))
    try:
        done = subprocess.run(
            [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(file)],
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        raise LogError(f"{file}: wandb could not read it ({err}); {EXPORT}") from None
    if done.returncode != 0 and not done.stdout.strip():
        why = " ".join((done.stderr.strip().splitlines() or ["no message"])[-1].split())
        raise LogError(
            f"{file}: `wandb leet inspect` failed ({why}); it needs wandb >= 0.31 (pip install -U wandb), {EXPORT}"
        )
    points = new_points()
    for index, line in enumerate(done.stdout.splitlines(), 1):
        history = _history(line)
        if history is None:
            continue
        item = history["item"]
        step = history.get("step")
        step = step.get("num", item.get("_step")) if isinstance(step, dict) else item.get("_step")
        step = number(step) if step is not None else None
        if step is None:
            continue
        step = as_step(step, f"{file}: record {index} of `wandb leet inspect`")
        for key, value in _flatten(item):
            value = number(value) if not isinstance(value, str) or value in NONFINITE_TEXT else None
            if not key.startswith("_") and value is not None:
                points[key].append((step, value))
    return finish(file, "wandb", points, "no history record with a number")


def _history(line: str) -> dict | None:
    """The `history` record of one line that `wandb leet inspect --json` printed, None for others."""
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):  # not JSON (a message), or absurd: not a history record
        return None
    history = record.get("history") if isinstance(record, dict) else None
    if not isinstance(history, dict) or not isinstance(history.get("item"), dict):
        return None
    return history
