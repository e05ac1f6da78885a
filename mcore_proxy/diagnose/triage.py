"""Triage: which fault of a signature library looks most like a new run's departure from its baseline.

The new run's signature against its baseline (`compare.pair_signature`) is matched with every
informative library entry (a run that departed from the campaign's baseline in some metric), metric
by metric with `compare.match_signatures`, the one rule of agreement. A metric's score, in [0, 1],
is the mean of four agreements (direction, trend, onset within `onset_window` steps, shift-curve
correlation when either has a trend, clipped at 0) times a size gate: 1 when both shifts are equal,
falling linearly with their ratio in decades to 0 at `SIZE_DECADES` (1000x) apart. Strengths in a
library differ, so the gate is wide; but two faults that move the same metric the same way often
differ by orders of magnitude in how far (the rollout KL of a bf16 rollout against router noise:
3000x), and as one vote of five that difference was outvoted by four agreements of direction.
Only metrics where the entry or the run shifted count: agreeing that nothing happened in a metric
tells faults apart no better than chance. An entry's score is the mean over those metrics
(0 when none is shared); a fault's score is its best entry's. Faults are ranked by score, ties by
the number of matching metrics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from mcore_proxy.diagnose.compare import MetricMatch, match_signatures
from mcore_proxy.diagnose.library import Library, LibraryEntry
from mcore_proxy.diagnose.signature import FaultSignature, MetricSignature


SIZE_DECADES = 3.0


def size_agreement(a: MetricSignature, b: MetricSignature) -> float:
    """1 for equal |shift|, 0 for shifts SIZE_DECADES or more decades apart (or one of them 0)."""
    big, small = sorted((abs(a.shift), abs(b.shift)), reverse=True)
    if big == 0:
        return 1.0
    if small == 0:
        return 0.0
    return max(0.0, 1.0 - math.log10(big / small) / SIZE_DECADES)


@dataclass(frozen=True)
class MetricEvidence:
    match: MetricMatch
    size: float

    @property
    def score(self) -> float:
        return self.match.score * self.size

    def describe(self) -> str:
        lib, run = self.match.orig, self.match.proxy
        r = self.match.correlation
        return (
            f"{self.match.metric}: library {lib.direction:+d} {lib.shift:+.3g} onset {lib.onset}, "
            f"run {run.direction:+d} {run.shift:+.3g} onset {run.onset}, "
            f"trend {lib.trend:+d}/{run.trend:+d}, r {'-' if r is None else format(r, '.2f')}, "
            f"size {self.size:.2f} -> {self.score:.2f}"
        )


@dataclass(frozen=True)
class EntryScore:
    entry: LibraryEntry
    evidence: dict = field(default_factory=dict)  # metric -> MetricEvidence (shifted in either)

    @property
    def score(self) -> float:
        return sum(e.score for e in self.evidence.values()) / len(self.evidence) if self.evidence else 0.0

    @property
    def matching(self) -> int:
        return sum(e.match.match for e in self.evidence.values())


@dataclass(frozen=True)
class FaultRank:
    fault: str
    best: EntryScore
    entries: tuple = ()  # every EntryScore of this fault, best first

    @property
    def score(self) -> float:
        return self.best.score


def score_entry(entry: LibraryEntry, run: FaultSignature, onset_window: int) -> EntryScore:
    evidence = {}
    for metric, mine in run.metrics.items():
        theirs = entry.signature.metrics.get(metric)
        if theirs is None or not (theirs.shifted or mine.shifted):
            continue
        evidence[metric] = MetricEvidence(match_signatures(theirs, mine, onset_window), size_agreement(theirs, mine))
    return EntryScore(entry, evidence)


def default_window(run: FaultSignature) -> int:
    """10 % of the run's compared steps, at least 3 (as `compare_runs`)."""
    spans = [m.last_step - m.first_step for m in run.metrics.values() if m.first_step is not None]
    return max(3, int(round(0.1 * max(spans, default=0))))


def rank_faults(run: FaultSignature, library: Library, onset_window: int | None = None) -> list[FaultRank]:
    """Library faults, best match first (see the module docstring)."""
    window = default_window(run) if onset_window is None else onset_window
    by_fault: dict[str, list[EntryScore]] = {}
    for entry in library.entries:
        if entry.informative:
            by_fault.setdefault(entry.fault, []).append(score_entry(entry, run, window))
    ranks = []
    for fault, scores in by_fault.items():
        scores.sort(key=lambda s: (s.score, s.matching), reverse=True)
        ranks.append(FaultRank(fault, scores[0], tuple(scores)))
    ranks.sort(key=lambda r: (r.score, r.best.matching), reverse=True)
    return ranks


def triage_table(run: FaultSignature, ranks: list[FaultRank], library: Library) -> str:
    shifted = [m for m, s in run.metrics.items() if s.shifted]
    lines = [
        f"run {run.fault} against baseline {run.baseline}: shifted in "
        f"{', '.join(shifted) if shifted else 'no metric (nothing to triage)'}",
        "",
        f"{'rank':>4}  {'fault':<16} {'score':>5}  {'best entry':<22} {'matching':>8}  evidence",
    ]
    for i, r in enumerate(ranks, 1):
        ev = list(r.best.evidence.values())
        first = ev[0].describe() if ev else "no metric shifted in either"
        lines.append(
            f"{i:>4}  {r.fault:<16} {r.score:>5.2f}  {r.best.entry.name:<22} {r.best.matching:>4}/{len(ev):<3}  {first}"
        )
        lines += [f"{'':>62}{e.describe()}" for e in ev[1:]]
    skipped = [e.name for e in library.entries if not e.informative]
    if skipped:
        lines.append(f"not ranked (no departure from the campaign's baseline): {', '.join(skipped)}")
    return "\n".join(lines)


def triage_dict(run: FaultSignature, ranks: list[FaultRank]) -> dict:
    """The `compare --json` document of a triage (the CLI adds `"format": "mcore-proxy-compare/1"`)."""
    return {
        "mode": "triage",
        "run": run.fault,
        "baseline": run.baseline,
        "shifted": [m for m, s in run.metrics.items() if s.shifted],
        "ranking": [
            {
                "fault": r.fault,
                "score": r.score,
                "best_entry": r.best.entry.name,
                "entries": {s.entry.name: s.score for s in r.entries},
                "evidence": {
                    m: {
                        "score": e.score,
                        "direction": e.match.direction,
                        "trend": e.match.trend,
                        "onset": e.match.onset,
                        "correlation": e.match.correlation,
                        "size": e.size,
                        "library": {
                            "direction": e.match.orig.direction,
                            "shift": e.match.orig.shift,
                            "onset": e.match.orig.onset,
                        },
                        "run": {
                            "direction": e.match.proxy.direction,
                            "shift": e.match.proxy.shift,
                            "onset": e.match.proxy.onset,
                        },
                    }
                    for m, e in r.best.evidence.items()
                },
            }
            for r in ranks
        ],
    }
