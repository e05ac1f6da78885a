"""Metric logs of training runs, anomaly signatures, and the original-vs-proxy comparison.

    read_log(path) -> RunLog                       (readers: TensorBoard, JSONL, CSV, consoles of
                                                    Megatron/MindSpeed-RL/verl/TRL, TRL trainer state,
                                                    MLflow, W&B and SwanLab offline runs; docs/logs.md)
    metric_signature(name, base, fault)            (signature: shift, trend, onset)
    compare_runs({role: RunLog}) -> Comparison     (compare: per-metric match, verdict)
    write_report(out, comparison)                  (report: JSON, Markdown, PNG)

Importing this package imports nothing heavy (numpy on use; scipy, ruptures, tensorboard and
matplotlib inside the functions that need them; a missing one is `optional.MissingDependency`, exit 2).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "read_log": "mcore_proxy.diagnose.readers",
    "Series": "mcore_proxy.diagnose.series",
    "RunLog": "mcore_proxy.diagnose.series",
    "ALIASES": "mcore_proxy.diagnose.aliases",
    "canonical_metrics": "mcore_proxy.diagnose.aliases",
    "metric_signature": "mcore_proxy.diagnose.signature",
    "MetricSignature": "mcore_proxy.diagnose.signature",
    "FaultSignature": "mcore_proxy.diagnose.signature",
    "compare_runs": "mcore_proxy.diagnose.compare",
    "match_signatures": "mcore_proxy.diagnose.compare",
    "Comparison": "mcore_proxy.diagnose.compare",
    "write_report": "mcore_proxy.diagnose.report",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'mcore_proxy.diagnose' has no attribute {name!r}")
