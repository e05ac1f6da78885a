"""Megatron's iteration folders and the tracker file, for every Megatron format.

A checkpoint root holds `latest_checkpointed_iteration.txt` (an integer or `release`) naming its
iteration folder `iter_{:07d}/` (or `release/`); a reader may also be given an iteration folder
directly. The tracker is written last by a save: it marks the checkpoint complete.
"""

from __future__ import annotations

import re
from pathlib import Path

from mcore_proxy.core.errors import CheckpointError

TRACKER = "latest_checkpointed_iteration.txt"
_ITER_DIR = re.compile(r"^iter_(\d{7})$")

Iteration = int | str  # a step number, "release", or (a folder not named iter_*) the folder's name


def folder_name(iteration: Iteration | None) -> str:
    """The iteration folder of `iteration` (None: 0, as Megatron counts a fresh save)."""
    it = 0 if iteration is None else iteration
    return "release" if it == "release" else f"iter_{int(it):07d}"


def is_iteration_folder_name(name: str) -> bool:
    return bool(_ITER_DIR.match(name)) or name == "release"


def tracker_bytes(iteration: Iteration | None) -> bytes:
    """The tracker's content for `iteration`."""
    return str(0 if iteration is None else iteration).encode()


def tracker_marker(iteration: Iteration | None) -> dict[str, bytes]:
    """The tracker as a completeness marker (relative path -> bytes): writers hand it to the caller,
    which writes it last (see `output.write_markers`)."""
    return {TRACKER: tracker_bytes(iteration)}


def header_iteration(iteration: Iteration | None) -> int:
    """The `iteration` entry a Megatron save stores in its files (0 for a release)."""
    return 0 if iteration in (None, "release") else int(iteration)


def read_tracker(tracker: Path) -> str:
    """The tracker's text (stripped); a file that is not short text is refused by name."""
    data = tracker.read_bytes()[:4096]
    try:
        return data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise CheckpointError(
            f"{tracker}: holds binary data, expected an iteration number or 'release'; "
            "fix the file or pass the iter_* folder directly"
        ) from None


def tracked_folder(root: Path) -> Path | None:
    """The folder the tracker of `root` names, or None without a readable tracker (detection:
    never raises)."""
    tracker = Path(root) / TRACKER
    if not tracker.is_file():
        return None
    text = tracker.read_bytes()[:4096].decode("utf-8", "replace").strip()
    if text == "release" or text.isdigit():
        return Path(root) / folder_name(text if text == "release" else int(text))
    return None


def resolve_iteration_dir(path: str | Path, holds_data, not_found: str) -> tuple[Path, Iteration]:
    """Checkpoint root (with tracker) or an iteration folder -> (iteration folder, iteration).

    holds_data(folder): whether `folder` is itself an iteration folder of the caller's format;
    not_found: the message when nothing fits."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(
            f"{path}: no such checkpoint folder; pass the folder Megatron saved (the one holding {TRACKER})"
        )
    tracker = path / TRACKER
    if tracker.is_file():
        text = read_tracker(tracker)
        if text == "release":
            iteration: Iteration = "release"
        elif text.isdigit():
            iteration = int(text)
        else:
            raise CheckpointError(
                f"{tracker}: holds {text!r}, expected an iteration number or "
                "'release'; fix the file or pass the iter_* folder directly"
            )
        it_dir = path / folder_name(iteration)
        if not it_dir.is_dir():
            raise CheckpointError(
                f"{tracker}: names iteration {text} but {it_dir.name}/ does not "
                "exist; fix the tracker or pass an existing iter_* folder"
            )
        return it_dir, iteration
    if holds_data(path):
        m = _ITER_DIR.match(path.name)
        return path, int(m.group(1)) if m else ("release" if path.name == "release" else path.name)
    iters = sorted(p.name for p in path.iterdir() if is_iteration_folder_name(p.name))
    if iters:
        raise CheckpointError(
            f"{path}: has {', '.join(iters)} but no {TRACKER}; pass the iteration "
            f"folder you mean directly (e.g. {path / iters[-1]})"
        )
    raise CheckpointError(f"{path}: {not_found}")
