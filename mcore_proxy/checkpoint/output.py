"""Output folders that never look complete unless they are: lock, stage, then rename.

`staged_output(out)`:
  1. checks the target (must not exist, not inside an input, parent exists, enough free space);
  2. takes a lock beside it (`.OUT.mcore-proxy.lock`, flock: released by the kernel when the owner
     dies, even by `kill -9`), so a second converter on the same output is refused;
  3. removes staging folders of earlier runs on the same output: while we hold the lock their
     owners are gone (a killed run leaves its staging folder behind, never a checkpoint);
  4. yields a hidden staging folder `.OUT.mcore-proxy-staging-<id>`; the writer puts the
     completeness markers (tracker, torch_dist metadata.json) in last, after the manifest;
  5. renames it to `out` on success, removes it on any failure or signal.

A failed write (ENOSPC, EFBIG, EIO, EROFS, ...) becomes one OutputError sentence. Readers refuse
staging folders by name (`refuse_staging`): an interrupted output is never read as a checkpoint.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import shutil
import time
from pathlib import Path

from mcore_proxy.errors import CheckpointError, OutputError

log = logging.getLogger(__name__)

STAGING_TAG = ".mcore-proxy-staging-"
LOCK_SUFFIX = ".mcore-proxy.lock"
# our staging folders, and the `.partial-` ones of earlier mcore-proxy versions
_STAGING = re.compile(r"^\..+(\.mcore-proxy-staging-[\w.-]+|\.partial-(\d+|torchrun))$")

_REASONS = {
    errno.ENOSPC: "the file system is full",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EFBIG: "a file exceeds the file-size limit (ulimit -f) or the file system's largest file",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.EIO: "an I/O error (the disk or the network file system failed)",
}


def write_failure(out: Path, err: OSError) -> OutputError:
    """One sentence for a failed write under `out`."""
    reason = _REASONS.get(err.errno, err.strerror or str(err))
    where = f" at {err.filename}" if err.filename else ""
    return OutputError(f"{out}: writing the output failed ({reason}{where}); nothing was left behind, "
                       "fix the cause and run again")


def is_staging(path: str | Path) -> bool:
    """Whether `path` is (or lies inside) a staging folder of an mcore-proxy output."""
    return any(_STAGING.match(part) for part in Path(path).absolute().parts)


def refuse_staging(path: str | Path) -> None:
    """CheckpointError for a staging folder: it is an unfinished output, never a checkpoint."""
    if is_staging(path):
        raise CheckpointError(f"{path}: is the staging folder of an unfinished mcore-proxy output (the run was "
                              "interrupted), not a checkpoint; delete it and run the conversion again")


def check_output_path(out: str | Path, inputs: tuple[str | Path, ...] = ()) -> Path:
    """The output must not exist and must not lie inside (or contain) an input."""
    out = Path(out).absolute()
    if out.exists():
        raise OutputError(f"{out}: output folder already exists; choose a new path or remove it first")
    if is_staging(out):
        raise OutputError(f"{out}: lies in an mcore-proxy staging folder; choose a path outside it")
    for src in inputs:
        src = Path(src).resolve()
        if out.resolve() == src or src in out.resolve().parents or out.resolve() in src.parents:
            raise OutputError(f"{out}: output must not be inside the input checkpoint {src} (or hold it); "
                              "choose a path outside it")
    if not out.parent.is_dir():
        raise OutputError(f"{out.parent}: parent folder of the output does not exist; create it first")
    return out


def free_bytes(folder: Path) -> int:
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize


def check_free_space(out: Path, needed: int) -> None:
    """Refuse early when the file system of `out` has less free space than `needed` bytes."""
    free = free_bytes(out.parent)
    if needed > free:
        raise OutputError(f"{out}: needs about {_size(needed)} but its file system has {_size(free)} free; free "
                          "space or choose another output (--no-space-check skips this check)")


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def lock_path(out: Path) -> Path:
    return out.with_name(f".{out.name}{LOCK_SUFFIX}")


@contextlib.contextmanager
def output_lock(out: Path):
    """Hold the lock of output `out` for the block; OutputError if another process holds it."""
    path = lock_path(out)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OutputError(f"{out}: another mcore-proxy run is writing this output (it holds {path}); wait "
                              "for it to finish or choose another output") from None
        # the holder before us may have removed the file after we opened it: lock the current one
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield path
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)


def staging_folders(out: Path) -> list[Path]:
    return sorted(p for p in out.parent.glob(f".{out.name}.*") if p.is_dir() and _STAGING.match(p.name))


def remove_tree(path: Path) -> None:
    """rmtree that retries: a worker being stopped may still create a file while it runs."""
    for _ in range(5):
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            return
        time.sleep(0.1)


def remove_stale_staging(out: Path) -> None:
    """Remove staging folders of earlier runs on `out` (call while holding its lock)."""
    for folder in staging_folders(out):
        log.warning("removing %s, left by an earlier run that was stopped", folder)
        remove_tree(folder)


@contextlib.contextmanager
def staged_output(out: str | Path, inputs: tuple[str | Path, ...] = (), *, needed_bytes: int = 0,
                  check_space: bool = True, staging_id: str | None = None):
    """Yield the staging folder of `out`; rename it to `out` only on success (module docstring)."""
    out = check_output_path(out, inputs)
    tmp = out.with_name(f".{out.name}{STAGING_TAG}{staging_id or os.getpid()}")
    try:
        with output_lock(out):
            remove_stale_staging(out)
            if check_space:
                check_free_space(out, needed_bytes)
            try:
                tmp.mkdir()
                yield tmp
                os.rename(tmp, out)
            finally:
                if tmp.exists():
                    remove_tree(tmp)
    except OSError as err:
        raise write_failure(out, err) from None


def write_synced(path: Path, data: bytes) -> None:
    """Write a small file and fsync it (markers: they must not reach the disk before the data)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def write_markers(root: Path, markers: dict[str, bytes]) -> None:
    """Write the completeness markers in order (the tracker is the last one)."""
    for rel, data in markers.items():
        write_synced(Path(root) / rel, data)
