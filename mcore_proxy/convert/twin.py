"""The twin proof: before a proxy is written for a family discovered from transformers
(`checkpoint/hf/discovery.py`), the family's record is proven on the architecture's tiny twin.

The twin (its config from `discovery.Discovery.twin`: the checkpoint's structure, small sizes) is
built by transformers on CPU with random weights, routers unit-scale so that dropping experts
changes the routing. Its state dict is read by the same reader a folder gets
(`native.StateDictView`), pruned to half its experts per layer (per group where routing is
grouped) by the same `PrunedView`, written by the same output rule (`native_writer`: every
tensor's key and config.json), and loaded by transformers into the proxy twin. The proof holds
when the proxy twin's logits equal the original twin's with its routers restricted to the kept
experts (`hf.models.restrict_gates`) within 1e-5 (relative to the logit), in fp32 or, where
transformers' fp32 kernels round above that, in fp64 with eager experts (and softmaxes a router
asks for in float32 kept in float64); and when restricting the routers moved the logits at all
(else the proof could not have failed). The pruned checkpoint
in `save_pretrained`'s spelling (transformers' `revert_weight_conversion`) must equal the proxy
twin's own, key for key and bit for bit: the spelling a Hub checkpoint uses is proven too.

Nothing is written to disk: the proof runs in memory, in seconds, once per architecture and
config structure in a process (commands write only their own output, so it is not cached on
disk). `inspect` reports it; `convert` refuses a discovered family whose proof fails.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

from mcore_proxy.checkpoint.hf import (
    FULL_LIST,
    Discovery,
    HFConfig,
    StateDictView,
    build_twin,
    discovered,
    native_outputs,
    proxy_config,
)
from mcore_proxy.core.errors import CheckpointError
from mcore_proxy.convert.prune import PrunedView
from mcore_proxy.select.plan import LayerPlan, RouterSettings, SelectionPlan, SourceInfo

TOLERANCE = 1e-5
MIN_EFFECT = 1e-3  # restricting the routers must move some logit this much, or the proof proves nothing
# router logits of std ~2.4 at the twin's hidden size 64: decisive, yet no sigmoid saturates to 1.0 in
# fp32; saturated scores tie exactly, and torch.topk breaks ties by position, so even the original's
# choice would depend on the expert count (Flint, whose router is fp32 in every precision, did at 1.0)
ROUTER_STD = 0.3


@dataclass(frozen=True)
class Proof:
    """A family's twin proof. max_abs_diff: proxy twin vs the restricted original (logits);
    effect: how far restricting the routers moved the original's logits; precision: "fp32", or
    "fp64" where fp32 rounding alone exceeded the tolerance."""

    architecture: str
    passed: bool
    max_abs_diff: float | None  # None where the twin could not be pruned and loaded
    effect: float
    precision: str
    experts: tuple[int, int]  # the twin's (E, K)
    seconds: float
    why: str = ""

    def summary(self) -> str:
        if not self.passed:
            return f"twin proof failed: {self.why}"
        return (
            f"proven on a tiny twin ({self.experts[0]} -> {self.experts[1]} experts per layer): the pruned twin "
            f"equals the restricted original within {self.max_abs_diff:.1e} ({self.precision}, restriction moved "
            f"the logits {self.effect:.2f}), {self.seconds:.1f} s"
        )


def proof_of(view) -> Proof | None:
    """The twin proof of a view whose family was discovered; None for declared families (their
    tests prove them) and other formats."""
    family = getattr(view.info.format_info, "descriptor", None)
    if family is None or family.origin != "discovered":
        return None
    return prove(family.architectures[0])


def require_proven(view) -> Proof | None:
    """`proof_of(view)`, and CheckpointError in one sentence if it failed."""
    proof = proof_of(view)
    if proof is not None and not proof.passed:
        raise CheckpointError(
            f"{view.path}: {proof.architecture} was discovered from transformers, but its {proof.why}, so no "
            f"proxy is written from it; every family and its status: {FULL_LIST}"
        )
    return proof


_PROOFS: dict[tuple[str, str], Proof] = {}


def prove(architecture: str) -> Proof:
    """The twin proof of the family discovered for `architecture` in this process (once per twin)."""
    found = discovered(architecture)
    if found is None:
        raise CheckpointError(f"{architecture}: no family was discovered for it in this process; open its checkpoint")
    key = (architecture, json.dumps(found.twin, sort_keys=True, default=str))
    if key not in _PROOFS:
        _PROOFS[key] = run_proof(found)
    return _PROOFS[key]


def run_proof(found: Discovery) -> Proof:
    """The proof of one discovery's family record on its twin (`prove` runs it once per twin)."""
    architecture = found.family.architectures[0]
    start = time.perf_counter()
    try:
        return _prove(found, start)
    except (RuntimeError, ValueError, KeyError, IndexError, TypeError, CheckpointError) as err:
        why = f"twin could not be pruned and loaded ({type(err).__name__}: {' '.join(str(err).split())[:200]})"
        return Proof(architecture, False, None, 0.0, "", (found.twin_experts, 0), _since(start), why)


