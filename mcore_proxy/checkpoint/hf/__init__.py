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
- `writer.HFWriter`: either kind of view as an HF folder (the format interface's Writer);
- `structure`: a config.json as the ModelSpec fields `estimate` counts (`spec_fields_from_config`).

What callers outside this package use is imported from here (the names in `__all__`), never from
the modules above (`tests/test_package_imports.py`): the FORMAT record, the family registry
(`declared`, `discovered`) that finds routers in transformers models, the
names of the quantization schemes `ModelView.quantized_schemes` reports, and what the twin proof
(`convert/twin.py`) reads and writes an in-memory twin with.
"""

from __future__ import annotations

from mcore_proxy.checkpoint.hf.config import HFConfig
from mcore_proxy.checkpoint.hf.discovery import FULL_LIST, Discovery, build_twin, discovered
from mcore_proxy.checkpoint.hf.families import declared
from mcore_proxy.checkpoint.hf.folder import is_hf_checkpoint
from mcore_proxy.checkpoint.hf.native import StateDictView, open_hf
from mcore_proxy.checkpoint.hf.native_writer import native_outputs, proxy_config
from mcore_proxy.checkpoint.hf.quant import INT4_PACKED, MXFP4
from mcore_proxy.checkpoint.hf.reader import HFCheckpoint
from mcore_proxy.checkpoint.hf.structure import read_config_json, spec_fields_from_config
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

__all__ = [
    "FORMAT",
    "FULL_LIST",
    "Discovery",
    "HFCheckpoint",
    "HFConfig",
    "INT4_PACKED",
    "MXFP4",
    "StateDictView",
    "build_twin",
    "declared",
    "discovered",
    "is_hf_checkpoint",
    "native_outputs",
    "proxy_config",
    "read_config_json",
    "spec_fields_from_config",
]
