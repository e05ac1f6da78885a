"""What every injector shares: its spec, the clock, its own random generator, the layer filter,
and a record of what it did.

An injector never changes anything while its schedule is off: its hooks return the module's output
untouched (the same tensor objects), so a run with an injector switched off is bit-identical to a
run without it.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import torch

from mcore_proxy.faults.clock import CLOCK, StepClock
from mcore_proxy.faults.spec import FaultSpec


@dataclass
class Record:
    """What an injector did: calls of its hooks, and the steps on which it acted."""

    calls: int = 0
    active_calls: int = 0
    active_steps: set = field(default_factory=set)

    def as_dict(self) -> dict:
        return {"calls": self.calls, "active_calls": self.active_calls, "active_steps": sorted(self.active_steps)}


class Injector:
    """Base of the fault kinds. Subclasses set `kind` and override the `attach_*` of the sites
    they act on (each returns handles with `.remove()`); `Site` kinds are in `sites.py`."""

    kind = ""
    sites: tuple[str, ...] = ()

    def __init__(self, spec: FaultSpec, clock: StepClock = CLOCK):
        self.spec, self.clock = spec, clock
        self.record = Record()
        self._generators: dict[torch.device, torch.Generator] = {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec.to_text()!r})"

    # -- schedule and filters -------------------------------------------------------------------
    def on(self, step: int | None = None) -> bool:
        """Whether the fault acts now (records the call either way)."""
        step = self.clock.step if step is None else step
        self.record.calls += 1
        active = self.spec.schedule.active(step)
        if active:
            self.record.active_calls += 1
            self.record.active_steps.add(step)
        return active

    def wants_layer(self, layer_id: str | None) -> bool:
        layers = self.spec.params.get("layers")
        return layers is None or layer_id in layers

    # -- randomness -----------------------------------------------------------------------------
    def generator(self, device: torch.device) -> torch.Generator:
        """This injector's own generator on `device` (the run's random streams stay untouched)."""
        device = torch.device(device)
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.spec.seed)
        return self._generators[device]

    def keyed_generator(self, key: str, device) -> torch.Generator:
        """A generator fixed by (seed, key): the same numbers for that key in every run."""
        seed = zlib.crc32(f"{self.spec.seed}:{self.kind}:{key}".encode())
        return torch.Generator(device=torch.device(device)).manual_seed(seed)

    def randn_like(self, tensor: torch.Tensor) -> torch.Tensor:
        """N(0, 1) noise shaped like `tensor`, drawn in fp32 then cast (reproducible across dtypes)."""
        noise = torch.randn(
            tensor.shape, generator=self.generator(tensor.device), device=tensor.device, dtype=torch.float32
        )
        return noise.to(tensor.dtype)

    # -- attachment points (see sites.py) -------------------------------------------------------
    def places(self, engine: str) -> bool:
        """Whether the fault acts in `engine` ("trainer" or "rollout"): its spec's `engine`."""
        return self.spec.engine in ("any", engine)

    def attach(self, site) -> list:
        if site.kind not in self.sites or not self.places(site.engine):
            return []
        return getattr(self, f"attach_{site.kind}")(site)

    def attach_optimizer(self, optimizer) -> list:
        return []