def _since(start: float) -> float:
    return time.perf_counter() - start


def _prove(found: Discovery, start: float) -> Proof:
    import torch

    from mcore_proxy.hf.models import restrict_gates, run

    family, arch = found.family, found.family.architectures[0]
    original = build_twin(found.twin)
    fill(original, family)
    state = original.state_dict()
    config = HFConfig(found.twin, Path(f"<twin of {arch}>") / "config.json")
    view = StateDictView(state, config, family)
    plan = twin_plan(view.spec)
    pruned = PrunedView(view, plan)
    proxy = build_twin(proxy_config(found.twin, pruned.spec, family))
    proxy.load_state_dict(_written(pruned), strict=True)
    tokens = torch.randint(3, 120, (2, 11), generator=torch.Generator().manual_seed(5))
    full = run(original, tokens)
    with restrict_gates(original, plan):
        reference = run(original, tokens)
    got = run(proxy, tokens)
    precision = "fp32"
    if not _close(got, reference):
        precision = "fp64"  # transformers' fp32 kernels round above the tolerance: the exact arithmetic decides
        for model in (original, proxy):
            model.double()
            if hasattr(model, "set_experts_implementation"):
                model.set_experts_implementation("eager")
        with torch.no_grad(), _softmax_keeps_fp64():
            got = proxy(input_ids=tokens, use_cache=False).logits
            with restrict_gates(original, plan):
                reference = original(input_ids=tokens, use_cache=False).logits
        for model in (original, proxy):
            model.float()
    experts = (view.spec.num_experts, plan.num_experts)
    if not all(
        bool(torch.isfinite(t).all()) for t in (full, reference, got)
    ):  # NaN never passes, nor is reported as a number
        return Proof(arch, False, None, 0.0, precision, experts, _since(start), "twin's logits are not finite")
    diff, effect = float((got - reference).abs().max()), float((full - reference.float()).abs().max())
    if not _close(got, reference):
        return Proof(arch, False, diff, effect, precision, experts, _since(start), f"pruned twin differs by {diff:.1e}")
    if not effect > MIN_EFFECT:
        why = f"twin's routing did not change when its routers were restricted (max logit change {effect:.1e})"
        return Proof(arch, False, diff, effect, precision, experts, _since(start), why)
    mismatch = _saved_mismatch(original, proxy, found, config, plan)
    if mismatch:
        return Proof(arch, False, diff, effect, precision, experts, _since(start), mismatch)
    return Proof(arch, True, diff, effect, precision, experts, _since(start))


def saved_twin(architecture: str) -> tuple[dict, HFConfig]:
    """The twin of the family discovered for `architecture`, as `save_pretrained` would write it:
    (key -> tensor in the saved spelling, its config.json). What a folder of this type holds, for
    asking which family reads it (`native.read_with_family`)."""
    found = discovered(architecture)
    model = build_twin(found.twin)
    fill(model, found.family)
    return _saved(model), HFConfig(found.twin, Path(f"<twin of {architecture}>") / "config.json")


@contextlib.contextmanager
def _softmax_keeps_fp64():
    """Within the fp64 run, a softmax asked for float32 (Gemma-4's router: `softmax(...,
    dtype=torch.float32)`) stays in float64: else its fp32 rounding, moved by the expert count and
    by the machine's kernels, decides the proof instead of the arithmetic."""
    import torch

    softmax = torch.nn.functional.softmax

    def exact(input, dim=None, _stacklevel=3, dtype=None):
        return softmax(
            input,
            dim=dim,
            _stacklevel=_stacklevel,
            dtype=torch.float64 if dtype is not None and input.dtype == torch.float64 else dtype,
        )

    torch.nn.functional.softmax = exact
    try:
        yield
    finally:
        torch.nn.functional.softmax = softmax


