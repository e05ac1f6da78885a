"""Off-CI proof: Megatron-LM's DeepSeek-V4 (its `dev` branch) loads the legacy and torch_dist
checkpoints mcore-proxy converts from transformers' DeepSeek-V4, strictly, and computes
transformers' logits. Results: bench/RESULTS.md, "DeepSeek-V4 in Megatron-LM's dev branch".

Not run in CI: it needs the Megatron-LM `dev` tree (checked at d48bd6be0a85; `git archive dev
megatron | tar -x -C /tmp/mlm_dev`) and a Python for it, such as /tmp/mc17 (Python 3.11, torch 2.13
CPU, the dependencies of the megatron-core 0.19.2 wheel: numpy, packaging, triton; the dev tree goes
first on sys.path). transformers runs in this project's venv. Usage:

  .venv/bin/python bench/deepseek_v4_megatron_dev.py --mlm /tmp/mlm_dev --mlm-python /tmp/mc17/bin/python

Stage "hf" (this interpreter): builds the tiny V4 of testing/hf_fixtures.py (hash-routed layer 0,
sliding / CSA / HCA attention with sinks, compressor and indexer, hyper-connections, MTP block),
converts it with `mcore-proxy convert --format legacy` (TP 1, EP 1: one rank file) and
`--format torch_dist` (EP 2), runs DeepseekV4ForCausalLM on fixed tokens and saves tokens and
logits; the same for a proxy (a plan keeping 4 of 8 experts from `collect` + `select`, applied
HF -> Megatron, against transformers running the HF -> HF proxy). Stage "megatron"
(--mlm-python): builds GPTModel from the dev tree with the TransformerConfig the checkpoint's args
describe (`_config`: the args' own field names, a few renamed), loads the rank file's `model` with
`strict=True`, runs forward and reports the largest absolute logit difference; the same after
zeroing the model and loading the torch_dist files with `dist_checkpointing.load` (EP 2 files into
the EP 1 model, re-sharded by the dev tree); then, to show that the comparison would catch a
mapping error, the difference after each of a few plausible mistakes (`MISTAKES`) in the loaded
tensors; for the proxy, how many rows of its hash table repeat an expert (0 since the substitute
rule gives each slot a kept expert the row does not already name; a repeat is summed by
transformers but counted once by the dev router) and the difference with the dev router summing
repeated slots (`_summed_duplicate_slots`, which found that difference).

What the dev tree needs on a CPU without Transformer Engine (patches in `_patch_megatron`, none
changes a formula): torch.cuda.current_device / synchronize / nvtx made no-ops; the CUDA RNG tracker's
fork; absent TE symbols set to None; a plain replicated linear with TELinear's call shape and an
`_extra_state` entry (as TE's modules have) for `backend.linear()` and dsv4's TELinear check; the
indexer's Hadamard rotation (fast_hadamard_transform, bf16 only) in torch: it rotates both the
indexer's queries and keys by one orthonormal matrix, so their scores are unchanged (transformers
applies none); `csa_compress_ratios` set after TransformerConfig's check, which admits only 0, 4 and
128 (the fixture's heavily compressed rate is 8; the code builds any rate > 1 as non-overlapping
without an indexer, as transformers builds heavily compressed attention).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BATCH, SEQ, SEED = 2, 64, 0


# -- stage hf: this project's venv ---------------------------------------------------------------------


def _plan(src: Path, work: Path) -> Path:
    """A plan keeping 4 of 8 experts, made as a user makes one: collect on calibration text, select."""
    from mcore_proxy.cli import main
    from mcore_proxy.testing.hf_fixtures import calibration_jsonl

    plan = work / "plan.json"
    if not plan.exists():
        data = calibration_jsonl(work / "data.jsonl", records=32)
        assert main(["collect", "--hf", str(src), "--data", str(data), "-o", str(work / "stats"), "--force"]) == 0
        assert (
            main(
                [
                    "select",
                    "--ckpt",
                    src,
                    "--stats",
                    work / "stats" / "routing_stats.safetensors",
                    "--num-experts",
                    "4",
                    "-o",
                    plan,
                ]
            )
            == 0
        )
    return plan


def stage_hf(work: Path) -> None:
    sys.path.insert(0, str(ROOT))
    import torch

    from mcore_proxy.cli import main
    from mcore_proxy.hf.models import load_model, run
    from mcore_proxy.testing.hf_fixtures import build_cached

    src = build_cached("deepseek_v4", work / "fixtures")
    tokens = torch.randint(3, 128, (BATCH, SEQ), generator=torch.Generator().manual_seed(SEED))
    plan = _plan(src, work)
    cases = {
        "full": (src, work / "legacy", []),
        "proxy": (work / "hf-proxy", work / "legacy-proxy", ["--plan", str(plan)]),
    }
    if not cases["proxy"][0].exists():
        assert main(["convert", str(src), "--plan", str(plan), "-o", str(cases["proxy"][0])]) == 0
    for name, (hf, legacy, extra) in cases.items():
        if not legacy.exists():
            assert main(["convert", str(src), "-o", str(legacy), "--format", "legacy", "--target-ep", "1", *extra]) == 0
        dist = legacy.parent / legacy.name.replace("legacy", "dist")  # torch_dist at EP 2, re-sharded on load
        if not dist.exists():
            assert (
                main(["convert", str(src), "-o", str(dist), "--format", "torch_dist", "--target-ep", "2", *extra]) == 0
            )
        logits = run(load_model(hf), tokens)
        torch.save(
            {
                "tokens": tokens,
                "logits": logits,
                "dist": str(dist / "release"),
                "rank_file": str(legacy / "release" / "mp_rank_00" / "model_optim_rng.pt"),
            },
            work / f"hf-{name}.pt",
        )
    print(json.dumps({"hf_fixture": str(src), "cases": list(cases)}))


# -- stage megatron: the Megatron-LM dev venv ----------------------------------------------------------------


def _patch_megatron(mlm: str):
    """Make the dev tree build and run on CPU without Transformer Engine (see the module docstring)."""

    sys.path.insert(0, mlm)
    sys.path.insert(1, str(ROOT))  # after the dev tree: its megatron is the one imported
    from mcore_proxy.functional.cpu import stub_cuda_for_cpu

    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    stub_cuda_for_cpu()  # the CUDA and TE stand-ins verify --functional uses too

    class LocalLinear(nn.Module):
        """TELinear(parallel_mode="duplicated") stand-in: replicated, TE's call shape and extra state."""

        def __init__(self, input_size, output_size, *, config, init_method, bias, skip_bias_add, **_):
            super().__init__()
            self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
            init_method(self.weight)
            self.bias = nn.Parameter(torch.zeros(output_size)) if bias else None
            self.skip_bias_add = skip_bias_add

        def forward(self, x):
            if self.skip_bias_add:
                return F.linear(x, self.weight), self.bias
            return F.linear(x, self.weight, self.bias), None

        def backward_dw(self):
            pass

        def get_extra_state(self):
            return None

        def set_extra_state(self, state):
            pass

    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.transformer.experimental_attention_variant import deepseek_v4_hybrid_attention as dsv4

    class CPUBackend(LocalSpecProvider):
        def linear(self):
            return LocalLinear

    dsv4.TELinear = LocalLinear

    def hadamard(x):
        """fast_hadamard_transform's rotation (Sylvester Hadamard scaled by d**-0.5) in torch, any dtype."""
        d = x.size(-1)
        h = torch.ones(1, 1)
        while h.size(0) < d:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        return (x.float() @ h.t() * d**-0.5).to(x.dtype)

    from megatron.core.transformer.experimental_attention_variant import csa

    csa.rotate_activation = hadamard
    return CPUBackend()


