"""Tiny real megatron-core MoE GPT models on CPU: build, save as Megatron training does, load, run.

Everything here runs inside ranks spawned with `torch.multiprocessing.spawn` over gloo, so the
checkpoints are written by megatron-core's own modules at a real TP/PP/EP/ETP layout.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mcore_proxy.checkpoint.layout import rank_dir_name
from mcore_proxy.testing.mcore_cpu import destroy_distributed, free_port, init_distributed


@dataclass(frozen=True)
class ToyMoE:
    """Architecture of a tiny MoE GPT (megatron-core argument names where they exist)."""

    num_layers: int = 4
    hidden_size: int = 32
    num_attention_heads: int = 4
    ffn_hidden_size: int = 64            # dense layers
    num_experts: int = 8
    moe_ffn_hidden_size: int = 16
    topk: int = 2
    moe_layer_freq: int | tuple[int, ...] = 1
    shared_expert_size: int | None = None
    shared_expert_gate: bool = False
    score_function: str = "softmax"
    expert_bias: bool = False
    num_groups: int | None = None
    group_topk: int | None = None
    vocab_size: int = 128
    seq_length: int = 16
    router_std: float = 1.0              # wide router rows: decisive, diverse routing
    weight_seed: int = 0                 # different seeds: different router and expert weights

    def transformer_config(self, layout: "Layout"):
        from megatron.core.transformer.transformer_config import TransformerConfig

        freq = list(self.moe_layer_freq) if isinstance(self.moe_layer_freq, tuple) else self.moe_layer_freq
        return TransformerConfig(
            num_layers=self.num_layers, hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads, ffn_hidden_size=self.ffn_hidden_size,
            num_moe_experts=self.num_experts, moe_ffn_hidden_size=self.moe_ffn_hidden_size,
            moe_router_topk=self.topk, moe_layer_freq=freq,
            moe_shared_expert_intermediate_size=self.shared_expert_size,
            moe_shared_expert_gate=self.shared_expert_gate,
            moe_router_score_function=self.score_function,
            moe_router_enable_expert_bias=self.expert_bias,
            moe_router_num_groups=self.num_groups, moe_router_group_topk=self.group_topk,
            moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type="allgather", moe_grouped_gemm=layout.grouped,
            gated_linear_unit=True, add_bias_linear=False, normalization="RMSNorm",
            hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
            params_dtype=torch.float32, pipeline_dtype=torch.float32, bf16=False,
            tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
            expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.etp,
            num_layers_in_first_pipeline_stage=layout.first_stage_layers,
            sequence_parallel=False,
        )

    def megatron_args(self, layout: "Layout") -> argparse.Namespace:
        """`args` as Megatron training pickles them: argparse names, plus a megatron enum."""
        from megatron.core.transformer.enums import AttnBackend

        freq = list(self.moe_layer_freq) if isinstance(self.moe_layer_freq, tuple) else self.moe_layer_freq
        return argparse.Namespace(
            num_layers=self.num_layers, hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads, ffn_hidden_size=self.ffn_hidden_size,
            num_experts=self.num_experts, moe_ffn_hidden_size=self.moe_ffn_hidden_size,
            moe_router_topk=self.topk, moe_layer_freq=freq,
            moe_shared_expert_intermediate_size=self.shared_expert_size,
            moe_shared_expert_gate=self.shared_expert_gate,
            moe_router_score_function=self.score_function,
            moe_router_enable_expert_bias=self.expert_bias,
            moe_router_num_groups=self.num_groups, moe_router_group_topk=self.group_topk,
            moe_grouped_gemm=layout.grouped, moe_token_dispatcher_type="allgather",
            swiglu=True, add_bias_linear=False, normalization="RMSNorm",
            padded_vocab_size=self.vocab_size, seq_length=self.seq_length,
            max_position_embeddings=self.seq_length, position_embedding_type="rope",
            tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
            expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.etp,
            decoder_first_pipeline_num_layers=layout.first_stage_layers,
            decoder_last_pipeline_num_layers=None, num_layers_per_virtual_pipeline_stage=None,
            use_distributed_optimizer=False, bf16=False, fp16=False, params_dtype=torch.float32,
            attention_backend=AttnBackend.auto, transformer_impl="local",
            world_size=layout.world_size, data_parallel_size=layout.world_size // (layout.tp * layout.pp),
            ckpt_format="torch", iteration=0,
        )


@dataclass(frozen=True)
class Layout:
    """A parallel layout of one run: TP/PP/EP/ETP, expert module, first-stage layer count."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None               # None: equal to tp, as Megatron defaults
    grouped: bool = False                # GroupedMLP (weight1/weight2) instead of SequentialMLP
    first_stage_layers: int | None = None

    def __post_init__(self):
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)

    @property
    def world_size(self) -> int:
        return max(self.tp * self.pp, self.ep * self.etp * self.pp)


