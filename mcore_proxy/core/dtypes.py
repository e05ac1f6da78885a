"""Tensor dtypes by name, without importing torch.

Readers index a checkpoint by shape and dtype name, and `inspect` sizes it, without torch (whose
import costs more than indexing 256 rank files from a cold disk: bench/RESULTS.md, issue 23).
torch is imported where bytes become tensors: `torch_dtype`.
"""

from __future__ import annotations

import math

# bytes per element of every dtype a checkpoint stores, by torch's name for it
ITEMSIZE = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "complex64": 8,
    "complex128": 16,
}

# torch's storage classes (`torch.BFloat16Storage`, as pickles name them) -> dtype names
STORAGE_DTYPES = {
    "FloatStorage": "float32",
    "DoubleStorage": "float64",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
    "UntypedStorage": "uint8",
}

FLOAT8 = frozenset(n for n in ITEMSIZE if n.startswith("float8_"))


class TorchDtypeName(str):
    """A torch dtype global in a file (`args.params_dtype = torch.bfloat16`), read without
    importing torch: its name, 'bfloat16'. Writers emit the global back (torchfile's pickler);
    `torch_dtype` gives the dtype itself."""

    __slots__ = ()


class Shape(tuple):
    """A tensor shape as `torch.Size` answers it (a tuple with `numel()`), made without torch."""

    __slots__ = ()

    def numel(self) -> int:
        return math.prod(self)


def dtype_name(dtype) -> str:
    """torch's name of a dtype given as a torch dtype or a name: torch.bfloat16 -> 'bfloat16'."""
    return str(dtype).removeprefix("torch.")


def itemsize(name: str) -> int:
    """Bytes per element of the dtype `name` (a torch dtype name); torch answers for names
    outside the table."""
    if name in ITEMSIZE:
        return ITEMSIZE[name]
    import torch

    return torch.empty((), dtype=torch_dtype(name)).element_size()


def nbytes(shape, name: str) -> int:
    """Bytes of a dense tensor of `shape` and dtype `name`."""
    return math.prod(shape) * itemsize(name)


def torch_dtype(name: str):
    """The torch dtype of a name ('bfloat16' -> torch.bfloat16): the first use imports torch."""
    import torch

    dtype = getattr(torch, dtype_name(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype
