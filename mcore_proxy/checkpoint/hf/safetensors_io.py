"""safetensors files: what a shard holds (via safetensors' own `safe_open`), and a streaming writer.

Reading uses `safe_open`, which maps the file and validates its header; `get_slice` reads only the
bytes of the rows asked for. Each read opens and closes the file, so no mapping outlives it and
the resident memory is the tensors held, not the shards touched.

Writing streams: the header (every tensor's dtype, shape and byte range) is known from shapes
alone, so it is written first and the tensors follow one at a time; a shard never sits in memory
whole (safetensors' `save_file` needs the whole dict). The layout is the safetensors format:
8-byte little-endian header length, the JSON header padded with spaces to a multiple of 8, the
data in header order.
"""

from __future__ import annotations

import functools
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mcore_proxy.checkpoint.zipwrite import HashingSink
from mcore_proxy.core.errors import CheckpointError

if TYPE_CHECKING:
    import torch

# safetensors' dtype codes -> torch's dtype names
_DTYPE_NAMES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "I32": "int32",
    "I64": "int64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "U16": "uint16",
    "U32": "uint32",
    # DeepSeek-V4's FP4 expert scales (torch >= 2.7 names the dtype)
    "F8_E8M0": "float8_e8m0fnu",
}


@functools.lru_cache(maxsize=None)
def dtypes() -> dict:
    """safetensors dtype code -> torch dtype, for the dtypes this torch has."""
    import torch

    found = {code: getattr(torch, name, None) for code, name in _DTYPE_NAMES.items()}
    return {code: dtype for code, dtype in found.items() if dtype is not None}


def dtype_code(dtype) -> str:
    """torch dtype -> safetensors dtype code."""
    return {v: k for k, v in dtypes().items()}[dtype]


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Key -> shape and dtype of every tensor in one shard; CheckpointError naming the file when
    it is not a complete safetensors file."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            out = {}
            for key in f.keys():
                piece = f.get_slice(key)
                dtype = dtypes().get(piece.get_dtype())
                if dtype is None:
                    raise CheckpointError(
                        f"{path}: tensor {key} has dtype {piece.get_dtype()}, which mcore-proxy "
                        f"does not handle (supported: {', '.join(dtypes())})"
                    )
                out[key] = TensorInfo(tuple(piece.get_shape()), dtype)
            return out
    except (SafetensorError, OSError) as err:
        raise CheckpointError(
            f"{path}: not a complete safetensors file ({' '.join(str(err).split())[:120]}); it "
            "may be truncated, copy it again from the model's source"
        ) from None


def read_tensor(path: Path, key: str, index: int | None = None) -> torch.Tensor:
    """One tensor, or row `index` of its first dimension (only those bytes are read)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return f.get_tensor(key) if index is None else f.get_slice(key)[index]
    except (SafetensorError, OSError) as err:
        raise CheckpointError(
            f"{path}: reading {key} failed ({' '.join(str(err).split())[:120]}); the shard "
            "may be damaged, copy it again from the model's source"
        ) from None


def header_bytes(tensors: list[tuple[str, tuple[int, ...], torch.dtype]], metadata: dict | None = None) -> bytes:
    """The 8-byte length and the padded JSON header for `tensors` laid out in order."""
    import torch

    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for key, shape, dtype in tensors:
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[key] = {"dtype": dtype_code(dtype), "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


class StreamingWriter:
    """Write one safetensors file: `StreamingWriter(path, layout)`, then `write(key, tensor)` for
    every tensor of `layout` in its order, then `close()` -> (size, sha256 hex), hashed while
    written (`zipwrite.HashingSink`) and synced. A tensor of another shape, dtype or order than
    declared is an error, never a silently corrupt file."""

    def __init__(self, path: Path, layout: list[tuple[str, tuple[int, ...], torch.dtype]]):
        self.path, self._layout, self._next = Path(path), list(layout), 0
        if self.path.exists():
            raise FileExistsError(17, "File exists", str(self.path))
        self._sink = HashingSink(self.path)
        self._sink.write(header_bytes(self._layout))

    def write(self, key: str, tensor: torch.Tensor) -> None:
        want_key, shape, dtype = self._layout[self._next]
        if key != want_key or tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
            raise RuntimeError(
                f"{self.path}: tensor {key} {tuple(tensor.shape)} {tensor.dtype} written where the "
                f"header declares {want_key} {tuple(shape)} {dtype}"
            )
        if tensor.numel():
            self._sink.write(tensor.detach().cpu().contiguous())
        self._next += 1

    def write_rows(self, key: str, rows: list[torch.Tensor]) -> None:
        """One tensor given as its rows along axis 0 (`torch.stack(rows)`), written row after row:
        the same bytes as the stacked tensor, without making it."""
        want_key, shape, dtype = self._layout[self._next]
        got = (len(rows), *rows[0].shape) if rows else (0,)
        if (
            key != want_key
            or tuple(got) != tuple(shape)
            or any(r.dtype != dtype or r.shape != rows[0].shape for r in rows)
        ):
            raise RuntimeError(
                f"{self.path}: rows of {key} {tuple(got)} written where the header declares "
                f"{want_key} {tuple(shape)} {dtype}"
            )
        for row in rows:
            if row.numel():
                self._sink.write(row.detach().cpu().contiguous())
        self._next += 1

    def close(self) -> tuple[int, str]:
        if self._next != len(self._layout):
            self._sink.abort()
            raise RuntimeError(f"{self.path}: {len(self._layout) - self._next} declared tensors were not written")
        return self._sink.close()

    def abort(self) -> None:
        self._sink.abort()
