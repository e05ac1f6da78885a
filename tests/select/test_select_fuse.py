import logging

import numpy as np
import pytest

from mcore_proxy.select.fuse import average_ranks, fuse, normalise


def sym(upper):
    """3x3 symmetric matrix from its upper triangle (d01, d02, d12)."""
    d = np.zeros((3, 3))
    d[np.triu_indices(3, 1)] = upper
    return d + d.T


def test_minmax_over_off_diagonal():
    n = normalise(sym([2.0, 4.0, 6.0]), "minmax")
    assert n[np.triu_indices(3, 1)] == pytest.approx([0.0, 0.5, 1.0])
    assert np.all(np.diag(n) == 0) and np.allclose(n, n.T)


def test_rank_normalisation_shares_ties():
    assert average_ranks(np.array([5.0, 1.0, 1.0])) == pytest.approx([2.0, 0.5, 0.5])
    n = normalise(sym([1.0, 1.0, 9.0]), "rank")
    assert n[np.triu_indices(3, 1)] == pytest.approx([0.25, 0.25, 1.0])


@pytest.mark.parametrize("how", ["minmax", "rank"])
def test_constant_view_adds_nothing(how, caplog):
    with caplog.at_level(logging.INFO):
        assert not normalise(sym([3.0, 3.0, 3.0]), how).any()
    assert "constant" in caplog.text


def test_unknown_normalisation_raises():
    with pytest.raises(ValueError, match="normalisation"):
        normalise(sym([1, 2, 3]), "zscore")


def test_fuse_is_weighted_mean_of_normalised_views():
    a, b = sym([0.0, 1.0, 2.0]), sym([10.0, 30.0, 20.0])
    na, nb = normalise(a), normalise(b)
    assert fuse({"a": a, "b": b}, {"a": 1, "b": 1}) == pytest.approx((na + nb) / 2)
    assert fuse({"a": a, "b": b}, {"a": 2, "b": 2}) == pytest.approx((na + nb) / 2)
    assert fuse({"a": a, "b": b}, {"a": 3, "b": 1}) == pytest.approx(0.75 * na + 0.25 * nb)
    assert fuse({"a": a, "b": b}, {"a": 1, "b": 0}) == pytest.approx(na)
    with pytest.raises(ValueError, match="sum to zero"):
        fuse({"a": a}, {"a": 0})
