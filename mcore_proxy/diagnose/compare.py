"""Does the proxy reproduce the original's fault? Signatures of (original baseline, original fault)
and (proxy baseline, proxy fault), matched metric by metric.

A metric matches when the two signatures agree in direction of the shift and in trend, their
onsets lie within `onset_window` steps of each other (when either shifted; or, for signatures over
seeds, when the onsets' ranges under resampling the seeds overlap: the seeds cannot tell them
apart, which a gradual drift's change point needs), when either shift
curve has a trend their normalised shift curves correlate (Pearson r >= MIN_CORRELATION) on their
common steps, and both or neither turn non-finite under the fault (NaN or inf in the faulted run,
none in its baseline: a blow-up is part of a fault's signature; a proxy that shifts the same way
without blowing up, or blows up where the original does not, does not reproduce it). The step at
which each turns non-finite is reported, not matched: a blow-up's step depends on the run's
numbers more than on the fault. Two signs agree when they are equal, or when one is significant (p <
alpha) and the other leans the same way without reaching significance (same sign of its
estimate, p < ALPHA_WEAK): a borderline test on one side is not a contradiction. Opposite
significant signs, or a significant shift facing an estimate of the other sign, zero, or one
with p >= ALPHA_WEAK, do not agree. The verdict is *consistent* when every compared metric
matches and the original's faulted run departed in at least one (shifted, or turned non-finite;
otherwise there is nothing to reproduce: *inconclusive*, which is not consistent).

Every run is restricted, per metric, to the steps all four runs logged (with a value, finite or
not); what that leaves out (a metric one run lacks, steps beyond the shortest run) is said in
`Comparison.left_out`. The NaN/inf values of each run in those steps are counted
(`MetricSignature.nonfinite_base`, `nonfinite_fault`). A log with no finite value at all is refused
(`require_finite`): there is no curve in it to take a signature of.
`match_signatures` is the one rule of agreement; a later triage can rank stored signatures with
`MetricMatch.score`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mcore_proxy.diagnose.aliases import ALIASES, canonical_metrics, resolve
from mcore_proxy.diagnose.series import RunLog, Series
from mcore_proxy.diagnose.signature import MIN_POINTS, FaultSignature, MetricSignature, metric_signature
from mcore_proxy.core.errors import LogError

ROLES = ("orig_base", "orig_fault", "proxy_base", "proxy_fault")
MIN_CORRELATION = 0.5
ALPHA_WEAK = 0.25


def role_name(role: str) -> str:
    return role.replace("_", "-")


@dataclass(frozen=True)
class MetricMatch:
    metric: str
    orig: MetricSignature
    proxy: MetricSignature
    direction: bool
    trend: bool
    onset: bool
    correlation: float | None
    correlation_required: bool
    onset_window: int
    nonfinite: bool = True  # both or neither turn non-finite under the fault

    @property
    def correlation_ok(self) -> bool:
        return not self.correlation_required or (self.correlation is not None and self.correlation >= MIN_CORRELATION)

    @property
    def match(self) -> bool:
        return self.direction and self.trend and self.onset and self.correlation_ok and self.nonfinite

    @property
    def score(self) -> float:
        """Agreement in [0, 1] of the finite curves: direction, trend, onset, and the correlation
        (clipped at 0); the non-finite agreement is in `match`, not here."""
        r = max(self.correlation or 0.0, 0.0) if self.correlation_required else 1.0
        return (self.direction + self.trend + self.onset + r) / 4

    def reasons(self) -> list[str]:
        out = []
        if not self.direction:
            out.append(f"direction {self.orig.direction:+d} vs {self.proxy.direction:+d}")
        if not self.trend:
            out.append(f"trend {self.orig.trend:+d} vs {self.proxy.trend:+d}")
        if not self.onset:
            ranges = ""
            if self.orig.onset_range is not None or self.proxy.onset_range is not None:
                ranges = f", over seeds {self.orig.onset_range} vs {self.proxy.onset_range}"
            out.append(f"onset {self.orig.onset} vs {self.proxy.onset} (window {self.onset_window}{ranges})")
        if not self.correlation_ok:
            r = "n/a" if self.correlation is None else f"{self.correlation:.2f}"
            out.append(f"shift curves correlate r={r} < {MIN_CORRELATION}")
        if not self.nonfinite:
            out.append(_nonfinite_reason(self.orig, self.proxy))
        return out


def _nonfinite_reason(orig: MetricSignature, proxy: MetricSignature) -> str:
    """Which side turns non-finite under the fault, and from which step."""
    yes, no = ("original", "proxy") if orig.turns_nonfinite else ("proxy", "original")
    sig = orig if orig.turns_nonfinite else proxy
    return f"NaN/inf under the fault in the {yes} from step {sig.nonfinite_onset}, not in the {no}"


def curve_correlation(a: MetricSignature, b: MetricSignature) -> float | None:
    steps, ia, ib = np.intersect1d(a.curve_steps, b.curve_steps, return_indices=True)
    if len(steps) < 3:
        return None
    x, y = np.asarray(a.curve)[ia], np.asarray(b.curve)[ib]
    if np.std(x) == 0 or np.std(y) == 0:
        return None
    return float(np.corrcoef(x, y)[0, 1])


def ranges_overlap(a, b) -> bool:
    """Whether two [lo, hi] step ranges overlap (False when either is None)."""
    return a is not None and b is not None and a[0] <= b[1] and b[0] <= a[1]


def signs_agree(a: int, a_estimate: float, a_p: float, b: int, b_estimate: float, b_p: float) -> bool:
    """Whether two thresholded signs (+1, 0, -1) with their estimates and p-values agree."""
    if a == b:
        return True
    if a != 0 and b != 0:
        return False
    strong = a or b
    estimate, p = (b_estimate, b_p) if a else (a_estimate, a_p)
    return int(np.sign(estimate)) == strong and p < ALPHA_WEAK


def match_signatures(orig: MetricSignature, proxy: MetricSignature, onset_window: int) -> MetricMatch:
    """The rule of agreement of two signatures of one metric."""
    shifted = orig.shifted or proxy.shifted
    onset = not shifted or (
        orig.onset is not None
        and proxy.onset is not None
        and (abs(orig.onset - proxy.onset) <= onset_window or ranges_overlap(orig.onset_range, proxy.onset_range))
    )
    direction = signs_agree(orig.direction, orig.shift, orig.p_shift, proxy.direction, proxy.shift, proxy.p_shift)
    trend = signs_agree(orig.trend, orig.tau, orig.p_trend, proxy.trend, proxy.tau, proxy.p_trend)
    return MetricMatch(
        orig.metric,
        orig,
        proxy,
        direction,
        trend,
        onset,
        curve_correlation(orig, proxy),
        orig.trend != 0 or proxy.trend != 0,
        onset_window,
        orig.turns_nonfinite == proxy.turns_nonfinite,
    )


@dataclass(frozen=True)
class Comparison:
    sources: dict  # role -> log path
    matches: dict = field(default_factory=dict)  # metric -> MetricMatch
    raw_names: dict = field(default_factory=dict)  # metric -> role -> raw name in that log
    series: dict = field(default_factory=dict, repr=False)  # metric -> role -> Series (window)
    left_out: list = field(default_factory=list)

    @property
    def shifted(self) -> list[str]:
        """Metrics where the original's faulted run departs: shifted, or turned non-finite."""
        return [m for m, match in self.matches.items() if match.orig.departed]

    @property
    def mismatched(self) -> list[str]:
        return [m for m, match in self.matches.items() if not match.match]

    @property
    def consistent(self) -> bool:
        return bool(self.shifted) and not self.mismatched

    def verdict(self) -> str:
        if self.mismatched:
            return "NOT CONSISTENT: the proxy's signature differs in " + "; ".join(
                f"{m} ({', '.join(self.matches[m].reasons())})" for m in self.mismatched
            )
        if not self.shifted:
            return (
                "NOT CONSISTENT (inconclusive): the original's faulted run shows no significant "
                "shift in any compared metric, so there is nothing to reproduce"
            )
        # a metric that departed by turning NaN/inf alone is marked: no shift of its curve was found
        named = [m if self.matches[m].orig.shifted else f"{m} (NaN/inf)" for m in self.shifted]
        return (
            f"CONSISTENT: the proxy reproduces the original's fault signature in all "
            f"{len(self.matches)} compared metrics (shifted in the original: {', '.join(named)})"
        )

    def signatures(self) -> tuple[FaultSignature, FaultSignature]:
        """The (original, proxy) fault signatures, e.g. to store in a library."""
        orig = FaultSignature(
            self.sources["orig_base"], self.sources["orig_fault"], {m: x.orig for m, x in self.matches.items()}
        )
        proxy = FaultSignature(
            self.sources["proxy_base"], self.sources["proxy_fault"], {m: x.proxy for m, x in self.matches.items()}
        )
        return orig, proxy


