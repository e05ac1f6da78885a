"""engines/hooks.py: one owner removes every hook it holds, once, newest first."""

from __future__ import annotations

import torch

from mcore_proxy.engines.hooks import CallbackHandle, Hooks


def test_hooks_fire_until_removed_and_removal_is_once_newest_first():
    layer = torch.nn.Linear(3, 3)
    calls, order = [], []
    with Hooks() as hooks:
        hooks.forward(layer, lambda m, args, out: calls.append("plain"))
        hooks.forward(layer, lambda m, args, kwargs, out: calls.append(sorted(kwargs)), with_kwargs=True)
        hooks.add(CallbackHandle(lambda: order.append("first")), CallbackHandle(lambda: order.append("second")))
        assert len(hooks) == 4
        layer(torch.ones(1, 3))
        assert calls == ["plain", []]
    assert order == ["second", "first"] and len(hooks) == 0
    layer(torch.ones(1, 3))  # removed: nothing more is recorded
    hooks.remove()  # idempotent
    assert calls == ["plain", []] and order == ["second", "first"]


def test_a_callback_handle_runs_its_removal_once():
    count = []
    handle = CallbackHandle(lambda: count.append(1))
    handle.remove()
    handle.remove()
    assert count == [1]