def fixed_tokens(model: ToyMoE, batch: int = 2, seed: int = 7) -> torch.Tensor:
    """[batch, seq] int64 token ids, the same in every rank and run."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.vocab_size, (batch, model.seq_length), generator=g)


def build_gpt(model: ToyMoE, layout: Layout):
    """Build this rank's pipeline stage of the GPT model (call after init_distributed)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    config = model.transformer_config(layout)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    gpt = GPTModel(config, spec, vocab_size=model.vocab_size, max_sequence_length=model.seq_length,
                   pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                   parallel_output=False, position_embedding_type="rope")
    return gpt.eval()


def diversify_weights(gpt, model: ToyMoE) -> None:
    """Make experts differ and routing decisive, deterministically.

    CPU initialisation draws the same numbers on every EP rank, so experts on different EP ranks
    would be copies; noise keyed by (layer, global expert, TP rank) breaks that, and router rows
    and expert biases keyed by layer stay identical on all replicas.
    """
    from megatron.core import parallel_state as ps

    ep_rank, tp_rank = ps.get_expert_model_parallel_rank(), ps.get_expert_tensor_parallel_rank()
    for layer in gpt.decoder.layers:
        mlp = layer.mlp
        if not hasattr(mlp, "router"):
            continue
        g = torch.Generator().manual_seed(1000 + layer.layer_number + 7919 * model.weight_seed)
        mlp.router.weight.data.copy_(torch.randn(mlp.router.weight.shape, generator=g) * model.router_std)
        if getattr(mlp.router, "expert_bias", None) is not None:
            mlp.router.expert_bias.copy_(torch.randn(mlp.router.expert_bias.shape, generator=g) * 0.1)
        local = mlp.experts.num_local_experts
        for name, p in mlp.experts.named_parameters():
            for j in range(local):
                expert = ep_rank * local + j
                gen = torch.Generator().manual_seed(layer.layer_number * 100_003 + expert * 101 + tp_rank
                                                    + 7919 * model.weight_seed)
                _add_expert_noise(p, name, j, local, gen)


def _add_expert_noise(p, name: str, j: int, local: int, gen) -> None:
    if "local_experts" in name:          # SequentialMLP: one module per expert
        if name.split(".")[1] == str(j):
            p.data.add_(torch.randn(p.shape, generator=gen) * 0.05)
    else:                                # GroupedMLP: [H, E*2F] / [E*F, H], expert-major memory
        view = p.data.view(local, -1)
        view[j].add_(torch.randn(view[j].shape, generator=gen) * 0.05)


def forward_logits(gpt, tokens: torch.Tensor) -> torch.Tensor | None:
    """Logits [b, s, vocab] on the last stage (None elsewhere); stages exchange activations by p2p."""
    from megatron.core import parallel_state as ps

    b, s = tokens.shape
    positions = torch.arange(s).expand(b, s)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]
    hidden = gpt.config.hidden_size
    with torch.no_grad():
        if not ps.is_pipeline_first_stage():
            recv = torch.empty(s, b, hidden)
            torch.distributed.recv(recv, src=ps.get_pipeline_model_parallel_prev_rank())
            gpt.set_input_tensor(recv)
        out = gpt(tokens, positions, mask)
        if not ps.is_pipeline_last_stage():
            torch.distributed.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
            return None
    return out


