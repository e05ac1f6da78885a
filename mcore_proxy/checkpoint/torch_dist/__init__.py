"""Megatron's `torch_dist` (`--ckpt-format torch_dist`) checkpoints: PyTorch DCP files of
ShardedTensors, independent of the saving run's parallel layout (`files.py` describes them)."""

from __future__ import annotations

from mcore_proxy.checkpoint.interface import Format
from mcore_proxy.checkpoint.torch_dist.reader import TorchDistCheckpoint, is_torch_dist_checkpoint
from mcore_proxy.checkpoint.torch_dist.writer import DistWriter

FORMAT = Format(
    name="torch_dist",
    summary="Megatron --ckpt-format torch_dist: PyTorch DCP .metadata + *.distcp",
    detect=is_torch_dist_checkpoint,
    open=TorchDistCheckpoint,
    writer=DistWriter(),
)

__all__ = ["FORMAT", "TorchDistCheckpoint"]
