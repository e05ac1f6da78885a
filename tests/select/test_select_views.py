import numpy as np
import pytest

from mcore_proxy.select import views


def check_distance_matrix(d):
    assert np.allclose(d, d.T)
    assert np.all(np.diag(d) == 0)
    assert np.all(d >= 0)


def test_cosine_distance_by_hand():
    d = views.router_distance(np.array([[1.0, 0.0], [0.0, 2.0], [3.0, 3.0]]), "cosine")
    check_distance_matrix(d)
    assert d[0, 1] == pytest.approx(1.0)
    assert d[0, 2] == pytest.approx(1 - 1 / np.sqrt(2))
    assert d[1, 2] == pytest.approx(1 - 1 / np.sqrt(2))


def test_zero_row_is_orthogonal_to_everything():
    d = views.cosine_distance(np.array([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0]]))
    assert d[0, 1] == pytest.approx(1.0) and d[0, 2] == pytest.approx(1.0)


def test_euclidean_distance_by_hand():
    d = views.router_distance(np.array([[0.0, 0.0], [3.0, 4.0], [3.0, 0.0]]), "euclidean")
    check_distance_matrix(d)
    assert d[0, 1] == pytest.approx(5.0)
    assert d[1, 2] == pytest.approx(4.0)


def test_unknown_metric_and_mode_raise():
    with pytest.raises(ValueError, match="router metric"):
        views.router_distance(np.eye(2), "manhattan")
    with pytest.raises(ValueError, match="co-activation mode"):
        views.coactivation_distance(np.eye(2, dtype=np.int64), np.ones(2), "friends")


# freq [4, 4, 1, 0]: C01 = 2 -> 2/sqrt(16) = 0.5; C02 = 1 -> 1/sqrt(4) = 0.5; C12 = 0
FREQ = np.array([4, 4, 1, 0])
COACT = np.array([[4, 2, 1, 0], [2, 4, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0]])


def test_coactivation_partners_by_hand():
    d = views.coactivation_distance(COACT, FREQ, "partners")
    check_distance_matrix(d)
    assert d[0, 1] == pytest.approx(0.5) and d[0, 2] == pytest.approx(0.5)
    assert d[1, 2] == pytest.approx(0.0)
    # expert 3 was never selected: neutral, the mean of the defined pairs (0.5 + 0.5 + 0) / 3
    assert d[3, :3] == pytest.approx([1 / 3] * 3)


def test_coactivation_substitutes_by_hand():
    d = views.coactivation_distance(COACT, FREQ, "substitutes")
    check_distance_matrix(d)
    assert d[0, 1] == pytest.approx(0.5) and d[1, 2] == pytest.approx(1.0)
    assert d[3, :3] == pytest.approx([2 / 3] * 3)


def test_prototype_distance_uses_means_and_neutralises_dead_experts():
    proto_sum = np.array([[2.0, 0.0], [0.0, 5.0], [3.0, 3.0], [0.0, 0.0]])
    d = views.prototype_distance(proto_sum, FREQ)
    means = proto_sum[:3] / FREQ[:3, None]
    assert d[:3, :3] == pytest.approx(views.cosine_distance(means))
    defined = d[:3, :3][np.triu_indices(3, 1)]
    assert d[3, :3] == pytest.approx([defined.mean()] * 3)
