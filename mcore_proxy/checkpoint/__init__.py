"""Checkpoint readers and writers around the canonical ModelView (DESIGN.md 4.3).

`open_checkpoint(path)` detects the format of a folder and returns its ModelView;
`write_checkpoint(view, out, target, fmt)` writes any ModelView in a format. The formats are
one table (`formats.FORMATS`); the interface a format implements is `interface.py`'s.

The names below are resolved on first use (PEP 562): importing a subpackage's command-line module
must not import every reader and torch (`mcore-proxy --help`, `watch`).
"""

from __future__ import annotations

import importlib

_HOME = {
    "detect_format": "formats",
    "open_checkpoint": "formats",
    "write_checkpoint": "formats",
    "ModelView": "view",
    "DictModelView": "view",
    "ViewInfo": "view",
    "router_fingerprint": "view",
}
__all__ = list(_HOME)


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
