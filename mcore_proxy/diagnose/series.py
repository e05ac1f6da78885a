"""The data of a metric log: one `Series` (steps, values) per metric, and the `RunLog` of one run."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Series:
    """A metric over training steps: steps [n] int64 strictly increasing, values [n] float64 (finite).

    Duplicate steps (a restarted run logging a step twice) keep the last value; non-finite values
    are dropped (a NaN loss is a fact of the run, but not a point of a curve)."""

    steps: np.ndarray = field(repr=False)
    values: np.ndarray = field(repr=False)

    def __post_init__(self):
        steps = np.asarray(self.steps, dtype=np.int64)
        values = np.asarray(self.values, dtype=np.float64)
        if steps.shape != values.shape or steps.ndim != 1:
            raise ValueError(f"steps {steps.shape} and values {values.shape} must be equal 1-d shapes")
        keep = np.isfinite(values)
        steps, values = steps[keep], values[keep]
        order = np.argsort(steps, kind="stable")
        steps, values = steps[order], values[order]
        last = np.r_[steps[1:] != steps[:-1], True] if len(steps) else np.zeros(0, bool)
        object.__setattr__(self, "steps", steps[last])
        object.__setattr__(self, "values", values[last])

    def __len__(self) -> int:
        return len(self.steps)

    def __repr__(self) -> str:
        if not len(self):
            return "Series(empty)"
        return f"Series({len(self)} points, steps {self.steps[0]}..{self.steps[-1]})"

    @classmethod
    def from_points(cls, points: list[tuple[int, float]]) -> "Series":
        if not points:
            return cls(np.zeros(0, np.int64), np.zeros(0))
        steps, values = zip(*points)
        return cls(np.array(steps), np.array(values, dtype=np.float64))

    def window(self, lo: int, hi: int) -> "Series":
        """Points with lo <= step <= hi."""
        keep = (self.steps >= lo) & (self.steps <= hi)
        return Series(self.steps[keep], self.values[keep])


@dataclass(frozen=True)
class RunLog:
    """One run's metrics as its log names them. `source`: the file or folder read; `format`:
    tensorboard | jsonl | csv | console (Megatron/MindSpeed-RL) | verl-console | trl-console | trl-state |
    mlflow | wandb | swanlab."""

    source: str
    format: str
    metrics: dict = field(default_factory=dict, repr=False)  # raw name -> Series

    def __repr__(self) -> str:
        return f"RunLog({self.source!r}, {self.format}, {len(self.metrics)} metrics)"
