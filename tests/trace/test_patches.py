"""patches/: activation by environment in fresh interpreters launched the way a user launches.

- sitecustomize chains an existing sitecustomize and imports nothing heavy at start-up;
- `torchrun` of examples/train_step_cpu.py (which never imports mcore_proxy.trace) on 2 ranks
  with EP=2: per-rank files appear, flushed every N steps and at exit, and merge exactly;
- MindSpeed (its patch-manager stand-in) replacing TopKRouter.forward: still traced, and the
  statistics (saliency included, through the wrapped MoELayer.__init__) equal those of the
  hook-installed reference run on the same weights and tokens.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mcore_proxy.core.stats import load_stats
from mcore_proxy.trace.cli import merge_folder

pytestmark = pytest.mark.megatron  # real megatron-core models (slow)

REPO = Path(__file__).resolve().parents[2]
PATCHES = REPO / "patches"
EXAMPLE = REPO / "examples" / "train_step_cpu.py"
HERE = Path(__file__).parent


def user_env(*pythonpath, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MCORE_PROXY_")}
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in pythonpath)
    env["OMP_NUM_THREADS"] = "1"
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run(cmd, env, timeout=300):
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=HERE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_sitecustomize_chains_and_stays_light(tmp_path):
    other = tmp_path / "site"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import os\nos.environ['USER_SITECUSTOMIZE_RAN'] = '1'\n")
    probe = (
        "import os, sys, json; print(json.dumps({'user': os.environ.get('USER_SITECUSTOMIZE_RAN'), "
        "'active': 'mcore_proxy.trace.activate' in sys.modules, 'torch': 'torch' in sys.modules}))"
    )
    out = run([sys.executable, "-c", probe], user_env(PATCHES, other, MCORE_PROXY_TRACE_DIR=tmp_path / "s"))
    assert json.loads(out) == {"user": "1", "active": True, "torch": False}
    out = run([sys.executable, "-c", probe], user_env(PATCHES, other))
    assert json.loads(out) == {"user": "1", "active": False, "torch": False}
    out = run([sys.executable, "-c", probe], user_env(PATCHES, other, MCORE_PROXY_CHAIN_SITECUSTOMIZE=0))
    assert json.loads(out)["user"] is None


def test_torchrun_of_an_unmodified_script(tmp_path):
    assert "mcore_proxy.trace" not in EXAMPLE.read_text()
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(0, 256, 2000).astype(np.int32))
    stats_dir = tmp_path / "stats"
    env = user_env(PATCHES, MCORE_PROXY_TRACE_DIR=stats_dir, MCORE_PROXY_TRACE_FLUSH_STEPS=2)
    steps, micro_batch, seq = 3, 2, 32
    run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(EXAMPLE),
            "--tokens",
            str(tokens),
            "--ep",
            "2",
            "--steps",
            str(steps),
            "--micro-batch",
            str(micro_batch),
            "--seq-length",
            str(seq),
        ],
        env,
    )
    assert sorted(p.name for p in stats_dir.iterdir()) == [
        "rank00000.json",
        "rank00000.safetensors",
        "rank00001.json",
        "rank00001.safetensors",
    ]
    for rank in range(2):
        s = load_stats(stats_dir / f"rank{rank:05d}.safetensors")
        assert s.meta["steps"] == steps and s.meta["rank"] == rank and s.meta["world_size"] == 2
    merged = merge_folder(stats_dir)
    assert merged.layer_ids == ["0", "1", "2", "3"] and merged.topk == 2
    for s in merged.layers.values():  # 2 data-parallel replicas, each its own tokens
        assert s.tokens == 2 * steps * micro_batch * seq
        assert s.freq.sum() == s.tokens * 2
        np.testing.assert_array_equal(np.diag(s.coact), s.freq)


def test_mindspeed_replacement_is_traced_exactly(tmp_path, traced):
    stats_dir = tmp_path / "stats"
    out = run(
        [sys.executable, str(HERE / "scripts" / "env_forward.py"), "--mindspeed"],
        user_env(PATCHES, HERE / "mindspeed_standin", MCORE_PROXY_TRACE_DIR=stats_dir, MCORE_PROXY_TRACE_SALIENCY=1),
    )
    report = json.loads(out.strip().splitlines()[-1])
    assert report == {"calls": [1, 2, 3, 4], "forward": "topk_router_forward", "traced": True, "trace_imported": True}
    env_stats = load_stats(stats_dir / "rank00000.safetensors")
    ref = merge_folder(traced("ref"))
    assert env_stats.layer_ids == ref.layer_ids
    for lid in ref.layer_ids:
        a, b = ref.layers[lid], env_stats.layers[lid]
        assert a.tokens == b.tokens == 64
        np.testing.assert_array_equal(a.coact, b.coact)
        np.testing.assert_allclose(a.proto_sum, b.proto_sum, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(a.gate_mass, b.gate_mass, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(a.saliency_sum, b.saliency_sum, rtol=1e-5, atol=1e-5)
