"""Anomaly signatures: how a faulted run's metric departs from its baseline's.

For one metric, with the shift curve d(s) = fault(s) - baseline(s) on the steps both logged:

- onset: where d departs from zero. Change points of d come from `ruptures` (PELT, least-squares
  cost, penalty 3 sigma^2 log n with sigma the step-to-step noise of d); the onset is the start of
  the first segment whose mean differs from zero by more than 3 sigma / sqrt(segment length) and
  by at least a tenth of the largest segment mean (a fault active from the first step has onset
  at the first step; none if no segment departs);
- direction and size: the mean of d from the onset on, its size relative to the baseline's
  level and noise; the sign counts only if a t-test on block means of d (blocks of >= 5 steps,
  which tames the autocorrelation of training curves) gives p < alpha;
- trend: Mann-Kendall (Kendall's tau of the block means against time) of d from the onset on,
  with the Theil-Sen slope per step; the sign counts only if p < alpha;
- the normalised shift curve: d smoothed (centred moving mean over ~5 % of the steps) and divided
  by its largest absolute value, so curves of different models and units overlay in [-1, 1];
- non-finite values: how many NaN/inf each run logged in the compared steps, and the first step of
  the faulted run's. The statistics above run on finite values only; a metric that is NaN or
  infinite in the faulted run and never in the baseline *turns non-finite* under the fault, which
  is a component of the signature in its own right (`compare.match_signatures` requires the proxy
  to agree on it).

A `FaultSignature` is these per metric, JSON-serialisable and versioned
(`mcore-proxy-signature/1`), so a library of them can be stored and matched later.
scipy and ruptures are imported inside the functions that need them.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass, field

import numpy as np

from mcore_proxy.core.optional import require
from mcore_proxy.diagnose.series import Series

FORMAT = "mcore-proxy-signature/1"
ALPHA = 0.05
MIN_POINTS = 8


@dataclass(frozen=True)
class MetricSignature:
    """The signature of one metric (shift = fault - baseline). Steps are the logs' own steps."""

    metric: str
    points: int  # aligned steps used
    first_step: int | None
    last_step: int | None
    direction: int  # +1 up, -1 down, 0 no significant shift
    shift: float  # mean of d from the onset on, in the metric's units
    relative_shift: float | None  # shift / mean |baseline| (None if the baseline is 0)
    effect: float | None  # shift / baseline step-to-step noise (None if noiseless)
    p_shift: float
    trend: int  # +1 growing shift, -1 shrinking, 0 none
    tau: float
    p_trend: float
    slope: float  # Theil-Sen slope of d per step
    onset: int | None  # step where the shift begins; None without one
    curve_steps: list = field(default_factory=list, repr=False)
    curve: list = field(default_factory=list, repr=False)  # normalised smoothed shift
    note: str = ""
    nonfinite_base: int = 0  # NaN/inf values the baseline logged in the compared steps
    nonfinite_fault: int = 0  # and the faulted run
    nonfinite_onset: int | None = None  # the faulted run's first step with one
    # over seeds only (diagnose/seeds.py): the steps the onset spans when the seeds are resampled
    # ([5th, 95th] percentile); None for one run, whose onset has no spread to measure
    onset_range: list | None = None

    @property
    def shifted(self) -> bool:
        return self.direction != 0

    @property
    def turns_nonfinite(self) -> bool:
        """NaN or inf in the faulted run where the baseline has none: the fault made the metric blow up."""
        return self.nonfinite_fault > 0 and self.nonfinite_base == 0

    @property
    def departed(self) -> bool:
        """Whether the faulted run departs from the baseline: a significant shift, or turning non-finite."""
        return self.shifted or self.turns_nonfinite

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "MetricSignature":
        return cls(**data)


@dataclass(frozen=True)
class FaultSignature:
    """Signatures of every metric of one (baseline, faulted) pair of runs."""

    baseline: str
    fault: str
    metrics: dict = field(default_factory=dict)  # metric -> MetricSignature
    label: str = ""  # e.g. the fault spec, for a library

    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            "baseline": self.baseline,
            "fault": self.fault,
            "label": self.label,
            "metrics": {k: v.to_dict() for k, v in self.metrics.items()},
        }

    @classmethod
    def from_dict(cls, data: dict) -> "FaultSignature":
        if data.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} signature (format {data.get('format')!r})")
        return cls(
            data["baseline"],
            data["fault"],
            {k: MetricSignature.from_dict(v) for k, v in data["metrics"].items()},
            data.get("label", ""),
        )


def align(base: Series, fault: Series) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(steps, baseline, fault) on the steps both logged; if they share fewer than half of the
    overlapping range's points (different logging intervals), the fault run is interpolated onto
    the baseline's steps within the overlap."""
    lo, hi = max(base.steps[0], fault.steps[0]), min(base.steps[-1], fault.steps[-1])
    steps, ib, jf = np.intersect1d(base.steps, fault.steps, return_indices=True)
    in_range = int(((base.steps >= lo) & (base.steps <= hi)).sum())
    if len(steps) * 2 >= in_range:
        return steps, base.values[ib], fault.values[jf]
    keep = (base.steps >= lo) & (base.steps <= hi)
    steps = base.steps[keep]
    return steps, base.values[keep], np.interp(steps, fault.steps, fault.values)


