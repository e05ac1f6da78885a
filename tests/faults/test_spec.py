"""Fault specifications: the text form of MCORE_PROXY_FAULTS, defaults, schedules, clear errors;
and the pure top-k alteration."""

import pytest
import torch

from mcore_proxy.faults.clock import StepClock
from mcore_proxy.faults.router import alter_topk
from mcore_proxy.faults.spec import FaultSpecError, Schedule, parse, parse_env


def test_the_issue_example_parses_with_defaults():
    noise, omission = parse("router_noise:std=0.05,layers=0-3;update_omission:every=2")
    assert noise.kind == "router_noise" and noise["std"] == 0.05
    assert noise["layers"] == frozenset({"0", "1", "2", "3"})
    assert omission["group"] == "all" and omission.schedule == Schedule(every=2)
    assert [s.to_text() for s in parse("topk;logprob_precision:dtype=fp16")] == [
        "topk:mode=swap,rate=0.1",
        "logprob_precision:dtype=fp16,when=no_grad",
    ]


def test_lists_continue_after_commas_and_text_round_trips():
    (spec,) = parse("topk:mode=drop,layers=1,3-4,mtp.0,rate=0.5,steps=2,5-6,seed=7,engine=trainer")
    assert spec["layers"] == frozenset({"1", "3", "4", "mtp.0"})
    assert spec.schedule.steps == frozenset({2, 5, 6}) and spec.seed == 7 and spec.engine == "trainer"
    assert parse(spec.to_text()) == (spec,)
    assert parse("router_noise")[0].engine == "any"


def test_schedule_start_stop_every():
    s = Schedule(start=2, stop=9, every=3)
    assert [step for step in range(12) if s.active(step)] == [2, 5, 8]
    assert [step for step in range(4) if Schedule().active(step)] == [0, 1, 2, 3]
    assert not any(Schedule(steps=frozenset()).active(step) for step in range(5))


@pytest.mark.parametrize(
    "text, message",
    [
        ("router_nois:std=1", "unknown kind 'router_nois'; known: router_noise"),
        ("router_noise:sd=1", "unknown parameter 'sd'; router_noise takes std, layers, start"),
        ("router_noise:std=abc", "std=abc is invalid"),
        ("router_noise:std=-1", r"std=-1 is invalid \(must be a finite number >= 0\)"),
        ("expert_noise:std=nan", "std=nan is invalid"),
        ("router_weight:std=inf", "std=inf is invalid"),
        ("topk:rate=2", r"rate=2 is invalid \(must be within \[0, 1\]\)"),
        ("topk:mode=shuffle", "must be one of swap, drop"),
        ("update_omission:every=0", "every=0 is invalid"),
        ("update_omission:std", "'std' is not key=value"),
        ("router_noise:std=1,std=2", "given twice"),
        ("router_noise:steps=1,start=2", "either steps= or start/stop/every"),
        ("router_noise:layers=3-1", "empty range"),
        (" ; ", "no fault in"),
        ("router_noise:engine=sglang", "must be one of any, trainer, rollout"),
        ("update_omission:engine=rollout", "acts on the trainer's optimizer"),
    ],
)
def test_bad_specs_say_what_and_where(text, message):
    with pytest.raises(FaultSpecError, match=message):
        parse(text)


def test_env_errors_name_the_variable(monkeypatch):
    monkeypatch.setenv("MCORE_PROXY_FAULTS", "router_noise:std=x")
    with pytest.raises(FaultSpecError, match=r"MCORE_PROXY_FAULTS='router_noise:std=x': .*fix the variable"):
        parse_env()


def test_clock_counts_each_optimizer_and_can_be_pinned():
    clock, a, b = (
        StepClock(),
        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1),
        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1),
    )
    assert clock.step == 0
    for _ in range(3):  # a chained optimizer: both inner optimizers step once
        assert clock.optimizer_step(a) == clock.optimizer_step(b)
        clock.advance(a)
        clock.advance(b)
    assert clock.step == 3 and clock.optimizer_step(a) == 3
    clock.set_step(10)
    clock.advance(a)
    assert clock.step == 10 and clock.optimizer_step(b) == 10


def test_alter_topk_swap_and_drop_exactly():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4000, 8, generator=g)
    routing_map = torch.zeros(4000, 8, dtype=torch.bool).scatter(1, logits.topk(2, dim=1).indices, True)
    probs = torch.softmax(logits, dim=1) * routing_map
    p, m = alter_topk(probs, routing_map, 0.2, "swap", g)
    assert (m.sum(dim=1) == 2).all() and torch.equal(p > 0, m)
    torch.testing.assert_close(p.sum(dim=1), probs.sum(dim=1))
    assert torch.equal(p.sort(dim=1).values, probs.sort(dim=1).values)  # probabilities move intact
    assert abs((routing_map & ~m).sum().item() / 8000 - 0.2) < 0.02
    p, m = alter_topk(probs, routing_map, 0.2, "drop", g)
    assert not (m & ~routing_map).any() and abs(1 - m.sum().item() / 8000 - 0.2) < 0.02
    p, m = alter_topk(probs, routing_map, 0.0, "swap", g)
    assert torch.equal(p, probs) and torch.equal(m, routing_map)
    full = torch.ones(3, 2, dtype=torch.bool)  # no free expert to swap to
    p, m = alter_topk(torch.full((3, 2), 0.5), full, 1.0, "swap", g)
    assert torch.equal(m, full)
