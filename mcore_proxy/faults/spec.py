"""Fault specifications: what to inject, with which parameters, on which steps. Standard library only
(parsed at interpreter start by the environment activation, before torch is imported).

Text form, as in `MCORE_PROXY_FAULTS` (faults separated by `;`, parameters by `,`; a bare value
continues the list of the parameter before it):

    router_noise:std=0.05,layers=0-3;update_omission:every=2,group=experts
    topk:mode=drop,rate=0.1,layers=1,3,start=10,stop=20

Every kind takes the schedule parameters `start` (first step on, default 0), `stop` (first step
off again; default never), `every` (on one step in N counted from `start`, default 1), `steps`
(an explicit list such as `3,5,8-10`, instead of start/stop/every) and `seed` (of the fault's own
random generator, default 0; the run's own random streams are never touched), and `engine`
(`trainer`: the megatron-core and transformers models and the optimizers; `rollout`: the models a
rollout engine, vLLM, builds; default `any`), which places a fault in one engine where both run in
one process, as verl's hybrid engine and examples/rl_vllm do. A *step* is a
training step: the number of optimizer steps the process has completed, or what the training loop
sets with `mcore_proxy.faults.set_step` (see `mcore_proxy.faults.clock`).

`layers` are global 0-based layer ids, the L of `decoder.layers.{L}` (megatron's layer_number - 1)
and `mtp.{k}` for MTP layers, as in the routing statistics; default: every MoE layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mcore_proxy.core.errors import ProxyError

ENV_FAULTS = "MCORE_PROXY_FAULTS"
ENGINES = ("any", "trainer", "rollout")
TRAINER_ONLY = ("update_omission",)  # acts on the optimizer, which only the trainer has


class FaultSpecError(ProxyError):
    """A fault specification that cannot be parsed or names an unknown kind or parameter."""


def _std(text: str) -> float:
    """A noise scale: a negative, infinite or NaN one is a typo, not a fault to inject."""
    value = float(text)
    if not 0.0 <= value < float("inf"):
        raise ValueError("must be a finite number >= 0")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError("must be >= 1")
    return value


def _nonneg_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError("must be >= 0")
    return value


def _rate(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise ValueError("must be within [0, 1]")
    return value


def _int_items(items: list[str]) -> frozenset[int]:
    out: set[int] = set()
    for item in items:
        lo, sep, hi = item.partition("-")
        a, b = int(lo), int(hi) if sep else int(lo)
        if b < a:
            raise ValueError(f"empty range {item}")
        out.update(range(a, b + 1))
    return frozenset(out)


def _layers(items: list[str]) -> frozenset[str]:
    ints = [i for i in items if not i.startswith("mtp.")]
    mtp = {i for i in items if i.startswith("mtp.")}
    for item in mtp:
        int(item[4:])
    return frozenset({str(i) for i in _int_items(ints)} | mtp)


def _choice(*options):
    def parse(text: str) -> str:
        if text not in options:
            raise ValueError(f"must be one of {', '.join(options)}")
        return text

    parse.__name__ = "|".join(options)
    return parse


# Parameters: name -> (parser, default, takes a list). The schedule's apply to every kind.
SCHEDULE_PARAMS = {
    "start": (_nonneg_int, 0, False),
    "stop": (_nonneg_int, None, False),
    "every": (_positive_int, 1, False),
    "steps": (_int_items, None, True),
    "seed": (int, 0, False),
    "engine": (_choice(*ENGINES), "any", False),
}
LAYERS = {"layers": (_layers, None, True)}
KINDS: dict[str, dict] = {
    # Gaussian noise of `std` (logit units) added to every router logit.
    "router_noise": {"std": (_std, 0.05, False), **LAYERS},
    # Router logits rounded to bf16/fp16/fp8 (E4M3) (a router computed in low precision: the rollout
    # engine's default, or its FP8 inference, where the trainer keeps its router in fp32, as
    # `--moe-router-dtype fp32` does).
    "router_precision": {"dtype": (_choice("bf16", "fp16", "fp8"), "bf16", False), **LAYERS},
    # The k-th and (k+1)-th router logits swapped where they are less than `margin` apart (logit
    # units): near-ties broken the other way, as another engine's summation order does.
    "router_tie_flip": {"margin": (_std, 0.01, False), **LAYERS},
    # The router weight seen as W + N, N fixed per layer with std `std` x rms(W) (logits + x N^T).
    "router_weight": {"std": (_std, 0.1, False), **LAYERS},
    # Each top-k choice, with probability `rate`: `swap` for an expert the token did not choose
    # (keeping its probability), or `drop` (the token uses fewer experts).
    "topk": {"mode": (_choice("swap", "drop"), "swap", False), "rate": (_rate, 0.1, False), **LAYERS},
    # Relative element-wise noise on the routed experts' output: out * (1 + std * N(0, 1)).
    "expert_noise": {"std": (_std, 0.01, False), **LAYERS},
    # Output logits rounded to bf16/fp16/fp8 (E4M3) in rollout forward passes (training stays fp32):
    # `when=no_grad` forward passes without autograd, `rollout` inside `faults.rollout()`, `always`.
    "logprob_precision": {
        "dtype": (_choice("bf16", "fp16", "fp8"), "bf16", False),
        "when": (_choice("no_grad", "rollout", "always"), "no_grad", False),
    },
    # Optimizer steps left out: for every parameter, the expert parameters, or the others.
    "update_omission": {"group": (_choice("all", "experts", "dense"), "all", False)},
}


@dataclass(frozen=True)
class Schedule:
    """On which training steps a fault acts."""

    start: int = 0
    stop: int | None = None
    every: int = 1
    steps: frozenset[int] | None = None

    def active(self, step: int) -> bool:
        if self.steps is not None:
            return step in self.steps
        if step < self.start or (self.stop is not None and step >= self.stop):
            return False
        return (step - self.start) % self.every == 0


@dataclass(frozen=True)
class FaultSpec:
    """One fault: its kind, its parameters (defaults filled in), its schedule and seed."""

    kind: str
    params: dict = field(default_factory=dict)
    schedule: Schedule = field(default_factory=Schedule)
    seed: int = 0
    engine: str = "any"  # ENGINES: where the fault acts

    def __post_init__(self):
        if self.kind not in KINDS:
            raise FaultSpecError(f"unknown fault kind {self.kind!r}; known: {', '.join(KINDS)}")
        unknown = set(self.params) - set(KINDS[self.kind])
        if unknown:
            raise FaultSpecError(
                f"fault {self.kind!r} takes no parameter {sorted(unknown)[0]!r}; "
                f"it takes {', '.join([*KINDS[self.kind], *SCHEDULE_PARAMS])}"
            )
        if self.engine not in ENGINES:
            raise FaultSpecError(f"fault {self.kind!r}: engine {self.engine!r} is not one of {', '.join(ENGINES)}")
        if self.kind in TRAINER_ONLY and self.engine == "rollout":
            raise FaultSpecError(
                f"fault {self.kind!r} acts on the trainer's optimizer, which a rollout engine has not; "
                "drop engine=rollout"
            )
        full = {name: default for name, (_, default, _) in KINDS[self.kind].items()}
        full.update(self.params)
        object.__setattr__(self, "params", full)

    def __getitem__(self, name: str):
        return self.params[name]

    def to_text(self) -> str:
        """The canonical text form (parses back to an equal spec)."""
        items = [f"{k}={_format(v)}" for k, v in sorted(self.params.items()) if v is not None]
        s = self.schedule
        if s.steps is not None:
            items.append(f"steps={_format(s.steps)}")
        else:
            items += [f"start={s.start}"] * (s.start != 0) + [f"stop={s.stop}"] * (s.stop is not None)
            items += [f"every={s.every}"] * (s.every != 1)
        items += [f"seed={self.seed}"] * (self.seed != 0)
        items += [f"engine={self.engine}"] * (self.engine != "any")
        return self.kind + (":" + ",".join(items) if items else "")


def _format(value) -> str:
    if isinstance(value, frozenset):
        return ",".join(sorted(map(str, value), key=lambda v: (v.startswith("mtp."), len(v), v)))
    return str(value)


def _split_params(text: str, where: str) -> dict[str, list[str]]:
    params: dict[str, list[str]] = {}
    last = None
    for token in (t.strip() for t in text.split(",")):
        if not token:
            continue
        key, sep, value = token.partition("=")
        if sep:
            key = key.strip()
            if key in params:
                raise FaultSpecError(f"{where}: parameter {key!r} given twice")
            params[key], last = [value.strip()], key
        elif last is None:
            raise FaultSpecError(f"{where}: {token!r} is not key=value")
        else:
            params[last].append(token)
    return params


def parse_one(text: str) -> FaultSpec:
    kind, _, rest = text.strip().partition(":")
    kind = kind.strip()
    where = f"fault {text.strip()!r}"
    if kind not in KINDS:
        raise FaultSpecError(f"{where}: unknown kind {kind!r}; known: {', '.join(KINDS)}")
    table = {**KINDS[kind], **SCHEDULE_PARAMS}
    params, schedule = {}, {}
    for key, values in _split_params(rest, where).items():
        if key not in table:
            raise FaultSpecError(f"{where}: unknown parameter {key!r}; {kind} takes {', '.join(table)}")
        parser, _, is_list = table[key]
        if len(values) > 1 and not is_list:
            raise FaultSpecError(f"{where}: {key} takes one value, got {','.join(values)}")
        try:
            value = parser(values if is_list else values[0])
        except ValueError as err:
            raise FaultSpecError(f"{where}: {key}={','.join(values)} is invalid ({err})") from None
        (schedule if key in SCHEDULE_PARAMS else params)[key] = value
    seed = schedule.pop("seed", 0)
    engine = schedule.pop("engine", "any")
    if "steps" in schedule and set(schedule) - {"steps"}:
        raise FaultSpecError(f"{where}: give either steps= or start/stop/every, not both")
    return FaultSpec(kind, params, Schedule(**schedule), seed, engine)


def parse(text: str) -> tuple[FaultSpec, ...]:
    """`"kind:k=v,...;kind..."` -> the specs, in order."""
    specs = tuple(parse_one(part) for part in text.split(";") if part.strip())
    if not specs:
        raise FaultSpecError(f"no fault in {text!r}; write e.g. 'router_noise:std=0.05'")
    return specs


def parse_env() -> tuple[FaultSpec, ...]:
    """The specs of `MCORE_PROXY_FAULTS` (raising FaultSpecError naming the variable)."""
    import os

    text = os.environ.get(ENV_FAULTS, "")
    try:
        return parse(text)
    except FaultSpecError as err:
        raise FaultSpecError(f"{ENV_FAULTS}={text!r}: {err}; fix the variable or unset it") from None


def check_env() -> None:
    """Activation check (`mcore_proxy.activation.Feature.check`)."""
    parse_env()
