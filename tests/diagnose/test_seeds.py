"""compare over seeds (diagnose/seeds.py): the seeds are the replicates, so a fault that no short
run proves alone is proven by several, and a proxy that does not follow is still refused."""

from __future__ import annotations

import numpy as np
import pytest

from mcore_proxy.diagnose.compare import compare_runs
from mcore_proxy.diagnose.seeds import SeedsComparison, across_seeds, aligned, onset_range
from mcore_proxy.diagnose.series import RunLog, Series
from mcore_proxy.diagnose.signature import align


def log(name: str, data: dict) -> RunLog:
    return RunLog(name, "jsonl", {k: Series(np.arange(len(v)), v) for k, v in data.items()})


def over_seeds(
    synthetic, orig, proxy, *, seeds=5, steps=15, onset=3, proxy_onset=None, swapped=(), metrics=("reward",)
):
    """SeedsComparison of synthetic runs: the original runs fault `orig`, the proxy `proxy` (seeds
    in `swapped`: the proxy's baseline and faulted run exchanged, so its shift points the other way)."""
    curves = synthetic.curves
    comparisons = []
    for s in range(seeds):
        proxy_runs = [
            curves(seed=s + 50, steps=steps, scale=0.8),
            curves(proxy, seed=s + 50, steps=steps, scale=0.8, onset=onset if proxy_onset is None else proxy_onset),
        ]
        if s in swapped:
            proxy_runs.reverse()
        logs = {
            "orig_base": log("ob", curves(seed=s, steps=steps)),
            "orig_fault": log("of", curves(orig, seed=s, steps=steps, onset=onset)),
            "proxy_base": log("pb", proxy_runs[0]),
            "proxy_fault": log("pf", proxy_runs[1]),
        }
        comparisons.append(compare_runs(logs, list(metrics)))
    return SeedsComparison(tuple(comparisons))


def test_short_runs_no_seed_proves_alone_prove_the_fault_together(synthetic):
    """15 steps, reward frozen from step 3 in both models: one run's block test (3 blocks) calls
    the drop significant in 3 of 5 seeds only; the five seeds together put it far beyond their
    spread, and every seed's shifts point down in both models."""
    result = over_seeds(synthetic, "omission", "omission")
    assert sum(c.consistent for c in result.comparisons) == 3
    reward = result.metrics["reward"]
    assert reward.orig.signature.direction == -1 and reward.orig.signature.p_shift < 1e-3
    assert reward.proxy.signature.direction == -1 and all(x < 0 for x in reward.proxy.shifts)
    assert result.agreeing == 5 and result.consistent
    assert result.verdict().startswith("CONSISTENT over 5 seeds")


def test_a_proxy_that_does_not_shift_does_not_reproduce(synthetic):
    result = over_seeds(synthetic, "omission", None)
    assert not result.consistent and result.agreeing == 0
    assert "the seed-mean signatures differ in reward (direction -1 vs +0" in result.verdict()


def test_without_a_fault_there_is_nothing_to_reproduce(synthetic):
    result = over_seeds(synthetic, None, None)
    assert not result.consistent and not result.departed
    assert "inconclusive" in result.verdict()


def test_onsets_the_seeds_tell_apart_do_not_agree(synthetic):
    """A sharp shift at step 30 in the original and at 80 in the proxy: far outside the window, and
    the resampled seeds' onset ranges do not overlap."""
    result = over_seeds(
        synthetic, "precision", "precision", steps=120, onset=30, proxy_onset=80, metrics=("logprob_diff",)
    )
    match = result.metrics["logprob_diff"].match
    assert match.orig.onset_range[1] < match.proxy.onset_range[0]
    assert not match.onset and not result.consistent
    assert "over seeds [" in result.verdict()


def test_one_seed_the_other_way_counts_against_the_share(synthetic):
    result = over_seeds(synthetic, "omission", "omission", swapped=(4,))
    assert result.metrics["reward"].proxy.shifts[4] > 0
    assert result.agreeing == 4 and result.unreproduced(4) == ["reward"] and result.consistent
    assert not SeedsComparison(result.comparisons, min_share=1.0).consistent


def test_onset_range_brackets_the_onset_and_is_repeatable(synthetic):
    result = over_seeds(synthetic, "precision", "precision", steps=60, onset=20, metrics=("logprob_diff",))
    pairs = [
        (c.series["logprob_diff"]["orig_base"], c.series["logprob_diff"]["orig_fault"]) for c in result.comparisons
    ]
    steps, base, fault = aligned([align(b, f) for b, f in pairs])
    assert base.shape == fault.shape == (5, 60)
    lo, hi = onset_range(steps, base, fault)
    assert lo <= 20 <= hi and [lo, hi] == onset_range(steps, base, fault)
    assert onset_range(steps, base, base) is None  # no shift: no onset in any draw


@pytest.mark.parametrize(
    "shifts, expected",
    [([0.1, 0.1, 0.1], (1, 0.0)), ([0.0, 0.0], (0, 1.0)), ([0.5], (0, 1.0)), ([-1.0, -1.1, -0.9, -1.05], (-1, None))],
)
def test_across_seeds(shifts, expected):
    direction, p = across_seeds(shifts)
    assert direction == expected[0]
    if expected[1] is not None:
        assert p == expected[1]
    else:
        assert p < 1e-3
