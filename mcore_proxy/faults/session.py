"""A fault session: the injectors of a list of specs, attached to models and optimizers, owning
every hook handle (removed on `close()` / leaving the `with` block).

    from mcore_proxy import faults
    with faults.inject("router_noise:std=0.05,layers=0-3;update_omission:every=2",
                       model=gpt, optimizer=opt) as session:
        train()                                # session.report(): what each fault did

Environment activation (`MCORE_PROXY_FAULTS`, `mcore_proxy.faults.runtime`) uses the same session
class, attaching to each MoE layer, GPT model and optimizer as the run builds them.
"""

from __future__ import annotations

import itertools
import logging

from mcore_proxy.engines.hooks import Hooks
from mcore_proxy.faults import sites as sites_mod
from mcore_proxy.faults.clock import CLOCK, StepClock
from mcore_proxy.faults.experts import ExpertNoise
from mcore_proxy.faults.logprob import LogprobPrecision
from mcore_proxy.faults.optimizer import UpdateOmission, torch_optimizers
from mcore_proxy.faults.router import RouterNoise, RouterPrecision, RouterTieFlip, RouterWeight, TopK
from mcore_proxy.faults.spec import FaultSpec, parse

log = logging.getLogger(__name__)

INJECTORS = {
    cls.kind: cls
    for cls in (
        RouterNoise,
        RouterPrecision,
        RouterTieFlip,
        RouterWeight,
        TopK,
        ExpertNoise,
        LogprobPrecision,
        UpdateOmission,
    )
}
_ATTACHED = "_mcore_proxy_fault_sessions"
_TOKENS = itertools.count()


class FaultSession:
    def __init__(self, specs, clock: StepClock = CLOCK):
        specs = parse(specs) if isinstance(specs, str) else tuple(specs)
        if not all(isinstance(s, FaultSpec) for s in specs):
            raise TypeError("FaultSession takes fault specs or their text form")
        self.clock = clock
        self.injectors = [INJECTORS[s.kind](s, clock) for s in specs]
        self.hooks = Hooks()  # every hook of every injector, and the optimizer step hooks
        self._token = next(_TOKENS)
        self._marked: list = []

    # -- attaching ------------------------------------------------------------------------------
    def _first_time(self, obj) -> bool:
        """Each module or optimizer is attached once per session (wrappers may see it twice)."""
        seen = obj.__dict__.setdefault(_ATTACHED, set())
        if self._token in seen:
            return False
        seen.add(self._token)
        self._marked.append(seen)
        return True

    def attach_sites(self, sites) -> int:
        """Attach every injector to the sites it acts on; returns the number of sites seen."""
        n = 0
        for site in sites:
            n += 1
            if not self._first_time(site.module):
                continue
            for injector in self.injectors:
                self.hooks.add(*injector.attach(site))
        return n

    def attach_model(self, model) -> int:
        """Attach to every site of `model` (a module or a list of virtual-pipeline chunks)."""
        return self.attach_sites(sites_mod.find_sites(model))

    def attach_optimizer(self, optimizer) -> None:
        """Attach to a torch or megatron optimizer; its steps also move the clock."""
        for opt in torch_optimizers(optimizer):
            if not self._first_time(opt):
                continue
            for injector in self.injectors:
                self.hooks.add(*injector.attach_optimizer(opt))
            self.hooks.add(opt.register_step_post_hook(lambda o, args, kwargs: self.clock.advance(o)))

    # -- lifecycle ------------------------------------------------------------------------------
    def close(self) -> None:
        self.hooks.remove()
        for seen in self._marked:
            seen.discard(self._token)
        self._marked.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def report(self) -> list[dict]:
        """Per fault: its canonical text and what it did (calls, active calls, active steps)."""
        return [{"fault": i.spec.to_text(), **i.record.as_dict()} for i in self.injectors]


def inject(specs, *, model=None, optimizer=None, clock: StepClock = CLOCK) -> FaultSession:
    """Attach the faults `specs` (text or FaultSpecs) to `model` and `optimizer` (either may be
    omitted or attached later with `attach_model` / `attach_optimizer`). Refuses when
    `MCORE_PROXY_FAULTS` already injects faults in this process (they would act twice)."""
    from mcore_proxy.faults import activate

    if activate.FEATURE.active():
        raise RuntimeError(
            f"faults are already injected through {activate.FEATURE.env_var}; unset it or do not call inject()"
        )
    session = FaultSession(specs, clock)
    if model is not None:
        if not session.attach_model(model):
            log.warning("faults: no MoE layer or output layer found in the model: nothing attached")
    if optimizer is not None:
        session.attach_optimizer(optimizer)
    return session
