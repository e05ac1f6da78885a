"""Cost planning before converting: parameters, memory per device and the smallest layouts.

`estimate(arch, request)` compares the original model with its proxy (K routed experts per MoE
layer): parameter counts, bytes of weights, gradients, distributed-optimizer state and
activations on the most loaded device, the fewest devices each fits on, and the ratios.
The model is a ModelSpec (mcore/spec.py) from `sources` (presets, HF config.json, a checkpoint's metadata).
"""

from __future__ import annotations

from dataclasses import dataclass

from mcore_proxy.core.errors import PlanError, ProxyError
from mcore_proxy.estimate.memory import DeviceMemory, Layout, Training
from mcore_proxy.estimate.model import ParameterCount, count_parameters, expert_flops_per_token, with_experts
from mcore_proxy.mcore.spec import ModelSpec
from mcore_proxy.estimate.search import Constraints, check_constraints, fitting_layouts, least_memory, nearest
from mcore_proxy.core.units import GIB

FORMAT = "mcore-proxy-estimate/1"


@dataclass(frozen=True)
class Request:
    """What to plan for: K, the device memory (bytes) and the share of it training may use."""

    num_experts: int
    device_memory: int = 64 * GIB
    memory_fraction: float = 0.9
    training: Training = Training()
    constraints: Constraints = Constraints()

    def __post_init__(self):
        if self.device_memory <= 0 or not 0 < self.memory_fraction <= 1:
            raise ProxyError(
                f"--device-memory must be positive and --memory-fraction in (0, 1], got "
                f"{self.device_memory} bytes and {self.memory_fraction}"
            )

    @property
    def budget(self) -> int:
        return int(self.device_memory * self.memory_fraction)


@dataclass(frozen=True)
class VariantPlan:
    """One model (original or proxy): its parameters and the layouts it fits on, fewest devices first."""

    arch: ModelSpec
    params: ParameterCount
    layouts: tuple[tuple[Layout, DeviceMemory], ...]

    @property
    def best(self) -> tuple[Layout, DeviceMemory]:
        return self.layouts[0]

    @property
    def devices(self) -> int:
        return self.best[0].devices


@dataclass(frozen=True)
class Estimate:
    request: Request
    original: VariantPlan
    proxy: VariantPlan

    @property
    def device_ratio(self) -> float:
        return self.original.devices / self.proxy.devices

    @property
    def expert_flops(self) -> tuple[int, int]:
        return expert_flops_per_token(self.original.arch), expert_flops_per_token(self.proxy.arch)


def check_k(arch: ModelSpec, k: int, ep: int | None) -> None:
    """K as `select` will accept it (fewer than E, at least top-k, whole routing groups) and, with
    a fixed EP, divisible by it; ProxyError with the nearest feasible choices otherwise."""
    from mcore_proxy.select.constraints import check_sizes, resolve_groups  # numpy: loaded here only

    def problem(value: int) -> str | None:
        try:
            check_sizes(arch.num_experts, value, arch.topk, 1)
            resolve_groups(arch.num_experts, value, arch.topk, arch.num_groups, arch.group_topk, arch.score_function)
        except PlanError as err:
            return str(err)
        return None

    ok = [v for v in range(1, arch.num_experts) if problem(v) is None]
    if (err := problem(k)) is not None:
        raise ProxyError(f"{err} (nearest feasible: {nearest(k, ok, '--num-experts')})")
    if ep and k % ep:
        eps = [d for d in range(1, k + 1) if k % d == 0 and arch.num_experts % d == 0]
        raise ProxyError(
            f"--num-experts {k} is not divisible by --ep {ep}, so the proxy's experts cannot be "
            f"split evenly over the expert-parallel ranks; nearest feasible: "
            f"{nearest(k, [v for v in ok if v % ep == 0], '--num-experts')}, or "
            f"{nearest(ep, eps, '--ep')}"
        )


def _plan(arch: ModelSpec, req: Request) -> VariantPlan:
    check_constraints(arch, req.constraints)
    found = fitting_layouts(arch, req.training, req.budget, req.constraints)
    if not found:
        raise ProxyError(_no_fit(arch, req))
    fewest = found[0][0].devices
    return VariantPlan(arch, count_parameters(arch), tuple(lm for lm in found if lm[0].devices == fewest)[:3])


# device memory sizes of common accelerators (GiB), to name the nearest one that would do
DEVICE_SIZES_GIB = (8, 12, 16, 24, 32, 40, 48, 64, 80, 96, 128, 141, 192, 288)


def _no_fit(arch: ModelSpec, req: Request) -> str:
    c = req.constraints
    fixed = " ".join(
        f"{k.upper()}={v}" for k, v in (("tp", c.tp), ("pp", c.pp), ("ep", c.ep), ("etp", c.etp), ("dp", c.dp)) if v
    )
    what = (
        f"no layout{' with ' + fixed if fixed else ''} of at most {c.max_devices} devices fits "
        f"{arch.name} with {arch.num_experts} experts in {req.budget / GIB:.1f} GiB per device "
        f"({req.memory_fraction:.0%} of {req.device_memory / GIB:.1f} GiB)"
    )
    if fixed:
        free = Constraints(devices_per_node=c.devices_per_node, max_devices=c.max_devices)
        found = fitting_layouts(arch, req.training, req.budget, free)
        if found:
            layout, mem = found[0]
            return (
                f"{what}; nearest feasible: {layout.describe()} on {layout.devices} devices ({mem.total / GIB:.1f} GiB)"
            )
    best = least_memory(arch, req.training, c)
    if best is None:
        return f"{what}; no valid layout exists within that device bound, raise --max-devices"
    need = best[1].total / req.memory_fraction / GIB
    for size in (s for s in DEVICE_SIZES_GIB if s >= need):
        found = fitting_layouts(arch, req.training, int(size * GIB * req.memory_fraction), c)
        if found:
            layout, mem = found[0]
            return (
                f"{what}; nearest feasible: --device-memory {size}GiB, on {layout.devices} devices "
                f"({layout.describe()}), or a shorter --seq-len or --recompute full"
            )
    return f"{what}; even the least loaded layout needs {need:.1f} GiB per device"


def estimate(arch: ModelSpec, req: Request) -> Estimate:
    """Plan the original and its proxy with `req.num_experts` experts (see the module docstring)."""
    check_k(arch, req.num_experts, req.constraints.ep)
    return Estimate(req, _plan(arch, req), _plan(with_experts(arch, req.num_experts), req))


__all__ = [
    "Estimate",
    "Request",
    "VariantPlan",
    "Training",
    "Constraints",
    "estimate",
    "check_k",
    "FORMAT",
    "GIB",
]
