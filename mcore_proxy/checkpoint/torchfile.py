"""Read and write `torch.save` zip files without torch.load and without an unrestricted unpickler.

Reading parses only `data.pkl` with a whitelisting unpickler: tensors become `LazyTensor`
handles that read their bytes from the zip member on demand (a dropped expert is never read),
and globals outside the whitelist (megatron enums in `args`, numpy RNG state, optimizer
classes) become inert `Unresolved` objects: no foreign code runs. Unresolved objects pickle
back under their original class path, so `args` written here load in Megatron unchanged.

Writing streams: `TorchFileWriter` writes each tensor's bytes as soon as it is added and the
pickled structure last, so a rank file never has to exist in memory as a whole (the zip layout
itself is `zipwrite`'s).
"""

from __future__ import annotations

import collections
import collections.abc
import enum
import functools
import gc
import hashlib
import io
import os
import pickle
import signal
import struct
import sys
import types
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mcore_proxy.checkpoint.descriptors import POOL, MetadataReadAhead, will_need
from mcore_proxy.checkpoint.safe_globals import (
    READ_GLOBALS,
    Unresolved,
    enum_by_name,
    global_enum_member,
    is_emittable,
    torch_load_allowing,
    unresolved_class,
)
from mcore_proxy.checkpoint.zipindex import read_directory, read_stored
from mcore_proxy.checkpoint.zipwrite import HashingSink, TorchZipWriter, as_bytes, torch_archive_records
from mcore_proxy.runtime.memory import import_torch_while_waiting, prefer_huge_pages
from mcore_proxy.core.dtypes import ITEMSIZE, Shape, TorchDtypeName, dtype_name, itemsize, torch_dtype
from mcore_proxy.core.dtypes import STORAGE_DTYPES as _STORAGE_DTYPES
from mcore_proxy.core.errors import CheckpointError
from mcore_proxy.core.tensors import empty, is_tensor

if TYPE_CHECKING:  # torch is imported where bytes become tensors, not to index a file
    import torch

# -- reading -------------------------------------------------------------------------------

_DTYPE_STORAGE = {v: k for k, v in _STORAGE_DTYPES.items() if k != "UntypedStorage"}


@dataclass(frozen=True, repr=False, slots=True)  # one per tensor a reader keeps
class _StorageRef:
    member: str  # zip member holding the bytes
    dtype: str  # torch's dtype name: the index needs no torch
    numel: int
    header_offset: int  # of the member's local header: where its bytes are, once the zip index is gone


class LazyTensor:
    """A tensor inside a torch zip file, read only when asked. `shape`/`dtype` cost nothing."""

    __slots__ = ("file", "storage", "offset", "shape", "stride")

    def __init__(self, file: "TorchFile", storage: _StorageRef, offset: int, shape, stride):
        self.file, self.storage, self.offset = file, storage, int(offset)
        # the shared objects are found by the plain tuples (a Shape hashes and compares as its sizes)
        self.shape = _SHAPES.get(shape) or _shared(_SHAPES, Shape(shape))
        self.stride = _STRIDES.get(stride) or _shared(_STRIDES, tuple(stride))

    @property
    def dtype_name(self) -> str:
        """torch's name of the dtype ('bfloat16'), known without torch."""
        return self.storage.dtype

    @property
    def dtype(self) -> "torch.dtype":
        return torch_dtype(self.storage.dtype)

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * itemsize(self.storage.dtype)

    def is_contiguous(self) -> bool:
        expected, acc = [], 1
        for n in reversed(self.shape):
            expected.append(acc)
            acc *= n
        return tuple(reversed(expected)) == self.stride or self.shape.numel() <= 1

    def read_flat(self, start: int, count: int) -> "torch.Tensor":
        """Elements [start, start+count) of this (contiguous) tensor's memory, 1-D."""
        if not self.is_contiguous():
            return self.load().reshape(-1)[start : start + count].clone()
        return self.file.read_elements(self.storage, self.offset + start, count)

    def byte_range(self, start: int = 0, count: int | None = None) -> tuple[int, int]:
        """(file offset, length) of elements [start, start+count) of this contiguous tensor's
        memory (the whole tensor by default): the bytes `read_flat`/`load` read."""
        count = self.shape.numel() - start if count is None else count
        return self.file.byte_range(self.storage, self.offset + start, count)

    def will_need(self, start: int = 0, count: int | None = None) -> None:
        """Ask the kernel to start reading those bytes into the page cache, without waiting:
        read-ahead of exactly what the next `read_flat`/`load` reads."""
        if self.is_contiguous():
            self.file.will_need(*self.byte_range(start, count))

    def load(self) -> "torch.Tensor":
        """The whole tensor (a fresh CPU tensor owning its memory)."""
        if self.is_contiguous():
            return self.read_flat(0, self.shape.numel()).view(self.shape)
        span = 1 + sum((n - 1) * s for n, s in zip(self.shape, self.stride)) if self.shape.numel() else 0
        flat = self.file.read_elements(self.storage, self.offset, span)
        return flat.as_strided(self.shape, self.stride).clone()

    def __repr__(self):
        return f"LazyTensor({tuple(self.shape)}, torch.{self.dtype_name})"


