"""Router faults: corrupted logits (`router_noise`, `router_precision`, `router_tie_flip`), a
corrupted weight (`router_weight`) and altered top-k choices (`topk`).

Logits are changed between megatron's `TopKRouter.gating` and `routing`: the router instance gets
a `gating` of its own that calls its class's `gating` (whatever MindSpeed installed there) and then
the attached logit faults in order, so aux losses, z-loss and expert-bias updates see the corrupted
logits as they would with a corrupted router. Choices are changed on the router's forward output
`(probs [tokens, E], routing_map [tokens, E] bool)` by a forward hook, which every forward
replacement passes through. For transformers the gate `nn.Linear`'s output is changed by a hook.
"""

from __future__ import annotations

import torch

from mcore_proxy.engines.hooks import CallbackHandle
from mcore_proxy.core.routing import softmax_topk
from mcore_proxy.faults.base import Injector

_CHAIN = "_mcore_proxy_logit_faults"


def add_logit_fault(router, fn) -> CallbackHandle:
    """Run `fn(input, logits) -> logits` after `router.gating`; removable."""
    chain = router.__dict__.get(_CHAIN)
    if chain is None:
        chain = []

        def gating(input, _router=router, _chain=chain):
            logits = type(_router).gating(_router, input)
            for step in list(_chain):
                logits = step(input, logits)
            return logits

        object.__setattr__(router, _CHAIN, chain)
        object.__setattr__(router, "gating", gating)
    chain.append(fn)

    def remove():
        chain.remove(fn)
        if not chain:
            del router.__dict__["gating"]
            del router.__dict__[_CHAIN]

    return CallbackHandle(remove)


def _logit_site_handles(injector, site, transform) -> list:
    """Attach `transform(input, logits, layer_id)` to a megatron router or a transformers gate."""

    def fn(input, logits):
        lid = site.layer()
        if not injector.wants_layer(lid) or not injector.on():
            return logits
        return transform(input, logits, lid)

    if site.kind == "router":
        return [add_logit_fault(site.module, fn)]
    if site.kind == "vllm_router":  # before vLLM's own rule, which derives the top-k from them
        from mcore_proxy.engines.vllm import add_logit_transform

        return [add_logit_transform(site.module, fn)]

    def hook(router, args, output):  # transformers: (logits, top-k scores, indices)
        logits = fn(args[0].reshape(-1, args[0].shape[-1]), output[0])
        if logits is output[0]:
            return None
        return (logits, *softmax_topk(router, logits))

    return [site.module.register_forward_hook(hook)]


class RouterNoise(Injector):
    """logits + std * N(0, 1)."""

    kind = "router_noise"
    sites = ("router", "gate", "vllm_router")

    def _transform(self, input, logits, lid):
        return logits + self.spec["std"] * self.randn_like(logits)

    def attach_router(self, site):
        return _logit_site_handles(self, site, self._transform)

    attach_gate = attach_vllm_router = attach_router


class RouterPrecision(Injector):
    """logits rounded to bf16, fp16 or fp8 E4M3 (and cast back): a router run in low precision."""

    kind = "router_precision"
    sites = ("router", "gate", "vllm_router")

    def attach_router(self, site):
        from mcore_proxy.faults.logprob import DTYPES, round_to

        dtype = DTYPES[self.spec["dtype"]]
        return _logit_site_handles(self, site, lambda input, logits, lid: round_to(logits, dtype))

    attach_gate = attach_vllm_router = attach_router


def site_topk(site) -> int:
    """The experts per token of a router site: megatron's `topk`, transformers' and vLLM's `top_k`."""
    return int(getattr(site.module, "topk", None) or site.module.top_k)


def flip_near_ties(logits: torch.Tensor, k: int, margin: float) -> torch.Tensor:
    """logits [..., E] (megatron's [S, B, E], transformers' and vLLM's [T, E]) -> the same, with
    the logits of each token's k-th and (k+1)-th expert swapped where they lie less than `margin`
    apart: the runner-up takes the last place, as a tie broken the other way by a different kernel
    or reduction order would. Unchanged where no pair is that close (margin 0: never)."""
    if k >= logits.shape[-1]:
        return logits
    shape, logits = logits.shape, logits.reshape(-1, logits.shape[-1])
    values, index = logits.float().topk(k + 1, dim=-1)
    near = (values[:, k - 1] - values[:, k]) < margin
    if not bool(near.any()):
        return logits.reshape(shape)
    rows = near.nonzero()[:, 0]
    last, runner_up = index[rows, k - 1], index[rows, k]
    out = logits.clone()
    out[rows, last], out[rows, runner_up] = logits[rows, runner_up], logits[rows, last]
    return out.reshape(shape)


class RouterTieFlip(Injector):
    """Near-ties at the top-k boundary broken the other way: the rollout engine's kernels sum in
    another order than the trainer's, so a token whose k-th and (k+1)-th experts score within a
    hair goes to the other one (R3's mechanism). Compared on the router logits; for a router that
    chooses by score + selection bias (DeepSeek-V3) or by group, the logits' order is a proxy."""

    kind = "router_tie_flip"
    sites = ("router", "gate", "vllm_router")

    def attach_router(self, site):
        k, margin = site_topk(site), self.spec["margin"]
        return _logit_site_handles(self, site, lambda input, logits, lid: flip_near_ties(logits, k, margin))

    attach_gate = attach_vllm_router = attach_router


