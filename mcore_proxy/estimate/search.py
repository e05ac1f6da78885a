"""The smallest valid Megatron layouts whose most loaded device fits the memory budget.

Valid: TP divides the attention heads, key/value groups, vocabulary and MLP widths (at most one
node, and one of 1, 2, 4, 8); PP splits the decoder layers (`memory.stage_layers`); EP divides
the routed experts; ETP divides the expert width (1 unless fixed: the usual MoE setting);
EP x ETP divides TP x DP; the device count is a divisor or a multiple of the devices per node.
Memory falls with DP only through the distributed optimizer's shards, so for every (TP, PP, EP,
ETP) the smallest DP that fits is solved for directly instead of tried one by one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from mcore_proxy.core.errors import ProxyError
from mcore_proxy.estimate.memory import (
    DeviceMemory,
    Layout,
    Training,
    device_memory,
    device_params,
    stage_activations,
    stage_layers,
    stage_params,
)
from mcore_proxy.mcore.spec import ModelSpec

TP_CHOICES = (1, 2, 4, 8)


@dataclass(frozen=True)
class Constraints:
    """Parallel sizes the user fixed (None: searched) and the bounds of the search."""

    tp: int | None = None
    pp: int | None = None
    ep: int | None = None
    etp: int | None = None
    dp: int | None = None
    devices_per_node: int = 8
    max_devices: int = 16384


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tp_problem(a: ModelSpec, tp: int) -> str | None:
    """Why Megatron cannot split this model over `tp` tensor-parallel ranks (None: it can)."""
    sizes = {"attention heads": a.num_attention_heads, "vocabulary rows": a.vocab_size, "MLP width": a.ffn_hidden_size}
    if a.mla is None and a.v4_attention is None:  # MLA's latent and V4's one shared head are whole
        sizes["key/value groups"] = a.num_query_groups
    if a.v4_attention is not None:
        sizes["output-projection groups"] = a.v4_attention.o_groups
        sizes["indexer heads"] = a.v4_attention.index_n_heads
    if a.linear_attention is not None:
        sizes["linear-attention key heads"] = a.linear_attention.num_key_heads
        sizes["linear-attention value heads"] = a.linear_attention.num_value_heads
    if a.shared_expert_size:
        sizes["shared-expert width"] = a.shared_expert_size
    bad = [f"{n} {what}" for what, n in sizes.items() if n % tp]
    return f"TP={tp} does not divide the {' and '.join(bad)}" if bad else None


def valid_tps(a: ModelSpec, node: int) -> list[int]:
    return [t for t in TP_CHOICES if t <= node and tp_problem(a, t) is None]


def allowed_devices(n: int, node: int) -> bool:
    """Whole nodes, or a part of one that divides it."""
    return n % node == 0 or node % n == 0


@lru_cache(maxsize=4096)
def _stage_terms(a: ModelSpec, stages: tuple[int, ...], tp: int, ep: int, etp: int, train: Training):
    """Per stage: (bytes that do not shrink with DP, dense optimizer bytes, expert optimizer bytes)."""
    weight_b, grad_b, optim_b = train.bytes_per_param
    probe = Layout(tp=tp, pp=len(stages), ep=ep, etp=etp, dp=ep * etp, stages=stages)
    acts = stage_activations(a, probe, train)
    terms = []
    for s, p in enumerate(stage_params(a, stages)):
        dense, expert, buffers = device_params(p, probe)
        fixed = (dense + expert) * (weight_b + grad_b) + 4 * buffers + acts[s]
        terms.append((fixed, dense * optim_b, expert * optim_b))
    return tuple(terms)


def _smallest_dp(terms, budget: int, tp: int, ep: int, etp: int, base: int) -> int | None:
    """Smallest multiple of `base` with every stage's fixed + dense/dp + expert/edp <= budget."""
    need = 1.0
    for fixed, dense_opt, expert_opt in terms:
        room = budget - fixed
        if room <= 0:
            return None
        need = max(need, (dense_opt + expert_opt * ep * etp / tp) / room)
    return base * max(1, math.ceil(need / base))


def _shapes(a: ModelSpec, c: Constraints):
    """Every valid (TP, PP stages, EP, ETP) under the constraints, with the DP step they need:
    EP x ETP must divide TP x DP, so DP is a multiple of lcm(TP, EP x ETP) / TP."""
    for tp in [c.tp] if c.tp else valid_tps(a, c.devices_per_node):
        for pp in [c.pp] if c.pp else range(1, a.num_layers + 1):
            stages = stage_layers(a.num_layers, pp)
            if stages is None or tp * pp > c.max_devices:
                continue
            for etp in [c.etp] if c.etp else [1]:
                for ep in [c.ep] if c.ep else _divisors(a.num_experts):
                    yield tp, stages, ep, etp, math.lcm(tp, ep * etp) // tp


