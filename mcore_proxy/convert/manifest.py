"""manifest.json: sha256 and size of every file of an output, with its provenance.

Paths in a manifest hold no place of this machine: the files are listed relative to the output
folder, and the inputs (`source.path`, `plan.path`) relative to it too (`../orig`), so a proxy
moved together with its inputs (a workspace copied to another node or mount point) still names
them. They are provenance only, never read back: `verify` takes its inputs on its command line,
and an input's identity is its sha256 or router fingerprint, beside the path.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mcore_proxy.checkpoint.torchfile import file_sha256

MANIFEST = "manifest.json"
FORMAT = "mcore-proxy-manifest/1"
PATHS_NOTE = (
    "relative to this folder: the files, and source.path and plan.path (where the inputs were when "
    "convert ran); provenance only, never read back: an input's identity is its sha256 or "
    "router_fingerprint"
)


def relative_to_output(path: str | os.PathLike, out: str | os.PathLike) -> str:
    """Where input `path` lies as seen from output folder `out` ('../orig'), with '/' separators."""
    return Path(os.path.relpath(os.path.abspath(path), os.path.abspath(out))).as_posix()


def file_table(folder: Path) -> dict[str, dict]:
    """Relative path -> {size, sha256} for every file under `folder` except the manifest.

    Files are hashed in threads: hashlib releases the GIL on large buffers, so rank files hash
    in parallel on every core."""
    folder = Path(folder)
    files = [p for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MANIFEST]
    with ThreadPoolExecutor(max_workers=min(len(files), os.cpu_count() or 1) or 1) as pool:
        digests = list(pool.map(file_sha256, files))
    return {str(p.relative_to(folder)): {"size": p.stat().st_size, "sha256": d} for p, d in zip(files, digests)}


def write_manifest(folder: Path, info: dict, files: dict[str, dict], pending: dict[str, bytes] | None = None) -> Path:
    """Write the manifest of `folder` from `files` (relative path -> {size, sha256}, as the writers
    computed them while writing: nothing is read back).

    The file list is compared with what is on disk (names and sizes only): a file a writer did not
    report, or reported with another size, is an InternalError, never an unlisted file.
    `pending`: files written after the manifest (the completeness markers, relative path -> bytes),
    listed with the hash of the bytes they will hold: the tracker stays the last file written."""
    from mcore_proxy.core.output import write_synced
    from mcore_proxy.core.errors import InternalError

    on_disk = {
        str(p.relative_to(folder)): p.stat().st_size
        for p in Path(folder).rglob("*")
        if p.is_file() and p.name != MANIFEST
    }
    reported = {rel: entry["size"] for rel, entry in files.items()}
    if on_disk != reported:
        extra = sorted(set(on_disk) - set(reported)) + sorted(r for r in reported if on_disk.get(r) != reported[r])
        raise InternalError(f"{folder}: the writer's account of its files disagrees with the disk at {extra[:3]}")
    files = dict(files)
    for rel, data in (pending or {}).items():
        files[rel] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    doc = {"format": FORMAT, "paths": PATHS_NOTE, **info, "files": dict(sorted(files.items()))}
    path = Path(folder) / MANIFEST
    write_synced(path, (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode())
    return path


def check_manifest(folder: Path) -> list[str]:
    """Differences between the files of `folder` and its manifest; empty when they agree."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return [f"{path}: no manifest"]
    try:
        recorded = json.loads(path.read_bytes()).get("files", {})
        recorded = {k: v for k, v in recorded.items() if isinstance(v, dict)}
    except (ValueError, AttributeError, RecursionError):  # a damaged manifest is a difference, not a crash
        return [f"{path}: not a readable manifest"]
    found = file_table(folder)
    problems = [f"{name}: listed in the manifest but missing" for name in sorted(set(recorded) - set(found))]
    problems += [f"{name}: not listed in the manifest" for name in sorted(set(found) - set(recorded))]
    problems += [
        f"{name}: sha256 differs from the manifest"
        for name in sorted(set(found) & set(recorded))
        if found[name]["sha256"] != recorded[name].get("sha256")
    ]
    return problems


def plan_fingerprint(plan_path: Path) -> str:
    return hashlib.sha256(Path(plan_path).read_bytes()).hexdigest()
