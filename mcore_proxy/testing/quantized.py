"""Quantized copies of tiny Hugging Face checkpoints, in the three layouts releases use, for tests
and the fuzz campaign. The library never quantizes (it copies quantized rows as they are, and
dequantizes on request); the quantizers here are the reference scheme each release documents:

- `fp8_copy`: DeepSeek-V3's FP8 release: float8_e4m3fn linears with fp32 `*_scale_inv` blocks;
- `mxfp4_copy`: gpt-oss's Hub layout: fused experts as `*_blocks` (FP4 e2m1 pairs) and
  `*_scales` (E8M0, one per 32 inputs), transposed to [E, out, in/32, ..];
- `v4_release_copy`: DeepSeek-V4's release: keys without `model.`, routed experts in FP4 packed
  two per int8 with one E8M0 `.scale` per row and 32 columns, other linears FP8 with E8M0 block
  `.scale`s (`quantization_config.scale_fmt = ue8m0`, `expert_dtype = fp4`).

Small blocks (8 x 8) so that the tiny tensors hold several, some partial.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Callable

import torch

from mcore_proxy.checkpoint.hf.quant import FP4_VALUES, FP8_MAX

INDEX = "model.safetensors.index.json"
# the linear layers DeepSeek's FP8 release quantises (not the router, eh_proj, embeddings, head)
FP8_LINEAR = re.compile(
    r"^model\.layers\.\d+\.(self_attn|mlp)\.(.+\.)?(q_a_proj|q_b_proj|q_proj|kv_a_proj_with_mqa|"
    r"kv_b_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$"
)
# DeepSeek-V4's release: routed experts FP4, these linears FP8 (attention, compressor, indexer, shared)
V4_EXPERT = re.compile(r"^(layers\.\d+|mtp\.\d+)\.ffn\.experts\.\d+\.w[123]\.weight$")
V4_FP8 = re.compile(
    r"^(layers\.\d+|mtp\.\d+)\.(attn\.(.+\.)?(wq_a|wq_b|wkv|wo_b|wgate)|ffn\.shared_experts\.w[123])"
    r"\.weight$"
)
V4_RELEASE_NAMES = (
    ("model.embed_tokens.", "embed."),
    ("lm_head.", "head."),
    ("model.hc_head.hc_", "hc_head_"),
    ("model.", ""),
)
BLOCK = (8, 8)


def _grid(rows: int, cols: int, block: tuple[int, int]) -> tuple[int, int]:
    return -(-rows // block[0]), -(-cols // block[1])


def _expand(scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    return scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]


def fp8_blocks(weight: torch.Tensor, block=BLOCK, ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, C] -> (float8_e4m3fn [R, C], scale [R/b0, C/b1]): each block scaled so its largest
    magnitude fits FP8_MAX; fp32 scales (DeepSeek-V3), or powers of two as E8M0 (DeepSeek-V4)."""
    rows, cols = weight.shape
    w = weight.to(torch.float32)
    gr, gc = _grid(rows, cols, block)
    padded = torch.zeros(gr * block[0], gc * block[1])
    padded[:rows, :cols] = w.abs()
    scale = padded.reshape(gr, block[0], gc, block[1]).amax((1, 3)).clamp(min=1e-12) / FP8_MAX
    if ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (w / _expand(scale, rows, cols, block)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, (scale.to(torch.float8_e8m0fnu) if ue8m0 else scale)


def _fp4_codes(values: torch.Tensor) -> torch.Tensor:
    """float32 already scaled into [-6, 6] -> the nearest FP4 e2m1 code (sign in bit 3), uint8."""
    lut = torch.tensor(FP4_VALUES[:8])
    idx = (values.abs().unsqueeze(-1) - lut).abs().argmin(-1)
    return (idx + 8 * (values < 0)).to(torch.uint8)


def _fp4_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[.., C] -> (packed uint8 [.., C/2] with the even element in the low nibble, E8M0 exponent
    bytes [.., C/32]): groups of 32 along the last axis, each scaled by a power of two so its
    largest magnitude fits 6.0."""
    g = weight.to(torch.float32).reshape(*weight.shape[:-1], -1, 32)
    exp = torch.ceil(torch.log2(g.abs().amax(-1).clamp(min=2.0**-120) / 6.0)).clamp(-127, 127)
    codes = _fp4_codes(g / torch.exp2(exp).unsqueeze(-1)).reshape(*weight.shape)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exp + 127).to(torch.uint8)


def fp4_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4's FP4 experts: [R, C] -> (int8 [R, C/2], float8_e8m0fnu [R, C/32])."""
    packed, scale = _fp4_groups(weight)
    return packed.view(torch.int8), scale.view(torch.float8_e8m0fnu)


def mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's MXFP4: a transformers weight [.., in, out] -> (blocks uint8 [.., out, in/32, 16],
    scales uint8 [.., out, in/32])."""
    packed, scale = _fp4_groups(weight.transpose(-1, -2))
    return packed.reshape(*packed.shape[:-1], -1, 16), scale


def quantized_copy(
    src: Path,
    dst: Path,
    quantize: Callable[[str, torch.Tensor], dict[str, torch.Tensor]],
    quantization_config: dict,
    rename: Callable[[str], str] = lambda k: k,
    **config,
) -> Path:
    """Copy HF checkpoint `src` to `dst`, each tensor replaced by what `quantize(key, tensor)` makes
    of it (under the key `rename` gives), config.json with `quantization_config` and `config`."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True)
    index = json.loads((src / INDEX).read_text())
    weight_map = {}
    for file in sorted(set(index["weight_map"].values())):
        out = {}
        for key, value in load_file(str(src / file)).items():
            out.update(quantize(rename(key), value))
        save_file(out, str(dst / file), metadata={"format": "pt"})
        weight_map.update({k: file for k in out})
    index["weight_map"] = weight_map
    (dst / INDEX).write_text(json.dumps(index, indent=2))
    data = json.loads((src / "config.json").read_text())
    data.update(config, quantization_config=quantization_config)
    (dst / "config.json").write_text(json.dumps(data, indent=2))
    for extra in src.iterdir():
        if extra.is_file() and not (dst / extra.name).exists():
            shutil.copy2(extra, dst / extra.name)
    return dst


