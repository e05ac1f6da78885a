"""`expert_noise`: relative element-wise noise on the routed experts' output, out * (1 + std * N(0, 1)),
the error model of a lower-precision or non-deterministic expert kernel."""

from __future__ import annotations

from mcore_proxy.faults.base import Injector


class ExpertNoise(Injector):
    kind = "expert_noise"
    sites = ("experts", "hf_expert")

    def _noisy(self, out):
        return out * (1 + self.spec["std"] * self.randn_like(out))

    def attach_experts(self, site):
        """megatron `MoELayer.experts`: output `(out [routed tokens, H], bias)`."""

        def hook(module, args, output):
            if not self.wants_layer(site.layer()) or not self.on():
                return None
            if isinstance(output, tuple):
                return (self._noisy(output[0]), *output[1:])
            return self._noisy(output)

        return [site.module.register_forward_hook(hook)]

    attach_hf_expert = attach_experts
