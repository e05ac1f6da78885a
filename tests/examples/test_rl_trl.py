"""examples/rl_faults_trl/train_grpo.py, fast: two GRPO steps of TRL's GRPOTrainer on a tiny untrained
Qwen3-MoE, faults switched on by the environment only (`PYTHONPATH=patches`, `MCORE_PROXY_FAULTS`);
the injector report says each acted where it should, the expert weights did not move under
`update_omission:group=experts`, and the run's `trainer_state.json` is read by compare's reader."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl", reason="trl is not installed (the TRL example needs it: pip install trl)")

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "rl_faults_trl"
sys.path.insert(0, str(EXAMPLE))

import task_hf  # noqa: E402

FAULTS = "update_omission:group=experts;logprob_precision:dtype=bf16,when=no_grad"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    base = tmp_path_factory.mktemp("rl_trl")
    model_dir = base / "model"
    model = task_hf.build(
        seed=0,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=4,
    )
    model.save_pretrained(model_dir)
    task_hf.tokenizer().save_pretrained(model_dir)
    out = base / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MCORE_PROXY_")}
    env.update(
        PYTHONPATH=os.pathsep.join([str(REPO / "patches"), str(REPO)]),
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
        MCORE_PROXY_FAULTS=FAULTS,
        MCORE_PROXY_FAULTS_REPORT=str(base / "faults.json"),
    )
    proc = subprocess.run(
        [
            sys.executable,
            str(EXAMPLE / "train_grpo.py"),
            "--model",
            str(model_dir),
            "--out",
            str(out),
            "--steps",
            "2",
            "--dataset",
            "8",
            "--prompts",
            "4",
            "--samples",
            "2",
            "--lr",
            "1e-2",
            "--report-to",
            "none",
            "--save-model",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return model_dir, out, json.loads((base / "faults.json").read_text())


def test_injectors_acted_where_they_should(run):
    model_dir, out, report = run
    assert report["faults"] == FAULTS
    omission, precision = report["report"]
    # one call per optimizer step: the AdamW behind accelerate's AcceleratedOptimizer, once per step
    assert omission["calls"] == 2 and omission["active_steps"] == [0, 1]
    # no-grad passes: generation (one lm_head call per token) and the reference model's log-probs
    # through TRL's fused head; never the training pass
    assert precision["active_steps"] == [0, 1] and precision["active_calls"] >= 4
    from safetensors.torch import load_file

    before, after = load_file(model_dir / "model.safetensors"), load_file(out / "final" / "model.safetensors")
    experts = {k for k in before if ".mlp.experts." in k}
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert experts and moved and not moved & experts  # the rest trained, the experts never moved


def test_trainer_state_is_what_compare_reads(run):
    _, out, _ = run
    from mcore_proxy.diagnose.aliases import canonical_metrics
    from mcore_proxy.diagnose.readers import read_log

    log = read_log(out / "trainer_state.json")
    found = canonical_metrics(log.metrics)
    for metric in ("reward", "kl_loss", "logprob_diff", "rollout_kl", "entropy", "grad_norm"):
        assert metric in found, (metric, sorted(log.metrics))
    diff = log.metrics[found["logprob_diff"]]
    assert list(diff.steps) == [1, 2]
    assert min(diff.values) > 1e-5  # generation's logits rounded to bf16, training's not
    # the rollout-vs-training KL under verl's k3 name (non-negative), and its k1 beside it
    assert found["rollout_kl"] == "rollout_corr/k3_kl"
    k3 = log.metrics["rollout_corr/k3_kl"].values
    assert min(k3) > 0 and max(k3) < max(diff.values)  # ~ E[r^2]/2 of differences below 1
    assert "rollout_corr/kl" in log.metrics
    state = json.loads((out / "trainer_state.json").read_text())
    assert [h["step"] for h in state["log_history"] if "loss" in h] == [1, 2]
