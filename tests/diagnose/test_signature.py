"""Signatures of known shifts: direction, size, trend and onset are found where they were put,
and a rerun with another seed (no fault) shows none."""

import json

import numpy as np
import pytest

from mcore_proxy.diagnose.series import Series
from mcore_proxy.diagnose.signature import FaultSignature, align, metric_signature

STEPS = np.arange(120)


def sig(metric, base, fault, **kw):
    return metric_signature(metric, Series(STEPS, base[metric]), Series(STEPS, fault[metric]), **kw)


def test_update_omission_suppresses_reward_growing_gap(synthetic):
    base, fault = synthetic.curves(), synthetic.curves("omission", onset=30)
    s = sig("critic/score/mean", base, fault)
    assert s.direction == -1 and s.trend == -1 and s.slope < 0
    assert 20 <= s.onset <= 45
    assert s.shift < -0.1 and s.p_shift < 0.01


def test_precision_fault_jumps_at_its_onset_and_grows(synthetic):
    base, fault = synthetic.curves(), synthetic.curves("precision", onset=60)
    s = sig("training/rollout_probs_diff_mean", base, fault)
    assert s.direction == 1 and s.trend == 1 and abs(s.onset - 60) <= 2
    k = sig("actor/kl_loss", base, fault)
    assert k.direction == 1 and abs(k.onset - 60) <= 3


def test_constant_shift_has_no_trend(synthetic):
    base, fault = synthetic.curves(), synthetic.curves("noise", onset=40)
    s = sig("actor/entropy", base, fault)
    assert s.direction == 1 and s.trend == 0 and abs(s.onset - 40) <= 2
    assert s.shift == pytest.approx(0.08, abs=0.01)


def test_no_fault_no_signature(synthetic):
    base = synthetic.curves()
    other_seed = synthetic.curves(seed=1)
    for metric in base:
        s = sig(metric, base, other_seed)
        assert s.direction == 0, (metric, s)
    same = sig("actor/entropy", base, base)
    assert same.direction == 0 and same.onset is None and same.note == "no departure from the baseline"


def test_too_short_and_alignment(synthetic):
    s = metric_signature("x", Series(np.arange(5), np.ones(5)), Series(np.arange(5), np.zeros(5)))
    assert s.direction == 0 and "only 5 common steps" in s.note
    # logged every 2 steps vs every 3: interpolated onto the baseline's steps in the overlap
    base, fault = Series(np.arange(0, 60, 2), np.arange(30.0)), Series(np.arange(0, 61, 3), np.arange(21.0) * 1.5)
    steps, b, f = align(base, fault)
    assert steps.tolist() == list(range(0, 60, 2)) and np.allclose(f, b)


def test_json_round_trip(synthetic):
    base, fault = synthetic.curves(), synthetic.curves("omission", onset=30)
    fs = FaultSignature(
        "base.jsonl", "fault.jsonl", {"reward": sig("critic/score/mean", base, fault)}, label="update_omission"
    )
    again = FaultSignature.from_dict(json.loads(json.dumps(fs.to_dict())))
    assert again == fs
    with pytest.raises(ValueError, match="not a mcore-proxy-signature/1"):
        FaultSignature.from_dict({"format": "other"})
