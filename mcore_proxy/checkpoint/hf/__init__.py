"""The Hugging Face format: sharded safetensors + config.json of the Mixture-of-Experts families
transformers 5 builds (no remote code).

- `folder`: the index and the shards' headers (no tensor data);
- `descriptor`, `families`: one declaration per family (router, routed experts, config keys);
- `native.HFNativeView`: a folder as its family sees it (what `open_checkpoint` returns), and
  `native_writer`: writing it back, pruned, in the source's spelling: the HF -> HF path;
- `reader.HFCheckpoint`: the folder under megatron-core names, for families with a Megatron
  mapping (`qwen3_moe`, `deepseek`, `mixtral`, `qwen2_moe`, `glm4_moe`, `deepseek_v4` (Megatron-LM dev's names): one
  table per family and
  the config.json <-> Megatron args translations, `gqa`: what the GQA ones share; `mapping`: the row types and pure
  transforms; `checks`: config.json against the
  tensors; `fp8`: DeepSeek's block scales);
- `writer.HFWriter`: either kind of view as an HF folder (the format interface's Writer).
"""

from __future__ import annotations

from mcore_proxy.checkpoint.hf.folder import is_hf_checkpoint
from mcore_proxy.checkpoint.hf.native import open_hf
from mcore_proxy.checkpoint.hf.reader import HFCheckpoint
from mcore_proxy.checkpoint.hf.writer import HFWriter
from mcore_proxy.checkpoint.interface import Format

FORMAT = Format(
    name="hf",
    summary="Hugging Face: config.json + sharded safetensors (save_pretrained)",
    detect=is_hf_checkpoint,
    open=open_hf,
    writer=HFWriter(),
    framework="transformers",
)

__all__ = ["FORMAT", "HFCheckpoint", "is_hf_checkpoint"]
