"""Host tensors: checkpoint bytes moved, sliced and re-joined without importing torch.

A legacy -> legacy conversion never computes on a weight: it reads byte runs, takes rows or
experts, splits and joins shards and writes the bytes again. torch's import costs 2.4-3 s on this
machine, most of the gap between `convert` and the I/O floor on small and medium checkpoints
(bench/RESULTS.md, issue 23). Inside `host_tensors()`, readers return `HostTensor`s: a numpy
array of the elements plus torch's name of their dtype. Dtypes numpy lacks (bfloat16, float8)
are held as integers of the same width, which is exact for every operation here, since
none of them does arithmetic. The operations are the subset of torch's that the convert path uses
(indexing, `narrow`, `view`/`reshape`, `t`, `cat`, `stack`, integer casts); anything else asks
for `torch()` and gets a zero-copy torch tensor. Outside the context nothing changes: readers
return torch tensors.

Why a process-wide switch rather than a parameter: the tensors are made at the bottom of a stack
of views (reader -> naming view -> pruned view -> writer) that all share the `ModelView.get`
signature; the switch is set by the convert pipeline around its opening and writing of the views
only, in every process that writes (main, `--workers`, torchrun ranks).
"""

from __future__ import annotations

import contextlib
import sys

from mcore_proxy.core.dtypes import Shape, TorchDtypeName, itemsize

# numpy's type of each torch dtype numpy has; the others are held as raw same-width integers
_NATIVE = {
    "float64": "<f8",
    "float32": "<f4",
    "float16": "<f2",
    "int64": "<i8",
    "int32": "<i4",
    "int16": "<i2",
    "int8": "i1",
    "uint8": "u1",
    "bool": "?",
    "complex64": "<c8",
    "complex128": "<c16",
}
_RAW = {1: "u1", 2: "<i2", 4: "<i4", 8: "<i8"}  # signed: torch < 2.3 has no uint16 from numpy
_INTEGER = frozenset({"int64", "int32", "int16", "int8", "uint8"})

_host = False


@contextlib.contextmanager
def host_tensors(enabled: bool = True):
    """Readers return HostTensors inside (if `enabled`); restores the previous mode on exit."""
    global _host
    before, _host = _host, enabled
    try:
        yield
    finally:
        _host = before


def host_mode() -> bool:
    return _host


def numpy_dtype(name: str):
    """The numpy dtype that holds elements of torch dtype `name` bit for bit."""
    import numpy as np

    return np.dtype(_NATIVE.get(name) or _RAW[itemsize(name)])


def _shape_args(shape) -> tuple:
    return tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else tuple(shape)