def _close(got, reference) -> bool:
    return bool(((got - reference).abs() <= TOLERANCE * (1 + reference.abs())).all())


def fill(model, family) -> None:
    """Random weights the proof can fail on: routers N(0, ROUTER_STD^2) (routing decided by the
    logits, so a dropped expert changes it), selection biases N(0, 0.1), norms near 1, every other
    matrix N(0, 1 / fan_in); integer tables and buffers a checkpoint does not hold (RoPE
    frequencies) keep transformers' own values."""
    import torch

    g = torch.Generator().manual_seed(1)
    routers = set(family.router.weight)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():  # parameters and persistent buffers (not RoPE's)
            if not tensor.is_floating_point():
                continue
            x = torch.randn(tensor.shape, generator=g)
            leaf = name.rsplit(".", 1)[-1]
            if any(name.endswith("." + r) for r in routers):
                tensor.copy_(ROUTER_STD * x)
            elif "norm" in name.lower():
                tensor.copy_(1.0 + 0.1 * x if leaf == "weight" else 0.1 * x)
            elif "bias" in leaf or tensor.ndim <= 1:
                tensor.copy_(0.1 * x + (1.0 if "scale" in leaf else 0.0))
            else:
                tensor.copy_(x / max(tensor.shape[-1], 1) ** 0.5)


def twin_plan(spec) -> SelectionPlan:
    """Half the experts of every MoE layer, chosen at random (seeded), evenly per routing group."""
    import torch

    E, groups = spec.num_experts, spec.num_groups or 1
    K = E // 2
    g = torch.Generator().manual_seed(2)
    layers = {}
    hashed = set(spec.hash_layer_ids)
    for lid in spec.moe_layer_ids:
        per = E // groups
        kept = sorted(i * per + int(j) for i in range(groups) for j in torch.randperm(per, generator=g)[: K // groups])
        # a hash-routed layer's dropped experts go to the kept ones, in id order (select's rule, simplified)
        substitutes = {d: tuple(kept) for d in range(E) if d not in kept} if lid in hashed else {}
        layers[lid] = LayerPlan(kept=tuple(kept), substitutes=substitutes)
    router = RouterSettings(min(spec.topk, K), spec.num_groups, spec.group_topk, spec.score_function)
    source = SourceInfo(E, spec.topk, spec.num_groups, spec.group_topk)
    return SelectionPlan(source, K, 1, "twin-proof", {}, router, layers)


def _written(view) -> dict:
    """What the HF writer would write for `view`: HF key -> tensor (a fused tensor's rows stacked)."""
    import torch

    out = {}
    for o in native_outputs(view):
        rows = [view.get(name) for name in o.sources]
        out[o.key] = torch.stack(rows) if len(rows) > 1 or len(o.shape) > len(rows[0].shape) else rows[0]
    return out


def _saved(model) -> dict:
    """A model's state dict in the spelling `save_pretrained` writes (transformers'
    `revert_weight_conversion`), every tensor contiguous as in a file."""
    from transformers.core_model_loading import revert_weight_conversion

    return {k: v.contiguous() for k, v in revert_weight_conversion(model, dict(model.state_dict())).items()}


def _saved_mismatch(original, proxy, found: Discovery, config: HFConfig, plan) -> str:
    """'' when the original twin in save_pretrained's spelling, pruned, is the proxy twin in that
    spelling; else what differs."""
    pruned = PrunedView(StateDictView(_saved(original), config, found.family), plan)
    got = _written(pruned)
    want = _saved(proxy)
    if set(got) != set(want):
        extra, missing = sorted(set(got) - set(want)), sorted(set(want) - set(got))
        return f"save_pretrained spelling does not round-trip (keys {(extra or missing)[:2]})"
    bad = [k for k in want if not (got[k].shape == want[k].shape and bool((got[k] == want[k]).all()))]
    return f"save_pretrained spelling does not round-trip ({bad[0]} differs)" if bad else ""
