"""`logprob_precision`: the rollout computes its log-probabilities from logits in bf16, fp16 or fp8
(E4M3, as FP8 rollout engines serve) while training computes them in fp32 (the rollout
engine/trainer precision mismatch of RL pipelines).

The output layer's logits are rounded to the low precision (and cast back, so shapes and dtypes
are what the caller expects) in the forward passes the `when` parameter names: `no_grad` (forward
passes without autograd: generation and log-prob recomputation of a rollout), `rollout` (inside
`mcore_proxy.faults.rollout()`; with environment activation also every transformers `generate`
call), or `always`. Training forward passes are left in full precision. Log-prob passes that
read the head's weight without calling the module (TRL's fused LM head) are reached through
`faults/fused_head.py`.
"""

from __future__ import annotations

import torch

from mcore_proxy.faults import fused_head
from mcore_proxy.faults.base import Injector
from mcore_proxy.faults.clock import in_rollout

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}


def round_to(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype.itemsize == 1:
        # E4M3 has no infinity: saturate at its largest finite value, as FP8 engines do, rather than
        # rely on how a torch version casts what is out of range
        limit = torch.finfo(dtype).max
        tensor = tensor.clamp(-limit, limit)
    return tensor.to(dtype).to(tensor.dtype)


class LogprobPrecision(Injector):
    kind = "logprob_precision"
    sites = ("output",)

    def applies_now(self) -> bool:
        when = self.spec["when"]
        return (
            when == "always"
            or (when == "no_grad" and not torch.is_grad_enabled())
            or (when == "rollout" and in_rollout())
        )

    def attach_output(self, site):
        dtype = DTYPES[self.spec["dtype"]]

        def hook(module, args, output):
            if not self.applies_now() or not self.on():
                return None
            if isinstance(output, tuple):  # megatron ColumnParallelLinear: (logits, bias)
                return (round_to(output[0], dtype), *output[1:])
            return round_to(output, dtype)

        handles = [site.module.register_forward_hook(hook)]
        # a fused head reading the weight without calling the module (fused_head.py)
        rounding = lambda logits: round_to(logits, dtype)  # noqa: E731
        handles.append(fused_head.register(site.module, lambda: rounding if self.applies_now() and self.on() else None))
        return handles
