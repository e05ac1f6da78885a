"""Quantized tensors of Hugging Face checkpoints: how to recognise each scheme by its companion
tensor, and how to dequantize it (`--dequantize`). Pruning never needs these: a routed expert's
weight and its scales are rows of the same expert and are copied bit for bit together.

Schemes (the weight `X`, its companion, what the real weight is):
- FP8 with block scales (DeepSeek-V3, GLM, Qwen3, MiniMax FP8 releases): `X` float8_e4m3fn
  [R, C], `X_scale_inv` fp32 [ceil(R/b0), ceil(C/b1)]: X * scale, blockwise;
- DeepSeek-V4's release: `X.weight` with `X.scale` (E8M0: 2^(byte - 127)): float8_e4m3fn weights in
  blocks as above, or routed experts in FP4 e2m1 packed two per int8 [R, C/2] (low nibble: the
  even column) with one scale per row and 32 columns [R, C/32];
- MXFP4 as gpt-oss stores its experts: `X_blocks` uint8 [.., out, in/32, 16] (FP4 e2m1, low
  nibble first, 32 per block) and `X_scales` uint8 [.., out, in/32] (E8M0); the weight is
  [.., in, out] (gpt-oss's transposed layout);
- compressed-tensors int4 (`X_packed`, `X_scale`, `X_shape`, Kimi-K2.x): pruned, not dequantized.

Block sizes come from config.json's `quantization_config.weight_block_size` when it has one,
else from the scale grid (`rows // scale_rows`), as transformers derives them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from mcore_proxy.core.errors import CheckpointError

if TYPE_CHECKING:
    import torch

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FP8 = "float8_e4m3fn"  # dtype name (core.dtypes)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
DEFAULT_BLOCK = (128, 128)  # DeepSeek's weight_block_size
FP8_BLOCK, V4_SCALE, MXFP4, INT4_PACKED = "fp8-block", "e8m0-scale", "mxfp4", "int4-packed"


@dataclass(frozen=True)
class Quantized:
    """One quantized tensor of a view: `weight` and `scale` (view names), the dequantized tensor's
    name `name`, and its scheme."""

    name: str
    weight: str
    scale: str
    scheme: str


def find_quantized(names: list[str]) -> list[Quantized]:
    """Every quantized weight among `names` (view names: HF keys and canonical expert names), by
    its companion tensor."""
    present = set(names)
    found = []
    for n in names:
        if n + "_scale_inv" in present:
            found.append(Quantized(n, n, n + "_scale_inv", FP8_BLOCK))
        elif n.endswith(".weight") and n[: -len("weight")] + "scale" in present:
            found.append(Quantized(n, n, n[: -len("weight")] + "scale", V4_SCALE))
        elif n.endswith("_blocks") and n[: -len("_blocks")] + "_scales" in present:
            found.append(Quantized(n[: -len("_blocks")], n, n[: -len("_blocks")] + "_scales", MXFP4))
        elif n.endswith("weight_packed") and n[: -len("_packed")] + "_scale" in present:  # else a KeyError
            found.append(Quantized(n[: -len("_packed")], n, n[: -len("_packed")] + "_scale", INT4_PACKED))
    return found


def e8m0(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 exponents (uint8 bytes or float8_e8m0fnu) -> float32 2^(byte - 127)."""
    import torch

    raw = scale.view(torch.uint8) if scale.dtype != torch.uint8 else scale
    return torch.ldexp(torch.ones(raw.shape), raw.to(torch.int32) - 127)


def fp4_unpack(packed: torch.Tensor) -> torch.Tensor:
    """[.., C/2] bytes of FP4 e2m1 pairs (low nibble: the even element) -> float32 [.., C]."""
    import torch

    u8 = packed.contiguous().view(torch.uint8)
    lut = torch.tensor(FP4_VALUES)
    return torch.stack([lut[(u8 & 0xF).long()], lut[(u8 >> 4).long()]], dim=-1).reshape(*u8.shape[:-1], -1)


def _expand(scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    return scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]


