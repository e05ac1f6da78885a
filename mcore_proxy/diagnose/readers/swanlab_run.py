"""SwanLab offline (or local) runs: `swanlog/run-<date>-<id>/run-<id>.swanlab`.

The `.swanlab` file is SwanLab's record log (protobuf `Record`s in LevelDB-log framing, header
`:SWL`), which only the swanlab package reads: its `DataStoreReader` (in the private
`swanlab.sdk.internal.core_python.store`) and its `Record` message; SwanLab says files of another
format version are not readable by a newer SDK. This reader uses those two (tested with swanlab
0.10.3): `scalar` records give (key, step, value). When they are missing, renamed, or refuse the
file's version, the reader refuses with a sentence saying how to export instead. A record cut off at
the end of a run still writing ends the read.

Accepted paths: the `.swanlab` file, its run folder, or a `swanlog/` folder holding exactly one run.
"""

from __future__ import annotations

from pathlib import Path

from mcore_proxy.core.optional import MissingDependency, missing_message
from mcore_proxy.diagnose.readers.common import as_step, finish, listed, new_points
from mcore_proxy.diagnose.series import RunLog
from mcore_proxy.core.errors import LogError

EXPORT = (
    "or sync it (swanlab sync) and export its metrics as CSV, or log the run to TensorBoard too "
    "(swanlab.sync_tensorboard_torch / a SummaryWriter)"
)


def run_file(folder: Path) -> Path | None:
    files = sorted(folder.glob("run-*.swanlab"))
    return files[-1] if files else None


def run_folders(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_dir() and p.name.startswith("run-") and run_file(p) is not None)


def is_swanlab(folder: Path) -> bool:
    return run_file(folder) is not None or bool(run_folders(folder))


def _swanlab_api(file: Path):
    try:
        from swanlab.proto.swanlab.record.v1.record_pb2 import Record
        from swanlab.sdk.internal.core_python.store import DataStoreReader
    except ModuleNotFoundError as err:
        if err.name == "swanlab":
            raise MissingDependency(
                f"{missing_message(['swanlab'], f'{file}: reading a SwanLab run')} ({EXPORT})", ("swanlab",)
            ) from None
        raise LogError(
            f"{file}: this swanlab version has no record reader where it was (swanlab 0.10 had one; {err}); {EXPORT}"
        ) from None
    except ImportError as err:
        raise LogError(f"{file}: swanlab cannot be imported ({err}); {EXPORT}") from None
    return Record, DataStoreReader


def read_swanlab(path: Path) -> RunLog:
    if path.is_dir():
        file = run_file(path)
        if file is None:
            found = run_folders(path)
            if len(found) > 1:
                names = listed([p.name for p in found])
                raise LogError(f"{path}: a SwanLab folder with {len(found)} runs ({names}); pass one run's folder")
            file = run_file(found[0])
    else:
        file = path
    Record, DataStoreReader = _swanlab_api(file)
    reader = DataStoreReader()
    try:
        reader.open(file)
    except Exception as err:  # swanlab's DataStoreError (bad header, other format version) and IO errors
        raise LogError(f"{file}: swanlab cannot read it ({' '.join(str(err).split())}); {EXPORT}") from None
    points, index = new_points(), 0
    try:
        while True:
            index += 1
            try:
                data = reader.scan()
            except Exception:  # noqa: BLE001 - swanlab's DataStoreError, assertions: a cut or corrupt tail
                break
            if data is None:
                break
            record = Record()
            try:
                record.ParseFromString(data)
            except Exception:  # noqa: BLE001 - protobuf's DecodeError: a damaged record
                break
            if record.HasField("scalar"):
                s = record.scalar
                step = as_step(int(s.step), f"{file}: record {index}")
                points[s.key].append((step, float(s.value.number)))
    finally:
        reader.close()
    return finish(file, "swanlab", points, "no scalar record")