# One object per distinct shape or stride: a 61-layer DeepSeek-V3 index holds 56,000 LazyTensors
# of a few dozen shapes, and a reader's peak memory should not grow with depth (issue 23). Shapes
# and strides live apart: a Shape equals the plain tuple of its sizes, so one table would hand a
# stride (1,) back as the shape of a 1-element tensor, and `shape.numel()` would fail.
_SHAPES: dict[tuple, tuple] = {}
_STRIDES: dict[tuple, tuple] = {}


def _shared(table: dict[tuple, tuple], value: tuple) -> tuple:
    return table.setdefault(value, value)


def _sizes(xs) -> bool:
    """A shape or stride: a tuple or list of non-negative ints (bools are not sizes)."""
    return isinstance(xs, (tuple, list)) and all(type(x) is int and x >= 0 for x in xs)


# (shape, stride) -> (elements spanned, shape, stride) of boxes already checked: a rank file declares
# a few dozen distinct boxes, each for many tensors.
_CHECKED_BOXES: dict[tuple[tuple, tuple], tuple[int, tuple, tuple]] = {}


def _checked_box(size, stride) -> tuple[int, tuple, tuple]:
    """(span in elements, shape, stride) of a declared box, or UnpicklingError. A box is returned
    as it was first checked: a later `(True,)`, equal to `(1,)` as a key, comes back as ints."""
    try:
        return _CHECKED_BOXES[(size, stride)]
    except (KeyError, TypeError):  # TypeError: lists are not keys; checked below
        pass
    if not (_sizes(size) and _sizes(stride) and len(size) == len(stride)):
        raise pickle.UnpicklingError(f"a tensor with shape {size!r}, stride {stride!r}")
    span = 1 + sum((n - 1) * st for n, st in zip(size, stride)) if all(size) else 0
    box = (span, tuple(size), tuple(stride))
    if type(size) is tuple and type(stride) is tuple:
        _CHECKED_BOXES[(size, stride)] = box
    return box


def _rebuild_tensor_v2(storage, offset, size, stride, requires_grad=False, hooks=None, metadata=None):
    """A LazyTensor after checking the declared box against its storage (nothing is allocated)."""
    if not (isinstance(storage, tuple) and len(storage) == 2 and isinstance(storage[1], _StorageRef)):
        raise pickle.UnpicklingError("a tensor without its storage")
    if not (type(offset) is int and offset >= 0):
        raise pickle.UnpicklingError(f"a tensor with offset {offset!r}")
    span, size, stride = _checked_box(size, stride)
    if offset + span > storage[1].numel:
        raise pickle.UnpicklingError(
            f"a tensor of shape {tuple(size)} beyond its storage of {storage[1].numel} elements"
        )
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
    def __init__(self, dtype: str):
        self.dtype = dtype


def _latin1_bytes(text: str, encoding: str = "latin1") -> bytes:
    return text.encode(encoding)


