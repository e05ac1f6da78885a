"""Transformer Engine `_extra_state` of grouped expert linears: reset to "no FP8 state", never sliced.

What TE stores (TransformerEngine `transformer_engine/pytorch/module/base.py`,
`TransformerEngineBaseModule.get_extra_state` / `set_extra_state`, TE >= 2.0): a uint8 tensor that
is empty when the module has no FP8 state, otherwise `pickle.dumps(state)` of a dict holding the
FP8 `recipe` (a TE class instance), `scale_fwd` / `amax_history_fwd` / `scale_bwd` /
`amax_history_bwd` (delayed scaling) and `extra_fp8_variables` (with `num_gemms`). TE < 2.0 stored
an `io.BytesIO` of `torch.save(state)`. On load, `set_extra_state` returns without touching the
module for None or an empty tensor: the module keeps its fresh FP8 meta (scale 1, zero amax
history), which delayed scaling refills within `amax_history_len` steps.

A `TEGroupedLinear` (TEGroupedMLP's `linear_fc1` / `linear_fc2`) keeps ONE such state for all of
a rank's local experts (num_gemms = local experts): its scales and amax histories hold one column
per GEMM (megatron-core 0.16.1 `extensions/transformer_engine.py`, `_split_extra_state`:
`scale_fwd.view(3, -1)[:, gemm]`, `amax_history_fwd.view(len, 3, -1)[:, :, gemm]`, ...). Keeping K
of E experts, or moving experts to another EP rank, changes which columns a rank needs.

The choice: RESET, not slice. Slicing would mean unpickling the state, and it holds a TE recipe
object, i.e. a global that runs code when constructed; mcore-proxy never unpickles bytes read from
a checkpoint (`safe_globals.py`), so the state stays opaque and slicing cannot be done, let alone
proven correct. So:
  - legacy rank file -> view: a grouped linear's state becomes, for each of its local experts,
    `...mlp.experts.{e}.linear_fc{1,2}._extra_state` = an empty uint8 tensor (exactly what
    megatron-core's `_split_extra_state` gives each expert when there is no FP8 state; with FP8
    state it is the reset, counted in the log);
  - view -> legacy TEGroupedMLP file: one empty tensor per grouped linear (per-expert states, e.g.
    read from torch_dist, are not merged: that too would need unpickling);
  - torch_dist keeps one `_extra_state` object per expert (megatron-core splits the grouped state
    on save and merges the kept experts' on load), so torch_dist -> torch_dist carries each kept
    expert's bytes unchanged under its renumbered expert id.
Non-expert TE linears (`linear_qkv`, `linear_proj`, dense `linear_fc1`/`linear_fc2`) are not
affected by dropping experts: their states are copied byte for byte.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from mcore_proxy.core.tensors import empty

if TYPE_CHECKING:
    import torch


def empty_extra_state() -> torch.Tensor:
    """TE's encoding of "no FP8 state": an empty uint8 tensor (a fresh one each call; a
    HostTensor in `core.tensors.host_tensors` mode)."""
    return empty((0,), "uint8")


def holds_state(value) -> bool:
    """Whether a stored extra state carries bytes (FP8 metadata), judged from its shape only:
    nothing is read or unpickled. None and empty tensors carry none; anything else (a byte tensor
    with elements, an inert `io.BytesIO` of older TE) does."""
    if value is None:
        return False
    shape = getattr(value, "shape", None)
    return shape is None or math.prod(shape) > 0
