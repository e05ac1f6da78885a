"""TRL / transformers `trainer_state.json`: the Trainer's `log_history`, a list of the dicts it
logged, each with the `step` (global step) it was logged at: training entries (`loss`,
`grad_norm`, `learning_rate`, `epoch`, and TRL's `reward`, `reward_std`, `kl`, `entropy`,
`completions/mean_length`, `rewards/<func>/mean`, `clip_ratio/region_mean`, ...), evaluation entries
(`eval_*`), and the closing summary (`train_runtime`, `train_loss`, ...), which is skipped.

Accepted paths: the file itself, a `checkpoint-N` folder holding it, or an output folder holding
`trainer_state.json` (written by `Trainer.save_state()`) and/or `checkpoint-N/` folders. Of these the
newest wins: the highest `global_step`, the top-level file on a tie (each checkpoint's state holds
the whole history up to it, so the newest is a superset).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from mcore_proxy.diagnose.readers.common import BadRecord, as_step, finish, new_points, number
from mcore_proxy.diagnose.series import RunLog
from mcore_proxy.core.errors import LogError

STATE = "trainer_state.json"
SUMMARY_KEYS = ("train_runtime", "train_samples_per_second", "train_steps_per_second")
CHECKPOINT = re.compile(r"checkpoint-(\d+)$")
FIX = "pass the trainer_state.json a transformers/TRL Trainer wrote (in its output folder or a checkpoint-N folder)"


def checkpoints(folder: Path) -> list[Path]:
    """checkpoint-N folders holding a trainer state, by N."""
    found = [
        (int(m.group(1)), p)
        for p in folder.glob("checkpoint-*")
        if (m := CHECKPOINT.match(p.name)) and (p / STATE).is_file()
    ]
    return [p for _, p in sorted(found)]


def is_trl_folder(folder: Path) -> bool:
    return (folder / STATE).is_file() or bool(checkpoints(folder))


def load_state(path: Path) -> dict:
    try:
        state = json.loads(path.read_text(errors="replace"))
    except json.JSONDecodeError as err:
        raise LogError(
            f"{path}: not complete JSON ({err.msg} at line {err.lineno}); if the trainer is "
            "saving a checkpoint right now, read it again in a moment"
        ) from None
    except RecursionError:
        raise BadRecord(f"{path}: JSON nested too deep to read; {FIX}") from None
    except ValueError:  # json's limit on integer literals (4300 digits): JSONDecodeError is caught above
        raise BadRecord(f"{path}: holds a number of thousands of digits, which no trainer state has; {FIX}") from None
    if not isinstance(state, dict) or not isinstance(state.get("log_history"), list):
        raise LogError(f"{path}: no 'log_history' list; {FIX}")
    return state


def newest_state(folder: Path) -> Path:
    candidates = [folder / STATE] if (folder / STATE).is_file() else []
    if checkpoints(folder):
        candidates.append(checkpoints(folder)[-1] / STATE)
    if len(candidates) == 1:
        return candidates[0]

    def global_step(p: Path) -> int:
        try:
            return int(json.loads(p.read_text(errors="replace")).get("global_step", -1))
        except (ValueError, TypeError, AttributeError, OverflowError, RecursionError):
            return -1  # unreadable or absurd here: load_state names the defect of the one chosen

    top, last = candidates
    return top if global_step(top) >= global_step(last) else last


def read_trainer_state(path: Path) -> RunLog:
    file = path if path.is_file() else newest_state(path)
    state = load_state(file)
    points = new_points()
    for index, entry in enumerate(state["log_history"]):
        if not isinstance(entry, dict) or any(k in entry for k in SUMMARY_KEYS):
            continue
        step = entry.get("step")
        if not isinstance(step, (int, float)) or isinstance(step, bool):
            continue
        step = as_step(step, f"{file}: log_history entry {index}")
        for key, value in entry.items():
            value = number(value)
            if key != "step" and value is not None:
                points[key].append((step, value))
    return finish(file, "trl-state", points, "its log_history holds no logged step")