@functools.lru_cache(maxsize=1024)  # a dozen globals per rank file, the same in every one
def _shared_global(module: str, name: str):
    """What a global stands for when that is the same object in every file: tensor rebuilders,
    data types, storage types, dtype names, protocol 2's bytes; None for the others."""
    if (module, name) in _TENSOR_GLOBALS:
        return _TENSOR_GLOBALS[(module, name)]
    if (module, name) in READ_GLOBALS:
        return READ_GLOBALS[(module, name)]
    if module == "torch" and name in _STORAGE_DTYPES:
        return _StorageType(_STORAGE_DTYPES[name])
    if module == "torch" and name in ITEMSIZE:  # a dtype in args (`params_dtype`)
        return TorchDtypeName(name)
    if (module, name) == ("_codecs", "encode"):  # how protocol 2 pickles bytes
        return _latin1_bytes
    return None


def _pickle_input(data: bytes) -> io.BufferedReader:
    """`data` as the unpickler's input. A buffered reader has `peek`, so the C unpickler takes its
    bytes in one prefetch; from a bare BytesIO it calls `read` once per opcode, which made a
    rank file's parse (625 ints of RNG state alone) more than twice as slow."""
    return io.BufferedReader(io.BytesIO(data))


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, file, members: dict[str, tuple[int, int]]):
        super().__init__(_pickle_input(data))
        self._file, self._members = file, members

    def find_class(self, module: str, name: str):
        module = "builtins" if module == "__builtin__" else module  # protocol 2 spells it so
        found = _shared_global(module, name)
        if found is not None:
            return found
        if (module, name) == ("builtins", "getattr"):  # enums pickled by name; nothing else (safe_globals)
            return functools.partial(enum_by_name, where=str(self._file.path))
        member = global_enum_member(module, name)  # `signal.SIGTERM`, as Python 3.11.2 pickles it
        return unresolved_class(module, name) if member is None else member

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unsupported persistent id {str(pid)[:60]}")
        _, storage_type, key, _location, numel = pid
        if not (isinstance(key, str) and isinstance(numel, int) and numel >= 0):
            raise pickle.UnpicklingError(f"storage {str(key)[:40]} declares {str(numel)[:40]} elements")
        dtype = storage_type.dtype if isinstance(storage_type, _StorageType) else "uint8"
        # the same member names recur in every rank file: one string each
        member = sys.intern(f"{self._file.prefix}/data/{key}" if self._file.prefix else f"data/{key}")
        header_offset, size = self._members.get(member, (0, 0))
        if size < numel * itemsize(dtype):
            # checked before anything is allocated: a declared size must fit the bytes in the file
            raise pickle.UnpicklingError(f"storage {key} declares {numel} elements but its member holds {size} bytes")
        return (self._file, _StorageRef(member, dtype, numel, header_offset))


MAX_PICKLE_BYTES = 1 << 30  # a torch.save structure pickle; rank files hold ~100 kB of it


def unpickle_torch_zip(zf: zipfile.ZipFile, owner) -> object:
    """The structure of a torch.save zip, through the restricted unpickler. Sets `owner.prefix`
    (the archive folder); its LazyTensors read their bytes through `owner.read_elements`."""
    end = zf.fp.seek(0, os.SEEK_END)
    return _unpickle_members(zf.infolist(), zf.read, zf.start_dir, end, owner)


