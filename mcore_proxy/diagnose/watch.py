"""Following a run's metric log as it grows: the early-warning detectors re-run on every check,
one JSON line per new alert, and a one-screen view of the run.

`Watcher.check()` re-reads the log and the baseline's (the readers hold no state, so a re-read is the update; a
TensorBoard folder, JSONL or console log that is still being written is read up to its last
complete record), runs `detect.detect`, and returns the alerts not reported before. An alert is
reported once per (detector, metric): its onset is the step where the trouble began, `step` the
last step the log had when it was noticed (so `step - onset` is how long it took to notice). A NaN
or infinite value is the `nonfinite` detector's alert (`value`: how many), with the step of the
first; a log whose record is wrong for good (`readers.common.BadRecord`: a step out of range, a line
nested too deep) stops the watch with that sentence instead of being waited for.

Alert line (`mcore-proxy-alert/1`):
    {"format": "mcore-proxy-alert/1", "time": "2026-12-01T12:00:00Z", "log": LOG,
     "detector": "rising", "metric": "logprob_diff", "raw_name": "training/rollout_logprob_diff_mean",
     "onset": 15, "step": 19, "value": 0.0013, "message": "..."}
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from mcore_proxy.diagnose.aliases import canonical_metrics
from mcore_proxy.diagnose.detect import DETECTORS, Finding, Settings, detect
from mcore_proxy.diagnose.readers import read_log
from mcore_proxy.diagnose.readers.common import BadRecord
from mcore_proxy.diagnose.series import RunLog
from mcore_proxy.core.errors import LogError

FORMAT = "mcore-proxy-alert/1"
SPARK = "▁▂▃▄▅▆▇█"


@dataclass(frozen=True)
class Alert:
    finding: Finding
    log: str
    raw_name: str
    step: int  # last step of the log when noticed
    time: float  # seconds since the epoch

    def to_dict(self) -> dict:
        f = self.finding
        return {
            "format": FORMAT,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.time)),
            "log": self.log,
            "detector": f.detector,
            "metric": f.metric,
            "raw_name": self.raw_name,
            "onset": f.onset,
            "step": self.step,
            "value": f.value,
            "message": f.message,
        }


@dataclass
class Watcher:
    """The state of one watch: what was read last and which alerts were reported."""

    log: Path
    baseline: Path | None = None
    settings: Settings = field(default_factory=Settings)
    enabled: tuple = DETECTORS
    run: RunLog | None = None
    base: RunLog | None = None
    alerts: list = field(default_factory=list)
    last_step: int | None = None
    last_growth: float = field(default_factory=time.time)
    waiting: str = ""  # why nothing could be read yet

    def _read(self) -> bool:
        try:
            run = read_log(self.log)
        except BadRecord:  # a complete record is wrong: no later read will mend it
            raise
        except LogError as err:  # not there yet, or nothing complete in it yet
            self.waiting = str(err)
            return False
        self.waiting = ""
        step = run.last_step
        if step != self.last_step:
            self.last_step, self.last_growth = step, time.time()
        self.run = run
        return True

    def check(self) -> list[Alert]:
        """Re-read the log(s), run the detectors, return the alerts that are new."""
        if self.baseline is not None:  # re-read too: the baseline may still be running
            self.base = read_log(self.baseline)
        if not self._read():
            return []
        seen = {(a.finding.detector, a.finding.metric) for a in self.alerts}
        names = canonical_metrics(self.run.metrics)
        new = [
            Alert(f, str(self.log), names.get(f.metric, f.metric), self.last_step, time.time())
            for f in detect(self.run, self.base, self.settings, self.enabled)
            if (f.detector, f.metric) not in seen
        ]
        self.alerts += new
        return new


def sparkline(values, width: int = 40) -> str:
    import numpy as np

    # halved: the span of two finite values near +-1.8e308 would overflow, their half-span cannot
    v = np.asarray(values[-width:], dtype=float) / 2
    if not len(v):
        return ""
    lo, hi = float(v.min()), float(v.max())
    if hi == lo:
        return SPARK[0] * len(v)
    return "".join(SPARK[int((x - lo) / (hi - lo) * (len(SPARK) - 1))] for x in v)


def view(w: Watcher, every: float) -> str:
    """One screen: the run, each known metric (last, min, max, sparkline, status), the alerts."""
    head = f"mcore-proxy watch {w.log}" + (f"  (baseline {w.baseline})" if w.baseline else "")
    if w.run is None:
        return f"{head}\nwaiting for the log: {w.waiting}\n"
    when = time.strftime("%H:%M:%S")
    lines = [
        head,
        f"{w.run.format}, last step {w.last_step}, checked {when}, every {every:g} s; "
        f"{len(w.alerts)} alert(s) (JSON lines on stdout)",
        "",
        f"{'metric':<16} {'last':>10} {'min':>10} {'max':>10}  {'last 40 steps':<40}  status",
    ]
    by_metric: dict = {}
    for a in w.alerts:
        by_metric.setdefault(a.finding.metric, []).append(a)
    for metric, raw in canonical_metrics(w.run.metrics).items():
        status = (
            "; ".join(f"ALERT {a.finding.detector} since {a.finding.onset}" for a in by_metric.get(metric, [])) or "ok"
        )
        lines.append(f"{metric:<16} {_figures(w.run.metrics[raw])}  {status}")
    if w.alerts:
        lines += ["", "alerts:"] + [
            f"  step {a.step}: {a.finding.detector} {a.finding.metric}: {a.finding.message}" for a in w.alerts[-8:]
        ]
    return "\n".join(lines) + "\n"


def _figures(s) -> str:
    """The last logged value (NaN or inf too), min and max and the sparkline of the curve; a series
    of NaN/inf only says so."""
    if not len(s):
        return f"{'-':>10} {'-':>10} {'-':>10}  {f'only NaN/inf ({s.nonfinite} values)':<40}"
    last = s.nonfinite_values[-1] if s.nonfinite and s.nonfinite_steps[-1] > s.steps[-1] else s.values[-1]
    return f"{last:>10.4g} {s.values.min():>10.4g} {s.values.max():>10.4g}  {sparkline(s.values):<40}"


def alert_line(alert: Alert) -> str:
    return json.dumps(alert.to_dict())
