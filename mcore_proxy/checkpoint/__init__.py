"""Checkpoint readers and writers around the canonical ModelView (DESIGN.md 4.3).

`open_checkpoint(path)` detects the format of a folder and returns its ModelView. Adding a
format means adding one module with `is_<format>_checkpoint(path)` and a ModelView class, and
one row in `_FORMATS`.
"""
from __future__ import annotations

import importlib
from pathlib import Path

from mcore_proxy.checkpoint.view import DictModelView, ModelView, router_fingerprint
from mcore_proxy.errors import CheckpointError

# (format name, module, detector, ModelView class): tried in order.
_FORMATS = (
    ("torch_dist", "mcore_proxy.checkpoint.torch_dist", "is_torch_dist_checkpoint", "TorchDistCheckpoint"),
    ("legacy", "mcore_proxy.checkpoint.legacy", "is_legacy_checkpoint", "LegacyCheckpoint"),
    ("hf", "mcore_proxy.checkpoint.hf", "is_hf_checkpoint", "HFCheckpoint"),
)


def _load(module: str, attr: str):
    return getattr(importlib.import_module(module), attr)


def detect_format(path: str | Path) -> str:
    """The format name of a checkpoint folder; CheckpointError with the fix if none fits."""
    from mcore_proxy.checkpoint.output import refuse_staging

    path = Path(path)
    refuse_staging(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint folder; check the path")
    if not path.is_dir():
        raise CheckpointError(f"{path}: is a file; pass the checkpoint folder Megatron saved")
    if not any(path.iterdir()):
        raise CheckpointError(f"{path}: folder is empty; pass the folder Megatron saved with --save")
    for name, module, detector, _ in _FORMATS:
        if _load(module, detector)(path):
            return name
    raise CheckpointError(f"{path}: not a checkpoint (no latest_checkpointed_iteration.txt, iter_*, mp_rank_* or "
                          "torch_dist metadata of Megatron, no config.json with safetensors of Hugging Face); pass "
                          "the folder Megatron or save_pretrained wrote")


def open_checkpoint(path: str | Path) -> ModelView:
    """Open a checkpoint folder of any supported format as a lazy canonical ModelView."""
    fmt = detect_format(path)
    for name, module, _, cls in _FORMATS:
        if name == fmt:
            return _load(module, cls)(path)
    raise AssertionError(fmt)


__all__ = ["ModelView", "DictModelView", "router_fingerprint", "open_checkpoint", "detect_format"]
