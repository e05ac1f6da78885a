"""MLflow (mcore_proxy/diagnose/readers/mlflow_store.py) on stores written by mlflow's own client
(conftest.mlflow_stores: a file store with experiments `base` (2 runs) and `fault` (1 run), and a
SQLite database with one run); the reader itself needs no mlflow."""

from pathlib import Path

import numpy as np
import pytest

from mcore_proxy.diagnose.aliases import canonical_metrics
from mcore_proxy.diagnose.readers import read_log
from mcore_proxy.diagnose.readers.mlflow_store import meta
from mcore_proxy.core.errors import LogError


def experiments(store):
    return {meta(p)["name"]: p for p in store.iterdir() if p.is_dir() and "name" in meta(p)}


def test_run_and_experiment_folders(mlflow_stores):
    store, _ = mlflow_stores
    fault = experiments(store)["fault"]
    run = read_log(fault)  # an experiment with one run: that run
    assert run.format == "mlflow" and meta(Path(run.source))["run_name"] == "lr_x10"
    assert canonical_metrics(run.metrics) == {"kl_loss": "actor/kl_loss", "reward": "critic/score/mean"}
    assert run.metrics["actor/kl_loss"].steps.tolist() == list(range(1, 11))
    assert run.metrics["critic/score/mean"].values[-1] == pytest.approx(0.5)
    assert "timing_s/gen" in run.metrics
    same = read_log(run.source)  # the run folder itself
    assert same.metrics["actor/kl_loss"].values.tolist() == run.metrics["actor/kl_loss"].values.tolist()


def test_several_runs_are_refused_with_their_names(mlflow_stores):
    store, _ = mlflow_stores
    with pytest.raises(
        LogError,
        match=r"an MLflow store with 3 runs \(\w+ \(\w+\), .*\); pass the folder of "
        r"one run, e\.g\. ",
    ) as err:
        read_log(store)
    assert all(f"({name})" in str(err.value) for name in ("seed0", "seed1", "lr_x10"))
    with pytest.raises(LogError, match="2 runs"):
        read_log(experiments(store)["base"])


def test_growing_metric_file_and_deleted_runs(mlflow_stores, tmp_path):
    import shutil

    store, _ = mlflow_stores
    base = shutil.copytree(experiments(store)["base"], tmp_path / "base")
    runs = sorted(p for p in base.iterdir() if p.is_dir())
    meta_file = runs[0] / "meta.yaml"
    meta_file.write_text(meta_file.read_text().replace("lifecycle_stage: active", "lifecycle_stage: deleted"))
    metric = runs[1] / "metrics" / "actor" / "kl_loss"
    with metric.open("a") as f:
        f.write("1796280371999 0.0")  # step 11 half written
    run = read_log(base)  # the deleted run does not count
    assert run.source == str(runs[1]) and run.metrics["actor/kl_loss"].steps[-1] == 10


def test_sqlite_database(mlflow_stores):
    _, db = mlflow_stores
    if db is None:
        pytest.skip("sqlalchemy/alembic missing: mlflow cannot write a SQLite store")
    run = read_log(db)
    assert run.format == "mlflow" and run.metrics["actor/kl_loss"].steps.tolist() == [1, 2, 3, 4, 5]
    assert run.metrics["critic/score/mean"].values[-1] == pytest.approx(0.5)
    # NaN (stored as 0 with is_nan) and +-inf (stored as +-1.8e308) come back as what was logged
    entropy, grad = run.metrics["actor/entropy"], run.metrics["actor/grad_norm"]
    assert len(entropy) == 0 and entropy.nonfinite_steps.tolist() == [3] and np.isnan(entropy.nonfinite_values[0])
    assert grad.nonfinite_steps.tolist() == [4, 5] and grad.nonfinite_values.tolist() == [np.inf, -np.inf]


def test_sqlite_that_is_not_mlflow(tmp_path):
    import sqlite3

    path = tmp_path / "other.db"
    with sqlite3.connect(path) as con:
        con.execute("CREATE TABLE t (x)")
    with pytest.raises(LogError, match="without MLflow's runs and metrics tables"):
        read_log(path)