# args field -> TransformerConfig field where Megatron-LM's names differ (arguments.py)
_RENAMED = {
    "num_experts": "num_moe_experts",
    "norm_epsilon": "layernorm_epsilon",
    "padded_vocab_size": "actual_vocab_size",
}
_COPIED = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "multi_latent_attention",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_head_dim",
    "qk_pos_emb_head_dim",
    "v_head_dim",
    "qk_layernorm",
    "o_groups",
    "o_lora_rank",
    "rope_type",
    "rotary_base",
    "rotary_scaling_factor",
    "mscale",
    "mscale_all_dim",
    "experimental_attention_variant",
    "csa_window_size",
    "csa_compress_rotary_base",
    "dsa_indexer_n_heads",
    "dsa_indexer_head_dim",
    "dsa_indexer_topk",
    "moe_ffn_hidden_size",
    "moe_router_topk",
    "moe_layer_freq",
    "moe_shared_expert_intermediate_size",
    "moe_router_score_function",
    "moe_router_enable_expert_bias",
    "moe_router_topk_scaling_factor",
    "moe_n_hash_layers",
    "moe_router_pre_softmax",
    "moe_router_dtype",
    "activation_func_clamp_value",
    "enable_hyper_connections",
    "num_residual_streams",
    "mhc_sinkhorn_iterations",
    "mtp_num_layers",
    "normalization",
    "add_bias_linear",
    "hidden_dropout",
    "attention_dropout",
)


