"""W&B offline runs (mcore_proxy/diagnose/readers/wandb_run.py), written by wandb itself in offline
mode (conftest.wandb_dir: two runs) and read back through `python -m wandb leet inspect --json`."""

import pytest

from mcore_proxy.diagnose.aliases import canonical_metrics
from mcore_proxy.diagnose.readers import read_log
from mcore_proxy.core.errors import LogError


def test_offline_run_folder_and_file(wandb_dir):
    folder = sorted(p for p in wandb_dir.iterdir() if p.name.startswith("offline-run-"))[0]
    run = read_log(folder)
    assert run.format == "wandb"
    assert canonical_metrics(run.metrics) == {"kl_loss": "actor/kl_loss", "reward": "critic/score/mean"}
    assert run.metrics["actor/kl_loss"].steps.tolist() == list(range(10))
    assert run.metrics["critic/score/mean"].values[-1] == pytest.approx(0.45)
    assert run.metrics["perf.throughput"].values[0] == 100.0  # a nested dict, flattened
    assert "note" not in run.metrics and not any(k.startswith("_") for k in run.metrics)
    # W&B prints NaN and infinities as the strings "NaN", "Infinity", "-Infinity": read as such
    grad = run.metrics["perf/loss_scale"]
    assert grad.nonfinite_steps.tolist() == [3, 5, 7] and grad.nonfinite_kinds() == {"NaN": 1, "+inf": 1, "-inf": 1}
    assert read_log(run.source).metrics["actor/kl_loss"].values.tolist() == run.metrics["actor/kl_loss"].values.tolist()


def test_wandb_folder_with_two_runs_is_refused_and_latest_run_works(wandb_dir):
    with pytest.raises(LogError, match=r"a W&B folder with 2 runs \(offline-run-.*\); pass one run's folder"):
        read_log(wandb_dir)
    assert read_log(wandb_dir / "latest-run").metrics["actor/kl_loss"].steps[-1] == 9


def test_a_damaged_file_is_one_sentence(wandb_dir, tmp_path):
    bad = tmp_path / "run-x.wandb"
    bad.write_bytes(b":W&B" + b"\x00" * 20)
    with pytest.raises(LogError, match=str(bad)):
        read_log(bad)
