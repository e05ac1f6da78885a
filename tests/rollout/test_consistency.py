"""The pure measures of `rollout/consistency.py` on hand-made choices (no engine needed)."""

from __future__ import annotations

import torch

from mcore_proxy.rollout.consistency import average_ranks, decision_disagreement, differing_experts, spearman


def test_decision_disagreement_counts_choices_not_in_the_other_set():
    a = torch.tensor([[0, 1], [2, 3], [4, 5]])
    b = torch.tensor([[1, 0], [2, 6], [7, 8]])  # same set in another order; one of two; none
    assert decision_disagreement(a, b).tolist() == [0.0, 0.5, 1.0]
    assert differing_experts(a, b, 9).tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 1]


def test_ranks_and_rank_correlation():
    assert average_ranks([3, 1, 3]).tolist() == [2.5, 1.0, 2.5]
    assert spearman([0.1, 0.3, 0.2], [1, 3, 2]) == 1.0
    assert spearman([1, 2, 3], [3, 2, 1]) == -1.0
    assert spearman([1, 2, 3], [5, 5, 5]) is None  # a constant side has no ranking