class HostTensor:
    """A CPU tensor as numpy elements + torch's dtype name. `array` may be a view of another."""

    __slots__ = ("array", "dtype_name")

    def __init__(self, array, dtype_name: str):
        self.array, self.dtype_name = array, dtype_name

    # -- what torch.Tensor answers without computing ---------------------------------------------
    @property
    def shape(self) -> Shape:
        return Shape(self.array.shape)

    @property
    def dtype(self) -> TorchDtypeName:
        return TorchDtypeName(self.dtype_name)

    def numel(self) -> int:
        return int(self.array.size)

    def is_contiguous(self) -> bool:
        return bool(self.array.flags.c_contiguous)

    def __repr__(self):
        return f"HostTensor({tuple(self.array.shape)}, {self.dtype_name})"

    # -- moving elements -------------------------------------------------------------------------
    def _new(self, array) -> HostTensor:
        return HostTensor(array, self.dtype_name)

    def detach(self) -> HostTensor:
        return self

    def cpu(self) -> HostTensor:
        return self

    def contiguous(self) -> HostTensor:
        import numpy as np

        return self if self.is_contiguous() else self._new(np.ascontiguousarray(self.array))

    def clone(self) -> HostTensor:
        return self._new(self.array.copy())

    def __getitem__(self, index) -> HostTensor:
        return self._new(self.array[index])

    def narrow(self, dim: int, start: int, length: int) -> HostTensor:
        index = [slice(None)] * self.array.ndim
        index[dim] = slice(start, start + length)
        return self._new(self.array[tuple(index)])

    def chunk(self, chunks: int, dim: int = 0) -> tuple[HostTensor, ...]:
        """torch's chunk: pieces of ceil(n / chunks) along `dim` (the last may be shorter)."""
        n = self.array.shape[dim]
        size = -(-n // chunks)
        return tuple(self.narrow(dim, s, min(size, n - s)) for s in range(0, n, size))

    def reshape(self, *shape) -> HostTensor:
        return self._new(self.array.reshape(_shape_args(shape)))

    def view(self, *shape) -> HostTensor:
        """A new shape over the same elements (torch's `view(*shape)`; not its dtype form)."""
        if not self.is_contiguous():
            raise ValueError("view of a non-contiguous HostTensor: use reshape")
        return self.reshape(*shape)

    def t(self) -> HostTensor:
        if self.array.ndim > 2:
            raise ValueError(f"t() of a {self.array.ndim}-D tensor")
        return self._new(self.array.T)

    def as_strided(self, shape, stride) -> HostTensor:
        """Elements at `stride` (in elements, as torch counts) over this 1-D tensor's memory."""
        from numpy.lib.stride_tricks import as_strided

        item = self.array.itemsize
        return self._new(as_strided(self.array, tuple(shape), tuple(s * item for s in stride), writeable=False))

    def to(self, dtype) -> HostTensor:
        """An integer -> integer cast on the host, which numpy wraps as torch does (the int64 ->
        int32 hash table of a DeepSeek-V4 conversion); any other cast goes through torch."""
        from mcore_proxy.core.dtypes import dtype_name, torch_dtype

        name = dtype_name(dtype)
        if name == self.dtype_name:
            return self
        if name in _INTEGER and self.dtype_name in _INTEGER:
            return HostTensor(self.array.astype(numpy_dtype(name)), name)
        return self.torch().to(torch_dtype(name))

    def torch(self):
        """The same memory as a torch tensor (imports torch)."""
        import torch

        from mcore_proxy.core.dtypes import torch_dtype

        array = self.contiguous().array
        if self.dtype_name in _NATIVE:
            return torch.from_numpy(array)
        return torch.from_numpy(array).view(torch_dtype(self.dtype_name))  # the raw integers' bits

    def data_ptr(self) -> int:
        return self.array.ctypes.data


def empty(shape, dtype_name: str, host: bool | None = None):
    """An uninitialized tensor: a HostTensor in host mode (or if `host`), a torch tensor otherwise."""
    if host_mode() if host is None else host:
        import numpy as np

        return HostTensor(np.empty(tuple(shape), numpy_dtype(dtype_name)), dtype_name)
    import torch

    from mcore_proxy.core.dtypes import torch_dtype

    return torch.empty(tuple(shape), dtype=torch_dtype(dtype_name))


def cast(tensor, dtype_name: str):
    """`tensor` in the dtype named `dtype_name` (a HostTensor stays one where numpy casts exactly)."""
    if isinstance(tensor, HostTensor):
        return tensor.to(dtype_name)
    from mcore_proxy.core.dtypes import torch_dtype

    return tensor.to(torch_dtype(dtype_name))


def is_tensor(value) -> bool:
    """A HostTensor or a torch tensor (asked without importing torch)."""
    if isinstance(value, HostTensor):
        return True
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _as_torch(tensors: list) -> list:
    return [t.torch() if isinstance(t, HostTensor) else t for t in tensors]


def cat(tensors: list, dim: int = 0):
    """torch.cat of HostTensors (numpy) or of torch tensors; a mix goes through torch."""
    if all(isinstance(t, HostTensor) for t in tensors):
        import numpy as np

        return tensors[0]._new(np.concatenate([t.array for t in tensors], axis=dim))
    import torch

    return torch.cat(_as_torch(tensors), dim=dim)


def stack(tensors: list, dim: int = 0):
    """torch.stack of HostTensors (numpy) or of torch tensors; a mix goes through torch."""
    if all(isinstance(t, HostTensor) for t in tensors):
        import numpy as np

        return tensors[0]._new(np.stack([t.array for t in tensors], axis=dim))
    import torch

    return torch.stack(_as_torch(tensors), dim=dim)
