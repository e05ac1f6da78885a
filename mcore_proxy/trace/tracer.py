"""Tracer: the accumulators of one rank, the de-duplication rules, step counting and flushing.

The tracer knows nothing about megatron: `mcore_proxy.trace.megatron` turns a router module into
a `RouterInfo` (layer id, whether this rank's router input counts) and calls `record`.

Rules (written into every sidecar as `dedupe`):
- tensor-parallel ranks without sequence parallelism see identical router inputs: only TP rank 0
  records them; with sequence, context, data or expert parallelism every rank records its own
  tokens (the router runs before the token dispatch, on the rank's own tokens);
- router calls made while the autograd engine runs a backward pass are the re-computation of
  activation checkpointing (megatron's full/selective recompute re-runs the forward inside
  backward): they are skipped, so a token is counted once;
- tokens marked as padding (`padding_mask` True, megatron-core's convention) are left out.

A *step* is one forward pass of the model on this rank: a call of the first MoE router this rank
records (its lowest local MoE layer); with gradient accumulation that is one micro-batch. With
`flush_every=N` the file is rewritten (atomically, cumulative totals) when step N+1, 2N+1, ...
begins, so a file always holds whole forward passes; `close()` writes the final totals.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from mcore_proxy.core.stats import RoutingStats, layer_sort_key, save_stats
from mcore_proxy.engines.hooks import Hooks
from mcore_proxy.trace.accumulator import LayerAccumulator, full_routing

log = logging.getLogger(__name__)

FILE_PATTERN = "rank{rank:05d}.safetensors"
DEDUPE_RULE = (
    "tensor-parallel ranks without sequence parallelism see identical router inputs: "
    "only TP rank 0 records them; with sequence, context, data or expert parallelism "
    "every rank records its own tokens; router calls during backward (activation "
    "recomputation) are skipped; padding tokens are excluded"
)


@dataclass(frozen=True)
class RouterInfo:
    """What the tracer needs to know about one router, resolved once per router."""

    layer_id: str  # "12" (global 0-based decoder layer) or "mtp.0"
    num_experts: int
    topk: int
    counts: bool = True  # False on TP ranks > 0 without sequence parallelism


_GRAPH_TASK_ID = getattr(torch._C, "_current_graph_task_id", None)


def in_backward() -> bool:
    """True while the autograd engine executes a backward pass on this thread, which is where
    activation checkpointing re-runs forward code. (torch < 2.0 cannot tell: never skipped.)"""
    return _GRAPH_TASK_ID is not None and _GRAPH_TASK_ID() != -1


def _global_rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


def _world_size() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


class Tracer:
    """Routing statistics of one rank. A context manager: on exit it flushes and detaches."""

    def __init__(
        self, out_dir: str | os.PathLike, *, flush_every: int = 0, rank: int | None = None, meta: dict | None = None
    ):
        self.out_dir = Path(out_dir)
        self.flush_every = int(flush_every)
        self.layers: dict[str, LayerAccumulator] = {}
        self.topk: int | None = None
        self.steps = 0
        self.meta = dict(meta or {})
        self._rank = rank
        self._world = None
        self._step_layer: str | None = None
        self.hooks = Hooks()  # every hook that feeds this tracer; `detach` removes them
        self._skipped_backward = 0
        self.closed = False

    # -- recording -------------------------------------------------------------------------
    def record(
        self,
        info: RouterInfo,
        hidden: torch.Tensor,
        probs: torch.Tensor,
        routing_map: torch.Tensor,
        padding_mask: torch.Tensor | None = None,
    ) -> None:
        """One router call: hidden [s, b, H] or [T, H], probs/routing_map [T, E] (or the older
        `scores, indices [T, k]`), padding_mask [s, b] or [T] with True for padding."""
        if self.closed or not info.counts:
            return
        if in_backward():
            self._skipped_backward += 1
            return
        if self._rank is None:
            self._rank, self._world = _global_rank(), _world_size()
        if self._step_layer is None:
            self._step_layer = info.layer_id
        if info.layer_id == self._step_layer:
            if self.flush_every and self.steps and self.steps % self.flush_every == 0:
                self.flush()
            self.steps += 1
        probs, routing_map = full_routing(probs, routing_map, info.num_experts)
        acc = self.layers.get(info.layer_id)
        if acc is None:
            acc = LayerAccumulator(info.num_experts, hidden.shape[-1], hidden.device)
            self.layers[info.layer_id] = acc
            self.topk = info.topk
        acc.add(hidden, probs, routing_map, padding_mask)

    def record_saliency(
        self, layer_id: str, global_experts: torch.Tensor, output: torch.Tensor, tokens_per_expert
    ) -> None:
        """One experts-module call: output [N, H] rows grouped by local expert, each row already
        scaled by its gate (megatron-core applies the probabilities inside the experts);
        tokens_per_expert [E_local] rows per local expert; global_experts [E_local] their ids."""
        if self.closed or in_backward():
            return
        acc = self.layers.get(layer_id)
        if acc is None:  # the router of this layer is not recorded on this rank
            return
        with torch.no_grad():
            # the reduction accumulates in fp32 for bf16/fp16 rows; only the [N] result is
            # rounded to the output dtype (a float copy of all rows would cost 8x the time)
            norms = output.detach().norm(dim=-1)
            counts = torch.as_tensor(tokens_per_expert, device=norms.device)
            owner = torch.repeat_interleave(
                torch.arange(counts.numel(), device=norms.device), counts, output_size=norms.shape[0]
            )
            sums = torch.zeros(counts.numel(), dtype=torch.float64, device=norms.device)
            sums.index_add_(0, owner, norms.to(torch.float64))
            acc.add_saliency(global_experts, sums)

    # -- output ----------------------------------------------------------------------------
    def stats(self) -> RoutingStats | None:
        """Host copy of everything recorded so far (None before the first recorded call)."""
        if not self.layers:
            return None
        layers = {lid: self.layers[lid].to_layer_stats() for lid in sorted(self.layers, key=layer_sort_key)}
        meta = dict(self.meta)
        meta.update(
            rank=self._rank if self._rank is not None else _global_rank(),
            world_size=self._world if self._world is not None else _world_size(),
            ranks_merged=1,
            steps=self.steps,
            dedupe=DEDUPE_RULE,
            recompute_calls_skipped=self._skipped_backward,
        )
        return RoutingStats(layers, int(self.topk), meta)

    @property
    def path(self) -> Path:
        rank = self._rank if self._rank is not None else _global_rank()
        return self.out_dir / FILE_PATTERN.format(rank=rank)

    def flush(self) -> Path | None:
        """Write `rank{R:05d}.safetensors` + `.json` atomically; None if nothing was recorded."""
        stats = self.stats()
        if stats is None:
            log.info("trace: rank %s recorded no MoE router call; no file written", self._rank)
            return None
        return save_stats(stats, self.path)

    def detach(self) -> None:
        """Remove every hook this tracer owns (`hooks`)."""
        self.hooks.remove()

    def close(self) -> Path | None:
        """Final flush, then detach every hook. Idempotent."""
        if self.closed:
            return None
        try:
            return self.flush()
        finally:
            self.closed = True
            self.detach()

    def __enter__(self) -> "Tracer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Tracer(out_dir={str(self.out_dir)!r}, layers={len(self.layers)}, steps={self.steps})"