def noise_scale(x: np.ndarray) -> float:
    """Step-to-step noise: robust std of first differences / sqrt(2) (0 for a constant curve)."""
    if len(x) < 3:
        return 0.0
    diff = np.diff(x)
    mad = 1.4826 * float(np.median(np.abs(diff - np.median(diff))))
    sigma = mad if mad > 0 else float(np.std(diff))
    return sigma / np.sqrt(2)


def smooth(x: np.ndarray) -> np.ndarray:
    w = max(1, len(x) // 20)
    if w == 1:
        return x.astype(float)
    kernel = np.ones(2 * w + 1)
    num = np.convolve(x, kernel, mode="same")
    den = np.convolve(np.ones_like(x, dtype=float), kernel, mode="same")
    return num / den


def onset_index(d: np.ndarray, sigma: float) -> int | None:
    """Index where the shift curve departs from zero (see the module docstring)."""
    ruptures = require("ruptures", why="fault signatures (change points)")

    n = len(d)
    scale = sigma if sigma > 0 else max(float(np.max(np.abs(d))), 1e-300) * 1e-6
    if not np.any(d):
        return None
    min_size = max(2, n // 20)
    ends = (
        ruptures.Pelt(model="l2", min_size=min_size, jump=1).fit(d.reshape(-1, 1)).predict(pen=3 * scale**2 * np.log(n))
    )
    starts = [0, *ends[:-1]]
    means = [float(np.mean(d[a:b])) for a, b in zip(starts, ends)]
    largest = max(abs(m) for m in means)
    for (a, b), m in zip(zip(starts, ends), means):
        if abs(m) > 3 * scale / np.sqrt(b - a) and abs(m) >= 0.1 * largest:
            return a
    return None


def _blocks(x: np.ndarray) -> np.ndarray:
    n_blocks = int(np.clip(len(x) // 5, 3, 20))
    return np.array([b.mean() for b in np.array_split(x, n_blocks)]) if len(x) >= 3 else x


def metric_signature(metric: str, base: Series, fault: Series, *, alpha: float = ALPHA) -> MetricSignature:
    """The signature of `fault` against `base` for one metric."""
    stats = require("scipy.stats", why="fault signatures (statistical tests)")

    empty = dict(
        direction=0,
        shift=0.0,
        relative_shift=None,
        effect=None,
        p_shift=1.0,
        trend=0,
        tau=0.0,
        p_trend=1.0,
        slope=0.0,
        onset=None,
    )
    nonfinite = _nonfinite_fields(base, fault)
    if not len(base) or not len(fault):
        which = " and ".join(n for n, x in (("the baseline", base), ("the faulted run", fault)) if not len(x))
        return MetricSignature(metric, 0, None, None, **empty, **nonfinite, note=f"no finite value in {which}")
    steps, b, f = align(base, fault)
    if len(steps) < MIN_POINTS:
        return MetricSignature(
            metric,
            len(steps),
            int(steps[0]) if len(steps) else None,
            int(steps[-1]) if len(steps) else None,
            **empty,
            **nonfinite,
            note=f"only {len(steps)} common steps (need {MIN_POINTS})",
        )
    d = f - b
    sigma_d, sigma_b = noise_scale(d), noise_scale(b)
    smoothed = smooth(d)
    peak = float(np.max(np.abs(smoothed)))
    curve = (smoothed / peak if peak > 0 else smoothed).tolist()
    common = dict(
        metric=metric,
        points=len(steps),
        first_step=int(steps[0]),
        last_step=int(steps[-1]),
        curve_steps=steps.tolist(),
        curve=curve,
        **nonfinite,
    )
    start = onset_index(d, sigma_d)
    if start is None:
        return MetricSignature(**common, **empty, note="no departure from the baseline")
    post, post_b = d[start:], b[start:]
    shift = float(np.mean(post))
    blocks = _blocks(post)
    if np.all(blocks == blocks[0]):  # an exactly constant shift: no sampling noise at all
        p_shift = 0.0 if blocks[0] != 0 else 1.0
    else:
        with warnings.catch_warnings():  # nearly equal block means: scipy warns, the p is still right
            warnings.simplefilter("ignore", RuntimeWarning)
            p_shift = float(stats.ttest_1samp(blocks, 0.0).pvalue)
    direction = int(np.sign(shift)) if p_shift < alpha else 0
    tau, p_trend = (
        stats.kendalltau(np.arange(len(blocks)), blocks)
        if len(blocks) >= 3 and not np.all(blocks == blocks[0])
        else (0.0, 1.0)
    )
    tau, p_trend = float(np.nan_to_num(tau)), float(np.nan_to_num(p_trend, nan=1.0))
    trend = int(np.sign(tau)) if p_trend < alpha else 0
    slope = float(stats.theilslopes(post, steps[start:])[0]) if len(post) >= 2 else 0.0
    level = float(np.mean(np.abs(post_b)))
    return MetricSignature(
        **common,
        direction=direction,
        shift=shift,
        relative_shift=shift / level if level > 0 else None,
        effect=shift / sigma_b if sigma_b > 0 else None,
        p_shift=p_shift,
        trend=trend,
        tau=tau,
        p_trend=p_trend,
        slope=slope,
        onset=int(steps[start]),
    )


def _nonfinite_fields(base: Series, fault: Series) -> dict:
    """The NaN/inf counts of a (baseline, faulted) pair, as MetricSignature fields."""
    onset = int(fault.nonfinite_steps[0]) if fault.nonfinite else None
    return dict(nonfinite_base=base.nonfinite, nonfinite_fault=fault.nonfinite, nonfinite_onset=onset)
