"""Megatron's legacy (`--ckpt-format torch`) checkpoints: one rank file per (TP, PP, EP) rank."""

from __future__ import annotations

from mcore_proxy.checkpoint.interface import Format
from mcore_proxy.checkpoint.legacy.reader import LegacyCheckpoint, is_legacy_checkpoint, load_rank
from mcore_proxy.checkpoint.legacy.writer import LegacyWriter

FORMAT = Format(
    name="legacy",
    summary="Megatron --ckpt-format torch: iter_*/mp_rank_*/model_optim_rng.pt",
    detect=is_legacy_checkpoint,
    open=LegacyCheckpoint,
    writer=LegacyWriter(),
    load_rank=load_rank,
)

__all__ = ["FORMAT", "LegacyCheckpoint"]
