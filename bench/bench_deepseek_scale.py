"""The pipeline at DeepSeek-V3 scale (issue 10 item 5): inspect, select and convert a synthetic
checkpoint with DeepSeek-V3's real layer and expert counts, laid out as a large job saves it.

    python bench/bench_deepseek_scale.py [--data /work/benchdata-scale] [--repeat 3] [--depths 8,16,61]
    python bench/bench_deepseek_scale.py --smoke --data DIR      # tiny sizes, seconds (tests/bench)

The model (`scale_model`): 61 layers, the first 3 dense, 256 routed experts per MoE layer, top-8
with 8 groups / top-4 groups, sigmoid scores with expert bias, scaling 2.5, one shared expert,
one MTP layer, multi-latent attention with q_lora and kv_lora and latent norms, rope, untied
embeddings, bf16: DeepSeek-V3's structure at reduced width (H 256, 8 heads, expert FFN 96,
vocab 4096; 3.47 GiB on disk, 5.2 GiB with the 8- and 16-layer ones). The layout: legacy
`--ckpt-format torch`, TP 1, PP 8 with uneven stages (first 7 and last 6 layers, Megatron's
`--decoder-first/last-pipeline-num-layers`, or with `--stages num-layer-list` MindSpeed-LLM's
`--num-layer-list 7,8,8,8,8,8,8,6` with its `first_k_dense_replace` / int `moe_layer_freq`
spelling of the dense layers), EP 32, ETP 1:
256 rank folders `mp_rank_00_PPP_EEE`, the MTP layer on the last stage beside its copy of the
word embeddings, megatron-core's local-spec (SequentialMLP) names.

`--naming mindspeed-llm` writes the same model as MindSpeed-LLM's DeepSeek-V3 recipe saves it
(`mindspeed_llm_state`, applied to each rank's megatron-named state in `write_checkpoint`; the
data folder's tag ends in `-mindspeed-llm`). The recipe is what MindSpeed-LLM's two 671B pretrain
scripts have in common (Ascend/MindSpeed-LLM `examples/mcore/deepseek3/pretrain_deepseek3_671b_4k_ptd.sh`
and `..._A3_ptd.sh`; the hf2mcore `ckpt_convert_deepseek3_hf2mcore.sh` likewise passes
`--moe-grouped-gemm`): `--multi-head-latent-attention --qk-layernorm` without `--mla-mm-split`
(only the A3 script splits), `--moe-grouped-gemm`, `--moe-tp-extend-ep`, `--first-k-dense-replace 3
--moe-layer-freq 1`, `--n-shared-experts 1`, `--mtp-num-layers 1`, legacy `--ckpt-format torch` with
the local transformer implementation. So each rank file holds MindSpeed-LLM's keys by the library's
own mapping (`checkpoint.mindspeed_llm.megatron_to_mindspeed`): the fused down projection
`self_attention.linear_qkv.weight` = [q_a; kv_a] [q_lora + kv_lora + rope, H] (a `LinearNoTP`, no
`_extra_state`), `linear_q_up_proj` / `linear_kv_up_proj`, `mtp.final_layernorms.0.weight` and the
top-level `final_layernorm.weight`; GroupedMLP experts `mlp.experts.weight1` [H, E_local * 2F] /
`weight2` [E_local * F, H] (memory [E_local][H][2F] / [E_local][F][H], no extra state); args with
MindSpeed-LLM's flags (`multi_head_latent_attention`, `qk_nope_head_dim` / `qk_rope_head_dim`,
`moe_grouped_gemm`, `moe_tp_extend_ep`, `mla_mm_split` False, `n_shared_experts`) beside the
megatron ones the reader reads. At TP 1 `--moe-tp-extend-ep` places experts as plain EP does
(E / (EP x TP) per folder). Stages: the scripts pad 61 layers to `--num-layers 64 --noop-layers
61,62,63` (8 per stage); the bench instead spells the same uneven split as the megatron-named
variant with MindSpeed-LLM's `--num-layer-list 7,8,8,8,8,8,8,6` (the hf2mcore script's documented
alternative), so the two variants differ in naming only and the truncated depths need no padding.

megatron-core cannot build a 256-expert 61-layer model on a 2-core box, so `write_checkpoint`
writes the rank files itself, as Megatron-LM's `save_checkpoint` would: `torch.save` of
{args (argparse.Namespace, from the same `ToyMoE.megatron_args` the megatron-core fixtures use),
checkpoint_version 3.0, iteration, model (rank-local names and shapes, `_extra_state` None for
every local linear), optimizer, opt_param_scheduler, rng_state,
num_floating_point_operations_so_far}. tests/bench/test_bench_deepseek_scale.py generates the
megatron-core DeepSeek fixture's own model with it and compares keys, shapes and args with the
files megatron-core saved, so the generator cannot drift. Values are random bf16 (replicated
tensors equal on every EP rank); routers and the routing statistics come from
`select.synthetic.planted_layer` (32 planted clusters per layer), so selection sees a coherent
router and trace.

The measurement, in one run, every command under `/usr/bin/time -v` after
`sync; echo 3 > /proc/sys/vm/drop_caches` (cold page cache; warm, and said so, where that is not
permitted), repeated --repeat times interleaved: `cp -r` of each source, `mcore-proxy inspect`,
`mcore-proxy select` (K 16 per layer, target EP 2) and `mcore-proxy convert` to TP 1 / PP 1 /
EP 2, for checkpoints truncated to each of --depths layers (same 256 rank folders, same
per-layer tensors: peak RSS must be flat in depth). Bytes read: disk reads of the process tree
(`File system inputs` of time -v, i.e. read_bytes with the cache dropped; that includes some
290 MiB of Python, torch and library files every command reads cold), and of it the bytes of the
checkpoint's own files in the page cache right after the command (`fincore`). --libs measures
library commits side by side (git archives first on PYTHONPATH). Medians and the
ratio to `cp -r` in the same repetition print as a markdown table; every sample goes to
DATA/scale-results.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
import zlib
from pathlib import Path

import torch

from mcore_proxy.checkpoint.mindspeed_llm import (
    MEGATRON,
    MINDSPEED_LLM,
    NAMINGS,
    MindSpeedNaming,
    MLADims,
    megatron_to_mindspeed,
)
from mcore_proxy.functional.model import Layout, ToyMoE
from mcore_proxy.mcore.spec import MLA
from mcore_proxy.testing.families import DEEPSEEK_V3

HERE = Path(__file__).resolve().parent
MIB, GIB = 2**20, 2**30
ITERATION = 1000


def scale_model(num_layers: int = 61) -> ToyMoE:
    """DeepSeek-V3's structure (layer/expert counts, routing, MLA, MTP) at reduced width."""
    return dataclasses.replace(
        DEEPSEEK_V3,
        num_layers=num_layers,
        hidden_size=256,
        num_attention_heads=8,
        ffn_hidden_size=768,
        mla=MLA(q_lora_rank=96, kv_lora_rank=32, qk_head_dim=32, qk_pos_emb_head_dim=16, v_head_dim=32),
        num_experts=256,
        moe_ffn_hidden_size=96,
        shared_expert_size=96,
        topk=8,
        num_groups=8,
        group_topk=4,
        moe_layers=tuple(range(3, num_layers)),
        vocab_size=4096,
        seq_length=4096,
    )


