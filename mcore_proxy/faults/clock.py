"""The training step and phase a process is in, as the fault schedules see them.

A *step* is a training step: by default the number of optimizer steps this process has completed,
counted per optimizer (megatron's ChainedOptimizer steps a dense and an expert torch optimizer once
each per training step) and taken as the most advanced one; forward passes before the first
optimizer step are step 0. A loop that knows its iteration (Megatron's `args.iteration`, an RL
trainer's global step, a rollout worker without optimizer) says so with `set_step(n)`, after which
the optimizers no longer move the clock.

The *phase*: inside `with rollout():` forward passes are rollout passes (what the
`logprob_precision` fault's `when=rollout` acts on).
"""

from __future__ import annotations

import contextlib
import threading
import weakref


class StepClock:
    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self._counts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._auto = 0
        self._pinned: int | None = None

    @property
    def step(self) -> int:
        return self._auto if self._pinned is None else self._pinned

    def set_step(self, step: int) -> None:
        self._pinned = int(step)

    def optimizer_step(self, optimizer) -> int:
        """The index of the step `optimizer` is taking now (0 for its first)."""
        return self._counts.get(optimizer, 0) if self._pinned is None else self._pinned

    def advance(self, optimizer) -> None:
        """Called after `optimizer` stepped (taken or omitted)."""
        self._counts[optimizer] = self._counts.get(optimizer, 0) + 1
        self._auto = max(self._auto, self._counts[optimizer])


CLOCK = StepClock()
_PHASE = threading.local()


def set_step(step: int) -> None:
    """Tell the fault schedules which training step this process is in from now on."""
    CLOCK.set_step(step)


def current_step() -> int:
    return CLOCK.step


@contextlib.contextmanager
def rollout():
    """Forward passes inside the block are rollout passes."""
    depth = getattr(_PHASE, "rollout", 0)
    _PHASE.rollout = depth + 1
    try:
        yield
    finally:
        _PHASE.rollout = depth


def in_rollout() -> bool:
    return getattr(_PHASE, "rollout", 0) > 0
