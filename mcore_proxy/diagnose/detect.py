"""Early-warning detectors over a run's metric curves, each giving the step where the trouble began.

Every detector is a pure function of `Series` (steps, values) that returns a `Finding` or None;
`detect(run, baseline, settings)` applies them to a `RunLog` (metrics found through the alias
table). They look at the whole curve so far, so re-running them on a grown log is the update.

- `plateau` (reward): the reward's rolling mean (window `window`) has not exceeded its best value
  for `patience` steps; onset: the first step of the best window. A plateau is normal late in
  training, so the patience is long; with a baseline, `diverge` is the sharper test.
- `rising` (log-prob difference, rollout-vs-training KL, PPO KL): the curve departs upwards from its own early level
(the
  median of the first `warmup` points, which are taken to be healthy). This is the signature of
  `signature.metric_signature` against that constant level: a change point (PELT) marks the
  onset, a t-test on block means from there on gives the significance, and the shift must exceed
  `rise` standard deviations of the warm-up points (a noisy early level is not a baseline). The KL loss to the
  reference policy grows in every healthy RL run, so it is not watched this way by default.
- `collapse` (entropy): the rolling mean falls below `collapse` x the early level; onset: the first
  step of the rolling window that first fell below it (or of the last stretch below it).
- `spike` (grad norm): a point above `spike` x the median of the `window * 4` points before it and
  above that median + `spike` x their MAD-based spread; onset: the step of the first spike.
- `nonfinite` (every metric, or those of `nonfinite_metrics`): a NaN or an infinite value was
  logged; onset: the step of the first. The loudest fault signal a run gives (a diverged loss, an
  overflowing log-prob ratio), and one no curve shows, since curves hold finite values only.
- `diverge` (every metric, with a baseline): the run's signature against the baseline's on the
  steps both logged (`compare.pair_signature`) shows a significant shift; onset: its onset.

`rising` and `diverge` fire only once the shift covers `persist` logged steps: a constant shift of
the last two points has no noise to be tested against and would pass any test. `diverge` also
needs the shift to be at least `effect` times the baseline's step-to-step noise (any size when the
baseline is noiseless, e.g. a log-prob difference of exactly 0): two runs with the same seed differ
so little that a shift of 0.1 % of a metric is "significant" without mattering.

The thresholds are guesses stated as defaults, not tuned on the acceptance runs; bench/RESULTS.md
records how they did on the demonstration.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mcore_proxy.diagnose.aliases import canonical_metrics
from mcore_proxy.diagnose.series import RunLog, Series

DETECTORS = ("nonfinite", "plateau", "rising", "collapse", "spike", "diverge")


@dataclass(frozen=True)
class Settings:
    window: int = 5  # rolling-mean window (steps of the log)
    warmup: int = 5  # first points taken as the run's healthy level
    patience: int = 20  # plateau: steps without a new best rolling reward
    collapse: float = 0.5  # entropy: alert below this fraction of its early level
    spike: float = 10.0  # grad norm: alert above this multiple of its recent median
    rise: float = 3.0  # rising: the shift must exceed this many warm-up standard deviations
    persist: int = 3  # rising, diverge: the shift must cover this many logged steps
    effect: float = 1.0  # diverge: |shift| in units of the baseline's step-to-step noise
    rising_metrics: tuple = (
        "logprob_diff",
        "rollout_kl",
        "ppo_kl",
        "routing_disagreement",
        "routing_token_disagreement",
    )
    nonfinite_metrics: tuple = ()  # canonical or raw names watched for NaN/inf; () every metric

    def __post_init__(self):
        if min(self.window, self.patience, self.persist) < 1 or self.warmup < 2:
            raise ValueError("window, patience and persist must be >= 1, warmup >= 2 (a spread needs two points)")
        if not 0 < self.collapse < 1 or self.spike <= 1:
            raise ValueError("collapse must lie in (0, 1) and spike be > 1")


@dataclass(frozen=True)
class Finding:
    detector: str
    metric: str  # canonical name (a metric without one: its raw name)
    onset: int  # step where the trouble began
    value: float  # the value that made the detector fire (its units below); nonfinite: their count
    message: str


def _rolling(values: np.ndarray, window: int) -> np.ndarray:
    """Mean of each full window [i - window + 1, i], for i >= window - 1."""
    kernel = np.ones(window) / window
    return np.convolve(values, kernel, mode="valid")


def plateau(series: Series, s: Settings) -> Finding | None:
    if len(series) < s.window + s.patience:
        return None
    rolled = _rolling(series.values, s.window)
    best = int(np.argmax(rolled))  # first index of the best value
    since = len(rolled) - 1 - best
    if since < s.patience:
        return None
    onset = int(series.steps[best])  # the first step of the best window
    return Finding(
        "plateau",
        "reward",
        onset,
        float(rolled[best]),
        f"no new best {s.window}-step mean reward ({rolled[best]:.4g}) for {since} steps",
    )


def rising(metric: str, series: Series, s: Settings) -> Finding | None:
    from mcore_proxy.diagnose.signature import MIN_POINTS, metric_signature

    if len(series) < max(MIN_POINTS, s.warmup + 3):
        return None
    early = series.values[: s.warmup]
    level, spread = float(np.median(early)), float(np.std(early, ddof=1))
    sig = metric_signature(metric, Series(series.steps, np.full(len(series), level)), series)
    if (
        sig.direction <= 0
        or sig.onset is None
        or sig.shift <= s.rise * spread
        or not _persists(series, sig.onset, s.persist)
    ):
        return None
    return Finding(
        "rising",
        metric,
        sig.onset,
        sig.shift,
        f"up by {sig.shift:.3g} from its early level {level:.3g} since step {sig.onset} (p {sig.p_shift:.2g})",
    )


def collapse(metric: str, series: Series, s: Settings) -> Finding | None:
    if len(series) < s.warmup + s.window:
        return None
    level = float(np.median(series.values[: s.warmup]))
    if level <= 0:
        return None
    rolled = _rolling(series.values, s.window)
    below = rolled < s.collapse * level
    if not below[-1]:
        return None
    first = len(below) - int(np.argmin(below[::-1])) if not below.all() else 0  # start of the last stretch
    onset = int(series.steps[first])
    return Finding(
        "collapse",
        metric,
        onset,
        float(rolled[-1]),
        f"{s.window}-step mean {rolled[-1]:.3g} below {s.collapse:g} x its early level {level:.3g}",
    )


def spike(metric: str, series: Series, s: Settings) -> Finding | None:
    history = 4 * s.window
    v = series.values
    for i in range(max(history, s.warmup), len(v)):
        past = v[i - history : i]
        median = float(np.median(past))
        spread = 1.4826 * float(np.median(np.abs(past - median)))
        if v[i] > s.spike * median and v[i] > median + s.spike * spread:
            return Finding(
                "spike",
                metric,
                int(series.steps[i]),
                float(v[i]),
                f"{v[i]:.3g} at step {series.steps[i]}, {v[i] / median:.0f}x the median "
                f"{median:.3g} of the {history} steps before",
            )
    return None


def nonfinite(metric: str, series: Series) -> Finding | None:
    """A finding when `series` logged NaN or infinite values: onset the first such step, value their
    count (a finite number, so that the alert stays valid JSON)."""
    if not series.nonfinite:
        return None
    return Finding(
        "nonfinite", metric, int(series.nonfinite_steps[0]), float(series.nonfinite), series.describe_nonfinite()
    )


def nonfinite_all(run: RunLog, s: Settings) -> list[Finding]:
    """`nonfinite` on every metric of `run` (canonical names where the alias table has one), or on
    those `s.nonfinite_metrics` names."""
    canonical = {raw: name for name, raw in canonical_metrics(run.metrics).items()}
    wanted = set(s.nonfinite_metrics)
    found = []
    for raw, series in run.metrics.items():
        name = canonical.get(raw, raw)
        if not wanted or name in wanted or raw in wanted:
            found.append(nonfinite(name, series))
    return [f for f in found if f is not None]


def _persists(series: Series, onset: int, count: int) -> bool:
    """Whether `series` logged at least `count` steps from `onset` on (a shift seen on the last
    step or two is not yet a shift: a constant two-point segment has no noise to test against)."""
    return int((series.steps >= onset).sum()) >= count


def diverge(baseline: RunLog, run: RunLog, s: Settings) -> list[Finding]:
    from mcore_proxy.diagnose.aliases import resolve
    from mcore_proxy.diagnose.compare import pair_signature

    signature, _ = pair_signature(baseline, run)
    signature = {
        m: sig
        for m, sig in signature.metrics.items()
        if sig.shifted
        and sig.onset is not None
        and (sig.effect is None or abs(sig.effect) >= s.effect)
        and _persists(run.metrics[resolve(m, run.metrics)], sig.onset, s.persist)
    }
    return [
        Finding(
            "diverge",
            m,
            sig.onset,
            sig.shift,
            f"{'above' if sig.direction > 0 else 'below'} the baseline by {sig.shift:+.3g}"
            f"{'' if sig.relative_shift is None else f' ({sig.relative_shift:+.0%})'} since step "
            f"{sig.onset} (p {sig.p_shift:.2g})",
        )
        for m, sig in signature.items()
    ]


def detect(
    run: RunLog, baseline: RunLog | None = None, settings: Settings = Settings(), enabled=DETECTORS
) -> list[Finding]:
    """Every finding of the enabled detectors on `run` (and against `baseline`)."""
    names = canonical_metrics(run.metrics)
    series = {m: run.metrics[raw] for m, raw in names.items()}
    found: list[Finding] = nonfinite_all(run, settings) if "nonfinite" in enabled else []
    if "plateau" in enabled and "reward" in series:
        found.append(plateau(series["reward"], settings))
    if "rising" in enabled:
        found += [rising(m, series[m], settings) for m in settings.rising_metrics if m in series]
    if "collapse" in enabled and "entropy" in series:
        found.append(collapse("entropy", series["entropy"], settings))
    if "spike" in enabled and "grad_norm" in series:
        found.append(spike("grad_norm", series["grad_norm"], settings))
    if "diverge" in enabled and baseline is not None:
        found += diverge(baseline, run, settings)
    return [f for f in found if f is not None]
