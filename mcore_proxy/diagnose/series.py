"""The data of a metric log: one `Series` (steps, values) per metric, and the `RunLog` of one run."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

_EMPTY_STEPS = np.zeros(0, np.int64)
_EMPTY_VALUES = np.zeros(0, np.float64)


@dataclass(frozen=True)
class Series:
    """A metric over training steps, as two disjoint parts:

    - the curve: steps [n] int64 strictly increasing, values [n] float64, all finite;
    - the non-finite points: nonfinite_steps [m] int64 strictly increasing, nonfinite_values [m]
      float64, each NaN, +inf or -inf.

    A NaN or an infinity is the loudest fact a run can log, but it is not a point of a curve: the
    statistics of signatures and detectors run on the curve, and the non-finite points are kept to
    be counted and alerted on (`detect.nonfinite`, `MetricSignature.nonfinite_fault`). Duplicate
    steps (a restarted run logging a step twice) keep the last value, finite or not; `len()` is the
    number of curve points, `logged` the number of steps with a value of either kind."""

    steps: np.ndarray = field(repr=False)
    values: np.ndarray = field(repr=False)
    nonfinite_steps: np.ndarray = field(default_factory=lambda: _EMPTY_STEPS, repr=False)
    nonfinite_values: np.ndarray = field(default_factory=lambda: _EMPTY_VALUES, repr=False)

    def __post_init__(self):
        steps = np.concatenate([np.asarray(self.steps, np.int64), np.asarray(self.nonfinite_steps, np.int64)])
        values = np.concatenate([np.asarray(self.values, np.float64), np.asarray(self.nonfinite_values, np.float64)])
        if steps.shape != values.shape or steps.ndim != 1:
            raise ValueError(f"steps {steps.shape} and values {values.shape} must be equal 1-d shapes")
        order = np.argsort(steps, kind="stable")
        steps, values = steps[order], values[order]
        last = np.r_[steps[1:] != steps[:-1], True] if len(steps) else np.zeros(0, bool)
        steps, values = steps[last], values[last]
        finite = np.isfinite(values)
        object.__setattr__(self, "steps", steps[finite])
        object.__setattr__(self, "values", values[finite])
        object.__setattr__(self, "nonfinite_steps", steps[~finite])
        object.__setattr__(self, "nonfinite_values", values[~finite])

    def __len__(self) -> int:
        return len(self.steps)

    def __repr__(self) -> str:
        if not self.logged:
            return "Series(empty)"
        extra = f", {self.nonfinite} non-finite" if self.nonfinite else ""
        return f"Series({len(self)} points{extra}, steps {self.first_step}..{self.last_step})"

    @property
    def logged(self) -> int:
        """Steps with a value, finite or not."""
        return len(self.steps) + len(self.nonfinite_steps)

    @property
    def nonfinite(self) -> int:
        """Steps whose value is NaN or infinite."""
        return len(self.nonfinite_steps)

    @property
    def first_step(self) -> int | None:
        """The first step with a value of either kind (None for an empty series)."""
        ends = [int(a[0]) for a in (self.steps, self.nonfinite_steps) if len(a)]
        return min(ends) if ends else None

    @property
    def last_step(self) -> int | None:
        """The last step with a value of either kind (None for an empty series)."""
        ends = [int(a[-1]) for a in (self.steps, self.nonfinite_steps) if len(a)]
        return max(ends) if ends else None

    def nonfinite_kinds(self) -> dict[str, int]:
        """How many non-finite values of each kind: {"NaN": a, "+inf": b, "-inf": c}, zeros left out."""
        v = self.nonfinite_values
        kinds = {"NaN": int(np.isnan(v).sum()), "+inf": int((v == np.inf).sum()), "-inf": int((v == -np.inf).sum())}
        return {k: n for k, n in kinds.items() if n}

    def describe_nonfinite(self) -> str:
        """'3 NaN, 2 +inf and 1 -inf of 40 logged values, the first at step 7' ('' when there is none)."""
        if not self.nonfinite:
            return ""
        parts = [f"{n} {k}" for k, n in self.nonfinite_kinds().items()]
        kinds = " and ".join([", ".join(parts[:-1]), parts[-1]] if len(parts) > 1 else parts)
        return f"{kinds} of {self.logged} logged values, the first at step {int(self.nonfinite_steps[0])}"

    @classmethod
    def from_points(cls, points: list[tuple[int, float]]) -> "Series":
        """A series from (step, value) pairs in the order they were logged; values may be non-finite."""
        if not points:
            return cls(_EMPTY_STEPS, _EMPTY_VALUES)
        steps, values = zip(*points)
        return cls(np.array(steps, dtype=np.int64), np.array(values, dtype=np.float64))

    def window(self, lo: int, hi: int) -> "Series":
        """Points with lo <= step <= hi, of both kinds."""
        keep = (self.steps >= lo) & (self.steps <= hi)
        bad = (self.nonfinite_steps >= lo) & (self.nonfinite_steps <= hi)
        return Series(self.steps[keep], self.values[keep], self.nonfinite_steps[bad], self.nonfinite_values[bad])


@dataclass(frozen=True)
class RunLog:
    """One run's metrics as its log names them. `source`: the file or folder read; `format`:
    tensorboard | jsonl | csv | console (Megatron/MindSpeed-RL) | verl-console | trl-console | trl-state |
    mlflow | wandb | swanlab. Every series has at least one logged step; a series may hold only
    non-finite values (no curve)."""

    source: str
    format: str
    metrics: dict = field(default_factory=dict, repr=False)  # raw name -> Series

    def __repr__(self) -> str:
        return f"RunLog({self.source!r}, {self.format}, {len(self.metrics)} metrics)"

    @property
    def last_step(self) -> int | None:
        """The last step any metric logged, finite or not."""
        return max((s.last_step for s in self.metrics.values()), default=None)

    @property
    def finite(self) -> bool:
        """Whether any metric holds a finite value (a curve to compare)."""
        return any(len(s) for s in self.metrics.values())
