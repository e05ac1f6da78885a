"""Smoke test of the RL demonstration (examples/rl_faults): two GRPO steps of a tiny untrained
megatron-core MoE on bench/quality's task, a fault from the environment; its logs are read back by
the diagnose readers. The demonstration itself (an hour of CPU) is not part of the suite."""

import json
import subprocess
import sys

import pytest

quality = pytest.importorskip("bench.quality.task", reason="the RL demonstration uses bench/quality's task (issue 13)")

from mcore_proxy.diagnose.aliases import canonical_metrics  # noqa: E402
from mcore_proxy.diagnose.readers import read_log  # noqa: E402

pytestmark = pytest.mark.megatron

MAKE = """
import dataclasses, sys
from bench.quality import model as qmodel
from mcore_proxy.functional.cpu import destroy_distributed, free_port, init_distributed
init_distributed(0, 1, free_port())
tiny = dataclasses.replace(qmodel.SHAPES["coarse"], hidden_size=32, ffn_hidden_size=64, num_experts=4,
                           moe_ffn_hidden_size=16)
qmodel.save(qmodel.build(tiny), tiny, sys.argv[1], 1)
destroy_distributed()
"""


def test_two_grpo_steps_with_a_fault_from_the_environment(tmp_path, helpers):
    from pathlib import Path

    env = helpers.user_env(helpers.PATCHES, helpers.REPO, Path(quality.__file__).parents[2])
    proc = subprocess.run(
        [sys.executable, "-c", MAKE, str(tmp_path / "ckpt")], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    env.update(MCORE_PROXY_FAULTS="update_omission:start=1", MCORE_PROXY_FAULTS_REPORT=str(tmp_path / "f.json"))
    proc = subprocess.run(
        [
            sys.executable,
            str(helpers.REPO / "examples" / "rl_faults" / "grpo.py"),
            "--ckpt",
            str(tmp_path / "ckpt"),
            "--out",
            str(tmp_path / "run"),
            "--steps",
            "2",
            "--prompts",
            "2",
            "--samples",
            "2",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    for log in (tmp_path / "run" / "tb", tmp_path / "run" / "metrics.jsonl"):
        run = read_log(log)
        assert set(canonical_metrics(run.metrics)) == {
            "reward",
            "kl_loss",
            "ppo_kl",
            "entropy",
            "grad_norm",
            "logprob_diff",
            "response_length",
            "clipfrac",
            "pg_loss",
        }
        assert run.metrics["critic/score/mean"].steps.tolist() == [0, 1]
    assert json.loads((tmp_path / "f.json").read_text())["report"][0]["active_steps"] == [1]
