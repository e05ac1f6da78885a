"""compare over seeds: one comparison per seed (the i-th log of each of the four roles), and the
share of seeds on which the proxy reproduces the original's fault.

On small models a fault's signature can come and go with the seed (another draw of prompts, of
samples, of noise), so one seed's verdict is not evidence. The verdict over seeds is *consistent*
when at least `min_share` of the seeds' comparisons are consistent (default 0.8: 4 of 5), each by
`compare.Comparison`'s rule. Per metric it counts the seeds on which the original's faulted run
departed, on which the proxy matched, and on which both held (reproduced), with the directions
seed by seed, so a reader sees which metric carries the verdict.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mcore_proxy.diagnose.compare import Comparison

DEFAULT_MIN_SHARE = 0.8


@dataclass(frozen=True)
class SeedsComparison:
    comparisons: tuple[Comparison, ...]  # seed i: the comparison of the i-th log of each role
    min_share: float = DEFAULT_MIN_SHARE

    @property
    def seeds(self) -> int:
        return len(self.comparisons)

    @property
    def needed(self) -> int:
        """Consistent seeds the verdict needs: ceil(min_share x seeds)."""
        return max(1, math.ceil(self.min_share * self.seeds - 1e-9))

    @property
    def agreeing(self) -> int:
        return sum(c.consistent for c in self.comparisons)

    @property
    def consistent(self) -> bool:
        return self.agreeing >= self.needed

    def metrics(self) -> dict[str, dict]:
        """metric -> counts over the seeds that compared it, and the directions seed by seed."""
        out: dict[str, dict] = {}
        for seed, comparison in enumerate(self.comparisons):
            for metric, m in comparison.matches.items():
                row = out.setdefault(
                    metric,
                    {
                        "seeds": 0,
                        "departed": 0,
                        "matched": 0,
                        "reproduced": 0,
                        "orig_direction": {},
                        "proxy_direction": {},
                    },
                )
                departed = m.orig.departed
                row["seeds"] += 1
                row["departed"] += departed
                row["matched"] += m.match
                row["reproduced"] += departed and m.match
                row["orig_direction"][seed] = m.orig.direction
                row["proxy_direction"][seed] = m.proxy.direction
        return out

    def verdict(self) -> str:
        word = "CONSISTENT" if self.consistent else "NOT CONSISTENT"
        return (
            f"{word} over seeds: the proxy reproduces the original's fault signature in {self.agreeing} of "
            f"{self.seeds} seeds (a verdict needs {self.needed}, min share {self.min_share:g})"
        )


def _directions(values: dict) -> str:
    return " ".join(f"{v:+d}" for _, v in sorted(values.items()))


def seeds_table(result: SeedsComparison) -> str:
    """Per metric: the original's departures, the proxy's matches and both, over the seeds, with the
    directions seed by seed; then each seed's verdict and the verdict over seeds."""
    lines = [f"{'metric':<28} {'orig departs':>12} {'proxy matches':>13} {'reproduced':>10}  directions orig | proxy"]
    for metric, row in result.metrics().items():
        lines.append(
            f"{metric:<28} {row['departed']:>9}/{row['seeds']:<2} {row['matched']:>10}/{row['seeds']:<2} "
            f"{row['reproduced']:>7}/{row['seeds']:<2}  {_directions(row['orig_direction'])} | "
            f"{_directions(row['proxy_direction'])}"
        )
    for seed, comparison in enumerate(result.comparisons):
        lines.append(f"seed {seed}: {comparison.verdict()}")
    lines.append(result.verdict())
    return "\n".join(lines)


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
        "metrics": result.metrics(),
        "per_seed": [as_dict(c) for c in result.comparisons],
    }


def seeds_figure(result: SeedsComparison, metric: str):
    """The normalised shift curves (fault - baseline) of every seed, original beside proxy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
    colors = plt.get_cmap("tab10")
    for seed, comparison in enumerate(result.comparisons):
        match = comparison.matches.get(metric)
        if match is None:
            continue
        for ax, sig in zip(axes, (match.orig, match.proxy)):
            style = "-" if match.match else ":"
            ax.plot(sig.curve_steps, sig.curve, style, color=colors(seed % 10), lw=1.3, label=f"seed {seed}")
    for ax, title in zip(axes, ("original", "proxy")):
        ax.axhline(0, color="gray", lw=0.5)
        ax.set_title(f"{title}: {metric}, normalised shift (dotted: seed not matched)")
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
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
        for metric in result.metrics():
            fig = seeds_figure(result, metric)
            fig.savefig(tmp / f"{safe_name(metric)}.png", dpi=90)
            plt.close(fig)
            lines.append(f"![{metric}]({safe_name(metric)}.png)")
        (tmp / "report.md").write_text("\n".join(lines) + "\n")
    return out