def _pick_metrics(logs: dict[str, RunLog], requested) -> tuple[dict, list[str]]:
    """metric -> role -> raw name, for metrics every given run has; and sentences of what is not."""
    left_out = []
    if requested:
        names = list(requested)
    else:
        present = [canonical_metrics(log.metrics) for log in logs.values()]
        names = [m for m in ALIASES if any(m in p for p in present)]
    chosen = {}
    for name in names:
        raw = {role: resolve(name, log.metrics) for role, log in logs.items()}
        missing = [r for r, v in raw.items() if v is None]
        if missing:
            left_out.append(
                f"{name}: not in " + ", ".join(f"{role_name(r)} ({logs[r].source})" for r in missing) + "; left out"
            )
        else:
            chosen[name] = raw
    return chosen, left_out


def _window(series: dict[str, Series]) -> tuple[int, int]:
    """The steps every series logged a value in (finite or not): a run that turns NaN at the end
    is compared up to its end, so that its NaN are counted."""
    return max(s.first_step for s in series.values()), min(s.last_step for s in series.values())


def require_finite(log: RunLog) -> RunLog:
    """`log`, or LogError when every metric in it holds only NaN or infinite values."""
    if log.finite:
        return log
    first = min(log.metrics.values(), key=lambda s: int(s.nonfinite_steps[0]))
    raise LogError(
        f"{log.source}: every metric holds only NaN or infinite values ({len(log.metrics)} metrics, "
        f"from step {int(first.nonfinite_steps[0])}), so there is no curve to compare; `mcore-proxy "
        "watch` shows where the run broke"
    )