class RouterWeight(Injector):
    """logits of the weight W + N: logits + x N^T, N [E, H] fixed per layer, std = `std` x rms(W)."""

    kind = "router_weight"
    sites = ("router", "gate")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._perturbation: dict[int, torch.Tensor] = {}

    def perturbation(self, weight: torch.Tensor, lid: str | None, key: int | None = None) -> torch.Tensor:
        """N for `weight`, drawn once per `key` (default: the weight) on first use."""
        key = id(weight) if key is None else key
        if key not in self._perturbation:
            g = self.keyed_generator(f"layer{lid}", weight.device)
            noise = torch.randn(weight.shape, generator=g, device=weight.device, dtype=torch.float32)
            rms = weight.detach().float().pow(2).mean().sqrt()
            self._perturbation[key] = noise * self.spec["std"] * rms
        return self._perturbation[key]

    def _attach(self, site):
        module = site.module

        def transform(input, logits, lid):
            # the weight as it is when the router runs: transformers' from_pretrained replaces the
            # parameters after post_init (where environment activation attaches), so rms(W) is the
            # loaded weight's, not the random initialisation's
            delta = self.perturbation(module.weight, lid, id(module)).to(device=logits.device, dtype=logits.dtype)
            return logits + torch.nn.functional.linear(input.to(logits.dtype), delta)

        return _logit_site_handles(self, site, transform)

    attach_router = attach_gate = _attach


def alter_topk(
    probs: torch.Tensor, routing_map: torch.Tensor, rate: float, mode: str, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Alter each chosen (token, expert) with probability `rate`.

    probs [T, E] float (0 where not chosen), routing_map [T, E] bool -> new (probs, routing_map).
    drop: the choice is removed (probability 0). swap: it moves to an expert the token had not
    chosen, chosen at random, which takes its probability; every token keeps its expert count.
    """
    hit = routing_map & (torch.rand(routing_map.shape, generator=generator, device=routing_map.device) < rate)
    if mode == "drop":
        return probs.masked_fill(hit, 0.0), routing_map & ~hit
    t, e = routing_map.shape
    free = ~routing_map
    hit &= hit.cumsum(dim=1) <= free.sum(dim=1, keepdim=True)  # never more swaps than free experts
    lost = hit.sum(dim=1, keepdim=True)
    k = int(lost.max()) if t else 0
    if k == 0:
        return probs, routing_map
    # replacements: `lost` of the token's free experts, in random order
    scores = torch.rand((t, e), generator=generator, device=routing_map.device).masked_fill(routing_map, -1.0)
    new = free & (scores.argsort(dim=1, descending=True).argsort(dim=1) < lost)
    # the j-th lost choice of a token hands its probability to the token's j-th new expert
    index = torch.arange(e, device=probs.device)
    src = torch.where(hit, index, e).sort(dim=1).values[:, :k]  # e: padding
    dst = torch.where(new, index, e).sort(dim=1).values[:, :k]
    padded = torch.cat([probs.masked_fill(hit, 0.0), probs.new_zeros(t, 1)], dim=1)
    moved = torch.cat([probs, probs.new_zeros(t, 1)], dim=1).gather(1, src)
    out = padded.scatter(1, dst, moved)[:, :e]
    return out, (routing_map & ~hit) | new


class TopK(Injector):
    """Swap or drop top-k choices at a rate: megatron routers' `(probs, routing_map)` outputs,
    transformers routers' `(logits, scores [T, k], indices [T, k])` (a dropped choice keeps its
    index with score 0)."""

    kind = "topk"
    sites = ("router", "gate")

    def attach_gate(self, site):
        def hook(router, args, output):
            if not self.wants_layer(site.layer()) or not self.on():
                return None
            logits, scores, index = output[0], output[1], output[2]
            t, e = logits.shape[0], router.num_experts
            routing_map = torch.zeros((t, e), dtype=torch.bool, device=index.device).scatter(1, index, True)
            probs = torch.zeros((t, e), dtype=scores.dtype, device=scores.device).scatter(1, index, scores)
            probs, routing_map = alter_topk(
                probs, routing_map, self.spec["rate"], self.spec["mode"], self.generator(index.device)
            )
            if self.spec["mode"] == "drop":
                return (logits, probs.gather(1, index), index)
            new_index = routing_map.nonzero()[:, 1].view(t, -1)
            return (logits, probs.gather(1, new_index), new_index)

        return [site.module.register_forward_hook(hook)]

    def attach_router(self, site):
        def hook(module, args, output):
            if not self.wants_layer(site.layer()) or not self.on():
                return None
            probs, routing_map = output[0], output[1]
            g = self.generator(routing_map.device)
            new_probs, new_map = alter_topk(probs, routing_map, self.spec["rate"], self.spec["mode"], g)
            return (new_probs, new_map, *output[2:])

        return [site.module.register_forward_hook(hook)]
