"""`update_omission`: optimizer steps that silently do not happen, for every parameter or a group.

Attached to torch optimizers (megatron's optimizers step inner torch optimizers: `.optimizer`, and
`.chained_optimizers` of a ChainedOptimizer) through step pre/post hooks: on an omitted step the
gradients of the omitted parameters are hidden (`grad = None`, which torch's and apex's optimizers
skip: neither the parameter nor its moments or step count move) and put back after the step, so
gradient norms and zeroing behave as usual. Groups: `experts` are the parameters of the routed
experts modules of the attached models (at any EP degree), and megatron's expert-parallel
parameters (`param.allreduce is False`, or a param group flagged `is_expert_parallel`, which is
how the fp32 main copies of megatron's mixed-precision optimizers are recognised); `dense` the
others.
"""

from __future__ import annotations

import weakref

from mcore_proxy.faults.base import Injector


def torch_optimizers(optimizer) -> list:
    """The torch optimizers inside a megatron optimizer (or the torch optimizer itself)."""
    if hasattr(optimizer, "chained_optimizers"):
        return [t for sub in optimizer.chained_optimizers for t in torch_optimizers(sub)]
    inner = getattr(optimizer, "optimizer", None)
    if inner is not None and hasattr(inner, "param_groups") and inner is not optimizer:
        return torch_optimizers(inner)
    return [optimizer]


class UpdateOmission(Injector):
    kind = "update_omission"
    sites = ("experts", "hf_expert")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._hidden: dict[int, list] = {}
        self._expert_modules: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._expert_params: set[int] = set()

    def attach_experts(self, site) -> list:
        """Learn which modules are experts (nothing is hooked). Their parameters are looked up at
        each step: transformers' from_pretrained replaces a model's parameters after post_init,
        where environment activation attaches."""
        self._expert_modules[id(site.module)] = site.module
        return []

    attach_hf_expert = attach_experts

    def _refresh_experts(self) -> None:
        self._expert_params = {id(p) for m in list(self._expert_modules.values()) for p in m.parameters()}

    def is_expert(self, param, group: dict) -> bool:
        return (
            id(param) in self._expert_params
            or bool(group.get("is_expert_parallel", False))
            or getattr(param, "allreduce", True) is False
        )

    def omitted(self, param, group: dict) -> bool:
        which = self.spec["group"]
        return which == "all" or (which == "experts") == self.is_expert(param, group)

    def pre_step(self, optimizer) -> None:
        if not self.on(self.clock.optimizer_step(optimizer)):
            return
        if self.spec["group"] != "all":
            self._refresh_experts()
        hidden = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None and self.omitted(p, group):
                    hidden.append((p, p.grad))
                    p.grad = None
        self._hidden[id(optimizer)] = hidden

    def post_step(self, optimizer) -> None:
        for p, grad in self._hidden.pop(id(optimizer), ()):
            p.grad = grad

    def attach_optimizer(self, optimizer) -> list:
        handles = []
        for opt in torch_optimizers(optimizer):
            handles.append(opt.register_step_pre_hook(lambda o, args, kwargs: self.pre_step(o)))
            handles.append(opt.register_step_post_hook(lambda o, args, kwargs: self.post_step(o)))
        return handles
