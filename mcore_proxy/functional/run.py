"""Run megatron-core models on CPU: fixed tokens in, logits out, routers optionally restricted.

`load_and_run` is what `verify --functional` does with a checkpoint: spawn the ranks of a
layout over gloo, build the model, load a legacy checkpoint strictly, run `fixed_tokens`.
"""

from __future__ import annotations

import contextlib
import os

import torch

from mcore_proxy.checkpoint.formats import get_format
from mcore_proxy.functional.cpu import destroy_distributed, free_port, init_distributed
from mcore_proxy.functional.model import Layout, ToyMoE, build_gpt


def fixed_tokens(model: ToyMoE, batch: int = 2, seed: int = 7) -> torch.Tensor:
    """[batch, seq] int64 token ids, the same in every rank and run."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.vocab_size, (batch, model.seq_length), generator=g)


def causal_inputs(b: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Position ids [b, s] and megatron's causal attention mask [1, 1, s, s] (True: masked)."""
    return torch.arange(s).expand(b, s), torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]


def forward_logits(gpt, tokens: torch.Tensor) -> torch.Tensor | None:
    """Logits [b, s, vocab] on the last stage (None elsewhere); stages exchange activations by p2p."""
    from megatron.core import parallel_state as ps

    b, s = tokens.shape
    positions, mask = causal_inputs(b, s)
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


def rank_coords(layout: Layout) -> tuple[int, int, int]:
    from megatron.core import parallel_state as ps

    return (
        ps.get_tensor_model_parallel_rank(),
        ps.get_pipeline_model_parallel_rank(),
        ps.get_expert_model_parallel_rank(),
    )


def writes_folder(coords, world: int) -> bool:
    """Like Megatron: one writer per (tp, pp, ep) folder, the lowest rank holding it."""
    everyone = [None] * world
    torch.distributed.all_gather_object(everyone, coords)
    return everyone.index(coords) == torch.distributed.get_rank()


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


def _load_worker(rank, world, port, model, layout, ckpt_dir, out_path, keep=None):
    init_distributed(rank, world, port, tp=layout.tp, pp=layout.pp, ep=layout.ep, etp=layout.etp)
    try:
        gpt = build_gpt(model, layout)
        coords = rank_coords(layout)
        state = get_format("legacy").load_rank(ckpt_dir, coords, layout)  # weights only: nothing in it runs
        gpt.load_state_dict(state["model"], strict=True)
        with restrict_routers(gpt, keep) if keep is not None else contextlib.nullcontext():
            logits = forward_logits(gpt, fixed_tokens(model))
        first = writes_folder(coords, world)  # a collective: every rank calls it once
        if logits is not None and first and coords == (0, layout.pp - 1, 0):
            torch.save(logits, out_path)
        torch.distributed.barrier()
    finally:
        destroy_distributed()


def load_and_run(
    model: ToyMoE, layout: Layout, ckpt_dir: str | os.PathLike, out_path, keep: dict[str, list[int]] | None = None
) -> torch.Tensor:
    """Load a legacy checkpoint into megatron-core models built at `layout` in spawned gloo ranks
    (strict; with `torch.load(weights_only=True)` and the allow-list of safe globals), run the
    fixed tokens, and return the logits [b, s, vocab]. `keep` restricts the routers to those
    experts (see `restrict_routers`)."""
    torch.multiprocessing.spawn(
        _load_worker,
        args=(layout.world_size, free_port(), model, layout, str(ckpt_dir), str(out_path), keep),
        nprocs=layout.world_size,
        join=True,
    )
    return torch.load(out_path)
