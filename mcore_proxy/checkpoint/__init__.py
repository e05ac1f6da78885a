"""Checkpoint readers and writers around the canonical ModelView (DESIGN.md 4.3).

`open_checkpoint(path)` detects the format of a folder and returns its ModelView;
`write_checkpoint(view, out, target, fmt)` writes any ModelView in a format. The formats are
one table (`formats.FORMATS`); the interface a format implements is `interface.py`'s.
"""
from __future__ import annotations

from mcore_proxy.checkpoint.formats import detect_format, open_checkpoint, write_checkpoint
from mcore_proxy.checkpoint.view import DictModelView, ModelView, ViewInfo, router_fingerprint

__all__ = ["ModelView", "DictModelView", "ViewInfo", "router_fingerprint", "open_checkpoint", "detect_format",
           "write_checkpoint"]
