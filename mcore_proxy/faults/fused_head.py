"""Output-logit faults on a *fused* LM head: a log-prob computation that reads `lm_head.weight`
directly instead of calling the `lm_head` module, so a forward hook on `lm_head` never sees it.

TRL (>= 1.x) computes every log-prob pass of its trainers this way: `add_fused_lm_head` gives the
model a forward that runs the backbone and then `trl.kernels.ChunkedLogProbFunction.apply(hidden,
weight, bias, targets, temperature, chunk_size, final_logit_softcapping, logit_scale, outputs)`
(imported into `trl.trainer.utils` as `_ChunkedLogProbFunction`), tile by tile, without the
[tokens, vocab] logits. GRPO's reference-model and old-policy log-probs and its training
log-probs all go through it; only generation calls `lm_head`.

Injectors that change the output logits (`logprob_precision`) register a function with the
head (`register(lm_head, fn)`); `patch_trl_module` replaces that name in
`trl.trainer.utils` by a wrapper whose `apply` asks each registered function whether it acts now.
When none does, TRL's own function runs untouched (same results, same memory). When one does,
the log-probs are computed here in plain torch from the full logits, which the functions change
(e.g. round to bf16) before TRL's transform (x logit_scale, softcap, / temperature); the outputs
are TRL's: log-probs, and entropy, log sum p^2, mean logit and is-top-1 when asked for.
"""

from __future__ import annotations

import logging
import weakref

import torch

from mcore_proxy.engines.hooks import CallbackHandle

log = logging.getLogger(__name__)

_MARK = "__mcore_proxy_fused_head__"
_HEADS: dict[int, tuple] = {}  # id(head) -> (weakref to the head, registered functions)
TRL_MODULE = "trl.trainer.utils"
TRL_NAME = "_ChunkedLogProbFunction"


def register(head: torch.nn.Module, fn) -> CallbackHandle:
    """`fn() -> transform | None`, called once per fused log-prob pass over `head`'s weight: a
    function `logits -> logits` when the fault acts on this pass (recording it), else None. The
    head is looked up by its weight at call time (loading may replace the parameter after the
    model is built)."""
    key = id(head)
    entry = _HEADS.get(key)
    if entry is None:
        entry = _HEADS[key] = (weakref.ref(head), [])
        weakref.finalize(head, _HEADS.pop, key, None)  # nothing stored on the module or tensor
    chain = entry[1]
    chain.append(fn)

    def remove():
        chain.remove(fn)
        if not chain and _HEADS.get(key) is entry:
            del _HEADS[key]

    return CallbackHandle(remove)


def active_transforms(weight) -> list:
    """The transforms of the faults acting now on the head whose weight is `weight`."""
    for ref, chain in list(_HEADS.values()):
        head = ref()
        if head is not None and getattr(head, "weight", None) is weight:
            return [t for t in (fn() for fn in list(chain)) if t is not None]
    return []


def logprob_outputs(
    hidden, weight, bias, targets, temperature, final_logit_softcapping=None, logit_scale=1.0, outputs=(), transforms=()
):
    """TRL's `ChunkedLogProbFunction` outputs `(log_probs, entropy, log_sum_sq_probs, mean_logits,
    is_top1)` [N] from full logits, each `transforms` applied to the logits first."""
    logits = torch.nn.functional.linear(
        hidden, weight.to(hidden.dtype), None if bias is None else bias.to(hidden.dtype)
    )
    for transform in transforms:
        logits = transform(logits)
    z = logits.float() * logit_scale
    if final_logit_softcapping is not None:
        z = final_logit_softcapping * torch.tanh(z / final_logit_softcapping)
    z = z / temperature
    log_p = torch.log_softmax(z, dim=-1)
    picked = log_p.gather(-1, targets[:, None]).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1) if "entropy" in outputs else None
    log_sum_sq = torch.logsumexp(2 * log_p, dim=-1) if "log_sum_sq_probs" in outputs else None
    mean_logits = z.mean(-1) if "mean_logits" in outputs else None
    is_top1 = z.argmax(-1) == targets if "is_top1" in outputs else None
    return picked, entropy, log_sum_sq, mean_logits, is_top1


class FusedLogProb:
    """Stands in for TRL's `ChunkedLogProbFunction` (only `.apply` is used by TRL)."""

    def __init__(self, original):
        self.original = original
        setattr(self, _MARK, True)

    def apply(
        self,
        hidden,
        weight,
        bias,
        targets,
        temperature,
        chunk_size,
        final_logit_softcapping=None,
        logit_scale=1.0,
        outputs=None,
        *rest,
    ):
        transforms = active_transforms(weight)
        if not transforms or rest:
            args = (
                (hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping, logit_scale)
                + (() if outputs is None else (outputs,))
                + rest
            )
            return self.original.apply(*args)
        if outputs is None:
            outputs = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
        return logprob_outputs(
            hidden, weight, bias, targets, temperature, final_logit_softcapping, logit_scale, outputs, transforms
        )

    def __getattr__(self, name):
        return getattr(self.original, name)


def patch_trl_module(module) -> bool:
    """Replace `trl.trainer.utils._ChunkedLogProbFunction` by the wrapper (idempotent). Returns
    whether TRL's fused head was found."""
    original = getattr(module, TRL_NAME, None)
    if original is None or not hasattr(original, "apply"):
        log.warning(
            "faults: %s.%s not found: output-logit faults (logprob_precision) do not reach "
            "TRL's fused log-prob passes, only the passes that call lm_head",
            TRL_MODULE,
            TRL_NAME,
        )
        return False
    if not getattr(original, _MARK, False):
        setattr(module, TRL_NAME, FusedLogProb(original))
    return True