def _unpickle_members(infos, read, start_dir: int, end: int, owner) -> object:
    """`unpickle_torch_zip` from a zip directory (`zipfile.ZipInfo`s or `zipindex.ZipMember`s)
    and a function reading one member's bytes; `end`: the file's size."""
    pkl = [i for i in infos if i.filename.endswith("/data.pkl") or i.filename == "data.pkl"]
    if len(pkl) != 1:
        raise zipfile.BadZipFile("no single data.pkl member")
    if pkl[0].compress_type != zipfile.ZIP_STORED or pkl[0].file_size > MAX_PICKLE_BYTES:
        raise zipfile.BadZipFile(f"data.pkl is compressed or declares {pkl[0].file_size} bytes")
    name = pkl[0].filename
    owner.prefix = name.rsplit("/", 1)[0] if "/" in name else ""
    # what this parse read: through data.pkl (its local header: 30 bytes, the name, and torch's
    # extra field that pads the data to 64 bytes), and the zip directory
    owner.metadata_span = (
        pkl[0].header_offset + 30 + len(pkl[0].orig_filename.encode()) + 64 + pkl[0].file_size,
        end - start_dir,
    )
    # only stored members whose bytes fit in the file can back a storage: torch never compresses
    members = {
        i.filename: (i.header_offset, i.file_size)
        for i in infos
        if i.compress_type == zipfile.ZIP_STORED and i.header_offset + i.file_size <= end
    }
    return _RestrictedUnpickler(read(pkl[0]), owner, members).load()


# What parsing a damaged or hostile zip/pickle can raise: zipfile and pickle raise many types
# (struct.error, KeyError from the memo, TypeError from a bad REDUCE, RecursionError, MemoryError
# for absurd declared sizes), all meaning "this file is not what it claims".
UNREADABLE = (
    zipfile.BadZipFile,
    zipfile.LargeZipFile,
    EOFError,
    pickle.UnpicklingError,
    OSError,
    ValueError,
    TypeError,
    KeyError,
    IndexError,
    AttributeError,
    struct.error,
    RecursionError,
    MemoryError,
    OverflowError,
    NotImplementedError,
    UnicodeDecodeError,
)


def brief_error(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}".splitlines()[0] if str(err) else type(err).__name__
    return text if len(text) <= 120 else text[:117] + "..."


# torch.save before torch 1.6 (and `_use_new_zipfile_serialization=False` since) writes a pickle
# stream that opens with protocol 2 and its magic number 0x1950a86a20f9469cfc6c as a long
_LEGACY_TORCH_MAGIC = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"


def is_legacy_torch_format(path: Path) -> bool:
    """Whether `path` starts like a pre-1.6 (non-zip) torch.save file."""
    try:
        with open(path, "rb") as fh:
            return fh.read(len(_LEGACY_TORCH_MAGIC)) == _LEGACY_TORCH_MAGIC
    except OSError:
        return False


