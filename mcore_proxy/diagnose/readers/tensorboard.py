"""TensorBoard event files: every `events.out.tfevents.*` under a folder, in name order (a
restarted run's later file wins on a step logged twice), read with the `tensorboard` package's
event-file loader (scalars written as `simple_value` or as scalar tensors; NaN and inf kept). A step
out of 0..10^15 is refused naming the file and the event. The tensorboard package comes with the
`diagnose` extra."""

from __future__ import annotations

import logging
from pathlib import Path

from mcore_proxy.core.optional import require
from mcore_proxy.diagnose.readers.common import FORMATS_HINT, as_step, finish, new_points
from mcore_proxy.diagnose.series import RunLog
from mcore_proxy.core.errors import LogError

TB_PATTERN = "events.out.tfevents.*"


def event_files(path: Path) -> list[Path]:
    return sorted(path.rglob(TB_PATTERN)) if path.is_dir() else [path]


def read_tensorboard(path: Path) -> RunLog:
    files = event_files(path)
    if not files:
        raise LogError(
            f"{path}: folder holds no TensorBoard event file ({TB_PATTERN}) nor another known log; {FORMATS_HINT}"
        )
    logging.getLogger("tensorboard").setLevel(logging.ERROR)
    why = f"{path}: reading TensorBoard logs"
    EventFileLoader = require("tensorboard.backend.event_processing.event_file_loader", why=why).EventFileLoader
    tensor_util = require("tensorboard.util.tensor_util", why=why)
    points = new_points()
    for file in files:
        for index, step, tag, value in _scalars(file, EventFileLoader, tensor_util):
            points[tag].append((as_step(step, f"{file}: event {index}"), value))
    return finish(path, "tensorboard", points, f"{len(files)} event file(s) without scalars")


def _scalars(file: Path, EventFileLoader, tensor_util) -> list[tuple[int, int, str, float]]:
    """(event index, step, tag, value) of every scalar in one event file; values may be NaN or inf."""
    out = []
    try:
        for index, event in enumerate(EventFileLoader(str(file)).Load()):
            for value in event.summary.value:
                array = tensor_util.make_ndarray(value.tensor) if value.HasField("tensor") else None
                if array is not None and array.size == 1 and array.dtype.kind in "fiub":
                    out.append((index, event.step, value.tag, float(array.reshape(-1)[0])))
    except Exception as err:  # the loader raises protobuf/IO errors of many kinds on bad files
        raise LogError(
            f"{file}: not a readable TensorBoard event file ({type(err).__name__}: "
            f"{err}); pass the folder a SummaryWriter wrote"
        ) from None
    return out