def fitting_layouts(a: ModelSpec, train: Training, budget: int, c: Constraints) -> list[tuple[Layout, DeviceMemory]]:
    """Every (TP, PP, EP, ETP) at its smallest fitting DP, fewest devices first, then least memory."""
    found = []
    for tp, stages, ep, etp, base in _shapes(a, c):
        if c.dp:
            dp = c.dp if c.dp % base == 0 else None
        else:
            dp = _smallest_dp(_stage_terms(a, stages, tp, ep, etp, train), budget, tp, ep, etp, base)
        while dp is not None and tp * len(stages) * dp <= c.max_devices:
            layout = Layout(tp=tp, pp=len(stages), ep=ep, etp=etp, dp=dp, stages=stages)
            mem = device_memory(a, layout, train)
            if mem.total <= budget and allowed_devices(layout.devices, c.devices_per_node):
                found.append((layout, mem))
                break
            dp = None if c.dp else dp + base  # rounding, or a device count that is not whole nodes
    found.sort(key=lambda lm: (lm[0].devices, lm[1].total, lm[0].tp, lm[0].pp))
    return found


def least_memory(a: ModelSpec, train: Training, c: Constraints) -> tuple[Layout, DeviceMemory] | None:
    """The layout within the device bound whose most loaded device needs the least memory (each
    shape at its largest DP, where the optimizer state is spread thinnest)."""
    best = None
    for tp, stages, ep, etp, base in _shapes(a, c):
        per = tp * len(stages)
        dp = c.dp or base * (c.max_devices // (per * base))
        while not c.dp and dp > 0 and not allowed_devices(per * dp, c.devices_per_node):
            dp -= base
        if dp < 1 or dp % base or per * dp > c.max_devices:
            continue
        layout = Layout(tp=tp, pp=len(stages), ep=ep, etp=etp, dp=dp, stages=stages)
        mem = device_memory(a, layout, train)
        if best is None or mem.total < best[1].total:
            best = (layout, mem)
    return best


def check_constraints(a: ModelSpec, c: Constraints) -> None:
    """ProxyError naming the fixed size that cannot work for this model, with the nearest valid ones."""
    if c.tp and (problem := tp_problem(a, c.tp)):
        raise ProxyError(f"--tp {c.tp}: {problem}; nearest valid: {nearest(c.tp, valid_tps(a, 64), '--tp')}")
    if c.pp and stage_layers(a.num_layers, c.pp) is None:
        ok = [p for p in range(1, a.num_layers + 1) if stage_layers(a.num_layers, p)]
        raise ProxyError(
            f"--pp {c.pp} cannot split {a.num_layers} decoder layers into stages of at least "
            f"one layer; nearest valid: {nearest(c.pp, ok, '--pp')}"
        )
    if c.ep and a.num_experts % c.ep:
        raise ProxyError(
            f"--ep {c.ep} does not divide the {a.num_experts} experts of {a.name}; "
            f"nearest valid: {nearest(c.ep, _divisors(a.num_experts), '--ep')}"
        )
    if c.etp and a.moe_ffn_hidden_size % c.etp:
        raise ProxyError(
            f"--etp {c.etp} does not divide the expert width {a.moe_ffn_hidden_size}; nearest "
            f"valid: {nearest(c.etp, _divisors(a.moe_ffn_hidden_size), '--etp')}"
        )
    tp, ep, etp = c.tp or 1, c.ep or 1, c.etp or 1
    if c.dp and (tp * c.dp) % (ep * etp):
        base = math.lcm(tp, ep * etp) // tp
        raise ProxyError(
            f"--dp {c.dp}: TP x DP = {tp * c.dp} is not a multiple of EP x ETP = {ep * etp}; "
            f"nearest valid: {nearest(c.dp, list(range(base, 4 * max(base, c.dp) + 1, base)), '--dp')}"
        )


def nearest(value: int, valid: list[int], flag: str) -> str:
    """The closest valid values below and above, as flags: `--ep 16 or --ep 32`."""
    below = [v for v in valid if v < value]
    above = [v for v in valid if v > value]
    options = ([max(below)] if below else []) + ([min(above)] if above else [])
    return " or ".join(f"{flag} {v}" for v in options) or "none"
