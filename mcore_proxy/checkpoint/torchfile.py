"""Read and write `torch.save` zip files without torch.load and without an unrestricted unpickler.

Reading parses only `data.pkl` with a whitelisting unpickler: tensors become `LazyTensor`
handles that read their bytes from the zip member on demand (a dropped expert is never read),
and globals outside the whitelist (megatron enums in `args`, numpy RNG state, optimizer
classes) become inert `Unresolved` objects: no foreign code runs. Unresolved objects pickle
back under their original class path, so `args` written here load in Megatron unchanged.

Writing streams: `TorchFileWriter` writes each tensor's bytes as soon as it is added and the
pickled structure last, so a rank file never has to exist in memory as a whole.
"""
from __future__ import annotations

import collections
import collections.abc
import io
import os
import pickle
import struct
import sys
import types
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from mcore_proxy.checkpoint.safe_globals import READ_GLOBALS, is_emittable
from mcore_proxy.errors import CheckpointError

# -- reading -------------------------------------------------------------------------------

_STORAGE_DTYPES = {
    "FloatStorage": torch.float32, "DoubleStorage": torch.float64, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool, "UntypedStorage": torch.uint8,
}
_DTYPE_STORAGE = {v: k for k, v in _STORAGE_DTYPES.items() if k != "UntypedStorage"}

class Unresolved:
    """An object of a class this process does not (or may not) import, kept as data.

    It remembers the constructor arguments and pickled state, and pickles back to the same
    class path, so e.g. `args.attention_backend` (a megatron enum) survives a round trip.
    Fields of a pickled dict state (dataclasses, plain objects) read as attributes.
    """

    _module = "?"
    _name = "?"

    def __new__(cls, *args, **kwargs):
        obj = object.__new__(cls)
        obj._args, obj._state = args, None
        return obj

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        self._state = state

    def __getattr__(self, attr):
        state = self.__dict__.get("_state")
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
            state = {**(state[0] or {}), **state[1]}  # (dict, slots) state
        if isinstance(state, dict) and attr in state:
            return state[attr]
        raise AttributeError(f"{self._module}.{self._name} has no field {attr!r}")

    def __reduce__(self):
        return (type(self), self._args, self._state) if self._state is not None else (type(self), self._args)

    def __eq__(self, other):
        return type(self) is type(other) and (_freeze(self._args), _freeze(self._state)) == \
            (_freeze(other._args), _freeze(other._state))

    def __hash__(self):
        return hash((self._module, self._name, _freeze(self._args), _freeze(self._state)))

    def __repr__(self):
        args = ", ".join(map(repr, self._args))
        return f"<{self._module}.{self._name}({args})>"


def _freeze(obj):
    """A hashable stand-in of nested data (unhashable leaves such as arrays compare by identity)."""
    if isinstance(obj, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in obj.items()))
    if isinstance(obj, (list, tuple)):
        return tuple(_freeze(v) for v in obj)
    return obj if isinstance(obj, collections.abc.Hashable) else id(obj)


_UNRESOLVED_CLASSES: dict[tuple[str, str], type] = {}


def unresolved_class(module: str, name: str) -> type:
    """One stand-in class per original class path (classes compare by identity in pickles)."""
    key = (module, name)
    if key not in _UNRESOLVED_CLASSES:
        _UNRESOLVED_CLASSES[key] = type(name, (Unresolved,), {
            "_module": module, "_name": name, "__module__": module, "__qualname__": name})
    return _UNRESOLVED_CLASSES[key]


@dataclass(frozen=True, repr=False)
class _StorageRef:
    member: str          # zip member holding the bytes
    dtype: torch.dtype
    numel: int


