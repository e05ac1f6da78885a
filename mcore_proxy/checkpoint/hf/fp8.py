"""FP8 block quantisation as DeepSeek publishes it: `X` float8_e4m3fn [R, C] with `X_scale_inv`
fp32 [ceil(R/b0), ceil(C/b1)], one scale per b0 x b1 block (`quantization_config.weight_block_size`,
[128, 128] for DeepSeek-V3); the real weight is `X * scale_inv` blockwise (the last blocks of a
dimension may be partial).

Pruning never needs these: kept tensors and their scales are copied bit for bit. They serve
`--dequantize` (bf16 output) and the tests, which quantise a tiny model the same way.
"""
from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0          # largest finite float8_e4m3fn
DEFAULT_BLOCK = (128, 128)


def _expand(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    return scale.repeat_interleave(block[0], 0)[:shape[0]].repeat_interleave(block[1], 1)[:, :shape[1]]


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block=DEFAULT_BLOCK,
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """fp8 [R, C] x fp32 block scales -> `dtype` [R, C]."""
    rows, cols = weight.shape
    want = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"block scales of shape {tuple(scale_inv.shape)} do not fit a {rows}x{cols} weight in "
                         f"{block[0]}x{block[1]} blocks (expected {want})")
    return (weight.to(torch.float32) * _expand(scale_inv.to(torch.float32), (rows, cols), block)).to(dtype)


def quantize(weight: torch.Tensor, block=DEFAULT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, C] -> (fp8 [R, C], fp32 scale_inv per block): each block scaled so its largest
    magnitude is FP8_MAX, as DeepSeek's released weights are."""
    rows, cols = weight.shape
    w = weight.to(torch.float32)
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    scale = torch.empty(grid, dtype=torch.float32)
    for i in range(grid[0]):
        for j in range(grid[1]):
            part = w[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
            scale[i, j] = part.abs().max().clamp(min=1e-12) / FP8_MAX
    q = (w / _expand(scale, (rows, cols), block)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale
