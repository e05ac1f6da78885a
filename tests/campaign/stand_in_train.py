"""A stand-in for a training command (not a trainer): writes a verl-style JSONL metric log whose
curves depend on the fault it was given through MCORE_PROXY_FAULTS, the way the campaign hands a
fault to any launcher. router_noise lowers the reward from step 10 by 0.5 x std; logprob_precision
raises the log-prob difference from step 0. --fail exits 3 after a few steps; --delay (or STAND_IN_DELAY) sleeps per
step, so a real signal can arrive mid-run. It records the fault text it saw in seen_fault.txt."""

import argparse
import json
import os
import re
import time
from pathlib import Path

import numpy as np

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=60)
p.add_argument("--seed", type=int, default=0)
p.add_argument("--delay", type=float, default=float(os.environ.get("STAND_IN_DELAY", "0")))
p.add_argument("--fail", action="store_true")
args = p.parse_args()
out = Path(args.out)
out.mkdir(parents=True, exist_ok=True)
fault = os.environ.get("MCORE_PROXY_FAULTS", "")
(out / "seen_fault.txt").write_text(fault)
noise = re.search(r"router_noise:std=([0-9.]+)", fault)
rng = np.random.default_rng(args.seed)
with open(out / "metrics.jsonl", "w") as f:
    for step in range(args.steps):
        reward = 0.2 + 0.5 * (1 - np.exp(-step / 20)) + rng.normal(0, 0.02)
        diff = abs(rng.normal(0, 1e-5))
        if noise and step >= 10:
            reward -= 0.5 * float(noise.group(1))
        if "logprob_precision" in fault:
            diff += 0.002
        f.write(
            json.dumps(
                {"step": step, "data": {"critic/score/mean": reward, "training/rollout_logprob_diff_mean": diff}}
            )
            + "\n"
        )
        f.flush()
        if args.fail and step == 3:
            raise SystemExit(3)
        time.sleep(args.delay)