class LazyTensor:
    """A tensor inside a torch zip file, read only when asked. `shape`/`dtype` cost nothing."""

    __slots__ = ("file", "storage", "offset", "shape", "stride")

    def __init__(self, file: "TorchFile", storage: _StorageRef, offset: int, shape, stride):
        self.file, self.storage, self.offset = file, storage, int(offset)
        self.shape, self.stride = torch.Size(shape), tuple(stride)

    @property
    def dtype(self) -> torch.dtype:
        return self.storage.dtype

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * _itemsize(self.dtype)

    def is_contiguous(self) -> bool:
        expected, acc = [], 1
        for n in reversed(self.shape):
            expected.append(acc)
            acc *= n
        return tuple(reversed(expected)) == self.stride or self.shape.numel() <= 1

    def read_flat(self, start: int, count: int) -> torch.Tensor:
        """Elements [start, start+count) of this (contiguous) tensor's memory, 1-D."""
        if not self.is_contiguous():
            return self.load().reshape(-1)[start:start + count].clone()
        return self.file.read_elements(self.storage, self.offset + start, count)

    def load(self) -> torch.Tensor:
        """The whole tensor (a fresh CPU tensor owning its memory)."""
        if self.is_contiguous():
            return self.read_flat(0, self.shape.numel()).view(self.shape)
        span = 1 + sum((n - 1) * s for n, s in zip(self.shape, self.stride)) if self.shape.numel() else 0
        flat = self.file.read_elements(self.storage, self.offset, span)
        return flat.as_strided(self.shape, self.stride).clone()

    def __repr__(self):
        return f"LazyTensor({tuple(self.shape)}, {self.dtype})"


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _rebuild_tensor_v2(storage, offset, size, stride, requires_grad=False, hooks=None, metadata=None):
    """A LazyTensor after checking the declared box against its storage (nothing is allocated)."""
    if not (isinstance(storage, tuple) and len(storage) == 2 and isinstance(storage[1], _StorageRef)):
        raise pickle.UnpicklingError("a tensor without its storage")
    ints = lambda xs: isinstance(xs, (tuple, list)) and all(  # noqa: E731
        isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in xs)
    if not (isinstance(offset, int) and offset >= 0 and ints(size) and ints(stride) and len(size) == len(stride)):
        raise pickle.UnpicklingError(f"a tensor with offset {offset!r}, shape {size!r}, stride {stride!r}")
    span = 1 + sum((n - 1) * st for n, st in zip(size, stride)) if all(size) else 0
    if offset + span > storage[1].numel:
        raise pickle.UnpicklingError(f"a tensor of shape {tuple(size)} beyond its storage of "
                                     f"{storage[1].numel} elements")
    return LazyTensor(storage[0], storage[1], offset, size, stride)


def _rebuild_parameter(data, requires_grad=False, hooks=None, *rest):
    return data


def _rebuild_from_type_v2(func, new_type, args, state):
    return func(*args)


_TENSOR_GLOBALS = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
}


class _StorageType:
    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, file, sizes: dict[str, int]):
        super().__init__(io.BytesIO(data))
        self._file, self._sizes = file, sizes

    def find_class(self, module: str, name: str):
        module = "builtins" if module == "__builtin__" else module  # protocol 2 spells it so
        if (module, name) in _TENSOR_GLOBALS:
            return _TENSOR_GLOBALS[(module, name)]
        if (module, name) in READ_GLOBALS:
            return READ_GLOBALS[(module, name)]
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(_STORAGE_DTYPES[name])
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) == ("_codecs", "encode"):  # how protocol 2 pickles bytes
            return lambda text, encoding="latin1": text.encode(encoding)
        return unresolved_class(module, name)

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unsupported persistent id {str(pid)[:60]}")
        _, storage_type, key, _location, numel = pid
        if not (isinstance(key, str) and isinstance(numel, int) and numel >= 0):
            raise pickle.UnpicklingError(f"storage {str(key)[:40]} declares {str(numel)[:40]} elements")
        dtype = storage_type.dtype if isinstance(storage_type, _StorageType) else torch.uint8
        member = f"{self._file.prefix}/data/{key}" if self._file.prefix else f"data/{key}"
        size = self._sizes.get(member)
        if size is None or size < numel * _itemsize(dtype):
            # checked before anything is allocated: a declared size must fit the bytes in the file
            raise pickle.UnpicklingError(f"storage {key} declares {numel} elements but its member holds "
                                         f"{size or 0} bytes")
        return (self._file, _StorageRef(member, dtype, numel))


