"""examples/train_proxy_mindspeed_ptd.sh end to end on CPU: convert, then train the proxy with
the flags convert printed, in megatron-core on two gloo ranks (PP=2)."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mcore_proxy.checkpoint import open_checkpoint
from mcore_proxy.select.synthetic import planted_plan
from mcore_proxy.functional.cpu import free_port

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "train_proxy_mindspeed_ptd.sh"


def env() -> dict:
    return {**os.environ, "PYTHON": sys.executable, "MASTER_PORT": str(free_port()), "PYTHONWARNINGS": "ignore"}


@pytest.fixture(scope="module")
def launched(megatron_ckpt, tmp_path_factory, digest):
    """The example run once on the quickstart's checkpoint and a plan keeping 8 of 16 experts."""
    ckpt, _ = megatron_ckpt("deepseek_like_pp2_uneven")
    before = digest(ckpt)
    work = tmp_path_factory.mktemp("train_proxy")
    planted_plan(open_checkpoint(ckpt), 8, work / "plan.json", target_ep=1)
    r = subprocess.run(
        ["bash", str(SCRIPT), str(ckpt), str(work / "plan.json"), str(work / "run")],
        cwd=REPO,
        env=env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert digest(ckpt) == before  # the input is never modified
    return r, work / "run"


def test_the_launch_trains_the_proxy_with_the_flags_convert_printed(launched):
    r, work = launched
    assert r.returncode == 0, r.stderr[-3000:]
    flags = re.search(r"^proxy launch flags: (.*)$", r.stdout, re.M).group(1)
    assert "--num-experts 8" in flags and "--expert-model-parallel-size 1" in flags
    assert "--decoder-first-pipeline-num-layers 1" in flags and "--no-load-optim --no-load-rng" in flags
    log = (work / "train.log").read_text()
    assert f"loaded {work}/proxy iteration 10: 8 experts per MoE layer, 2 ranks at TP=1 PP=2 EP=1 ETP=1 DP=1" in log
    losses = [float(x) for x in re.findall(r"lm loss: (\S+) \|", log)]
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.5  # it learns the mock batch


def test_without_the_convert_flags_the_proxy_does_not_load(launched):
    """The original's own arguments (16 experts) describe a model the proxy checkpoint is not."""
    _, work = launched
    original = (
        "--num-layers 4 --hidden-size 32 --ffn-hidden-size 64 --num-attention-heads 4 --seq-length 16 "
        "--padded-vocab-size 128 --swiglu --disable-bias-linear --untie-embeddings-and-output-weights "
        "--num-experts 16 --moe-router-topk 4 --moe-ffn-hidden-size 16 --moe-layer-freq [0,1,1,1] "
        "--moe-shared-expert-intermediate-size 24 --moe-shared-expert-gate --moe-router-score-function "
        "sigmoid --moe-router-enable-expert-bias --moe-router-num-groups 4 --moe-router-group-topk 2 "
        "--pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 1 --micro-batch-size 2 "
        "--train-iters 1 --mock-data --no-load-optim --no-load-rng"
    ).split()
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(REPO / "examples" / "pretrain_gpt_cpu.py"),
            *original,
            "--load",
            str(work / "proxy"),
        ],
        cwd=REPO,
        env=env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode != 0
    assert "does not match the model the arguments describe" in r.stderr
    assert "mlp.router.expert_bias: checkpoint [8], model [16]" in r.stderr
    assert "tensors missing from the checkpoint (first decoder.layers.0.mlp.experts.local_experts.8." in r.stderr
