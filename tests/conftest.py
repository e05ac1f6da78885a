"""Session-wide fixtures: real Megatron checkpoints written by megatron-core on CPU.

Each checkpoint is built once per session in spawned gloo ranks. Set MCORE_PROXY_FIXTURE_CACHE
to a folder to keep them between sessions (keyed by the builder's source and configuration).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from mcore_proxy.testing.fixtures import FIXTURES, build_family_fixtures, build_fixture


@pytest.fixture(scope="session")
def fixture_root(tmp_path_factory) -> Path:
    """MCORE_PROXY_FIXTURE_CACHE, else this session's folder; under pytest-xdist the workers share
    one (their base temp folders are siblings), and `testing.cache.build_lock` lets one build each."""
    cache = os.environ.get("MCORE_PROXY_FIXTURE_CACHE")
    if cache:
        return Path(cache)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return tmp_path_factory.getbasetemp().parent / "megatron-fixtures"
    return tmp_path_factory.mktemp("megatron-fixtures")


@pytest.fixture(scope="session")
def megatron_ckpt(fixture_root):
    """`megatron_ckpt(name)` -> (checkpoint folder, reference logits file), built once."""
    built: dict[str, tuple[Path, Path]] = {}

    def get(name: str) -> tuple[Path, Path]:
        if name not in built:
            built[name] = build_fixture(name, fixture_root)
        return built[name]

    return get


@pytest.fixture(scope="session")
def family_ckpt(fixture_root):
    """{name: FamilyCheckpoint} of the DeepSeek-V3- and Qwen3-MoE-shaped fixtures (legacy and
    torch_dist from the same ranks, plus reference logits), built once in one set of ranks."""
    return build_family_fixtures(fixture_root)


@pytest.fixture(scope="session")
def hf_model(fixture_root):
    """`hf_model(name)` -> folder of a tiny transformers-built checkpoint (testing/hf_fixtures.py:
    qwen3_moe, deepseek_v3, deepseek_v32), saved by save_pretrained in several shards, built once."""
    from mcore_proxy.testing.hf_fixtures import build_cached

    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = build_cached(name, fixture_root)
        return built[name]

    return get


@pytest.fixture(scope="session")
def hf_proxy(hf_model, tmp_path_factory):
    """`hf_proxy(name)` -> (original, statistics, plan path, plan, HF proxy): the pipeline a user runs
    (collect on calibration text, select K = E/2, convert), once per session."""
    from mcore_proxy.checkpoint import open_checkpoint
    from mcore_proxy.cli import main
    from mcore_proxy.select.plan import load_plan
    from mcore_proxy.testing.hf_fixtures import calibration_jsonl

    made: dict[str, tuple] = {}

    def get(name: str):
        if name not in made:
            orig, base = hf_model(name), tmp_path_factory.mktemp(f"hf-{name}")
            data = calibration_jsonl(base / "data.jsonl", records=32)
            assert main(["collect", "--hf", orig, "--data", data, "-o", base / "stats", "--batch-size", "8"]) == 0
            stats, plan_path, proxy = base / "stats" / "routing_stats.safetensors", base / "plan.json", base / "proxy"
            half = open_checkpoint(orig).spec.num_experts // 2
            assert main(["select", "--ckpt", orig, "--stats", stats, "--num-experts", half, "-o", plan_path]) == 0
            assert main(["convert", str(orig), "--plan", str(plan_path), "-o", str(proxy)]) == 0
            made[name] = (orig, stats, plan_path, load_plan(plan_path), proxy)
        return made[name]

    return get


def tree_digest(path: Path) -> str:
    """sha256 over every file's relative path and bytes: proves an input was not modified."""
    h = hashlib.sha256()
    for p in sorted(Path(path).rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(path)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="session")
def digest():
    return tree_digest


def pytest_collection_modifyitems(items):
    for item in items:
        if {"megatron_ckpt", "family_ckpt"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.megatron)


def folder_of(nodeid: str) -> str:
    """'tests/convert/test_x.py::test_y' -> 'convert'; a root-level file is its own folder."""
    path = nodeid.split("::", 1)[0]
    parts = path.split("/")
    return parts[1] if len(parts) > 2 else path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`bash tests/run.sh` runs the suite in pytest-xdist workers, a whole test folder per worker at
    a time, so that a folder's session fixtures (its conftest's) are built once. (xdist's own
    `--dist loadgroup` does not group under pytest 9 here; this is its scope scheduler by folder.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ByFolder(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return folder_of(nodeid)

    return ByFolder(config, log)


def pytest_configure(config):
    config.addinivalue_line("markers", "megatron: builds or runs real megatron-core models (slow)")
    config.addinivalue_line("markers", "vllm: serves models in vLLM's own environment (tools/vllm_env.sh)")


__all__ = ["FIXTURES"]
