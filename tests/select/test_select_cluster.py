import numpy as np
import pytest

from mcore_proxy.select.cluster import kmedoids, representatives, restart_seeds

# Two groups {0, 1, 2} and {3, 4}: in the first, expert 1 is the only best medoid (cost 1 + 1
# against 2 + 1 for experts 0 and 2); the second costs 1 whichever medoid. Optimal loss 3.
D5 = np.array([[0, 1, 2, 9, 9], [1, 0, 1, 9, 9], [2, 1, 0, 9, 9], [9, 9, 9, 0, 1], [9, 9, 9, 1, 0]], dtype=float)


def partition(labels):
    return sorted(sorted(np.flatnonzero(labels == c).tolist()) for c in np.unique(labels))


def test_five_by_five_known_medoids():
    c = kmedoids(D5, 2, seed=0, restarts=4)
    assert partition(c.labels) == [[0, 1, 2], [3, 4]]
    assert 1 in c.medoids.tolist()
    assert c.loss == pytest.approx(3.0)
    assert c.labels[c.medoids[c.labels[1]]] == c.labels[1]


def test_one_cluster_takes_the_central_medoid():
    c = kmedoids(D5[:3, :3], 1, seed=0, restarts=1)
    assert c.medoids.tolist() == [1] and c.loss == pytest.approx(2.0)


def test_more_clusters_than_points_is_refused():
    with pytest.raises(ValueError, match="cannot make 6 clusters of 5"):
        kmedoids(D5, 6)


def test_restarts_are_deterministic_and_keep_the_lowest_loss():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(40, 5))
    d = np.sqrt(((x[:, None] - x[None]) ** 2).sum(-1))
    runs = [kmedoids(d, 6, seed=7, restarts=5) for _ in range(2)]
    assert runs[0].medoids.tolist() == runs[1].medoids.tolist()
    assert runs[0].labels.tolist() == runs[1].labels.tolist()
    assert runs[0].loss <= kmedoids(d, 6, seed=7, restarts=1).loss + 1e-12
    assert restart_seeds(7, 5) == restart_seeds(7, 5) != restart_seeds(8, 5)


LABELS = np.array([0, 0, 0, 1, 1])
MEDOIDS = np.array([1, 3])


def test_representative_is_most_frequent_member():
    reps = representatives(LABELS, MEDOIDS, np.array([1, 2, 9, 2, 7]))
    assert reps == [([0, 1, 2], 2), ([3, 4], 4)]


def test_representative_ties_go_to_medoid_then_lowest_id():
    # 0 and 1 tie, 1 is the medoid -> 1; 3 and 4 tie, 3 is the medoid -> 3
    assert representatives(LABELS, MEDOIDS, np.array([5, 5, 1, 2, 2])) == [([0, 1, 2], 1), ([3, 4], 3)]
    # 0 and 2 tie, neither is the medoid -> the lowest id, 0
    assert representatives(LABELS, MEDOIDS, np.array([5, 1, 5, 2, 2]))[0] == ([0, 1, 2], 0)


def test_never_selected_expert_wins_only_a_dead_cluster():
    # the medoid 1 was never selected: the selected member 0 wins; cluster {3, 4} is all dead
    reps = representatives(LABELS, MEDOIDS, np.array([3, 0, 0, 0, 0]))
    assert reps == [([0, 1, 2], 0), ([3, 4], 3)]


@pytest.mark.parametrize("n", [1, 5, 12])
def test_all_zero_distances_still_give_k_distinct_medoids(n):
    # BUILD stops after one medoid at loss 0; that restart must not be chosen, and with a
    # single restart (BUILD only) the medoids are completed
    d = np.zeros((n, n))
    for k in range(1, n + 1):
        for restarts in (1, 4):
            c = kmedoids(d, k, seed=3, restarts=restarts)
            assert len(set(c.medoids.tolist())) == k and c.loss == 0.0
            assert sorted(set(c.labels.tolist())) == list(range(k))  # no empty cluster
            assert (c.labels[c.medoids] == np.arange(k)).all()  # medoid in its own cluster


def test_zero_blocks_and_ties_give_k_clusters_and_the_log_says_restarts_disagree(caplog):
    rng = np.random.default_rng(0)
    x = rng.random((12, 12))
    d = (x + x.T) / 2
    d[:9, :9] = 0.0  # nine experts never co-activated (partners distance 0): BUILD stops at 4
    np.fill_diagonal(d, 0.0)
    with caplog.at_level("INFO", logger="mcore_proxy.select.cluster"):
        c = kmedoids(d, 6, seed=0, restarts=8)
    assert len(set(c.medoids.tolist())) == 6
    assert sorted(set(c.labels.tolist())) == list(range(6))
    assert "restarts returned fewer than k distinct medoids" in caplog.text
    assert c.loss == pytest.approx(sum(d[i, c.medoids[c.labels[i]]] for i in range(12)))


def test_complete_medoids_adds_farthest_points_first():
    from mcore_proxy.select.cluster import complete_medoids

    assert complete_medoids(D5, [1], 2).tolist() == [1, 3]  # 3 and 4 tie at 9: lowest id
    assert complete_medoids(np.zeros((3, 3)), [], 3).tolist() == [0, 1, 2]
