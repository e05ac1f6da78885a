"""One builder at a time per cached fixture, across processes.

Test workers (pytest-xdist) share one fixture folder; without a lock two of them would both find a
fixture missing and build it into the same folder at once. `flock` is released by the kernel when
its holder dies, so a killed worker never leaves the others waiting.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path


@contextlib.contextmanager
def build_lock(root: str | os.PathLike, key: str):
    """Hold `root/.{key}.lock` exclusively; the caller checks for the fixture again inside."""
    Path(root).mkdir(parents=True, exist_ok=True)
    with open(Path(root) / f".{key}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield
