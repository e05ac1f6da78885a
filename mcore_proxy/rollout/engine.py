"""The rollout side of a check: sequences through vLLM, their prompt log-probs and every token's
top-k experts per MoE layer. Runs in vLLM's environment (its own interpreter: docs/rollout.md),
called by `rollout.run.run_engine` and used by examples/rl_vllm (`start_llm`, `score`), never
imported by the rest of the package:

    VLLM_PYTHON -m mcore_proxy.rollout.engine REQUEST.json OUT_DIR

REQUEST.json: {"models": [{"path": HF_DIR, "name": NAME}], "dtype": "float32" | "bfloat16",
"sequences": [[token ids], ...]}. For each model, `OUT_DIR/NAME.safetensors` holds
`logprobs.{i}` [len(sequence i) - 1] (float32: the log-prob of token j + 1 given tokens 0..j, as
vLLM's `prompt_logprobs` report it) and `topk.{layer}` [total tokens, k] int32 (vLLM's choice for
every token of every sequence, in order), and `OUT_DIR/NAME.json` the engine's facts. The models
are loaded one after the other in this one process (vLLM's second start is seconds, its first
about a minute on CPU).

vLLM runs eager (hooks need it: `engines.vllm`), without prefix caching (a cached prefix
would skip its tokens' forward pass) and one sequence per step, so that each forward pass is one
sequence's prefill. Faults given by `MCORE_PROXY_FAULTS` act here when the patches folder is on
PYTHONPATH (the caller sets both).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path

# one process: the hooks and the model live where this code runs (vLLM's engine core otherwise
# runs in a child process)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

KV_CACHE_BYTES = 1 << 28  # the tiny models' sequences need little; vLLM's CPU default reserves most RAM


def start_llm(path: str, dtype: str, max_len: int, *, max_num_seqs: int = 1, seed: int = 0, **kwargs):
    """(vLLM's `LLM` on the HF folder `path`, the model it built): eager, no prefix caching, sequences
    up to `max_len` tokens prefilled in one pass, a small KV cache. Token ids in, token ids out
    (`skip_tokenizer_init`): the tiny models have no tokenizer, and the checks need none."""
    import importlib

    from vllm import LLM

    from mcore_proxy.engines import vllm as vllm_engine

    loaded = []
    vllm_engine.on_model_loaded(loaded.append)
    vllm_engine.patch_loader_module(importlib.import_module("vllm.model_executor.model_loader.base_loader"))
    budget = max(max_len + 1, 32)
    try:
        llm = LLM(
            model=path,
            dtype=dtype,
            enforce_eager=True,
            enable_prefix_caching=False,
            skip_tokenizer_init=True,
            max_num_seqs=max_num_seqs,
            max_model_len=budget,
            max_num_batched_tokens=max(budget, max_num_seqs * budget),
            kv_cache_memory_bytes=KV_CACHE_BYTES,
            gpu_memory_utilization=0.1,  # on CPU: the share of RAM vLLM checks is free at start
            seed=seed,
            **kwargs,
        )
    finally:  # a fresh engine per sync: the list must not keep the earlier models alive
        vllm_engine.stop_on_model_loaded(loaded.append)
    return llm, loaded[-1]


def score(llm, model, sequences: list[list[int]]) -> tuple[list, dict]:
    """Each sequence's prefill alone: (log-probs [len - 1] float32 per sequence, as vLLM's
    `prompt_logprobs` report them; layer id -> top-k ids [total tokens, k] int32, every token of
    every sequence in order)."""
    import torch
    from vllm import SamplingParams

    from mcore_proxy.engines import vllm as vllm_engine
    from mcore_proxy.engines.hooks import Hooks

    routers = vllm_engine.moe_routers(model)
    calls: dict[str, list] = {layer: [] for layer in routers}
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    logprobs = []
    with Hooks() as hooks:
        for layer, router in routers.items():
            hooks.add(
                vllm_engine.add_observer(
                    router, lambda h, logits, w, ids, layer=layer: calls[layer].append(ids.clone())
                )
            )
        for ids in sequences:  # one request per call: each forward pass is one sequence's prefill
            (out,) = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
            logprobs.append(
                torch.tensor(
                    [entry[token].logprob for token, entry in zip(ids[1:], out.prompt_logprobs[1:])],
                    dtype=torch.float32,
                )
            )
    total = sum(len(s) for s in sequences)
    topk = {}
    for layer, chunks in calls.items():
        ids = torch.cat(chunks).to(torch.int32)  # max_tokens=1: the prefill is the only pass
        if ids.shape[0] != total:
            raise RuntimeError(f"layer {layer}: vLLM routed {ids.shape[0]} tokens, the sequences hold {total}")
        topk[layer] = ids
    return logprobs, topk


def run_model(path: str, sequences: list[list[int]], dtype: str) -> tuple[dict, dict]:
    """(tensors, facts) of one model: see the module docstring."""
    import torch
    import vllm

    from mcore_proxy.engines import vllm as vllm_engine

    start = time.perf_counter()
    llm, model = start_llm(path, dtype, max(len(s) for s in sequences))
    started = time.perf_counter() - start
    logprobs, topk = score(llm, model, sequences)
    routers = vllm_engine.moe_routers(model)
    tensors: dict[str, torch.Tensor] = {f"logprobs.{i}": lp for i, lp in enumerate(logprobs)}
    tensors.update({f"topk.{layer}": ids.contiguous() for layer, ids in topk.items()})
    facts = {
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "dtype": dtype,
        "layers": list(routers),
        "experts": {layer: vllm_engine.router_shape(r)[0] for layer, r in routers.items()},
        "start_seconds": round(started, 2),
        "faults": os.environ.get("MCORE_PROXY_FAULTS", ""),
    }
    del llm, model
    gc.collect()
    return tensors, facts


def main(argv: list[str]) -> int:
    from safetensors.torch import save_file

    request_path, out_dir = Path(argv[0]), Path(argv[1])
    request = json.loads(request_path.read_text())
    for model in request["models"]:
        tensors, facts = run_model(model["path"], request["sequences"], request["dtype"])
        save_file(tensors, str(out_dir / f"{model['name']}.safetensors"))
        (out_dir / f"{model['name']}.json").write_text(json.dumps(facts, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
