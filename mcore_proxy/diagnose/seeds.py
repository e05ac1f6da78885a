"""compare over seeds: is the fault's signature real beyond the seed spread, and does the proxy
reproduce it seed by seed?

On small models a fault's signature comes and goes with the seed (another draw of prompts, of
samples, of noise), and one short run's own test has little power: 12 steps after a fault's onset
make 3 blocks for `signature.metric_signature`'s block t-test, so a reward drop of 0.14 in one
15-step run can be "not significant". Over seeds, the seeds themselves are the replicates: the
noise a fault must exceed is the spread between seeds, the one the RL literature reports.

Per metric and model (original, proxy), given each seed's (baseline, faulted) pair:

- the seed-mean signature: `metric_signature` of the mean baseline curve against the mean faulted
  curve over the seeds, on the steps every seed logged. It gives the onset (the change point of the
  mean shift, far steadier than one seed's), the trend, and the normalised shift curve; and the
  onset's range when the seeds are resampled (bootstrap, [5th, 95th] percentile), so that two
  onsets the seeds cannot tell apart agree (a gradual drift has no sharp change point: its onset
  moves with the draw);
- each seed's shift: the mean of (faulted - baseline) from that onset on (from the other model's
  onset when this one has none; from the first step when neither has);
- the direction: the sign of the mean of the seeds' shifts where a one-sample t-test of those
  shifts against 0 gives p < alpha (beyond the seed spread), else 0.

The two models' seed-mean signatures are matched by `compare.match_signatures`, the one rule of
agreement (direction, trend, onsets within the window, curve correlation, non-finite). A seed
*reproduces* the fault when, on every metric where the original departed, its own shifts in the
original and in the proxy both point the original's way (and both or neither turn non-finite); a
seed that lacks the metric does not reproduce it. The verdict over seeds is *consistent* when the
original departed in at least one metric, every metric's seed-mean signatures match, and at least
`min_share` of the seeds reproduce (default 0.8: 4 of 5).

Each seed's own single-run verdict (`compare.Comparison`) is still reported beside, as a
sensitivity: it asks every seed alone to be significant, which short runs rarely are.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np

from mcore_proxy.core.optional import require
from mcore_proxy.diagnose.compare import Comparison, MetricMatch, match_signatures
from mcore_proxy.diagnose.series import Series
from mcore_proxy.diagnose.signature import ALPHA, MetricSignature, align, metric_signature, noise_scale, onset_index

DEFAULT_MIN_SHARE = 0.8


@dataclass(frozen=True)
class SeedShifts:
    """One metric of one model over the seeds that compared it."""

    signature: MetricSignature  # of the seed-mean curves; direction and p_shift from the seeds' shifts
    seeds: tuple[int, ...]  # the seeds (indices into the comparisons) that compared the metric
    shifts: tuple[float, ...]  # per seed: mean of (faulted - baseline) from `start` on, metric units
    turns_nonfinite: tuple[bool, ...]  # per seed: NaN/inf in the faulted run, none in its baseline
    start: int | None  # the step the shifts are measured from
    curves: tuple = ()  # per seed: (steps, faulted - baseline), for the figure


def aligned(each: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each seed's aligned (steps, baseline, faulted run) (`signature.align`) -> (steps [n],
    baselines [seeds, n], faulted runs [seeds, n]) on the steps every seed has."""
    common = each[0][0]
    for steps, _, _ in each[1:]:
        common = np.intersect1d(common, steps)
    base = np.array([b[np.isin(s, common)] for s, b, _ in each])
    fault = np.array([f[np.isin(s, common)] for s, _, f in each])
    return common, base, fault


def onset_range(steps: np.ndarray, base: np.ndarray, fault: np.ndarray, draws: int = 100) -> list | None:
    """[5th, 95th] percentile of the seed-mean shift's onset (step) when the seeds are resampled with
    replacement `draws` times (a fixed generator: the same logs give the same range); None when
    fewer than half of the draws find an onset. base, fault: [seeds, n]."""
    rng = np.random.default_rng(0)
    found = []
    for _ in range(draws):
        pick = rng.integers(0, len(base), len(base))
        d = fault[pick].mean(axis=0) - base[pick].mean(axis=0)
        start = onset_index(d, noise_scale(d))
        if start is not None:
            found.append(int(steps[start]))
    if 2 * len(found) < draws:
        return None
    return [int(np.floor(np.percentile(found, 5))), int(np.ceil(np.percentile(found, 95)))]


