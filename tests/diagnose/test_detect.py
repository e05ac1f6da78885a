"""Early-warning detectors on synthetic curves with faults from known steps: each fires on its
trouble with an onset near the true one, and none fires on the healthy run."""

import numpy as np
import pytest

from mcore_proxy.diagnose.detect import Settings, collapse, detect, plateau, rising, spike
from mcore_proxy.diagnose.series import RunLog, Series


def runlog(data: dict, name="run") -> RunLog:
    return RunLog(name, "jsonl", {k: Series(np.arange(len(v)), v) for k, v in data.items()})


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_healthy_run_is_quiet(synthetic, seed):
    healthy = runlog(synthetic.curves(seed=seed))
    assert detect(healthy) == []
    # against another healthy run of the same setting (other seed): no divergence either
    assert detect(healthy, runlog(synthetic.curves(seed=seed + 10))) == []


def test_rising_log_prob_difference_found_near_its_onset(synthetic):
    run = runlog(synthetic.curves("precision", onset=60))
    found = {(f.detector, f.metric): f for f in detect(run)}
    assert set(found) == {("rising", "logprob_diff")}
    assert 58 <= found["rising", "logprob_diff"].onset <= 62
    # seen while the run grows: a prefix with 5 steps after the onset already alerts
    s = run.metrics["training/rollout_probs_diff_mean"]
    early = rising("logprob_diff", s.window(0, 64), Settings())
    assert early is not None and 58 <= early.onset <= 62
    assert rising("logprob_diff", s.window(0, 59), Settings()) is None  # before the onset: nothing


def test_rising_needs_the_shift_to_persist():
    values = np.r_[np.zeros(20), 1.0, 1.0]  # a constant shift of the last two points only
    s = Series(np.arange(22), values)
    assert rising("logprob_diff", s, Settings()) is None
    assert rising("logprob_diff", s, Settings(persist=2)) is not None


def test_divergence_from_the_baseline(synthetic):
    base = runlog(synthetic.curves(seed=0))
    run = runlog(synthetic.curves("omission", seed=0, onset=30))
    found = {(f.detector, f.metric): f for f in detect(run, base)}
    assert ("diverge", "reward") in found
    assert 25 <= found["diverge", "reward"].onset <= 45
    assert found["diverge", "reward"].value < 0


def test_plateau_onset_is_the_last_improvement():
    t = np.arange(60.0)
    reward = np.where(t < 20, 0.01 * t, 0.19 - 0.001 * (t - 20))  # improves until step 19, then not
    found = plateau(Series(t.astype(int), reward), Settings(patience=20))
    assert found is not None and found.onset == 19
    assert plateau(Series(t[:35].astype(int), reward[:35]), Settings(patience=20)) is None


def test_entropy_collapse_and_grad_norm_spike():
    rng = np.random.default_rng(0)
    t = np.arange(50)
    entropy = np.where(t < 30, 1.0, 0.2) + rng.normal(0, 0.01, 50)
    found = collapse("entropy", Series(t, entropy), Settings())
    assert found is not None and 27 <= found.onset <= 31
    assert collapse("entropy", Series(t[:30], entropy[:30]), Settings()) is None
    grad = 1.0 + rng.normal(0, 0.1, 50)
    assert spike("grad_norm", Series(t, grad), Settings()) is None
    grad[37] = 40.0
    found = spike("grad_norm", Series(t, grad), Settings())
    assert found is not None and found.onset == 37


def test_settings_refuse_nonsense():
    with pytest.raises(ValueError, match="collapse"):
        Settings(collapse=1.5)
    with pytest.raises(ValueError, match=">= 1"):
        Settings(window=0)


def test_divergence_needs_a_shift_that_matters(synthetic):
    base = synthetic.curves(seed=0)
    tiny = {k: v.copy() for k, v in base.items()}
    tiny["critic/score/mean"][40:] += 0.002  # significant (same noise), but 1/15 of the noise
    big = {k: v.copy() for k, v in base.items()}
    big["critic/score/mean"][40:] -= 0.1
    assert detect(runlog(tiny), runlog(base)) == []
    found = detect(runlog(big), runlog(base))
    assert [(f.detector, f.metric) for f in found] == [("diverge", "reward")] and 38 <= found[0].onset <= 42
    assert detect(runlog(tiny), runlog(base), Settings(effect=0.01))[0].metric == "reward"