MAX_PICKLE_BYTES = 1 << 30  # a torch.save structure pickle; rank files hold ~100 kB of it


def unpickle_torch_zip(zf: zipfile.ZipFile, owner) -> object:
    """The structure of a torch.save zip, through the restricted unpickler. Sets `owner.prefix`
    (the archive folder); its LazyTensors read their bytes through `owner.read_elements`."""
    infos = zf.infolist()
    pkl = [i for i in infos if i.filename.endswith("/data.pkl") or i.filename == "data.pkl"]
    if len(pkl) != 1:
        raise zipfile.BadZipFile("no single data.pkl member")
    if pkl[0].compress_type != zipfile.ZIP_STORED or pkl[0].file_size > MAX_PICKLE_BYTES:
        raise zipfile.BadZipFile(f"data.pkl is compressed or declares {pkl[0].file_size} bytes")
    name = pkl[0].filename
    owner.prefix = name.rsplit("/", 1)[0] if "/" in name else ""
    pos = zf.fp.tell()
    end = zf.fp.seek(0, os.SEEK_END)  # a member's declared size must fit inside the file
    zf.fp.seek(pos)
    sizes = {i.filename: i.file_size for i in infos
             if i.compress_type == zipfile.ZIP_STORED and i.header_offset + i.file_size <= end}
    return _RestrictedUnpickler(zf.read(name), owner, sizes).load()


# What parsing a damaged or hostile zip/pickle can raise: zipfile and pickle raise many types
# (struct.error, KeyError from the memo, TypeError from a bad REDUCE, RecursionError, MemoryError
# for absurd declared sizes), all meaning "this file is not what it claims".
UNREADABLE = (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, pickle.UnpicklingError, OSError, ValueError,
              TypeError, KeyError, IndexError, AttributeError, struct.error, RecursionError, MemoryError,
              OverflowError, NotImplementedError, UnicodeDecodeError)


def brief_error(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}".splitlines()[0] if str(err) else type(err).__name__
    return text if len(text) <= 120 else text[:117] + "..."


class TorchFile:
    """One `torch.save` zip file, opened for lazy reading. `obj` is the unpickled structure."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._offsets: dict[str, tuple[int, int]] = {}
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
            if hasattr(os, "posix_fadvise"):
                # we pread exactly the tensors we need; readahead would pull in dropped experts
                os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_RANDOM)
            self._zip = zipfile.ZipFile(self.path)
            self.obj = unpickle_torch_zip(self._zip, self)
        except UNREADABLE as err:
            self.close()
            raise CheckpointError(
                f"{self.path}: not a readable torch checkpoint ({brief_error(err)}); the file is truncated or "
                "damaged, copy it again from the source") from None

    def _data_offset(self, member: str) -> int:
        """Byte offset of a stored member's data: torch writes members uncompressed, so a
        tensor's bytes are one run of the file, read with pread and no copy through zipfile."""
        if member not in self._offsets:
            try:
                info = self._zip.getinfo(member)
            except KeyError:
                raise CheckpointError(f"{self.path}: member {member} is missing; the file is damaged, "
                                      "copy it again from the source") from None
            if info.compress_type != zipfile.ZIP_STORED:
                raise CheckpointError(f"{self.path}: member {member} is compressed; torch never writes "
                                      "that, the file was re-packed, copy the original")
            header = os.pread(self._fd, 30, info.header_offset)
            if len(header) != 30 or header[:4] != b"PK\x03\x04":
                raise CheckpointError(f"{self.path}: bad local header of {member}; the file is truncated "
                                      "or damaged, copy it again from the source")
            name_len, extra_len = struct.unpack("<HH", header[26:30])
            self._offsets[member] = (info.header_offset + 30 + name_len + extra_len, info.file_size)
        return self._offsets[member]

    def read_elements(self, storage: _StorageRef, start: int, count: int) -> torch.Tensor:
        """`count` elements from element `start` of a storage, reading only those bytes."""
        item = _itemsize(storage.dtype)
        offset, size = self._data_offset(storage.member)
        if start + count > storage.numel or size < storage.numel * item:
            raise CheckpointError(f"{self.path}: {storage.member} holds {size} bytes, fewer than its "
                                  "tensors need; the file is truncated or damaged, copy it again")
        out = torch.empty(count, dtype=storage.dtype)
        buf = memoryview(out.view(torch.uint8).numpy()) if count else memoryview(b"")
        done = 0
        while done < len(buf):  # pread may return short counts on large reads
            n = os.preadv(self._fd, [buf[done:]], offset + start * item + done)
            if n <= 0:
                raise CheckpointError(f"{self.path}: {storage.member} ends early; the file is truncated, "
                                      "copy it again from the source")
            done += n
        return out

    def close(self):
        fd, self._fd = getattr(self, "_fd", None), None
        if fd is not None:
            os.close(fd)
        zf, self._zip = getattr(self, "_zip", None), None
        if zf is not None:
            zf.close()

    __del__ = close