# the rank folder name of Megatron's legacy format (`mp_rank_TT[_PPP][_EEE]`)
legacy_rank_dir = rank_dir_name


def _rank_coords(layout: Layout) -> tuple[int, int, int]:
    from megatron.core import parallel_state as ps

    return (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
            ps.get_expert_model_parallel_rank())


def _writes_folder(coords, world: int) -> bool:
    """Like Megatron: one writer per (tp, pp, ep) folder, the lowest rank holding it."""
    everyone = [None] * world
    torch.distributed.all_gather_object(everyone, coords)
    return everyone.index(coords) == torch.distributed.get_rank()


def _training_extras(gpt) -> dict:
    """Optimizer, scheduler and RNG entries as a training save has them (the reader ignores them)."""
    opt = torch.optim.Adam(gpt.parameters(), lr=1e-4)
    return {
        "optimizer": {"optimizer": opt.state_dict(), "param_groups_sizes": [len(list(gpt.parameters()))]},
        "opt_param_scheduler": {"max_lr": 1e-4, "num_steps": 10},
        "rng_state": [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                       "torch_rng_state": torch.get_rng_state(), "rng_tracker_states": {}}],
        "num_floating_point_operations_so_far": 0,
    }


def _save_worker(rank, world, port, model, layout, ckpt_dir, iteration, ref_path):
    init_distributed(rank, world, port, tp=layout.tp, pp=layout.pp, ep=layout.ep, etp=layout.etp)
    try:
        gpt = build_gpt(model, layout)
        diversify_weights(gpt, model)
        logits = forward_logits(gpt, fixed_tokens(model))
        coords = _rank_coords(layout)
        writer = _writes_folder(coords, world)  # a collective: every rank calls it once
        if writer:
            folder = Path(ckpt_dir) / f"iter_{iteration:07d}" / legacy_rank_dir(*coords, layout)
            folder.mkdir(parents=True, exist_ok=True)
            state = {"args": model.megatron_args(layout), "checkpoint_version": 3.0,
                     "iteration": iteration, "model": gpt.state_dict_for_save_checkpoint()}
            state.update(_training_extras(gpt))
            torch.save(state, folder / "model_optim_rng.pt")
        if logits is not None and writer and coords == (0, layout.pp - 1, 0):
            torch.save(logits, ref_path)
        torch.distributed.barrier()
        if rank == 0:
            (Path(ckpt_dir) / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    finally:
        destroy_distributed()


def save_checkpoint(model: ToyMoE, layout: Layout, ckpt_dir: str | os.PathLike, iteration: int = 10,
                    ref_path: str | os.PathLike | None = None) -> Path:
    """Build the model at `layout` in spawned gloo ranks, save a legacy checkpoint, and write the
    logits [b, s, vocab] on `fixed_tokens` to `ref_path` (default: beside the checkpoint)."""
    ckpt_dir = Path(ckpt_dir)
    ref_path = Path(ref_path or ckpt_dir.with_name(ckpt_dir.name + ".logits.pt"))
    torch.multiprocessing.spawn(_save_worker, args=(layout.world_size, free_port(), model, layout,
                                                    str(ckpt_dir), iteration, str(ref_path)),
                                nprocs=layout.world_size, join=True)
    return ref_path


@contextlib.contextmanager
def restrict_routers(gpt, keep: dict[str, list[int]]):
    """Within the block, every router may choose only its layer's kept experts: the reference a
    correct proxy must reproduce exactly (DESIGN.md 7). Logits of dropped experts become -inf
    (softmax: probability 0; sigmoid: score 0) and their expert bias -inf, so selection never
    picks them. Restored on exit.

    keep: layer id ("3", "mtp.0") -> kept original expert ids.
    """
    num_layers, saved = gpt.config.num_layers, []
    for module in gpt.modules():
        if not hasattr(module, "gating") or not hasattr(module, "expert_bias"):
            continue
        n = module.layer_number
        layer_id = str(n - 1) if n <= num_layers else f"mtp.{n - num_layers - 1}"
        dropped = torch.ones(module.weight.shape[0], dtype=torch.bool)
        dropped[keep[layer_id]] = False
        bias = None if module.expert_bias is None else module.expert_bias.clone()
        saved.append((module, bias))
        module.gating = lambda x, _orig=module.gating, _d=dropped: _orig(x).masked_fill(_d, float("-inf"))
        if bias is not None:
            module.expert_bias.masked_fill_(dropped, float("-inf"))
    try:
        yield
    finally:
        for module, bias in saved:
            del module.gating  # back to the class method
            if bias is not None:
                module.expert_bias.copy_(bias)


def toy_from_args(args, where: str | None = None) -> ToyMoE:
    """The ToyMoE a tiny checkpoint's Megatron args describe (local spec, RMSNorm, SwiGLU, RoPE).
    Absent fields take Megatron's defaults from the one table in `mcore_proxy.megatron_args`."""
    from mcore_proxy.layer_pattern import parse_layer_pattern
    from mcore_proxy.megatron_args import arg, arg_bool, arg_int, ffn_hidden_size
    from mcore_proxy.spec import ModelSpec

    spec = ModelSpec.from_args(args, where)
    freq = parse_layer_pattern(arg(args, "moe_layer_freq", where), "args moe_layer_freq")
    return ToyMoE(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size,
        num_attention_heads=arg_int(args, "num_attention_heads", where, minimum=1),
        ffn_hidden_size=ffn_hidden_size(args, where), num_experts=spec.num_experts,
        moe_ffn_hidden_size=spec.moe_ffn_hidden_size, topk=spec.topk,
        moe_layer_freq=tuple(freq) if isinstance(freq, list) else freq,
        shared_expert_size=spec.shared_expert_size,
        shared_expert_gate=arg_bool(args, "moe_shared_expert_gate", where),
        score_function=spec.score_function, expert_bias=spec.expert_bias,
        num_groups=spec.num_groups, group_topk=spec.group_topk,
        vocab_size=arg_int(args, "padded_vocab_size", where, minimum=1),
        seq_length=arg_int(args, "seq_length", where, minimum=1))


def _load_worker(rank, world, port, model, layout, ckpt_dir, out_path, keep=None):
    from mcore_proxy.checkpoint.safe_globals import load_weights_only

    init_distributed(rank, world, port, tp=layout.tp, pp=layout.pp, ep=layout.ep, etp=layout.etp)
    try:
        gpt = build_gpt(model, layout)
        root = Path(ckpt_dir)
        tracker = (root / "latest_checkpointed_iteration.txt").read_text().strip()
        sub = "release" if tracker == "release" else f"iter_{int(tracker):07d}"
        coords = _rank_coords(layout)
        path = root / sub / legacy_rank_dir(*coords, layout) / "model_optim_rng.pt"
        state = load_weights_only(path)  # what verify --functional loads: nothing in it may run
        gpt.load_state_dict(state["model"], strict=True)
        with restrict_routers(gpt, keep) if keep is not None else contextlib.nullcontext():
            logits = forward_logits(gpt, fixed_tokens(model))
        first = _writes_folder(coords, world)  # a collective: every rank calls it once
        if logits is not None and first and coords == (0, layout.pp - 1, 0):
            torch.save(logits, out_path)
        torch.distributed.barrier()
    finally:
        destroy_distributed()


def load_and_run(model: ToyMoE, layout: Layout, ckpt_dir: str | os.PathLike, out_path,
                 keep: dict[str, list[int]] | None = None) -> torch.Tensor:
    """Load a legacy checkpoint into megatron-core models built at `layout` (strict), run the
    fixed tokens, and return the logits [b, s, vocab]. `keep` restricts the routers to those
    experts (see `restrict_routers`)."""
    torch.multiprocessing.spawn(_load_worker, args=(layout.world_size, free_port(), model, layout,
                                                    str(ckpt_dir), str(out_path), keep),
                                nprocs=layout.world_size, join=True)
    return torch.load(out_path)