def smoke_model(num_layers: int = 5) -> ToyMoE:
    """The same structure at test size: 32 experts (8 groups), H 32."""
    return dataclasses.replace(DEEPSEEK_V3, num_layers=num_layers, moe_layers=tuple(range(3, num_layers)))


def stage_counts(num_layers: int, pp: int) -> list[int]:
    """Decoder layers per pipeline stage: even if PP divides them, else the middle stages
    ceil(L/PP) each and the first and last the rest (61 over 8: 7, 8 x 6, 6)."""
    if num_layers % pp == 0:
        return [num_layers // pp] * pp
    middle = -(-num_layers // pp)
    rest = num_layers - middle * (pp - 2)
    first, last = -(-rest // 2), rest // 2
    if last < 1:
        raise SystemExit(f"{num_layers} layers do not split over PP {pp} as first + even middle + last")
    return [first] + [middle] * (pp - 2) + [last]


# -- the checkpoint ----------------------------------------------------------------------------


def megatron_args(model: ToyMoE, counts: list[int], ep: int, stages: str = "first-last") -> argparse.Namespace:
    """args as the saving job's Megatron-LM (or MindSpeed-LLM, `stages="num-layer-list"`) leaves them."""
    pp = len(counts)
    even = len(set(counts)) == 1
    args = model.megatron_args(Layout(tp=1, pp=pp, ep=ep, etp=1, first_stage_layers=None if even else counts[0]))
    vars(args).update(
        bf16=True,
        params_dtype=torch.bfloat16,
        iteration=ITERATION,
        use_distributed_optimizer=True,
        moe_router_dtype=None,
        sequence_parallel=False,
    )
    if not even:
        args.decoder_last_pipeline_num_layers = counts[-1]
    if stages == "num-layer-list":  # MindSpeed-LLM: --num-layer-list, --first-k-dense-replace, int freq
        dense = model.moe_layers[0]
        vars(args).update(
            num_layer_list=",".join(map(str, counts)),
            decoder_first_pipeline_num_layers=None,
            decoder_last_pipeline_num_layers=None,
            first_k_dense_replace=dense,
            moe_layer_freq=1,
            noop_layers=None,
        )
    elif stages != "first-last":
        raise SystemExit(f"--stages {stages!r}: expected first-last or num-layer-list")
    return args


def mindspeed_llm_args(args: argparse.Namespace, model: ToyMoE) -> argparse.Namespace:
    """`args` as MindSpeed-LLM's DeepSeek-V3 recipe leaves them (module docstring): its flags'
    spellings added beside the megatron-core ones the reader reads (`multi_latent_attention`,
    `qk_head_dim`, `qk_pos_emb_head_dim`, `mtp_num_layers`)."""
    vars(args).update(
        multi_head_latent_attention=True,
        qk_nope_head_dim=model.mla.qk_head_dim,
        qk_rope_head_dim=model.mla.qk_pos_emb_head_dim,
        mla_mm_split=False,
        moe_grouped_gemm=True,
        moe_tp_extend_ep=True,
        n_shared_experts=1,
        transformer_impl="local",
    )
    return args


_LOCAL_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.local_experts\.(\d+)\.linear_fc([12])\.(weight|_extra_state)$")


def grouped_experts(state: dict) -> dict:
    """SequentialMLP local experts -> GroupedMLP's `weight1` [H, E_local * 2F] / `weight2`
    [E_local * F, H], as Megatron's GroupedMLP stores them (it views them as [E_local, H, 2F] /
    [E_local, F, H]: expert j's transposed fc1 [2F, H] / fc2 [H, F] is block j); GroupedMLP has no
    `_extra_state`. Other keys stay in order; each grouped weight takes its first expert's place."""
    out, blocks = {}, {}
    for key, value in state.items():
        m = _LOCAL_EXPERT.match(key)
        if m is None:
            out[key] = value
        elif m[4] == "weight":
            grouped = f"{m[1]}.weight{m[3]}"
            parts = blocks.setdefault(grouped, [])
            assert int(m[2]) == len(parts), f"{key}: local experts out of order"
            out.setdefault(grouped, None)
            parts.append(value.t())
    for grouped, parts in blocks.items():
        stacked = torch.stack(parts)  # [E_local, H, 2F] or [E_local, F, H]
        out[grouped] = stacked.reshape(stacked.shape[1], -1) if grouped.endswith("1") else stacked.flatten(0, 1)
    return out


def mindspeed_llm_state(state: dict, args: argparse.Namespace) -> dict:
    """One rank's megatron-named `model` state (TP 1: attention tensors full) -> the same tensors as
    MindSpeed-LLM's DeepSeek-V3 recipe saves them: grouped GEMM experts, then the library's
    MindSpeed-LLM mapping (fused `linear_qkv`, MTP / final norm names). The fused projection is a
    `LinearNoTP` without extra state, so the down projections' `_extra_state` entries go."""
    naming = MindSpeedNaming(mtp=bool(args.mtp_num_layers))
    state = {k: v for k, v in grouped_experts(state).items() if not re.search(r"_down_proj\._extra_state$", k)}
    return megatron_to_mindspeed(state, naming, MLADims.from_args(args))


def _randn(shape, name: str, dtype=torch.bfloat16, std: float = 0.02, memo: dict | None = None) -> torch.Tensor:
    """Random values keyed by `name`; `memo` keeps replicated tensors so that the 32 EP ranks of
    a stage draw them once (the same tensor objects, saved into each rank file)."""
    if memo is not None and name in memo:
        return memo[name]
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    t = (torch.randn(shape, generator=g) * std).to(dtype)
    if memo is not None:
        memo[name] = t
    return t


def _linear(out: dict, key: str, shape, seed_name: str, memo: dict | None = None) -> None:
    out[f"{key}.weight"] = _randn(shape, seed_name, memo=memo)
    out[f"{key}._extra_state"] = None  # megatron-core's local linears save None


def layer_tensors(
    model: ToyMoE,
    prefix: str,
    seed_prefix: str,
    moe: bool,
    router: torch.Tensor | None,
    experts: range,
    memo: dict | None = None,
) -> dict:
    """One transformer layer's rank-local state at TP 1 / ETP 1 (megatron-core local spec, MLA):
    `prefix` its rank-local key prefix, `seed_prefix` its global name (values are keyed by it, so
    every EP rank holds the same replicated tensors), `experts` the global ids this EP rank holds,
    `memo` replicated tensors already drawn (see `_randn`)."""
    h, heads = model.hidden_size, model.num_attention_heads
    qk, rope, v = model.mla.qk_head_dim, model.mla.qk_pos_emb_head_dim, model.mla.v_head_dim
    out: dict = {}

    def w(key, shape):
        _linear(out, f"{prefix}.{key}", shape, f"{seed_prefix}.{key}", memo)

    def norm(key, size):
        out[f"{prefix}.{key}.weight"] = _randn((size,), f"{seed_prefix}.{key}", memo=memo) + 1

    norm("input_layernorm", h)
    w("self_attention.linear_proj", (h, heads * v))
    w("self_attention.linear_q_down_proj", (model.mla.q_lora_rank, h))
    w("self_attention.linear_q_up_proj", (heads * (qk + rope), model.mla.q_lora_rank))
    w("self_attention.linear_kv_down_proj", (model.mla.kv_lora_rank + rope, h))
    w("self_attention.linear_kv_up_proj", (heads * (qk + v), model.mla.kv_lora_rank))
    norm("self_attention.q_layernorm", model.mla.q_lora_rank)
    norm("self_attention.kv_layernorm", model.mla.kv_lora_rank)
    norm("pre_mlp_layernorm", h)
    if not moe:
        w("mlp.linear_fc1", (2 * model.ffn_hidden_size, h))
        w("mlp.linear_fc2", (h, model.ffn_hidden_size))
        return out
    f = model.moe_ffn_hidden_size
    out[f"{prefix}.mlp.router.weight"] = router.to(torch.bfloat16)
    out[f"{prefix}.mlp.router.expert_bias"] = _randn(
        (model.num_experts,), f"{seed_prefix}.mlp.router.expert_bias", torch.float32, std=0.1, memo=memo
    )
    for j, e in enumerate(experts):
        _linear(
            out,
            f"{prefix}.mlp.experts.local_experts.{j}.linear_fc1",
            (2 * f, h),
            f"{seed_prefix}.mlp.experts.{e}.linear_fc1",
        )
        _linear(
            out,
            f"{prefix}.mlp.experts.local_experts.{j}.linear_fc2",
            (h, f),
            f"{seed_prefix}.mlp.experts.{e}.linear_fc2",
        )
    w("mlp.shared_experts.linear_fc1", (2 * model.shared_expert_size, h))
    w("mlp.shared_experts.linear_fc2", (h, model.shared_expert_size))
    return out


def planted(model: ToyMoE, layer_id: str, tokens: int):
    """The planted routing of one MoE layer (`"12"` or `"mtp.0"`): its router [E, H] and statistics."""
    from mcore_proxy.select.synthetic import planted_layer

    seed = 10_000 + int(layer_id.split(".")[-1]) + (5_000 if layer_id.startswith("mtp.") else 0)
    return planted_layer(
        num_experts=model.num_experts,
        clusters=min(32, model.num_experts // 2),
        hidden=model.hidden_size,
        topk=model.topk,
        tokens=tokens,
        seed=seed,
    )


def rank_state(
    model: ToyMoE, counts: list[int], pp_rank: int, ep_rank: int, ep: int, routers: dict, memo: dict | None = None
) -> dict:
    """Rank (tp 0, pp_rank, ep_rank)'s `model` entry: the stage's layers with local numbers, the
    embedding on the first stage, and on the last the final norm, the MTP layer beside its own
    embedding copy (megatron-core's GPTModel builds one wherever MTP runs) and the output layer.
    `memo`: the stage's replicated tensors drawn for an earlier EP rank (see `_randn`)."""
    h, v = model.hidden_size, model.vocab_size
    local = model.num_experts // ep
    experts = range(ep_rank * local, (ep_rank + 1) * local)
    first, last = pp_rank == 0, pp_rank == len(counts) - 1
    start = sum(counts[:pp_rank])
    out: dict = {}

    def norm(name):
        out[name] = _randn((h,), name, memo=memo) + 1

    if first or (last and model.mtp_layers):
        out["embedding.word_embeddings.weight"] = _randn((v, h), "embedding.word_embeddings.weight", memo=memo)
    for i in range(counts[pp_rank]):
        L = start + i
        moe = L in model.moe_layers
        out.update(
            layer_tensors(model, f"decoder.layers.{i}", f"decoder.layers.{L}", moe, routers.get(str(L)), experts, memo)
        )
    if last:
        norm("decoder.final_layernorm.weight")
        for d in range(model.mtp_layers):
            p = f"mtp.layers.{d}"
            norm(f"{p}.enorm.weight")
            norm(f"{p}.hnorm.weight")
            _linear(out, f"{p}.eh_proj", (h, 2 * h), f"{p}.eh_proj", memo)
            out.update(
                layer_tensors(
                    model, f"{p}.transformer_layer", f"{p}.transformer_layer", True, routers[f"mtp.{d}"], experts, memo
                )
            )
            norm(f"{p}.final_layernorm.weight")
        _linear(out, "output_layer", (v, h), "output_layer", memo)
    return out


def moe_layer_ids(model: ToyMoE) -> list[str]:
    return model.moe_layer_ids


def write_checkpoint(
    root: Path,
    model: ToyMoE,
    pp: int,
    ep: int,
    stages: str = "first-last",
    tokens: int = 4096,
    stats_path: Path | None = None,
    naming: str = MEGATRON,
) -> None:
    """Write the legacy checkpoint (and its planted routing statistics) under `root`, complete or
    not at all: built in a sibling folder, renamed into place last. `naming`: megatron-core's
    local-spec names or MindSpeed-LLM's (`mindspeed_llm_state`)."""
    from mcore_proxy.core.stats import RoutingStats, save_stats
    from mcore_proxy.testing.build import training_extras

    if root.exists():
        return
    counts = stage_counts(model.num_layers, pp)
    if naming not in NAMINGS:
        raise SystemExit(f"--naming {naming!r}: expected one of {', '.join(NAMINGS)}")
    args = megatron_args(model, counts, ep, stages)
    if naming == MINDSPEED_LLM:
        args = mindspeed_llm_args(args, model)
    layers = {lid: planted(model, lid, tokens) for lid in moe_layer_ids(model)}
    routers = {lid: torch.from_numpy(p.router) for lid, p in layers.items()}
    tmp = root.with_name(f".{root.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    it_dir = tmp / f"iter_{ITERATION:07d}"
    for pp_rank in range(pp):
        memo: dict = {}
        for ep_rank in range(ep):
            state = rank_state(model, counts, pp_rank, ep_rank, ep, routers, memo)
            if naming == MINDSPEED_LLM:
                state = mindspeed_llm_state(state, args)
            name = (f"mp_rank_00_{pp_rank:03d}" if pp > 1 else "mp_rank_00") + (f"_{ep_rank:03d}" if ep > 1 else "")
            folder = it_dir / name
            folder.mkdir(parents=True)
            params = torch.nn.ParameterList(
                [
                    torch.nn.Parameter(t, requires_grad=True)
                    for t in state.values()
                    if t is not None and t.is_floating_point()
                ]
            )
            torch.save(
                {
                    "args": args,
                    "checkpoint_version": 3.0,
                    "iteration": ITERATION,
                    "model": state,
                    **training_extras(params),
                },
                folder / "model_optim_rng.pt",
            )
    (tmp / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    if stats_path is not None:
        save_stats(
            RoutingStats(
                {lid: p.stats for lid, p in layers.items()},
                model.topk,
                meta={
                    "source": "bench/bench_deepseek_scale.py: select.synthetic.planted_layer, "
                    "32 clusters per layer (synthetic)"
                },
            ),
            stats_path,
        )
    os.replace(tmp, root)


# -- measuring ---------------------------------------------------------------------------------


def disk_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def cached_bytes(root: Path) -> int | None:
    """Bytes of `root`'s files in the page cache (util-linux `fincore`): right after a command
    that started with the cache dropped, what it read from the checkpoint (readahead included),
    apart from the Python and library files every process reads (`File system inputs`)."""
    files = [str(p) for p in root.rglob("*") if p.is_file()]
    try:
        r = subprocess.run(["fincore", "-b", "-n", "-o", "RES", *files], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return sum(int(x) for x in r.stdout.split())


def main(argv=None) -> int:
    sys.path.insert(0, str(HERE))
    from bench_convert import drop_caches, measure, pin_library, print_header, rm

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="/work/benchdata-scale", help="checkpoints, plans, outputs (rebuilt if missing)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--depths", default="8,16,61", help="decoder layers of the truncated checkpoints")
    ap.add_argument("--pp", type=int, default=8)
    ap.add_argument("--ep", type=int, default=32)
    ap.add_argument(
        "--naming",
        default=MEGATRON,
        choices=NAMINGS,
        help="megatron-core's names or MindSpeed-LLM's DeepSeek-V3 recipe (module docstring)",
    )
    ap.add_argument(
        "--stages",
        choices=("first-last", "num-layer-list"),
        help="uneven stages' spelling (default: first-last, num-layer-list with --naming mindspeed-llm)",
    )
    ap.add_argument("--keep", type=int, default=16)
    ap.add_argument("--target-ep", type=int, default=2)
    ap.add_argument("--target-pp", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=4096, help="planted tokens per MoE layer")
    ap.add_argument("--warm", action="store_true", help="do not drop the page cache")
    ap.add_argument(
        "--libs", default="HEAD", help="library commits measured side by side (git archives), e.g. 8ab7dfb,HEAD"
    )
    ap.add_argument("--build-only", action="store_true", help="build the missing checkpoints, measure nothing")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: 5 layers, 32 experts, PP 2, EP 4, once")
    a = ap.parse_args(argv)
    a.stages = a.stages or ("num-layer-list" if a.naming == MINDSPEED_LLM else "first-last")
    if a.smoke:
        a.depths, a.pp, a.ep, a.keep, a.repeat, a.tokens = "5", 2, 4, 16, 1, 256
    data = Path(a.data)
    data.mkdir(parents=True, exist_ok=True)
    depths = [int(x) for x in a.depths.split(",")]
    make = smoke_model if a.smoke else scale_model
    # The console script beside this interpreter: CI runs the venv's python without activating it.
    mcore = (
        shutil.which("mcore-proxy", path=str(Path(sys.executable).parent))
        or shutil.which("mcore-proxy")
        or "mcore-proxy"
    )
    src, stats, info = {}, {}, {}
    for n in depths:
        # megatron-named folders keep their tag (data built before --naming stays valid)
        tag = f"{'smoke' if a.smoke else 'dsv3'}-{n}L-pp{a.pp}-ep{a.ep}-{a.stages}" + (
            f"-{a.naming}" if a.naming != MEGATRON else ""
        )
        src[n], stats[n] = data / tag, data / f"{tag}.stats.safetensors"
        t = time.perf_counter()
        if not src[n].exists():
            print(f"building {src[n]} ...", flush=True)
            write_checkpoint(src[n], make(n), a.pp, a.ep, a.stages, a.tokens, stats[n], a.naming)
            print(f"  built in {time.perf_counter() - t:.0f} s", flush=True)
        info[n] = {"bytes": disk_bytes(src[n]), "rank_files": len(list(src[n].rglob("model_optim_rng.pt")))}
        print(f"{src[n].name}: {info[n]['bytes'] / GIB:.2f} GiB in {info[n]['rank_files']} rank files", flush=True)
    if a.build_only:
        return 0
    cold = not a.warm and drop_caches()
    tmp = data / "scale-tmp"
    rm(tmp)
    tmp.mkdir()
    log = data / "scale-bench.log"
    log.write_text("")
    plan = {n: tmp / f"plan-{n}.json" for n in depths}
    keep, tep = str(a.keep), str(a.target_ep)

    libs = [pin_library(data, rev) for rev in a.libs.split(",")]

    def jobs(n):
        out = tmp / f"out-{n}"
        select = [
            mcore,
            "select",
            "--ckpt",
            str(src[n]),
            "--stats",
            str(stats[n]),
            "--num-experts",
            keep,
            "--target-ep",
            tep,
            "-o",
            str(plan[n]),
            "--force",
        ]
        convert = [
            mcore,
            "convert",
            str(src[n]),
            "--plan",
            str(plan[n]),
            "-o",
            str(out),
            "--target-tp",
            "1",
            "--target-pp",
            str(a.target_pp),
            "--target-ep",
            tep,
        ]
        j = {f"cp -r ({n}L)": (["cp", "-r", str(src[n]), str(out)], out, {})}
        for sha, lib in libs:
            tag, env = (f" @{sha}" if len(libs) > 1 else ""), {"PYTHONPATH": lib}
            j[f"inspect{tag} ({n}L)"] = ([mcore, "inspect", str(src[n])], None, env)
            j[f"select K={a.keep}{tag} ({n}L)"] = (select, None, env)
            j[f"convert K={a.keep} -> TP 1 PP {a.target_pp} EP {a.target_ep}{tag} ({n}L)"] = (convert, out, env)
        return j

    order = {k: v for n in depths for k, v in jobs(n).items()}
    print_header(cold, f"torch {torch.__version__}")
    load_before = os.getloadavg()
    samples: dict[str, list[dict]] = {k: [] for k in order}
    proxy = {}
    for r in range(a.repeat):
        for label, (cmd, out, env) in order.items():
            if out is not None:
                rm(out)
            n = int(label.rsplit("(", 1)[1].split("L")[0])
            m = measure(cmd, cold, log, env)
            m["source_read"] = cached_bytes(src[n]) if cold else None
            if out is not None and out.exists():
                m["out_bytes"] = disk_bytes(out)
                if label.startswith("convert"):
                    proxy[label] = m["out_bytes"]
                    if r == 0:
                        v = subprocess.run(
                            [mcore, "verify", "--orig", str(src[n]), "--proxy", str(out), "--plan", str(plan[n])],
                            capture_output=True,
                            text=True,
                            check=False,
                            env={**os.environ, **env},
                        )
                        m["verify_rc"] = v.returncode
                        if v.returncode:
                            raise SystemExit(
                                f"verify failed ({v.returncode}) on {out}:\n{v.stdout[-2000:]}{v.stderr[-2000:]}"
                            )
                rm(out)
            samples[label].append(m)
            print(
                f"[{r + 1}/{a.repeat}] {label}: wall {m['wall']:.1f} s, max RSS {m['rss_max'] / MIB:.0f} MiB, "
                f"tree PSS {m['pss_tree'] / MIB:.0f} MiB, disk read {m['read_bytes'] / MIB:.0f} MiB"
                + (f" (of the source {m['source_read'] / MIB:.0f} MiB)" if m["source_read"] is not None else "")
                + (f", out {m['out_bytes'] / MIB:.0f} MiB" if "out_bytes" in m else "")
                + (", verify ok" if m.get("verify_rc") == 0 else ""),
                flush=True,
            )
    load_after = os.getloadavg()
    rm(tmp)
    med = {}
    for k, v in samples.items():
        n = int(k.rsplit("(", 1)[1].split("L")[0])
        cp = samples[f"cp -r ({n}L)"]
        med[k] = {f: statistics.median(x[f] for x in v) for f in ("wall", "rss_max", "pss_tree", "read_bytes")}
        reads = [x["source_read"] for x in v]
        med[k]["source_read"] = statistics.median(reads) if None not in reads else None
        # time -v has 10 ms resolution: a smoke-sized cp -r can take "0.00 s"
        med[k]["ratio"] = statistics.median(x["wall"] / max(c["wall"], 0.01) for x, c in zip(v, cp))
    (data / "scale-results.json").write_text(
        json.dumps(
            {
                "date": time.strftime("%Y-%m-%d %H:%M"),
                "argv": sys.argv,
                "cold_cache": cold,
                "inputs": info,
                "load_before": load_before,
                "load_after": load_after,
                "samples": samples,
                "medians": med,
            },
            indent=1,
            default=str,
        )
    )
    print(
        f"\nload average (1, 5, 15 min): before {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}, "
        f"after {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}"
    )
    for n in depths:
        conv = next(k for k in proxy if k.endswith(f"({n}L)"))
        print(
            f"{n}L: source {info[n]['bytes'] / GIB:.2f} GiB in {info[n]['rank_files']} rank files; "
            f"proxy {proxy[conv] / GIB:.3f} GiB ({proxy[conv] / info[n]['bytes']:.1%})"
        )
    print(f"medians of {a.repeat}; / cp -r = median over repetitions of (wall / wall of cp -r in the same repetition)")
    print(
        "| command | wall s | / cp -r | peak RSS MiB (largest process) | peak PSS MiB (process tree) "
        "| disk read MiB (process tree) | of it from the source MiB | / source size |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for k, m in med.items():
        n = int(k.rsplit("(", 1)[1].split("L")[0])
        src_read = m["source_read"] if m["source_read"] is not None else float("nan")
        print(
            f"| {k} | {m['wall']:.2f} | {m['ratio']:.2f} | {m['rss_max'] / MIB:.0f} | {m['pss_tree'] / MIB:.0f} "
            f"| {m['read_bytes'] / MIB:.0f} | {src_read / MIB:.0f} | {src_read / info[n]['bytes']:.3f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
