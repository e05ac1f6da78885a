"""SwanLab offline runs (mcore_proxy/diagnose/readers/swanlab_run.py), written by swanlab itself in
offline mode (conftest.swanlog: two runs) and read back with swanlab's record reader."""

import pytest

from mcore_proxy.diagnose.aliases import canonical_metrics
from mcore_proxy.diagnose.readers import read_log
from mcore_proxy.core.errors import LogError


def test_offline_run(swanlog):
    folder = sorted(p for p in swanlog.iterdir() if p.is_dir())[0]
    run = read_log(folder)
    assert run.format == "swanlab"
    assert canonical_metrics(run.metrics) == {"kl_loss": "actor/kl_loss", "reward": "critic/score/mean"}
    assert run.metrics["actor/kl_loss"].steps.tolist() == list(range(10))
    assert run.metrics["critic/score/mean"].values[-1] == pytest.approx(0.45)
    scale = run.metrics["perf/loss_scale"]  # NaN and infinities are kept apart from the curve
    assert scale.nonfinite_steps.tolist() == [3, 5, 7] and scale.nonfinite_kinds() == {"NaN": 1, "+inf": 1, "-inf": 1}


def test_swanlog_with_two_runs_is_refused(swanlog):
    with pytest.raises(LogError, match=r"a SwanLab folder with 2 runs \(run-.*\); pass one run's folder"):
        read_log(swanlog)


def test_cut_and_foreign_files(swanlog, tmp_path):
    file = next(sorted(p for p in swanlog.iterdir() if p.is_dir())[0].glob("run-*.swanlab"))
    data = file.read_bytes()
    cut = tmp_path / "run-cut.swanlab"
    cut.write_bytes(data[: len(data) - 40])  # a run still writing: the read ends at the cut
    assert read_log(cut).metrics["actor/kl_loss"].steps[0] == 0
    other = tmp_path / "run-other.swanlab"
    other.write_bytes(b":SWL\xd6\xe1\x09" + data[7:])  # another format version
    with pytest.raises(LogError, match=r"swanlab cannot read it \(.*version.*\); or sync it"):
        read_log(other)
