"""The Hugging Face format: sharded safetensors + config.json, for Qwen3-MoE, DeepSeek-V3 and
DeepSeek-V3.2 (transformers 5 model classes, no remote code).

- `reader.HFCheckpoint`: the folder as a lazy canonical ModelView (DESIGN.md 4.3);
- `writer.HFWriter`: any canonical ModelView as an HF folder (the format interface's Writer);
- `mapping`: the row types and pure transforms; `qwen3_moe`, `deepseek`: one table per family
  and the config.json <-> Megatron args translations; `checks`: config.json against the tensors;
  `fp8`: DeepSeek's block scales.
"""
from __future__ import annotations

from mcore_proxy.checkpoint.hf.reader import HFCheckpoint, is_hf_checkpoint
from mcore_proxy.checkpoint.hf.writer import HFWriter
from mcore_proxy.checkpoint.interface import Format

FORMAT = Format(name="hf", summary="Hugging Face: config.json + sharded safetensors (save_pretrained)",
                detect=is_hf_checkpoint, open=HFCheckpoint, writer=HFWriter(), framework="transformers")

__all__ = ["FORMAT", "HFCheckpoint", "is_hf_checkpoint"]
