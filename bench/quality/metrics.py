"""What the ablation measures for the original and each proxy on the test split.

- exact match: greedy answer equals the true one (`model.accuracy`);
- next-token KL(original || proxy) in nats, averaged over the answer positions (teacher forced:
  the position of "=" and of each answer digit, whose next token the model must get right);
- hidden-state cosine: cosine of the final hidden states (decoder output, after the final
  norm) of original and proxy, averaged over every non-padding position;
- routing coverage: share of the original's top-k selections on the test split (traced by
  `mcore_proxy.trace`) that fall on kept experts, averaged over MoE layers.
"""

from __future__ import annotations

from dataclasses import dataclass

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


def _batches(problems, size=250):
    for start in range(0, len(problems), size):
        tokens, mask = task.batch(problems[start : start + size])
        yield task.trim(tokens, mask)


@torch.no_grad()
def forward_outputs(gpt, problems) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs at answer positions [n, V], final hidden states at text positions [m, H])."""
    hidden = []
    hook = gpt.decoder.register_forward_hook(lambda mod, inp, out: hidden.append(out))
    lps, hs = [], []
    try:
        for tokens, mask in _batches(problems):
            hidden.clear()
            lg = qmodel.logits(gpt, tokens)
            lps.append(torch.log_softmax(lg[mask].double(), -1))
            h = hidden[-1].transpose(0, 1)  # [s, b, H] -> [b, s, H]
            hs.append(h[tokens != task.PAD].double())
    finally:
        hook.remove()
    return torch.cat(lps), torch.cat(hs)


def reference(gpt, problems) -> Reference:
    lp, h = forward_outputs(gpt, problems)
    return Reference(lp, h, qmodel.accuracy(gpt, problems))


def compare(gpt, problems, ref: Reference) -> dict:
    """accuracy, kl (nats), hidden_cosine of a proxy against the reference."""
    lp, h = forward_outputs(gpt, problems)
    kl = (ref.log_probs.exp() * (ref.log_probs - lp)).sum(-1).mean()
    cos = torch.nn.functional.cosine_similarity(h, ref.hidden, dim=-1).mean()
    return {"accuracy": qmodel.accuracy(gpt, problems), "kl": float(kl), "hidden_cosine": float(cos)}


def routing_coverage(test_stats, plan) -> float:
    """Mean over MoE layers of the share of test-split top-k selections on kept experts."""
    shares = []
    for lid in plan.layer_ids:
        f = test_stats.layers[lid].freq.astype(np.float64)
        shares.append(f[plan.kept(lid)].sum() / f.sum())
    return float(np.mean(shares))
