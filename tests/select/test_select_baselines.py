import numpy as np
import pytest

from mcore_proxy.core.errors import StatsError
from mcore_proxy.select import baselines
from mcore_proxy.core.stats import LayerStats


def layer(freq, gate_mass=None, saliency=None):
    freq = np.asarray(freq, dtype=np.int64)
    e = freq.shape[0]
    gm = np.asarray(gate_mass if gate_mass is not None else freq, dtype=np.float64)
    sal = None if saliency is None else np.asarray(saliency, dtype=np.float64)
    return LayerStats(int(freq.sum()), freq, gm, np.diag(freq), np.ones((e, 2)), sal)


RNG = np.random.default_rng(0)


def test_top_k_breaks_ties_by_lowest_id():
    assert baselines.top_k(np.array([1.0, 3.0, 3.0, 2.0, 3.0]), 2) == [1, 2]
    assert baselines.top_k(np.array([1.0, 3.0, 3.0, 2.0, 3.0]), 2, np.array([0, 3, 4])) == [3, 4]


def test_frequency_keeps_top_k_by_freq():
    s = layer([5, 9, 0, 7, 1])
    assert baselines.top_k(baselines.ranking_scores("frequency", s, RNG), 2) == [1, 3]


def test_gate_mass_keeps_top_k_by_gate_mass():
    s = layer([5, 9, 0, 7, 1], gate_mass=[4.0, 0.5, 0.0, 0.1, 3.0])
    assert baselines.top_k(baselines.ranking_scores("gate-mass", s, RNG), 2) == [0, 4]


def test_saliency_is_per_activation_and_never_selected_rank_last():
    # saliency / freq = [2, 1, -, 3, 0.5]
    s = layer([5, 10, 0, 2, 2], saliency=[10.0, 10.0, 0.0, 6.0, 1.0])
    scores = baselines.ranking_scores("saliency", s, RNG)
    assert baselines.top_k(scores, 2) == [0, 3]
    assert baselines.top_k(scores, 4) == [0, 1, 3, 4]


def test_saliency_without_saliency_sum_is_refused():
    with pytest.raises(StatsError, match="no saliency_sum for layer 7.*another --method"):
        baselines.ranking_scores("saliency", layer([1, 2, 3]), RNG, "7")


def test_first_k_keeps_the_lowest_ids():
    assert baselines.top_k(baselines.ranking_scores("first-k", layer([0, 0, 9, 9]), RNG), 2) == [0, 1]


def test_random_is_seeded_uniform_subset():
    s = layer(np.ones(16, dtype=np.int64))

    def pick(seed):
        return baselines.top_k(baselines.ranking_scores("random", s, np.random.default_rng(seed)), 4)

    assert pick(3) == pick(3)
    assert len(set(pick(3))) == 4 and all(0 <= i < 16 for i in pick(3))
    assert len({tuple(pick(seed)) for seed in range(10)}) > 1
