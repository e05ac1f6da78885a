"""The Hugging Face format: sharded safetensors + config.json, for Qwen3-MoE, DeepSeek-V3 and
DeepSeek-V3.2 (transformers 5 model classes, no remote code).

- `reader.HFCheckpoint`: the folder as a lazy canonical ModelView (DESIGN.md 4.3);
- `writer.HFWriter`: any canonical ModelView as an HF folder (check, units, write_unit, finish);
- `mapping`: the row types and pure transforms; `qwen3_moe`, `deepseek`: one table per family
  and the config.json <-> Megatron args translations; `checks`: config.json against the tensors;
  `fp8`: DeepSeek's block scales; `launch`: Megatron launch flags from the args.
"""
from __future__ import annotations

from mcore_proxy.checkpoint.hf.reader import HFCheckpoint, is_hf_checkpoint
from mcore_proxy.errors import ProxyError


def dequantized(view):
    """`view` read with its FP8 weights dequantised to bf16 (`--dequantize-fp8`)."""
    if not isinstance(view, HFCheckpoint) or view.hf.fp8_block is None:
        raise ProxyError(f"--dequantize-fp8: {getattr(view, 'path', 'the checkpoint')} holds no FP8 weights with "
                         "block scales; leave the option out")
    return view.with_dequantized_fp8()


__all__ = ["HFCheckpoint", "is_hf_checkpoint", "dequantized"]
