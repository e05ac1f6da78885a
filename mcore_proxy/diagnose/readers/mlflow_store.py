"""MLflow's local file store (`mlflow.set_tracking_uri("file:./mlruns")`), read as the plain text it
is, without the mlflow package:

    mlruns/<experiment id>/meta.yaml                      (name: ...)
    mlruns/<experiment id>/<run id>/meta.yaml             (run_id, run_name, lifecycle_stage)
    mlruns/<experiment id>/<run id>/metrics/<key>         one line per point: "timestamp value step"

A key with slashes (`actor/kl_loss`) is a nested path under `metrics/`. The path given may be the
store (`mlruns/`), an experiment folder or a run folder; a store or experiment must hold exactly one
live run (deleted runs and `.trash` are ignored), otherwise the reader refuses and lists the runs,
so that no run is compared by accident. A last line without its newline (a run still logging) is
skipped. NaN and infinite values are kept (`Series`); a step out of 0..10^15 is refused.

MLflow >= 3.7 defaults to a SQLite database (`mlflow.db`) and keeps the file store only with
`MLFLOW_ALLOW_FILE_STORE=true`; verl's mlflow backend defaults to `sqlite:////tmp/mlruns.db`. Such a
database is read too (`read_mlflow_sqlite`: its `runs` and `metrics` tables, with Python's sqlite3).
"""

from __future__ import annotations

import math
import sqlite3
import sys
from pathlib import Path

from mcore_proxy.diagnose.readers.common import (
    as_step,
    complete_lines,
    finish,
    listed,
    new_points,
    number,
)
from mcore_proxy.diagnose.series import RunLog
from mcore_proxy.core.errors import LogError

SQLITE_MAGIC = b"SQLite format 3\x00"


def meta(folder: Path) -> dict[str, str]:
    """The top-level `key: value` lines of a folder's meta.yaml ({} when there is none)."""
    try:
        text = (folder / "meta.yaml").read_text(errors="replace")
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        if line[:1].strip() and ":" in line:
            key, _, value = line.partition(":")
            out[key.strip()] = value.strip().strip("'\"")
    return out


def is_run(folder: Path) -> bool:
    m = meta(folder)
    return "run_id" in m or "run_uuid" in m or ((folder / "metrics").is_dir() and bool(m))


def is_experiment(folder: Path) -> bool:
    return "experiment_id" in meta(folder) and not is_run(folder)


def is_store(folder: Path) -> bool:
    return folder.is_dir() and any(is_experiment(p) for p in folder.iterdir() if p.is_dir())


def is_mlflow(folder: Path) -> bool:
    return is_run(folder) or is_experiment(folder) or is_store(folder)


def _live(run: Path) -> bool:
    return meta(run).get("lifecycle_stage", "active") != "deleted"


def runs(folder: Path) -> list[Path]:
    if is_run(folder):
        return [folder]
    experiments = (
        [folder]
        if is_experiment(folder)
        else sorted(p for p in folder.iterdir() if p.is_dir() and p.name != ".trash" and is_experiment(p))
    )
    return [r for e in experiments if _live(e) for r in sorted(e.iterdir()) if r.is_dir() and is_run(r) and _live(r)]


def _name(run: Path) -> str:
    m = meta(run)
    name = m.get("run_name") or _tag(run, "mlflow.runName")
    return f"{run.name} ({name})" if name else run.name


def _tag(run: Path, tag: str) -> str:
    try:
        return (run / "tags" / tag).read_text(errors="replace").strip()
    except OSError:
        return ""


def _refuse_many(path: Path, names: list[str], example: str) -> LogError:
    return LogError(
        f"{path}: an MLflow store with {len(names)} runs ({listed(names)}); pass the folder of one run, e.g. {example}"
    )


def read_mlflow(path: Path) -> RunLog:
    found = runs(path)
    if not found:
        raise LogError(
            f"{path}: an MLflow store with no live run; pass the folder of a run that "
            "logged metrics (mlruns/<experiment id>/<run id>)"
        )
    if len(found) > 1:
        raise _refuse_many(path, [_name(r) for r in found], str(found[-1]))
    run = found[0]
    points = new_points()
    metrics = run / "metrics"
    files = sorted(p for p in metrics.rglob("*") if p.is_file()) if metrics.is_dir() else []
    for file in files:
        key = file.relative_to(metrics).as_posix()
        for index, line in enumerate(complete_lines(file), 1):
            fields = line.split()
            if len(fields) < 2:
                continue
            value = number(fields[1])
            step = number(fields[2]) if len(fields) > 2 else 0.0
            if value is not None and step is not None:
                points[key].append((as_step(step, f"{file}: line {index}"), value))
    return finish(run, "mlflow", points, f"run {_name(run)} has no metric file under metrics/")


def is_sqlite(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(len(SQLITE_MAGIC)) == SQLITE_MAGIC
    except OSError:
        return False


def _sql_value(value: float, is_nan) -> float:
    """A metric value as MLflow's SQL store logged it: it writes NaN as 0 with is_nan set, and +-inf
    as +-1.7976931348623157e308 (SQL has no infinity; `SqlAlchemyStore.sanitize_metric_value`)."""
    if is_nan:
        return math.nan
    if abs(value) == sys.float_info.max:
        return math.copysign(math.inf, value)
    return value


def read_mlflow_sqlite(path: Path, run_id: str | None = None) -> RunLog:
    """An MLflow SQLite tracking database (`sqlite:///mlflow.db`): its one live run's metrics."""
    try:
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    except sqlite3.Error as err:
        raise LogError(f"{path}: cannot open the SQLite database ({err}); check the path") from None
    try:
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if not {"runs", "metrics"} <= tables:
            raise LogError(
                f"{path}: a SQLite database without MLflow's runs and metrics tables; pass an "
                "MLflow tracking database (mlflow.db) or a file-store run folder"
            )
        live = con.execute(
            "SELECT run_uuid, name FROM runs WHERE lifecycle_stage != 'deleted' ORDER BY start_time"
        ).fetchall()
        if run_id is not None:
            live = [r for r in live if r[0] == run_id]
        if not live:
            raise LogError(f"{path}: an MLflow database with no live run; pass one whose run logged metrics")
        if len(live) > 1:
            names = listed([f"{r[0]} ({r[1]})" if r[1] else r[0] for r in live])
            raise LogError(
                f"{path}: an MLflow database with {len(live)} runs ({names}); export the "
                "run to compare (mlflow's client: get_metric_history) to CSV, or log each run "
                "to its own database or file store"
            )
        points = new_points()
        rows = con.execute(
            "SELECT key, value, step, is_nan FROM metrics WHERE run_uuid = ? ORDER BY timestamp", (live[0][0],)
        )
        for key, value, step, is_nan in rows:
            value = number(value)  # SQLite keeps any type in any column: text is no value
            if value is not None:
                where = f"{path}: metrics table, key {key!r}"
                points[key].append((as_step(step or 0, where), _sql_value(value, is_nan)))
    except sqlite3.Error as err:
        raise LogError(
            f"{path}: cannot read the MLflow database ({err}); if the run is writing it, read it again in a moment"
        ) from None
    finally:
        con.close()
    return finish(path, "mlflow", points, f"run {live[0][0]} has no metric")