def block_of(weight_shape, scale_shape, block: tuple[int, int] | None, where: str) -> tuple[int, int]:
    """The block size of FP8 block scales: config.json's, else derived from the grid."""
    if len(weight_shape) != 2 or len(scale_shape) != 2 or 0 in (*weight_shape, *scale_shape):  # else exit 3
        raise CheckpointError(
            f"{where}: block scales of shape {list(scale_shape)} for a weight of shape "
            f"{list(weight_shape)}; expected both 2-D and not empty, the checkpoint is inconsistent"
        )
    rows, cols = weight_shape
    if block is None:
        block = (-(-rows // scale_shape[0]), -(-cols // scale_shape[1]))
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_shape) != grid:
        raise CheckpointError(
            f"{where}: block scales of shape {list(scale_shape)} do not fit a {rows}x{cols} weight in "
            f"{block[0]}x{block[1]} blocks (expected {list(grid)}); the checkpoint is inconsistent"
        )
    return block


def check_pair(
    q: Quantized, weight_shape, weight_dtype, scale_shape, scale_dtype, block: tuple[int, int] | None
) -> None:
    """CheckpointError unless the shapes and dtypes of `q`'s weight and scale (from the shard
    headers) are ones its scheme dequantizes: checked before anything is read or written."""
    import torch

    w, s = tuple(weight_shape), tuple(scale_shape)
    if q.scheme in (MXFP4, V4_SCALE) and scale_dtype.itemsize != 1:  # E8M0 exponents are bytes
        raise CheckpointError(
            f"{q.scale}: E8M0 scales of dtype {scale_dtype}; expected one byte each (uint8 or "
            "float8_e8m0fnu), the checkpoint is inconsistent"
        )
    if q.scheme in (FP8_BLOCK, V4_SCALE) and weight_dtype != torch.int8:
        block_of(w, s, block, q.weight)
        return
    if q.scheme == MXFP4:
        one_byte = weight_dtype in (torch.uint8, torch.int8)  # FP4 pairs: another dtype would unpack to more
        want = w[:-1] if len(w) >= 3 and w[-1] == 16 and 0 not in w and one_byte else None
        what = "MXFP4 blocks [.., out, in/32, 16] of bytes with scales [.., out, in/32]"
    elif q.scheme == V4_SCALE:
        want = (w[0], -(-2 * w[1] // 32)) if len(w) == 2 and 0 not in w else None
        what = "FP4 pairs [R, C/2] with one scale per row and 32 columns [R, C/32]"
    else:
        return
    if s != want:
        raise CheckpointError(
            f"{q.weight}: {weight_dtype} {list(w)} with {q.scale} of shape {list(s)}; expected "
            f"{what}, the checkpoint is inconsistent"
        )


def dequantize_blocks(
    weight: torch.Tensor,
    factors: torch.Tensor,
    block: tuple[int, int] | None,
    where: str,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """FP8 [R, C] x float32 factors [ceil(R/b0), ceil(C/b1)], one per block (the last blocks of a
    dimension may be partial) -> `dtype` [R, C] (bfloat16 by default)."""
    import torch

    dtype = torch.bfloat16 if dtype is None else dtype
    if weight.dim() != 2:
        raise CheckpointError(f"{where}: a block-scaled weight of shape {list(weight.shape)}; expected 2 dimensions")
    block = block_of(tuple(weight.shape), tuple(factors.shape), block, where)
    return (weight.to(torch.float32) * _expand(factors.to(torch.float32), *weight.shape, block)).to(dtype)


def dequantize(
    q: Quantized,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] | None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The real weight of one quantized tensor, in `dtype` (what transformers loads it as: the
    checkpoint's own dtype; bfloat16 by default)."""
    import torch

    dtype = torch.bfloat16 if dtype is None else dtype
    if q.scheme == INT4_PACKED:
        raise CheckpointError(
            f"{q.weight}: compressed-tensors int4 weights are pruned as they are but not "
            "dequantized by mcore-proxy; leave out --dequantize"
        )
    if q.scheme == MXFP4:
        values = fp4_unpack(weight).reshape(*weight.shape[:-2], -1, 32)  # [.., out, in/32, 32]
        real = (values * e8m0(scale).unsqueeze(-1)).reshape(*weight.shape[:-2], -1)  # [.., out, in]
        return real.transpose(-1, -2).contiguous().to(dtype)
    if q.scheme == V4_SCALE and weight.dtype == torch.int8:  # FP4 experts: one scale per row and 32 columns
        values = fp4_unpack(weight)
        return (values * e8m0(scale).repeat_interleave(32, dim=-1)[..., : values.shape[-1]]).to(dtype)
    return dequantize_blocks(weight, e8m0(scale) if q.scheme == V4_SCALE else scale, block, q.weight, dtype)


def config_dtype(config: dict) -> torch.dtype:
    """The dtype config.json declares (`dtype`, older `torch_dtype`, or its text model's), which
    transformers dequantizes into; bfloat16 when it declares none."""
    import torch

    for where in (config, config.get("text_config") or {}):
        name = where.get("dtype") or where.get("torch_dtype") if isinstance(where, dict) else None
        if name in ("bfloat16", "float16", "float32"):
            return getattr(torch, name)
    return torch.bfloat16
