"""Output folders that never look complete unless they are: lock, stage, then rename.

`staged_output(out)`:
  1. checks the target (must not exist unless replacing, not inside an input, parent exists,
     enough free space);
  2. takes a lock beside it (`.OUT.mcore-proxy.lock`, flock: released by the kernel when the owner
     dies, even by `kill -9`), so a second converter on the same output is refused;
  3. removes staging folders of earlier runs on the same output: while we hold the lock their
     owners are gone (a killed run leaves its staging folder behind, never a checkpoint);
  4. yields a hidden staging folder `.OUT.mcore-proxy-staging-<id>`; the writer puts the
     completeness markers (tracker, torch_dist metadata.json) in last, after the manifest;
  5. renames it to `out` on success, removes it on any failure or signal. Replacing (`--force`),
     the complete new folder and the old one swap places in one atomic rename (Linux
     `renameat2(RENAME_EXCHANGE)`), then the old one is removed: the old output is never deleted
     before the new one is complete, and a failed run leaves it as it was.

`staged_files(folder, name, patterns)` does the same for outputs that are files in a folder (a
plan, a statistics file and its sidecar, the PNGs of a report): they are written into a staging
folder and moved into place one by one at the end, each replacing its old version.

A failed write (ENOSPC, EFBIG, EIO, EROFS, ...) becomes one OutputError sentence. Readers refuse
staging folders by name (`refuse_staging`): an interrupted output is never read as a checkpoint.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import fnmatch
import glob
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path

from mcore_proxy.core.errors import CheckpointError, OutputError
from mcore_proxy.core.units import format_bytes

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
    return OutputError(
        f"{out}: writing the output failed ({reason}{where}); nothing was left behind, fix the cause and run again"
    )


def is_staging(path: str | Path) -> bool:
    """Whether `path` is (or lies inside) a staging folder of an mcore-proxy output."""
    return any(_STAGING.match(part) for part in Path(path).absolute().parts)


def refuse_staging(path: str | Path) -> None:
    """CheckpointError for a staging folder: it is an unfinished output, never a checkpoint."""
    if is_staging(path):
        raise CheckpointError(
            f"{path}: is the staging folder of an unfinished mcore-proxy output (the run was "
            "interrupted), not a checkpoint; delete it and run the conversion again"
        )


def given_path(path: str | Path, what: str = "output") -> Path:
    """`path` as an absolute Path; an empty string is refused (`Path("")` is the current folder,
    which an unset variable must never mean)."""
    if isinstance(path, str) and not path.strip():
        raise OutputError(f"the {what} path is empty (an unset variable?); give the path to write")
    return Path(path).absolute()


# files whose presence makes a folder a checkpoint or a part of one: Megatron's tracker, a rank
# folder's file, torch_dist's metadata, a Hugging Face model's config (beside its weights)
_CHECKPOINT_FILES = ("latest_checkpointed_iteration.txt", "model_optim_rng.pt", ".metadata")


def looks_like_checkpoint(folder: Path) -> bool:
    """Whether `folder` is (a part of) a checkpoint or an mcore-proxy convert output, by its files."""
    try:
        if any((folder / name).is_file() for name in _CHECKPOINT_FILES):
            return True
        if any(folder.glob("mp_rank_*")):  # an iteration folder
            return True
        if (folder / "config.json").is_file() and any(folder.glob("*.safetensors*")):
            return True
        return has_marker(folder, *OUTPUT_MARKERS[0])
    except OSError:  # an ancestor we may not list holds nothing we would write into
        return False


def check_not_in_checkpoint(folder: str | Path) -> None:
    """OutputError when `folder` or one of its ancestors is a checkpoint: a command writes where it
    was asked, and never into a checkpoint's folder (its own output folder is written whole, beside)."""
    folder = Path(folder).absolute()
    for place in (folder, *folder.parents):
        if place.is_dir() and looks_like_checkpoint(place):
            where = "is" if place == folder else f"lies in {place}, which is"
            raise OutputError(
                f"{folder}: {where} a checkpoint folder, and outputs never go into a checkpoint; "
                "choose an output outside it"
            )