class TorchFile:
    """One `torch.save` zip file, opened for lazy reading. `obj` is the unpickled structure.

    Only `obj` stays in memory: the zip index is dropped once unpickled (every storage carries its
    member's place), so a reader holding hundreds of rank files keeps just the LazyTensors it took,
    and `drop_structure` lets it forget the rest of `obj`. Tensor bytes are pread through a
    descriptor borrowed from `descriptors.POOL`, so thousands of rank files need no more open files
    than the pool's bound.
    """

    # (bytes from the start through data.pkl, bytes of the zip directory at the end): what parsing
    # the file read, known for files parsed in this process (`open_many`'s read-ahead sizes)
    metadata_span: tuple[int, int] | None = None

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._offsets: dict[str, int] = {}
        try:
            # the zip index and data.pkl: read once, then the descriptor is closed
            with open(self.path, "rb") as fh:
                if hasattr(os, "posix_fadvise"):
                    # we pread exactly the tensors we need; readahead would pull in dropped experts
                    # (with the kernel's read_ahead_kb of several MiB, a file's metadata reads alone
                    # pulled in about 1 MiB of every rank file: bench/RESULTS.md, DeepSeek-V3 scale)
                    os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
                directory = read_directory(fh)  # torch's own layout, without zipfile's objects
                if directory is not None:
                    members, start_dir, end = directory
                    self.obj = _unpickle_members(members, lambda m: read_stored(fh, m), start_dir, end, self)
                else:
                    with zipfile.ZipFile(fh) as zf:
                        self.obj = unpickle_torch_zip(zf, self)
        except (FileNotFoundError, IsADirectoryError):
            raise CheckpointError(f"{self.path}: file missing; copy it from the source checkpoint") from None
        except UNREADABLE as err:
            if is_legacy_torch_format(self.path):
                raise CheckpointError(
                    f"{self.path}: is a torch.save file in the format before torch 1.6 (not a zip), which "
                    "mcore-proxy does not read; load it where you trust it and save a copy with a current torch "
                    "(torch.save writes the zip format), then pass the copy"
                ) from None
            raise CheckpointError(
                f"{self.path}: not a readable torch checkpoint ({brief_error(err)}); the file is truncated or "
                "damaged, copy it again from the source"
            ) from None

    def drop_structure(self) -> None:
        """Forget `obj` (the args, optimizer state and every record of the file): the LazyTensors
        already taken from it stay readable, the rest is freed."""
        self.obj = None

    @contextmanager
    def _fd(self):
        """This file's descriptor from the pool (CheckpointError if it can no longer be opened)."""
        try:
            with POOL.borrow(self.path) as fd:
                yield fd
        except OSError as err:
            raise CheckpointError(
                f"{self.path}: cannot be read any more ({err.strerror}); the checkpoint changed "
                "while it was read, copy it again from the source"
            ) from None

    def _data_offset(self, storage: _StorageRef) -> int:
        """Byte offset of a stored member's data: torch writes members uncompressed, so a
        tensor's bytes are one run of the file, read with pread and no copy through zipfile.
        (The unpickler already checked the member exists, is stored and holds the storage.)"""
        member = storage.member
        if member not in self._offsets:
            with self._fd() as fd:
                header = os.pread(fd, 30, storage.header_offset)
            if len(header) != 30 or header[:4] != b"PK\x03\x04":
                raise CheckpointError(
                    f"{self.path}: bad local header of {member}; the file is truncated "
                    "or damaged, copy it again from the source"
                )
            name_len, extra_len = struct.unpack("<HH", header[26:30])
            self._offsets[member] = storage.header_offset + 30 + name_len + extra_len
        return self._offsets[member]

    def read_elements(self, storage: _StorageRef, start: int, count: int) -> "torch.Tensor":
        """`count` elements from element `start` of a storage, reading only those bytes: a torch
        tensor, or a HostTensor in `core.tensors.host_tensors` mode."""
        item = itemsize(storage.dtype)
        offset = self._data_offset(storage)
        if start + count > storage.numel:
            raise CheckpointError(
                f"{self.path}: a read of elements {start}..{start + count} lies beyond the "
                f"{storage.numel} of {storage.member}; the file is damaged, copy it again"
            )
        out = empty((count,), storage.dtype)
        prefer_huge_pages(out.data_ptr(), count * item)  # before the first write faults its pages in
        buf = as_bytes(out) if count else memoryview(b"")
        done = 0
        with self._fd() as fd:
            while done < len(buf):  # pread may return short counts on large reads
                n = os.preadv(fd, [buf[done:]], offset + start * item + done)
                if n <= 0:
                    raise CheckpointError(
                        f"{self.path}: {storage.member} ends early; the file is truncated, "
                        "copy it again from the source"
                    )
                done += n
        return out

    def byte_range(self, storage: _StorageRef, start: int, count: int) -> tuple[int, int]:
        """(file offset, length) of `count` elements from element `start` of a storage."""
        item = itemsize(storage.dtype)
        return self._data_offset(storage) + start * item, count * item

    def will_need(self, offset: int, length: int) -> None:
        """Start reading bytes [offset, offset+length) in the background (`descriptors.will_need`)."""
        if length > 0:
            with self._fd() as fd:
                will_need(fd, offset, length)

    def close(self):
        """Close this file's pooled descriptor if open (reads reopen it)."""
        POOL.forget(self.path)


# -- opening many files in worker processes ---------------------------------------------------

_PLAIN = (type(None), bool, int, float, str, bytes)