def pair_signature(baseline: RunLog, run: RunLog, metrics=None, label: str = "") -> tuple[FaultSignature, list[str]]:
    """The signature of `run` against `baseline` on the steps both logged, per metric (canonical or
    raw names; default every aliased metric both logs have), and sentences of what was left out. A
    metric with too few common steps gets an empty signature saying so (`MetricSignature.note`)."""
    chosen, left_out = _pick_metrics({"baseline": baseline, "run": run}, metrics)
    signatures = {}
    for name, raw in chosen.items():
        base, other = baseline.metrics[raw["baseline"]], run.metrics[raw["run"]]
        lo, hi = _window({"baseline": base, "run": other})
        signatures[name] = metric_signature(name, base.window(lo, hi), other.window(lo, hi))
    return FaultSignature(baseline.source, run.source, signatures, label), left_out


def compare_runs(logs: dict[str, RunLog], metrics=None, onset_window: int | None = None) -> Comparison:
    """logs: role (ROLES) -> RunLog. metrics: canonical or raw names (default: every aliased
    metric the logs have). onset_window: steps (default max(3, 10 % of the compared window))."""
    for log in logs.values():
        require_finite(log)
    chosen, left_out = _pick_metrics(logs, metrics)
    matches, used, raw_names = {}, {}, {}
    for name, raw in chosen.items():
        series = {role: logs[role].metrics[raw[role]] for role in ROLES}
        lo, hi = _window(series)
        cut = {role: s.window(lo, hi) for role, s in series.items()}
        if min(s.logged for s in cut.values()) < MIN_POINTS:
            left_out.append(
                f"{name}: the four runs share only steps {lo}-{hi} "
                f"({min(s.logged for s in cut.values())} points, need {MIN_POINTS}); left out"
            )
            continue
        beyond = [
            f"{role_name(r)} {s.first_step}-{s.last_step}"
            for r, s in series.items()
            if s.first_step < lo or s.last_step > hi
        ]
        if beyond:
            longest = max(s.last_step - s.first_step for s in series.values()) or 1
            very = " (runs of very different lengths)" if (hi - lo) < 0.5 * longest else ""
            left_out.append(
                f"{name}: compared steps {lo}-{hi}, the overlap of the four runs{very}; "
                f"steps outside it left out (logged: {', '.join(beyond)})"
            )
        window = onset_window if onset_window is not None else max(3, int(round(0.1 * (hi - lo))))
        orig = metric_signature(name, cut["orig_base"], cut["orig_fault"])
        proxy = metric_signature(name, cut["proxy_base"], cut["proxy_fault"])
        matches[name] = match_signatures(orig, proxy, window)
        used[name], raw_names[name] = cut, raw
    if not matches:
        raise LogError(
            "no metric can be compared: "
            + ("; ".join(left_out) or "the logs share no known metric")
            + "; pass --metrics with names all four logs have"
        )
    return Comparison({role: logs[role].source for role in ROLES}, matches, raw_names, used, left_out)