def shift_from(steps: np.ndarray, d: np.ndarray, start: int | None) -> float:
    """Mean of the shift curve d (faulted - baseline) on steps >= start (all of them for None); 0 if none."""
    keep = steps >= start if start is not None else np.ones(len(steps), bool)
    return float(np.mean(d[keep])) if keep.any() else 0.0


def across_seeds(shifts, alpha: float = ALPHA) -> tuple[int, float]:
    """(direction, p): the sign of the mean shift where a one-sample t-test of the seeds' shifts
    against 0 gives p < alpha, else 0; equal shifts test exactly (p 0 unless they are all 0)."""
    stats = require("scipy.stats", why="compare over seeds (statistical tests)")

    x = np.asarray(shifts, float)
    if len(x) < 2 or np.all(x == x[0]):
        p = 0.0 if len(x) >= 2 and x[0] != 0 else 1.0
    else:
        with warnings.catch_warnings():  # nearly equal shifts: scipy warns, the p is still right
            warnings.simplefilter("ignore", RuntimeWarning)
            p = float(stats.ttest_1samp(x, 0.0).pvalue)
    return (int(np.sign(x.mean())) if p < alpha else 0), p


def _pairs(comparisons, metric: str, model: str) -> tuple[tuple[int, ...], list[tuple[Series, Series]]]:
    seeds = tuple(i for i, c in enumerate(comparisons) if metric in c.matches)
    pairs = [
        (comparisons[i].series[metric][f"{model}_base"], comparisons[i].series[metric][f"{model}_fault"]) for i in seeds
    ]
    return seeds, pairs


def _mean_signature(metric: str, pairs, each) -> MetricSignature:
    """The signature of the seed-mean curves; pairs: each seed's (baseline, faulted) Series, each:
    the same aligned (`signature.align`)."""
    steps, base, fault = aligned(each)
    sig = metric_signature(metric, Series(steps, base.mean(axis=0)), Series(steps, fault.mean(axis=0)))
    return replace(
        sig,
        nonfinite_base=sum(b.nonfinite for b, _ in pairs),
        nonfinite_fault=sum(f.nonfinite for _, f in pairs),
        nonfinite_onset=min((int(f.nonfinite_steps[0]) for _, f in pairs if f.nonfinite), default=None),
        onset_range=onset_range(steps, base, fault) if sig.onset is not None else None,
        note=f"mean of {len(pairs)} seeds" + (f"; {sig.note}" if sig.note else ""),
    )


def seed_shifts(comparisons, metric: str) -> tuple[SeedShifts, SeedShifts]:
    """The (original, proxy) `SeedShifts` of one metric (see the module docstring)."""
    models = {}
    for model in ("orig", "proxy"):
        seeds, pairs = _pairs(comparisons, metric, model)
        each = [align(b, f) for b, f in pairs]  # every seed's pair aligned once
        models[model] = seeds, pairs, [(steps, f - b) for steps, b, f in each], _mean_signature(metric, pairs, each)
    out = {}
    for model, other in (("orig", "proxy"), ("proxy", "orig")):
        seeds, pairs, curves, mean = models[model]
        start = mean.onset if mean.onset is not None else models[other][3].onset
        shifts = tuple(shift_from(steps, d, start) for steps, d in curves)
        direction, p = across_seeds(shifts)
        out[model] = SeedShifts(
            replace(mean, direction=direction, p_shift=p, shift=float(np.mean(shifts))),
            seeds,
            shifts,
            tuple(f.nonfinite > 0 and b.nonfinite == 0 for b, f in pairs),
            start,
            tuple((steps.tolist(), d.tolist()) for steps, d in curves),
        )
    return out["orig"], out["proxy"]


@dataclass(frozen=True)
class SeedsMetric:
    """One metric over the seeds: both models' shifts, and their seed-mean signatures matched."""

    orig: SeedShifts
    proxy: SeedShifts
    match: MetricMatch

    def reproduced(self, seed: int) -> bool:
        """Whether `seed` reproduces the original's departure (always, when the original did not depart)."""
        if not self.match.orig.departed:
            return True
        if seed not in self.orig.seeds or seed not in self.proxy.seeds:
            return False
        i, j = self.orig.seeds.index(seed), self.proxy.seeds.index(seed)
        if self.orig.turns_nonfinite[i] != self.proxy.turns_nonfinite[j]:
            return False
        way = self.match.orig.direction
        return way == 0 or int(np.sign(self.orig.shifts[i])) == way == int(np.sign(self.proxy.shifts[j]))