def materialize(obj):
    """Replace every LazyTensor in a nested structure by its loaded tensor (small objects only)."""
    if isinstance(obj, LazyTensor):
        return obj.load()
    if isinstance(obj, dict):
        return type(obj)((k, materialize(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(materialize(v) for v in obj)
    return obj


# -- writing -------------------------------------------------------------------------------

class _TensorRecord:
    __slots__ = ("key", "dtype", "shape", "numel")

    def __init__(self, key: str, dtype: torch.dtype, shape: torch.Size):
        self.key, self.dtype, self.shape, self.numel = key, dtype, torch.Size(shape), shape.numel()


class _StoragePid:
    __slots__ = ("record",)

    def __init__(self, record: _TensorRecord):
        self.record = record


class _Pickler(pickle._Pickler):  # the Python pickler: it lets us emit Unresolved class paths
    """Pickles the structure of a torch.save file; every GLOBAL it emits is checked against the
    allow-list (`safe_globals.is_emittable`): the next reader may run it."""

    def persistent_id(self, obj):
        if isinstance(obj, _StoragePid):
            r = obj.record
            return ("storage", getattr(torch, _DTYPE_STORAGE[r.dtype]), r.key, "cpu", r.numel)
        return None

    def reducer_override(self, obj):
        if isinstance(obj, _TensorRecord):
            stride = torch.empty(obj.shape, device="meta").stride()
            return (torch._utils._rebuild_tensor_v2,
                    (_StoragePid(obj), 0, obj.shape, stride, False, collections.OrderedDict()))
        return NotImplemented

    def save_global(self, obj, name=None):
        unresolved = isinstance(obj, type) and issubclass(obj, Unresolved) and obj is not Unresolved
        module = obj._module if unresolved else (getattr(obj, "__module__", None) if name is None
                                                  else pickle.whichmodule(obj, name))
        qualname = obj._name if unresolved else (name or getattr(obj, "__qualname__", "?"))
        if not is_emittable(str(module), str(qualname)):
            raise CheckpointError(f"refusing to write the global {module}.{qualname}: it is not on the "
                                  "allow-list of data types, and the next reader of the file would run it")
        if unresolved:
            self.write(pickle.GLOBAL + f"{obj._module}\n{obj._name}\n".encode("utf-8"))
            self.memoize(obj)
            return
        super().save_global(obj, name)

    dispatch = dict(pickle._Pickler.dispatch)
    dispatch[type] = save_global
    dispatch[types.FunctionType] = save_global
    dispatch[types.BuiltinFunctionType] = save_global


class WriteSink(io.RawIOBase):
    """A file torch's C++ zip writer writes through, which never lets a write error reach it.

    `torch._C.PyTorchFileWriter` turns a failed write into a RuntimeError without the errno, and
    its destructor writes the end of the archive again, which aborts the process (std::terminate)
    when that write fails too. Here the first OSError (ENOSPC, EFBIG, EIO, EROFS) is kept and
    every later write is accepted and discarded, so the C++ side always succeeds; `check()`
    raises the kept error, which callers do after every record. `close()` fsyncs: a write error
    the kernel reports only at writeback (EIO, a quota on a network file system) surfaces here,
    before the tracker says the checkpoint is complete.
    """

    def __init__(self, path: str | Path, append: bool = False):
        super().__init__()
        self.path = Path(path)
        self.error: OSError | None = None
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC), 0o644)
        self._pos = os.lseek(self._fd, 0, os.SEEK_END) if append else 0

    def writable(self):
        return True

    def seekable(self):
        return False

    def tell(self):
        return self._pos

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        if self.error is None:
            try:
                done = 0
                while done < n:
                    done += os.write(self._fd, view[done:])
            except OSError as err:
                self.error = err
        self._pos += n
        return n

    def seek(self, offset, whence=os.SEEK_SET):
        # torch seeks forward over the bytes of a record it writes later (write_record_metadata);
        # this sink writes those records in order, so a relative forward seek is a hole of zeros
        if whence != os.SEEK_CUR or offset < 0:
            raise io.UnsupportedOperation("WriteSink seeks only forward")
        if self.error is None:
            try:
                os.lseek(self._fd, offset, os.SEEK_CUR)
            except OSError as err:
                self.error = err
        self._pos += offset
        return self._pos

    def flush(self):
        pass

    def check(self) -> None:
        """Raise the first write error, if any (an OSError with its errno and this path)."""
        if self.error is not None:
            err = self.error
            raise OSError(err.errno, err.strerror, str(self.path)) from None

    def close(self) -> None:
        fd, self._fd = getattr(self, "_fd", None), None
        if fd is not None:
            try:
                if self.error is None:
                    os.fsync(fd)
            except OSError as err:
                self.error = self.error or err
            finally:
                os.close(fd)
        super().close()


class TorchFileWriter:
    """Write a `torch.save`-compatible zip incrementally: tensors first, structure last.

    `add(tensor)` writes the bytes now and returns a placeholder to put in the structure;
    `close(obj)` pickles the structure. torch.load (and so Megatron) reads the result. Write
    errors are OSErrors with the errno (see `WriteSink`), never an abort.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._sink = WriteSink(self.path)
        self._writer = torch._C.PyTorchFileWriter(self._sink)
        self._count = 0
        self.bytes_written = 0

    def add(self, tensor: torch.Tensor) -> _TensorRecord:
        t = tensor.detach().contiguous().cpu()
        key = str(self._count)
        self._count += 1
        nbytes = t.numel() * t.element_size()
        self._writer.write_record(f"data/{key}", t.untyped_storage() if t.storage_offset() == 0 and
                                  t.untyped_storage().nbytes() == nbytes else t.clone().untyped_storage(),
                                  nbytes)
        self._sink.check()
        self.bytes_written += nbytes
        return _TensorRecord(key, t.dtype, t.shape)

    def close(self, obj) -> None:
        buf = io.BytesIO()
        _Pickler(buf, protocol=2).dump(obj)
        data = buf.getvalue()
        self._writer.write_record("data.pkl", data, len(data))
        self._writer.write_record(".format_version", "1", 1)
        self._writer.write_record("byteorder", sys.byteorder, len(sys.byteorder))
        self._writer.write_end_of_file()
        self._sink.close()
        self._sink.check()


def save_object(obj, path: str | Path) -> None:
    """torch.save equivalent that keeps Unresolved objects' class paths; tensors anywhere in obj."""
    writer = TorchFileWriter(path)

    def convert(o):
        if isinstance(o, torch.Tensor):
            return writer.add(o)
        if isinstance(o, LazyTensor):
            return writer.add(o.load())
        if isinstance(o, dict):
            return type(o)((k, convert(v)) for k, v in o.items())
        if isinstance(o, (list, tuple)) and not hasattr(o, "_fields"):
            return type(o)(convert(v) for v in o)
        return o

    writer.close(convert(obj))