def model_payload(path: str) -> bytes | None:
    """Worker side of `open_many`: the model state of one rank file (`model`, `model0`, ...) as
    plain data: a LazyTensor becomes its storage and box, a None or number stays itself. None
    when the file holds anything else there (the parent then parses the file itself: objects
    read from a checkpoint never cross a process boundary as pickles)."""
    try:
        tf = TorchFile(path)
    except CheckpointError as err:
        return pickle.dumps(("error", str(err)))
    chunks = {}
    for key, chunk in tf.obj.items() if isinstance(tf.obj, dict) else ():
        if not (key == "model" or (key.startswith("model") and key[5:].isdigit())):
            continue
        if not isinstance(chunk, dict):
            return None
        out = chunks[key] = {}
        for name, value in chunk.items():
            if isinstance(value, LazyTensor):
                st, box = value.storage, (value.offset, tuple(value.shape), value.stride)
                out[name] = (0, st.member, st.dtype, st.numel, st.header_offset, *box)
            elif isinstance(value, _PLAIN) and isinstance(name, str):
                out[name] = (1, value)
            else:
                return None
    tf.drop_structure()  # its LazyTensors point back at it: freed now, not by a garbage collection
    return pickle.dumps(("ok", chunks), protocol=pickle.HIGHEST_PROTOCOL)