@dataclass(frozen=True)
class SeedsComparison:
    comparisons: tuple[Comparison, ...]  # seed i: the comparison of the i-th log of each role
    min_share: float = DEFAULT_MIN_SHARE
    onset_window: int | None = None  # steps; default: the widest of the seeds' own windows

    @property
    def seeds(self) -> int:
        return len(self.comparisons)

    @property
    def needed(self) -> int:
        """Seeds that must reproduce: ceil(min_share x seeds)."""
        return max(1, math.ceil(self.min_share * self.seeds - 1e-9))

    @cached_property
    def metrics(self) -> dict[str, SeedsMetric]:
        """metric -> its seed-mean signatures matched and its shifts seed by seed."""
        out = {}
        for name in dict.fromkeys(m for c in self.comparisons for m in c.matches):
            orig, proxy = seed_shifts(self.comparisons, name)
            window = self.onset_window
            if window is None:  # the seeds' own default windows (10 % of their steps, at least 3)
                window = max(c.matches[name].onset_window for c in self.comparisons if name in c.matches)
            out[name] = SeedsMetric(orig, proxy, match_signatures(orig.signature, proxy.signature, window))
        return out

    @property
    def departed(self) -> list[str]:
        return [m for m, x in self.metrics.items() if x.match.orig.departed]

    @property
    def mismatched(self) -> list[str]:
        return [m for m, x in self.metrics.items() if not x.match.match]

    def unreproduced(self, seed: int) -> list[str]:
        """The departed metrics `seed` does not reproduce (empty: it reproduces the fault)."""
        return [m for m in self.departed if not self.metrics[m].reproduced(seed)]

    @property
    def agreeing(self) -> int:
        return sum(not self.unreproduced(seed) for seed in range(self.seeds)) if self.departed else 0

    @property
    def consistent(self) -> bool:
        return bool(self.departed) and not self.mismatched and self.agreeing >= self.needed

    def verdict(self) -> str:
        head = f"over {self.seeds} seeds"
        if not self.departed:
            return (
                f"NOT CONSISTENT (inconclusive) {head}: the original's faulted runs show no shift beyond "
                "the seed spread in any compared metric, so there is nothing to reproduce"
            )
        if self.mismatched:
            return f"NOT CONSISTENT {head}: the seed-mean signatures differ in " + "; ".join(
                f"{m} ({', '.join(self.metrics[m].match.reasons())})" for m in self.mismatched
            )
        word = "CONSISTENT" if self.consistent else "NOT CONSISTENT"
        return (
            f"{word} {head}: the proxy reproduces the original's fault signature in {self.agreeing} of "
            f"{self.seeds} seeds (a verdict needs {self.needed}, min share {self.min_share:g}; shifted beyond "
            f"the seed spread in the original: {', '.join(self.departed)})"
        )


def _way(s: SeedShifts) -> str:
    sig = s.signature
    onset = "-" if sig.onset is None else sig.onset
    return f"{sig.direction:+d} {sig.shift:+.3g} (p {sig.p_shift:.2g}) / {sig.trend:+d} / {onset}"


def _shifts(s: SeedShifts) -> str:
    return " ".join(f"{x:+.2g}" for x in s.shifts)


def seeds_table(result: SeedsComparison) -> str:
    """Per metric: each model's seed-mean signature (direction, mean shift and its p over the seeds
    / trend / onset), the match, and the shifts seed by seed; then each seed, whether it reproduces
    the fault (and its single-run verdict beside), and the verdict over seeds."""
    head = f"{'metric':<22} {'original: dir shift (p) / trend / onset':<44} {'proxy':<40} match"
    lines = [head]
    for metric, x in result.metrics.items():
        verdict = "yes" if x.match.match else "NO: " + ", ".join(x.match.reasons())
        lines.append(f"{metric:<22} {_way(x.orig):<44} {_way(x.proxy):<40} {verdict}")
        lines.append(f"{'':<22} shifts by seed: original {_shifts(x.orig)} | proxy {_shifts(x.proxy)}")
    for seed, comparison in enumerate(result.comparisons):
        missed = result.unreproduced(seed)
        said = "reproduces" if not missed else "does not reproduce " + ", ".join(missed)
        alone = "consistent" if comparison.consistent else "not consistent"
        lines.append(f"seed {seed}: {said} (this seed alone, by its own tests: {alone})")
    lines.append(result.verdict())
    return "\n".join(lines)


