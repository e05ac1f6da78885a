"""TRL / transformers trainer_state.json (mcore_proxy/diagnose/readers/trl.py), written by a real
transformers Trainer run with TRL's GRPO metric names (conftest.trl_run): the file, a checkpoint
folder, the output folder (newest checkpoint), and a trainer_state.json caught while being written."""

import json
import shutil

import numpy as np
import pytest

from mcore_proxy.diagnose.aliases import canonical_metrics
from mcore_proxy.diagnose.readers import read_log
from mcore_proxy.core.errors import LogError


def test_output_folder_reads_the_newest_checkpoint(trl_run):
    _, out = trl_run
    run = read_log(out)
    assert run.format == "trl-state" and run.source == str(out / "checkpoint-6" / "trainer_state.json")
    assert canonical_metrics(run.metrics) == {
        "reward": "reward",
        "kl_loss": "kl",
        "entropy": "entropy",
        "grad_norm": "grad_norm",
        "response_length": "completions/mean_length",
        "clipfrac": "clip_ratio/region_mean",
    }
    assert run.metrics["loss"].steps.tolist() == list(range(1, 7))
    np.testing.assert_allclose(run.metrics["kl"].values, 0.001 * np.arange(1, 7))
    assert run.metrics["eval_loss"].steps.tolist() == [3, 6]
    assert run.metrics["rewards/accuracy_reward/mean"].values[-1] == pytest.approx(0.6)


def test_checkpoint_folder_and_file(trl_run):
    _, out = trl_run
    assert read_log(out / "checkpoint-4").metrics["loss"].steps.tolist() == [1, 2, 3, 4]
    assert read_log(out / "checkpoint-2" / "trainer_state.json").metrics["loss"].steps.tolist() == [1, 2]


def test_top_level_state_after_save_state_wins_over_older_checkpoints(trl_run, tmp_path):
    _, out = trl_run
    folder = tmp_path / "out"
    shutil.copytree(out / "checkpoint-4", folder / "checkpoint-4")
    shutil.copy(out / "checkpoint-6" / "trainer_state.json", folder / "trainer_state.json")
    run = read_log(folder)
    assert run.source == str(folder / "trainer_state.json") and run.metrics["loss"].steps[-1] == 6


def test_state_being_written_and_wrong_json(trl_run, tmp_path):
    _, out = trl_run
    text = (out / "checkpoint-6" / "trainer_state.json").read_text()
    half = tmp_path / "checkpoint-8" / "trainer_state.json"
    half.parent.mkdir()
    half.write_text(text[: len(text) // 2])
    with pytest.raises(LogError, match="not complete JSON .*read it again"):
        read_log(half)
    other = tmp_path / "trainer_state.json"
    other.write_text(json.dumps({"global_step": 3}))
    with pytest.raises(LogError, match="no 'log_history' list"):
        read_log(other)