def _config(args):
    """The dev tree's MLATransformerConfig for the checkpoint's args (CPU, fp32, no TE)."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    fields = {name: getattr(args, name) for name in _COPIED}
    fields.update({new: getattr(args, old) for old, new in _RENAMED.items()})
    ratios = list(args.csa_compress_ratios)
    fields.update(
        csa_compress_ratios=[r if r in (0, 4) else 128 for r in ratios],  # passes the 0/4/128 check; set below
        gated_linear_unit=bool(args.swiglu),
        activation_func=F.silu,
        dsa_kernel_backend="none",
        dsa_indexer_loss_coeff=0.0,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=False,
        mtp_loss_scaling_factor=0.1,
        use_cpu_initialization=True,
        params_dtype=args.params_dtype,
        pipeline_dtype=args.params_dtype,
        bf16=bool(args.bf16),
        transformer_impl="local",
    )
    config = MLATransformerConfig(**fields)
    config.csa_compress_ratios = ratios
    return config


@contextlib.contextmanager
def _summed_duplicate_slots():
    """Megatron-LM's hash routing with a token's repeated expert id given the sum of its slots'
    weights (transformers applies the expert once per slot) instead of one slot's
    (`routing_probs = zeros.scatter(1, top_indices, probs)` keeps the last): a diagnosis, not a fix."""
    import torch
    from megatron.core.transformer.moe.router import TopKRouter

    original = TopKRouter._hash_routing

    def summed(self, logits, input_ids):
        probs, routing_map = original(self, logits, input_ids)
        top = self.tid2eid[input_ids.T.reshape(-1)].long()
        weights = probs.new_zeros(probs.shape).scatter_add(1, top, probs.gather(1, top))
        counts = probs.new_zeros(probs.shape).scatter_add(1, top, torch.ones_like(top, dtype=probs.dtype))
        return torch.where(counts > 1, weights, probs), routing_map

    TopKRouter._hash_routing = summed
    try:
        yield
    finally:
        TopKRouter._hash_routing = original


def _swap(state: dict, a: str, b: str) -> None:
    state[a], state[b] = state[b], state[a]


# plausible mapping mistakes, each applied alone to the loaded tensors: the logits must move far
# more than the tolerance for the comparison to prove the mapping
MISTAKES = {
    "hyper-connection scales pre/post swapped (layer 1)": lambda s, e: _swap(
        s,
        "decoder.layers.1.self_attention_hyper_connection.alpha_pre",
        "decoder.layers.1.self_attention_hyper_connection.alpha_post",
    ),
    "hash table shifted by one expert (layer 0)": lambda s, e: s.__setitem__(
        "decoder.layers.0.mlp.router.tid2eid", (s["decoder.layers.0.mlp.router.tid2eid"] + 1) % e
    ),
    "experts 0 and 1 swapped (layer 1)": lambda s, e: [
        _swap(
            s, f"decoder.layers.1.mlp.experts.local_experts.0.{w}", f"decoder.layers.1.mlp.experts.local_experts.1.{w}"
        )
        for w in ("linear_fc1.weight", "linear_fc2.weight")
    ],
    "gate and up halves swapped (shared expert, layer 2)": lambda s, e: s.__setitem__(
        "decoder.layers.2.mlp.shared_experts.linear_fc1.weight",
        s["decoder.layers.2.mlp.shared_experts.linear_fc1.weight"].roll(32, 0),
    ),
    "indexer query projection negated (layer 1)": lambda s, e: s.__setitem__(
        "decoder.layers.1.self_attention.core_attention.indexer.linear_wq_b.weight",
        -s["decoder.layers.1.self_attention.core_attention.indexer.linear_wq_b.weight"],
    ),
    "compressor position bias rows reversed (layer 2, HCA)": lambda s, e: s.__setitem__(
        "decoder.layers.2.self_attention.core_attention.compressor.ape",
        s["decoder.layers.2.self_attention.core_attention.compressor.ape"].flip(0),
    ),
    "attention sinks negated (layer 0)": lambda s, e: s.__setitem__(
        "decoder.layers.0.self_attention.core_attention.attn_sink",
        -s["decoder.layers.0.self_attention.core_attention.attn_sink"],
    ),
}


def stage_megatron(work: Path, mlm: str, cases: list[str]) -> dict:
    backend = _patch_megatron(mlm)
    import torch
    import megatron.core
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_transformer_layer_with_experimental_attention_variant_spec,
    )
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec_for_backend
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    results = {"megatron_core": megatron.core.__file__, "version": megatron.core.__version__}
    for case in cases:
        hf = torch.load(work / f"hf-{case}.pt", weights_only=False)
        saved = torch.load(hf["rank_file"], weights_only=False)  # our own output (args: a Namespace)
        args = saved["args"]
        config = _config(args)
        layers = get_transformer_layer_with_experimental_attention_variant_spec(config, backend=backend)
        block = TransformerBlockSubmodules(layer_specs=layers, layer_norm=backend.layer_norm(rms_norm=True))
        mtp = get_gpt_mtp_block_spec_for_backend(config, layers[-1], backend=backend)
        model = GPTModel(
            config,
            block,
            vocab_size=args.padded_vocab_size,
            max_sequence_length=args.seq_length,
            parallel_output=False,
            position_embedding_type="rope",
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            mtp_block_spec=mtp,
        ).eval()
        model.load_state_dict(saved["model"], strict=True)
        tokens = hf["tokens"]
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        mask = torch.triu(torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool), 1)[None, None]
        with torch.no_grad():
            logits = model(tokens, positions, mask).float()
        diff = (logits - hf["logits"]).abs()
        results[case] = {
            "experts": args.num_experts,
            "tensors_loaded": len(saved["model"]),
            "logits": list(logits.shape),
            "max_abs_diff": float(diff.max()),
            "mean_abs_diff": float(diff.mean()),
            "max_abs_logit": float(hf["logits"].abs().max()),
            "argmax_agree": float((logits.argmax(-1) == hf["logits"].argmax(-1)).float().mean()),
        }
        from megatron.core import dist_checkpointing

        with torch.no_grad():  # nothing left of the legacy load: every tensor must come from torch_dist
            for tensor in model.state_dict().values():
                if isinstance(tensor, torch.Tensor):
                    tensor.zero_()
        loaded = dist_checkpointing.load(model.sharded_state_dict(), hf["dist"])
        for common in ("args", "checkpoint_version", "iteration", "content_metadata"):  # common.pt, not weights
            loaded.pop(common, None)
        model.load_state_dict(loaded, strict=True)
        with torch.no_grad():
            from_dist = model(tokens, positions, mask).float()
        results[case]["torch_dist_ep2_max_abs_diff"] = float((from_dist - hf["logits"]).abs().max())
        model.load_state_dict(saved["model"], strict=True)
        if case == "proxy":
            results[case]["hash_rows_repeating_an_expert"] = int(
                (saved["model"]["decoder.layers.0.mlp.router.tid2eid"].sort(-1).values.diff(dim=-1) == 0).any(-1).sum()
            )
            with torch.no_grad(), _summed_duplicate_slots():
                summed = model(tokens, positions, mask).float()
            results[case]["max_abs_diff_duplicate_slots_summed"] = float((summed - hf["logits"]).abs().max())
        if case == "full":
            results["mistakes"] = {}
            for what, mistake in MISTAKES.items():
                state = dict(saved["model"])
                mistake(state, args.num_experts)
                model.load_state_dict(state, strict=True)
                with torch.no_grad():
                    wrong = model(tokens, positions, mask).float()
                results["mistakes"][what] = float((wrong - hf["logits"]).abs().max())
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mlm", default="/tmp/mlm_dev", help="the Megatron-LM dev tree (holds megatron/)")
    parser.add_argument("--mlm-python", default="/tmp/mc17/bin/python", help="a Python that runs the dev tree")
    parser.add_argument("--work", type=Path, default=ROOT / "bench" / "out" / "deepseek_v4_dev")
    parser.add_argument("--stage", choices=("hf", "megatron"), help=argparse.SUPPRESS)
    parser.add_argument("--cases", default="full", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    opts.work.mkdir(parents=True, exist_ok=True)
    if opts.stage == "hf":
        return stage_hf(opts.work)
    if opts.stage == "megatron":
        print(json.dumps(stage_megatron(opts.work, opts.mlm, opts.cases.split(","))))
        return
    hf = subprocess.run(
        [sys.executable, __file__, "--stage", "hf", "--work", str(opts.work)],
        check=True,
        capture_output=True,
        text=True,
    )
    cases = json.loads(hf.stdout.strip().splitlines()[-1])["cases"]
    mg = subprocess.run(
        [
            opts.mlm_python,
            __file__,
            "--stage",
            "megatron",
            "--work",
            str(opts.work),
            "--mlm",
            opts.mlm,
            "--cases",
            ",".join(cases),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    print(json.dumps(json.loads(mg.stdout.strip().splitlines()[-1]), indent=2))


if __name__ == "__main__":
    main()
