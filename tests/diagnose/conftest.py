"""Synthetic but realistic metric curves for the signature and comparison tests: a noisy rising
reward, a flat KL and log-prob difference; faults shift them in known ways from known steps."""

from __future__ import annotations

import json

import numpy as np
import pytest

DATA = __import__("pathlib").Path(__file__).parents[1] / "data"


def curves(
    fault: str | None = None, steps: int = 120, seed: int = 0, onset: int = 0, scale: float = 1.0, strength: float = 1.0
) -> dict[str, np.ndarray]:
    """name -> values at steps 0..steps-1 (verl metric names). `scale`: of the reward curve (another
    model); `strength`: of the fault's effect."""
    rng = np.random.default_rng(seed)
    t = np.arange(steps, dtype=float)
    reward = scale * (0.2 + 0.6 * (1 - np.exp(-t / 40))) + rng.normal(0, 0.03, steps)
    kl = 0.002 + 0.00002 * t + rng.normal(0, 0.0003, steps)
    diff = np.abs(rng.normal(0, 1e-4, steps))
    entropy = 1.0 - 0.002 * t + rng.normal(0, 0.01, steps)
    on = t >= onset
    if fault == "omission":  # reward stops improving at the onset
        frozen = scale * (0.2 + 0.6 * (1 - np.exp(-onset / 40)))
        reward = np.where(on, (1 - strength) * reward + strength * (frozen + rng.normal(0, 0.03, steps)), reward)
    elif fault == "precision":  # log-prob difference and KL jump at the onset and keep growing
        diff = diff + on * strength * (0.004 + 0.00005 * (t - onset))
        kl = kl + on * strength * (0.001 + 0.00003 * (t - onset))
    elif fault == "noise":  # entropy up, reward slightly down
        entropy = entropy + on * 0.08 * strength
        reward = reward - on * 0.05 * scale * strength
    return {
        "critic/score/mean": reward,
        "actor/kl_loss": kl,
        "training/rollout_probs_diff_mean": diff,
        "actor/entropy": entropy,
    }


def write_jsonl(path, data: dict[str, np.ndarray], drop: tuple = ()) -> str:
    n = len(next(iter(data.values())))
    with open(path, "w") as f:
        for step in range(n):
            f.write(
                json.dumps({"step": step, "data": {k: float(v[step]) for k, v in data.items() if k not in drop}}) + "\n"
            )
    return str(path)


def write_verl_console(path, data: dict[str, np.ndarray]) -> str:
    """The curves as a verl console log: each step's record as verl's `concat_dict_to_str` prints it
    (`step:N - key:pformat(value)`, numpy 2 scalars as `np.float64(x)`; see tests/data/verl_console.log
    for lines printed by verl itself) behind a Ray prefix, between tqdm bar updates and a warning."""
    import pprint

    n = len(next(iter(data.values())))
    with open(path, "w") as f:
        f.write("(TaskRunner pid=7) TaskRunner hostname: node-1\n(WorkerDict pid=8) UserWarning: something\n")
        for step in range(n):
            record = " - ".join(
                [f"step:{step}"] + [f"{k}:{pprint.pformat(np.float64(v[step]))}" for k, v in data.items()]
            )
            f.write(f"(TaskRunner pid=7) {record}\n")
            f.write(
                f"(TaskRunner pid=7) Training Progress: {step}/{n} [00:01<00:02]\rTraining Progress: {step + 1}/{n}\n"
            )
    return str(path)


@pytest.fixture
def synthetic():
    from types import SimpleNamespace

    return SimpleNamespace(curves=curves, write_jsonl=write_jsonl, write_verl_console=write_verl_console, DATA=DATA)
