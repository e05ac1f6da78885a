"""Per-layer routing-statistics accumulator (DESIGN.md 4.1), on the device the router runs on.

Every update is a handful of tensor operations over the whole micro-batch: two matrix products
(`routing_map.T @ routing_map`, whose diagonal is freq, and `routing_map.T @ hidden`) and a
masked column sum;
no Python loop over tokens and no device-to-host copy. Counts are int64; sums are formed in fp32
per update (a 0/1 mask times the activations, exact for bf16 inputs even under TF32) and
accumulated in fp64. The host sees the numbers only in `to_layer_stats`, i.e. at a flush.
"""

from __future__ import annotations

import torch

from mcore_proxy.core.stats import LayerStats


def full_routing(probs: torch.Tensor, routing: torch.Tensor, num_experts: int):
    """Normalise router outputs to `probs [T, E] float, routing_map [T, E] bool`.

    megatron-core >= 0.9 returns exactly that. Older cores (and MindSpeed-LLM forks of them)
    return `scores [T, k], indices [T, k] int`; those are scattered into the dense form.
    """
    if routing.dtype == torch.bool:
        return probs.reshape(-1, num_experts), routing.reshape(-1, num_experts)
    indices = routing.reshape(-1, routing.shape[-1]).long()
    tokens = indices.shape[0]
    dense_map = torch.zeros(tokens, num_experts, dtype=torch.bool, device=indices.device)
    dense_map.scatter_(1, indices, True)
    dense_probs = torch.zeros(tokens, num_experts, dtype=probs.dtype, device=probs.device)
    dense_probs.scatter_(1, indices, probs.reshape(tokens, -1))
    return dense_probs, dense_map


_FP32_OUT_GEMM: dict[tuple[str, torch.dtype], bool] = {}
_CPU_CHUNK = 256


def routed_sum(mask: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """`mask.T @ hidden` in fp32: mask [T, E] 0/1 fp32, hidden [T, H] -> [E, H] fp32.

    For bf16/fp16 activations on an accelerator, a half-precision GEMM that accumulates and
    returns fp32 (`torch.mm(..., out_dtype=torch.float32)`, torch >= 2.8 on CUDA) is exact
    here (0/1 times a half value is exact) and several times faster than upcasting; where the
    backend lacks it (CPU, older torch, other devices) the activations are upcast to fp32 - on
    CPU in slices of `_CPU_CHUNK` tokens, so that the upcast copy stays in cache (half the time
    of one large upcast; on accelerators one launch beats many).
    """
    key = (hidden.device.type, hidden.dtype)
    half = hidden.dtype in (torch.bfloat16, torch.float16)
    if half and _FP32_OUT_GEMM.get(key, hidden.device.type != "cpu"):
        try:
            out = torch.mm(mask.t().to(hidden.dtype), hidden, out_dtype=torch.float32)
            _FP32_OUT_GEMM[key] = True
            return out
        except (RuntimeError, NotImplementedError, TypeError):
            _FP32_OUT_GEMM[key] = False
    if hidden.device.type == "cpu" and hidden.dtype != torch.float32 and hidden.shape[0] > _CPU_CHUNK:
        out = torch.zeros(mask.shape[1], hidden.shape[1], dtype=torch.float32)
        mask_t = mask.t()
        for start in range(0, hidden.shape[0], _CPU_CHUNK):
            stop = start + _CPU_CHUNK
            out.addmm_(mask_t[:, start:stop], hidden[start:stop].float())
        return out
    return mask.t() @ hidden.float()


class LayerAccumulator:
    """Running sums for one MoE layer: tokens, freq [E], gate_mass [E], coact [E, E],
    proto_sum [E, H] and, once `add_saliency` was called, saliency_sum [E]."""

    def __init__(self, num_experts: int, hidden_size: int, device: torch.device | str):
        e, h = num_experts, hidden_size
        self.num_experts, self.hidden_size = e, h
        self.tokens = torch.zeros((), dtype=torch.int64, device=device)
        self.freq = torch.zeros(e, dtype=torch.int64, device=device)
        self.gate_mass = torch.zeros(e, dtype=torch.float64, device=device)
        self.coact = torch.zeros(e, e, dtype=torch.int64, device=device)
        self.proto_sum = torch.zeros(e, h, dtype=torch.float64, device=device)
        self.saliency_sum: torch.Tensor | None = None

    @torch.no_grad()
    def add(
        self,
        hidden: torch.Tensor,
        probs: torch.Tensor,
        routing_map: torch.Tensor,
        padding_mask: torch.Tensor | None = None,
    ) -> None:
        """Add one router call.

        hidden [T, H] (or [s, b, H]): router input; probs [T, E]: routing probabilities (zero
        outside the top-k); routing_map [T, E] bool; padding_mask [T] (or [s, b]) bool, True
        marks a padding token (megatron-core's convention), which is left out of every sum.
        """
        hidden = hidden.detach().reshape(-1, self.hidden_size)
        selected = routing_map.detach().reshape(-1, self.num_experts)
        if padding_mask is not None:
            valid = ~padding_mask.detach().reshape(-1, 1).to(device=selected.device, dtype=torch.bool)
            selected = selected & valid
            self.tokens += valid.sum()
        else:
            self.tokens += selected.shape[0]
        mask = selected.to(torch.float32)  # [T, E] 0/1
        coact = (mask.t() @ mask).to(torch.int64)  # exact: integers < 2**24 per call
        self.coact += coact
        self.freq += coact.diagonal()  # a token selects e with itself
        self.gate_mass += (probs.detach().reshape(mask.shape) * mask).sum(dim=0).to(torch.float64)
        self.proto_sum += routed_sum(mask, hidden).to(torch.float64)

    @torch.no_grad()
    def add_saliency(self, global_experts: torch.Tensor, sums: torch.Tensor) -> None:
        """Add per-expert sums of gate x ||expert output|| for the experts `global_experts` [n]."""
        if self.saliency_sum is None:
            self.saliency_sum = torch.zeros(self.num_experts, dtype=torch.float64, device=self.freq.device)
        self.saliency_sum.index_add_(0, global_experts.to(self.freq.device), sums.to(self.saliency_sum))

    def to_layer_stats(self) -> LayerStats:
        """Host copy as the contract's LayerStats (the only device-to-host transfer)."""
        sal = None if self.saliency_sum is None else self.saliency_sum.cpu().numpy()
        return LayerStats(
            int(self.tokens.item()),
            self.freq.cpu().numpy(),
            self.gate_mass.cpu().numpy(),
            self.coact.cpu().numpy(),
            self.proto_sum.cpu().numpy(),
            sal,
        )
