"""Megatron `torch_dist` checkpoints: the files of one iteration folder, and how keys name tensors.

One iteration folder (megatron-core 0.16.1, checked by saving real models on CPU):
  metadata.json   `{"sharded_backend": "torch_dist", ...}`, written last: without it the save
                  did not finish
  common.pt       torch.save of everything not sharded: `args`, `iteration`,
                  `checkpoint_version`, `content_metadata` (flags of `sharded_state_dict`)
  .metadata       pickled PyTorch DCP `Metadata`: per key the global shape, dtype and chunk
                  boxes; `storage_data` maps each chunk to (file, byte offset, byte length)
  __R_N.distcp    data files; every chunk is a standalone torch.save blob at its offset

Keys are ShardedTensor keys, not module names:
  - a homogeneous decoder stacks its layers on a prepended axis (`decoder.layers.mlp.router.weight`
    [L, E, H]); with `moe_layer_freq` a list or an int > 1, keys are per layer
    (`decoder.layers.{L}.mlp.router.weight` [E, H]); MTP layers are always per layer;
  - routed experts add an expert axis: `...mlp.experts.experts.linear_fc1.weight` [L, E, 2F, H]
    (fc1 = all gate rows, then all up rows); SequentialMLP, GroupedMLP and TEGroupedMLP save the
    same keys, so the files do not depend on the expert module nor on TP/PP/EP;
  - the local (non-TE, non-MLA) layer spec saves `input_layernorm.*` / `pre_mlp_layernorm.*` under
    the keys of TE's fused norms (`self_attention.linear_qkv.layer_norm_*`,
    `mlp.linear_fc1.layer_norm_*`), so both specs share one layout;
  - `_extra_state` of linears are ShardedObjects `KEY/shard_{offsets}_{shape}` over the prepended
    axes (`shard_0_1` when there are none), each a torch.save of `[value]` (`[None]` for local
    linears).

The key mapping lives in the name registry (`checkpoint/names.py`: `KeyStyle`, `parse_dist_key`).
"""

from __future__ import annotations

CONFIG_FILE = "metadata.json"
DCP_METADATA = ".metadata"
COMMON_FILE = "common.pt"
BACKEND = "torch_dist"
CONFIG = {
    "sharded_backend": BACKEND,
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}
# The `sharded_state_dict` flags Megatron reads back from common.pt before loading; False is the
# layout described above (True splits experts and GLU halves into separate keys).
CONTENT_METADATA = {"singleton_local_shards": False}
