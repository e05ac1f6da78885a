"""Checkpoint readers and writers around the canonical ModelView (DESIGN.md 4.3)."""
from mcore_proxy.checkpoint.view import DictModelView, ModelView, router_fingerprint

__all__ = ["ModelView", "DictModelView", "router_fingerprint"]