class _PlainUnpickler(pickle.Unpickler):
    """Reads a worker's payload: plain containers and scalars only, no global of any kind."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"a worker's index payload names {module}.{name}")


def _from_payload(path: Path, payload: bytes | None) -> "TorchFile":
    if payload is None:
        return TorchFile(path)
    status, body = _PlainUnpickler(_pickle_input(payload)).load()
    if status == "error":
        raise CheckpointError(body)
    tf = object.__new__(TorchFile)
    tf.path, tf._offsets = path if isinstance(path, Path) else Path(path), {}
    storages: dict[str, _StorageRef] = {}
    tf.obj = {}
    for key, chunk in body.items():
        model = tf.obj[key] = {}
        for name, value in chunk.items():
            if value[0] == 1:
                model[name] = value[1]
                continue
            _, member, dtype, numel, header_offset, offset, shape, stride = value
            ref = storages.get(member)
            if ref is None:
                ref = storages[member] = _StorageRef(member, dtype, numel, header_offset)
            model[name] = LazyTensor(tf, ref, offset, shape, stride)
    return tf


def _worker_signals() -> None:
    """A parsing worker leaves Ctrl-C to its parent, which stops the pool, and dies quietly when
    the pool stops it (SIGTERM): it must not run the parent's handlers (`runtime.interrupts`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def open_many(
    paths: list[Path], workers: int, like: "collections.abc.Iterable[TorchFile]" = ()
) -> "collections.abc.Iterator[TorchFile]":
    """TorchFiles of `paths`, in order, parsed by `workers` forked processes (in this one when
    `workers` <= 1). Only the model state crosses back, as plain data (`model_payload`): the
    files' other entries (args, optimizer, RNG state) are not kept; open the files that must
    tell those with `TorchFile`. Parsing a rank file (zip index, pickle) is pure Python, so
    processes, not threads. Each file's metadata is read ahead (`MetadataReadAhead`), as much of
    it as the files `like` these held, with a margin (64 KiB and 32 KiB without them)."""
    ahead_args = read_ahead_sizes(like)
    if workers <= 1 or len(paths) < 2:
        ahead = MetadataReadAhead(paths, *ahead_args)
        try:
            for p in paths:
                yield TorchFile(p)
                ahead.consumed()
        finally:
            ahead.close()
        return
    import multiprocessing

    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    # Forked workers leave what they inherit out of their garbage collections, which would otherwise
    # walk (and copy, page by page) every object of this process again and again.
    gc.freeze()
    try:
        pool = multiprocessing.get_context(method).Pool(workers, initializer=_worker_signals)
    finally:
        gc.unfreeze()
    with pool:
        # up to 64 files a task: each result wakes this process, whose core the workers share
        chunksize = max(1, min(64, len(paths) // (4 * workers)))
        payloads = pool.imap(model_payload, [str(p) for p in paths], chunksize)
        ahead = MetadataReadAhead(paths, *ahead_args)  # after the fork: no child starts with this thread's state
        try:
            import_torch_while_waiting()
            for path, payload in zip(paths, payloads):
                yield _from_payload(path, payload)
                ahead.consumed()
        finally:
            ahead.close()


def read_ahead_sizes(like) -> tuple[int, ...]:
    """(head, tail) bytes to read ahead of files like `like`: a quarter more than their largest,
    in whole 4 KiB pages; () (the defaults) when none of them was parsed here."""
    spans = [tf.metadata_span for tf in like if tf.metadata_span is not None]
    if not spans:
        return ()
    return tuple(-(-int(1.25 * max(s[i] for s in spans)) // 4096) * 4096 for i in (0, 1))


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


class TensorRecord:
    __slots__ = ("key", "dtype", "shape", "numel")

    def __init__(self, key: str, dtype: str, shape: tuple[int, ...]):
        self.key, self.dtype, self.shape = key, dtype_name(dtype), Shape(shape)
        self.numel = self.shape.numel()


class _StoragePid:
    __slots__ = ("record",)

    def __init__(self, record: TensorRecord):
        self.record = record


class _Global:
    """A torch global (`torch._utils._rebuild_tensor_v2`, `torch.BFloat16Storage`, `torch.Size`,
    `torch.bfloat16`) pickled by its name, so writing a file needs no torch. One object per name:
    the pickler memoizes it as it memoizes torch's own object, so the bytes are the same."""

    _made: dict[tuple[str, str], _Global] = {}

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name

    def __call__(self, *args):  # pickle's save_reduce asks for a callable; this one is never run
        raise TypeError(f"{self.module}.{self.name} is a name to pickle, not the torch object")

    @classmethod
    def of(cls, module: str, name: str) -> _Global:
        key = (module, name)
        if key not in cls._made:
            cls._made[key] = cls(module, name)
        return cls._made[key]


class _Size(tuple):
    """A shape pickled as torch pickles `torch.Size`: `torch.Size((2, 3))`."""


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    """torch's strides of a fresh tensor of `shape` (a size-0 dim counts as 1)."""
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


class _Pickler(pickle._Pickler):  # the Python pickler: it lets us emit Unresolved class paths
    """Pickles the structure of a torch.save file; every GLOBAL it emits is checked against the
    allow-list (`safe_globals.is_emittable`): the next reader may run it."""

    def persistent_id(self, obj):
        if isinstance(obj, _StoragePid):
            r = obj.record
            return ("storage", _Global.of("torch", _DTYPE_STORAGE[r.dtype]), r.key, "cpu", r.numel)
        return None

    def reducer_override(self, obj):
        if isinstance(obj, TensorRecord):
            stride = _contiguous_stride(obj.shape)
            return (
                _Global.of("torch._utils", "_rebuild_tensor_v2"),
                (_StoragePid(obj), 0, _Size(obj.shape), stride, False, collections.OrderedDict()),
            )
        if isinstance(obj, _Size):
            return _Global.of("torch", "Size"), (tuple(obj),)
        if isinstance(obj, enum.Enum):
            # by value, whatever this Python's own form (3.11.2: by name): docs/safe-loading.md
            return type(obj), (obj.value,)
        return NotImplemented

    def save_named_global(self, obj: _Global):
        self._emit(obj.module, obj.name)
        self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode("utf-8"))
        self.memoize(obj)

    def _emit(self, module: str, qualname: str) -> None:
        if not is_emittable(module, qualname):
            raise CheckpointError(
                f"refusing to write the global {module}.{qualname}: it is not on the "
                "allow-list of data types, and the next reader of the file would run it"
            )

    def save_global(self, obj, name=None):
        unresolved = isinstance(obj, type) and issubclass(obj, Unresolved) and obj is not Unresolved
        module = (
            obj._module
            if unresolved
            else (getattr(obj, "__module__", None) if name is None else pickle.whichmodule(obj, name))
        )
        qualname = obj._name if unresolved else (name or getattr(obj, "__qualname__", "?"))
        self._emit(str(module), str(qualname))
        if unresolved:
            self.write(pickle.GLOBAL + f"{obj._module}\n{obj._name}\n".encode("utf-8"))
            self.memoize(obj)
            return
        super().save_global(obj, name)

    def save_dtype_name(self, obj):
        self.save(_Global.of("torch", str(obj)))  # back as the global it was read: `torch.bfloat16`

    dispatch = dict(pickle._Pickler.dispatch)
    dispatch[TorchDtypeName] = save_dtype_name
    dispatch[_Global] = save_named_global
    dispatch[type] = save_global
    dispatch[types.FunctionType] = save_global
    dispatch[types.BuiltinFunctionType] = save_global


class TorchFileWriter:
    """Write a `torch.save`-compatible zip incrementally: tensors first, structure last.

    `add(tensor)` writes the tensor's bytes now, from its memory (a copy only if it is not
    contiguous), and returns a placeholder to put in the structure; `close(obj)` pickles the
    structure. torch.load (and so Megatron) reads the result. The bytes go through a
    `zipwrite.HashingSink` (pass `sink` to write several archives into one file, as a torch_dist
    data file holds one per chunk): `size` and `sha256` are known at close, computed while
    writing. Write errors are OSErrors with the errno, never an abort.
    """

    def __init__(self, path: str | Path | None = None, sink: HashingSink | None = None):
        self._own = sink is None
        self._sink = HashingSink(path) if sink is None else sink
        self.path = self._sink.path
        self._zip = TorchZipWriter(self._sink)
        self._count = 0
        self.size: int | None = None
        self.sha256: str | None = None

    def add(self, tensor: "torch.Tensor") -> TensorRecord:
        return self.add_pieces([tensor])

    def add_pieces(self, pieces: list["torch.Tensor"]) -> TensorRecord:
        """One tensor stored as `pieces` back to back (blocks along dim 0, e.g. the gate and up
        rows of a GLU shard): the same bytes as their concatenation, without making it."""
        pieces = [p.detach().cpu() for p in pieces]  # torch tensors or HostTensors
        pieces = [p if p.is_contiguous() else p.contiguous() for p in pieces]
        shape = (sum(p.shape[0] for p in pieces), *pieces[0].shape[1:]) if len(pieces) > 1 else pieces[0].shape
        key = str(self._count)
        self._count += 1
        try:
            self._zip.write_member(f"data/{key}", pieces)
        except BaseException:
            self.abort()
            raise
        return TensorRecord(key, pieces[0].dtype, shape)

    def close(self, obj) -> None:
        try:
            buf = io.BytesIO()
            _Pickler(buf, protocol=2).dump(obj)
            torch_archive_records(self._zip, buf.getvalue())
            if self._own:
                self.size, self.sha256 = self._sink.close()
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        if self._own:
            self._sink.abort()


def file_sha256(path: str | Path, chunk: int = 1 << 22) -> str:
    """sha256 (hex) of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def save_object(obj, path: str | Path | None = None, sink: HashingSink | None = None) -> TorchFileWriter:
    """torch.save equivalent that keeps Unresolved objects' class paths; tensors anywhere in obj.
    Into a file of its own at `path`, or as the next archive of `sink`. Returns the writer
    (`size`, `sha256` when it owned the file)."""
    writer = TorchFileWriter(path, sink=sink)

    def convert(o):
        if is_tensor(o):
            return writer.add(o)
        if isinstance(o, LazyTensor):
            return writer.add(o.load())
        if isinstance(o, dict):
            return type(o)((k, convert(v)) for k, v in o.items())
        if isinstance(o, (list, tuple)) and not hasattr(o, "_fields"):
            return type(o)(convert(v) for v in o)
        return o

    writer.close(convert(obj))
    return writer


def load_weights_only(path):
    """`torch.load(path, weights_only=True)` with the allowed classes as its safe globals (torch
    >= 2.4; earlier torch has no way to add them, so the restricted reader stands in)."""
    import torch

    if hasattr(torch.serialization, "safe_globals"):
        with torch_load_allowing():
            return torch.load(path, map_location="cpu", weights_only=True)
    return materialize(TorchFile(path).obj)