def fp8_copy(src: Path, dst: Path, block: tuple[int, int] = BLOCK) -> Path:
    """DeepSeek-V3's FP8 release of `src`: every decoder/MTP linear in FP8 with fp32 block scales."""

    def quantize(key, value):
        if FP8_LINEAR.search(key) and value.dim() == 2:
            q, scale = fp8_blocks(value, block)
            return {key: q, key + "_scale_inv": scale}
        return {key: value}

    return quantized_copy(
        src,
        dst,
        quantize,
        {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)},
    )


def mxfp4_copy(src: Path, dst: Path) -> Path:
    """gpt-oss's Hub layout of `src`: fused expert weights (not their biases) as MXFP4 blocks and
    scales; attention, router, embeddings and head as they are (gpt-oss's modules_to_not_convert)."""

    def quantize(key, value):
        if key.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            blocks, scales = mxfp4(value)
            return {key + "_blocks": blocks, key + "_scales": scales}
        return {key: value}

    return quantized_copy(
        src,
        dst,
        quantize,
        {
            "quant_method": "mxfp4",
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
        },
    )


def v4_release_copy(src: Path, dst: Path, block: tuple[int, int] = BLOCK) -> Path:
    """DeepSeek-V4's release layout of a `save_pretrained` folder `src`: the release's key names,
    FP4 routed experts and FP8 linears, both with E8M0 `.scale` tensors."""

    def rename(key):
        for old, new in V4_RELEASE_NAMES:
            if key.startswith(old):
                return new + key[len(old) :]
        return key

    def quantize(key, value):
        if V4_EXPERT.match(key):
            q, scale = fp4_rows(value)
        elif V4_FP8.match(key):
            q, scale = fp8_blocks(value, block, ue8m0=True)
        else:
            return {key: value}
        return {key: q, key[: -len("weight")] + "scale": scale}

    return quantized_copy(
        src,
        dst,
        quantize,
        {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "scale_fmt": "ue8m0",
            "weight_block_size": list(block),
        },
        rename=rename,
        expert_dtype="fp4",
    )