def check_output_path(out: str | Path, inputs: tuple[str | Path, ...] = (), *, replace: bool = False) -> Path:
    """The output must not exist (unless `replace` and it is an earlier mcore-proxy output), must
    not lie inside (or contain) an input, and must not lie inside a checkpoint."""
    out = given_path(out)
    if (out.exists() or out.is_symlink()) and not replace:
        raise OutputError(
            f"{out}: output folder already exists; pass --force to replace it (the new output is "
            "written completely first, then swapped in), or choose a new path"
        )
    if is_staging(out):
        raise OutputError(f"{out}: lies in an mcore-proxy staging folder; choose a path outside it")
    for src in inputs:
        src = Path(src).resolve()
        if out.resolve() == src or src in out.resolve().parents or out.resolve() in src.parents:
            raise OutputError(
                f"{out}: output must not be inside the input {src} (or hold it); choose a path outside it"
            )
    check_folder(out.parent)
    check_not_in_checkpoint(out.parent)
    if out.exists() or out.is_symlink():
        check_replaceable(out)
    return out


def check_folder(folder: Path, *, create: bool = False) -> None:
    """`folder`, which will hold an output, must be a folder; with `create` it may also be missing
    while its parent exists (it is then made, and only it: never a chain of parents)."""
    if folder.is_dir():
        return
    if folder.exists() or folder.is_symlink():
        raise OutputError(f"{folder}: is not a folder, so it cannot hold the output; choose another path")
    if not (create and folder.parent.is_dir()):
        missing = folder if not create else folder.parent
        raise OutputError(f"{missing}: folder of the output does not exist; create it first")


# the file that marks a folder as one of our outputs, by its "format": what --force may replace
OUTPUT_MARKERS = (
    ("manifest.json", "mcore-proxy-manifest/1"),  # convert
    ("report.json", "mcore-proxy-compare/1"),
)  # compare -o


def has_marker(folder: str | Path, name: str, fmt: str) -> bool:
    """Whether `folder/name` is a JSON object whose "format" is `fmt`."""
    try:
        return json.loads((Path(folder) / name).read_bytes()).get("format") == fmt
    except (OSError, ValueError, AttributeError, RecursionError):
        return False


def is_output_folder(folder: str | Path) -> bool:
    """Whether `folder` holds the marker file of an mcore-proxy output folder (OUTPUT_MARKERS)."""
    return any(has_marker(folder, name, fmt) for name, fmt in OUTPUT_MARKERS)


def check_replaceable(out: Path) -> None:
    """`--force` replaces only what mcore-proxy wrote: a folder with its marker file (a convert output's
    manifest.json, a compare report's report.json), or an empty one (a typo must not swap away a
    folder of other data)."""
    if out.is_symlink() or not out.is_dir():
        raise OutputError(
            f"{out}: exists and is not a folder; --force replaces only a folder written by "
            "mcore-proxy; remove it yourself or choose another output"
        )
    if any(out.iterdir()) and not is_output_folder(out):
        raise OutputError(
            f"{out}: holds no mcore-proxy manifest.json (or compare report.json), so --force does "
            "not replace it (it may hold other data); remove it yourself or choose another output"
        )


def free_bytes(folder: Path) -> int:
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize


def check_free_space(out: Path, needed: int) -> None:
    """Refuse early when the file system of `out` has less free space than `needed` bytes."""
    free = free_bytes(out.parent)
    if needed > free:
        raise OutputError(
            f"{out}: needs about {format_bytes(needed)} but its file system has {format_bytes(free)} "
            "free; free space or choose another output (--no-space-check skips this check)"
        )


def lock_path(out: Path) -> Path:
    return out.with_name(f".{out.name}{LOCK_SUFFIX}")


@contextlib.contextmanager
def output_lock(out: Path):
    """Hold the lock of output `out` for the block; OutputError if another process holds it."""
    path = lock_path(out)
    with held_lock(path, f"{out}: another mcore-proxy run is writing this output (it holds {path})"):
        yield path


@contextlib.contextmanager
def held_lock(path: Path, busy: str):
    """Hold an flock on `path` (created, holding our pid) for the block, and remove the file after:
    no lock file stays behind a finished run. OutputError(`busy`, with the holder's pid) if another
    process holds it; the kernel releases it when its owner dies, even by `kill -9`."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise OutputError(f"{busy}, pid {holder}; wait for it to finish or stop it first") from None
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
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)


def staging_folders(out: Path) -> list[Path]:
    return sorted(p for p in out.parent.glob(f".{glob.escape(out.name)}.*") if p.is_dir() and _STAGING.match(p.name))


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
def staged_output(
    out: str | Path,
    inputs: tuple[str | Path, ...] = (),
    *,
    needed_bytes: int = 0,
    check_space: bool = True,
    staging_id: str | None = None,
    replace: bool = False,
):
    """Yield the staging folder of `out`; move it to `out` only on success (module docstring)."""
    out = check_output_path(out, inputs, replace=replace)
    tmp = out.with_name(f".{out.name}{STAGING_TAG}{staging_id or os.getpid()}")
    try:
        with output_lock(out):
            check_output_path(out, inputs, replace=replace)  # again, now that no other run can write it
            remove_stale_staging(out)
            if check_space:
                check_free_space(out, needed_bytes)
            try:
                tmp.mkdir()
                yield tmp
                move_into_place(tmp, out)
            finally:
                if tmp.exists():
                    remove_tree(tmp)  # on success, after a swap: the old output
    except OSError as err:
        raise write_failure(out, err) from None


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one atomic rename (Linux renameat2 RENAME_EXCHANGE); False where the system
    or file system cannot (then nothing changed)."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def move_into_place(new: Path, out: Path) -> None:
    """Rename the complete `new` to `out`. An existing `out` is swapped with `new` (so `new` then holds
    the old output, for the caller to remove); without an atomic swap the old one is first renamed
    aside to `.OUT.mcore-proxy-replaced-<pid>` (kept by a crash between the renames, never removed
    before the new one is in place)."""
    if not (out.exists() or out.is_symlink()):
        os.rename(new, out)
    elif not exchange(new, out):
        aside = out.with_name(f".{out.name}.mcore-proxy-replaced-{os.getpid()}")
        os.rename(out, aside)
        os.rename(new, out)
        os.rename(aside, new)


@contextlib.contextmanager
def staged_files(
    folder: str | Path,
    name: str,
    patterns: tuple[str, ...],
    *,
    replace: bool = False,
    inputs: tuple[str | Path, ...] = (),
):
    """Yield a staging folder for an output made of files in `folder`: the files matching `patterns`
    (globs; the first one names the output in messages). At the end each written file is moved into
    `folder` in the order of `patterns`, replacing its old version, and old files matching
    `patterns` that the new output lacks are removed; on failure nothing in `folder` changes.
    `name` names the lock and the staging folder (`.NAME.mcore-proxy.lock` in `folder`). The output
    may neither lie in an input folder nor replace an input file of `inputs`."""
    folder = given_path(folder)
    anchor = folder / name
    if is_staging(folder):
        raise OutputError(f"{folder}: lies in an mcore-proxy staging folder; choose a path outside it")
    _check_not_an_input(folder, patterns, inputs)
    check_folder(folder, create=True)
    check_not_in_checkpoint(folder)
    created = not folder.exists()
    tmp = anchor.with_name(f".{name}{STAGING_TAG}{os.getpid()}")
    try:
        folder.mkdir(exist_ok=True)
        with output_lock(anchor):
            old = _existing_files(folder, patterns, replace)
            remove_stale_staging(anchor)
            try:
                tmp.mkdir()
                yield tmp
                new = [f for pattern in patterns for f in sorted(tmp.glob(pattern)) if f.is_file()]
                for f in new:
                    os.replace(f, folder / f.name)
                for f in old - {folder / f.name for f in new}:
                    f.unlink()
            finally:
                remove_tree(tmp)
    except OSError as err:
        raise write_failure(folder, err) from None
    finally:
        if created and folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()


def _check_not_an_input(folder: Path, patterns: tuple[str, ...], inputs: tuple[str | Path, ...]) -> None:
    here = folder.resolve()
    for src in inputs:
        src = Path(src).resolve()
        if src.is_dir() and (here == src or src in here.parents):
            raise OutputError(f"{folder}: lies inside the input {src}, which is never modified; choose another output")
        if src.parent == here and any(fnmatch.fnmatch(src.name, pattern) for pattern in patterns):
            raise OutputError(f"{src}: is an input of this command; choose another output")


def _existing_files(folder: Path, patterns: tuple[str, ...], replace: bool) -> set[Path]:
    """Files of an earlier output in `folder`; OutputError unless `replace`, or when one is a folder."""
    found = list(dict.fromkeys(p for pattern in patterns for p in sorted(folder.glob(pattern))))
    for p in found:
        if p.is_dir() and not p.is_symlink():
            raise OutputError(f"{p}: is a folder where the output writes a file; choose another output")
    if found and not replace:
        raise OutputError(
            f"{found[0]}: exists; pass --force to replace it (the new output is written completely "
            "first, then moved into place), or choose another output"
        )
    return set(found)


def write_synced(path: Path, data: bytes) -> None:
    """Write a small file and fsync it (markers: they must not reach the disk before the data)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def write_markers(root: Path, markers: dict[str, bytes]) -> None:
    """Write the completeness markers in order (the tracker is the last one)."""
    for rel, data in markers.items():
        write_synced(Path(root) / rel, data)