def _shifts_dict(s: SeedShifts) -> dict:
    return {
        "signature": s.signature.to_dict(),
        "seeds": list(s.seeds),
        "shifts": list(s.shifts),
        "turns_nonfinite": list(s.turns_nonfinite),
        "start": s.start,
    }


def seeds_dict(result: SeedsComparison) -> dict:
    from mcore_proxy.diagnose.report import as_dict

    return {
        "mode": "seeds",  # of the compare document, `mcore-proxy-compare/1`
        "seeds": result.seeds,
        "agreeing": result.agreeing,
        "needed": result.needed,
        "min_share": result.min_share,
        "consistent": result.consistent,
        "verdict": result.verdict(),
        "metrics": {
            m: {
                "match": x.match.match,
                "reasons": x.match.reasons(),
                "onset_window": x.match.onset_window,
                "correlation": x.match.correlation,
                "departed": x.match.orig.departed,
                "reproduced": [x.reproduced(seed) for seed in range(result.seeds)],
                "original": _shifts_dict(x.orig),
                "proxy": _shifts_dict(x.proxy),
            }
            for m, x in result.metrics.items()
        },
        "per_seed": [
            {"reproduces": not result.unreproduced(seed), "not_reproduced": result.unreproduced(seed)}
            for seed in range(result.seeds)
        ],
        "single_run": [as_dict(c) for c in result.comparisons],  # each seed alone, by its own tests
    }


def seeds_figure(result: SeedsComparison, metric: str):
    """Each seed's shift curve (faulted - baseline) in metric units, thin, and their mean, thick;
    original beside proxy, with the step the seeds' shifts are measured from."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = result.metrics[metric]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    colors = plt.get_cmap("tab10")
    for ax, title, s in zip(axes, ("original", "proxy"), (x.orig, x.proxy)):
        for seed, (steps, d) in zip(s.seeds, s.curves):
            style = "-" if x.reproduced(seed) else ":"
            ax.plot(steps, d, style, color=colors(seed % 10), lw=1, label=f"seed {seed}")
        steps = s.signature.curve_steps
        if steps:
            mean = np.mean([np.interp(steps, a, b) for a, b in s.curves], axis=0)
            ax.plot(steps, mean, color="black", lw=2.2, label="mean")
        if s.start is not None:
            ax.axvline(s.start, color="gray", ls="--", lw=0.8)
        ax.axhline(0, color="gray", lw=0.5)
        ax.set_title(f"{title}: {metric}, faulted - baseline (dotted: seed not reproduced)", fontsize=9)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def write_seeds_report(out, result: SeedsComparison, *, inputs: tuple = (), replace: bool = False):
    """The report folder `out`: report.json, report.md and one PNG per metric (every seed's curves)."""
    import json
    from pathlib import Path

    from mcore_proxy.core.optional import require
    from mcore_proxy.core.output import staged_output
    from mcore_proxy.diagnose.report import safe_name

    require("matplotlib", why="compare -o (the report's figures)", extra="diagnose")
    import matplotlib.pyplot as plt

    out = Path(out)
    with staged_output(out, inputs, replace=replace) as tmp:
        (tmp / "report.json").write_text(
            json.dumps({"format": "mcore-proxy-compare/1", **seeds_dict(result)}, indent=1)
        )
        lines = ["# mcore-proxy compare over seeds", "", result.verdict(), "", "```", seeds_table(result), "```", ""]
        for metric in result.metrics:
            fig = seeds_figure(result, metric)
            fig.savefig(tmp / f"{safe_name(metric)}.png", dpi=90)
            plt.close(fig)
            lines.append(f"![{metric}]({safe_name(metric)}.png)")
        (tmp / "report.md").write_text("\n".join(lines) + "\n")
    return out
