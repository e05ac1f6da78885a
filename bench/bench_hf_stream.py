"""Streaming of the Hugging Face reader and writers on a multi-GB checkpoint (issue 11).

    python bench/bench_hf_stream.py [--out bench/out/hf] [--layers 12] [--keep]

Builds once (cached under --out) a synthetic Qwen3-MoE checkpoint in Hugging Face's own layout
(config.json, model.safetensors.index.json, shards of at most 1 GB written with safetensors,
per-expert Hub names; bf16): hidden 1024, 8 heads / 4 KV groups of 128, 64 experts x F=512
(top-8), vocab 32000, --layers MoE layers (12: 2.6 GB, 0.2 GB per layer). Random weights:
streaming does not depend on their values. Then runs, each under `/usr/bin/time -v`:

  mcore-proxy inspect SRC
  mcore-proxy convert SRC -o OUT                          HF -> HF, every tensor re-written
  mcore-proxy convert SRC -o OUT --format legacy --target-ep 4   HF -> Megatron, 4 rank files

and prints wall time and maximum RSS against the bound of the issue (two layers plus 1 GiB).
Outputs are deleted after each run.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

H, HEADS, GROUPS, HEAD_DIM, E, F, TOPK, VOCAB = 1024, 8, 4, 128, 64, 512, 8, 32000
SHARD = 1 << 30


def layer_tensors(i: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    p = f"model.layers.{i}."
    shapes = {
        "input_layernorm.weight": (H,),
        "post_attention_layernorm.weight": (H,),
        "self_attn.q_proj.weight": (HEADS * HEAD_DIM, H),
        "self_attn.k_proj.weight": (GROUPS * HEAD_DIM, H),
        "self_attn.v_proj.weight": (GROUPS * HEAD_DIM, H),
        "self_attn.o_proj.weight": (H, HEADS * HEAD_DIM),
        "self_attn.q_norm.weight": (HEAD_DIM,),
        "self_attn.k_norm.weight": (HEAD_DIM,),
        "mlp.gate.weight": (E, H),
    }
    for e in range(E):
        shapes.update(
            {
                f"mlp.experts.{e}.gate_proj.weight": (F, H),
                f"mlp.experts.{e}.up_proj.weight": (F, H),
                f"mlp.experts.{e}.down_proj.weight": (H, F),
            }
        )
    return {p + k: torch.randn(s, generator=g).to(torch.bfloat16) for k, s in shapes.items()}


def build(folder: Path, layers: int) -> int:
    """Write the checkpoint shard by shard (one layer in memory at a time); returns its bytes."""
    from safetensors.torch import save_file

    if (folder / "done").is_file():
        return int((folder / "done").read_text())
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    groups = [
        {
            "model.embed_tokens.weight": torch.randn(VOCAB, H, generator=g).to(torch.bfloat16),
            "model.norm.weight": torch.ones(H, dtype=torch.bfloat16),
            "lm_head.weight": torch.randn(VOCAB, H, generator=g).to(torch.bfloat16),
        }
    ]
    groups += [None] * layers  # made when written
    names, pending, size, total, weight_map = [], {}, 0, 0, {}

    def flush():
        nonlocal pending, size
        if pending:
            name = f"part-{len(names):05d}.safetensors"
            save_file(pending, str(folder / name), metadata={"format": "pt"})
            names.append(name)
            weight_map.update({k: name for k in pending})
            pending, size = {}, 0

    for i, group in enumerate(groups):
        tensors = group if group is not None else layer_tensors(i - 1, g)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        if size + nbytes > SHARD:
            flush()
        pending.update(tensors)
        size += nbytes
        total += nbytes
    flush()
    n = len(names)
    renamed = {old: f"model-{j + 1:05d}-of-{n:05d}.safetensors" for j, old in enumerate(names)}
    for old, new in renamed.items():
        (folder / old).rename(folder / new)
    index = {"metadata": {"total_size": total}, "weight_map": {k: renamed[v] for k, v in sorted(weight_map.items())}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": VOCAB,
        "hidden_size": H,
        "intermediate_size": 4 * H,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": GROUPS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        "tie_word_embeddings": False,
        "attention_bias": False,
        "use_sliding_window": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": F,
        "norm_topk_prob": True,
        "num_experts": E,
        "num_experts_per_tok": TOPK,
        "dtype": "bfloat16",
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "done").write_text(str(total))
    return total


def timed(argv: list[str]) -> tuple[float, int]:
    """(wall seconds, maximum RSS in bytes) of one command under /usr/bin/time -v."""
    start = time.perf_counter()
    run = subprocess.run(["/usr/bin/time", "-v", *argv], capture_output=True, text=True)
    wall = time.perf_counter() - start
    if run.returncode:
        sys.exit(f"{' '.join(argv)} failed ({run.returncode}):\n{run.stderr[-2000:]}")
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", run.stderr).group(1)) * 1024
    return wall, rss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench/out/hf"))
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--keep", action="store_true", help="keep the source checkpoint afterwards")
    a = ap.parse_args()
    src = a.out / f"qwen3-moe-{a.layers}l"
    total = build(src, a.layers)
    layer = sum(t.numel() * t.element_size() for t in layer_tensors(0, torch.Generator().manual_seed(1)).values())
    bound = 2 * layer + (1 << 30)
    cli = [sys.executable, "-m", "mcore_proxy"]
    runs = [
        ("inspect", ["inspect", str(src)]),
        ("convert HF -> HF", ["convert", str(src), "-o", "{out}"]),
        ("convert HF -> legacy, EP 4", ["convert", str(src), "-o", "{out}", "--format", "legacy", "--target-ep", "4"]),
    ]
    print(
        f"source: {total / 2**30:.2f} GiB in {len(list(src.glob('*.safetensors')))} shards, one layer "
        f"{layer / 2**20:.0f} MiB; bound two layers + 1 GiB = {bound / 2**20:.0f} MiB\n"
    )
    print("| command | wall (s) | max RSS (MiB) | within bound |\n|---|---|---|---|")
    for label, argv in runs:
        out = a.out / "result"
        shutil.rmtree(out, ignore_errors=True)
        wall, rss = timed(cli + [x.replace("{out}", str(out)) for x in argv])
        shutil.rmtree(out, ignore_errors=True)
        print(f"| {label} | {wall:.1f} | {rss / 2**20:.0f} | {'yes' if rss < bound else 'NO'} |", flush=True)
    if not a.keep:
        shutil.rmtree(src)


if __name__ == "__main__":
    main()
