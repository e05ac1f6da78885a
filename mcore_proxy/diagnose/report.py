"""The comparison as text (a table and the verdict), as JSON, and as a folder with PNG curves.

`write_report(out, comparison)` writes, staged and renamed at the end like every output here:
`report.json` (signatures, matches, verdict, what was left out), `report.md` (the table, the
verdict, the pictures) and one `{metric}.png` per metric: the original's baseline and faulted
curves, the proxy's, side by side, and both normalised shift curves overlaid with their onsets.
matplotlib is imported inside.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from mcore_proxy.diagnose.compare import ROLES, Comparison, role_name
from mcore_proxy.core.optional import require


def _fmt(value, spec=".3g") -> str:
    return "-" if value is None else format(value, spec)


def _sig(sig) -> str:
    return f"{sig.direction:+d} {_fmt(sig.shift)} / {sig.trend:+d} / {'-' if sig.onset is None else sig.onset}"


def nonfinite_counts(match) -> dict[str, int]:
    """role -> NaN/inf values it logged in the compared steps of one metric (roles as the CLI names them)."""
    return {
        "orig-base": match.orig.nonfinite_base,
        "orig-fault": match.orig.nonfinite_fault,
        "proxy-base": match.proxy.nonfinite_base,
        "proxy-fault": match.proxy.nonfinite_fault,
    }


def _nonfinite_line(metric: str, match) -> str | None:
    """'non-finite: logprob_diff: orig-fault 20 from step 2, proxy-fault 20 from step 2' (None without any)."""
    counts = {r: n for r, n in nonfinite_counts(match).items() if n}
    if not counts:
        return None
    onsets = {"orig-fault": match.orig.nonfinite_onset, "proxy-fault": match.proxy.nonfinite_onset}
    parts = [f"{r} {n}" + (f" from step {onsets[r]}" if r in onsets else "") for r, n in counts.items()]
    return f"non-finite: {metric}: NaN/inf in {', '.join(parts)}"


def summary_table(comparison: Comparison) -> str:
    """One line per metric: original and proxy (direction shift / trend / onset), agreement; then a
    line per metric with NaN/inf values in any run, what was left out, and the verdict."""
    head = f"{'metric':<16} {'original: dir shift / trend / onset':<36} {'proxy':<30} {'r':>6}  match"
    lines = [head]
    for metric, m in comparison.matches.items():
        r = _fmt(m.correlation, ".2f") if m.correlation_required else "n/a"
        verdict = "yes" if m.match else "NO: " + ", ".join(m.reasons())
        lines.append(f"{metric:<16} {_sig(m.orig):<36} {_sig(m.proxy):<30} {r:>6}  {verdict}")
    lines += [line for metric, m in comparison.matches.items() if (line := _nonfinite_line(metric, m))]
    lines += [f"left out: {note}" for note in comparison.left_out]
    lines.append(comparison.verdict())
    return "\n".join(lines)


def as_dict(comparison: Comparison) -> dict:
    orig, proxy = comparison.signatures()
    return {
        "format": "mcore-proxy-compare/1",
        "runs": {role_name(r): comparison.sources[r] for r in ROLES},
        "consistent": comparison.consistent,
        "verdict": comparison.verdict(),
        "left_out": comparison.left_out,
        "metrics": {
            m: {
                "match": x.match,
                "direction": x.direction,
                "trend": x.trend,
                "onset": x.onset,
                "onset_window": x.onset_window,
                "correlation": x.correlation,
                "correlation_required": x.correlation_required,
                "score": x.score,
                "nonfinite": x.nonfinite,
                "nonfinite_counts": nonfinite_counts(x),
                "raw_names": {role_name(r): n for r, n in comparison.raw_names[m].items()},
            }
            for m, x in comparison.matches.items()
        },
        "signatures": {"original": orig.to_dict(), "proxy": proxy.to_dict()},
    }


def safe_name(metric: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", metric)


def metric_figure(comparison: Comparison, metric: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    match, series = comparison.matches[metric], comparison.series[metric]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, model in zip(axes[:2], ("orig", "proxy")):
        for role, style in (
            (f"{model}_base", dict(color="tab:blue", label="baseline")),
            (f"{model}_fault", dict(color="tab:red", label="fault")),
        ):
            s = series[role]
            ax.plot(s.steps, s.values, lw=1.2, **style)
            if s.nonfinite:  # NaN/inf have no height: ticks along the top, in the run's colour
                ax.plot(
                    s.nonfinite_steps,
                    [0.97] * s.nonfinite,
                    "|",
                    color=style["color"],
                    transform=ax.get_xaxis_transform(),
                    label=f"{style['label']}: NaN/inf",
                )
        sig = match.orig if model == "orig" else match.proxy
        if sig.onset is not None:
            ax.axvline(sig.onset, color="gray", ls="--", lw=1, label=f"onset {sig.onset}")
        ax.set_title(f"{'original' if model == 'orig' else 'proxy'}: {metric}")
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
    ax = axes[2]
    for sig, color, label in ((match.orig, "black", "original"), (match.proxy, "tab:green", "proxy")):
        ax.plot(
            sig.curve_steps,
            sig.curve,
            color=color,
            lw=1.5,
            label=f"{label}: dir {sig.direction:+d}, trend {sig.trend:+d}",
        )
    ax.axhline(0, color="gray", lw=0.5)
    r = "n/a" if match.correlation is None else f"{match.correlation:.2f}"
    ax.set_title(f"normalised shift (fault - baseline), r = {r}: {'match' if match.match else 'MISMATCH'}")
    ax.set_xlabel("step")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def write_report(out, comparison: Comparison, *, inputs: tuple = (), replace: bool = False) -> Path:
    """The report folder `out`; it may neither lie in nor hold one of the `inputs` (the logs), and an
    existing report is replaced only with `replace` (`--force`)."""
    matplotlib = require("matplotlib", why="compare -o (the report's figures)", extra="diagnose")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mcore_proxy.core.output import staged_output

    out = Path(out)
    with staged_output(out, inputs, replace=replace) as tmp:
        (tmp / "report.json").write_text(json.dumps(as_dict(comparison), indent=1))
        lines = ["# mcore-proxy compare", "", comparison.verdict(), "", "```", summary_table(comparison), "```", ""]
        for metric in comparison.matches:
            fig = metric_figure(comparison, metric)
            name = f"{safe_name(metric)}.png"
            fig.savefig(tmp / name, dpi=90)
            plt.close(fig)
            lines.append(f"![{metric}]({name})")
        (tmp / "report.md").write_text("\n".join(lines) + "\n")
    return out


def library_figure(library):
    """A signature library at a glance: entries x metrics, coloured by the shift's sign and size in
    baseline noise units (|effect| >= 5 saturates; a shift against a noiseless baseline is drawn
    saturated), with the onset step written in each shifted cell; grey: no significant shift."""
    matplotlib = require("matplotlib", why="the signature library's figure", extra="diagnose")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    metrics = list(dict.fromkeys(m for e in library.entries for m in e.signature.metrics))
    grid = np.full((len(library.entries), len(metrics)), np.nan)
    fig, ax = plt.subplots(figsize=(1.1 * len(metrics) + 3, 0.45 * len(library.entries) + 1.8))
    for i, entry in enumerate(library.entries):
        for j, metric in enumerate(metrics):
            sig = entry.signature.metrics.get(metric)
            if sig is None or not sig.shifted:
                continue
            size = 1.0 if sig.effect is None else min(abs(sig.effect) / 5, 1.0)
            grid[i, j] = sig.direction * max(size, 0.15)
            ax.text(
                j,
                i,
                str(sig.onset),
                ha="center",
                va="center",
                fontsize=8,
                color="white" if abs(grid[i, j]) > 0.6 else "black",
            )
    ax.set_facecolor("#e8e8e8")
    image = ax.imshow(np.ma.masked_invalid(grid), cmap="RdBu_r", vmin=-1, vmax=1, aspect="auto")
    ax.set_xticks(range(len(metrics)), metrics, rotation=35, ha="right")
    ax.set_yticks(range(len(library.entries)), [f"{e.name}" for e in library.entries])
    ax.set_title(
        f"signature library against {library.baseline_name}: shift per metric (number: onset step)", fontsize=10
    )
    fig.colorbar(image, ax=ax, label="direction x min(|effect| / 5, 1)", shrink=0.8)
    fig.tight_layout()
    return fig
