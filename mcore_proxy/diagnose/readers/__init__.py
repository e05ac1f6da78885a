"""Readers of training-metric logs, one per format; `read_log(path) -> RunLog` is the one entry point
and picks the reader from the path (docs/logs.md has the table):

- a folder:
  - MLflow file store, experiment or run (`meta.yaml` with `experiment_id` / `run_id`, `metrics/`):
    `mlflow_store`;
  - W&B run folder (`run-*.wandb`) or a `wandb/` folder of runs: `wandb_run`;
  - SwanLab run folder (`run-*.swanlab`) or a `swanlog/` folder of runs: `swanlab_run`;
  - TensorBoard event files anywhere below (`events.out.tfevents.*`): `tensorboard`;
  - TRL / transformers output or checkpoint folder (`trainer_state.json`, `checkpoint-N/`): `trl`;
  (a TRL output folder that also has TensorBoard events is read from the events: they are written at
  every logging step, the trainer state only at checkpoints);
- a file, by name: `*tfevents*` (TensorBoard), `trainer_state.json` or a `.json` holding a
  `log_history` (TRL), `.jsonl`/`.json` (JSONL), `.csv`, `.wandb`, `.swanlab`, an SQLite file
  (MLflow database);
- any other file is a console log, whose kind is found by content (`console`): Megatron,
  MindSpeed-RL, verl or TRL/transformers metric lines among everything else.

Wrong or unreadable input raises `LogError`: one sentence naming the file and the fix. Readers hold
no state between calls, so re-reading a growing log gives its new points; the last line (record)
of a file still being written is skipped until it is complete.
"""

from __future__ import annotations

import json
from pathlib import Path

from mcore_proxy.diagnose.readers.common import FORMATS_HINT, STEP_KEYS, head_bytes
from mcore_proxy.diagnose.readers.console import parse_console_line, read_console
from mcore_proxy.diagnose.readers.mlflow_store import (
    is_mlflow,
    is_sqlite,
    read_mlflow,
    read_mlflow_sqlite,
)
from mcore_proxy.diagnose.readers.swanlab_run import is_swanlab, read_swanlab
from mcore_proxy.diagnose.readers.tables import read_csv, read_jsonl
from mcore_proxy.diagnose.readers.tensorboard import (
    TB_PATTERN,
    event_files,
    read_tensorboard,
)
from mcore_proxy.diagnose.readers.trl import STATE, is_trl_folder, read_trainer_state
from mcore_proxy.diagnose.readers.wandb_run import is_wandb, read_wandb
from mcore_proxy.diagnose.series import RunLog
from mcore_proxy.core.errors import LogError

__all__ = [
    "STEP_KEYS",
    "TB_PATTERN",
    "detect_format",
    "parse_console_line",
    "read_console",
    "read_csv",
    "read_jsonl",
    "read_log",
    "read_mlflow",
    "read_mlflow_sqlite",
    "read_swanlab",
    "read_tensorboard",
    "read_trainer_state",
    "read_wandb",
]


def _trl_json(path: Path) -> bool:
    """Whether a .json file is a Trainer state (one pretty-printed object with a log_history)."""
    head = head_bytes(path, 65536).decode("utf-8", "replace")
    if '"log_history"' in head:
        return True
    if path.name == STATE:
        return True
    try:  # a small file whose log_history comes late
        return path.stat().st_size < 65536 and isinstance(json.loads(head), dict) and "log_history" in json.loads(head)
    except (ValueError, OSError, RecursionError):  # not JSON, or absurd: read as JSONL, which says why
        return False


def detect_format(path: Path) -> str:
    """The reader `read_log` uses for `path` (an existing file or folder)."""
    if path.is_dir():
        if is_mlflow(path):
            return "mlflow"
        if is_wandb(path):
            return "wandb"
        if is_swanlab(path):
            return "swanlab"
        if is_trl_folder(path) and not event_files(path):
            return "trl-state"
        return "tensorboard"
    name = path.name
    if "tfevents" in name:
        return "tensorboard"
    if path.suffix == ".wandb":
        return "wandb"
    if path.suffix == ".swanlab":
        return "swanlab"
    if path.suffix == ".json" and _trl_json(path):
        return "trl-state"
    if path.suffix in (".jsonl", ".json"):
        return "jsonl"
    if path.suffix == ".csv":
        return "csv"
    if is_sqlite(path):
        return "mlflow-sqlite"
    if b"\x00" in head_bytes(path):
        return "binary"
    return "console"


READERS = {
    "mlflow": read_mlflow,
    "wandb": read_wandb,
    "swanlab": read_swanlab,
    "trl-state": read_trainer_state,
    "tensorboard": read_tensorboard,
    "jsonl": read_jsonl,
    "csv": read_csv,
    "mlflow-sqlite": read_mlflow_sqlite,
    "console": read_console,
}


def read_log(path) -> RunLog:
    """Read a run's metric log (see the module docstring and docs/logs.md for the formats)."""
    path = Path(path)
    if not path.exists():
        raise LogError(f"{path}: no such file or folder; {FORMATS_HINT}")
    try:
        fmt = detect_format(path)
        if fmt == "binary":
            raise LogError(f"{path}: a binary file of no known log format; {FORMATS_HINT}")
        return READERS[fmt](path)
    except RecursionError:  # a reader's parser following absurd nesting (JSONL and TRL say which line)
        raise LogError(f"{path}: nested too deep to read, which no metric log is; {FORMATS_HINT}") from None
    except (OSError, UnicodeError) as err:
        raise LogError(
            f"{path}: cannot be read ({err.strerror if isinstance(err, OSError) else err}); "
            "check the path and its permissions"
        ) from None
