"""Fixtures of the fault tests: scenarios of real megatron-core training steps, run once per session
in a fresh interpreter (tests/faults/scripts/scenarios.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
SCRIPT = HERE / "scripts" / "scenarios.py"
REPO = HERE.parents[1]

# name -> spec ("none": no injector; names ending in _closed: attached, then closed before training)
SCENARIOS = {
    "none": "none",
    "router_noise": "router_noise:std=0.5,start=1",
    "router_noise_layer": "router_noise:std=0.5,layers=2",
    "router_noise_off": "router_noise:std=0.5,start=100",
    "router_noise_closed": "router_noise:std=0.5",
    "router_weight": "router_weight:std=0.5,steps=0,2",
    "router_weight_again": "router_weight:std=0.5,steps=0,2",
    "router_weight_off": "router_weight:std=0.5,start=100",
    "router_precision": "router_precision:dtype=bf16",
    "router_precision_off": "router_precision:start=100",
    "router_tie_flip": "router_tie_flip:margin=0.05",
    "router_tie_flip_off": "router_tie_flip:margin=0.05,start=100",
    "topk_swap": "topk:mode=swap,rate=0.25,layers=0",
    "topk_drop": "topk:mode=drop,rate=0.25,layers=0",
    "topk_off": "topk:rate=0.25,start=100",
    "expert_noise": "expert_noise:std=0.01",
    "expert_noise_off": "expert_noise:std=0.01,start=100",
    "logprob_bf16": "logprob_precision:dtype=bf16",
    "logprob_fp16": "logprob_precision:dtype=fp16,when=always",
    "logprob_rollout_only": "logprob_precision:when=rollout",
    "logprob_off": "logprob_precision:start=100",
    "omit_every2": "update_omission:every=2",
    "omit_experts": "update_omission:group=experts",
    "omit_dense": "update_omission:group=dense",
    "omit_off": "update_omission:start=100",
    "combined": "router_noise:std=0.5,start=1;update_omission:every=2;logprob_precision",
}


STANDIN = REPO / "tests" / "trace" / "mindspeed_standin"
PATCHES = REPO / "patches"


def same(a, b) -> bool:
    """Bit-identical nested records (dicts, lists, tensors, plain values)."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def user_env(*pythonpath, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MCORE_PROXY_")}
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in pythonpath)
    env["OMP_NUM_THREADS"] = "1"
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_scenarios(out: Path, args: list[str], env: dict) -> dict:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(out), *args], env=env, capture_output=True, text=True, timeout=900, cwd=HERE
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out)


@pytest.fixture(scope="session")
def scenarios(tmp_path_factory):
    """name -> record of that scenario (see scripts/scenarios.py)."""
    out = tmp_path_factory.mktemp("fault_scenarios") / "runs.pt"
    return run_scenarios(out, [f"{n}={s}" for n, s in SCENARIOS.items()], user_env())


@pytest.fixture(scope="session")
def helpers():
    """Plain helpers of these tests: same(a, b), user_env(*pythonpath, **env), run_scenarios, paths."""
    from types import SimpleNamespace

    return SimpleNamespace(
        same=same,
        user_env=user_env,
        run_scenarios=run_scenarios,
        PATCHES=PATCHES,
        STANDIN=STANDIN,
        REPO=REPO,
        SCENARIOS=SCENARIOS,
    )
