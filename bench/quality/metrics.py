"""What the ablation measures for the original and each proxy on the test split.

- exact match: greedy answer equals the true one (`model.accuracy`);
- next-token KL(original || proxy) in nats, averaged over the answer positions (teacher forced:
  the position of "=" and of each answer digit, whose next token the model must get right);
- hidden-state cosine: cosine of the final hidden states (decoder output, after the final
  norm) of original and proxy, averaged over every non-padding position;
- routing coverage: share of the original's top-k selections on the test split (traced by
  `mcore_proxy.trace`) that fall on kept experts, averaged over MoE layers;
- gate mass kept (issue 24): per MoE layer, the share of the original's routing weight (its
  gates, summed over the experts it chose for a token) that lands on kept experts, averaged over
  text positions; a property of the plan and the original, not of the proxy's routing;
- routing agreement (issue 24): per MoE layer, the share of the proxy's choices for a token that
  the original also chose for it (proxy expert j is original `kept[j]`), averaged over text
  positions, each model routing its own hidden states (so drift of earlier layers counts);
- accuracy's binomial standard error, sqrt(p (1 - p) / n) over the n test problems.
"""

from __future__ import annotations

from dataclasses import dataclass

import contextlib

import numpy as np
import torch

from bench.quality import model as qmodel
from bench.quality import task


@dataclass(frozen=True, repr=False)
class Reference:
    """The original model's outputs on the test split."""

    log_probs: torch.Tensor  # [n_answer_positions, V] at the answer positions
    hidden: torch.Tensor  # [n_text_positions, H] final hidden states
    accuracy: float
    routing: dict  # layer id -> (gates [n_text_positions, E], chosen [n_text_positions, E] bool)


def routers(gpt) -> dict[str, torch.nn.Module]:
    """MoE layer id ("0", "1", ...) -> its router module."""
    out = {}
    for module in gpt.modules():
        if hasattr(module, "gating") and hasattr(module, "layer_number"):
            out[str(module.layer_number - 1)] = module
    return out


@contextlib.contextmanager
def recording_routing(gpt):
    """Within the block, every router's (gates [s*b, E], chosen [s*b, E]) per forward pass is
    appended to the yielded {layer id: list}; tokens in megatron's [s, b] order."""
    seen: dict[str, list] = {}
    hooks = [
        router.register_forward_hook(lambda mod, inp, out, _l=lid: seen.setdefault(_l, []).append(out))
        for lid, router in routers(gpt).items()
    ]
    try:
        yield seen
    finally:
        for h in hooks:
            h.remove()


def _batches(problems, size=250):
    for start in range(0, len(problems), size):
        tokens, mask = task.batch(problems[start : start + size])
        yield task.trim(tokens, mask)


@torch.no_grad()
def forward_outputs(gpt, problems) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(log-probs at answer positions [n, V], final hidden states at text positions [m, H],
    {layer id: (gates [m, E], chosen [m, E])} at the same text positions)."""
    hidden = []
    hook = gpt.decoder.register_forward_hook(lambda mod, inp, out: hidden.append(out))
    lps, hs, routing = [], [], {}
    try:
        with recording_routing(gpt) as seen:
            for tokens, mask in _batches(problems):
                hidden.clear()
                seen.clear()
                lg = qmodel.logits(gpt, tokens)
                lps.append(torch.log_softmax(lg[mask].double(), -1))
                h = hidden[-1].transpose(0, 1)  # [s, b, H] -> [b, s, H]
                hs.append(h[tokens != task.PAD].double())
                text = (tokens != task.PAD).T.reshape(-1)  # the routers see [s, b] flattened
                for lid, ((gates, chosen),) in seen.items():
                    routing.setdefault(lid, []).append((gates[text].float(), chosen[text]))
    finally:
        hook.remove()
    routing = {lid: tuple(torch.cat(part) for part in zip(*parts)) for lid, parts in routing.items()}
    return torch.cat(lps), torch.cat(hs), routing


def reference(gpt, problems) -> Reference:
    lp, h, routing = forward_outputs(gpt, problems)
    return Reference(lp, h, qmodel.accuracy(gpt, problems), routing)


def binomial_se(p: float, n: int) -> float:
    """Standard error of a share p measured on n independent problems."""
    return float(np.sqrt(p * (1 - p) / n))


def gate_mass_kept(ref: Reference, plan) -> dict[str, float]:
    """Per layer: the original's gate mass on kept experts, averaged over text positions."""
    out = {}
    for lid in plan.layer_ids:
        gates, _ = ref.routing[lid]
        kept = gates[:, plan.kept(lid)].sum(-1) / gates.sum(-1).clamp_min(1e-20)
        out[lid] = float(kept.mean())
    return out


def routing_agreement(ref: Reference, proxy_routing: dict, plan) -> dict[str, float]:
    """Per layer: share of the proxy's choices that the original made for the same token."""
    out = {}
    for lid in plan.layer_ids:
        _, orig = ref.routing[lid]
        _, proxy = proxy_routing[lid]
        both = orig[:, plan.kept(lid)] & proxy  # [m, K]: proxy expert j is original kept[j]
        out[lid] = float((both.sum(-1) / proxy.sum(-1).clamp_min(1)).mean())
    return out


def compare(gpt, problems, ref: Reference, plan=None) -> dict:
    """accuracy (with its binomial standard error), kl (nats), hidden_cosine of a proxy against
    the reference; with `plan`, per-layer gate mass kept and routing agreement too."""
    lp, h, routing = forward_outputs(gpt, problems)
    kl = (ref.log_probs.exp() * (ref.log_probs - lp)).sum(-1).mean()
    cos = torch.nn.functional.cosine_similarity(h, ref.hidden, dim=-1).mean()
    acc = qmodel.accuracy(gpt, problems)
    out = {
        "accuracy": acc,
        "accuracy_se": binomial_se(acc, len(problems)),
        "kl": float(kl),
        "hidden_cosine": float(cos),
    }
    if plan is not None:
        out["gate_mass_kept"] = gate_mass_kept(ref, plan)
        out["routing_agreement"] = routing_agreement(ref, routing, plan)
    return out


def routing_coverage(test_stats, plan) -> float:
    """Mean over MoE layers of the share of test-split top-k selections on kept experts."""
    shares = []
    for lid in plan.layer_ids:
        f = test_stats.layers[lid].freq.astype(np.float64)
        shares.append(f[plan.kept(lid)].sum() / f.sum())
    return float(np.mean(shares))
